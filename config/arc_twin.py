# The ARC CPU twin: synthetic ARC-like tasks (prepare_arc.py's six families) on a 6x6 canvas, a small attention TRM
# with the puzzle embedding, trained on a laptop CPU in about 15 minutes (docs/arc.md, "The CPU twin").
# Data: python prepare_arc.py --synthetic --canvas 6 --num_tasks 60 --num_eval_tasks 24 --num_aug 7 --output_dir data/arc-twin
# Run:  python prepare_arc.py --synthetic --canvas 6 --num_tasks 60 --num_eval_tasks 24 --num_aug 7 --output_dir data/arc-twin && python train.py config/arc_twin.py
data_path = 'data/arc-twin'
out_dir = 'out/arc_twin'
device = 'cpu'
compile = False
epochs = 600                 # 600 x 84 groups x 3.71 rows / 64 = 2,925 steps
eval_every_epochs = 200
global_batch_size = 64
hidden_size = 64
num_heads = 2
expansion = 2.0
H_cycles = 2
L_cycles = 2
halt_max_steps = 4
mlp_t = False                # attention: as good per step as mlp_t here and cheaper (its sequence MLP is 256 wide)
pos_encodings = 'rope'
puzzle_emb_ndim = 64         # each augmentation's own vector: the only thing that tells a task's rule
puzzle_emb_len = 2
puzzle_emb_lr = 5e-2         # sign-SGD; an identifier is touched about once in 8 epochs
puzzle_emb_weight_decay = 0.1
forward_dtype = 'float32'    # most laptop CPUs are slower in bfloat16
loss_dtype = 'float32'
lr = 2e-3
lr_warmup_steps = 50
weight_decay = 0.1
ema_rate = 0.99
xla_cache_dir = ''
tensorboard = False
