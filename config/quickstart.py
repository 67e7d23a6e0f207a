# The quick start: 6x6 Sudoku generated offline, a small TRM trained on a laptop CPU in minutes.
# Data: python prepare_sudoku.py --generate 3000 --size 6 --num_test 500 --num_aug 7 --output_dir data/sudoku6
data_path = 'data/sudoku6'
out_dir = 'out/quickstart'
device = 'cpu'
epochs = 30                  # 30 x 3000 puzzles / 128 = 703 steps
eval_every_epochs = 10
log_interval = 50
global_batch_size = 128
hidden_size = 64
H_cycles = 2
L_cycles = 3
halt_max_steps = 4
puzzle_emb_ndim = 0          # one identifier for every puzzle: nothing to learn there
forward_dtype = 'float32'    # most laptop CPUs are slower in bfloat16
loss_dtype = 'float32'
lr = 2e-3
lr_warmup_steps = 50
lr_min_ratio = 0.1
weight_decay = 0.1
ema_rate = 0.99
xla_cache_dir = ''
