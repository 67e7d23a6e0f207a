# maze_tn_T3n4: the Maze-Hard 30x30 recipe (config/maze.py) itself (H_cycles = 3, L_cycles = 4): this family's base point.
# Family maze_tn_* -- recursion grid: T = H_cycles rounds of n = L_cycles z-updates (the paper's T/n study).
# It shares out_dir 'out/study/maze_base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/maze_tn_T3n4.py
#   its dataset:  python prepare_maze.py --output_dir data/maze-30x30-hard-1k
#   the family:   python study.py --pattern='maze_tn_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/maze.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/maze_base'
wandb_run_name = 'study-maze_base'
