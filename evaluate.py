"""
One evaluation pass on every device (CPU, CUDA, XLA): `evaluate` runs each batch for a fixed number of
supervision steps from fresh latents and sums the metrics over all ranks; with test-time views it scores the
views' votes and the verifier's choice (`score_views`), and reports the exact accuracy with its Wilson
interval. train.py, bench.py and solve.py share it, so each measures the same thing. An ARC dataset's test rows are
its tasks' stored views: evaluate hands each batch's answers to arc.py's ARCVotes, which scores the vote per test
input; `format_eval` writes its scores into the evaluation's log line.

Everything on the device follows the rules that keep XLA (TPU) from recompiling: one fixed graph per batch,
the same reads on every rank, the batch's sums added up on the host.
"""
import math

import numpy as np
import torch

from data import IGNORE_LABEL_ID
from device import stops_every_step
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
    view right (oracle: the ceiling) and some view accepted (accepted). Right: the label, or with a verifier
    any answer it accepts (one-view verified_accuracy's rule; a maze has several shortest paths)."""
    B, L = labels.shape
    K = len(answers) // B
    back = Grid.apply(answers, inverse).reshape(K, B, L)  # every view's answer, on its puzzle
    conf = np.asarray(confidence).reshape(K, B)
    right = ((back == labels) | (labels < 0)).all(-1) & rows  # [K, B]
    ok = (np.asarray(verifier(np.tile(inputs, (K, 1)), back.reshape(K * B, L))).reshape(K, B) & rows
          if verifier is not None else None)
    if ok is not None:  # another valid answer is right too (a maze's other shortest path), as verified_accuracy
        right |= ok
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
    """Each row's answer [B, L] and q_halt [B] at its step first [B] (where the model first halted), from every
    step's preds_all [S, B, L] and q_all [S, B]."""
    return (preds_all.gather(0, first[None, :, None].expand(1, *preds_all.shape[1:]))[0],
            q_all.gather(0, first[None])[0])


def batch_sums(preds, q_halt, row_loss, first, labels, valid, h):
    """One batch's metric sums on the device (evaluate's): preds [S, B, L] and q_halt [S, B] at every step,
    row_loss [B] at step h, first [B] the step where the model halted each row, labels [B, L], valid [B]."""
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
        lm_loss=(row_loss * rows).sum(),
        # comparable with the training's loss: act_loss's lm and q_halt terms (no q_continue target here)
        loss=((row_loss + 0.5 * torch.nn.functional.binary_cross_entropy_with_logits(
            q_halt[h].float(), seq_ok[h].float(), reduction='none')) * rows).sum(),
    )


@torch.no_grad()
def evaluate(model, loader, dev, n_steps, halt_max_steps, verifier=None, show_example=False, predict=None,
             should_stop=None, progress=None, arc=None, arc_pool_at=None):
    """Runs every batch for n_steps supervision steps (one fixed graph per batch) and reports the metrics
    at halt_max_steps, the exact accuracy at every step count, and with the model's early stop (the 'q_halt
    stop': model.halts, the rule it was trained to halt by). Every rank runs the same batches count and the same
    reads (dev.read), so the ranks' graphs stay identical.
    A loader with views K > 1 gives each batch in K views (one batch of K x the rows): the metrics above are
    view 0's (the puzzles as they are), and by_views holds vote@k, verified@k, oracle@k (and accepted@k)
    for each k of view_counts(K), after the last of the n_steps (test-time depth counts: views x steps) and
    with the q_halt stop (each view's answer where it stopped).
    should_stop(within=False): asked before every batch, and within one (within=True) after every halt_max_steps
    supervision steps (test-time scaling runs thousands), on every rank (a verdict the ranks agree on, so all stop
    at the same point; the steps keep their one graph each), or after every step where stops_every_step; when it
    says stop, the evaluation is abandoned and (None, None) returned. progress(i): told after every supervision
    step of a batch (a watchdog's heartbeat).
    arc: the loader's dataset's arc.ARCVotes, which count every row's answer (ARCVotes.read) and score the vote;
    arc_pool_at: the step of the checkpoint evaluated, whose answers join a pooling run's pool (None: not)."""
    predict = predict or model.predict
    K = getattr(loader, 'views', 1)
    ks = view_counts(K)
    was_training = model.training
    model.eval()
    h = min(halt_max_steps, n_steps) - 1
    sums, example, verified, ran, by_views = {}, None, 0, 0, {}
    within = should_stop and (lambda: should_stop(within=True))
    chunk = 1 if stops_every_step(dev) else halt_max_steps
    if arc is not None:
        arc.start(loader.example_idx)
    for batch in loader:
        if should_stop is not None and should_stop():
            model.train(was_training)
            return None, None
        inverse = batch.pop('views_inverse', None)
        rows_index = batch.pop('example_index', None)
        b = dev.to_device(batch)
        out = predict(b, n_steps, loss_at=h, should_stop=within, chunk=chunk,
                      on_step=progress and (lambda i, pred, q_halt, halt: progress(i + 1)))
        if out is None:
            model.train(was_training)
            return None, None
        preds_all, q_all, halts_all, loss_all = out  # [S, K*B, L], [S, K*B], [S, K*B], [K*B]
        halt = torch.cat([halts_all[:-1], torch.ones_like(halts_all[-1:])])  # the last step always stops
        first_all = halt.int().argmax(0)  # the first step where the model halts (model.halts)
        B = preds_all.shape[1] // K  # view 0's rows: the puzzles as they are
        preds, q_halt, row_loss, first = preds_all[:, :B], q_all[:, :B], loss_all[:B], first_all[:B]
        part = batch_sums(preds, q_halt, row_loss, first, b['labels'][:B], b['valid'][:B], h)
        # read with the batch's answers, in its one graph, and added up on the host: summed on the device, the
        # first batch's sums and the later ones' would be different graphs (a compilation at the second batch)
        keys = sorted(part)
        flat_part = torch.cat([part[k].reshape(-1).float() for k in keys])
        inp, v = batch['inputs'][:B], batch['valid'][:B]
        ran += int(v.sum())
        if K > 1:  # every view's answer after the last step and where the model halted: one graph, one read
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
    sums['ran'] = np.array([float(ran)])  # the rows run, labelled or not (a hidden test set's are not)
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
    res['eval_flops'] = float(model.flops_per_example(train=False)) * n_steps * K * float(s['ran'][0])
    if arc is not None:
        res.update(arc.results(arc_pool_at))
    if K > 1:
        names = sorted(by_views)
        res['by_views'] = [dict(views=k, **{m: float(s['views_' + m][j]) / max(n, 1) for m in names})
                           for j, k in enumerate(ks)]
    model.train(was_training)
    return res, example


def arc_scores(s):
    """arc.score_arc's s in words: '(N test outputs, V views): ARC Prize score (per output) pass@1 .. pass@2 .. |
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
    if not r['count']:  # a hidden test set's rows: their zeros are no accuracy
        line = (f"eval on 0 rows with a known answer: no exact, token or q_halt accuracy | steps "
                f"{r['steps']:.0f}")
    else:
        line = (f"eval on {int(r['count'])}: exact {r['exact_accuracy']:.4f} (95% CI {r['exact_ci_low']:.4f}-"
                f"{r['exact_ci_high']:.4f}) | token {r['token_accuracy']:.4f}"
                f" | q_halt acc {r['q_halt_accuracy']:.4f}"
                f" | steps {r['steps']:.0f}")
        if 'verified_accuracy' in r:
            line += f" | verified {r['verified_accuracy']:.4f}"
        line += f" | with q_halt stop: exact {r['exact_accuracy_q_halt']:.4f} in {r['steps_q_halt']:.2f} steps"
    if r['count'] and len(r['exact_by_steps']) > r['steps']:
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
