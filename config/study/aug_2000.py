# aug_2000: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with data_path = 'data/sudoku-extreme-1k-aug-2000'.
# Family aug_* -- augmentations: 1000 Sudoku-Extreme puzzles, each with A shuffled copies.
#   one run:      python train.py config/study/aug_2000.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-2000 --subsample_size 1000 --num_aug 2000
#   the family:   python study.py --pattern='aug_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
data_path = 'data/sudoku-extreme-1k-aug-2000'  # <- studied (baseline.py: 'data/sudoku-extreme-1k-aug-1000')
out_dir = 'out/study/aug_2000'
wandb_run_name = 'study-aug_2000'
