"""
ARC's scoring: an ARC dataset's test rows are its tasks' stored views (test_views.npz), so its evaluation scores a
vote, not rows. `ARCVotes` keeps every row's answer, mapped back to its task, and counts it per test input;
`score_arc` scores the vote (pass@K per test output, the ARC Prize's score, and per task, the reference's), pooled
over a run's evaluations where asked, and `arc_submission` writes the ARC Prize submission. evaluate.evaluate hands
each batch's answers to ARCVotes.read; solve.py --task ranks one task's answers with the same vote.
"""
import os
import zipfile
import zlib

import numpy as np
import torch

from data import load_arrays, load_json
from evaluate import at_first, view_counts, wilson_interval
from puzzles import read_tasks

PASS_AT = (1, 2, 5, 10, 100, 1000)  # the reference's K of pass@K (capped at the views a test input has)
ARC_MODES = ('last', 'q_halt')      # the answer after the last step; where the model first halted
CONFIDENCE_BITS = 117               # a confidence is counted in units of 2^-117: integers, so their sums are
CONFIDENCE_ONE = 2 ** CONFIDENCE_BITS  # exact whatever the order they come in, and one down to 2^-64 (a q_halt
                                    # logit of -44) keeps float64's 53 bits, as the reference's float64 sum
                                    # does: a coarser fixed step ties small confidences that the reference ranks
POOL_V1_BITS = 53                   # the unit of a pool whose checkpoint holds the columns 'high' and 'low'
LIMB = 48                           # a pool's summed confidence in three int64 columns of 48 bits each (the
                                    # top one holds up to 2^42 votes of confidence 1)


def answer_key(grid):
    """A grid of colours [h, w] (uint8) -> bytes that identify it, shape included (h, w <= 255)."""
    g = np.ascontiguousarray(grid, np.uint8)
    return bytes(g.shape) + g.tobytes()


def key_grid(key):
    """answer_key's bytes -> the grid as lists of ints (ARC's JSON); an empty grid as [[0]]."""
    h, w = key[0], key[1]
    if h == 0 or w == 0:
        return [[0]]
    return np.frombuffer(key[2:], np.uint8).reshape(h, w).tolist()


def confidence(q_halt):
    """sigmoid(q_halt logits) in float64 (in float32 every logit above ~16.6 is exactly 1.0: ties)."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(q_halt, np.float64)))


def load_views(path):
    """test_views.npz's arrays, or a ValueError in one line naming the file and advising a rebuild: an empty,
    cut-short or otherwise damaged copy is no zip of arrays (numpy raises EOFError, BadZipFile, ...)."""
    try:
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path} cannot be read ({str(e) or type(e).__name__}): rebuild the dataset with "
                         "prepare_arc.py") from e


def rank_answers(tally):
    """{answer: (count, summed confidence)} of one test input -> its answers, best first: by count, then by
    mean confidence (at equal counts: the sum). Among ties an empty crop comes after every grid, then the
    answer first in `tally` goes first (ARCVotes.votes lists them lowest view first: view 0 is the task as it
    is), so the order is the same on every rank and in any batch order."""
    first = {a: i for i, a in enumerate(tally)}
    return sorted(tally, key=lambda a: (-tally[a][0], -tally[a][1], not (a[0] and a[1]), first[a]))


def score_arc(puzzles, votes, ks=PASS_AT):
    """The vote's score over the tasks of `puzzles` ({task id: task}, test_puzzles.json's, the test outputs
    inside), from votes {(task id, test index): {answer_key: (count, summed confidence)}}. A test input passes
    at K when its output is among the K best-ranked answers (rank_answers); one without votes fails; one
    without an output (a hidden test set's) is not scored. pass@K averages over the tasks with a scored test
    input, a task scoring the share of them that pass (the reference's score), with the Wilson interval over
    those tasks; outputs_pass@K is the ARC Prize's score: every scored test output counts once (its interval
    over them). None where nothing is scored. K runs over ks up to the most views a test input had (1 and 2
    always). ranks: per task, each test input's rank of its output (0: not among the answers; None: not
    scored)."""
    ranks, views = {}, 1
    for task_id, task in puzzles.items():
        ranks[task_id] = []
        for i, pair in enumerate(task['test']):
            tally = votes.get((task_id, i), {})
            views = max(views, sum(c for c, _ in tally.values()))
            if 'output' not in pair:
                ranks[task_id].append(None)
                continue
            order = rank_answers(tally)
            right = answer_key(np.asarray(pair['output'], np.uint8))
            ranks[task_id].append(order.index(right) + 1 if right in order else 0)
    ks = [k for k in ks if k <= max(2, views)]
    scored = {t: [r for r in rs if r is not None] for t, rs in ranks.items()}
    scored = {t: rs for t, rs in scored.items() if rs}
    outputs = [r for rs in scored.values() for r in rs]
    T, N = len(scored), len(outputs)
    out = dict(tasks=len(ranks), test_outputs=sum(map(len, ranks.values())), unscored=sum(
        r is None for rs in ranks.values() for r in rs), scored_tasks=T, views=views,
        answered=sum(len(votes.get((t, i), {})) > 0 for t, rs in ranks.items() for i in range(len(rs))))
    for k in ks:
        per_task = float(sum(np.mean([0 < r <= k for r in rs]) for rs in scored.values()))
        per_output = sum(0 < r <= k for r in outputs)
        out[f'pass@{k}'] = per_task / T if T else None
        out[f'outputs_pass@{k}'] = per_output / N if N else None
        if k in (1, 2):
            for name, hits, n in ((f'pass@{k}', per_task, T), (f'outputs_pass@{k}', per_output, N)):
                out[name + '_ci_low'], out[name + '_ci_high'] = wilson_interval(hits, n) if n else (None, None)
    out['ranks'] = ranks
    return out


def arc_submission(puzzles, votes):
    """The ARC Prize submission: {task id: [{'attempt_1': grid, 'attempt_2': grid}, one per test input in
    order]}, the vote's two best answers; a lone answer is both attempts (as the reference writes it), a test
    input without votes gets [[0]] for both. Test inputs without a known output are in it too."""
    sub = {}
    for task_id, task in puzzles.items():
        sub[task_id] = []
        for i in range(len(task['test'])):
            order = rank_answers(votes.get((task_id, i), {}))[:2]
            grids = [key_grid(a) for a in order] or [[[0]]]
            sub[task_id].append(dict(attempt_1=grids[0], attempt_2=grids[-1]))
    return sub


class ARCVotes:
    """Every answer of an ARC evaluation, kept compact for the vote: each test row's answer is cropped and
    mapped back to its task on the host as its batch arrives (test_views.npz tells each row's task, test
    input, augmentation and view number), then counted with its confidence (sigmoid of q_halt, float64) per
    test input, answer and band of view numbers (view 0, 1, 2-3, 4-7, ...: the first k views, k a power of
    two, are whole bands), once for each of ARC_MODES, with the lowest view that gave it. 385,815 rows of
    900 tokens thus never sit in memory.
    With `pooling`, the pool also keeps the 'last' answers of every evaluation of the run so far (the
    reference's vote: its last evaluation votes over every checkpoint's answers); a checkpoint carries it
    (pool_state), so a resumed run continues it. `schedule`, the steps the run evaluates at: those up to an
    evaluation that the pool lacks (a run resumed from a checkpoint that did not pool) are named with its
    scores (pooled_missing). With `keep`, each row's 'last' answer and confidence are kept too (kept_rows):
    what solve.py --task=FILE.json shows the final evaluation's votes from, solving nothing again."""

    def __init__(self, kind, views, puzzles, pooling=False, schedule=(), keep=False):
        """kind: puzzles.ARC of the canvas; views: test_views.npz's arrays; puzzles: test_puzzles.json's."""
        self.kind, self.puzzles, self.pooling, self.schedule = kind, puzzles, pooling, sorted(schedule)
        self.keep = keep
        self.names = [str(t) for t in views['tasks']]
        self.task, self.test_index = np.asarray(views['task']), np.asarray(views['test_index'])
        self.dihedral, self.colours = np.asarray(views['dihedral']), np.asarray(views['colours'])
        self.view = np.asarray(views['view'])
        self.band = np.array([int(v).bit_length() for v in self.view], np.int64)
        self.pool, self.pool_steps = {}, []  # {(task, i): {answer: [count, confidence, view, first]}}, steps
        self.start()

    @classmethod
    def open(cls, root, kind, pooling=False, schedule=(), keep=False):
        """The votes of an ARC dataset at root (prepare_arc.py's test_views.npz and test_puzzles.json), checked
        against its test split; None for a kind whose views are not stored in its dataset (whose rows are
        scored one by one)."""
        if kind is None or not kind.stored_views:
            return None
        paths = [os.path.join(root, n) for n in ('test_views.npz', 'test_puzzles.json')]
        for p in paths:
            if not os.path.exists(p):
                raise SystemExit(f"{p} is missing: an ARC dataset's evaluation needs it; rebuild the dataset "
                                 "with prepare_arc.py")
        try:
            views = load_views(paths[0])
        except ValueError as e:
            raise SystemExit(str(e))
        try:
            puzzles = load_json(paths[1])
            # every task checked as prepare_arc.py checked it: a damaged output would fail the final evaluation's
            # scoring, after the training and before its checkpoint
            read_tasks(puzzles, paths[1], kind.n, unsolved=True)
            split = load_arrays(root, 'test')
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read the ARC test views of {root}: {e}; rebuild the dataset with prepare_arc.py")
        if problem := stored_views_problem(views, puzzles, split, kind, os.path.join(root, 'test')):
            raise SystemExit(f"{paths[0]} {problem}: it is not this test split's (another build's, or one stopped "
                             "between its renames); rebuild the dataset with prepare_arc.py")
        return cls(kind, views, puzzles, pooling, schedule, keep)

    def start(self, rows=None):
        """Forget the answers; the tasks scored from now on are those of the test split's `rows` (None: all)."""
        tasks = np.unique(self.task[rows]) if rows is not None else range(len(self.names))
        self.scored = [self.names[t] for t in tasks]
        self.tally = {m: {} for m in ARC_MODES}
        self.kept = {}  # with keep: {row: (its 'last' answer's tokens, its confidence)}

    def answer(self, row, tokens):
        """Row `row`'s answer tokens [L], cropped and mapped back to its task: answer_key's bytes."""
        return answer_key(self.kind.unaugment(self.kind.crop(tokens), self.dihedral[row], self.colours[row]))

    def add(self, mode, rows, answers, confidence):
        """One batch: rows [B] the test split's row of each answer (< 0: padding, skipped), answers [B, L]
        tokens, confidence [B] in [0, 1] (float64)."""
        tally = self.tally[mode]
        confidence = np.asarray(confidence, np.float64)
        units = [int(u) for u in np.rint(np.ldexp(confidence, CONFIDENCE_BITS))]  # Python ints: no overflow
        for r, a, c, f in zip(np.asarray(rows).tolist(), answers, units, confidence):
            if r < 0:
                continue
            if self.keep and mode == 'last':
                self.kept[r] = (a, f)
            per = tally.setdefault((self.names[self.task[r]], int(self.test_index[r]), int(self.band[r])), {})
            key, view = self.answer(r, a), int(self.view[r])
            e = per.get(key)
            if e is None:
                per[key] = [1, c, view]
            else:
                e[0], e[1], e[2] = e[0] + 1, e[1] + c, min(e[2], view)

    def read(self, dev, preds_all, q_all, first, rows, flat):
        """One batch of evaluate(): every rank's answers and q_halt logits after the last step and at q_halt's
        stop, gathered to every rank and read with `flat` (the batch's sums) in its one graph and read, then
        counted (rows: the global batch's, as the loader gives them). Returns flat's host copy."""
        at_stop, q_stop = at_first(preds_all, q_all, first)
        parts = [preds_all[-1].to(torch.uint8), q_all[-1].float(), at_stop.to(torch.uint8), q_stop.float()]
        a_last, q_last, a_stop, q_at_stop, got = dev.read([dev.all_gather(t) for t in parts] + [flat])
        self.add('last', rows, a_last, confidence(q_last))
        self.add('q_halt', rows, a_stop, confidence(q_at_stop))
        return got

    def kept_rows(self):
        """With keep: the rows answered (the test split's, ascending), their 'last' answers' tokens [N, L] and
        confidences [N], as add() took them; where the run pools, the pool too (pool_state's arrays, each named
        pool_<name>): the vote its submission follows, which restore() reads back."""
        rows = sorted(self.kept)
        pool = self.pool_state()['arc_pool'] if self.pooling and self.pool_steps else {}
        return dict(rows=np.array(rows, np.int64), confidence=np.array([self.kept[r][1] for r in rows], np.float64),
                    answers=np.array([self.kept[r][0] for r in rows], np.uint8).reshape(len(rows), -1),
                    **{f'pool_{k}': np.asarray(v) for k, v in pool.items()})

    def votes(self, mode, views=None):
        """{(task id, test index): {answer: (count, summed confidence)}} over the rows whose view number is below
        `views` (a power of two; None: every row); mode 'pooled': the pool's. Each test input's answers are
        listed lowest view first (in the pool: then the earliest evaluation), rank_answers' order of ties."""
        if mode == 'pooled':
            parts = self.pool.items()
        else:
            parts = (((task, i), per) for (task, i, band), per in self.tally[mode].items()
                     if views is None or (1 << band) <= views)
        merged = {}
        for ti, per in parts:
            into = merged.setdefault(ti, {})
            for a, (c, s, v, *first) in per.items():
                e = into.get(a)
                into[a] = [c, s, v, *first] if e is None else [e[0] + c, e[1] + s, min(e[2], v), *e[3:]]
        return {ti: {a: (per[a][0], per[a][1] / CONFIDENCE_ONE)
                     for a in sorted(per, key=lambda a: (per[a][2:], a))} for ti, per in merged.items()}

    def pool_in(self, step):
        """The 'last' answers of the evaluation just finished into the pool, as that of checkpoint `step`; a
        step already pooled (evaluated again at a run's end) is not counted twice."""
        if step in self.pool_steps:
            return
        first = len(self.pool_steps)
        for (task, i, _), per in self.tally['last'].items():
            into = self.pool.setdefault((task, i), {})
            for a, (c, s, v) in per.items():
                e = into.get(a)
                into[a] = [c, s, v, first] if e is None else [e[0] + c, e[1] + s, min(e[2], v), e[3]]
        self.pool_steps.append(step)

    def score(self, pooled=False):
        """score_arc of both modes over the tasks scored, the ranks left out, and the nested curve: pass@1 and
        pass@2 over the first k views, k = 1, 2, 4, ... and every view; with `pooled`, the pool's too."""
        puzzles = {t: self.puzzles[t] for t in self.scored}
        out = {}
        for mode in ARC_MODES + (('pooled',) if pooled else ()):
            out[mode] = {k: v for k, v in score_arc(puzzles, self.votes(mode)).items() if k != 'ranks'}
        curve = []
        for k in view_counts(out['last']['views']):
            row = dict(views=k)
            for mode in ARC_MODES:
                s = score_arc(puzzles, self.votes(mode, None if k == out['last']['views'] else k), ks=(1, 2))
                suffix = '' if mode == 'last' else '_' + mode
                row.update({f'{p}pass@{j}{suffix}': s[f'{p}pass@{j}'] for p in ('', 'outputs_') for j in (1, 2)})
            curve.append(row)
        out['by_views'] = curve
        if pooled:
            out['pooled_steps'] = list(self.pool_steps)
            out['pooled_missing'] = self.missing()
        return out

    def missing(self):
        """The steps of the run's schedule, up to its newest pooled evaluation, whose answers the pool lacks."""
        last = max(self.pool_steps, default=-1)
        return [s for s in self.schedule if s <= last and s not in self.pool_steps]

    def results(self, pool_at=None):
        """evaluate()'s entries: 'arc' (score()) and the flat ones that the logs, results.json, W&B,
        TensorBoard and a study's report read: arc_pass@K (per task, the reference's) and arc_prize_pass@K (per
        test output, the ARC Prize's), K = 1, 2, with their intervals, arc_pass@K_q_halt, arc_tasks,
        arc_test_outputs and arc_unscored. pool_at: this evaluation is checkpoint pool_at's: with pooling, its
        answers join the pool, and the pool's scores come as arc_pooled_pass@K and arc_pooled_prize_pass@K."""
        pooled = self.pooling and pool_at is not None
        if pooled:
            self.pool_in(pool_at)
        score = self.score(pooled)
        out = {}
        for name, s in (('arc_', score['last']),) + ((('arc_pooled_', score['pooled']),) if pooled else ()):
            for k in (1, 2):
                for own, theirs in ((f'{name}pass@{k}', f'pass@{k}'), (f'{name}prize_pass@{k}', f'outputs_pass@{k}')):
                    out.update({own + c: s[theirs + c] for c in ('', '_ci_low', '_ci_high')})
        out.update({f'arc_{k}_q_halt': score['q_halt'][k] for k in ('pass@1', 'pass@2')})
        last = score['last']
        out.update(arc_tasks=last['tasks'], arc_test_outputs=last['test_outputs'], arc_unscored=last['unscored'])
        if pooled:
            out['arc_pooled_evaluations'] = len(self.pool_steps)
        return dict(out, arc=score)

    def submission(self):
        """arc_submission of the tasks scored, by the pooled vote where the run pools (submission_vote)."""
        mode = 'pooled' if self.pooling and self.pool_steps else 'last'
        return arc_submission({t: self.puzzles[t] for t in self.scored}, self.votes(mode))

    def submission_vote(self):
        """Which vote submission() follows, in words (results.json and an evaluation's record keep it)."""
        if self.pooling and self.pool_steps:
            missing = self.missing()
            lacks = f" (missing: step{'s' * (len(missing) > 1)} {', '.join(map(str, missing))})" if missing else ''
            return f"pooled over the evaluations at steps {', '.join(map(str, self.pool_steps))}{lacks}"
        return 'this checkpoint'

    # --- the pool in a checkpoint: one entry per test input and distinct answer, in flat arrays ---

    def pool_state(self):
        """{'arc_pool': the pool} for a checkpoint ({} without pooling): the answers' bytes end to end (zlib:
        grids of few colours shrink many times) and, per entry, its test input, its answer's length, votes,
        summed confidence (three int64 columns of LIMB bits), lowest view and first evaluation: 44 bytes and the
        answer's h x w + 2 bytes compressed per distinct answer of a test input."""
        if not self.pooling:
            return {}
        inputs = list(self.pool)
        entries = [(j, a, *e) for j, ti in enumerate(inputs) for a, e in self.pool[ti].items()]
        j, answers, count, total, view, first = zip(*entries) if entries else [()] * 6
        column = lambda values, dtype=np.int32: torch.from_numpy(np.array(values, dtype).reshape(-1))
        blob = zlib.compress(b''.join(answers), 1)
        return {'arc_pool': dict(
            steps=list(self.pool_steps), tasks=[t for t, _ in inputs],
            test_index=column([i for _, i in inputs]), input=column(j), length=column(list(map(len, answers))),
            answers=torch.from_numpy(np.frombuffer(blob, np.uint8).copy()), count=column(count),
            **{f'confidence{i}': column([(t >> (LIMB * i)) & ((1 << LIMB) - 1) if i < 2 else t >> (LIMB * i)
                                         for t in total], np.int64) for i in range(3)},
            view=column(view), first=column(first))}

    def restore(self, state):
        """The pool a checkpoint carried (pool_state's 'arc_pool', or kept_rows' numpy copy of it; None: none), with
        pooling on; one with the columns 'high' and 'low' (summed in units of 2^-53) is read in its unit."""
        if not self.pooling or not state:
            return
        inputs = list(zip(map(str, state['tasks']), state['test_index'].tolist()))
        blob = zlib.decompress(np.asarray(state['answers']).tobytes())
        ends = np.cumsum(np.asarray(state['length'])).tolist()
        self.pool, self.pool_steps = {}, list(map(int, state['steps']))
        if 'confidence0' in state:
            limbs = [state[f'confidence{i}'].tolist() for i in range(3)]
            total = [sum(x << (LIMB * i) for i, x in enumerate(t)) for t in zip(*limbs)]
        else:
            old = zip(state['high'].tolist(), state['low'].tolist())
            total = [((high << 32) | low) << (CONFIDENCE_BITS - POOL_V1_BITS) for high, low in old]
        columns = zip(*(state[k].tolist() for k in ('input', 'count', 'view', 'first')), total)
        for start, end, (j, c, v, f, t) in zip([0] + ends, ends, columns):
            self.pool.setdefault(inputs[j], {})[blob[start:end]] = [c, t, v, f]


def stored_views_problem(views, puzzles, split, kind, where):
    """What makes test_views.npz (views) not that of the test split at `where` (split: its arrays) and of
    test_puzzles.json (puzzles), in words that follow the file's name; None when it fits: a row per split row,
    a task per group (row by row the group's), tasks and test inputs that test_puzzles.json holds, and each
    task's first row its test input once mapped back."""
    need = ('tasks', 'task', 'test_index', 'dihedral', 'colours', 'view')
    if [k for k in need if k not in views]:
        return f"lacks {', '.join(k for k in need if k not in views)}"
    n, rows = len(split['inputs']), {len(views[k]) for k in need[1:]}
    if rows != {n}:
        return f"holds {' or '.join(map(str, sorted(rows)))} rows, but {where} holds {n}"
    starts = np.asarray(split['puzzle_indices'])[np.asarray(split['group_indices'])]
    if len(views['tasks']) != len(starts) - 1:
        return f"names {len(views['tasks'])} tasks, but {where} holds {len(starts) - 1} groups"
    if not np.array_equal(views['task'], np.repeat(np.arange(len(starts) - 1), np.diff(starts))):
        return f"gives rows other tasks than {where}'s groups hold"
    missing = [str(t) for t in views['tasks'] if str(t) not in puzzles]
    if missing:
        return f"names tasks that test_puzzles.json lacks ({', '.join(missing[:3])})"
    counts = np.array([len(puzzles[str(t)]['test']) for t in views['tasks']])
    if (views['test_index'] >= counts[views['task']]).any():
        return "names test inputs that test_puzzles.json lacks"
    for g, r in enumerate(starts[:-1].tolist()):
        t = str(views['tasks'][g])
        i = int(views['test_index'][r])
        grid = kind.unaugment(kind.crop(np.asarray(split['inputs'][r])), views['dihedral'][r], views['colours'][r])
        if answer_key(grid) != answer_key(np.asarray(puzzles[t]['test'][i]['input'], np.uint8)):
            return f"maps row {r} of {where} to task {t}'s test input {i + 1}, which is another grid"
    return None
