"""
What a puzzle is, one object per kind: its tokens and characters, a user's text parsed, a board rendered, the
rule its cells obey, the verifier (any valid answer counts, not only the dataset's label) and its symmetries.
The trainer, solve.py and the prepare_*.py builders ask the object and never test which kind it is.

    kind = puzzle_for(meta)        # Sudoku(6), Maze(30), ... or None: an unknown puzzle (exact match only)
    kind.correct(inputs, preds)    # bool [B]
    kind.parse(text, where)        # tokens [L]; a bad text raises ValueError with one line naming the problem

draw_steps and draw_arc_task draw a puzzle's steps and an ARC task's attempts as figures (solve.py --png).

A kind's `name` is what dataset.json's puzzle_type and a checkpoint's `data` store. A new kind is one
subclass of Grid (registered in KINDS under its name), a builder that writes it with
data.write_split(..., extra=dict(puzzle_type=NAME, grid_size=n)) and a config (README: forking).
"""
import functools
import itertools
import math
import os
import re

import numpy as np



def plural(k, word):
    return f"{k} {word}{'s' * (k != 1)}"


def article(name):
    """'a 4x4 Sudoku', 'an 8x8 maze'."""
    return ('an ' if name[:1] == '8' or name[:2] in ('11', '18') else 'a ') + name


class Grid:
    """An n x n puzzle, one token per cell, row-major. Token 0 is PAD; token t >= 1 shows as chars[t - 1].
    A symmetry is (pos, token_map), batched: pos [k, L] the source cell of each cell, token_map
    [k, vocab_size] a relabelling of the tokens; it maps valid puzzles with their answers to valid puzzles
    with theirs."""
    name = ''            # what datasets and checkpoints store
    noun = 'puzzle'      # in messages: 'a 6x6 Sudoku'
    chars = ''           # token t -> chars[t - 1]
    aliases = {}         # more characters a user may type for a token: {char: token}
    question_chars = ''  # what a question (a user's puzzle) may hold
    pad_char = '?'
    sep = ' '            # between cells of a rendered row
    colors = None        # {char: rgb} draws a board as an image; None draws characters on a grid of boxes
    box = None           # (rows, cols) of the boxes drawn with thick lines (None: none)
    one_line_answer = False  # the summary line shows the answer as one string
    short_hint = ''      # after a row too short: why it may be so

    def __init__(self, n):
        self.n, self.L = n, n * n

    @property
    def vocab_size(self):
        return len(self.chars) + 1

    @property
    def title(self):
        return f"{self.n}x{self.n} {self.noun}"

    @property
    def titles(self):
        """The title in the plural: '6x6 Sudokus'."""
        return self.title + 's'

    # characters

    @functools.cached_property
    def _char_lut(self):
        """byte -> token (255: none)"""
        lut = np.full(256, 255, np.uint8)
        lut[[ord(c) for c in self.chars]] = np.arange(1, len(self.chars) + 1)
        for c, t in self.aliases.items():
            lut[ord(c)] = t
        return lut

    def cell(self, t):
        t = int(t)
        return self.chars[t - 1] if 1 <= t <= len(self.chars) else self.pad_char

    def encode(self, strings):
        """Equal-length strings (or their raw bytes [N, L] uint8) -> [N, L] uint8 tokens, 255 for a character
        that is no token."""
        if isinstance(strings, np.ndarray):
            return self._char_lut[strings]
        if len(strings) == 0:
            return np.zeros((0, 0), np.uint8)
        # 'replace' keeps one byte per character, so a stray non-ASCII character stays in its column
        buf = np.frombuffer(''.join(strings).encode('ascii', 'replace'), np.uint8)
        return self._char_lut[buf].reshape(len(strings), -1)

    def decode(self, tokens):
        """One row of tokens -> its string."""
        return ''.join(self.cell(t) for t in np.asarray(tokens).ravel())

    def render(self, tokens, before=None):
        """A board as text, one line a row; cells that differ from `before` get a trailing '*'."""
        n = self.n
        t = np.asarray(tokens).reshape(n, n)
        changed = np.zeros((n, n), bool) if before is None else t != np.asarray(before).reshape(n, n)
        cells = [[self.cell(t[r, c]) + ('*' if changed[r, c] else ' ') for c in range(n)] for r in range(n)]
        if self.box is None:
            return '\n'.join(''.join(row).rstrip() for row in cells)
        br, bc = self.box
        lines = []
        for r in range(n):
            if r and r % br == 0:
                lines.append('-+-'.join('-' * (3 * bc - 1) for _ in range(n // bc)))
            lines.append(' | '.join(' '.join(cells[r][c:c + bc]) for c in range(0, n, bc)).rstrip())
        return '\n'.join(lines)

    # a user's text

    @classmethod
    def guess(cls, text):
        """What this text looks like when it is one of these ('4x4 Sudoku', or the bare noun), else None."""
        return None

    def split_file(self, lines):
        """[(text, first line, last line)] from a file's lines (1-based numbers): blank-line-separated blocks
        of rows; a block of several lines, each longer than a row, is that many puzzles (one a line)."""
        blocks, cur, out = [], [], []
        for i, line in enumerate(lines + ['']):
            if line == '':
                if cur:
                    blocks.append(cur)
                cur = []
            else:
                cur.append((i + 1, line))
        for block in blocks:
            if len(block) > 1 and all(len(l) > self.n for _, l in block):  # no row: each line a whole puzzle
                out += [(l, i, i) for i, l in block]
            else:
                out.append(('\n'.join(l for _, l in block), block[0][0], block[-1][0]))
        return out

    def parse(self, text, where):
        """A user's rows ('/' or newlines between them, or one line of n*n characters) -> tokens [L]."""
        rows = text.replace('\r', '').replace('/', '\n').split('\n')
        while rows and rows[-1] == '':
            rows.pop()
        while rows and rows[0] == '':  # a quoted block of lines often opens with a line end
            rows.pop(0)
        if len(rows) == 1 and len(rows[0]) == self.L:
            rows = [rows[0][i:i + self.n] for i in range(0, self.L, self.n)]
        shape = f"{article(self.title)} has {self.text_shape()}"
        if len(rows) != self.n:
            of = f" of {plural(len(rows[0]), 'character')}" if len(rows) == 1 else ''
            hint = self.short_hint if len(rows) == 1 and self.n < len(rows[0]) < self.L else ''
            raise ValueError(f"{where}: {plural(len(rows), 'row')}{of}; {shape}{hint}")
        for r, row in enumerate(rows):
            if len(row) != self.n:
                hint = self.short_hint if len(row) < self.n else ''
                raise ValueError(f"{where}: row {r + 1} has {plural(len(row), 'character')}; {shape}{hint}")
            for c, ch in enumerate(row):
                if ch not in self.question_chars:
                    raise ValueError(f"{where}: character {ch!r} in row {r + 1}, column {c + 1}"
                                     f"{self.why_not(ch)}; {shape}")
        return self.encode([''.join(rows)])[0].astype(np.int32)

    def text_shape(self):
        return (f"{self.n} rows of {self.n} characters from '{self.question_chars}', joined by '/' or "
                f"newlines, or one line of {self.L}")

    def why_not(self, ch):
        """A hint after a character a question may not hold."""
        return ''

    def contradiction(self, tokens, where):
        """Givens that cannot all hold: a message, or None."""
        return None

    def describe(self, tokens):
        """A few words on a question, after its title."""
        return ''

    # symmetries

    symmetric = False  # draw() gives more than the identity: augmentation and test-time views need it
    stored_views = ''  # why fresh views are none, for a kind whose views are stored in its dataset

    def identity(self, k):
        return np.tile(np.arange(self.L), (k, 1)), np.tile(np.arange(self.vocab_size, dtype=np.uint8), (k, 1))

    def draw(self, rng, k):
        """k random symmetries (the identity here: a kind without symmetries)."""
        return self.identity(k)

    def views(self, K, B, seed, batch):
        """The symmetries of K views of a batch of B puzzles, view-major ([K * B] rows, view j in rows
        j*B..(j+1)*B-1): view 0 the puzzles themselves, view j >= 1 drawn from a generator of its own
        (seed, batch, j). So the first k views of a K-view evaluation are those of a k-view one, and every
        rank of a pod draws the same symmetries for the global batch."""
        parts = [self.identity(B)] + [self.draw(np.random.default_rng([seed, 11, batch, j]), B)
                                      for j in range(1, K)]
        return np.concatenate([p for p, _ in parts]), np.concatenate([m for _, m in parts])

    @staticmethod
    def apply(tokens, sym):
        """tokens [k, L] -> the k images, row i under symmetry i."""
        pos, token_map = sym
        moved = np.take_along_axis(np.asarray(tokens), pos, 1)
        return np.take_along_axis(token_map, moved.astype(np.intp), 1)

    @staticmethod
    def invert(sym):
        pos, token_map = sym
        return np.argsort(pos, 1), np.argsort(token_map, 1).astype(token_map.dtype)

    @staticmethod
    def apply_labels(labels, sym):
        """labels [k, L] -> their images; a negative label (ignored by the loss) moves but keeps its value."""
        pos, token_map = sym
        moved = np.take_along_axis(np.asarray(labels), pos, 1)
        return np.where(moved < 0, moved, np.take_along_axis(token_map, np.maximum(moved, 0).astype(np.intp), 1))


# -----------------------------------------------------------------------------
# Sudoku: PAD 0, blank 1, digit d -> d + 1 (vocab n + 2, seq_len n * n)

BOXES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}  # grid size n -> (rows, cols) of one box


@functools.lru_cache(maxsize=None)
def _perm_table(m):
    """All m! permutations of range(m): drawing an index into this table is a uniform permutation,
    and far cheaper than argsort of random keys for a million copies."""
    count = math.factorial(m)
    flat = np.fromiter(itertools.chain.from_iterable(itertools.permutations(range(m))), np.uint8, m * count)
    return flat.reshape(count, m)


def _random_perms(rng, m, shape):
    table = _perm_table(m)
    return table[rng.integers(0, len(table), size=shape)].astype(np.int32)


class Sudoku(Grid):
    """Every row, column and box holds each digit once; the givens stay."""
    name, noun = 'sudoku', 'Sudoku'
    symmetric = True
    pad_char = '.'
    aliases = {'0': 1}
    one_line_answer = True

    def __init__(self, n, boxes=True):
        if boxes and n not in BOXES:
            sizes = ', '.join(f'{k}x{k}' for k in BOXES)
            raise ValueError(f"no Sudoku of size {n}x{n}: the sizes are {sizes}")
        super().__init__(n)
        self.box = BOXES[n] if boxes else None  # without boxes: a Latin square
        self.chars = '.' + '123456789'[:n]
        self.question_chars = '.0' + '123456789'[:n]

    def text_shape(self):
        return f"{self.L} characters from '{self.question_chars}'"

    @functools.cached_property
    def units(self):
        """[(name, flat cell indices)]: the rows, the columns and the boxes, the Sudoku rule's units."""
        n = self.n
        units = [(f"row {r + 1}", [r * n + c for c in range(n)]) for r in range(n)]
        units += [(f"column {c + 1}", [r * n + c for r in range(n)]) for c in range(n)]
        if self.box:
            br, bc = self.box
            corners = [(r, c) for r in range(0, n, br) for c in range(0, n, bc)]
            units += [(f"box {b + 1} (rows {r0 + 1}-{r0 + br}, columns {c0 + 1}-{c0 + bc})",
                       [(r0 + i) * n + c0 + j for i in range(br) for j in range(bc)])
                      for b, (r0, c0) in enumerate(corners)]
        return units

    @functools.cached_property
    def _unit_index(self):
        return np.array([cells for _, cells in self.units], np.intp)

    def units_hold(self, tokens):
        """[B, L] tokens -> bool [B]: every unit holds each digit once (a blank, PAD or anything else is no
        digit). A unit's sum of 2**(d-1) equals 2**n - 1 exactly when its n digits are distinct (n powers of
        two have n set bits in their sum only if no two are equal)."""
        t = np.asarray(tokens)
        if t.dtype != np.uint8:
            t = np.clip(t, 0, 255).astype(np.uint8)
        lut = np.zeros(256, np.uint16)
        lut[2:self.n + 2] = 1 << np.arange(self.n)
        bits, cells = lut[np.ascontiguousarray(t.T)], self._unit_index  # [L, B]: a cell's batch lies together
        sums = bits[cells[:, 0]]
        for j in range(1, cells.shape[1]):  # one cell of every unit at a time, whole rows of B: memory-fast
            sums += bits[cells[:, j]]
        return (sums == (1 << self.n) - 1).all(0)

    def correct(self, inputs, preds):
        """bool [B]: the prediction keeps every given and obeys the rule."""
        inputs, preds = np.asarray(inputs), np.asarray(preds)
        assert preds.shape[-1] == self.L, f"{preds.shape[-1]} tokens, not {article(self.title)}"
        keeps = ((preds == inputs) | (inputs < 2)).all(1)
        return keeps & self.units_hold(preds)

    def clashes(self, tokens):
        """bool [n, n]: cells whose digit appears again in one of their units."""
        t = np.asarray(tokens).ravel()
        out = np.zeros(self.L, bool)
        for _, cells in self.units:
            d = t[cells]
            out[np.array(cells)[(d > 1) & ((d[:, None] == d[None, :]).sum(1) > 1)]] = True
        return out.reshape(self.n, self.n)

    def first_repeat(self, tokens):
        """(unit name, digit, first cell, second cell) of the first digit that a unit holds twice, or None."""
        t = np.asarray(tokens).ravel()
        for name, cells in self.units:
            seen = {}
            for i in cells:
                if t[i] > 1 and t[i] in seen:
                    return name, int(t[i]) - 1, seen[t[i]], i
                seen[t[i]] = i
        return None

    @classmethod
    def guess(cls, text):
        chars = set(text) - set(' \t/\r\n')
        if chars and chars <= set('.0123456789'):
            k = len(''.join(text.split()).replace('/', ''))
            n = math.isqrt(k)
            return f"{n}x{n} Sudoku" if n * n == k and n in BOXES else 'Sudoku'
        return None

    def split_file(self, lines):
        return [(line, i + 1, i + 1) for i, line in enumerate(lines) if line.strip()]

    def parse(self, text, where):
        s = ''.join(text.split()).replace('/', '')
        shape = f"{article(self.title)} has {self.text_shape()}"
        if len(s) != self.L:
            guess = looks_like(text)
            also = f" ({article(guess)})" if guess and guess not in (self.title, self.noun) else ''
            row = len(s) == self.n and not re.search(r'[/\n]', text.strip())  # a grid written one row a line
            hint = f" (one row? a file holds one puzzle a line: its {self.n} rows on one line, or joined by '/')"
            raise ValueError(f"{where}: {plural(len(s), 'character')}{also}; {shape}{hint * row}")
        # rows of other lengths can still add up to n*n characters: cut anew, a given would move to another cell
        rows = [r for r in (''.join(r.split()) for r in text.replace('/', '\n').split('\n')) if r]
        short = next(((k, r) for k, r in enumerate(rows) if len(r) != self.n), None) if len(rows) > 1 else None
        if short:
            raise ValueError(f"{where}: row {short[0] + 1} has {plural(len(short[1]), 'character')}; "
                             f"{article(self.title)} has {self.n} rows of {self.n} characters from "
                             f"'{self.question_chars}' joined by '/' or newlines, or one line of {self.L}")
        for i, c in enumerate(s):
            if c not in self.question_chars:
                raise ValueError(f"{where}: character {c!r} at position {i + 1}; {shape}")
        return self.encode([s])[0].astype(np.int32)

    def contradiction(self, tokens, where):
        found = self.first_repeat(tokens)
        if found is None:
            return None
        name, d, i, j = found
        n = self.n
        return (f"{where}: the givens contradict each other: {d} twice in {name} "
                f"(row {i // n + 1} column {i % n + 1} and row {j // n + 1} column {j % n + 1})")

    def describe(self, tokens):
        return f", {plural(int((np.asarray(tokens) <= 1).sum()), 'blank')}"

    def draw(self, rng, k):
        """k random symmetries: digit relabelling, band and row-within-band permutation, stack and
        column-within-stack permutation, and a transpose with p=0.5 where boxes are square (without boxes:
        any row and column permutation, and the transpose)."""
        n, (br, bc) = self.n, self.box or (1, 1)
        token_map = np.zeros((k, self.vocab_size), np.uint8)
        token_map[:, 1] = 1
        token_map[:, 2:] = _random_perms(rng, n, k) + 2
        rows = (_random_perms(rng, n // br, k)[:, :, None] * br
                + _random_perms(rng, br, (k, n // br))).reshape(k, n)
        cols = (_random_perms(rng, n // bc, k)[:, :, None] * bc
                + _random_perms(rng, bc, (k, n // bc))).reshape(k, n)
        row_part, col_part = rows * n, cols  # out[i, j] = in[rows[i], cols[j]]
        if br == bc:  # transposed first: out[i, j] = in.T[rows[i], cols[j]] = in[cols[j], rows[i]]
            flip = (rng.random(k) < 0.5)[:, None]
            row_part, col_part = np.where(flip, rows, row_part), np.where(flip, cols * n, col_part)
        return (row_part[:, :, None] + col_part[:, None, :]).reshape(k, n * n), token_map


# -----------------------------------------------------------------------------
# Maze: PAD 0, then '#' wall, ' ' open, 'S' start, 'G' goal, 'o' path cell (only in answers)

PAD, WALL, OPEN, START, GOAL, PATH = range(6)


def _pack_rows(mask):
    """[B, n, n] bool -> [B, n] bitsets: bit j of word i is cell (i, j). uint64 up to n = 64 (so a BFS
    step is a few shifts on B*n words instead of B*n*n bools), Python ints (object) beyond."""
    n = mask.shape[-1]
    dt = np.uint64 if n <= 64 else object
    return np.bitwise_or.reduce(mask.astype(dt) << np.arange(n).astype(dt), axis=-1)


def _grid_size(L):
    n = math.isqrt(L)
    assert n * n == L, f"sequence length {L} is not a perfect square"
    return n


def shortest_path_length(grids):
    """BFS steps from S to G through non-wall cells, for each row of [B, n*n] maze tokens; -1 when G is
    unreachable or the row lacks a unique S and G. All rows expand their frontier together, as
    bitsets, and leave the batch once they reach G or their frontier stops growing."""
    x = np.asarray(grids)
    B, L = x.shape
    n = _grid_size(L)
    dist = np.full(B, -1, np.int64)
    is_s, is_g = x == START, x == GOAL
    rows = np.flatnonzero((is_s.sum(1) == 1) & (is_g.sum(1) == 1))
    passable = _pack_rows(np.isin(x[rows], (OPEN, START, GOAL, PATH)).reshape(-1, n, n))
    reach = _pack_rows(is_s[rows].reshape(-1, n, n))
    goal = _pack_rows(is_g[rows].reshape(-1, n, n))
    step = 0
    while len(rows):
        step += 1
        new = reach | (reach << 1) | (reach >> 1)  # left/right neighbours (bit n is cut by passable)
        new[:, 1:] |= reach[:, :-1]  # the cell above
        new[:, :-1] |= reach[:, 1:]  # the cell below
        new &= passable
        hit = (new & goal).any(1)
        dist[rows[hit]] = step
        keep = ~hit & (new != reach).any(1)  # a frontier that stopped growing: no path
        reach = new
        if not keep.all():
            rows, reach, passable, goal = rows[keep], reach[keep], passable[keep], goal[keep]
    return dist


class Maze(Grid):
    """The shortest S->G path through open cells, marked 'o'; any shortest path counts."""
    name, noun = 'maze', 'maze'
    symmetric = True
    chars = '# SGo'
    question_chars = '# SG'
    sep = ''
    short_hint = " (open cells are spaces: a row's last ones count, and some editors strip them)"
    colors = {'#': (0.22, 0.22, 0.25), ' ': (1, 1, 1), 'S': (0.15, 0.65, 0.25), 'G': (0.85, 0.2, 0.2),
              'o': (0.25, 0.45, 0.95), '?': (0.9, 0.3, 0.9)}

    @classmethod
    def guess(cls, text):
        chars = set(text) - set(' \t/\r\n')
        if chars & set('#SG') and chars <= set('# SGo'):
            rows = [r for r in text.replace('\r', '').replace('/', '\n').split('\n') if r]
            return f"{len(rows)}x{len(rows)} maze" if len(rows) > 1 else 'maze'
        return None

    def text_shape(self):
        return (f"{self.n} rows of {self.n} characters from '{self.question_chars}' (wall, open, start, "
                f"goal), joined by '/' or newlines, or one line of {self.L}")

    def why_not(self, ch):
        if ch == 'o':
            return " ('o' marks a path, which is the model's to find: give the maze without it)"
        return ''

    def contradiction(self, tokens, where):
        s, g = int((tokens == START).sum()), int((tokens == GOAL).sum())
        if s != 1 or g != 1:
            return f"{where}: {s} S (start) and {g} G (goal) cells; a maze needs exactly one of each"
        if shortest_path_length(tokens[None])[0] < 0:
            return f"{where}: no open path leads from S to G"
        return None

    def describe(self, tokens):
        return f", shortest path {plural(int(shortest_path_length(np.asarray(tokens)[None])[0]), 'step')}"

    def correct(self, inputs, preds):
        """bool [B]: the prediction keeps every wall, S and G of the input maze (and adds none), and its 'o'
        cells form a 4-connected simple S->G path through open cells whose length equals the input's
        shortest path length. Any optimal path is accepted.
        Why degree checks suffice: if S and G have exactly one marked neighbour (S, G or 'o') and every
        'o' exactly two, the marked cells are one S..G path plus disjoint cycles. That path has at least
        d(S,G) steps, i.e. uses >= d-1 'o' cells; so with exactly d-1 'o' cells there are no cycles and the
        path is a shortest one. Conversely a shortest path has no chords (one would be a shortcut)."""
        x, p = np.asarray(inputs), np.asarray(preds)
        assert x.shape == p.shape and x.ndim == 2, (x.shape, p.shape)
        B, L = x.shape
        n = _grid_size(L)
        valid_question = np.isin(x, (WALL, OPEN, START, GOAL)).all(1)
        keeps_maze = np.where(x != OPEN, p == x, (p == OPEN) | (p == PATH)).all(1)
        on = np.isin(p, (START, GOAL, PATH)).reshape(B, n, n)
        deg = np.zeros((B, n, n), np.int8)  # marked 4-neighbours of each cell
        deg[:, 1:] += on[:, :-1]
        deg[:, :-1] += on[:, 1:]
        deg[:, :, 1:] += on[:, :, :-1]
        deg[:, :, :-1] += on[:, :, 1:]
        deg = deg.reshape(B, L)
        is_path = p == PATH
        is_end = (p == START) | (p == GOAL)
        degrees_ok = (~is_path | (deg == 2)).all(1) & (~is_end | (deg == 1)).all(1)
        ok = np.zeros(B, bool)
        cand = np.flatnonzero(valid_question & keeps_maze & degrees_ok)  # only these need a BFS
        if len(cand):
            ok[cand] = shortest_path_length(x[cand]) == is_path[cand].sum(1) + 1
        return ok

    def dihedral(self, ks):
        """The symmetries ks (0..7) of the square: rotations by 90 degrees k % 4 times, mirrored for k >= 4;
        0 is the identity."""
        cells = np.arange(self.L).reshape(self.n, self.n)
        table = [np.rot90(cells, k % 4) for k in range(8)]
        table = np.stack([(g[:, ::-1] if k >= 4 else g).ravel() for k, g in enumerate(table)])
        ks = np.asarray(ks)
        return table[ks], np.tile(np.arange(self.vocab_size, dtype=np.uint8), (len(ks), 1))

    def draw(self, rng, k):
        return self.dihedral(rng.integers(0, 8, k))


# -----------------------------------------------------------------------------
# ARC: PAD 0, EOS 1, colour c -> c + 2 (vocab 12); one grid of any shape up to n x n at the canvas's top-left

ARC_PALETTE = {'0': (0, 0, 0), '1': (0, 0.455, 0.851), '2': (1, 0.255, 0.212), '3': (0.180, 0.800, 0.251),
               '4': (1, 0.863, 0), '5': (0.667, 0.667, 0.667), '6': (0.941, 0.071, 0.745),
               '7': (1, 0.522, 0.106), '8': (0.498, 0.859, 1), '9': (0.529, 0.047, 0.145)}
EOS = 1
_DIHEDRAL = (lambda g: g, lambda g: g[:, ::-1].T, lambda g: g[::-1, ::-1], lambda g: g.T[:, ::-1],  # views by
             lambda g: g[:, ::-1], lambda g: g[::-1], lambda g: g.T, lambda g: g[::-1, ::-1].T)   # slicing: cheap
DIHEDRAL_INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)  # t -> the transform that undoes t


class ARC(Grid):
    """An ARC-AGI grid: h x w colours 0-9 (1 <= h, w <= n) at the top-left of an n x n canvas, EOS on the row
    just below it and the column just right of it where they fall inside the canvas (the corner stays PAD).
    The labels train that border too, so the model draws the output's size; crop() reads it back.
    There is no verifier (an answer is right only when it is the task's output), and a fresh symmetry is no
    view: a task's augmentations (a dihedral transform and a permutation of colours 1-9, 0 fixed) are stored
    in the dataset, each with its own trained puzzle embedding, and an augmentation without one scores 0."""
    name, noun = 'arc', 'ARC grid'
    chars = '|0123456789'  # token 1 (EOS) shows as '|'
    question_chars = '0123456789'
    pad_char = '.'
    sep = ''
    colors = dict(ARC_PALETTE, **{'|': (1, 1, 1), '.': (0.85, 0.85, 0.85)})
    correct = None  # no verifier: exact match against the label only
    stored_views = "its views are the stored augmentations of the test split (fresh ones carry no trained " \
                   "puzzle embedding)"

    @property
    def title(self):
        return f"ARC grid on a {self.n}x{self.n} canvas"

    @property
    def titles(self):
        return f"ARC grids on a {self.n}x{self.n} canvas"

    # the augmentation: a dihedral transform t (0 identity, 1-3 rotations by 90 degrees counter-clockwise
    # k times, 4 left-right flip, 5 up-down flip, 6 transpose, 7 anti-transpose; the numbering is the one the
    # reference's dataset names carry) and a colour map (colours[c]: what colour c becomes), on grids of any
    # shape, so an input and its differently shaped output go through the same augmentation

    @staticmethod
    def dihedral(grid, t):
        return _DIHEDRAL[t](np.asarray(grid))

    @classmethod
    def augment(cls, grid, t, colours):
        return cls.dihedral(np.asarray(colours, np.uint8)[np.asarray(grid)], t)

    @classmethod
    def unaugment(cls, grid, t, colours):
        """The inverse of augment(., t, colours): the dihedral transform undone, then the colours."""
        return np.argsort(colours).astype(np.uint8)[cls.dihedral(grid, DIHEDRAL_INVERSE[t])]

    # canvas <-> grid

    def to_canvas(self, grid, r=0, c=0):
        """A grid of colours [h, w] -> tokens [n*n] (uint8) with the grid's top-left at (r, c)."""
        g = np.asarray(grid)
        h, w = g.shape
        n = self.n
        assert 0 <= r and r + h <= n and 0 <= c and c + w <= n, (g.shape, r, c, n)
        canvas = np.zeros((n, n), np.uint8)
        canvas[r:r + h, c:c + w] = g + 2
        if r + h < n:
            canvas[r + h, c:c + w] = EOS
        if c + w < n:
            canvas[r:r + h, c + w] = EOS
        return canvas.ravel()

    def crop(self, tokens):
        """tokens [n*n] -> the grid of colours [h, w]: the largest top-left rectangle of colour tokens (the
        area of a row-by-row scan that narrows to each row's first non-colour cell); [0, 0] when the first
        cell holds none."""
        t = np.asarray(tokens).reshape(self.n, self.n)
        is_colour = (t >= 2) & (t <= 11)
        width = np.minimum.accumulate(np.where(is_colour.all(1), self.n, is_colour.argmin(1)))
        area = width * np.arange(1, self.n + 1)
        h = int(area.argmax()) + 1 if area.max() > 0 else 0
        return (t[:h, :width[h - 1] if h else 0] - 2).astype(np.uint8)

    # a user's grid and its text

    def text_shape(self):
        return (f"rows of equal length, 1 to {self.n} of them, of 1 to {self.n} colour digits 0-9, joined by "
                "'/' or newlines (or a JSON list of rows: [[0, 1], [2, 3]])")

    def grid_from_text(self, text, where):
        """A user's grid -> colours [h, w] (uint8); a bad text raises ValueError with one line."""
        s = text.strip()
        shape = f"an ARC grid has {self.text_shape()}"
        if s.startswith('['):
            s = s.replace(' ', '').replace('\n', '').replace('],[', '/').strip('[]')
            s = s.replace(',', '')
        rows = [r.replace(' ', '') for r in s.replace('\r', '').replace('/', '\n').split('\n')]
        while rows and rows[-1] == '':
            rows.pop()
        if not rows or not rows[0]:
            raise ValueError(f"{where}: an empty grid; {shape}")
        if len(rows) > self.n:
            raise ValueError(f"{where}: {plural(len(rows), 'row')}, over the canvas's {self.n}; {shape}")
        for r, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise ValueError(f"{where}: row {r + 1} has {len(row)} cells and row 1 {len(rows[0])}; {shape}")
            if len(row) > self.n:
                raise ValueError(f"{where}: rows of {len(row)} cells, over the canvas's {self.n}; {shape}")
            for c, ch in enumerate(row):
                if ch not in self.question_chars:
                    raise ValueError(f"{where}: character {ch!r} in row {r + 1}, column {c + 1}; {shape}")
        return (np.frombuffer(''.join(rows).encode(), np.uint8) - ord('0')).reshape(len(rows), -1)

    def parse(self, text, where):
        return self.to_canvas(self.grid_from_text(text, where)).astype(np.int32)

    def split_file(self, lines):
        """[(text, first line, last line)]: blank-line-separated blocks, one grid each."""
        blocks, cur = [], []
        for i, line in enumerate(lines + ['']):
            if line.strip():
                cur.append((i + 1, line))
            elif cur:
                blocks.append(('\n'.join(l for _, l in cur), cur[0][0], cur[-1][0]))
                cur = []
        return blocks

    def describe(self, tokens):
        h, w = self.crop(tokens).shape
        return f", {h}x{w}"

    def render(self, tokens, before=None):
        """The cropped grid as digits, one line a row; cells that differ from `before` (when its crop has the
        same shape) get a trailing '*'."""
        g = self.crop(tokens)
        if g.size == 0:
            return '(no grid: the canvas does not start with a colour)'
        b = None if before is None else self.crop(before)
        changed = (g != b) if b is not None and b.shape == g.shape else np.zeros(g.shape, bool)
        return '\n'.join(''.join(f"{v}{'*' if m else ' '}" for v, m in zip(row, mrow)).rstrip()
                         for row, mrow in zip(g, changed))


# -----------------------------------------------------------------------------
# ARC's task files (a challenges JSON): read and checked, for prepare_arc.py and solve.py --task

NO_OUTPUT = np.zeros((0, 0), np.uint8)  # a test input without a solution: it places no token, its labels stay PAD


class Task:
    """One task: its id, its pairs as (key, input, output) in its file's order (key 'train' for a
    demonstration, 'test' for a test pair; output NO_OUTPUT for a test input without a solution), its JSON with
    the test outputs there are (test_puzzles.json) and the file it came from."""
    def __init__(self, task_id, pairs, raw, source):
        self.id, self.pairs, self.raw, self.source = task_id, pairs, raw, source

    def examples(self, key=None):
        return [(x, y) for k, x, y in self.pairs if key is None or k == key]


def task_grid(g, canvas, where):
    """A JSON grid -> uint8 [h, w], or ValueError naming what is wrong with it."""
    if not isinstance(g, list) or not g or not all(isinstance(r, list) for r in g):
        raise ValueError(f"{where}: not a grid (a non-empty list of rows)")
    w = len(g[0])
    for r, row in enumerate(g):
        if not row:
            raise ValueError(f"{where}: row {r + 1} is empty (a grid holds at least one cell a row)")
        if len(row) != w:
            raise ValueError(f"{where}: row {r + 1} has {len(row)} cells, row 1 {w}: not a rectangle")
        bad = [v for v in row if type(v) is not int or not 0 <= v <= 9]
        if bad:
            raise ValueError(f"{where}: row {r + 1} holds {bad[0]!r}, not a colour 0-9")
    if len(g) > canvas or w > canvas:
        raise ValueError(f"{where}: a {len(g)}x{w} grid, over the {canvas}x{canvas} canvas")
    return np.array(g, np.uint8)


def read_tasks(tasks, source, canvas, keys=None, unsolved=False):
    """{id: {'train': [...], 'test': [...]}} (test outputs in place) -> [Task] in the dict's order. keys fixes
    the order of a task's pairs ('test' first for the Kaggle ARC-AGI-1 files), else the task's own order.
    unsolved: a test input may come without an output (NO_OUTPUT)."""
    if not isinstance(tasks, dict) or not tasks:
        raise ValueError(f"{source}: no tasks (expected a JSON object of task id -> task)")
    out = []
    for task_id, task in tasks.items():
        where = f"{source}: task {task_id}"
        if '|||' in task_id:
            raise ValueError(f"{where}: an id may not hold '|||' (it separates a name's parts)")
        if not isinstance(task, dict) or not isinstance(task.get('train'), list) \
                or not isinstance(task.get('test'), list):
            raise ValueError(f"{where}: expected an object with the lists 'train' and 'test'")
        for key, what in (('train', 'demonstration pairs'), ('test', 'test inputs')):
            if not task[key]:
                raise ValueError(f"{where}: no {what} (its '{key}' list is empty)")
        pairs = []
        for key in keys or [k for k in task if k in ('train', 'test')]:
            for i, pair in enumerate(task[key]):
                w = f"{where}: {key} pair {i + 1}"
                solved = not (unsolved and key == 'test')  # else its output may be missing
                if not isinstance(pair, dict) or 'input' not in pair or (solved and 'output' not in pair):
                    raise ValueError(f"{w}: expected an object with an input{' and an output' if solved else ''}")
                x = task_grid(pair['input'], canvas, f"{w} input")
                pairs.append((key, x, task_grid(pair['output'], canvas, f"{w} output") if 'output' in pair
                              else NO_OUTPUT))
        out.append(Task(task_id, pairs, task, source))
    return out


# -----------------------------------------------------------------------------
# a dataset's kind

KINDS = {'sudoku': Sudoku, 'maze': Maze, 'arc': ARC}  # name -> class; a kind added elsewhere registers here


def puzzle_for(meta):
    """The kind of a dataset (its dataset.json, or a checkpoint's `data`: puzzle_type and seq_len at least),
    or None for an unknown one. Datasets built here name it; the reference's are recognised by their
    vocabulary and length."""
    L = int(meta['seq_len'])
    n = int(meta.get('grid_size') or math.isqrt(L))
    if meta.get('puzzle_type'):
        cls = KINDS.get(meta['puzzle_type'])
        try:
            return cls(n) if cls and n * n == L else None
        except ValueError:
            return None
    if n * n != L:
        return None
    if n in BOXES and meta['vocab_size'] == n + 2:
        return Sudoku(n)
    if meta['vocab_size'] == len(Maze.chars) + 1:
        return Maze(n)
    if meta['vocab_size'] == len(ARC.chars) + 1 and n == 30:
        return ARC(n)
    return None


def puzzle_type(meta):
    """The kind's name ('sudoku', 'maze', ...) or None."""
    kind = puzzle_for(meta)
    return kind.name if kind else None


def verifier_for(meta):
    """A checker of whole answers, (inputs, preds) -> bool [B], or None for an unknown puzzle."""
    kind = puzzle_for(meta)
    return kind.correct if kind else None


def seq_len_for_vocab(vocab_size):
    """The sequence length that a vocabulary alone tells (a Sudoku's n + 2, unless a maze has it too), or
    None."""
    n = vocab_size - 2
    return n * n if n in BOXES and vocab_size != len(Maze.chars) + 1 else None


def views_problem(kind, K, rows=1, row_bytes=0, memory=None):
    """Why a puzzle of this kind (None: unknown) cannot be shown in K views, or None when it can. A batch of
    `rows` puzzles in K views is K x rows rows at once: each holds its tokens and labels (with their int64
    gather indices), its symmetry and the inverse on the host, and row_bytes more (the model's state of a
    row); K views whose batch needs more than `memory` bytes (None: what this machine has available) are
    refused before anything runs, not found out by an allocation that fails halfway."""
    if K == 1:
        return None
    if kind is None:
        return (f"{K} views need a known puzzle kind: this dataset's is unknown (its answers are only compared "
                "with the labels), so views must be 1")
    if kind.stored_views:
        return f"{K} fresh views of an {kind.noun}: {kind.stored_views}, so views must be 1"
    if not kind.symmetric:
        return f"{article(kind.title)} has no symmetries to show it in other views, so views must be 1"
    per_view = rows * (kind.L * (8 + 8 + 8 + 4 + 4 + 4 + 4) + 2 * kind.vocab_size + row_bytes)
    if memory is None:
        from device import memory_headroom  # (torch: only when views are asked for)
    memory, what = memory_headroom() if memory is None else (memory, 'available')
    # the need rounded up and what there is down: the two never read as the same size
    size = lambda n, r: f"{r(n / 1e8) / 10:,.1f} GB" if n >= 1e9 else f"{r(n / 1e6):,} MB"
    if memory is not None and K * per_view > memory:
        return (f"{K} views of a batch of {plural(rows, 'puzzle')} need {size(K * per_view, math.ceil)} of memory "
                f"at least ({per_view / 1e6:.3g} MB a view), more than the {size(memory, math.floor)} {what}: at most "
                f"{max(1, memory // per_view):,} views at this batch size")
    return None


def vote(answers, confidence, accepted=None):
    """Combine the K views' answers of B puzzles, each mapped back to its puzzle: answers [K, B, L],
    confidence [K, B] (the halting head's logit), accepted [K, B] (the verifier's verdict, or None).
    Returns (vote, choice, count): vote [B] a view holding the most frequent whole answer (a tie goes to the
    answer that one of its views is most confident of), choice [B] the same among the accepted answers where
    a view has one (else the vote), count [K, B] how many views gave each view's answer."""
    a, c = np.asarray(answers), np.asarray(confidence, np.float64)
    K = len(a)
    count = np.zeros(c.shape, np.int64)
    best = np.full(c.shape, -np.inf)  # the highest confidence among the views sharing each view's answer
    for i in range(K):
        same = (a == a[i]).all(-1)  # [K, B]
        count[i] = same.sum(0)
        best[i] = np.where(same, c, -np.inf).max(0)
    # count first, then confidence: a sigmoid in (0, 1) never lifts one count over the next (float64)
    key = count + 0.5 / (1 + np.exp(-best)) + 0.25
    picked = key.argmax(0)
    if accepted is None:
        return picked, picked, count
    return picked, (key + (K + 1) * np.asarray(accepted, bool)).argmax(0), count


def looks_like(text):
    """A guess at what a puzzle string is ('4x4 Sudoku', '8x8 maze', 'maze'), for a clear error when it is not
    what a checkpoint solves; None for no known kind."""
    return next((g for cls in KINDS.values() if (g := cls.guess(text))), None)


def shape_from_name(path):
    """(seq_len, vocab_size, why) of the task a dataset folder's name says: 'maze' (30x30 unless the name
    says RxC), 'sudoku<N>' (N = 4, 6 or 9), anything else the paper's 9x9 Sudoku."""
    name = os.path.basename(os.path.normpath(path)).lower() if path else ''
    if 'maze' in name:
        m = re.search(r'(\d+)x(\d+)', name)
        r, c = (int(m.group(1)), int(m.group(2))) if m else (30, 30)
        return r * c, len(Maze.chars) + 1, f"maze {r}x{c}, from data_path's name {path!r}"
    m = re.search(r'sudoku[-_]?(\d+)', name)
    if m and int(m.group(1)) in BOXES:
        n = int(m.group(1))
        return n * n, n + 2, f"sudoku {n}x{n}, from data_path's name {path!r}"
    if 'sudoku' in name:
        return 81, 11, f"sudoku 9x9, from data_path's name {path!r}"
    return 81, 11, (f"sudoku 9x9, the default: data_path's name {path!r} names no known puzzle" if path
                    else "sudoku 9x9, the default: no data_path")


def render_example(meta, inputs, preds, correct):
    """A held-out puzzle and the model's answer, side by side, as text."""
    kind = puzzle_for(meta)
    n = math.isqrt(meta['seq_len'])
    if n * n != meta['seq_len']:
        return f"puzzle: {list(inputs)}\nanswer: {list(preds)} ({'correct' if correct else 'wrong'})"
    cell = kind.cell if kind else (lambda t: format(int(t), 'x')[-1])
    sep = kind.sep if kind else ' '
    rows = [sep.join(cell(t) for t in inputs[r * n:(r + 1) * n]) + '   |   ' +
            sep.join(cell(t) for t in preds[r * n:(r + 1) * n]) for r in range(n)]
    return ('held-out puzzle   ->   model answer (' + ('correct' if correct else 'WRONG') + ')\n'
            + '\n'.join(rows))


# -----------------------------------------------------------------------------
# pictures (solve.py --png): plt is matplotlib.pyplot, imported by the caller

def draw_steps(plt, kind, items, title):
    """One row of small boards per puzzle (wrapped every 6): the puzzle, then each step, changed cells
    highlighted, titled with the step, the halt probability and correct / not. Sudoku: givens bold on grey,
    the model's digits blue; red where a digit clashes with another of its row, column or box, or a given
    was overwritten."""
    from matplotlib.patches import Rectangle
    per_row = 6
    layout = []  # (puzzle item, first panel, panels)
    for it in items:
        panels = 1 + it['shown']
        for start in range(0, panels, per_row):
            layout.append((it, start, min(per_row, panels - start)))
    ncols = min(per_row, max(p for _, _, p in layout))
    fig, axes = plt.subplots(len(layout), ncols, figsize=(2.3 * ncols, 2.55 * len(layout) + 0.4),
                             squeeze=False)
    n = kind.n
    for row, (it, start, count) in enumerate(layout):
        for col in range(ncols):
            ax = axes[row, col]
            ax.set_xticks([])
            ax.set_yticks([])
            if col >= count:
                ax.axis('off')
                continue
            k = start + col  # 0: the puzzle, k: step k
            cur = it['inputs'] if k == 0 else it['preds'][k - 1]
            prev = None if k == 0 else (it['inputs'] if k == 1 else it['preds'][k - 2])
            grid = np.asarray(cur).reshape(n, n)
            changed = np.zeros((n, n), bool) if prev is None else grid != np.asarray(prev).reshape(n, n)
            given = np.asarray(it['inputs']).reshape(n, n)
            if kind.colors:
                img = np.array([[kind.colors.get(kind.cell(v), (0.9, 0.3, 0.9)) for v in r] for r in grid])
                ax.imshow(img, interpolation='nearest', extent=(0, n, n, 0))
                for r, c in zip(*np.nonzero(changed)):
                    ax.add_patch(Rectangle((c + 0.08, r + 0.08), 0.84, 0.84, fill=False,
                                           edgecolor=(1, 0.6, 0),
                                           linewidth=1.2))
            else:
                br, bc = kind.box or (n, n)
                bad = kind.clashes(grid)
                ax.set_xlim(0, n)
                ax.set_ylim(n, 0)
                ax.set_aspect('equal')
                for r in range(n):
                    for c in range(n):
                        face = (1, 0.85, 0.3) if changed[r, c] else (0.9, 0.9, 0.9) if given[r, c] > 1 \
                            else (1, 1, 1)
                        ax.add_patch(Rectangle((c, r), 1, 1, facecolor=face, edgecolor='none'))
                        ch, is_given = kind.cell(grid[r, c]), given[r, c] > 1
                        red = bad[r, c] or (is_given and grid[r, c] != given[r, c])  # a clash, a given lost
                        if ch != '.':
                            ax.text(c + 0.5, r + 0.54, ch, ha='center', va='center', fontsize=max(6, 60 // n),
                                    color=(0.85, 0.1, 0.1) if red else 'black' if is_given
                                    else (0.1, 0.3, 0.8),
                                    fontweight='bold' if is_given else 'normal')
                for i in range(n + 1):
                    ax.axhline(i, color='black', linewidth=1.6 if i % br == 0 else 0.4)
                    ax.axvline(i, color='black', linewidth=1.6 if i % bc == 0 else 0.4)
            if k == 0:
                ax.set_title(f"{it['label']}\n(given)", fontsize=8)
            else:
                ok = it['correct'][k - 1]
                halt = ' (halt)' if k - 1 == it['halt'] else ''
                ax.set_title(f"step {k}{halt}\nhalt p {it['prob'][k - 1]:.2f} | "
                             f"{'correct' if ok else 'not correct'}", fontsize=8,
                             color=(0.05, 0.5, 0.15) if ok else (0.75, 0.1, 0.1))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def draw_arc_task(plt, demos, tests, title):
    """The task as ARC draws it, under `title`: each demonstration (input, output), then each test input with the two
    attempts (titled with their votes, right or wrong) and the solution when known, in the ARC palette."""
    lut = np.array([ARC_PALETTE[str(c)] for c in range(10)])
    per_row = 4
    rows_ = [('demo', k, p) for k, p in enumerate(demos)]
    rows_ = [rows_[i:i + 2] for i in range(0, len(rows_), 2)] + [[('test', i, x)] for i, x in enumerate(tests)]
    fig, axes = plt.subplots(len(rows_), per_row, figsize=(2.4 * per_row, 2.6 * len(rows_) + 0.3), squeeze=False)

    def panel(ax, grid, title, color='black'):
        g = np.asarray(grid, np.int64)
        ax.set_xticks([])
        ax.set_yticks([])
        if g.ndim != 2 or g.size == 0:
            ax.text(0.5, 0.5, '(no grid)', ha='center', va='center', fontsize=8)
        else:
            h, w = g.shape
            ax.imshow(lut[g], interpolation='nearest', extent=(0, w, h, 0))
            for r in range(h + 1):
                ax.axhline(r, color=(0.33, 0.33, 0.33), linewidth=0.4)
            for c in range(w + 1):
                ax.axvline(c, color=(0.33, 0.33, 0.33), linewidth=0.4)
            ax.set_xlim(0, w)
            ax.set_ylim(h, 0)
        ax.set_title(title, fontsize=8, color=color)

    for r, items in enumerate(rows_):
        col = 0
        for what, k, it in items:
            if what == 'demo':
                panel(axes[r, col], it['input'], f"demonstration {k + 1}: input")
                panel(axes[r, col + 1], it['output'], f"demonstration {k + 1}: output")
                col += 2
                continue
            panel(axes[r, 0], it['input'], f"test input {k + 1}")
            for j, (g, v) in enumerate(zip(it['attempts'], it['verdicts'])):
                color = (0.05, 0.5, 0.15) if 'right' in v else (0.75, 0.1, 0.1) if 'wrong' in v else 'black'
                votes_ = f"{it['votes'][j]} of {it['views']} votes" if j == 0 or not it['lone'] else \
                    '= attempt 1 (the only answer)'
                panel(axes[r, 1 + j], g, f"attempt {j + 1}{v}\n{votes_}", color)
            col = 1 + len(it['attempts'])
            if it['solution'] is not None:
                panel(axes[r, col], it['solution'], 'solution')
                col += 1
        for c in range(col, per_row):
            axes[r, c].axis('off')
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig

