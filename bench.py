"""
Speed of TRM training and evaluation on the current device (CPU, CUDA GPU or XLA/TPU), with exactly the
model and training step of train.py (step.train_step: forward, loss, backward, AdamATan2, sign-SGD on the
puzzle embedding, EMA), on random batches or on a dataset:
    python bench.py                                             # the paper's Sudoku MLP model
    python bench.py config/baseline.py --global_batch_size=384  # any train.py config and batch
    python bench.py config/quickstart.py --steps=3 --warmup_steps=1  # a laptop CPU: the quick start's model, seconds
    python bench.py config/maze.py                              # the shape from the config: 900 tokens
    python bench.py config/arc1.py --global_batch_size=8        # ARC-AGI-1: 900 tokens, an 876,406-row table
    python bench.py --compile=False                             # CUDA, TorchTPU, XLA: eager (train.py compiles)
    python bench.py --compile_mode=max-autotune-no-cudagraphs   # CUDA
    python bench.py --seq_align=1                               # mlp_t without the sequence padding (A/B)
    python bench.py --kernels=off --kernels_ab=mlp_t            # CUDA: backends/kernels.py off, then kernels=mlp_t
    PJRT_DEVICE=TPU python bench.py config/baseline.py --loss_dtype=float32
    PJRT_DEVICE=TPU python bench.py config/baseline.py --vs_eager=True  # and the eager step: device_vs_eager=
    python bench.py --profile_steps=0:3                         # also a trace of 3 more steps
    python bench.py --eval_views=8                              # every evaluated puzzle in 8 views (train.py's)
    python bench.py config/baseline.py --steps=0 --eval_batches=0 --checkpoint_dir=gs://B/x  # save + upload
The task's shape (tokens per example, vocabulary): from the dataset's metadata when data_path holds one, else
from data_path's name ('maze' -> 30x30 maze, 900 tokens, vocab 6; 'sudoku6' -> 6x6; 'arc1...' / 'arc2...' ->
ARC-AGI's 30x30 canvas, 900 tokens, vocab 12, and its puzzle embedding table's rows; else 9x9 Sudoku, 81
tokens, vocab 11); --seq_len / --vocab_size / --num_puzzle_identifiers override it. On CUDA, TorchTPU and XLA the
step and the evaluation are compiled (train.py's compile=True: step.step_form and step.compiled_predict, the ones
train.py uses, with the device's torch.compile backend). On
XLA it also splits a step's time into the host's (tracing, hashing, dispatch; each step waited for, so the two
do not overlap) and the device's execution (torch_xla's ExecuteTime), and says which one bounds the step;
with vs_eager=True it measures the eager (lazy) step too, in the same run, and prints the ratio of the two
steps' device times, and the median ratio with the two steps alternated one by one (robust to a machine whose
speed drifts).
It prints ms/step, examples/s, tokens/s, model FLOPs, MFU against the device's peak dense bf16 rate, the time
to the first step (compilation) apart from the timed steps, peak memory, evaluation puzzles/s, and on XLA the
graph compilations and CPU fallbacks. With a puzzle embedding it also times the sign-SGD update of the table
alone (step.sign_sgd_update_, emb_update_ms) on emb_update_batch ids, four examples per puzzle as in ARC's
batches; emb_update_dense=True times the same update computed over the whole table as well (three table-sized
temporaries: at ARC-AGI-1's 1.8 GB table, 5.4 GB more memory). The last line, `bench: key=value ...`, is for scripts.
With train.py's eval_views=K the evaluation batches are those of train.py's K-view evaluation: each of the
eval_batch_size puzzles in K views (puzzles.py's symmetries of the dataset's kind, view 0 the puzzle itself), one
batch of K x eval_batch_size rows; puzzles/s counts puzzles, and the evaluation's FLOPs and MFU count every view.
The votes over the views (host work after the batch's one read) are not timed.
A CPU or CUDA bench whose batch its memory cannot hold (runkeep/memory.py's estimate, train.py's start-up check)
is refused in one line before anything is allocated; check_memory=False starts it anyway.
"""
import contextlib
import os
import time

import numpy as np

from configurator import import_torch

torch = import_torch()  # where an address-space limit leaves it no room: one line

from configurator import config_problems, file_in_the_way, read_config_block, set_where  # noqa: E402

# every key of train.py with its default, so that its config files and flags work here unchanged
_here = os.path.dirname(os.path.abspath(__file__))
_train_keys = read_config_block(os.path.join(_here, 'train.py'))
globals().update({k: v for k, (v, _) in _train_keys.items()})
# -----------------------------------------------------------------------------
# config: bench's own keys (train.py's are above)
global_batch_size = 0           # batch size; 0: 768 on a GPU or TPU, 64 on the CPU (config files may set it)
data_path = ''                  # dataset folder (shape, batches); if absent, its name says the shape
seq_len = 0                     # tokens/example; 0: from the dataset or data_path's name (default 81, 9x9)
vocab_size = 0                  # 0: likewise (Sudoku 9x9: 11, maze: 6)
num_puzzle_identifiers = 0      # puzzle embedding rows; 0: the dataset's, or data_path's name (arc1: 876,406,
                                # arc2: 1,191,730), else 1
seq_align = 8                   # mlp_t pads its matmuls' sequence axis to a multiple of this (exact); 1: off
steps = 20                      # timed train steps (0: none; with checkpoint_dir, only the checkpoint's)
warmup_steps = 3                # untimed steps, the first timed alone: compile, autotune, allocator (XLA: 2+)
eval_batches = 3                # timed eval batches (model.predict, eval_steps or halt_max_steps); 0 skips
compile_mode = 'default'        # torch.compile mode (CUDA): 'default' | 'max-autotune-no-cudagraphs' (minutes)
profile_steps = ''              # 'START:END': after the timing, a profiler trace of END-START more steps into
                                # profile_dir (train.py's key, which traces a run's steps START+1..END)
profile_dir = 'out/profile'     # where profile_steps='START:END' puts a trace of END-START more steps
host_flush_mb = 0               # XLA on the CPU: read this many MiB after each execution before host time is taken
                                # again, so every depth's host work starts from cold caches (there the device's
                                # executions share the host's caches, the deeper ones evicting more; on a TPU not)
vs_eager = False                # XLA, compile=True: also time the eager step (host, device) after the
                                # compiled one; prints device_vs_eager= (compiled device time / eager's) and
                                # device_vs_eager_alternated= (the median ratio with the steps alternated)
emb_update_batch = 0            # ids per timed sign-SGD update of the puzzle embedding (0: global_batch_size)
emb_update_dense = False        # also time the update computed over the whole table (table-sized temporaries)
kernels_ab = ''                 # a kernels value to time the step and the evaluation again with ('': no A/B),
                                # same model, batches and process; print both and their ratio (profile_steps then
                                # traces the second)
checkpoint_dir = ''             # first time a checkpoint of this model and batch as train.py writes it (on SIGTERM too): here, and its upload when gs://
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(_here, 'configurator.py')).read())
# train.py's keys pass train.py's rules (global_batch_size's 0 is bench's: the device's default, below); bench's
# own counts may not be negative
_bad = config_problems({k: globals()[k] for k in _train_keys if (k, globals()[k]) != ('global_batch_size', 0)},
                       _set_at)
_bad += [f"{k}={globals()[k]!r} (allowed: >= 0){set_where(_set_at, [k])}" for k in config_keys
         if k not in _train_keys and type(globals()[k]) in (int, float) and globals()[k] < 0]
if profile_steps and not profile_dir:  # the trace's folder is made after the timing: said now
    _bad.append(f"profile_dir={profile_dir!r} names no folder (allowed: a folder, or one that can be made)"
                f"{set_where(_set_at, ['profile_dir'])}")
elif profile_steps and (_up := file_in_the_way(profile_dir)):
    _bad.append(f"profile_dir={profile_dir!r}: {_up} is a file (allowed: a folder, or one that can be made)"
                f"{set_where(_set_at, ['profile_dir'])}")
if freeze_weights and not puzzle_emb_ndim:  # train.py's rule: its step would train nothing
    _bad.append("freeze_weights=True trains only the puzzle embedding, and puzzle_emb_ndim=0 has none: nothing "
                "would train")
if _bad:
    raise SystemExit("config error: " + '; '.join(_bad))
# train.py's keys of a run (its folder, starting point, records, length) pass so that its config files work here;
# one typed as a flag is said, as bench times this config's model from fresh weights and writes no run (and
# xla_cache_dir: the first step's time is the compilation's, cold)
_run_keys = ('out_dir', 'local_dir', 'init_from', 'overwrite', 'eval_only', 'eval_every_epochs', 'eval_subset',
             'arc_pool_votes', 'arc_answers', 'log_interval', 'checkpoint_interval', 'keep_last_n', 'wandb_log',
             'wandb_project', 'wandb_run_name', 'tensorboard', 'epochs', 'max_steps', 'max_minutes', 'preflight',
             'watchdog_minutes', 'xla_cache_dir')
if _typed := [f'--{k}' for k in _run_keys if _set_by.get(k, '').startswith('--')]:
    print(f"note: {', '.join(_typed)}: train.py's keys of a run, which bench.py does not use (it times the config's "
          f"model from fresh weights, writing no run: checkpoint_dir times a save)")
# -----------------------------------------------------------------------------

from data import BUILDING, check_split, in_views, load_metadata  # noqa: E402
from device import Device, Profiler, choose_dtype, parse_steps, resolve_device  # noqa: E402
from device import KERNEL_CHOICES, resolve_loss_dtype, use_kernels  # noqa: E402
from model import MODEL_KEYS, TRM, TRMConfig  # noqa: E402
from puzzles import puzzle_for, puzzle_type, shape_from_name, views_problem  # noqa: E402
from step import AdamATan2, Eager, StepConfig, compiled_predict, step_form  # noqa: E402
from step import sign_sgd_update_, train_step  # noqa: E402

device_type = resolve_device(device)
dev = Device(device_type)
if device_type == 'xla':
    if warmup_steps < 2:  # step 1 also creates the optimizer state: a graph of its own
        print(f"note: warmup_steps={warmup_steps} -> 2 on XLA (the first two steps compile different graphs)")
        warmup_steps = 2
compiled = bool(compile) and device_type != 'cpu'  # as train.py compiles
if compile and device_type == 'cpu':
    print("note: compile=True applies to CUDA, TorchTPU and XLA (the train.py key); the CPU runs the step eagerly")
global_batch_size = global_batch_size or (64 if device_type == 'cpu' else 768)
if steps == 0 and not checkpoint_dir:  # (a negative count is refused above)
    raise SystemExit(f"config error: steps={steps}; at least 1 step is timed (0 only with checkpoint_dir)"
                     f"{set_where(_set_at, ['steps'])}")
if steps == 0 and profile_steps:  # it ends after the save, before the steps a trace would take
    print(f"note: profile_steps={profile_steps}: steps=0 times the checkpoint alone, so no step is traced")
if seq_align < 1:
    raise SystemExit(f"config error: seq_align={seq_align} (allowed: >= 1){set_where(_set_at, ['seq_align'])}")
if vocab_size == 1:  # random batches draw their tokens from 1 .. vocab_size-1
    raise SystemExit(f"config error: vocab_size={vocab_size} (allowed: 0 or >= 2: token 0 is PAD, so a vocabulary "
                     f"of 1 has no token to hold){set_where(_set_at, ['vocab_size'])}")
if kernels_ab not in ('',) + KERNEL_CHOICES:  # (kernels: refused above with train.py's keys)
    raise SystemExit(f"config error: kernels_ab={kernels_ab!r} (allowed: '' (no A/B) | "
                     f"{' | '.join(map(repr, KERNEL_CHOICES))}){set_where(_set_at, ['kernels_ab'])}")
compile_modes = ('default', 'max-autotune-no-cudagraphs')
if compile_mode not in compile_modes:
    raise SystemExit(f"config error: compile_mode={compile_mode!r} (allowed: {' | '.join(map(repr, compile_modes))}; "
                     f"the modes with CUDA graphs overwrite the carry one step returns before the next step reads it)"
                     f"{set_where(_set_at, ['compile_mode'])}")
profile_span = parse_steps(profile_steps) if profile_steps else None  # (checked above) traced after the timing
warmup_steps = max(warmup_steps, 1)  # the first step (compilation) is never among the timed ones
forward_dtype, dtype_why, warning = choose_dtype(forward_dtype, device_type)
if warning:
    print(warning)
loss_dtype = resolve_loss_dtype(loss_dtype, device_type)


fmt = lambda x, spec: 'n/a' if x is None else format(x, spec)



# --- the task's shape, then a few batches staged on the device up front (loading is not what is measured) ---
dev.manual_seed(seed)
have_data = bool(data_path) and os.path.exists(os.path.join(data_path, 'train', 'dataset.json'))
# a dataset's first build under way (prepare_*.py, or one that was killed): its name says the shape, as a name with
# nothing there does
_unbuilt = os.path.exists(os.path.join(data_path, BUILDING + '.lock')) and \
    not os.path.exists(os.path.join(data_path, 'train'))
if have_data:  # both splits are read (train and evaluation batches): a broken file is named, not met mid-run
    if _broken := check_split(data_path, 'train') + check_split(data_path, 'test'):
        raise SystemExit(f"config error: data_path={data_path}: {_broken[0]}")
    meta = load_metadata(data_path, 'train')
    shape = (meta['seq_len'], meta['vocab_size'],
             f"{puzzle_type(meta) or 'unknown puzzle'}, from the dataset's metadata in {data_path}")
elif os.path.exists(data_path) and not _unbuilt:  # only a name says the shape: a folder there is a mistake
    _up = os.path.dirname(os.path.normpath(data_path))  # a dataset's split folder, say: its dataset is above it
    _hint = f"; --data_path={_up} is one" if os.path.exists(os.path.join(_up, 'train', 'dataset.json')) else ''
    raise SystemExit(f"config error: data_path={data_path}{set_where(_set_at, ['data_path'])}: no dataset there (no "
                     f"train/dataset.json; allowed: a dataset folder, or a name with nothing there, whose words say "
                     f"the shape){_hint}")
else:
    shape = shape_from_name(data_path)
    if data_path:
        shape = shape[:2] + (shape[2] + f"; {'its build unfinished' if _unbuilt else 'no dataset there'}: random "
                                        "batches",)
# ARC-AGI's builds (prepare_arc.py's default names), for a run without the dataset: the shape and the table
ARC_IDENTIFIERS = {'arc1': 876406, 'arc2': 1191730}
arc_ids = next((n for k, n in ARC_IDENTIFIERS.items()
                if os.path.basename(os.path.normpath(data_path)).lower().startswith(k)), None) if data_path else None
if arc_ids and not have_data:
    shape = (900, 12, f"ARC-AGI 30x30 canvas, from data_path's name {data_path!r}; no dataset there: random "
                      "batches")
if seq_len or vocab_size:
    why = ', '.join(f"--{k}={v}" for k, v in (('seq_len', seq_len), ('vocab_size', vocab_size)) if v)
    shape = (seq_len or shape[0], vocab_size or shape[1], f"{why} as given; otherwise {shape[2]}")
    if have_data and (shape[0], shape[1]) != (meta['seq_len'], meta['vocab_size']):
        print(f"note: the dataset's shape is {meta['seq_len']} tokens, vocab {meta['vocab_size']}; random "
              "batches of the given shape instead")
        have_data = False
seq_len, vocab_size = shape[0], shape[1]
print(f"shape: {seq_len} tokens, vocab {vocab_size} ({shape[2]})")
if not have_data:
    data_path = ''
    num_puzzle_identifiers = num_puzzle_identifiers or arc_ids or 1
eval_B = eval_batch_size or global_batch_size  # puzzles per evaluation batch; with views, K x as many rows
n_eval_steps = eval_steps or halt_max_steps
puzzle = puzzle_for(meta if data_path else dict(seq_len=seq_len, vocab_size=vocab_size))  # the views' kind
if not isinstance(eval_views, int) or eval_views < 1:
    raise SystemExit(f"config error: eval_views={eval_views!r} (allowed: an integer >= 1; 1: no views)")
# the network as train.py builds it on this data (model.py's TRMConfig), which the checks below count from
cfg = TRMConfig(vocab_size=vocab_size, seq_len=seq_len,
                num_puzzle_identifiers=meta['num_puzzle_identifiers'] if data_path else num_puzzle_identifiers,
                **{k: globals()[k] for k in MODEL_KEYS})
# as train.py checks them: the whole evaluation batch in K views, each row with the model's latents
row_bytes = cfg.latent_bytes(getattr(torch, forward_dtype).itemsize)
if problem := views_problem(puzzle, eval_views, eval_B, row_bytes):
    raise SystemExit(f"config error: eval_views={eval_views}: {problem} (the shape: {shape[2]})")
if check_memory and device_type in ('cpu', 'cuda'):
    # train.py's start-up check on this batch and table: a CPU without swap that runs out stops answering
    from runkeep.memory import ALLOCATOR_SLACK, headroom, memory_problem, run_memory
    mem_shape = dict(vars(cfg), total_len=cfg.total_len, forward_dtype=forward_dtype, loss_dtype=loss_dtype)
    mem_parts = run_memory(mem_shape, global_batch_size, eval_B * eval_views if eval_batches and steps else 0,
                           n_eval_steps, ema=ema, accumulation=gradient_accumulation_steps)
    if not steps:  # the checkpoint alone: its state is made (gradients, moments, the carry), no step runs
        mem_parts.update(activations=0, slack=ALLOCATOR_SLACK * mem_parts['gradients'])
    elif puzzle_emb_ndim > 0:  # the timed sign-SGD update compares its N ids pairwise: [N, N] bools and int64s
        mem_parts['emb_update'] = 9 * (emb_update_batch or global_batch_size) ** 2
    (give, where), own = headroom(dev)
    if problem := memory_problem(mem_parts, 1, 'this bench', where, give, '--check_memory=False', own):
        raise SystemExit(problem)
if data_path:
    from data import EvalLoader, TrainLoader
    loader = TrainLoader(data_path, global_batch_size, seed=seed)
    if num_puzzle_identifiers and num_puzzle_identifiers != loader.meta['num_puzzle_identifiers']:
        print(f"note: num_puzzle_identifiers={num_puzzle_identifiers} ignored: the dataset has "
              f"{loader.meta['num_puzzle_identifiers']:,}")
    vocab_size, seq_len, num_puzzle_identifiers = (loader.meta[k] for k in
                                                   ('vocab_size', 'seq_len', 'num_puzzle_identifiers'))
    host_train = [loader.next_batch() for _ in range(2)]
    host_eval, eval_puzzles = [], []
    for b in EvalLoader(data_path, eval_B, split='test', seed=seed, views=eval_views, kind=puzzle):
        host_eval.append({k: b[k] for k in ('inputs', 'labels', 'puzzle_identifiers')})  # K x eval_B rows
        eval_puzzles.append(int(b['valid'][:eval_B].sum()))  # the test set's last batch: the rest is padding
        if len(host_eval) == 2:
            break
else:
    rng = np.random.default_rng(seed)

    def random_batch(B):
        return dict(inputs=rng.integers(1, vocab_size, (B, seq_len), dtype=np.int32),  # 0 is PAD
                    labels=rng.integers(1, vocab_size, (B, seq_len), dtype=np.int32),
                    puzzle_identifiers=rng.integers(0, num_puzzle_identifiers, B, dtype=np.int32))
    host_train = [random_batch(global_batch_size) for _ in range(2)]
    host_eval, eval_puzzles = [random_batch(eval_B) for _ in range(2)], [eval_B] * 2
    if eval_views > 1:
        # as data.EvalLoader gives batch b on one rank: view-major, K x eval_B rows
        host_eval = [in_views(batch, puzzle, puzzle.views(eval_views, eval_B, seed, b))
                     for b, batch in enumerate(host_eval)]
batches, eval_data = [dev.to_device(b) for b in host_train], [dev.to_device(b) for b in host_eval]

# --- model, optimizer, EMA and step: model.py's, the same objects train.py builds ---------------------------
model = TRM(cfg, seq_align=seq_align).to(dev.device).requires_grad_(not freeze_weights)  # as train.py's
kernels_in, kernels_why = use_kernels(kernels, device_type, forward_dtype, model)  # train.py's: fused blocks, or plain
model.train()
opt = AdamATan2(model.parameters(), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
ema_params = [p.detach().clone() for p in model.parameters()] if ema else None  # the same update as an EMA
                                                                                # model's
# train.py's step: compiled on CUDA, TorchTPU and XLA with the same helper (forward + loss + its backward; the
# update), by the device's torch.compile backend as train.py's (TorchTPU's; None: inductor)
form = step_form(device_type, compiled, compile_mode, dev.compile_backend)
predict = compiled_predict(model, compile_mode, dev.compile_backend) if compiled else model.predict
compiler = f"backend {dev.compile_backend!r}" if dev.compile_backend else 'xla_backend' if device_type == 'xla' \
    else compile_mode
if compile_mode != 'default' and (compiler != compile_mode or not compiled):
    why = device_type if compiled else f'{device_type}, not compiled'
    print(f"note: compile_mode={compile_mode!r} is inductor's, for a compiled CUDA step: not used here ({why})")
sc = StepConfig(lr=lr, puzzle_emb_lr=puzzle_emb_lr, puzzle_emb_weight_decay=puzzle_emb_weight_decay,
                warmup_steps=lr_warmup_steps, total_steps=10 ** 6, min_ratio=lr_min_ratio,
                global_batch_size=global_batch_size, ema_rate=ema_rate if ema else None, grad_clip=grad_clip,
                gradient_accumulation_steps=gradient_accumulation_steps, freeze_weights=freeze_weights)
step_t = torch.zeros((), device=dev.device)  # the step count lives on the device (the LR schedule runs there)
carry = model.initial_carry(batches[0])
loss = None

name = dev.name()
peak = dev.peak_tflops()
flops = model.flops_per_example()  # one supervision step: every net call, the no-grad recursion passes
                                   # included
print(f"device: {device_type} | {name} | peak {f'{peak} TFLOP/s bf16' if peak else 'n/a'} | forward dtype "
      f"{dtype_why} | kernels {kernels_why}")
print(f"model: {model.num_params():,} parameters | {'mlp_t' if mlp_t else 'attention'}, pos {pos_encodings}, "
      f"D {hidden_size}, H_cycles {H_cycles}, L_cycles {L_cycles} | batch {global_batch_size} x {seq_len} "
      f"tokens | {forward_dtype}, loss {loss_type} {loss_dtype} | {flops / 1e9:.2f} GFLOPs per example-step "
      f"| data {data_path or 'random'} | {f'compiled ({compiler})' if compiled else 'eager'}"
      + (' | trains the puzzle embedding only (freeze_weights)' if freeze_weights else '')
      + (f" | mlp_t sequence axis {cfg.total_len} -> {cfg.total_len + model.net.layers[0].seq_pad} "
         f"(seq_align {seq_align})" if mlp_t else ''))


# --- a checkpoint: the same parts as train.py's (weights, EMA, AdamATan2 moments, the ACT carry of the batch)
size_mb = carry_mb = save_s = upload_s = None  # the save's figures: scripts read them on the last line too
if checkpoint_dir:
    import shutil
    import tempfile

    from runkeep import gcs
    from device import to_cpu
    from runkeep.checkpoint import CheckpointError, save_atomic
    for p in model.parameters():  # AdamATan2's moments exist from the first step on: their bytes belong in
                                  # the file (frozen weights have none)
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.init_state()
    opt.zero_grad()
    remote = checkpoint_dir if gcs.is_gcs(checkpoint_dir) else ''
    folder = tempfile.mkdtemp(prefix='bench_ckpt_') if remote else checkpoint_dir
    path = os.path.join(folder, 'ckpt_bench.pt')
    try:
        os.makedirs(folder, exist_ok=True)
        t0 = time.perf_counter()
        dev.wait()
        ema_copy = {k: v.clone() for k, v in model.state_dict().items()}  # its own bytes, as train.py's EMA
                                                                          # model's
        state = to_cpu(dict(model=model.state_dict(), ema=ema_copy, optimizer=opt.state_dict(), carry=carry))
        save_atomic(state, path)
        save_s = time.perf_counter() - t0
        size_mb = os.path.getsize(path) / 1e6
        if remote:
            t0 = time.perf_counter()
            gcs.upload_file(path, f"{remote.rstrip('/')}/ckpt_bench.pt")
            upload_s = time.perf_counter() - t0
    except (OSError, CheckpointError, gcs.GCSError) as e:
        raise SystemExit(f"checkpoint_dir={checkpoint_dir!r}: {e}")
    finally:
        if remote:  # the local copy was only the upload's source
            shutil.rmtree(folder, ignore_errors=True)
    carry_mb = sum(t.numel() * t.element_size() for t in state['carry'].values()) / 1e6
    print(f"checkpoint: {size_mb:.1f} MB ({carry_mb:.1f} MB of it the ACT carry of {global_batch_size} rows "
          f"in {forward_dtype}) | device to host + write {save_s:.2f} s "
          f"({path if not remote else 'local temporary file'})"
          + (f" | upload to {remote} {upload_s:.2f} s | save + upload {save_s + upload_s:.2f} s" if remote
             else ''))
    if steps == 0:
        print(f"bench: checkpoint_mb={size_mb:.1f} carry_mb={carry_mb:.1f} save_s={save_s:.2f} "
              f"upload_s={fmt(upload_s, '.2f') if remote else 'n/a'}")
        raise SystemExit(0)


def one_step(i, span=None):
    """Step i; span: the profiler's phase it runs in (the sync after it outside, as in train.py: XLA cuts the
    graph there, which a profiler's scope must not span)."""
    global carry, loss
    with span or contextlib.nullcontext():
        carry, loss, _ = train_step(model, opt, ema_params, carry, batches[i % len(batches)], step_t, sc, form)
    dev.sync()  # one graph per step on XLA, cut where train.py cuts it


def finish():
    """Wait for the device. XLA's wait_device_ops does not wait for compiled (dynamo) graphs: reading one of
    their outputs (the step count, updated last) does."""
    dev.wait()
    step_t.cpu()


def run_steps(n):
    """n training steps; returns their wall time, read once the device has finished them."""
    t0 = time.perf_counter()
    for i in range(n):
        one_step(i)
    finish()
    return time.perf_counter() - t0


def host_and_device(n, other_form=None):
    """XLA: the medians over n steps of the host's time per step (the step's Python and its sync: tracing,
    hashing, dispatch) and the device's (its executions: torch_xla's ExecuteTime). Each compiled graph is run
    alone and waited for, and the waits are taken off the host's time, as is an execution that XLA on the CPU
    runs inside the sync itself: what is left is the host's work, as on a TPU, whose executions take no host
    CPU."""
    import torch_xla
    run_graph, waited = torch_xla._XLAC._run_cached_graph, [0.0]
    flush = np.ones(int(host_flush_mb * 2 ** 17)) if host_flush_mb else None

    def run_alone(*args):
        t0 = time.perf_counter()
        dev.wait()
        t1 = time.perf_counter()
        out = run_graph(*args)
        t2 = time.perf_counter()
        tensors = [t for t in out if torch.is_tensor(t)]
        if tensors:
            min(tensors, key=torch.numel).cpu()  # reading an output waits for this execution
        if flush is not None:
            flush.sum()
        waited[0] += (t1 - t0) + (time.perf_counter() - t2)
        return out
    torch_xla._XLAC._run_cached_graph = run_alone
    host, device = [], []
    try:
        for i in range(n):
            finish()
            e0, w0, t0 = dev.execute_seconds(), waited[0], time.perf_counter()
            carry_loss = train_step(model, opt, ema_params, carry, batches[i % len(batches)], step_t, sc,
                                    other_form or form)
            t1 = time.perf_counter()
            dev.wait()
            t2 = time.perf_counter()
            dev.sync()
            t3 = time.perf_counter()
            finish()
            e = dev.execute_seconds() - e0
            in_sync = max(0.0, e - (time.perf_counter() - t3)) if t2 - t1 < 1e-3 else 0.0  # ran inside sync
            host.append((t1 - t0) - (waited[0] - w0) + max(0.0, (t3 - t2) - in_sync))
            device.append(e)
            globals().update(carry=carry_loss[0], loss=carry_loss[1])
    finally:
        torch_xla._XLAC._run_cached_graph = run_graph
    return float(np.median(host)), float(np.median(device))


# --- training ---------------------------------------------------------------------------------------------
first_step_s = run_steps(1)  # the time to the first step: compilation (CUDA, XLA) and first allocations
warmup_s = first_step_s + run_steps(warmup_steps - 1)
compiles_warm = dev.xla_report()[0]
dt = run_steps(steps) / steps
host_s, device_s = host_and_device(steps) if device_type == 'xla' else (None, None)
compiles_end, fallbacks = dev.xla_report()  # read before anything below moves a value to the host
ex_s = global_batch_size / dt
tflops = flops * ex_s / 1e12
mfu = tflops / peak if peak else None
mem, mem_what = dev.peak_memory()
print(f"train: {dt * 1e3:.1f} ms/step | {ex_s:.2f} examples/s | {ex_s * seq_len:.0f} tokens/s | {tflops:.3f} "
      f"TFLOP/s | MFU {f'{100 * mfu:.1f}%' if mfu else 'n/a'} | first step {first_step_s:.1f} s | warm-up "
      f"{warmup_s:.1f} s ({warmup_steps} step{'s' if warmup_steps > 1 else ''}, the first included) | "
      f"memory {mem / 2 ** 30:.2f} GiB ({mem_what}) | loss {float(loss.cpu()) / global_batch_size:.4f}")

# --- the puzzle embedding's sign-SGD update alone (in the step above too), after the peak memory was read ---
def dense_sign_sgd_update_(table, ids, grads, lr, weight_decay):
    """step.sign_sgd_update_'s update computed over the whole table, for comparison: a table-sized scatter-add
    of the gradients, a touched-row mask, the decayed table and the where that keeps untouched rows."""
    grad_sum = torch.zeros_like(table).index_add_(0, ids.long(), grads.to(table.dtype))
    touched = torch.zeros(table.shape[0], dtype=table.dtype, device=table.device).index_add_(
        0, ids.long(), torch.ones_like(ids, dtype=table.dtype)) > 0
    new = table * (1 - lr * weight_decay) - lr * torch.sign(grad_sum)
    table.copy_(torch.where(touched[:, None], new, table))


def time_emb_update(update, ids, grads, n=5):
    """Median ms of n updates of the model's table, each waited for, after one untimed (XLA: compiles)."""
    lr_t = torch.tensor(puzzle_emb_lr, device=dev.device)
    times = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            update(model.puzzle_emb, ids, grads, lr_t, puzzle_emb_weight_decay)
        dev.sync()
        dev.wait()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times[1:]))


emb_ms = emb_dense_ms = None
if puzzle_emb_ndim > 0:
    emb_B = emb_update_batch or global_batch_size
    gen = torch.Generator().manual_seed(seed)
    emb_ids = torch.randint(0, num_puzzle_identifiers, (-(-emb_B // 4),), generator=gen).repeat_interleave(4)
    emb_ids = emb_ids[:emb_B].to(dev.device)
    emb_grads = torch.randn(emb_B, puzzle_emb_ndim, generator=gen).to(dev.device)
    emb_ms = time_emb_update(sign_sgd_update_, emb_ids, emb_grads)
    if emb_update_dense:
        emb_dense_ms = time_emb_update(dense_sign_sgd_update_, emb_ids, emb_grads)
    print(f"emb update: sign-SGD of {emb_B} ids ({len(set(emb_ids.cpu().tolist()))} puzzles) on the "
          f"{num_puzzle_identifiers:,} x {puzzle_emb_ndim} table ({model.puzzle_emb.numel() * 4 / 2 ** 30:.2f} "
          f"GiB): {emb_ms:.2f} ms (step.sign_sgd_update_, the batch's rows only)"
          + (f" | over the whole table {emb_dense_ms:.2f} ms" if emb_dense_ms is not None else ''))

# --- evaluation: fresh batches, n_eval_steps supervision steps each, no halting, the rows' loss at step
# halt_max_steps (evaluate.evaluate's work: a graph of its own where compiled) ---------------------------
def time_evaluation():
    """(puzzles/s over eval_batches batches, the first batch's seconds (compilation; None on the CPU), XLA's
    compilations after that batch and at the end, its fallback counters, the puzzles those batches held)."""
    model.eval()  # the trained weights themselves, not the EMA copy: the cost is the same
    loss_at = min(halt_max_steps, n_eval_steps) - 1  # as evaluate's
    warm_s, compiles_warm = None, compiles_end
    with torch.no_grad():
        if device_type != 'cpu':  # one batch timed alone: XLA and torch.compile compile the evaluation (on the CPU:
                           # no need)
            t0 = time.perf_counter()
            out = predict(eval_data[0], n_eval_steps, loss_at=loss_at)
            dev.sync()
            dev.wait()
            out[1].cpu()  # compiled graphs are waited for by reading an output
            warm_s = time.perf_counter() - t0
            compiles_warm = dev.xla_report()[0]
        t0 = time.perf_counter()
        puzzles = sum(eval_puzzles[i % len(eval_data)] for i in range(eval_batches))
        for i in range(eval_batches):
            out = predict(eval_data[i % len(eval_data)], n_eval_steps,  # kept: XLA skips what nothing uses
                          loss_at=loss_at)
            dev.sync()
        dev.wait()
        out[1].cpu()
        rate = puzzles / (time.perf_counter() - t0)  # each in eval_views rows
        compiles, after = dev.xla_report()
    model.train()
    return rate, warm_s, compiles_warm, compiles, after, puzzles


eval_ps = eval_mfu = eval_warm_s = None
eval_fallbacks = {}
compiles_eval_warm = compiles_eval_end = compiles_end
if eval_batches > 0:
    eval_ps, eval_warm_s, compiles_eval_warm, compiles_eval_end, after, eval_n = time_evaluation()
    eval_fallbacks = {n: c - fallbacks.get(n, 0) for n, c in after.items() if c > fallbacks.get(n, 0)}
    eval_tflops = model.flops_per_example(train=False) * n_eval_steps * eval_views * eval_ps / 1e12
    eval_mfu = eval_tflops / peak if peak else None
    views_what = f" x {eval_views} views = {eval_views * eval_B} rows" if eval_views > 1 else ''
    print(f"eval: {eval_ps:.2f} puzzles/s ({n_eval_steps} steps, batch {eval_B}{views_what}; {eval_n} puzzles in "
          f"{eval_batches} batch{'es' * (eval_batches > 1)}) | "
          f"{eval_tflops:.3f} TFLOP/s | MFU {f'{100 * eval_mfu:.1f}%' if eval_mfu else 'n/a'}"
          + (f" | first batch {eval_warm_s:.1f} s (compilation, not in the rate)" if eval_warm_s is not None
             else ''))

# --- kernels_ab: the same timings with another kernels value, on the same model, batches and process --------
ab_kernels = ab_dt = ab_first_s = ab_eval_ps = None
if kernels_ab:
    ab_in, ab_why = use_kernels(kernels_ab, device_type, forward_dtype, model)
    if ab_in == kernels_in:
        print(f"note: kernels_ab={kernels_ab}: no A/B here: both run kernels={kernels_in} ({ab_why})")
    else:
        model.__dict__.pop('_compiled_predict', None)  # compiled afresh, as the step is: the blocks changed
        if compiled:
            torch._dynamo.reset()  # no graph of the first way is reused, whatever dynamo's guards see
        form = step_form(device_type, compiled, compile_mode, dev.compile_backend)
        predict = compiled_predict(model, compile_mode, dev.compile_backend) if compiled else model.predict
        try:  # a kernel that fails (to build, to run) on this GPU: said, and the first variant's figures kept
            ab_first_s = run_steps(1)
            run_steps(warmup_steps - 1)
            ab_dt = run_steps(steps) / steps
            ab_eval_ps = time_evaluation()[0] if eval_batches > 0 else None
            ab_kernels = ab_in
        except Exception as e:
            import traceback
            traceback.print_exc()
            print(f"kernels A/B: the run with kernels={ab_in} failed ({type(e).__name__}: {str(e)[:300]}); the "
                  f"figures above are kernels={kernels_in}'s")
            profile_span = None  # nothing left to trace
    if ab_kernels:
        # ratios are the second's speed over the first's: above 1, kernels=<second> is faster
        print(f"kernels A/B: train {dt * 1e3:.1f} ms/step with kernels={kernels_in}, {ab_dt * 1e3:.1f} with "
              f"kernels={ab_kernels}: x{dt / ab_dt:.3f} | first step with kernels={ab_kernels} {ab_first_s:.1f} s "
              f"({ab_why})"
              + (f" | eval {eval_ps:.2f} puzzles/s with kernels={kernels_in}, {ab_eval_ps:.2f} with "
                 f"kernels={ab_kernels}: x{ab_eval_ps / eval_ps:.3f}" if ab_eval_ps else ''))

# --- XLA, vs_eager: the eager (lazy) step on the same model, for the ratio of the device's work ------------
eager_host_s = eager_device_s = eager_first_s = alternated = None
if vs_eager and device_type == 'xla' and compiled:
    def run_eager(n):
        global carry
        for i in range(n):
            carry, _, _ = train_step(model, opt, ema_params, carry, batches[i % len(batches)], step_t, sc,
                                     Eager())
            dev.sync()
        finish()
    t0 = time.perf_counter()
    run_eager(1)
    eager_first_s = time.perf_counter() - t0
    # its warm-up as it is timed: a lazy step's graphs depend on where the syncs fall, and host_and_device's
    # differ from run_eager's (warmed up by run_eager alone, the first timed step compiles)
    host_and_device(warmup_steps - 1, Eager())  # (XLA: warmup_steps >= 2)
    compiles_eager_warm = dev.xla_report()[0]
    eager_host_s, eager_device_s = host_and_device(steps, Eager())
    compiles_eager_end = dev.xla_report()[0]
    # then the two steps alternated one by one: a shared machine's speed drifts within seconds, and the median of
    # per-round ratios sees both steps at the same moment
    rounds = [host_and_device(1)[1] / max(host_and_device(1, Eager())[1], 1e-9) for _ in range(steps)]
    alternated = float(np.median(rounds))
elif vs_eager:
    print("note: vs_eager=True applies to XLA with compile=True; ignored")
variant = getattr(form, 'variant', 'eager (lazy tracing every step)' if device_type == 'xla' else
                  f'{dev.compile_backend} (torch.compile backend)' if compiled and dev.compile_backend else
                  f'inductor ({compile_mode})' if compiled else 'eager')

if device_type == 'xla':
    bound = 'host' if host_s > device_s else 'device'
    print(f"xla: step variant: {variant}")
    print(f"xla: host {host_s * 1e3:.1f} ms/step (tracing, hashing, dispatch"
          f"{f'; caches flushed ({host_flush_mb} MiB)' if host_flush_mb else ''}) | device {device_s * 1e3:.1f} "
          f"ms/step (execution) | the step is {bound}-bound | first training step {first_step_s:.1f} s, "
          f"first evaluation batch {fmt(eval_warm_s, '.1f')} s (both with compilation)")
    if eager_device_s is not None:
        print(f"xla: eager step (vs_eager): host {eager_host_s * 1e3:.1f} ms/step | device "
              f"{eager_device_s * 1e3:.1f} ms/step | first step {eager_first_s:.1f} s | compiled/eager "
              f"device time {device_s / eager_device_s:.3f}, max(host, device) "
              f"{max(host_s, device_s) / max(eager_host_s, eager_device_s):.3f}; the two alternated step by step, "
              f"median of {steps} rounds: device time {alternated:.3f} | compilations {compiles_eager_warm} "
              f"after its warm-up, {compiles_eager_end} after its timed steps")
    print(f"xla: compilations {compiles_warm} after warm-up, {compiles_end} after the timed steps"
          f"{' (no recompilation)' if compiles_end == compiles_warm else ' -- RECOMPILED: run with PT_XLA_DEBUG_LEVEL=2'}"
          f"; evaluation {compiles_eval_warm} -> {compiles_eval_end}")
    print("xla: CPU fallbacks in training: "
          + (', '.join(f'{n} x{c}' for n, c in fallbacks.items()) or 'none')
          + '; in evaluation: ' + (', '.join(f'{n} x{c}' for n, c in eval_fallbacks.items()) or 'none'))

# --- profile: END-START more steps under the profiler, after the timing (train.py's Profiler) ---------------
if profile_span:
    prof = Profiler(dev, profile_dir, 0, profile_span[1] - profile_span[0])
    prof.begin(0)
    for i in range(prof.end):  # a span per step, as train.py's trace has: its length is a step's
        one_step(i, prof.phase('train_step'))
    finish()
    where = prof.finish(prof.end)
    if device_type == 'xla':
        print(f"profile: XLA trace in {where}/plugins/profile/<time>/ (*.xplane.pb: TensorBoard's profile "
              "plugin; *.trace.json.gz: https://ui.perfetto.dev)")
    else:
        print(f"profile: Chrome trace {where} (https://ui.perfetto.dev or chrome://tracing)")

print(f"bench: device={device_type} batch={global_batch_size} seq_len={seq_len} vocab_size={vocab_size} "
      f"params={model.num_params()} "
      f"dtype={forward_dtype} compiled={int(compiled)} seq_align={seq_align} "
      f"kernels={kernels_in} ab_kernels={ab_kernels or 'n/a'} "
      f"ab_ms_per_step={fmt(ab_dt and ab_dt * 1e3, '.2f')} ab_first_step_s={fmt(ab_first_s, '.2f')} "
      f"ab_eval_puzzles_per_s={fmt(ab_eval_ps, '.2f')} ms_per_step={dt * 1e3:.2f} "
      f"first_step_s={first_step_s:.2f} examples_per_s={ex_s:.2f} tokens_per_s={ex_s * seq_len:.0f} "
      f"flops_per_example={flops} tflops={tflops:.4f} mfu={fmt(mfu, '.4f')} warmup_s={warmup_s:.2f} "
      f"peak_mem_gib={mem / 2 ** 30:.3f} eval_puzzles_per_s={fmt(eval_ps, '.2f')} "
      f"eval_mfu={fmt(eval_mfu, '.4f')} eval_views={eval_views} compiles_warm={compiles_warm} "
      f"compiles_end={compiles_end} "
      f"fallbacks={len(set(fallbacks) | set(eval_fallbacks))} "
      f"host_ms_per_step={fmt(host_s and host_s * 1e3, '.2f')} host_flush_mb={host_flush_mb} "
      f"device_ms_per_step={fmt(device_s and device_s * 1e3, '.2f')} "
      f"eval_first_batch_s={fmt(eval_warm_s, '.2f')} emb_update_ms={fmt(emb_ms, '.3f')} "
      f"emb_update_dense_ms={fmt(emb_dense_ms, '.3f')} variant={variant.split(' (')[0].replace(' ', '_')} "
      f"device_vs_eager={fmt(eager_device_s and device_s / eager_device_s, '.3f')} "
      f"device_vs_eager_alternated={fmt(alternated, '.3f')} "
      f"eager_host_ms_per_step={fmt(eager_host_s and eager_host_s * 1e3, '.2f')} "
      f"eager_device_ms_per_step={fmt(eager_device_s and eager_device_s * 1e3, '.2f')} "
      f"checkpoint_mb={fmt(size_mb, '.1f')} carry_mb={fmt(carry_mb, '.1f')} save_s={fmt(save_s, '.2f')} "
      f"upload_s={fmt(upload_s, '.2f')}")
