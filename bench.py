"""
Throughput of the TRM training step and of evaluation on the current device, with the same model
and step as train.py, on synthetic batches (or a real dataset with --data_path=...):
    python bench.py                                   # the paper's Sudoku MLP model
    python bench.py config/baseline.py --global_batch_size=384
    PJRT_DEVICE=TPU python bench.py config/baseline.py --loss_dtype=float32
Prints ms/step, examples/s, tokens/s, model FLOPs, MFU against the device's peak, warm-up (compile)
time, peak memory, evaluation puzzles/s; on XLA also the graph compilations after warm-up and at the end.
"""
import os
import resource
import time

import numpy as np
import torch

# -----------------------------------------------------------------------------
# config: every key of train.py is accepted (so its config files work), plus a few of bench's own
_src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')).read()
exec(_src[_src.index('# I/O\n'):_src.index('# ---', _src.index('# I/O\n'))])  # train.py's config block
data_path = ''             # '' -> synthetic batches of the shape below
seq_len = 81               # synthetic data: Sudoku-sized
vocab_size = 11
num_puzzle_identifiers = 1
device = 'auto'
steps = 20                 # timed training steps
warmup_steps = 3           # untimed steps first (compilation happens here)
eval_batches = 3           # timed evaluation batches of halt_max_steps steps each
profile = False            # write a torch.profiler trace of a few steps
profile_dir = 'out/profile'
# -----------------------------------------------------------------------------
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
# -----------------------------------------------------------------------------

from model import TRM, AdamATan2, TRMConfig, forward_loss, train_step  # noqa: E402

# peak dense bf16 TFLOP/s (per chip / GPU), for MFU
PEAK_TFLOPS = [('H100 PCIe', 756), ('H100', 989), ('H200', 989), ('A100', 312), ('L40S', 362),
               ('v6e', 918), ('v5e', 197), ('v5litepod', 197), ('v4', 275)]


def device_name_and_peak(kind, dev):
    if kind == 'cuda':
        name = torch.cuda.get_device_name(dev)
    elif kind == 'xla':
        import torch_xla.runtime as xr
        name = f"xla:{xr.device_type()}"
        try:
            import torch_xla.core.xla_model as xm
            name += ' ' + str(xm.xla_device_hw(dev)) + ' ' + os.environ.get('TPU_ACCELERATOR_TYPE', '')
        except Exception:
            pass
    else:
        return 'cpu', None
    for key, peak in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return name, peak
    return name, None


kind = 'xla' if (device == 'auto' and os.environ.get('PJRT_DEVICE')) else \
    ('cuda' if device == 'auto' and torch.cuda.is_available() else ('cpu' if device == 'auto' else device))
if kind == 'xla':
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    dev = torch_xla.device()
else:
    dev = torch.device('cuda' if kind == 'cuda' else 'cpu')


def wait():
    """Everything queued so far has finished, so the clock can be read."""
    if kind == 'cuda':
        torch.cuda.synchronize()
    elif kind == 'xla':
        torch_xla.sync()
        xm.wait_device_ops()


def compiles():
    return ((met.metric_data('CompileTime') or [0])[0]) if kind == 'xla' else 0


torch.manual_seed(seed)
if data_path:
    from data import EvalLoader, TrainLoader
    loader = TrainLoader(data_path, global_batch_size, seed=seed)
    meta = loader.meta
    vocab_size, seq_len, num_puzzle_identifiers = meta['vocab_size'], meta['seq_len'], meta['num_puzzle_identifiers']
    next_batch = loader.next_batch
else:
    rng = np.random.default_rng(seed)

    def next_batch():
        x = rng.integers(1, vocab_size, (global_batch_size, seq_len), dtype=np.int32)
        return dict(inputs=x, labels=x.copy(), puzzle_identifiers=np.zeros(global_batch_size, dtype=np.int32))

model_keys = [f for f in TRMConfig.__dataclass_fields__ if f not in ('vocab_size', 'seq_len', 'num_puzzle_identifiers')]
cfg = TRMConfig(vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
                **{k: globals()[k] for k in model_keys})
model = TRM(cfg).to(dev)
opt = AdamATan2(model.parameters(), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
ema_params = [p.detach().clone() for p in model.parameters()] if ema else None
fwd = torch.compile(forward_loss) if (compile and kind == 'cuda') else forward_loss
hp = dict(lr=lr, puzzle_emb_lr=puzzle_emb_lr, puzzle_emb_weight_decay=puzzle_emb_weight_decay, warmup=lr_warmup_steps,
          total=10 ** 6, min_ratio=lr_min_ratio, global_batch_size=global_batch_size, ema_rate=ema_rate if ema else None)
step_t = torch.zeros((), device=dev)
to_dev = lambda b: {k: torch.from_numpy(v).to(dev) for k, v in b.items()}
batches = [to_dev(next_batch()) for _ in range(2)]  # data loading is not what is measured here
carry = model.initial_carry(batches[0])
name, peak = device_name_and_peak(kind, dev)
flops = model.flops_per_example()
print(f"bench: {name} | {model.num_params():,} parameters | batch {global_batch_size} | {cfg.forward_dtype} | "
      f"{flops / 1e9:.2f} GFLOPs per example-step")

# --- training ------------------------------------------------------------------------------------

def run_steps(n):
    """n training steps; returns their wall time once the device has finished them."""
    global carry, loss
    t0 = time.time()
    for i in range(n):
        carry, loss, _ = train_step(model, opt, ema_params, carry, batches[i % 2], step_t, hp, fwd)
        if kind == 'xla':
            torch_xla.sync()
    wait()
    return time.time() - t0


warmup_s = run_steps(warmup_steps)
compiles_warm = compiles()
if kind == 'cuda':
    torch.cuda.reset_peak_memory_stats(dev)
dt = run_steps(steps) / steps
compiles_end = compiles()
ex_s = global_batch_size / dt
tflops = flops * ex_s / 1e12
mfu = f"{100 * tflops / peak:.1f}%" if peak else 'n/a'
if kind == 'cuda':
    mem = f"{torch.cuda.max_memory_allocated(dev) / 2 ** 30:.2f} GiB"
elif kind == 'xla':
    try:
        info = xm.get_memory_info(dev)
        mem = f"{info.get('peak_bytes_used', info.get('bytes_used', 0)) / 2 ** 30:.2f} GiB"
    except Exception:
        mem = 'n/a'
else:
    mem = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB (process max RSS)"
print(f"train: {dt * 1000:.1f} ms/step | {ex_s:.1f} examples/s | {ex_s * seq_len:.0f} tokens/s | "
      f"{tflops:.3f} TFLOP/s | MFU {mfu} | warm-up {warmup_s:.1f} s ({warmup_steps} steps) | peak memory {mem} | "
      f"final loss {float(loss.cpu()) / global_batch_size:.4f}")

# --- evaluation: halt_max_steps supervision steps per batch, no halting ----------------------------
eval_ps = float('nan')
if eval_batches > 0:
    model.eval()
    with torch.no_grad():
        preds, _ = model.predict(batches[0], halt_max_steps)  # the same graph as timed below (same outputs kept)
        wait()
        t0 = time.time()
        for i in range(eval_batches):
            preds, _ = model.predict(batches[i % 2], halt_max_steps)
            if kind == 'xla':
                torch_xla.sync()
        wait()
    eval_ps = global_batch_size * eval_batches / (time.time() - t0)
    eval_tflops = model.flops_per_example(train=False) * halt_max_steps * eval_ps / 1e12
    eval_mfu = f"{100 * eval_tflops / peak:.1f}%" if peak else 'n/a'
    print(f"eval: {eval_ps:.1f} puzzles/s at {halt_max_steps} steps | {eval_tflops:.3f} TFLOP/s | MFU {eval_mfu}")
if kind == 'xla':
    fallbacks = sorted(n for n in met.counter_names() if n.startswith('aten::'))
    print(f"xla: {compiles_warm} compilations after warm-up, {compiles_end} after the timed steps "
          f"(equal: no recompilation) | CPU fallbacks: {', '.join(fallbacks) or 'none'}")

if profile:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    os.makedirs(profile_dir, exist_ok=True)
    model.train()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == 'cuda' else [])
    with torch_profile(activities=acts) as prof:
        run_steps(3)
    path = os.path.join(profile_dir, f'trace_{kind}.json')
    prof.export_chrome_trace(path)
    print(f"profile: wrote {path} (open in chrome://tracing or https://ui.perfetto.dev)")

print(f"bench: device={kind} ms_per_step={dt * 1000:.2f} examples_per_s={ex_s:.2f} tokens_per_s={ex_s * seq_len:.0f} "
      f"flops_per_example={flops} mfu={mfu} eval_puzzles_per_s={eval_ps:.2f} compiles_warm={compiles_warm} "
      f"compiles_end={compiles_end}")
