# data_500: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with data_path = 'data/sudoku-extreme-500-aug-1000'.
# Family data_* -- training puzzles: a Sudoku-Extreme subsample of K puzzles, each with 1000 augmentations.
#   one run:      python train.py config/study/data_500.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-500-aug-1000 --subsample_size 500 --num_aug 1000
#   the family:   python study.py --pattern='data_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
data_path = 'data/sudoku-extreme-500-aug-1000'  # <- studied (baseline.py: 'data/sudoku-extreme-1k-aug-1000')
out_dir = 'out/study/data_500'
wandb_run_name = 'study-data_500'
