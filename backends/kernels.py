"""
Fused Triton kernels for the Block's forward and backward on CUDA GPUs: train.py's and bench.py's key kernels
('auto' picks 'mlp_t' or 'off' where device.choose_kernels says why). model.py keeps the plain path a reader
sees; fuse_blocks(model, which) installs a fused forward as each Block's `fused` forward, which the Block then
runs: which='triton' every kernel below (for experiments), which='mlp_t' only mlp_t's forward where no gradient
is taken (the no-grad calls of the recursion, evaluation), everything else on the plain path.

What is fused, and why. The kernels keep on chip the tensors the plain path writes to memory and reads back:
  - mlp_t (the SwiGLU over the sequence axis, Sudoku's MLP-mixer): one kernel per batch row and tile of channels
    reads h[b, :, d0:d0+BD], runs gate/up, silu(gate) * up and down over the whole sequence with the [rows, 2 x
    inter] intermediate in registers, adds the residual and applies the RMSNorm over the sequence axis, and
    writes the block's [B, L, D] layout back: no transpose, no padding copy, no intermediate in memory. Its
    backward (the grad calls of the recursion) is one kernel for the input's gradient, which recomputes gate and
    up and writes what the weight gradients need, then two matrix products (cuBLAS) for those.
  - the channel SwiGLU, forward only (the no-grad calls and evaluation): a GEMM whose epilogue computes
    silu(gate) * up from gate and up tiles held by the same program, so [rows, 2 x inter] is never written; then
    the down GEMM with the residual and the RMSNorm over D in its epilogue (a tile spans the whole width).
Rounding: each product's result is rounded to the activation dtype where the plain path's cuBLAS output is
(gate, up, the down product), so the fused path equals the plain one within that dtype's rounding.

Each kernel is a torch.library custom op with a fake (shape) implementation, and mlp_t's its autograd formula, so
torch.compile keeps them in its graphs as single calls and inductor fuses what surrounds them. With
TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors: that is how the tests check
them on a machine without a GPU (in float32: the interpreter has no bfloat16).
This file imports triton: import it only where kernels='triton' or 'mlp_t' was chosen (a CPU wheel of torch has
no triton).
"""
import os

import torch
import triton
import triton.language as tl

from model import rms_norm

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'

# tile sizes and warps of each kernel (dev/kernels_check.py may try others)
TILES = dict(mlp_t=dict(BD=128, BI=64, num_warps=8, num_stages=2),
             mlp_t_backward=dict(BD=64, BI=32, num_warps=8, num_stages=2),
             swiglu=dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=4),
             down_norm=dict(BM=64, BK=32, num_warps=16, num_stages=3))
MAX_SEQ = 256    # mlp_t holds a tile's whole (padded) sequence: [BD, next power of 2 of L] in registers
MAX_WIDTH = 512  # down_norm holds a row tile's whole width: [BM, next power of 2 of D]


def _pow2(n):
    return max(16, triton.next_power_of_2(n))  # tl.dot wants every side a power of 2, at least 16


def _launch(kernel, grid, *args, **tiles):
    """A kernel launch; the interpreter takes no warps or stages."""
    if INTERPRET:
        tiles = {k: v for k, v in tiles.items() if k not in ('num_warps', 'num_stages')}
    kernel[grid](*args, **tiles)


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


@torch.library.custom_op('trm::mlp_t', mutates_args=())
def mlp_t(h: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, L, D], rstd [B, D] float32): the mlp_t branch of a Block with its residual and RMSNorm, from
    mlp_t_weights' wg [LP, 2I] and wd [I, LP]."""
    h, wg, wd = h.contiguous(), wg.contiguous(), wd.contiguous()
    B, L, D = h.shape
    I = wd.shape[0]
    t = TILES['mlp_t']
    out = torch.empty_like(h)
    rstd = torch.empty(B, D, dtype=torch.float32, device=h.device)
    BD = min(t['BD'], _pow2(D))
    _launch(_mlp_t_forward, (B, triton.cdiv(D, BD)), h, wg, wd, out, rstd, L, D, eps, I,
            LP=wg.shape[0], BD=BD, BI=min(t['BI'], I), PREC=_precision(h.dtype), num_warps=t['num_warps'],
            num_stages=t['num_stages'])
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
    t = TILES['mlp_t_backward']
    dh = torch.empty_like(h)
    xr, dy = h.new_empty(B * D, LP), h.new_empty(B * D, LP)
    dgu, s = h.new_empty(B * D, 2 * I), h.new_empty(B * D, I)
    BD = min(t['BD'], _pow2(D))
    _launch(_mlp_t_backward, (B, triton.cdiv(D, BD)), h, out, dout, rstd, wg, wd, dh, xr, dy, dgu, s, L, D, I,
            LP=LP, BD=BD, BI=min(t['BI'], I), PREC=_precision(h.dtype), num_warps=t['num_warps'],
            num_stages=t['num_stages'])
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
# the channel SwiGLU: s = silu(x Wg^T) * (x Wu^T) in one GEMM, then rms_D(residual + s Wd^T) in another

@triton.jit
def _swiglu_forward(x_ptr, w_ptr, s_ptr, M, I, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, PREC: tl.constexpr):
    io = s_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BN)
    m = (pid // n_tiles).to(tl.int64) * BM + tl.arange(0, BM)  # consecutive programs share a row tile
    n = (pid % n_tiles) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptr + m[:, None] * K + (k0 + k)[None, :], mask=(m[:, None] < M) & (k0 + k < K)[None, :],
                    other=0.0)
        # gate rows n of w and the matching up rows, I further, both read transposed: [k, n] = w[n, k]
        w_mask = (k0 + k < K)[:, None] & (n < I)[None, :]
        wg = tl.load(w_ptr + n[None, :] * K + (k0 + k)[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_ptr + (I + n)[None, :] * K + (k0 + k)[:, None], mask=w_mask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    g = acc_g.to(io).to(tl.float32)
    u = acc_u.to(io).to(tl.float32)
    tl.store(s_ptr + m[:, None] * I + n[None, :], (g * tl.sigmoid(g) * u).to(io),
             mask=(m[:, None] < M) & (n < I)[None, :])


@torch.library.custom_op('trm::swiglu', mutates_args=())
def swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for x [M, K] and w [2I, K] = [gate; up]: [M, I]."""
    x = x.contiguous()
    M, K = x.shape
    I = w.shape[0] // 2
    t = TILES['swiglu']
    BM, BN, BK = min(t['BM'], _pow2(M)), min(t['BN'], _pow2(I)), min(t['BK'], _pow2(K))
    s = x.new_empty(M, I)
    _launch(_swiglu_forward, (triton.cdiv(M, BM) * triton.cdiv(I, BN),), x, w.contiguous(), s, M, I, K,
            BM=BM, BN=BN, BK=BK, PREC=_precision(x.dtype), num_warps=t['num_warps'], num_stages=t['num_stages'])
    return s


@swiglu.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0] // 2)


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


@torch.library.custom_op('trm::down_norm', mutates_args=())
def down_norm(s: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(residual + s @ w^T) over the last axis, for s [M, I], w [D, I], residual [M, D]: [M, D]."""
    s, residual = s.contiguous(), residual.contiguous()
    M, K = s.shape
    D = w.shape[0]
    t = TILES['down_norm']
    BM, BK = min(t['BM'], _pow2(M)), min(t['BK'], _pow2(K))
    out = torch.empty_like(residual)
    _launch(_down_norm_forward, (triton.cdiv(M, BM),), s, w.contiguous(), residual, out, M, D, eps, K,
            BM=BM, DP=_pow2(D), BK=BK, PREC=_precision(s.dtype), num_warps=t['num_warps'],
            num_stages=t['num_stages'])
    return out


@down_norm.register_fake
def _(s, w, residual, eps):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


# -----------------------------------------------------------------------------
# the Block's fused forward

def block_forward(block, h, rope, everything=True):
    """Block.forward (model.py) with the fused kernels where they apply. everything=True: mlp_t always (its
    autograd is the kernels'), the channel SwiGLU where no gradient is taken (the no-grad recursion,
    evaluation); attention and the channel SwiGLU under grad stay the plain path's. everything=False: only
    mlp_t's forward, and only where no gradient is taken; under grad the whole block is the plain path."""
    fuse = everything or not torch.is_grad_enabled()
    if hasattr(block, 'mlp_t') and fuse:
        h = mlp_t(h, *mlp_t_weights(block, h.dtype), block.eps)[0]
    elif hasattr(block, 'mlp_t'):
        h = block.mix_sequence(h)
    else:
        h = rms_norm(h + block.self_attn(h, rope), block.eps)
    if torch.is_grad_enabled() or not everything:
        return rms_norm(h + block.mlp(h), block.eps)
    B, L, D = h.shape
    x = h.reshape(B * L, D)
    s = swiglu(x, block.mlp.gate_up_proj.weight.to(h.dtype))
    return down_norm(s, block.mlp.down_proj.weight.to(h.dtype), x, block.eps).view(B, L, D)


def mlp_t_forward(block, h, rope):
    """kernels='mlp_t': block_forward with only mlp_t's no-grad forward fused."""
    return block_forward(block, h, rope, everything=False)


def fusable(block, which='triton'):
    """'' where `which`'s fused forward runs this block, else why not (no mlp_t to fuse, a shape past what a
    tile holds)."""
    if which == 'mlp_t' and not hasattr(block, 'mlp_t'):
        return "the model mixes the sequence with attention, not mlp_t"
    if hasattr(block, 'mlp_t') and block.mlp_t.down_proj.weight.shape[0] > MAX_SEQ:
        return f"mlp_t over {block.mlp_t.down_proj.weight.shape[0]} positions (at most {MAX_SEQ})"
    if which == 'triton' and block.mlp.down_proj.weight.shape[0] > MAX_WIDTH:
        return f"hidden_size {block.mlp.down_proj.weight.shape[0]} (at most {MAX_WIDTH})"
    return ''


def fuse_blocks(model, which='triton'):
    """Each Block of model runs which's fused forward: 'triton' (every kernel), 'mlp_t' (mlp_t's no-grad
    forward), 'off' (the plain forward again). Returns what was fused, or why nothing was."""
    blocks = list(model.net.layers)
    why = fusable(blocks[0], which) if which != 'off' else 'off'
    for block in blocks:
        block.fused = None if why else block_forward if which == 'triton' else mlp_t_forward
    if why:
        return f"none fused: {why}"
    if which == 'mlp_t':
        return 'mlp_t forward (no-grad); the rest plain'
    return ('mlp_t (forward and backward), channel SwiGLU (no-grad)' if hasattr(blocks[0], 'mlp_t')
            else 'channel SwiGLU (no-grad); attention plain')
