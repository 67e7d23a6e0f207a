"""
A pod's first hour with nothing silent: device='auto' on a machine with TPU chips and no PJRT_DEVICE stops
before any step; a hung rank is ended by the watchdog (stacks logged, non-zero exit, the rerun resumes) while
a slow but progressing run is not; --smoke=True ends with its verdict and leaves out_dir usable.
    python -m pytest -q tests/test_first_hour.py
"""
import json
import os

import gcs
from conftest import BUCKET, ROOT, TOY_ARGS, XLA_ENV, assert_user_error, make_reverse_dataset, run


def hang_at(tmp_path, what):
    """The environment of a run that blocks for good at the watchdog's report `what` ('step 25', 'an evaluation
    batch') once the watchdog is armed, as a rank stuck in a collective would: a sitecustomize.py on PYTHONPATH,
    which Python runs first in every process the run starts (torch_xla's workers too), wraps Watchdog.progress."""
    hook = tmp_path / 'hang'
    hook.mkdir()
    (hook / 'sitecustomize.py').write_text(f'''import sys, threading
sys.path.insert(0, {ROOT!r})
import guard
progress = guard.Watchdog.progress

def hang(self, what, step=None):
    progress(self, what, step)
    if what == {what!r} and not self.waiting:
        threading.Event().wait()

guard.Watchdog.progress = hang
''')
    return dict(PYTHONPATH=str(hook))


def fake_pci(root, devices):
    """A sysfs PCI folder as the kernel lays it out: one folder per slot with its vendor and device ids."""
    for i, (vendor, device) in enumerate(devices):
        slot = os.path.join(root, f'0000:00:{i + 4:02x}.0')
        os.makedirs(slot)
        for name, value in (('vendor', vendor), ('device', device)):
            with open(os.path.join(slot, name), 'w') as f:
                f.write(value + '\n')
    return str(root)


def test_auto_on_a_tpu_vm_without_pjrt_device_stops_before_any_step(toy, tmp_path):
    tpu_vm = fake_pci(tmp_path / 'tpu', [('0x8086', '0x1237'), ('0x1ae0', '0x005e'), ('0x1ae0', '0x005e')])
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', *TOY_ARGS, '--max_steps=3']
    p = run(args + ['--device=auto'], env=dict(TRM_PCI_DEVICES=tpu_vm), check=False)
    assert_user_error(p, "device='auto' on a machine with 2 TPU chip(s) and no PJRT_DEVICE", 'PJRT_DEVICE=TPU',
                      '--device=cpu')
    assert 'step ' not in p.stdout and not os.path.exists(f'{tmp_path}/o')  # before any step or file
    # the host CPU stays possible when asked for
    p = run(args + ['--device=cpu'], env=dict(TRM_PCI_DEVICES=tpu_vm))
    assert 'device cpu x1' in p.stdout
    # a machine whose PCI bus holds no TPU (a Google device that is no TPU chip included): the CPU, as before
    no_tpu = fake_pci(tmp_path / 'cpu', [('0x8086', '0x1237'), ('0x1ae0', '0x0042')])
    p = run(args + ['--device=auto', f'--out_dir={tmp_path}/o2'], env=dict(TRM_PCI_DEVICES=no_tpu))
    assert 'device cpu x1' in p.stdout


def records(folder):
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        return [json.loads(l) for l in f]


def test_a_hung_rank_is_ended_with_its_stacks_and_the_same_command_resumes(toy, tmp_path):
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--max_steps=40',
            '--checkpoint_interval=10', '--log_interval=10', '--init_from=resume', '--watchdog_minutes=0.05']
    p = run(args, env=hang_at(tmp_path, 'step 25'), timeout=300, check=False)  # blocks for good at step 25
    assert p.returncode == 75, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert 'watchdog: nothing finished for 0.' in p.stderr and '(watchdog_minutes=0.05; the last: step 25)' in p.stderr
    assert 'Current thread' in p.stderr and 'in main' in p.stderr  # every thread's stack: the loop's, where it hangs
    log = open(f'{out}/train.log').read()
    assert 'watchdog: nothing finished' in log and 'Current thread' in log and 'in main' in log
    hung = [r for r in records(out) if r['kind'] == 'watchdog']
    assert len(hung) == 1 and hung[0]['step'] == 25 and hung[0]['last'] == 'step 25', hung
    assert not os.path.exists(f'{out}/run.lock')
    # the same command, run again, resumes from the last checkpoint and finishes
    p = run(args, timeout=300)
    assert f'resuming from {out}/ckpt_00000020.pt (step 20)' in p.stdout
    assert json.load(open(f'{out}/results.json'))['step'] == 40


def test_a_hung_rank_under_torch_xla_launch_ends_the_command_with_the_same_code(toy, tmp_path):
    out = f'{tmp_path}/o'
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--device=auto', '--compile=False', '--max_steps=8',
             '--log_interval=2', '--watchdog_minutes=0.05'], env=dict(XLA_ENV, **hang_at(tmp_path, 'step 4')),
            timeout=600, check=False)  # the launcher's process, whose worker the watchdog ends
    assert p.returncode == 75, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert 'the last: step 4)' in p.stderr and 'a training process ended abruptly; exiting with code 75' in p.stderr
    assert 'Traceback' not in p.stderr and 'Current thread' in open(f'{out}/train.log').read()


def test_a_long_evaluation_is_not_ended_while_it_progresses_and_is_when_it_hangs(tmp_path):
    data = make_reverse_dataset(str(tmp_path / 'data'), n_test=1000)
    args = ['train.py', f'--data_path={data}', *TOY_ARGS, '--max_steps=6', '--log_interval=2', '--eval_batch_size=2',
            '--watchdog_minutes=0.01']  # 500 evaluation batches against 0.6 s
    out = f'{tmp_path}/o'
    p = run(args + [f'--out_dir={out}'], timeout=600)
    evals = [r for r in records(out) if r['kind'] == 'eval']
    assert 'watchdog: nothing finished' not in p.stderr and len(evals) == 1 and evals[0]['step'] == 6
    spent = json.load(open(f'{out}/results.json'))['wall_s']['eval']
    assert spent > 0.6, spent  # the premise: the evaluation outlasted the watchdog's limit, progressing
    # the same evaluation stuck at a batch: ended
    p = run(args + [f'--out_dir={tmp_path}/hung'], env=hang_at(tmp_path, 'an evaluation batch'), timeout=300,
            check=False)
    assert p.returncode == 75 and '(watchdog_minutes=0.01; the last: an evaluation batch)' in p.stderr, p.stderr[-2000:]
    assert 'in evaluate' in p.stderr and 'watchdog: nothing finished' in open(f'{tmp_path}/hung/train.log').read()


def check_smoke(p, out, xla):
    """The verdict of a smoke run that passed, its two runs in out/smoke, and out itself left for a real run."""
    verdict = p.stdout.split('=== smoke check', 1)[1]
    assert ': OK ===' in verdict.splitlines()[0], p.stdout[-3000:]
    for row in ('device ', 'TPU chips on the PCI bus   0', 'step time', 'evaluation                 200 seeded',
                'saved at step 10, resumed in a new process', 'bucket                     none (out_dir is local)',
                'W&B', 'TensorBoard'):
        assert row in verdict, (row, verdict)
    assert ('xla x1' in verdict and '(host ' in verdict and 'XLA graph compilations' in verdict) if xla \
        else 'cpu x1' in verdict
    assert len(verdict.splitlines()) < 20  # one screen
    smoke = os.path.join(out, 'smoke')
    evals = [(r['step'], r['count']) for r in records(smoke) if r['kind'] == 'eval']
    assert evals == [(10, 200), (20, 200)] and not os.path.exists(f'{smoke}/results.json')
    assert sorted(os.listdir(out)) == ['smoke'] and not os.path.exists(f'{smoke}/run.lock')


def test_smoke_on_the_cpu_ends_with_its_verdict_and_leaves_out_dir_usable(toy, tmp_path):
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS]
    check_smoke(run(args + ['--smoke=True'], timeout=600), out, xla=False)
    p = run(args + ['--max_steps=5', '--init_from=resume'])  # a real run then starts in out_dir
    assert 'no checkpoint in' in p.stdout and json.load(open(f'{out}/results.json'))['step'] == 5


def test_smoke_into_a_bucket_writes_and_reads_it_and_a_second_check_replaces_the_first(emu, toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/first', f'--local_dir={tmp_path}/local',
            *TOY_ARGS, '--smoke=True', '--eval_subset=100']
    for _ in range(2):
        p = run(args, timeout=600)
        assert ': OK ===' in p.stdout and 'evaluation                 100 seeded' in p.stdout, p.stdout[-3000:]
        assert 'bucket                     written and read; checkpoints there: [10, 20]' in p.stdout
    assert f'gs://{BUCKET}/first/smoke/metrics.jsonl' in [u for u, _ in gcs.list_objects(f'gs://{BUCKET}/first/')]


def test_smoke_on_cpu_xla_ends_with_its_verdict_and_compiles_are_no_hang(toy, tmp_path):
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--device=auto']
    # a watchdog of 6 s, far below the compile of the first steps and evaluations: they are not counted
    p = run(args + ['--smoke=True', '--watchdog_minutes=0.1'], env=XLA_ENV, timeout=900)
    check_smoke(p, out, xla=True)
    for n in (1, 2):
        assert 'watchdog: nothing finished' not in open(f'{out}/smoke/phase{n}.out').read()
