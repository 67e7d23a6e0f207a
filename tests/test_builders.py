"""
The dataset builders prepare_sudoku.py and prepare_maze.py, and the verifiers and downloader they share from
data.py: CSV round trips against a per-row reference, seeds, augmentations, generators and solver, malformed
rows, downloads from a local HTTP server (no mocks). The full-size Sudoku build is opt-in: TRM_BENCH_FULL=1.
    python -m pytest -q tests/test_builders.py
"""
import csv
import filecmp
import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

import prepare_maze as pm
import prepare_sudoku as ps
from conftest import ROOT, FileHandler, assert_user_error, run
from data import DownloadError, download, load_arrays, load_metadata
from puzzles import BOXES, PAD, PATH, Maze, Sudoku, shortest_path_length


def kind_of(tokens, kind):
    return kind(math.isqrt(np.shape(tokens)[-1]))


def sudoku_correct(inputs, preds, n=None):
    return (Sudoku(n) if n else kind_of(preds, Sudoku)).correct(inputs, preds)


def maze_correct(inputs, preds):
    return kind_of(preds, Maze).correct(inputs, preds)


def tokens_to_strings(tokens):
    """[B, n*n] Sudoku tokens -> their CSV strings ('.' blank)."""
    return [kind_of(tokens, Sudoku).decode(row) for row in tokens]


# -----------------------------------------------------------------------------
# prepare_sudoku.py

HARD_9X9 = {  # well-known very hard puzzles, typed in row by row
    'inkala': '8..........36......7..9.2...5...7.......457.....1...3...1....68..85...1..9....4..',
    'golden_nugget': '.......39.....1..5..3.5.8....8.9...6.7...2...1..4.......9.8..5..2....6..4..7.....',
    'easter_monster': '1.......2.9.4...5...6...7...5.9.3.......7.......85..4.7.....6...3...9.8...2.....1',
    'platinum_blonde': '.......12........3..23..4....18....5.6..7.8.......9.....85.....9...4.5..47...6...',
    'ai_escargot': '1....7.9..3..2...8..96..5....53..9...1..8...26....4...3......1..4......7..7...3..',
}
INKALA_SOLUTION = '812753649943682175675491283154237896369845721287169534521974368438526917796318452'


# -----------------------------------------------------------------------------
# synthetic CSVs: valid Sudokus of any count, vectorised (also used for the full-size benchmark)

def _valid_grids(rng, k, n=9):
    """k valid solved grids [k, n*n] (digits 1..n): a pattern grid under random relabelling and
    band/row/stack/column permutations (argsort of random keys; independent of prepare_sudoku)."""
    br, bc = BOXES[n]
    r, c = np.meshgrid(np.arange(n), np.arange(n), indexing='ij')
    base = (bc * (r % br) + r // br + c) % n  # a valid grid (digits 0..n-1)
    perm = lambda *shape: np.argsort(rng.random(shape), axis=-1)
    rows = (perm(k, n // br)[:, :, None] * br + perm(k, n // br, br)).reshape(k, n)
    cols = (perm(k, n // bc)[:, :, None] * bc + perm(k, n // bc, bc)).reshape(k, n)
    grids = base[rows[:, :, None], cols[:, None, :]].reshape(k, n * n)
    return np.take_along_axis(perm(k, n), grids, axis=1) + 1


def write_synthetic_csv(path, rows, seed=0, n=9, blank_p=0.7, chunk=200_000):
    """`rows` data rows of valid puzzles: answers from a pool of random valid grids, questions with
    random blanks ('.'), ratings 0..999 and sources of different lengths (variable-width rows)."""
    rng = np.random.default_rng(seed)
    L = n * n
    pool = _valid_grids(rng, 4096, n).astype(np.uint8) + 48
    sources = [b'puzzles0_kaggle', b'puzzles2_17_clue', b'puzzles4_forum_hardest_1905', b'puzzles7_serg_benchmark']
    width = max(map(len, sources))
    src = np.zeros((len(sources), width), np.uint8)
    for i, s in enumerate(sources):
        src[i, :len(s)] = np.frombuffer(s, np.uint8)
    with open(path, 'wb') as f:
        f.write(ps.HEADER.encode() + b'\n')
        for start in range(0, rows, chunk):
            k = min(chunk, rows - start)
            a = pool[rng.integers(0, len(pool), k)]
            q = np.where(rng.random((k, L)) < blank_p, np.uint8(46), a)
            s = rng.integers(0, len(sources), k)
            rating = rng.integers(0, 1000, k)
            rlen = 1 + (rating >= 10) + (rating >= 100)
            j = np.arange(3)
            rdig = (rating[:, None] // 10 ** np.clip(rlen[:, None] - 1 - j, 0, 2) % 10 + 48).astype(np.uint8)
            line = np.concatenate([src[s], np.full((k, 1), 44, np.uint8), q, np.full((k, 1), 44, np.uint8), a,
                                   np.full((k, 1), 44, np.uint8), rdig, np.full((k, 1), 10, np.uint8)], axis=1)
            used = np.ones(line.shape, bool)
            used[:, :width] = np.arange(width) < np.array(list(map(len, sources)))[s][:, None]
            used[:, width + 2 * L + 3:width + 2 * L + 6] = j < rlen[:, None]
            f.write(line[used].tobytes())
    return path


def read_csv_rows(path):
    with open(path, newline='') as f:
        reader = csv.reader(f)
        next(reader)
        return list(reader)


def reference_arrays(path, min_difficulty=None):
    """What a straightforward per-row builder (the reference's algorithm, num_aug 0, no subsample)
    gives for one CSV: digits + 1, '.' -> blank token 1."""
    ins, labs = [], []
    for source, q, a, rating in read_csv_rows(path):
        if min_difficulty is None or int(rating) >= min_difficulty:
            ins.append(np.frombuffer(q.replace('.', '0').encode(), np.uint8) - 48 + 1)
            labs.append(np.frombuffer(a.encode(), np.uint8) - 48 + 1)
    return np.array(ins, np.int32), np.array(labs, np.int32)


def load_split(root, split):
    d = os.path.join(root, split)
    arrays = {k: np.load(os.path.join(d, f'all__{k}.npy')) for k in
              ('inputs', 'labels', 'puzzle_identifiers', 'puzzle_indices', 'group_indices')}
    with open(os.path.join(d, 'dataset.json')) as f:
        return arrays, json.load(f)


def split_bytes(root):
    out = {}
    for split in ('train', 'test'):
        for name in sorted(os.listdir(os.path.join(root, split))):
            with open(os.path.join(root, split, name), 'rb') as f:
                out[split, name] = f.read()
    return out


@pytest.fixture
def csv_dir(tmp_path):
    d = tmp_path / 'csv'
    d.mkdir()
    write_synthetic_csv(d / 'train.csv', 400, seed=1)
    write_synthetic_csv(d / 'test.csv', 300, seed=2)
    return d


# -----------------------------------------------------------------------------
# CSV -> .npy

def test_sudoku_test_split_round_trips_and_matches_reference(csv_dir, tmp_path):
    out = tmp_path / 'out'
    ps.build(csv_dir, out, num_aug=3, subsample_size=50)
    arrays, meta = load_split(out, 'test')
    rows = read_csv_rows(csv_dir / 'test.csv')
    assert tokens_to_strings(arrays['inputs']) == [r[1] for r in rows]
    assert tokens_to_strings(arrays['labels']) == [r[2] for r in rows]
    ref_in, ref_lab = reference_arrays(csv_dir / 'test.csv')
    N = len(rows)
    assert arrays['inputs'].dtype == np.int32 and np.array_equal(arrays['inputs'], ref_in)
    assert np.array_equal(arrays['labels'], ref_lab)
    assert np.array_equal(arrays['puzzle_indices'], np.arange(N + 1))
    assert np.array_equal(arrays['group_indices'], np.arange(N + 1))
    assert np.array_equal(arrays['puzzle_identifiers'], np.zeros(N))
    assert meta == dict(pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=11, seq_len=81,
                        num_puzzle_identifiers=1, total_groups=N, mean_puzzle_examples=1.0, total_puzzles=N,
                        sets=['all'], puzzle_type='sudoku', grid_size=9)
    assert json.load(open(out / 'identifiers.json')) == ['<blank>']
    # train without subsample/augmentation is the reference's too; '0' blanks read like '.'
    text = (csv_dir / 'train.csv').read_text()
    (csv_dir / 'train.csv').write_text(text.replace('.', '0'))
    ps.build(csv_dir, tmp_path / 'full')
    arrays, _ = load_split(tmp_path / 'full', 'train')
    ref_in, ref_lab = reference_arrays(csv_dir / 'train.csv')
    assert np.array_equal(arrays['inputs'], ref_in) and np.array_equal(arrays['labels'], ref_lab)


def test_sudoku_train_layout_subsample_and_min_difficulty(csv_dir, tmp_path):
    ps.build(csv_dir, tmp_path / 'o', subsample_size=40, num_aug=5, min_difficulty=300, seed=3)
    arrays, meta = load_split(tmp_path / 'o', 'train')
    assert meta['total_groups'] == 40 and meta['total_puzzles'] == 240 and len(arrays['inputs']) == 240
    assert np.array_equal(arrays['group_indices'], np.arange(0, 241, 6))
    assert np.array_equal(arrays['puzzle_indices'], np.arange(241))
    # every group starts with an unaugmented row of the CSV whose rating passes the filter
    rows = {(q, a): int(r) for _, q, a, r in read_csv_rows(csv_dir / 'train.csv')}
    originals = zip(tokens_to_strings(arrays['inputs'][::6]), tokens_to_strings(arrays['labels'][::6]))
    ratings = [rows[key] for key in originals]
    assert min(ratings) >= 300 and len(set(ratings)) > 1
    # the test split is filtered too, as the reference's builder filters both: its rows, in file order
    arrays, meta = load_split(tmp_path / 'o', 'test')
    ref_in, ref_lab = reference_arrays(csv_dir / 'test.csv', min_difficulty=300)
    assert 0 < len(ref_in) < len(read_csv_rows(csv_dir / 'test.csv')) and meta['total_puzzles'] == len(ref_in)
    assert np.array_equal(arrays['inputs'], ref_in) and np.array_equal(arrays['labels'], ref_lab)


def test_sudoku_seed_determinism(csv_dir, tmp_path):
    for name, seed in (('a', 0), ('b', 0), ('c', 1)):
        ps.build(csv_dir, tmp_path / name, subsample_size=30, num_aug=20, seed=seed)
    a, b, c = (split_bytes(tmp_path / x) for x in 'abc')
    assert a == b
    assert a[('train', 'all__inputs.npy')] != c[('train', 'all__inputs.npy')]
    assert a[('test', 'all__inputs.npy')] == c[('test', 'all__inputs.npy')]  # test split has no randomness


def _check_augmented(inputs, labels, K, n):
    L = n * n
    assert sudoku_correct(inputs, labels, n).all()  # labels solve their (augmented) inputs
    assert sudoku_correct(labels, labels, n).all()
    g_in, g_lab = inputs.reshape(-1, K, L), labels.reshape(-1, K, L)
    # a copy keeps the number of givens, and every given agrees with the copy's solution
    assert ((g_in == 1).sum(2) == (g_in[:, :1] == 1).sum(2)).all()
    assert ((g_in == g_lab) | (g_in == 1)).all()
    assert (g_lab[:, 1:] != g_lab[:, :1]).any(2).mean() > 0.9  # copies really are shuffled


def test_sudoku_augmentations_keep_solutions_valid(csv_dir, tmp_path):
    ps.build(csv_dir, tmp_path / 'o', subsample_size=20, num_aug=50, seed=5)
    arrays, _ = load_split(tmp_path / 'o', 'train')
    _check_augmented(arrays['inputs'], arrays['labels'], 51, 9)
    rng = np.random.default_rng(0)
    for n in (4, 6, 9):
        grids = _valid_grids(rng, 30, n)
        q = np.where(rng.random(grids.shape) < 0.5, 0, grids)
        inp, lab = ps.augment(q.astype(np.uint8) + 1, grids.astype(np.uint8) + 1, n, 40, rng)
        _check_augmented(inp, lab, 41, n)
        pos, token_map = Sudoku(n).draw(rng, 4000)
        assert (np.sort(pos, 1) == np.arange(n * n)).all()  # every position map is a permutation
        assert (token_map[:, :2] == (0, 1)).all() and (np.sort(token_map[:, 2:n + 2], 1) == np.arange(2, n + 2)).all()
        src_row = pos.reshape(-1, n, n) // n
        transposed = ~(src_row == src_row[:, :, :1]).all(2)  # an output row drawn from several input rows
        assert (0.45 < transposed.mean() < 0.55) if n != 6 else not transposed.any()  # 6x6: boxes not square


def test_every_kinds_symmetries_map_answers_to_answers_and_invert():
    rng = np.random.default_rng(1)
    for kind in (Sudoku(4), Sudoku(6), Sudoku(9)):
        grids = _valid_grids(rng, 200, kind.n) + 1
        q = np.where(rng.random(grids.shape) < 0.5, 1, grids)
        sym = kind.draw(rng, len(q))
        q2, a2 = kind.apply(q, sym), kind.apply(grids, sym)
        assert kind.correct(q2, a2).all() and (a2 != grids).any(1).mean() > 0.9
        assert (kind.apply(a2, kind.invert(sym)) == grids).all() and (kind.apply(q2, kind.invert(sym)) == q).all()
    maze = ['#######', '#S   G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    path = ['#######', '#SoooG#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    kind = Maze(7)
    q, a = _tokens(*[maze] * 8), _tokens(*[path] * 8)
    sym = kind.dihedral(range(8))
    images = kind.apply(q, sym)
    assert kind.correct(images, kind.apply(a, sym)).all() and len({r.tobytes() for r in images}) == 8
    sym = kind.draw(rng, 8)
    assert (kind.apply(kind.apply(a, sym), kind.invert(sym)) == a).all()


def test_augmented_datasets_stay_byte_for_byte(tmp_path):
    """The builders' augmentation draws the same symmetries from the same seed as it always did: datasets
    built before the kinds owned their symmetries are these bytes."""
    def digest(root):
        h = hashlib.sha256()
        for split in ('train', 'test'):
            for name in sorted(os.listdir(os.path.join(root, split))):
                h.update(open(os.path.join(root, split, name), 'rb').read())
        return h.hexdigest()[:16]
    t = str(tmp_path)
    for n, aug, want in ((4, 5, '2aae8251e633c3ef'), (6, 7, 'c0d1f482b8d3ed20'), (9, 3, '612ec63c3423ad1a')):
        ps.write_csv(f'{t}/s{n}/train.csv', ps.generate_puzzles(12, n, seed=n), 'g')
        ps.write_csv(f'{t}/s{n}/test.csv', ps.generate_puzzles(3, n, seed=100 + n), 'g')
        ps.build(f'{t}/s{n}', f'{t}/o{n}', num_aug=aug, seed=7)
        assert digest(f'{t}/o{n}') == want, n
    pm.generate_csvs(f'{t}/m', 10, 3, size=9, min_path_len=4, seed=1)
    pm.build_dataset(f'{t}/m', f'{t}/om', aug=True, seed=2)
    assert digest(f'{t}/om') == 'b98b50fb913cfebd'


# -----------------------------------------------------------------------------
# verifier

def test_sudoku_verifier():
    sol = np.frombuffer(INKALA_SOLUTION.encode(), np.uint8).astype(np.int64) - 48 + 1
    puzzle = np.frombuffer(HARD_9X9['inkala'].replace('.', '0').encode(), np.uint8).astype(np.int64) - 48 + 1
    assert sudoku_correct(puzzle[None], sol[None]).tolist() == [True]
    changed_given = puzzle.copy()
    changed_given[0] = 2 if sol[0] != 2 else 3  # a given the solution contradicts
    r, c = np.divmod(np.arange(81), 9)
    latin = (r + c) % 9 + 2  # rows and columns fine, boxes repeat digits
    bad_digit = sol.copy()
    bad_digit[40] = 0  # PAD is no digit
    swapped = sol.copy()
    swapped[[1, 2]] = swapped[[2, 1]]  # two blanks of row 1 swapped: the columns repeat digits
    relabelled = np.where(sol == 2, 3, np.where(sol == 3, 2, sol))  # a valid grid that changes givens
    blank = np.ones(81, np.int64)
    got = sudoku_correct(np.stack([changed_given, blank, blank, puzzle, puzzle, blank]),
                            np.stack([sol, latin, bad_digit, swapped, relabelled, relabelled]))
    assert got.tolist() == [False, False, False, False, False, True]
    for n in (4, 6):  # other sizes, n inferred from seq_len
        g = _valid_grids(np.random.default_rng(n), 5, n) + 1
        assert sudoku_correct(np.ones_like(g), g).all()
        broken = g.copy()
        broken[:, [0, n]] = broken[:, [n, 0]]  # swap two cells of one column: rows and boxes break
        assert not sudoku_correct(np.ones_like(g), broken).any()


# -----------------------------------------------------------------------------
# solver and generator

def test_sudoku_hard_puzzles_solve():
    for name, p in HARD_9X9.items():
        assert len(p) == 81, name
        sols, guesses = ps.solve(p)
        assert ps.count_solutions(p) == 1, name
        q = np.array([[1 if ch == '.' else int(ch) + 1 for ch in p]])
        assert sudoku_correct(q, np.array(sols) + 1).all(), name
        assert guesses > 0, name
    assert ''.join(map(str, ps.solve(HARD_9X9['inkala'])[0][0])) == INKALA_SOLUTION
    assert ps.count_solutions('.' * 81) == 2 and ps.count_solutions('11' + '.' * 79) == 0


@pytest.mark.parametrize('n,count,min_rating', [(4, 60, 0), (6, 20, 0), (9, 4, 1)])
def test_sudoku_generator(n, count, min_rating):
    puzzles = ps.generate_puzzles(count, n, seed=7, min_rating=min_rating)
    assert puzzles == ps.generate_puzzles(count, n, seed=7, min_rating=min_rating)  # seeded
    assert len({q for q, _, _ in puzzles}) == count
    for q, a, rating in puzzles:
        assert len(q) == len(a) == n * n
        assert ps.count_solutions(q) == 1
        sols, guesses = ps.solve(q)
        assert ''.join(map(str, sols[0])) == a and rating == guesses >= min_rating


def test_sudoku_generate_cli(tmp_path, capsys):
    out = tmp_path / 's6'
    assert ps.main(['--generate', '12', '--num_test', '3', '--size', '6', '--num_aug', '4',
                    '--output_dir', str(out), '--seed', '2']) == 0
    first = (out / 'csv' / 'train.csv').read_bytes()
    arrays, meta = load_split(out, 'train')
    assert meta['vocab_size'] == 8 and meta['seq_len'] == 36 and meta['grid_size'] == 6
    assert meta['total_groups'] == 12 and meta['total_puzzles'] == 60
    _check_augmented(arrays['inputs'], arrays['labels'], 5, 6)
    test_arrays, test_meta = load_split(out, 'test')
    assert test_meta['total_puzzles'] == 3 and test_meta['puzzle_type'] == 'sudoku'
    assert tokens_to_strings(test_arrays['inputs']) == [r[1] for r in read_csv_rows(out / 'csv' / 'test.csv')]
    assert ps.main(['--generate', '12', '--num_test', '3', '--size', '6', '--output_dir', str(tmp_path / 'again'),
                    '--seed', '2']) == 0
    assert (tmp_path / 'again' / 'csv' / 'train.csv').read_bytes() == first
    capsys.readouterr()
    assert ps.main(['--generate', '50', '--size', '4', '--min_rating', '1', '--output_dir', str(tmp_path / 'x')]) == 1
    assert 'found only 0 of 55 distinct 4x4 puzzles with rating >= 1' in capsys.readouterr().err


# -----------------------------------------------------------------------------
# malformed rows

BAD_ROWS = [  # (how to break a good row, words the message must contain)
    (lambda s, q, a, r: f"{s},{q},{a}", 'expected 4 fields'),
    (lambda s, q, a, r: f"{s},{q[:-1]},{a},{r}", 'question has 80 characters'),
    (lambda s, q, a, r: f"{s},{q},{a}5,{r}", 'answer has 82 characters'),
    (lambda s, q, a, r: f"{s},x{q[1:]},{a},{r}", "invalid character 'x' at position 1"),
    (lambda s, q, a, r: f"{s},{q[:4]}\u00e9{q[5:]},{a},{r}", "invalid character '\u00e9' at position 5"),  # 2 bytes
    (lambda s, q, a, r: f"{s},{q},0{a[1:]},{r}", "answer has the invalid character '0'"),
    (lambda s, q, a, r: f"{s},{q},{a},1.5", "rating '1.5' is not an integer"),
    (lambda s, q, a, r: f"{s},{q},{a},", "rating '' is not an integer"),
    (lambda s, q, a, r: f"{s},{q[:80]}{int(a[80]) % 9 + 1},{a},{r}", 'where the question gives'),
    (lambda s, q, a, r: f"{s},{q},{a[1]}{a[0]}{a[2:]},{r}", 'answer repeats the digit'),
]


def test_sudoku_malformed_rows(csv_dir, tmp_path, capsys):
    lines = (csv_dir / 'train.csv').read_text().splitlines()
    good = list(lines)
    bad_lines = []
    for k, (breaker, _) in enumerate(BAD_ROWS):
        at = 5 + 7 * k  # 0-based index in the file = 1-based line - 1
        lines[at] = breaker(*lines[at].split(','))
        bad_lines.append(at + 1)
    for k, (breaker, words) in enumerate(BAD_ROWS):  # each kind alone: the message names file and line
        one = list(good)
        one[bad_lines[k] - 1] = lines[bad_lines[k] - 1]
        path = tmp_path / f'bad{k}.csv'
        path.write_text('\n'.join(one) + '\n')
        with pytest.raises(ps.CSVFormatError) as e:
            ps.build_split(path, tmp_path / 'o', 'test')
        assert isinstance(e.value, ValueError)
        assert str(e.value).startswith(f"{path}:{bad_lines[k]}: ") and words in str(e.value), (k, str(e.value))
    (csv_dir / 'train.csv').write_text('\r\n'.join(lines))  # CRLF, no final newline: still read right
    assert ps.main(['--csv_dir', str(csv_dir), '--output_dir', str(tmp_path / 'x')]) == 1
    assert f"train.csv:{bad_lines[0]}: expected 4 fields" in capsys.readouterr().err
    assert ps.main(['--csv_dir', str(csv_dir), '--output_dir', str(tmp_path / 'x'), '--skip_bad']) == 0
    captured = capsys.readouterr()
    assert f"400 rows read, {len(BAD_ROWS)} bad rows skipped, {400 - len(BAD_ROWS)} groups" in captured.out
    assert captured.err.count('skipped ') == 5  # the first few are shown
    arrays, _ = load_split(tmp_path / 'x', 'train')
    good_rows = [r.split(',') for i, r in enumerate(lines) if i > 0 and i + 1 not in bad_lines]
    assert tokens_to_strings(arrays['inputs']) == [r[1] for r in good_rows]
    # a subsample draws only good rows: content-bad rows drawn are replaced from the rest
    ps.build(csv_dir, tmp_path / 'sub', subsample_size=400 - len(BAD_ROWS), skip_bad=True, seed=4)
    arrays, _ = load_split(tmp_path / 'sub', 'train')
    assert tokens_to_strings(arrays['inputs']) == [r[1] for r in good_rows]  # all good rows, file order
    with pytest.raises(ps.CSVFormatError, match=rf"train\.csv:{bad_lines[0]}: expected 4 fields"):
        ps.build(csv_dir, tmp_path / 'sub2', subsample_size=10)  # structure is checked on every row
    # line 1 must be a header (other column names only give a note, as the reference skips line 1)
    body = (csv_dir / 'test.csv').read_text().split('\n', 1)[1]
    for header in ('source,question,answer\n', ''):
        (csv_dir / 'test.csv').write_text(header + body)
        with pytest.raises(ps.CSVFormatError, match=r'test\.csv:1: expected the header'):
            ps.scan_csv(csv_dir / 'test.csv')
    (csv_dir / 'test.csv').write_text('a,b,c,d\n' + body)
    assert ps.scan_csv(csv_dir / 'test.csv')['rows'] == 300 and 'differs from' in capsys.readouterr().err


def test_sudoku_test_split_is_read_at_the_train_split_s_size(tmp_path):
    """train.csv of 4x4 rows, test.csv with a 9x9 row first: not a dataset whose splits differ in size, but one
    line naming test.csv's row and both sizes; with --skip_bad the 9x9 row is a bad row of the 4x4 test split."""
    d = tmp_path / 'csv'
    ps.write_csv(d / 'train.csv', ps.generate_puzzles(8, 4, seed=1), 'g')
    ps.write_csv(d / 'test.csv', [(HARD_9X9['inkala'], INKALA_SOLUTION, 0)] + ps.generate_puzzles(2, 4, seed=2), 'g')
    args = ['prepare_sudoku.py', '--csv_dir', str(d), '--output_dir', str(tmp_path / 'o')]
    assert_user_error(run(args, check=False), f"{d / 'test.csv'}:2: question has 81 characters (9x9), expected 16 "
                      f"(4x4: the size of {d / 'train.csv'}:2)", one_line=True)
    assert not os.path.exists(tmp_path / 'o')
    p = run(args + ['--skip_bad'])
    assert 'test: 3 rows read, 1 bad rows skipped' in p.stdout, p.stdout
    assert load_metadata(str(tmp_path / 'o'), 'test')['grid_size'] == 4


def test_sudoku_grid_size_comes_from_the_first_well_formed_row(tmp_path):
    """A first row with a field missing is that row's error (or, with --skip_bad, a bad row skipped), not a grid
    size of -1 characters; a file of no data rows says so."""
    d = tmp_path / 'csv'
    ps.write_csv(d / 'test.csv', ps.generate_puzzles(3, 4, seed=2), 'g')
    ps.write_csv(d / 'train.csv', ps.generate_puzzles(8, 4, seed=1), 'g')
    lines = (d / 'train.csv').read_text().splitlines()
    (d / 'train.csv').write_text('\n'.join(lines[:1] + ['g,' + lines[1].split(',')[1]] + lines[1:]) + '\n')
    args = ['prepare_sudoku.py', '--csv_dir', str(d), '--output_dir', str(tmp_path / 'o')]
    assert_user_error(run(args, check=False), f"{d / 'train.csv'}:2: expected 4 fields (source,question,answer,"
                      "rating), found 2", one_line=True)
    p = run(args + ['--skip_bad'])
    assert 'train: 9 rows read, 1 bad rows skipped, 8 groups' in p.stdout, p.stdout
    assert load_metadata(str(tmp_path / 'o'), 'train')['grid_size'] == 4
    (d / 'train.csv').write_text(ps.HEADER + '\n')
    for extra in ([], ['--skip_bad'], ['--size', '4']):
        assert_user_error(run(args + extra, check=False), f"{d / 'train.csv'}: no data rows", one_line=True)
    (d / 'train.csv').write_text(ps.HEADER + '\nx,1.\nx,12\n')  # rows, none well-formed
    assert_user_error(run(args, check=False), f"{d / 'train.csv'}:2: expected 4 fields", one_line=True)
    assert_user_error(run(args + ['--skip_bad'], check=False), f"{d / 'train.csv'}: none of its 2 data rows is "
                      "well-formed", "line 2: expected 4 fields", one_line=True)


# -----------------------------------------------------------------------------
# download against a local server

def test_sudoku_download(server, tmp_path, csv_dir):
    content = (csv_dir / 'test.csv').read_bytes()
    FileHandler.files.update({'/d/test.csv': content, '/d/train.csv': (csv_dir / 'train.csv').read_bytes()})
    dest = tmp_path / 'dl' / 'test.csv'
    dest.parent.mkdir()
    (tmp_path / 'dl' / 'test.csv.part').write_bytes(content[:10_000])  # an interrupted earlier run
    assert download(f'{server}/d/test.csv', str(dest), expected_rows=300) == str(dest)
    assert dest.read_bytes() == content and not (tmp_path / 'dl' / 'test.csv.part').exists()
    assert FileHandler.log == [('/d/test.csv', 'bytes=10000-', 206)]
    download(f'{server}/d/test.csv', str(dest), expected_rows=300)  # cached: no request
    assert len(FileHandler.log) == 1
    FileHandler.log.clear()
    with pytest.raises(DownloadError, match=r'300 data rows, expected 299'):
        download(f'{server}/d/test.csv', str(dest), expected_rows=299)  # wrong count is a clear error
    with pytest.raises(DownloadError, match=rf'{server}/d/test.csv: 300 data rows, expected 301'):
        download(f'{server}/d/test.csv', str(tmp_path / 'other.csv'), expected_rows=301)
    assert not (tmp_path / 'other.csv').exists() and (tmp_path / 'other.csv.part').exists()
    with pytest.raises(DownloadError) as e:
        download(f'{server}/status/404', str(tmp_path / 'a.csv'))
    assert f'GET {server}/status/404 failed: HTTP 404' in str(e.value)
    with pytest.raises(DownloadError) as e:
        download(f'{server}/status/500', str(tmp_path / 'b.csv'), retries=2, backoff=0.01)
    assert f'GET {server}/status/500 failed: HTTP 500' in str(e.value) and '3 attempts' in str(e.value)
    assert [s for p, _, s in FileHandler.log if p == '/status/500'] == [500, 500, 500]
    FileHandler.fail_once.add('/d/flaky.csv')  # one 503, then fine: retried
    FileHandler.files['/d/flaky.csv'] = content
    download(f'{server}/d/flaky.csv', str(tmp_path / 'flaky.csv'), backoff=0.01)
    assert (tmp_path / 'flaky.csv').read_bytes() == content
    FileHandler.drop_once.add('/d/drop.csv')  # dropped mid-stream: the retry resumes with a Range
    FileHandler.files['/d/drop.csv'] = big = content * 10
    download(f'{server}/d/drop.csv', str(tmp_path / 'drop.csv'), backoff=0.01)
    assert (tmp_path / 'drop.csv').read_bytes() == big
    (_, first, s1), (_, second, s2) = [x for x in FileHandler.log if x[0] == '/d/drop.csv']
    assert first is None and s1 == 200 and s2 == 206
    assert 0 < int(re.fullmatch(r'bytes=(\d+)-', second).group(1)) <= len(big) // 2
    with socket.socket() as s:  # a port with nothing listening
        s.bind(('127.0.0.1', 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(DownloadError, match=f'GET http://127.0.0.1:{closed_port}/x.csv failed: ConnectionError'):
        download(f'http://127.0.0.1:{closed_port}/x.csv', str(tmp_path / 'c.csv'), retries=0)
    # the CLI downloads from --base_url into --download_dir, then builds
    out = tmp_path / 'built'
    assert ps.main(['--base_url', f'{server}/d', '--download_dir', str(tmp_path / 'cache'), '--output_dir',
                    str(out), '--subsample_size', '10', '--num_aug', '2']) == 0
    assert load_split(out, 'train')[1]['total_puzzles'] == 30 and load_split(out, 'test')[1]['total_puzzles'] == 300


# -----------------------------------------------------------------------------
# full-size memory (opt-in: about a minute to write 800 MB of CSV); its wall time is printed, not asserted: a
# test does not race the clock of a slower or shared machine

@pytest.mark.skipif(not os.environ.get('TRM_BENCH_FULL'), reason='set TRM_BENCH_FULL=1 to run the full-size build')
def test_sudoku_full_size_build_memory(tmp_path):
    d = tmp_path / 'csv'
    d.mkdir()
    write_synthetic_csv(d / 'train.csv', ps.EXPECTED_ROWS['train'], seed=1)
    write_synthetic_csv(d / 'test.csv', ps.EXPECTED_ROWS['test'], seed=2)
    cmd = ['/usr/bin/time', '-v', sys.executable, 'prepare_sudoku.py', '--csv_dir', str(d),
           '--output_dir', str(tmp_path / 'out'), '--subsample_size', '1000', '--num_aug', '1000']
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    wall = re.search(r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)', res.stderr)
    seconds = int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))
    rss_mb = int(re.search(r'Maximum resident set size \(kbytes\): (\d+)', res.stderr).group(1)) / 1024
    print(f"full-size build: {seconds:.2f} s wall, {rss_mb:.0f} MB peak RSS")
    assert rss_mb <= 1024


# -----------------------------------------------------------------------------
# prepare_maze.py

def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _write_csv(path, rows):
    with open(path, 'w', newline='') as f:
        w = csv.writer(f, lineterminator='\n')
        w.writerow(['source', 'question', 'answer', 'rating'])
        w.writerows(rows)
    return str(path)


def _tokens(*grids):
    """Mazes given as lists of row strings -> [B, n*n] tokens."""
    return Maze(len(grids[0])).encode([''.join(g) for g in grids]).astype(np.int64)


@pytest.fixture(scope='module')
def gen_csv(tmp_path_factory):
    """A small generated 30x30 set (hard threshold 110), shared by the tests that only read it."""
    d = tmp_path_factory.mktemp('maze_gen') / 'csv'
    pm.generate_csvs(str(d), 24, 8, size=30, seed=0)
    return d


def test_maze_csv_roundtrip(gen_csv, tmp_path):
    out = str(tmp_path / 'ds')
    pm.build_dataset(str(gen_csv), out)
    for split, n_rows in (('train', 24), ('test', 8)):
        rows, arr, meta = _rows(gen_csv / f'{split}.csv'), load_arrays(out, split), load_metadata(out, split)
        assert len(rows) == n_rows
        assert [Maze(30).decode(r) for r in arr['inputs']] == [r['question'] for r in rows]
        assert [Maze(30).decode(r) for r in arr['labels']] == [r['answer'] for r in rows]
        assert meta['vocab_size'] == 6 and meta['seq_len'] == 900 and meta['pad_id'] == 0
        assert meta['ignore_label_id'] == 0 and meta['blank_identifier_id'] == 0
        assert meta['num_puzzle_identifiers'] == 1 and meta['puzzle_type'] == 'maze' and meta['grid_size'] == 30
        assert meta['total_groups'] == meta['total_puzzles'] == n_rows and meta['mean_puzzle_examples'] == 1
        assert np.array_equal(arr['puzzle_indices'], np.arange(n_rows + 1))
        assert np.array_equal(arr['group_indices'], np.arange(n_rows + 1))
        assert not arr['puzzle_identifiers'].any() and arr['inputs'].dtype == np.int32
    with open(os.path.join(out, 'identifiers.json')) as f:
        assert json.load(f) == ['<blank>']
    # other CSV dialects of the same table (CRLF, every field quoted) read the same
    rows = _rows(gen_csv / 'test.csv')
    with open(tmp_path / 'crlf.csv', 'w', newline='') as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL, lineterminator='\r\n')
        w.writerow(['source', 'question', 'answer', 'rating'])
        w.writerows([[r['source'], r['question'], r['answer'], r['rating']] for r in rows])
    q, a, n, skipped = pm.read_csv(str(tmp_path / 'crlf.csv'))
    assert n == 30 and not skipped and np.array_equal(q, load_arrays(out, 'test')['inputs'])


def test_a_maze_csv_with_a_byte_order_mark_reads_as_without(gen_csv, tmp_path):
    # a spreadsheet's UTF-8 export: a BOM before the header, whose first column is then the question
    rows = _rows(gen_csv / 'test.csv')
    with open(tmp_path / 'bom.csv', 'w', newline='', encoding='utf-8-sig') as f:
        w = csv.writer(f, lineterminator='\r\n')
        w.writerow(['question', 'answer', 'source', 'rating'])
        w.writerows([[r['question'], r['answer'], r['source'], r['rating']] for r in rows])
    q, a, n, skipped = pm.read_csv(str(tmp_path / 'bom.csv'))
    assert n == 30 and not skipped and [Maze(30).decode(r) for r in q] == [r['question'] for r in rows]


def test_maze_seed_determinism(gen_csv, tmp_path):
    dirs = {}
    for name, seed in (('a', 3), ('b', 3), ('c', 4)):
        dirs[name] = str(tmp_path / name)
        pm.build_dataset(str(gen_csv), dirs[name], aug=True, subsample_size=20, seed=seed)
    for split in ('train', 'test'):
        names = sorted(os.listdir(os.path.join(dirs['a'], split)))
        match, mismatch, errors = filecmp.cmpfiles(os.path.join(dirs['a'], split), os.path.join(dirs['b'], split),
                                                   names, shallow=False)
        assert match == names and not mismatch and not errors
    a, c = load_arrays(dirs['a'], 'train'), load_arrays(dirs['c'], 'train')
    assert not np.array_equal(a['inputs'], c['inputs'])
    # augmentation order alone (no subsample) also depends on the seed
    for name, seed in (('d', 1), ('e', 2)):
        pm.build_dataset(str(gen_csv), str(tmp_path / name), aug=True, seed=seed)
    assert not np.array_equal(load_arrays(str(tmp_path / 'd'), 'train')['inputs'],
                              load_arrays(str(tmp_path / 'e'), 'train')['inputs'])


def test_maze_dihedral_augmentation(gen_csv, tmp_path):
    out = str(tmp_path / 'aug')
    pm.build_dataset(str(gen_csv), out, aug=True, seed=0)
    arr, meta = load_arrays(out, 'train'), load_metadata(out, 'train')
    x, y = np.asarray(arr['inputs']), np.asarray(arr['labels'])
    assert meta['total_groups'] == 24 and meta['total_puzzles'] == 192 and len(x) == 192
    assert np.array_equal(arr['group_indices'], np.arange(0, 193, 8))
    assert maze_correct(x, y).all()  # every image of a label is still an optimal path of its image
    orig = [r['question'] for r in _rows(gen_csv / 'train.csv')]
    for g in range(24):
        assert Maze(30).decode(x[8 * g]) == orig[g]  # identity first
        images = {x[8 * g + j].tobytes() for j in range(8)}
        square = x[8 * g].reshape(30, 30)
        expected = {np.ascontiguousarray(m(np.rot90(square, k))).tobytes() for k in range(4) for m in (np.copy, np.fliplr)}
        assert images == expected and len(images) == 8
    assert load_metadata(out, 'test')['total_puzzles'] == 8  # test is never augmented


def test_maze_generator(gen_csv, tmp_path):
    for split in ('train', 'test'):
        rows = _rows(gen_csv / f'{split}.csv')
        q, a = _tokens(*[r['question'] for r in rows]), _tokens(*[r['answer'] for r in rows])
        steps = shortest_path_length(q)
        assert (steps > 110).all() and steps.tolist() == [int(r['rating']) for r in rows]
        assert maze_correct(q, a).all()
        assert ((a == PATH).sum(1) + 1 == steps).all()  # length = steps = 'o' cells + 1
    # same seed -> same CSVs; other sizes get a scaled default threshold; the CLI builds the dataset
    d1, d2 = tmp_path / 'g1', tmp_path / 'g2'
    for d in (d1, d2):
        pm.main(['--generate', '6', '--num_test', '3', '--size', '12', '--seed', '5', '--output_dir', str(d)])
    for split in ('train', 'test'):
        assert filecmp.cmp(d1 / 'csv' / f'{split}.csv', d2 / 'csv' / f'{split}.csv', shallow=False)
    assert pm.default_min_path_len(30) == 110 and pm.default_min_path_len(12) == 18
    arr = load_arrays(str(d1), 'train')
    assert len(arr['inputs']) == 6 and (shortest_path_length(arr['inputs']) > 18).all()
    assert load_metadata(str(d1), 'test')['grid_size'] == 12


def test_maze_verifier():
    maze5 = ['#####', '#S  #', '# # #', '#  G#', '#####']  # two shortest paths (4 steps) around the pillar
    path_a = ['#####', '#Soo#', '# #o#', '#  G#', '#####']
    path_b = ['#####', '#S  #', '#o# #', '#ooG#', '#####']
    through_wall = ['#####', '#So #', '# o #', '# oG#', '#####']  # right count, crosses the pillar
    wall_changed = [' ####', '#Soo#', '# #o#', '#  G#', '#####']
    no_start = ['#####', '# oo#', '# #o#', '#  G#', '#####']
    start_as_path = ['#####', '#ooo#', '# #o#', '#  G#', '#####']
    extra_cell = ['#####', '#Soo#', '#o#o#', '#  G#', '#####']
    assert shortest_path_length(_tokens(maze5)).tolist() == [4]
    preds = [path_a, path_b, through_wall, wall_changed, no_start, start_as_path, extra_cell, maze5]
    got = maze_correct(_tokens(*[maze5] * len(preds)), _tokens(*preds))
    assert got.tolist() == [True, True, False, False, False, False, False, False]
    with_pad = _tokens(path_a)
    with_pad[0, 6] = PAD
    assert not maze_correct(_tokens(maze5), with_pad)[0]

    maze7 = ['#######', '#S   G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    short = ['#######', '#SoooG#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    longer = ['#######', '#S   G#', '#o###o#', '#ooooo#', '# ### #', '#     #', '#######']
    broken = ['#######', '#So oG#', '# ### #', '#  o  #', '# ### #', '#     #', '#######']  # 3 'o', not joined
    gap = ['#######', '#So  G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    detour_loop = ['#######', '#SoooG#', '# ### #', '#oo   #', '#o### #', '#oo   #', '#######']
    assert shortest_path_length(_tokens(maze7)).tolist() == [4]
    preds = [short, longer, broken, gap, detour_loop]
    got = maze_correct(_tokens(*[maze7] * len(preds)), _tokens(*preds))
    assert got.tolist() == [True, False, False, False, False]
    # an open room: many shortest paths (8 steps); extra loops or detours are rejected
    room = ['#######', '#S    #', '#     #', '#     #', '#     #', '#    G#', '#######']
    stairs = ['#######', '#So   #', '# oo  #', '#  oo #', '#   o #', '#   oG#', '#######']
    ell = ['#######', '#Soooo#', '#    o#', '#    o#', '#    o#', '#    G#', '#######']
    ell_plus_cycle = ['#######', '#Soooo#', '#    o#', '#oo  o#', '#oo  o#', '#    G#', '#######']
    detour = ['#######', '#Sooo #', '#   o #', '#  oo #', '#  ooo#', '#    G#', '#######']
    assert shortest_path_length(_tokens(room)).tolist() == [8]
    got = maze_correct(_tokens(*[room] * 4), _tokens(stairs, ell, ell_plus_cycle, detour))
    assert got.tolist() == [True, True, False, False]
    # an unsolvable maze is never correct, and its shortest path length is -1
    closed = ['#####', '#S# #', '### #', '#  G#', '#####']
    assert shortest_path_length(_tokens(closed)).tolist() == [-1]
    assert not maze_correct(_tokens(closed), _tokens(closed))[0]


def test_maze_malformed_rows(gen_csv, tmp_path, capsys):
    good = [[r['source'], r['question'], r['answer'], r['rating']] for r in _rows(gen_csv / 'test.csv')[:3]]
    src, q, a, rating = good[0]
    wall = q.index('#')
    o = a.index('o')
    cases = {
        'short': ([src, q[:-1], a[:-1], rating], 'lengths'),
        'char': ([src, 'x' + q[1:], 'x' + a[1:], rating], "outside '# SG'"),
        'two_starts': ([src, q[:wall] + 'S' + q[wall + 1:], a[:wall] + 'S' + a[wall + 1:], rating], 'exactly one S'),
        'wall': ([src, q, a[:wall] + ' ' + a[wall + 1:], rating], "differs from the question"),
        'broken_path': ([src, q, a[:o] + ' ' + a[o + 1:], rating], 'not a shortest'),
        'closed': ([src, q.replace(' ', '#'), q.replace(' ', '#'), rating], 'no open path leads from S to G'),
        'fields': ([src, q], 'field'),
    }
    for name, (bad, reason) in cases.items():
        path = _write_csv(tmp_path / f'{name}.csv', good[:2] + [bad] + good[2:])
        with pytest.raises(ValueError, match=f"{name}.csv:4: .*{reason}"):
            pm.read_csv(path)
    path = _write_csv(tmp_path / 'all.csv', good[:1] + [bad for bad, _ in cases.values()] + good[1:])
    with pytest.raises(ValueError, match=r"all\.csv:3: .*\(6 more bad row"):
        pm.read_csv(path)
    qs, ans, n, skipped = pm.read_csv(path, skip_bad=True)
    assert skipped == len(cases) and n == 30 and [Maze(30).decode(r) for r in qs] == [g[1] for g in good]
    (tmp_path / 'empty.csv').write_text('')
    (tmp_path / 'nohead.csv').write_text(f'{src},{q},{a},{rating}\n')
    for name in ('empty', 'nohead'):
        with pytest.raises(ValueError, match=f"{name}.csv:1: expected a header"):
            pm.read_csv(str(tmp_path / f'{name}.csv'))
    with pytest.raises(ValueError, match="no data rows"):
        pm.read_csv(_write_csv(tmp_path / 'header_only.csv', []))
    # through the CLI: an error by default, a dataset with --skip_bad
    os.makedirs(tmp_path / 'csvs')
    _write_csv(tmp_path / 'csvs' / 'train.csv', good[:1] + [cases['wall'][0]] + good[1:])
    _write_csv(tmp_path / 'csvs' / 'test.csv', good)
    capsys.readouterr()
    assert pm.main(['--csv_dir', str(tmp_path / 'csvs'), '--output_dir', str(tmp_path / 'out')]) == 1
    assert re.search(r"train\.csv:3:", capsys.readouterr().err)  # an error message naming file and line
    assert pm.main(['--csv_dir', str(tmp_path / 'csvs'), '--output_dir', str(tmp_path / 'out'), '--skip_bad']) == 0
    assert load_metadata(str(tmp_path / 'out'), 'train')['total_puzzles'] == 3


def test_maze_test_split_is_read_at_the_train_split_s_size(tmp_path):
    """train.csv of 6x6 mazes, test.csv of two 7x7 ones and a 6x6 one: not a test split of 7x7 mazes with a bad
    row (nor splits that differ in size, without a file named), but one line naming test.csv's first 7x7 row and
    both sizes; with --skip_bad the 7x7 rows are bad rows of the 6x6 test split."""
    small, big, d = tmp_path / 'small', tmp_path / 'big', tmp_path / 'csv'
    pm.generate_csvs(str(small), 4, 2, size=6, seed=1)
    pm.generate_csvs(str(big), 1, 2, size=7, seed=2)
    os.makedirs(d)
    (d / 'train.csv').write_text((small / 'train.csv').read_text())
    one_small = (small / 'test.csv').read_text().splitlines()[1]
    (d / 'test.csv').write_text((big / 'test.csv').read_text() + one_small + '\n')
    args = ['prepare_maze.py', '--csv_dir', str(d), '--output_dir', str(tmp_path / 'o')]
    assert_user_error(run(args, check=False), f"{d / 'test.csv'}:2: question/answer lengths 49/49, expected 36 "
                      f"(6x6: the size of {d / 'train.csv'})", one_line=True)
    assert not os.path.exists(tmp_path / 'o')
    p = run(args + ['--skip_bad'])
    assert 'test: 1 mazes 6x6 -> 1 examples, 1 groups, skipped 2' in p.stdout, p.stdout
    assert load_metadata(str(tmp_path / 'o'), 'test')['grid_size'] == 6


def test_maze_download(gen_csv, http_dir, tmp_path):
    root, url = http_dir
    (root / 'maze').mkdir()
    for split in ('train', 'test'):
        (root / 'maze' / f'{split}.csv').write_bytes((gen_csv / f'{split}.csv').read_bytes())
    out = str(tmp_path / 'dl')
    pm.main(['--base_url', url, '--output_dir', out])
    for split in ('train', 'test'):
        assert filecmp.cmp(os.path.join(out, 'raw', f'{split}.csv'), gen_csv / f'{split}.csv', shallow=False)
        rows = _rows(gen_csv / f'{split}.csv')
        assert [Maze(30).decode(r) for r in load_arrays(out, split)['labels']] == [r['answer'] for r in rows]
