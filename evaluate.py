"""
One evaluation pass on every device (CPU, CUDA, XLA): `evaluate` runs each batch for a fixed number of
supervision steps from fresh latents and sums the metrics over all ranks; with test-time views it scores the
views' votes and the verifier's choice (`score_views`), and reports the exact accuracy with its Wilson
interval. train.py, bench.py and solve.py share it, so each measures the same thing. An ARC dataset's test rows are
its tasks' stored views: `ARCVotes` keeps every row's answer, mapped back to its task, and scores the vote per
test input (pass@K, `score_arc`) and writes the ARC Prize submission.

Everything on the device follows the rules that keep XLA (TPU) from recompiling: one fixed graph per batch,
the same reads on every rank, the batch's sums added up on the host.
"""
import json
import math
import os

import numpy as np
import torch

from data import IGNORE_LABEL_ID
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


def rank_answers(tally):
    """{answer: (count, summed confidence)} of one test input -> its answers, best first: by count, then by mean
    confidence (then by the answer's bytes, so equal keys order the same on every rank)."""
    return sorted(tally, key=lambda a: (-tally[a][0], -tally[a][1] / tally[a][0], a))


def score_arc(puzzles, votes, ks=PASS_AT):
    """The vote's score over the tasks of `puzzles` ({task id: task}, test_puzzles.json's, the test outputs
    inside), from votes {(task id, test index): {answer_key: (count, summed confidence)}}. A test input passes
    at K when its output is among the K best-ranked answers (rank_answers); one without votes fails. pass@K
    averages over tasks, a task scoring the share of its test inputs that pass (the reference's score), with
    the Wilson interval over tasks; outputs_pass@K counts every test output once. K runs over ks up to the
    most views a test input had (1 and 2 always). ranks: per task, each test input's rank of its output (0:
    not among the answers)."""
    ranks, views = {}, 1
    for task_id, task in puzzles.items():
        ranks[task_id] = []
        for i, pair in enumerate(task['test']):
            tally = votes.get((task_id, i), {})
            views = max(views, sum(c for c, _ in tally.values()))
            order = rank_answers(tally)
            right = answer_key(np.asarray(pair['output'], np.uint8))
            ranks[task_id].append(order.index(right) + 1 if right in order else 0)
    ks = [k for k in ks if k <= max(2, views)]
    T, outputs = len(ranks), [r for rs in ranks.values() for r in rs]
    out = dict(tasks=T, test_outputs=len(outputs), views=views,
               answered=sum(len(votes.get((t, i), {})) > 0 for t, rs in ranks.items() for i in range(len(rs))))
    for k in ks:
        per_task = sum(np.mean([0 < r <= k for r in rs]) for rs in ranks.values())
        out[f'pass@{k}'] = float(per_task) / max(T, 1)
        out[f'outputs_pass@{k}'] = sum(0 < r <= k for r in outputs) / max(len(outputs), 1)
        if k in (1, 2):
            out[f'pass@{k}_ci_low'], out[f'pass@{k}_ci_high'] = wilson_interval(float(per_task), T)
    out['ranks'] = ranks
    return out


def arc_submission(puzzles, votes):
    """The ARC Prize submission: {task id: [{'attempt_1': grid, 'attempt_2': grid}, one per test input in
    order]}, the vote's two best answers; a lone answer is both attempts (as the reference writes it), a test
    input without votes gets [[0]] for both."""
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
    input, augmentation and view number), then counted with its confidence (sigmoid of q_halt) per test
    input, answer and band of view numbers (view 0, 1, 2-3, 4-7, ...: the first k views, k a power of two,
    are whole bands), once for each of ARC_MODES. 385,815 rows of 900 tokens thus never sit in memory."""

    def __init__(self, kind, views, puzzles):
        """kind: puzzles.ARC of the canvas; views: test_views.npz's arrays; puzzles: test_puzzles.json's."""
        self.kind, self.puzzles = kind, puzzles
        self.names = [str(t) for t in views['tasks']]
        self.task, self.test_index = np.asarray(views['task']), np.asarray(views['test_index'])
        self.dihedral, self.colours = np.asarray(views['dihedral']), np.asarray(views['colours'])
        self.view = np.asarray(views['view'])
        self.band = np.array([int(v).bit_length() for v in self.view], np.int64)
        self.start()

    @classmethod
    def open(cls, root, kind):
        """The votes of an ARC dataset at root (prepare_arc.py's test_views.npz and test_puzzles.json); None for
        a kind whose views are not stored in its dataset (whose rows are scored one by one)."""
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
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read the ARC test views of {root}: {e}")
        missing = [t for t in views.get('tasks', []) if str(t) not in puzzles]
        if 'tasks' not in views or missing:
            raise SystemExit(f"{paths[0]} does not match {paths[1]} (tasks {missing[:3]} missing): rebuild the "
                             "dataset with prepare_arc.py")
        return cls(kind, views, puzzles)

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
        tokens, confidence [B] in (0, 1)."""
        tally = self.tally[mode]
        for r, a, c in zip(np.asarray(rows).tolist(), answers, np.asarray(confidence, np.float64).tolist()):
            if r < 0:
                continue
            per = tally.setdefault((self.names[self.task[r]], int(self.test_index[r]), int(self.band[r])), {})
            key = self.answer(r, a)
            count, total = per.get(key, (0, 0.0))
            per[key] = (count + 1, total + c)

    def read(self, dev, preds_all, q_all, first, rows, flat):
        """One batch of evaluate(): every rank's answers after the last step and at q_halt's stop, gathered to
        every rank and read with `flat` (the batch's sums) in its one graph and read, then counted (rows: the
        global batch's, as the loader gives them). Returns flat's host copy."""
        at_stop, q_stop = at_first(preds_all, q_all, first)
        parts = [preds_all[-1].to(torch.uint8), torch.sigmoid(q_all[-1].float()), at_stop.to(torch.uint8),
                 torch.sigmoid(q_stop.float())]
        a_last, c_last, a_stop, c_stop, got = dev.read([dev.all_gather(t) for t in parts] + [flat])
        self.add('last', rows, a_last, c_last)
        self.add('q_halt', rows, a_stop, c_stop)
        return got

    def votes(self, mode, views=None):
        """{(task id, test index): {answer: (count, summed confidence)}} over the rows whose view number is below
        `views` (a power of two; None: every row)."""
        out = {}
        for (task, i, band), per in self.tally[mode].items():
            if views is not None and (1 << band) > views:
                continue
            merged = out.setdefault((task, i), {})
            for a, (c, s) in per.items():
                c0, s0 = merged.get(a, (0, 0.0))
                merged[a] = (c0 + c, s0 + s)
        return out

    def score(self):
        """score_arc of both modes over the tasks scored, the ranks left out, and the nested curve: pass@1 and
        pass@2 over the first k views, k = 1, 2, 4, ... and every view."""
        puzzles = {t: self.puzzles[t] for t in self.scored}
        out = {}
        for mode in ARC_MODES:
            out[mode] = {k: v for k, v in score_arc(puzzles, self.votes(mode)).items() if k != 'ranks'}
        curve = []
        for k in view_counts(out['last']['views']):
            row = dict(views=k)
            for mode in ARC_MODES:
                s = score_arc(puzzles, self.votes(mode, None if k == out['last']['views'] else k), ks=(1, 2))
                suffix = '' if mode == 'last' else '_' + mode
                row.update({f'pass@1{suffix}': s['pass@1'], f'pass@2{suffix}': s['pass@2']})
            curve.append(row)
        out['by_views'] = curve
        return out

    def results(self):
        """evaluate()'s entries: 'arc' (score()) and the flat arc_pass@1, arc_pass@2 (with their intervals, and
        at q_halt's stop) and arc_tasks that the logs, results.json and a study's report read."""
        score = self.score()
        last = score['last']
        out = {f'arc_pass@{k}{s}': last[f'pass@{k}{s}'] for k in (1, 2) for s in ('', '_ci_low', '_ci_high')}
        out.update({f'arc_{k}_q_halt': score['q_halt'][k] for k in ('pass@1', 'pass@2')})
        return dict(out, arc=score, arc_tasks=last['tasks'])

    def submission(self, mode='last'):
        """arc_submission of the tasks scored."""
        return arc_submission({t: self.puzzles[t] for t in self.scored}, self.votes(mode))


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
             should_stop=None, progress=None, arc=None):
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
    arc: the loader's dataset's ARCVotes, which count every row's answer (ARCVotes.read) and score the vote."""
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
        out = predict(b, n_steps, loss_at=h, should_stop=should_stop, chunk=halt_max_steps, progress=progress)
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
        res.update(arc.results())
    if K > 1:
        names = sorted(by_views)
        res['by_views'] = [dict(views=k, **{m: float(s['views_' + m][j]) / max(n, 1) for m in names})
                           for j, k in enumerate(ks)]
    model.train(was_training)
    return res, example


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
    if 'arc' in r:  # ARC's vote over the stored views
        a = r['arc']['last']
        line += (f"\n  ARC {a['tasks']} tasks ({a['test_outputs']} test outputs, {a['views']} views): "
                 + ' | '.join(f"pass@{k} {a[f'pass@{k}']:.4f} (95% CI {a[f'pass@{k}_ci_low']:.4f}-"
                              f"{a[f'pass@{k}_ci_high']:.4f})" for k in (1, 2))
                 + f" | with q_halt stop: pass@1 {r['arc']['q_halt']['pass@1']:.4f} pass@2 "
                 f"{r['arc']['q_halt']['pass@2']:.4f} | pass@2 by views: "
                 + ' '.join(f"{v['views']}:{v['pass@2']:.3f}" for v in r['arc']['by_views']))
    for v in r.get('by_views', []):  # test-time views: one line per view count
        line += (f"\n  {v['views']:>2} views: vote {v['vote']:.4f} | verified {v['verified']:.4f} | oracle "
                 f"{v['oracle']:.4f} (ceiling)" + (f" | accepted {v['accepted']:.4f}" if 'accepted' in v else '')
                 + f" | with q_halt stop: vote {v['vote_q_halt']:.4f} verified {v['verified_q_halt']:.4f}")
    return line
