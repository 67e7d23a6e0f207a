"""
backends/kernels.py checked where it runs, for dev/gpu_speed.sh: exactness at the real shapes, a tiny training run with the
kernels on and off, each fused op's time against the compiled plain path, the top kernels of a profile, and the
summary table of gpu_speed.sh's logs.
    python dev/kernels_check.py exact              # fused vs plain, both vs float64 (float32 for a model's step)
    python dev/kernels_check.py train              # a tiny run's token accuracy after N steps, kernels on and off
    python dev/kernels_check.py ops                # ms per call, TFLOP/s: fused ops (each tile tried) vs compiled
                                                   # plain; the Maze attention through each of SDPA's backends
    python dev/kernels_check.py profile TRACE OUT  # the kernels of a bench.py Chrome trace by GPU time, into OUT
    python dev/kernels_check.py table DIR          # gpu_speed.sh's table from the bench and reference logs in DIR
    python dev/kernels_check.py build [CAP]        # each kernel built for compute capability CAP (90), no GPU:
                                                   # its shared memory, registers and spills
--dry: tiny shapes in float32 on the CPU through Triton's interpreter (run with TRITON_INTERPRET=1): the stages
start and the numbers mean nothing for speed. Exit status 1 when an exactness check fails.
"""
import copy
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DRY = '--dry' in sys.argv
ARGS = [a for a in sys.argv[1:] if a != '--dry']


def setup():
    """(device, dtype, the Sudoku block's config keys, the maze's, batch): real shapes on a GPU, tiny on --dry."""
    import torch
    if DRY:
        if os.environ.get('TRITON_INTERPRET') != '1':
            raise SystemExit("--dry runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        small = dict(vocab_size=6, seq_len=11, num_puzzle_identifiers=1, hidden_size=32, num_heads=2,
                     puzzle_emb_ndim=32, puzzle_emb_len=2, H_cycles=1, L_cycles=2, halt_max_steps=2)
        return 'cpu', torch.float32, dict(small), dict(small, mlp_t=False, pos_encodings='rope'), 2
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --dry (and TRITON_INTERPRET=1) on the CPU")
    sudoku = dict(vocab_size=11, seq_len=81, num_puzzle_identifiers=1)
    maze = dict(vocab_size=6, seq_len=900, num_puzzle_identifiers=1, mlp_t=False, pos_encodings='rope', L_cycles=4)
    return 'cuda', torch.bfloat16, sudoku, maze, 768


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(name, fused, plain, exact):
    """One line: both paths' error against the exact result; ok when the fused one's is at most twice the
    plain one's (the dtype's rounding, not a bug's)."""
    ef, ep = rel(fused, exact), rel(plain, exact)
    ok = ef <= 2 * ep + 1e-6
    print(f"  {name:34s} fused {ef:.2e}  plain {ep:.2e}  (vs exact) | fused vs plain {rel(fused, plain):.2e} | "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return ok


def have_quack():
    """'' where quack-kernels loads here (kernels='quack' can be checked), else why not."""
    if DRY:
        return "no quack on the CPU"
    try:
        from backends.kernels import load_quack
        load_quack()
        return ''
    except ImportError as e:
        return str(e)


def block_checks(keys, B, dev, dtype, which='triton'):
    """A block of the model (its real shapes) with which's fused forward: the no-grad forward, and the input's
    and the weights' gradients; against the block in float64."""
    import torch
    from backends import kernels
    from model import TRM, TRMConfig
    forward = lambda b, x, r: kernels.block_forward(b, x, r, which)
    torch.manual_seed(0)
    model = TRM(TRMConfig(**keys, forward_dtype='float32')).to(dev)
    exact_model = copy.deepcopy(model).double()
    block, exact_block, rope, exact_rope = model.net.layers[0], exact_model.net.layers[0], model.rope(), \
        exact_model.rope()
    h = torch.randn(B, model.config.total_len, model.config.hidden_size, device=dev).to(dtype)
    oks = []
    with torch.no_grad():
        exact = exact_block(h.double(), exact_rope)
        plain = block(h, rope)
        block.fused = forward
        fused = block(h, rope)
        block.fused = None
    oks.append(compare('block forward (no grad)', fused, plain, exact))
    g = torch.randn_like(exact)

    def grads(b, x, r, fused_forward):
        b.fused = fused_forward
        b.zero_grad()
        x = x.clone().requires_grad_(True)
        (b(x, r).double() * g).sum().backward()
        b.fused = None
        return [x.grad] + [p.grad for n, p in b.named_parameters() if n.startswith('mlp')]
    exact_g = grads(exact_block, h.double(), exact_rope, None)
    plain_g = grads(block, h, rope, None)
    fused_g = grads(block, h, rope, forward)
    names = ['d h'] + [f'd {n}' for n, _ in block.named_parameters() if n.startswith('mlp')]
    for name, f, p, e in zip(names, fused_g, plain_g, exact_g):
        oks.append(compare(f'block backward: {name}', f, p, e))
    return oks


def step_checks(keys, B, dev, dtype):
    """A model's training step (forward_loss and its backward) with every kernel ('triton'), with kernels='mlp_t'
    and 'gated' (and 'quack' where it loads), and with none, against the same step in float64: the loss and the
    blocks' gradients, and all gradients together."""
    import torch
    from backends import kernels
    from model import TRM, TRMConfig
    from step import forward_loss
    torch.manual_seed(0)
    low = TRM(TRMConfig(**keys, forward_dtype=str(dtype).split('.')[-1], loss_dtype='float64')).to(dev)
    f64 = copy.deepcopy(low).double()  # every weight, activation and the loss in float64 (rms_norm: float32)
    f64.forward_dtype = torch.float64
    L, V = keys['seq_len'], keys['vocab_size']
    batch = dict(inputs=torch.randint(1, V, (B, L), dtype=torch.int32, device=dev),
                 labels=torch.randint(1, V, (B, L), dtype=torch.int32, device=dev),
                 puzzle_identifiers=torch.zeros(B, dtype=torch.int32, device=dev))

    def run(model):
        torch.manual_seed(1)
        model.zero_grad()
        carry = model.initial_carry(batch)
        _, loss, _ = forward_loss(model, carry, batch, None)
        loss.backward()
        return [loss.detach().reshape(1)] + [p.grad for p in model.parameters()]
    exact = run(f64)
    plain = run(low)
    kernels.fuse_blocks(low, 'triton')
    fused = run(low)
    kernels.fuse_blocks(low, 'mlp_t')
    mlp_t_only = run(low)
    kernels.fuse_blocks(low, 'gated')
    gated = run(low)
    quack_loads = not have_quack()
    if quack_loads:
        kernels.fuse_blocks(low, 'quack')
        quack = run(low)
    kernels.fuse_blocks(low, 'off')
    names = ['loss'] + [f"d {n}" for n, _ in low.named_parameters()]
    oks = [compare(n, f, p, e) for n, f, p, e in zip(names, fused, plain, exact) if '.mlp' in n or n == 'loss']
    flat = lambda gs: torch.cat([t.double().flatten() for t in gs[1:]])
    oks.append(compare('all gradients together', flat(fused), flat(plain), flat(exact)))
    oks.append(compare("kernels='mlp_t': loss", mlp_t_only[0], plain[0], exact[0]))
    oks.append(compare("kernels='mlp_t': all gradients", flat(mlp_t_only), flat(plain), flat(exact)))
    oks.append(compare("kernels='gated': loss", gated[0], plain[0], exact[0]))
    oks.append(compare("kernels='gated': all gradients", flat(gated), flat(plain), flat(exact)))
    if quack_loads:
        oks.append(compare("kernels='quack': loss", quack[0], plain[0], exact[0]))
        oks.append(compare("kernels='quack': all gradients", flat(quack), flat(plain), flat(exact)))
    return oks


def tile_modes(dev, dtype, M, K, I):
    """The gated GEMMs with one tile moved three ways (the threads' loads, TMA copies, TMA in a persistent grid),
    at a SwiGLU's real shape plus a ragged row tile: the TMA results equal the loads' bit for bit. One line per
    way; on a GPU without TMA (before Hopper) only the loads run, and nothing is compared."""
    import torch
    from backends import kernels
    tiles, tuned = (kernels.GATED_CONFIGS, kernels.DGATED_CONFIGS), (kernels._gated_tuned, kernels._dgated_tuned)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M + 5, K, generator=g, device=dev).to(dtype)
    dy = torch.randn(M + 5, K, generator=g, device=dev).to(dtype)  # the down product's gradient: D = K
    w_gu = (torch.randn(2 * I, K, generator=g, device=dev) / K ** 0.5).to(dtype)
    w_d = (torch.randn(K, I, generator=g, device=dev) / I ** 0.5).to(dtype)
    modes = dict(loads=kernels.LOADS, TMA=kernels.TMA_TILES, persistent=kernels.TMA_PERSISTENT)
    if dev != 'cpu' and torch.cuda.get_device_capability()[0] < 9:
        modes = dict(loads=kernels.LOADS)
    oks, first = [], None
    try:
        for how, mode in modes.items():
            one = dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=3, **mode)
            kernels.GATED_CONFIGS = kernels.DGATED_CONFIGS = [one]  # the interpreter's pick
            prune = kernels._tma_where_it_runs
            kernels._gated_tuned = kernels._tuned(kernels._gated_forward, [one], ['M', 'I', 'K', 'KEEP'], prune)
            kernels._dgated_tuned = kernels._tuned(kernels._dgated_backward, [one], ['M', 'I', 'K'], prune)
            y, s, gu = kernels.gated_mlp(x, w_gu, w_d)
            got = [y, s, gu, kernels.swiglu(x, w_gu), kernels.dgated(dy, w_d, gu)]
            if first is None:
                first = got
                print(f"  gated GEMMs, {how:10s} [{M + 5}, {K}] x [{2 * I}, {K}]: computed", flush=True)
                continue
            oks.append(all(torch.equal(a, b) for a, b in zip(got, first)))
            print(f"  gated GEMMs, {how:10s} [{M + 5}, {K}] x [{2 * I}, {K}]: "
                  f"{'the loads bit for bit: ok' if oks[-1] else 'differs from the loads: FAIL'}", flush=True)
    finally:  # the lists and autotuners every later check uses
        (kernels.GATED_CONFIGS, kernels.DGATED_CONFIGS), (kernels._gated_tuned, kernels._dgated_tuned) = tiles, tuned
    return oks


def exact():
    dev, dtype, sudoku, maze, B = setup()
    t0 = time.time()
    print(f"exactness on {dev} in {dtype}: error norms ||x - exact|| / ||exact||", flush=True)
    print(f"Sudoku MLP block (mlp_t), batch {B}:")
    oks = block_checks(sudoku, B, dev, dtype)
    print(f"Maze attention block, batch {max(2, B // 24)}:")
    oks += block_checks(maze, max(2, B // 24), dev, dtype)
    print(f"Maze attention block, kernels='cudnn' (cuDNN's attention), batch {max(2, B // 24)}:")
    oks += block_checks(maze, max(2, B // 24), dev, dtype, 'cudnn')
    why_not = have_quack()
    print(f"kernels='quack': {why_not or 'quack-kernels loads'}", flush=True)
    if not why_not:
        print(f"Sudoku MLP block (mlp_t), kernels='quack', batch {B}:")
        oks += block_checks(sudoku, B, dev, dtype, 'quack')
        print(f"Maze attention block, kernels='quack', batch {max(2, B // 24)}:")
        oks += block_checks(maze, max(2, B // 24), dev, dtype, 'quack')
    print("the gated GEMMs' ways of moving a tile:")
    oks += tile_modes(dev, dtype, *((300, 32, 256) if DRY else (B * 97, 512, 1536)))  # Sudoku's channel SwiGLU
    print(f"Sudoku MLP training step, batch {max(2, B // 6)}:")
    oks += step_checks(sudoku, max(2, B // 6), dev, dtype)
    print(f"exactness: {sum(oks)}/{len(oks)} ok in {time.time() - t0:.0f} s", flush=True)
    return 0 if all(oks) else 1


def train():
    """A tiny mlp_t model learns to reverse a sequence, with the kernels off and then on, from the same weights
    and batches: the token accuracy of the last steps should agree within noise."""
    import numpy as np
    import torch
    from backends import kernels
    from model import TRM, TRMConfig
    from step import AdamATan2, StepConfig, train_step
    dev, dtype, _, _, _ = setup()
    n_steps, B, L = (3, 4, 6) if DRY else (300, 256, 16)
    keys = dict(vocab_size=11, seq_len=L, num_puzzle_identifiers=1, hidden_size=32 if DRY else 128,
                num_heads=2, H_cycles=2, L_cycles=2, halt_max_steps=2, puzzle_emb_ndim=0,
                forward_dtype=str(dtype).split('.')[-1], loss_dtype='float32')

    def batch(i):
        x = np.random.default_rng(i).integers(1, 11, (B, L)).astype(np.int32)
        return {k: torch.from_numpy(v).to(dev) for k, v in
                dict(inputs=x, labels=x[:, ::-1].copy(), puzzle_identifiers=np.zeros(B, np.int32)).items()}

    def run(on):
        torch.manual_seed(0)
        model = TRM(TRMConfig(**keys)).to(dev)
        kernels.fuse_blocks(model, 'triton' if on else 'off')
        opt = AdamATan2(model.parameters(), lr=2e-3, weight_decay=0.1)
        sc = StepConfig(lr=2e-3, puzzle_emb_lr=0.0, puzzle_emb_weight_decay=0.0, warmup_steps=20,
                        total_steps=n_steps, min_ratio=1.0, global_batch_size=B)
        step_t, carry, sums = torch.zeros((), device=dev), model.initial_carry(batch(0)), None
        t0 = time.time()
        for i in range(n_steps):
            carry, loss, m = train_step(model, opt, None, carry, batch(i), step_t, sc)
            if i >= n_steps - 20:
                sums = m if sums is None else {k: sums[k] + m[k] for k in sums}
        acc = float(sums['accuracy'] / sums['count'].clamp_min(1))
        print(f"  kernels {'on ' if on else 'off'}: token accuracy {acc:.4f} over the last steps, loss "
              f"{float(loss) / B:.4f} at step {n_steps} ({time.time() - t0:.1f} s)", flush=True)
        return acc
    print(f"tiny training run ({n_steps} steps, batch {B}, mlp_t D {keys['hidden_size']}, {dtype}, eager, "
          f"reverse {L} tokens):")
    off, on = run(False), run(True)
    ok = abs(on - off) <= 0.05 or DRY
    print(f"tiny run: accuracy off {off:.4f}, on {on:.4f}: {'ok' if ok else 'FAIL'} (within 0.05)", flush=True)
    return 0 if ok else 1


def time_ms(fn, n=20):
    import torch
    for _ in range(3):
        fn()
    if DRY:
        return float('nan')
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def mix_sequence_major(block, h):
    """mlp_t on a sequence-major hidden state h [S, B, D]: each product is one plain matmul with the weight on
    the left ([2I, S] x [S, B*D], then [S, I] x [I, B*D]), no transpose and no padding copy; the gate/up weight
    is read transposed from an [S, 2I] copy, whose rows stay 16-byte aligned where S is no multiple of 8."""
    import torch
    S, B, D = h.shape
    w_gu = block.mlp_t.gate_up_proj.weight.t().to(h.dtype).contiguous().t()
    gate, up = (w_gu @ h.view(S, B * D)).chunk(2, dim=0)
    y = block.mlp_t.down_proj.weight.to(h.dtype) @ (torch.nn.functional.silu(gate) * up)
    v = (h + y.view(S, B, D)).float()
    return (v * torch.rsqrt(v.square().mean(0, keepdim=True) + block.eps)).to(h.dtype)


def ops():
    """ms per call at the Sudoku block's real shapes: each fused op (autotuned: its pick, and every candidate
    timed) against the plain path compiled by inductor (torch.compile's default mode), and each gated GEMM
    against cuBLAS's bare product of the same shape (the floor its epilogue adds to); each with its useful
    TFLOP/s (the true sequence's products, no padding; backward: twice the forward's more).
    Then mlp_t in a sequence-major layout, compiled plain, which the model does not use: measured to decide; and
    the Maze attention through each of SDPA's backends (attention_ops)."""
    import torch
    from backends import kernels
    from model import TRM, TRMConfig, rms_norm, swiglu_inter
    dev, dtype, sudoku, maze, B = setup()
    torch.manual_seed(0)
    model = TRM(TRMConfig(**sudoku, forward_dtype=str(dtype).split('.')[-1])).to(dev)
    block = model.net.layers[0]
    S, D = model.config.total_len, model.config.hidden_size
    e, multiple = model.config.expansion, model.config.mlp_multiple
    mix, channel = 6 * B * D * S * swiglu_inter(S, e, multiple), 6 * B * S * D * swiglu_inter(D, e, multiple)
    flops = dict(mlp_t=mix, mlp_t_backward=3 * mix, mlp_t_gated_backward=3 * mix, swiglu=channel * 2 / 3,
                 down_norm=channel / 3, dgated=channel / 3, gated_mlp_backward=3 * channel)
    speed = lambda op, ms: f"{ms:.3f} ms {flops[op] / ms / 1e9:6.1f} TFLOP/s"
    h = torch.randn(B, S, D, device=dev).to(dtype)
    hg, g = h.clone().requires_grad_(True), torch.randn_like(h)
    compile_ = (lambda f: f) if DRY else torch.compile
    plain_mix = compile_(block.mix_sequence)
    plain_channel = compile_(lambda x: rms_norm(x + block.mlp(x), block.eps))
    x = h.reshape(-1, h.shape[-1])
    w_gu, w_d = block.mlp.gate_up_proj.weight.to(dtype), block.mlp.down_proj.weight.to(dtype)
    fused_channel = compile_(lambda x: rms_norm(x + kernels.gated_swiglu(block.mlp, x), block.eps))
    fused_mix = compile_(lambda x: kernels.mix_sequence_gated(block, x))
    s = kernels.swiglu(x, w_gu)
    dy = torch.randn_like(x)
    gu = kernels.gated_mlp(x, w_gu, w_d)[2]
    fused = dict(
        mlp_t=lambda: kernels.mlp_t(h, *kernels.mlp_t_weights(block, dtype), block.eps),
        mlp_t_backward=lambda: kernels.mlp_t(hg, *kernels.mlp_t_weights(block, dtype), block.eps)[0].backward(g),
        mlp_t_gated_backward=lambda: fused_mix(hg).backward(g),
        swiglu=lambda: kernels.swiglu(x, w_gu),
        down_norm=lambda: kernels.down_norm(s, w_d, x, block.eps),
        dgated=lambda: kernels.dgated(dy, w_d, gu),
        gated_mlp_backward=lambda: fused_channel(hg).backward(g))
    plain = dict(mlp_t=lambda: plain_mix(h), mlp_t_backward=lambda: plain_mix(hg).backward(g),
                 mlp_t_gated_backward=lambda: plain_mix(hg).backward(g),
                 swiglu=lambda: x @ w_gu.t(), down_norm=lambda: plain_channel(h), dgated=lambda: dy @ w_d,
                 gated_mlp_backward=lambda: plain_channel(hg).backward(g))
    plain_is = dict(swiglu='cuBLAS', dgated='cuBLAS')
    tuned = dict(mlp_t=kernels._mlp_t_tuned, mlp_t_backward=kernels._mlp_t_backward_tuned,
                 swiglu=kernels._gated_tuned, down_norm=kernels._down_norm_tuned, dgated=kernels._dgated_tuned)
    print(f"ms per call, batch {B} (plain: inductor-compiled; cuBLAS: the bare product of the GEMM's shape; "
          "*_backward: forward and backward together; the channel sublayer's plain figure, swiglu + down_norm, "
          "is beside down_norm):", flush=True)
    for op in fused:
        with torch.no_grad() if not op.endswith('_backward') else torch.enable_grad():
            if op in tuned:  # tuned afresh at this op's call, so that the candidates' times below are its shape's
                tuned[op].cache.clear()
                tuned[op].configs_timings = {}
            rows = [('fused', '', time_ms(fused[op]))]
            ref = time_ms(plain[op])
        if op in tuned:
            best = getattr(tuned[op], 'best_config', None)
            rows[0] = ('fused', f"autotuned: {best.all_kwargs() if best else 'first config (interpreter)'}",
                       rows[0][2])
            # every candidate the autotuner timed at this shape (its median, in ms), fastest first; none in the
            # interpreter, which runs the first config untimed
            for c, t in sorted(tuned[op].configs_timings.items(), key=lambda ct: ct[1]):
                rows.append(('tried', c.all_kwargs(), t[0] if isinstance(t, list) else t))
        for label, tiles, ms in rows:
            print(f"  {op:20s} {label:7s} {tiles} " + (speed(op, ms) if isinstance(ms, float) else ms), flush=True)
        print(f"  {op:20s} {plain_is.get(op, 'plain'):7s} {speed(op, ref)}", flush=True)
    h_sm = h.transpose(0, 1).contiguous()
    hg_sm, g_sm = h_sm.clone().requires_grad_(True), g.transpose(0, 1).contiguous()
    major = compile_(lambda x: mix_sequence_major(block, x))
    with torch.no_grad():
        differs = rel(major(h_sm).transpose(0, 1), plain_mix(h))
    hg.grad = None  # (the timings above left theirs)
    major(hg_sm).backward(g_sm)
    plain_mix(hg).backward(g)
    print(f"  mlp_t, sequence-major ([S, B, D], plain, compiled; against the plain path: forward {differs:.1e}, "
          f"d h {rel(hg_sm.grad.transpose(0, 1), hg.grad):.1e}):", flush=True)
    with torch.no_grad():
        print(f"  {'mlp_t':20s} {'seq-maj':7s} {speed('mlp_t', time_ms(lambda: major(h_sm)))}", flush=True)
    print(f"  {'mlp_t_backward':20s} {'seq-maj':7s} "
          f"{speed('mlp_t_backward', time_ms(lambda: major(hg_sm).backward(g_sm)))}", flush=True)
    attention_ops(dev, dtype, maze)
    why_not = have_quack()
    if why_not:
        print(f"  quack: not timed ({why_not})", flush=True)
        return 0
    # quack-kernels' gated GEMMs in place of the Triton ones (kernels='quack'): its default tile per shape, then
    # its autotuner's pick (JIT compilation of each candidate first)
    quack_channel = compile_(lambda x: rms_norm(x + kernels.gated_swiglu(block.mlp, x, quack=True), block.eps))
    quack_mix = compile_(lambda x: kernels.mix_sequence_gated(block, x, quack=True))
    gu_quack = kernels.quack_gated_mlp(x, w_gu, w_d)[1]
    quack = dict(quack_swiglu=(lambda: kernels.quack_swiglu(x, w_gu), 'swiglu'),
                 quack_dgated=(lambda: kernels.quack_dgated(dy, w_d, gu_quack), 'dgated'),
                 quack_gated_mlp_backward=(lambda: quack_channel(hg).backward(g), 'gated_mlp_backward'),
                 quack_mlp_t_backward=(lambda: quack_mix(hg).backward(g), 'mlp_t_gated_backward'))
    for tuned in (False, True):
        kernels.QUACK_TUNED = tuned
        for op, (fn, ours) in quack.items():
            if tuned and op.endswith('_backward'):
                continue
            with torch.no_grad() if not op.endswith('_backward') else torch.enable_grad():
                ms = time_ms(fn)
            print(f"  {op:24s} {'tuned' if tuned else 'default':7s} {ms:.3f} ms (Triton's and the plain path's: "
                  f"{ours} above)", flush=True)
    kernels.QUACK_TUNED = False
    return 0


def attention_ops(dev, dtype, maze):
    """The Maze model's attention (batch 192, its heads and length, the [B, S, heads, head_dim] projections seen
    as [B, heads, S, head_dim]) through each of SDPA's backends, forward and forward with backward, and the one SDPA
    picks by itself: whether kernels='cudnn' (cuDNN's first) can pay, and how much of a step it could save."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from model import TRMConfig
    cfg = TRMConfig(**maze)
    B, S, H, hd = (2 if DRY else 192), cfg.total_len, cfg.num_heads, cfg.hidden_size // cfg.num_heads
    q, k, v = (torch.randn(B, S, H, hd, device=dev).to(dtype).transpose(1, 2).requires_grad_(True)
               for _ in range(3))
    g = torch.randn_like(q)
    flops = 4 * B * H * S * S * hd  # QK^T and PV; the backward's 2.5 times that
    sdpa = torch.nn.functional.scaled_dot_product_attention
    default = torch._fused_sdp_choice(q, k, v) if dev == 'cuda' else None
    print(f"SDPA at the Maze model's attention [{B}, {H}, {S}, {hd}] {dtype}: SDPA's own pick "
          f"{SDPBackend(default).name if default is not None else 'n/a (CPU)'}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}:", flush=True)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                with torch.no_grad():
                    fwd = time_ms(lambda: sdpa(q, k, v))
                both = time_ms(lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), g))
        except RuntimeError as e:  # a backend this device or shape does not have
            print(f"  {backend.name:20s} does not run here ({str(e).splitlines()[0][:120]})", flush=True)
            continue
        print(f"  {backend.name:20s} forward {fwd:.3f} ms {flops / fwd / 1e9:6.1f} TFLOP/s | forward and backward "
              f"{both:.3f} ms {3.5 * flops / both / 1e9:6.1f} TFLOP/s", flush=True)


def build_all(cap=90):
    """Each kernel at the Sudoku model's shapes with every tile its autotuner tries, compiled for a GPU of
    compute capability `cap` by Triton's own ptxas, no GPU needed: {name, with ' {tiles}' past the first tile:
    (shared memory bytes, registers per thread, stack bytes: register spills, whether its products run
    on Hopper's asynchronous tensor-core instructions (wgmma), whether its tiles move by TMA copies)}. A kernel
    that does not build raises ptxas's error."""
    import subprocess
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from backends import kernels
    bf, f32 = '*bf16', '*fp32'
    mlp_t = lambda t: dict(I=512, LP=128, BD=t['BD'], BI=t['BI'])
    gated = lambda K: (kernels._gated_forward, dict(x_ptr=bf, w_ptr=bf, s_ptr=bf, gu_ptr=bf, M='i32', I='i32'),
                       lambda t: dict(K=K, KEEP=True, BM=t['BM'], BN=t['BN'], BK=t['BK'], TMA=t['TMA'],
                                      PERSIST=t['PERSIST']))
    dgated = lambda K: (kernels._dgated_backward, dict(dy_ptr=bf, wd_ptr=bf, gu_ptr=bf, dgu_ptr=bf, M='i32',
                                                       I='i32'), lambda t: dict(K=K, BM=t['BM'], BN=t['BN'],
                                                                                BK=t['BK'], TMA=t['TMA'],
                                                                                PERSIST=t['PERSIST']))
    specs = dict(  # the JIT's view of the Sudoku MLP's calls: L 97, D 512, mlp_t inter 512, channel inter 1536
        mlp_t=(kernels._mlp_t_forward, dict(h_ptr=bf, wg_ptr=bf, wd_ptr=bf, out_ptr=bf, rstd_ptr=f32, L='i32',
                                             D='i32', eps='fp32'), mlp_t),
        mlp_t_backward=(kernels._mlp_t_backward, dict(h_ptr=bf, out_ptr=bf, dout_ptr=bf, rstd_ptr=f32, wg_ptr=bf,
                                                      wd_ptr=bf, dh_ptr=bf, xr_ptr=bf, dy_ptr=bf, dgu_ptr=bf,
                                                      s_ptr=bf, L='i32', D='i32'), mlp_t),
        gated=gated(512), dgated=dgated(512),  # the channel SwiGLU: K is D
        gated_mlp_t=gated(104), dgated_mlp_t=dgated(104),  # mlp_t's under kernels='gated': K is the padded L
        down_norm=(kernels._down_norm_forward, dict(s_ptr=bf, w_ptr=bf, res_ptr=bf, out_ptr=bf, M='i32', D='i32',
                                                    eps='fp32'),
                   lambda t: dict(K=1536, BM=t['BM'], DP=512, BK=t['BK'])))
    tool = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump')
    configs = dict(mlp_t=kernels.MLP_T_CONFIGS, mlp_t_backward=kernels.MLP_T_BACKWARD_CONFIGS,
                   gated=kernels.GATED_CONFIGS, dgated=kernels.DGATED_CONFIGS, gated_mlp_t=kernels.GATED_CONFIGS,
                   dgated_mlp_t=kernels.DGATED_CONFIGS, down_norm=kernels.DOWN_NORM_CONFIGS)
    out = {}
    for name, (fn, sig, constants) in specs.items():
        for i, tiles in enumerate(configs[name]):
            consts = dict(constants(tiles), PREC='tf32')
            # pointers and the integers a real call passes are 16-aligned (D 512, M 74,496, I 1536): the JIT's view
            attrs = {(fn.arg_names.index(n),): [['tt.divisibility', 16]] for n, t in sig.items()
                     if t.startswith('*') or n in ('D', 'M', 'I')}
            k = triton.compile(ASTSource(fn, {**sig, **{n: 'constexpr' for n in consts}}, consts, attrs),
                               target=GPUTarget('cuda', cap, 32),
                               options=dict(num_warps=tiles['num_warps'], num_stages=tiles['num_stages']))
            with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
                f.write(k.asm['cubin'])
                f.flush()
                usage = subprocess.run([tool, '-res-usage', f.name], capture_output=True, text=True).stdout
            key = name if i == 0 else f"{name} {tiles}"
            out[key] = (k.metadata.shared, int(re.search(r'REG:(\d+)', usage).group(1)),
                        int(re.search(r'STACK:(\d+)', usage).group(1)), 'wgmma.mma_async' in k.asm['ptx'],
                        'cp.async.bulk.tensor' in k.asm['ptx'])
    return out


def build(cap='90'):
    for name, (smem, regs, stack, wgmma, tma) in build_all(int(cap)).items():
        print(f"{name:96s} shared {smem // 1024:4d} KiB | {regs:3d} registers | {stack:4d} bytes spilled"
              f"{' | wgmma' if wgmma else ''}{' | TMA' if tma else ''}")
    return 0


OURS = ('_mlp_t_forward', '_mlp_t_backward', '_gated_forward', '_dgated_backward', '_down_norm_forward')


def kind_of(name):
    n = name.lower()
    if name.startswith(OURS):
        return 'backends/kernels.py'
    if 'quack' in n:  # kernels='quack': quack-kernels' CuTe DSL GEMMs
        return 'quack GEMM'
    if any(k in n for k in ('gemm', 'nvjet', 'cutlass', 'xmma', 'cublas', 'sm90_', 'sm80_')):
        return 'cuBLAS GEMM'
    return 'inductor Triton' if n.startswith('triton') else 'other'


def profile(trace, out):
    """The GPU kernels of a Chrome trace (bench.py --profile_steps) summed by name: top 30, and by kind."""
    with open(trace) as f:
        events = [e for e in json.load(f).get('traceEvents', []) if e.get('cat') == 'kernel' and 'dur' in e]
    if not events:
        raise SystemExit(f"{trace}: no GPU kernel events")
    by_name, by_kind = {}, {}
    for e in events:
        by_name[e['name']] = by_name.get(e['name'], 0.0) + e['dur']
        by_kind[kind_of(e['name'])] = by_kind.get(kind_of(e['name']), 0.0) + e['dur']
    total = sum(by_name.values())
    span = max(e['ts'] + e['dur'] for e in events) - min(e['ts'] for e in events)
    lines = [f"GPU kernels of {os.path.basename(trace)}: {len(events)} launches, {total / 1e3:.1f} ms of kernel "
             f"time over a {span / 1e3:.1f} ms span (busy {100 * total / span:.0f}%)", "by kind:"]
    lines += [f"  {k:16s} {v / 1e3:9.2f} ms {100 * v / total:5.1f}%" for k, v in sorted(by_kind.items(),
                                                                                    key=lambda kv: -kv[1])]
    lines.append("top 30 by time:")
    lines += [f"  {v / 1e3:9.2f} ms {100 * v / total:5.1f}%  {n[:110]}" for n, v in
              sorted(by_name.items(), key=lambda kv: -kv[1])[:30]]
    with open(out, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines[:8]))
    return 0


def fields(path, prefix):
    """The key=value fields of the last line of `path` that starts with prefix ('bench:', 'ref:'), or {}."""
    try:
        lines = [l for l in open(path).read().splitlines() if l.startswith(prefix)]
    except OSError:
        return {}
    return dict(re.findall(r'(\w+)=(\S+)', lines[-1])) if lines else {}


def num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def table(folder):
    """workload | the kernels value timed against off | ours, kernels off | ours, that value | reference | that
    value vs off | vs reference (speed ratios), from bench.py's --kernels_ab logs (either value first)."""
    rows = [('Sudoku MLP, batch 768, train (ms/step)', 'bench_sudoku.txt', 'ref_mlp.txt', 'ms_per_step', True),
            ('Sudoku MLP, evaluation (puzzles/s)', 'bench_sudoku.txt', 'ref_mlp.txt', 'eval_puzzles_per_s', False),
            ('Maze attention, batch 192, train (ms/step)', 'bench_maze.txt', 'ref_maze.txt', 'ms_per_step', True),
            ('Maze attention, evaluation (puzzles/s)', 'bench_maze.txt', 'ref_maze.txt', 'eval_puzzles_per_s',
             False)]
    fmt = lambda v: 'n/a' if v is None else f"{v:.1f}"
    ratio = lambda a, b, lower: None if a is None or b is None else (b / a if lower else a / b)
    out = ["| workload | kernels on | ours, kernels off | ours, kernels on | reference | on vs off | on vs reference |",
           "|---|---|---|---|---|---|---|"]
    for what, ours, ref, key, lower in rows:
        b, r = fields(os.path.join(folder, ours), 'bench:'), fields(os.path.join(folder, ref), 'ref:')
        timed = {b.get('kernels'): num(b.get(key)), b.get('ab_kernels'): num(b.get('ab_' + key))}
        off = timed.pop('off', None)
        which = next((k for k in timed if k not in (None, 'n/a')), None)
        on = timed.get(which)
        ref_v = num(r.get(key))
        speed = lambda a, c: 'n/a' if ratio(a, c, lower) is None else f"{ratio(a, c, lower):.3f}x"
        out.append(f"| {what} | {which or 'n/a'} | {fmt(off)} | {fmt(on)} | {fmt(ref_v)} | {speed(on, off)} | "
                   f"{speed(on, ref_v)} |")
    print('\n'.join(out))
    return 0


if __name__ == '__main__':
    what = ARGS[0] if ARGS else ''
    if what == 'profile' and len(ARGS) == 3:
        raise SystemExit(profile(ARGS[1], ARGS[2]))
    if what == 'table' and len(ARGS) == 2:
        raise SystemExit(table(ARGS[1]))
    if what == 'build' and len(ARGS) <= 2:
        raise SystemExit(build(*ARGS[1:]))
    if what in ('exact', 'train', 'ops') and len(ARGS) == 1:
        raise SystemExit(globals()[what]())
    raise SystemExit(__doc__.strip())
