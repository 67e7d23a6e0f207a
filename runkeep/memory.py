"""
Memory: what a run needs, before it starts, against what this machine gives it (device.memory_headroom). train.py
(startup.startup_problems), solve.py and study.py refuse a run that would not fit (check_memory=False starts it
anyway), instead of finding out when the machine, out of memory and without swap, stops answering.
    run_memory(shape, rows, ...)   the run's bytes by part: weights, gradients, optimizer moments, the EMA copy,
                                   the puzzle-embedding table, the ACT carry, a training step's activations, an
                                   evaluation batch, the allocator's slack; need() adds them up at the peak;
                                   config_memory(cfg, data, device_type) the same from train.py's keys
    headrooms()                    what a CPU process may allocate: the host's limits, shared, and its own
    headroom(dev)                  the same for a CPU or CUDA device (a GPU: its free memory)
    memory_problem(...)            the verdict: '' or one line with the numbers and the flag that overrides
The activations are counted from the tensors each block keeps for its backward pass, as the code in model.py
builds them (docs/reliability.md: how close the estimate came to measured runs).
"""
import math

from device import address_space_headroom, host_headroom, size  # what this machine gives


# -----------------------------------------------------------------------------
# what a run needs

DTYPE_BYTES = dict(float32=4, bfloat16=2, float16=2, float64=8)
# a process's memory beyond its live tensors at a step's or an evaluation's peak, as a share of them, with room over
# what CPU runs showed (glibc's allocator keeps what it freed, and reuses it only in pieces that fit; docs/log.md)
ALLOCATOR_SLACK = 0.3


def inner_multiple(shape):
    """The multiple a SwiGLU's inner width rounds up to: a checkpoint from before the key has model.py's default."""
    from model import TRMConfig
    return shape.get('mlp_multiple', TRMConfig.mlp_multiple)


def model_parameters(shape):
    """The parameter count of the TRM of `shape`, as model.py builds it (no model is built: on the meta device
    that would import torch._dynamo, seconds at every start): the token embedding, the lm and q heads, learned
    positions, and per block the sequence SwiGLU (mlp_t) or attention's qkv and o, then the channel SwiGLU.
    tests/test_limits.py keeps it equal to TRM.num_params()."""
    from model import swiglu_inter
    S, D, V, e = shape['total_len'], shape['hidden_size'], shape['vocab_size'], shape['expansion']
    multiple = inner_multiple(shape)
    swiglu = lambda d: 3 * d * swiglu_inter(d, e, multiple)  # gate-up (d -> 2 inner) and down (inner -> d)
    mix = swiglu(S) if shape['mlp_t'] else 4 * D * D
    return (2 * V * D + 2 * D + 2 + (S * D if shape['pos_encodings'] == 'learned' else 0)
            + shape['L_layers'] * (mix + swiglu(D)))


def block_bytes(shape, s):
    """Bytes one block keeps for its backward pass per row (model.Block, as its ops save their inputs), s the
    forward dtype's size: the residual stream's RMSNorms in float32, the SwiGLUs' gate-up, gate and product,
    attention's qkv, its output and copy, the flash kernel's log-sum-exp (rope: its rotated q and k), or
    mlp_t's padded input and sequence SwiGLU."""
    from model import SEQ_ALIGN, swiglu_inter
    S, D, e = shape['total_len'], shape['hidden_size'], shape['expansion']  # S: positions
    multiple = inner_multiple(shape)
    I = swiglu_inter(D, e, multiple)
    norms = 2 * (S * D * 4 + S * 4)
    mlp = S * D * s + 4 * S * I * s  # its input (the first norm's output), gate-up, silu(gate), product
    if shape['mlp_t']:
        Sp, It = -(-S // SEQ_ALIGN) * SEQ_ALIGN, swiglu_inter(S, e, multiple)
        mix = D * Sp * s + 4 * D * It * s
    else:
        rope = 2 * S * D * s if shape['pos_encodings'] == 'rope' else 0
        mix = S * D * s + 3 * S * D * s + rope + S * D * s + S * D * s + S * shape['num_heads'] * 4
    return norms + mlp + mix


def config_shape(cfg, data, device_type, cuda_capability=None):
    """The shape run_memory counts (TRMConfig's fields and total_len) of a train.py run: cfg its config (train.py's
    keys), data its dataset's seq_len, vocab_size and num_puzzle_identifiers, device_type its device's ('cpu',
    'cuda'), whose number formats 'auto' resolves to (cuda_capability: a GPU's, when none is initialized here)."""
    from device import choose_dtype, resolve_loss_dtype
    from model import MODEL_KEYS, TRMConfig
    shape = {k: cfg[k] for k in MODEL_KEYS}
    shape.update(forward_dtype=choose_dtype(cfg['forward_dtype'], device_type, cuda_capability=cuda_capability)[0],
                 loss_dtype=resolve_loss_dtype(cfg['loss_dtype'], device_type), seq_len=int(data['seq_len']),
                 vocab_size=int(data['vocab_size']), num_puzzle_identifiers=int(data['num_puzzle_identifiers']))
    shape['total_len'] = TRMConfig(**shape).total_len
    return shape


def config_memory(cfg, data, device_type, processes=1, cuda_capability=None, params=None):
    """run_memory of one of `processes` processes (ranks) of a train.py run (config_shape's arguments)."""
    shape = config_shape(cfg, data, device_type, cuda_capability)
    eval_rows = (cfg['eval_batch_size'] or cfg['global_batch_size']) // processes * cfg['eval_views']
    return run_memory(shape, cfg['global_batch_size'] // processes, eval_rows,
                      cfg['eval_steps'] or cfg['halt_max_steps'], params=params, ema=cfg['ema'],
                      train=not cfg['eval_only'], accumulation=cfg['gradient_accumulation_steps'])


def run_memory(shape, rows, eval_rows, eval_steps, params=None, ema=True, train=True, accumulation=1):
    """{part: bytes} of one process of a run: shape is TRMConfig's fields (the dataset's included, dtypes
    resolved: 'float32', ...) and total_len; rows the training batch rows of this process, eval_rows its
    evaluation rows (views included), eval_steps the supervision steps an evaluation batch runs. params: the
    parameter count (None: counted). train=False: an evaluation alone (--eval_only)."""
    from model import swiglu_inter
    s, loss = DTYPE_BYTES[shape['forward_dtype']], DTYPE_BYTES[shape['loss_dtype']]
    latents, grad_calls = latent_bytes(shape), trm_config(shape).net_calls()[1]
    S, D, seq, V = shape['total_len'], shape['hidden_size'], shape['seq_len'], shape['vocab_size']
    P = model_parameters(shape) if params is None else params
    table = shape['num_puzzle_identifiers'] * max(shape['puzzle_emb_ndim'], 1) * 4
    parts = dict(weights=4 * P, ema=4 * P if ema else 0, puzzle_embeddings=table)
    per_call = shape['L_layers'] * block_bytes(shape, s)
    multiple = inner_multiple(shape)
    widest = S * swiglu_inter(D, shape['expansion'], multiple)  # per row, a SwiGLU's widest tensor
    if shape['mlp_t']:
        widest = max(widest, D * swiglu_inter(S, shape['expansion'], multiple))
    if train:
        micro = math.ceil(rows / accumulation)
        parts.update(gradients=4 * P, optimizer=8 * P,
                     # every row's latents, its tokens, labels, identifier, steps; the next batch on its way
                     carry=rows * (latents + 2 * seq * 4 + 13) + rows * (2 * seq * 4 + 4),
                     # the net calls with grad (the last round's) keep theirs, the heads their input and the loss
                     # its logits in float and loss dtype; in flight, the widest gradient of the backward pass
                     # (a SwiGLU's gate-up)
                     activations=micro * (grad_calls * per_call + 2 * widest * s + 2 * S * D * s
                                          + seq * V * (s + 5 * loss)))
    # an evaluation batch: x, the latents, every step's answers and q_halt; in flight (no gradients kept), a
    # SwiGLU's gate-up, gate and product and the RMSNorms' float32 copies
    parts['evaluation'] = eval_rows * (S * D * s + latents + eval_steps * (seq * 4 + 4) + 4 * widest * s + 4 * S * D * 4
                                       + seq * 40)  # the answers' host copies (views: mapped back, voted)
    # the allocator holds more than the live tensors: freed blocks it keeps, pieces too small to reuse
    parts['slack'] = ALLOCATOR_SLACK * max(parts.get('gradients', 0) + parts.get('activations', 0),
                                           parts['evaluation'])
    return parts


def trm_config(shape):
    """model.py's TRMConfig of a shape (run_memory's): what the model says of its latents and its recursion."""
    from model import TRMConfig
    return TRMConfig(**{k: shape[k] for k in TRMConfig.__dataclass_fields__ if k in shape})


def latent_bytes(shape):
    """One row's latents in the forward dtype, as model.py counts them, of a shape (run_memory's)."""
    return trm_config(shape).latent_bytes(DTYPE_BYTES[shape['forward_dtype']])


def need(parts):
    """The peak of a run's parts: all of them together, an evaluation batch beside a training step's. The
    evaluation after a step does not get the step's freed memory back: the allocator keeps its heap mapped (a
    trim gives back pages, not address space) and maps the evaluation's large tensors anew."""
    return sum(parts.values())


def describe(parts):
    names = dict(weights='weights', ema='EMA', puzzle_embeddings='puzzle embeddings', gradients='gradients',
                 optimizer='optimizer moments', carry='ACT carry', activations="a step's activations",
                 evaluation='an evaluation batch', process='the process itself (Python, torch)',
                 emb_update="bench.py's timed puzzle-embedding update (its ids compared pairwise)",
                 slack=f"the allocator's slack ({ALLOCATOR_SLACK:.0%} of the larger)")
    return ', '.join(f"{names[k]} {size(v)}" for k, v in parts.items() if v)


def headrooms():
    """What this process may still allocate on a CPU, as two limits ((bytes, words) each, or (None, '')): the
    host's, which its processes share (device.host_headroom), and this process's own (the address space RLIMIT_AS
    leaves it: each process has the whole limit), known only where it is the smaller."""
    host, own = host_headroom(), address_space_headroom()
    return host, own if own[0] is not None and (host[0] is None or own[0] < host[0]) else (None, '')


def headroom(dev):
    """headrooms() of a CPU device; a CUDA device's free memory as the shared limit, with none of its own."""
    return (dev.free_memory(), (None, '')) if dev.type == 'cuda' else headrooms()


def memory_problem(parts, processes, what, where, give, override, own=(None, '')):
    """'' when `processes` processes of this need fit in `give` bytes (what a limit they share leaves them,
    `where` in words) and one of them in `own` (bytes, words: what a limit of each process's own leaves it,
    RLIMIT_AS's), else one line: the need and its parts, the limit that refuses it (the tighter one, in its
    words), and what to change or `override` to start anyway."""
    each = need(parts)
    refused = [(g / n, g, w, n) for g, w, n in ((give, where, processes), (*own, 1)) if g is not None and n * each > g]
    if not refused:
        return ''
    _, give, where, n = min(refused)
    many = f"{n} processes x {size(each)} of memory" if n > 1 else \
        f"{size(each)} of memory" + (f" in each of its {processes} processes" if processes > 1 else '')
    return (f"{what} needs about {many} ({describe(parts)}), more than the {size(give)} {where}: lower "
            f"global_batch_size (or raise gradient_accumulation_steps), eval_batch_size or eval_views, run it on "
            f"a larger machine, or set {override} to start it anyway")
