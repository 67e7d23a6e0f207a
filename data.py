"""
Datasets on disk and the loaders that feed train.py.

Layout (TRM_SPEC section 5, shared with the reference implementation, so either side reads the
other's datasets):
    <root>/<split>/dataset.json
    <root>/<split>/all__{inputs,labels,puzzle_identifiers,puzzle_indices,group_indices}.npy
    <root>/identifiers.json
puzzle_indices are example offsets per puzzle, group_indices puzzle offsets per group (a puzzle and
its augmentations form one group).
"""
import json
import os

import numpy as np

IGNORE_LABEL_ID = -100  # what the loss ignores; the dataset's own ignore_label_id is mapped to it
METADATA_FIELDS = ('pad_id', 'ignore_label_id', 'blank_identifier_id', 'vocab_size', 'seq_len',
                   'num_puzzle_identifiers', 'total_groups', 'mean_puzzle_examples', 'total_puzzles', 'sets')
ARRAY_NAMES = ('inputs', 'labels', 'puzzle_identifiers', 'puzzle_indices', 'group_indices')

# -----------------------------------------------------------------------------
# writing (used by prepare_sudoku.py and prepare_maze.py)

def write_split(root, split, inputs, labels, puzzle_identifiers, puzzle_indices, group_indices,
                vocab_size, pad_id=0, ignore_label_id=0, blank_identifier_id=0, num_puzzle_identifiers=1,
                extra=None):
    """Write one split. inputs/labels: [N, seq_len] integer arrays; puzzle_indices: [P+1] offsets into
    examples; group_indices: [G+1] offsets into puzzles. `extra` adds fields to dataset.json (readers
    of the reference format ignore them)."""
    inputs, labels = np.asarray(inputs), np.asarray(labels)
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
    for name, arr in arrays.items():  # one int32 copy at a time (none if already int32): a 1M-row build stays small
        np.save(os.path.join(d, f'all__{name}.npy'), arr.astype(np.int32, copy=False))
    meta = dict(pad_id=int(pad_id), ignore_label_id=int(ignore_label_id),
                blank_identifier_id=int(blank_identifier_id), vocab_size=int(vocab_size),
                seq_len=int(inputs.shape[1]), num_puzzle_identifiers=int(num_puzzle_identifiers),
                total_groups=n_groups, mean_puzzle_examples=len(inputs) / max(1, n_puzzles),
                total_puzzles=n_puzzles, sets=['all'])
    meta.update(extra or {})
    with open(os.path.join(d, 'dataset.json'), 'w') as f:
        json.dump(meta, f)
    with open(os.path.join(root, 'identifiers.json'), 'w') as f:
        json.dump(['<blank>'] + [str(i) for i in range(1, int(num_puzzle_identifiers))], f)
    return meta


# -----------------------------------------------------------------------------
# reading

def load_metadata(root, split):
    path = os.path.join(root, split, 'dataset.json')
    if not os.path.exists(path):
        raise FileNotFoundError(f"no dataset at {path}: build one with prepare_sudoku.py or prepare_maze.py "
                                f"(see README), or point data_path at an existing dataset")
    with open(path) as f:
        meta = json.load(f)
    missing = [k for k in METADATA_FIELDS if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks the field(s) {missing}")
    return meta


def load_arrays(root, split, set_name='all'):
    """Memory-mapped arrays of one split: a million-example set does not fill RAM."""
    arrays = {}
    for name in ARRAY_NAMES:
        path = os.path.join(root, split, f'{set_name}__{name}.npy')
        try:
            arrays[name] = np.load(path, mmap_mode='r')
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
    return arrays


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


class TrainLoader:
    """Training batches sampled by groups, as the reference does: each epoch visits every group once
    in random order; a group gives one random puzzle (e.g. one augmentation), whose examples (in random
    order) fill the batch. Batches run on across epoch boundaries (the reference concatenates
    eval_interval epochs) and always hold exactly global_batch_size rows; each rank takes its slice.

    Reproducible and resumable: the epoch's group order comes from (seed, epoch) and a batch's random
    draws from (seed, batch_index), so the position (epoch, cursor, batch_index) is the whole state."""

    def __init__(self, root, global_batch_size, rank=0, world_size=1, seed=0, split='train'):
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}")
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
        examples_per_epoch = self.n_groups * self.meta['mean_puzzle_examples']
        return int(epochs * examples_per_epoch // self.B)

    def state_dict(self):
        return dict(epoch=self.epoch, cursor=self.cursor, batch_index=self.batch_index)

    def load_state_dict(self, state):
        self.epoch, self.cursor, self.batch_index = int(state['epoch']), int(state['cursor']), int(state['batch_index'])

    def _group_order(self, epoch):
        if self._order_epoch != epoch:
            self._order_epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_groups)
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
            start, size = self.puzzle_indices[puzzle], self.puzzle_indices[puzzle + 1] - self.puzzle_indices[puzzle]
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

    @property
    def epochs_done(self):
        return self.epoch + self.cursor / self.n_groups


class EvalLoader:
    """Sequential batches over a split's examples (or a fixed seeded subset of them). The last batch is
    padded to full size with pad inputs, ignored labels and the blank identifier; `valid` marks real rows."""

    def __init__(self, root, global_batch_size, rank=0, world_size=1, split='test', subset=0, seed=0):
        if global_batch_size % world_size:
            raise ValueError(f"eval batch size {global_batch_size} is not divisible by world_size={world_size}")
        self.meta = load_metadata(root, split)
        self.arrays = load_arrays(root, split)
        self.B, self.rank, self.local_B = global_batch_size, rank, global_batch_size // world_size
        n = len(self.arrays['inputs'])
        idx = np.arange(n)
        if subset and subset < n:
            idx = np.sort(np.random.default_rng([seed, 7]).choice(n, subset, replace=False))
        self.example_idx = idx
        # example -> puzzle, for the puzzle identifiers
        self.example_puzzle = np.searchsorted(np.asarray(self.arrays['puzzle_indices']), idx, side='right') - 1

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
            yield {k: v[sl] for k, v in batch.items()}


def render_example(meta, inputs, preds, correct):
    """A held-out puzzle and the model's answer, side by side, as text."""
    kind, n = meta.get('puzzle_type'), int(round(meta['seq_len'] ** 0.5))
    if kind == 'maze' or (kind is None and meta['vocab_size'] == 6 and meta['seq_len'] == 900):
        chars = '?# SGo'
        cell = lambda t: chars[t] if 0 <= t < len(chars) else '?'
    elif kind == 'sudoku' or (kind is None and meta['vocab_size'] == 11):
        cell = lambda t: '.' if t <= 1 else str(t - 1)
    else:
        cell = lambda t: format(int(t), 'x')[-1]
    if n * n != meta['seq_len']:
        return f"puzzle: {list(inputs)}\nanswer: {list(preds)} ({'correct' if correct else 'wrong'})"
    rows = [' '.join(cell(int(t)) for t in inputs[r * n:(r + 1) * n]) + '   |   ' +
            ' '.join(cell(int(t)) for t in preds[r * n:(r + 1) * n]) for r in range(n)]
    return ('held-out puzzle   ->   model answer (' + ('correct' if correct else 'WRONG') + ')\n' + '\n'.join(rows))
