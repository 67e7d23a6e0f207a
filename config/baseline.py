# The paper's Sudoku-Extreme recipe, MLP variant (paper: 87.4% exact; stated runtime of the reference: 18-36 h on one L40S).
# Its keys are train.py's defaults (`python train.py --help` lists them: D 512, L_layers 2, H_cycles 3, L_cycles 6,
# mlp_t, no positions, batch 768, lr 1e-4, weight decay 1.0, 50,000 epochs, EMA 0.999); this file names the run.
# Data: python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
out_dir = 'out/sudoku-mlp'
wandb_run_name = 'sudoku-mlp'
eval_subset = 20000           # intermediate evaluations on a seeded 20k subset; the final one uses all 422,786
