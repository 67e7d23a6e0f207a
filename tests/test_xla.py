"""
The XLA path on the CPU (PJRT_DEVICE=CPU, torch_xla): training through torch_xla.launch gives the same losses
and weights as eager CPU, stops compiling after warm-up, no CPU fallbacks; evaluation runs one graph per batch.
    python -m pytest -q tests/test_xla.py
"""
import json

import torch

import pytest

pytest.importorskip('torch_xla')  # Linux wheels only: on macOS these tests skip

from conftest import TOY_ARGS, XLA_ENV, make_reverse_dataset, run, step_lines


def test_xla_training_matches_cpu_and_stops_compiling(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=2', '--eval_interval=100', '--log_interval=5', '--max_steps=30',
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
    a = torch.load(f'{tmp_path}/x/ckpt_00000030.pt', weights_only=True)
    b = torch.load(f'{tmp_path}/c/ckpt_00000030.pt', weights_only=True)
    for k in b['model']:
        torch.testing.assert_close(a['model'][k], b['model'][k], rtol=1e-3, atol=2e-4, msg=k)


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
