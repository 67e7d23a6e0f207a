"""
The data layer: the seeded, resumable, rank-sliced train loader, the padded evaluation loader, evaluation
counting only real rows (evaluate.evaluate), the Wilson interval, puzzle types and verifiers by metadata.
    python -m pytest -q tests/test_data.py
"""
import json

import numpy as np
import torch

from conftest import TINY, make_reverse_dataset, train
from data import EvalLoader, TrainLoader, load_arrays, write_split
from device import Device
from model import TRM, TRMConfig
from puzzles import Maze, Sudoku, puzzle_for, puzzle_type, render_example, verifier_for
from evaluate import evaluate, format_eval, wilson_interval


# data

def grouped_dataset(root):
    """3 groups with 1, 2 and 3 puzzles; puzzles with 1-4 examples; distinct ids per puzzle."""
    sizes = [2, 1, 3, 4, 1, 2]
    n = sum(sizes)
    x = np.arange(n)[:, None] * np.ones((1, 4), dtype=np.int64) % 50 + 2
    puzzle_indices = np.concatenate([[0], np.cumsum(sizes)])
    write_split(root, 'train', x, x, np.arange(6) % 4, puzzle_indices, [0, 1, 3, 6], vocab_size=60,
                num_puzzle_identifiers=4)
    return root


def test_train_loader_is_seeded_resumable_and_sliced_by_rank(tmp_path):
    root = grouped_dataset(str(tmp_path))
    a = TrainLoader(root, 4, seed=3)
    seq = [a.next_global_indices() for _ in range(10)]
    assert all(len(ex) == 4 for ex, _ in seq)  # always the full global batch
    b = TrainLoader(root, 4, seed=3)
    for _ in range(4):
        b.next_global_indices()
    state = b.state_dict()
    c = TrainLoader(root, 4, seed=3)
    c.load_state_dict(state)
    for i in range(4, 10):
        ex, pz = c.next_global_indices()
        assert np.array_equal(ex, seq[i][0]) and np.array_equal(pz, seq[i][1])
    # examples belong to the puzzle they are listed with, and each puzzle's examples are distinct
    pi = load_arrays(root, 'train')['puzzle_indices']
    for ex, pz in seq:
        assert np.all((ex >= pi[pz]) & (ex < pi[pz + 1]))
    other = TrainLoader(root, 4, seed=4)
    assert any(not np.array_equal(other.next_global_indices()[0], ex) for ex, _ in seq)  # the seed matters
    # every rank takes its slice of the same global batch
    r0, r1 = TrainLoader(root, 4, rank=0, world_size=2, seed=3), TrainLoader(root, 4, rank=1, world_size=2, seed=3)
    full = TrainLoader(root, 4, seed=3).next_batch()
    both = np.concatenate([r0.next_batch()['inputs'], r1.next_batch()['inputs']])
    assert np.array_equal(both, full['inputs'])


def test_train_loader_visits_every_group_once_per_epoch(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=20, n_test=4)
    ld = TrainLoader(root, 5, seed=0)
    seen = np.concatenate([ld.next_global_indices()[0] for _ in range(4)])
    assert sorted(seen) == list(range(20)) and ld.epoch == 1 and ld.cursor == 0
    assert ld.steps_for(3) == 12


def test_the_logged_epoch_counts_the_batches_trained_on(tmp_path):
    """The loader runs a batch ahead of the step (the next batch is on its way to the device): the log's epoch
    is that of the batches consumed, so a 2-epoch run of 4 steps per epoch logs epochs 1 and 2."""
    root = make_reverse_dataset(str(tmp_path / 'd'), n_train=200, n_test=20)
    train(root, tmp_path / 'o')  # batch 50: 4 steps per epoch
    lines = [json.loads(l) for l in open(tmp_path / 'o' / 'metrics.jsonl') if '"kind": "train"' in l]
    assert [(l['step'], l['epoch']) for l in lines] == [(4, 1.0), (8, 2.0)], lines


def test_eval_loader_pads_the_last_batch(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=8, n_test=10)
    batches = list(EvalLoader(root, 4))
    assert len(batches) == 3 and all(b['inputs'].shape == (4, 8) for b in batches)
    last = batches[-1]
    assert last['valid'].tolist() == [True, True, False, False]
    assert np.all(last['labels'][2:] == -100) and np.all(last['inputs'][2:] == 0)
    # a seeded subset is fixed
    s1, s2 = EvalLoader(root, 4, subset=6, seed=1), EvalLoader(root, 4, subset=6, seed=1)
    assert np.array_equal(s1.example_idx, s2.example_idx) and len(s1.example_idx) == 6


# -----------------------------------------------------------------------------
# evaluation

def test_evaluation_counts_only_real_rows(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=8, n_test=10)
    torch.manual_seed(0)
    cfg = TRMConfig(**dict(TINY, num_puzzle_identifiers=1))
    m = TRM(cfg)
    dev = Device('cpu')
    res, _ = evaluate(m, EvalLoader(root, 4), dev, 4, 4)
    assert res['count'] == 10
    # the same numbers computed row by row over the 10 real examples
    arrays = load_arrays(root, 'test')
    inputs = torch.tensor(np.asarray(arrays['inputs']), dtype=torch.int32)
    labels = torch.tensor(np.asarray(arrays['labels']))
    preds, _, _ = m.predict(dict(inputs=inputs, puzzle_identifiers=torch.zeros(10, dtype=torch.int32)), 4)
    tok = (preds[-1] == labels).float().mean(-1)
    assert abs(res['token_accuracy'] - tok.mean().item()) < 1e-6
    assert abs(res['exact_accuracy'] - (tok == 1).float().mean().item()) < 1e-6
    lo, hi = res['exact_ci_low'], res['exact_ci_high']
    assert 0 <= lo <= res['exact_accuracy'] <= hi <= 1
    line = format_eval(res)
    assert line.startswith('eval on 10: exact ') and 'verified' not in line  # no verifier was given


def test_wilson_interval_gives_the_readme_figures():
    lo, hi = wilson_interval(443, 500)  # README quick start: exact 0.8860 (95% CI 0.8552-0.9110)
    assert (round(lo, 4), round(hi, 4)) == (0.8552, 0.9110)
    lo, hi = wilson_interval(470, 500)  # 94.0% (95% CI 91.6-95.8%)
    assert (round(lo, 3), round(hi, 3)) == (0.916, 0.958)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0 and 0 < hi < 0.2  # never a zero-width interval at 0 or 1
    assert wilson_interval(0, 0) == (0.0, 0.0)


def test_puzzle_type_and_verifier_from_metadata():
    assert puzzle_type(dict(puzzle_type='maze', vocab_size=6, seq_len=16)) == 'maze'  # stated wins
    assert puzzle_type(dict(vocab_size=11, seq_len=81)) == 'sudoku'  # the reference's datasets: by shape
    assert puzzle_type(dict(vocab_size=6, seq_len=900)) == 'maze'
    assert puzzle_type(dict(vocab_size=6, seq_len=8)) is None  # the toy reverse task
    sudoku, maze = puzzle_for(dict(vocab_size=11, seq_len=81)), puzzle_for(dict(vocab_size=6, seq_len=900))
    assert isinstance(sudoku, Sudoku) and sudoku.n == 9 and sudoku.box == (3, 3)
    assert isinstance(maze, Maze) and maze.n == 30
    assert puzzle_for(dict(puzzle_type='sudoku', grid_size=6, vocab_size=8, seq_len=36)).box == (2, 3)
    assert verifier_for(dict(vocab_size=11, seq_len=81)).__self__.name == 'sudoku'
    assert verifier_for(dict(vocab_size=6, seq_len=8)) is None
    assert puzzle_for(dict(puzzle_type='no such kind', vocab_size=6, seq_len=16)) is None


def test_render_example_shows_a_sudoku_side_by_side():
    meta = dict(puzzle_type='sudoku', vocab_size=6, seq_len=16)
    answer = np.array([1, 2, 3, 4, 3, 4, 1, 2, 2, 1, 4, 3, 4, 3, 2, 1]) + 1  # digits d are tokens d + 1
    puzzle = np.where(np.arange(16) % 3 == 0, answer, 1)  # blanks are token 1
    text = render_example(meta, puzzle, answer, True)
    lines = text.splitlines()
    assert lines[0] == 'held-out puzzle   ->   model answer (correct)' and len(lines) == 5
    assert lines[1] == '1 . . 4   |   1 2 3 4'
    assert 'WRONG' in render_example(meta, puzzle, answer, False)
