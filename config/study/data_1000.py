# data_1000: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) itself (data_path = 'data/sudoku-extreme-1k-aug-1000'): this family's base point.
# Family data_* -- training puzzles: a Sudoku-Extreme subsample of K puzzles, each with 1000 augmentations.
# It shares out_dir 'out/study/base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/data_1000.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='data_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/base'
wandb_run_name = 'study-base'
