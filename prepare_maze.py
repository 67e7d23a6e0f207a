"""
Prepare the Maze-Hard dataset (the reference's layout, see data.py): 30x30 mazes, 1000 train + 1000 test.

Three sources, one code path (CSV -> validated token arrays -> data.write_split):
    python prepare_maze.py                                   # download sapientinc/maze-30x30-hard-1k
    python prepare_maze.py --csv_dir DIR                     # local DIR/train.csv, DIR/test.csv
    python prepare_maze.py --generate 1000 --num_test 1000   # offline generator, CSVs in <out>/csv/
Options: --aug (the 8 dihedral images of every train maze, one group per maze), --subsample_size K
(seeded subset of train), --seed, --skip_bad (skip and count malformed rows instead of failing).

CSV rows are `source,question,answer,rating`; question/answer are n*n-char row-major strings over
'# SGo' (wall, open, start, goal, path cell; 'o' only in the answer). Tokens: PAD 0, then 1..5 in that
order. Path length, everywhere in this file, is the number of STEPS from S to G (= number of 'o'
cells + 1). The verifier (puzzles.Maze.correct) accepts any shortest path, not only the label's.
"""
import argparse
import csv
import math
import os
import random
import sys
import time
from collections import Counter, deque

import numpy as np

from runkeep import gcs
from data import (DownloadError, WriteError, building, csv_dir_problem, download, interrupted, write_split,
                  writing)
from puzzles import GOAL, OPEN, PAD, PATH, START, WALL, Maze, shortest_path_length

BASE_URL = 'https://huggingface.co/datasets/sapientinc/maze-30x30-hard-1k/resolve/main'
HARD_ROWS = 1000  # rows per split of the hard-1k set, checked when downloading from BASE_URL
HARD_MIN_PATH_LEN = 110  # the hard set keeps 30x30 mazes whose shortest path is longer than this

# -----------------------------------------------------------------------------
# CSV -> validated token arrays

def read_csv(path, skip_bad=False, n=None, n_from=None):
    """One split's CSV -> (questions, answers, n, n_skipped); questions/answers: [N, n*n] uint8 tokens.
    A malformed row raises ValueError naming the file and 1-based line, or with skip_bad is skipped
    and counted. The grid size n is inferred from the most common question length (a perfect square),
    or given (n_from: the file whose size it is; a row of another size is a bad row)."""
    qs, ans, lines, bad = [], [], [], []  # bad: (line, reason)
    # utf-8-sig: a spreadsheet's export starts with a BOM, which would be part of the first column's name
    with open(path, newline='', encoding='utf-8-sig', errors='replace') as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or 'question' not in header or 'answer' not in header:
            raise ValueError(f"{path}:1: expected a header naming the columns question and answer "
                             f"(source,question,answer,rating), got {header!r}")
        qi, ai = header.index('question'), header.index('answer')
        for row in reader:
            if not row:
                continue  # blank line, e.g. a trailing newline
            if len(row) <= max(qi, ai):
                bad.append((reader.line_num, f"{len(row)} field(s), expected {len(header)}"))
                continue
            qs.append(row[qi]); ans.append(row[ai]); lines.append(reader.line_num)
    if not qs:
        raise ValueError(f"{path}: no data rows")
    if n is None:
        L = Counter(len(q) for q in qs).most_common(1)[0][0]
        n = math.isqrt(L)
        if n < 2 or n * n != L:
            raise ValueError(f"{path}: questions are {L} characters long, not n*n for an n x n maze")
    L, size = n * n, f"{n}x{n}" + (f": the size of {n_from}" if n_from else '')
    good = []
    for i, (q, a) in enumerate(zip(qs, ans)):
        if len(q) != L or len(a) != L:
            bad.append((lines[i], f"question/answer lengths {len(q)}/{len(a)}, expected {L} ({size})"))
        else:
            good.append(i)
    kind = Maze(n)
    q = kind.encode([qs[i] for i in good]).reshape(-1, L)
    a = kind.encode([ans[i] for i in good]).reshape(-1, L)
    # checks in order; a row is reported with the first one it fails
    checks = [
        (f"question has a character outside '{kind.question_chars}'",
         ~np.isin(q, (WALL, OPEN, START, GOAL)).all(1)),
        (f"answer has a character outside '{kind.chars}'", (a == 255).any(1)),
        ("question needs exactly one S and one G", ((q == START).sum(1) != 1) | ((q == GOAL).sum(1) != 1)),
        ("no open path leads from S to G", shortest_path_length(q) < 0),  # the maze's fault, not its answer's
        ("answer differs from the question other than by 'o' on open cells",
         ~np.where(a == PATH, q == OPEN, a == q).all(1)),
    ]
    failed = np.zeros(len(good), bool)
    for reason, mask in checks:
        for j in np.flatnonzero(mask & ~failed):
            bad.append((lines[good[j]], reason))
        failed |= mask
    # the label must be a shortest S->G path (ANY shortest path; the verifier does not look at labels)
    rest = np.flatnonzero(~failed)
    not_optimal = rest[~kind.correct(q[rest], a[rest])]
    for j in not_optimal:
        bad.append((lines[good[j]], "answer's 'o' cells are not a shortest S->G path"))
    failed[not_optimal] = True
    if bad and not skip_bad:
        line, reason = min(bad)
        more = f" ({len(bad) - 1} more bad row(s))" if len(bad) > 1 else ""
        raise ValueError(f"{path}:{line}: {reason}{more}; pass --skip_bad to skip malformed rows")
    if failed.all():
        raise ValueError(f"{path}: no valid rows left after skipping {len(bad)} malformed row(s)")
    if bad:
        print(f"{path}: skipped {len(bad)} malformed row(s), first: line {min(bad)[0]}: {min(bad)[1]}")
    return q[~failed], a[~failed], n, len(bad)

# -----------------------------------------------------------------------------
# token arrays -> dataset on disk

def augment(questions, answers, rng):
    """Each maze -> its 8 dihedral images: the identity first, the other 7 in a seeded random order.
    Returns [8N, L] arrays; rows 8i..8i+7 are the images of maze i (one group)."""
    N, L = questions.shape
    pos = Maze(math.isqrt(L)).dihedral(range(8))[0]
    order = np.concatenate([np.zeros((N, 1), np.int64), 1 + np.argsort(rng.random((N, 7)), axis=1)], 1)

    def images(x):
        all8 = np.stack([x[:, p] for p in pos])  # [8, N, L]
        return all8[order, np.arange(N)[:, None]].reshape(8 * N, L)
    return images(questions), images(answers)


def build_dataset(csv_dir, output_dir, aug=False, subsample_size=None, seed=0, skip_bad=False):
    """csv_dir/{train,test}.csv -> output_dir/{train,test}/ (data.write_split layout). One puzzle per
    maze, one example per puzzle; one group per maze (with aug: the maze and its 7 images). The same
    seed gives byte-identical files. Returns {split: metadata}."""
    rng = np.random.default_rng(seed)
    metas, n = {}, None
    for split in ('train', 'test'):
        # test.csv is read at train's size: a row of another size is its bad row, not another size of split
        q, a, n, skipped = read_csv(os.path.join(csv_dir, f'{split}.csv'), skip_bad, n,
                                    n and os.path.join(csv_dir, 'train.csv'))
        if split == 'train' and subsample_size is not None and subsample_size < len(q):
            keep = np.sort(rng.choice(len(q), subsample_size, replace=False))  # sorted: keeps CSV order
            q, a = q[keep], a[keep]
        elif split == 'train' and subsample_size is not None:
            print(f"--subsample_size {subsample_size} >= {len(q)} train mazes: using them all")
        per_group = 1
        if split == 'train' and aug:
            q, a = augment(q, a, rng)
            per_group = 8
        P = len(q)
        metas[split] = write_split(output_dir, split, q, a, puzzle_identifiers=np.zeros(P, np.int32),
                                   puzzle_indices=np.arange(P + 1),
                                   group_indices=np.arange(0, P + 1, per_group),
                                   vocab_size=Maze(n).vocab_size, pad_id=PAD, ignore_label_id=0,
                                   blank_identifier_id=0,
                                   num_puzzle_identifiers=1, extra=dict(puzzle_type=Maze.name, grid_size=n))
        steps = shortest_path_length(q)
        print(f"{split}: {P // per_group} mazes {n}x{n} -> {P} examples, {P // per_group} groups"
              f"{f', skipped {skipped}' if skipped else ''}; shortest path steps min {steps.min()} "
              f"mean {steps.mean():.1f} max {steps.max()}")
    return metas

# -----------------------------------------------------------------------------
# sources: download, or generate offline

def download_csvs(dest_dir, base_url=BASE_URL):
    """Fetch train.csv and test.csv from base_url into dest_dir (cached and resumed by download)."""
    expected = HARD_ROWS if base_url == BASE_URL else None  # another base_url (a mirror, a test) may differ
    for split in ('train', 'test'):
        download(f"{base_url.rstrip('/')}/{split}.csv", os.path.join(dest_dir, f'{split}.csv'),
                 expected_rows=expected)
    return dest_dir


def default_min_path_len(size):
    """110 steps at 30x30, scaled with the number of cells for other sizes (the same fraction 110/900)."""
    return round(HARD_MIN_PATH_LEN * size * size / 900)


def generate_maze(n, rnd, loop_frac=0.05):
    """A random n x n maze as a bytearray of '#'/' ' (row-major). Rooms sit on the odd coordinates
    (n//2 per side; even n has no wall row/column at the far edges, the grid boundary is the wall),
    joined by a randomized depth-first search (a spanning tree: long winding corridors); then each
    remaining wall between two neighbouring rooms is knocked out with probability loop_frac, which
    makes loops and so sometimes several shortest paths, as in the hard set."""
    m = n // 2
    grid = bytearray(b'#' * (n * n))

    def room(i, j):
        return (2 * i + 1) * n + 2 * j + 1

    seen = [False] * (m * m)
    i, j = rnd.randrange(m), rnd.randrange(m)
    seen[i * m + j] = True
    grid[room(i, j)] = 32  # ord(' ')
    stack = [(i, j)]
    while stack:
        i, j = stack[-1]
        nbrs = [(a, b) for a, b in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1))
                if 0 <= a < m and 0 <= b < m and not seen[a * m + b]]
        if not nbrs:
            stack.pop()
            continue
        a, b = rnd.choice(nbrs)
        seen[a * m + b] = True
        grid[room(a, b)] = grid[(i + a + 1) * n + (j + b + 1)] = 32  # the room and the wall between
        stack.append((a, b))
    for i in range(m):
        for j in range(m):
            for a, b in ((i + 1, j), (i, j + 1)):
                if a < m and b < m and rnd.random() < loop_frac:
                    grid[(i + a + 1) * n + (j + b + 1)] = 32
    return grid


def _bfs(grid, n, src):
    """Steps from src to every cell (-1: wall or unreachable), BFS parents, and the number of shortest
    paths from src (capped at 2: we only want to know whether there are several)."""
    N = n * n
    dist, parent, npaths = [-1] * N, [-1] * N, [0] * N
    dist[src], npaths[src] = 0, 1
    queue = deque([src])
    while queue:
        v = queue.popleft()
        d, c = dist[v] + 1, v % n
        for w in (v - n if v >= n else -1, v + n if v + n < N else -1,
                  v - 1 if c > 0 else -1, v + 1 if c < n - 1 else -1):
            if w < 0 or grid[w] == 35:  # ord('#')
                continue
            if dist[w] < 0:
                dist[w], parent[w], npaths[w] = d, v, npaths[v]
                queue.append(w)
            elif dist[w] == d:
                npaths[w] = min(2, npaths[w] + npaths[v])
    return dist, parent, npaths


def _gave_up(near, again, found, asked, thr, size, loop_frac):
    """Why 1000 mazes in a row gave no new one, in one line: most had no goal far enough (a threshold this size or
    loop_frac cannot reach), or most were mazes made before (too few distinct ones at this size)."""
    if near >= again:
        return (f"1000 mazes in a row without a new one whose path is longer than {thr} steps at size {size}: "
                "lower --min_path_len or --loop_frac")
    more = ', a larger --size or a higher --loop_frac' if loop_frac < 1 else ' or a larger --size'
    return (f"{size}x{size} mazes at --loop_frac {loop_frac:g} hold too few distinct ones for the {asked} asked: "
            f"{found} made, then {again} of the next 1000 were repeats; ask for fewer mazes{more}")


def generate_csvs(csv_dir, num_train, num_test, size=30, min_path_len=None, seed=0, loop_frac=0.05):
    """Write csv_dir/{train,test}.csv with random mazes whose shortest S->G path is LONGER than
    min_path_len steps. Per maze: S uniform over open cells, then G uniform over the open cells more
    than min_path_len steps from S (a new maze when there are none). Label: the BFS-parent shortest
    path. rating = path steps. No maze appears twice (so none of test is in train). Returns stats."""
    if size < 4:
        raise ValueError(f"--size {size}: a maze's side must be at least 4")
    thr = default_min_path_len(size) if min_path_len is None else min_path_len
    rnd = random.Random(seed)
    os.makedirs(csv_dir, exist_ok=True)
    t0, tried, multi, total_steps, seen = time.time(), 0, 0, 0, set()
    for split, count in (('train', num_train), ('test', num_test)):
        with writing(os.path.join(csv_dir, f'{split}.csv'), 'w', newline='') as f:
            writer = csv.writer(f, lineterminator='\n')
            writer.writerow(['source', 'question', 'answer', 'rating'])
            made, near, again = 0, 0, 0  # the misses since the last maze: no goal far enough, a maze made before
            while made < count:
                tried += 1
                grid = generate_maze(size, rnd, loop_frac)
                s = rnd.choice([v for v in range(size * size) if grid[v] == 32])
                dist, parent, npaths = _bfs(grid, size, s)
                far = [v for v, d in enumerate(dist) if d > thr]
                question = bytearray(grid)
                if far:
                    g = rnd.choice(far)
                    question[s], question[g] = ord('S'), ord('G')
                if not far or bytes(question) in seen:
                    near, again = near + (not far), again + bool(far)
                    if near + again >= 1000:
                        raise ValueError(_gave_up(near, again, len(seen), num_train + num_test, thr, size,
                                                  loop_frac))
                    continue
                seen.add(bytes(question))
                answer = bytearray(question)
                v = parent[g]
                while v != s:
                    answer[v] = ord('o')
                    v = parent[v]
                writer.writerow([f'generated-{size}x{size}-seed{seed}', question.decode(), answer.decode(),
                                 dist[g]])
                made, near, again = made + 1, 0, 0
                multi += npaths[g] > 1
                total_steps += dist[g]
    dt = time.time() - t0
    n_made = num_train + num_test
    stats = dict(mazes=n_made, tried=tried, seconds=dt, mazes_per_s=n_made / max(dt, 1e-9),
                 mean_steps=total_steps / max(1, n_made), multi_path_frac=multi / max(1, n_made),
                 min_path_len=thr)
    print(f"generated {n_made} {size}x{size} mazes (path > {thr} steps) in {dt:.1f}s "
          f"({stats['mazes_per_s']:.0f}/s, {tried} tried); mean path {stats['mean_steps']:.1f} steps; "
          f"{100 * stats['multi_path_frac']:.0f}% have several shortest paths")
    return stats

# -----------------------------------------------------------------------------

def option_problem(args):
    """What is wrong with the options, in one line naming the option and what it allows; None when nothing
    is. Checked before anything is generated or written."""
    at_least = [('seed', 0), ('subsample_size', 1)]
    if args.generate is not None:
        at_least += [('generate', 1), ('num_test', 1), ('size', 4), ('min_path_len', 0)]
        if args.csv_dir is not None:
            return "--generate and --csv_dir exclude each other: generate mazes, or read them from CSVs"
        if not 0 <= args.loop_frac <= 1:  # NaN fails both comparisons
            return f"--loop_frac {args.loop_frac}: a fraction of the inner walls, from 0 to 1"
    for name, low in at_least:
        value = getattr(args, name)
        if value is not None and value < low:
            return f"--{name} {value}: must be at least {low}"
    return csv_dir_problem(args.csv_dir) if args.csv_dir is not None else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n\n')[0])
    p.add_argument('--output_dir', default=None, help="default data/maze-30x30-hard-1k, or "
                   "data/maze-gen-{size}x{size} with --generate")
    p.add_argument('--csv_dir', default=None,
                   help="use DIR/train.csv and DIR/test.csv instead of downloading")
    p.add_argument('--base_url', default=BASE_URL, help="where {train,test}.csv are downloaded from")
    p.add_argument('--generate', type=int, default=None, metavar='N', help="generate N train mazes offline")
    p.add_argument('--num_test', type=int, default=1000, help="test mazes to generate")
    p.add_argument('--size', type=int, default=30, help="generated maze side (at least 4)")
    p.add_argument('--min_path_len', type=int, default=None, help="keep generated mazes whose shortest "
                   "path is longer than this many steps (default 110 at 30x30, scaled with the area)")
    p.add_argument('--loop_frac', type=float, default=0.05, help="fraction of inner walls knocked out (0-1)")
    p.add_argument('--aug', action='store_true', help="add the 7 other dihedral images of each train maze")
    p.add_argument('--subsample_size', type=int, default=None, help="seeded subset of train mazes")
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--skip_bad', action='store_true', help="skip and count malformed rows instead of failing")
    args = p.parse_args(argv)
    problem = option_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    generate = args.generate is not None
    out = args.output_dir if args.output_dir is not None else (
        f'data/maze-gen-{args.size}x{args.size}' if generate else 'data/maze-30x30-hard-1k')
    out, bucket_uri = gcs.build_folder(out)
    uploading = ''
    try:
        csv_dir = args.csv_dir
        if not generate and csv_dir is None:
            csv_dir = download_csvs(os.path.join(out, 'raw'), args.base_url)
        # the previous dataset (its CSVs too) stays whole until this one is; the CSVs read stay, in it or not
        with building(out, reads=[csv_dir]) as tmp:
            if generate:
                csv_dir = os.path.join(tmp, 'csv')  # in place as <out>/csv with the splits
                generate_csvs(csv_dir, args.generate, args.num_test, args.size, args.min_path_len, args.seed,
                              args.loop_frac)
            build_dataset(csv_dir, tmp, aug=args.aug, subsample_size=args.subsample_size, seed=args.seed,
                          skip_bad=args.skip_bad)
        uploading = bucket_uri  # (a Ctrl-C from here on leaves the new build in out)
        out = gcs.publish_dataset(out, bucket_uri)  # built locally, then uploaded for every host
    except (ValueError, DownloadError, WriteError, OSError, gcs.GCSError) as e:  # bad rows or options, an
                                                    # empty split, a full disk, a failed download or upload
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the build's files are gone (data.building)
        return interrupted(out, uploading)
    print(f"wrote {out}")
    return 0

if __name__ == '__main__':
    raise SystemExit(main())
