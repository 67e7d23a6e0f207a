# lr_3e-5: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with lr = 3e-5.
# Family lr_* -- learning rate of AdamATan2 around the recipe's 1e-4 (puzzle_emb_lr stays 1e-4; warm-up and epochs fixed).
#   one run:      python train.py config/study/lr_3e-5.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='lr_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/lr_3e-5'
wandb_run_name = 'study-lr_3e-5'
lr = 3e-05                      # <- studied (train.py default: 0.0001)
