# abl_halt16: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) itself (halt_max_steps = 16): this family's base point.
# Family abl_* -- ablations of the recipe: EMA off, halt_max_steps, attention instead of the MLP mixer, ACT continue loss, no puzzle embedding.
# It shares out_dir 'out/study/base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/abl_halt16.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='abl_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/base'
wandb_run_name = 'study-base'
