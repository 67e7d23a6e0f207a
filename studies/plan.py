"""
A study's plan: the experiment files and what each run is at a scale (its flags, command, dataset), what it
costs before it runs, where it stands (finished, started, nothing) and the evaluations it saved. study.py
runs the plan and studies/report.py compares the results; both pass the CLI's values in one Options.
"""
import ast
import fnmatch
import json
import os
import re
import shlex
from dataclasses import dataclass

import numpy as np

from runkeep import gcs
from configurator import (config_files, config_problems, key_problem, place_words, places,
                          find_file, read_config_block, type_problem)
from puzzles import shape_from_name
from runkeep.checkpoint import checkpoint_name, list_checkpoints, load_checkpoint

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
TRAIN_DEFAULTS = {k: v for k, (v, _) in read_config_block(os.path.join(HERE, 'train.py')).items()}
SCALE_ROOTS = dict(full='out/study', gpu='out/study-gpu', cpu='out/study-cpu')
GPU_FRACTION = 0.1              # of epochs, eval_every_epochs and lr_warmup_steps at the gpu scale
CPU_FRACTION = 0.0008           # of epochs at the cpu scale (50,000 -> 40)
CPU_FIXED = dict(device='cpu', forward_dtype='float32', loss_dtype='float32', xla_cache_dir='',
                 global_batch_size=32,
                 lr=2e-3, lr_warmup_steps=30, weight_decay=0.1, puzzle_emb_ndim=0, ema_rate=0.99,
                 eval_subset=0,
                 log_interval=25, checkpoint_interval=50, num_heads=2,
                 # the reference's 256 would keep every twin's SwiGLUs 256 wide whatever its width (hidden_size / 16)
                 mlp_multiple=32)
CPU_SUDOKU = dict(size=4, pool=1000, num_test=200, puzzles_div=5, aug_div=100)
# The maze twin trains the mlp_t variant at batch 64: attention with RoPE stays on its copying plateau for thousands of
# steps on 8x8 mazes (the reference's model too), so an attention twin could only ever report zeros.
CPU_MAZE = dict(size=8, train=2400, num_test=100, batch=64, mlp_t=True, pos_encodings='none')
# the real datasets' sizes, for costs before they are built
# (shapes from the folder's name: puzzles.shape_from_name)
SUDOKU_EXTREME = dict(num_puzzle_identifiers=1, test=422_786)
MAZE_HARD = dict(num_puzzle_identifiers=1, groups=1000, test=1000, gpu_batch=128)  # gpu scale: 900-token rows
# ARC-AGI-1 + ConceptARC (prepare_arc.py --version 1): 960 tasks (train groups), 400 of them evaluated; the sizes of
# the builds measured at num_aug 10, 100 and 1000 (docs/arc.md): (identifiers, train rows, test rows). Another
# num_aug is interpolated, per (num_aug + 1), linearly in log(num_aug) between the two nearest (beyond them: the
# nearest's ratio): a task of few colours and symmetric grids has fewer distinct augmentations than asked, so the
# counts grow a little slower than num_aug (at 1000: 91% of 960 x 1001 puzzles).
ARC1_SIZES = {10: (10_559, 43_862, 4_607), 100: (95_993, 398_598, 41_907), 1000: (876_406, 3_633_410, 385_815)}
ARC1 = dict(groups=960, seq_len=900, vocab_size=12)
# the cpu twin of an ARC run: synthetic tasks on a 10x10 canvas (prepare_arc.py --synthetic), num_aug / aug_div
# augmentations: 128 tasks (96 trained + 32 whose test outputs are held out) x (num_aug + 1) puzzles of about 3.75
# rows; a fifth of the cpu scale's epochs, 16 (about 240 steps at batch 32)
CPU_ARC = dict(canvas=10, num_tasks=96, num_eval_tasks=32, aug_div=10, mean=3.75, epochs_div=5)
# differ between runs without changing what is trained
NOT_VARIED = ('out_dir', 'wandb_run_name', 'local_dir')
RUNNER_KEYS = ('out_dir', 'local_dir', 'init_from', 'eval_only')  # the runner sets them for every run
# keys that do not change what a run trains or its results: a finished run recorded with other values of
# these is still the run the study asks for
NOT_SHAPING = ('out_dir', 'local_dir', 'data_cache_dir', 'init_from', 'overwrite', 'eval_only',
               'eval_batch_size', 'log_interval', 'checkpoint_interval', 'keep_last_n', 'wandb_log',
               'wandb_project', 'wandb_run_name', 'tensorboard', 'profile_steps', 'device', 'compile', 'kernels',
               'xla_cache_dir', 'gcs_retries', 'watchdog_minutes', 'check_memory')
EVAL_FILE = re.compile(r'views(\d+)-steps(\d+)\.json')  # train.py --eval_only's record in <out_dir>/evals


@dataclass
class Options:
    """What every run of one study shares: study.py's keys, read once there (its config block holds the
    defaults)."""
    scale: str          # 'full' | 'gpu' | 'cpu' (SCALE_ROOTS)
    root: str           # out_root: a run goes to root/<name of its file's out_dir>; gs:// allowed
    local_root: str     # root's local folder (root itself unless gs://): each run's local_dir
    data_root: str      # the cpu scale's generated datasets
    config_dir: str     # the experiment files
    extra: dict         # --extra as train.py keys and values
    extra_args: list    # --extra as flags, added to every command
    nproc: int          # processes per run (torchrun above 1)
    seeds: int          # runs per experiment: seeds 0 .. seeds-1


# -----------------------------------------------------------------------------
# experiment files: train.py's config as each file sets it

def natural_key(s):
    return [int(t) if t.isdigit() else t for t in re.split(r'(\d+)', s)]


def fmt_value(v):
    return repr(v) if isinstance(v, float) else str(v)


def read_renamed(path):
    """A script's _renamed ({old key: (its new name, a note)}: its keys of earlier releases), read from its source
    (train.py is a script, never imported)."""
    for n in ast.parse(open(path).read()).body:
        if isinstance(n, ast.Assign) and any(getattr(t, 'id', None) == '_renamed' for t in n.targets):
            v = n.value
            return {k.arg: ast.literal_eval(k.value) for k in v.keywords} if isinstance(v, ast.Call) else \
                ast.literal_eval(v)
    return {}


TRAIN_RENAMED = read_renamed(os.path.join(HERE, 'train.py'))


def read_meta(path):
    """The '_' names of a config file (_base, _prepare): study.py's, not train.py's. Those of its _base chain
    come first, as its keys do (configurator.config_files has refused a chain that loops)."""
    scope = {}
    path = find_file(path)
    exec(compile(open(path).read(), path, 'exec'), scope)  # one namespace, as configurator.config_files has
    meta = {k: v for k, v in scope.items() if k.startswith('_') and not k.startswith('__')}
    if not isinstance(meta.get('_base'), str):
        return meta
    inherited = read_meta(meta['_base'])
    if 'data_path' in scope:  # a dataset of its own: the base's _prepare builds the base's
        inherited.pop('_prepare', None)
    return {**inherited, **meta}


def effective(path):
    """(train.py's config for this file, as configurator.py applies it: defaults, _base chain, the file; its
    '_' names; where each key was set: {key: (file, line)}). What train.py would refuse (an unknown key, another
    type, a value its rules forbid) is a SystemExit of one line per problem in train.py's words, naming the file
    and line: said before a dry run costs it (a zero batch divides by zero) and before anything runs."""
    cfg, set_at, bad = dict(TRAIN_DEFAULTS), {}, []
    for p, keys in config_files(path, keys=TRAIN_DEFAULTS):
        at = places(p, keys)
        for k, v in keys.items():
            where = place_words(at[k])
            if problem := key_problem(k, where, TRAIN_DEFAULTS, TRAIN_RENAMED) or \
                    type_problem(k, v, TRAIN_DEFAULTS[k], where):
                bad.append(problem)  # the value before it stays, for the rules below
            else:
                cfg[k], set_at[k] = v, at[k]
    bad += config_problems(cfg, set_at)
    if bad:
        raise SystemExit('\n'.join(f"config error: {b}" for b in bad))
    return cfg, read_meta(path), set_at


# -----------------------------------------------------------------------------
# datasets: what a data_path is, at each scale, and the command that builds it

UNREADABLE = set()  # the dataset.json problems said (once a study)


def dataset_for(cfg, meta, opts, read_built=True):
    """The dataset a run uses at opts.scale: path, build command (None: unknown), kind, training puzzles
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
        if opts.scale == 'cpu':
            c, root = CPU_SUDOKU, opts.data_root
            k, a = max(1, K // c['puzzles_div']), A // c['aug_div']
            d.update(path=f"{root}/sudoku{c['size']}-{k}-aug-{a}", puzzles=k, aug=a, groups=k,
                     vocab_size=c['size'] + 2, seq_len=c['size'] ** 2, test=c['num_test'],
                     build=['prepare_sudoku.py', '--generate', str(c['pool']), '--size', str(c['size']),
                            '--num_test', str(c['num_test']), '--subsample_size', str(k), '--num_aug', str(a),
                            '--seed', '0', '--output_dir', f"{root}/sudoku{c['size']}-{k}-aug-{a}"])
    elif re.fullmatch(r'maze-30x30-hard-1k', name):
        d.update(kind='maze', puzzles=1000, aug=0, **MAZE_HARD)
        if d['build'] is None:
            d['build'] = ['prepare_maze.py', '--output_dir', path]
        if opts.scale == 'cpu':
            c = CPU_MAZE
            p = f"{opts.data_root}/maze{c['size']}-{c['train']}"
            d.update(path=p, puzzles=c['train'], groups=c['train'], seq_len=c['size'] ** 2,
                     test=c['num_test'],
                     build=['prepare_maze.py', '--generate', str(c['train']), '--size', str(c['size']),
                            '--num_test', str(c['num_test']), '--output_dir', p])
    m = re.fullmatch(r'arc1concept-aug-(\d+)', name)
    if m:
        A = int(m[1])
        ids, train_rows, test_rows = arc1_sizes(A)
        d.update(kind='arc', puzzles=ARC1['groups'], aug=A, groups=ARC1['groups'], seq_len=ARC1['seq_len'],
                 vocab_size=ARC1['vocab_size'], num_puzzle_identifiers=ids, mean=train_rows / (ids - 1),
                 test=test_rows)
        if d['build'] is None:
            d['build'] = ['prepare_arc.py', '--version', '1', '--num_aug', str(A), '--output_dir', path]
        if opts.scale == 'cpu':
            c = CPU_ARC
            a = max(1, A // c['aug_div'])
            p = f"{opts.data_root}/arc-synthetic-{c['canvas']}-aug-{a}"
            tasks = c['num_tasks'] + c['num_eval_tasks']
            d.update(path=p, puzzles=tasks, aug=a, groups=tasks, seq_len=c['canvas'] ** 2, mean=c['mean'],
                     num_puzzle_identifiers=tasks * (a + 1) + 1, test=c['num_eval_tasks'] * (a + 1),
                     build=['prepare_arc.py', '--synthetic', '--canvas', str(c['canvas']), '--num_tasks',
                            str(c['num_tasks']), '--num_eval_tasks', str(c['num_eval_tasks']), '--num_aug', str(a),
                            '--output_dir', p])
    metas = [os.path.join(d['path'], s, 'dataset.json') for s in ('train', 'test')]
    d['exists'] = all(os.path.exists(p) for p in metas)
    if d['exists'] and read_built:  # the real sizes
        from data import load_metadata
        try:
            tr, te = (load_metadata(d['path'], s) for s in ('train', 'test'))
        except ValueError as ex:  # cut short, hand-edited: said once; its runs fail at start, naming it too
            if str(ex) not in UNREADABLE:
                UNREADABLE.add(str(ex))
                print(f"study: warning: {ex}: the sizes of {d['path']} are not read from it (its runs fail at start)")
            return d
        # counted from the arrays where they can be read: the reference's builders write the group count as
        # total_puzzles
        test, puzzles = rows(d['path'], 'test', 'inputs'), rows(d['path'], 'train', 'puzzle_indices')
        d.update(groups=tr['total_groups'], mean=tr['mean_puzzle_examples'], vocab_size=tr['vocab_size'],
                 seq_len=tr['seq_len'], num_puzzle_identifiers=tr['num_puzzle_identifiers'],
                 test=test if test is not None else int(te['total_puzzles'] * te['mean_puzzle_examples']),
                 kind=d['kind'] or tr.get('puzzle_type'))
        if d['puzzles'] is None:
            puzzles = puzzles - 1 if puzzles else tr['total_puzzles']
            d.update(puzzles=tr['total_groups'], aug=round(puzzles / tr['total_groups']) - 1)
    return d


def rows(root, split, name):
    """The length of a split's all__<name>.npy, from its header alone; None where it cannot be read."""
    try:
        return len(np.load(os.path.join(root, split, f'all__{name}.npy'), mmap_mode='r'))
    except (OSError, ValueError, EOFError):
        return None


def arc1_sizes(num_aug):
    """(identifiers, train rows, test rows) of prepare_arc.py --version 1 at num_aug: measured (ARC1_SIZES), else
    interpolated per (num_aug + 1) in log(num_aug) between the nearest measured builds."""
    import math
    if num_aug in ARC1_SIZES:
        return ARC1_SIZES[num_aug]
    known = sorted(ARC1_SIZES)
    lo = max([k for k in known if k < num_aug] or known[:1])
    hi = min([k for k in known if k > num_aug] or known[-1:])
    t = 0.0 if lo == hi else (math.log(max(num_aug, 1)) - math.log(lo)) / (math.log(hi) - math.log(lo))
    t = min(max(t, 0.0), 1.0)
    out = []
    for i in range(3):
        a, b = (ARC1_SIZES[lo][i] - (i == 0)) / (lo + 1), (ARC1_SIZES[hi][i] - (i == 0)) / (hi + 1)
        out.append(round((a + t * (b - a)) * (num_aug + 1)) + (i == 0))
    return tuple(out)


def build_display(cmd):
    return ' '.join(shlex.quote(x) for x in ['python'] + cmd)


# -----------------------------------------------------------------------------
# experiments

def seeded(name, seed):
    """A run's label or folder for seed `seed`: seed 0's is the file's own, as without --seeds."""
    return name + (f"-s{seed}" if seed else '')


class Experiment:
    """One config file at the study's scale (opts): its family, varied keys, out_dir, dataset, train.py flags
    and command."""

    def __init__(self, path, opts, name=None, seed=0):
        self.path, self.name, self.seed, self.opts = path, name or os.path.basename(path)[:-3], seed, opts
        self.run = seeded(self.name, seed)  # the run's label: one per seed
        self.family = family_of(self.name)
        self.cfg, self.meta, set_at = effective(path)
        if opts.seeds > 1 and self.cfg['seed'] != TRAIN_DEFAULTS['seed']:
            # its seed-0 run would train this seed, which a seed s run may train again: one run, two seeds
            raise SystemExit(f"config error: {place_words(set_at['seed'])} sets seed = {self.cfg['seed']!r}, and "
                             f"--seeds={opts.seeds} trains seeds 0 .. {opts.seeds - 1} (allowed: one of them)")
        base = self.meta.get('_base')
        self.base_cfg = effective(base)[0] if base else dict(TRAIN_DEFAULTS)
        self.varied = {k: v for k, v in self.cfg.items() if v != self.base_cfg.get(k) and k not in NOT_VARIED}
        self.data = dataset_for(self.cfg, self.meta, opts)
        leaf = seeded(self.cfg['out_dir'].rstrip('/').split('/')[-1], seed)
        self.out_dir, self.local = f"{opts.root}/{leaf}", os.path.join(opts.local_root, leaf)
        self.twin_note = ''  # what the cpu twin trains where it differs in kind from the file
        self.flags = self.scale_flags()
        self.flags['out_dir'] = self.out_dir
        if seed:  # seed 0 is the file's own (train.py's default): its folder and flags stay as without
                  # --seeds
            self.flags['seed'] = seed
            if self.cfg['wandb_run_name']:
                self.flags['wandb_run_name'] = seeded(self.cfg['wandb_run_name'], seed)
        if gcs.is_gcs(opts.root):
            self.flags['local_dir'] = self.local
        self.run_cfg = {**self.cfg, **self.flags, **opts.extra}
        # what the scale and --extra make of a file train.py takes (--extra=--global_batch_size=0 included)
        set_at = {**set_at, **{k: (f'--scale={opts.scale}', None) for k in self.flags},
                  **{k: ('--extra', None) for k in opts.extra}}
        if bad := config_problems(self.run_cfg, set_at):
            raise SystemExit('\n'.join(f"config error: {b}" for b in bad))
        nproc = opts.nproc
        launcher = ['train.py'] if nproc == 1 else ['-m', 'torch.distributed.run', '--standalone',
                                                     f'--nproc_per_node={nproc}', 'train.py']
        # every run resumes its own checkpoints; one whose file starts from a checkpoint (an adaptation) starts
        # from it while it has none
        start = self.cfg['init_from']
        resume = start if start.startswith('resume') else 'resume' if start == 'scratch' else 'resume:' + start
        self.cmd = launcher + [path] + [f"--{k}={fmt_value(v)}" for k, v in self.flags.items()] + \
            list(opts.extra_args) + [f'--init_from={resume}']
        shown = (['torchrun'] + self.cmd[2:]) if nproc > 1 else (['python'] + self.cmd)
        # cpu scale: one thread per run. These models are too small to gain from a second thread, and beside
        # other jobs a multi-threaded one crawls. A value set by the user is kept.
        self.env = {'OMP_NUM_THREADS': '1'} if opts.scale == 'cpu' and 'OMP_NUM_THREADS' not in os.environ else {}
        self.display = ' '.join([f"{k}={v}" for k, v in self.env.items()] + [shlex.quote(x) for x in shown])
        self.same_as = None  # the experiment whose run (out_dir) this one shares
        self.family_keys = []  # set by load_experiments: the keys any member of the family changes

    def scale_flags(self):
        c, o, scale = self.cfg, {}, self.opts.scale
        if scale == 'gpu':
            o['epochs'] = max(1, round(c['epochs'] * GPU_FRACTION))
            o['eval_every_epochs'] = max(1, round(c['eval_every_epochs'] * GPU_FRACTION))
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
            if self.data['kind'] == 'maze':
                o['global_batch_size'] = round(o['global_batch_size'] * CPU_MAZE['batch']
                                               / CPU_FIXED['global_batch_size'])
                o.update(mlp_t=CPU_MAZE['mlp_t'], pos_encodings=CPU_MAZE['pos_encodings'])
                self.twin_note = 'cpu twin: mlp_t, no positions'
            # halt_max_steps / 4 (16 -> 4); below 4 kept (abl_halt1, abl_halt2), so abl_halt2 and abl_halt8
            # both train 2 steps at this scale
            o['halt_max_steps'] = c['halt_max_steps'] if c['halt_max_steps'] < 4 else c['halt_max_steps'] // 4
            if self.data['kind'] == 'arc':
                # ARC needs its puzzle embedding (a task is told only by it): kept ON at the width / 16; its
                # synthetic tasks need fewer epochs (about 240 steps)
                o['puzzle_emb_ndim'] = max(8, c['puzzle_emb_ndim'] // 16)
                self.twin_note = 'cpu twin: synthetic 10x10 ARC tasks'
            elif not c['puzzle_emb_ndim'] and b['puzzle_emb_ndim']:
                # every cpu twin runs without the embedding, the base too: so the twin of a file that turns it
                # off turns it on (at the width / 16), and the pair (cpu base, twin) shows the same contrast
                # reversed
                o['puzzle_emb_ndim'] = max(8, b['puzzle_emb_ndim'] // 16)
                self.twin_note = (f"cpu twin: puzzle_emb_ndim={o['puzzle_emb_ndim']}, the embedding ON "
                                  "against the cpu base's 0")
            o['eval_steps'] = 2 * o['halt_max_steps']  # test-time scaling: twice the trained steps
            o['epochs'] = max(1, round(c['epochs'] * CPU_FRACTION))
            if self.data['kind'] == 'arc':
                o['epochs'] = max(1, o['epochs'] // CPU_ARC['epochs_div'])
            o['eval_every_epochs'] = max(1, o['epochs'] // 2)
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
        return point_of(self.name)


def family_of(name):
    """An experiment's family: its name up to the last '_'; a name without one (a recipe of its own) is one."""
    return name.rsplit('_', 1)[0] if '_' in name else name


def point_of(name):
    """An experiment's point in its family: its name after the last '_' (a name without one: the name)."""
    return name[len(family_of(name)) + 1:] or name


def family_pattern(name):
    """The --pattern that selects an experiment's family: 'rec_*' for rec_L4; a name without '_', the name."""
    return family_of(name) + '_*' if '_' in name else name


def load_experiments(patterns, opts):
    """(every experiment's name in opts.config_dir, the Experiments the patterns select: each seed of each,
    in the patterns' order); names only without patterns. Experiments that are one run share it (same_as)."""
    config_dir = opts.config_dir
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
        fams = sorted({family_pattern(n) for n in names}, key=natural_key)
        raise SystemExit(f"no experiment matches {','.join(patterns)!r}; families: {', '.join(fams)}")
    exps, bad = [], []
    for n in chosen:  # every bad value of every file said at once, each line once (a shared _base's too)
        try:
            exps += [Experiment(os.path.join(config_dir, n + '.py'), opts, seed=s) for s in range(opts.seeds)]
        except SystemExit as ex:
            bad += [line for line in str(ex).splitlines() if line not in bad]
    if bad:
        raise SystemExit('\n'.join(bad))
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
    return has_file(e, 'results.json')


def has_file(e, name):
    return exists(f"{e.out_dir.rstrip('/')}/{name}")


def exists(path):
    """Whether a file is there, a local path or a gs:// object."""
    return gcs.object_exists(path) if gcs.is_gcs(path) else os.path.exists(path)


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
    why = resume_problem(e, steps)
    return (f"started (checkpoint at step {steps[-1]})" + (f", not used: {why}" if why else '')) if steps \
        else 'not started'


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
        what = results_problem(res)
    except (OSError, ValueError) as ex:
        what = 'empty' if os.path.isfile(path) and not os.path.getsize(path) else f"{type(ex).__name__}: {ex}"
    if what:
        return None, (f"unreadable results.json in {e.out_dir} ({what}); not reused: move it away and rerun "
                      "to evaluate the run's last checkpoint again")
    if diffs := config_diffs(e, res.get('config')):
        return None, (f"{e.out_dir}/results.json was made with another configuration ({diffs}): "
                      f"not reused, and not retrained over it: move {e.out_dir} away to train it again")
    return res, ''


def results_problem(res):
    """What in a results.json's value the study and its report could not use (a field missing, a string or a list
    where train.py writes a number or an object: a hand edit, a damaged copy), or ''."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    shown = lambda v: json.dumps(v)[:40]
    if not isinstance(res, dict):
        return f"it is {shown(res)}, not an object"
    fe = res.get('final_eval')
    if not isinstance(fe, dict):
        return f"its final_eval is {shown(fe)}, not an object"
    for where, d, keys in (('final_eval.', fe, ('exact_accuracy', 'exact_ci_low', 'exact_ci_high', 'token_accuracy',
                                                'q_halt_accuracy')),
                           ('', res, ('parameters', 'train_flops', 'flops_per_example_step'))):
        for k in keys:
            if not number(d.get(k)):
                return f"its {where}{k} is {shown(d.get(k))}, not a number"
    for k in ('config', 'best_eval', 'wall_s'):
        if res.get(k) is not None and not isinstance(res[k], dict):
            return f"its {k} is {shown(res[k])}, not an object"
    steps = fe.get('exact_by_steps')
    if steps is not None and not (isinstance(steps, list) and all(map(number, steps))):
        return f"its final_eval.exact_by_steps is {shown(steps)}, not a list of numbers"
    return ''


def config_diffs(e, recorded, then='there'):
    """Where a run's recorded config (its results.json's, a checkpoint's, or the one the study started with)
    and the command the study runs now differ, on the keys that shape the result (the dataset by its name: a copy
    elsewhere is the same data): "key 'recorded' there, 'now' now; ..." (`then` for 'there') or ''."""
    now, diffs = e.run_cfg, []
    for k, was in (recorded or {}).items():
        if k in NOT_SHAPING or k not in now:
            continue
        a, b = (str(was).rstrip('/').split('/')[-1], str(now[k]).rstrip('/').split('/')[-1]) \
            if k == 'data_path' else (was, now[k])
        if a != b:
            diffs.append(f"{k} {a!r} {then}, {b!r} now")
    return '; '.join(diffs)


def resume_problem(e, steps=None):
    """Why a started run (checkpoints, no results.json) is not resumed, as read_results says why a finished one
    is not reused: its newest readable checkpoint was saved with another configuration than the command the
    study runs now (a resume would finish a run of both, which its results.json would record as this one); ''
    when it resumes. steps: its checkpoint_steps, if listed already."""
    for step in reversed(checkpoint_steps(e) if steps is None else steps):
        name = checkpoint_name(step)
        local = os.path.join(e.local, name)
        path = local if os.path.exists(local) else fetch(e, name)
        try:  # its tensors mapped, not read: study.py's memory check takes its own size for each run's process
            saved = load_checkpoint(path, mmap=True)['config']
        except Exception:  # missing, unreadable or not train.py's: train.py tries an older one too, and says so
            continue
        if diffs := config_diffs(e, saved if isinstance(saved, dict) else {}):
            return (f"{e.out_dir}/{name} was saved with another configuration ({diffs}): not resumed, and not "
                    f"trained over: move {e.out_dir} away to train it again")
        return ''
    return ''


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
    frozen = bool(run_cfg.get('freeze_weights'))  # as train.py builds it: frozen weights get no gradient
    key = json.dumps(dict(kw, freeze_weights=frozen), sort_keys=True)
    if key not in _models:
        with torch.device('meta'):
            m = TRM(TRMConfig(**kw)).requires_grad_(not frozen)
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
    every = max(1, steps_for(c['eval_every_epochs'], d['groups'], d['mean'], B))
    middle = len(evaluation_steps(steps, every)) - 1  # and the final one
    sub = min(c['eval_subset'] or d['test'], d['test'])
    # train.py evaluates the raw weights too at an intermediate evaluation with an EMA (not at the final one),
    # and every pass runs each puzzle in eval_views views (evaluate.py)
    sub_passes = middle * (1 + bool(c['ema']))
    eval_flops = fwd * (c['eval_steps'] or c['halt_max_steps']) * c['eval_views'] * (sub_passes * sub + d['test'])
    return dict(params=params, fpe=fpe, steps=steps, batch=B, train_flops=fpe * steps * B,
                eval_flops=eval_flops, evals=middle + 1, passes=sub_passes + 1, views=c['eval_views'])


def flop_rate(opts, bench_file='', examples_per_s=0.0):
    """(FLOP/s, where it comes from, what bench_file benched: its 'bench:' line's keys, {} without one) of the
    device, from bench.py's figure: its output in bench_file, or its examples_per_s for config/baseline.py at
    opts.scale; (None, why not, {}) without one."""
    if bench_file:
        want = ("(expected: bench.py's output, whose last 'bench:' line gives examples_per_s=N and "
                "flops_per_example=N)")
        try:
            lines = [l for l in open(bench_file).read().splitlines() if l.startswith('bench:')]
        except (OSError, UnicodeDecodeError) as ex:
            raise SystemExit(f"config error: bench_file={bench_file!r} cannot be read "
                             f"({getattr(ex, 'strerror', None) or ex}) {want}")
        if not lines:
            raise SystemExit(f"config error: bench_file={bench_file!r} has no 'bench:' line {want}")
        kv = dict(t.split('=', 1) for t in lines[-1].split()[1:] if '=' in t)
        try:
            eps, fpe = float(kv['examples_per_s']), float(kv['flops_per_example'])
        except (KeyError, ValueError):
            eps = fpe = float('nan')
        if not (0 < eps < float('inf') and 0 < fpe < float('inf')):  # missing, or no speed at all (0, nan, inf)
            raise SystemExit(f"config error: bench_file={bench_file!r}: its last 'bench:' line has no finite "
                             f"positive examples_per_s and flops_per_example {want}")
        rate = eps * fpe
        shape = ' '.join(f"{k}={kv[k]}" for k in BENCH_SHAPE if k in kv)
        return rate, (f"{bench_file} ({shape}): {eps:.1f} examples/s x {fpe / 1e9:.2f} GFLOPs = "
                      f"{rate / 1e12:.3g} TFLOP/s"), kv
    if examples_per_s > 0:
        ref = Experiment(os.path.join(HERE, 'config', 'baseline.py'), opts, 'baseline')
        rc = cost(ref)
        if not rc or 'error' in rc:
            raise SystemExit("cannot cost config/baseline.py at this scale for --examples_per_s")
        rate = examples_per_s * rc['fpe']
        return rate, (f"--examples_per_s={examples_per_s:g} for config/baseline.py at scale {opts.scale} "
                      f"({rc['fpe'] / 1e9:.3g} GFLOPs per example-step) = {rate / 1e12:.3g} TFLOP/s"), {}
    return None, ("no speed figure given, so no time estimate: run `python bench.py config/baseline.py` with "
                  "this scale's flags on the target device and pass --examples_per_s=<its examples/s> (or "
                  "--bench_file=<a file with its output>)"), {}


# what a 'bench:' line says of the run it timed, which a FLOP rate depends on besides the FLOPs
BENCH_SHAPE = ('device', 'dtype', 'batch', 'seq_len', 'params')


def bench_mismatch(bench, exps):
    """'' when the bench timed one of these runs' shape, else one line saying what it timed against what the
    runs are. A run's device or dtype 'auto' is decided on the machine that runs it, so it matches any."""
    runs = {k: set() for k in BENCH_SHAPE}
    for e in exps:
        c = cost(e)
        if e.same_as or not c or 'error' in c:
            continue
        for k, v in (('device', e.run_cfg['device']), ('dtype', e.run_cfg['forward_dtype']), ('batch', c['batch']),
                     ('seq_len', e.data['seq_len']), ('params', c['params'])):
            runs[k].add(str(v))
    runs = {k: v for k, v in runs.items() if v and k in bench and 'auto' not in v}
    if not runs or all(bench[k] in v for k, v in runs.items()):
        return ''
    theirs = ' '.join(f"{k}={'/'.join(sorted(v, key=natural_key))}" for k, v in runs.items())
    ours = ' '.join(f"{k}={bench[k]}" for k in runs)
    return (f"note: the bench timed {ours}, not the shape of these runs ({theirs}): its FLOP rate is applied to "
            f"each run's FLOPs as it is, though a rate changes with the device, dtype, batch and width, so the "
            f"times below can be several times off; bench one of the runs' own commands (bench.py takes train.py's "
            f"config file and flags) for a closer figure")


def duration(s):
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def run_flops(e, data=None):
    """A run's FLOPs, training and evaluation (None: unknown, or the model cannot be built)."""
    c = cost(e, data)
    return c['train_flops'] + c['eval_flops'] if c and 'error' not in c else None


def share_cost(e):
    """A run's FLOPs from its config and the datasets' known sizes only, never a local dataset.json: every
    host of a pod computes the same numbers, so the same partition."""
    return run_flops(e, dataset_for(e.cfg, e.meta, e.opts, read_built=False))


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


def order_runs(runs, costs, slots):
    """The order runs start in: the list's (names, naturally sorted) with one slot; longest first with more,
    which shortens the study (the results do not depend on the order)."""
    if slots == 1:
        return list(runs)
    return [r for _, r in sorted(zip(costs, runs), key=lambda x: (-(x[0] or 0), natural_key(x[1].run)))]


# -----------------------------------------------------------------------------
# saved evaluations: train.py --eval_only's records in <out_dir>/evals

def own_steps(e):
    """The supervision steps a run evaluates by itself (train.py: eval_steps, else halt_max_steps)."""
    return e.run_cfg['eval_steps'] or e.run_cfg['halt_max_steps']


def saved_evals(e, res=None):
    """{(views, steps): local path} of a run's saved re-evaluations, from its folder and, for a gs:// run, its
    bucket (downloaded beside the local copies); with `res` (its results.json), only those of its checkpoint."""
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
        if (m := EVAL_FILE.fullmatch(n)) and (res is None or not other_checkpoint(os.path.join(folder, n), res)):
            found[int(m[1]), int(m[2])] = os.path.join(folder, n)
    return found


def other_checkpoint(path, res):
    """Why the saved re-evaluation at path is not of the checkpoint results.json `res` is of, or '' when it is.
    A roll-back or an --overwrite run may reach the same step with other weights: each save has its own
    checkpoint_id (a results.json without one, of an older trainer, is matched by its step)."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as ex:  # cut short, empty: not to be told as an evaluation of step None
        return f"cannot be read ({'empty' if isinstance(ex, ValueError) and not os.path.getsize(path) else ex})"
    if not isinstance(rec, dict):
        return "is not a record of an evaluation (a JSON object)"
    step, cid = rec.get('step'), rec.get('checkpoint_id')
    if step != res.get('step'):
        return f"evaluated step {step}, not results.json's {res.get('step')}"
    if res.get('checkpoint_id') and cid != res['checkpoint_id']:
        return f"evaluated another checkpoint of step {step} than results.json's (a run rolled back or overwritten)"
    return ''

