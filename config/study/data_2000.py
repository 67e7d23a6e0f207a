# data_2000: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with data_path = 'data/sudoku-extreme-2000-aug-1000'.
# Family data_* -- training puzzles: a Sudoku-Extreme subsample of K puzzles, each with 1000 augmentations.
#   one run:      python train.py config/study/data_2000.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-2000-aug-1000 --subsample_size 2000 --num_aug 1000
#   the family:   python study.py --pattern='data_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
data_path = 'data/sudoku-extreme-2000-aug-1000'  # <- studied (baseline.py: 'data/sudoku-extreme-1k-aug-1000')
out_dir = 'out/study/data_2000'
wandb_run_name = 'study-data_2000'
