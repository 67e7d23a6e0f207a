# The paper's Sudoku-Extreme recipe, MLP variant (TRM_SPEC section 6; paper: 87.4% exact).
# Data: python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
data_path = 'data/sudoku-extreme-1k-aug-1000'
out_dir = 'out/sudoku-mlp'
wandb_run_name = 'sudoku-mlp'
epochs = 50000
eval_interval = 5000
eval_subset = 20000           # intermediate evaluations on a seeded 20k subset; the final one uses all 422,786
global_batch_size = 768
lr = 1e-4
puzzle_emb_lr = 1e-4
weight_decay = 1.0
puzzle_emb_weight_decay = 1.0
lr_warmup_steps = 2000
hidden_size = 512
L_layers = 2
H_cycles = 3
L_cycles = 6
mlp_t = True
pos_encodings = 'none'
ema = True
