# maze_size_d256: the Maze-Hard 30x30 recipe (config/maze.py) with hidden_size = 256.
# Family maze_size_* -- model size: width hidden_size (size_d*) and depth L_layers (size_L*).
#   one run:      python train.py config/study/maze_size_d256.py
#   its dataset:  python prepare_maze.py --output_dir data/maze-30x30-hard-1k
#   the family:   python study.py --pattern='maze_size_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/maze.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/maze_size_d256'
wandb_run_name = 'study-maze_size_d256'
hidden_size = 256               # <- studied (maze.py: 512)
puzzle_emb_ndim = 256           # <- the width of the model, as the reference ties it (puzzle_emb_ndim: ${.hidden_size})
