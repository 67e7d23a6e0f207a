"""
--smoke=True's verdict reads only what this smoke's runs wrote, and a run that did not finish its part is a
failure: its second run stopped by SIGTERM before it evaluates makes the check FAIL (exit != 0), after an
earlier smoke into the same out_dir passed. Real processes on the toy task.
    python -m pytest -q tests/test_preflight.py
"""
import os
import signal
import subprocess
import sys
import time


from conftest import ROOT, TOY_ARGS, run

SMOKE = TOY_ARGS + ['--smoke=True', '--eval_subset=20', '--log_interval=1']


def phase_pid(parent, phase):
    """The pid of the smoke run `phase` that `parent` started, or None."""
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            cmd = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\0')
            stat = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        if f'--smoke_phase={phase}'.encode() in cmd and int(stat[1]) == parent:
            return int(pid)
    return None


def test_a_smoke_whose_second_run_was_stopped_before_evaluating_fails(toy, tmp_path):
    out = tmp_path / 'o'
    cmd = ['train.py', f'--data_path={toy}', f'--out_dir={out}'] + SMOKE
    first = run(cmd, timeout=600)
    assert '=== smoke check' in first.stdout and 'OK ===' in first.stdout, first.stdout[-3000:]
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    proc = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline, pid = time.time() + 300, None
    while pid is None and proc.poll() is None and time.time() < deadline:
        pid = phase_pid(proc.pid, 2)
        time.sleep(0.02)
    assert pid, 'the second smoke run did not start'
    log = out / 'smoke' / 'phase2.out'
    while proc.poll() is None and time.time() < deadline and 'resuming from' not in (
            log.read_text() if log.exists() else ''):
        time.sleep(0.01)
    # held still while the stop request arrives: it lands before the run's 10 steps and evaluation, whatever
    # the machine's speed (its handlers are in place once it says it resumes)
    os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGTERM)  # a stop before its evaluation: it saves and exits 0
    os.kill(pid, signal.SIGCONT)
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and 'FAILED' in text.split('=== smoke check')[-1], text[-3000:]
