"""
A run's exit code says how the run ended, whatever its streams: with stdout closed outright (`>&-`, no file
descriptor 1 at all) or stderr closed (`2>&-`), a run trains, writes results.json and exits 0. Real processes
on the toy task.
    python -m pytest -q tests/test_streams.py
"""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TOY_ARGS

FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=100', '--log_interval=4', '--max_steps=4']


def train_closed(toy, out, redirect):
    """train.py under bash with one of its streams closed by `redirect` ('>&-' or '2>&-')."""
    args = ' '.join([sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}'] + FAST)
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    return subprocess.run(['bash', '-c', f'exec {args} {redirect}'], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize('redirect', ['>&-', '2>&-'], ids=['stdout', 'stderr'])
def test_a_run_with_a_closed_stream_trains_and_exits_0(toy, tmp_path, redirect):
    out = tmp_path / 'o'
    p = train_closed(toy, out, redirect)
    assert p.returncode == 0, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    assert os.path.exists(out / 'ckpt_00000004.pt') and os.path.exists(out / 'results.json')
    assert 'eval on 200' in open(out / 'train.log').read()
