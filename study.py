"""
Scaling studies: families of train.py runs that differ from the paper's recipe in one or two keys, run in
sequence or N at once (resumable), costed before they run, and compared afterwards in one table and a few
plots.

    python study.py                                            # the families and their experiments
    python study.py --pattern='rec_*' --dry_run=True           # each run's command, parameters, FLOPs, time
    python study.py --pattern='rec_*'                          # build missing datasets, then run them in turn
    python study.py --pattern='rec_*,tn_*' --scale=cpu         # the CPU smoke twin of the same families
    python study.py --pattern='*' --scale=gpu --examples_per_s=2500 --dry_run=True
    python study.py --pattern='rec_*,tn_*' --scale=cpu --report=True   # table (md, csv) and PNGs
    python study.py --pattern='rec_*' --scale=cpu --eval_only=True --eval_views=1,2,4,8,16 --eval_steps=4,8
    torchrun users: --nproc=4;  TPU pods: PJRT_DEVICE=TPU python study.py ... --out_root=gs://BUCKET/study

The experiments are files, one per run: config/study/<family>_<point>.py, plain Python that train.py runs
by itself (`python train.py config/study/rec_L2.py`). Each names its base recipe in `_base`
(config/baseline.py for Sudoku-Extreme, config/maze.py for Maze-Hard; configurator.py applies it first) and
holds only what the run changes: its out_dir and W&B name, and the studied key(s), marked. Why files and not
one file per family with an override syntax: a run is then one file a researcher can open, diff, run alone,
copy to start a new point, and cite in a paper; a glob over file names selects a family (`size_*`, `size_d*`,
`maze_rec_*`); and nothing new sits between the file and train.py: the runner passes only --key=value flags,
the same configurator reads them. The family is the name up to its last '_' (so points carry no '_').

Grid points equal to the base recipe (size_d512, size_L2, rec_L6, tn_T3n6, data_1000, aug_1000, abl_halt16;
maze_size_d512, maze_size_L2, maze_rec_L4, maze_tn_T3n4) are one run: their files share out_dir
out/study/base (maze: out/study/maze_base), so it is trained once and shows up in every family. Likewise
tn_T3n4 is rec_L4's run (out/study/rec_L4) and maze_tn_T3n6 is maze_rec_L6's.

Runs go to <out_root>/<last part of the file's out_dir>. A run whose results.json exists is skipped when it
was made with the command the study runs now (compared on every key that shapes the result; not on out_dir,
logging, checkpoint or W&B keys, device, compile); made with another (the file or --extra changed since), or
unreadable, it is reported NOT REUSED, neither reused nor trained over (move its folder away to train it
again), and the report does not use it. Every other run gets --init_from=resume, which continues its newest
checkpoint or starts from scratch when there is none. A failed run is reported with its error (its last
line on stderr, or the signal that killed it) and the next one starts; the exit code is 1 if any run
failed. One study at a time runs into an out_root: study.lock in its local folder names it (host, pid); a
second study.py is refused, and a lock whose study is gone is taken over. SIGINT or
SIGTERM to study.py: the running train.py gets one SIGTERM (it saves a checkpoint and exits), the study
stops; if study.py is killed outright, train.py gets a SIGTERM from the kernel (Linux) and does the same.
Rerun the same command to continue. Missing datasets are built first with the command the dataset's name
implies (data/sudoku-extreme-<K>-aug-<A>: prepare_sudoku.py --subsample_size K --num_aug A; K may be
written 1k; data/maze-30x30-hard-1k: prepare_maze.py), or the file's `_prepare` string.
On a TPU pod every host runs the same command: the order is fixed (names, naturally sorted), out_root
must be gs:// (every host then sees the same results.json and checkpoints), each host builds its own copy
of a missing dataset (the builds are seeded, so the copies are identical).

Scales (--scale), applied as --key=value flags after the file, so each twin is the same family:
  full  the files as they are (the paper's sizes; out/study)
  gpu   one GPU (out/study-gpu): epochs, eval_interval and lr_warmup_steps x 0.1 (Sudoku-Extreme 1k:
        6,510 steps at batch 768); Maze global_batch_size 128 (config/maze.py's one-GPU advice). The
        datasets are the real ones.
  cpu   smoke (out/study-cpu): generated datasets instead of the real ones, built offline in seconds:
        Sudoku-Extreme K puzzles x A augmentations -> 4x4 Sudoku, K/5 puzzles x A/100 augmentations drawn
        from one seeded pool of 1,000 (same 200 held-out puzzles for every point), in data_root;
        Maze-Hard -> 200 generated 8x8 mazes (100 held out). hidden_size / 16, num_heads 2,
        halt_max_steps / 4 (evaluated at twice that: eval_steps), puzzle_emb_ndim 0, epochs x 0.0008 (base: 40
        epochs, 250 steps at batch 32), eval_interval = epochs / 2, checkpoint_interval 50, log_interval 25,
        lr 2e-3 (warm-up 30 steps), weight_decay 0.1, ema_rate 0.99, float32, device cpu, one thread
        (OMP_NUM_THREADS=1 unless set). The rec_* + tn_* twin is 8 runs (tn_T3n4 shares rec_L4's run); README
        gives its measured time.
--extra='--key=value ...' is added to every run after the scale's flags (e.g. --extra='--seed=1' with
another --out_root for a second seed); not the keys the runner sets (out_dir, local_dir, init_from,
eval_only). Values in --extra and in the experiment files must have train.py's types (checked at load).

Costs (--dry_run): parameters and FLOPs per example-step from model.TRM built on the meta device; steps as
train.py computes them (epochs x groups x mean examples per puzzle / global_batch_size) from the dataset's
dataset.json, or before it is built from the known sizes (Sudoku-Extreme: K groups of 1 + A puzzles of one
example each; 422,786 held-out puzzles; Maze-Hard: 1,000 + 1,000); training FLOPs = FLOPs per example-step
x steps x global_batch_size (as train.py's results.json); evaluation FLOPs (forward passes over the
held-out sets at every evaluation) are shown apart. Times need a measured speed: --examples_per_s (what
`python bench.py config/baseline.py` plus the scale's flags prints; turned into a FLOP rate with that
model's FLOPs, so each run's time follows its own FLOPs) or --bench_file (a file with bench.py's output).

Parallel runs (--slots=N): N train.py processes at once on this host, each with the same flags as alone (so
the same results) and its own devices: GPUs: nproc each, by CUDA_VISIBLE_DEVICES (from the environment, or
`nvidia-smi -L`; CUDA is never initialized in study.py); TPU (PJRT_DEVICE=TPU, chips counted on the PCI bus as
torch_xla does): N = the host's chips, one chip a run, by libtpu's per-process variables TPU_VISIBLE_CHIPS=i,
TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1, TPU_PROCESS_BOUNDS=1,1,1, TPU_PROCESS_PORT=8476+i,
TPU_PROCESS_ADDRESSES=localhost:8476+i, CLOUD_TPU_TASK_ID=0 (torch_xla's launcher then starts one process);
2 .. chips-1 chips a run are refused (the launcher starts one process per visible chip and gives each chip i
of 0..k-1, so two runs cannot be told apart); CPU: the cores are split between slots (sched_setaffinity in the
child, OMP_NUM_THREADS = its cores unless set; the cpu scale keeps 1 thread a run). Runs start longest first;
each keeps its train.log; the console shows a line when one starts or ends and, every status_every seconds,
one status line per running run. SIGINT/SIGTERM: every running train.py gets one SIGTERM (saves, exits).
Pods (--hosts_mode=share): each host runs its own share of the runs on its own chips, no collective across
hosts: a fixed partition of the runs (longest first onto the least-loaded host, costs from the configs and
the datasets' known sizes only), so every host knows its share alone; host index from --host_index,
TPU_WORKER_ID, CLOUD_TPU_TASK_ID or the TPU metadata; host count from --num_hosts, TPU_WORKER_HOSTNAMES or
the metadata (more than one host and no index from these: an error). With --slots=1 a host's chips act as
a TPU VM of their own: TPU_SKIP_MDS_QUERY=1, TPU_ACCELERATOR_TYPE (from the metadata), TPU_WORKER_ID=0,
TPU_WORKER_HOSTNAMES=localhost, TPU_HOST_BOUNDS=1,1,1, TPU_CHIPS_PER_HOST_BOUNDS (the host's chips, from the
metadata). Use out_root=gs://... so the report sees every host's results. The default, hosts_mode=all, runs
each run over the whole pod.
The dry run prints which host and slot runs what and the study's wall time under each mode.
Seeds (--seeds=K): seed s of every experiment (seed 0: the file's own folder; s > 0: <out_dir>-s<s>,
--seed=s). New families: lr_* (3e-5 .. 1e-3), bs_* (256 .. 6144 at fixed epochs, so steps ~ 1/B, with
square-root scaling lr = 1e-4 * sqrt(B / 768); puzzle_emb_lr and warm-up steps stay), abl_halt1/2 and
abl_noemb. At the cpu scale lr and batch keep their ratio to the base's (2e-3 x lr / 1e-4, 32 x B / 768);
halt_max_steps < 4 is kept (abl_halt2 and abl_halt8 then both train 2 steps); the cpu base has no puzzle
embedding, so abl_noemb's cpu twin turns it ON (width 32): the same contrast against the cpu base, reversed.

--report=True (and every run of a study, at its end) writes <report_dir>/report.md, report.csv and PNGs:
held-out exact accuracy (95% Wilson interval; with --seeds: the mean, bars min-max) against parameters,
training FLOPs, device-hours (results.json's wall time x devices), recursion (n = L_cycles; T x (n + 1)
network calls per supervision step), lr and batch, training puzzles and augmentations, per ablation, and
accuracy against supervision steps; and error_fits.png: error = 1 - exact fitted per family as a * X^-b + c
against parameters, FLOPs and puzzles (report.md: the parameters, R^2, and why a fit is not meaningful: under
4 distinct points, a spread under 1 point, R^2 <= 0). report.csv has one row per run (seed column) and each
experiment's exact_mean/std/min/max over its seeds.

Test-time compute (--eval_only=True): breadth, every held-out puzzle in k views (view 0 the puzzle, the others
seeded symmetries of it; eval_views, e.g. '1,2,4,8,16': powers of two and the largest any count), and depth, S
supervision steps (eval_steps, e.g. '4,8'; 0 or '': the run's own, eval_steps or halt_max_steps). Each run the
report would use (results.json there and reused) is evaluated again by its own command plus --eval_only=True
--eval_views=K --eval_steps=S, K = the largest k (the first k views of a K-view evaluation are a k-view
evaluation, so one evaluation per S gives every k), from its newest checkpoint (--init_from=resume); train.py
saves <out_dir>/evals/views{K}-steps{S}.json (and uploads it to a gs:// out_dir), its output goes to the run's
evals.log. An S whose file has K views or more is skipped, so a rerun continues where it stopped; unfinished
or NOT REUSED runs are listed as skipped with the reason. The evaluations run in turn (--slots does not
apply), then the report. The report reads, per run and S, the file with the most views: report.md's section
'Test-time compute' and report_views.csv (run, views k, steps S, vote@k, verified@k, oracle@k, accepted@k,
each also with q_halt's stop, eval FLOPs per puzzle = k x S x forward FLOPs, seconds of the evaluation) and
acc_vs_test_compute.png: accuracy against test-time FLOPs per puzzle (log), a colour per run of a family, a
marker per S, points labelled by k, verified@k solid, vote@k dashed, oracle@k (the ceiling) dotted. train.py
scores vote/verified/oracle after the last of the S steps (the left panel); the q_halt variants take each
view's answer where its q_halt stopped it, within the S steps (the right panel); both at k x S x forward FLOPs.
"""
import atexit
import csv
import fnmatch
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import deque

import gcs
from configurator import config_files, parse_flags, read_config_block
from device import tpu_chips, tpu_host_alone_env, usable_cores
from puzzles import shape_from_name
from checkpoint import list_checkpoints
from guard import holder_gone, local_folder, lock_record

# -----------------------------------------------------------------------------
# config
pattern = ''                    # experiments: name globs ('rec_*', 'size_d*,tn_*', '*'); '': list families
scale = 'full'                  # 'full' (files as they are) | 'gpu' (one GPU) | 'cpu' (smoke); see docstring
dry_run = False                 # print each run's command, parameters, FLOPs and time estimate; run nothing
list_only = False               # print each selected experiment's varied keys, out_dir and state; run nothing
report = False                  # collect selected runs' results into report.md, report.csv, PNGs; run nothing
eval_only = False               # evaluate finished runs again in eval_views views at eval_steps steps; no training
eval_views = '1,2,4,8,16'       # with eval_only: view counts k (powers of two; the largest any): one run in max k
eval_steps = ''                 # with eval_only: test-time supervision steps S, e.g. '4,8' (0 or '': the run's own)
nproc = 1                       # processes per run: >1: torchrun --standalone --nproc_per_node=nproc (TPU: 1)
out_root = ''                   # runs go to out_root/<name of the file's out_dir> ('': out/study, out/study-gpu, out/study-cpu by scale; gs:// allowed)
data_root = 'data/study-cpu'    # where the cpu scale's generated datasets go
config_dir = 'config/study'     # the experiment files
extra = ''                      # extra train.py flags, after the scale's (e.g. '--seed=1 --wandb_log=True')
examples_per_s = 0.0            # bench.py's training examples/s for config/baseline.py at this scale (0: none, no time estimate)
bench_file = ''                 # or a file of bench.py's output: its last 'bench:' line gives the FLOP rate
build_data = True               # build missing datasets first (False: a run without its dataset fails)
report_dir = ''                 # where --report writes ('': the local folder of out_root)
slots = 1                       # runs at once here, each on its own GPUs, TPU chip or CPU cores (docstring)
hosts_mode = 'all'              # 'all': each run on all pod hosts, in turn | 'share': each host its share
host_index = -1                 # this host, 'share' (-1: TPU_WORKER_ID, CLOUD_TPU_TASK_ID, TPU metadata, 0)
num_hosts = 0                   # hosts for 'share' (0: TPU_WORKER_HOSTNAMES, the TPU metadata, else 1)
seeds = 1                       # runs per experiment: seeds 0 .. seeds-1 (seed s > 0 in <out_dir>-s<s>)
status_every = 60.0             # with slots > 1: seconds between status lines (one line per running run)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
# -----------------------------------------------------------------------------

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_DEFAULTS = {k: v for k, (v, _) in read_config_block(os.path.join(HERE, 'train.py')).items()}
SCALE_ROOTS = dict(full='out/study', gpu='out/study-gpu', cpu='out/study-cpu')
GPU_FRACTION = 0.1              # of epochs, eval_interval and lr_warmup_steps at the gpu scale
CPU_FRACTION = 0.0008           # of epochs at the cpu scale (50,000 -> 40)
CPU_FIXED = dict(device='cpu', forward_dtype='float32', loss_dtype='float32', xla_cache_dir='',
                 global_batch_size=32,
                 lr=2e-3, lr_warmup_steps=30, weight_decay=0.1, puzzle_emb_ndim=0, ema_rate=0.99,
                 eval_subset=0,
                 log_interval=25, checkpoint_interval=50, num_heads=2)
CPU_SUDOKU = dict(size=4, pool=1000, num_test=200, puzzles_div=5, aug_div=100)
CPU_MAZE = dict(size=8, train=200, num_test=100)
# the real datasets' sizes, for costs before they are built
# (shapes from the folder's name: puzzles.shape_from_name)
SUDOKU_EXTREME = dict(num_puzzle_identifiers=1, test=422_786)
MAZE_HARD = dict(num_puzzle_identifiers=1, groups=1000, test=1000, gpu_batch=128)  # gpu scale: 900-token rows
# differ between runs without changing what is trained
NOT_VARIED = ('out_dir', 'wandb_run_name', 'local_dir')
RUNNER_KEYS = ('out_dir', 'local_dir', 'init_from', 'eval_only')  # the runner sets them for every run
# keys that do not change what a run trains or its results: a finished run recorded with other values of
# these is still the run the study asks for
NOT_SHAPING = ('out_dir', 'local_dir', 'data_cache_dir', 'init_from', 'overwrite', 'eval_only',
               'eval_batch_size', 'log_interval', 'checkpoint_interval', 'keep_last_n', 'wandb_log',
               'wandb_project', 'wandb_run_name', 'device', 'compile', 'xla_cache_dir', 'gcs_retries')
STUDY_LOCK = 'study.lock'       # in the local folder of out_root: one study at a time runs into it
STOP = dict(requested=False, children=set())

if scale not in SCALE_ROOTS:
    raise SystemExit(f"config error: scale={scale!r} (allowed: {' | '.join(map(repr, SCALE_ROOTS))})")
if nproc < 1:
    raise SystemExit(f"config error: nproc={nproc} (allowed: >= 1)")
if sum([dry_run, list_only, report, eval_only]) > 1:
    raise SystemExit("config error: choose one of dry_run, list_only, report and eval_only")


def int_list(key, text, least):
    """The integers of a comma-separated key ('1,2,4'), each >= least."""
    try:
        vals = [int(t) for t in str(text).replace(' ', '').split(',') if t]
    except ValueError:
        vals = None
    if vals is None or any(v < least for v in vals):
        raise SystemExit(f"config error: {key}={text!r} (allowed: comma-separated integers >= {least}, e.g. "
                         f"{'1,2,4,8,16' if key == 'eval_views' else '4,8'})")
    return vals


VIEWS = sorted(set(int_list('eval_views', eval_views, 1))) or [1]
STEPS = list(dict.fromkeys(int_list('eval_steps', eval_steps, 0))) or [0]  # 0: each run's own
# a K-view evaluation reports k = 1, 2, 4, .. and K (step.view_counts): other counts are not measured
if odd_views := [k for k in VIEWS[:-1] if k & (k - 1)]:
    raise SystemExit(f"config error: eval_views={eval_views!r}: {odd_views} not reported by an evaluation in "
                     f"{VIEWS[-1]} views (allowed: powers of two, and the largest any count)")
if slots < 1 or seeds < 1:
    raise SystemExit(f"config error: slots={slots}, seeds={seeds} (allowed: >= 1)")
if hosts_mode not in ('all', 'share'):
    raise SystemExit(f"config error: hosts_mode={hosts_mode!r} (allowed: 'all' | 'share')")
if os.environ.get('PJRT_DEVICE') and nproc > 1:
    raise SystemExit("config error: with PJRT_DEVICE set train.py starts one process per chip itself: use "
                     "--nproc=1")
ROOT = (out_root or SCALE_ROOTS[scale]).rstrip('/')


LOCAL_ROOT = local_folder(ROOT) if gcs.is_gcs(ROOT) else ROOT  # a run's local_dir: train.py's default for it


def natural_key(s):
    return [int(t) if t.isdigit() else t for t in re.split(r'(\d+)', s)]


def fmt_value(v):
    return repr(v) if isinstance(v, float) else str(v)


def value_problem(key, value):
    """'key=value (allowed: ...)' when value cannot be train.py's key (not its default's type; an int where a
    float is expected is fine, as configurator.py takes it), else ''."""
    default = TRAIN_DEFAULTS[key]
    if type(value) is type(default) or (type(default) is float and type(value) is int):
        return ''
    kind = {bool: 'True or False', int: 'an int', float: 'a number', str: 'a str'}[type(default)]
    return f"{key}={value!r} (allowed: {kind}, as train.py's default {default!r})"


try:
    EXTRA_ARGS = shlex.split(extra)
except ValueError as ex:  # an unclosed quote
    raise SystemExit(f"config error: --extra={extra!r}: {ex} (allowed: --key=value flags, quoted as in a "
                     "shell)")
EXTRA = parse_flags(extra, TRAIN_DEFAULTS, '--extra')
if [k for k in EXTRA if k in RUNNER_KEYS]:
    raise SystemExit(f"config error: --extra sets {', '.join(k for k in EXTRA if k in RUNNER_KEYS)}, which "
                     f"study.py sets for every run (not allowed in --extra: {', '.join(RUNNER_KEYS)}): the "
                     "runs go to --out_root/<the file's out_dir name> and resume with --init_from=resume")
if any(value_problem(k, v) for k, v in EXTRA.items()):
    raise SystemExit("config error: --extra: "
                     + '; '.join(filter(None, map(value_problem, EXTRA, EXTRA.values()))))
if seeds > 1 and 'seed' in EXTRA:
    raise SystemExit("config error: --seeds and --extra='--seed=...' together (allowed: one of them)")


def read_meta(path):
    """The '_' names of a config file (_base, _prepare): study.py's, not train.py's."""
    scope = {}
    exec(compile(open(path).read(), path, 'exec'), {}, scope)
    return {k: v for k, v in scope.items() if k.startswith('_') and not k.startswith('__')}


def effective(path):
    """(train.py's config for this file, as configurator.py applies it: defaults, _base chain, the file; its
    '_' names)."""
    cfg = dict(TRAIN_DEFAULTS)
    for p, keys in config_files(path):
        unknown = [k for k in keys if k not in TRAIN_DEFAULTS]
        if unknown:
            raise SystemExit(f"config error: {p} sets unknown key(s) {unknown}")
        bad = list(filter(None, map(value_problem, keys, keys.values())))
        if bad:  # refused here, before a dry run costs it and every run of it fails
            raise SystemExit(f"config error: {p} sets {'; '.join(bad)}")
        cfg.update(keys)
    return cfg, read_meta(path)


# -----------------------------------------------------------------------------
# datasets: what a data_path is, at each scale, and the command that builds it

def dataset_for(cfg, meta, read_built=True):
    """The dataset a run uses at this scale: path, build command (None: unknown), kind, training puzzles
    (groups) and augmentations, sizes for the cost. Read from dataset.json once it is built (read_built)."""
    path = cfg['data_path']
    name = path.rstrip('/').split('/')[-1]
    d = dict(path=path, build=shlex.split(meta['_prepare']) if meta.get('_prepare') else None, kind=None,
             puzzles=None, aug=None, groups=None, mean=1.0, test=None)
    d['seq_len'], d['vocab_size'], _ = shape_from_name(path)
    m = re.fullmatch(r'sudoku-extreme-(\d+)(k?)-aug-(\d+)', name)
    if m:
        K, A = int(m[1]) * (1000 if m[2] else 1), int(m[3])
        d.update(kind='sudoku', puzzles=K, aug=A, groups=K, **SUDOKU_EXTREME)
        if d['build'] is None:
            d['build'] = ['prepare_sudoku.py', '--output_dir', path, '--subsample_size', str(K), '--num_aug',
                          str(A)]
        if scale == 'cpu':
            c = CPU_SUDOKU
            k, a = max(1, K // c['puzzles_div']), A // c['aug_div']
            d.update(path=f"{data_root}/sudoku{c['size']}-{k}-aug-{a}", puzzles=k, aug=a, groups=k,
                     vocab_size=c['size'] + 2, seq_len=c['size'] ** 2, test=c['num_test'],
                     build=['prepare_sudoku.py', '--generate', str(c['pool']), '--size', str(c['size']),
                            '--num_test', str(c['num_test']), '--subsample_size', str(k), '--num_aug', str(a),
                            '--seed', '0', '--output_dir', f"{data_root}/sudoku{c['size']}-{k}-aug-{a}"])
    elif re.fullmatch(r'maze-30x30-hard-1k', name):
        d.update(kind='maze', puzzles=1000, aug=0, **MAZE_HARD)
        if d['build'] is None:
            d['build'] = ['prepare_maze.py', '--output_dir', path]
        if scale == 'cpu':
            c = CPU_MAZE
            p = f"{data_root}/maze{c['size']}"
            d.update(path=p, puzzles=c['train'], groups=c['train'], seq_len=c['size'] ** 2,
                     test=c['num_test'],
                     build=['prepare_maze.py', '--generate', str(c['train']), '--size', str(c['size']),
                            '--num_test', str(c['num_test']), '--output_dir', p])
    metas = [os.path.join(d['path'], s, 'dataset.json') for s in ('train', 'test')]
    d['exists'] = all(os.path.exists(p) for p in metas)
    if d['exists'] and read_built:  # the real sizes
        with open(metas[0]) as f:
            tr = json.load(f)
        with open(metas[1]) as f:
            te = json.load(f)
        d.update(groups=tr['total_groups'], mean=tr['mean_puzzle_examples'], vocab_size=tr['vocab_size'],
                 seq_len=tr['seq_len'], num_puzzle_identifiers=tr['num_puzzle_identifiers'],
                 test=int(te['total_puzzles'] * te['mean_puzzle_examples']),
                 kind=d['kind'] or tr.get('puzzle_type'))
        if d['puzzles'] is None:
            d.update(puzzles=tr['total_groups'], aug=round(tr['total_puzzles'] / tr['total_groups']) - 1)
    return d


def build_display(cmd):
    return ' '.join(shlex.quote(x) for x in ['python'] + cmd)


# -----------------------------------------------------------------------------
# experiments

class Experiment:
    """One config file at this scale: its family, varied keys, out_dir, dataset, train.py flags and
    command."""

    def __init__(self, path, name=None, seed=0):
        self.path, self.name, self.seed = path, name or os.path.basename(path)[:-3], seed
        self.run = self.name + (f"-s{seed}" if seed else '')  # the run's label: one per seed
        self.family = self.name.rsplit('_', 1)[0] if '_' in self.name else self.name
        self.cfg, self.meta = effective(path)
        base = self.meta.get('_base')
        self.base_cfg = effective(base)[0] if base else dict(TRAIN_DEFAULTS)
        self.varied = {k: v for k, v in self.cfg.items() if v != self.base_cfg.get(k) and k not in NOT_VARIED}
        self.data = dataset_for(self.cfg, self.meta)
        leaf = self.cfg['out_dir'].rstrip('/').split('/')[-1] + (f"-s{seed}" if seed else '')
        self.out_dir, self.local = f"{ROOT}/{leaf}", os.path.join(LOCAL_ROOT, leaf)
        self.twin_note = ''  # what the cpu twin trains where it differs in kind from the file
        self.flags = self.scale_flags()
        self.flags['out_dir'] = self.out_dir
        if seed:  # seed 0 is the file's own (train.py's default): its folder and flags stay as without
                  # --seeds
            self.flags['seed'] = seed
            if self.cfg['wandb_run_name']:
                self.flags['wandb_run_name'] = f"{self.cfg['wandb_run_name']}-s{seed}"
        if gcs.is_gcs(ROOT):
            self.flags['local_dir'] = self.local
        self.run_cfg = {**self.cfg, **self.flags, **EXTRA}
        launcher = ['train.py'] if nproc == 1 else ['-m', 'torch.distributed.run', '--standalone',
                                                     f'--nproc_per_node={nproc}', 'train.py']
        self.cmd = launcher + [path] + [f"--{k}={fmt_value(v)}" for k, v in self.flags.items()] + \
            EXTRA_ARGS + ['--init_from=resume']
        shown = (['torchrun'] + self.cmd[2:]) if nproc > 1 else (['python'] + self.cmd)
        # cpu scale: one thread per run. These models are too small to gain from a second thread, and beside
        # other jobs a multi-threaded one crawls (measured on a busy 2-core machine: 5 examples/s with 2
        # threads, 77-150 with 1). A value set by the user is kept.
        self.env = {'OMP_NUM_THREADS': '1'} if scale == 'cpu' and 'OMP_NUM_THREADS' not in os.environ else {}
        self.display = ' '.join([f"{k}={v}" for k, v in self.env.items()] + [shlex.quote(x) for x in shown])
        self.same_as = None  # the experiment whose run (out_dir) this one shares
        self.family_keys = []  # set by load_experiments: the keys any member of the family changes

    def scale_flags(self):
        c, o = self.cfg, {}
        if scale == 'gpu':
            o['epochs'] = max(1, round(c['epochs'] * GPU_FRACTION))
            o['eval_interval'] = max(1, round(c['eval_interval'] * GPU_FRACTION))
            o['lr_warmup_steps'] = round(c['lr_warmup_steps'] * GPU_FRACTION)
            if self.data.get('gpu_batch'):
                o['global_batch_size'] = min(c['global_batch_size'], self.data['gpu_batch'])
        elif scale == 'cpu':
            o.update(CPU_FIXED)
            b = self.base_cfg
            # the lr and batch the file sets relative to its base recipe's carry over (lr_*, bs_* families)
            o['lr'] = float(f"{CPU_FIXED['lr'] * c['lr'] / b['lr']:.3g}")
            o['global_batch_size'] = max(1, round(CPU_FIXED['global_batch_size'] * c['global_batch_size']
                                                  / b['global_batch_size']))
            o['hidden_size'] = max(8, c['hidden_size'] // 16)
            # halt_max_steps / 4 (16 -> 4); below 4 kept (abl_halt1, abl_halt2), so abl_halt2 and abl_halt8
            # both train 2 steps at this scale
            o['halt_max_steps'] = c['halt_max_steps'] if c['halt_max_steps'] < 4 else c['halt_max_steps'] // 4
            if not c['puzzle_emb_ndim'] and b['puzzle_emb_ndim']:
                # every cpu twin runs without the embedding, the base too: so the twin of a file that turns it
                # off turns it on (at the width / 16), and the pair (cpu base, twin) shows the same contrast
                # reversed
                o['puzzle_emb_ndim'] = max(8, b['puzzle_emb_ndim'] // 16)
                self.twin_note = (f"cpu twin: puzzle_emb_ndim={o['puzzle_emb_ndim']}, the embedding ON "
                                  "against the cpu base's 0")
            o['eval_steps'] = 2 * o['halt_max_steps']  # test-time scaling: twice the trained steps
            o['epochs'] = max(1, round(c['epochs'] * CPU_FRACTION))
            o['eval_interval'] = max(1, o['epochs'] // 2)
        if self.data['path'] != c['data_path']:
            o['data_path'] = self.data['path']
        return {k: v for k, v in o.items() if v != c[k]}

    def varied_text(self):
        """The keys its family studies (those any member changes), with this run's values."""
        keys = self.family_keys or list(self.varied)
        text = ', '.join(f"{k}={self.cfg[k]!r}" for k in keys)
        text = (text + ' (base)' if text else 'base recipe') if not self.varied else text
        return text + (f" ({self.twin_note})" if self.twin_note else '')

    def point(self):
        return self.name[len(self.family) + 1:] or self.name


def load_experiments(patterns):
    files = sorted((f for f in os.listdir(config_dir) if f.endswith('.py')), key=natural_key) \
        if os.path.isdir(config_dir) else []
    if not files:
        raise SystemExit(f"no experiment files in {config_dir}")
    names = [f[:-3] for f in files]
    if not patterns:
        return names, []
    # in the patterns' order
    chosen = list(dict.fromkeys(n for p in patterns for n in names if fnmatch.fnmatchcase(n, p)))
    if not chosen:
        fams = sorted({n.rsplit('_', 1)[0] for n in names}, key=natural_key)
        raise SystemExit(f"no experiment matches {','.join(patterns)!r}; families: "
                         f"{', '.join(f + '_*' for f in fams)}")
    exps = [Experiment(os.path.join(config_dir, n + '.py'), seed=s) for n in chosen for s in range(seeds)]
    for e in exps:
        e.family_keys = list(dict.fromkeys(k for x in exps if x.family == e.family for k in x.varied))
    by_dir = {}
    for e in exps:
        first = by_dir.setdefault(e.out_dir, e)
        if first is not e:
            if first.run_cfg | {'wandb_run_name': 0} != e.run_cfg | {'wandb_run_name': 0}:
                raise SystemExit(f"config error: {first.path} and {e.path} share out_dir {e.out_dir} but "
                                 "differ in "
                                 f"{sorted(k for k in e.run_cfg if e.run_cfg[k] != first.run_cfg[k])}")
            e.same_as = first.run
    return names, exps


# -----------------------------------------------------------------------------
# state of a run: finished (results.json), started (checkpoints), nothing

def has_results(e):
    if gcs.is_gcs(e.out_dir):
        return gcs.object_exists(f"{e.out_dir}/results.json")
    return os.path.exists(os.path.join(e.out_dir, 'results.json'))


def checkpoint_steps(e):
    found = set()
    for folder in [e.local] + ([e.out_dir] if gcs.is_gcs(e.out_dir) else []):
        try:
            found |= set(list_checkpoints(folder))
        except Exception as ex:  # an unreachable bucket: train.py will say more
            print(f"warning: cannot list {folder}: {ex}")
    return sorted(found)


def state(e):
    if has_results(e):
        why = read_results(e)[1]
        return f"done, not used: {why}" if why else 'done'
    steps = checkpoint_steps(e)
    return f"started (checkpoint at step {steps[-1]})" if steps else 'not started'


def fetch(e, name):
    """Local path of a run's file (downloaded from the bucket for gs:// runs), or None."""
    local = os.path.join(e.local, name)
    if gcs.is_gcs(e.out_dir):
        gcs.download_if_there(f"{e.out_dir}/{name}", local, f"the local copy of {name} is used, if any")
    return local if os.path.exists(local) else None


def read_results(e):
    """(a finished run's results.json, '') or (None, why it is not used): unreadable, or recorded with another
    configuration than the command the study runs now, on the keys that shape the result (the dataset by its
    name: a copy elsewhere is the same data). (None, '') when there is none."""
    path = fetch(e, 'results.json')
    if path is None:
        return None, ''
    try:
        with open(path) as f:
            res = json.load(f)
        fe = res['final_eval']
        for k in ('exact_accuracy', 'exact_ci_low', 'exact_ci_high', 'token_accuracy', 'q_halt_accuracy'):
            float(fe[k])
        int(res['parameters']), float(res['train_flops']), float(res['flops_per_example_step'])
    except (OSError, ValueError, KeyError, TypeError) as ex:
        what = 'empty' if os.path.isfile(path) and not os.path.getsize(path) else f"{type(ex).__name__}: {ex}"
        return None, (f"unreadable results.json in {e.out_dir} ({what}); not reused: move it away and rerun "
                      "to evaluate the run's last checkpoint again")
    now, diffs = e.run_cfg, []
    for k, was in (res.get('config') or {}).items():
        if k in NOT_SHAPING or k not in now:
            continue
        a, b = (str(was).rstrip('/').split('/')[-1], str(now[k]).rstrip('/').split('/')[-1]) \
            if k == 'data_path' else (was, now[k])
        if a != b:
            diffs.append(f"{k} {a!r} there, {b!r} now")
    if diffs:
        return None, (f"{e.out_dir}/results.json was made with another configuration ({'; '.join(diffs)}): "
                      f"not reused, and not retrained over it: move {e.out_dir} away to train it again")
    return res, ''


# -----------------------------------------------------------------------------
# costs

_models = {}


def model_cost(run_cfg, data):
    """(parameters, training FLOPs per example-step, forward FLOPs per example-step) of the run's TRM, built
    on the meta device (no memory, no time)."""
    import torch
    from model import TRM, TRMConfig
    kw = {f: run_cfg[f] for f in TRMConfig.__dataclass_fields__ if f in run_cfg}
    kw.update(vocab_size=data['vocab_size'], seq_len=data['seq_len'],
              num_puzzle_identifiers=data['num_puzzle_identifiers'], forward_dtype='float32',
              loss_dtype='float32')
    key = json.dumps(kw, sort_keys=True)
    if key not in _models:
        with torch.device('meta'):
            m = TRM(TRMConfig(**kw))
        _models[key] = (m.num_params(), m.flops_per_example(), m.flops_per_example(train=False))
    return _models[key]


def cost(e, data=None):
    """Parameters, FLOPs and steps of a run, as train.py will count them (data: other sizes than e.data's)."""
    from data import steps_for
    from step import evaluation_steps
    c, d = e.run_cfg, data or e.data
    if d['groups'] is None or d.get('vocab_size') is None:
        return None
    try:
        params, fpe, fwd = model_cost(c, d)
    except ValueError as ex:
        return dict(error=str(ex))
    B = c['global_batch_size']
    total = steps_for(c['epochs'], d['groups'], d['mean'], B)
    steps = min(total, c['max_steps']) if c['max_steps'] > 0 else total
    every = max(1, steps_for(c['eval_interval'], d['groups'], d['mean'], B))
    middle = len(evaluation_steps(steps, every)) - 1  # and the final one
    sub = min(c['eval_subset'] or d['test'], d['test'])
    eval_flops = fwd * (c['eval_steps'] or c['halt_max_steps']) * (middle * sub + d['test'])
    return dict(params=params, fpe=fpe, steps=steps, batch=B, train_flops=fpe * steps * B,
                eval_flops=eval_flops,
                evals=middle + 1)


def flop_rate():
    """(FLOP/s, where it comes from) of the device, from bench.py's figure; (None, why not) without one."""
    if bench_file:
        lines = [l for l in open(bench_file).read().splitlines() if l.startswith('bench:')]
        if not lines:
            raise SystemExit(f"config error: bench_file={bench_file!r} has no 'bench:' line (bench.py's last "
                             "line)")
        kv = dict(t.split('=', 1) for t in lines[-1].split()[1:] if '=' in t)
        rate = float(kv['examples_per_s']) * float(kv['flops_per_example'])
        return rate, (f"{bench_file}: {float(kv['examples_per_s']):.1f} examples/s x "
                      f"{float(kv['flops_per_example']) / 1e9:.2f} GFLOPs = {rate / 1e12:.3g} TFLOP/s")
    if examples_per_s > 0:
        ref = Experiment(os.path.join(HERE, 'config', 'baseline.py'), 'baseline')
        rc = cost(ref)
        if not rc or 'error' in rc:
            raise SystemExit("cannot cost config/baseline.py at this scale for --examples_per_s")
        rate = examples_per_s * rc['fpe']
        return rate, (f"--examples_per_s={examples_per_s:g} for config/baseline.py at scale {scale} "
                      f"({rc['fpe'] / 1e9:.3g} GFLOPs per example-step) = {rate / 1e12:.3g} TFLOP/s")
    return None, ("no speed figure given, so no time estimate: run `python bench.py config/baseline.py` with "
                  "this scale's flags on the target device and pass --examples_per_s=<its examples/s> (or "
                  "--bench_file=<a file with its output>)")


def duration(s):
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


# -----------------------------------------------------------------------------
# hosts, slots and devices: where each run goes

TPU_PORT = 8476                 # libtpu's first process port (torch_xla's default); slot i uses TPU_PORT + i


def host_devices(exps):
    """(kind, ids) of what this host's runs train on, found without initializing a device in study.py: 'tpu'
    (PJRT_DEVICE=TPU) and its chips (on the PCI bus, as torch_xla counts them), 'cuda' and
    CUDA_VISIBLE_DEVICES or the GPUs `nvidia-smi -L` lists, else 'cpu' and the cores study.py may run on."""
    wanted = {e.run_cfg['device'] for e in exps} or {'auto'}
    if os.environ.get('PJRT_DEVICE') == 'TPU' and wanted <= {'auto', 'xla'}:
        return 'tpu', [str(i) for i in range(tpu_chips())]  # no device is touched
    if wanted <= {'auto', 'cuda'}:
        gpus = [g for g in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if g.strip()]
        if 'CUDA_VISIBLE_DEVICES' not in os.environ:
            try:
                out = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True, timeout=30).stdout
                gpus = [str(i) for i, l in enumerate(l for l in out.splitlines() if l.startswith('GPU '))]
            except (OSError, subprocess.SubprocessError):
                gpus = []
        if gpus:
            return 'cuda', gpus
    return 'cpu', [str(c) for c in usable_cores()]


def this_host():
    """(index, count) of this host among the pod's for hosts_mode='share': the flags, else the environment
    (TPU_WORKER_ID or CLOUD_TPU_TASK_ID, TPU_WORKER_HOSTNAMES), else the TPU VM's metadata, else (0, 1).
    Sharing among several hosts with no index from any of them is refused: every host would run host 0's
    share."""
    index, count = host_index, num_hosts
    var = next((v for v in ('TPU_WORKER_ID', 'CLOUD_TPU_TASK_ID') if os.environ.get(v, '').strip()), None)
    if index < 0 and var:
        if not os.environ[var].strip().isdigit():
            raise SystemExit(f"config error: {var}={os.environ[var]!r} is not a host index (allowed: an "
                             "integer >= 0); set it right or give --host_index")
        index = int(os.environ[var])
    if count < 1 and os.environ.get('TPU_WORKER_HOSTNAMES'):
        count = len(os.environ['TPU_WORKER_HOSTNAMES'].split(','))
    if (index < 0 or count < 1) and os.environ.get('PJRT_DEVICE') == 'TPU':
        from torch_xla._internal import tpu  # the metadata server, as torch_xla asks it; no device is touched
        index = tpu.worker_id() if index < 0 else index
        count = tpu.num_tpu_workers() if count < 1 else count
    count = max(count, 1)
    if index < 0 and count > 1 and hosts_mode == 'share':
        raise SystemExit(f"config error: hosts_mode='share' over {count} hosts, but this host's index is "
                         "unknown (no --host_index, TPU_WORKER_ID, CLOUD_TPU_TASK_ID or TPU metadata): give "
                         f"each host its own --host_index (0 .. {count - 1})")
    index = max(index, 0)
    if index >= count:
        raise SystemExit(f"config error: host_index={index} with num_hosts={count} (allowed: 0 .. "
                         f"{count - 1})")
    return index, count


def slot_plans(kind, ids, n, hosts):
    """One dict per slot: label, environment (None: unset) and CPU cores (None: as study.py's). GPUs: nproc
    each (CUDA_VISIBLE_DEVICES). TPU: slots=1 every chip (with hosts_mode='share' on a pod, as a host of its
    own), or one chip per slot (libtpu's per-process variables); torch_xla starts one process per chip and
    cannot be told which chips each of one run's processes takes, so 2 .. chips-1 chips a run is refused.
    Cores are split between slots (affinity, and OMP_NUM_THREADS for runs that set no thread count)."""
    plans = [dict(label='', env={}, cores=None) for _ in range(n)]
    if kind == 'tpu':
        if n > 1 and n != len(ids):
            raise SystemExit(f"config error: slots={n} on a TPU host of {len(ids)} chip(s) (allowed: 1 or "
                             f"{len(ids)}: one chip per run)")
        for i, p in enumerate(plans if n > 1 else []):
            port = TPU_PORT + i
            p['env'] = dict(TPU_VISIBLE_CHIPS=str(i), TPU_CHIPS_PER_PROCESS_BOUNDS='1,1,1',
                            TPU_PROCESS_BOUNDS='1,1,1', TPU_PROCESS_PORT=str(port),
                            TPU_PROCESS_ADDRESSES=f'localhost:{port}', CLOUD_TPU_TASK_ID='0')
            p['label'] = f'TPU chip {i}'
        if n == 1 and hosts > 1:
            plans[0]['env'], plans[0]['label'] = \
                tpu_host_alone_env(), f'all {len(ids)} TPU chips of this host'
    elif kind == 'cuda' and n > 1:
        if n * nproc > len(ids):
            raise SystemExit(f"config error: slots={n} x nproc={nproc} GPUs, this host has {len(ids)} "
                             f"(allowed: slots x nproc <= {len(ids)})")
        for i, p in enumerate(plans):
            gpus = ids[i * nproc:(i + 1) * nproc]
            p['env'], p['label'] = dict(CUDA_VISIBLE_DEVICES=','.join(gpus)), f"GPU {','.join(gpus)}"
    if n > 1:
        cores = usable_cores()
        per = len(cores) // n
        for i, p in enumerate(plans):
            p['cores'] = cores[i * per:(i + 1) * per] if per else [cores[i % len(cores)]]
            if 'OMP_NUM_THREADS' not in os.environ:
                p['env']['OMP_NUM_THREADS'] = str(len(p['cores']))
            cpu = f"cpu {p['cores'][0]}" + (f"-{p['cores'][-1]}" if len(p['cores']) > 1 else '')
            p['label'] = f"{p['label']}, {cpu}" if p['label'] else cpu
    return plans


def run_flops(e, data=None):
    """A run's FLOPs, training and evaluation (None: unknown, or the model cannot be built)."""
    c = cost(e, data)
    return c['train_flops'] + c['eval_flops'] if c and 'error' not in c else None


def share_cost(e):
    """A run's FLOPs from its config and the datasets' known sizes only, never a local dataset.json: every
    host of a pod computes the same numbers, so the same partition."""
    return run_flops(e, dataset_for(e.cfg, e.meta, read_built=False))


def partition(names, costs, n):
    """Host of each run: longest first onto the least-loaded host (ties: the lower index, then the name), a
    fixed function of the list, so every host knows its share without talking to the others. Runs of unknown
    cost count as the mean of the known ones."""
    known = [c for c in costs if c is not None]
    costs = [c if c is not None else (sum(known) / len(known) if known else 1.0) for c in costs]
    load, host = [0.0] * n, [0] * len(names)
    for i in sorted(range(len(names)), key=lambda i: (-costs[i], natural_key(names[i]))):
        host[i] = min(range(n), key=lambda h: (load[h], h))
        load[host[i]] += costs[i]
    return host, load


def schedule(seconds, n):
    """List scheduling in the given order onto n slots (each run on the slot free first): (slot, start) of
    each, and the makespan."""
    free, out = [0.0] * n, []
    for t in seconds:
        s = min(range(n), key=lambda i: (free[i], i))
        out.append((s, free[s]))
        free[s] += t
    return out, max(free) if seconds else 0.0


def order_runs(runs, costs):
    """The order runs start in: the list's (names, naturally sorted) with one slot; longest first with more,
    which shortens the study (the results do not depend on the order)."""
    if slots == 1:
        return list(runs)
    return [r for _, r in sorted(zip(costs, runs), key=lambda x: (-(x[0] or 0), natural_key(x[1].run)))]


def my_runs(runs):
    """(the runs this host runs, this host's index, host count, host of every run)."""
    if hosts_mode == 'all':
        return runs, 0, 1, [0] * len(runs)
    index, count = this_host()
    host, _ = partition([e.run for e in runs], [share_cost(e) for e in runs], count)
    return [e for e, h in zip(runs, host) if h == index], index, count, host


# -----------------------------------------------------------------------------
# listing and dry run

def print_families(names):
    fams = {}
    for n in names:
        fams.setdefault(n.rsplit('_', 1)[0], []).append(n.rsplit('_', 1)[1])
    print(f"{len(names)} experiments in {config_dir}, by family (select with --pattern='<family>_*'):")
    for f, pts in fams.items():
        print(f"  {f + '_*':<14} {' '.join(pts)}")
    print("\npython study.py --pattern='rec_*' --dry_run=True     commands and costs\n"
          "python study.py --pattern='rec_*,tn_*' --scale=cpu  run (a CPU smoke twin), then --report=True\n"
          "python study.py --help                            every key, the scales, the design")


def print_list(exps):
    for e in exps:
        where = f"same run as {e.same_as}" if e.same_as else state(e)
        print(f"{e.run:<16} {e.family:<10} {e.varied_text():<52} {e.out_dir}  [{where}]")


def print_dry_run(exps):
    rate, why = flop_rate()
    print(f"scale {scale}: {len(exps)} experiment(s), {sum(not e.same_as for e in exps)} run(s) | {why}\n")
    total = dict(train=0.0, eval=0.0, time=0.0, runs=0)
    flops = {}
    for e in exps:
        head = f"{e.run}  [{e.family}: {e.varied_text()}]  -> {e.out_dir}"
        if e.same_as:
            print(f"{head}\n  same run as {e.same_as} (shared out_dir): counted once\n")
            continue
        print(head)
        print(f"  {e.display}")
        d = e.data
        built = 'built' if d['exists'] else ('missing; built first by: ' + build_display(d['build'])
                                             if d['build']
                                             else 'MISSING, and no rule builds it')
        print(f"  data {d['path']}: {built}")
        c = cost(e)
        if c is None:
            print("  cost: unknown until the dataset is built (its size is not known before)\n")
            continue
        if 'error' in c:
            print(f"  cost: the model cannot be built: {c['error']}\n")
            continue
        flops[e.run] = c['train_flops'] + c['eval_flops']
        t = flops[e.run] / rate / nproc if rate else None
        print(f"  {c['params']:,} parameters | {c['fpe'] / 1e9:.3g} GFLOPs per example-step | {c['steps']:,} "
              f"steps x batch {c['batch']} = {c['steps'] * c['batch']:,} examples | training "
              f"{c['train_flops']:.3g} FLOPs | {c['evals']} evaluation(s) {c['eval_flops']:.3g} FLOPs"
              + (f" | about {duration(t)}" + (f" on {nproc} processes" if nproc > 1 else '') if t else ''))
        print()
        total['train'] += c['train_flops']
        total['eval'] += c['eval_flops']
        total['time'] += t or 0
        total['runs'] += 1
    print(f"total: {total['runs']} costed run(s), training {total['train']:.3g} FLOPs, evaluation "
          f"{total['eval']:.3g} FLOPs"
          + (f", about {duration(total['time'])}" if rate else " (no time estimate)"))
    print_plan([e for e in exps if not e.same_as], flops, rate)


def print_plan(runs, flops, rate):
    """Which host and slot runs what, and the study's wall time under each mode, from the runs' FLOPs at the
    device's rate (a run on d devices takes FLOPs / (d x rate): perfect scaling, so a lower bound)."""
    kind, ids = host_devices(runs)
    index, hosts = this_host()
    share = hosts_mode == 'share'
    plans = slot_plans(kind, ids, slots, hosts if share else 1)
    per_host = len(ids) if kind in ('tpu', 'cuda') else nproc  # devices one host gives a run
    per_slot = max(1, per_host // slots) if kind == 'tpu' else nproc
    mean = sum(flops.values()) / len(flops) if flops else 1.0
    secs = lambda e, d: flops.get(e.run, mean) / (rate * d) if rate else 0.0

    def on_host(host_of, h):  # (its runs in starting order, (slot, start) of each, its wall time)
        mine = [e for e, x in zip(runs, host_of) if x == h]
        mine = order_runs(mine, [flops.get(e.run) for e in mine])
        return (mine, *schedule([secs(e, per_slot) for e in mine], slots))

    by_share = partition([e.run for e in runs], [share_cost(e) for e in runs], hosts)[0]
    shown = by_share if share else [0] * len(runs)
    print(f"\nplan: {len(runs)} run(s), hosts_mode={hosts_mode}, {hosts} host(s)"
          + (f" (this is host {index})" if share else '') + f", {slots} slot(s) a host; this host's devices: "
          f"{len(ids)} {dict(tpu='TPU chip(s)', cuda='GPU(s)', cpu='CPU core(s)')[kind]}")
    for h in range(hosts if share else 1):
        mine, placed, _ = on_host(shown, h)
        for e, (s, start) in zip(mine, placed):
            when = f"  starts about {duration(start)}, ends about {duration(start + secs(e, per_slot))}" \
                if rate else ''
            label = f" ({plans[s]['label']})" if plans[s]['label'] else ''
            print(f"  host {h} slot {s}{label}: {e.run}{when}")
    if not rate:
        print("wall time: no estimate without a speed figure (--examples_per_s or --bench_file)")
        return
    pod = per_host * hosts if kind == 'tpu' else nproc
    print(f"wall time of the study (estimates; a run on d devices: its FLOPs / (d x {rate / 1e12:.3g} "
          f"TFLOP/s)):\n  sequential, each run on {pod} device(s) (hosts_mode=all, slots=1): "
          f"{duration(sum(secs(e, pod) for e in runs))}\n"
          f"  slots={slots} on one host, {per_slot} device(s) a run: "
          f"{duration(on_host([0] * len(runs), 0)[2])}\n  hosts_mode=share, {hosts} host(s) x {slots} "
          f"slot(s): {duration(max(on_host(by_share, h)[2] for h in range(hosts)))}")


# -----------------------------------------------------------------------------
# running

def on_signal(signum, frame):
    STOP['requested'] = True
    children = [p for p in STOP['children'] if p.poll() is None]
    print(f"\nstudy: got signal {signum}; "
          + (f"asking the {len(children)} running process(es) to save and stop"
                                               if children else "stopping"), flush=True)
    for p in children:
        try:
            p.send_signal(signal.SIGTERM)  # train.py saves a checkpoint and exits; a second stops it at once
        except ProcessLookupError:
            pass


def _child_setup(parent, cores=None):
    """In the child before exec: die with study.py (the kernel sends SIGTERM when it goes, even on SIGKILL),
    so an orphaned train.py saves and stops instead of running on beside a rerun; then its slot's cores."""
    try:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, cores)


def _libc():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True)
    except Exception:
        return None


_LIBC = _libc()  # looked up once, here: a child between fork and exec only calls it


def child_env(extra):
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_process(cmd, log_path, env_extra=None, display=None):
    """Runs `python cmd...`, its output streamed here and appended to log_path; (exit code, last lines, its
    error: Running.error)."""
    sys.stdout.flush()
    r = Running(cmd, log_path, display or build_display(cmd), env_extra)
    while (got := r.pump(echo=True)) != 'eof':
        if not got:  # nothing written yet
            time.sleep(0.05)
    return r.close() + (r.error(),)


class Running:
    """One child process of the study (a train.py run, or a dataset build): its process, its log (appended
    to), its last lines, the last lines of its stderr (where its error is) and latest progress line; for a
    run, its experiment e and slot."""

    def __init__(self, cmd, log_path, display, env=None, cores=None, e=None, slot=None):
        self.e, self.slot, self.t0 = e, slot, time.time()
        self.tail, self.errors, self.progress, self.last_eval = deque(maxlen=30), deque(maxlen=60), '', ''
        os.makedirs(os.path.dirname(log_path) or '.', exist_ok=True)
        self.log = open(log_path, 'ab')
        self.log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {display}\n".encode())
        parent = os.getpid()
        self.p = subprocess.Popen([sys.executable] + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=child_env(env), start_new_session=True,
                                  preexec_fn=lambda: _child_setup(parent, cores))
        self.bufs = {self.p.stdout.fileno(): b'', self.p.stderr.fileno(): b''}  # open pipes: unfinished line
        for fd in self.bufs:
            os.set_blocking(fd, False)
        STOP['children'].add(self.p)

    def pump(self, echo):
        """Takes what the process wrote (stdout and stderr): into its log, and here when echo. 'eof' at the
        end of its output, '' when nothing is waiting, else 'more'."""
        got = ''
        for fd in list(self.bufs):
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if echo and chunk:
                try:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                except (OSError, ValueError):  # the reader of study.py's stdout is gone
                    sys.stdout.lost()
            self.log.write(chunk)
            self.log.flush()
            *lines, rest = (self.bufs[fd] + chunk).split(b'\n') if chunk else [self.bufs[fd], b'']
            if chunk:
                self.bufs[fd], got = rest, 'more'
            else:
                del self.bufs[fd]
            for raw in lines:
                line = raw.decode(errors='replace').rstrip()
                if line.strip():
                    self.tail.append(line)
                    if fd == self.p.stderr.fileno():
                        self.errors.append(line)
                if line.startswith('step '):
                    self.progress = line
                elif line.startswith('eval on'):
                    self.last_eval = line
        return got or ('' if self.bufs else 'eof')

    def error(self):
        """The process's error: the last line it wrote to stderr that is not a warning, a traceback's frame
        or torchrun's report around it (a SystemExit's message, a traceback's last line); '' if none."""
        skip = re.compile(r'\s|[=\-\[*]|Traceback \(|During handling|The above exception|Root Cause|'
                          r'Failures:|.*ChildFailedError|.*\w+ FAILED$|.*\w*Warning: |[WIEF]\d{4} ')
        return next((l for l in reversed(self.errors) if not skip.match(l)), '')

    def close(self):
        rc = self.p.wait()
        STOP['children'].discard(self.p)
        self.p.stdout.close()
        self.p.stderr.close()
        self.log.close()
        return rc, list(self.tail)


def lock_study():
    """One study at a time into an out_root: a lock file in its local folder (host, pid), taken over when its
    study is gone (this host's pid ended, or the host restarted), removed at exit."""
    path = os.path.join(LOCAL_ROOT, STUDY_LOCK)
    for attempt in range(2):
        try:
            os.makedirs(LOCAL_ROOT, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                rec = None
            if attempt == 0 and holder_gone(rec):
                print(f"study: taking over {path}, the lock of a study that is gone (on {rec.get('host')}, "
                      f"pid {rec.get('pid')}, since {rec.get('since')})")
                os.remove(path)
                continue
            who = f"the study on {rec.get('host')}, pid {rec.get('pid')}, since {rec.get('since')}" \
                if isinstance(rec, dict) else 'a study whose lock cannot be read'
            raise SystemExit(f"{ROOT} is in use by {who} (lock {path}): wait for it to end, use another "
                             "--out_root, or remove the lock if that study is gone")
        except OSError as ex:
            raise SystemExit(f"cannot create the lock {path}: {ex.strerror}; out_root must be a folder this "
                             "study can write")
        with os.fdopen(fd, 'w') as f:
            json.dump(lock_record(), f)
        atexit.register(lambda: os.path.exists(path) and os.remove(path))
        return


def run_study(exps):
    lock_study()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    runs = [e for e in exps if not e.same_as]
    mine, index, hosts, host_of = my_runs(runs)
    if os.environ.get('PJRT_DEVICE') == 'TPU' and not gcs.is_gcs(ROOT) and hosts_mode == 'all':
        print(f"warning: PJRT_DEVICE=TPU and out_root {ROOT} is local: on a pod use "
              "--out_root=gs://BUCKET/...")
    if hosts_mode == 'share' and hosts > 1 and not gcs.is_gcs(ROOT):
        print(f"warning: out_root {ROOT} is local: each host's results stay on it (--out_root=gs://... shows "
              "all)")
    kind, ids = host_devices(mine)
    plans = slot_plans(kind, ids, slots, hosts if hosts_mode == 'share' else 1)
    status, t_study = {}, time.time()
    for e, h in zip(runs, host_of):
        if h != index:
            status[e.run] = (f"on host {h}", None)
    todo = []
    for e in mine:
        why = read_results(e)[1] if has_results(e) else None
        if why is None:
            todo.append(e)
        elif why:  # neither reused nor trained over: said here and in the summary
            status[e.run] = ('NOT REUSED', why)
            print(f"study: {e.run}: {why}")
        else:
            status[e.run] = ('done before', None)
    where = f"host {index} of {hosts}: {len(mine)} of the " if hosts_mode == 'share' else ''
    print(f"study: scale {scale}, {len(exps)} experiment(s), {where}{len(runs)} run(s): "
          f"{len(mine) - len(todo)} finished before, {len(todo)} to run, in {ROOT}"
          + (f"; {slots} at once on {kind} "
             f"({', '.join(p['label'] for p in plans)})" if slots > 1 else ''))
    failed_data = build_datasets(todo)
    todo = order_runs(todo, [run_flops(e) for e in todo])
    run_slots(todo, plans, status, failed_data)
    print(f"\nstudy: summary ({duration(time.time() - t_study)}):")
    for e in exps:
        s, why = status.get(e.same_as or e.run, ('?', None))
        if e.same_as:
            s, why = s, f"same run as {e.same_as}"
        print(f"  {e.run:<16} {s:<18} {why or ''}")
    bad = [n for n, (s, _) in status.items() if s not in ('done',
                                                          'done before') and not s.startswith('on host')]
    if STOP['requested']:
        print("study: stopped; rerun the same command to continue (finished runs are skipped, started ones "
              "resume)")
    elif bad:
        print(f"study: {len(bad)} run(s) did not finish: {', '.join(bad)}")
    return 1 if bad or STOP['requested'] else 0


def build_datasets(todo):
    """Builds the missing datasets of the runs to do, in turn; {path: why it failed}."""
    failed_data = {}
    if not build_data:
        return failed_data
    wanted = []
    for e in todo:
        if not e.data['exists'] and e.data['path'] not in wanted:
            wanted.append(e.data['path'])
    for path in wanted:
        if STOP['requested']:
            break
        d = next(e.data for e in todo if e.data['path'] == path)
        if d['build'] is None:
            failed_data[path] = f"dataset {path} is missing and no rule builds it (set _prepare in the file)"
            continue
        print(f"\nstudy: building {path}: {build_display(d['build'])}", flush=True)
        rc, tail, _ = run_process(d['build'], os.path.join(LOCAL_ROOT, 'datasets.log'))
        if not all(os.path.exists(os.path.join(path, s, 'dataset.json')) for s in ('train', 'test')):
            failed_data[path] = f"building dataset {path} failed (exit code {rc}): {tail[-1] if tail else ''}"
            print(f"study: {failed_data[path]}")
    return failed_data


def run_slots(todo, plans, status, failed_data):
    """Runs `todo` in order, len(plans) at once, each on the first free slot. One slot: the run's output
    streams here as it comes; more: a status line per running run every status_every seconds, and a line when
    one starts or ends (each run's whole output is in its train.log)."""
    queue, running, free = list(todo), [], list(range(len(plans)))
    echo, last_status = len(plans) == 1, time.time()
    while queue or running:
        while queue and free and not STOP['requested']:
            # a missing dataset does not skip the run: train.py then fails at start-up on every rank together,
            # so on a pod every host goes through the same sequence even if only one host's build failed
            e, slot = queue.pop(0), free.pop(0)
            steps = checkpoint_steps(e)
            on = f" on slot {slot} ({plans[slot]['label']})" if not echo else ''
            print(f"\nstudy: {e.run} [{e.varied_text()}]: "
                  + (f"resuming from its checkpoint at step {steps[-1]}" if steps else "starting") + on
                  + f"\n  {e.display}", flush=True)
            running.append(Running(e.cmd, os.path.join(e.local, 'train.log'), e.display,
                                   {**plans[slot]['env'], **e.env}, plans[slot]['cores'], e, slot))
        if STOP['requested']:
            for e in queue:
                status.setdefault(e.run, ('not run (stopped)', None))
            queue = []
        for r in list(running):
            got = r.pump(echo)
            while got == 'more':
                got = r.pump(echo)
            if got == 'eof':
                running.remove(r)
                free = sorted(free + [r.slot])
                finished(r, status, failed_data)
        if not echo and running and time.time() - last_status >= status_every:
            last_status = time.time()
            print(f"study: {time.strftime('%H:%M:%S')}, {len(running)} running, {len(queue)} waiting:",
                  flush=True)
            for r in sorted(running, key=lambda r: r.slot):
                print(f"  {r.e.run:<16} slot {r.slot} {duration(time.time() - r.t0):>8}  "
                      f"{(r.progress or 'starting')[:90]}"
                      + (f" | last {r.last_eval[:40]}" if r.last_eval else ''),
                      flush=True)
        time.sleep(0.05 if echo else 0.2)


def finished(r, status, failed_data):
    e = r.e
    rc, _ = r.close()
    took = time.time() - r.t0
    if has_results(e):
        status[e.run] = ('done', f"in {duration(took)}")
    elif STOP['requested']:
        status[e.run] = ('stopped', f"checkpoint saved; rerun to continue ({duration(took)})")
    else:  # its error, not its last line (a board, a step line)
        why, err = f"exit code {rc}", r.error()[:300]
        if rc == 0:
            why += f", but no results.json in {e.out_dir}"
        elif rc < 0 and -rc in signal.valid_signals():
            why += f" (killed by {signal.Signals(-rc).name})"
        elif not err:
            why += ", with no error message"
        why = f"{failed_data[e.data['path']]}; " if e.data['path'] in failed_data else \
            why + (f": {err} " if err else ' ')
        status[e.run] = ('FAILED', f"{why}(log: {os.path.join(e.local, 'train.log')})")
    print(f"study: {e.run}: {status[e.run][0]}" + (f" {status[e.run][1]}" if status[e.run][1] else ''),
          flush=True)


# -----------------------------------------------------------------------------
# test-time views and steps: finished runs evaluated again (--eval_only)

EVAL_FILE = re.compile(r'views(\d+)-steps(\d+)\.json')  # train.py --eval_only's record in <out_dir>/evals


def own_steps(e):
    """The supervision steps a run evaluates by itself (train.py: eval_steps, else halt_max_steps)."""
    return e.run_cfg['eval_steps'] or e.run_cfg['halt_max_steps']


def saved_evals(e):
    """{(views, steps): local path} of a run's saved re-evaluations, from its folder and, for a gs:// run, its
    bucket (downloaded beside the local copies)."""
    if gcs.is_gcs(e.out_dir):
        try:
            names = [uri.rsplit('/', 1)[1] for uri, _ in gcs.list_objects(f"{e.out_dir}/evals/")]
        except Exception as ex:  # an unreachable bucket: the local copies, if any
            print(f"warning: cannot list {e.out_dir}/evals ({ex}); the local copies are used, if any")
            names = []
        for n in filter(EVAL_FILE.fullmatch, names):
            fetch(e, f"evals/{n}")
    folder = os.path.join(e.local, 'evals')
    found = {}
    for n in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if m := EVAL_FILE.fullmatch(n):
            found[int(m[1]), int(m[2])] = os.path.join(folder, n)
    return found


def run_evals(exps):
    """--eval_only: every finished run whose results.json the study reuses is evaluated again, once per
    eval_steps S, in K = max(eval_views) views (its first k views are a k-view evaluation, so one run gives
    every k): its command plus --eval_only=True --eval_views=K --eval_steps=S (with --init_from=resume: the
    newest checkpoint), which saves <out_dir>/evals/views{K}-steps{S}.json. Skipped when a file of S with K
    views or more is there; unfinished runs are listed as skipped with their state. In turn, one at a time
    (--slots does not apply). The exit code: 1 if an evaluation failed or the study was stopped."""
    lock_study()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    K, t_study = VIEWS[-1], time.time()
    mine = my_runs([e for e in exps if not e.same_as])[0]
    todo, summary = [], []  # summary: (run, steps, status, detail)
    for e in mine:
        if not has_results(e):
            summary.append((e.run, '', 'skipped', f"not finished ({state(e)}): train it first (study.py "
                                                  "without --eval_only)"))
            continue
        why = read_results(e)[1]
        if why:
            summary.append((e.run, '', 'skipped', f"NOT REUSED: {why}"))
            continue
        have = saved_evals(e)
        for S in dict.fromkeys(s or own_steps(e) for s in STEPS):
            more = [k for k, s in have if s == S and k >= K]
            if more:
                summary.append((e.run, S, 'done before', have[max(more), S]))
            else:
                todo.append((e, S))
    print(f"study: scale {scale}, test-time evaluation of {len(mine)} run(s) in {K} view(s) (k = "
          f"{', '.join(map(str, VIEWS))}) at steps {', '.join(str(s) if s else 'own' for s in STEPS)}: "
          f"{sum(s == 'done before' for _, _, s, _ in summary)} done before, {len(todo)} to run, in {ROOT}")
    for e, S in todo:
        if STOP['requested']:
            summary.append((e.run, S, 'not run (stopped)', ''))
            continue
        flags = ['--eval_only=True', f'--eval_views={K}', f'--eval_steps={S}']
        display = ' '.join([e.display] + flags)
        print(f"\nstudy: {e.run} [{e.varied_text()}]: evaluating in {K} view(s) at {S} steps\n  {display}",
              flush=True)
        t, path = time.time(), os.path.join(e.local, 'evals', f"views{K}-steps{S}.json")
        rc, _, err = run_process(e.cmd + flags, os.path.join(e.local, 'evals.log'), e.env, display)
        err = err[:300]
        if os.path.exists(path):
            summary.append((e.run, S, 'done', f"in {duration(time.time() - t)}: {path}"))
        elif STOP['requested']:
            summary.append((e.run, S, 'stopped', 'rerun to evaluate it'))
        else:
            why = f"exit code {rc}" + (f": {err}" if err else f", but no {path}" if rc == 0 else '')
            summary.append((e.run, S, 'FAILED', f"{why} (log: {os.path.join(e.local, 'evals.log')})"))
    print(f"\nstudy: summary of the test-time evaluations ({duration(time.time() - t_study)}):")
    for run, S, st, detail in summary:
        print(f"  {run:<16} {f'steps {S}' if S else '':<10} {st:<18} {detail}")
    bad = [f"{run} (steps {S})" for run, S, st, _ in summary if st in ('FAILED', 'stopped', 'not run (stopped)')]
    if STOP['requested']:
        print("study: stopped; rerun the same command to continue (saved evaluations are skipped)")
    elif bad:
        print(f"study: {len(bad)} evaluation(s) failed: {', '.join(bad)}")
    return 1 if bad or STOP['requested'] else 0


# -----------------------------------------------------------------------------
# report

def timed_minutes(metrics_path, batch):
    """Minutes of training and evaluation recorded in metrics.jsonl: each train line covers (step - previous
    step) x batch / examples_per_s seconds since the previous one (evaluations in between included), plus the
    final evaluation; start-up time is not in it. None when there is nothing to add."""
    try:
        with open(metrics_path) as f:
            lines = [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError):
        return None
    total, prev, last_train = 0.0, 0, None
    for l in lines:
        if l.get('kind') == 'train' and l.get('examples_per_s'):
            total += (l['step'] - prev) * batch / l['examples_per_s']
            prev, last_train = l['step'], l
    if last_train is None:
        return None
    final = [l for l in lines if l.get('kind') == 'eval' and l['step'] == last_train['step']]
    if final:
        total += max(0.0, final[-1]['time'] - last_train['time'])
    return total / 60


def collect(exps):
    rows = []
    for e in exps:
        r = dict(name=e.name, run=e.run, seed=e.seed, family=e.family, point=e.point(),
                 varied=e.varied_text(),
                 out_dir=e.out_dir, lr=e.run_cfg['lr'], global_batch_size=e.run_cfg['global_batch_size'],
                 H_cycles=e.run_cfg['H_cycles'], L_cycles=e.run_cfg['L_cycles'],
                 hidden_size=e.run_cfg['hidden_size'], L_layers=e.run_cfg['L_layers'],
                 puzzles=e.data['puzzles'], aug=e.data['aug'], status='not started')
        res, why = read_results(e)
        if res:
            fe, be = res['final_eval'], res.get('best_eval') or {}
            cfg = res.get('config', {})
            r.update(status='done', params=res['parameters'], train_flops=res['train_flops'],
                     flops_per_example_step=res['flops_per_example_step'], steps=res.get('step'),
                     examples=res.get('examples_seen'), exact=fe['exact_accuracy'],
                     exact_ci_low=fe['exact_ci_low'],
                     exact_ci_high=fe['exact_ci_high'], verified=fe.get('verified_accuracy'),
                     token=fe['token_accuracy'], q_halt=fe['q_halt_accuracy'], test_count=fe.get('count'),
                     best_exact=be.get('exact_accuracy'), best_step=be.get('step'), device=res.get('device'),
                     exact_by_steps=fe.get('exact_by_steps') or [], halt_max_steps=cfg.get('halt_max_steps'),
                     H_cycles=cfg.get('H_cycles', r['H_cycles']), L_cycles=cfg.get('L_cycles', r['L_cycles']))
            wall = res.get('wall_s') or {}  # results.json of runs before it was recorded: none
            r.update(device_hours=res.get('device_hours'), world_size=res.get('world_size'),
                     **{f'wall_s_{k}': wall.get(k) for k in ('total', 'startup', 'train', 'eval')})
            m = fetch(e, 'metrics.jsonl')
            r['minutes'] = timed_minutes(m,
                                         cfg.get('global_batch_size',
                                                 e.run_cfg['global_batch_size'])) if m else None
        else:
            steps = checkpoint_steps(e)
            if steps:
                r['status'] = f"started (step {steps[-1]})"
            c = cost(e)
            if c and 'error' not in c:
                r.update(params=c['params'], train_flops=c['train_flops'], steps=c['steps'])
            if why:  # its numbers are not this configuration's, or cannot be read: not shown as done
                r.update(not_used=why, status=('unreadable results.json' if why.startswith('unreadable') else
                                               'not used: results.json of another configuration'))
        rows.append(r)
    return rows


def pct(x):
    return '' if x is None else f"{100 * x:.1f}"


def points(rows):
    """One row per experiment: with one seed its run's row, bars its 95% Wilson interval; with more, the mean
    of its finished seeds (exact, device-hours), bars their min-max, std and the per-seed values beside."""
    out = []
    for name in dict.fromkeys(r['name'] for r in rows):
        group = [r for r in rows if r['name'] == name]
        done = [r for r in group if r['status'] == 'done']
        p = dict(done[0] if done else group[0])
        if seeds == 1:
            if done:
                p.update(bar_lo=p['exact_ci_low'], bar_hi=p['exact_ci_high'])
            out.append(p)
            continue
        vals = [r['exact'] for r in done]
        p.update(seeds_done=len(done), per_seed=vals,
                 status='done' if done else group[0]['status'])
        if done:
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
            hours = [r['device_hours'] for r in done if r.get('device_hours') is not None]
            p.update(exact=mean, exact_std=std, bar_lo=min(vals), bar_hi=max(vals),
                     device_hours=sum(hours) / len(hours) if hours else None)
        out.append(p)
    return out


def seed_stats(rows):
    """{name: (mean, std, min, max, finished seeds)} of the exact accuracy over each experiment's seeds."""
    stats = {}
    for p in points(rows) if seeds > 1 else []:
        if p.get('seeds_done'):
            stats[p['name']] = (p['exact'], p['exact_std'], p['bar_lo'], p['bar_hi'], p['seeds_done'])
    for r in rows if seeds == 1 else []:
        if r['status'] == 'done':
            stats[r['name']] = (r['exact'], 0.0, r['exact'], r['exact'], 1)
    return stats


def write_tables(rows, folder, views=()):
    os.makedirs(folder, exist_ok=True)
    md = [f"# Study report: scale {scale}, {ROOT}\n"]
    if seeds == 1:
        head = ['name', 'family', 'varied', 'params', 'train FLOPs', 'steps', 'exact % (95% CI)',
                'verified %',
                'token %', 'best exact % (step)', 'minutes', 'device-h', 'status']
        md += ["Held-out exact accuracy after the final evaluation (95% Wilson interval), on every test "
               "puzzle. minutes: training and evaluations, from metrics.jsonl (start-up excluded). device-h: "
               "the run's wall time (start-up, training, evaluations) x its devices, from results.json.\n",
               '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
        for r in rows:
            done = r['status'] == 'done'
            md.append('| ' + ' | '.join([
                r['name'], r['family'], r['varied'], f"{r['params']:,}" if r.get('params') else '',
                f"{r['train_flops']:.3g}" if r.get('train_flops') else '',
                f"{r['steps']:,}" if r.get('steps') else '',
                f"{pct(r['exact'])} ({pct(r['exact_ci_low'])}-{pct(r['exact_ci_high'])})" if done else '',
                pct(r.get('verified')) if done else '', pct(r.get('token')) if done else '',
                f"{pct(r['best_exact'])} ({r['best_step']})" if done and r.get('best_exact') is not None
                else '',
                f"{r['minutes']:.1f}" if r.get('minutes') is not None else '',
                f"{r['device_hours']:.3g}" if r.get('device_hours') is not None else '', r['status']]) + ' |')
    else:
        head = ['name', 'family', 'varied', 'params', 'train FLOPs', 'steps',
                'exact %: mean ± std (min-max)', 'seeds done', 'exact % per seed (0, 1, ...)',
                'device-h (mean)', 'status']
        md += [f"Held-out exact accuracy after the final evaluation, over {seeds} seeds per experiment (seed "
               "s > 0 in <out_dir>-s<s>): mean, sample standard deviation and min-max of the finished seeds. "
               f"report.csv has one row per seed run.\n", '| ' + ' | '.join(head) + ' |',
               '|' + '---|' * len(head)]
        for p in points(rows):
            done = bool(p.get('seeds_done'))
            md.append('| ' + ' | '.join([
                p['name'], p['family'], p['varied'], f"{p['params']:,}" if p.get('params') else '',
                f"{p['train_flops']:.3g}" if p.get('train_flops') else '',
                f"{p['steps']:,}" if p.get('steps') else '',
                f"{pct(p['exact'])} ± {pct(p['exact_std'])} ({pct(p['bar_lo'])}-{pct(p['bar_hi'])})" if done
                else '',
                f"{p['seeds_done']}/{seeds}", ', '.join(pct(v) for v in p['per_seed']),
                f"{p['device_hours']:.3g}" if p.get('device_hours') is not None else '', p['status']]) + ' |')
    md += fits_section(rows)
    md += views_section(views)
    md += [f"\nCurves: `tensorboard --logdir {ROOT}` shows every run's training, evaluation, speed and XLA "
           "scalars (each run as <name>/tb; TensorBoard reads a gs:// folder as well).\n"]
    with open(os.path.join(folder, 'report.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')
    write_csv(rows, folder)
    if views:
        write_views_csv(views, folder)
    return '\n'.join(md)


def write_csv(rows, folder):
    """report.csv: one row per run (one per seed), its experiment's statistics over seeds repeated on each."""
    cols = ['name', 'seed', 'run', 'family', 'point', 'varied', 'status', 'out_dir', 'params',
            'flops_per_example_step',
            'train_flops', 'steps', 'examples', 'exact', 'exact_ci_low', 'exact_ci_high', 'verified', 'token',
            'q_halt', 'best_exact', 'best_step', 'minutes', 'test_count', 'hidden_size', 'L_layers',
            'H_cycles',
            'L_cycles', 'puzzles', 'aug', 'lr', 'global_batch_size', 'device', 'world_size', 'wall_s_total',
            'wall_s_startup', 'wall_s_train', 'wall_s_eval', 'device_hours', 'exact_mean', 'exact_std',
            'exact_min',
            'exact_max', 'seeds_done']
    stats = seed_stats(rows)
    with open(os.path.join(folder, 'report.csv'), 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            r = dict(r, **dict(zip(cols[-5:], stats.get(r['name'], [None] * 5))))
            w.writerow(['' if r.get(c) is None else r.get(c) for c in cols])


# -----------------------------------------------------------------------------
# test-time compute: accuracy against views and steps (the runs' evals/views{K}-steps{S}.json)

VIEW_COLS = ['run', 'family', 'point', 'views', 'steps', 'halt_max_steps', 'vote', 'verified',
             'oracle', 'accepted', 'vote_q_halt', 'verified_q_halt', 'oracle_q_halt', 'accepted_q_halt',
             'flops_per_puzzle', 'forward_flops_per_step', 'seconds', 'eval_views', 'checkpoint_step',
             'test_count', 'file']


def collect_views(exps):
    """One row per (run, steps S, views k) of the saved re-evaluations of the runs the report uses: for each
    S the file with the most views K (its first k views are a k-view evaluation). The accuracies at k are
    the by_views entry of k (K = 1: view 0's exact accuracy, which vote, verified and oracle all are with one
    view); flops_per_puzzle = the evaluation's forward FLOPs / puzzles x k / K = k x S x forward FLOPs per
    step; seconds: the whole K-view evaluation's."""
    rows = []
    for e in exps:
        if e.same_as or read_results(e)[0] is None:  # unfinished or not reused: not compared
            continue
        best = {}
        for (K, S), path in saved_evals(e).items():
            if K >= best.get(S, (0, None))[0]:
                best[S] = (K, path)
        for S, (K, path) in sorted(best.items()):
            try:
                with open(path) as f:
                    rec = json.load(f)
                res = rec['eval']
                n = float(res['count'])
                per_view = float(res['eval_flops']) / max(n, 1) / K
                by = res.get('by_views') or [dict(
                    views=1, vote=res['exact_accuracy'], verified=res['exact_accuracy'],
                    oracle=res['exact_accuracy'], accepted=res.get('verified_accuracy'),
                    **{m + '_q_halt': res['exact_accuracy_q_halt'] for m in ('vote', 'verified', 'oracle')})]
                for v in by:
                    k = int(v['views'])
                    rows.append(dict(
                        run=e.run, family=e.family, point=e.point(), views=k, steps=S,
                        halt_max_steps=int(rec['config']['halt_max_steps']),
                        **{m: v.get(m) for m in VIEW_COLS[6:14]},
                        flops_per_puzzle=per_view * k, forward_flops_per_step=per_view / S,
                        seconds=rec.get('seconds'), eval_views=K, checkpoint_step=rec.get('step'),
                        test_count=int(n), file=path))
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as ex:
                print(f"report: {path} cannot be read ({type(ex).__name__}: {ex}); left out")
    return rows


def views_section(views):
    """report.md's test-time compute table."""
    if not views:
        return []
    lines = ["\n## Test-time compute: views and supervision steps\n",
             "Each finished run evaluated again (`--eval_only=True`) on every test puzzle in k views (view 0 "
             "the puzzle, the others seeded symmetries of it) for S supervision steps. vote@k: the answer most "
             "views agree on; verified@k: an answer the verifier accepts where a view found one, else the "
             "vote; oracle@k: any view right (the ceiling). These are scored after the last of the S steps; "
             "the q_halt columns take each view's answer where its q_halt stopped it, "
             "within the S steps. FLOPs per puzzle: k x S x forward FLOPs per step (what the evaluation ran); "
             "seconds: the whole evaluation in the most views (all k at once). report_views.csv has every "
             "column (accepted@k too).\n",
             "| run | views k | steps S | vote@k % | verified@k % | oracle@k % | q_halt stop: "
             "vote / verified / oracle % | eval FLOPs per puzzle | seconds |", '|' + '---|' * 9]
    for r in views:
        lines.append('| ' + ' | '.join([
            r['run'], str(r['views']), str(r['steps']), pct(r['vote']),
            pct(r['verified']), pct(r['oracle']),
            ' / '.join(pct(r[m + '_q_halt']) for m in ('vote', 'verified', 'oracle')),
            f"{r['flops_per_puzzle']:.3g}", '' if r['seconds'] is None else f"{r['seconds']:.1f}"]) + ' |')
    return lines


def write_views_csv(views, folder):
    with open(os.path.join(folder, 'report_views.csv'), 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(VIEW_COLS)
        for r in views:
            w.writerow(['' if r.get(c) is None else r[c] for c in VIEW_COLS])


def plot_views(plt, views):
    """acc_vs_test_compute.png: per family, accuracy against test-time FLOPs per puzzle (log), one colour per
    run, one marker per S, points labelled by k; verified@k solid, vote@k dashed, oracle@k dotted and
    lighter. Left: the answers after the last of the S steps; right: each view's answer where q_halt stopped
    it; both at the FLOPs of the S steps run (k x S x forward)."""
    if not views:
        return None
    from matplotlib.lines import Line2D
    fams = list(dict.fromkeys(r['family'] for r in views))
    fig, axes = plt.subplots(len(fams), 2, figsize=(14, 5.5 * len(fams)), squeeze=False)
    markers = 'osD^v<>p*h'
    for (left, right), f in zip(axes, fams):
        runs = list(dict.fromkeys(r['run'] for r in views if r['family'] == f))
        steps = sorted({r['steps'] for r in views if r['family'] == f})
        colors = {run: plt.get_cmap('tab10')(i % 10) for i, run in enumerate(runs)}
        for ax, suffix in ((left, ''), (right, '_q_halt')):
            placed, ys_all = set(), []  # label cells taken (log x, y): one k label a cell, the rest crowd
            for run in runs:
                for S in steps:
                    pts = sorted((r for r in views if r['run'] == run and r['steps'] == S), key=lambda r: r['views'])
                    if not pts:
                        continue
                    xs = [r['flops_per_puzzle'] for r in pts]
                    mk, c = markers[steps.index(S) % len(markers)], colors[run]
                    for m, ls, alpha in (('verified', '-', 1.0), ('vote', '--', 0.9), ('oracle', ':', 0.5)):
                        ys = [100 * r[m + suffix] for r in pts]
                        ys_all += ys
                        ax.plot(xs, ys, ls=ls, marker=mk, color=c, alpha=alpha,
                                ms=5 if m == 'verified' else 3, lw=1.6 if m == 'verified' else 1.1,
                                label=f"{run}, S={S}" if m == 'verified' else None)
                    for r, x in zip(pts, xs):
                        y = 100 * r['verified' + suffix]
                        cell = (round(math.log10(x) * 12), round(y / 2.5))
                        if cell not in placed:
                            placed.add(cell)
                            ax.annotate(f"k={r['views']}", (x, y), fontsize=7, color=c, textcoords='offset points',
                                        xytext=(3, -10))
            ax.set_xscale('log')
            ax.set_ylim(max(0.0, min(ys_all) - 5) if ys_all else 0, 101.5)
            ax.grid(alpha=0.3, which='both')
            ax.set_ylabel('held-out accuracy (%)')
        left.set_xlabel('test-time FLOPs per puzzle (log): k views x S steps x forward FLOPs')
        right.set_xlabel('test-time FLOPs per puzzle (log): k views x S steps x forward FLOPs')
        left.set_title(f"{f}_*: answers after S steps (scale {scale})", fontsize=10)
        right.set_title(f"{f}_*: each view's answer where q_halt stopped it, within S steps (scale {scale})",
                        fontsize=10)
        handles, labels = left.get_legend_handles_labels()
        styles = [Line2D([], [], color='grey', ls=ls, alpha=a, label=t) for ls, a, t in
                  (('-', 1.0, 'verified@k'), ('--', 0.9, 'vote@k'), (':', 0.5, 'oracle@k (ceiling)'))]
        left.legend(handles=handles + styles, fontsize=7, loc='best')
    return fig


# -----------------------------------------------------------------------------
# fits: error = a * X^-b + c per family

FIT_AXES = (('params', 'parameters'), ('train_flops', 'training FLOPs'), ('puzzles', 'training puzzles'))


def fit_power_law(xs, errs):
    """Least-squares fit of err = a * x^-b + c with a >= 0, b in (0, 4], 0 <= c < min(err): a grid over b and
    c, a in closed form for each, then two finer grids around the best. With its R^2 and whether it means
    anything: >= 4 distinct x (3 parameters fit 3 points exactly), an error spread of at least 1 percentage
    point, and a fit better than the mean (R^2 > 0)."""
    import numpy as np
    x, y = np.asarray(xs, float), np.asarray(errs, float)
    n = len(set(xs))
    out = dict(n=n, a=None, b=None, c=None, r2=None, meaningful=False)
    if n < 4:
        out['why'] = (f"{n} distinct points: a, b and c fit them exactly, so the fit says nothing" if n == 3
                      else f"{n} distinct point(s): too few for a fit (4 needed)")
        return out
    u = x / x.min()  # x / x0: a * x^-b = (a * x0^-b) * u^-b, better conditioned
    tss = float(((y - y.mean()) ** 2).sum())
    lo_b, hi_b, lo_c, hi_c, best = 1e-3, 4.0, 0.0, float(y.min()), None
    for _ in range(3):
        bs = np.linspace(lo_b, hi_b, 200)
        cs = np.linspace(lo_c, hi_c, 80, endpoint=hi_c == lo_c or best is not None)
        cs = cs[(cs >= 0) & (cs < max(float(y.min()), 1e-12))] if float(y.min()) > 0 else np.zeros(1)
        f = u[None, :] ** -bs[:, None]                                    # [b, point]
        t = y[None, :] - cs[:, None]                                      # [c, point]
        a = np.clip((t @ f.T) / (f * f).sum(1)[None, :], 0, None)         # [c, b]
        rss = ((a[:, :, None] * f[None] - t[:, None, :]) ** 2).sum(-1)    # [c, b]
        i, j = np.unravel_index(int(rss.argmin()), rss.shape)
        best = (float(a[i, j]), float(bs[j]), float(cs[i]), float(rss[i, j]))
        db, dc = (hi_b - lo_b) / 20, (hi_c - lo_c) / 20
        lo_b, hi_b = max(1e-3, best[1] - db), min(4.0, best[1] + db)
        lo_c, hi_c = max(0.0, best[2] - dc), min(float(y.min()), best[2] + dc)
    a, b, c, rss = best
    out.update(a=a * float(x.min()) ** b, b=b, c=c, r2=1 - rss / tss if tss > 0 else 0.0)
    if float(y.max() - y.min()) < 0.01:
        out['why'] = "flat: the error varies by less than 1 percentage point"
    elif out['r2'] <= 0:
        out['why'] = "the fit is no better than the mean error"
    else:
        out.update(meaningful=True, why='')
    return out


def family_fits(done):
    """(family, x key, x label, xs, errors, fit) for every family with at least two distinct x on an axis."""
    fits = []
    for f in dict.fromkeys(r['family'] for r in done):
        for key, label in FIT_AXES:
            pts = [r for r in done if r['family'] == f and r.get(key) is not None]
            if len({r[key] for r in pts}) < 2:
                continue
            xs, errs = [r[key] for r in pts], [1 - r['exact'] for r in pts]
            fits.append((f, key, label, xs, errs, fit_power_law(xs, errs)))
    return fits


def fit_text(fit):
    return f"{fit['a']:.3g}·X^-{fit['b']:.3f} + {fit['c']:.4f}"


def fits_section(rows):
    done = [p for p in points(rows) if p['status'] == 'done' and p.get('exact') is not None]
    fits = family_fits(done)
    if not fits:
        return []
    lines = ["\n## Fits: error = a · X^-b + c\n",
             "Error = 1 - held-out exact accuracy" + (f" (mean of {seeds} seeds)" if seeds > 1 else '')
             + ", per family against its parameters, training FLOPs and training puzzles (where the family "
               "has two or more distinct values). Least squares with b > 0 and 0 <= c < the smallest error; "
               "a fit is meaningful with 4 or more distinct points, an error spread of 1 percentage point or "
               "more, and R² > 0.\n", "| family | X | points | fit | R² | meaningful |",
             "|---|---|---|---|---|---|"]
    for f, key, label, xs, errs, fit in fits:
        r2 = '' if fit['r2'] is None else f"{fit['r2']:.3f}"
        lines.append(f"| {f}_* | {label} | {fit['n']} | {fit_text(fit) if fit['a'] is not None else ''} | "
                     f"{r2} | {'yes' if fit['meaningful'] else 'no: ' + fit['why']} |")
    return lines


def plot(rows, folder, views=()):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("report: matplotlib is not installed, so no plots (pip install matplotlib); "
              "the tables are written")
        return []
    done = [p for p in points(rows) if p['status'] == 'done' and p.get('exact') is not None]
    fams = list(dict.fromkeys(r['family'] for r in done))
    colors = {f: plt.get_cmap('tab10')(i % 10) for i, f in enumerate(fams)}
    title = f"scale {scale}"
    ylabel = ('held-out exact accuracy (%)\nbars: 95% Wilson interval' if seeds == 1 else
              f'held-out exact accuracy (%)\nmean of {seeds} seeds, bars: min-max')
    written = []

    def series(ax, xkey, label_x, fam_filter=None, logx=False, annotate=True):
        if not logx:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        used = 0
        for f in fams:
            pts = sorted((r for r in done if r['family'] == f and r.get(xkey) is not None),
                         key=lambda r: r[xkey])
            if fam_filter and not fam_filter(f) or len({r[xkey] for r in pts}) < 2:
                continue
            xs = [r[xkey] for r in pts]
            ys = [100 * r['exact'] for r in pts]
            err = [[100 * (r['exact'] - r['bar_lo']) for r in pts],
                   [100 * (r['bar_hi'] - r['exact']) for r in pts]]
            ax.errorbar(xs, ys, yerr=err, marker='o', capsize=3, color=colors[f], label=f"{f}_*")
            if annotate:
                for r, x, y in zip(pts, xs, ys):  # families sharing a point: one label above, one below
                    ax.annotate(r['point'], (x, y), textcoords='offset points', fontsize=7, color=colors[f],
                                xytext=(4, 4 if used % 2 == 0 else -11))
            used += 1
        if logx:
            ax.set_xscale('log')
        ax.set_xlabel(label_x)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        if used:
            ax.legend(fontsize=8)
        return used

    def save(fig, name):
        path = os.path.join(folder, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    for r in done:
        r['calls'] = r['H_cycles'] * (r['L_cycles'] + 1)
        r['per_puzzle'] = None if r.get('aug') is None else 1 + r['aug']
    for xkey, label, name, what in (
            ('params', 'parameters (count, log scale)', 'acc_vs_params.png', 'model size'),
            ('train_flops', 'training compute (FLOPs, log scale)', 'acc_vs_flops.png', 'training compute'),
            ('device_hours', 'cost: device-hours (wall time x devices, log scale)', 'acc_vs_device_hours.png',
             'cost')):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if series(ax, xkey, label, logx=True):
            ax.set_title(f"Exact accuracy vs {what} ({title})")
            save(fig, name)
        else:
            plt.close(fig)
    # two panels a figure: (x key, x label, families, log x, panel title)
    for name, panels in (
            ('acc_vs_recursion.png',
             [('L_cycles', 'n = L_cycles (z-updates per round)', ('rec',), False,
               'Recursion depth n at T = 3'),
              ('calls', 'T x (n + 1) = H_cycles x (L_cycles + 1) (network calls per supervision step)',
               ('rec', 'tn'), False, 'Recursion T x (n + 1)')]),
            ('acc_vs_optimizer.png',
             [('lr', 'learning rate (log scale)', ('lr',), True, 'Learning rate'),
              ('global_batch_size', 'global batch size (log scale; lr = 1e-4 x sqrt(B / 768))', ('bs',), True,
               'Batch size')]),
            ('acc_vs_data.png',
             [('puzzles', 'training puzzles (log scale)', ('data',), True, 'Training puzzles'),
              ('per_puzzle', 'examples per training puzzle = 1 + augmentations (log scale)', ('aug',), True,
               'Augmentations')])):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        drawn = [series(ax, xkey, label, lambda f, ends=ends: f.endswith(ends), logx=logx)
                 for ax, (xkey, label, ends, logx, _) in zip(axes, panels)]
        if any(drawn):
            for ax, panel in zip(axes, panels):
                ax.set_title(f"{panel[4]} ({title})")
            save(fig, name)
        else:
            plt.close(fig)
    for name, fig in (('acc_ablations.png', plot_ablations(plt, done, title, colors, ylabel)),
                      ('acc_vs_supervision_steps.png', plot_supervision_steps(plt, done, title)),
                      ('error_fits.png', plot_fits(plt, done, title, colors)),
                      ('acc_vs_test_compute.png', plot_views(plt, views))):
        if fig:
            save(fig, name)
    return written


def plot_ablations(plt, done, title, colors, ylabel):
    """One bar per ablation run, with its error bars."""
    abl = [r for r in done if r['family'].endswith('abl')]
    if not abl:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ys = [100 * r['exact'] for r in abl]
    err = [[100 * (r['exact'] - r['bar_lo']) for r in abl],
           [100 * (r['bar_hi'] - r['exact']) for r in abl]]
    ax.bar(range(len(abl)), ys, yerr=err, capsize=4, color=[colors[r['family']] for r in abl])
    ax.set_xticks(range(len(abl)), [f"{r['point']}\n{r['varied'][:28]}" for r in abl], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 103)
    ax.set_title(f"Ablations ({title})")
    return fig


def plot_fits(plt, done, title, colors):
    """One panel per axis (parameters, training FLOPs, training puzzles): each family's error against it,
    log-log, with its fit a * X^-b + c drawn where the fit is meaningful (report.md says why where it is
    not)."""
    import numpy as np
    fits = family_fits(done)
    axes_used = [a for a in FIT_AXES if any(f[1] == a[0] for f in fits)]
    if not axes_used:
        return None
    fig, axes = plt.subplots(1, len(axes_used), figsize=(6 * len(axes_used), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes.flat, axes_used):
        for f, k, _, xs, errs, fit in fits:
            if k != key:
                continue
            what = f"error {fit_text(fit)} (as a fraction), R² {fit['r2']:.2f}" if fit['meaningful'] else \
                'no meaningful fit (report.md says why)'
            ax.plot(xs, [100 * e for e in errs], 'o', color=colors[f], label=f"{f}_*: {what}")
            if fit['meaningful']:
                grid = np.geomspace(min(xs), max(xs), 100)
                ax.plot(grid, 100 * (fit['a'] * grid ** -fit['b'] + fit['c']), '-', color=colors[f], lw=1)
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel(f"{label} (log scale)")
        ax.set_ylabel('error = 100% - exact accuracy (%, log scale)'
                      + (f'\nmean of {seeds} seeds' if seeds > 1 else ''))
        ax.set_title(f"Error vs {label}: a·X^-b + c ({title})", fontsize=10)
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=7)
    return fig


def plot_supervision_steps(plt, done, title):
    """One panel per family: held-out exact accuracy against the supervision steps run at test time."""
    from matplotlib.ticker import MaxNLocator
    with_steps = [r for r in done if len(r.get('exact_by_steps') or []) > 0]
    if not with_steps:
        return None
    sfams = list(dict.fromkeys(r['family'] for r in with_steps))
    cols = min(3, len(sfams))
    nrow = math.ceil(len(sfams) / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(5.2 * cols, 4 * nrow), squeeze=False)
    for ax, f in zip(axes.flat, sfams):
        runs = [r for r in with_steps if r['family'] == f]
        cmap = plt.get_cmap('viridis')
        for i, r in enumerate(runs):
            ys = [100 * v for v in r['exact_by_steps']]
            ax.plot(range(1, len(ys) + 1), ys, marker='.', color=cmap(i / max(1, len(runs) - 1)),
                    label=f"{r['point']}")
            if r.get('halt_max_steps') and r['halt_max_steps'] < len(ys):
                ax.axvline(r['halt_max_steps'], color='grey', ls=':', lw=1)
        ax.set_title(f"{f}_* ({title})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel('supervision steps at test time (dotted: halt_max_steps)')
        ax.set_ylabel('held-out exact accuracy (%)')
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(sfams):]:
        ax.axis('off')
    return fig


def make_report(exps):
    rows, views = collect(exps), collect_views(exps)
    folder = report_dir or LOCAL_ROOT
    print(write_tables(rows, folder, views))
    pngs = plot(rows, folder, views)
    print(f"\nreport: {os.path.join(folder, 'report.md')}, {os.path.join(folder, 'report.csv')}"
          + (f", {os.path.join(folder, 'report_views.csv')}" if views else '')
          + ''.join(f", {p}" for p in pngs))
    for r in rows:
        if r.get('not_used'):
            print(f"report: {r['run']}: {r['not_used']}")
    missing = [r['name'] for r in rows if r['status'] != 'done' and not r.get('not_used')]
    if missing:
        print(f"report: not finished yet: {', '.join(missing)}")


# -----------------------------------------------------------------------------

if __name__ == '__main__':
    patterns = [p.strip() for p in pattern.split(',') if p.strip()]
    names, exps = load_experiments(patterns)
    if not exps:
        print_families(names)
    elif list_only:
        print_list(exps)
    elif dry_run:
        print_dry_run(exps)
    elif report:
        make_report(exps)
    elif eval_only:
        rc = run_evals(exps)
        print()
        make_report(exps)  # with the test-time table and plot
        sys.exit(rc)
    else:
        rc = run_study(exps)
        print()
        make_report(exps)  # what is finished so far, compared
        sys.exit(rc)
