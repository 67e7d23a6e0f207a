"""
The quick whole-path smoke test (about a minute on a laptop CPU): build a 4x4 Sudoku dataset with the real
builder, train a tiny TRM on it with train.py, check that it solves held-out puzzles, re-evaluate its
checkpoint with --eval_only, and check that a run stopped at --max_steps and resumed ends in exactly the
state of an uninterrupted run. Everything runs as a user runs it, in new processes from the repository root.
    python -m pytest -q test_smoke.py              # this file
    python -m pytest -q -n auto --dist loadfile test_smoke.py tests/   # everything, one worker per core
"""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
STEPS = 200  # 25 epochs of 400 puzzles at batch 50; the final evaluation is at the last step
TRAIN_ARGS = ['--device=cpu', '--epochs=25', '--eval_every_epochs=25', '--log_interval=25',
              '--global_batch_size=50',
              '--hidden_size=32', '--num_heads=2', '--mlp_t=True', '--pos_encodings=none',
              '--puzzle_emb_ndim=0',
              '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=4', '--lr=2e-3', '--lr_warmup_steps=20',
              '--weight_decay=0.1', '--ema_rate=0.95', '--forward_dtype=float32', '--loss_dtype=float32',
              '--xla_cache_dir=', '--seed=0']


def run(args):
    """A script of this repo in a new process, on the CPU, with W&B off; fails the test on a non-zero exit."""
    env = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    for k in ('PJRT_DEVICE', 'STORAGE_EMULATOR_HOST'):
        env.pop(k, None)
    p = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"{args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def final_eval(out):
    """The last 'eval on N: exact ...' line, and its numbers by name."""
    line = [l for l in out.splitlines() if l.startswith('eval on')][-1]
    words = line.replace('|', ' ').split()
    value = lambda name: float(words[words.index(name) + 1])
    return line, dict(exact=value('exact'), token=value('token'), verified=value('verified'))


def same_state(a, b, where='checkpoint'):
    """Equal nested dicts / lists of tensors and plain values, tensors bit for bit."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            same_state(a[k], b[k], f'{where}[{k!r}]')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f'{where}[{i}]')
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.fixture(scope='module')
def sudoku(tmp_path_factory):
    """400 + 100 generated 4x4 Sudokus (unique solutions), one shuffled copy of each training puzzle."""
    d = str(tmp_path_factory.mktemp('sudoku4'))
    out = run(['prepare_sudoku.py', '--generate', '400', '--size', '4', '--num_test', '100', '--num_aug', '1',
               '--seed', '0', '--output_dir', d])
    assert 'done in' in out
    return d


@pytest.fixture(scope='module')
def trained(sudoku, tmp_path_factory):
    """One uninterrupted training run: (out_dir, stdout)."""
    out_dir = str(tmp_path_factory.mktemp('straight'))
    return out_dir, run(['train.py', f'--data_path={sudoku}', f'--out_dir={out_dir}'] + TRAIN_ARGS)


def test_the_builder_writes_the_dataset(sudoku):
    for split, puzzles in (('train', 800), ('test', 100)):
        with open(os.path.join(sudoku, split, 'dataset.json')) as f:
            meta = json.load(f)
        assert meta['puzzle_type'] == 'sudoku' and meta['seq_len'] == 16 and meta['vocab_size'] == 6
        assert meta['total_puzzles'] == puzzles
        for name in ('inputs', 'labels', 'puzzle_identifiers', 'puzzle_indices', 'group_indices'):
            assert os.path.exists(os.path.join(sudoku, split, f'all__{name}.npy')), (split, name)


def test_a_tiny_trm_learns_to_solve_held_out_sudokus(trained):
    out_dir, out = trained
    losses = [float(l.split('| loss ')[1].split()[0]) for l in out.splitlines() if l.startswith('step ')]
    assert len(losses) == STEPS // 25 and losses[-1] < 0.5 * losses[0], losses
    line, r = final_eval(out)
    print(line)
    assert line.startswith('eval on 100: ')  # every held-out puzzle
    assert r['exact'] > 0.5, line  # chance: about 4^-10 per puzzle (4x4 with ~10 blanks)
    assert r['verified'] == r['exact'], line  # unique solutions: the verifier agrees with the labels
    assert r['token'] > 0.8, line
    assert 'held-out puzzle' in out and 'model answer' in out  # an example is shown
    assert os.path.exists(os.path.join(out_dir, f'ckpt_{STEPS:08d}.pt'))


def test_eval_only_reproduces_the_final_evaluation(sudoku, trained, tmp_path):
    out_dir, out = trained
    ckpt = os.path.join(out_dir, f'ckpt_{STEPS:08d}.pt')
    again = run(['train.py', f'--data_path={sudoku}', f'--out_dir={tmp_path}/eval', f'--init_from={ckpt}',
                 '--eval_only=True'] + TRAIN_ARGS)
    assert 'loaded weights from' in again
    assert final_eval(again)[0] == final_eval(out)[0]  # the same weights give the same numbers
    assert not glob.glob(f'{tmp_path}/eval/ckpt_*')  # evaluating saves no checkpoint


def test_stopped_and_resumed_run_ends_where_an_uninterrupted_run_ends(sudoku, trained, tmp_path):
    out_dir, out = trained
    args = ['train.py', f'--data_path={sudoku}', f'--out_dir={tmp_path}/split'] + TRAIN_ARGS
    run(args + [f'--max_steps={STEPS // 2}'])
    assert os.path.exists(f'{tmp_path}/split/ckpt_{STEPS // 2:08d}.pt')
    resumed = run(args + ['--init_from=resume'])
    assert 'resuming from' in resumed and f'(step {STEPS // 2})' in resumed
    assert final_eval(resumed)[0] == final_eval(out)[0]
    a = torch.load(os.path.join(out_dir, f'ckpt_{STEPS:08d}.pt'), weights_only=True)
    b = torch.load(f'{tmp_path}/split/ckpt_{STEPS:08d}.pt', weights_only=True)
    assert a['step'] == b['step'] == STEPS
    for k in ('config', 'run_id', 'wandb_run_id', 'checkpoint_id', 'timing', 'device_s'):  # out_dir, init_from,
        a.pop(k, None), b.pop(k, None)  # max_steps; each run's own id, each save's own id, and the wall clock
    same_state(a, b)  # weights, EMA, optimiser moments, data position, ACT carry, RNG, best
