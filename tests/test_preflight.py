"""
--preflight=True's verdict reads only what this pre-flight's runs wrote, and a run that did not finish its part is a
failure: its second run stopped by SIGTERM before it evaluates makes the check FAIL (exit != 0), after an
earlier pre-flight into the same out_dir passed. Real processes on the toy task.
    python -m pytest -q tests/test_preflight.py
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from runkeep import gcs
from conftest import BUCKET, ROOT, TOY_ARGS, XLA_ENV, children, command, held_step, run, script_env

SMOKE = TOY_ARGS + ['--preflight=True', '--eval_subset=20', '--log_interval=1']


def phase_pid(parent, phase):
    """The pid of the pre-flight run `phase` that `parent` started, or None."""
    return next((kid for kid in children(parent) if f'--preflight_phase={phase}' in command(kid)), None)


def test_a_preflight_whose_second_run_was_stopped_before_evaluating_fails(toy, tmp_path):
    out = tmp_path / 'o'
    cmd = ['train.py', f'--data_path={toy}', f'--out_dir={out}'] + SMOKE
    first = run(cmd, timeout=600)
    assert '=== pre-flight check' in first.stdout and 'OK ===' in first.stdout, first.stdout[-3000:]
    go = tmp_path / 'go'
    # the second run's first step waits for the file `go`
    e = script_env(held_step(tmp_path / 'hook', 1, go, argv=['--preflight_phase=2']))
    proc = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = out / 'preflight' / 'phase2.out'
    while proc.poll() is None and 'test hook: step 1 waits' not in (log.read_text() if log.exists() else ''):
        time.sleep(0.02)
    pid = phase_pid(proc.pid, 2)
    assert pid, 'the second pre-flight run did not start'
    # the stop request lands in its first step, before its 10 steps and evaluation, whatever the machine's speed
    os.kill(pid, signal.SIGTERM)  # a stop before its evaluation: it saves and exits 0
    go.touch()
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and 'FAILED' in text.split('=== pre-flight check')[-1], text[-3000:]


def test_a_preflight_on_a_dataset_without_its_test_split_fails_pointing_at_the_reason_above(toy, tmp_path):
    data = tmp_path / 'data'
    os.makedirs(data / 'train')
    for f in os.listdir(os.path.join(toy, 'train')):
        os.symlink(os.path.join(toy, 'train', f), data / 'train' / f)
    p = run(['train.py', f'--data_path={data}', f'--out_dir={tmp_path / "o"}'] + SMOKE, check=False)
    reason, verdict = p.stdout.split('=== pre-flight check')
    assert p.returncode == 1 and 'FAILED: run 1 (see above)' in verdict.splitlines()[0], p.stdout[-3000:]
    assert f'no dataset at {data}/test/dataset.json' in reason, p.stdout[-3000:]


def records(folder):
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        return [json.loads(l) for l in f]


def check_preflight(p, out, xla):
    """The verdict of a pre-flight that passed, its two runs in out/preflight, and out itself left for a real
    run."""
    verdict = p.stdout.split('=== pre-flight check', 1)[1]
    assert ': OK ===' in verdict.splitlines()[0], p.stdout[-3000:]
    for row in ('device ', 'TPU chips on the PCI bus   0', 'step time', 'evaluation                 200 seeded',
                'saved at step 10, resumed in a new process', 'bucket                     none (out_dir is local)',
                'W&B', 'TensorBoard'):
        assert row in verdict, (row, verdict)
    assert ('xla x1' in verdict and '(host ' in verdict and 'XLA graph compilations' in verdict) if xla \
        else 'cpu x1' in verdict
    assert len(verdict.splitlines()) < 20  # one screen
    folder = os.path.join(out, 'preflight')
    evals = [(r['step'], r['count']) for r in records(folder) if r['kind'] == 'eval']
    assert evals == [(10, 200), (20, 200)] and not os.path.exists(f'{folder}/results.json')
    assert sorted(os.listdir(out)) == ['preflight'] and not os.path.exists(f'{folder}/run.lock')


def test_preflight_on_the_cpu_ends_with_its_verdict_and_leaves_out_dir_usable(toy, tmp_path):
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS]
    check_preflight(run(args + ['--preflight=True'], timeout=600), out, xla=False)
    p = run(args + ['--max_steps=5', '--init_from=resume'])  # a real run then starts in out_dir
    assert 'no checkpoint in' in p.stdout and json.load(open(f'{out}/results.json'))['step'] == 5


def test_preflight_into_a_bucket_writes_and_reads_it_and_a_second_check_replaces_the_first(emu, toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/first', f'--local_dir={tmp_path}/local',
            *TOY_ARGS, '--preflight=True', '--eval_subset=100']
    for _ in range(2):
        p = run(args, timeout=600)
        assert ': OK ===' in p.stdout and 'evaluation                 100 seeded' in p.stdout, p.stdout[-3000:]
        assert 'bucket                     written and read; checkpoints there: [10, 20]' in p.stdout
    assert f'gs://{BUCKET}/first/preflight/metrics.jsonl' in [u for u, _ in gcs.list_objects(f'gs://{BUCKET}/first/')]


def test_preflight_on_cpu_xla_ends_with_its_verdict_and_compiles_are_no_hang(toy, tmp_path):
    pytest.importorskip('torch_xla')  # Linux wheels only
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--device=auto']
    # a watchdog of 6 s, far below the compile of the first steps and evaluations: they are not counted
    p = run(args + ['--preflight=True', '--watchdog_minutes=0.1'], env=XLA_ENV, timeout=900)
    check_preflight(p, out, xla=True)
    for n in (1, 2):
        assert 'watchdog: nothing finished' not in open(f'{out}/preflight/phase{n}.out').read()


def test_the_w_b_verdict_finds_the_key_where_a_run_finds_it(tmp_path, server, monkeypatch):
    # a run finds its W&B key in the .netrc that NETRC names, as W&B does; the pre-flight looked in ~/.netrc alone
    # and said of a machine whose runs log online that they would log offline
    from runkeep.preflight import wandb_check
    (tmp_path / 'netrc').write_text(f"machine {server.split('//')[1]}\n  login user\n  password {'k' * 40}\n")
    for name in ('WANDB_API_KEY', 'WANDB_MODE'):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('NETRC', str(tmp_path / 'netrc'))
    monkeypatch.setenv('WANDB_BASE_URL', server)
    assert wandb_check() == f"logged in, {server} reachable"
