"""
The XLA path on the CPU (PJRT_DEVICE=CPU, torch_xla): training through torch_xla.launch gives the same losses
and weights as eager CPU, stops compiling after warm-up, no CPU fallbacks; evaluation runs one graph per batch.
    python -m pytest -q tests/test_xla.py
"""
import json
import os

import pytest
import torch

pytest.importorskip('torch_xla')  # Linux wheels only: on macOS these tests skip

from conftest import TOY_ARGS, XLA_ENV, assert_user_error, make_reverse_dataset, run, site_hook, step_lines


def test_xla_training_matches_cpu_and_stops_compiling(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=2', '--eval_every_epochs=100', '--log_interval=5', '--max_steps=30',
              '--halt_exploration_prob=0.0', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=16'] + TOY_ARGS
    common = [a for a in common if a not in ('--mlp_t=True', '--pos_encodings=none', '--puzzle_emb_ndim=0', '--device=cpu')]
    x = run(['train.py', f'--out_dir={tmp_path}/x', '--device=xla'] + common, env=XLA_ENV)
    c = run(['train.py', f'--out_dir={tmp_path}/c', '--device=cpu'] + common)
    assert 'device xla x1' in x.stdout  # through torch_xla.launch, one process
    xr, cr = step_lines(x.stdout), step_lines(c.stdout)
    assert len(xr) == len(cr) == 6
    for a, b in zip(xr, cr):
        assert abs(a['loss'] - b['loss']) <= 1e-3 * abs(b['loss']), (a, b)
    compiles = [r['compiles'] for r in xr]
    assert compiles[1] == compiles[-1], compiles  # no new graph after warm-up (steps 1 and 2 differ)
    assert 'CPU fallbacks: none' in x.stdout
    # the device's share of a step is the time it was busy: not more than the step's wall time, although the host
    # runs ahead and each graph's ExecuteTime counts the graphs it was queued behind
    lines = [json.loads(l) for l in open(f'{tmp_path}/x/metrics.jsonl')]
    lines = [l for l in lines if l['kind'] == 'train']
    assert len(lines) == 6 and all(0 < l['device_ms'] <= l['ms_per_step'] for l in lines), [
        (l['device_ms'], l['ms_per_step']) for l in lines]
    a = torch.load(f'{tmp_path}/x/ckpt_00000030.pt', weights_only=True)
    b = torch.load(f'{tmp_path}/c/ckpt_00000030.pt', weights_only=True)
    for k in b['model']:
        torch.testing.assert_close(a['model'][k], b['model'][k], rtol=1e-3, atol=2e-4, msg=k)


@pytest.mark.parametrize('extra', [['--compile=False'], ['--gradient_accumulation_steps=2', '--grad_clip=1.0']],
                         ids=['lazy_step', 'accumulation'])
def test_the_steps_after_a_log_line_run_the_graph_of_the_steps_before_it(toy, tmp_path, extra):
    """The lazy step (where compile is off) and gradient accumulation trace the metric sums into the step's graph:
    the step after a log line, which starts new sums, must run the same graph as the others, or each log line
    costs a compilation (the whole step's, for the lazy one) and warns that every step may be compiling."""
    x = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/x', '--device=xla', '--log_interval=11',
             '--max_steps=33', '--eval_every_epochs=100'] + [a for a in TOY_ARGS if a != '--device=cpu'] + extra,
            env=XLA_ENV)
    compiles = [r['compiles'] for r in step_lines(x.stdout)]
    assert len(compiles) == 3 and compiles[0] == compiles[-1], compiles
    assert 'warning' not in x.stdout, x.stdout[-3000:]


def test_a_resumed_xla_run_draws_the_exploration_of_the_uninterrupted_one(toy, tmp_path):
    """torch_xla advances its generator at every graph cut (torch_xla.sync), and an evaluation, a log line's read
    or a save cuts graphs too: a run stopped after an evaluation and resumed would draw other ACT exploration
    rows from there on than the run that went through. Weights whose q_head says halt at once (as a trained
    model's often does) make every halt depend on those draws."""
    args = [f'--data_path={toy}', '--global_batch_size=100', '--epochs=1', '--eval_every_epochs=1',
            '--log_interval=1', '--halt_exploration_prob=0.5'] + [a for a in TOY_ARGS if not a.startswith(
                ('--device', '--global_batch_size'))]
    run(['train.py', f'--out_dir={tmp_path}/w', '--device=cpu', '--max_steps=1'] + args)
    ckpt = torch.load(f'{tmp_path}/w/ckpt_00000001.pt', weights_only=False)
    for part in ('model', 'ema'):
        ckpt[part]['q_head.bias'].fill_(5.0)
    torch.save(ckpt, f'{tmp_path}/halting.pt')
    args += ['--device=xla', f'--init_from={tmp_path}/halting.pt']
    whole = run(['train.py', f'--out_dir={tmp_path}/a'] + args, env=XLA_ENV)
    run(['train.py', f'--out_dir={tmp_path}/b', '--max_steps=4'] + args, env=XLA_ENV)  # evaluates at step 4
    resumed = run(['train.py', f'--out_dir={tmp_path}/b'] + args[:-1] + ['--init_from=resume'], env=XLA_ENV)
    keep = ('step', 'loss', 'accuracy', 'steps', 'grad_norm')
    a, b = ([{k: r[k] for k in keep if k in r} for r in step_lines(p.stdout)] for p in (whole, resumed))
    assert len(a) == 10 and b == a[4:], (a, b)
    assert any(r['steps'] < 4 for r in a if 'steps' in r) and any(r['steps'] > 1 for r in a if 'steps' in r), a
    a, b = (torch.load(f'{tmp_path}/{o}/ckpt_00000010.pt', weights_only=True) for o in 'ab')
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]) and torch.equal(a['ema'][k], b['ema'][k]), k


XLA_EVAL = """
import json, sys
import torch, torch_xla, torch_xla.debug.metrics as met
from data import EvalLoader
from device import Device
from model import TRM, TRMConfig
from evaluate import evaluate
dev = Device('xla')
model = TRM(TRMConfig(vocab_size=6, seq_len=8, hidden_size=32, num_heads=2, H_cycles=2, L_cycles=2, halt_max_steps=4,
                      puzzle_emb_ndim=16, puzzle_emb_len=1, mlp_t=False, forward_dtype='float32')).to(dev.device)
loader = EvalLoader(sys.argv[1], 4)  # 10 examples: 3 batches, the last one padded
count = lambda name: (met.metric_data(name) or [0])[0]
evaluate(model, loader, dev, 6, 4)
c0, e0 = count('CompileTime'), count('ExecuteTime')
res, _ = evaluate(model, loader, dev, 6, 4)
print(json.dumps(dict(batches=len(loader), compiles=count('CompileTime') - c0, executions=count('ExecuteTime') - e0,
                      count=res['count'], fallbacks=dev.xla_report()[1])))
"""


def test_xla_evaluation_runs_one_graph_per_batch(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=8, n_test=10)
    p = run(['-c', XLA_EVAL, root], env=XLA_ENV)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r['batches'] == 3 and r['count'] == 10
    assert r['compiles'] == 0  # the second evaluation reuses every graph
    assert r['executions'] <= r['batches'] + 1  # one graph per batch (+ the final reduction)
    assert r['fallbacks'] == {}  # {aten op: count} that fell back to the CPU


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


def test_pjrt_device_that_cannot_run_here_stops_in_one_line(toy, tmp_path):
    # PJRT_DEVICE=TPU where the PCI bus holds no TPU chip (a launch command run on the wrong machine), and a name
    # torch_xla does not know: one line each, before any step or file, not torch_xla's traceback
    no_tpu = fake_pci(tmp_path / 'cpu', [('0x8086', '0x1237'), ('0x1ae0', '0x0042')])
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', *TOY_ARGS, '--max_steps=3']
    args = [a for a in args if a != '--device=cpu']
    for script in (args, ['bench.py', '--steps=1', '--warmup_steps=1', '--eval_batches=0', *args[3:]]):
        p = run(script, env=dict(PJRT_DEVICE='TPU', TRM_PCI_DEVICES=no_tpu), check=False)
        assert_user_error(p, 'PJRT_DEVICE=TPU', 'no TPU chip', 'PJRT_DEVICE=CPU', one_line=True)
        p = run(script + ['--device=xla'], env=dict(PJRT_DEVICE='tpu'), check=False)
        assert_user_error(p, "PJRT_DEVICE='tpu'", "'TPU'", "'CPU'", one_line=True)
    assert not os.path.exists(f'{tmp_path}/o')


def test_device_xla_without_torch_xla_stops_in_one_line(toy, tmp_path):
    # an environment that cannot import torch_xla (macOS, TorchTPU's): --device=xla, or 'auto' under PJRT_DEVICE,
    # is one line naming requirements.txt, before any step or file, for train.py (its launcher) and bench.py alike
    env = site_hook(tmp_path / 'site', "sys.modules['torch_xla'] = None  # as where it is not installed\n")
    args = [a for a in ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', *TOY_ARGS, '--max_steps=3']
            if a != '--device=cpu']
    for script in (args, ['bench.py', '--steps=1', '--warmup_steps=1', '--eval_batches=0', *args[3:]]):
        for device, pjrt in (('xla', None), ('auto', 'CPU')):
            p = run(script + [f'--device={device}'], env=dict(env, PJRT_DEVICE=pjrt), check=False)
            assert_user_error(p, "device='xla' needs torch_xla", 'requirements.txt', one_line=True)
    assert not os.path.exists(f'{tmp_path}/o')
