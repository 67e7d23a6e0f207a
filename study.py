"""
Scaling studies: families of train.py runs that differ from the paper's recipe in one or two keys, costed
before they run, run in turn or N at once (resumable), and compared in one table and a few plots.

    python study.py                                            # the families and their experiments
    python study.py --pattern='rec_*' --dry_run=True           # each run's command, parameters, FLOPs, time
    python study.py --pattern='rec_*'                          # build missing datasets, then run them in turn
    python study.py --pattern='rec_*,tn_*' --scale=cpu         # the CPU twin of the same families
    python study.py --pattern='rec_*,tn_*' --scale=cpu --slots=2       # two runs at once, a core each
    python study.py --pattern='*' --scale=gpu --examples_per_s=2500 --dry_run=True
    python study.py --pattern='rec_*,tn_*' --scale=cpu --report=True   # table (md, csv) and PNGs
    python study.py --pattern='rec_*' --scale=cpu --eval_only=True --eval_views=1,2,4,8,16 --eval_steps=4,8
    torchrun users: --nproc=4;  TPU pods: PJRT_DEVICE=TPU python study.py ... --out_root=gs://BUCKET/study

An experiment is a file, config/study/<family>_<point>.py, that train.py also runs alone: it names its
recipe in `_base` and holds only what the run changes. Points that are one configuration share an out_dir
and are trained once. Runs go to <out_root>/<last part of the file's out_dir>. A run whose results.json was
made with the command the study runs now is skipped; made with another, it is reported NOT REUSED and left
alone; a started run resumes its newest checkpoint (--init_from=resume) if that was saved with this command
too, else it is NOT REUSED likewise. Rerun the same command after a stop or a crash to continue. One study
at a time runs into an out_root (study.lock names it).

Scales (--scale), flags applied after the file's: full (the files as they are; out/study), gpu (one GPU, a
tenth of the epochs; out/study-gpu), cpu (a CPU twin: generated 4x4 Sudoku and 8x8 mazes, a model 16
times narrower, 250 steps, one thread a run; out/study-cpu). --slots=N runs N at once here, each on its own
GPUs, TPU chip or CPU cores; --hosts_mode=share gives each pod host its own share of the runs; --seeds=K
trains every point K times; --eval_only=True evaluates finished runs again in k views at S supervision
steps. The report (--report=True, and at the end of every study): report.md, report.csv, power-law fits
per family and PNGs.

The files: studies/plan.py (experiment files, scales, datasets, costs, run state, saved evaluations),
studies/report.py (tables, fits, plots; its FAMILY_PANELS says which plot draws a family) and this script
(the keys below, hosts and slots, the train.py processes, the re-evaluations).
The design, each scale's flags, the cost model, slots and pods, seeds, views and the report: docs/studies.md
"""
import atexit
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import deque

from runkeep import gcs
from configurator import TRAIN_RULES, LineLog, Tee, find_file, parse_flags, type_problem
from device import tpu_chips, tpu_host_alone_env, tpu_host_index, tpu_hosts, usable_cores
from runkeep.locks import LOCK_NAME, STUDY_VAR, create_lock, holder_gone, local_record
from runkeep.records import take_bucket_log
from runkeep.signals import die_with_parent
from runkeep.startup import local_folder
from puzzles import KINDS
from studies.plan import (RUNNER_KEYS, SCALE_ROOTS, TRAIN_DEFAULTS, Experiment, Options, build_display,
                        bench_mismatch, checkpoint_steps, config_diffs, cost, duration, family_pattern, flop_rate,
                        has_results, load_experiments, model_cost, order_runs, own_steps, partition, point_of,
                        read_results, resume_problem, run_flops, saved_evals, schedule, share_cost, state)
from studies.report import ENDED, make_report

# -----------------------------------------------------------------------------
# config
pattern = ''                    # experiments: name globs ('rec_*', 'size_d*,tn_*', '*'); '': list families
scale = 'full'                  # 'full' (files as they are) | 'gpu' (one GPU) | 'cpu' (the CPU twin); docs/studies.md
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
pod = ''                        # dry run: also the time on this TPU slice ('v4-32', 'v5e-32', 'v6e-8', ...), from an ASSUMED MFU
assume_mfu = 0.25               # with pod: the share of the chips' bf16 peak a run is ASSUMED to sustain (not measured)
build_data = True               # build missing datasets first (False: a run without its dataset fails)
report_dir = ''                 # where --report writes ('': the local folder of out_root)
slots = 1                       # runs at once here, each on its own GPUs, TPU chip or CPU cores (docs/studies.md)
hosts_mode = 'all'              # 'all': each run on all pod hosts, in turn | 'share': each host its share
host_index = -1                 # this host, 'share' (-1: TPU_WORKER_ID, CLOUD_TPU_TASK_ID, TPU metadata, 0)
num_hosts = 0                   # hosts for 'share' (0: TPU_WORKER_HOSTNAMES, the TPU metadata, else 1)
seeds = 1                       # runs per experiment: seeds 0 .. seeds-1 (seed s > 0 in <out_dir>-s<s>)
status_every = 60.0             # with slots > 1: seconds between status lines (one line per running run)
check_memory = True             # a run this host's memory (RAM, or a GPU's) cannot hold is not run (False: run it)
# -----------------------------------------------------------------------------
# the libraries' constants imported above (ENDED, ...) are no keys a flag may set
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and not k.isupper() and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
# -----------------------------------------------------------------------------

STUDY_LOCK = 'study.lock'       # in the local folder of out_root: one study at a time runs into it
STOP = dict(requested=False, children=set())
ESTIMATE = {}                   # run -> its seconds from the speed figure, for a run started from scratch

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
# 0 or -1 says 'none' or 'from the environment': a value below it is a mistake, not the same thing
if bad := [f"{k}={v!r} (allowed: {what})" for k, v, ok, what in (
        ('examples_per_s', examples_per_s, 0 <= examples_per_s < float('inf'), 'examples/s > 0, or 0: none'),
        ('host_index', host_index, host_index >= -1, 'a host index >= 0, or -1: from the environment'),
        ('num_hosts', num_hosts, num_hosts >= 0, 'hosts >= 1, or 0: from the environment'),
        ('status_every', status_every, status_every > 0, 'seconds > 0')) if not ok]:
    raise SystemExit("config error: " + '; '.join(bad))
if hosts_mode not in ('all', 'share'):
    raise SystemExit(f"config error: hosts_mode={hosts_mode!r} (allowed: 'all' | 'share')")
if os.environ.get('PJRT_DEVICE') and nproc > 1:
    raise SystemExit("config error: with PJRT_DEVICE set train.py starts one process per chip itself: use "
                     "--nproc=1")
if out_root and not TRAIN_RULES['out_dir'][0](out_root):  # 'gs://' alone would be a local folder named 'gs:'
    raise SystemExit(f"config error: out_root={out_root!r} (allowed: '', a folder or gs://BUCKET/prefix)")
ROOT = (out_root or SCALE_ROOTS[scale]).rstrip('/')
LOCAL_ROOT = local_folder(ROOT) if gcs.is_gcs(ROOT) else ROOT  # a run's local_dir: train.py's default for it
try:
    EXTRA_ARGS = shlex.split(extra)
except ValueError as ex:  # an unclosed quote
    raise SystemExit(f"config error: --extra={extra!r}: {ex} (allowed: --key=value flags, quoted as in a "
                     "shell)")
EXTRA = parse_flags(extra, TRAIN_DEFAULTS, '--extra')
if not check_memory:  # train.py's own check, too
    EXTRA_ARGS, EXTRA = EXTRA_ARGS + ['--check_memory=False'], dict(EXTRA, check_memory=False)
if [k for k in EXTRA if k in RUNNER_KEYS]:
    raise SystemExit(f"config error: --extra sets {', '.join(k for k in EXTRA if k in RUNNER_KEYS)}, which "
                     f"study.py sets for every run (not allowed in --extra: {', '.join(RUNNER_KEYS)}): the "
                     "runs go to --out_root/<the file's out_dir name> and resume with --init_from=resume")
if bad := [p for k, v in EXTRA.items() if (p := type_problem(k, v, TRAIN_DEFAULTS[k], '--extra'))]:
    raise SystemExit("config error: " + '; '.join(bad))
if seeds > 1 and 'seed' in EXTRA:
    raise SystemExit("config error: --seeds and --extra='--seed=...' together (allowed: one of them)")
# --pod (dry run): chips of a TPU slice and their bf16 peak (FLOP/s); v4 and v5p names count TensorCores (2 a chip)
TPU_PEAK = dict(v4=275e12, v5e=197e12, v5litepod=197e12, v5p=459e12, v6e=918e12)
POD = None
if pod:
    m = re.fullmatch(r'(v4|v5e|v5litepod|v5p|v6e)-(\d+)', pod)
    if not m or not 0 < assume_mfu <= 1:
        raise SystemExit(f"config error: pod={pod!r}, assume_mfu={assume_mfu!r} (allowed: a TPU slice such as "
                         f"'v4-32', 'v5e-32', 'v6e-8'; assume_mfu in (0, 1])")
    cores = 2 if m[1] in ('v4', 'v5p') else 1  # what the name's number counts a chip as
    chips = int(m[2]) // cores
    if chips < 1 or int(m[2]) % cores:
        raise SystemExit(f"config error: pod={pod!r} is no slice of whole chips (allowed: at least 1 chip; v4 and "
                         f"v5p names count TensorCores, 2 a chip: 'v4-8' is 4 chips)")
    POD = dict(name=pod, chips=chips, rate=chips * TPU_PEAK[m[1]] * assume_mfu,
               why=f"ASSUMED, not measured: {pod} = {chips} chips x {TPU_PEAK[m[1]] / 1e12:g} TFLOP/s bf16 peak x "
                   f"{assume_mfu:g} MFU = {chips * TPU_PEAK[m[1]] * assume_mfu / 1e15:.3g} PFLOP/s, perfect "
                   "scaling over the chips")
# all that studies/plan.py and studies/report.py see of these keys (they read no global of this script)
OPTS = Options(scale=scale, root=ROOT, local_root=LOCAL_ROOT, data_root=data_root, config_dir=config_dir,
               extra=EXTRA, extra_args=EXTRA_ARGS, nproc=nproc, seeds=seeds)

# -----------------------------------------------------------------------------
# hosts, slots and devices: where each run goes

TPU_PORT = 8476                 # libtpu's first process port (torch_xla's default); slot i uses TPU_PORT + i


def host_devices(exps):
    """(kind, ids) of what this host's runs train on, found without initializing a device in study.py: 'tpu'
    (PJRT_DEVICE=TPU) and its chips (on the PCI bus, as torch_xla counts them), 'cuda' and
    CUDA_VISIBLE_DEVICES or the GPUs `nvidia-smi -L` lists, else 'cpu' and the cores study.py may run on."""
    wanted = {e.run_cfg['device'] for e in exps} or {'auto'}
    if 'tpu' in wanted and (slots > 1 or nproc > 1):  # TorchTPU's launcher in each run would take every chip
        raise SystemExit(f"config error: --slots={slots} --nproc={nproc} with device='tpu' (TorchTPU): its train.py "
                         "starts one process per TPU device of this host itself, so its runs go one at a time: "
                         "--slots=1 --nproc=1")
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
        index = tpu_host_index() if index < 0 else index  # the metadata server's
        count = tpu_hosts() if count < 1 else count
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
    for n in names:  # a name without '_' is a family of its own, selected by its name
        fams.setdefault(family_pattern(n), []).append(point_of(n))
    print(f"{len(names)} experiments in {config_dir}, by family (select with --pattern='<family>_*'):")
    for f, pts in fams.items():
        print(f"  {f:<14} {' '.join(pts)}")
    print("\npython study.py --pattern='rec_*' --dry_run=True     commands and costs\n"
          "python study.py --pattern='rec_*,tn_*' --scale=cpu  run (a CPU twin), then --report=True\n"
          "python study.py --help                            every key, the scales, the design")


def print_list(exps):
    for e in exps:
        where = f"same run as {e.same_as}" if e.same_as else state(e)
        print(f"{e.run:<16} {e.family:<10} {e.varied_text():<52} {e.out_dir}  [{where}]")


def run_seconds(e, flops, rate, devices):
    """A run's seconds: its FLOPs at `rate` FLOP/s on `devices` devices, or its max_minutes where that is less
    (the time budget stops its training; an adaptation's epochs are more than any budget lets it train)."""
    t, budget = flops / (rate * devices), 60 * (e.run_cfg.get('max_minutes') or 0)
    return min(t, budget) if budget > 0 else t


def print_dry_run(exps):
    rate, why, bench = flop_rate(OPTS, bench_file, examples_per_s)
    note = bench_mismatch(bench, exps)
    print(f"scale {scale}: {len(exps)} experiment(s), {sum(not e.same_as for e in exps)} run(s) | {why}"
          + (f"\n{note}" if note else '') + "\n")
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
        t = run_seconds(e, flops[e.run], rate, nproc) if rate else None
        capped = t is not None and t < flops[e.run] / rate / nproc
        print(f"  {c['params']:,} parameters | {c['fpe'] / 1e9:.3g} GFLOPs per example-step | {c['steps']:,} "
              f"steps x batch {c['batch']} = {c['steps'] * c['batch']:,} examples | training "
              f"{c['train_flops']:.3g} FLOPs | {c['evals']} evaluation(s)"
              + (f", {c['passes']} passes (the EMA's and the raw weights)" if c['passes'] > c['evals'] else '')
              + (f", {c['views']} views each" if c['views'] > 1 else '') + f": {c['eval_flops']:.3g} FLOPs"
              + (f" | about {duration(t)}" + (f" on {nproc} processes" if nproc > 1 else '')
                 + (" (its max_minutes)" if capped else '') if t else '')
              + (f" | on a {POD['name']}: about {duration(flops[e.run] / POD['rate'])} (assumed MFU)" if POD else ''))
        print()
        total['train'] += c['train_flops']
        total['eval'] += c['eval_flops']
        total['time'] += t or 0
        total['runs'] += 1
    print(f"total: {total['runs']} costed run(s), training {total['train']:.3g} FLOPs, evaluation "
          f"{total['eval']:.3g} FLOPs"
          + (f", about {duration(total['time'])}" if rate else " (no time estimate)"))
    if POD:
        print(f"on a {POD['name']}, one run after another on all its chips: about "
              f"{duration((total['train'] + total['eval']) / POD['rate'])} ({POD['why']})")
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
    secs = lambda e, d: run_seconds(e, flops.get(e.run, mean), rate, d) if rate else 0.0

    def on_host(host_of, h):  # (its runs in starting order, (slot, start) of each, its wall time)
        mine = [e for e, x in zip(runs, host_of) if x == h]
        mine = order_runs(mine, [flops.get(e.run) for e in mine], slots)
        # without a rate, the runs' FLOPs place them all the same (no time is said)
        return (mine, *schedule([secs(e, per_slot) if rate else flops.get(e.run, mean) for e in mine], slots))

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
        for pid in stop_targets(p):
            try:
                os.kill(pid, signal.SIGTERM)  # train.py saves a checkpoint and exits; a second stops it at once
            except ProcessLookupError:
                pass


def stop_targets(p):
    """The pids a stop asks for the child p: torchrun's ranks where p is its agent, which, asked itself, ends its
    ranks' stop with a traceback of its own in the run's output (its ranks exiting 0 end it quietly); else p."""
    if 'torch.distributed.run' in p.args:
        try:
            with open(f'/proc/{p.pid}/task/{p.pid}/children') as f:
                if ranks := [int(c) for c in f.read().split()]:
                    return ranks
        except (OSError, ValueError):
            pass
    return [p.pid]


def _child_setup(parent, cores=None):
    """In the child before exec: it dies with study.py (even by SIGKILL), so an orphaned train.py saves and stops
    instead of running on beside a rerun; then its slot's cores."""
    die_with_parent(parent)
    if cores:
        os.sched_setaffinity(0, cores)


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
        self.log_path, self.log = log_path, None
        try:
            os.makedirs(os.path.dirname(log_path) or '.', exist_ok=True)
            self.log = LineLog(log_path)
        except OSError as ex:
            self.log_failed(ex)
        # where this process's part of the log begins
        self.start = os.lseek(self.log.fileno(), 0, os.SEEK_END) if self.log else None
        self.write_log(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {display}\n".encode(), header=True)
        parent = os.getpid()
        # a run's rank 0 writes the log not again; a gs:// run resumed on another machine puts the bucket's log
        # before this process's part (OUTPUT_FROM_VAR), not in its place
        env = dict(env or {}, **{Tee.OUTPUT_LOG_VAR: os.path.abspath(log_path), STUDY_VAR: str(parent)},
                   **({Tee.OUTPUT_FROM_VAR: str(self.start)} if self.start is not None else {}))
        # the script (the first .py: train.py, prepare_*.py) is the repository's, wherever the study was started
        if (at := next((i for i, a in enumerate(cmd) if a.endswith('.py')), None)) is not None:
            cmd = cmd[:at] + [find_file(cmd[at])] + cmd[at + 1:]
        self.p = subprocess.Popen([sys.executable] + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=child_env(env), start_new_session=True,
                                  preexec_fn=lambda: _child_setup(parent, cores))
        self.bufs = {self.p.stdout.fileno(): b'', self.p.stderr.fileno(): b''}  # open pipes: unfinished line
        self.shown = dict.fromkeys(self.bufs, 0)  # of each unfinished line, how much is on the terminal
        self.mid_line = None  # the pipe whose unfinished line the terminal ends with
        for fd in self.bufs:
            os.set_blocking(fd, False)
        STOP['children'].add(self.p)

    def pump(self, echo):
        """Takes what the process wrote (stdout and stderr), in whole lines: into its log, and here when echo.
        'eof' at the end of its output, '' when nothing is waiting, else 'more'."""
        got = ''
        for fd in list(self.bufs):
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            # the log and the terminal take whole lines of each pipe (a line of one glued into the other's
            # unfinished one is neither's); an unfinished line at the end of the output is ended there
            text = self.bufs[fd] + chunk if chunk else self.bufs[fd] + b'\n' * bool(self.bufs[fd])
            *lines, rest = text.split(b'\n')
            whole = text[:len(text) - len(rest)]
            if echo:
                # a line rewritten in place ('\r': a download's progress) is shown as it goes, not at its end
                upto = len(text) if b'\r' in rest else len(whole)
                self.echo(fd, text[self.shown[fd]:upto])
                self.shown[fd] = upto - len(whole)
            self.write_log(whole)
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

    def echo(self, fd, data):
        """Onto study.py's stdout, which shows both pipes: the other pipe's unfinished line there is ended first,
        so that neither is glued into the other."""
        if not data:
            return
        if self.mid_line not in (None, fd):
            data = b'\n' + data
        self.mid_line = None if data.endswith(b'\n') else fd
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except (OSError, ValueError):  # the reader of study.py's stdout is gone
            sys.stdout.lost()

    def write_log(self, data, header=False):
        """Appends to the log in whole lines, as the child's Tee appends to a train.log of its own (LineLog): a
        line that does not fit (a full disk) is left out, said here at the first, and counted in a note there once
        lines fit again; the copying goes on. A log replaced meanwhile (a resumed gs:// run on a new machine
        fetches its train.log) is appended to anew, its note counting the lines missing from the one before; one
        that cannot be opened again is said once and left as it is. Lines still missing at the process's end are
        counted on this terminal then (close)."""
        if self.log is None:
            return
        try:
            try:
                replaced = os.stat(self.log_path).st_ino != os.fstat(self.log.fileno()).st_ino
            except FileNotFoundError:
                replaced = True
            if replaced:
                self.log = self.log.reopened()
        except OSError as ex:
            self.log_failed(ex)
            return
        for what, x in self.log.write(data, header):
            print(f"\nstudy: could not append to {self.log_path} ({x.strerror or x}): this process's lines that do "
                  "not fit there are left out until there is room, then a note says how many" if what == 'lost' else
                  f"\nstudy: note: {self.log_path} is appended to again; {x} line(s) of this process's output before "
                  "its note there are not in it", flush=True)

    def log_failed(self, ex):
        print(f"\nstudy: cannot write {self.log_path} ({ex.strerror or ex}): the rest of this process's output "
              "is not kept there", flush=True)
        if self.log is not None:
            with contextlib.suppress(OSError):
                self.log.close()
        self.log = None

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
        if self.log is not None:
            with contextlib.suppress(OSError):  # what did not fit was said at its write
                self.log.close()
            if note := self.log.end_note("this process's output"):
                print(f"\nstudy: {note}", flush=True)
        return rc, list(self.tail)


def lock_study():
    """One study at a time into an out_root: a lock file in its local folder (host, pid), taken over when its
    study is gone (this host's pid ended, or the host restarted), removed at exit."""
    path = os.path.join(LOCAL_ROOT, STUDY_LOCK)
    if problems := create_lock(LOCAL_ROOT, STUDY_LOCK, 'study', 'out_root', ROOT, bare_when_full=True):
        raise SystemExit(problems[0])
    atexit.register(lambda: os.path.exists(path) and os.remove(path))


def wait_for_orphans(runs):
    """Waits for the train.py processes that a killed study left in these runs' folders: each saves a checkpoint
    and stops on its own once its study is gone, holding its run's lock until then, and this study then resumes
    the run from that checkpoint instead of failing on the lock. Said in one line; a stop request ends the
    wait."""
    left = []
    for e in runs:
        rec = local_record(os.path.join(e.local, LOCK_NAME))
        if isinstance(rec, dict) and rec.get('study') not in (None, str(os.getpid())) and not holder_gone(rec):
            left.append((e.run, rec))
    if not left:
        return
    print(f"study: waiting for the train.py of {len(left)} run(s) that the study before this one (pid "
          f"{left[0][1]['study']}, ended) left behind, to save a checkpoint and stop: "
          + ', '.join(f"{run} (pid {rec.get('pid')})" for run, rec in left), flush=True)
    while not STOP['requested'] and not all(holder_gone(rec) for _, rec in left):
        time.sleep(0.2)


def run_study(exps):
    """Runs the selected runs not finished before; (the exit code, {run: (status, why)} as the summary says)."""
    lock_study()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    runs = [e for e in exps if not e.same_as]
    mine, index, hosts, host_of = my_runs(runs)
    wait_for_orphans(mine)
    if os.environ.get('PJRT_DEVICE') == 'TPU' and not gcs.is_gcs(ROOT) and hosts_mode == 'all':
        print(f"warning: PJRT_DEVICE=TPU and out_root {ROOT} is local: on a pod use "
              "--out_root=gs://BUCKET/...")
    if hosts_mode == 'share' and hosts > 1 and not gcs.is_gcs(ROOT):
        print(f"warning: out_root {ROOT} is local: each host's results stay on it (--out_root=gs://... shows "
              "all)")
    # a speed figure given to a real run: each run's estimate beside its measured time. A figure that cannot be
    # read stops no run (a pod's worker may lack the file the first host has): it is said, and nothing estimated
    try:
        rate = flop_rate(OPTS, bench_file, examples_per_s)[0] if bench_file or examples_per_s else None
    except SystemExit as ex:
        rate = None
        print(f"study: no time estimates: {ex}", flush=True)
    kind, ids = host_devices(mine)
    plans = slot_plans(kind, ids, slots, hosts if hosts_mode == 'share' else 1)
    status, t_study = {}, time.time()
    for e, h in zip(runs, host_of):
        if h != index:
            status[e.run] = (f"on host {h}", None)
    todo = []
    for e in mine:
        # a finished run of another configuration is not reused, a started one not resumed
        why = read_results(e)[1] if has_results(e) else resume_problem(e) or None
        if why is None:
            todo.append(e)
        elif why:  # neither reused nor trained over: said here and in the summary
            status[e.run] = ('NOT REUSED', why)
            print(f"study: {e.run}: {why}")
        else:
            status[e.run] = ('done before', None)
    held = sum(s == 'NOT REUSED' for s, _ in status.values())
    where = f"host {index} of {hosts}: {len(mine)} of the " if hosts_mode == 'share' else ''
    print(f"study: scale {scale}, {len(exps)} experiment(s), {where}{len(runs)} run(s): "
          f"{len(mine) - len(todo) - held} finished before, " + (f"{held} not reused, " if held else '')
          + f"{len(todo)} to run, in {ROOT}"
          + (f"; {slots} at once on {kind} "
             f"({', '.join(p['label'] for p in plans)})" if slots > 1 else ''))
    todo = [e for e in todo if fits(e, kind, ids, status)] if check_memory else todo
    failed_data = build_datasets(todo)
    todo = order_runs(todo, [run_flops(e) for e in todo], slots)
    for e in todo:  # a resumed run's measured time is only its remainder's
        if rate and run_flops(e) and not checkpoint_steps(e):
            ESTIMATE[e.run] = run_seconds(e, run_flops(e), rate, nproc)
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
    return 1 if bad or STOP['requested'] else 0, status


def fits(e, kind, ids, status):
    """Whether this host can hold run e in memory (memory.run_memory of its config, at its batch, on its dataset's
    sizes, known before the dataset is built), with a process of its own (Python and torch: as much as this one
    holds now) for each of its nproc ranks: a CPU's headroom shared by the slots, or a GPU's free memory
    (nvidia-smi). One that does not is said in one line and not run, before its dataset is built; TPU runs
    (torch_xla's and TorchTPU's) and datasets of unknown size are not checked."""
    d = e.data
    if kind == 'tpu' or e.run_cfg['device'] == 'tpu' or d.get('num_puzzle_identifiers') is None or \
            d.get('vocab_size') is None:
        return True
    from device import resident_bytes
    from runkeep.memory import config_memory, headrooms, memory_problem
    c, own = e.run_cfg, (None, '')  # own: a limit each process has to itself (RLIMIT_AS, inherited by each run)
    if kind == 'cuda':
        try:
            out = subprocess.run(['nvidia-smi', '--query-gpu=index,memory.free,compute_cap', '--format=csv,noheader,'
                                  'nounits'], capture_output=True, text=True, timeout=30).stdout
            gpus = {i.strip(): (float(m) * 2 ** 20, tuple(map(int, cap.split('.'))))
                    for i, m, cap in (l.split(',') for l in out.splitlines() if l.count(',') == 2)}
            give, cap = min(gpus[g] for g in ids if g in gpus)
        except (OSError, subprocess.SubprocessError, ValueError):
            return True  # its train.py checks its GPU itself
        where = 'free on its GPU (nvidia-smi)'
    else:
        (give, where), own = headrooms()
        cap = None
        if slots > 1 and give is not None:
            give, where = give // slots, f"{where}, a {slots}th of it for each of --slots={slots}"
    parts = config_memory(c, d, kind, nproc, cuda_capability=cap, params=model_cost(c, d)[0])
    parts['process'] = resident_bytes()
    steps = (cost(e) or {}).get('steps')
    what = f"its train.py ({steps:,} steps at batch {c['global_batch_size']})" if steps else 'its train.py'
    problem = memory_problem(parts, nproc if kind == 'cpu' else 1, what, where, give,
                             '--check_memory=False (study.py)', own)
    if problem:
        status[e.run] = ('NOT RUN', problem)
        print(f"study: {e.run}: not run (its dataset not built either): {problem}", flush=True)
    return not problem


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
            e = queue.pop(0)
            if why := changed_since(e):
                status[e.run] = ('NOT RUN', why)
                print(f"\nstudy: {e.run}: not run: {why}", flush=True)
                continue
            slot = free.pop(0)
            steps = checkpoint_steps(e)
            on = f" on slot {slot} ({plans[slot]['label']})" if not echo else ''
            print(f"\nstudy: {e.run} [{e.varied_text()}]: "
                  + (f"resuming from its checkpoint at step {steps[-1]}" if steps else "starting") + on
                  + (f" (estimated about {duration(ESTIMATE[e.run])} from "
                     f"{'the bench' if bench_file else '--examples_per_s'})" if e.run in ESTIMATE else '')
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


def changed_since(e):
    """Why run e is not started: its file (or its _base) now says another configuration than the one this study
    costed, checked and reports, and train.py would read the file as it is now; '' when it is unchanged."""
    try:
        now = Experiment(e.path, OPTS, seed=e.seed)
    except SystemExit as ex:
        return f"{e.path} changed since the study started and is now refused: {ex}"
    diffs = config_diffs(now, e.run_cfg, then='then')
    return f"{e.path} changed since the study started ({diffs}): rerun the study to run it as it is now" \
        if diffs else ''


def finished(r, status, failed_data):
    e = r.e
    rc, _ = r.close()
    took = time.time() - r.t0
    if has_results(e):
        estimate = f" measured (estimated about {duration(ESTIMATE[e.run])})" if e.run in ESTIMATE else ''
        status[e.run] = ('done', f"in {duration(took)}{estimate}")
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
    said = f"{status[e.run][0]}" + (f" {status[e.run][1]}" if status[e.run][1] else '')
    print(f"study: {e.run}: {said}", flush=True)
    log = os.path.join(e.local, 'train.log')
    if status[e.run][0] != 'done':  # its last line: a later report tells a failed or stopped run from a running one
        try:
            with open(log, 'a') as f:
                f.write(f"{ENDED}{said}\n")
        except OSError as ex:
            print(f"study: {e.run}: cannot write to {log} ({ex.strerror or ex})", flush=True)
    # the run uploaded its train.log before this study had copied its last lines there; one that ended before it
    # went on from the bucket's (a failed start-up check) goes after the bucket's, not in its place
    if gcs.is_gcs(e.out_dir):
        try:
            take_bucket_log(log, e.out_dir, r.start, "its upload replaces the bucket's")
            gcs.upload_file(log, f"{e.out_dir.rstrip('/')}/train.log")
        except (gcs.GCSError, OSError) as ex:
            print(f"study: {e.run}: its train.log was not uploaded to {e.out_dir} ({ex}); it is in {e.local}",
                  flush=True)


# -----------------------------------------------------------------------------
# test-time views and steps: finished runs evaluated again (--eval_only)

def views_of(e, K):
    """The views run e is evaluated in: K, or 1 where its kind's views are stored in its dataset (ARC: the test
    split holds every augmentation of a task, and they vote in every evaluation; a fresh view would carry no
    trained puzzle embedding)."""
    kind = KINDS.get(e.data.get('kind') or '')
    return 1 if kind is not None and kind.stored_views else K


def run_evals(exps):
    """--eval_only: every finished run whose results.json the study reuses is evaluated again, once per
    eval_steps S, in K = max(eval_views) views (its first k views are a k-view evaluation, so one run gives
    every k): its command plus --eval_only=True --eval_views=K --eval_steps=S (with --init_from=resume: the
    newest checkpoint), which saves <out_dir>/evals/views{K}-steps{S}.json. Skipped when a file of S with K
    views or more, of the step results.json is of, is there; unfinished runs are listed as skipped with their
    state. In turn, one at a time (--slots does not apply). The exit code: 1 if an evaluation failed or the
    study was stopped."""
    lock_study()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    K, t_study = VIEWS[-1], time.time()
    mine = my_runs([e for e in exps if not e.same_as])[0]
    wait_for_orphans(mine)
    todo, summary = [], []  # summary: (run, steps, status, detail)
    for e in mine:
        if not has_results(e):
            summary.append((e.run, '', 'skipped', f"not finished ({state(e)}): train it first (study.py "
                                                  "without --eval_only)"))
            continue
        res, why = read_results(e)
        if why:
            summary.append((e.run, '', 'skipped', f"NOT REUSED: {why}"))
            continue
        have = saved_evals(e, res)  # an evaluation of another checkpoint (earlier, rolled back) is not this run's
        views = views_of(e, K)
        for S in dict.fromkeys(s or own_steps(e) for s in STEPS):
            more = [k for k, s in have if s == S and k >= views]
            if more:
                summary.append((e.run, S, 'done before', have[max(more), S]))
            else:
                todo.append((e, S, views))
    print(f"study: scale {scale}, test-time evaluation of {len(mine)} run(s) in {K} view(s) (k = "
          f"{', '.join(map(str, VIEWS))}) at steps {', '.join(str(s) if s else 'own' for s in STEPS)}: "
          f"{sum(s == 'done before' for _, _, s, _ in summary)} done before, {len(todo)} to run, in {ROOT}")
    for e, S, views in todo:
        if STOP['requested']:
            summary.append((e.run, S, 'not run (stopped)', ''))
            continue
        flags = ['--eval_only=True', f'--eval_views={views}', f'--eval_steps={S}']
        display = ' '.join([e.display] + flags)
        stored = f" ({KINDS[e.data['kind']].stored_views}; not {K})" if views < K else ''
        print(f"\nstudy: {e.run} [{e.varied_text()}]: evaluating in {views} view(s){stored} at {S} steps\n"
              f"  {display}", flush=True)
        t, path = time.time(), os.path.join(e.local, 'evals', f"views{views}-steps{S}.json")
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

def write_report(exps, told=None):
    """The report (studies.report.make_report; told: the study's status of each run); one that cannot be written
    (a full disk, a file-size limit) is a line, not a traceback: each run's own files hold its results. Whether
    it was written."""
    folder = report_dir or LOCAL_ROOT
    try:
        make_report(exps, OPTS, folder, told)
        return True
    except OSError as ex:
        print(f"\nstudy: the report cannot be written in {folder} ({ex.filename or 'a file there'}: "
              f"{ex.strerror or ex}); each run's results stay in its own folder", flush=True)
        return False


if __name__ == '__main__':
    patterns = [p.strip() for p in pattern.split(',') if p.strip()]
    names, exps = load_experiments(patterns, OPTS)
    if not exps:
        print_families(names)
    elif list_only:
        print_list(exps)
    elif dry_run:
        print_dry_run(exps)
    elif report:
        sys.exit(0 if write_report(exps) else 1)
    elif eval_only:
        rc = run_evals(exps)
        print()
        write_report(exps)  # with the test-time table and plot
        sys.exit(rc)
    else:
        rc, told = run_study(exps)
        print()
        write_report(exps, told)  # what is finished so far, compared; what failed, as the summary says
        sys.exit(rc)
