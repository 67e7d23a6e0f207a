"""
Train a Tiny Recursive Model. One process on a CPU or GPU:
    python train.py config/baseline.py --L_cycles=4
several GPUs (or CPU processes, gloo) on one node:
    torchrun --standalone --nproc_per_node=4 train.py config/maze.py
TPU (one process per local chip; on a pod the same command on every host):
    PJRT_DEVICE=TPU python train.py config/baseline.py --out_dir=gs://BUCKET/run1
Resume after a stop or preemption: the same command with --init_from=resume.
A new machine first: the same command with --preflight=True (two short runs, then one screen of verdicts).
A config file is Python that sets the keys below; a line `_base = 'config/baseline.py'` in it (a path from the
working folder or the repository's root) applies that recipe first, so a file holds only what its run changes.

The story: the config; the set-up (device, start-up checks, data, model, optimizers); the starting point
(a checkpoint to resume, weights to start from, or scratch); the loop (one supervision step = one optimizer step,
the same on CPU, CUDA and XLA), with its evaluations and checkpoints; the finish. What keeps the run alive on a
rented machine (checks, locks, records, uploads, signals, the watchdog) is runkeep's Run.
"""
import contextlib
import copy
import os
import time

import runkeep  # the shell's front (its FRONT: Run, launch, resolve_init_from, ...): what keeps the run alive
from configurator import TRAIN_RULES, config_problems, import_torch, set_where  # (torch-free: checked first)

_T_START = time.time()  # this process's start (a torch_xla worker: its own, when it re-imports this file)
runkeep.tell_other_hosts_if_ending_early()  # under a torchrun spanning hosts: an error before joining, there too

# -----------------------------------------------------------------------------
# config. Defaults: the paper's Sudoku-Extreme MLP recipe (87.4% exact in the paper), on one device.
# I/O
out_dir = 'out/sudoku'          # checkpoints and results: a local folder, or gs://bucket/prefix
local_dir = ''                  # local copy of a gs:// out_dir ('': out/<bucket>/<prefix>, one per out_dir)
data_path = 'data/sudoku-extreme-1k-aug-1000'  # dataset root (prepare_sudoku.py / prepare_maze.py)
data_cache_dir = '~/.cache/trm_data'  # where each host keeps its copy of a gs:// data_path
init_from = 'scratch'           # scratch | resume | resume:CKPT | a checkpoint (ours, reference's) | hf://..
overwrite = False               # a new run (scratch or init_from=FILE) may replace the checkpoints in out_dir
eval_only = False               # evaluate init_from's weights and exit
eval_every_epochs = 5000        # epochs between evaluations (and checkpoints)
eval_subset = 0                 # seeded test examples of intermediate evaluations (0, and the final one: all)
eval_steps = 0                  # supervision steps at evaluation (0: halt_max_steps); more: test-time scaling
eval_views = 1                  # test-time breadth: each puzzle also in views-1 seeded symmetries, voting
eval_batch_size = 0             # evaluation batch, split over ranks (0: global_batch_size)
arc_pool_votes = False          # ARC: also the vote pooled over the run's evaluations (the reference's)
arc_answers = False             # ARC: the final evaluation also keeps each test row's answer (answers.npz)
log_interval = 100              # steps between log lines (host reads of training metrics)
checkpoint_interval = 0         # steps between extra checkpoints (0: at evaluations, the end, SIGTERM only)
keep_last_n = 2                 # checkpoints kept, plus the best (0: keep all)
wandb_log = False               # log to Weights & Biases (rank 0; offline in out_dir when W&B is unreachable)
wandb_project = 'trm'           # W&B project
wandb_run_name = ''             # W&B run name ('': W&B picks one)
tensorboard = True              # TensorBoard event files in <run>/tb (a gs:// run: uploaded to <out_dir>/tb)
profile_steps = ''              # 'START:END': a profiler trace of steps START+1..END into <run>/profile
# data
global_batch_size = 768         # examples per optimizer step, split over all ranks
epochs = 50000                  # steps = epochs * groups * mean examples per puzzle / global_batch_size
max_steps = 0                   # >0: stop after this many steps (the LR schedule still spans `epochs`)
max_minutes = 0.0               # >0: wall-time budget: training stops in time for the final evaluation
seed = 0                        # initial weights, data order, ACT exploration
# model (the reference's names)
hidden_size = 512               # D, the width
num_heads = 8                   # attention heads (head_dim = D / num_heads)
expansion = 4.0                 # SwiGLU width factor
L_layers = 2                    # blocks in the one network `net`
H_cycles = 3                    # T: rounds of {L_cycles z-updates, one y-update} per supervision step
L_cycles = 6                    # n: z-updates per round
halt_max_steps = 16             # N_sup: supervision steps at most (ACT)
halt_exploration_prob = 0.1     # share of rows that must run a random minimum of steps
pos_encodings = 'none'          # 'rope' | 'learned' | 'none'
mlp_t = True                    # MLP-mixer over the sequence instead of attention (Sudoku)
puzzle_emb_ndim = 512           # puzzle embedding width (0: none); the reference ties it to hidden_size: change both
puzzle_emb_len = 16             # prefix tokens reserved for the puzzle embedding
forward_dtype = 'auto'          # 'auto' (bf16 where native, else fp32) | 'bfloat16' | 'float16' | 'float32'
no_ACT_continue = True          # False: also learn q_continue against a bootstrapped target
rms_norm_eps = 1e-5             # RMSNorm epsilon
rope_theta = 10000.0            # RoPE base
mlp_multiple = 256              # SwiGLU inner widths round up to a multiple of this (the reference's; toys: 32)
loss_type = 'stablemax'         # 'stablemax' | 'softmax'
loss_dtype = 'auto'             # stablemax precision: 'auto' (float64; XLA float32) | 'float64' | 'float32'
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
freeze_weights = False          # True: train only the puzzle embedding (the network as init_from gave it)
grad_clip = 0.0                 # clip the global gradient norm to this (0: never, as the reference)
gradient_accumulation_steps = 1 # micro-batches per step, each with its rows of the ACT carry: the same update
# system
device = 'auto'                 # 'auto' (PJRT_DEVICE: xla; a GPU: cuda; else cpu) | 'cpu'|'cuda'|'xla'|'tpu'
compile = True                  # torch.compile the step and evaluation (CUDA, TorchTPU, XLA: see step.py)
kernels = 'auto'                # CUDA kernels: 'auto'|'off'|'mlp_t'|'cudnn'|'gated'|'quack'|'triton' (docs/speed.md)
xla_cache_dir = '~/.cache/trm_xla'  # persistent XLA compilation cache ('' disables)
gcs_retries = 8                 # retries of a failed GCS request (exponential backoff) before an upload is given up
preflight = False               # True: check this machine in minutes instead: two short runs in <out>/preflight
preflight_phase = 0             # set by preflight: 1|2, a run whose last eval is eval_subset's, no results.json
watchdog_minutes = 30.0         # no step or eval batch done this long (a hung host): stacks, exit 75 (0: off)
check_memory = True             # refuse at start a CPU or CUDA run its memory cannot hold (an estimate)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
_renamed = dict(eval_interval=('eval_every_epochs', 'it counts epochs'), smoke=('preflight', ''),
                smoke_phase=('preflight_phase', ''))  # old names: refused with the new one
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())


def config_errors(config, set_at=None):
    """Every key's allowed values and the model's shape (configurator.py's rules; set_at: where each key was set),
    then the keys that must agree with each other."""
    return config_problems(config, set_at) + [why for broken, why in (
        (not TRAIN_RULES['out_dir'][0](config['data_path']), f"data_path={config['data_path']!r} (allowed: a "
         "dataset's folder or gs://BUCKET/prefix, not empty)" + set_where(set_at or {}, ['data_path'])),
        (config['eval_only'] and config['init_from'] == 'scratch',
         "eval_only=True needs --init_from=resume or a checkpoint file"),
        (config['freeze_weights'] and not config['puzzle_emb_ndim'],
         "freeze_weights=True trains only the puzzle embedding, and puzzle_emb_ndim=0 has none: nothing would "
         "train"),
    ) if broken]


config = {k: globals()[k] for k in config_keys}
if bad := config_errors(config, _set_at):
    raise SystemExit("config error: " + '; '.join(bad))
config.update(runkeep.resolve_init_from(dict(config, _set_by=_set_by), ours=True))  # hf:// fetched; its run's keys
if bad := config_errors(config):  # what init_from's run's keys make of the rest
    raise SystemExit("config error: " + '; '.join(bad))
globals().update(config)
# -----------------------------------------------------------------------------

torch = import_torch()  # after the config: --help and config errors answer at once

from arc import ARCVotes  # noqa: E402
from data import EvalLoader, TrainLoader  # noqa: E402
from device import Device, Prefetcher, Profiler, choose_dtype, resolve_device, resolve_loss_dtype  # noqa: E402
from device import use_kernels  # noqa: E402
from evaluate import evaluate  # noqa: E402
from model import MODEL_KEYS, TRM, TRMConfig  # noqa: E402
from puzzles import puzzle_for, verifier_for, views_problem  # noqa: E402
from step import AdamATan2, StepConfig, compiled_predict, evaluation_steps, read_sums, step_form  # noqa: E402
from step import train_step  # noqa: E402

# what a resume may not change: the model's shape and the meaning of the step counter and the saved carry
RESUME_FIXED = [k for k in MODEL_KEYS if k not in ('halt_exploration_prob', 'forward_dtype', 'loss_dtype')]
RESUME_FIXED += ['global_batch_size', 'seed']

if __name__ == '__mp_main__':  # a torch_xla worker re-importing this file, in its main thread
    runkeep.start_worker()  # its signals come through the launcher, once; it dies with the launcher


def build(meta, dev, total_steps, data_path):
    """The model for this dataset on this device, its optimizer, its EMA copy (or itself; the copy shares the
    puzzle embedding, a buffer never averaged: an ARC table held once), the step's settings (the LR schedule,
    EMA, clipping, accumulation) and why this forward dtype; eval_views refused where it would not fit in
    memory."""
    dtype, dtype_why, warning = choose_dtype(forward_dtype, dev.type)
    if warning and dev.master:
        print(warning)
    if dev.master and init_from == 'scratch' and puzzle_emb_ndim not in (0, hidden_size) \
            and 'puzzle_emb_ndim' not in _set_by:  # --hidden_size alone: not the reference's model
        print(f"note: puzzle_emb_ndim={puzzle_emb_ndim} with hidden_size={hidden_size}: the reference ties them "
              f"(--puzzle_emb_ndim={hidden_size} builds its model)")
    model_cfg = {k: config[k] for k in MODEL_KEYS}
    model_cfg.update(forward_dtype=dtype, loss_dtype=resolve_loss_dtype(loss_dtype, dev.type))
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TRM(TRMConfig.for_data(meta, **model_cfg)).to(dev.device).requires_grad_(not freeze_weights)
    dtype_why += f" | kernels {use_kernels(kernels, dev.type, dtype, model)[1]}"  # before the EMA's copy
    row_bytes = model.config.latent_bytes(getattr(torch, dtype).itemsize)
    eval_batch = eval_batch_size or global_batch_size
    if problem := views_problem(puzzle_for(meta), eval_views, eval_batch, row_bytes):
        raise SystemExit(f"config error: eval_views={eval_views}: {problem} (the dataset in {data_path})")
    opt = AdamATan2(model.parameters(), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    ema_model = copy.deepcopy(model, {id(model.puzzle_emb): model.puzzle_emb}) if ema else model
    sc = StepConfig(lr=lr, puzzle_emb_lr=puzzle_emb_lr, puzzle_emb_weight_decay=puzzle_emb_weight_decay,
                    warmup_steps=lr_warmup_steps, total_steps=total_steps, min_ratio=lr_min_ratio,
                    global_batch_size=global_batch_size, ema_rate=ema_rate if ema else None,
                    grad_clip=grad_clip, gradient_accumulation_steps=gradient_accumulation_steps,
                    freeze_weights=freeze_weights)
    return model, opt, ema_model, sc, dtype_why


def evaluation(run, weights, loader, arc, show_example=False, pool_at=None):
    """evaluate() of `weights` (the EMA's, or the raw model's) on `loader`, an EvalLoader, watched by the run
    (stop requests between batches, the watchdog, the time budget): (results, example), or (None, None) when a
    stop request abandons it. pool_at: the step whose answers join a pooling ARC run's pool."""
    dev = run.dev
    predict = compiled_predict(weights, backend=dev.compile_backend) if compile and dev.type != 'cpu' else None
    with run.evaluating(loader) as watch:
        return evaluate(weights, loader, dev, eval_steps or halt_max_steps, halt_max_steps,
                        verifier_for(loader.meta), show_example, predict=predict, arc=arc, arc_pool_at=pool_at,
                        should_stop=watch.should_stop, progress=watch.progress)


def evaluate_and_save(run, step, last_step, model, ema_model, loaders, arc, save=None, log=True):
    """The evaluation at `step` (at the run's last step the whole test split, else eval_subset's), logged, then
    the checkpoint (save(); None: none), and at the last step results.json. False when a stop request came
    during it: it is abandoned, and the checkpoint of `step` saved as owing it (its resume evaluates it first)."""
    final = step == last_step and not preflight_phase  # a pre-flight run's last evaluation is an intermediate one
    dev = run.dev
    xla_before = dev.xla_counters()
    res, example = evaluation(run, ema_model, loaders[0 if final else eval_subset], arc, final, pool_at=step)
    # early in a run the EMA may still trail the weights it averages: intermediate evaluations show both
    raw = evaluation(run, model, loaders[eval_subset], arc)[0] if res and ema and not final else None
    if res is None or (ema and not final and raw is None):
        if save:
            # 'final': the time budget's last step, which its resume evaluates as the end; a configured end that
            # a resume with more steps moves is an evaluation owed before training on
            save(' (stop requested)', owed='final' if final and run.out_of_time else True)
        return False
    run.log_eval(step, res, raw, xla_before, log)
    examples = {s: len(loader.example_idx) for s, loader in loaders.items()}  # the test examples of each
    run.new_best(step, res, examples[0 if final else eval_subset], examples[eval_subset], examples[0])
    if save:
        save()
    if final:
        run.finish(step, res, example, model.num_params(), model.flops_per_example(), arc)
    return True


def main(index=None):
    # --- set-up: the device, the start-up checks every rank agrees on, data, model, optimizers --------------
    dev = Device(resolve_device(device), xla_cache_dir)
    run = runkeep.Run(config, dev, started=_T_START)
    loader = TrainLoader(run.data_path, global_batch_size, dev.rank, dev.world_size, seed)
    meta, total_steps = loader.meta, loader.steps_for(epochs)
    if total_steps < 1:
        raise SystemExit(f"config error: epochs={epochs} of {loader.n_groups} groups at global_batch_size="
                         f"{global_batch_size} is less than one step")
    model, opt, ema_model, sc, dtype_why = build(meta, dev, total_steps, run.data_path)
    dev.manual_seed(seed + dev.rank)  # from here on the rank offset decorrelates ACT exploration
    run_steps = min(total_steps, max_steps) if max_steps > 0 else total_steps
    eval_every = max(1, loader.steps_for(eval_every_epochs))
    eval_at = set(evaluation_steps(run_steps, eval_every))
    if dev.master:
        upto = f", this run to step {run_steps} (max_steps)" if run_steps < total_steps else ''
        # (--eval_only evaluates its checkpoint once, whatever the schedule)
        at = f" (this run: at {', '.join(map(str, sorted(eval_at)))})" if len(eval_at) <= 4 and not eval_only else ''
        print(f"device {dev.type} x{dev.world_size} ({dev.name()}) | forward dtype {dtype_why} | "
              f"{model.num_params():,} parameters | {model.flops_per_example() / 1e9:.2f} GFLOPs per "
              f"example-step | {total_steps} steps ({epochs} epochs of {loader.n_groups} groups, batch "
              f"{global_batch_size}){upto}, eval every {eval_every}{at}")

    # --- the starting point: a checkpoint to resume, weights to start from, or scratch ---------------------
    arc = ARCVotes.open(run.data_path, puzzle_for(meta), arc_pool_votes and not eval_only, eval_at, arc_answers)
    step, carry_state = run.resume(model, ema_model, opt, loader, RESUME_FIXED, run_steps, arc)
    # the test split opened now and held: a dataset rebuilt under the run (renames) leaves these files to it
    loaders = {s: EvalLoader(run.data_path, eval_batch_size or global_batch_size, dev.rank, dev.world_size,
                             subset=s, seed=seed, views=eval_views, kind=puzzle_for(meta),
                             progress=run.host_progress) for s in {0, eval_subset}}
    run.plan_budget(model, ema_model, loaders[0], loaders[eval_subset], eval_steps or halt_max_steps, run_steps,
                    global_batch_size)
    if eval_only:
        return run.evaluate_checkpoint(lambda: evaluation(run, ema_model, loaders[0], arc, show_example=True),
                                       step, arc)
    if run.owed_final:  # the time budget's last step: its final evaluation, as the run stopped in it would have
        run_steps = step
    if step >= run_steps:  # nothing to train; a run ended without results.json evaluates again and writes it
        # the keys that end the run: a max_steps past the end of the epochs moves nothing, one at it ends it too
        ending = [f"--max_steps={max_steps}"] if 0 < max_steps < total_steps else [f"--epochs={epochs}"] + (
            [f"--max_steps={max_steps}"] if max_steps == total_steps else [])
        later = f"--max_steps={max_steps} ends later" if max_steps > total_steps else ''
        done = run.finished_before(step, run_steps, ending, later) or evaluate_and_save(
            run, step, step, model, ema_model, loaders, arc, log=not run.logged('eval', step))
        run.end(stopped=not done)
        if not done and dev.master:  # its checkpoint stays as it was, still owing this evaluation
            print("stopped during the final evaluation, without results.json" + (" or submission.json" if arc else "")
                  + "; rerun with --init_from=resume to evaluate again")
        return
    run.open_records(step)

    # --- the training loop: one supervision step = one optimizer step, the same on CPU, CUDA and XLA ---
    form = step_form(dev.type, compile, backend=dev.compile_backend)  # as in bench.py
    step_t = torch.full((), float(step), device=dev.device)  # on the device: the LR schedule runs there
    ema_params = list(ema_model.parameters())
    prefetch = Prefetcher(loader, dev)
    carry = {k: v.to(dev.device) for k, v in carry_state.items()} if carry_state is not None else \
        model.initial_carry(prefetch.upcoming)

    def save(tag='', owed=False):
        return run.save(step, model, ema_model, opt, carry, prefetch.consumed_state, tag, owed)

    # the evaluation a stop interrupted, done first
    stop_now = run.owed and not evaluate_and_save(run, step, run_steps, model, ema_model, loaders, arc, save)
    start_step = step
    prof = Profiler.for_run(dev, os.path.join(run.local, 'profile'), profile_steps, step, run_steps)
    phase = prof.phase if prof else (lambda name: contextlib.nullcontext())  # names a step's parts in a trace
    run.loop_started(step)
    acc, bad_step = None, torch.full((1,), -1.0, device=dev.device)  # the first step with a non-finite loss
    model.train()
    while step < run_steps and not stop_now:
        if prof:
            prof.begin(step)
        t_step = time.time()
        dev.seed_step(seed, step)  # XLA: the exploration draws of this step, whatever graphs ran since the last
        with phase('train_step'):
            carry, loss, metrics = train_step(model, opt, ema_params, carry, prefetch.next(), step_t, sc, form,
                                              dev.all_reduce_sum_, dev.all_gather)
            metrics['loss'] = loss
            bad_step = torch.where(torch.isfinite(loss) | (bad_step >= 0), bad_step, step_t)  # this step's
            acc = metrics if acc is None else {k: acc[k] + metrics[k] for k in metrics}
        dev.sync()  # outside the phase: XLA cuts the graph here, which a profiler's scope must not span
        step += 1
        run.step_done(step, time.time() - t_step)  # the host's part (XLA: the device runs the graph on its own)
        if prof and prof.finish(step):
            # its folder, not the path finish() names: off XLA that is the trace's file, and TorchTPU's device trace
            # lies beside it
            run.upload_folder(prof.folder)

        # --- log, stop, evaluate, save ------------------------------------------------------------------
        at_eval = step in eval_at
        at_ckpt = checkpoint_interval > 0 and step % checkpoint_interval == 0
        stop_now = run.stop_requested(step, start_step, at_eval, at_ckpt)  # SIGTERM or Ctrl-C on any rank
        if run.out_of_time:  # --max_minutes: this step is the last, in time for the final evaluation
            run_steps, at_eval = step, True
        if step % log_interval == 0 or at_eval or at_ckpt or stop_now:
            # the next sums start from zeros the read's graph makes: the step after a log line then runs the
            # graph of the steps before it (XLA; where the sums are traced into the step's graph)
            zeros = {k: torch.zeros_like(v) for k, v in acc.items()}
            sums, bad_at = read_sums(dev, acc, bad_step)  # on every rank: the same graphs on every rank
            run.check_divergence(bad_at, step)
            run.log_train(sums, step, run_steps, loader.epochs_done(prefetch.consumed_state),
                          float(sc.lr_at(step - 1, sc.lr)), model.flops_per_example())
            acc = zeros
        if stop_now:
            save(' (stop requested)', owed=at_eval)
        elif at_eval:
            stop_now = not evaluate_and_save(run, step, run_steps, model, ema_model, loaders, arc, save)
        elif at_ckpt:
            save()
        if step == start_step + 1:
            run.warm_save(model, ema_model, carry)  # XLA: the save's graph now, not at SIGTERM

    # --- finish: bounded waits for uploads and W&B, then every rank leaves together ---
    if prof and prof.finish(step, last=True):
        run.upload_folder(prof.folder)
    if dev.type == 'xla' and dev.master:
        compiles, fallbacks = dev.xla_report()
        print(f"xla: {compiles} graph compilations; CPU fallbacks: {', '.join(fallbacks) or 'none'}")
    run.end(stop_now)
    if stop_now and dev.master:  # an ARC run's submission is its final evaluation's, so a stop leaves none
        print("stopped cleanly" + (", without a submission.json (the final evaluation writes it)" if arc else "")
              + "; rerun with --init_from=resume to continue")


if __name__ == '__main__':
    raise SystemExit(runkeep.launch(main, config, _T_START))
