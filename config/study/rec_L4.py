# rec_L4: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with L_cycles = 4.
# Family rec_* -- recursion: n = L_cycles z-updates per round, at T = H_cycles = 3.
#   one run:      python train.py config/study/rec_L4.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='rec_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/rec_L4'
wandb_run_name = 'study-rec_L4'
L_cycles = 4                    # <- studied (baseline.py: 6)
