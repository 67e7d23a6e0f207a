# maze_tn_T3n6: the Maze-Hard 30x30 recipe (config/maze.py) with H_cycles = 3, L_cycles = 6.
# Family maze_tn_* -- recursion grid: T = H_cycles rounds of n = L_cycles z-updates (the paper's T/n study).
#   one run:      python train.py config/study/maze_tn_T3n6.py
#   its dataset:  python prepare_maze.py --output_dir data/maze-30x30-hard-1k
#   the family:   python study.py --pattern='maze_tn_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
# It is the same run as maze_rec_L6 (H_cycles 3, L_cycles 6) and shares its out_dir: the study trains it once.
_base = 'config/maze.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/maze_rec_L6'
wandb_run_name = 'study-maze_rec_L6'
L_cycles = 6                    # <- studied (maze.py: 4)
