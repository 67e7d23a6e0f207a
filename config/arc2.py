# ARC-AGI-2 (paper: 7.8% pass@2 on the 120 evaluation2 tasks; independent re-runs 3-6%).
# config/arc1.py's recipe (_base) on ARC-AGI-2's data: training2 + evaluation2 demonstrations + ConceptARC,
# tested on evaluation2. 100,000 epochs are 722,098 steps at batch 768.
# Data (1,191,730 puzzle identifiers: a 2.4 GB embedding table):
#   python prepare_arc.py --version 2       # -> data/arc2concept-aug-1000
# Never evaluate a model trained on this data on ARC-AGI-1: training2 holds 766 ARC-AGI-1 tasks, 375 of them
# ARC-AGI-1 evaluation tasks, so an ARC-AGI-1 score would be measured on trained tasks.
_base = 'config/arc1.py'  # the recipe this run changes: applied first, then the lines below
data_path = 'data/arc2concept-aug-1000'
out_dir = 'out/arc2'
wandb_run_name = 'arc2'
