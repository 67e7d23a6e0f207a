# ARC-AGI-1 (paper: 44.6% pass@2 on the 400 public evaluation tasks; independent single-checkpoint re-runs 38-43%).
# The reference's ARC recipe: attention with RoPE, L_cycles 4, weight decay 0.1, puzzle_emb_lr 1e-2 and its weight
# decay 0.1, 100,000 epochs (518,226 steps at batch 768) with an evaluation every 10,000. Kept from train.py's
# defaults (`python train.py --help`): D 512, 8 heads, L_layers 2, H_cycles 3, halt_max_steps 16, puzzle_emb_ndim
# 512, puzzle_emb_len 16, batch 768, lr 1e-4 with 2,000 warmup steps (then constant), EMA 0.999.
# The reference states about 3 days on 4 H100s (docs/arc.md, Training).
# Data (876,406 puzzle identifiers: a 1.8 GB embedding table; 6.8 GiB on disk):
#   python prepare_arc.py --version 1       # -> data/arc1concept-aug-1000
# Never train on ARC-AGI-2's data and evaluate on ARC-AGI-1: training2 holds 766 ARC-AGI-1 tasks, 375 of them
# ARC-AGI-1 evaluation tasks. This recipe trains on ARC-AGI-1 training + evaluation demonstrations + ConceptARC only.
data_path = 'data/arc1concept-aug-1000'
out_dir = 'out/arc1'
wandb_run_name = 'arc1'
epochs = 100000
eval_every_epochs = 10000         # epochs: 10 evaluations, each on the whole test split (every view votes)
L_cycles = 4
mlp_t = False
pos_encodings = 'rope'
weight_decay = 0.1
puzzle_emb_lr = 1e-2
puzzle_emb_weight_decay = 0.1
arc_pool_votes = True         # the vote pooled over the run's evaluations, as the reference's evaluator reports
