# Sudoku-Extreme, attention variant (paper: 74.7% exact). Same data as baseline.py.
data_path = 'data/sudoku-extreme-1k-aug-1000'
out_dir = 'out/sudoku-att'
wandb_run_name = 'sudoku-att'
epochs = 50000
eval_interval = 5000
eval_subset = 20000
global_batch_size = 768
lr = 1e-4
puzzle_emb_lr = 1e-4
weight_decay = 1.0
puzzle_emb_weight_decay = 1.0
hidden_size = 512
num_heads = 8
L_cycles = 6
mlp_t = False
pos_encodings = 'rope'
