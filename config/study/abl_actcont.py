# abl_actcont: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with no_ACT_continue = False.
# Family abl_* -- ablations of the recipe: EMA off, halt_max_steps, attention instead of the MLP mixer, ACT continue loss, no puzzle embedding.
#   one run:      python train.py config/study/abl_actcont.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='abl_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/abl_actcont'
wandb_run_name = 'study-abl_actcont'
no_ACT_continue = False         # <- studied (train.py default: True)
