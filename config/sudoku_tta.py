# Time to accuracy on one GPU: the full-size Sudoku MLP model of config/baseline.py (train.py's defaults: 5,028,866
# parameters), trained for 1,562 steps on 3,000 generated 9x9 Sudokus (100 shuffled copies each), evaluated once at
# the end on 1,000 held-out ones.
# Data (offline, no download):
#   python prepare_sudoku.py --generate 3000 --num_test 1000 --size 9 --seed 0 --num_aug 100 --output_dir data/sudoku9-3k-aug100
# Run, and time it:
#   time python train.py config/sudoku_tta.py
#
# No GPU run of this file has been measured in this repository: its accuracy and time are yet to be recorded.
data_path = 'data/sudoku9-3k-aug100'
out_dir = 'out/sudoku-tta'
wandb_run_name = 'sudoku-tta'
epochs = 400                  # steps = 400 epochs x 3,000 groups (1 example each) / batch 768 = 1,562
eval_every_epochs = 400           # epochs between evaluations: one, at the end
lr = 3e-4                     # the short schedule
lr_warmup_steps = 100
ema = False                   # a short run: the weights themselves, not an EMA that trails them
