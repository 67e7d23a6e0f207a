# lr_1e-4: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) itself (lr = 1e-4): this family's base point.
# Family lr_* -- learning rate of AdamATan2 around the recipe's 1e-4 (puzzle_emb_lr stays 1e-4; warm-up and epochs fixed).
# It shares out_dir 'out/study/base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/lr_1e-4.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='lr_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/base'
wandb_run_name = 'study-base'
