"""
Train a Tiny Recursive Model. One process on a CPU or GPU:
    python train.py config/baseline.py --L_cycles=4
several GPUs (or CPU processes, gloo) on one node:
    torchrun --standalone --nproc_per_node=4 train.py config/maze.py
TPU (one process per local chip; on a pod the same command on every host):
    PJRT_DEVICE=TPU python train.py config/baseline.py
Resume after a stop or preemption: run the same command with --init_from=resume.
"""
import copy
import glob
import math
import os
import re
import secrets
import signal
import time

import numpy as np
import torch

# -----------------------------------------------------------------------------
# config. Defaults: the paper's Sudoku-Extreme MLP recipe (TRM_SPEC section 6), one device.
# I/O
out_dir = 'out/sudoku'          # a local folder, or gs://bucket/prefix (then local_dir keeps a local copy)
local_dir = ''                  # '' -> out/<last part of a gs:// out_dir>
data_path = 'data/sudoku-extreme-1k-aug-1000'
init_from = 'scratch'           # 'scratch' | 'resume' | a checkpoint file (ours or the reference's) to start from
eval_only = False               # evaluate init_from's weights and exit
eval_interval = 5000            # epochs between evaluations
eval_subset = 0                 # intermediate evaluations on this many seeded test examples (0: all); the final one uses all
eval_steps = 0                  # supervision steps at evaluation (0: halt_max_steps); more is test-time scaling
eval_batch_size = 0             # 0: global_batch_size
log_interval = 100              # steps between console/W&B lines; the only place the host reads device values
checkpoint_interval = 0         # steps between extra checkpoints (0: only at evaluations, the end and on SIGTERM)
keep_last_n = 2                 # checkpoints kept, plus the best
wandb_log = False
wandb_project = 'trm'
wandb_run_name = ''
# data
global_batch_size = 768
epochs = 50000
max_steps = 0                   # >0: stop after this many steps (the LR schedule still spans `epochs`)
seed = 0
# model (the reference's names)
hidden_size = 512
num_heads = 8
expansion = 4.0
L_layers = 2
H_cycles = 3
L_cycles = 6
halt_max_steps = 16
halt_exploration_prob = 0.1
pos_encodings = 'none'          # 'rope' | 'learned' | 'none'
mlp_t = True
puzzle_emb_ndim = 512
puzzle_emb_len = 16
forward_dtype = 'bfloat16'
no_ACT_continue = True
rms_norm_eps = 1e-5
rope_theta = 10000.0
loss_type = 'stablemax'         # 'stablemax' | 'softmax'
loss_dtype = 'float64'          # 'float32' on TPU (no fast float64 there)
# optimiser
lr = 1e-4
lr_min_ratio = 1.0              # the reference's default: constant after warmup
lr_warmup_steps = 2000
beta1 = 0.9
beta2 = 0.95
weight_decay = 1.0
puzzle_emb_lr = 1e-4
puzzle_emb_weight_decay = 1.0
ema = True
ema_rate = 0.999
# system
device = 'auto'                 # 'auto' | 'cpu' | 'cuda' | 'xla' (auto picks xla when PJRT_DEVICE is set)
compile = False                 # torch.compile the forward + loss (CUDA)
xla_cache_dir = '~/.cache/trm_xla'  # persistent XLA compilation cache ('' disables)
gcs_retries = 8                 # attempts per GCS request (exponential backoff) before an upload is given up
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------

from data import IGNORE_LABEL_ID, EvalLoader, TrainLoader, render_example
from model import TRM, AdamATan2, TRMConfig, forward_loss, from_reference_state_dict, lr_at
from model import train_step as model_train_step
import gcs

MODEL_KEYS = [f for f in TRMConfig.__dataclass_fields__ if f not in ('vocab_size', 'seq_len', 'num_puzzle_identifiers')]
CKPT_RE = re.compile(r'ckpt_(\d{8})\.pt$')


# -----------------------------------------------------------------------------
# devices: the only place that knows about XLA, CUDA and CPU. The training step below is shared.

def resolve_device(name):
    if name == 'auto':
        return 'xla' if os.environ.get('PJRT_DEVICE') else ('cuda' if torch.cuda.is_available() else 'cpu')
    if name not in ('cpu', 'cuda', 'xla'):
        raise SystemExit(f"config error: device={name!r}; allowed 'auto', 'cpu', 'cuda', 'xla'")
    return name


class Device:
    def __init__(self, kind):
        self.kind = kind
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        if kind == 'xla':
            import torch_xla
            import torch_xla.runtime as xr
            if xla_cache_dir and os.environ.get('PJRT_DEVICE') != 'CPU':  # the CPU client cannot reload executables
                # one writable cache per local process: every host of a pod fills its own
                xr.initialize_cache(os.path.join(os.path.expanduser(xla_cache_dir), str(xr.local_ordinal())),
                                    readonly=False)
            self.device = torch_xla.device()
            self.rank, self.world_size = xr.global_ordinal(), xr.world_size()
            self.local_rank = xr.local_ordinal()
        else:
            if int(os.environ.get('WORLD_SIZE', 1)) > 1:  # torchrun
                import torch.distributed as dist
                self.rank, self.world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
                self.local_rank = int(os.environ.get('LOCAL_RANK', 0))
                dist.init_process_group(backend='nccl' if kind == 'cuda' else 'gloo')
            if kind == 'cuda':
                torch.cuda.set_device(self.local_rank)
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
            self.device = torch.device(kind, self.local_rank) if kind == 'cuda' else torch.device('cpu')
        self.master = self.rank == 0

    def all_reduce_sum_(self, tensors):
        if self.world_size == 1:
            return
        if self.kind == 'xla':
            import torch_xla.core.xla_model as xm
            xm.all_reduce(xm.REDUCE_SUM, tensors)
        else:
            import torch.distributed as dist
            flat = torch.cat([t.reshape(-1) for t in tensors])  # one collective, not one per tensor
            dist.all_reduce(flat)
            torch._foreach_copy_(tensors, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)])

    def all_gather(self, t):
        if self.world_size == 1:
            return t
        if t.dtype == torch.bool:  # not every backend gathers bools
            return self.all_gather(t.to(torch.int32)).bool()
        if self.kind == 'xla':
            import torch_xla.core.xla_model as xm
            return xm.all_gather(t, dim=0)
        import torch.distributed as dist
        out = torch.empty((self.world_size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous())
        return out

    def sync(self):
        """End of a step: XLA cuts and dispatches the graph here; elsewhere a no-op."""
        if self.kind == 'xla':
            import torch_xla
            torch_xla.sync()

    def barrier(self):
        if self.world_size == 1:
            return
        if self.kind == 'xla':
            import torch_xla.core.xla_model as xm
            xm.rendezvous('barrier')
        else:
            import torch.distributed as dist
            dist.barrier()

    def to_device(self, batch):
        pin = self.kind == 'cuda'
        return {k: (torch.from_numpy(v).pin_memory() if pin else torch.from_numpy(v)).to(self.device, non_blocking=pin)
                for k, v in batch.items()}

    def manual_seed(self, s):
        torch.manual_seed(s)
        if self.kind == 'xla':  # the device draws ACT exploration from its own generator
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(s)

    def rng_state(self):
        state = dict(cpu=torch.get_rng_state())
        if self.kind == 'cuda':
            state['cuda'] = torch.cuda.get_rng_state(self.device)
        if self.kind == 'xla':
            import torch_xla.core.xla_model as xm
            state['xla'] = str(xm.get_rng_state())  # an unsigned 64-bit seed
        return state

    def set_rng_state(self, state):
        torch.set_rng_state(state['cpu'])
        if self.kind == 'cuda' and 'cuda' in state:
            torch.cuda.set_rng_state(state['cuda'], self.device)
        if self.kind == 'xla' and 'xla' in state:
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(int(state['xla']))

    def xla_report(self):
        """(graph compilations so far, aten ops that fell back to the CPU) on XLA. With static shapes the
        compilations stop growing after warm-up and nothing falls back."""
        import torch_xla.debug.metrics as met
        compiles = met.metric_data('CompileTime')
        return (compiles[0] if compiles else 0), sorted(n for n in met.counter_names() if n.startswith('aten::'))

    def shutdown(self):
        if self.kind != 'xla' and self.world_size > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


class Prefetcher:
    """Keeps the next batch on its way to the device while the current step runs, and remembers the
    loader position of the batches actually consumed (what a checkpoint must store)."""
    def __init__(self, loader, dev):
        self.loader, self.dev = loader, dev
        self.consumed_state = loader.state_dict()
        self.upcoming = dev.to_device(loader.next_batch())

    def next(self):
        batch = self.upcoming
        self.consumed_state = self.loader.state_dict()
        self.upcoming = self.dev.to_device(self.loader.next_batch())
        return batch


# -----------------------------------------------------------------------------
# checkpoints: atomic local files, mirrored to GCS in the background

class CheckpointError(RuntimeError):
    pass


def to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_atomic(obj, path):
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the whole new one, never half of it


def load_checkpoint(path):
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated and was not loaded: {e}") from e


def list_checkpoints(folder):
    """{step: path} of the complete checkpoints in a local folder or gs:// prefix (temporary files and
    half-done uploads never match: local writes are renamed when whole, GCS objects appear when whole)."""
    if gcs.is_gcs(folder):
        names = [uri for uri, _ in gcs.list_objects(folder.rstrip('/') + '/ckpt_')]
    else:
        names = glob.glob(os.path.join(folder, 'ckpt_*.pt'))
    return {int(m.group(1)): n for n in names if (m := CKPT_RE.search(n))}


def find_resume_checkpoint(local, remote, dev):
    """Newest loadable checkpoint, local or in the bucket. Rank 0 picks the step and every rank loads
    that step (hosts of a pod other than the first fetch it from the bucket); if any rank cannot load
    it (corrupt, truncated, missing), that is reported and all ranks try the next older one."""
    found = list_checkpoints(local) if os.path.isdir(local) else {}
    if remote:
        try:
            for step, uri in list_checkpoints(remote).items():
                found.setdefault(step, uri)
        except Exception as e:  # the bucket is unreachable: resume from what is here
            print(f"warning: cannot list {remote} ({e}); using local checkpoints only")
    candidates = sorted(found, reverse=True) if dev.master else []
    for i in range(10 ** 6):
        proposal = torch.tensor([float(candidates[i]) if i < len(candidates) else -1.0] if dev.master else [0.0],
                                device=dev.device)
        dev.all_reduce_sum_([proposal])
        step = int(proposal.item())
        if step < 0:
            return None, None
        path = found.get(step) or f"{remote.rstrip('/')}/ckpt_{step:08d}.pt"
        ckpt = None
        try:
            if gcs.is_gcs(path):
                name = os.path.basename(path) if dev.master else f'.rank{dev.rank}_{os.path.basename(path)}'
                dest = os.path.join(local, name)
                os.makedirs(local, exist_ok=True)
                print(f"downloading {path}")
                gcs.download_file(path, dest)
                path = dest
            ckpt = load_checkpoint(path)
        except Exception as e:
            print(f"warning: rank {dev.rank}: {e}; trying an older checkpoint")
        if not dev.master and os.path.basename(path).startswith('.rank') and os.path.exists(path):
            os.remove(path)
        failed = torch.tensor([float(ckpt is None)], device=dev.device)
        dev.all_reduce_sum_([failed])
        if failed.item() == 0:
            return ckpt, path
    return None, None


def prune_checkpoints(folder, keep_last_n, best_step):
    found = list_checkpoints(folder)
    keep = set(sorted(found)[-keep_last_n:]) | {best_step}
    for step, path in found.items():
        if step not in keep:
            try:
                gcs.delete_object(path) if gcs.is_gcs(path) else os.remove(path)
            except Exception as e:
                print(f"warning: could not delete old checkpoint {path}: {e}")


# -----------------------------------------------------------------------------
# evaluation

def verifier_for(meta):
    """A checker of whole answers that accepts any valid solution, not only the label."""
    kind = meta.get('puzzle_type') or ('sudoku' if meta['vocab_size'] == 11 and meta['seq_len'] == 81 else
                                       'maze' if meta['vocab_size'] == 6 and meta['seq_len'] == 900 else None)
    if kind == 'sudoku':
        from prepare_sudoku import sudoku_correct
        return sudoku_correct
    if kind == 'maze':
        from prepare_maze import maze_correct
        return maze_correct
    return None


def wilson_interval(k, n, z=1.96):
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@torch.no_grad()
def evaluate(model, loader, dev, n_steps, halt_max_steps, verifier=None, show_example=False):
    """Runs every batch for n_steps supervision steps (one fixed graph per batch) and reports the
    metrics at halt_max_steps, the exact accuracy at every step count, and with q_halt early stopping."""
    model.eval()
    h = min(halt_max_steps, n_steps) - 1
    sums, example, verified = None, None, 0
    for batch in loader:
        b = dev.to_device(batch)
        preds, q_halt = model.predict(b, n_steps)  # [S, B, L], [S, B]
        labels = b['labels']
        valid_tok = labels != IGNORE_LABEL_ID
        n_valid = valid_tok.sum(-1)
        rows = (b['valid'] & (n_valid > 0)).float()
        tok_ok = (preds == labels) & valid_tok
        seq_ok = tok_ok.sum(-1) == n_valid  # [S, B]
        halt = q_halt > 0
        halt[-1] = True
        first = halt.int().argmax(0)  # the first step whose q_halt says stop
        part = dict(
            count=rows.sum(),
            exact_per_step=(seq_ok.float() * rows).sum(-1),
            token_accuracy=((tok_ok.sum(-1)[h].float() / n_valid.clamp_min(1)) * rows).sum(),
            q_halt_accuracy=(((q_halt[h] >= 0) == seq_ok[h]).float() * rows).sum(),
            exact_q_halt=(seq_ok.gather(0, first[None])[0].float() * rows).sum(),
            steps_q_halt=((first + 1).float() * rows).sum(),
        )
        sums = part if sums is None else {k: sums[k] + part[k] for k in sums}
        final_preds = preds[h]
        dev.sync()  # one graph per batch; the predictions below are then plain transfers
        if verifier is not None:
            p, inp, v = final_preds.cpu().numpy(), batch['inputs'], batch['valid']
            ok = np.asarray(verifier(inp, p)) & v
            verified += int(ok.sum())
            if show_example and example is None and v.any():
                i = int(np.argmax(v))
                example = (inp[i], p[i], bool(ok[i]))
    if verifier is not None:
        sums['verified'] = torch.tensor(float(verified), device=dev.device)
    keys = sorted(sums)
    flat = torch.cat([sums[k].reshape(-1).float() for k in keys])  # one reduction, one transfer
    dev.all_reduce_sum_([flat])
    host = np.split(flat.cpu().numpy(), np.cumsum([sums[k].numel() for k in keys])[:-1])
    s = dict(zip(keys, host))
    n = float(s['count'][0])
    exact_k = s['exact_per_step'][h]
    lo, hi = wilson_interval(exact_k, n)
    res = dict(count=n, exact_accuracy=exact_k / max(n, 1), exact_ci_low=lo, exact_ci_high=hi,
               token_accuracy=float(s['token_accuracy'][0]) / max(n, 1),
               q_halt_accuracy=float(s['q_halt_accuracy'][0]) / max(n, 1), steps=float(h + 1),
               exact_accuracy_q_halt=float(s['exact_q_halt'][0]) / max(n, 1),
               steps_q_halt=float(s['steps_q_halt'][0]) / max(n, 1),
               exact_by_steps=[float(x) / max(n, 1) for x in s['exact_per_step']])
    if 'verified' in s:
        res['verified_accuracy'] = float(s['verified'][0]) / max(n, 1)
    model.train()
    return res, example


def format_eval(r):
    line = (f"eval on {int(r['count'])}: exact {r['exact_accuracy']:.4f} (95% CI {r['exact_ci_low']:.4f}-"
            f"{r['exact_ci_high']:.4f}) | token {r['token_accuracy']:.4f} | q_halt acc {r['q_halt_accuracy']:.4f}"
            f" | steps {r['steps']:.0f}")
    if 'verified_accuracy' in r:
        line += f" | verified {r['verified_accuracy']:.4f}"
    line += f" | with q_halt stop: exact {r['exact_accuracy_q_halt']:.4f} in {r['steps_q_halt']:.2f} steps"
    if len(r['exact_by_steps']) > r['steps']:
        line += ' | exact by steps: ' + ' '.join(f"{i + 1}:{a:.3f}" for i, a in enumerate(r['exact_by_steps']))
    return line


# -----------------------------------------------------------------------------
# stop requests: SIGTERM (spot preemption) and Ctrl-C save a checkpoint, then exit. Installed when the
# module loads in a process's main thread: torch_xla.launch runs main() in a worker thread.

STOP = dict(requested=False)


def on_signal(signum, frame):
    STOP['requested'] = True
    signal.signal(signum, signal.SIG_DFL)  # a second one stops at once
    print(f"pid {os.getpid()}: got signal {signum}; will save a checkpoint and exit", flush=True)


if __name__ in ('__main__', '__mp_main__'):  # the script, or a torch_xla worker re-importing it
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def main(index=None):
    dev = Device(resolve_device(device))
    master = dev.master
    gs_out = out_dir if gcs.is_gcs(out_dir) else ''
    local = (local_dir or os.path.join('out', out_dir.rstrip('/').split('/')[-1])) if gs_out else out_dir
    if master:
        os.makedirs(local, exist_ok=True)
    torch.manual_seed(seed)  # the same initial weights on every rank

    loader = TrainLoader(data_path, global_batch_size, dev.rank, dev.world_size, seed)
    meta = loader.meta
    cfg = TRMConfig(vocab_size=meta['vocab_size'], seq_len=meta['seq_len'],
                    num_puzzle_identifiers=meta['num_puzzle_identifiers'], **{k: config[k] for k in MODEL_KEYS})
    model = TRM(cfg).to(dev.device)
    dev.manual_seed(seed + dev.rank)  # from here on the rank offset decorrelates ACT exploration
    total_steps = loader.steps_for(epochs)
    run_steps = min(total_steps, max_steps) if max_steps > 0 else total_steps
    eval_every = max(1, loader.steps_for(eval_interval))
    if master and dev.kind == 'xla' and loss_dtype == 'float64':
        print("warning: TPUs emulate float64 slowly; --loss_dtype=float32 is the fast path")
    if master:
        print(f"device {dev.kind} x{dev.world_size} | {model.num_params():,} parameters | "
              f"{model.flops_per_example() / 1e9:.2f} GFLOPs per example-step | {total_steps} steps "
              f"({epochs} epochs of {loader.n_groups} groups, batch {global_batch_size}), eval every {eval_every}")

    opt = AdamATan2(model.parameters(), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    ema_model = copy.deepcopy(model) if ema else model
    ema_params = list(ema_model.parameters())
    step, best = 0, dict(step=-1, exact_accuracy=-1.0)
    run_id = None
    carry_state, loader_state, resumed_from = None, None, None

    # --- starting point -------------------------------------------------------------------------
    if init_from == 'resume':
        ckpt, path = find_resume_checkpoint(local, gs_out, dev)
        if ckpt is None:
            if master:
                print("init_from=resume: no checkpoint found, starting from scratch")
        else:
            resumed_from = path
            if master:
                print(f"resuming from {path} (step {ckpt['step']})")
            model.load_state_dict(ckpt['model'])
            if ema:
                ema_model.load_state_dict(ckpt['ema'])
            opt.load_state_dict(ckpt['optimizer'])
            step, best, run_id = ckpt['step'], ckpt['best'], ckpt.get('wandb_run_id') or None
            loader_state = ckpt['loader']
            # the carry is saved for the global batch: each rank takes its rows (the world size may change)
            lb = global_batch_size // dev.world_size
            carry_state = {k: v[dev.rank * lb:(dev.rank + 1) * lb] for k, v in ckpt['carry'].items()}
            if dev.rank == 0:
                dev.set_rng_state(ckpt['rng'])
            else:  # other ranks' exploration streams: reseeded deterministically from the step
                dev.manual_seed(seed + dev.rank + 1000003 * step)
    elif init_from != 'scratch':
        if not os.path.exists(init_from):
            raise SystemExit(f"config error: init_from={init_from!r} is not 'scratch', 'resume' or an existing checkpoint file")
        ckpt = load_checkpoint(init_from)
        sd = ckpt.get('ema') or ckpt['model'] if 'model' in ckpt else from_reference_state_dict(ckpt)
        model.load_state_dict(sd)
        ema_model.load_state_dict(sd)
        print(f"loaded weights from {init_from}")
    if loader_state:
        loader.load_state_dict(loader_state)

    verifier = verifier_for(meta)
    n_eval_steps = eval_steps or halt_max_steps
    eval_B = eval_batch_size or global_batch_size

    def run_eval(subset, show_example=False):
        ev = EvalLoader(data_path, eval_B, dev.rank, dev.world_size, subset=subset, seed=seed)
        ema_model.puzzle_emb.copy_(model.puzzle_emb)  # buffers are not averaged
        return evaluate(ema_model, ev, dev, n_eval_steps, halt_max_steps, verifier, show_example)

    if eval_only:
        res, example = run_eval(0, show_example=True)
        if master:
            print(format_eval(res))
            if example:
                print(render_example(meta, *example))
        return

    # --- W&B ------------------------------------------------------------------------------------
    wandb_run = None
    if master and wandb_log:
        import wandb
        run_id = run_id or secrets.token_hex(4)  # kept in checkpoints: a resumed run logs to the same W&B run
        wandb_run = wandb.init(project=wandb_project, name=wandb_run_name or None, id=run_id, resume='allow',
                               config=config, dir=local)

    # uploads run in the background; after each, the bucket is pruned like the local folder
    uploader = gcs.Uploader(client=gcs.GCS(retries=gcs_retries),
                            on_success=lambda *_: prune_checkpoints(gs_out, keep_last_n, best['step'])) \
        if (master and gs_out) else None

    def save(tag=''):
        """All ranks call this (it syncs); rank 0 writes and uploads."""
        global_carry = {k: dev.all_gather(v) for k, v in carry.items()}  # a collective: every rank
        if not master:
            return
        state = dict(model=model.state_dict(), ema=ema_model.state_dict() if ema else None,
                     optimizer=opt.state_dict(), step=step, loader=prefetch.consumed_state,
                     carry=global_carry, rng=dev.rng_state(), config=config, best=best, wandb_run_id=run_id or '')
        state = to_cpu(state)
        path = os.path.join(local, f'ckpt_{step:08d}.pt')
        save_atomic(state, path)
        prune_checkpoints(local, keep_last_n, best['step'])
        if uploader:
            uploader.submit(path, f"{gs_out.rstrip('/')}/{os.path.basename(path)}")
        print(f"saved {path}{tag}")
        return path

    # --- the training step (shared by CPU, CUDA and XLA) -------------------------------------------
    fwd = torch.compile(forward_loss) if (compile and dev.kind == 'cuda') else forward_loss
    step_t = torch.tensor(float(step), device=dev.device)  # on the device: the LR schedule runs there
    hp = dict(lr=lr, puzzle_emb_lr=puzzle_emb_lr, puzzle_emb_weight_decay=puzzle_emb_weight_decay,
              warmup=lr_warmup_steps, total=total_steps, min_ratio=lr_min_ratio, global_batch_size=global_batch_size,
              ema_rate=ema_rate if ema else None)

    def train_step(carry, batch):
        return model_train_step(model, opt, ema_params, carry, batch, step_t, hp, fwd, dev.all_reduce_sum_, dev.all_gather)

    stop = STOP
    # --- loop -----------------------------------------------------------------------------------------
    prefetch = Prefetcher(loader, dev)
    first = prefetch.upcoming
    carry = model.initial_carry(first)
    if carry_state is not None:
        carry = {k: v.to(dev.device) for k, v in carry_state.items()}
    model.train()
    acc = None
    bad_step = torch.tensor(-1.0, device=dev.device)  # first step with a non-finite loss, kept on the device
    t0, last_step, last_good = time.time(), step, resumed_from
    interrupted = False
    while step < run_steps:
        batch = prefetch.next()
        carry, loss, metrics = train_step(carry, batch)
        metrics['loss'] = loss
        bad_step = torch.where(torch.isfinite(loss) | (bad_step >= 0), bad_step, step_t - 1)
        acc = metrics if acc is None else {k: acc[k] + metrics[k] for k in metrics}
        dev.sync()
        step += 1

        # (no intermediate evaluation just before the final one)
        at_eval = step == run_steps or (step % eval_every == 0 and run_steps - step >= eval_every // 2)
        at_ckpt = checkpoint_interval > 0 and step % checkpoint_interval == 0
        stop_now = stop['requested'] and dev.world_size == 1  # several ranks: only the agreed flag below counts
        at_log = step % log_interval == 0 or at_eval or at_ckpt or step == run_steps or stop_now
        if at_log:
            # the one place the host reads device values
            flags = torch.stack([(bad_step >= 0).float(), torch.tensor(float(stop['requested']), device=dev.device)])
            reduced = torch.cat([v.float().reshape(1) for v in acc.values()] + [flags])
            dev.all_reduce_sum_([reduced])
            host = torch.cat([reduced, bad_step.reshape(1)]).cpu().numpy()  # one transfer
            m = dict(zip(acc.keys(), host[:len(acc)]))
            if host[-3] > 0:
                where = f"at step {int(host[-1])}" if host[-1] >= 0 else "on another rank"
                msg = (f"loss became NaN or inf {where}; stopping without saving. "
                       f"Last good checkpoint: {last_good or 'none'}")
                if master:
                    print(msg)
                if uploader:
                    uploader.wait()
                raise SystemExit(msg)
            if host[-2] > 0:  # some rank got the signal: all stop at this same step
                stop_now = True
            dt = time.time() - t0
            n_steps = step - last_step
            if master:
                cnt = max(m['count'], 1)
                line = dict(step=step, epoch=loader.epochs_done, loss=m['loss'] / (global_batch_size * n_steps),
                            accuracy=m['accuracy'] / cnt, exact_accuracy=m['exact_accuracy'] / cnt,
                            q_halt_accuracy=m['q_halt_accuracy'] / cnt, steps=m['steps'] / cnt,
                            lr=float(lr_at(step - 1, lr, lr_warmup_steps, total_steps, lr_min_ratio)),
                            examples_per_s=global_batch_size * n_steps / max(dt, 1e-9))
                print(f"step {step}/{run_steps} | epoch {line['epoch']:.1f} | loss {line['loss']:.4f} | "
                      f"acc {line['accuracy']:.4f} | exact {line['exact_accuracy']:.4f} | steps {line['steps']:.1f}"
                      f" | lr {line['lr']:.2e} | {line['examples_per_s']:.0f} ex/s"
                      + (f" | compiles {dev.xla_report()[0]}" if dev.kind == 'xla' else ''))
                if wandb_run:
                    wandb_run.log({f'train/{k}': v for k, v in line.items()}, step=step)
            acc, t0, last_step = None, time.time(), step

        if stop_now:
            last_good = save(' (stop requested)')
            interrupted = True
            break
        if at_eval:
            final = step == run_steps
            res, example = run_eval(0 if final else eval_subset, show_example=final)
            if master:
                print(format_eval(res))
                if wandb_run:
                    wandb_run.log({f'eval/{k}': v for k, v in res.items() if k != 'exact_by_steps'}, step=step)
            if res['exact_accuracy'] > best['exact_accuracy']:
                best = dict(step=step, exact_accuracy=float(res['exact_accuracy']))
            last_good = save()
            if final and master and example:
                print(render_example(meta, *example))
        elif at_ckpt:
            last_good = save()

    if uploader:
        # after SIGTERM a spot VM has ~30 s in all: the checkpoint upload gets most of it
        if not uploader.wait(timeout=25 if interrupted else None):
            print(f"warning: uploads to {gs_out} still running at exit; the local copies are in {local}")
        if uploader.failures:
            print(f"warning: {uploader.failures} upload(s) to {gs_out} failed; the local copies are in {local}")
    if wandb_run:
        wandb_run.finish()
    if dev.kind == 'xla' and master:
        compiles, fallbacks = dev.xla_report()
        print(f"xla: {compiles} graph compilations; CPU fallbacks: {', '.join(fallbacks) or 'none'}")
    dev.barrier()
    dev.shutdown()
    if interrupted:
        print("stopped cleanly; rerun with --init_from=resume to continue")


if __name__ == '__main__':
    if resolve_device(device) == 'xla':
        import torch_xla
        torch_xla.launch(main)  # one process per local chip; every host of a pod runs the same command
    else:
        main()
