# arc_aug_1000: the paper's ARC-AGI-1 recipe (config/arc1.py) itself (data_path = 'data/arc1concept-aug-1000'): this family's base point.
# Family arc_aug_* -- augmentations: the 960 ARC-AGI-1 + ConceptARC tasks, each with N augmentations (dihedral x colour permutation).
# It shares out_dir 'out/study/arc_base' with the other families' base points: the study trains it once.
#   one run:      python train.py config/study/arc_aug_1000.py
#   its dataset:  python prepare_arc.py --version 1 --num_aug 1000 --output_dir data/arc1concept-aug-1000
#   the family:   python study.py --pattern='arc_aug_*' [--scale=gpu|cpu] [--dry_run=True | --report=True]
_base = 'config/arc1.py'  # the recipe this run changes: applied first, then the lines below
out_dir = 'out/study/arc_base'
wandb_run_name = 'study-arc_base'
