# arc_aug_300: the paper's ARC-AGI-1 recipe (config/arc1.py) with data_path = 'data/arc1concept-aug-300'.
# Family arc_aug_* -- augmentations: the 960 ARC-AGI-1 + ConceptARC tasks, each with N augmentations (dihedral x colour permutation).
#   one run:      python train.py config/study/arc_aug_300.py
#   its dataset:  python prepare_arc.py --version 1 --num_aug 300 --output_dir data/arc1concept-aug-300
#   the family:   python study.py --pattern='arc_aug_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/arc1.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/arc_aug_300'
wandb_run_name = 'study-arc_aug_300'
data_path = 'data/arc1concept-aug-300'  # <- studied (arc1.py: 'data/arc1concept-aug-1000')
