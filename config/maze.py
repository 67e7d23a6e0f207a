# Maze-Hard 30x30 (paper: 85.3% exact), attention variant, 4 GPUs in the paper (< 24 h);
# on one GPU use --global_batch_size=128.
# Data: python prepare_maze.py --output_dir data/maze-30x30-hard-1k
data_path = 'data/maze-30x30-hard-1k'
out_dir = 'out/maze'
wandb_run_name = 'maze'
L_cycles = 4
mlp_t = False
pos_encodings = 'rope'
