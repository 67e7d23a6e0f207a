# Sudoku-Extreme, attention variant (paper: 74.7% exact). Same data as baseline.py.
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/sudoku-att'
wandb_run_name = 'sudoku-att'
mlp_t = False
pos_encodings = 'rope'
