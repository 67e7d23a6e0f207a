"""
Stops and signals: SIGTERM and Ctrl-C save a checkpoint that a resume continues from, and every rank exits
together at the same step (also when one rank alone is told), during an evaluation, under torch_xla's launcher,
with a second signal, once when the process that started the run is killed (and with stdout's reader gone:
tests/test_streams.py).
    python -m pytest -q tests/test_signals.py
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (FAST, ROOT, TOY_ARGS, XLA_ENV, Lines, alive, children, ckpts, command, finish, hold, popen_train,
                      read_until, script_env, site_hook, start, train)


def assert_unlocked(out):
    assert not os.path.exists(os.path.join(out, 'run.lock')), 'the run left its lock behind'


def test_sigterm_saves_and_resume_continues(toy, tmp_path):
    out = tmp_path / 'o'
    proc = start(toy, out, '--epochs=200', '--log_interval=1')
    text = read_until(proc, 'step 3/')
    proc.send_signal(signal.SIGTERM)
    text += finish(proc, 120)
    assert proc.returncode == 0, text[-3000:]
    assert 'stopped cleanly' in text
    [ckpt] = ckpts(out)
    step = torch.load(out / ckpt, weights_only=True)['step']
    assert step >= 3
    p = train(toy, out, '--epochs=200', '--log_interval=1', '--init_from=resume', f'--max_steps={step + 2}')
    assert 'resuming from' in p.stdout and f'step {step + 2}/' in p.stdout


def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(toy, tmp_path):
    args = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--data_path={toy}',
            f'--out_dir={tmp_path}/o', '--epochs=200', '--eval_every_epochs=1000', '--log_interval=2'] + TOY_ARGS
    e = script_env(dict(OMP_NUM_THREADS='1'))
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    text = read_until(proc, 'step 4/')
    workers = subprocess.run(['pgrep', '-P', str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGTERM)  # rank 1 only: as when one host is told first
    text += finish(proc, 120)
    assert proc.returncode == 0, text[-3000:]
    assert 'stopped cleanly' in text
    [ckpt] = ckpts(tmp_path / 'o')
    assert torch.load(tmp_path / 'o' / ckpt, weights_only=True)['carry']['inputs'].shape[0] == 50


# rank 1 never joins the process group, as a rank that ended before joining on another host (a config error there):
# rank 0 waits in the join, for the group's timeout
NEVER_JOINS = """
if sys.argv[0].endswith('train.py') and 'RANK' in os.environ:
    import torch.distributed as dist
    real = dist.init_process_group

    def init_process_group(*a, **k):
        print(f"test hook: rank {os.environ['RANK']} joins", flush=True)
        if os.environ['RANK'] == '1':
            threading.Event().wait()
        return real(*a, **k)
    dist.init_process_group = init_process_group
"""


def test_a_stop_while_torchrun_ranks_join_ends_them_at_once_with_nothing_to_save(toy, tmp_path):
    # torchrun's SIGTERM (a VM's shutdown) goes on to both ranks; unanswered, it kills them 30 s later
    args = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--data_path={toy}',
            f'--out_dir={tmp_path}/o', '--global_batch_size=48'] + [a for a in FAST if 'global_batch' not in a]
    e = script_env(dict(site_hook(tmp_path / 'hook', NEVER_JOINS), OMP_NUM_THREADS='1'))
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
    lines = Lines(proc)
    # either rank first; the two ranks share the pipe, and print() writes a line's text and its end apart, so the
    # two lines may come as one ('test hook: rank 1 joinstest hook: rank 0 joins'): counted, not matched per line
    while '\n'.join(lines.seen).count('test hook: rank') < 2:
        lines.until('test hook: rank')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    assert text.count('while joining the other ranks: nothing to save yet') == 2, text[-3000:]
    assert 'saving a checkpoint' not in text and 'Unable to shutdown' not in text, text[-3000:]
    assert not os.path.exists(tmp_path / 'o'), os.listdir(tmp_path / 'o')


def test_a_stop_during_an_evaluation_saves_its_step_at_once_and_the_resume_evaluates(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=3', '--lr=1e-3')  # a finished run, which the next replaces: its results.json goes
    # the final evaluation at step 3: 200 batches of one example, 128 supervision steps each (a minute or more)
    proc = start(toy, out, '--max_steps=3', '--eval_batch_size=1', '--eval_steps=128', '--overwrite=True')
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


def test_a_stop_during_the_resume_s_final_evaluation_says_that_it_stopped_and_what_the_rerun_does(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=3')
    os.remove(out / 'results.json')  # as a stop during the final evaluation leaves the run
    ckpt = open(out / 'ckpt_00000003.pt', 'rb').read()
    # the resume evaluates again, slowly: 200 batches of one example, 128 supervision steps each
    proc = start(toy, out, '--max_steps=3', '--init_from=resume', '--eval_batch_size=1', '--eval_steps=128')
    text = read_until(proc, 'the checkpoint is at the last step 3')
    proc.send_signal(signal.SIGTERM)
    text += finish(proc, 60)
    assert proc.returncode == 0 and 'eval on' not in text, text[-3000:]
    assert 'stopped during the final evaluation' in text.splitlines()[-1], text[-3000:]
    assert not os.path.exists(out / 'results.json') and open(out / 'ckpt_00000003.pt', 'rb').read() == ckpt
    assert_unlocked(out)


def test_a_run_stopped_in_its_final_evaluation_and_resumed_with_more_steps_trains_on(toy, tmp_path):
    out = tmp_path / 'o'
    proc = start(toy, out, '--max_steps=3', '--eval_batch_size=1', '--eval_steps=128')  # a final evaluation of minutes
    text = read_until(proc, 'step 3/3')
    proc.send_signal(signal.SIGTERM)
    text += finish(proc, 60)
    assert proc.returncode == 0 and 'stopped cleanly' in text, text[-3000:]
    # no time budget ended this run at step 3: more steps on resume are trained, as the docs allow
    p = train(toy, out, '--max_steps=5', '--init_from=resume')
    assert 'time budget' not in p.stdout and 'step 5/' in p.stdout, p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == 5


def test_the_first_stop_signal_is_acknowledged_at_once_and_a_second_does_not_lose_the_save(toy, tmp_path):
    out = tmp_path / 'o'
    proc = popen_train(toy, out, '--epochs=200', '--log_interval=1')
    lines = Lines(proc)
    lines.until('step 30/')  # past the calibration: the ranks agree on stop requests every ~2 s from here
    hold(proc)  # every thread of it, so nothing more is written until SIGCONT
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


def test_a_stop_during_one_long_evaluation_batch_is_honoured_within_it(toy, tmp_path):
    out = tmp_path / 'o'
    # the final evaluation: one batch of all 200 examples for 2000 supervision steps (many minutes here); a
    # sitecustomize.py says when the batch's 10th step is done: its stop check before the batch has passed (one
    # process: after every step; ranks agree every halt_max_steps steps: test_stop_bounded.py's torchrun test)
    said = site_hook(tmp_path / 'hook', """import model
real, calls = model.TRM.predict_step, [0]


def predict_step(self, *args, **kwargs):
    out = real(self, *args, **kwargs)
    calls[0] += 1
    if calls[0] == 10:
        print('test hook: evaluation step 10 done', flush=True)
    return out


model.TRM.predict_step = predict_step
""")
    proc = popen_train(toy, out, '--max_steps=3', '--eval_batch_size=200', '--eval_steps=2000', '--log_interval=1',
                       env=said)
    lines = Lines(proc)
    lines.until('test hook: evaluation step 10 done')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(90)  # the whole batch would take far longer
    assert proc.returncode == 0, text[-3000:]
    assert 'eval on' not in text and 'stopped cleanly' in text, text[-3000:]
    assert ckpts(out) == ['ckpt_00000003.pt'] and not os.path.exists(out / 'results.json')


def xla_workers(pid):
    """The torch_xla worker processes of a launcher (not multiprocessing's resource tracker)."""
    return [k for k in children(pid) if 'spawn_main' in command(k)]


def test_the_xla_launcher_passes_on_a_sigterm_the_kernel_gave_to_a_thread_other_than_its_main_one(toy, tmp_path):
    """A signal to a process goes to any one of its threads. torch_xla's launcher waits for its workers in a lock,
    in its main thread, where Python would run a handler only once the wait ends (the whole training): a SIGTERM
    that the kernel gave one of its other threads must still reach the workers at once, as a preemption's."""
    pytest.importorskip('torch_xla')  # Linux only, as the threads' signal (tgkill)
    import ctypes
    proc = popen_train(toy, tmp_path / 'o', '--device=xla', '--epochs=400', '--log_interval=1',
                       args=[a for a in FAST if a != '--device=cpu'], env=XLA_ENV)
    lines = Lines(proc)
    try:
        lines.until('step 6/', timeout=400)
        others = [int(t) for t in os.listdir(f'/proc/{proc.pid}/task') if int(t) != proc.pid]
        assert others, 'the launcher has no thread but its main one'
        tgkill = {'x86_64': 234, 'aarch64': 131}[os.uname().machine]  # the syscall's number
        assert ctypes.CDLL(None, use_errno=True).syscall(tgkill, proc.pid, others[0], signal.SIGTERM) == 0
        text = lines.rest(120)
        assert 'got SIGTERM: saving a checkpoint' in text and 'stopped cleanly' in text, text[-3000:]
        assert proc.returncode == 0 and ckpts(tmp_path / 'o'), text[-3000:]
    finally:
        lines.kill()


def gone(pid, timeout):
    deadline = time.time() + timeout
    while alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


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
            workers = xla_workers(proc.pid)
            assert workers, children(proc.pid)
            before = ckpts(out)
            os.kill(proc.pid, stop)  # the launcher's pid: what `kill PID`, `timeout` and a scheduler signal
            text = lines.rest(120)  # to the end of the pipe: the worker holds it too
            # the messages are strings: pytest shows a string whole, other objects cut to a few hundred characters
            assert all(gone(w, 120) for w in workers), f'{stop.name}: a worker outlived its launcher\n{text[-3000:]}'
            said = 'got SIGTERM' if stop == signal.SIGTERM else f'its parent process (pid {proc.pid}) ended'
            assert said in text and 'stopped cleanly' in text, f'{stop.name}:\n{text[-3000:]}'
            assert stop == signal.SIGKILL or proc.returncode == 0, text[-3000:]
            assert ckpts(out) != before and not os.path.exists(out / 'run.lock'), f'{before}\n{text[-3000:]}'
    finally:
        for p in procs:
            with_group = [p.pid] + children(p.pid)
            for pid in with_group:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


# what study.py and solve.py are to the train.py they start, with the threads such a process has: the run is to
# end with it, even by SIGKILL. Its starting thread ends once the run holds its out_dir (its signal handlers are in)
PARENT = """
import os, subprocess, sys, threading, time
from runkeep.signals import die_with_parent
parent, lock, run = os.getpid(), sys.argv[1], []

def start():
    run.append(subprocess.Popen(sys.argv[2:], preexec_fn=lambda: die_with_parent(parent)))
    while not os.path.exists(lock) and run[0].poll() is None:
        time.sleep(0.1)

starter = threading.Thread(target=start)
starter.start()
starter.join()
for _ in range(16):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print('parent: the run ended with exit code', run[0].wait())
"""


@pytest.mark.parametrize('device', ['cpu', 'xla'])
def test_a_run_stops_once_when_its_parent_is_killed_and_not_when_a_parent_s_thread_ends(toy, tmp_path, device):
    """The kernel's signal on a parent's end follows the thread that started the child: it comes when that
    thread finishes, the parent alive, and from a killed parent once for each of its threads. The run must go on
    in the first case and take the second for one stop request, not for a person's third signal (an end without
    its checkpoint). On XLA the launcher is the child: it passes the stop on to its worker as a SIGTERM."""
    if device == 'xla':
        pytest.importorskip('torch_xla')
    out = tmp_path / 'o'
    args = [a for a in FAST if a != '--device=cpu'] + [f'--device={device}', '--epochs=400', '--log_interval=1']
    e = script_env(XLA_ENV if device == 'xla' else {})
    cmd = [sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}'] + args
    proc = subprocess.Popen([sys.executable, '-c', PARENT, str(out / 'run.lock')] + cmd, cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
    lines, ours = Lines(proc), []
    try:
        lines.until('step 6/', timeout=400)
        [run] = children(proc.pid)
        ours = [run] + xla_workers(run)
        before = '\n'.join(lines.seen)
        assert 'saving a checkpoint' not in before, before[-3000:]
        proc.kill()  # with its 17 threads
        text = lines.rest(120)  # to the end of the pipe: the run holds it too
        assert all(gone(pid, 120) for pid in ours), f'the run outlived its parent\n{text[-3000:]}'
        said = (f'pid {run}: its parent process (pid {proc.pid}) ended: saving a checkpoint' if device == 'cpu'
                else f'pid {ours[-1]}: got SIGTERM: saving a checkpoint')
        assert said in text and text.count('saving a checkpoint') == 1, text[-3000:]
        assert 'a third time' not in text and 'stopped cleanly' in text, text[-3000:]
        assert ckpts(out) and not os.path.exists(out / 'run.lock'), text[-3000:]
    finally:
        for pid in [proc.pid] + ours:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
