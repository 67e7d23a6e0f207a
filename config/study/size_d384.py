# size_d384: the paper's Sudoku-Extreme MLP recipe (config/baseline.py) with hidden_size = 384.
# Family size_* -- model size: width hidden_size (size_d*) and depth L_layers (size_L*).
#   one run:      python train.py config/study/size_d384.py
#   its dataset:  python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
#   the family:   python study.py --pattern='size_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/baseline.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/size_d384'
wandb_run_name = 'study-size_d384'
hidden_size = 384               # <- studied (baseline.py: 512)
puzzle_emb_ndim = 384           # <- the width of the model, as the reference ties it (puzzle_emb_ndim: ${.hidden_size})
