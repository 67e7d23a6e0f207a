# tn_T3n4: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with H_cycles = 3, L_cycles = 4.
# Family tn_* -- recursion grid: T = H_cycles rounds of n = L_cycles z-updates (the paper's T/n study).
#   one run:      python train.py config/study/tn_T3n4.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='tn_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
# It is the same run as rec_L4 (H_cycles 3, L_cycles 4) and shares its out_dir: the study trains it once.
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/rec_L4'
wandb_run_name = 'study-rec_L4'
L_cycles = 4                    # <- studied (baseline.py: 6)
