"""
Build Sudoku datasets in the reference's layout (see data.py): Sudoku-Extreme, or generated 4x4 / 6x6 / 9x9
puzzles.

    python prepare_sudoku.py --output_dir data/sudoku-extreme-1k-aug-1000 --subsample_size 1000 --num_aug 1000
    python prepare_sudoku.py --csv_dir /path/with/train_and_test_csv --output_dir data/sudoku-extreme-full
    python prepare_sudoku.py --generate 2000 --size 4 --output_dir data/sudoku4

Source CSV: header `source,question,answer,rating`, then one puzzle a row, n*n-char row-major strings
('.' or '0' blank); n is --size, else that of train.csv's first well-formed row, and test.csv is read at
train's n. Tokens: PAD 0, blank 1, digit d -> d+1 (vocab n+2, seq_len n*n). Each original
puzzle and its `num_aug` shuffled copies form one group; every puzzle holds one example.

Reading is vectorised numpy over the raw bytes (no Python loop per row): every row's structure and
rating are checked, and the content (characters, givens, Sudoku rules) of every row that goes into the
dataset, so the 1k x 1001 build from the 3.8M-row file takes seconds and under 1 GB. Only the puzzle
generator (--generate) is scalar Python.
"""
import argparse
import functools
import math
import os
import random
import re
import sys
import time

import numpy as np

from runkeep import gcs
from data import (DownloadError, building, csv_dir_problem, download, final_path, interrupted, write_split,
                  writing)
from puzzles import BOXES, Sudoku

BASE_URL = 'https://huggingface.co/datasets/sapientinc/sudoku-extreme/resolve/main'
EXPECTED_ROWS = {'train': 3_831_994, 'test': 422_786}  # data rows, header excluded
HEADER = 'source,question,answer,rating'


class CSVFormatError(ValueError):
    """A malformed source CSV; the message names the file and the 1-based line."""


# -----------------------------------------------------------------------------
# reading the CSV. Pass 1 (scan_csv) reads every row's structure and rating, vectorised a chunk at a
# time; pass 2 (take_rows) reads and checks the content of only the rows that go into the dataset
# (1000 of the 3.8M train rows for the 1k set; every test row), so the drawn subsample never needs
# the whole file parsed.

CHUNK = 1 << 23  # bytes parsed at a time: memory stays flat whatever the file size
ROWS_AT_ONCE = 1 << 16  # rows content-checked at a time in pass 2
RATING_WIDTH = 18  # longest rating field accepted (fits int64)
PAD = 2 * 81 + 2 + RATING_WIDTH  # slack after a chunk so fixed-width windows never leave the buffer


def _windows(arr, width):
    """All `width`-byte windows of a 1-D byte array, as a [len - width + 1, width] view (no copy):
    indexing it with field offsets copies fixed-width fields out of a variable-width file."""
    return np.lib.stride_tricks.as_strided(arr, shape=(len(arr) - width + 1, width), strides=(1, 1),
                                           writeable=False)


def _check_structure(buf, end, n):
    """Pass 1 on the complete lines of buf[:end] (buf has PAD bytes of slack after end). Per line:
    error code (0 good, 1 fields, 2 question length, 3 answer length, 4 rating), offset of the
    question in buf, rating, line start."""
    L = n * n
    data = buf[:end]
    nl = np.flatnonzero(data == 10)
    starts = np.concatenate(([0], nl[:-1] + 1))
    ends = nl - ((nl > starts) & (data[np.maximum(nl - 1, 0)] == 13))  # drop a '\r' before '\n'
    commas = np.flatnonzero(data == 44)
    upto_end = np.searchsorted(commas, nl)
    first = np.concatenate(([0], upto_end[:-1]))  # index of the line's first comma in `commas`
    commas = np.concatenate((commas, [0, 0, 0]))  # keeps the lookups below in range on short lines
    c1, c2, c3 = commas[first], commas[first + 1], commas[first + 2]
    # rating: 1..RATING_WIDTH chars, an optional '-' then digits; parsed column by column (Horner)
    rlen, at = ends - c3 - 1, c3 + 1
    neg = buf[at] == 45
    rating_ok = (rlen >= 1) & (rlen <= RATING_WIDTH) & (rlen > neg)
    rating = np.zeros(len(nl), np.int64)
    for j in range(min(int(rlen.max(initial=0)), RATING_WIDTH)):
        d = buf[at + j].astype(np.int64) - 48
        active = (j < rlen) & ~neg if j == 0 else j < rlen
        rating_ok &= ~active | ((d >= 0) & (d <= 9))
        rating = np.where(active, rating * 10 + d, rating)
    rating = np.where(neg, -rating, rating)
    err = np.zeros(len(nl), np.uint8)
    for code, bad in ((4, ~rating_ok), (3, c3 - c2 - 1 != L), (2, c2 - c1 - 1 != L),
                      (1, upto_end - first != 3)):
        err[bad] = code  # last assignment wins: the first problem of a row is reported
    return err, c1 + 1, np.where(err == 0, rating, 0), starts


def _content(qa, n):
    """Pass 2 on [k, 2*n*n+1] raw bytes (question ',' answer). Returns error codes (0 good,
    5 question character, 6 answer character, 7 answer contradicts a given, 8 answer breaks a rule)
    and the token arrays (blank 1, digit d -> d+1)."""
    kind = Sudoku(n)
    inputs, labels = kind.encode(qa[:, :kind.L]), kind.encode(qa[:, kind.L + 1:])  # 255: no token
    q_bad = (inputs == 255).any(1)
    a_bad = (labels - np.uint8(2) >= n).any(1)  # uint8 wrap: a blank and no token fail too
    contradicts = ((inputs != 1) & (inputs != labels)).any(1)
    err = np.zeros(len(qa), np.uint8)
    for code, bad in ((8, ~kind.units_hold(labels)), (7, contradicts), (6, a_bad), (5, q_bad)):
        err[bad] = code
    return err, inputs, labels


def _side(chars):
    """The side of the Sudoku grid a field of `chars` characters holds (9 for 81), or None when it holds none."""
    k = math.isqrt(chars)
    return k if k in BOXES and k * k == chars else None


def _grid(chars):
    """' (9x9)' for a field of 81 characters: the grid it would be, when it is one."""
    k = _side(chars)
    return f" ({k}x{k})" if k else ''


def _structure(fields, n, n_from):
    """What is wrong with a row's structure (pass 1's checks: fields, lengths, rating), in words; None if nothing.
    n_from: where the size n came from, named when a length differs (the file and line, or --size)."""
    if len(fields) != 4:
        return f"expected 4 fields (source,question,answer,rating), found {len(fields)}"
    _, q, a, r = fields
    for name, s in (('question', q), ('answer', a)):
        if len(s) != n * n:
            return f"{name} has {len(s)} characters{_grid(len(s))}, expected {n * n} ({n}x{n}: {n_from})"
    if not (re.fullmatch(r'-?[0-9]+', r) and len(r) <= RATING_WIDTH):
        return f"rating {r!r} is not an integer"
    return None


def _describe(line, n, n_from):
    """What is wrong with one CSV line, in words (scalar; only run for the rows that are reported)."""
    try:  # in the characters its writer typed (_text reads one per byte): an 'é' is one, not two
        line = line.encode('latin-1').decode('utf-8')
    except UnicodeDecodeError:
        pass
    fields = line.split(',')
    problem = _structure(fields, n, n_from)
    if problem:
        return problem
    _, q, a, r = fields
    kind = Sudoku(n)
    for name, s, allowed in (('question', q, kind.question_chars), ('answer', a, kind.chars[1:])):
        for i, ch in enumerate(s):
            if ch not in allowed:
                return f"{name} has the invalid character {ch!r} at position {i + 1} (allowed: {allowed})"
    for i, (g, s) in enumerate(zip(q, a)):
        if g not in '.0' and g != s:
            return f"answer has {s} where the question gives {g} (row {i // n + 1}, column {i % n + 1})"
    repeat = kind.first_repeat(kind.encode([a])[0])
    if repeat:
        return f"answer repeats the digit {repeat[1]} in {repeat[0]}"
    return "malformed row"


def _text(raw):
    """A line's bytes without its '\\n' or '\\r\\n', one char per byte (lengths agree with the checks)."""
    raw = raw[:-1] if raw.endswith(b'\n') else raw
    return (raw[:-1] if raw.endswith(b'\r') else raw).decode('latin-1')


def _line_at(path, offset):
    """The line holding byte `offset`."""
    with open(path, 'rb') as f:
        lo = max(0, offset - (1 << 16))
        f.seek(lo)
        before = f.read(offset - lo)
        f.seek(lo + before.rfind(b'\n') + 1)
        return _text(f.readline(1 << 16))


def _last_newline(buf, m):
    """Position of the last newline in buf[:m], or -1; looks at the tail first (lines are short)."""
    for lo in (max(0, m - (1 << 16)), 0):
        hits = np.flatnonzero(buf[lo:m] == 10)
        if len(hits):
            return lo + int(hits[-1])
    return -1


def _no_size(fields):
    """Why a malformed row tells no grid size, in words."""
    k = _side(len(fields[1])) if len(fields) == 4 else 0
    if k is None:
        return (f"question has {len(fields[1])} characters, expected one of "
                f"{', '.join(str(b * b) for b in sorted(BOXES))}")
    return _structure(fields, k, "its question's size")


def _first_size(f, path, skip_bad):
    """(n, where it came from) of the first well-formed row of f, read from its first data row on: a malformed
    row before it is reported or counted by pass 1, as any other. A file without one is an error naming it."""
    first, rows = None, 0
    for rows, raw in enumerate(f, 1):
        fields = _text(raw).split(',')
        k = _side(len(fields[1])) if len(fields) == 4 else None
        if k and not _structure(fields, k, ''):
            return k, f"the size of {path}:{rows + 1}"
        first = first or (rows + 1, _no_size(fields))
    if first is None:
        raise CSVFormatError(f"{path}: no data rows, only the header")
    line, why = first
    raise CSVFormatError(f"{path}: none of its {rows:,} data rows is well-formed (the first, line {line}: {why})"
                         if skip_bad else f"{path}:{line}: {why}")


class _Bad:
    """Handles bad rows: raise at the first, or (skip_bad) count them and keep the first few messages."""
    def __init__(self, path, n, n_from, skip_bad):
        self.path, self.n, self.n_from, self.skip_bad, self.count, self.messages = path, n, n_from, skip_bad, 0, []

    def __call__(self, offsets, lines):
        for offset, line in zip(offsets[:1 if not self.skip_bad else max(0, 5 - len(self.messages))], lines):
            msg = f"{self.path}:{line}: {_describe(_line_at(self.path, int(offset)), self.n, self.n_from)}"
            if not self.skip_bad:
                raise CSVFormatError(msg)
            self.messages.append(msg)
        self.count += len(offsets)


def scan_csv(path, n=None, skip_bad=False, n_from=None):
    """Pass 1 over the whole file: every row needs 4 fields, a question and an answer of n*n chars and
    an integer rating. A bad row raises CSVFormatError naming file and line, or with skip_bad is
    dropped and counted. n: the grid size (None: the first well-formed row's), n_from: where it came from
    (default: --size). Returns dict(n, n_from, q_off: file offset of each good row's question, rating,
    line: its 1-based line number, rows: data rows read, bad: the _Bad tally)."""
    with open(path, 'rb') as f:
        header = f.readline(1 << 16).decode('utf-8', 'replace').lstrip('\ufeff').rstrip('\r\n')
        names = header.split(',')
        if len(names) != 4 or re.fullmatch(r'[.0-9]{16}|[.0-9]{36}|[.0-9]{81}', names[1]):
            raise CSVFormatError(f"{path}:1: expected the header {HEADER!r}, found {header[:80]!r}")
        if header != HEADER:  # the reference builder skips line 1 whatever it says; so do we, with a note
            print(f"{path}:1: header {header[:80]!r} differs from {HEADER!r}; reading the columns in that "
                  f"order anyway", file=sys.stderr)
        body = f.tell()
        if n is None:
            n, n_from = _first_size(f, path, skip_bad)
            f.seek(body)
        n_from = n_from or f"--size {n}"
        bad = _Bad(path, n, n_from, skip_bad)
        buf = np.zeros(CHUNK + PAD, np.uint8)
        view = memoryview(buf)
        # per good row: question offset, rating, line number; preallocated from the first chunk's line
        # length and grown if needed (many small per-chunk arrays would stay behind in the heap)
        cols, kept = [np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32)], 0
        base, row0, carry, eof = body, 0, 0, False
        while not eof:
            got = f.readinto(view[carry:CHUNK])
            m = carry + got
            if got == 0:  # end of file; a last line without '\n' ends here
                if carry == 0:
                    break
                buf[m], m, eof = 10, m + 1, True
            end = _last_newline(buf, m) + 1
            if end == 0:
                raise CSVFormatError(f"{path}:{row0 + 2}: line longer than {CHUNK:,} bytes")
            err, q_off, rating, starts = _check_structure(buf, end, n)
            wrong = np.flatnonzero(err)
            bad(base + starts[wrong], row0 + 2 + wrong)
            good = np.flatnonzero(err == 0)
            if kept + len(good) > len(cols[0]):
                guess = int(os.path.getsize(path) / max(1, end) * len(err) * 1.05) + 1024
                size = max(guess, int(1.5 * len(cols[0])), kept + len(good))
                cols = [np.concatenate((c[:kept], np.zeros(size - kept, c.dtype))) for c in cols]
            for c, v in zip(cols, (base + q_off[good], rating[good], row0 + 2 + good)):
                c[kept:kept + len(good)] = v
            kept += len(good)
            row0 += len(err)
            base += end
            carry = m - end
            buf[:carry] = buf[end:m].copy()
    if row0 == 0:
        raise CSVFormatError(f"{path}: no data rows, only the header")
    return dict(n=n, n_from=n_from, q_off=cols[0][:kept], rating=cols[1][:kept], line=cols[2][:kept], rows=row0,
                bad=bad)


def load_rows(path, q_off, n):
    """Raw bytes [k, 2*n*n+1] (question ',' answer) of the rows whose questions start at `q_off`.
    Reads in offset order, one read per run of rows that fit in CHUNK bytes: a few scattered rows
    cost a few small reads, all rows one sequential pass (a memory map would touch far more pages)."""
    W = 2 * n * n + 1
    q_off = np.asarray(q_off, np.int64)
    out = np.empty((len(q_off), W), np.uint8)
    order = np.argsort(q_off, kind='stable')
    offs = q_off[order]
    with open(path, 'rb') as f:
        i = 0
        while i < len(offs):
            j = int(np.searchsorted(offs, offs[i] + CHUNK - W, 'right'))
            f.seek(int(offs[i]))
            block = np.frombuffer(f.read(int(offs[j - 1] - offs[i]) + W), np.uint8)
            out[order[i:j]] = _windows(block, W)[offs[i:j] - offs[i]]
            i = j
    return out


def take_rows(path, scan, candidates, want=None):
    """Pass 2: the first `want` (default: all) rows of `candidates` (indices into the scan) whose content
    is good: characters, answer consistent with the givens, valid Sudoku. A bad row raises, or with
    skip_bad is counted and the next candidate takes its place. Returns (indices, inputs, labels)
    in file order; inputs/labels are token arrays [k, n*n]."""
    n, bad = scan['n'], scan['bad']
    want = len(candidates) if want is None else want
    none = np.zeros((0, n * n), np.uint8)
    kept, ins, labs, pos = [np.zeros(0, np.int64)], [none], [none], 0
    while want > 0 and pos < len(candidates):
        idx = candidates[pos:pos + min(want, ROWS_AT_ONCE)]
        pos += len(idx)
        err, inputs, labels = _content(load_rows(path, scan['q_off'][idx], n), n)
        wrong = np.flatnonzero(err)
        bad(scan['q_off'][idx[wrong]], scan['line'][idx[wrong]])
        good = err == 0
        kept.append(idx[good])
        ins.append(inputs[good])
        labs.append(labels[good])
        want -= int(good.sum())
    return _in_file_order(kept, ins, labs)


def _in_file_order(kept, ins, labs):
    kept = np.concatenate(kept)
    order = np.argsort(kept, kind='stable')
    return kept[order], np.concatenate(ins)[order], np.concatenate(labs)[order]


# -----------------------------------------------------------------------------
# augmentation: validity-preserving shuffles, all copies at once with numpy index maps

def augment(inputs, labels, n, num_aug, rng, chunk=1 << 14):
    """Token arrays [G, n*n] -> [G * (num_aug + 1), n*n]: each puzzle followed by num_aug shuffled
    copies; inputs and labels of a copy share one symmetry (the kind's)."""
    kind = Sudoku(n)
    G, L = inputs.shape
    K = num_aug + 1
    out_in, out_lab = np.empty((G, K, L), np.uint8), np.empty((G, K, L), np.uint8)
    out_in[:, 0], out_lab[:, 0] = inputs, labels
    # label token in the low 4 bits, "is a given" in bit 4: one gather moves both
    packed = (labels | ((inputs != 1).astype(np.uint8) << 4)).ravel()
    step = max(1, chunk // max(1, num_aug))  # puzzles per round: bounds the index arrays' memory
    for g0 in range(0, G if num_aug else 0, step):
        g1 = min(G, g0 + step)
        k = (g1 - g0) * num_aug
        pos, token_map = kind.draw(rng, k)
        pos += (np.repeat(np.arange(g0, g1, dtype=np.int32), num_aug) * L)[:, None]  # into packed
        moved = np.take(packed, pos)
        lab = np.take(token_map, (np.arange(k) * token_map.shape[1])[:, None] + (moved & 15))
        out_lab[g0:g1, 1:] = lab.reshape(g1 - g0, num_aug, L)
        out_in[g0:g1, 1:] = np.where(moved >= 16, lab, np.uint8(1)).reshape(g1 - g0, num_aug, L)
    return out_in.reshape(G * K, L), out_lab.reshape(G * K, L)

# -----------------------------------------------------------------------------
# solver: bitmask candidates, naked + hidden singles, minimum-remaining-values branching

@functools.lru_cache(maxsize=None)
def _geometry(n):
    units = [cells for _, cells in Sudoku(n).units]
    peers = [sorted({p for u in units if i in u for p in u} - {i}) for i in range(n * n)]
    return units, peers, (1 << n) - 1


def _propagate(cand, queue, units, peers, full):
    """Apply singles until nothing changes; False on a contradiction. `queue`: newly solved cells."""
    while True:
        while queue:  # naked singles: a solved cell's digit leaves its peers
            i = queue.pop()
            b = cand[i]
            for p in peers[i]:
                m = cand[p]
                if m & b:
                    m ^= b
                    if not m:
                        return False
                    cand[p] = m
                    if not m & (m - 1):
                        queue.append(p)
        for unit in units:  # hidden singles: a digit with one place left in a unit goes there
            once = twice = 0
            for i in unit:
                m = cand[i]
                twice |= once & m
                once |= m
            if once != full:
                return False  # some digit has no place left
            hidden = once & ~twice
            if hidden:
                for i in unit:
                    m = cand[i]
                    h = m & hidden
                    if h and h != m:
                        if h & (h - 1):
                            return False  # one cell is the only place for two digits
                        cand[i] = h
                        queue.append(i)
        if not queue:
            return True


def _search(cand, queue, geo, limit, rng, found, stats):
    """Depth-first: propagate, then branch on the unsolved cell with the fewest candidates."""
    if not _propagate(cand, queue, *geo):
        return
    best, best_count = -1, 99
    for i, m in enumerate(cand):
        if m & (m - 1):
            c = m.bit_count()
            if c < best_count:
                best, best_count = i, c
                if c == 2:
                    break
    if best < 0:
        found.append(cand)
        return
    m = cand[best]
    choices = [1 << d for d in range(m.bit_length()) if m >> d & 1]
    if rng is not None:
        rng.shuffle(choices)
    for b in choices:
        stats[0] += 1  # one guess
        child = cand.copy()
        child[best] = b
        _search(child, [best], geo, limit, rng, found, stats)
        if len(found) >= limit:
            return


def solve(grid, n=None, limit=1, rng=None):
    """grid: n*n ints (0 blank) or a CSV string. Returns (solutions, guesses): up to `limit` solutions
    (lists of ints) and the number of guesses (branching assignments) the search made. Guesses are
    deterministic without `rng`; with a random.Random the branch order is shuffled."""
    if isinstance(grid, str):
        grid = [0 if ch in '.0' else int(ch) for ch in grid]
    grid = [int(v) for v in grid]  # plain ints, also from a numpy array
    n = n or math.isqrt(len(grid))
    if n not in BOXES or len(grid) != n * n:
        raise ValueError(f"a {len(grid)}-cell grid is not a {'/'.join(f'{k}x{k}' for k in BOXES)} Sudoku")
    units, peers, full = geo = _geometry(n)
    cand, queue = [full] * (n * n), []
    for i, v in enumerate(grid):
        if v:
            cand[i] = 1 << (v - 1)
            queue.append(i)
    found, stats = [], [0]
    _search(cand, queue, geo, limit, rng, found, stats)
    return [[m.bit_length() for m in s] for s in found], stats[0]


def count_solutions(grid, n=None, limit=2):
    """Number of solutions, counted up to `limit` (2 answers 'is it unique?')."""
    return len(solve(grid, n, limit=limit)[0])

# -----------------------------------------------------------------------------
# generator: random solved grid, then clue removal that keeps the solution unique

def make_puzzle(n, rng):
    """One minimal puzzle (no given can be removed without a second solution). Returns
    (question, answer, rating): digit lists (0 blank) and the deterministic solver's guess count."""
    solution = solve([0] * (n * n), n, rng=rng)[0][0]  # random branch order -> random solved grid
    puzzle = list(solution)
    order = list(range(n * n))
    rng.shuffle(order)
    for i in order:
        puzzle[i] = 0
        if count_solutions(puzzle, n) > 1:
            puzzle[i] = solution[i]
    return puzzle, solution, solve(puzzle, n)[1]


def generate_puzzles(count, n, seed=0, min_rating=0):
    """`count` distinct puzzles with rating >= min_rating, as CSV-ready (question, answer, rating)
    strings. Same seed -> same puzzles. Gives up once fewer than 1 try in 100 succeeds."""
    rng = random.Random(seed)
    seen, out, tries = set(), [], 0
    while len(out) < count:
        tries += 1
        if tries > 1000 and tries > 100 * (len(out) + 1):
            raise RuntimeError(f"found only {len(out)} of {count} distinct {n}x{n} puzzles with rating >= "
                               f"{min_rating} in {tries - 1} tries (too few exist, or the rating is too "
                               "high)")
        q, a, rating = make_puzzle(n, rng)
        qs = ''.join('.' if v == 0 else str(v) for v in q)
        if rating >= min_rating and qs not in seen:
            seen.add(qs)
            out.append((qs, ''.join(map(str, a)), rating))
    return out


def write_csv(path, puzzles, source):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with writing(path, 'w', newline='') as f:
        f.write(HEADER + '\n')
        f.writelines(f"{source},{q},{a},{r}\n" for q, a, r in puzzles)

# -----------------------------------------------------------------------------
# build

def _none_kept(csv_path, split, scan, subsample_size, min_difficulty):
    """Why a split kept no puzzle, in one line naming the option or the CSV."""
    generated = final_path(csv_path) != os.fspath(csv_path)  # written into the build's folder, gone after this
    path, bad = f"the generated {os.path.basename(csv_path)}" if generated else csv_path, scan['bad']
    if split == 'train' and subsample_size == 0:
        return "--subsample_size 0 keeps no puzzle; ask for at least 1"
    if min_difficulty is not None and len(scan['rating']) and scan['rating'].max() < min_difficulty:
        return (f"no row of {path} is rated {min_difficulty} or more (--min_difficulty {min_difficulty}; the "
                f"highest rating: {scan['rating'].max()})")
    return f"{path}: no valid row left after skipping {bad.count:,} malformed row(s); the first, {bad.messages[0]}"


def build_split(csv_path, output_dir, split, n=None, subsample_size=None, min_difficulty=None, num_aug=0,
                rng=None, skip_bad=False, n_from=None):
    """One split from one CSV. Both keep the rows rated min_difficulty or more (the reference's builder filters
    both); train takes subsample_size (seeded) and num_aug, test keeps its rows in file order, unaugmented (one
    group per puzzle). n, n_from: as scan_csv's."""
    t0 = time.time()
    rng = rng if rng is not None else np.random.default_rng(0)
    scan = scan_csv(csv_path, n, skip_bad, n_from)
    n = scan['n']
    candidates = np.arange(len(scan['q_off']))
    if min_difficulty is not None:
        candidates = candidates[scan['rating'] >= min_difficulty]
    if split == 'train' and subsample_size is not None and subsample_size < len(candidates):
        # a seeded draw; pass 2 then reads only these rows. Bad ones (skip_bad) are replaced by
        # rows drawn from the rest, so the set stays a uniform draw from the good rows.
        drawn = candidates[rng.choice(len(candidates), size=subsample_size, replace=False)]
        idx, inputs, labels = take_rows(csv_path, scan, drawn)
        if len(idx) < subsample_size:
            rest = rng.permutation(np.setdiff1d(candidates, drawn))
            more = take_rows(csv_path, scan, rest, subsample_size - len(idx))
            idx, inputs, labels = _in_file_order(*zip((idx, inputs, labels), more))
    else:
        if split == 'train' and subsample_size is not None and len(candidates):  # none: the error below says why
            print(f"{split}: subsample_size {subsample_size:,} >= the {len(candidates):,} rows available: "
                  f"keeping all", file=sys.stderr)
        idx, inputs, labels = take_rows(csv_path, scan, candidates)
    if len(inputs) == 0:  # said here, where the cause is known: write_split would only say the split is empty
        raise ValueError(f"the {split} split of {final_path(output_dir)} would hold no examples: "
                         f"{_none_kept(csv_path, split, scan, subsample_size, min_difficulty)}")
    bad, rows, groups, n_from = scan['bad'], scan['rows'], len(inputs), scan['n_from']
    del scan, candidates, idx
    for msg in bad.messages:
        print(f"skipped {msg}", file=sys.stderr)
    K = 1 + (num_aug if split == 'train' else 0)
    if K > 1:
        inputs, labels = augment(inputs, labels, n, K - 1, rng)
    N = len(inputs)
    write_split(output_dir, split, inputs, labels, puzzle_identifiers=np.zeros(N, np.int32),
                puzzle_indices=np.arange(N + 1), group_indices=np.arange(0, N + 1, K), vocab_size=n + 2,
                extra=dict(puzzle_type=Sudoku.name, grid_size=n))
    print(f"{split}: {rows:,} rows read, {bad.count:,} bad rows skipped, {groups:,} groups, {N:,} puzzles "
          f"({n}x{n}) in {time.time() - t0:.1f} s")
    return dict(n=n, n_from=n_from, rows=rows, skipped=bad.count, groups=groups, puzzles=N)


def build(csv_dir, output_dir, n=None, subsample_size=None, min_difficulty=None, num_aug=0, seed=0,
          skip_bad=False):
    """Both splits; test is read at train's grid size, so its rows of another size are bad rows, not a test
    split that train.py refuses."""
    rng = np.random.default_rng(seed)  # one stream, train first: same seed -> identical files
    built, n_from = {}, None
    for split in ('train', 'test'):
        built[split] = build_split(os.path.join(csv_dir, f'{split}.csv'), output_dir, split, n, subsample_size,
                                   min_difficulty, num_aug, rng, skip_bad, n_from)
        n, n_from = built[split]['n'], built[split]['n_from']
    return built


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].strip())
    p.add_argument('--output_dir', required=True)
    src = p.add_argument_group('source (default: download Sudoku-Extreme)')
    src.add_argument('--csv_dir', help='read train.csv and test.csv from here instead of downloading')
    src.add_argument('--base_url', default=BASE_URL, help='where {train,test}.csv are downloaded from '
                     '(default: the Sudoku-Extreme dataset)')
    src.add_argument('--download_dir', default=os.path.join('data', 'downloads', 'sudoku-extreme'),
                     help='cache for downloaded CSVs; a second run does not download (default: %(default)s)')
    src.add_argument('--generate', type=int, metavar='N', help='generate N train puzzles offline instead')
    src.add_argument('--num_test', type=int, help='test puzzles to generate (default: max(1, N // 10))')
    src.add_argument('--min_rating', type=int, default=0,
                     help='generated puzzles need at least this many solver guesses, their rating (default: '
                     '0)')
    src.add_argument('--size', type=int, choices=sorted(BOXES), help='grid size (CSV: inferred; generate: 9)')
    b = p.add_argument_group('build')
    b.add_argument('--subsample_size', type=int, help='train: keep this many puzzles (seeded draw)')
    b.add_argument('--min_difficulty', type=int, help='keep rows rated >= this (both splits, as the reference)')
    b.add_argument('--num_aug', type=int, default=0, help='train: shuffled copies per puzzle (default: 0)')
    b.add_argument('--seed', type=int, default=0, help='subsample and augmentation seed (default: 0)')
    b.add_argument('--skip_bad', action='store_true', help='skip malformed rows (counted) instead of failing')
    args = p.parse_args(argv)
    if args.generate is not None and args.csv_dir is not None:
        p.error('--generate and --csv_dir exclude each other')
    if args.csv_dir is not None and (problem := csv_dir_problem(args.csv_dir)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    for name in ('generate', 'num_test', 'subsample_size', 'num_aug', 'min_rating'):
        if (getattr(args, name) or 0) < 0:
            p.error(f'--{name} {getattr(args, name)}: must not be negative')
    if not 0 <= args.seed < 2 ** 32:  # numpy's seeds
        p.error(f'--seed {args.seed}: must be from 0 to {2 ** 32 - 1}')
    for name, split in (('generate', 'train'), ('num_test', 'test')):
        if args.generate is not None and getattr(args, name) == 0:
            print(f"error: --{name} 0: the {split} split would hold no examples; ask for at least 1", file=sys.stderr)
            return 2
    args.output_dir, bucket_uri = gcs.build_folder(args.output_dir)  # the bucket checked once the options are
    t0, uploading = time.time(), ''
    try:
        csv_dir = args.csv_dir
        if args.generate is None and csv_dir is None:
            csv_dir = args.download_dir
            official = args.base_url.rstrip('/') == BASE_URL  # row counts known for the official files only
            for split in ('train', 'test'):
                download(f"{args.base_url.rstrip('/')}/{split}.csv", os.path.join(csv_dir, f'{split}.csv'),
                         EXPECTED_ROWS[split] if official else None)
        # the previous dataset, CSVs too, stays whole till this one is; the CSVs read stay, in the dataset or not
        with building(args.output_dir, reads=[csv_dir]) as tmp:
            if args.generate is not None:
                n = args.size or 9
                num_test = args.num_test if args.num_test is not None else max(1, args.generate // 10)
                puzzles = generate_puzzles(args.generate + num_test, n, args.seed, args.min_rating)
                csv_dir = os.path.join(tmp, 'csv')  # in place as <output_dir>/csv with the splits
                for split, rows in (('train', puzzles[:args.generate]), ('test', puzzles[args.generate:])):
                    write_csv(os.path.join(csv_dir, f'{split}.csv'), rows, f'generated_{n}x{n}')
                print(f"generated {len(puzzles):,} {n}x{n} puzzles in {time.time() - t0:.1f} s -> "
                      f"{os.path.join(args.output_dir, 'csv')}")
            build(csv_dir, tmp, args.size, args.subsample_size, args.min_difficulty, args.num_aug, args.seed,
                  args.skip_bad)
        uploading = bucket_uri  # (a Ctrl-C from here on leaves the new build in output_dir)
        args.output_dir = gcs.publish_dataset(args.output_dir, bucket_uri)  # built here, then uploaded
    except (ValueError, DownloadError, RuntimeError, OSError, gcs.GCSError) as e:  # CSVFormatError: a
                                                  # ValueError; a full disk: data.WriteError, a RuntimeError
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the build's files are gone (data.building)
        return interrupted(args.output_dir, uploading)
    print(f"done in {time.time() - t0:.1f} s -> {args.output_dir}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
