"""
solve.py --eval_views=K, as a user runs it: a tiny TRM trained here on 4x4 Sudokus (half-trained, so that its views
disagree) solves each puzzle in K views; the output names every distinct answer, mapped back to the puzzle, with
the views that gave it and the verifier's verdict, the vote's answer and the verifier's pick. A view's answer is
the answer to the transformed puzzle solved alone, mapped back; --eval_views=1 is solve.py as before; a kind without
symmetries, an unknown dataset and --eval_views=0 are one-line errors. This file, run as
`python tests/test_solve_views.py solve.py ARGS...`, registers a Sudoku kind without symmetries and runs solve.py.
    python -m pytest -q tests/test_solve_views.py
"""
import csv
import glob
import json
import os
import re
import runpy
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT, run
import puzzles

K = 4


def solve(*args, check=True):
    return run(['solve.py', *map(str, args)], check=check)


def summaries(out):
    """{puzzle number: its summary line}."""
    return {int(m.group(1)): l for l in out.splitlines() if (m := re.match(r'puzzle (\d+): ', l))}


def answers_of(line):
    """A views summary line's distinct answers: {name: (views, accepted)}."""
    part = re.search(r' \| answers (.*?) \| ', line).group(1)
    return {name: ([int(v) for v in vs.split()], verdict == 'accepted')
            for name, vs, verdict in re.findall(r'([A-Z]+) \d+ \(views? ([\d ]+)\) (accepted|rejected)', part)}


def valid(question, answer):
    """A 4x4 Sudoku's answer keeps the givens and holds each digit once in every row, column and box."""
    a = np.array([int(c) if c.isdigit() else 0 for c in answer]).reshape(4, 4)
    boxes = [a[r:r + 2, c:c + 2].ravel() for r in (0, 2) for c in (0, 2)]
    kept = all(q == '.' or q == c for q, c in zip(question, answer))
    return kept and all(sorted(u) == [1, 2, 3, 4] for u in [*a, *a.T, *boxes])


@pytest.fixture(scope='module')
def sudoku4(tmp_path_factory):
    """A 4x4 Sudoku checkpoint after 125 steps (it solves about half the held-out puzzles) and the held-out
    puzzles."""
    tmp = tmp_path_factory.mktemp('views')
    data, out = tmp / 's4', tmp / 'o4'
    run(['prepare_sudoku.py', '--generate', '400', '--size', '4', '--num_test', '20', '--num_aug', '1',
         '--output_dir', str(data)])
    run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--device=cpu', '--hidden_size=32', '--num_heads=2',
         '--puzzle_emb_ndim=0', '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=3', '--global_batch_size=64',
         '--epochs=20', '--eval_every_epochs=20', '--log_interval=50', '--lr=2e-3', '--lr_warmup_steps=10',
         '--forward_dtype=float32', '--xla_cache_dir='])
    with open(data / 'csv' / 'test.csv') as f:
        questions = [r['question'] for r in csv.DictReader(f)]
    pfile = tmp / 'puzzles.txt'
    pfile.write_text('\n'.join(questions) + '\n')
    return SimpleNamespace(tmp=tmp, data=data, ckpt=sorted(glob.glob(str(out / 'ckpt_*.pt')))[-1],
                           questions=questions, file=pfile)


def test_views_show_the_answers_the_vote_and_the_verifiers_pick(sudoku4):
    p = solve(f'--init_from={sudoku4.ckpt}', f'--file={sudoku4.file}', f'--eval_views={K}', '--quiet=True')
    assert f'20 puzzles in {K} views each' in p.stdout
    lines = summaries(p.stdout)
    assert sorted(lines) == list(range(1, 21))
    split = 0
    for i, line in lines.items():
        q = sudoku4.questions[i - 1]
        groups = answers_of(line)
        assert sorted(v for vs, _ in groups.values() for v in vs) == list(range(K)), line  # each view once
        voted = re.search(r'the vote: answer ([A-Z]+) \((\d+) of 4 views\), (accepted|rejected)', line)
        assert voted and voted.group(1) == 'A' and int(voted.group(2)) == max(len(vs) for vs, _ in groups.values())
        assert (voted.group(3) == 'accepted') == groups['A'][1]
        pick = re.search(r"the verifier's pick: answer ([A-Z]+)", line)
        any_ok = any(ok for _, ok in groups.values())
        # the verifier picks an accepted answer where a view found one, else the vote's stands
        assert line.startswith(f'puzzle {i}: solved (verified) in 4 views' if any_ok else
                               f"puzzle {i}: NOT solved (the verifier rejects every view's answer) in 4 views")
        assert (pick is not None) == (any_ok and not groups['A'][1]), line
        assert valid(q, line.rsplit('answer ', 1)[1]) == any_ok, line
        split += len(groups) > 1
    assert split, "every puzzle's views agree: no vote to show"
    m = re.search(r"solved (\d+)/20 \(verified: the verifier's pick of 4 views\) \| the vote's answer accepted "
                  r"(\d+)/20", p.stdout)
    assert m and int(m.group(1)) >= int(m.group(2)), p.stdout[-2000:]

    # verbose: each distinct answer's line, its board, with its views' steps and halt probabilities
    one = next(i for i, l in lines.items() if len(answers_of(l)) > 1)
    v = solve(f'--init_from={sudoku4.ckpt}', f'--puzzle={sudoku4.questions[one - 1]}', f'--eval_views={K}')
    shown = [l for l in v.stdout.splitlines() if l.startswith('answer ')]
    assert len(shown) == len(answers_of(summaries(v.stdout)[1])) > 1
    assert re.match(r"answer A: \d of 4 views \(views? \d: step \d, halt prob [01]\.\d{3}.*\) \| (accepted|rejected) "
                    r"by the verifier \| the vote's", shown[0]), shown[0]
    assert "cells that differ from answer A marked *" in v.stdout


def test_a_views_answer_is_the_transformed_puzzle_solved_and_mapped_back(sudoku4):
    """View j of puzzle i (from 0) is the puzzle under Grid.views(K, 1, 0, i)'s symmetry j: solving that
    puzzle alone and mapping its answer back gives the answer the views run shows for view j."""
    kind = puzzles.Sudoku(4)
    p = solve(f'--init_from={sudoku4.ckpt}', f'--file={sudoku4.file}', f'--eval_views={K}')
    i = next(n - 1 for n, l in summaries(p.stdout).items() if len(answers_of(l)) > 1)  # views that disagree
    q = sudoku4.questions[i]
    block = p.stdout.split(f'puzzle {i + 1} (line {i + 1}')[1].split(f'puzzle {i + 1}: ')[0]
    shown = dict(re.findall(r'^answer ([A-Z]+): .* \| (\d{16})$', block, re.M))
    line = summaries(p.stdout)[i + 1]
    by_view = {v: shown[name] for name, (vs, _) in answers_of(line).items() for v in vs}
    assert sorted(by_view) == list(range(K))
    pos, token_map = kind.views(K, 1, 0, i)
    for j in range(K):
        sym = (pos[j:j + 1], token_map[j:j + 1])
        seen = kind.decode(kind.apply(kind.encode([q]), sym))
        alone = solve(f'--init_from={sudoku4.ckpt}', f'--puzzle={seen}', '--eval_views=1', '--quiet=True')
        answer = summaries(alone.stdout)[1].rsplit('answer ', 1)[1]
        back = kind.decode(kind.apply(kind.encode([answer]), kind.invert(sym)))
        assert back == by_view[j], (j, seen, answer, back, by_view)


def test_one_view_is_solve_as_before(sudoku4):
    def text(p):
        return re.sub(r'\d+\.\d+ s\b', 'T s', '\n'.join(l for l in p.stdout.splitlines() if l != 'config: eval_views = 1'))
    args = [f'--init_from={sudoku4.ckpt}', f'--file={sudoku4.file}', '--eval_batch_size=8']
    before, now = solve(*args), solve(*args, '--eval_views=1')
    assert text(before) == text(now) and '20 puzzles in batches of 8' in now.stdout
    assert not re.search(r'\bviews\b|answer A:', now.stdout.replace('config: eval_views = 1', ''))


def test_many_views_keep_each_line_short_and_count_what_they_do_not_name(sudoku4):
    """A summary line named every view of every answer (--eval_views=1000: some 8000 characters), and each answer's
    line every view's steps, and every answer had its board: the first 8 answers and 8 views of each are named and
    drawn, the rest counted."""
    n = 200
    p = solve(f'--init_from={sudoku4.ckpt}', f'--puzzle={sudoku4.questions[0]}', f'--eval_views={n}')
    line = summaries(p.stdout)[1]
    shown = re.findall(r'([A-Z]+) (\d+) \(views? ([\d ]+)(?: \.\.\.)?\) (?:accepted|rejected)', line)
    rest = re.search(r'(\d+) more answers? of (\d+) views?, \d+ accepted \| ', line)
    assert rest and len(shown) == 8 and all(len(vs.split()) == min(8, int(c)) for _, c, vs in shown), line
    assert sum(int(c) for _, c, _ in shown) + int(rest.group(2)) == n, line
    assert len(line) < 1000 and max(len(l) for l in p.stdout.splitlines()) < 1000, line
    # the first 8 answers drawn, the rest one line with the summary's counts
    assert len([l for l in p.stdout.splitlines() if l.startswith('answer ')]) == 8, p.stdout
    assert f"... {rest.group(1)} more answer" in p.stdout and f" of {rest.group(2)} view" in p.stdout, p.stdout


def test_refusals(sudoku4, tmp_path):
    # a kind without symmetries (registered by this file's __main__): one line, no traceback
    plain = tmp_path / 'plain4'
    (plain / 'train').mkdir(parents=True)
    meta = json.loads((sudoku4.data / 'train' / 'dataset.json').read_text())
    (plain / 'train' / 'dataset.json').write_text(json.dumps(dict(meta, puzzle_type='plainsudoku')))
    q = sudoku4.questions[0]
    p = run([os.path.abspath(__file__), 'solve.py', f'--init_from={sudoku4.ckpt}', f'--data_path={plain}',
             f'--puzzle={q}', f'--eval_views={K}'], check=False)
    err = p.stderr.strip()
    assert p.returncode != 0 and 'Traceback' not in err and len(err.splitlines()) == 1, err
    assert err == 'eval_views=4: a 4x4 plain Sudoku has no symmetries to show it in other views, so views must be 1', err
    ok = run([os.path.abspath(__file__), 'solve.py', f'--init_from={sudoku4.ckpt}', f'--data_path={plain}',
              f'--puzzle={q}', '--eval_views=1', '--quiet=True'])  # one view: solved as given
    assert 'puzzle 1: ' in ok.stdout
    # an unknown dataset: no kind, no views
    (plain / 'train' / 'dataset.json').write_text(json.dumps(dict(meta, puzzle_type='nosuchpuzzle')))
    p = solve(f'--init_from={sudoku4.ckpt}', f'--data_path={plain}', f'--puzzle={q}', f'--eval_views={K}', check=False)
    err = p.stderr.strip()
    assert p.returncode != 0 and 'Traceback' not in err and len(err.splitlines()) == 1, err
    assert 'holds no puzzle kind that solve.py knows' in err
    for bad in (0, -2):
        p = solve(f'--init_from={sudoku4.ckpt}', f'--puzzle={q}', f'--eval_views={bad}', check=False)
        assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr
        assert f'config error: eval_views={bad} (allowed: a number >= 1' in p.stderr, p.stderr


class PlainSudoku(puzzles.Sudoku):
    """A 4x4 Sudoku kind that claims no symmetries."""
    name, noun = 'plainsudoku', 'plain Sudoku'
    symmetric = False

    def draw(self, rng, k):
        return self.identity(k)


if __name__ == '__main__':  # the real script, with the plain Sudoku known: python tests/test_solve_views.py SCRIPT ..
    puzzles.KINDS[PlainSudoku.name] = PlainSudoku
    sys.argv = sys.argv[1:]
    sys.path.insert(0, ROOT)
    runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name='__main__')
