# maze_rec_L4: the Maze-Hard 30x30 recipe (config/maze.py) itself (L_cycles = 4): this family's base point.
# Family maze_rec_* -- recursion: n = L_cycles z-updates per round, at T = H_cycles = 3.
# It shares out_dir 'out/study/maze_base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/maze_rec_L4.py
#   its dataset:  python prepare_maze.py --output_dir data/maze-30x30-hard-1k
#   the family:   python study.py --pattern='maze_rec_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/maze.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/maze_base'
wandb_run_name = 'study-maze_base'
