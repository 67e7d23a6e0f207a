"""Tests of prepare_maze.py: CSV round trip, seeds, augmentation, generator, verifier, bad rows, download."""
import csv
import filecmp
import functools
import http.server
import json
import os
import threading

import numpy as np
import pytest

import prepare_maze as pm
from data import load_arrays, load_metadata


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
    return pm.encode([''.join(g) for g in grids]).astype(np.int64)


@pytest.fixture(scope='module')
def gen_csv(tmp_path_factory):
    """A small generated 30x30 set (hard threshold 110), shared by the tests that only read it."""
    d = tmp_path_factory.mktemp('maze_gen') / 'csv'
    pm.generate_csvs(str(d), 24, 8, size=30, seed=0)
    return d


def test_csv_roundtrip(gen_csv, tmp_path):
    out = str(tmp_path / 'ds')
    pm.build_dataset(str(gen_csv), out)
    for split, n_rows in (('train', 24), ('test', 8)):
        rows, arr, meta = _rows(gen_csv / f'{split}.csv'), load_arrays(out, split), load_metadata(out, split)
        assert len(rows) == n_rows
        assert [pm.decode(r) for r in arr['inputs']] == [r['question'] for r in rows]
        assert [pm.decode(r) for r in arr['labels']] == [r['answer'] for r in rows]
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


def test_seed_determinism(gen_csv, tmp_path):
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


def test_dihedral_augmentation(gen_csv, tmp_path):
    out = str(tmp_path / 'aug')
    pm.build_dataset(str(gen_csv), out, aug=True, seed=0)
    arr, meta = load_arrays(out, 'train'), load_metadata(out, 'train')
    x, y = np.asarray(arr['inputs']), np.asarray(arr['labels'])
    assert meta['total_groups'] == 24 and meta['total_puzzles'] == 192 and len(x) == 192
    assert np.array_equal(arr['group_indices'], np.arange(0, 193, 8))
    assert pm.maze_correct(x, y).all()  # every image of a label is still an optimal path of its image
    orig = [r['question'] for r in _rows(gen_csv / 'train.csv')]
    for g in range(24):
        assert pm.decode(x[8 * g]) == orig[g]  # identity first
        images = {x[8 * g + j].tobytes() for j in range(8)}
        expected = {pm.dihedral(x[8 * g].reshape(30, 30), k).reshape(-1).tobytes() for k in range(8)}
        assert images == expected and len(images) == 8
    assert load_metadata(out, 'test')['total_puzzles'] == 8  # test is never augmented


def test_generator(gen_csv, tmp_path):
    for split in ('train', 'test'):
        rows = _rows(gen_csv / f'{split}.csv')
        q, a = _tokens(*[r['question'] for r in rows]), _tokens(*[r['answer'] for r in rows])
        steps = pm.shortest_path_length(q)
        assert (steps > 110).all() and steps.tolist() == [int(r['rating']) for r in rows]
        assert pm.maze_correct(q, a).all()
        assert ((a == pm.PATH).sum(1) + 1 == steps).all()  # length = steps = 'o' cells + 1
    # same seed -> same CSVs; other sizes get a scaled default threshold; the CLI builds the dataset
    d1, d2 = tmp_path / 'g1', tmp_path / 'g2'
    for d in (d1, d2):
        pm.main(['--generate', '6', '--num_test', '3', '--size', '12', '--seed', '5', '--output_dir', str(d)])
    for split in ('train', 'test'):
        assert filecmp.cmp(d1 / 'csv' / f'{split}.csv', d2 / 'csv' / f'{split}.csv', shallow=False)
    assert pm.default_min_path_len(30) == 110 and pm.default_min_path_len(12) == 18
    arr = load_arrays(str(d1), 'train')
    assert len(arr['inputs']) == 6 and (pm.shortest_path_length(arr['inputs']) > 18).all()
    assert load_metadata(str(d1), 'test')['grid_size'] == 12


def test_verifier():
    maze5 = ['#####', '#S  #', '# # #', '#  G#', '#####']  # two shortest paths (4 steps) around the pillar
    path_a = ['#####', '#Soo#', '# #o#', '#  G#', '#####']
    path_b = ['#####', '#S  #', '#o# #', '#ooG#', '#####']
    through_wall = ['#####', '#So #', '# o #', '# oG#', '#####']  # right count, crosses the pillar
    wall_changed = [' ####', '#Soo#', '# #o#', '#  G#', '#####']
    no_start = ['#####', '# oo#', '# #o#', '#  G#', '#####']
    start_as_path = ['#####', '#ooo#', '# #o#', '#  G#', '#####']
    extra_cell = ['#####', '#Soo#', '#o#o#', '#  G#', '#####']
    assert pm.shortest_path_length(_tokens(maze5)).tolist() == [4]
    preds = [path_a, path_b, through_wall, wall_changed, no_start, start_as_path, extra_cell, maze5]
    got = pm.maze_correct(_tokens(*[maze5] * len(preds)), _tokens(*preds))
    assert got.tolist() == [True, True, False, False, False, False, False, False]
    with_pad = _tokens(path_a)
    with_pad[0, 6] = pm.PAD
    assert not pm.maze_correct(_tokens(maze5), with_pad)[0]

    maze7 = ['#######', '#S   G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    short = ['#######', '#SoooG#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    longer = ['#######', '#S   G#', '#o###o#', '#ooooo#', '# ### #', '#     #', '#######']
    broken = ['#######', '#So oG#', '# ### #', '#  o  #', '# ### #', '#     #', '#######']  # 3 'o', not joined
    gap = ['#######', '#So  G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    detour_loop = ['#######', '#SoooG#', '# ### #', '#oo   #', '#o### #', '#oo   #', '#######']
    assert pm.shortest_path_length(_tokens(maze7)).tolist() == [4]
    preds = [short, longer, broken, gap, detour_loop]
    got = pm.maze_correct(_tokens(*[maze7] * len(preds)), _tokens(*preds))
    assert got.tolist() == [True, False, False, False, False]
    # an open room: many shortest paths (8 steps); extra loops or detours are rejected
    room = ['#######', '#S    #', '#     #', '#     #', '#     #', '#    G#', '#######']
    stairs = ['#######', '#So   #', '# oo  #', '#  oo #', '#   o #', '#   oG#', '#######']
    ell = ['#######', '#Soooo#', '#    o#', '#    o#', '#    o#', '#    G#', '#######']
    ell_plus_cycle = ['#######', '#Soooo#', '#    o#', '#oo  o#', '#oo  o#', '#    G#', '#######']
    detour = ['#######', '#Sooo #', '#   o #', '#  oo #', '#  ooo#', '#    G#', '#######']
    assert pm.shortest_path_length(_tokens(room)).tolist() == [8]
    got = pm.maze_correct(_tokens(*[room] * 4), _tokens(stairs, ell, ell_plus_cycle, detour))
    assert got.tolist() == [True, True, False, False]
    # an unsolvable maze is never correct, and its shortest path length is -1
    closed = ['#####', '#S# #', '### #', '#  G#', '#####']
    assert pm.shortest_path_length(_tokens(closed)).tolist() == [-1]
    assert not pm.maze_correct(_tokens(closed), _tokens(closed))[0]


def test_malformed_rows(gen_csv, tmp_path):
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
        'fields': ([src, q], 'field'),
    }
    for name, (bad, reason) in cases.items():
        path = _write_csv(tmp_path / f'{name}.csv', good[:2] + [bad] + good[2:])
        with pytest.raises(ValueError, match=f"{name}.csv:4: .*{reason}"):
            pm.read_csv(path)
    path = _write_csv(tmp_path / 'all.csv', good[:1] + [bad for bad, _ in cases.values()] + good[1:])
    with pytest.raises(ValueError, match=r"all\.csv:3: .*\(5 more bad row"):
        pm.read_csv(path)
    qs, ans, n, skipped = pm.read_csv(path, skip_bad=True)
    assert skipped == len(cases) and n == 30 and [pm.decode(r) for r in qs] == [g[1] for g in good]
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
    with pytest.raises(ValueError, match=r"train\.csv:3:"):
        pm.main(['--csv_dir', str(tmp_path / 'csvs'), '--output_dir', str(tmp_path / 'out')])
    pm.main(['--csv_dir', str(tmp_path / 'csvs'), '--output_dir', str(tmp_path / 'out'), '--skip_bad'])
    assert load_metadata(str(tmp_path / 'out'), 'train')['total_puzzles'] == 3


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path):
    """Serve a temporary folder on 127.0.0.1; the server stops when the test ends."""
    root = tmp_path / 'srv'
    root.mkdir()
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0),
                                             functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    try:
        yield root, f'http://127.0.0.1:{server.server_port}/maze'
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_download(gen_csv, http_dir, tmp_path):
    root, url = http_dir
    (root / 'maze').mkdir()
    for split in ('train', 'test'):
        (root / 'maze' / f'{split}.csv').write_bytes((gen_csv / f'{split}.csv').read_bytes())
    out = str(tmp_path / 'dl')
    pm.main(['--base_url', url, '--output_dir', out])
    for split in ('train', 'test'):
        assert filecmp.cmp(os.path.join(out, 'raw', f'{split}.csv'), gen_csv / f'{split}.csv', shallow=False)
        rows = _rows(gen_csv / f'{split}.csv')
        assert [pm.decode(r) for r in load_arrays(out, split)['labels']] == [r['answer'] for r in rows]
