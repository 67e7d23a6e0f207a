"""
The XLA training step is traced once (step.XLACompiled, torch.compile with the openxla backend), in one process
with one micro-batch as ONE graph (forward, backward and update): after warm-up no step runs the network's Python
(no lazy tracing of the H_cycles x (L_cycles + 1) net calls), whatever the recursion depth; it computes what the
eager (lazy) step computes, with as many matrix products; nothing recompiles; nothing falls back to the CPU. The
evaluation's compiled predict_step likewise; gradient accumulation and clipping (two graphs: forward + backward,
update) compile once too. No timing: counts only.
    python -m pytest -q tests/test_xla_trace.py
"""
import json

import pytest

pytest.importorskip('torch_xla')

from conftest import XLA_ENV, run

SCRIPT = r"""
import json, re, sys
import numpy as np
import torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.debug.metrics as met
from torch._dynamo.utils import counters
import model as M
import step as S

calls = [0]
real_forward = M.Net.forward
def counted(self, *a, **k):
    if not torch.compiler.is_compiling():  # Python run outside dynamo's one-time trace
        calls[0] += 1
    return real_forward(self, *a, **k)
M.Net.forward = counted

def count(name):
    return (met.metric_data(name) or [0])[0]

def lazy_nodes():  # IR nodes of the lazy graphs synced so far
    d = met.metric_data('TensorsGraphSize')
    return d[1] if d else 0

# the matrix products (HLO dots) of the graphs a step executes: the compiled graphs' HLO read once, when the
# openxla bridge compiles them, their runs counted by hash; the step's lazy remainder read before its sync
X = torch_xla._XLAC
graph_dots, executed = {}, []
def n_dots(tensors):
    return len(re.findall(r' dot\(', X._get_xla_tensors_hlo(tensors)))
real_warm_up, real_run = X._xla_warm_up_cache, X._run_cached_graph
def warm_up(tensors, devices):
    graph_dots[X._get_graph_hash(tensors)] = n_dots(tensors)
    return real_warm_up(tensors, devices)
def run_cached(graph_hash, args):
    executed.append(graph_dots[graph_hash])
    return real_run(graph_hash, args)
X._xla_warm_up_cache, X._run_cached_graph = warm_up, run_cached

dev = torch_xla.device()
report = {}
for H, L in ((1, 1), (2, 3)):
    runs = {}
    for kind in ('eager', 'compiled', 'accumulated'):
        torch.manual_seed(0)
        xm.set_rng_state(0)
        cfg = M.TRMConfig(vocab_size=6, seq_len=8, num_puzzle_identifiers=3, hidden_size=16, num_heads=1,
                          puzzle_emb_ndim=16, puzzle_emb_len=1, H_cycles=H, L_cycles=L, halt_max_steps=4,
                          halt_exploration_prob=0.0, forward_dtype='float32', loss_dtype='float32')
        model = M.TRM(cfg).to(dev)
        model.train()
        opt = S.AdamATan2(model.parameters(), lr=1e-3, weight_decay=0.1)
        ema = [p.detach().clone() for p in model.parameters()]
        sc = S.StepConfig(lr=1e-3, puzzle_emb_lr=1e-4, puzzle_emb_weight_decay=0.1, warmup_steps=3, total_steps=20,
                          min_ratio=0.5, global_batch_size=4, ema_rate=0.9,
                          grad_clip=1.0 if kind == 'accumulated' else 0.0,
                          gradient_accumulation_steps=2 if kind == 'accumulated' else 1)
        rng = np.random.default_rng(0)
        batches = [{k: torch.from_numpy(v).to(dev) for k, v in dict(
            inputs=rng.integers(1, 6, (4, 8), dtype=np.int32), labels=rng.integers(1, 6, (4, 8), dtype=np.int32),
            puzzle_identifiers=rng.integers(0, 3, 4, dtype=np.int32)).items()} for _ in range(2)]
        step_t = torch.zeros((), device=dev)
        carry = model.initial_carry(batches[0])
        form = S.step_form('xla', kind != 'eager')
        losses, per_step = [], []
        graphs0 = counters['stats']['unique_graphs']
        for i in range(6):
            c0, n0, g0 = count('CompileTime'), calls[0], lazy_nodes()
            executed.clear()
            carry, loss, metrics = S.train_step(model, opt, ema, carry, batches[i % 2], step_t, sc, form)
            live = [*model.parameters(), *model.buffers(), *ema, *carry.values(), *metrics.values(), loss,
                    step_t, *[t for st in opt.state if st for t in st.values()]]
            dots = sum(executed) + n_dots(live)
            torch_xla.sync()
            if i == 0:  # AdamATan2's first moment after one step: (1 - beta1) x the first gradient, per parameter
                grad1 = {n: st['exp_avg'].cpu().tolist() for (n, _), st in zip(model.named_parameters(), opt.state)}
            losses.append(loss)
            per_step.append(dict(compiles=count('CompileTime') - c0, net_calls=calls[0] - n0,
                                 lazy_nodes=lazy_nodes() - g0, dots=dots, graphs=len(executed)))
        dynamo_graphs = counters['stats']['unique_graphs'] - graphs0
        model.eval()
        predict = S.compiled_predict(model) if kind != 'eager' else model.predict
        ev = []
        with torch.no_grad():
            for _ in range(3):
                c0, n0 = count('CompileTime'), calls[0]
                preds, q, _ = predict(batches[0], 4)
                torch_xla.sync()
                ev.append(dict(compiles=count('CompileTime') - c0, net_calls=calls[0] - n0))
            ref, q_ref, _ = model.predict(batches[0], 4)  # the unrolled lazy graph, the same weights
        runs[kind] = dict(losses=[float(x.cpu()) for x in losses], per_step=per_step, eval=ev,
                          dynamo_graphs=dynamo_graphs,
                          preds_match=bool((preds == ref).all().cpu()), q_diff=float((q - q_ref).abs().max().cpu()),
                          weights={k: v.cpu().tolist() for k, v in model.state_dict().items()},
                          ema=[e.cpu().tolist() for e in ema], grad1=grad1)
    report[f'{H}x{L}'] = runs
report['fallbacks'] = {n: met.counter_value(n) for n in met.counter_names() if n.startswith('aten::')}
print(json.dumps(report))
"""


def test_xla_step_is_traced_once_and_equals_eager(tmp_path):
    p = run(['-c', SCRIPT], env=XLA_ENV, timeout=1200)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r.pop('fallbacks') == {}
    warm = {}
    for depth, runs in r.items():
        e, c, a = runs['eager'], runs['compiled'], runs['accumulated']
        # gradient accumulation (two micro-batches) and clipping: traced once as well, and training (autograd
        # sums the micro-batches' gradients lazily: the update's inputs are materialised by a small lazy graph,
        # compiled once more at the second step)
        assert all(s['net_calls'] == 0 for s in a['per_step'][1:]) and all(s['compiles'] == 0 for s in a['per_step'][2:])
        assert all(x == x and x > 0 for x in a['losses']), a['losses']
        # ... and its micro-batches share one forward and backward graph: a graph per micro-batch would compile
        # the whole network k times over (and past dynamo's recompile limit run the rest lazily in Python). At
        # most the update's graph more than the one-graph step (none where dynamo reuses an earlier depth's)
        assert a['dynamo_graphs'] <= c['dynamo_graphs'] + 1, (depth, a['dynamo_graphs'], c['dynamo_graphs'])
        # eager traces the whole recursion every step: the counter does see it
        assert all(s['net_calls'] == int(depth[0]) * (int(depth[2]) + 1) for s in e['per_step']), e['per_step']
        # traced once: from the second step on, no Python of the net runs, and nothing compiles
        assert all(s['net_calls'] == 0 and s['compiles'] == 0 for s in c['per_step'][1:]), c['per_step']
        warm[depth] = [s['lazy_nodes'] for s in c['per_step'][2:]]
        # one process, one micro-batch: the whole step (forward, backward, update) is ONE compiled graph, as the
        # eager step is one lazy graph: nothing else runs, nothing is left to trace lazily
        assert all(s['graphs'] == 1 and s['lazy_nodes'] == 0 for s in c['per_step'][1:]), c['per_step']
        # the same device work as eager: as many matrix products per step (a backward that recomputed the
        # forward would add its products), and some at all (the count sees them)
        assert c['per_step'][-1]['dots'] == e['per_step'][-1]['dots'] > 0, (depth, c['per_step'],
                                                                             e['per_step'])
        # evaluation: one step compiled, no Python of the net and no compilation after the first batch
        assert all(v['net_calls'] == 0 and v['compiles'] == 0 for v in c['eval'][1:]), c['eval']
        assert c['preds_match'] and c['q_diff'] < 1e-4, (c['preds_match'], c['q_diff'])  # compiled predict = unrolled
        for a, b in zip(c['losses'], e['losses']):
            assert abs(a - b) <= 1e-3 * abs(b), (depth, c['losses'], e['losses'])
        import torch
        # the first step's gradients, in float rounding of eager's
        for k, g in e['grad1'].items():
            g = torch.tensor(g)
            torch.testing.assert_close(torch.tensor(c['grad1'][k]), g, rtol=1e-3, atol=1e-5 * g.abs().max().item(),
                                       msg=lambda m: f'{depth} gradient of {k}: {m}')
        # the weights and the EMA after six steps. AdamATan2's first step is sign-SGD-like (atan2(m, sqrt(v)) = atan2(g,
        # |g|) up to bias correction), so an element whose first gradient is at float32 rounding (seen: 3e-11 against
        # eager's -6e-11, where the parameter's median is 4e-3) moves lr one way or the other with the order of the
        # additions that make it; such elements may be a thousandth of a parameter, the others match to float tolerance
        names = list(e['grad1'])  # the parameters' order, the EMA's
        for k in e['weights']:
            wc, we = torch.tensor(c['weights'][k]), torch.tensor(e['weights'][k])
            if k in e['grad1']:
                g = torch.tensor(e['grad1'][k])
                sure = (g == 0) | (g.abs() > 1e-5 * g.abs().max())  # a token never seen: 0 in both, no step
                assert (~sure).sum() <= max(1, sure.numel() // 1000), (depth, k, int((~sure).sum()))
                wc, we = wc[sure], we[sure]
                ema_c, ema_e = (torch.tensor(x[names.index(k)])[sure] for x in (c['ema'], e['ema']))
                torch.testing.assert_close(ema_c, ema_e, rtol=1e-3, atol=2e-4, msg=lambda m: f'{depth} EMA of {k}: {m}')
            torch.testing.assert_close(wc, we, rtol=1e-3, atol=2e-4, msg=lambda m: f'{depth} {k}: {m}')
    # what is still traced lazily per step does not grow with the recursion depth
    assert warm['1x1'] == warm['2x3'], warm


FALLBACK = r"""
import json, torch, torch_xla
import step as S

def f(x, w):
    w.add_(1)  # an input updated in place, as the optimizer's moments are
    return torch.lgamma(x) * 2 + x + w  # lgamma: no XLA lowering in torch_xla 2.9, a CPU fallback
g = torch.compile(f, backend=S.xla_backend, dynamic=False)
dev = torch_xla.device()
w = torch.zeros(4, device=dev)
out = []
with torch.no_grad():
    for i in range(3):
        x = torch.rand(4) + 0.5
        out.append(dict(got=g(x.to(dev), w).cpu().tolist(), want=(torch.lgamma(x) * 2 + x + i + 1).tolist()))
try:
    g(x.to(dev), w)  # with autograd on: refused in words
except RuntimeError as e:
    out.append(str(e))
print(json.dumps(out))
"""


def test_an_op_without_xla_lowering_is_not_frozen_into_the_graph():
    # step.xla_backend traces dynamo's graph once on lazy tensors: an op that falls back to the CPU during that
    # trace would leave its first result in the graph as a constant (every later call would return it). The
    # backend sees the fallback and hands the graph to the bridge's partitioning path: fresh results every call.
    p = run(['-c', FALLBACK], env=XLA_ENV, timeout=600)
    *calls, refusal = json.loads(p.stdout.strip().splitlines()[-1])
    for c in calls:
        assert c['got'] == pytest.approx(c['want'], rel=1e-5), calls
    assert 'torch.no_grad()' in refusal, refusal
