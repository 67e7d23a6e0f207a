# arc_emb_len_32: the paper's ARC-AGI-1 recipe (config/arc1.py) with puzzle_emb_len = 32.
# Family arc_emb_len_* -- puzzle embedding length: prefix positions before the grid; the task's 512-wide embedding fills the first, the rest start at zero.
#   one run:      python train.py config/study/arc_emb_len_32.py
#   its dataset:  python prepare_arc.py --version 1 --num_aug 1000 --output_dir data/arc1concept-aug-1000
#   the family:   python study.py --pattern='arc_emb_len_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/arc1.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/arc_emb_len_32'
wandb_run_name = 'study-arc_emb_len_32'
puzzle_emb_len = 32             # <- studied (arc1.py: 16)
