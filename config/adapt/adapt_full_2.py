# adapt_full_2: the CPU twin (config/arc_twin.py, pretrained) adapted to 24 tasks it never saw.
# Family adapt_full_* -- adaptation time: a full fine-tune of the CPU twin onto 24 new tasks, in M minutes (max_minutes).
#   first, once:  python prepare_arc.py --synthetic --canvas 6 --num_tasks 60 --num_eval_tasks 24 --num_aug 7 --new_tasks 24 --output_dir data/arc-twin && python train.py config/arc_twin.py
#   the family:   python study.py --config_dir=config/adapt --pattern='adapt_full_*' [--dry_run=True | --report=True]
_base = 'config/arc_twin.py'  # the twin's model and recipe, applied first, then the lines below
_prepare = 'prepare_arc.py --challenges data/arc-twin/json/arc-agi_new_challenges.json --solutions data/arc-twin/json/arc-agi_new_solutions.json --canvas 6 --num_aug 7 --output_dir data/arc-twin-new-aug-7'
out_dir = 'out/adapt/adapt_full_2'
init_from = 'out/arc_twin/ckpt_00002925.pt'  # the twin's; study.py makes it resume:FILE: a rerun resumes its own
data_path = 'data/arc-twin-new-aug-7'
epochs = 100000               # more than any budget here: max_minutes ends the run
eval_every_epochs = 100           # epochs: the pooled vote gathers every evaluation
arc_pool_votes = True
max_minutes = 2.0              # <- studied
