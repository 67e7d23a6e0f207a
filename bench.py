"""
Speed of TRM training and evaluation on the current device (CPU, CUDA GPU or XLA/TPU), with exactly the
model and training step of train.py (model.train_step: forward_loss, backward, AdamATan2, sign-SGD on the
puzzle embedding, EMA), on random batches or on a dataset:
    python bench.py                                               # the paper's Sudoku MLP model
    python bench.py config/baseline.py --global_batch_size=384    # any train.py config; the batch is global_batch_size
    python bench.py --device=cpu --forward_dtype=float32 --steps=2 --warmup_steps=1 --eval_batch_size=8
    python bench.py --compile=True --compile_mode=max-autotune-no-cudagraphs    # CUDA
    PJRT_DEVICE=TPU python bench.py config/baseline.py --loss_dtype=float32
    python bench.py --profile=True                                # also a trace of profile_steps steps
It prints ms/step, examples/s, tokens/s, model FLOPs, MFU against the device's peak dense bf16 rate, warm-up
(compile) time, peak memory, evaluation puzzles/s, and on XLA the graph compilations and CPU fallbacks.
The last line, `bench: key=value ...`, is for scripts.
"""
import ast
import os
import resource
import time

import numpy as np
import torch

# -----------------------------------------------------------------------------
# config. First every key of train.py with its default, read from train.py's config block, so that its
# config files (config/baseline.py sets data_path, epochs, lr, out_dir, ...) and flags work here unchanged.
_here = os.path.dirname(os.path.abspath(__file__))
for _node in ast.parse(open(os.path.join(_here, 'train.py')).read()).body:
    if isinstance(_node, ast.Assign) and isinstance(_node.targets[0], ast.Name):
        if _node.targets[0].id == 'config_keys':
            break  # the end of train.py's config block
        try:
            globals()[_node.targets[0].id] = ast.literal_eval(_node.value)
        except ValueError:
            pass  # not a plain literal: not a config key
# then bench's own keys and defaults
global_batch_size = 0           # the batch size; 0: 768 on a GPU or TPU, 64 on the CPU (config files may set it)
data_path = ''                  # '': random tokens of the shape below; else a dataset folder (shape from its metadata)
seq_len = 81                    # random data: Sudoku-sized
vocab_size = 11
num_puzzle_identifiers = 1
steps = 20                      # timed training steps
warmup_steps = 3                # untimed steps first: compilation, autotuning, allocator (XLA: the first 2 steps differ)
eval_batches = 3                # timed evaluation batches (model.predict for eval_steps or halt_max_steps steps); 0 skips
compile_mode = 'default'        # with --compile=True on CUDA; 'max-autotune-no-cudagraphs' compiles for minutes
profile = False                 # afterwards, trace profile_steps more steps into profile_dir
profile_steps = 3
profile_dir = 'out/profile'
# -----------------------------------------------------------------------------
exec(open(os.path.join(_here, 'configurator.py')).read())
# -----------------------------------------------------------------------------

from model import TRM, AdamATan2, TRMConfig, forward_loss, train_step  # noqa: E402

# peak dense bf16 TFLOP/s of one GPU or TPU chip (datasheets), for MFU; the first name found in the device's wins
PEAK_TFLOPS = [('H100 PCIe', 756), ('H100 NVL', 835), ('H100', 989), ('H200', 989), ('A100', 312), ('L40S', 362),
               ('v6e', 918), ('v6 lite', 918), ('v5e', 197), ('v5 lite', 197), ('v5litepod', 197),
               ('v5p', 459), ('TPU v5', 459), ('v4', 275)]

kind = device if device != 'auto' else \
    'xla' if os.environ.get('PJRT_DEVICE') else 'cuda' if torch.cuda.is_available() else 'cpu'  # as train.py
if kind not in ('cpu', 'cuda', 'xla'):
    raise SystemExit(f"config error: device={device!r}; allowed 'auto', 'cpu', 'cuda', 'xla'")
if kind == 'xla':
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    dev = torch_xla.device()
    if warmup_steps < 2:  # step 1 also creates the optimizer state: a graph of its own
        print(f"note: warmup_steps={warmup_steps} -> 2 on XLA (the first two steps compile different graphs)")
        warmup_steps = 2
elif kind == 'cuda':
    dev = torch.device('cuda')
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py
    torch.backends.cudnn.allow_tf32 = True
else:
    dev = torch.device('cpu')
if compile and kind != 'cuda':
    print(f"note: compile=True applies to CUDA only (as in train.py); ignored on {kind}")
global_batch_size = global_batch_size or (64 if kind == 'cpu' else 768)


def device_name():
    if kind == 'cuda':
        return torch.cuda.get_device_name(dev)
    if kind == 'xla':
        name = xm.xla_device_kind(dev)  # e.g. 'TPU v4', 'TPU v5 lite', 'cpu'
        accel = os.environ.get('TPU_ACCELERATOR_TYPE', '')  # e.g. 'v5litepod-8'
        if not accel and xm.xla_device_hw(dev) == 'TPU':
            try:
                accel = torch_xla.tpu.get_tpu_type()  # asks the TPU VM's metadata server
            except Exception:
                pass
        return f"XLA {name} {accel}".strip()
    try:
        cpu = next(l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name'))
    except Exception:
        cpu = 'cpu'
    return f"{cpu}, {torch.get_num_threads()} threads"


def peak_tflops(name):
    if kind == 'cpu' or name.startswith('XLA cpu'):
        return None  # no meaningful peak figure for a CPU
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in name.lower()), None)


def wait():
    """Block until the device has finished everything queued, so the clock can be read."""
    if kind == 'cuda':
        torch.cuda.synchronize()
    elif kind == 'xla':
        xm.wait_device_ops()


def compiles():
    """XLA graph compilations so far (0 elsewhere)."""
    return (met.metric_data('CompileTime') or [0])[0] if kind == 'xla' else 0


def xla_fallbacks():
    """{aten op: count} of the ops XLA could not lower and ran on the CPU (none inside a clean step)."""
    return {n: met.counter_value(n) for n in sorted(met.counter_names()) if n.startswith('aten::')} if kind == 'xla' else {}


def peak_memory():
    """(bytes, what was measured)."""
    if kind == 'cuda':
        return torch.cuda.max_memory_allocated(dev), 'peak allocated'
    if kind == 'xla':
        try:
            info = xm.get_memory_info(dev)
            return int(info.get('peak_bytes_used', info['bytes_used'])), 'device peak'
        except Exception:
            pass  # the XLA CPU client has no allocator statistics
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'process max RSS'  # Linux: KiB


# --- data: a few batches staged on the device up front (loading is not what is measured) -----------------
torch.manual_seed(seed)
if kind == 'xla':
    xm.set_rng_state(seed)  # the ACT exploration draws on the device
if data_path and not os.path.exists(os.path.join(data_path, 'train', 'dataset.json')):
    print(f"note: no dataset at data_path={data_path!r}; using random batches (the speed does not depend on the data)")
    data_path = ''
eval_B = eval_batch_size or global_batch_size
n_eval_steps = eval_steps or halt_max_steps
if data_path:
    from data import EvalLoader, TrainLoader
    loader = TrainLoader(data_path, global_batch_size, seed=seed)
    vocab_size, seq_len, num_puzzle_identifiers = (loader.meta[k] for k in ('vocab_size', 'seq_len', 'num_puzzle_identifiers'))
    host_train = [loader.next_batch() for _ in range(2)]
    host_eval = []
    for b in EvalLoader(data_path, eval_B, split='test'):
        host_eval.append({k: b[k] for k in ('inputs', 'labels', 'puzzle_identifiers')})
        if len(host_eval) == 2:
            break
else:
    rng = np.random.default_rng(seed)

    def random_batch(B):
        return dict(inputs=rng.integers(1, vocab_size, (B, seq_len), dtype=np.int32),  # 0 is PAD
                    labels=rng.integers(1, vocab_size, (B, seq_len), dtype=np.int32),
                    puzzle_identifiers=rng.integers(0, num_puzzle_identifiers, B, dtype=np.int32))
    host_train = [random_batch(global_batch_size) for _ in range(2)]
    host_eval = [random_batch(eval_B) for _ in range(2)]
to_dev = lambda b: {k: torch.from_numpy(v).to(dev) for k, v in b.items()}
batches, eval_data = [to_dev(b) for b in host_train], [to_dev(b) for b in host_eval]

# --- model, optimizer, EMA and step, as train.py builds them ---------------------------------------------
model_keys = [f for f in TRMConfig.__dataclass_fields__ if f not in ('vocab_size', 'seq_len', 'num_puzzle_identifiers')]
cfg = TRMConfig(vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
                **{k: globals()[k] for k in model_keys})
model = TRM(cfg).to(dev)
model.train()
opt = AdamATan2(model.parameters(), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
ema_params = [p.detach().clone() for p in model.parameters()] if ema else None  # the same update as an EMA model's
fwd = torch.compile(forward_loss, mode=compile_mode) if (compile and kind == 'cuda') else forward_loss
hp = dict(lr=lr, puzzle_emb_lr=puzzle_emb_lr, puzzle_emb_weight_decay=puzzle_emb_weight_decay, warmup=lr_warmup_steps,
          total=10 ** 6, min_ratio=lr_min_ratio, global_batch_size=global_batch_size, ema_rate=ema_rate if ema else None)
step_t = torch.zeros((), device=dev)  # the step count lives on the device, as in train.py
carry = model.initial_carry(batches[0])
loss = None

name = device_name()
peak = peak_tflops(name)
flops = model.flops_per_example()  # one supervision step: every net call, the no-grad recursion passes included
print(f"device: {kind} | {name} | peak {f'{peak} TFLOP/s bf16' if peak else 'n/a'}")
print(f"model: {model.num_params():,} parameters | {'mlp_t' if mlp_t else 'attention'}, pos {pos_encodings}, "
      f"D {hidden_size}, H_cycles {H_cycles}, L_cycles {L_cycles} | batch {global_batch_size} x {seq_len} tokens | "
      f"{forward_dtype}, loss {loss_type} {loss_dtype} | {flops / 1e9:.2f} GFLOPs per example-step | "
      f"data {data_path or 'random'}")


def run_steps(n):
    """n training steps; returns their wall time, read once the device has finished them."""
    global carry, loss
    t0 = time.perf_counter()
    for i in range(n):
        carry, loss, _ = train_step(model, opt, ema_params, carry, batches[i % len(batches)], step_t, hp, fwd)
        if kind == 'xla':
            torch_xla.sync()  # one graph per step, as train.py cuts it
    wait()
    return time.perf_counter() - t0


# --- training ---------------------------------------------------------------------------------------------
warmup_s = run_steps(warmup_steps)
compiles_warm = compiles()
dt = run_steps(steps) / max(steps, 1)
compiles_end = compiles()
fallbacks = xla_fallbacks()  # read before anything below moves a value to the host
ex_s = global_batch_size / dt
tflops = flops * ex_s / 1e12
mfu = tflops / peak if peak else None
mem, mem_what = peak_memory()
print(f"train: {dt * 1e3:.1f} ms/step | {ex_s:.1f} examples/s | {ex_s * seq_len:.0f} tokens/s | {tflops:.3f} TFLOP/s | "
      f"MFU {f'{100 * mfu:.1f}%' if mfu else 'n/a'} | warm-up {warmup_s:.1f} s ({warmup_steps} steps) | "
      f"memory {mem / 2 ** 30:.2f} GiB ({mem_what}) | loss {float(loss.cpu()) / global_batch_size:.4f}")

# --- evaluation: fresh batches, n_eval_steps supervision steps each, no halting (as train.py's evaluate) --
eval_ps = eval_mfu = eval_warm_s = None
eval_fallbacks = {}
compiles_eval_warm = compiles_eval_end = compiles_end
if eval_batches > 0:
    model.eval()  # the trained weights themselves, not the EMA copy: the cost is the same
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.predict(eval_data[0], n_eval_steps)  # untimed: compiles the evaluation graph on XLA
        if kind == 'xla':
            torch_xla.sync()
        wait()
        eval_warm_s = time.perf_counter() - t0
        compiles_eval_warm = compiles()
        t0 = time.perf_counter()
        for i in range(eval_batches):
            out = model.predict(eval_data[i % len(eval_data)], n_eval_steps)  # kept: XLA skips what nothing uses
            if kind == 'xla':
                torch_xla.sync()
        wait()
        eval_ps = eval_B * eval_batches / (time.perf_counter() - t0)
        compiles_eval_end = compiles()
    eval_fallbacks = {n: c - fallbacks.get(n, 0) for n, c in xla_fallbacks().items() if c > fallbacks.get(n, 0)}
    model.train()
    eval_tflops = model.flops_per_example(train=False) * n_eval_steps * eval_ps / 1e12
    eval_mfu = eval_tflops / peak if peak else None
    print(f"eval: {eval_ps:.1f} puzzles/s ({n_eval_steps} steps, batch {eval_B}) | {eval_tflops:.3f} TFLOP/s | "
          f"MFU {f'{100 * eval_mfu:.1f}%' if eval_mfu else 'n/a'} | warm-up {eval_warm_s:.1f} s")

if kind == 'xla':
    print(f"xla: compilations {compiles_warm} after warm-up, {compiles_end} after the timed steps"
          f"{' (no recompilation)' if compiles_end == compiles_warm else ' -- RECOMPILED: run with PT_XLA_DEBUG_LEVEL=2'}"
          f"; evaluation {compiles_eval_warm} -> {compiles_eval_end}")
    print("xla: CPU fallbacks in training: " + (', '.join(f'{n} x{c}' for n, c in fallbacks.items()) or 'none')
          + '; in evaluation: ' + (', '.join(f'{n} x{c}' for n, c in eval_fallbacks.items()) or 'none'))

# --- profile: a few more steps under the profiler, after the timing --------------------------------------
if profile:
    os.makedirs(profile_dir, exist_ok=True)
    if kind == 'xla':
        import torch_xla.debug.profiler as xp
        xp.start_trace(profile_dir)
        run_steps(profile_steps)
        xp.stop_trace()
        print(f"profile: XLA trace of {profile_steps} steps under {profile_dir} (TensorBoard's profile plugin / XProf)")
    else:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == 'cuda' else [])
        with torch_profile(activities=acts) as prof:
            run_steps(profile_steps)
        path = os.path.join(profile_dir, f'trace_{kind}.json')
        prof.export_chrome_trace(path)
        print(prof.key_averages().table(sort_by='self_cuda_time_total' if kind == 'cuda' else 'self_cpu_time_total',
                                        row_limit=15))
        print(f"profile: chrome trace of {profile_steps} steps in {path} (open in https://ui.perfetto.dev)")

fmt = lambda x, spec: 'n/a' if x is None else format(x, spec)
print(f"bench: device={kind} batch={global_batch_size} dtype={forward_dtype} ms_per_step={dt * 1e3:.2f} "
      f"examples_per_s={ex_s:.2f} tokens_per_s={ex_s * seq_len:.0f} flops_per_example={flops} tflops={tflops:.4f} "
      f"mfu={fmt(mfu, '.4f')} warmup_s={warmup_s:.2f} peak_mem_gib={mem / 2 ** 30:.3f} "
      f"eval_puzzles_per_s={fmt(eval_ps, '.2f')} eval_mfu={fmt(eval_mfu, '.4f')} "
      f"compiles_warm={compiles_warm} compiles_end={compiles_end} fallbacks={len(fallbacks)}")
