"""
Fused Triton kernels for the Block's forward and backward on CUDA GPUs: train.py's and bench.py's key kernels
('auto' picks 'mlp_t' or 'off' where device.choose_kernels says why). model.py keeps the plain path a reader
sees; fuse_blocks(model, which) installs a fused forward as each Block's `fused` forward, which the Block then
runs: which='mlp_t' mlp_t's fused kernels (its forward, and its backward under grad), the rest plain, 'cudnn' an
attention model's attention through cuDNN's fused attention, 'gated' mlp_t's no-grad forward and the SwiGLUs'
gated GEMMs, 'quack' the same with quack-kernels' GEMMs (an optional package), 'triton' every Triton kernel below
(for experiments).

What is fused, and why. The kernels keep on chip the tensors the plain path writes to memory and reads back:
  - mlp_t (the SwiGLU over the sequence axis, Sudoku's MLP-mixer): one kernel per batch row and tile of channels
    reads h[b, :, d0:d0+BD], runs gate/up, silu(gate) * up and down over the whole sequence with the [rows, 2 x
    inter] intermediate in registers, adds the residual and applies the RMSNorm over the sequence axis, and
    writes the block's [B, L, D] layout back: no transpose, no padding copy, no intermediate in memory. Its
    backward (the grad calls of the recursion) is one kernel for the input's gradient, which recomputes gate and
    up and writes what the weight gradients need, then two matrix products (cuBLAS) for those.
  - the channel SwiGLU: a GEMM whose epilogue computes silu(gate) * up from gate and up tiles held by the same
    program. Without grad, [rows, 2 x inter] is never written, and the down GEMM takes the residual and the
    RMSNorm over D in its epilogue (a tile spans the whole width). Under grad the gated GEMM also writes gate and
    up, and the backward's first GEMM, ds = dy Wd, turns ds into gate's and up's gradients in its epilogue: the
    elementwise kernels around the GEMMs, and their reads and writes of [rows, inter]-sized tensors, are gone.
    With kernels='gated', mlp_t's SwiGLU under grad runs through the same GEMMs, on the transposed, padded
    sequence (rows b, d; K the padded length).
Rounding: each product's result is rounded to the activation dtype where the plain path's cuBLAS output is
(gate, up, the down product), so the fused path equals the plain one within that dtype's rounding.

Each kernel is a torch.library custom op with a fake (shape) implementation, and mlp_t's and gated_mlp's their
autograd formulas, so torch.compile keeps them in its graphs as single calls and inductor fuses what surrounds
them. With TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors: that is how the
tests check them on a machine without a GPU (in float32: the interpreter has no bfloat16).
This file imports triton: import it only where a kernels value other than 'off' was chosen (a CPU wheel of torch
has no triton).
"""
import ast
import hashlib
import inspect
import os
import textwrap

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import rms_norm

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'

# The tiles of the kernels that are no GEMM over rows. As with the GEMMs' below, Triton's autotuner times each
# candidate once per shape on a GPU and keeps the fastest; the interpreter takes the first. A tile's speed turns on
# the GPU and the shape in ways no rule predicts, so the candidates are those that build for Hopper without
# spilling registers or exceeding its shared memory (dev/kernels_check.py build; tests/test_kernels.py holds every
# candidate to that). BI divides mlp_t's inner width, a multiple of 256 (model.swiglu_inter).
MLP_T_CONFIGS = [dict(BD=128, BI=64, num_warps=8, num_stages=2),
                 dict(BD=128, BI=64, num_warps=8, num_stages=3),
                 dict(BD=128, BI=32, num_warps=8, num_stages=2),
                 dict(BD=128, BI=32, num_warps=16, num_stages=2),
                 dict(BD=64, BI=128, num_warps=8, num_stages=2),
                 dict(BD=64, BI=64, num_warps=8, num_stages=2),
                 dict(BD=64, BI=32, num_warps=8, num_stages=3)]
MLP_T_BACKWARD_CONFIGS = [dict(BD=64, BI=32, num_warps=8, num_stages=3),
                          dict(BD=64, BI=32, num_warps=8, num_stages=2),
                          dict(BD=64, BI=32, num_warps=4, num_stages=3),
                          dict(BD=128, BI=32, num_warps=8, num_stages=2),
                          dict(BD=128, BI=32, num_warps=8, num_stages=3)]
DOWN_NORM_CONFIGS = [dict(BM=64, BK=32, num_warps=16, num_stages=3),
                     dict(BM=64, BK=64, num_warps=16, num_stages=2)]
MAX_SEQ = 256    # mlp_t holds a tile's whole (padded) sequence: [BD, next power of 2 of L] in registers
MAX_WIDTH = 512  # down_norm holds a row tile's whole width: [BM, next power of 2 of D]


def _pow2(n):
    return max(16, triton.next_power_of_2(n))  # tl.dot wants every side a power of 2, at least 16


def _tuned(kernel, configs, key, prune=None):
    """kernel under Triton's autotuner over configs (dicts of its tile constants, warps and stages); prune(configs,
    named_args) narrows the candidates for a call."""
    return triton.autotune([triton.Config({k: v for k, v in c.items() if k not in ('num_warps', 'num_stages')},
                                          num_warps=c['num_warps'], num_stages=c['num_stages']) for c in configs],
                           key=key, prune_configs_by=dict(early_config_prune=prune) if prune else None)(kernel)


def _launch(tuned, configs, grid, *args, fit=None, **constants):
    """A launch of `tuned`'s kernel over grid(tiles): autotuned on a GPU; in the interpreter (which times nothing)
    with the first config, its tiles narrowed by fit(tiles) to the shape, as tiny shapes run faster so."""
    if INTERPRET:
        c = {k: v for k, v in configs[0].items() if k not in ('num_warps', 'num_stages')}
        c = fit(c) if fit else c
        tuned.fn[grid(c)](*args, **constants, **c)
    else:
        tuned[grid](*args, **constants)


def _precision(dtype):
    """tl.dot's input precision: float32 inputs multiply in float32 (tf32 would round them); for 16-bit inputs
    the option changes nothing."""
    return 'ieee' if dtype == torch.float32 else 'tf32'


# -----------------------------------------------------------------------------
# mlp_t: h [B, L, D] -> rms_L(h^T + swiglu_L(h^T))^T, one program per (batch row, tile of BD channels)

@triton.jit
def _mlp_t_forward(h_ptr, wg_ptr, wd_ptr, out_ptr, rstd_ptr, L, D, eps, I: tl.constexpr,
                   LP: tl.constexpr, BD: tl.constexpr, BI: tl.constexpr, PREC: tl.constexpr):
    io = out_ptr.dtype.element_ty
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    l = tl.arange(0, LP)
    i = tl.arange(0, BI)
    inside = (d[:, None] < D) & (l[None, :] < L)
    tile = b * L * D + l[None, :] * D + d[:, None]  # [BD, LP]: channel d's sequence, read in h's own layout
    x = tl.load(h_ptr + tile, mask=inside, other=0.0)
    acc = tl.zeros([BD, LP], dtype=tl.float32)
    for i0 in range(0, I, BI):
        # wg: [LP, 2I], gate columns then up columns, zero rows past L; wd: [I, LP], zero columns past L
        wg = tl.load(wg_ptr + l[:, None] * (2 * I) + (i0 + i)[None, :])
        wu = tl.load(wg_ptr + l[:, None] * (2 * I) + (I + i0 + i)[None, :])
        g = tl.dot(x, wg, input_precision=PREC).to(io).to(tl.float32)
        u = tl.dot(x, wu, input_precision=PREC).to(io).to(tl.float32)
        wd = tl.load(wd_ptr + (i0 + i)[:, None] * LP + l[None, :])
        acc += tl.dot((g * tl.sigmoid(g) * u).to(io), wd, input_precision=PREC)
    # past L and past D both terms are 0 (zero padding, zero weights): the sums see the true sequence only
    v = acc.to(io).to(tl.float32) + x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) / L + eps)
    tl.store(out_ptr + tile, (v * rstd[:, None]).to(io), mask=inside)
    tl.store(rstd_ptr + b * D + d, rstd, mask=d < D)


@triton.jit
def _mlp_t_backward(h_ptr, out_ptr, dout_ptr, rstd_ptr, wg_ptr, wd_ptr, dh_ptr, xr_ptr, dy_ptr, dgu_ptr, s_ptr, L,
                    D, I: tl.constexpr, LP: tl.constexpr, BD: tl.constexpr, BI: tl.constexpr, PREC: tl.constexpr):
    """The input's gradient dh, and for the weights' gradients (matrix products outside), by row (b, d): xr
    [B*D, LP], the sequences the forward multiplied; dy [B*D, LP], the gradient of the down product's output;
    s [B*D, I], silu(gate) * up; dgu [B*D, 2I], gate's and up's gradients (xr and dy zero past L: the products
    give the padded weights' gradients, aligned). Gate and up are recomputed from h, as the forward did."""
    io = dh_ptr.dtype.element_ty
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    l = tl.arange(0, LP)
    i = tl.arange(0, BI)
    inside = (d[:, None] < D) & (l[None, :] < L)
    tile = b * L * D + l[None, :] * D + d[:, None]
    x = tl.load(h_ptr + tile, mask=inside, other=0.0)
    r = tl.load(out_ptr + tile, mask=inside, other=0.0).to(tl.float32)
    dr = tl.load(dout_ptr + tile, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + b * D + d, mask=d < D, other=0.0)
    # out = v * rstd with v = h + y: dv = rstd * (dout - out * mean_L(dout * out)), 0 past L and D (r, dr are)
    dv = rstd[:, None] * (dr - r * (tl.sum(dr * r, axis=1) / L)[:, None])
    dy = dv.to(io)
    rows = (b * D + d)[:, None]  # the row (b, d) of xr, dy, s and dgu
    tl.store(dy_ptr + rows * LP + l[None, :], dy, mask=d[:, None] < D)
    tl.store(xr_ptr + rows * LP + l[None, :], x, mask=d[:, None] < D)
    dx = dv
    for i0 in range(0, I, BI):
        wg = tl.load(wg_ptr + l[:, None] * (2 * I) + (i0 + i)[None, :])
        wu = tl.load(wg_ptr + l[:, None] * (2 * I) + (I + i0 + i)[None, :])
        g = tl.dot(x, wg, input_precision=PREC).to(io).to(tl.float32)
        u = tl.dot(x, wu, input_precision=PREC).to(io).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(s_ptr + rows * I + (i0 + i)[None, :], (silu * u).to(io), mask=d[:, None] < D)
        wd = tl.load(wd_ptr + (i0 + i)[None, :] * LP + l[:, None])  # [LP, BI]: wd's transpose
        ds = tl.dot(dy, wd, input_precision=PREC).to(io).to(tl.float32)
        dg = (ds * u * sig * (1.0 + g * (1.0 - sig))).to(io)
        du = (ds * silu).to(io)
        tl.store(dgu_ptr + rows * (2 * I) + (i0 + i)[None, :], dg, mask=d[:, None] < D)
        tl.store(dgu_ptr + rows * (2 * I) + (I + i0 + i)[None, :], du, mask=d[:, None] < D)
        dx += tl.dot(dg, tl.trans(wg), input_precision=PREC)
        dx += tl.dot(du, tl.trans(wu), input_precision=PREC)
    tl.store(dh_ptr + tile, dx.to(io), mask=inside)


_mlp_t_tuned = _tuned(_mlp_t_forward, MLP_T_CONFIGS, ['L', 'D', 'I', 'LP'])
_mlp_t_backward_tuned = _tuned(_mlp_t_backward, MLP_T_BACKWARD_CONFIGS, ['L', 'D', 'I', 'LP'])


def _mlp_t_fit(D, I):
    return lambda t: dict(t, BD=min(t['BD'], _pow2(D)), BI=min(t['BI'], I))


@torch.library.custom_op('trm::mlp_t', mutates_args=())
def mlp_t(h: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, L, D], rstd [B, D] float32): the mlp_t branch of a Block with its residual and RMSNorm, from
    mlp_t_weights' wg [LP, 2I] and wd [I, LP]."""
    h, wg, wd = h.contiguous(), wg.contiguous(), wd.contiguous()
    B, L, D = h.shape
    I = wd.shape[0]
    out = torch.empty_like(h)
    rstd = torch.empty(B, D, dtype=torch.float32, device=h.device)
    _launch(_mlp_t_tuned, MLP_T_CONFIGS, lambda t: (B, triton.cdiv(D, t['BD'])), h, wg, wd, out, rstd, L, D, eps,
            I, LP=wg.shape[0], PREC=_precision(h.dtype), fit=_mlp_t_fit(D, I))
    return out, rstd


@mlp_t.register_fake
def _(h, wg, wd, eps):
    return torch.empty_like(h, memory_format=torch.contiguous_format), h.new_empty(h.shape[0], h.shape[2],
                                                                                    dtype=torch.float32)


@torch.library.custom_op('trm::mlp_t_backward', mutates_args=())
def mlp_t_backward(h: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, rstd: torch.Tensor, wg: torch.Tensor,
                   wd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mlp_t's gradients: (dh [B, L, D], dwg [LP, 2I], dwd [I, LP]), the weights' with zero padding."""
    h, out, dout, rstd, wg, wd = (t.contiguous() for t in (h, out, dout, rstd, wg, wd))
    B, L, D = h.shape
    LP, I = wg.shape[0], wd.shape[0]
    dh = torch.empty_like(h)
    xr, dy = h.new_empty(B * D, LP), h.new_empty(B * D, LP)
    dgu, s = h.new_empty(B * D, 2 * I), h.new_empty(B * D, I)
    _launch(_mlp_t_backward_tuned, MLP_T_BACKWARD_CONFIGS, lambda t: (B, triton.cdiv(D, t['BD'])), h, out, dout,
            rstd, wg, wd, dh, xr, dy, dgu, s, L, D, I, LP=LP, PREC=_precision(h.dtype), fit=_mlp_t_fit(D, I))
    return dh, xr.t() @ dgu, s.t() @ dy


@mlp_t_backward.register_fake
def _(h, out, dout, rstd, wg, wd):
    return torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(wg), torch.empty_like(wd)


def _mlp_t_setup(ctx, inputs, output):
    h, wg, wd, _ = inputs
    out, rstd = output
    ctx.save_for_backward(h, out, rstd, wg, wd)


def _mlp_t_grad(ctx, dout, _drstd):
    h, out, rstd, wg, wd = ctx.saved_tensors
    dh, dwg, dwd = mlp_t_backward(h, out, dout, rstd, wg, wd)
    return dh, dwg, dwd, None


mlp_t.register_autograd(_mlp_t_grad, setup_context=_mlp_t_setup)


def mlp_t_weights(block, dtype):
    """mlp_t's weights as the kernels read them: wg [LP, 2I] = gate_up's transpose, wd [I, LP] = down's
    transpose, each with zero padding from L to LP (a power of 2). Under torch.compile these few small ops are
    computed once per step for all of a block's calls."""
    gate_up, down = block.mlp_t.gate_up_proj.weight, block.mlp_t.down_proj.weight  # [2I, L], [L, I]
    LP = _pow2(gate_up.shape[1])
    pad = LP - gate_up.shape[1]
    wg = torch.nn.functional.pad(gate_up.to(dtype).t(), (0, 0, 0, pad))
    wd = torch.nn.functional.pad(down.to(dtype).t(), (0, pad))
    return wg.contiguous(), wd.contiguous()


# -----------------------------------------------------------------------------
# the channel SwiGLU: s = silu(x Wg^T) * (x Wu^T) in one GEMM (gated), then rms_D(residual + s Wd^T) in another
# (down_norm) where no gradient is taken; under grad, gated_mlp: the gated GEMM keeps gate and up for the
# backward, whose GEMM ds = dy Wd computes the gated gradient in its epilogue (dgated), so neither [rows, inter]
# nor [rows, 2 x inter] is written only to be read back by an elementwise kernel

# The GEMMs' candidate tiles, autotuned as mlp_t's and down_norm's are. TMA: the tiles move between global and
# shared memory through Hopper's tensor memory accelerator (descriptors built on the device) rather than through
# each thread's loads; offered on compute capability 9.0 or newer only. PERSIST (TMA's only): one program per SM,
# each looping over tiles, so that one tile's stores drain while the next tile's copies are in flight.
LOADS, TMA_TILES, TMA_PERSISTENT = (dict(TMA=False, PERSIST=False), dict(TMA=True, PERSIST=False),
                                   dict(TMA=True, PERSIST=True))
GATED_CONFIGS = [dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=3, **LOADS),
                 dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, **LOADS),
                 dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=4, **LOADS),
                 dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, **LOADS),
                 dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=3, **TMA_TILES),
                 dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, **TMA_TILES),
                 dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, **TMA_TILES),
                 dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=3, **TMA_PERSISTENT),
                 dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, **TMA_PERSISTENT)]
DGATED_CONFIGS = [dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, **LOADS),
                  dict(BM=128, BN=64, BK=64, num_warps=4, num_stages=4, **LOADS),
                  dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, **LOADS),
                  dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, **LOADS),
                  dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, **TMA_TILES),
                  dict(BM=128, BN=64, BK=64, num_warps=4, num_stages=4, **TMA_TILES),
                  dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, **TMA_TILES),
                  dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, **TMA_PERSISTENT),
                  dict(BM=128, BN=64, BK=64, num_warps=4, num_stages=4, **TMA_PERSISTENT)]
GROUP_M = tl.constexpr(8)  # row tiles consecutive tiles share, so a weight tile is reused from L2


@triton.jit
def _tile(t, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """Tile t's first row and first column: tiles walk GROUP_M row tiles down a column of tiles before the next
    column, so the weight tiles that programs running together read stay in L2."""
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first = t // (GROUP_M * n_n) * GROUP_M
    rows = tl.minimum(n_m - first, GROUP_M)
    pm = first + (t % (GROUP_M * n_n)) % rows
    pn = (t % (GROUP_M * n_n)) // rows
    return pm * BM, pn * BN


@triton.jit
def _rows_by_k(ptr, m, k, M, K: tl.constexpr, BK: tl.constexpr):
    """The [BM, BK] tile ptr[m, k] of a row-major [M, K] matrix, zero past M (and past K where BK does not
    divide it)."""
    if K % BK == 0:
        return tl.load(ptr + m[:, None] * K + k[None, :], mask=m[:, None] < M, other=0.0)
    return tl.load(ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k < K)[None, :], other=0.0)


@triton.jit
def _gated_forward(x_ptr, w_ptr, s_ptr, gu_ptr, M, I, K: tl.constexpr, KEEP: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                   PERSIST: tl.constexpr):
    """s [M, I] = silu(g) * u with g, u = x [M, K] times the gate and up rows of w [2I, K]; KEEP: also write
    gu [M, 2I] = [g, u], which the backward reads (the plain path's gate_up output, the same bits). BN divides
    I (fusable checks it), so only rows and K need masks; TMA's copies read zeros past the edges and write
    nothing there. With TMA each program loops over the tiles the grid's width apart: one tile each, or with
    PERSIST (a grid of one program per SM: _programs) several."""
    io = s_ptr.dtype.element_ty
    if TMA:
        x_tiles = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
        w_tiles = tl.make_tensor_descriptor(w_ptr, [2 * I, K], [K, 1], [BN, BK])
        s_tiles = tl.make_tensor_descriptor(s_ptr, [M, I], [I, 1], [BM, BN])
        if KEEP:  # (a constexpr: a name bound in the branch compiled stays bound below)
            gu_tiles = tl.make_tensor_descriptor(gu_ptr, [M, 2 * I], [2 * I, 1], [BM, BN])
        t = tl.program_id(0)
        while t < tl.cdiv(M, BM) * tl.cdiv(I, BN):
            m0, n0 = _tile(t, M, I, BM, BN)
            acc_g = tl.zeros([BM, BN], dtype=tl.float32)
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = x_tiles.load([m0, k0])
                acc_g = tl.dot(a, w_tiles.load([n0, k0]).T, acc_g, input_precision=PREC)
                acc_u = tl.dot(a, w_tiles.load([I + n0, k0]).T, acc_u, input_precision=PREC)
            g, u = acc_g.to(io), acc_u.to(io)
            if KEEP:
                gu_tiles.store([m0, n0], g)
                gu_tiles.store([m0, I + n0], u)
            g = g.to(tl.float32)
            s_tiles.store([m0, n0], (g * tl.sigmoid(g) * u.to(tl.float32)).to(io))
            t += tl.num_programs(0)
    else:
        tl.static_assert(not PERSIST, "the threads' loads run a tile per program")
        m0, n0 = _tile(tl.program_id(0), M, I, BM, BN)
        m, n, k = m0.to(tl.int64) + tl.arange(0, BM), n0 + tl.arange(0, BN), tl.arange(0, BK)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = _rows_by_k(x_ptr, m, k0 + k, M, K, BK)
            # gate rows n of w and the matching up rows, I further, as [BN, BK] tiles multiplied transposed
            wg = _rows_by_k(w_ptr, n, k0 + k, I, K, BK)
            wu = _rows_by_k(w_ptr + I * K, n, k0 + k, I, K, BK)
            acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PREC)
            acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PREC)
        rows = m[:, None] < M
        g, u = acc_g.to(io), acc_u.to(io)
        if KEEP:
            tl.store(gu_ptr + m[:, None] * (2 * I) + n[None, :], g, mask=rows)
            tl.store(gu_ptr + m[:, None] * (2 * I) + (I + n)[None, :], u, mask=rows)
        g = g.to(tl.float32)
        tl.store(s_ptr + m[:, None] * I + n[None, :], (g * tl.sigmoid(g) * u.to(tl.float32)).to(io), mask=rows)


@triton.jit
def _dgated_epilogue(acc, gu_ptr, dgu_ptr, m0, n0, M, I, BM: tl.constexpr, BN: tl.constexpr):
    """The gradient GEMM's tile of ds = acc into dgu's gate and up columns, read and written by the threads in
    the accumulator's layout, one of gate and up at a time (fewer registers live)."""
    io = dgu_ptr.dtype.element_ty
    m, n = m0.to(tl.int64) + tl.arange(0, BM), n0 + tl.arange(0, BN)
    rows = m[:, None] < M
    at = m[:, None] * (2 * I) + n[None, :]  # gate's column n of row m in gu and dgu; up's is I further
    ds = acc.to(io).to(tl.float32)
    g = tl.load(gu_ptr + at, mask=rows, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(dgu_ptr + at + I, (ds * silu).to(io), mask=rows)
    ds = ds * (sig + silu * (1.0 - sig))
    u = tl.load(gu_ptr + at + I, mask=rows, other=0.0).to(tl.float32)
    tl.store(dgu_ptr + at, (ds * u).to(io), mask=rows)


@triton.jit
def _dgated_backward(dy_ptr, wd_ptr, gu_ptr, dgu_ptr, M, I, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, PERSIST: tl.constexpr):
    """dgu [M, 2I] = [dg, du], the gradients of gate and up, from ds = dy [M, K] times wd [K, I] (the down
    weight, as stored) and gu [M, 2I]: ds is rounded as the plain path's product is, then
    du = ds * silu(g), dg = ds * u * silu'(g) in float32, silu'(g) = sig + silu(g) * (1 - sig). TMA moves the
    product's tiles only, looping as _gated_forward's do."""
    if TMA:
        dy_tiles = tl.make_tensor_descriptor(dy_ptr, [M, K], [K, 1], [BM, BK])
        wd_tiles = tl.make_tensor_descriptor(wd_ptr, [K, I], [I, 1], [BK, BN])
        t = tl.program_id(0)
        while t < tl.cdiv(M, BM) * tl.cdiv(I, BN):
            m0, n0 = _tile(t, M, I, BM, BN)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                acc = tl.dot(dy_tiles.load([m0, k0]), wd_tiles.load([k0, n0]), acc, input_precision=PREC)
            _dgated_epilogue(acc, gu_ptr, dgu_ptr, m0, n0, M, I, BM, BN)
            t += tl.num_programs(0)
    else:
        tl.static_assert(not PERSIST, "the threads' loads run a tile per program")
        m0, n0 = _tile(tl.program_id(0), M, I, BM, BN)
        m, n, k = m0.to(tl.int64) + tl.arange(0, BM), n0 + tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = _rows_by_k(dy_ptr, m, k0 + k, M, K, BK)
            if K % BK == 0:
                b = tl.load(wd_ptr + (k0 + k)[:, None] * I + n[None, :])
            else:
                b = tl.load(wd_ptr + (k0 + k)[:, None] * I + n[None, :], mask=(k0 + k < K)[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        _dgated_epilogue(acc, gu_ptr, dgu_ptr, m0, n0, M, I, BM, BN)


def _tma_where_it_runs(configs, named_args, **_):
    """The autotuner's candidates for a call: the TMA tiles only on compute capability 9.0 or newer, where every
    matrix starts and each of its rows begins 16-byte aligned (what a TMA copy reads)."""
    mats = [t for t in named_args.values() if isinstance(t, torch.Tensor)]
    tma = torch.cuda.get_device_capability(mats[0].device)[0] >= 9 and all(
        t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in mats)
    return [c for c in configs if tma or not c.kwargs['TMA']]


_gated_tuned = _tuned(_gated_forward, GATED_CONFIGS, ['M', 'I', 'K', 'KEEP'], prune=_tma_where_it_runs)
_dgated_tuned = _tuned(_dgated_backward, DGATED_CONFIGS, ['M', 'I', 'K'], prune=_tma_where_it_runs)


def _tma_scratch(size, alignment, stream):
    """Global memory for the TMA descriptors the kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device='cuda')


def _programs(M, N, tiles, device):
    """The grid of a GEMM over [M, N] with `tiles`: a program per tile, or with PERSIST one per SM (in the
    interpreter, 3: each then loops over several tiles)."""
    n = triton.cdiv(M, tiles['BM']) * triton.cdiv(N, tiles['BN'])
    if not tiles['PERSIST']:
        return (n,)
    return (min(n, torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 3),)


def _gemm(tuned, configs, M, N, *args, **constants):
    """A GEMM's launch over [M, N] tiles."""
    device = args[0].device
    if not INTERPRET:
        triton.set_allocator(_tma_scratch)  # per call: the allocator is per thread, and autograd's is another
    _launch(tuned, configs, lambda t: _programs(M, N, t, device), *args, **constants)


def _aligned(t):
    """t contiguous and starting 16-byte aligned, as a TMA copy reads it (a view into a tensor may start
    anywhere): the autotuner keeps its pick per shape, not per address."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _gated(x, w, keep):
    x, w = _aligned(x), _aligned(w)
    M, K = x.shape
    I = w.shape[0] // 2
    s = x.new_empty(M, I)
    gu = x.new_empty(M, 2 * I) if keep else s  # unread without KEEP
    _gemm(_gated_tuned, GATED_CONFIGS, M, I, x, w, s, gu, M, I, K=K, KEEP=keep,
          PREC=_precision(x.dtype))
    return s, gu


@torch.library.custom_op('trm::swiglu', mutates_args=())
def swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for x [M, K] and w [2I, K] = [gate; up]: [M, I]."""
    return _gated(x, w, keep=False)[0]


@swiglu.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0] // 2)


@torch.library.custom_op('trm::gated_mlp', mutates_args=())
def gated_mlp(x: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """A SwiGLU under grad (the channel one; with kernels='gated' mlp_t's too), x [M, K], wgu [2I, K], wd [D, I]:
    (y = s @ wd^T [M, D], s [M, I], gu [M, 2I]); s and gu are what the backward reads, not for the caller."""
    s, gu = _gated(x, wgu, keep=True)
    return s @ wd.t(), s, gu


@gated_mlp.register_fake
def _(x, wgu, wd):
    I = wgu.shape[0] // 2
    return x.new_empty(x.shape[0], wd.shape[0]), x.new_empty(x.shape[0], I), x.new_empty(x.shape[0], 2 * I)


@torch.library.custom_op('trm::dgated', mutates_args=())
def dgated(dy: torch.Tensor, wd: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """[dg, du] [M, 2I] from the down product's gradient dy [M, D], wd [D, I] and gu [M, 2I] (gated_mlp's)."""
    dy, wd = _aligned(dy), _aligned(wd)
    M, D = dy.shape
    I = wd.shape[1]
    dgu = torch.empty_like(gu)
    _gemm(_dgated_tuned, DGATED_CONFIGS, M, I, dy, wd, _aligned(gu), dgu, M, I, K=D,
          PREC=_precision(dy.dtype))
    return dgu


@dgated.register_fake
def _(dy, wd, gu):
    return torch.empty_like(gu)


def _gated_mlp_setup(ctx, inputs, output):
    x, wgu, wd = inputs
    _, s, gu = output
    ctx.save_for_backward(x, wgu, wd, s, gu)


def _gated_mlp_grad(ctx, dy, _ds, _dgu):
    x, wgu, wd, s, gu = ctx.saved_tensors
    dy = dy.contiguous()
    dgu = dgated(dy, wd, gu)
    return dgu @ wgu, dgu.t() @ x, dy.t() @ s  # the same three products as the plain path's backward


gated_mlp.register_autograd(_gated_mlp_grad, setup_context=_gated_mlp_setup)


@triton.jit
def _down_norm_forward(s_ptr, w_ptr, res_ptr, out_ptr, M, D, eps, K: tl.constexpr, BM: tl.constexpr,
                       DP: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    io = out_ptr.dtype.element_ty
    m = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    n = tl.arange(0, DP)
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(s_ptr + m[:, None] * K + (k0 + k)[None, :], mask=(m[:, None] < M) & (k0 + k < K)[None, :],
                    other=0.0)
        w = tl.load(w_ptr + n[None, :] * K + (k0 + k)[:, None], mask=(k0 + k < K)[:, None] & (n < D)[None, :],
                    other=0.0)  # w's transpose: [k, n] = w[n, k]
        acc = tl.dot(a, w, acc, input_precision=PREC)
    inside = (m[:, None] < M) & (n < D)[None, :]
    rows = m[:, None] * D + n[None, :]
    # past D both terms are 0 (zero padding): the mean sees the true width only
    v = acc.to(io).to(tl.float32) + tl.load(res_ptr + rows, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
    tl.store(out_ptr + rows, (v * rstd[:, None]).to(io), mask=inside)


_down_norm_tuned = _tuned(_down_norm_forward, DOWN_NORM_CONFIGS, ['M', 'D', 'K'])


@torch.library.custom_op('trm::down_norm', mutates_args=())
def down_norm(s: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(residual + s @ w^T) over the last axis, for s [M, I], w [D, I], residual [M, D]: [M, D]."""
    s, residual = s.contiguous(), residual.contiguous()
    M, K = s.shape
    D = w.shape[0]
    out = torch.empty_like(residual)
    _launch(_down_norm_tuned, DOWN_NORM_CONFIGS, lambda t: (triton.cdiv(M, t['BM']),), s, w.contiguous(), residual,
            out, M, D, eps, K, DP=_pow2(D), PREC=_precision(s.dtype),
            fit=lambda t: dict(t, BM=min(t['BM'], _pow2(M)), BK=min(t['BK'], _pow2(K))))
    return out


@down_norm.register_fake
def _(s, w, residual, eps):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


# -----------------------------------------------------------------------------
# the same SwiGLU GEMMs from quack-kernels (kernels='quack'): NVIDIA CuTe DSL GEMMs for Hopper and Blackwell, whose
# epilogues compute silu(gate) * up (gemm_gated) and, in the backward's ds = dy Wd, gate's and up's gradients
# (gemm_dgated), in place of the Triton tiles above, which run those GEMMs slower than cuBLAS runs the bare
# products. quack holds gate and up interleaved, as columns g0, u0, g1, u1, ...: the weight's rows are interleaved
# for it (a copy of the weight, not of the activations) and its gradient's rows put back in [gate; up] order. The
# saved pre-activations stay interleaved; only quack's own kernels read them. quack is an optional package, imported
# where kernels='quack' was chosen (fuse_blocks), never on a CPU.

QUACK_TUNED = False  # True: quack's autotuner compiles and times each candidate tile per shape; False: its default


def load_quack():
    """quack's gemm_gated and gemm_dgated, or ImportError saying what is missing or broken."""
    try:
        from quack.gemm_interface import gemm_dgated, gemm_gated
        # the first GEMM with an activation imports its epilogues, where a broken install fails: said here, not there
        import quack.epilogue.library  # noqa: F401
    except Exception as e:
        raise ImportError(f"kernels='quack' needs the quack-kernels package and its CUDA 12.9+ CuTe DSL "
                          f"(pip install quack-kernels): {type(e).__name__}: {e}") from e
    return gemm_gated, gemm_dgated


def interleave(w):
    """[2I, K] rows [gate; up] -> rows g0, u0, g1, u1, ... (quack's order)."""
    return w.reshape(2, w.shape[0] // 2, -1).transpose(0, 1).reshape(w.shape)


def deinterleave(w):
    """interleave's inverse: rows g0, u0, g1, u1, ... -> [gate; up]."""
    return w.reshape(w.shape[0] // 2, 2, -1).transpose(0, 1).reshape(w.shape)


@torch.library.custom_op('trm::quack_swiglu', mutates_args=())
def quack_swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """swiglu through quack: silu(x @ gate^T) * (x @ up^T) for x [M, K], w [2I, K] = [gate; up]: [M, I]."""
    gemm_gated, _ = load_quack()
    return gemm_gated(x.contiguous(), interleave(w).t(), activation='swiglu', store_preact=False,
                      tuned=QUACK_TUNED)[1]


@quack_swiglu.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0] // 2)


@torch.library.custom_op('trm::quack_gated_mlp', mutates_args=())
def quack_gated_mlp(x: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_mlp through quack: (y = s @ wd^T [M, D], gu [M, 2I] interleaved, for the backward only)."""
    gemm_gated, _ = load_quack()
    gu, s = gemm_gated(x.contiguous(), interleave(wgu).t(), activation='swiglu', tuned=QUACK_TUNED)
    return s @ wd.t(), gu


@quack_gated_mlp.register_fake
def _(x, wgu, wd):
    return x.new_empty(x.shape[0], wd.shape[0]), x.new_empty(x.shape[0], wgu.shape[0])


@torch.library.custom_op('trm::quack_dgated', mutates_args=())
def quack_dgated(dy: torch.Tensor, wd: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgu [M, 2I] interleaved, s [M, I] recomputed) from dy [M, D], wd [D, I] and quack_gated_mlp's gu."""
    _, gemm_dgated = load_quack()
    dgu, s = gemm_dgated(dy.contiguous(), wd.contiguous(), gu, activation='swiglu', tuned=QUACK_TUNED)
    return dgu, s


@quack_dgated.register_fake
def _(dy, wd, gu):
    return torch.empty_like(gu), gu.new_empty(gu.shape[0], gu.shape[1] // 2)


def _quack_gated_mlp_setup(ctx, inputs, output):
    x, wgu, wd = inputs
    ctx.save_for_backward(x, wgu, wd, output[1])


def _quack_gated_mlp_grad(ctx, dy, _dgu):
    x, wgu, wd, gu = ctx.saved_tensors
    dgu, s = quack_dgated(dy, wd, gu)  # s is recomputed in the epilogue: the forward kept only gu
    return dgu @ interleave(wgu), deinterleave(dgu.t() @ x), dy.t() @ s


quack_gated_mlp.register_autograd(_quack_gated_mlp_grad, setup_context=_quack_gated_mlp_setup)


def check_quack(device, dtype):
    """quack's gated GEMMs once, forward and backward, on small tensors of this device against the plain
    products: RuntimeError where its JIT compiler or kernels fail here or disagree, so that a run falls back to the
    plain path before its first step rather than failing in it. Its own random generator: the run's is untouched."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, wgu, wd, dy = (torch.randn(*shape, generator=gen, device=device) / 4 for shape in
                      ((256, 128), (512, 128), (128, 256), (256, 128)))
    fused = [t.to(dtype).detach().requires_grad_(True) for t in (x, wgu, wd)]
    plain = [t.detach().clone().requires_grad_(True) for t in (x, wgu, wd)]
    with torch.enable_grad():  # fuse_blocks may be called under no_grad (evaluation, solve.py)
        try:
            with torch.no_grad():
                s = quack_swiglu(fused[0], fused[1])
            y = quack_gated_mlp(*fused)[0]
            y.float().backward(dy)
        except Exception as e:
            raise RuntimeError(f"quack's gated GEMMs failed on a {device} tensor: {type(e).__name__}: "
                               f"{str(e)[:200]}") from e
        gate, up = (plain[0] @ plain[1].t()).chunk(2, dim=-1)
        s_plain = torch.nn.functional.silu(gate) * up
        y_plain = s_plain @ plain[2].t()
        y_plain.backward(dy)
    for name, a, b in zip(('swiglu', 'output', 'd x', 'd gate_up', 'd down'), [s, y] + [t.grad for t in fused],
                          [s_plain, y_plain] + [t.grad for t in plain]):
        err = float((a.detach().float() - b.detach()).norm() / b.detach().norm())
        if not err < 0.02:  # bfloat16 keeps 8 significant bits: 2^-8, about 0.004, per value
            raise RuntimeError(f"quack's gated GEMMs disagree with the plain products here ({name}: relative "
                               f"error {err:.3g})")


# -----------------------------------------------------------------------------
# attention through cuDNN's fused attention (kernels='cudnn'): the plain path's scaled_dot_product_attention call,
# with SDPA's cuDNN backend first in its priority order for that call and the others after it, so that a shape
# cuDNN does not take runs as before. torch.compile keeps the preference: dynamo records sdpa_kernel's context in
# its graph, and SDPA's backend is chosen as the graph is traced. On the CPU (the tests, in the interpreter) the
# order changes nothing: CPU attention has no cuDNN backend.

CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


def cudnn_attention(block, h, rope):
    """block.self_attn(h, rope) (model.py's Attention) with cuDNN's attention preferred."""
    with sdpa_kernel(CUDNN_FIRST, set_priority=True):
        return block.self_attn(h, rope)


def cudnn_why_not(block, seq_len, device, dtype):
    """'' where cuDNN's fused attention takes this block's attention (its heads, head width, dtype, the [B, heads,
    S, head_dim] views of the [B, S, heads, head_dim] projections, a gradient) on this CUDA device, else why not."""
    attn = block.self_attn
    q, k, v = (torch.empty(2, seq_len, attn.num_heads, attn.head_dim, device=device, dtype=dtype,
                           requires_grad=True).transpose(1, 2) for _ in range(3))
    if torch.backends.cuda.can_use_cudnn_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)):
        return ''
    return (f"cuDNN's fused attention does not take {attn.num_heads} heads of width {attn.head_dim} in {dtype} here "
            f"(torch.backends.cuda.can_use_cudnn_attention; cuDNN {torch.backends.cudnn.version()})")


# -----------------------------------------------------------------------------
# the Block's fused forward

def gated_swiglu(mlp, x, pad=0, quack=False):
    """SwiGLU.forward (model.py) through gated_mlp (quack_gated_mlp with quack=True), for calls under grad:
    x [..., d + pad], the weights padded with zeros as SwiGLU pads them, the padded outputs cut off."""
    w_gu, w_d = mlp.gate_up_proj.weight.to(x.dtype), mlp.down_proj.weight.to(x.dtype)
    if pad:
        w_gu, w_d = torch.nn.functional.pad(w_gu, (0, pad)), torch.nn.functional.pad(w_d, (0, 0, 0, pad))
    y = (quack_gated_mlp if quack else gated_mlp)(x.reshape(-1, x.shape[-1]), w_gu, w_d)[0].view(x.shape)
    return y[..., :y.shape[-1] - pad] if pad else y


def mix_sequence_gated(block, h, quack=False):
    """Block.mix_sequence (model.py) with mlp_t's SwiGLU through the gated GEMMs, for calls under grad."""
    ht = h.transpose(1, 2)
    x = torch.nn.functional.pad(ht, (0, block.seq_pad)) if block.seq_pad else ht
    return rms_norm(ht + gated_swiglu(block.mlp_t, x, block.seq_pad, quack), block.eps).transpose(1, 2)


def block_forward(block, h, rope, which='triton'):
    """Block.forward (model.py) with `which`'s fused kernels:
      'mlp_t'  mlp_t's fused kernel (forward, and backward under grad); everything else plain.
      'gated'  'mlp_t', and the SwiGLUs' gated GEMMs: under grad both SwiGLUs (mlp_t's over the sequence, the
               channel one) through gated_mlp, whose GEMMs compute the SwiGLU and its gradient in their
               epilogues; without grad the channel one as swiglu then down_norm (the residual and the RMSNorm in
               the down GEMM's epilogue, where a tile holds the width).
      'quack'  'gated' with quack's gated GEMMs (quack_gated_mlp, quack_swiglu) in place of the Triton ones.
      'triton' every kernel: 'gated' with mlp_t's fused kernel under grad too, as 'mlp_t' runs it.
      'cudnn'  an attention block's attention through cuDNN's fused attention (cudnn_attention); the rest plain.
    Attention stays the plain path's but with 'cudnn'."""
    grad, quack = torch.is_grad_enabled(), which == 'quack'
    if hasattr(block, 'mlp_t') and (which in ('mlp_t', 'triton') or not grad):
        h = mlp_t(h, *mlp_t_weights(block, h.dtype), block.eps)[0]
    elif hasattr(block, 'mlp_t') and which in ('gated', 'quack'):
        h = mix_sequence_gated(block, h, quack)
    elif hasattr(block, 'mlp_t'):
        h = block.mix_sequence(h)
    else:
        attn = cudnn_attention(block, h, rope) if which == 'cudnn' else block.self_attn(h, rope)
        h = rms_norm(h + attn, block.eps)
    if which in ('mlp_t', 'cudnn'):
        return rms_norm(h + block.mlp(h), block.eps)
    if grad:
        return rms_norm(h + gated_swiglu(block.mlp, h, quack=quack), block.eps)
    B, L, D = h.shape
    x = h.reshape(B * L, D)
    w_gu, w_d = block.mlp.gate_up_proj.weight.to(h.dtype), block.mlp.down_proj.weight.to(h.dtype)
    s = (quack_swiglu if quack else swiglu)(x, w_gu)
    if D > MAX_WIDTH:
        return rms_norm(h + (s @ w_d.t()).view(B, L, D), block.eps)
    return down_norm(s, w_d, x, block.eps).view(B, L, D)


FORWARDS = dict(mlp_t=lambda block, h, rope: block_forward(block, h, rope, 'mlp_t'),
                cudnn=lambda block, h, rope: block_forward(block, h, rope, 'cudnn'),
                gated=lambda block, h, rope: block_forward(block, h, rope, 'gated'),
                quack=lambda block, h, rope: block_forward(block, h, rope, 'quack'),
                triton=block_forward)


# The fused forwards compute model.py's Block again, each in its own way: its tensors and the code below. A fork
# that gives the Block another tensor or module, or edits that code, changes the function they must equal; until
# they follow, the block runs the plain path (fusable says why). PLAIN_PATH is the fingerprint of the code the
# kernels were written for and checked against (tests/test_kernels.py): to change one is to change the other.
PLAIN_TENSORS = {'mlp_t.gate_up_proj.weight', 'mlp_t.down_proj.weight', 'self_attn.qkv_proj.weight',
                 'self_attn.o_proj.weight', 'mlp.gate_up_proj.weight', 'mlp.down_proj.weight'}
PLAIN_PATH = 'f3091bcba43ca87d'


def plain_path(block):
    """The fingerprint of the code block's plain forward runs: Block.forward and mix_sequence, SwiGLU's and
    CastedLinear's forwards, rms_norm; their syntax, without comments, docstrings and layout."""
    parts = []
    for fn in (type(block).forward, type(block).mix_sequence, type(block.mlp).forward,
               type(block.mlp.gate_up_proj).forward, rms_norm):
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
            else node.body
        parts.append(ast.dump(node.args) + ''.join(ast.dump(n) for n in body))
    return hashlib.sha256('\n'.join(parts).encode()).hexdigest()[:16]


def fusable(block, which='triton'):
    """'' where `which`'s fused forward runs this block, else why not (a tensor, module or code of the Block that
    they do not compute; no mlp_t to fuse, a sequence past what mlp_t's tile holds, an inner width the gated
    GEMMs' column tiles do not divide; for quack's, a width that is no multiple of 8: its GEMMs read 16-byte
    rows)."""
    others = [n for n, _ in block.named_children() if n not in ('mlp_t', 'self_attn', 'mlp')] + \
        sorted({n for n, _ in [*block.named_parameters(), *block.named_buffers()]} - PLAIN_TENSORS)
    if others:
        return (f"the Block holds {', '.join(others)}, which backends/kernels.py's fused forwards do not run "
                "(make them run it, or leave the kernels off)")
    try:
        fingerprint = plain_path(block)
    except (OSError, TypeError, SyntaxError) as e:  # no source to read (a frozen or interactive model)
        fingerprint = f'unreadable ({e})'
    if fingerprint != PLAIN_PATH:
        return (f"model.py's Block code (its forward or mix_sequence, SwiGLU's or CastedLinear's forward, rms_norm: "
                f"fingerprint {fingerprint}) is not what backends/kernels.py's fused forwards compute ({PLAIN_PATH}): "
                "make them follow it and set PLAIN_PATH, or leave the kernels off")
    if which == 'mlp_t' and not hasattr(block, 'mlp_t'):
        return "the model mixes the sequence with attention, not mlp_t"
    if which == 'cudnn':
        return "the model mixes the sequence with mlp_t, not attention" if hasattr(block, 'mlp_t') else ''
    if hasattr(block, 'mlp_t') and block.mlp_t.down_proj.weight.shape[0] > MAX_SEQ:
        return f"mlp_t over {block.mlp_t.down_proj.weight.shape[0]} positions (at most {MAX_SEQ})"
    widest = max(c['BN'] for c in GATED_CONFIGS + DGATED_CONFIGS)
    inner = [m.down_proj.weight.shape[1] for m in (getattr(block, 'mlp_t', None), block.mlp) if m is not None]
    if which == 'quack':  # every width its GEMMs see: the inner ones, D, and mlp_t's padded sequence
        widths = inner + [block.mlp.gate_up_proj.weight.shape[1]]
        if hasattr(block, 'mlp_t'):
            widths.append(block.mlp_t.gate_up_proj.weight.shape[1] + block.seq_pad)
        if any(w % 8 for w in widths):
            return f"a SwiGLU's widths ({widths}) are no multiples of 8 (quack's GEMMs read 16-byte rows)"
        return ''
    if which != 'mlp_t' and any(i % widest for i in inner):
        return f"a SwiGLU's inner width ({inner}) is no multiple of {widest} (the gated GEMMs' tiles)"
    return ''


def fuse_blocks(model, which='triton'):
    """Each Block of model runs which's fused forward ('mlp_t', 'cudnn', 'gated', 'quack', 'triton':
    block_forward) or, with 'off', the plain forward again. Returns what was fused, or why nothing was; 'quack'
    raises ImportError where quack does not load, RuntimeError where its kernels fail on the model's device
    (check_quack)."""
    blocks = list(model.net.layers)
    why = fusable(blocks[0], which) if which != 'off' else 'off'
    device = blocks[0].mlp.down_proj.weight.device
    if which == 'cudnn' and not why and device.type == 'cuda':
        why = cudnn_why_not(blocks[0], model.config.total_len, device, model.forward_dtype)
    if which == 'quack' and not why:  # here, not at the first step: a failure is one line before the run
        load_quack()
        check_quack(device, model.forward_dtype)
    for block in blocks:
        block.fused = None if why else FORWARDS[which]
    if why:
        return f"none fused: {why}"
    if which == 'cudnn':
        return "attention through cuDNN's fused attention (SDPA's cuDNN backend first); the rest plain"
    gemms = "quack's gated GEMMs" if which == 'quack' else 'gated GEMMs'
    mlp_t_part = ('mlp_t (forward and backward)' if which in ('mlp_t', 'triton') else
                  f'mlp_t forward (no-grad), under grad {gemms}') if hasattr(blocks[0], 'mlp_t') else 'attention plain'
    return mlp_t_part + ('; the rest plain' if which == 'mlp_t' else
                         f'; channel SwiGLU ({gemms}, forward and backward)')
