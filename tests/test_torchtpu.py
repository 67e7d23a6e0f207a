"""
TorchTPU beside torch_xla: --device=tpu is chosen only by name and refused in one line where TorchTPU or a chip
is missing; its code (launch, ranks, collectives, the compiled step, a checkpoint and its resume) runs here as
two CPU processes with gloo (TorchTPU.on_cpu, through tests/tpu_kind_driver.py) and gives the cpu kind's
losses; every TorchTPU call stays in backends/torchtpu.py.
    python -m pytest -q tests/test_torchtpu.py
"""
import ast
import importlib.util
import json
import os
import re

import numpy as np
import pytest

from conftest import ROOT, assert_user_error, run, site_hook
from device import choose_dtype, peak_tflops_of, resolve_device, resolve_loss_dtype

DRIVER = os.path.join(ROOT, 'tests', 'tpu_kind_driver.py')
no_torchtpu = pytest.mark.skipif(importlib.util.find_spec('torch_tpu') is not None,
                                 reason='TorchTPU is installed here')


def assert_refused_before_any_work(p, out_dir, *words):
    assert_user_error(p, 'requirements-torchtpu.txt', "device='tpu'", *words, one_line=True)
    assert not os.path.exists(out_dir)


@no_torchtpu
def test_device_tpu_without_torchtpu_stops_in_one_line_before_any_work(tmp_path):
    for extra in ([], ['--preflight=True']):
        p = run(['train.py', 'config/quickstart.py', '--device=tpu', f'--out_dir={tmp_path}/o'] + extra,
                check=False)
        assert_refused_before_any_work(p, f'{tmp_path}/o', 'needs TorchTPU', "No module named 'torch_tpu'")


@no_torchtpu
def test_device_tpu_with_a_torchtpu_that_finds_no_chip_stops_in_one_line(tmp_path):
    # TorchTPU on a machine without TPU chips: importable, and no 'tpu' device registered
    package = tmp_path / 'site' / 'torch_tpu'
    package.mkdir(parents=True)
    (package / '__init__.py').write_text('"""A TorchTPU installed on a machine without TPU chips."""\n')
    p = run(['train.py', 'config/quickstart.py', '--device=tpu', f'--out_dir={tmp_path}/o'],
            env=dict(PYTHONPATH=str(tmp_path / 'site')), check=False)
    assert_refused_before_any_work(p, f'{tmp_path}/o', 'TorchTPU is installed but found no TPU chip')


@no_torchtpu
def test_device_tpu_with_a_torchtpu_whose_import_fails_stops_in_one_line(tmp_path):
    # TorchTPU installed beside a libtpu of another version: its import raises RuntimeError, not ImportError
    package = tmp_path / 'site' / 'torch_tpu'
    package.mkdir(parents=True)
    (package / '__init__.py').write_text('raise RuntimeError("libtpu version 0.0.9 does not match the 0.0.21 '
                                         'this TorchTPU was built with")\n')
    p = run(['train.py', 'config/quickstart.py', '--device=tpu', f'--out_dir={tmp_path}/o'],
            env=dict(PYTHONPATH=str(tmp_path / 'site')), check=False)
    assert_refused_before_any_work(p, f'{tmp_path}/o', 'cannot be imported here', 'libtpu version 0.0.9 does not '
                                   'match', 'RuntimeError')


@no_torchtpu
def test_a_torchtpu_that_torch_s_autoload_cannot_load_stops_every_device_in_one_line(tmp_path):
    # TorchTPU as pip installs it declares an entry point that `import torch` itself loads: where that load fails (a
    # libtpu of another version), torch's own import raises, whatever the device
    site = tmp_path / 'site'
    (site / 'torch_tpu').mkdir(parents=True)
    (site / 'torch_tpu' / '__init__.py').write_text('raise RuntimeError("libtpu version 0.0.9 does not match the '
                                                    '0.0.21 this TorchTPU was built with")\n')
    (site / 'torch_tpu-0.2.0.dist-info').mkdir()
    (site / 'torch_tpu-0.2.0.dist-info' / 'METADATA').write_text('Metadata-Version: 2.1\nName: torch-tpu\n'
                                                                 'Version: 0.2.0\n')
    (site / 'torch_tpu-0.2.0.dist-info' / 'entry_points.txt').write_text('[torch.backends]\n'
                                                                         'torch_tpu = torch_tpu:_autoload\n')
    for device in ('tpu', 'cpu'):
        p = run(['train.py', 'config/quickstart.py', f'--device={device}', f'--out_dir={tmp_path}/o'],
                env=dict(PYTHONPATH=str(site)), check=False)
        assert_refused_before_any_work(p, f'{tmp_path}/o', 'torch_tpu', 'libtpu version 0.0.9 does not match',
                                       'TORCH_DEVICE_BACKEND_AUTOLOAD=0')


def test_auto_still_chooses_torch_xla_with_pjrt_device_and_else_the_cpu_here(monkeypatch, tmp_path):
    monkeypatch.setenv('TRM_PCI_DEVICES', str(tmp_path))  # a PCI bus without TPU chips
    monkeypatch.delenv('PJRT_DEVICE', raising=False)
    assert resolve_device('auto') == 'cpu'
    monkeypatch.setenv('PJRT_DEVICE', 'CPU')
    assert resolve_device('auto') == 'xla'
    p = run(['train.py', '--device=tpux'], check=False)
    assert_user_error(p, "device='tpux' (allowed: 'auto' | 'cpu' | 'cuda' | 'xla' | 'tpu')")


def test_a_tpu_chip_s_number_format_and_peak():
    assert choose_dtype('auto', 'tpu')[0] == 'bfloat16' and resolve_loss_dtype('auto', 'tpu') == 'float32'
    # the names TorchTPU gives its chips; a v7 chip is two devices, one process each
    want = {'TPU v4': 275, 'TPU v5e': 197, 'TPU v5p': 459, 'TPU v6e': 918, 'TPU v7': 1153.5, 'TPU': None}
    assert {n: peak_tflops_of(f'TorchTPU {n}') for n in want} == want


def test_the_preflight_s_torchtpu_verdicts():
    from runkeep.preflight import PREFLIGHT_STEPS, torchtpu_rows
    half = PREFLIGHT_STEPS // 2
    train = [dict(step=half, xla_compiles_total=3), dict(step=PREFLIGHT_STEPS, xla_compiles_total=3),
             dict(step=PREFLIGHT_STEPS + half, xla_compiles_total=3), dict(step=2 * PREFLIGHT_STEPS, xla_compiles_total=5)]
    rows = dict(torchtpu_rows('device tpu x8 (TorchTPU TPU v6e v6e-8) | forward dtype ...', train))
    assert rows['TorchTPU graphs compiled'] == \
        f'3 then 5 (still growing: 3 at step {PREFLIGHT_STEPS + half}) (the first run, the resumed run)'
    assert rows['collectives across chips'].startswith('8 processes:') and 'completed' in \
        rows['collectives across chips']
    assert dict(torchtpu_rows('device tpu x1 (TorchTPU TPU v5e)', train))['collectives across chips'] == \
        'one device: none to check'
    assert dict(torchtpu_rows('', []))['collectives across chips'] == 'NOT checked (no run started)'


def driver(args, toy, out, torchrun=False):
    launcher = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2'] if torchrun else []
    p = run(launcher + [DRIVER, f'--data={toy}', f'--out={out}'] + args, timeout=900)
    lines = json_objects(p.stdout)
    return [l for l in lines if 'rank' in l], [l for l in lines if 'step' in l]


def test_the_tpu_kind_on_two_cpu_processes_trains_saves_and_resumes_as_the_cpu_kind(toy, tmp_path):
    # the cpu kind as torchrun runs it on a host; eight steps in one run
    _, cpu = driver(['--kind=cpu', '--steps=8'], toy, tmp_path / 'cpu', torchrun=True)
    # the 'tpu' kind launches itself (one process per device: two), four steps, a checkpoint; then a new run
    # resumes from it for four more
    ranks, first = driver(['--steps=4'], toy, tmp_path / 'tpu')
    assert sorted((r['rank'], r['world']) for r in ranks) == [(0, 2), (1, 2)], ranks
    assert all(r['agreed'] == 1.0 and r['name'].startswith("TorchTPU's code on the CPU (gloo)") for r in ranks)
    assert sorted(os.listdir(tmp_path / 'tpu')) == ['rank0.pt', 'rank1.pt']
    _, second = driver(['--steps=4', '--resume=True'], toy, tmp_path / 'tpu')
    tpu = first + second
    assert [r['step'] for r in tpu] == [r['step'] for r in cpu] == list(range(1, 9))
    # the same losses: the first step exactly, then as close as AOTAutograd's reordered float32 sums allow
    assert tpu[0]['loss'] == cpu[0]['loss']
    np.testing.assert_allclose([r['loss'] for r in tpu], [r['loss'] for r in cpu], rtol=2e-4)
    assert cpu[-1]['loss'] < cpu[0]['loss'] - 0.2  # it learns: a comparison of two stuck runs proves little
    # torch.compile's graphs are compiled at the first step of each run, never again
    for run_ in (first, second):
        assert run_[0]['compiles'] > 0 and {r['compiles'] for r in run_} == {run_[0]['compiles']}, run_


def test_bench_compiles_the_tpu_kind_s_step_and_evaluation_with_its_compiler_as_train_does(tmp_path):
    # bench.py --device=tpu on TorchTPU.on_cpu(1) (the default TorchTPU here): the step and the evaluation are
    # compiled by the TorchTPU's torch.compile backend, as train.py's are, not timed eagerly
    env = site_hook(tmp_path / 'site', """
if sys.argv[0].endswith('bench.py'):
    import torch
    from backends import torchtpu
    torchtpu.require = lambda: None  # no TorchTPU here: its code on the CPU stands in
    on_cpu, real_init = torchtpu.TorchTPU.on_cpu, torchtpu.TorchTPU.__init__

    def init(self, *args, **kwargs):
        if args or kwargs:
            real_init(self, *args, **kwargs)
        else:
            self.__dict__.update(vars(on_cpu(1)))
    torchtpu.TorchTPU.__init__ = init
    real_compile = torch.compile

    def compile(*args, **kwargs):
        print(f"test hook: torch.compile backend={kwargs.get('backend')}", flush=True)
        return real_compile(*args, **kwargs)
    torch.compile = compile
""")
    p = run(['bench.py', '--device=tpu', '--global_batch_size=8', '--hidden_size=32', '--num_heads=2',
             '--puzzle_emb_ndim=0', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=2', '--steps=1',
             '--warmup_steps=1', '--eval_batches=1', '--forward_dtype=float32', '--loss_dtype=float32'], env=env)
    assert "TorchTPU's code on the CPU (gloo)" in p.stdout, p.stdout
    backends = [l.split('=', 1)[1] for l in p.stdout.splitlines() if l.startswith('test hook: torch.compile')]
    assert backends == ['aot_eager'] * 3, p.stdout  # the step's two parts and the evaluation's step
    line = [l for l in p.stdout.splitlines() if l.startswith('bench: device=')][-1]
    s = dict(kv.split('=', 1) for kv in line.split()[1:])
    assert s['device'] == 'tpu' and s['compiled'] == '1' and s['variant'] == 'aot_eager', line


def test_a_multi_host_launch_without_this_host_s_rank_or_the_first_host_s_address_stops_in_one_line(tmp_path):
    # NNODES > 1 where neither TorchTPU nor the command set where the hosts meet: one line naming what is missing
    p = run([DRIVER, f'--data={tmp_path}', f'--out={tmp_path}/o'], check=False,
            env=dict(NNODES='2', NODE_RANK=None, MASTER_ADDR='10.0.0.2', MASTER_PORT=None))
    assert_user_error(p, 'NNODES=2', 'NODE_RANK', 'MASTER_PORT', 'docs/tpu.md', one_line=True)
    assert 'MASTER_ADDR' not in p.stderr and not os.path.exists(tmp_path / 'o')
    p = run([DRIVER, f'--data={tmp_path}', f'--out={tmp_path}/o'], check=False, env=dict(NNODES='two'))
    assert_user_error(p, "NNODES='two'", one_line=True)


def torchtpu_uses(path):
    """What of TorchTPU a file's code uses: imports of torch_tpu or torchtpu, torch.tpu's attributes, and
    the names of its collectives ('tpu_dist') and of its compiler (backend='tpu')."""
    uses = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            uses |= {a.name for a in node.names} & {'torch_tpu', 'backends.torchtpu'}
        elif isinstance(node, ast.ImportFrom) and node.module:
            named = {f'{node.module}.{a.name}' for a in node.names}
            uses |= ({node.module.split('.')[0], node.module} | named) & {'torch_tpu', 'backends.torchtpu'}
        elif isinstance(node, ast.Attribute) and node.attr == 'tpu' and getattr(node.value, 'id', '') == 'torch':
            uses.add('torch.tpu')
        elif isinstance(node, ast.Constant) and node.value == 'tpu_dist':
            uses.add('tpu_dist')
        elif isinstance(node, ast.keyword) and node.arg == 'backend' and getattr(node.value, 'value', '') == 'tpu':
            uses.add("backend='tpu'")
    return uses


def test_every_torchtpu_call_lives_in_torchtpu_py():
    files = [f for f in os.listdir(ROOT) if f.endswith('.py')]
    for folder in ('tests', 'backends', 'runkeep', 'studies'):
        files += [os.path.join(folder, f) for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith('.py')]
    uses = {f: torchtpu_uses(os.path.join(ROOT, f)) for f in files}
    # the test sees what it forbids
    assert uses.pop(os.path.join('backends', 'torchtpu.py')) >= {'torch_tpu', 'torch.tpu', 'tpu_dist'}
    assert uses.pop('device.py') == {'backends.torchtpu'}  # the room's only door
    uses.pop(os.path.join('tests', 'test_torchtpu.py'))  # this file names them, to look for them
    assert {f: u for f, u in uses.items() if u} == {}


def json_objects(text):
    """Every JSON object the ranks printed: two ranks writing at once can put two objects on one line (an
    unbuffered print writes the object and its newline apart)."""
    decoder, found = json.JSONDecoder(), []
    for line in text.splitlines():
        i = line.find('{')
        while i != -1:
            obj, end = decoder.raw_decode(line, i)
            found.append(obj)
            i = line.find('{', end)
    return found


def test_the_torchtpu_environment_has_every_package_the_trainer_needs_but_torch_2_9():
    # it cannot include requirements.txt (torch 2.9.0 pinned there), so each other package is named again
    def names(file):
        lines = (l.split('#')[0].strip() for l in open(os.path.join(ROOT, file)))
        return {re.split(r'[=<>!~ ;\[]', l)[0].lower().replace('_', '-') for l in lines if l and not l.startswith('-')}
    missing = names('requirements.txt') - names('requirements-torchtpu.txt') - {'torch'}
    assert not missing, f'requirements-torchtpu.txt lacks {sorted(missing)}'
