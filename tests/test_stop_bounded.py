"""
A stop request always ends the run: one not reached while the run finishes nothing for TRM_STOP_GRACE_S (20 s;
a spot VM's notice is about 30) ends the process with a line naming the last checkpoint kept and exit code 75
(the same command resumes from it), in one process, in every torchrun rank, under torch_xla's launcher; a stop
that reaches its check saves and exits 0 as always, however long the save, and so does a run whose evaluation
outlasts the grace while its steps keep finishing. A sitecustomize.py on PYTHONPATH stands in for a step that
never ends (a paper-size step thrashing a machine without swap) or a slow one.
    python -m pytest -q tests/test_stop_bounded.py
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (FAST, ROOT, XLA_ENV, Lines, alive, below, ckpts, command, our_frames, popen_train, script_env,
                      site_hook, train)

GRACE = 3  # seconds (TRM_STOP_GRACE_S), so the tests take seconds


def hook(tmp_path, body):
    return dict(site_hook(tmp_path / 'hook', body), TRM_STOP_GRACE_S=str(GRACE))


def step_never_ends(tmp_path, at=12, rank=None):
    """Training step `at` of this process (of rank `rank` only, if given) never returns."""
    return hook(tmp_path, f'''import step
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == {at} and os.environ.get('RANK', '0') in {[str(rank)] if rank is not None else ['0', '1']!r}:
        # one write that starts a line: another rank's line may be half written (its text, then its newline)
        sys.stdout.write('\\ntest hook: step {at} never ends\\n')
        sys.stdout.flush()
        threading.Event().wait()
    return real(*args, **kwargs)


step.train_step = train_step
''')


def assert_ended_by_the_bound(text, kept):
    lines = [l for l in text.splitlines() if 'was not reached' in l]
    assert lines, text[-3000:]
    assert f'the last checkpoint kept: {kept}' in lines[0] and 'exit code 75' in lines[0], lines[0]


def test_a_stop_inside_a_step_that_does_not_end_ends_the_process_naming_the_last_checkpoint(toy, tmp_path):
    out = tmp_path / 'o'
    proc = popen_train(toy, out, '--max_steps=200', '--checkpoint_interval=10', '--log_interval=1',
                       env=step_never_ends(tmp_path))
    lines = Lines(proc)
    lines.until('test hook: step 12 never ends')
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(60)
    assert proc.returncode == 75, (proc.returncode, text[-3000:])
    assert time.time() - t < GRACE + 20, time.time() - t
    assert 'got SIGTERM' in text
    assert_ended_by_the_bound(text, out / 'ckpt_00000010.pt')
    assert ckpts(out) == ['ckpt_00000010.pt'] and not os.path.exists(out / 'run.lock')
    assert 'was not reached' in open(out / 'train.log').read()
    # Ctrl-C: a person stopped it, and a loop that reruns on 75 must end: 130
    proc = popen_train(toy, out, '--max_steps=200', '--checkpoint_interval=10', '--log_interval=1',
                       '--init_from=resume', env=step_never_ends(tmp_path))
    lines = Lines(proc)
    lines.until('test hook: step 12 never ends')
    proc.send_signal(signal.SIGINT)
    text = lines.rest(60)
    assert proc.returncode == 130 and 'with exit code 130' in text, (proc.returncode, text[-3000:])


def test_a_stop_that_reaches_its_check_saves_and_exits_as_always_however_long_the_save(toy, tmp_path):
    out = tmp_path / 'o'
    env = hook(tmp_path, '''from runkeep import checkpoint
real = checkpoint.write_checkpoint


def write_checkpoint(state, path, tag='', *args, **kwargs):
    if 'stop requested' in tag:
        time.sleep(3 * float(os.environ['TRM_STOP_GRACE_S']))  # a large checkpoint on a slow disk
    return real(state, path, tag, *args, **kwargs)


checkpoint.write_checkpoint = write_checkpoint
''')
    proc = popen_train(toy, out, '--epochs=200', '--log_interval=1', env=env)
    lines = Lines(proc)
    lines.until('step 30/')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    assert proc.returncode == 0 and 'stopped cleanly' in text and 'not reached' not in text, text[-3000:]
    assert len(ckpts(out)) == 1 and not os.path.exists(out / 'run.lock')


def test_a_stop_during_a_save_that_outlasts_the_grace_waits_for_it_and_saves_and_exits_as_always(toy, tmp_path):
    # a checkpoint_interval save under way when the request comes (a large checkpoint on a slow disk) is work
    # the run finishes: it is not thrown away by the bound, and the stop's own checkpoint follows
    out = tmp_path / 'o'
    env = hook(tmp_path, '''from runkeep import checkpoint
from runkeep.signals import STOP
real = checkpoint.write_checkpoint


def write_checkpoint(state, path, tag='', *args, **kwargs):
    if 'stop requested' not in tag:
        print('test hook: a slow save begins', flush=True)
        while not STOP['requested']:
            time.sleep(0.05)
        time.sleep(2 * float(os.environ['TRM_STOP_GRACE_S']))
    return real(state, path, tag, *args, **kwargs)


checkpoint.write_checkpoint = write_checkpoint
''')
    proc = popen_train(toy, out, '--epochs=200', '--log_interval=1', '--checkpoint_interval=10', env=env)
    lines = Lines(proc)
    lines.until('test hook: a slow save begins')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    assert proc.returncode == 0 and 'stopped cleanly' in text and 'not reached' not in text, text[-3000:]
    assert ckpts(out) == ['ckpt_00000010.pt', 'ckpt_00000011.pt'] and not os.path.exists(out / 'run.lock')


def slow_evaluation_steps(tmp_path, seconds):
    """Every evaluation supervision step of this process takes `seconds` more (a laptop's CPU, a batch of many
    views): progress, slowly."""
    return hook(tmp_path, f'''import model
real = model.TRM.predict_step


def predict_step(self, *args, **kwargs):
    time.sleep({seconds})
    return real(self, *args, **kwargs)


model.TRM.predict_step = predict_step
''')


def test_a_stop_in_a_slow_evaluation_that_progresses_saves_its_step_and_the_resume_evaluates_it(toy, tmp_path):
    # the final evaluation's batches (4 supervision steps, eval_steps == halt_max_steps) outlast the bound, yet
    # a step finishes every GRACE / 2: the run is no hang, and its stop saves the step's checkpoint, owing it
    out = tmp_path / 'o'
    args = ['--max_steps=40', '--checkpoint_interval=10', '--eval_every_epochs=1000']
    proc = popen_train(toy, out, *args, env=slow_evaluation_steps(tmp_path, GRACE / 2))
    lines = Lines(proc)
    lines.until('step 40/40')
    time.sleep(2)  # inside the evaluation's first batch
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    assert proc.returncode == 0 and 'stopped cleanly' in text and 'not reached' not in text, text[-3000:]
    assert ckpts(out)[-1] == 'ckpt_00000040.pt' and 'eval on' not in text, text[-3000:]
    assert torch.load(out / 'ckpt_00000040.pt', weights_only=True)['eval_owed']
    assert not os.path.exists(out / 'run.lock') and not os.path.exists(out / 'results.json')
    p = train(toy, out, *args, '--init_from=resume')  # the evaluation owed, done first
    assert 'eval on 200' in p.stdout, p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == 40


def test_two_torchrun_ranks_in_a_slow_evaluation_that_progresses_come_to_their_stop_check_and_save(toy, tmp_path):
    # across ranks a stop check inside a batch is their agreement, after every halt_max_steps (4) supervision
    # steps: here after 4 of a batch's 8, which outlast the bound. One rank alone is signalled; its steps finish
    out = tmp_path / 'o'
    proc = torchrun(toy, out, ['--max_steps=40', '--checkpoint_interval=10', '--eval_every_epochs=1000',
                               '--eval_steps=8'], slow_evaluation_steps(tmp_path, GRACE / 2))
    lines = Lines(proc)
    lines.until('step 40/40')
    time.sleep(2)
    ranks = subprocess.run(['pgrep', '-P', str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[1]), signal.SIGTERM)  # one rank: as when one host is told first
    text = lines.rest(120)
    assert proc.returncode == 0 and 'stopped cleanly' in text and 'not reached' not in text, text[-3000:]
    assert ckpts(out)[-1] == 'ckpt_00000040.pt' and 'eval on' not in text, text[-3000:]
    assert torch.load(out / 'ckpt_00000040.pt', weights_only=True)['eval_owed']


def test_a_run_that_stops_finishing_work_after_the_request_is_ended_the_grace_after_the_last(tmp_path):
    # the bound on its own: a run that finished work for 3 x GRACE after the request, then nothing
    script = f'''import sys, time
sys.path.insert(0, {str(ROOT)!r})
from runkeep.signals import STOP, StopBound
last = [time.time()]
StopBound(lambda: ('step 13', 'step 12'), dict, lambda: last[0])
STOP.update(requested=True, signal='SIGTERM', at=time.time())
for _ in range(6):
    time.sleep({GRACE / 2})
    last[0] = time.time()
print('progressed', round(time.time() - STOP['at']), flush=True)
time.sleep({4 * GRACE})
'''
    t = time.time()
    p = subprocess.run([sys.executable, '-c', script], env=dict(os.environ, TRM_STOP_GRACE_S=str(GRACE)),
                       capture_output=True, text=True, timeout=60)
    took = time.time() - t
    assert p.returncode == 75 and 'progressed' in p.stdout, (p.returncode, p.stdout, p.stderr)
    assert 'nothing finished for 3 s' in p.stdout and 'step 13 never came to its stop check' in p.stdout, p.stdout
    assert 4 * GRACE - 1 < took < 6 * GRACE, took  # 3 x GRACE of progress, then GRACE: not at the request's GRACE


def test_every_torchrun_rank_ends_when_one_rank_s_step_does_not(toy, tmp_path):
    # rank 1's step 12 never ends, so rank 0 waits in that step's all-reduce: a VM's shutdown signals every
    # process (torchrun and both ranks); each rank ends itself, before torchrun's own 30 s would kill it
    out = tmp_path / 'o'
    proc = torchrun(toy, out, ['--max_steps=200', '--checkpoint_interval=10', '--log_interval=1'],
                    step_never_ends(tmp_path, rank='1'))
    lines = Lines(proc)
    lines.until('test hook: step 12 never ends')  # rank 0 then waits for rank 1 in step 12, or soon will
    t = time.time()
    for pid in [proc.pid] + below(proc.pid):
        os.kill(pid, signal.SIGTERM)
    text = lines.rest(120)
    assert time.time() - t < GRACE + 20, (time.time() - t, text[-3000:])
    assert proc.returncode != 0
    # both ranks, each in a line of its own: rank 1 at its bound, rank 0 then or at once when its collective
    # breaks (rank 1 is gone); no traceback of ours. torchrun's agent prints its own for the signal it got (its
    # SignalException, by design: it tells torchrun's caller why the agent ended); its frames are torch's, which
    # lie under the root too where the venv is inside the checkout
    assert text.count('was not reached') == 2, text[-3000:]
    assert not our_frames(text), text[-3000:]
    assert_ended_by_the_bound(text, out / 'ckpt_00000010.pt')
    assert not os.path.exists(out / 'run.lock')


@pytest.mark.skipif(not os.path.exists('/proc'), reason='reads /proc')
def test_under_torch_xla_s_launcher_the_worker_ends_and_so_does_the_launcher(toy, tmp_path):
    pytest.importorskip('torch_xla')
    out = tmp_path / 'o'
    xla = [a for a in FAST if a != '--device=cpu'] + ['--device=xla', '--compile=False']
    proc = popen_train(toy, out, '--max_steps=200', '--checkpoint_interval=10', '--log_interval=1', args=xla,
                       env=dict(XLA_ENV, **step_never_ends(tmp_path)))
    lines = Lines(proc)
    lines.until('test hook: step 12 never ends', timeout=600)
    workers = [k for k in below(proc.pid) if 'spawn_main' in command(k)]
    assert workers
    proc.send_signal(signal.SIGTERM)  # the launcher's pid, as `kill PID` or a scheduler would
    text = lines.rest(120)
    assert proc.returncode == 75, (proc.returncode, text[-3000:])
    assert_ended_by_the_bound(text, out / 'ckpt_00000010.pt')
    deadline = time.time() + 30
    while [w for w in workers if alive(w)] and time.time() < deadline:
        time.sleep(0.2)
    assert not [w for w in workers if alive(w)], 'a worker outlived its launcher'
    assert 'Traceback' not in text and not os.path.exists(out / 'run.lock')


def torchrun(toy, out, args, env):
    """train.py in two torchrun ranks on the CPU, in its own session."""
    env = script_env(env)
    return subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             'train.py', f'--data_path={toy}', f'--out_dir={out}', '--global_batch_size=48']
                            + [a for a in FAST if not a.startswith('--global_batch_size')] + args,
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            start_new_session=True)
