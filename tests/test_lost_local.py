"""
Nothing lost, second round (the local side): one run per out_dir, init_from=FILE into a folder of another
run's checkpoints, SIGTERM while stdout is a closed pipe, a stop request during an evaluation, train and test
splits of other shapes, a rebuild that fails halfway, a lost results.json, torn metrics.jsonl lines, a full
disk while logging, config errors, and solve.py's --png and puzzle kind. Real processes, real files.
    python -m pytest -q tests/test_lost_local.py
"""
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, TOY_ARGS, assert_user_error, run
from data import check_split, write_split

FAST = TOY_ARGS + ['--epochs=2', '--eval_interval=100', '--log_interval=4']  # 40 steps of batch 50 on the toy task
# 4x4 Sudokus with attention: the weights fit any sequence length, so a dataset of another shape loads them
SUDOKU = TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_interval=1000', '--log_interval=4']


def train(data, out, *extra, args=FAST, check=True, env=None):
    return run(['train.py', f'--data_path={data}', f'--out_dir={out}'] + args + list(extra), check=check, env=env)


def start(data, out, *extra, args=FAST, **kw):
    """train.py in the background (its own session, so a failed test can kill the whole group)."""
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    kw = dict(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT), **kw)
    return subprocess.Popen([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={out}'] + args
                            + list(extra), cwd=ROOT, env=e, text=True, start_new_session=True, **kw)


def read_until(proc, prefix, timeout=300):
    """The lines proc printed up to and including the first that starts with prefix."""
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return ''.join(lines)
        assert time.time() < deadline, ''.join(lines)[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no line starting with {prefix!r}:\n{''.join(lines)[-3000:]}")


def finish(proc, timeout):
    try:
        rest = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"train.py still running {timeout} s after the signal")
    return rest or ''


def ckpts(folder):
    return sorted(os.path.basename(c) for c in glob.glob(os.path.join(folder, 'ckpt_*.pt')))


def files(folder):
    return {n: open(os.path.join(folder, n), 'rb').read() for n in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, n))}


def assert_unlocked(out):
    assert not os.path.exists(os.path.join(out, 'run.lock')), 'the run left its lock behind'


def write_like(root, kind, side, n=20, seed=0, splits=('train', 'test')):
    """A dataset that says it holds side x side puzzles of `kind` (random tokens: shapes are what matter)."""
    rng = np.random.default_rng(seed)
    vocab = side + 2 if kind == 'sudoku' else 6
    for split in splits:
        x = rng.integers(1, vocab, (n, side * side))
        write_split(str(root), split, x, x, np.zeros(n), np.arange(n + 1), np.arange(n + 1), vocab_size=vocab,
                    extra=dict(puzzle_type=kind, grid_size=side))
    return str(root)


@pytest.fixture(scope='module')
def sudoku4(tmp_path_factory):
    """Generated 4x4 Sudokus (the builder's output): 60 train, 10 test."""
    root = tmp_path_factory.mktemp('s4') / 'd'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(root)])
    return str(root)


@pytest.fixture(scope='module')
def trained(sudoku4, tmp_path_factory):
    """A finished 4-step run on the 4x4 Sudokus: ckpt_00000004.pt, metrics.jsonl, results.json. Read only."""
    out = tmp_path_factory.mktemp('trained') / 'o'
    train(sudoku4, out, '--max_steps=4', args=SUDOKU)
    return str(out)


# -----------------------------------------------------------------------------
# 1, 2: an out_dir belongs to one run

def test_init_from_a_file_into_a_folder_of_checkpoints_is_refused_unless_overwrite(sudoku4, trained, tmp_path):
    out = shutil.copytree(trained, tmp_path / 'o')
    before, src = files(out), os.path.join(out, 'ckpt_00000004.pt')
    p = train(sudoku4, out, f'--init_from={src}', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, str(out), 'already holds checkpoints', '--overwrite=True')
    p = train(sudoku4, out, f'--init_from={src}', '--max_steps=2', '--overwrite=True', args=SUDOKU, check=False)
    assert_user_error(p, src, 'copy it')  # --overwrite=True would delete the weights it starts from
    assert files(out) == before  # every checkpoint, metrics.jsonl and results.json as they were
    shutil.copy(src, tmp_path / 'src.pt')
    train(sudoku4, out, f'--init_from={tmp_path}/src.pt', '--max_steps=2', '--overwrite=True', args=SUDOKU)
    assert ckpts(out) == ['ckpt_00000002.pt']
    assert_unlocked(out)


def test_one_run_per_out_dir_a_stale_lock_is_taken_over_and_every_exit_removes_it(toy, tmp_path):
    out = tmp_path / 'o'
    first = start(toy, out, '--epochs=200', '--log_interval=5')  # few lines: nobody reads them for a while
    try:
        read_until(first, 'step 5/')
        p = train(toy, out, '--init_from=resume', '--max_steps=2', check=False)
        assert_user_error(p, f'{out} is in use', socket.gethostname(), f'pid {first.pid}', 'since')
        lock = json.load(open(out / 'run.lock'))
        assert lock['pid'] == first.pid and lock['host'] == socket.gethostname()
    finally:
        first.send_signal(signal.SIGTERM)
    assert 'stopped cleanly' in finish(first, 120) and first.returncode == 0
    assert_unlocked(out)  # a SIGTERM stop
    # the lock of a process that has ended (killed with SIGKILL, its host crashed) is taken over
    gone = subprocess.Popen([sys.executable, '-c', 'pass'])
    gone.wait()
    lock = dict(lock, pid=gone.pid)
    json.dump(lock, open(out / 'run.lock', 'w'))
    step = torch.load(glob.glob(str(out / 'ckpt_*.pt'))[0], weights_only=True)['step']
    # the first run's epochs: its stop may come after FAST's last step (40), a checkpoint past which is refused
    p = train(toy, out, '--init_from=resume', '--epochs=200', f'--max_steps={step + 1}', '--checkpoint_interval=1')
    assert f'pid {gone.pid}' in p.stdout and 'taking over' in p.stdout
    assert_unlocked(out)  # a normal end
    p = train(toy, out, '--init_from=resume', '--hidden_size=64', check=False)
    assert_user_error(p, 'hidden_size=32')
    assert_unlocked(out)  # a refusal through fail_together
    p = train(toy, out, f"--init_from={out / ckpts(out)[-1]}", '--eval_only=True')
    assert 'eval on 200' in p.stdout
    assert_unlocked(out)  # eval_only


# -----------------------------------------------------------------------------
# 3, 4: stop requests that are not lost

def test_sigterm_while_stdout_is_a_closed_pipe_saves_the_stop_checkpoint(toy, tmp_path):
    out = tmp_path / 'o'
    err = open(tmp_path / 'stderr', 'w')
    proc = start(toy, out, '--epochs=200', '--log_interval=1', stderr=err)
    read_until(proc, 'step 2/')
    proc.stdout.close()  # the reader is gone: `train.py | head -3`, a lost tee, a closed SSH session
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert rc == 0, open(tmp_path / 'stderr').read()[-3000:]
    log = open(out / 'train.log').read()  # every line the run printed, also those nobody read
    saved = [l for l in log.splitlines() if l.startswith('saved') and '(stop requested)' in l]
    assert len(saved) == 1 and 'stopped cleanly' in log, log[-3000:]
    step = int(re.search(r'ckpt_(\d{8})\.pt', saved[0]).group(1))
    assert ckpts(out) == [f'ckpt_{step:08d}.pt'] and step > 2
    assert torch.load(out / ckpts(out)[0], weights_only=True)['step'] == step
    assert f'step {step}/' in log
    assert_unlocked(out)


def test_a_stop_during_an_evaluation_saves_its_step_at_once_and_the_resume_evaluates(toy, tmp_path):
    out = tmp_path / 'o'
    # the final evaluation at step 3: 200 batches of one example, 128 supervision steps each (a minute or more)
    proc = start(toy, out, '--max_steps=3', '--eval_batch_size=1', '--eval_steps=128')
    text = read_until(proc, 'step 3/3')
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    text += finish(proc, 60)
    took = time.time() - t0
    assert proc.returncode == 0, text[-3000:]
    assert 'eval on' not in text and 'stopped cleanly' in text, text[-3000:]
    assert took < 30, (took, text[-3000:])
    assert ckpts(out) == ['ckpt_00000003.pt'] and not os.path.exists(out / 'results.json')
    # the resume finds the run at its end without its final evaluation: it evaluates and writes results.json
    p = train(toy, out, '--init_from=resume', '--max_steps=3')
    assert 'nothing to do' not in p.stdout and 'eval on 200' in p.stdout, p.stdout[-3000:]
    res = json.load(open(out / 'results.json'))
    assert res['step'] == 3 and res['final_eval']['count'] == 200
    assert_unlocked(out)


# -----------------------------------------------------------------------------
# 8: data of other shapes, and builds that fail halfway

def test_train_and_test_splits_of_another_shape_or_puzzle_fail_at_start(sudoku4, tmp_path):
    d = shutil.copytree(sudoku4, tmp_path / 'd')
    shutil.rmtree(os.path.join(d, 'test'))
    write_like(d, 'sudoku', 6, splits=('test',))  # a rebuild to 6x6 that stopped after the test split
    p = train(d, tmp_path / 'o', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, 'start-up checks failed', 'seq_len', '16', '36')
    shutil.rmtree(os.path.join(d, 'test'))
    write_like(d, 'maze', 4, splits=('test',))  # 4x4 mazes: the same shape and vocabulary, another puzzle
    p = train(d, tmp_path / 'o', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, 'start-up checks failed', 'sudoku', 'maze')


def test_a_resume_onto_a_dataset_of_another_shape_is_one_line(toy, trained, tmp_path):
    out = shutil.copytree(trained, tmp_path / 'o')
    p = train(toy, out, '--init_from=resume', '--max_steps=8', args=SUDOKU, check=False)
    assert_user_error(p, 'ckpt_00000004.pt', 'seq_len', '16', '8')
    assert ckpts(out) == ['ckpt_00000004.pt']


def test_a_rebuild_that_fails_halfway_leaves_the_previous_dataset_whole(tmp_path):
    d, csv = tmp_path / 'd', tmp_path / 'csv'
    run(['prepare_sudoku.py', '--generate', '30', '--size', '4', '--num_test', '5', '--output_dir', str(d)])
    before = {s: files(d / s) for s in ('train', 'test')}
    os.makedirs(csv)
    shutil.copy(d / 'csv' / 'train.csv', csv / 'train.csv')
    (csv / 'test.csv').write_text(open(d / 'csv' / 'test.csv').read() + 'x,12,34,0\n')  # a bad last row
    p = run(['prepare_sudoku.py', '--csv_dir', str(csv), '--subsample_size', '10', '--output_dir', str(d)],
            check=False)
    assert_user_error(p, 'test.csv')
    assert {s: files(d / s) for s in ('train', 'test')} == before
    m = tmp_path / 'm'
    run(['prepare_maze.py', '--generate', '6', '--size', '6', '--num_test', '3', '--min_path_len', '2',
         '--output_dir', str(m)])
    before = {s: files(m / s) for s in ('train', 'test')}
    shutil.copy(m / 'csv' / 'train.csv', csv / 'train.csv')
    (csv / 'test.csv').write_text(open(m / 'csv' / 'test.csv').read() + 'x,#S,#G,1\n')
    p = run(['prepare_maze.py', '--csv_dir', str(csv), '--subsample_size', '3', '--output_dir', str(m)],
            check=False)
    assert_user_error(p, 'test.csv')
    assert {s: files(m / s) for s in ('train', 'test')} == before
    assert all(check_split(str(root), s) == [] for root in (d, m) for s in ('train', 'test'))


# -----------------------------------------------------------------------------
# 9, 12: records that fail, records that are torn, config errors

def test_a_failed_results_write_is_a_warning_and_the_resume_writes_it(toy, tmp_path):
    out = tmp_path / 'o'
    os.makedirs(out / 'results.json.tmp')  # results.json cannot be written, as on a full disk
    p = train(toy, out, '--max_steps=4')
    assert 'warning' in p.stdout and 'results.json' in p.stdout and 'Traceback' not in p.stdout + p.stderr
    assert ckpts(out) == ['ckpt_00000004.pt'] and not os.path.exists(out / 'results.json')
    os.rmdir(out / 'results.json.tmp')  # space freed
    p = train(toy, out, '--init_from=resume', '--max_steps=4')
    assert 'nothing to do' not in p.stdout, p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == 4
    evals = [json.loads(l) for l in open(out / 'metrics.jsonl') if '"eval"' in l]
    assert [e['step'] for e in evals] == [4]  # logged once


def test_a_full_disk_while_appending_metrics_is_a_warning_and_training_goes_on(toy, tmp_path):
    out = tmp_path / 'o'
    os.makedirs(out)
    limit = 1 << 21  # a checkpoint (about 1.1 MB) fits; metrics.jsonl, already near the limit, cannot grow
    pad = json.dumps(dict(kind='note', step=0, text='x' * (limit - 300))) + '\n'
    (out / 'metrics.jsonl').write_text(pad)
    wrapper = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
               "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")
    p = run(['-c', wrapper, f'--data_path={toy}', f'--out_dir={out}', '--max_steps=8'] + FAST, check=False)
    out_text = p.stdout + p.stderr
    assert p.returncode == 0 and 'Traceback' not in out_text, out_text[-3000:]
    assert 'warning' in p.stdout and 'metrics.jsonl' in p.stdout and 'step 8/8' in p.stdout
    assert ckpts(out) == ['ckpt_00000008.pt'] and os.path.exists(out / 'results.json')


def test_a_torn_line_in_metrics_is_dropped_with_a_warning(sudoku4, trained, tmp_path):
    out = shutil.copytree(trained, tmp_path / 'o')
    lines = open(os.path.join(out, 'metrics.jsonl')).readlines()
    lines.insert(1, '{"kind": "train", "step": 2, "lo\n')  # a line cut by a crash, then appended after
    open(os.path.join(out, 'metrics.jsonl'), 'w').writelines(lines)
    p = train(sudoku4, out, '--init_from=resume', '--max_steps=6', args=SUDOKU)
    assert 'warning' in p.stdout and 'metrics.jsonl line 2' in p.stdout
    rows = [json.loads(l) for l in open(os.path.join(out, 'metrics.jsonl'))]
    assert rows[-1]['step'] == 6


def test_an_empty_out_dir_and_a_config_file_with_a_syntax_error_are_one_line(toy, tmp_path):
    p = train(toy, '', '--max_steps=2', check=False)
    assert_user_error(p, 'config error', "out_dir=''")
    cfg = tmp_path / 'bad.py'
    cfg.write_text("lr = 1e-3\nx = (\n")
    p = run(['train.py', str(cfg)], check=False)
    assert_user_error(p, 'config error', f'{cfg}, line 2')
    cfg.write_text("lr = 1e-3\nhidden_size = undefined_name\n")
    p = run(['train.py', str(cfg)], check=False)
    assert_user_error(p, 'config error', f'{cfg}, line 2', 'undefined_name')


# -----------------------------------------------------------------------------
# 13: solve.py

def test_solve_png_into_a_folder_and_a_model_of_another_puzzle(trained, tmp_path):
    ckpt = os.path.join(trained, 'ckpt_00000004.pt')
    folder = tmp_path / 'pics'
    os.makedirs(folder)
    p = run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--png={folder}'], check=False)
    assert_user_error(p, f'png={folder}', 'folder')
    assert not os.path.exists(f'{folder}.png')
    p = run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--png={folder}/steps'])
    assert f'wrote {folder}/steps.png' in p.stdout and os.path.exists(folder / 'steps.png')
    mazes = write_like(tmp_path / 'maze4', 'maze', 4)
    p = run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--data_path={mazes}'])
    warning = [l for l in p.stdout.splitlines() if l.startswith('warning')]
    assert warning and '4x4 Sudoku' in warning[0] and '4x4 maze' in warning[0], p.stdout
