"""
The watchdog and a long evaluation: every supervision step of an evaluation batch is progress, so a healthy
evaluation whose batches each outlast watchdog_minutes finishes (exit 0, no watchdog line), in a run's final
evaluation and in --eval_only. Real processes on the toy task.
    python -m pytest -q tests/test_watchdog_eval.py
"""
import json
import os


from conftest import TOY_ARGS, run

FAST = TOY_ARGS + ['--epochs=2', '--eval_interval=100', '--log_interval=4']
# two evaluation batches of 100 rows at 400 supervision steps each: seconds a batch, a step in milliseconds
SLOW_EVAL = ['--eval_batch_size=100', '--eval_steps=400', '--watchdog_minutes=0.02']  # 1.2 s


def test_an_evaluation_whose_batches_outlast_the_watchdog_finishes(toy, tmp_path):
    out = tmp_path / 'o'
    train = ['train.py', f'--data_path={toy}', f'--out_dir={out}'] + FAST
    p = run(train + ['--max_steps=4'] + SLOW_EVAL, check=False)
    # 'watchdog:' begins the watchdog's own lines ('config: watchdog_minutes = ...' echoes the setting)
    assert p.returncode == 0 and 'watchdog:' not in p.stdout + p.stderr, (p.returncode, p.stderr[-3000:])
    assert json.load(open(out / 'results.json'))['step'] == 4
    p = run(train + ['--init_from=resume', '--eval_only=True'] + SLOW_EVAL, check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 0 and 'watchdog:' not in text and 'NoneType' not in text, (p.returncode, text[-3000:])
    assert os.path.exists(out / 'evals' / 'views1-steps400.json')
