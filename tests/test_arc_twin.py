"""
The ARC CPU twin (config/arc_twin.py, docs/arc.md "The CPU twin"), small: the same synthetic families, canvas and
model, trained for EPOCHS epochs instead of 600 (about two minutes on one core). It must learn: its pass@2 on the
held-out test outputs is above FLOOR, which copying the input cannot reach (it scores 0 on these tasks: checked
here), and submission.json holds every evaluation task.
"""
import json
import os

import numpy as np
import pytest

from conftest import run
from evaluate import ARCVotes
from puzzles import ARC

DATA = ['--synthetic', '--canvas=6', '--num_tasks=60', '--num_eval_tasks=24', '--num_aug=7']  # the twin's set
EPOCHS = 100  # 487 steps at batch 64
FLOOR = 0.0   # pass@2 must be above it; copying the input scores 0 (asserted below)


@pytest.fixture(scope='module')
def twin_data(tmp_path_factory):
    out = tmp_path_factory.mktemp('arctwin') / 'data'
    run(['prepare_arc.py'] + DATA + [f'--output_dir={out}'])
    return str(out)


def arc_line(stdout):
    return next(l.strip() for l in stdout.splitlines() if l.strip().startswith('ARC '))


def test_copying_the_input_scores_nothing(twin_data):
    """The floor's reason: every test row answered with its own input (mapped back as the model's answers are)."""
    inputs = np.load(os.path.join(twin_data, 'test', 'all__inputs.npy'))
    votes = ARCVotes.open(twin_data, ARC(6))
    votes.start()
    rows = np.arange(len(inputs))
    for mode in ('last', 'q_halt'):
        votes.add(mode, rows, inputs, np.full(len(rows), 0.5))
    res = votes.score()['last']
    assert res['tasks'] == 24 and res['pass@2'] <= FLOOR


def test_the_small_twin_learns_and_submits_every_evaluation_task(twin_data, tmp_path):
    out = tmp_path / 'o'
    p = run(['train.py', 'config/arc_twin.py', f'--data_path={twin_data}', f'--out_dir={out}', f'--epochs={EPOCHS}',
             f'--eval_interval={EPOCHS}'], timeout=900)
    line = arc_line(p.stdout)
    assert line.startswith('ARC 24 tasks (24 test outputs, 8 views): pass@1 '), line
    final = json.load(open(out / 'results.json'))['final_eval']
    assert final['arc_tasks'] == 24
    assert final['arc_pass@2'] > FLOOR, line
    puzzles = json.load(open(os.path.join(twin_data, 'test_puzzles.json')))
    sub = json.load(open(out / 'submission.json'))
    assert list(sub) == list(puzzles) and len(sub) == 24
    for task_id, attempts in sub.items():
        assert len(attempts) == len(puzzles[task_id]['test'])
