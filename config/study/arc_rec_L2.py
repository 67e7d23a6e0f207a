# arc_rec_L2: the paper's ARC-AGI-1 recipe (config/arc1.py) with L_cycles = 2.
# Family arc_rec_* -- recursion: n = L_cycles z-updates per round, at T = H_cycles = 3.
#   one run:      python train.py config/study/arc_rec_L2.py
#   its dataset:  python prepare_arc.py --version 1 --num_aug 1000 --output_dir data/arc1concept-aug-1000
#   the family:   python study.py --pattern='arc_rec_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/arc1.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/arc_rec_L2'
wandb_run_name = 'study-arc_rec_L2'
L_cycles = 2                    # <- studied (arc1.py: 4)
