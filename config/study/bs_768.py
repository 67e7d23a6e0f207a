# bs_768: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) itself (global_batch_size = 768, lr = 1e-4): this family's base point.
# Family bs_* -- global batch size at fixed epochs (steps scale as 1/B), lr = 1e-4 * sqrt(B / 768) (square-root
#   scaling for Adam-type optimizers; puzzle_emb_lr, warm-up steps and eval_every_epochs in epochs stay).
# It shares out_dir 'out/study/base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/bs_768.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='bs_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/base'
wandb_run_name = 'study-base'
