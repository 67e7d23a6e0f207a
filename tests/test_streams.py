"""
A run's exit code says how the run ended, whatever its streams: with stdout closed outright (`>&-`, no file
descriptor 1 at all), stderr closed (`2>&-`) or stdout a pipe whose reader is gone (`train.py | head -3`, a lost
tee, a closed SSH session), a run trains, writes results.json and exits 0, and every line it printed is in its
train.log; SIGTERM after the reader left saves the stop checkpoint. Real processes on the toy task.
    python -m pytest -q tests/test_streams.py
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import FAST, ROOT, ckpts, read_until, script_env, start


def assert_unlocked(out):
    assert not os.path.exists(os.path.join(out, 'run.lock')), 'the run left its lock behind'


@pytest.mark.parametrize('gone', ['>&-', '2>&-', 'reader'], ids=['stdout', 'stderr', 'stdout-reader'])
def test_a_run_whose_output_is_gone_trains_and_exits_0(toy, tmp_path, gone):
    out = tmp_path / 'o'
    args = ' '.join([sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=4'] + FAST)
    e = script_env()
    r, w = os.pipe()
    os.close(r)  # for 'reader': `( train.py ... & wait ) | head -c 1`, the reader left before the first line
    stdout, redirect = (w, '') if gone == 'reader' else (subprocess.PIPE, gone)
    with open(tmp_path / 'err', 'w') as err:
        p = subprocess.run(['bash', '-c', f'exec {args} {redirect}'], cwd=ROOT, env=e, stdout=stdout, stderr=err,
                           timeout=300)
    os.close(w)
    text = open(tmp_path / 'err').read()
    assert p.returncode == 0 and 'Traceback' not in text, (p.returncode, text[-3000:])
    assert ckpts(out) == ['ckpt_00000004.pt'] and os.path.exists(out / 'results.json')
    assert 'eval on 200' in open(out / 'train.log').read()


def logged_steps(out):
    """The step lines in a run's train.log so far."""
    try:
        with open(os.path.join(out, 'train.log')) as f:
            return sum(line.startswith('step ') for line in f)
    except FileNotFoundError:
        return 0


def test_sigterm_after_stdout_s_reader_left_saves_the_stop_checkpoint(toy, tmp_path):
    out = tmp_path / 'o'
    err = open(tmp_path / 'stderr', 'w')
    proc = start(toy, out, '--epochs=200', '--log_interval=1', stderr=err)
    read_until(proc, 'step 2/')
    proc.stdout.close()  # the reader is gone: `train.py | head -3`, a lost tee, a closed SSH session
    logged, deadline = logged_steps(out), time.time() + 120
    while logged_steps(out) < logged + 2:  # a line printed after the close: the run wrote on into the closed pipe
        assert proc.poll() is None and time.time() < deadline, open(tmp_path / 'stderr').read()[-3000:]
        time.sleep(0.05)
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


def hung_up(cmd, out):
    """`cmd` (train.py's, alone or under torchrun) in the foreground of an SSH session whose connection drops: the
    hangup (SIGHUP, which a shell there does not ignore as nohup does) to its process group, then a terminal
    nobody reads. Returns its exit code and train.log."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    read_until(proc, 'step 4/')
    os.killpg(proc.pid, signal.SIGHUP)
    proc.stdout.close()
    try:
        rc = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return rc, open(out / 'train.log').read()


def test_a_closed_ssh_session_s_hangup_does_not_stop_the_run(toy, tmp_path):
    out = tmp_path / 'o'
    rc, log = hung_up([sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=30'] + FAST,
                      out)
    assert rc == 0, (rc, log[-3000:])
    assert ckpts(out) == ['ckpt_00000030.pt'] and os.path.exists(out / 'results.json') and 'eval on 200' in log
    assert_unlocked(out)


def test_under_torchrun_whose_agent_ends_at_a_hangup_the_ranks_save_and_stop(toy, tmp_path):
    # torchrun's agent ends at a SIGHUP and passes it on to its ranks, killing them 30 s later: they save first
    out = tmp_path / 'o'
    rc, log = hung_up([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                       'train.py', f'--data_path={toy}', f'--out_dir={out}', '--epochs=200', '--global_batch_size=48']
                      + [a for a in FAST if not a.startswith(('--epochs', '--global_batch_size'))], out)
    assert 'got SIGHUP' in log and 'stopped cleanly' in log, (rc, log[-3000:])
    assert len(ckpts(out)) == 1
    assert_unlocked(out)


MANY_LINES = """
import sys
sys.path.insert(0, {root!r})
from configurator import Tee
Tee.install()
for i in range(3000):
    print(f'rank {{sys.argv[1]}} line {{i}} ' + 'x' * 40)
"""


def test_two_ranks_printing_into_one_terminal_keep_their_lines_whole():
    """torchrun's ranks share the terminal (one pipe), and print() writes a line's text and its end in two calls:
    the Tee makes each line one write, so another rank's line never lands inside it ('...x rank 1 line 7 ...')."""
    code = MANY_LINES.format(root=ROOT)
    r, w = os.pipe()
    ranks = [subprocess.Popen([sys.executable, '-c', code, str(rank)], env=script_env(), stdout=w) for rank in (0, 1)]
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    lines = text.splitlines()
    glued = [l for l in lines if not re.fullmatch(r'rank [01] line \d+ x{40}', l)]
    assert not glued and len(lines) == 6000, (len(lines), glued[:5])
