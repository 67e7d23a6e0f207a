"""
Train a Tiny Recursive Model. One process on a CPU or GPU:
    python train.py config/baseline.py --L_cycles=4
several GPUs (or CPU processes, gloo) on one node:
    torchrun --standalone --nproc_per_node=4 train.py config/maze.py
TPU (one process per local chip; on a pod the same command on every host):
    PJRT_DEVICE=TPU python train.py config/baseline.py --out_dir=gs://BUCKET/run1
Resume after a stop or preemption: the same command with --init_from=resume.
"""
import copy
import hashlib
import json
import os
import secrets
import signal
import threading
import time

# -----------------------------------------------------------------------------
# config. Defaults: the paper's Sudoku-Extreme MLP recipe (87.4% exact in the paper), on one device.
# I/O
out_dir = 'out/sudoku'          # checkpoints and results: a local folder, or gs://bucket/prefix
local_dir = ''                  # local copy of a gs:// out_dir ('': out/<last part of out_dir>)
data_path = 'data/sudoku-extreme-1k-aug-1000'  # dataset root (prepare_sudoku.py / prepare_maze.py)
data_cache_dir = '~/.cache/trm_data'  # where each host keeps its copy of a gs:// data_path
init_from = 'scratch'           # 'scratch' | 'resume' | a checkpoint file (ours or the reference's) to start from
overwrite = False               # a scratch run may replace the checkpoints already in out_dir
eval_only = False               # evaluate init_from's weights and exit
eval_interval = 5000            # epochs between evaluations (and checkpoints)
eval_subset = 0                 # intermediate evaluations on this many seeded test examples (0: all); the final one uses all
eval_steps = 0                  # supervision steps at evaluation (0: halt_max_steps); more is test-time scaling
eval_batch_size = 0             # evaluation batch, split over ranks (0: global_batch_size)
log_interval = 100              # steps between log lines (host reads of training metrics)
checkpoint_interval = 0         # steps between extra checkpoints (0: only at evaluations, the end and on SIGTERM)
keep_last_n = 2                 # checkpoints kept, plus the best (0: keep all)
wandb_log = False               # log to Weights & Biases (rank 0; offline in out_dir when W&B cannot be reached)
wandb_project = 'trm'           # W&B project
wandb_run_name = ''             # W&B run name ('': W&B picks one)
# data
global_batch_size = 768         # examples per optimizer step, split over all ranks
epochs = 50000                  # sets the step count: epochs * groups * mean examples per puzzle / global_batch_size
max_steps = 0                   # >0: stop after this many steps (the LR schedule still spans `epochs`)
seed = 0                        # initial weights, data order, ACT exploration
# model (the reference's names)
hidden_size = 512               # D, the width
num_heads = 8                   # attention heads (head_dim = D / num_heads)
expansion = 4.0                 # SwiGLU width factor
L_layers = 2                    # blocks in the one network `net`
H_cycles = 3                    # T: rounds of {L_cycles z-updates, one y-update} per supervision step
L_cycles = 6                    # n: z-updates per round
halt_max_steps = 16             # supervision steps at most (ACT)
halt_exploration_prob = 0.1     # share of rows that must run a random minimum of steps
pos_encodings = 'none'          # 'rope' | 'learned' | 'none'
mlp_t = True                    # MLP-mixer over the sequence instead of attention (Sudoku)
puzzle_emb_ndim = 512           # puzzle embedding width (0: none)
puzzle_emb_len = 16             # prefix tokens reserved for the puzzle embedding
forward_dtype = 'auto'          # 'auto' (bfloat16 where the hardware has it natively, else float32) | 'bfloat16' | 'float16' | 'float32'
no_ACT_continue = True          # False: also learn q_continue against a bootstrapped target
rms_norm_eps = 1e-5             # RMSNorm epsilon
rope_theta = 10000.0            # RoPE base
loss_type = 'stablemax'         # 'stablemax' | 'softmax'
loss_dtype = 'auto'             # stablemax precision: 'auto' (float64, float32 on XLA) | 'float64' | 'float32'
# optimiser
lr = 1e-4                       # AdamATan2 learning rate
lr_min_ratio = 1.0              # cosine decay to lr * lr_min_ratio (1.0, the reference's default: constant)
lr_warmup_steps = 2000          # linear warmup steps
beta1 = 0.9                     # AdamATan2 beta1
beta2 = 0.95                    # AdamATan2 beta2
weight_decay = 1.0              # decoupled weight decay on all weights
puzzle_emb_lr = 1e-4            # sign-SGD learning rate of the puzzle embedding
puzzle_emb_weight_decay = 1.0   # its weight decay
ema = True                      # evaluate and keep an EMA of the weights
ema_rate = 0.999                # EMA decay, reached after a warm-up: min(ema_rate, (1 + step) / (10 + step))
# system
device = 'auto'                 # 'auto' (xla when PJRT_DEVICE is set, else cuda if present, else cpu) | 'cpu' | 'cuda' | 'xla'
compile = True                  # torch.compile the training step and evaluation on CUDA (ignored on CPU and XLA)
xla_cache_dir = '~/.cache/trm_xla'  # persistent XLA compilation cache ('' disables)
gcs_retries = 8                 # attempts per GCS request (exponential backoff) before an upload is given up
# -----------------------------------------------------------------------------
# allowed values, checked before anything runs: key -> (test, what is allowed)
_pos, _nonneg = (lambda v: v > 0, 'a number > 0'), (lambda v: v >= 0, 'a number >= 0')
_one_of = lambda *a: (lambda v: v in a, ' | '.join(map(repr, a)))
RULES = dict(eval_interval=_pos, eval_subset=_nonneg, eval_steps=_nonneg, eval_batch_size=_nonneg, log_interval=_pos,
             checkpoint_interval=_nonneg, keep_last_n=_nonneg, global_batch_size=_pos, epochs=_pos, max_steps=_nonneg,
             hidden_size=_pos, num_heads=_pos, expansion=_pos, L_layers=_pos, H_cycles=_pos, L_cycles=_pos,
             halt_max_steps=_pos, halt_exploration_prob=(lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
             pos_encodings=_one_of('rope', 'learned', 'none'), puzzle_emb_ndim=_nonneg, puzzle_emb_len=_pos,
             forward_dtype=_one_of('auto', 'bfloat16', 'float16', 'float32'), rms_norm_eps=_pos, rope_theta=_pos,
             loss_type=_one_of('stablemax', 'softmax'), loss_dtype=_one_of('auto', 'float64', 'float32'), lr=_pos,
             lr_min_ratio=(lambda v: 0 <= v <= 1, 'in [0, 1]'), lr_warmup_steps=_nonneg,
             beta1=(lambda v: 0 <= v < 1, 'in [0, 1)'), beta2=(lambda v: 0 <= v < 1, 'in [0, 1)'),
             weight_decay=_nonneg, puzzle_emb_lr=_nonneg, puzzle_emb_weight_decay=_nonneg,
             ema_rate=(lambda v: 0 <= v < 1, 'in [0, 1)'), device=_one_of('auto', 'cpu', 'cuda', 'xla'), gcs_retries=_pos)
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
config = {k: globals()[k] for k in config_keys}
bad = [f"{k}={config[k]!r} (allowed: {what})" for k, (ok, what) in RULES.items() if not ok(config[k])]
if bad:
    raise SystemExit("config error: " + '; '.join(bad))
# -----------------------------------------------------------------------------

import torch  # noqa: E402  (after the config: --help and config errors answer at once)

import gcs  # noqa: E402
from data import EvalLoader, TrainLoader, check_split, render_example, verifier_for  # noqa: E402
from device import Device, Prefetcher, choose_dtype, resolve_device, resolve_loss_dtype, to_cpu  # noqa: E402
from model import TRM, AdamATan2, TRMConfig, evaluate, format_eval, forward_loss, from_reference_state_dict  # noqa: E402
from model import lr_at, train_step  # noqa: E402

MODEL_KEYS = [f for f in TRMConfig.__dataclass_fields__ if f not in ('vocab_size', 'seq_len', 'num_puzzle_identifiers')]
# a weight above this is divergence, not learning: trained TRM weights stay near their init scale (about 1 at most),
# and float32 activations overflow within a few blocks of weights this large
MAX_WEIGHT = 1e4
# what a resume may not change: the model's shape and the meaning of the step counter and the saved carry
RESUME_FIXED = [k for k in MODEL_KEYS if k not in ('halt_exploration_prob', 'forward_dtype', 'loss_dtype')] + \
    ['global_batch_size', 'seed']

# stop requests: SIGTERM (spot preemption) and Ctrl-C save a checkpoint, then every rank exits at the same step.
# Installed when the module loads in a process's main thread: torch_xla.launch runs main() in a worker thread.
STOP = dict(requested=False)


def on_signal(signum, frame):
    STOP['requested'] = True
    signal.signal(signum, signal.SIG_DFL)  # a second one stops at once
    print(f"pid {os.getpid()}: got signal {signum}; will save a checkpoint and exit", flush=True)


if __name__ in ('__main__', '__mp_main__'):  # the script, or a torch_xla worker re-importing it
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def fetch_dataset():
    """[problem] of fetching a gs:// data_path into data_cache_dir (an interrupted fetch is redone)."""
    try:
        gcs.fetch_tree(data_path, data_cache_dir)
        return []
    except Exception as e:
        return [f"cannot fetch {data_path}: {e}"]


def fingerprint(text):
    """A 24-bit hash of text: exact in float32, so ranks can compare it with a min/max reduction."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], 'big')


def startup_problems(dev, local):
    """Everything a run needs, checked before the first step on every rank: [(message)]. Each rank sees its
    own files (a pod's hosts each have their own disk), so each checks them."""
    problems = []
    for split in ('train', 'test'):
        problems += check_split(data_path, split)
    if init_from not in ('scratch', 'resume') and not os.path.isfile(init_from):
        problems.append(f"init_from={init_from!r} is not 'scratch', 'resume' or a checkpoint file on this host")
    eval_B = eval_batch_size or global_batch_size
    for what, B in (('global_batch_size', global_batch_size), ('eval_batch_size', eval_B)):
        if B % dev.world_size:
            problems.append(f"{what}={B} is not divisible by the world size {dev.world_size}")
    if dev.hosts > 1 and not gcs.is_gcs(out_dir):
        problems.append(f"out_dir={out_dir!r} is local, but the run spans {dev.hosts} hosts: only one would hold "
                        f"the checkpoints; use --out_dir=gs://BUCKET/...")
    if init_from == 'scratch' and not eval_only and not overwrite and dev.master:
        for folder in [local] + ([out_dir] if gcs.is_gcs(out_dir) else []):
            try:
                held = sorted(gcs.list_checkpoints(folder))
            except gcs.GCSError as e:  # an unreachable bucket: training goes on, its uploads are retried
                print(f"warning: cannot list {folder} ({e}); not checked for an earlier run's checkpoints")
                continue
            if held:
                problems.append(f"{folder} already holds checkpoints {held}: continue them with --init_from=resume, "
                                f"pick another --out_dir, or replace them with --overwrite=True")
    return problems


def fail_together(dev, problems, what):
    """Every rank learns whether any rank has a problem, and then all exit with one message."""
    failed = dev.agree([float(r == dev.rank and bool(problems)) for r in range(dev.world_size)])
    ranks = [r for r in range(dev.world_size) if failed[r] > 0]
    if ranks:
        where = f" on rank(s) {ranks}" if dev.world_size > 1 else ''
        mine = '; '.join(problems) if problems else f"see rank {ranks[0]}'s output"
        dev.shutdown()
        raise SystemExit(f"{what} failed{where}: {mine}")


def find_resume_checkpoint(dev, local, remote):
    """The newest checkpoint that every rank can load; rank 0 picks the step. Non-zero ranks read the bucket
    copy (the same bytes as rank 0's), and a fingerprint of the loaded weights is compared across ranks.
    Checkpoints found but none loadable, or a bucket that cannot be listed, is an error: never a fresh start
    that would overwrite them."""
    found, problems = {}, []
    if os.path.isdir(local):
        found.update(gcs.list_checkpoints(local))
    if remote:
        try:
            for step, uri in gcs.list_checkpoints(remote).items():
                if not dev.master or step not in found:
                    found[step] = uri
        except Exception as e:
            problems.append(f"cannot list the checkpoints in {remote} ({e}); retry when the bucket is reachable")
    fail_together(dev, problems, 'init_from=resume')
    candidates = sorted(found, reverse=True) if dev.master else []
    corrupt = []
    for i in range(len(candidates) + 1 if dev.master else 10 ** 9):
        step = int(dev.agree([candidates[i] if i < len(candidates) else -1.0 if dev.master else 0.0])[0])
        if step < 0:
            break
        path, ckpt = found.get(step) or f"{remote.rstrip('/')}/ckpt_{step:08d}.pt", None
        try:
            if gcs.is_gcs(path):
                dest = os.path.join(local, f'.rank{dev.rank}_ckpt_{step:08d}.pt')
                os.makedirs(local, exist_ok=True)
                gcs.download_file(path, dest)
                ckpt = gcs.load_checkpoint(dest)
                os.remove(dest)
            else:
                ckpt = gcs.load_checkpoint(path)
            for k in ('model', 'step', 'carry', 'config', 'optimizer'):
                if k not in ckpt:
                    raise gcs.CheckpointError(f"{path} is not a training checkpoint of this trainer (no '{k}')")
        except Exception as e:
            print(f"warning: rank {dev.rank}: {e}; trying an older checkpoint")
            corrupt.append(path)
            ckpt = None
        if dev.agree([float(ckpt is None)])[0] == 0:
            return ckpt, path, corrupt
    if found:
        fail_together(dev, [f"checkpoints found ({', '.join(found[s] for s in sorted(found))}) but none could be "
                            f"loaded; nothing was overwritten"] if dev.master else [], 'init_from=resume')
    return None, None, corrupt


def main(index=None):
    dev = Device(resolve_device(device), xla_cache_dir)
    gcs.default_client().retries = gcs_retries  # every bucket request of this run, uploads included
    master = dev.master
    gs_out = out_dir if gcs.is_gcs(out_dir) else ''
    local = (local_dir or os.path.join('out', out_dir.rstrip('/').split('/')[-1])) if gs_out else out_dir
    if gcs.is_gcs(data_path):  # one process per host fetches the dataset into the local cache, the others wait
        fail_together(dev, fetch_dataset() if dev.local_rank == 0 else [], f'fetching {data_path}')
        dev.barrier()
        globals()['data_path'] = gcs.fetch_tree(data_path, data_cache_dir)  # complete now: returns the local copy

    # --- start-up checks: all of them before the first step, the verdict shared by every rank -------------
    fail_together(dev, startup_problems(dev, local), 'start-up checks')
    code = ''.join(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)).read()
                   for f in ('train.py', 'model.py', 'data.py', 'device.py'))
    meta_text = ''.join(open(os.path.join(data_path, s, 'dataset.json')).read() for s in ('train', 'test'))
    prints = [fingerprint(json.dumps(config, sort_keys=True)), fingerprint(meta_text), fingerprint(code)]
    differ = [name for name, lo, hi in zip(('config', 'dataset metadata', 'code'), dev.agree(prints, 'min'),
                                           dev.agree(prints, 'max')) if lo != hi]
    fail_together(dev, [f"the hosts differ in their {', '.join(differ)}: copy the same files to every host"]
                  if differ and master else [], 'host agreement')
    if master:
        os.makedirs(local, exist_ok=True)
        for name in os.listdir(local):  # temporary files of saves that never finished
            if name.endswith('.tmp'):
                os.remove(os.path.join(local, name))
        if overwrite and init_from == 'scratch' and not eval_only:  # asked for: the old run's files go
            for folder in [local] + ([gs_out] if gs_out else []):
                gcs.prune_checkpoints(folder, 0, -1, delete_all=True)

    # --- data, model, optimiser ------------------------------------------------------------------------
    loader = TrainLoader(data_path, global_batch_size, dev.rank, dev.world_size, seed)
    meta = loader.meta
    dtype, dtype_why = choose_dtype(forward_dtype, dev.kind)
    model_cfg = {k: config[k] for k in MODEL_KEYS}
    model_cfg.update(forward_dtype=dtype, loss_dtype=resolve_loss_dtype(loss_dtype, dev.kind))
    cfg = TRMConfig(vocab_size=meta['vocab_size'], seq_len=meta['seq_len'],
                    num_puzzle_identifiers=meta['num_puzzle_identifiers'], **model_cfg)
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TRM(cfg).to(dev.device)
    opt = AdamATan2(model.parameters(), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    ema_model = copy.deepcopy(model) if ema else model
    dev.manual_seed(seed + dev.rank)  # from here on the rank offset decorrelates ACT exploration
    total_steps = loader.steps_for(epochs)
    run_steps = min(total_steps, max_steps) if max_steps > 0 else total_steps
    eval_every = max(1, loader.steps_for(eval_interval))
    n_eval_steps = eval_steps or halt_max_steps
    eval_B = eval_batch_size or global_batch_size
    verifier = verifier_for(meta)
    if master:
        print(f"device {dev.kind} x{dev.world_size} ({dev.name()}) | forward dtype {dtype_why} | "
              f"{model.num_params():,} parameters | {model.flops_per_example() / 1e9:.2f} GFLOPs per example-step | "
              f"{total_steps} steps ({epochs} epochs of {loader.n_groups} groups, batch {global_batch_size}), "
              f"eval every {eval_every}")
    if total_steps < 1:
        raise SystemExit(f"config error: epochs={epochs} of {loader.n_groups} groups at global_batch_size="
                         f"{global_batch_size} is less than one step")

    # --- starting point --------------------------------------------------------------------------------
    step, best, run_id, carry_state, resumed_from, corrupt = 0, dict(step=-1, exact_accuracy=-1.0), None, None, None, []
    if init_from == 'resume':
        ckpt, resumed_from, corrupt = find_resume_checkpoint(dev, local, gs_out)
        if ckpt is None and master:
            print(f"init_from=resume: no checkpoint in {out_dir} yet, starting from scratch")
        if ckpt is not None:
            saved = ckpt['config']
            changed = [k for k in RESUME_FIXED if k in saved and saved[k] != config[k]]
            fail_together(dev, [f"{resumed_from} was saved with {', '.join(f'{k}={saved[k]!r}' for k in changed)}; "
                                f"this run has {', '.join(f'{k}={config[k]!r}' for k in changed)}. A resume must keep "
                                f"them: start a new run (another out_dir) to change them"] if changed else [], 'resume')
            if master:
                other = {k: (saved[k], config[k]) for k in config if k in saved and saved[k] != config[k]}
                print(f"resuming from {resumed_from} (step {ckpt['step']})"
                      + ''.join(f"\n  {k}: {a!r} -> {b!r}" for k, (a, b) in other.items()))
            try:  # a file that loads but whose parts do not fit this model (edited, or another trainer's): named
                model.load_state_dict(ckpt['model'])
                if ema:
                    ema_model.load_state_dict(ckpt['ema'] or ckpt['model'])
                opt.load_state_dict(ckpt['optimizer'])
                loader.load_state_dict(ckpt['loader'])
                problems = []
            except (RuntimeError, ValueError, KeyError) as e:
                problems = [f"{resumed_from} does not fit this run ({' '.join(str(e).split())[:300]}); the file is kept. "
                            f"Move it aside to resume from the one before"]
            fail_together(dev, problems, 'resume')
            step, best, run_id = ckpt['step'], ckpt['best'], ckpt.get('run_id') or ckpt.get('wandb_run_id') or None
            lb = global_batch_size // dev.world_size  # the carry is saved for the global batch: each rank its rows
            carry_state = {k: v[dev.rank * lb:(dev.rank + 1) * lb] for k, v in ckpt['carry'].items()}
            if dev.rank == 0:
                dev.set_rng_state(ckpt['rng'])
            else:  # other ranks' exploration streams: reseeded deterministically from the step
                dev.manual_seed(seed + dev.rank + 1000003 * step)
            weights = float(sum(p.double().nan_to_num().sum() for p in ckpt['model'].values()
                                if p.is_floating_point()))  # a fingerprint of the loaded bytes, on the host
            if dev.agree([weights], 'min')[0] != dev.agree([weights], 'max')[0]:
                fail_together(dev, ["the ranks loaded different weights"] if master else [], 'resume')
    elif init_from != 'scratch':
        try:
            ckpt = gcs.load_checkpoint(init_from)
        except gcs.CheckpointError as e:
            raise SystemExit(f"init_from: {e}")
        if isinstance(ckpt, dict) and 'model' in ckpt:
            sd = ckpt.get('ema') or ckpt['model']  # ours: the EMA weights when there are any
        elif isinstance(ckpt, dict) and ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
            sd = from_reference_state_dict(ckpt)  # a bare state dict, the reference's keys or ours
        else:
            raise SystemExit(f"init_from={init_from} is neither a checkpoint of this trainer nor a state dict of "
                             f"the reference implementation")
        try:
            model.load_state_dict(sd)
        except RuntimeError as e:
            raise SystemExit(f"init_from={init_from}: not weights of this model ({' '.join(str(e).split())[:300]}); "
                             f"check hidden_size, mlp_t, pos_encodings, L_layers against the run that saved it")
        ema_model.load_state_dict(sd)
        if master:
            print(f"loaded weights from {init_from}")
    run_id = run_id or secrets.token_hex(4)

    def run_eval(subset, show_example=False, weights=None):
        weights = weights or ema_model  # the EMA's, or the raw model's
        ev = EvalLoader(data_path, eval_B, dev.rank, dev.world_size, subset=subset, seed=seed)
        ema_model.puzzle_emb.copy_(model.puzzle_emb)  # buffers are not averaged
        return evaluate(weights, ev, dev, n_eval_steps, halt_max_steps, verifier, show_example,
                        predict=weights.compiled_predict() if (compile and dev.kind == 'cuda') else None)

    if eval_only:
        if init_from == 'scratch':
            raise SystemExit("config error: eval_only=True needs --init_from=resume or a checkpoint file")
        res, example = run_eval(0, show_example=True)
        if master:
            print(format_eval(res))
            if example:
                print(render_example(meta, *example))
        dev.shutdown()
        return
    if step >= run_steps:
        if master:
            print(f"the checkpoint is at step {step}, and this run ends at step {run_steps}: nothing to do "
                  f"(raise --max_steps or --epochs to train on)")
        dev.shutdown()
        return

    # --- records: metrics.jsonl (a line per log step and evaluation), results.json at the end; W&B ------
    records = Records(local, gs_out, step) if master else None
    wandb_run = start_wandb(local, run_id) if (master and wandb_log) else None
    # uploads run in the background; after each, the bucket is pruned like the local folder
    uploader = gcs.Uploader(on_success=lambda *_: gcs.prune_checkpoints(gs_out, keep_last_n, best['step'])) \
        if (master and gs_out) else None

    # --- the training step (shared by CPU, CUDA and XLA) ------------------------------------------------
    fwd = model.compiled_step() if (compile and dev.kind == 'cuda') else forward_loss  # the same as bench.py's
    step_t = torch.full((), float(step), device=dev.device)  # on the device: the LR schedule runs there
    hp = dict(lr=lr, puzzle_emb_lr=puzzle_emb_lr, puzzle_emb_weight_decay=puzzle_emb_weight_decay,
              warmup=lr_warmup_steps, total=total_steps, min_ratio=lr_min_ratio, global_batch_size=global_batch_size,
              ema_rate=ema_rate if ema else None)
    ema_params = list(ema_model.parameters())
    prefetch = Prefetcher(loader, dev)
    carry = model.initial_carry(prefetch.upcoming)
    if carry_state is not None:
        carry = {k: v.to(dev.device) for k, v in carry_state.items()}
    start_step, t0, last_step, last_good, interrupted = step, time.time(), step, resumed_from, False
    verified = step if resumed_from else -1  # newest checkpoint step whose next step's loss was seen finite

    def checkpoint_tensors():
        """[are the weights sane, the carry of the global batch...]: one reduction, collectives on every rank.
        Sane: finite and below MAX_WEIGHT (NaN fails the comparison too)."""
        params = list(model.parameters()) + (list(ema_model.parameters()) if ema else [])
        largest = torch.stack([p.detach().abs().max().float() for p in params]).max()
        return [(largest <= MAX_WEIGHT).float().reshape(1)] + [dev.all_gather(carry[k]) for k in sorted(carry)]

    def save(tag=''):
        """Every rank calls it: the carry gather and the finiteness check are collectives, read on every rank;
        then rank 0 writes and uploads, and every rank learns whether that worked."""
        keys = sorted(carry)
        sane, *gathered = dev.read(checkpoint_tensors())  # the carry, in the order of `keys`
        problems = []
        if sane[0] == 0:
            problems = [f"the weights diverged by step {step} (non-finite or above {MAX_WEIGHT:g}): nothing saved. The last "
                        f"good checkpoint is {last_good or 'none'}; continue from it with --init_from=resume and "
                        f"a lower --lr (now {lr})"]
        elif master:
            state = dict(model=model.state_dict(), ema=ema_model.state_dict() if ema else None,
                         optimizer=opt.state_dict(), step=step, loader=prefetch.consumed_state,
                         carry=dict(zip(keys, map(torch.from_numpy, gathered))), rng=dev.rng_state(), config=config,
                         best=best, run_id=run_id)
            path = os.path.join(local, f'ckpt_{step:08d}.pt')
            try:
                t_save = time.time()
                gcs.save_atomic(to_cpu(state), path)
                print(f"saved {path}{tag} ({os.path.getsize(path) / 1e6:.1f} MB in {time.time() - t_save:.1f} s)")
                if path in corrupt:  # a new, whole file under the name of a corrupt one
                    corrupt.remove(path)
                gcs.prune_checkpoints(local, keep_last_n, best['step'], corrupt, protect=verified)
                if uploader:
                    uploader.submit(path, f"{gs_out.rstrip('/')}/{os.path.basename(path)}")
            except Exception as e:
                problems = [f"saving {path} failed: {e}"]
        fail_together(dev, problems, f'checkpoint at step {step}')
        return os.path.join(local, f'ckpt_{step:08d}.pt')

    model.train()
    acc, bad_step = None, torch.full((1,), -1.0, device=dev.device)  # first step with a non-finite loss
    stop_every = 1  # steps between agreements on a stop request; set from the measured step time below
    while step < run_steps:
        carry, loss, metrics = train_step(model, opt, ema_params, carry, prefetch.next(), step_t, hp, fwd,
                                          dev.all_reduce_sum_, dev.all_gather)
        metrics['loss'] = loss
        bad_step = torch.where(torch.isfinite(loss) | (bad_step >= 0), bad_step, step_t)  # step_t: this step's number
        acc = metrics if acc is None else {k: acc[k] + metrics[k] for k in metrics}
        dev.sync()
        step += 1

        at_eval = step == run_steps or (step % eval_every == 0 and run_steps - step >= eval_every // 2)
        at_ckpt = checkpoint_interval > 0 and step % checkpoint_interval == 0
        stop_now = False
        if step % stop_every == 0:  # a host flag: cheap to agree on, every ~2 s of training
            stop_now = dev.agree([float(STOP['requested'])], 'max')[0] > 0
        if step == start_step + 5:
            t5 = time.time()
        if step == start_step + 10:  # warmed up: agree on a stop every ~2 s of the slowest rank's steps from now on
            stop_every = max(1, int(2.0 / dev.agree([(time.time() - t5) / 5], 'max')[0]))
        if step % log_interval == 0 or at_eval or at_ckpt or step == run_steps or stop_now:
            reduced = torch.cat([v.float().reshape(1) for v in acc.values()])
            dev.all_reduce_sum_([reduced])
            dev.all_reduce_([bad_step], 'max')
            host, bad_at = dev.read([reduced, bad_step])
            m = dict(zip(acc.keys(), host))
            if bad_at[0] >= 0:  # divergence: the weights after step k-1 gave a non-finite loss at step k
                k = int(bad_at[0])
                if master:
                    last_good = set_aside_diverged(local, gs_out, uploader, k - 1)
                raise SystemExit(f"loss became NaN or inf at step {k}; stopping. Checkpoints from step {k - 1} on were "
                                 f"set aside (*.diverged). Last good checkpoint: {last_good or 'none'}; continue from "
                                 f"it with --init_from=resume and a lower --lr (now {lr})")
            verified = step - 1
            if master:
                n_steps, cnt = step - last_step, max(m['count'], 1)
                line = dict(step=step, epoch=loader.epochs_done, loss=m['loss'] / (global_batch_size * n_steps),
                            accuracy=m['accuracy'] / cnt, exact_accuracy=m['exact_accuracy'] / cnt,
                            q_halt_accuracy=m['q_halt_accuracy'] / cnt, steps=m['steps'] / cnt,
                            lr=float(lr_at(step - 1, lr, lr_warmup_steps, total_steps, lr_min_ratio)),
                            examples_per_s=global_batch_size * n_steps / max(time.time() - t0, 1e-9))
                print(f"step {step}/{run_steps} | epoch {line['epoch']:.1f} | loss {line['loss']:.4f} | "
                      f"acc {line['accuracy']:.4f} | exact {line['exact_accuracy']:.4f} | steps {line['steps']:.1f}"
                      f" | lr {line['lr']:.2e} | {line['examples_per_s']:.0f} ex/s"
                      + (f" | compiles {dev.xla_report()[0]}" if dev.kind == 'xla' else ''))
                records.log('train', line)
                wandb_log_safe(wandb_run, {f'train/{k}': v for k, v in line.items()}, step)
            acc, t0, last_step = None, time.time(), step

        if stop_now:
            last_good, interrupted = save(' (stop requested)'), True
            break
        if at_eval:
            final = step == run_steps
            res, example = run_eval(0 if final else eval_subset, show_example=final)
            # early in a run the EMA may still trail the weights it averages: intermediate evaluations show both
            raw = run_eval(eval_subset, weights=model)[0] if (ema and not final) else None
            if master:
                print(format_eval(res))
                if raw:
                    print(format_eval(raw).replace('eval on', 'eval of the raw weights (not the EMA) on', 1))
                records.log('eval', dict(step=step, **res, **(dict(raw=raw) if raw else {})))
                for name, r in (('eval', res), ('eval_raw', raw or {})):
                    wandb_log_safe(wandb_run, {f'{name}/{k}': v for k, v in r.items() if k != 'exact_by_steps'}, step)
            if res['exact_accuracy'] > best['exact_accuracy']:
                best = dict(step=step, exact_accuracy=float(res['exact_accuracy']), eval=res)
            last_good = save()
            if final and master and example:
                print(render_example(meta, *example))
            if final and master:
                records.finish(dict(config=config, parameters=model.num_params(), run_id=run_id,
                                    flops_per_example_step=model.flops_per_example(), device=dev.name(),
                                    world_size=dev.world_size, final_eval=res, best_eval=best, step=step,
                                    examples_seen=step * global_batch_size,
                                    train_flops=model.flops_per_example() * step * global_batch_size))
        elif at_ckpt:
            last_good = save()
        if step == start_step + 1 and dev.kind == 'xla':
            dev.read(checkpoint_tensors())  # compile the save's graph now, not inside a preemption notice

    if uploader:
        if records:
            records.upload(uploader)
        # after SIGTERM a spot VM has ~30 s in all: the checkpoint upload gets most of it
        if not uploader.wait(timeout=20 if interrupted else None):
            print(f"warning: uploads to {gs_out} still running at exit; the local copies are in {local}")
        if uploader.failures:
            print(f"warning: {uploader.failures} upload(s) to {gs_out} failed; the local copies are in {local}")
    if wandb_run:
        finish = threading.Thread(target=wandb_run.finish, daemon=True)
        finish.start()
        finish.join(timeout=5 if interrupted else 60)  # bounded: what did not reach W&B stays for `wandb sync`
    if dev.kind == 'xla' and master:
        compiles, fallbacks = dev.xla_report()
        print(f"xla: {compiles} graph compilations; CPU fallbacks: {', '.join(fallbacks) or 'none'}")
    dev.shutdown()
    if interrupted and master:
        print("stopped cleanly; rerun with --init_from=resume to continue")


# -----------------------------------------------------------------------------
# host-only helpers of rank 0: diverged checkpoints, results records, W&B

def set_aside_diverged(local, remote, uploader, first_bad):
    """Rename local checkpoints of step >= first_bad to *.diverged (and drop their bucket copies), so a resume
    never picks weights that diverge. Returns the newest checkpoint left."""
    if uploader:
        uploader.wait()
    for folder in [local] + ([remote] if remote else []):
        for step, path in gcs.list_checkpoints(folder).items():
            if step >= first_bad:
                gcs.delete_object(path) if gcs.is_gcs(path) else os.replace(path, path + '.diverged')
    left = gcs.list_checkpoints(local)
    return left[max(left)] if left else None


class Records:
    """metrics.jsonl (one JSON line per log step and per evaluation) and results.json (written once, at the
    end), in the run's folder and mirrored to the bucket. A resumed run drops the lines past its checkpoint's
    step, so it appends without duplicates."""
    def __init__(self, local, remote, step):
        self.path, self.remote = os.path.join(local, 'metrics.jsonl'), remote
        lines = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                lines = [l for l in f if l.endswith('\n') and json.loads(l).get('step', 0) <= step]  # a torn last line goes
        with open(self.path + '.tmp', 'w') as f:
            f.writelines(lines)
        os.replace(self.path + '.tmp', self.path)
        self.results = os.path.join(local, 'results.json')

    def log(self, kind, values):
        with open(self.path, 'a') as f:
            f.write(json.dumps(dict(kind=kind, time=time.time(), **values), default=float) + '\n')

    def finish(self, results):
        with open(self.results + '.tmp', 'w') as f:
            json.dump(results, f, indent=1, default=float)
        os.replace(self.results + '.tmp', self.results)

    def upload(self, uploader):
        for path in (self.path, self.results):
            if os.path.exists(path):
                uploader.submit(path, f"{self.remote.rstrip('/')}/{os.path.basename(path)}")


def start_wandb(local, run_id):
    """A W&B run; where W&B cannot be reached or is not logged in, an offline one in the run's folder (one
    warning line, `wandb sync` later). W&B is never a reason to lose a run."""
    import wandb
    kw = dict(project=wandb_project, name=wandb_run_name or None, id=run_id, resume='allow', config=config, dir=local)
    mode = os.environ.get('WANDB_MODE', 'online')
    try:
        if mode not in ('offline', 'disabled'):
            if not wandb.api.api_key:
                raise RuntimeError("not logged in (wandb login, or WANDB_API_KEY)")
            import requests  # a quick look first: wandb.init itself waits long for a server that is not there
            requests.head(os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai'), timeout=5)
        return wandb.init(settings=wandb.Settings(init_timeout=30), **kw)
    except Exception as e:
        print(f"warning: W&B unavailable ({str(e).splitlines()[0][:200]}); logging offline in {local}/wandb: "
              f"`wandb sync {local}/wandb/offline-run-*` uploads it later")
        try:
            return wandb.init(mode='offline', **kw)
        except Exception as e2:
            print(f"warning: W&B offline failed too ({e2}); training goes on without W&B")
            return None


def wandb_log_safe(run, values, step):
    if run is not None and values:
        try:
            run.log(values, step=step)
        except Exception as e:
            print(f"warning: W&B log failed at step {step}: {e}")


if __name__ == '__main__':
    if resolve_device(device) == 'xla':
        import torch_xla
        torch_xla.launch(main)  # one process per local chip; every host of a pod runs the same command
    else:
        main()
