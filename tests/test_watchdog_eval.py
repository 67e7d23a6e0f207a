"""
The watchdog and a long evaluation: every supervision step of an evaluation batch is progress, so a healthy
evaluation whose batches each outlast watchdog_minutes finishes (exit 0, no watchdog line), in a run's final
evaluation and in --eval_only; and a watchdog that fires again on the same work exits with another code than 75,
so a loop that reruns on 75 stops. Real processes on the toy task.
    python -m pytest -q tests/test_watchdog_eval.py
"""
import json
import os
import shutil

from conftest import SUDOKU, TOY_ARGS, run, site_hook
from test_watchdog import hang_at

FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=100', '--log_interval=4']
# two evaluation batches of 100 rows at 16 supervision steps each, against a watchdog of 1.2 s
SLOW_EVAL = ['--eval_batch_size=100', '--eval_steps=16', '--watchdog_minutes=0.02']


def slow_steps(tmp_path, seconds):
    """The environment of a run whose evaluation supervision steps each take `seconds` more (a slow device, or
    a batch of many views): a sitecustomize.py on PYTHONPATH, which Python runs first, wraps TRM.predict_step."""
    return site_hook(tmp_path / 'slow', f'''import model
step = model.TRM.predict_step


def slow(self, *args, **kwargs):
    time.sleep({seconds})
    return step(self, *args, **kwargs)


model.TRM.predict_step = slow
''')


def test_an_evaluation_whose_batches_outlast_the_watchdog_finishes(toy, tmp_path):
    # each supervision step 0.15 s longer (slow_steps): a batch takes 2.4 s or more on any CPU, twice the limit,
    # while a step stays well within it
    out, slow = tmp_path / 'o', slow_steps(tmp_path, 0.15)
    train = ['train.py', f'--data_path={toy}', f'--out_dir={out}'] + FAST
    p = run(train + ['--max_steps=4'] + SLOW_EVAL, env=slow, check=False)
    # 'watchdog:' begins the watchdog's own lines ('config: watchdog_minutes = ...' echoes the setting)
    assert p.returncode == 0 and 'watchdog:' not in p.stdout + p.stderr, (p.returncode, p.stderr[-3000:])
    assert json.load(open(out / 'results.json'))['step'] == 4
    p = run(train + ['--init_from=resume', '--eval_only=True'] + SLOW_EVAL, env=slow, check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 0 and 'watchdog:' not in text and 'NoneType' not in text, (p.returncode, text[-3000:])
    assert os.path.exists(out / 'evals' / 'views1-steps16.json')


def test_a_second_firing_on_the_same_work_ends_the_rerun_loop(toy, tmp_path):
    out = tmp_path / 'o'
    cmd = ['train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=4', '--init_from=resume',
           '--watchdog_minutes=0.02'] + FAST
    hung = hang_at(tmp_path, 'an evaluation batch')  # every run of it blocks for good in its evaluation
    first, second = (run(cmd, env=hung, timeout=300, check=False) for _ in range(2))
    assert first.returncode == 75 and 'waiting for the evaluation after step 4' in first.stderr, first.stderr[-2000:]
    # the rerun a loop makes hangs at the same point: 70, which ends `[ $? = 75 ] || break`
    assert second.returncode == 70 and 'exiting with code 70' in second.stderr, second.stderr[-2000:]
    # another command (another limit) is other work: the usual code
    third = run(cmd + ['--watchdog_minutes=0.03'], env=hung, timeout=300, check=False)
    assert third.returncode == 75, third.stderr[-2000:]


def test_an_evaluation_whose_every_step_outlasts_the_watchdog_finishes(trained, sudoku4, tmp_path):
    # eval_only in 4 views at 8 supervision steps (twice halt_max_steps, as a cpu-scale study evaluates): two
    # batches whose every step takes 1.5 s, against a watchdog of 1.2 s. The evaluation's first batch (its views
    # built on the host, its graphs, all its steps) is its yardstick: a unit up to 3 x its slowest is no hang
    out = tmp_path / 'o'
    shutil.copytree(trained, out)
    p = run(['train.py', f'--data_path={sudoku4}', f'--out_dir={out}', '--init_from=resume', '--eval_only=True',
             '--eval_views=4', '--eval_batch_size=5', '--eval_steps=8', '--watchdog_minutes=0.02'] + SUDOKU,
            env=slow_steps(tmp_path, 1.5), check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 0 and 'watchdog:' not in text, (p.returncode, text[-3000:])
    assert os.path.exists(out / 'evals' / 'views4-steps8.json')
