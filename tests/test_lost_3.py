"""
Nothing lost, third round (the run side): a closed stdout before the run starts, a stop request during a long
evaluation batch, a dataset rebuilt under a running run, a second stop signal while the first one saves, the XLA
launcher's signals, a gs:// lock's lease, and the one-line messages of a full disk, an out_dir that is a file,
a build over a file-size limit, --max_steps below the checkpoint and a type error's default. Real processes.
    python -m pytest -q tests/test_lost_3.py
"""
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TOY_ARGS, XLA_ENV, assert_user_error, run

FAST = TOY_ARGS + ['--epochs=2', '--eval_interval=100', '--log_interval=4']  # 40 steps of batch 50 on the toy task
SUDOKU = TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_interval=1000', '--log_interval=4']


def train(data, out, *extra, args=FAST, check=True, env=None):
    return run(['train.py', f'--data_path={data}', f'--out_dir={out}'] + args + list(extra), check=check, env=env)


def limited(limit, script='train.py'):
    """python -c arguments that run `script` under a file-size limit of `limit` bytes (a full disk's writes)."""
    return ['-c', "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            f"sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')"]


def ckpts(folder):
    return sorted(os.path.basename(c) for c in glob.glob(os.path.join(folder, 'ckpt_*.pt')))


# -----------------------------------------------------------------------------
# 1: a stdout whose reader is gone before the run prints its first line

def test_a_run_whose_stdout_reader_is_gone_from_the_start_trains_and_logs(toy, tmp_path):
    out = tmp_path / 'o'
    r, w = os.pipe()
    os.close(r)  # `( train.py ... & wait ) | head -c 1`: the reader left before the first line
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    with open(tmp_path / 'err', 'w') as err:
        p = subprocess.run([sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=4']
                           + FAST, cwd=ROOT, env=e, stdout=w, stderr=err, timeout=300)
    os.close(w)
    text = open(tmp_path / 'err').read()
    assert p.returncode == 0 and 'Traceback' not in text, text[-3000:]
    assert ckpts(out) == ['ckpt_00000004.pt'] and os.path.exists(out / 'results.json')
    assert 'eval on 200' in open(out / 'train.log').read()


# -----------------------------------------------------------------------------
# 11: --max_steps below the checkpoint's step, and a type error's default

def test_max_steps_below_the_checkpoint_says_so_and_changes_nothing(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    before = {n: open(out / n, 'rb').read() for n in ('metrics.jsonl', 'ckpt_00000008.pt')}
    for _ in range(2):  # every rerun says the same, and evaluates nothing
        p = train(toy, out, '--init_from=resume', '--max_steps=4', check=False)
        assert_user_error(p, 'step 8', '--max_steps=4')
        assert 'eval on' not in p.stdout
    assert {n: open(out / n, 'rb').read() for n in before} == before
    assert not os.path.exists(out / 'run.lock')


def test_a_type_error_names_train_py_s_default_not_an_earlier_flag(toy, tmp_path):
    p = run(['train.py', '--L_cycles=3', "--L_cycles='x'"], check=False)
    assert_user_error(p, 'L_cycles', '(default 6)')
    assert '(default 3)' not in p.stdout + p.stderr


# -----------------------------------------------------------------------------
# 10: a full disk at a resume, an out_dir that is a file or under one, a build over a file-size limit

def test_a_resume_onto_a_full_disk_is_one_line_that_keeps_the_run_s_files(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4')
    files = lambda: {n: open(out / n, 'rb').read() for n in os.listdir(out) if n != 'train.log' and (out / n).is_file()}
    before = files()
    size = os.path.getsize(out / 'metrics.jsonl')
    for limit in (40, size - 1):  # the lock's record does not fit; then metrics.jsonl's rewrite does not
        p = run(limited(limit) + [f'--data_path={toy}', f'--out_dir={out}', '--init_from=resume',
                                  '--max_steps=8'] + FAST, check=False)
        assert_user_error(p, str(out))
        assert 'File too large' in p.stdout + p.stderr
        assert files() == before
        assert not os.path.exists(out / 'run.lock')


def test_an_out_dir_that_is_a_file_or_under_a_file_is_one_line(toy, tmp_path):
    f = tmp_path / 'file'
    f.write_text('x')
    for out in (f, f / 'sub'):
        p = train(toy, out, '--max_steps=2', check=False)
        assert_user_error(p, f'out_dir={out}')
    assert f.read_text() == 'x'


def test_a_build_over_a_file_size_limit_names_the_file(tmp_path):
    d = tmp_path / 'd'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(d)])
    before = {s: sorted(os.listdir(d / s)) for s in ('train', 'test')}
    p = run(limited(2000, 'prepare_sudoku.py') + ['--csv_dir', str(d / 'csv'), '--output_dir', str(d)], check=False)
    assert_user_error(p, 'all__inputs.npy', 'File too large')
    assert len((p.stdout + p.stderr).strip().splitlines()) == 1, p.stdout + p.stderr
    assert {s: sorted(os.listdir(d / s)) for s in ('train', 'test')} == before


# -----------------------------------------------------------------------------
# 5: the first stop signal is acknowledged at once; a second one while it saves does not lose the save

def popen_train(data, out, *extra, args=FAST, env=None):
    """train.py in the background, stdout and stderr on one raw pipe (read through Lines), its own session."""
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1', **(env or {}))
    e.pop('PJRT_DEVICE', None) if 'PJRT_DEVICE' not in (env or {}) else None
    return subprocess.Popen([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={out}'] + args
                            + list(extra), cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            bufsize=0, start_new_session=True)


class Lines:
    """The lines a process prints, read from its pipe's file descriptor without read-ahead: what has not been
    read is still in the pipe, and `drain` drops what the process has written so far."""

    def __init__(self, proc):
        self.proc, self.fd, self.buf, self.seen = proc, proc.stdout.fileno(), b'', []

    def _read(self, timeout):
        if not select.select([self.fd], [], [], max(0.0, timeout))[0]:
            return None
        chunk = os.read(self.fd, 1 << 16)
        self.buf += chunk
        return chunk

    def next(self, timeout=300):
        deadline = time.time() + timeout
        while b'\n' not in self.buf:
            chunk = self._read(deadline - time.time())
            if not chunk:  # EOF, or nothing within the time
                return None
        line, self.buf = self.buf.split(b'\n', 1)
        self.seen.append(line.decode())
        return self.seen[-1]

    def until(self, prefix, timeout=300):
        deadline = time.time() + timeout
        while True:
            line = self.next(deadline - time.time())
            if line is None:
                self.kill()
                raise AssertionError(f"no line starting with {prefix!r}:\n" + '\n'.join(self.seen)[-3000:])
            if line.startswith(prefix):
                return line

    def drain(self):
        while self._read(0):
            pass
        *lines, self.buf = self.buf.split(b'\n')
        self.seen += [l.decode() for l in lines]

    def rest(self, timeout):
        deadline = time.time() + timeout
        while self.next(deadline - time.time()) is not None:
            pass
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {timeout} s on:\n" + '\n'.join(self.seen)[-3000:])
        return '\n'.join(self.seen)

    def kill(self):
        with_group = lambda: os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            with_group()
        except ProcessLookupError:
            pass
        self.proc.wait()


def test_the_first_stop_signal_is_acknowledged_at_once_and_a_second_does_not_lose_the_save(toy, tmp_path):
    out = tmp_path / 'o'
    proc = popen_train(toy, out, '--epochs=200', '--log_interval=1')
    lines = Lines(proc)
    lines.until('step 30/')  # past the calibration: the ranks agree on stop requests every ~2 s from here
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.5)
    lines.drain()  # every line printed before the signal
    partial = bool(lines.buf)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    first = [lines.next(60) for _ in range(1 + partial)]
    assert any('got SIGTERM' in (l or '') and 'saving a checkpoint' in (l or '') for l in first), first
    proc.send_signal(signal.SIGINT)  # an impatient Ctrl-C while it saves
    text = lines.rest(120)
    assert proc.returncode == 0, text[-3000:]
    assert 'got SIGINT' in text and 'the save goes on' in text, text[-3000:]
    saved = [l for l in text.splitlines() if l.startswith('saved') and '(stop requested)' in l]
    assert len(saved) == 1 and 'stopped cleanly' in text, text[-3000:]
    assert len(ckpts(out)) == 1 and not os.path.exists(out / 'run.lock')
    log = open(out / 'train.log').read()
    assert 'got SIGTERM' in log and 'got SIGINT' in log


# -----------------------------------------------------------------------------
# 2: a stop request during one long evaluation batch (test-time scaling: thousands of supervision steps)

def test_a_stop_during_one_long_evaluation_batch_is_honoured_between_chunks_of_its_steps(toy, tmp_path):
    out = tmp_path / 'o'
    # the final evaluation: one batch of all 200 examples for 2000 supervision steps (many minutes here)
    proc = popen_train(toy, out, '--max_steps=3', '--eval_batch_size=200', '--eval_steps=2000', '--log_interval=1')
    lines = Lines(proc)
    lines.until('step 3/3')
    time.sleep(3)  # inside the batch: its stop check before it has passed
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(90)  # the whole batch would take far longer
    assert proc.returncode == 0, text[-3000:]
    assert 'eval on' not in text and 'stopped cleanly' in text, text[-3000:]
    assert ckpts(out) == ['ckpt_00000003.pt'] and not os.path.exists(out / 'results.json')


# -----------------------------------------------------------------------------
# 3: a dataset rebuilt under a running run

def test_a_dataset_rebuilt_under_a_running_run_is_not_the_one_it_evaluates_and_the_builder_says_so(tmp_path):
    d, out = tmp_path / 'd', tmp_path / 'o'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(d)])
    proc = popen_train(d, out, '--max_steps=6', '--log_interval=1', args=SUDOKU)
    lines = Lines(proc)
    lines.until('step 2/')
    os.kill(proc.pid, signal.SIGSTOP)  # the rebuild happens between two of its steps
    try:
        p = run(['prepare_sudoku.py', '--generate', '40', '--size', '6', '--num_test', '7', '--output_dir', str(d)])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    warning = [l for l in p.stdout.splitlines() if l.startswith('warning')]
    assert warning and f'pid {proc.pid}' in warning[0] and str(out) in warning[0], p.stdout
    text = lines.rest(300)
    assert proc.returncode == 0 and 'Traceback' not in text, text[-3000:]
    assert 'eval on 10:' in text  # the 4x4 test split it started with, not the 7 6x6 ones now there
    assert json.load(open(out / 'results.json'))['final_eval']['count'] == 10
    assert json.load(open(d / 'test' / 'dataset.json'))['seq_len'] == 36  # the rebuild itself went through
    assert not [n for n in os.listdir(d) if n.startswith('.in_use')]  # the run's mark went with it


# -----------------------------------------------------------------------------
# 6: torch_xla's launcher passes SIGTERM on to its worker, and the worker dies with the launcher

def children(pid):
    kids = []
    for d in os.listdir('/proc'):
        try:
            if d.isdigit() and int(open(f'/proc/{d}/stat').read().rsplit(')', 1)[1].split()[1]) == pid:
                kids.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def gone(pid, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]
        except OSError:
            return True
        if state == 'Z':
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(not os.path.exists('/proc'), reason='reads /proc')
def test_the_xla_launcher_forwards_sigterm_and_its_worker_dies_with_it(toy, tmp_path):
    pytest.importorskip('torch_xla')
    out = tmp_path / 'o'
    xla = [a for a in FAST if a != '--device=cpu'] + ['--device=xla', '--epochs=400', '--log_interval=1']
    procs = []
    try:
        for stop in (signal.SIGTERM, signal.SIGKILL):
            proc = popen_train(toy, out, *(['--init_from=resume'] if procs else []), args=xla, env=XLA_ENV)
            procs.append(proc)
            lines = Lines(proc)
            lines.until('step ', timeout=400)
            workers = [k for k in children(proc.pid) if 'spawn_main' in open(f'/proc/{k}/cmdline').read()]
            assert workers, children(proc.pid)
            before = ckpts(out)
            os.kill(proc.pid, stop)  # the launcher's pid: what `kill PID`, `timeout` and a scheduler signal
            text = lines.rest(120)  # to the end of the pipe: the worker holds it too
            assert all(gone(w, 120) for w in workers), (stop, 'a worker outlived its launcher', text[-3000:])
            assert 'got SIGTERM' in text and 'stopped cleanly' in text, (stop, text[-3000:])
            assert stop == signal.SIGKILL or proc.returncode == 0, text[-3000:]
            assert ckpts(out) != before and not os.path.exists(out / 'run.lock'), (before, text[-3000:])
    finally:
        for p in procs:
            with_group = [p.pid] + children(p.pid)
            for pid in with_group:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
