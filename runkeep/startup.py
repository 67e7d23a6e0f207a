"""
The checks before a run's first step, as verdicts every rank agrees on (Device.agree), so all ranks stop together
with one message: the data, the batch sizes, init_from, the out_dir, the memory the run needs (memory.py), and
every host's config, dataset and code compared. A function that more than rank 0 needs is called by every rank at
the same point: a device value is read on every rank before rank 0 alone writes files.
"""
import glob
import hashlib
import json
import os
import re

import numpy as np

from data import check_split, load_arrays, load_metadata
from device import resident_bytes, size
from puzzles import puzzle_for, puzzle_type, views_problem

from . import gcs
from .locks import release_locks
from .memory import config_memory, config_shape, describe, headroom, latent_bytes, memory_problem, need
from .records import CKPT_RE

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root

# the code whose copies every host must share (a pod runs one command on every host): every file beside
# train.py and in its packages, so a new file is compared as soon as it is there
PACKAGE_FILES = [f for f in glob.glob(os.path.join(HERE, '*', '*.py'))
                 if os.path.isfile(os.path.join(os.path.dirname(f), '__init__.py'))]
CODE_FILES = sorted(glob.glob(os.path.join(HERE, '*.py')) + PACKAGE_FILES)


def fingerprint(text):
    """A 24-bit hash of text: exact in float32, so ranks can compare it with a min/max reduction."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], 'big')


def fail_together(dev, problems, what):
    """Every rank learns whether any rank has a problem, and then all exit with one message (the out_dir's
    lock removed first: a torch_xla worker process ends without running atexit)."""
    failed = dev.agree([float(r == dev.rank and bool(problems)) for r in range(dev.world_size)])
    ranks = [r for r in range(dev.world_size) if failed[r] > 0]
    if ranks:
        where = f" on rank(s) {ranks}" if dev.world_size > 1 else ''
        mine = '; '.join(problems) if problems else f"see rank {ranks[0]}'s output"
        release_locks()
        dev.shutdown()
        raise SystemExit(f"{what} failed{where}: {mine}")


def fail_if_ranks_differ(dev, values, problem):
    """fail_together when the ranks hold different values (fingerprints of what they loaded or read)."""
    lows, highs = dev.agree(values, 'min'), dev.agree(values, 'max')
    differ = [i for i, (lo, hi) in enumerate(zip(lows, highs)) if lo != hi]
    fail_together(dev, [problem(differ)] if differ and dev.master else [], 'host agreement')


def data_shape(meta):
    """What a model trained on a dataset is bound to: its puzzle kind, sequence length and vocabulary."""
    return dict(puzzle_type=puzzle_type(meta), seq_len=int(meta['seq_len']),
                vocab_size=int(meta['vocab_size']))


def describe_data(shape):
    """A few words on data_shape's dict (or the part of it a checkpoint saved): '4x4 Sudokus of seq_len 16,
    vocab_size 6'."""
    kind = puzzle_for(shape) if shape.get('puzzle_type') else None
    return (f"{kind.titles if kind else 'puzzles'} of seq_len {shape['seq_len']}"
            + (f", vocab_size {shape['vocab_size']}" if 'vocab_size' in shape else ''))


def startup_problems(cfg, dev):
    """What a run needs of its data, batch sizes, init_from and out_dir, checked before the first step on
    every rank: [message]. Each rank sees its own files (a pod's hosts each have their own disk), so each checks
    them. (The checkpoints already in out_dir: checkpoint.checkpoint_problems.)"""
    problems, shapes, root = [], {}, cfg['data_path']
    for split in ('train', 'test'):
        found = check_split(root, split)
        problems += found
        if not found:
            shapes[split] = data_shape(load_metadata(root, split))
    if len(shapes) == 2 and shapes['train'] != shapes['test']:  # a half-done rebuild, or splits of two
                                                                # datasets
        problems.append(f"{root}: the train split holds {describe_data(shapes['train'])}, the test split "
                        f"{describe_data(shapes['test'])}; rebuild the dataset whole (prepare_sudoku.py / "
                        f"prepare_maze.py) or point data_path at one whose splits agree")
    if len(shapes) == 2:  # the model's puzzle-embedding table is the train split's: the evaluation indexes it
        table = load_metadata(root, 'train')['num_puzzle_identifiers']
        ids = load_arrays(root, 'test')['puzzle_identifiers']
        if len(ids) and (top := int(ids.max())) >= table:
            problems.append(f"{os.path.join(root, 'test', 'all__puzzle_identifiers.npy')} holds the identifier "
                            f"{top}; the train split has num_puzzle_identifiers={table}: the test split names "
                            "puzzles the model has no embedding of. Rebuild the dataset whole")
    problems += init_from_problems(cfg['init_from'])
    B, k, n = cfg['global_batch_size'], cfg['gradient_accumulation_steps'], dev.world_size
    if B % (n * k):  # one line for the training batch: the accumulation named where there is one
        problems.append(f"global_batch_size={B} is not divisible by the world size {n}"
                        + (f" x gradient_accumulation_steps={k}" if k > 1 else ''))
    if cfg['eval_batch_size'] and cfg['eval_batch_size'] % n:  # unset, it is global_batch_size's
        problems.append(f"eval_batch_size={cfg['eval_batch_size']} is not divisible by the world size {n}")
    out_dir = cfg['out_dir']
    if dev.hosts > 1 and not gcs.is_gcs(out_dir):
        problems.append(f"out_dir={out_dir!r} is local, but the run spans {dev.hosts} hosts: only one would "
                        "hold the checkpoints; use --out_dir=gs://BUCKET/...")
    if len(shapes) == 2 and not problems:
        problems += memory_problems(cfg, dev, load_metadata(root, 'train'))
    return problems


def init_from_problems(init_from):
    """[message] when init_from names nothing a run can start from: a file missing on this host or a folder, or
    'resume:' followed by no file. A missing FILE of 'resume:FILE' is no problem yet: the run's own checkpoints,
    when out_dir holds any, are resumed without it (Run.resume says when it is needed and missing)."""
    allowed = "init_from is 'scratch', 'resume', a checkpoint file, 'resume:FILE' or hf://OWNER/REPO/PATH/step_<N>"
    if init_from.startswith('resume:'):
        after = init_from[len('resume:'):]
        if after in ('', 'scratch', 'resume') or after.startswith('resume:'):
            return [f"init_from={init_from!r}: 'resume:' is followed by the checkpoint file to start from while "
                    "out_dir holds no checkpoint of the run; to resume out_dir's checkpoints alone use "
                    "--init_from=resume"]
        return [f"init_from={init_from}: {after} is a folder, not a checkpoint file"] if os.path.isdir(after) else []
    if init_from in ('scratch', 'resume') or os.path.isfile(init_from):
        return []
    what = 'a folder, not a checkpoint file' if os.path.isdir(init_from) else 'no such file on this host'
    newest = newest_in(init_from if os.path.isdir(init_from) else os.path.dirname(init_from))
    return [f"init_from={init_from}: {what}" + (f"; the newest checkpoint there: --init_from={newest}" if newest
                                                 else f" ({allowed})")]


def newest_in(folder, reference=True):
    """The newest checkpoint in folder (ours, ckpt_<N>.pt, or the reference's step_<N>; reference=False: ours
    alone, as publish.py publishes those), or None: what a user who named the folder, or a step a shorter run did
    not reach, most likely meant."""
    try:
        names = os.listdir(folder or '.')
    except OSError:
        return None
    numbered = [(int(m.group(1)), n) for n in names
                if (m := CKPT_RE.fullmatch(n) or reference and re.fullmatch(r'step_(\d+)', n))]
    return os.path.join(folder, max(numbered)[1]) if numbered else None


def memory_problems(cfg, dev, meta):
    """A CPU or CUDA run this machine cannot carry, found before anything is allocated: memory.run_memory of its
    config, dataset and batch against what this process may still allocate (a CPU: the host's ranks share its
    MemAvailable and cgroup, each has RLIMIT_AS to itself) or its GPU's free memory; [message]. Rank 0 says
    the estimate in a line when it is over half of that. check_memory=False, XLA and TorchTPU: not checked."""
    if not cfg['check_memory'] or dev.type not in ('cpu', 'cuda'):
        return []
    views, train = cfg['eval_views'], not cfg['eval_only']
    eval_rows = (cfg['eval_batch_size'] or cfg['global_batch_size']) // dev.world_size
    shape = config_shape(cfg, meta, dev.type)
    row_bytes = latent_bytes(shape)
    if views_problem(puzzle_for(meta), views, eval_rows, row_bytes):
        return []  # train.py refuses those views in their own words, before any allocation
    processes = int(os.environ.get('LOCAL_WORLD_SIZE', 1)) if dev.type == 'cpu' else 1  # sharing its memory
    parts = config_memory(cfg, meta, dev.type, dev.world_size)
    (give, where), own = headroom(dev)  # own: a limit of this process's own (RLIMIT_AS), for one process's need
    problem = memory_problem(parts, processes, 'this run' if train else 'this evaluation', where, give,
                             '--check_memory=False', own)
    close = [(g, w, n) for g, w, n in ((give, where, processes), (*own, 1)) if g is not None
             and g / 2 < n * need(parts)]
    if dev.master and close and not problem:  # a close fit, said
        g, w, n = close[0]
        print(f"memory: about {size(need(parts))} more than the {size(resident_bytes())} this process holds "
              f"({describe(parts)})" + (f", {n} processes" if n > 1 else '') + f"; {size(g)} {w}")
    return [problem] if problem else []


def hosts_differ(dev, cfg, data_path, rows):
    """fail_together when the hosts differ in their config, dataset metadata, dataset contents (rows: sampled_rows
    of data_path) or code (CODE_FILES)."""
    code = ''.join(open(f).read() for f in CODE_FILES)
    meta = ''.join(open(os.path.join(data_path, s, 'dataset.json')).read() for s in ('train', 'test'))
    names = ('config', 'dataset metadata', 'dataset contents', 'code')
    values = [fingerprint(json.dumps(cfg, sort_keys=True)), fingerprint(meta), fingerprint(rows),
              fingerprint(code)]
    fail_if_ranks_differ(dev, values, lambda i: f"the hosts differ in their {', '.join(names[k] for k in i)}: "
                                                "copy the same files to every host")


def sampled_rows(data_path, rows=64):
    """A digest of `rows` evenly spaced rows of every array of both splits: a copy rebuilt with another seed has
    the same dataset.json and other examples, and hashing whole files would read a large dataset at every start."""
    h = hashlib.sha256()
    for split in ('train', 'test'):
        for name, a in sorted(load_arrays(data_path, split).items()):
            picked = np.unique(np.linspace(0, len(a) - 1, rows).astype(np.int64)) if len(a) else []
            h.update(f'{split}/{name}{a.shape}{a.dtype}'.encode() + np.ascontiguousarray(a[picked]).tobytes())
    return h.hexdigest()


def fetch_data(path, cache, dev):
    """The local copy of a gs:// data_path (one process per host fetches it into `cache`, the others wait);
    a local path as it is."""
    if not gcs.is_gcs(path):
        return path
    problems = []
    if dev.local_rank == 0:
        try:
            gcs.fetch_tree(path, cache)
        except Exception as e:
            problems = [f"cannot fetch {path}: {e}"]
    fail_together(dev, problems, f'fetching {path}')
    dev.barrier()
    return gcs.cached_copy(path, cache)  # complete now


def local_folder(out_dir):
    """The default local copy of a gs:// out_dir: out/BUCKET/PREFIX, one folder per out_dir (two runs ending
    in the same name never share one)."""
    bucket, prefix = gcs.split_gcs(out_dir)
    return os.path.join('out', bucket, *[p for p in prefix.split('/') if p not in ('', '.', '..')])

