# The maze quick start: 8x8 mazes generated offline, a small TRM (train.py's mlp_t mixer, no position encoding)
# trained on a laptop CPU in minutes.
# Data: python prepare_maze.py --generate 4000 --num_test 200 --size 8 --output_dir data/maze8
data_path = 'data/maze8'
out_dir = 'out/maze_quickstart'
device = 'cpu'
epochs = 24                  # 24 x 4000 mazes / 64 = 1500 steps
eval_every_epochs = 4
global_batch_size = 64
hidden_size = 64
H_cycles = 2
L_cycles = 2                 # 2 z-updates a round: cheaper steps, and more of them, learn faster here
halt_max_steps = 4
puzzle_emb_ndim = 0
forward_dtype = 'float32'
loss_dtype = 'float32'
lr = 2e-3
lr_warmup_steps = 50
weight_decay = 0.1
ema_rate = 0.99
xla_cache_dir = ''
