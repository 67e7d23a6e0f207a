# bs_1536: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with global_batch_size = 1536, lr = 1e-4 * sqrt(1536 / 768).
# Family bs_* -- global batch size at fixed epochs (steps scale as 1/B), lr = 1e-4 * sqrt(B / 768) (square-root
#   scaling for Adam-type optimizers; puzzle_emb_lr, warm-up steps and eval_every_epochs in epochs stay).
#   one run:      python train.py config/study/bs_1536.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='bs_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/bs_1536'
wandb_run_name = 'study-bs_1536'
global_batch_size = 1536        # <- studied (train.py default: 768)
lr = 0.000141                   # <- studied: 1e-4 * sqrt(1536 / 768), rounded (train.py default: 0.0001)
