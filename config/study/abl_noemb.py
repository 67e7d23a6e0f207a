# abl_noemb: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with puzzle_emb_ndim = 0 (no puzzle embedding, no prefix tokens).
# Family abl_* -- ablations of the recipe: EMA off, halt_max_steps, attention instead of the MLP mixer, ACT continue loss, no puzzle embedding.
#   one run:      python train.py config/study/abl_noemb.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='abl_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/abl_noemb'
wandb_run_name = 'study-abl_noemb'
puzzle_emb_ndim = 0             # <- studied (train.py default: 512)
# cpu scale: every twin runs without the embedding, so this file's twin runs WITH it (width 32) and is compared with the cpu base
