"""
backends/kernels.py, the fused Triton blocks (train.py's kernels key), on a machine without a GPU: their results against the
plain path's through Triton's interpreter (TRITON_INTERPRET=1, in a process of its own: the variable must be set
before triton is imported; float32, as the interpreter has no bfloat16, which the GPU's check covers:
dev/gpu_speed.sh), the compiled kernels for a Hopper GPU (Triton's own ptxas, no GPU needed), the choice 'auto'
makes and says, and dev/gpu_speed.sh's dry run. The tests that run or build a kernel skip where triton is not
installed (torch's CPU wheel); the choice and its fallback to the plain path run there too, where they matter.
    python -m pytest -q tests/test_kernels.py
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, make_reverse_dataset, run, site_hook
from device import choose_kernels

needs_triton = pytest.mark.skipif(importlib.util.find_spec('triton') is None,
                                  reason="the kernels need triton (not in torch's CPU wheel)")

INTERPRETED = r'''
import json, sys
import torch
from backends import kernels
from model import TRM, TRMConfig
from step import forward_loss

rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
out = {}
# the gated GEMMs alone over more row tiles than a group of programs walks (9 x 128 + 5 rows): every tile of the
# grid's order, the last group short; then a K and a D that no K tile divides. Each with the first tile of the
# lists (the interpreter runs that one) moved by the threads' loads, by TMA copies (rows and K past the edges read
# as zeros, nothing written there), and by TMA copies in a persistent grid (3 programs here, each looping over
# tiles)
tiles, results = (kernels.GATED_CONFIGS, kernels.DGATED_CONFIGS), {}
for how, mode in dict(loads=kernels.LOADS, TMA=kernels.TMA_TILES, persistent=kernels.TMA_PERSISTENT).items():
    kernels.GATED_CONFIGS, kernels.DGATED_CONFIGS = (
        sorted(c, key=lambda t: any(t[k] != v for k, v in mode.items())) for c in tiles)
    for what, (M, K, D) in dict(many_row_tiles=(1157, 64, 64), partial_k_tiles=(300, 48, 48)).items():
        torch.manual_seed(0)
        x, w_gu, w_d = torch.randn(M, K), torch.randn(512, K) / 8, torch.randn(D, 256) / 16
        dy = torch.randn(M, D)
        ins = [t.clone().requires_grad_(True) for t in (x, w_gu, w_d)]
        gate, up = (ins[0] @ ins[1].t()).chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up @ ins[2].t()).backward(dy)
        got = [t.clone().requires_grad_(True) for t in (x, w_gu, w_d)]
        kernels.gated_mlp(*got)[0].backward(dy)
        what = f"gated GEMMs {how} {what}"
        out[f'{what}: gradients'] = max(rel(a.grad, b.grad) for a, b in zip(got, ins))
        out[f'{what}: swiglu'] = rel(kernels.swiglu(x, w_gu), torch.nn.functional.silu(gate) * up)
        results.setdefault(how, []).extend([t.grad for t in got] + [kernels.swiglu(x, w_gu)])
kernels.GATED_CONFIGS, kernels.DGATED_CONFIGS = tiles
out['gated GEMMs by TMA, persistent or not: the loads\' bits equal'] = all(
    torch.equal(a, b) for how in ('TMA', 'persistent') for a, b in zip(results[how], results['loads']))
for name, keys in dict(mlp_t=dict(), attention=dict(mlp_t=False, pos_encodings='rope'),
                       mlp_t_partial_tile=dict(hidden_size=48, num_heads=2, seq_len=20),
                       attention_whole_k_tiles=dict(hidden_size=64, mlp_t=False, pos_encodings='rope')).items():
    torch.manual_seed(0)
    cfg = dict(vocab_size=6, seq_len=11, num_puzzle_identifiers=3, hidden_size=32, num_heads=2, expansion=4.0,
               puzzle_emb_ndim=32, puzzle_emb_len=2, H_cycles=2, L_cycles=2, halt_max_steps=3,
               forward_dtype='float32', loss_dtype='float64')
    cfg.update(keys)
    model = TRM(TRMConfig(**cfg))
    block, rope = model.net.layers[0], model.rope()
    h = torch.randn(2, model.config.total_len, model.config.hidden_size)
    modes = {k: v for k, v in kernels.FORWARDS.items() if k != 'quack'}  # quack's GEMMs: CUDA GPUs only
    if name.startswith('attention'):
        del modes['mlp_t']
    with torch.no_grad():  # the no-grad forward: mlp_t fused, and with gated and triton the channel SwiGLU too
        plain = block(h, rope)
        for which, forward in modes.items():
            block.fused = forward
            out[f'{name} {which} block forward'] = rel(block(h, rope), plain)
            block.fused = None

    def block_grads(forward):  # a block's call under grad: its output and the input's and weights' gradients
        block.fused = forward
        block.zero_grad()
        x = h.clone().requires_grad_(True)
        y = block(x, rope)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        block.fused = None
        return [y.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]
    plain_grads = block_grads(None)
    # kernels='cudnn' on the CPU: SDPA's order around the same call, which CPU attention ignores: the same bits
    # (mlp_t blocks: the plain path itself)
    out[f'{name} cudnn block under grad equal'] = all(
        torch.equal(a, b) for a, b in zip(block_grads(modes['cudnn']), plain_grads))
    for which in ('mlp_t', 'gated', 'triton'):  # a fused block under grad: output, input's and weights' grads
        if which in modes:
            out[f'{name} {which} block under grad'] = max(rel(a, b) for a, b in zip(block_grads(modes[which]),
                                                                                      plain_grads))
    B, V, L = 3, cfg['vocab_size'], cfg['seq_len']
    batch = dict(inputs=torch.randint(1, V, (B, L), dtype=torch.int32),
                 labels=torch.randint(1, V, (B, L), dtype=torch.int32),
                 puzzle_identifiers=torch.randint(0, 3, (B,), dtype=torch.int32))

    def step(fwd):  # a training step's loss and gradients (the puzzle rows' too), with sign-SGD's leaf
        torch.manual_seed(1)
        model.zero_grad()
        carry = model.initial_carry(batch)
        rows = model.puzzle_rows(carry['puzzle_identifiers']).detach().requires_grad_(True)
        _, loss, _ = fwd(model, carry, batch, rows)
        loss.backward()
        return [loss.detach().reshape(1)] + [p.grad.clone() for p in model.parameters()] + [rows.grad]
    plain = step(forward_loss)
    compiled = name == 'mlp_t'  # the custom ops and their autograd in torch.compile's graphs (one shape: slow)
    for which in modes:
        out[f'{name} {which} fused'] = kernels.fuse_blocks(model, which)
        steps = [('eager', forward_loss)]
        if compiled:
            torch._dynamo.reset()
            steps.append(('compiled', torch.compile(forward_loss, backend='aot_eager', dynamic=False)))
        for what, fwd in steps:
            got = step(fwd)
            out[f'{name} {which} {what} step loss'] = rel(got[0], plain[0])
            out[f'{name} {which} {what} step gradients'] = max(rel(a, b) for a, b in zip(got[1:], plain[1:]))
    if 'mlp_t' not in modes:
        out[f'{name} mlp_t fused'] = kernels.fuse_blocks(model, 'mlp_t')
    if name == 'attention':  # compiled, kernels='cudnn' keeps its preference: dynamo's graph sets SDPA's order
        kernels.fuse_blocks(model, 'cudnn')
        torch._dynamo.reset()
        graphs = []

        def record(gm, example_inputs):  # the graph dynamo captured, run as it is
            graphs.append(gm)
            return gm.forward
        got = step(torch.compile(forward_loss, backend=record, dynamic=False))
        out['attention cudnn captured step loss'] = rel(got[0], plain[0])
        out['attention cudnn captured step gradients'] = max(rel(a, b) for a, b in zip(got[1:], plain[1:]))
        nodes = [n for gm in graphs for n in gm.graph.nodes]
        orders = [[b.args[0] for b in n.args[0]] for n in nodes if n.target is torch.nn.attention._sdpa_kernel]
        out['attention cudnn captured: SDPA calls, orders set with cuDNN first, orders put back'] = [
            sum(n.target is torch.nn.functional.scaled_dot_product_attention for n in nodes),
            sum(o[0] == 'CUDNN_ATTENTION' for o in orders), sum(o[0] != 'CUDNN_ATTENTION' for o in orders)]
        kernels.fuse_blocks(model, 'off')
    model.eval()
    with torch.no_grad():
        kernels.fuse_blocks(model, 'off')
        plain = model.predict(batch, 3, loss_at=2)
        for which in modes:
            kernels.fuse_blocks(model, which)
            torch._dynamo.reset()
            got = model.predict(batch, 3, loss_at=2, step=torch.compile(model.predict_step, backend='aot_eager',
                                                                        dynamic=False) if compiled else None)
            out[f'{name} {which} evaluation predictions equal'] = bool((got[0] == plain[0]).all())
            out[f'{name} {which} evaluation loss'] = rel(got[3], plain[3])
    model.train()
print(json.dumps(out))
'''


def interpreted(script, timeout=2400):  # a guard against a hang only: a slow or busy CPU took over 600 s
    env = dict(os.environ, TRITON_INTERPRET='1', OMP_NUM_THREADS='1')
    p = subprocess.run([sys.executable, '-c', script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.splitlines()[-1])


@needs_triton
def test_the_fused_blocks_compute_the_plain_path_s_function_in_the_interpreter():
    """float32 through Triton's interpreter, with every kernel (kernels='triton'), with the gated GEMMs and mlp_t's
    no-grad forward (kernels='gated') and with mlp_t's fused forward and backward alone (kernels='mlp_t'): the
    forward of a block (mlp_t, attention, a channel tile that overhangs D, a width of whole K tiles), a block under
    grad (its output, the input's and the weights' gradients), a training step's loss and every gradient (eager,
    and compiled: the custom ops and their autograd inside torch.compile's graphs), and evaluation's predictions,
    each against the plain path's. kernels='cudnn' (SDPA's order around the same call, which CPU attention
    ignores) gives the plain path's bits here, and the step torch.compile captures sets that order, cuDNN first,
    around each attention call."""
    out = interpreted(INTERPRETED)
    gated = 'channel SwiGLU (gated GEMMs, forward and backward)'
    assert out['mlp_t triton fused'] == f'mlp_t (forward and backward); {gated}', out
    assert out['mlp_t gated fused'] == f'mlp_t forward (no-grad), under grad gated GEMMs; {gated}', out
    assert out['mlp_t mlp_t fused'] == 'mlp_t (forward and backward); the rest plain', out
    assert out['attention triton fused'] == out['attention gated fused'] == f'attention plain; {gated}', out
    assert out['attention mlp_t fused'] == 'none fused: the model mixes the sequence with attention, not mlp_t'
    assert out['attention cudnn fused'] == ("attention through cuDNN's fused attention (SDPA's cuDNN backend first); "
                                            "the rest plain"), out
    assert out['mlp_t cudnn fused'] == 'none fused: the model mixes the sequence with mlp_t, not attention', out
    # one call of the attention per block and network call (2 blocks x H_cycles 2 x (L_cycles 2 + 1)), each inside
    # an order that puts cuDNN first, and the order before it put back after it
    calls = out.pop('attention cudnn captured: SDPA calls, orders set with cuDNN first, orders put back')
    assert calls == [12, 12, 12], calls
    assert 'mlp_t_partial_tile mlp_t block under grad' in out, out
    for k, v in out.items():
        if k.endswith('equal'):
            assert v is True, (k, out)
        elif not k.endswith('fused'):
            # float32 rounding: the fused sums run in another order than the plain path's, whose own order
            # differs between CPUs (AVX2, AVX-512), and the recursion carries each call's rounding into the next
            # (an evaluation step's z into the next step's); a wrong tile, mask or index is off by orders more
            assert v < 1e-4, (k, v, out)


@needs_triton
def test_the_kernels_build_for_a_hopper_gpu_without_spilling_registers():
    """Each kernel at the Sudoku model's shapes with every tile its autotuner tries (the gated GEMMs at the channel
    SwiGLU's K and at mlp_t's, a K no tile divides), compiled for sm_90a by Triton's own ptxas (no GPU needed): it
    builds, within Hopper's shared memory, its products on Hopper's asynchronous tensor-core instructions, and no
    register spills to local memory (a spill costs a kernel much of its speed: the autotuner is offered none)."""
    sys.path.insert(0, os.path.join(ROOT, 'dev'))
    from kernels_check import build_all
    built = build_all(90)
    for name, (smem, regs, spill, wgmma, tma) in built.items():
        assert spill == 0 and regs <= 255 and smem <= 227 * 1024 and wgmma, (name, smem, regs, spill, wgmma)
    from backends.kernels import (DGATED_CONFIGS, DOWN_NORM_CONFIGS, GATED_CONFIGS, MLP_T_BACKWARD_CONFIGS,
                                  MLP_T_CONFIGS)
    for name, configs in (('mlp_t', MLP_T_CONFIGS), ('mlp_t_backward', MLP_T_BACKWARD_CONFIGS),
                          ('down_norm', DOWN_NORM_CONFIGS), ('gated', GATED_CONFIGS), ('dgated', DGATED_CONFIGS),
                          ('gated_mlp_t', GATED_CONFIGS), ('dgated_mlp_t', DGATED_CONFIGS)):
        tried = [v for k, v in built.items() if k.split(' {')[0] == name]
        assert len(tried) == len(configs) > 1, (name, tried)
        if name.startswith(('gated', 'dgated')):  # tiles moved by TMA copies where the config says so, else loads
            assert [t for *_, t in tried] == [c['TMA'] for c in configs], (name, tried)
            assert any(c['PERSIST'] for c in configs) and not configs[0]['TMA'], configs
            # a persistent grid loops over TMA's tiles: PERSIST only with TMA
            assert all(c['TMA'] or not c['PERSIST'] for c in configs), configs


@needs_triton
def test_the_tma_tiles_are_offered_only_where_a_tma_copy_can_read_every_matrix(monkeypatch):
    """The autotuner's candidates for one call of a gated GEMM: every tile on compute capability 9.0 and newer
    where each matrix starts and each of its rows begins 16-byte aligned; the threads' loads alone before Hopper,
    where a row is not a multiple of 16 bytes, or where a matrix starts off the alignment (a TMA copy would fault
    there); and the wrapper realigns such a matrix, so the autotuner's pick per shape fits every call."""
    import torch
    from backends import kernels
    configs = kernels._gated_tuned.configs
    tma = [c.kwargs['TMA'] for c in configs]
    bf = dict(dtype=torch.bfloat16)
    offset = torch.zeros(64 * 64 + 1, **bf)[1:].view(64, 64)  # starts 2 bytes past an aligned address
    for cap, K, x, fits in (((9, 0), 64, None, True), ((10, 0), 64, None, True), ((8, 9), 64, None, False),
                            ((9, 0), 68, None, False), ((9, 0), 64, offset, False)):
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device=None, cap=cap: cap)
        args = dict(x_ptr=torch.zeros(64, K, **bf) if x is None else x, w_ptr=torch.zeros(128, K, **bf), M=64, I=64)
        got = kernels._tma_where_it_runs(configs, args)
        assert [c.kwargs['TMA'] for c in got] == [t for t in tma if fits or not t], (cap, K, got)
    assert offset.data_ptr() % 16 and kernels._aligned(offset).data_ptr() % 16 == 0
    assert torch.equal(kernels._aligned(offset), offset)


AUTO_MLP_T = ("auto: mlp_t (GPU of compute capability 9.0, bfloat16): mlp_t's fused forward and backward, measured "
              "faster than the compiled plain path on an H200")


@pytest.mark.parametrize('requested,kind,dtype,mlp_t,cap,have,interp,want,why', [
    # quack-kernels' GEMMs: only on a CUDA GPU of capability 9.x or 10.x, in 16 bits, where the package is there
    ('quack', 'cuda', 'bfloat16', True, (9, 0), (True, True), False, 'quack', 'quack (as configured)'),
    ('quack', 'cuda', 'float16', False, (10, 0), (True, True), False, 'quack', 'quack (as configured)'),
    ('quack', 'cuda', 'bfloat16', True, (9, 0), (True, False), False, 'off',
     "warning: kernels='quack' needs the quack-kernels package (pip install quack-kernels; CUDA 12.9 or newer), "
     "not installed: plain path"),
    ('quack', 'cuda', 'bfloat16', True, (8, 6), (True, True), False, 'off',
     "kernels='quack' runs on GPUs of compute capability 9.x and 10.x (Hopper, Blackwell), not 8.6: plain path"),
    ('quack', 'cuda', 'float32', True, (9, 0), (True, True), False, 'off',
     "kernels='quack' runs in bfloat16 or float16, not forward dtype float32: plain path"),
    ('quack', 'cpu', 'float32', True, None, (True, True), True, 'off',
     "warning: kernels='quack' runs on CUDA GPUs only (quack-kernels' GEMMs), not on device cpu: plain path"),
    ('quack', 'cuda', 'bfloat16', True, (9, 0), (False, True), False, 'off', "kernels='quack' needs the triton"),
    ('auto', 'cpu', 'float32', True, None, True, False, 'off', 'auto: off (device cpu'),
    ('auto', 'xla', 'bfloat16', True, None, True, False, 'off', 'auto: off (device xla'),
    ('auto', 'tpu', 'bfloat16', True, None, True, False, 'off', 'auto: off (device tpu'),
    ('auto', 'cuda', 'bfloat16', True, (9, 0), True, False, 'mlp_t', AUTO_MLP_T),
    ('auto', 'cuda', 'bfloat16', False, (9, 0), True, False, 'off', 'attention: no fused kernel is measured faster'),
    ('auto', 'cuda', 'bfloat16', True, (10, 0), True, False, 'off', 'measured on Hopper, 9.0, only'),
    ('auto', 'cuda', 'bfloat16', True, (8, 0), True, False, 'off', 'measured on Hopper'),
    ('auto', 'cuda', 'float32', True, (9, 0), True, False, 'off', 'forward dtype float32'),
    ('auto', 'cuda', 'bfloat16', True, (9, 0), False, False, 'off', 'triton is not installed'),
    ('mlp_t', 'cuda', 'bfloat16', True, (8, 6), True, False, 'mlp_t', 'mlp_t (as configured)'),
    ('mlp_t', 'cuda', 'bfloat16', False, (9, 0), True, False, 'off', "warning: kernels='mlp_t' fuses mlp_t, and this"),
    ('mlp_t', 'cpu', 'float32', True, None, True, True, 'mlp_t', "Triton's interpreter on the CPU"),
    ('mlp_t', 'cpu', 'float32', True, None, True, False, 'off', "warning: kernels='mlp_t' runs on CUDA GPUs"),
    ('gated', 'cuda', 'bfloat16', False, (9, 0), True, False, 'gated', 'gated (as configured)'),
    ('gated', 'cpu', 'float32', False, None, True, False, 'off', "warning: kernels='gated' runs on CUDA GPUs"),
    ('triton', 'cuda', 'bfloat16', True, (8, 6), True, False, 'triton', 'triton (as configured)'),
    ('triton', 'cuda', 'bfloat16', False, (9, 0), True, False, 'triton', 'triton (as configured)'),
    ('triton', 'cuda', 'bfloat16', True, (9, 0), False, False, 'off', "warning: kernels='triton' needs the triton"),
    ('triton', 'cpu', 'float32', True, None, True, False, 'off', "warning: kernels='triton' runs on CUDA GPUs"),
    ('triton', 'cpu', 'float32', True, None, True, True, 'triton', "Triton's interpreter on the CPU"),
    ('off', 'cuda', 'bfloat16', True, (9, 0), True, False, 'off', 'off (as configured)'),
    ('cudnn', 'cuda', 'bfloat16', False, (9, 0), True, False, 'cudnn', 'cudnn (as configured)'),
    ('cudnn', 'cuda', 'bfloat16', False, (8, 0), True, False, 'cudnn', 'cudnn (as configured)'),
    ('cudnn', 'cuda', 'bfloat16', False, (7, 5), True, False, 'off',
     "warning: kernels='cudnn' runs on GPUs of compute capability 8.0 or newer (cuDNN's fused attention), not 7.5"),
    ('cudnn', 'cuda', 'bfloat16', True, (9, 0), True, False, 'off',
     "warning: kernels='cudnn' runs attention through cuDNN, and this model mixes with mlp_t: plain path"),
    ('cudnn', 'cpu', 'float32', False, None, True, False, 'off', "warning: kernels='cudnn' runs on CUDA GPUs"),
    ('cudnn', 'cpu', 'float32', False, None, True, True, 'cudnn', "Triton's interpreter on the CPU"),
    # the interpreter computes the Triton kernels in float32 only (bfloat16 there gives wrong numbers, NaN
    # gradients): a 16-bit forward dtype, auto's pick on a CPU with native bf16, keeps the plain path; cuDNN's
    # attention runs no Triton kernel
    ('mlp_t', 'cpu', 'bfloat16', True, None, True, True, 'off',
     "warning: kernels='mlp_t' in Triton's interpreter runs in float32 only, not forward dtype bfloat16: plain path"),
    ('gated', 'cpu', 'bfloat16', True, None, True, True, 'off', "float32 only, not forward dtype bfloat16"),
    ('triton', 'cpu', 'float16', True, None, True, True, 'off', "float32 only, not forward dtype float16"),
    ('cudnn', 'cpu', 'bfloat16', False, None, True, True, 'cudnn', "Triton's interpreter on the CPU"),
    # the model's misfit is said before the device's or the dtype's, which another try would only meet next
    ('mlp_t', 'cpu', 'bfloat16', False, None, True, True, 'off', "fuses mlp_t, and this model mixes with attention"),
    ('cudnn', 'cpu', 'float32', True, None, True, False, 'off', "runs attention through cuDNN, and this model mixes"),
    ('auto', 'cuda', 'bfloat16', False, (9, 0), True, False, 'off', "--kernels=cudnn tries cuDNN's attention"),
])
def test_auto_picks_the_one_kernel_measured_faster_and_says_why(monkeypatch, requested, kind, dtype, mlp_t, cap,
                                                                 have, interp, want, why):
    if interp:
        monkeypatch.setenv('TRITON_INTERPRET', '1')
    else:
        monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    have_triton, have_quack = have if isinstance(have, tuple) else (have, False)
    choice, text = choose_kernels(requested, kind, dtype, mlp_t=mlp_t, cuda_capability=cap, have_triton=have_triton,
                                  have_quack=have_quack)
    assert choice == want and why in text, (choice, text)


FORKED_BLOCK = r'''
import json
import torch
from device import use_kernels
from model import TRM, TRMConfig, Block, rms_norm


def model(**kw):
    return TRM(TRMConfig(vocab_size=6, seq_len=16, num_puzzle_identifiers=1, hidden_size=64, num_heads=2,
                         puzzle_emb_ndim=0, forward_dtype='float32', **kw))


class PreNorm(Block):  # a fork's edit of Block.forward alone: pre-norm, the same tensors
    def forward(self, h, rope):
        h = h + self.mix_sequence(rms_norm(h, self.eps))
        return h + self.mlp(rms_norm(h, self.eps))


# a fork's Block (docs/forking.md, a new mixer): a module the fused forwards do not know, zero-initialised as a new
# residual branch often is, so that its output says nothing at the start; a bias in the channel SwiGLU; Block's
# forward edited; and the Block as it is
forks = dict(module=model(), bias=model(), forward=model(), none=model(), attention=model(mlp_t=False),
             multiple=model(mlp_multiple=32))
for block in forks['module'].net.layers:
    block.conv = torch.nn.Conv1d(64, 64, 3, padding=1, groups=64, bias=False)
    torch.nn.init.zeros_(block.conv.weight)
for block in forks['bias'].net.layers:
    block.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64))
for block in forks['forward'].net.layers:
    block.__class__ = PreNorm
print(json.dumps({name: {which: use_kernels(which, 'cpu', 'float32', m) for which in ('mlp_t', 'gated', 'triton')}
                  for name, m in forks.items()}))
'''


@needs_triton
def test_a_block_with_a_tensor_module_or_code_the_fused_forwards_do_not_compute_runs_the_plain_path_in_one_line():
    """A fork that changes model.py's Block (a new module, a bias, an edited forward) and leaves backends/kernels.py
    as it is: the fused forwards would compute the old Block, so every kernels value runs the plain path and says
    why; the Block as it is fuses (its code is the one the kernels were written for: PLAIN_PATH). So does a model
    whose SwiGLU widths round to another multiple than the kernels' tiles divide (--mlp_multiple=32)."""
    out = interpreted(FORKED_BLOCK)
    for fork, said in (('module', 'conv'), ('bias', 'mlp.down_proj.bias'), ('forward', 'PLAIN_PATH'),
                       ('multiple', 'not of mlp_multiple=32')):
        for which, (got, why) in out[fork].items():
            assert got == 'off' and said in why and 'plain path' in why and '\n' not in why, (fork, which, why)
    assert [got for got, _ in out['none'].values()] == ['mlp_t', 'gated', 'triton'], out['none']
    assert [got for got, _ in out['attention'].values()] == ['off', 'gated', 'triton'], out['attention']


@needs_triton
def test_train_says_its_kernels_on_the_first_line_and_a_forced_triton_falls_back_in_one_line(tmp_path):
    data = make_reverse_dataset(str(tmp_path / 'data'), n_train=64, n_test=8)
    args = ['train.py', f'--data_path={data}', '--device=cpu', '--max_steps=1', '--hidden_size=32',
            '--num_heads=2', '--puzzle_emb_ndim=0', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=2',
            '--global_batch_size=8', '--forward_dtype=float32', '--loss_dtype=float32', '--xla_cache_dir=',
            '--log_interval=1']
    env = {'TRITON_INTERPRET': ''}
    for i, (extra, want) in enumerate((([], 'kernels auto: off (device cpu: the kernels are for CUDA GPUs)'),
                                       (['--kernels=triton'], "kernels warning: kernels='triton' runs on CUDA GPUs"),
                                       (['--kernels=quack'], "kernels warning: kernels='quack' runs on CUDA GPUs "
                                                             "only (quack-kernels' GEMMs), not on device cpu"))):
        p = run(args + [f'--out_dir={tmp_path}/o{i}'] + extra, env=env)
        first = next(l for l in p.stdout.splitlines() if l.startswith('device cpu'))
        assert want in first and 'Traceback' not in p.stdout + p.stderr, first
    p = run(args + [f'--out_dir={tmp_path}/bad', '--kernels=cuda'], check=False)
    assert p.returncode == 1 and ("kernels='cuda' (allowed: 'auto' | 'off' | 'mlp_t' | 'cudnn' | 'gated' | "
                                  "'quack' | 'triton')") in p.stderr, p.stderr
    # in the interpreter a forced 'mlp_t' (auto's pick on a Hopper GPU) trains and evaluates through its kernel,
    # the EMA's copy included
    p = run(args + [f'--out_dir={tmp_path}/interp', '--kernels=mlp_t'], env={'TRITON_INTERPRET': '1'})
    first = next(l for l in p.stdout.splitlines() if l.startswith('device cpu'))
    assert ("kernels mlp_t (as configured; Triton's interpreter on the CPU): mlp_t (forward and backward); the "
            "rest plain") in first, first
    assert any(l.startswith('eval on') for l in p.stdout.splitlines()), p.stdout[-2000:]


def test_without_triton_every_forced_kernels_value_trains_on_the_plain_path_said_in_one_line(tmp_path):
    """torch's CPU wheel brings no triton: each forced value, the interpreter's too, is one warning on the first
    line and the run trains and evaluates on the plain path, with no traceback. Where triton is installed, the runs
    here do not see it, as on that wheel."""
    data = make_reverse_dataset(str(tmp_path / 'data'), n_train=64, n_test=8)
    args = ['train.py', f'--data_path={data}', '--device=cpu', '--max_steps=1', '--hidden_size=32',
            '--num_heads=2', '--puzzle_emb_ndim=0', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=2',
            '--global_batch_size=8', '--forward_dtype=float32', '--loss_dtype=float32', '--xla_cache_dir=',
            '--log_interval=1']
    env = site_hook(tmp_path / 'hook', "sys.modules['triton'] = None  # what `import triton` finds: no such package\n")
    for which, interpret, extra in (('mlp_t', '1', []), ('gated', '', []), ('triton', '', []), ('quack', '', []),
                                    ('cudnn', '1', ['--mlp_t=False', '--pos_encodings=rope'])):
        p = run(args + [f'--out_dir={tmp_path}/{which}', f'--kernels={which}'] + extra,
                env=dict(env, TRITON_INTERPRET=interpret))
        first = next(l for l in p.stdout.splitlines() if l.startswith('device cpu'))
        assert (f"kernels warning: kernels='{which}' needs the triton package, which is not installed: plain path "
                "|") in first, first
        assert 'Traceback' not in p.stdout + p.stderr and any(l.startswith('eval on') for l in p.stdout.splitlines()), \
            p.stdout[-2000:] + p.stderr[-2000:]


@needs_triton
def test_the_gpu_script_s_dry_run_starts_every_stage_and_prints_the_table(tmp_path):
    """dev/gpu_speed.sh with DRY=1 and AB=gated: each stage at tiny shapes on the CPU (bench.py's kernels A/B,
    off then gated, on both models through the interpreter included), the reference's stages skipped where .gpu
    is absent, and the summary table last; the ops stage's sequence-major mlp_t equals the plain one."""
    env = dict(os.environ, DRY='1', AB='gated', OUT=str(tmp_path / 'out'), PY=sys.executable, OMP_NUM_THREADS='1')
    p = subprocess.run(['bash', 'dev/gpu_speed.sh'], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for stage in ('check', 'sudoku', 'train', 'ops', 'maze'):
        assert f'   {stage}: ok in' in p.stdout, (stage, p.stdout[-4000:])
    check = open(tmp_path / 'out' / 'check.txt').read()
    assert re.search(r'exactness: (\d+)/\1 ok', check) and 'FAIL' not in check, check
    # the ops stage's sequence-major mlp_t (timed as a layout the model might take) computes mlp_t's function
    major = re.search(r'sequence-major .*forward ([-+.e\d]+), d h ([-+.e\d]+)', check)
    assert major and max(float(major[1]), float(major[2])) < 1e-5, check[-3000:]
    assert 'kernels A/B: train' in open(tmp_path / 'out' / 'bench_sudoku.txt').read()
    assert 'kernels A/B: train' in open(tmp_path / 'out' / 'bench_maze.txt').read()
    table = p.stdout.rstrip().splitlines()[-6:]
    assert table[0].startswith('| workload | kernels on | ours, kernels off | ours, kernels on | reference'), table
    sudoku, maze = table[2].split(' | '), table[4].split(' | ')
    assert sudoku[0] == '| Sudoku MLP, batch 768, train (ms/step)' and sudoku[1] == 'gated', table
    assert maze[1] == 'gated', table
    assert all(float(v) > 0 for v in (sudoku[2], sudoku[3], maze[2], maze[3])), table
    assert len(os.listdir(tmp_path / 'out')) <= 8


def test_the_gpu_script_refuses_a_stage_or_kernels_value_it_does_not_know_before_any_stage(tmp_path):
    """A misspelt stage, A/B value or switch is said in one line before the first stage starts, not after the
    stages before it have spent the GPU session's time (or with every A/B stage refused by bench.py, every stage
    'not run' behind a bash error for a budget in minutes, a switch ignored)."""
    for extra, want in ((dict(STAGES='sudoku,ref-mlp'), "gpu_speed: STAGES names 'ref-mlp' (allowed: check, sudoku, "
                                                        "sudoku_all, ref_mlp, train, ops, maze, ref_maze, autotune)"),
                        (dict(STAGES='sudoku', AB='gatd'), "gpu_speed: AB='gatd' (allowed: auto, off, mlp_t, cudnn, "
                                                           "gated, quack, triton)"),
                        (dict(STAGES='maze', AB_MAZE='cudn'), "gpu_speed: AB_MAZE='cudn' (allowed: auto, off, "
                                                              "mlp_t, cudnn, gated, quack, triton)"),
                        (dict(STAGES='train', BUDGET_S='8m'), "gpu_speed: BUDGET_S='8m' (allowed: a whole number of "
                                                              "seconds)"),
                        (dict(STAGES='train', KNOBS='yes'), "gpu_speed: KNOBS='yes' (allowed: 0, 1)"),
                        (dict(STAGES='train', DRY='true'), "gpu_speed: DRY='true' (allowed: 0, 1)")):
        env = dict(os.environ, DRY='1', OUT=str(tmp_path / 'out'), PY=sys.executable, OMP_NUM_THREADS='1')
        env.update(extra)
        p = subprocess.run(['bash', 'dev/gpu_speed.sh'], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 1 and p.stderr.strip().splitlines() == [want], (extra, p.stdout[-2000:], p.stderr)
        assert '== ' not in p.stdout, (extra, p.stdout[-2000:])


def test_the_profile_summary_sums_the_gpu_kernels_by_kind(tmp_path):
    trace = tmp_path / 'trace.json'
    events = [dict(cat='kernel', name='_mlp_t_forward', ts=0, dur=30), dict(cat='kernel', name='_mlp_t_forward',
              ts=40, dur=30), dict(cat='kernel', name='sm90_xmma_gemm_bf16bf16', ts=70, dur=20),
              dict(cat='kernel', name='triton_poi_fused_add_0', ts=90, dur=10), dict(cat='cpu_op', name='aten::mm',
              ts=0, dur=500)]
    trace.write_text(json.dumps(dict(traceEvents=events)))
    p = run(['dev/kernels_check.py', 'profile', str(trace), str(tmp_path / 'top.txt')])
    text = (tmp_path / 'top.txt').read_text()
    assert '4 launches, 0.1 ms of kernel time over a 0.1 ms span (busy 90%)' in text, text
    assert re.search(r'kernels\.py +0\.06 ms +66\.7%', text) and 'cuBLAS GEMM' in text, text
    assert 'inductor Triton' in text and p.returncode == 0


def test_bench_refuses_a_kernels_ab_that_is_no_kernels_value_in_one_line():
    for value in ('fast', 'True'):  # True: the flag's old form, a switch
        p = run(['bench.py', '--device=cpu', f'--kernels_ab={value}'], check=False)
        want = (f"config error: kernels_ab='{value}' (allowed: '' (no A/B) | 'auto' | 'off' | 'mlp_t' | 'cudnn' | "
                f"'gated' | 'quack' | 'triton'), from --kernels_ab={value}")
        assert p.returncode == 1 and p.stderr.strip().splitlines() == [want], p.stderr


@needs_triton
def test_bench_times_an_attention_model_with_cudnn_s_attention_against_the_plain_path_in_one_run():
    """The Maze A/B of dev/gpu_speed.sh, tiny on the CPU: kernels=off, then kernels=cudnn on the same model, each
    timed and named on the A/B line and the bench: line."""
    p = run(['bench.py', 'config/maze.py', '--device=cpu', '--forward_dtype=float32', '--hidden_size=32',
             '--num_heads=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=2', '--global_batch_size=2',
             '--eval_batch_size=2', '--steps=1', '--warmup_steps=1', '--eval_batches=1', '--seq_len=16',
             '--puzzle_emb_len=2', '--puzzle_emb_ndim=32', '--kernels=off', '--kernels_ab=cudnn'],
            env={'TRITON_INTERPRET': '1'})
    ab = next(l for l in p.stdout.splitlines() if l.startswith('kernels A/B:'))
    assert "with kernels=cudnn" in ab and "attention through cuDNN's fused attention" in ab, ab
    assert re.search(r'\bkernels=off ab_kernels=cudnn ab_ms_per_step=[.\d]+ ', p.stdout), p.stdout[-2000:]
