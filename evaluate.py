"""
One evaluation pass on every device (CPU, CUDA, XLA): `evaluate` runs each batch for a fixed number of
supervision steps from fresh latents and sums the metrics over all ranks; with test-time views it scores the
views' votes and the verifier's choice (`score_views`), and reports the exact accuracy with its Wilson
interval. train.py, bench.py and solve.py share it, so each measures the same thing. An ARC dataset's test rows are
its tasks' stored views: `ARCVotes` keeps every row's answer, mapped back to its task, scores the vote per test
input (`score_arc`: pass@K per test output, the ARC Prize's score, and per task, the reference's), pools it over
a run's evaluations where asked, and writes the ARC Prize submission.

Everything on the device follows the rules that keep XLA (TPU) from recompiling: one fixed graph per batch,
the same reads on every rank, the batch's sums added up on the host.
"""
import json
import math
import os
import zlib

import numpy as np
import torch

from data import IGNORE_LABEL_ID, load_arrays
from puzzles import Grid, vote

def wilson_interval(k, n, z=1.96):
    """95% confidence interval of an accuracy k/n (Wilson: sane at 0 and 1 and for small n)."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at k = 0 or n the bound is 0 or 1 up to rounding
    return max(0.0, centre - half), min(1.0, centre + half)


def view_counts(ks):
    """The view counts a K-view evaluation reports: the powers of two up to K, and K."""
    return sorted({2 ** i for i in range(ks.bit_length()) if 2 ** i <= ks} | {ks})


def score_views(answers, confidence, inverse, inputs, labels, rows, verifier, ks):
    """One batch's counts over its K views: answers [K*B, L] and confidence [K*B] as the model gave them
    (view-major), inverse the views' inverse symmetries, inputs/labels/rows [B] the puzzles themselves. Returns
    ({name: [len(ks)] counts}, [(vote, choice)] the views picked for each k): for the first k views of each k
    in ks, the vote's answer right (vote), the verifier's choice right (verified: an answer the verifier
    accepts where a view found one, else the vote; the verifier reads the puzzle only, never the labels), any
    view right (oracle: the ceiling) and some view accepted (accepted)."""
    B, L = labels.shape
    K = len(answers) // B
    back = Grid.apply(answers, inverse).reshape(K, B, L)  # every view's answer, on its puzzle
    conf = np.asarray(confidence).reshape(K, B)
    right = ((back == labels) | (labels < 0)).all(-1) & rows  # [K, B]
    ok = (np.asarray(verifier(np.tile(inputs, (K, 1)), back.reshape(K * B, L))).reshape(K, B) & rows
          if verifier is not None else None)
    out = {n: np.zeros(len(ks)) for n in ('vote', 'verified', 'oracle') + (('accepted',) if ok is not None else ())}
    cols, picks = np.arange(B), []
    for j, k in enumerate(ks):
        picked, choice, _ = vote(back[:k], conf[:k], None if ok is None else ok[:k])
        picks.append((picked, choice))
        out['vote'][j] = right[picked, cols].sum()
        out['verified'][j] = right[choice, cols].sum()
        out['oracle'][j] = right[:k].any(0).sum()
        if ok is not None:
            out['accepted'][j] = ok[:k].any(0).sum()
    return out, picks


def at_first(preds_all, q_all, first):
    """Each row's answer [B, L] and q_halt [B] at its step first [B] (where q_halt first said stop), from every
    step's preds_all [S, B, L] and q_all [S, B]."""
    return (preds_all.gather(0, first[None, :, None].expand(1, *preds_all.shape[1:]))[0],
            q_all.gather(0, first[None])[0])


# -----------------------------------------------------------------------------
# ARC: the vote over a task's stored views, pass@K and the submission

PASS_AT = (1, 2, 5, 10, 100, 1000)  # the reference's K of pass@K (capped at the views a test input has)
ARC_MODES = ('last', 'q_halt')      # the answer after the last step; where q_halt first said stop
CONFIDENCE_ONE = 2 ** 53            # a confidence is counted in units of 2^-53 (float64's step below 1):
                                    # integers, so their sums are exact, whatever the order they come in


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
    scores (pooled_missing)."""

    def __init__(self, kind, views, puzzles, pooling=False, schedule=()):
        """kind: puzzles.ARC of the canvas; views: test_views.npz's arrays; puzzles: test_puzzles.json's."""
        self.kind, self.puzzles, self.pooling, self.schedule = kind, puzzles, pooling, sorted(schedule)
        self.names = [str(t) for t in views['tasks']]
        self.task, self.test_index = np.asarray(views['task']), np.asarray(views['test_index'])
        self.dihedral, self.colours = np.asarray(views['dihedral']), np.asarray(views['colours'])
        self.view = np.asarray(views['view'])
        self.band = np.array([int(v).bit_length() for v in self.view], np.int64)
        self.pool, self.pool_steps = {}, []  # {(task, i): {answer: [count, confidence, view, first]}}, steps
        self.start()

    @classmethod
    def open(cls, root, kind, pooling=False, schedule=()):
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
            with np.load(paths[0]) as f:
                views = {k: f[k] for k in f.files}
            with open(paths[1]) as f:
                puzzles = json.load(f)
            split = load_arrays(root, 'test')
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read the ARC test views of {root}: {e}")
        if problem := views_problem(views, puzzles, split, kind, os.path.join(root, 'test')):
            raise SystemExit(f"{paths[0]} {problem}: it is not this test split's (another build's, or one stopped "
                             "between its renames); rebuild the dataset with prepare_arc.py")
        return cls(kind, views, puzzles, pooling, schedule)

    def start(self, rows=None):
        """Forget the answers; the tasks scored from now on are those of the test split's `rows` (None: all)."""
        tasks = np.unique(self.task[rows]) if rows is not None else range(len(self.names))
        self.scored = [self.names[t] for t in tasks]
        self.tally = {m: {} for m in ARC_MODES}

    def answer(self, row, tokens):
        """Row `row`'s answer tokens [L], cropped and mapped back to its task: answer_key's bytes."""
        return answer_key(self.kind.unaugment(self.kind.crop(tokens), self.dihedral[row], self.colours[row]))

    def add(self, mode, rows, answers, confidence):
        """One batch: rows [B] the test split's row of each answer (< 0: padding, skipped), answers [B, L]
        tokens, confidence [B] in [0, 1] (float64)."""
        tally = self.tally[mode]
        units = np.rint(np.asarray(confidence, np.float64) * CONFIDENCE_ONE).astype(np.int64).tolist()
        for r, a, c in zip(np.asarray(rows).tolist(), answers, units):
            if r < 0:
                continue
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
        summed confidence (two int64 halves), lowest view and first evaluation: 36 bytes and the answer's
        h x w + 2 bytes compressed per distinct answer of a test input."""
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
            high=column([t >> 32 for t in total], np.int64), low=column([t & 0xFFFFFFFF for t in total], np.int64),
            view=column(view), first=column(first))}

    def restore(self, state):
        """The pool a checkpoint carried (pool_state's 'arc_pool'; None: none), with pooling on."""
        if not self.pooling or not state:
            return
        inputs = list(zip(state['tasks'], state['test_index'].tolist()))
        blob = zlib.decompress(state['answers'].numpy().tobytes())
        ends = np.cumsum(state['length'].numpy()).tolist()
        self.pool, self.pool_steps = {}, list(state['steps'])
        columns = zip(*(state[k].tolist() for k in ('input', 'count', 'high', 'low', 'view', 'first')))
        for start, end, (j, c, high, low, v, f) in zip([0] + ends, ends, columns):
            self.pool.setdefault(inputs[j], {})[blob[start:end]] = [c, (high << 32) | low, v, f]


def views_problem(views, puzzles, split, kind, where):
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


def batch_sums(preds, q_halt, row_loss, first, labels, valid, h):
    """One batch's metric sums on the device (evaluate's): preds [S, B, L] and q_halt [S, B] at every step,
    row_loss [B] at step h, first [B] the step where q_halt stopped each row, labels [B, L], valid [B]."""
    valid_tok = labels != IGNORE_LABEL_ID
    n_valid = valid_tok.sum(-1)
    rows = (valid & (n_valid > 0)).float()
    tok_ok = (preds == labels) & valid_tok
    seq_ok = tok_ok.sum(-1) == n_valid  # [S, B]
    return dict(
        count=rows.sum(),
        exact_per_step=(seq_ok.float() * rows).sum(-1),
        token_accuracy=((tok_ok.sum(-1)[h].float() / n_valid.clamp_min(1)) * rows).sum(),
        q_halt_accuracy=(((q_halt[h] >= 0) == seq_ok[h]).float() * rows).sum(),
        exact_q_halt=(seq_ok.gather(0, first[None])[0].float() * rows).sum(),
        steps_q_halt=((first + 1).float() * rows).sum(),
        lm_loss=(row_loss * rows).sum(),  # at halt_max_steps; with q_halt's as the training's loss
        loss=((row_loss + 0.5 * torch.nn.functional.binary_cross_entropy_with_logits(
            q_halt[h].float(), seq_ok[h].float(), reduction='none')) * rows).sum(),
    )


@torch.no_grad()
def evaluate(model, loader, dev, n_steps, halt_max_steps, verifier=None, show_example=False, predict=None,
             should_stop=None, progress=None, arc=None, arc_pool_at=None):
    """Runs every batch for n_steps supervision steps (one fixed graph per batch) and reports the metrics
    at halt_max_steps, the exact accuracy at every step count, and with q_halt early stopping. Every rank
    runs the same batches count and the same reads (dev.read), so the ranks' graphs stay identical.
    A loader with views K > 1 gives each batch in K views (one batch of K x the rows): the metrics above are
    view 0's (the puzzles as they are), and by_views holds vote@k, verified@k, oracle@k (and accepted@k)
    for each k of view_counts(K), after the last of the n_steps (test-time depth counts: views x steps) and
    with q_halt's stop (each view's answer where it stopped).
    should_stop: asked before every batch, and within one after every halt_max_steps supervision steps
    (test-time scaling runs thousands), on every rank (a verdict the ranks agree on, so all stop at the same
    point; the steps keep their one graph each); when it says stop, the evaluation is abandoned and (None,
    None) returned. progress(i): told after every supervision step of a batch (a watchdog's heartbeat).
    arc: the loader's dataset's ARCVotes, which count every row's answer (ARCVotes.read) and score the vote;
    arc_pool_at: the step of the checkpoint evaluated, whose answers join a pooling run's pool (None: not)."""
    predict = predict or model.predict
    K = getattr(loader, 'views', 1)
    ks = view_counts(K)
    was_training = model.training
    model.eval()
    h = min(halt_max_steps, n_steps) - 1
    sums, example, verified, by_views = {}, None, 0, {}
    if arc is not None:
        arc.start(loader.example_idx)
    for batch in loader:
        if should_stop is not None and should_stop():
            model.train(was_training)
            return None, None
        inverse = batch.pop('views_inverse', None)
        rows_index = batch.pop('example_index', None)
        b = dev.to_device(batch)
        out = predict(b, n_steps, loss_at=h, should_stop=should_stop, chunk=halt_max_steps,
                      on_step=progress and (lambda i, pred, q_halt: progress(i + 1)))
        if out is None:
            model.train(was_training)
            return None, None
        preds_all, q_all, loss_all = out  # [S, K*B, L], [S, K*B], [K*B]
        halt = torch.cat([q_all[:-1] > 0,
                          torch.ones_like(q_all[-1:], dtype=torch.bool)])  # the last step always stops
        first_all = halt.int().argmax(0)  # the first step whose q_halt says stop
        B = preds_all.shape[1] // K  # view 0's rows: the puzzles as they are
        preds, q_halt, row_loss, first = preds_all[:, :B], q_all[:, :B], loss_all[:B], first_all[:B]
        part = batch_sums(preds, q_halt, row_loss, first, b['labels'][:B], b['valid'][:B], h)
        # read with the batch's answers, in its one graph, and added up on the host: summed on the device, the
        # first batch's sums and the later ones' would be different graphs (a compilation at the second batch)
        keys = sorted(part)
        flat_part = torch.cat([part[k].reshape(-1).float() for k in keys])
        inp, v = batch['inputs'][:B], batch['valid'][:B]
        if K > 1:  # every view's answer after the last step and where q_halt stopped it: one graph, one read
            at_stop, q_stop = at_first(preds_all, q_all, first_all)
            p_all, c_all, p_stop, c_stop, p, got = dev.read([preds_all[-1], q_all[-1], at_stop, q_stop, preds[h],
                                                             flat_part])
            hrows = v & ((batch['labels'][:B] != IGNORE_LABEL_ID).sum(-1) > 0)
            for suffix, answers, conf in (('', p_all, c_all), ('_q_halt', p_stop, c_stop)):
                counts, _ = score_views(answers, conf, inverse, inp, batch['labels'][:B], hrows, verifier, ks)
                for name, c in counts.items():
                    by_views[name + suffix] = by_views.get(name + suffix, 0) + c
        elif arc is not None:
            got = arc.read(dev, preds_all, q_all, first_all, rows_index, flat_part)
        elif verifier is not None:
            p, got = dev.read([preds[h], flat_part])  # one graph per batch, then a plain transfer
        else:
            got, = dev.read([flat_part])
        for k, x in zip(keys, np.split(got.astype(np.float64), np.cumsum([part[k].numel() for k in keys])[:-1])):
            sums[k] = sums.get(k, 0) + x
        if verifier is not None:
            ok = np.asarray(verifier(inp, p)) & v
            verified += int(ok.sum())
            if show_example and example is None and v.any():
                i = int(np.argmax(v))
                example = (inp[i], p[i], bool(ok[i]))
    sums['verified'] = np.array([float(verified)])
    sums.update({'views_' + name: np.asarray(c) for name, c in by_views.items()})
    keys = sorted(sums)
    # a host copy, so a graph input: torch.full makes 0 and 1 XLA constants, and a rank verifying 0 or 1
    # examples would run another graph than one verifying more (tests/test_pod.py); one reduction, one transfer
    flat = torch.tensor(np.concatenate([np.ravel(sums[k]) for k in keys]).astype(np.float32), device=dev.device)
    dev.all_reduce_sum_([flat])
    host = np.split(dev.read([flat])[0], np.cumsum([np.size(sums[k]) for k in keys])[:-1])
    s = dict(zip(keys, host))
    n = float(s['count'][0])
    exact_k = float(s['exact_per_step'][h])  # plain floats: results go into checkpoints and JSON
    lo, hi = wilson_interval(exact_k, n)
    res = dict(count=n, loss=float(s['loss'][0]) / max(n, 1), lm_loss=float(s['lm_loss'][0]) / max(n, 1),
               exact_accuracy=exact_k / max(n, 1), exact_ci_low=lo, exact_ci_high=hi,
               token_accuracy=float(s['token_accuracy'][0]) / max(n, 1),
               q_halt_accuracy=float(s['q_halt_accuracy'][0]) / max(n, 1), steps=float(h + 1),
               exact_accuracy_q_halt=float(s['exact_q_halt'][0]) / max(n, 1),
               steps_q_halt=float(s['steps_q_halt'][0]) / max(n, 1),
               exact_by_steps=[float(x) / max(n, 1) for x in s['exact_per_step']])
    if verifier is not None:
        res['verified_accuracy'] = float(s['verified'][0]) / max(n, 1)
    # the cost: forward FLOPs of every step of every view of every puzzle
    res['views'] = K
    res['eval_flops'] = float(model.flops_per_example(train=False)) * n_steps * K * n
    if arc is not None:
        res.update(arc.results(arc_pool_at))
    if K > 1:
        names = sorted(by_views)
        res['by_views'] = [dict(views=k, **{m: float(s['views_' + m][j]) / max(n, 1) for m in names})
                           for j, k in enumerate(ks)]
    model.train(was_training)
    return res, example


def arc_scores(s):
    """score_arc's s in words: '(N test outputs, V views): ARC Prize score (per output) pass@1 .. pass@2 .. |
    per task (the reference's) pass@1 .. pass@2 ..', each with its interval; or that nothing is scored."""
    n, views = s['test_outputs'], f"{s['views']} views"
    if s['pass@1'] is None:
        return f"({n} test outputs, none with a known solution: no pass@K; all in the submission; {views})"
    unscored = f", {s['unscored']} without a known solution: not scored;" if s['unscored'] else ','
    ci = lambda m: f"{s[m]:.4f} (95% CI {s[m + '_ci_low']:.4f}-{s[m + '_ci_high']:.4f})"
    return (f"({n} test outputs{unscored} {views}): ARC Prize score (per output) pass@1 {ci('outputs_pass@1')} "
            f"pass@2 {ci('outputs_pass@2')} | per task (the reference's) pass@1 {ci('pass@1')} pass@2 "
            f"{ci('pass@2')}")


def format_eval(r):
    """An evaluation's log line (evaluate's results), with one more line per view count."""
    line = (f"eval on {int(r['count'])}: exact {r['exact_accuracy']:.4f} (95% CI {r['exact_ci_low']:.4f}-"
            f"{r['exact_ci_high']:.4f}) | token {r['token_accuracy']:.4f}"
            f" | q_halt acc {r['q_halt_accuracy']:.4f}"
            f" | steps {r['steps']:.0f}")
    if 'verified_accuracy' in r:
        line += f" | verified {r['verified_accuracy']:.4f}"
    line += f" | with q_halt stop: exact {r['exact_accuracy_q_halt']:.4f} in {r['steps_q_halt']:.2f} steps"
    if len(r['exact_by_steps']) > r['steps']:
        line += ' | exact by steps: ' + ' '.join(f"{i + 1}:{a:.3f}"
                                                 for i, a in enumerate(r['exact_by_steps']))
    if 'arc' in r:  # ARC's vote over the stored views: this checkpoint's, and pooled over the run's evaluations
        a, arc = r['arc']['last'], r['arc']
        line += f"\n  ARC {a['tasks']} tasks " + arc_scores(a)
        if a['pass@1'] is not None:
            line += (f" | with q_halt stop (per task): pass@1 {arc['q_halt']['pass@1']:.4f} pass@2 "
                     f"{arc['q_halt']['pass@2']:.4f} | pass@2 by views (per task): "
                     + ' '.join(f"{v['views']}:{v['pass@2']:.3f}" for v in arc['by_views']))
        if 'pooled' in arc:
            steps = arc['pooled_steps']
            line += (f"\n  ARC pooled over {len(steps)} evaluation{'s' * (len(steps) > 1)} (step"
                     f"{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}; " + arc_scores(arc['pooled'])[1:])
            if missing := arc.get('pooled_missing'):
                many, it = 's' * (len(missing) > 1), 'them' if len(missing) > 1 else 'it'
                line += (f"\n  ARC pooled vote misses the evaluation{many} at step{many} "
                         f"{', '.join(map(str, missing))} of this run's schedule: the checkpoint it resumed held "
                         f"no answers of {it} (--arc_pool_votes turned on at a resume, or a stop during {it} "
                         f"saved by an older trainer); its submission is pooled without {it}")
    for v in r.get('by_views', []):  # test-time views: one line per view count
        line += (f"\n  {v['views']:>2} views: vote {v['vote']:.4f} | verified {v['verified']:.4f} | oracle "
                 f"{v['oracle']:.4f} (ceiling)" + (f" | accepted {v['accepted']:.4f}" if 'accepted' in v else '')
                 + f" | with q_halt stop: vote {v['vote_q_halt']:.4f} verified {v['verified_q_halt']:.4f}")
    return line
