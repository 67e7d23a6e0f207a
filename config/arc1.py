# ARC-AGI-1 (+ ConceptARC), the paper's ARC recipe: attention with RoPE, puzzle embedding of 16 tokens x 512.
# (A minimal copy made on branch arcsolve as the ARC study's base; the arcemb branch owns the full file.)
# Data: python prepare_arc.py --version 1 --concept_dir ../shared/arc   # -> data/arc1concept-aug-1000
data_path = 'data/arc1concept-aug-1000'
out_dir = 'out/arc1'
wandb_run_name = 'arc1'
pos_encodings = 'rope'
mlp_t = False
hidden_size = 512
num_heads = 8
H_cycles = 3
L_cycles = 4
halt_max_steps = 16
puzzle_emb_ndim = 512
puzzle_emb_len = 16
global_batch_size = 768
epochs = 100000
eval_interval = 10000
lr = 1e-4
lr_warmup_steps = 2000
puzzle_emb_lr = 1e-2
weight_decay = 0.1
puzzle_emb_weight_decay = 0.1
ema = True
