"""
The speed work, checked for exactness on the CPU (no timing is asserted anywhere):
mlp_t's padded sequence axis equals the unpadded computation (RMSNorm over the true length included) and the
padding never leaks; the compiled training step (torch.compile with inductor, as on CUDA) equals the eager one
and compiles no new graph after its first step; the compiled evaluation equals model.predict; bench.py takes
the task's shape from the config (a Maze config: 900 tokens, vocabulary 6).
    python -m pytest -q tests/test_speed.py
"""
import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from model import TRM, TRMConfig, rms_norm, round_up, swiglu_inter  # noqa: E402
from step import AdamATan2, Compiled, Eager, StepConfig, compiled_predict, forward_loss, train_step  # noqa: E402
from conftest import script_env  # noqa: E402

# Sudoku's shape (81 tokens + 16 puzzle-embedding positions = 97, padded to 104) at a small width
SUDOKU_SMALL = dict(vocab_size=11, seq_len=81, num_puzzle_identifiers=3, hidden_size=32, num_heads=2, H_cycles=2,
                    L_cycles=2, halt_max_steps=2, puzzle_emb_ndim=32, forward_dtype='float32', loss_dtype='float32')


def random_batch(B, L, vocab, n_ids, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(inputs=torch.randint(1, vocab, (B, L), generator=g, dtype=torch.int32),
                labels=torch.randint(1, vocab, (B, L), generator=g, dtype=torch.int32),
                puzzle_identifiers=torch.randint(0, n_ids, (B,), generator=g, dtype=torch.int32))


def twin_models(cfg, seed=0):
    """The same weights (puzzle embedding included) with mlp_t padded (the default) and unpadded."""
    torch.manual_seed(seed)
    padded = TRM(cfg)
    with torch.no_grad():
        padded.puzzle_emb.normal_()
    plain = TRM(cfg, seq_align=1)
    plain.load_state_dict(padded.state_dict())
    return padded, plain


# -----------------------------------------------------------------------------
# mlp_t: the padded sequence axis

def test_mlp_t_padding_keeps_parameters_and_checkpoint_shapes():
    full = TRM(TRMConfig(mlp_t=True, pos_encodings='none'))
    assert full.num_params() == 5_028_866  # the reference's count: padding adds no parameter
    layer = full.net.layers[0]
    inter = swiglu_inter(97, 4.0)
    assert layer.mlp_t.gate_up_proj.weight.shape == (2 * inter, 97)  # reference checkpoints load unchanged
    assert layer.mlp_t.down_proj.weight.shape == (97, inter)
    assert layer.seq_pad == 7 and round_up(97, 8) == 104
    assert TRM(TRMConfig(mlp_t=True, pos_encodings='none'), seq_align=1).net.layers[0].seq_pad == 0
    assert TRM(TRMConfig(mlp_t=True, pos_encodings='none'), seq_align=16).net.layers[0].seq_pad == 15


def test_padded_mlp_t_equals_the_unpadded_computation():
    cfg = TRMConfig(**SUDOKU_SMALL)
    padded, plain = twin_models(cfg)
    L, D, eps = cfg.total_len, cfg.hidden_size, cfg.rms_norm_eps
    assert L == 97 and padded.net.layers[0].seq_pad == 7 and plain.net.layers[0].seq_pad == 0

    # one block's sequence mixing against a formula written out here: RMSNorm divides by the TRUE length 97
    h = torch.randn(3, L, D)
    block = padded.net.layers[0]
    w1, w2 = block.mlp_t.gate_up_proj.weight, block.mlp_t.down_proj.weight
    ht = h.transpose(1, 2)  # [B, D, L]
    gate, up = (ht @ w1.T).chunk(2, -1)
    v = ht + (F.silu(gate) * up) @ w2.T
    want = (v / torch.sqrt(v.square().sum(-1, keepdim=True) / 97 + eps)).transpose(1, 2)
    got = block.mix_sequence(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wrong = (v / torch.sqrt(v.square().sum(-1, keepdim=True) / 104 + eps)).transpose(1, 2)
    assert (got - wrong).abs().max() > 1e-3  # the padded length's divisor would show

    # the whole training forward, loss and gradients: padded == unpadded (float32)
    batch = random_batch(4, cfg.seq_len, cfg.vocab_size, cfg.num_puzzle_identifiers, seed=1)
    results = []
    for m in (padded, plain):
        torch.manual_seed(7)  # the same ACT exploration draws
        carry = m.initial_carry(batch)
        rows = m.puzzle_rows(batch['puzzle_identifiers']).detach().requires_grad_(True)
        new_carry, loss, metrics = forward_loss(m, carry, batch, rows)
        loss.backward()
        results.append((new_carry['y'], new_carry['z'], loss, rows.grad,
                        [p.grad for p in m.parameters()], metrics))
    (y1, z1, l1, r1, g1, m1), (y2, z2, l2, r2, g2, m2) = results
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z1, z2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r1, r2, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for k in m1:
        torch.testing.assert_close(m1[k], m2[k])

    # evaluation
    padded.eval(), plain.eval()
    p1, q1, _ = padded.predict(batch, 2)
    p2, q2, _ = plain.predict(batch, 2)
    assert torch.equal(p1, p2)
    torch.testing.assert_close(q1, q2, rtol=1e-5, atol=1e-6)


def test_padded_positions_never_leak_into_real_ones():
    cfg = TRMConfig(**SUDOKU_SMALL)
    padded, _ = twin_models(cfg)
    block = padded.net.layers[0]
    pad, L, D = block.seq_pad, cfg.total_len, cfg.hidden_size
    h = torch.randn(3, L, D)
    x = h.transpose(1, 2)
    garbage = 1e4 * torch.randn(3, D, pad) + 3e3  # large, finite
    runs = []
    for fill in (torch.zeros(3, D, pad), garbage):
        block.zero_grad(set_to_none=True)
        xp = torch.cat([x, fill], -1)  # [B, D, L + pad]: the real positions, then the padding
        out = block.mlp_t(xp, pad=pad)
        assert out.shape == (3, D, L)
        mixed = rms_norm(x + out, block.eps).transpose(1, 2)  # what Block.mix_sequence does with it
        mixed.square().sum().backward()
        runs.append((out.detach(), mixed.detach(), [p.grad.clone() for p in block.mlp_t.parameters()]))
    (o0, m0, g0), (o1, m1, g1) = runs
    assert torch.equal(o0, o1) and torch.equal(m0, m1)  # padding x zero weight columns: exactly nothing
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)  # and the real weights' gradients see none of it either
    # and the real outputs are those of the unpadded SwiGLU
    torch.testing.assert_close(o0, block.mlp_t(x.contiguous()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block.mix_sequence(h), m0, rtol=1e-5, atol=1e-6)


# -----------------------------------------------------------------------------
# torch.compile: the step train.py and bench.py run on CUDA, here with inductor on the CPU

@pytest.mark.skipif(shutil.which('g++') is None and shutil.which('c++') is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compiled_step_and_predict_equal_eager_and_do_not_recompile():
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    # a tiny model whose sequence (9 + 2 = 11) mlp_t pads to 16, with the puzzle embedding (sign-SGD), the EMA
    # and a no-grad recursion round (H_cycles=2)
    cfg = TRMConfig(vocab_size=6, seq_len=9, num_puzzle_identifiers=3, hidden_size=16, num_heads=2, expansion=2.0,
                    H_cycles=2, L_cycles=1, halt_max_steps=2, puzzle_emb_ndim=16, puzzle_emb_len=2,
                    forward_dtype='float32', loss_dtype='float32')
    sc = StepConfig(lr=1e-3, puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.1, warmup_steps=2, total_steps=100,
                    min_ratio=0.1, global_batch_size=8, ema_rate=0.99)
    batches = [random_batch(8, cfg.seq_len, cfg.vocab_size, cfg.num_puzzle_identifiers, seed=s) for s in range(4)]
    torch.manual_seed(0)
    base = TRM(cfg)
    assert base.net.layers[0].seq_pad == 5

    def run(model, form, check_graphs=None):
        torch.manual_seed(1)
        opt = AdamATan2(model.parameters(), lr=sc.lr, weight_decay=0.1)
        ema = [p.detach().clone() for p in model.parameters()]
        step_t = torch.zeros(())
        carry = model.initial_carry(batches[0])
        trace = []
        for i, b in enumerate(batches):
            carry, loss, metrics = train_step(model, opt, ema, carry, b, step_t, sc, form)
            trace.append((loss.detach().clone(), carry['y'].clone(), carry['halted'].clone(),
                          {k: v.detach().clone() for k, v in metrics.items()}))
            if check_graphs is not None:
                check_graphs(i)
        return trace, [p.detach().clone() for p in model.parameters()], ema, model.puzzle_emb.clone(), step_t

    eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    want = run(eager_model, Eager())

    torch._dynamo.reset()
    counters.clear()
    graphs = {}

    def check_graphs(i):
        graphs[i] = counters['stats']['unique_graphs']
        if i == 0:  # the first step compiled both parts; from here on, any new graph is an error
            torch._dynamo.config.error_on_recompile = True

    with inductor_config.patch(fallback_random=True):  # compiled random draws (ACT exploration) = eager ones
        try:
            got = run(compiled_model, Compiled(), check_graphs)
        finally:
            torch._dynamo.config.error_on_recompile = False
    assert graphs == {0: 2, 1: 2, 2: 2, 3: 2}, graphs  # forward+loss, update: once, at the first step
    assert not counters['graph_break'], dict(counters['graph_break'])  # each part is one whole graph
    assert not counters['recompiles'], dict(counters['recompiles'])

    for (l1, y1, h1, m1), (l2, y2, h2, m2) in zip(want[0], got[0]):
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
        # the carry runs float32 through the recursion for 4 steps whose weights already differ by the updates'
        # rounding, and inductor's CPU kernels sum in another order than eager's, one that depends on the CPU's
        # vector width: a drift of a few 1e-4 on values of order 1, where a wrong graph is off by order 1
        torch.testing.assert_close(y2, y1, rtol=1e-4, atol=5e-4)
        assert torch.equal(h2, h1)
        for k in m1:
            torch.testing.assert_close(m2[k], m1[k], rtol=1e-5, atol=1e-5)
    for i in (1, 2):  # weights, EMA
        for a, b in zip(want[i], got[i]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-6)  # the sign-SGD puzzle embedding
    assert float(got[4]) == float(want[4]) == len(batches)

    # evaluation: each supervision step one compiled graph, reused for every step and every batch
    compiled_model.eval()
    predict = compiled_predict(compiled_model)
    assert compiled_predict(compiled_model) is predict  # built once per model
    before = counters['stats']['unique_graphs']
    for b in batches[:2]:
        p_want, q_want, _ = compiled_model.predict(b, 3)
        p_got, q_got, _ = predict(b, 3)
        assert p_got.shape == (3, 8, cfg.seq_len) and p_got.dtype == torch.int32
        assert torch.equal(p_got, p_want)
        torch.testing.assert_close(q_got, q_want, rtol=1e-5, atol=1e-5)
    assert counters['stats']['unique_graphs'] == before + 1
    assert not counters['graph_break'] and not counters['recompiles']


def test_train_and_bench_use_the_same_compiled_step():
    for name in ('train.py', 'bench.py'):
        src = open(os.path.join(ROOT, name)).read()
        assert 'step_form(' in src and 'compiled_predict(' in src, name


# -----------------------------------------------------------------------------
# bench.py: the task's shape from the config, not a Sudoku assumed

def run_bench(args):
    p = subprocess.run([sys.executable, 'bench.py'] + args, cwd=ROOT, env=script_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"bench.py {args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    line = [l for l in p.stdout.splitlines() if l.startswith('bench: device=')][-1]
    return dict(kv.split('=', 1) for kv in line.split()[1:]), p.stdout


BENCH_TINY = ['--device=cpu', '--global_batch_size=2', '--hidden_size=32', '--num_heads=2', '--L_cycles=1',
              '--H_cycles=1', '--halt_max_steps=2', '--steps=1', '--warmup_steps=1', '--eval_batches=1',
              '--forward_dtype=float32', '--loss_dtype=float32', '--puzzle_emb_len=1', '--puzzle_emb_ndim=32']


def test_bench_takes_the_maze_shape_from_a_maze_config(tmp_path):
    missing = str(tmp_path / 'maze-30x30-hard-1k')  # no dataset there: the name says the shape
    s, out = run_bench(['config/maze.py', f'--data_path={missing}'] + BENCH_TINY)
    assert 'shape: 900 tokens, vocab 6 (maze 30x30' in out
    assert 'batch 2 x 900 tokens' in out
    assert s['seq_len'] == '900' and s['vocab_size'] == '6'
    assert float(s['first_step_s']) > 0 and float(s['ms_per_step']) > 0
    # explicit keys win over the name
    s, out = run_bench(['config/maze.py', f'--data_path={missing}', '--seq_len=16', '--vocab_size=8'] + BENCH_TINY)
    assert s['seq_len'] == '16' and s['vocab_size'] == '8' and 'batch 2 x 16 tokens' in out
