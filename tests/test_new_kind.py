"""
A new puzzle kind is one class: a 4x4 Latin square (each row and column holds each digit once; no boxes) is
defined in this file alone, its dataset built with its own symmetries, and it is trained, evaluated, verified
and solved by the real train.py and solve.py, which learn of it from its registration in puzzles.KINDS (this
file, run as `python tests/test_new_kind.py SCRIPT ARGS...`, registers it and runs the script).
    python -m pytest -q tests/test_new_kind.py
"""
import glob
import os
import re
import runpy
import sys

import numpy as np

from conftest import ROOT, TOY_ARGS, run
from data import write_split
import puzzles


class Latin(puzzles.Sudoku):
    """A Sudoku without boxes: its rule's units are the rows and the columns, its symmetries every row and
    column permutation, the transposition and the relabelling of the digits."""
    name, noun = 'latin', 'Latin square'

    def __init__(self, n):
        super().__init__(n, boxes=False)


def latin_dataset(root, kind, n_train=300, n_test=60, blanks=5, num_aug=3, seed=0):
    """Squares drawn by the kind's symmetries from one pattern, a few cells blanked; each train puzzle with
    num_aug images under the kind's symmetries, one group."""
    rng = np.random.default_rng(seed)
    n = kind.n
    base = ((np.arange(n)[:, None] + np.arange(n)[None, :]) % n + 2).ravel()  # digit d is token d + 1
    for split, count, K in (('train', n_train, 1 + num_aug), ('test', n_test, 1)):
        answers = kind.apply(np.tile(base, (count, 1)), kind.draw(rng, count))
        blank = np.argsort(rng.random((count, kind.L)), 1)[:, :blanks]
        questions = answers.copy()
        np.put_along_axis(questions, blank, 1, 1)
        sym = kind.draw(rng, count * K)
        x, y = np.repeat(questions, K, 0), np.repeat(answers, K, 0)
        x, y = np.where((np.arange(len(x)) % K == 0)[:, None], x, kind.apply(x, sym)), \
            np.where((np.arange(len(y)) % K == 0)[:, None], y, kind.apply(y, sym))
        assert kind.correct(x, y).all()
        N = len(x)
        write_split(str(root), split, x, y, puzzle_identifiers=np.zeros(N, np.int32), puzzle_indices=np.arange(N + 1),
                    group_indices=np.arange(0, N + 1, K), vocab_size=kind.vocab_size,
                    extra=dict(puzzle_type=kind.name, grid_size=n))
    return questions, answers


def with_latin(*args):
    return run([os.path.abspath(__file__), *map(str, args)])


def test_a_latin_square_defined_here_trains_evaluates_verifies_and_solves(tmp_path):
    kind = Latin(4)
    assert [name for name, _ in kind.units] == [f"row {i}" for i in range(1, 5)] + [f"column {i}" for i in range(1, 5)]
    data, out = tmp_path / 'latin4', tmp_path / 'out'
    questions, answers = latin_dataset(data, kind)
    p = with_latin('train.py', f'--data_path={data}', f'--out_dir={out}', *TOY_ARGS, '--epochs=40',
                   '--eval_every_epochs=20', '--log_interval=50')
    evals = [l for l in p.stdout.splitlines() if l.startswith('eval on 60:')]
    assert evals and all(' | verified ' in l for l in evals), p.stdout[-3000:]  # the kind's verifier ran
    assert 'held-out puzzle   ->   model answer' in p.stdout
    verified = float(re.search(r'\| verified ([\d.]+)', evals[-1]).group(1))
    assert verified > 0.5, evals[-1]
    ckpt = sorted(glob.glob(str(out / 'ckpt_*.pt')))[-1]
    # solve.py reads the kind's text, checks its givens by its rule and verifies answers by it
    texts = [kind.decode(q) for q in questions[:20]]
    pfile = tmp_path / 'squares.txt'
    pfile.write_text('\n'.join(texts) + '\n')
    p = with_latin('solve.py', f'--init_from={ckpt}', f'--file={pfile}', '--quiet=True')
    assert '4x4 Latin squares' in p.stdout, p.stdout
    lines = [l for l in p.stdout.splitlines() if re.match(r'puzzle \d+: ', l)]
    assert len(lines) == 20
    for q, line in zip(questions, lines):  # the verdict is the rule's: rows and columns, the givens kept
        a = np.array([int(c) for c in line.rsplit('answer ', 1)[1]]).reshape(4, 4)
        given = q.reshape(4, 4) - 1  # 0 blank, else the digit
        valid = all(len(set(u)) == 4 for u in [*a, *a.T]) and ((given == 0) | (given == a)).all()
        assert ('solved (verified)' in line) == valid, line
    assert sum('solved (verified)' in l for l in lines) >= 10, p.stdout
    p = run([os.path.abspath(__file__), 'solve.py', f'--init_from={ckpt}', '--puzzle=1..1............'], check=False)
    assert p.returncode != 0 and 'the givens contradict each other: 1 twice in row 1' in p.stderr, p.stderr
    p = run([os.path.abspath(__file__), 'solve.py', f'--init_from={ckpt}', '--puzzle=3....3..........'], check=False)
    assert p.returncode == 0 and 'box' not in p.stdout + p.stderr  # no boxes: a Sudoku's clash is none here


if __name__ == '__main__':  # the real script, with the Latin square known: python tests/test_new_kind.py SCRIPT ARGS
    puzzles.KINDS[Latin.name] = Latin
    sys.argv = sys.argv[1:]
    sys.path.insert(0, ROOT)
    runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name='__main__')
