"""
Datasets on disk, the loaders that feed train.py, and the download helper, shared by the trainer, solve.py
and the prepare_*.py builders (what a puzzle is, its tokens and its verifier, is puzzles.py's).

Layout (the reference implementation's, so either side reads the other's datasets):
    <root>/<split>/dataset.json
    <root>/<split>/all__{inputs,labels,puzzle_identifiers,puzzle_indices,group_indices}.npy
    <root>/identifiers.json
puzzle_indices are example offsets per puzzle, group_indices puzzle offsets per group (a puzzle and
its augmentations form one group).
"""
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import sys
import time

import numpy as np
import requests

from configurator import file_in_the_way

IGNORE_LABEL_ID = -100  # what the loss ignores; the dataset's own ignore_label_id is mapped to it
METADATA_FIELDS = ('pad_id', 'ignore_label_id', 'blank_identifier_id', 'vocab_size', 'seq_len',
                   'num_puzzle_identifiers', 'total_groups', 'mean_puzzle_examples', 'total_puzzles', 'sets')
ARRAY_NAMES = ('inputs', 'labels', 'puzzle_identifiers', 'puzzle_indices', 'group_indices')
IN_USE = '.in_use.'  # a running run's mark in its dataset's folder: .in_use.<host>.<pid>

# -----------------------------------------------------------------------------
# writing (used by the prepare_*.py builders)

class WriteError(RuntimeError):
    """A file a builder could not write (a full disk, a file-size limit): the message names it, one line."""


def cannot_write(path, e):
    return WriteError(f"cannot write {path}: {e.strerror or e}")


@contextlib.contextmanager
def writing(path, mode='w', **kw):
    """open(path, mode) for a builder's output: an OSError while the file is opened, written or closed (the OS
    error alone names no file) becomes a WriteError naming it."""
    try:
        with open(path, mode, **kw) as f:
            yield f
    except OSError as e:
        raise cannot_write(path, e) from e


class _Writes:
    """A file that numpy writes through .write, in chunks: a real file it hands to ndarray.tofile, whose short
    write under a file-size limit passes silently and leaves a truncated array."""
    def __init__(self, f):
        self.write = f.write


def save_array(path, arr):
    """np.save through writing(): a failed write names the file, and a short one is not silently passed."""
    with writing(path, 'wb') as f:
        np.lib.format.write_array(_Writes(f), np.asanyarray(arr), allow_pickle=False)


def write_split(root, split, inputs, labels, puzzle_identifiers, puzzle_indices, group_indices,
                vocab_size, pad_id=0, ignore_label_id=0, blank_identifier_id=0, num_puzzle_identifiers=1,
                extra=None):
    """Write one split. inputs/labels: [N, seq_len] integer arrays; puzzle_indices: [P+1] offsets into
    examples; group_indices: [G+1] offsets into puzzles. `extra` adds fields to dataset.json (readers
    of the reference format ignore them)."""
    inputs, labels = np.asarray(inputs), np.asarray(labels)
    if len(inputs) == 0:
        raise ValueError(f"the {split} split of {final_path(root)} would hold no examples: a run could not use it")
    puzzle_indices = np.asarray(puzzle_indices, dtype=np.int32)
    group_indices = np.asarray(group_indices, dtype=np.int32)
    assert inputs.shape == labels.shape and inputs.ndim == 2, (inputs.shape, labels.shape)
    assert puzzle_indices[0] == 0 and puzzle_indices[-1] == len(inputs)
    assert group_indices[0] == 0 and group_indices[-1] == len(puzzle_indices) - 1
    n_puzzles, n_groups = len(puzzle_indices) - 1, len(group_indices) - 1
    d = os.path.join(root, split)
    os.makedirs(d, exist_ok=True)
    arrays = dict(inputs=inputs, labels=labels, puzzle_identifiers=np.asarray(puzzle_identifiers),
                  puzzle_indices=puzzle_indices, group_indices=group_indices)
    assert len(arrays['puzzle_identifiers']) == n_puzzles
    meta = dict(pad_id=int(pad_id), ignore_label_id=int(ignore_label_id),
                blank_identifier_id=int(blank_identifier_id), vocab_size=int(vocab_size),
                seq_len=int(inputs.shape[1]), num_puzzle_identifiers=int(num_puzzle_identifiers),
                total_groups=n_groups, mean_puzzle_examples=len(inputs) / max(1, n_puzzles),
                total_puzzles=n_puzzles, sets=['all'])
    meta.update(extra or {})
    for name, arr in arrays.items():  # one int32 copy at a time (none if int32 already): a 1M-row build
                                      # stays small
        save_array(os.path.join(d, f'all__{name}.npy'), arr.astype(np.int32, copy=False))
    with writing(os.path.join(d, 'dataset.json')) as f:
        json.dump(meta, f)
    with writing(os.path.join(root, 'identifiers.json')) as f:
        json.dump(['<blank>'] + [str(i) for i in range(1, int(num_puzzle_identifiers))], f)
    return meta


def runs_holding(root):
    """The live runs that hold the dataset in root: [(host, pid, out_dir)] from their marks (a run writes one
    at its start and removes it at its end; a mark of a gone process of this host is dropped)."""
    held = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not name.startswith(IN_USE):
            continue
        rec = {}
        try:
            with open(os.path.join(root, name)) as f:
                rec = json.load(f)
            if rec.get('host') == socket.gethostname():
                os.kill(int(rec['pid']), 0)
        except ProcessLookupError:
            continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable; or another user's
            pass
        rec = rec if isinstance(rec, dict) else {}
        held.append((rec.get('host', '?'), rec.get('pid', '?'), rec.get('out_dir', '?')))
    return held


BUILDING = '.building'  # a build's folder inside the dataset's: building()
# what the builders write into a dataset's folder: the splits and the files beside them, and the sources they
# generate (csv/ of --generate, json/ of prepare_arc.py --synthetic). A build that says what it reads replaces
# these names whether or not it writes them, so the folder holds no earlier build's sources beside its dataset
BUILT = ('train', 'test', 'identifiers.json', 'test_puzzles.json', 'test_views.npz', 'csv', 'json')


def final_path(path):
    """A path inside a build's folder as it will be once the build is in place: what a message names, as the
    build's folder is gone after a failure."""
    return os.sep.join(p for p in os.fspath(path).split(os.sep) if p != BUILDING)


def _inside(path, folder):
    return os.path.commonpath([path, folder]) == folder


@contextlib.contextmanager
def building(root, reads=None):
    """with building(root, reads) as tmp: write everything the build makes into tmp (a folder inside root): the
    splits and the files beside them, and the sources it generates (CSVs, tasks' JSON). When the block ends
    without an error they replace their namesakes in root, and the names of BUILT it did not write go (the rest
    of root, a download cache, stays). After an error the previous dataset is untouched, every file of it, and
    tmp is removed (root too, if this build made it): a build that fails halfway never leaves half a dataset.
    reads: the folders the build reads its sources from. A name of BUILT that holds one stays (a csv/ that the
    build reads is its source), unless the build writes it: then it fails, as the swap would delete what it
    read. None (a builder that does not say what it reads): every name of BUILT it did not write stays. A build
    into a root that a live build holds (_build_lock) is refused in one line; a killed build's tmp is removed."""
    tmp, lock = os.path.join(root, BUILDING), None
    up = file_in_the_way(root)
    if up:
        where = root if up == os.path.abspath(root) else f"{root}: {up}"
        raise NotADirectoryError(f"{where} is a file, not a folder (allowed: a folder, or a path where one can be "
                                 "made)")
    new = not os.path.exists(root)
    try:
        lock = _build_lock(root)  # a second build into root stops here, before it touches anything
        shutil.rmtree(tmp, ignore_errors=True)  # a build that was killed (its lock went with it)
        os.makedirs(tmp)
        yield tmp
        names = _replaced(root, sorted(os.listdir(tmp)), reads)
    except BaseException:
        if lock is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            _unlock(root, lock)
        if new:  # a failed first build leaves no empty folder behind (a live build's holds its lock file)
            with contextlib.suppress(OSError):
                os.rmdir(root)
        raise
    try:
        _swap(root, tmp, names)
    finally:
        _unlock(root, lock)


def _swap(root, tmp, names):
    for host, pid, out_dir in runs_holding(root):  # renames keep its open files: it goes on with the old data
        print(f"warning: {root} is in use by the run on {host}, pid {pid} (out_dir {out_dir}): it goes on "
              "training and evaluating on the dataset it started with; runs started or resumed from now get "
              "this one")
    old = os.path.join(root, '.previous')
    shutil.rmtree(old, ignore_errors=True)
    os.makedirs(old)
    for n in names:  # renames only: the old dataset goes aside, then the new one comes in
        if os.path.lexists(os.path.join(root, n)):
            os.replace(os.path.join(root, n), os.path.join(old, n))
    for n in os.listdir(tmp):
        os.replace(os.path.join(tmp, n), os.path.join(root, n))
    shutil.rmtree(old)
    os.rmdir(tmp)


def interrupted(root, upload=''):
    """A builder's end on Ctrl-C (or a launcher passing SIGINT on): the one line that says root is untouched
    (building removed this build's files), or with `upload` (the gs:// URI root was being sent to, after its
    build) that root is the new build and the bucket lacks it; the exit code of a SIGINT."""
    if upload:
        print(f"stopped by SIGINT: {root} is built, but its upload to {upload} did not finish: the same command "
              "builds and uploads it again", file=sys.stderr)
    else:
        print(f"stopped by SIGINT: {root} is as it was before this build", file=sys.stderr)
    return 128 + signal.SIGINT


def _build_lock(root):
    """The lock of a build into root, held until _unlock: an flock on root/.building.lock, which the OS releases
    when the process dies, so a killed build's folder is told from a live one's. Held by a live build: a
    ValueError naming it."""
    path = os.path.join(root, BUILDING + '.lock')
    while True:
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors='replace').strip() or '?'
            os.close(fd)
            raise ValueError(f"{root} is being built by another build (pid {pid}): wait for it to end, or build "
                             "into another folder") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            with contextlib.suppress(OSError):  # the pid only names this build to a second one
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
            return fd
        os.close(fd)  # the file of a build that ended as this one opened it (_unlock removed it): lock a new one


def _unlock(root, fd):
    with contextlib.suppress(OSError):
        os.remove(os.path.join(root, BUILDING + '.lock'))  # while held: no build can take the lock of a gone file
    os.close(fd)


def _replaced(root, written, reads):
    """The names of root that go aside for the build's: those it wrote and, reads given, the other names of BUILT
    but one that holds a folder it reads."""
    if reads is None:
        return written
    names = []
    for n in sorted(set(written) | set(BUILT)):
        held = [r for r in reads if r and _inside(os.path.realpath(r), os.path.realpath(os.path.join(root, n)))]
        if held and n in written:
            raise ValueError(f"{held[0]} is inside {os.path.join(root, n)}, which this build replaces: move the "
                             "files it reads out of there")
        if not held:
            names.append(n)
    return names


# -----------------------------------------------------------------------------
# reading

def load_metadata(root, split):
    path = os.path.join(root, split, 'dataset.json')
    if not os.path.exists(path):
        raise FileNotFoundError(f"no dataset at {path}: build one with prepare_sudoku.py, prepare_maze.py or "
                                f"prepare_arc.py (see README), or point data_path at an existing dataset")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a JSON object of dataset metadata")
    missing = [k for k in METADATA_FIELDS if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks the field(s) {missing}")
    if bad := metadata_problem(meta):
        field, allowed = bad
        raise ValueError(f"{path}: the field {field} is {meta[field]!r}; it must be {allowed}")
    return meta


def metadata_problem(meta):
    """(field, what it may be) of the first field of dataset.json a run could not use, or None: a value of
    another type, or an id outside the table it indexes, would fail hours in (the padded rows of an evaluation)
    or be blamed on another setting."""
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
    for k in ('vocab_size', 'seq_len', 'num_puzzle_identifiers'):
        if not whole(meta[k]) or meta[k] < 1:
            return k, 'a whole number >= 1'
    for k in ('total_groups', 'total_puzzles'):
        if not whole(meta[k]) or meta[k] < 0:
            return k, 'a whole number >= 0'
    m = meta['mean_puzzle_examples']
    if not (whole(m) or isinstance(m, float)) or not m > 0:
        return 'mean_puzzle_examples', 'a number > 0'
    for k, n in (('pad_id', 'vocab_size'), ('blank_identifier_id', 'num_puzzle_identifiers')):
        if not whole(meta[k]) or not 0 <= meta[k] < meta[n]:
            return k, f'a whole number in [0, {meta[n]})'
    if meta['ignore_label_id'] is not None and not whole(meta['ignore_label_id']):
        return 'ignore_label_id', 'a whole number or null'
    return None


def load_arrays(root, split, set_name='all'):
    """Memory-mapped arrays of one split: a million-example set does not fill RAM."""
    arrays = {}
    for name in ARRAY_NAMES:
        path = os.path.join(root, split, f'{set_name}__{name}.npy')
        try:
            arrays[name] = np.load(path, mmap_mode='r')
        except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
            raise ValueError(f"cannot read {path}: {_not_npy(path) or e}") from e
    return arrays


def _not_npy(path):
    """What a file numpy could not open is when it is no .npy file at all, else None: numpy reads such a file as
    a pickle, and its advice (allow_pickle=True) would be wrong."""
    try:
        with open(path, 'rb') as f:
            head = f.read(len(np.lib.format.MAGIC_PREFIX))
    except OSError:
        return None
    if not head:
        return 'the file is empty'
    return "not a .npy file (it lacks numpy's header)" if head != np.lib.format.MAGIC_PREFIX else None


def load_json(path, keys=None):
    """A JSON file's value, or a ValueError in one line that names the file: missing, unreadable, not complete
    JSON, or an object that holds a key twice (JSON readers keep only the last, so what the first held would
    vanish without a word: a task of a challenges file, a solution). keys: what the top-level object's keys
    are, for that line ('task id')."""
    seen, twice = [0], []  # objects read so far (inner ones first, the top level last); the first key twice

    def unique(pairs):
        seen[0] += 1
        obj = {}
        for k, v in pairs:
            if k in obj and not twice:
                twice.append((seen[0], k))
            obj[k] = v
        return obj
    try:
        with open(path) as f:
            value = json.load(f, object_pairs_hook=unique)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not complete JSON ({e.msg} at line {e.lineno}, column {e.colno}): a partial file "
                         "or download?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    if twice:
        at, k = twice[0]
        top = at == seen[0] and isinstance(value, dict)
        raise ValueError(f"{path}: " + (f"{keys} {k} twice" if top and keys else f"the key {k!r} twice in "
                                        + ('its top-level object' if top else 'one of its objects'))
                         + " (JSON readers keep only the last, so the first would be lost without a word): give "
                         "each its own key")
    return value


def check_split(root, split, chunk=1 << 20):
    """Problems that would stop a run hours in, found now: [] when the split opens, is not empty, its arrays
    agree with dataset.json and each other, and every token, label and identifier is inside its range.
    Vectorised over the memory-mapped arrays, a chunk of rows at a time, so a million-row split is checked at
    every start."""
    try:
        meta, a = load_metadata(root, split), load_arrays(root, split)
    except (OSError, ValueError) as e:
        return [str(e)]
    where = os.path.join(root, split)
    n, L, V = len(a['inputs']), meta['seq_len'], meta['vocab_size']
    if n == 0:
        return [f"{where} holds no examples (an empty split): rebuild it with more puzzles"]
    problems = [f"{where}/all__{name}.npy holds {a[name].dtype} values; it must hold integers"
                for name in ARRAY_NAMES if not np.issubdtype(a[name].dtype, np.integer)]
    for name in ('inputs', 'labels'):
        if a[name].shape != (n, L):
            problems.append(f"{where}/all__{name}.npy has shape {a[name].shape}; dataset.json says "
                            f"[{n}, {L}]")
    problems += [f"{where}/all__{name}.npy has shape {a[name].shape}; it must be one-dimensional, not empty"
                 for name in ('puzzle_identifiers', 'puzzle_indices', 'group_indices')
                 if a[name].ndim != 1 or not len(a[name])]
    if problems:
        return problems
    pi, gi = np.asarray(a['puzzle_indices']), np.asarray(a['group_indices'])
    if pi[0] != 0 or pi[-1] != n or (np.diff(pi) < 1).any():
        problems.append(f"{where}/all__puzzle_indices.npy does not split the {n} examples into puzzles")
    elif len(a['puzzle_identifiers']) != len(pi) - 1:
        problems.append(f"{where}/all__puzzle_identifiers.npy holds {len(a['puzzle_identifiers'])} puzzle "
                        f"identifiers; all__puzzle_indices.npy holds {len(pi) - 1} puzzles")
    if gi[0] != 0 or gi[-1] != len(pi) - 1 or (np.diff(gi) < 1).any():
        problems.append(f"{where}/all__group_indices.npy does not split the {len(pi) - 1} puzzles into "
                        "groups")
    ids = np.asarray(a['puzzle_identifiers'])
    if len(ids) and (ids.min() < 0 or ids.max() >= meta['num_puzzle_identifiers']):
        problems.append(f"{where}/all__puzzle_identifiers.npy holds ids outside [0, "
                        f"{meta['num_puzzle_identifiers']})")
    # a run's length is epochs x groups x mean_puzzle_examples: a value the arrays do not imply would change it
    # without a word. total_puzzles is not checked: the reference's builders write the group count there.
    P, G, m = len(pi) - 1, len(gi) - 1, meta['mean_puzzle_examples']
    if not np.isclose(m, n / P, rtol=1e-6, atol=0):
        problems.append(f"{where}/dataset.json: the field mean_puzzle_examples is {m!r}; the arrays hold {n} examples "
                        f"in {P} puzzles, so it must be {n / P:g} (a run's length is taken from it)")
    if meta['total_groups'] != G:
        problems.append(f"{where}/dataset.json: the field total_groups is {meta['total_groups']}; "
                        f"all__group_indices.npy holds {G} groups, so it must be {G}")
    if problems:
        return problems
    for name, extra in (('inputs', None), ('labels', meta['ignore_label_id'])):
        for r0 in range(0, n, chunk):
            x = np.asarray(a[name][r0:r0 + chunk])
            if x.min() >= 0 and x.max() < V:  # the common case: two reductions, no mask
                continue
            bad = (x < 0) | (x >= V)
            if extra is not None:
                bad &= x != extra
            if bad.any():
                r, c = np.argwhere(bad)[0]
                return [f"{where}/all__{name}.npy row {r0 + r}, position {c}: token {x[r, c]} is outside the "
                        f"vocabulary [0, {V})"]
    return []


def _to_batch(arrays, meta, example_idx, puzzle_idx):
    """Rows as the model wants them: int32 tokens, labels with the dataset's ignore id mapped to -100."""
    order = np.argsort(example_idx, kind='stable')  # sorted reads are kind to a memory map
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    inputs = np.asarray(arrays['inputs'][example_idx[order]])[inv].astype(np.int32)
    labels = np.asarray(arrays['labels'][example_idx[order]])[inv].astype(np.int32)
    labels[labels == meta['ignore_label_id']] = IGNORE_LABEL_ID
    pid = np.asarray(arrays['puzzle_identifiers'])[puzzle_idx].astype(np.int32)
    return dict(inputs=inputs, labels=labels, puzzle_identifiers=pid)


def steps_for(epochs, groups, mean_puzzle_examples, global_batch_size):
    """Optimizer steps of `epochs` passes over a split's groups (a group gives mean_puzzle_examples examples a
    pass): the run's length, and in epochs its eval_every_epochs."""
    return int(epochs * (groups * mean_puzzle_examples) // global_batch_size)


class TrainLoader:
    """Training batches sampled by groups, as the reference does: each epoch visits every group once
    in random order; a group gives one random puzzle (e.g. one augmentation), whose examples (in random
    order) fill the batch. Batches run on across epoch boundaries (the reference concatenates
    eval_every_epochs epochs) and always hold exactly global_batch_size rows; each rank takes its slice.

    Reproducible and resumable: the epoch's group order comes from (seed, epoch) and a batch's random
    draws from (seed, batch_index), so the position (epoch, cursor, batch_index) is the whole state; it is saved
    with the group count it indexes (a resume onto a dataset rebuilt with another count says so)."""

    def __init__(self, root, global_batch_size, rank=0, world_size=1, seed=0, split='train'):
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                             f"world_size={world_size}")
        self.meta = load_metadata(root, split)
        self.arrays = load_arrays(root, split)
        self.group_indices = np.asarray(self.arrays['group_indices'], dtype=np.int64)
        self.puzzle_indices = np.asarray(self.arrays['puzzle_indices'], dtype=np.int64)
        self.n_groups = len(self.group_indices) - 1
        self.B, self.rank, self.world_size, self.seed = global_batch_size, rank, world_size, seed
        self.local_B = global_batch_size // world_size
        self.epoch, self.cursor, self.batch_index = 0, 0, 0
        self._order_epoch, self._order = None, None

    def steps_for(self, epochs):
        return steps_for(epochs, self.n_groups, self.meta['mean_puzzle_examples'], self.B)

    def state_dict(self):
        return dict(epoch=self.epoch, cursor=self.cursor, batch_index=self.batch_index, groups=self.n_groups)

    def load_state_dict(self, state):
        self.epoch, self.cursor, self.batch_index = \
            int(state['epoch']), int(state['cursor']), int(state['batch_index'])

    def _group_order(self, epoch):
        if self._order_epoch != epoch:
            self._order_epoch, self._order = \
                epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_groups)
        return self._order

    def next_global_indices(self):
        """(example indices, puzzle indices) of the next global batch, advancing the position."""
        rng = np.random.default_rng([self.seed, 1 << 20, self.batch_index])
        examples, puzzles, filled = [], [], 0
        while filled < self.B:
            order = self._group_order(self.epoch)
            groups = order[self.cursor:self.cursor + (self.B - filled)]  # each group gives >= 1 example
            g0, g1 = self.group_indices[groups], self.group_indices[groups + 1]
            puzzle = g0 + (rng.random(len(groups)) * (g1 - g0)).astype(np.int64)
            start, size = \
                self.puzzle_indices[puzzle], self.puzzle_indices[puzzle + 1] - self.puzzle_indices[puzzle]
            take = np.minimum(size, self.B - filled - np.concatenate(([0], np.cumsum(size)[:-1])))
            used = int(np.searchsorted(np.cumsum(size), self.B - filled, side='left')) + 1
            used = min(used, len(groups))
            if (size[:used] == 1).all():  # one example per puzzle (Sudoku, Maze): no per-puzzle draws
                examples.append(start[:used])
                puzzles.append(puzzle[:used])
                filled += used
            else:
                for p, s0, sz, k in zip(puzzle[:used], start[:used], size[:used], take[:used]):
                    offs = rng.permutation(sz)[:k]
                    examples.append(s0 + offs)
                    puzzles.append(np.full(len(offs), p))
                    filled += len(offs)
            self.cursor += used
            if self.cursor >= self.n_groups:
                self.epoch, self.cursor = self.epoch + 1, 0
        self.batch_index += 1
        return np.concatenate(examples), np.concatenate(puzzles)

    def next_batch(self):
        ex, pz = self.next_global_indices()
        sl = slice(self.rank * self.local_B, (self.rank + 1) * self.local_B)
        return _to_batch(self.arrays, self.meta, ex[sl], pz[sl])

    def epochs_done(self, state):
        """The epochs a loader at `state` (a state_dict()) has drawn."""
        return state['epoch'] + state['cursor'] / self.n_groups


class EvalLoader:
    """Sequential batches over a split's examples (or a fixed seeded subset of them). The last batch is
    padded to full size with pad inputs, ignored labels and the blank identifier; `valid` marks real rows.
    'example_index' (host only, not for the device) is the GLOBAL batch's examples in the split, in rank order
    (-1: padding), so answers gathered from all ranks need no indices of their own. A kind
    whose views are stored in the dataset (ARC: a task's augmentations vote together) takes its subset in
    whole groups: the seeded groups' every example, until the subset's size is reached."""

    def __init__(self, root, global_batch_size, rank=0, world_size=1, split='test', subset=0, seed=0, views=1,
                 kind=None, progress=None):
        if global_batch_size % world_size:
            raise ValueError(f"eval batch size {global_batch_size} is not divisible by "
                             f"world_size={world_size}")
        self.meta = load_metadata(root, split)
        self.arrays = load_arrays(root, split)
        self.B, self.rank, self.local_B = global_batch_size, rank, global_batch_size // world_size
        n = len(self.arrays['inputs'])
        idx = np.arange(n)
        if subset and subset < n and kind is not None and kind.stored_views:
            starts = np.asarray(self.arrays['puzzle_indices'])[np.asarray(self.arrays['group_indices'])]
            order = np.random.default_rng([seed, 7]).permutation(len(starts) - 1)
            upto = int(np.searchsorted(np.cumsum(np.diff(starts)[order]), subset)) + 1  # the group that reaches it
            idx = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in np.sort(order[:upto])])
        elif subset and subset < n:
            idx = np.sort(np.random.default_rng([seed, 7]).choice(n, subset, replace=False))
        self.example_idx = idx
        self.views, self.kind, self.seed = views, kind, seed  # test-time views: puzzles.Grid.views
        # progress(what, batch_done): told when a batch's views are built, and when the evaluation asks for the
        # next batch (the last one is done, its scoring included): a watchdog's heartbeat on the host's work
        self.progress = progress or (lambda what, batch_done=False: None)
        # example -> puzzle, for the puzzle identifiers
        self.example_puzzle = np.searchsorted(np.asarray(self.arrays['puzzle_indices']), idx,
                                              side='right') - 1

    def __len__(self):
        return -(-len(self.example_idx) // self.B)

    def __iter__(self):
        for b in range(len(self)):
            ex = self.example_idx[b * self.B:(b + 1) * self.B]
            pz = self.example_puzzle[b * self.B:(b + 1) * self.B]
            n_real = len(ex)
            pad = self.B - n_real
            ex = np.concatenate([ex, np.zeros(pad, dtype=ex.dtype)])
            pz = np.concatenate([pz, np.zeros(pad, dtype=pz.dtype)])
            batch = _to_batch(self.arrays, self.meta, ex, pz)
            valid = np.arange(self.B) < n_real
            batch['inputs'][~valid] = self.meta['pad_id']
            batch['labels'][~valid] = IGNORE_LABEL_ID
            batch['puzzle_identifiers'][~valid] = self.meta['blank_identifier_id']
            batch['valid'] = valid
            sl = slice(self.rank * self.local_B, (self.rank + 1) * self.local_B)
            local = {k: v[sl] for k, v in batch.items()}
            if self.views > 1:
                local = self.in_views(local, sl, b)
                self.progress(f'the views of evaluation batch {b + 1} of {len(self)}')
            local['example_index'] = np.where(valid, ex, -1)  # the global batch's: every rank knows them
            yield local
            self.progress(f'evaluation batch {b + 1} of {len(self)}', batch_done=True)

    def in_views(self, local, sl, b):
        """Batch b's views (the global batch's, the same on every rank), then the rank's rows (sl) of each. Out
        of memory (the estimate before the run said they fit, and the memory went elsewhere): a config error in
        one line, as the estimate's."""
        K = self.views
        try:
            pos, token_map = self.kind.views(K, self.B, self.seed, b)
            rows = (np.arange(K)[:, None] * self.B + np.arange(sl.start, sl.stop)[None]).ravel()
            sym = pos[rows], token_map[rows]
            # 'views_inverse' (host only, not for the device) maps each row's answer back to its puzzle
            return dict(in_views(local, self.kind, sym), views_inverse=self.kind.invert(sym))
        except MemoryError as e:
            from device import memory_headroom, size
            free, what = memory_headroom()
            left = f"; {size(free)} {what}" if free is not None else ''
            raise SystemExit(f"config error: eval_views={K}: building the views of a batch of {self.B} puzzles ran "
                             f"out of memory ({' '.join(str(e).split())}){left}: lower eval_views or "
                             "eval_batch_size") from None


def in_views(batch, kind, sym):
    """A batch's rows in the K views of sym ([K x its rows], as Grid.views gives them), view-major (view 0 first:
    the rows as they are): K x the rows of every array, the inputs and labels transformed."""
    K = len(sym[0]) // len(batch['inputs'])
    out = {k: np.tile(v, (K,) + (1,) * (v.ndim - 1)) for k, v in batch.items()}
    out['inputs'] = kind.apply(out['inputs'], sym).astype(np.int32)
    out['labels'] = kind.apply_labels(out['labels'], sym).astype(np.int32)
    return out

# -----------------------------------------------------------------------------
# download: streamed, resumable (.part + HTTP Range), cached, row count checked (used by the builders)

class DownloadError(RuntimeError):
    """A download that failed for good; the message names the URL and what went wrong."""


class _Retryable(Exception):
    """A failure worth another try (5xx, dropped connection)."""


def csv_dir_problem(csv_dir):
    """What a builder's --csv_dir lacks (train.csv and test.csv, the splits it reads), in one line; None when
    both are there."""
    missing = [name for name in ('train.csv', 'test.csv') if not os.path.isfile(os.path.join(csv_dir, name))]
    if not os.path.isdir(csv_dir):
        return f"--csv_dir {csv_dir}: no such folder (allowed: a folder holding train.csv and test.csv)"
    return f"--csv_dir {csv_dir} holds no {' and no '.join(missing)} (allowed: a folder holding train.csv and " \
        "test.csv)" if missing else None


def count_rows(path):
    """Data rows in a CSV file (lines minus the header; a last line without '\\n' counts)."""
    lines, last = 0, b'\n'
    with open(path, 'rb') as f:
        while chunk := f.read(1 << 24):
            lines += chunk.count(b'\n')
            last = chunk[-1:]
    return max(0, lines + (last != b'\n') - 1)


def _check_rows(path, expected_rows, what):
    found = count_rows(path)
    if found != expected_rows:
        raise DownloadError(f"{what}: {found:,} data rows, expected {expected_rows:,} (file kept at {path}; "
                            f"delete it to download again)")


def _fetch(session, url, part):
    """One attempt: continue `part` from its current size to the end of the file."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    # identity encoding: a Range must count bytes of the file itself, not of a gzip stream
    headers = {'Accept-Encoding': 'identity', **({'Range': f'bytes={have}-'} if have else {})}
    try:
        r = session.get(url, headers=headers, stream=True, timeout=(15, 60))
    except requests.RequestException as e:  # refused, DNS, timeout: maybe transient
        raise _Retryable(f"{type(e).__name__}: {e}") from e
    with r:
        if r.status_code == 416 and have:  # nothing left to send: the .part may already be complete
            total = r.headers.get('Content-Range', '').rpartition('/')[2]
            if total.isdigit() and int(total) == have:
                return
            os.remove(part)
            raise _Retryable(f"HTTP 416 for a {have}-byte partial file; starting over")
        if r.status_code >= 500 or r.status_code == 429:
            raise _Retryable(f"HTTP {r.status_code} {r.reason}")
        if r.status_code not in (200, 206):
            raise DownloadError(f"GET {url} failed: HTTP {r.status_code} {r.reason}")
        total = None
        if r.status_code == 206:
            m = re.fullmatch(r'bytes (\d+)-(\d+)/(\d+|\*)', r.headers.get('Content-Range', '').strip())
            if not m or int(m.group(1)) != have:
                os.remove(part)
                raise _Retryable(f"server resumed at the wrong place ({r.headers.get('Content-Range')!r}); "
                                 f"starting over")
            total = int(m.group(3)) if m.group(3) != '*' else None
            mode = 'ab'
        else:  # 200: the server ignored the Range (or there was none): write from the start
            have, mode = 0, 'wb'
            if 'Content-Length' in r.headers:
                total = int(r.headers['Content-Length'])
        done, shown, t0 = have, 0.0, time.time()
        name = os.path.basename(part)[:-len('.part')]
        try:
            with open(part, mode) as f:
                for block in r.iter_content(1 << 16):  # small blocks: a dropped connection loses little
                    f.write(block)
                    done += len(block)
                    if time.time() - shown > 0.5:
                        shown = time.time()
                        pct = f" {100 * done / total:5.1f}%" if total else ''
                        rate = (done - have) / max(1e-9, shown - t0) / 1e6
                        print(f"\r{name}: {done / 1e6:,.1f}{f' / {total / 1e6:,.1f}' if total else ''} MB"
                              f"{pct} {rate:.1f} MB/s", end='', file=sys.stderr, flush=True)
        except (requests.RequestException, ConnectionError) as e:  # dropped mid-stream: resume next try
            raise _Retryable(f"{type(e).__name__} after {done:,} bytes: {e}") from e
        except OSError as e:  # a full disk: the file named
            raise cannot_write(part, e) from e
        finally:
            if shown:
                print(file=sys.stderr)
        if total is not None and done != total:
            raise _Retryable(f"connection closed at {done:,} of {total:,} bytes")


def download(url, dest_path, expected_rows=None, *, retries=5, backoff=2.0):
    """Download `url` to `dest_path` and return dest_path. A finished file is reused (no request);
    a partial one (`dest_path + '.part'`) is resumed with a Range request; 5xx answers and dropped
    connections are retried with exponential backoff; `expected_rows` checks the CSV's data rows."""
    if os.path.exists(dest_path):
        if expected_rows is not None:
            _check_rows(dest_path, expected_rows, dest_path)
        return dest_path
    os.makedirs(os.path.dirname(os.path.abspath(dest_path)), exist_ok=True)
    part = dest_path + '.part'
    session = requests.Session()
    for attempt in range(retries + 1):
        try:
            _fetch(session, url, part)
            break
        except _Retryable as e:
            if attempt == retries:
                raise DownloadError(f"GET {url} failed: {e} (gave up after {retries + 1} attempts)") from None
            wait = backoff * 2 ** attempt
            print(f"GET {url}: {e}; retrying in {wait:.1f} s", file=sys.stderr)
            time.sleep(wait)
    if expected_rows is not None:
        _check_rows(part, expected_rows, url)
    os.replace(part, dest_path)  # only a complete, checked file gets the final name
    return dest_path
