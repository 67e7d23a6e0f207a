"""
A study's report: the runs' results.json and saved evaluations collected into report.md, report.csv,
report_views.csv, power-law fits per family and PNG plots. Reads only what the runs left in their folders
(studies/plan.py says where), so a report can be made again at any time.
"""
import csv
import fcntl
import json
import math
import os

from runkeep.records import write_atomic

from .plan import checkpoint_steps, cost, exists, fetch, has_file, other_checkpoint, read_results, saved_evals, seeded


# -----------------------------------------------------------------------------
# the table: one row per run, one point per experiment (the mean over its seeds)

def timed_minutes(metrics_path, batch):
    """Minutes of training and evaluation recorded in metrics.jsonl: each train line covers (step - previous
    step) x batch / examples_per_s seconds since the previous one (evaluations in between included), plus the
    final evaluation; start-up time is not in it. None when there is nothing to add. A line that is no record of
    numbers (torn by a crash, damaged, hand-edited) is left out, the first one said."""
    lines, bad = [], []
    try:
        with open(metrics_path, errors='replace') as f:
            for i, l in enumerate(f, 1):
                try:
                    rec = json.loads(l) if l.strip() else {}
                except ValueError:
                    rec = None
                need = ('step', 'time') if isinstance(rec, dict) and rec.get('kind') in ('train', 'eval') else ()
                if isinstance(rec, dict) and all(isinstance(rec.get(k), (int, float)) for k in need) and \
                        isinstance(rec.get('examples_per_s') or 0, (int, float)):
                    lines.append(rec)
                else:
                    bad.append(i)
    except OSError:
        return None
    if bad:
        print(f"report: {metrics_path} line {bad[0]} is not a record of numbers (torn by a crash?)"
              + (f", {len(bad) - 1} more line(s) too" if len(bad) > 1 else '') + ": left out of its minutes")
    total, prev, last_train = 0.0, 0, None
    for l in lines:
        if l.get('kind') == 'train' and l.get('examples_per_s'):
            total += (l['step'] - prev) * batch / l['examples_per_s']
            prev, last_train = l['step'], l
    if last_train is None:
        return None
    final = [l for l in lines if l.get('kind') == 'eval' and l['step'] == last_train['step']]
    if final:
        total += max(0.0, final[-1]['time'] - last_train['time'])
    return total / 60


# an ARC run's report.csv columns <- its final evaluation's keys: per task (the reference's), per test output
# (the ARC Prize's), and with a pooled vote the pool's
ARC_COLUMNS = dict(arc_pass1='arc_pass@1', arc_pass2='arc_pass@2', arc_pass2_ci_low='arc_pass@2_ci_low',
                   arc_pass2_ci_high='arc_pass@2_ci_high', arc_prize_pass1='arc_prize_pass@1',
                   arc_prize_pass2='arc_prize_pass@2', arc_prize_pass2_ci_low='arc_prize_pass@2_ci_low',
                   arc_prize_pass2_ci_high='arc_prize_pass@2_ci_high', arc_pooled_pass2='arc_pooled_pass@2',
                   arc_pooled_prize_pass2='arc_pooled_prize_pass@2', arc_tasks='arc_tasks',
                   arc_test_outputs='arc_test_outputs', arc_unscored='arc_unscored')


# the line study.py ends the train.log of a run it saw end without results with (its summary's status and why)
ENDED = '--- study: '


def last_line(e):
    """The last line of a run's train.log (this machine's copy, else the bucket's), '' if none."""
    path = os.path.join(e.local, 'train.log')
    path = path if os.path.exists(path) else fetch(e, 'train.log')
    try:
        with open(path, 'rb') as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors='replace').splitlines()
    except (OSError, TypeError):
        return ''
    return next((l for l in reversed(lines) if l.strip()), '')


def collect(exps, told=None):
    """One row per run. told: the study's own {run: (status, why)} when the report is made at its end, so that a
    run it saw fail, or did not run or reuse, is said so in the row and not read as unfinished."""
    rows = []
    for e in exps:
        r = dict(name=e.name, run=e.run, seed=e.seed, family=e.family, point=e.point(),
                 varied=e.varied_text(),
                 # what this run trains differently from its base, at this scale (an ablation's bar label)
                 changes=[f"{k}={e.run_cfg[k]!r}" for k in e.varied],
                 out_dir=e.out_dir, lr=e.run_cfg['lr'], global_batch_size=e.run_cfg['global_batch_size'],
                 H_cycles=e.run_cfg['H_cycles'], L_cycles=e.run_cfg['L_cycles'],
                 hidden_size=e.run_cfg['hidden_size'], L_layers=e.run_cfg['L_layers'],
                 puzzles=e.data['puzzles'], aug=e.data['aug'], kind=e.data['kind'], status='not started')
        res, why = read_results(e)
        if res:
            fe, be = res['final_eval'], res.get('best_eval') or {}
            cfg = res.get('config', {})
            r.update(status='done', params=res['parameters'], train_flops=res['train_flops'],
                     flops_per_example_step=res['flops_per_example_step'], steps=res.get('step'),
                     examples=res.get('examples_seen'), exact=fe['exact_accuracy'],
                     exact_ci_low=fe['exact_ci_low'],
                     exact_ci_high=fe['exact_ci_high'], verified=fe.get('verified_accuracy'),
                     token=fe['token_accuracy'], q_halt=fe['q_halt_accuracy'], test_count=fe.get('count'),
                     best_exact=be.get('exact_accuracy'), best_step=be.get('step'),
                     best_subset=be['examples'] if be.get('examples', 0) < be.get('test_examples', 0) else None,
                     device=res.get('device'),
                     exact_by_steps=fe.get('exact_by_steps') or [], halt_max_steps=cfg.get('halt_max_steps'),
                     H_cycles=cfg.get('H_cycles', r['H_cycles']), L_cycles=cfg.get('L_cycles', r['L_cycles']))
            if 'arc_tasks' in fe:  # an ARC run: the vote over its stored views, per task and per test output
                r.update({c: fe.get(k) for c, k in ARC_COLUMNS.items()})
            wall = res.get('wall_s') or {}  # results.json of runs before it was recorded: none
            r.update(device_hours=res.get('device_hours'), world_size=res.get('world_size'),
                     **{f'wall_s_{k}': wall.get(k) for k in ('total', 'startup', 'train', 'eval')})
            m = fetch(e, 'metrics.jsonl')
            r['minutes'] = timed_minutes(m,
                                         cfg.get('global_batch_size',
                                                 e.run_cfg['global_batch_size'])) if m else None
        else:
            steps = checkpoint_steps(e)
            if steps:
                r['status'] = f"started (step {steps[-1]})"
            elif has_file(e, 'train.log'):  # before its first checkpoint, or ended where no study saw it end
                r['status'] = 'started, no checkpoint (see its train.log)'
            c = cost(e)
            if c and 'error' not in c:
                # what it would do when finished, not what it did
                r.update(params=c['params'], train_flops=c['train_flops'], steps=c['steps'], planned=True)
            s, said = (told or {}).get(e.same_as or e.run, ('', None))
            if not told and (end := last_line(e)).startswith(ENDED):  # the study's word when the run ended
                s, _, said = end[len(ENDED):].partition(' ')
                if s == 'stopped':
                    r['status'] = f"stopped at step {steps[-1]}" if steps else 'stopped before its first checkpoint'
            if why:  # its numbers are not this configuration's, or cannot be read: not shown as done
                r.update(not_used=why, status=('unreadable results.json' if why.startswith('unreadable') else
                                               'not used: results.json of another configuration'))
            elif s in ('FAILED', 'NOT RUN', 'NOT REUSED'):  # as the study's summary says, with its reason
                r.update(not_used=f"{s} {said or ''}".strip(),
                         status='not used: checkpoint of another configuration' if s == 'NOT REUSED' else s)
        rows.append(r)
    return rows


def pct(x):
    return '' if x is None else f"{100 * x:.1f}"


def subset_of(r):
    """A best exact cell's note: the intermediate evaluations' subset it was chosen on (the final: all)."""
    return f", of {r['best_subset']}" if r.get('best_subset') else ''


def plan_cells(r):
    """A row's params, train FLOPs and steps cells; an unfinished run's FLOPs and steps are its plan's."""
    mark = ' planned' if r.get('planned') else ''
    return [f"{r['params']:,}" if r.get('params') else '',
            f"{r['train_flops']:.3g}{mark}" if r.get('train_flops') else '',
            f"{r['steps']:,}{mark}" if r.get('steps') else '']


def points(rows, seeds):
    """One row per experiment of `seeds` runs: with one seed its run's row, bars its 95% Wilson interval; with
    more, the mean of its finished seeds (exact, its curve by supervision steps, device-hours), bars their
    min-max, std and the per-seed values beside."""
    out = []
    for name in dict.fromkeys(r['name'] for r in rows):
        group = [r for r in rows if r['name'] == name]
        done = [r for r in group if r['status'] == 'done']
        p = dict(done[0] if done else group[0])
        if seeds == 1:
            if done:
                p.update(bar_lo=p['exact_ci_low'], bar_hi=p['exact_ci_high'])
            out.append(p)
            continue
        vals = [r['exact'] for r in done]
        p.update(seeds_done=len(done), status='done' if done else group[0]['status'],
                 per_seed=[r['exact'] if r['status'] == 'done' else None
                           for r in sorted(group, key=lambda r: r['seed'])])  # an unfinished seed keeps its place
        if done:
            mean = sum(vals) / len(vals)
            # one value has no sample standard deviation: None, not 0
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else None
            hours = [r['device_hours'] for r in done if r.get('device_hours') is not None]
            # every seed's curve, so that it ends at the mean (a results.json of an earlier trainer has none)
            curves = [r['exact_by_steps'] for r in done if r['exact_by_steps']]
            p.update(exact=mean, exact_std=std, bar_lo=min(vals), bar_hi=max(vals),
                     device_hours=sum(hours) / len(hours) if hours else None,
                     exact_by_steps=[sum(c[i] for c in curves) / len(curves)
                                     for i in range(min(map(len, curves)))] if curves else [])
        out.append(p)
    return out


def seed_stats(rows, seeds):
    """{name: (mean, std, min, max, finished seeds)} of the exact accuracy over each experiment's seeds."""
    stats = {}
    for p in points(rows, seeds) if seeds > 1 else []:
        if p.get('seeds_done'):
            stats[p['name']] = (p['exact'], p['exact_std'], p['bar_lo'], p['bar_hi'], p['seeds_done'])
    for r in rows if seeds == 1 else []:
        if r['status'] == 'done':
            stats[r['name']] = (r['exact'], None, r['exact'], r['exact'], 1)
    return stats


# evaluate.py's exact accuracy is at halt_max_steps even where the evaluation runs more steps (eval_steps)
AT_STEPS = ("at halt_max_steps supervision steps (at eval_steps if fewer; the accuracy at each step count: "
            "acc_vs_supervision_steps.png)")


def more_seeds(exps, seeds):
    """The finished runs of seed `seeds` (<out_dir>-s<seeds>) beside the experiments' runs: a study of more
    seeds than this report is made with, whose other seeds the table would leave out unsaid."""
    found = []
    for e in exps:
        if e.seed == 0 and not e.same_as:
            if exists(f"{seeded(e.out_dir.rstrip('/'), seeds)}/results.json"):
                found.append(seeded(e.run, seeds))
    return found


def write_tables(rows, folder, opts, views=(), beyond=()):
    """report.md (returned as text), report.csv and, with views, report_views.csv in folder; beyond: more_seeds."""
    seeds = opts.seeds
    os.makedirs(folder, exist_ok=True)
    md = [f"# Study report: scale {opts.scale}, {opts.root}\n"]
    if beyond:
        md.append(f"**Seeds left out:** {listed(list(beyond))} finished too, but this report is made with "
                  f"--seeds={seeds}: rerun it with the study's --seeds for every seed's result.\n")
    if seeds == 1:
        head = ['name', 'family', 'varied', 'params', 'train FLOPs', 'steps', 'exact % (95% CI)',
                'verified %',
                'token %', 'best exact % (step)', 'minutes', 'device-h', 'status']
        arc = any(r.get('arc_tasks') is not None or r.get('kind') == 'arc' for r in rows)
        if arc:  # ARC's scores beside exact: pass@2 of the vote over each task's stored views
            head[head.index('exact % (95% CI)'):head.index('exact % (95% CI)')] = [
                'ARC Prize score pass@2 % (per output, 95% CI)', "ARC pass@2 % (95% CI), per task (the reference's)"]
        md += ["Held-out exact accuracy after the final evaluation (95% Wilson interval), on every test "
               f"puzzle, {AT_STEPS}. minutes: training and evaluations, from metrics.jsonl (start-up "
               "excluded). device-h: the run's wall time (start-up, training, evaluations) x its devices, from "
               "results.json. planned: a run not finished shows the training FLOPs and steps it is planned to "
               "reach, not what it did. best exact: the best evaluation of the run's, among those of the same "
               "test examples: 'of N', the intermediate evaluations' seeded subset of N, which the final one (of "
               "all) does not join.\n"
               + ("ARC runs: a test output passes at 2 when it is among the vote's two best answers over its "
                  "stored views. The ARC Prize's score counts every test output once; the reference's (the "
                  "paper's) averages over the evaluation tasks, a task scoring the share of its test outputs "
                  "that pass. Each with its 95% Wilson interval (over test outputs, over tasks); test outputs "
                  "without a known solution are not scored (report.csv: arc_unscored). exact is per test row "
                  "(one view).\n" if arc else ''),
               '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
        for r in rows:
            done = r['status'] == 'done'
            arc_cell = ([f"{pct(r[p + '2'])} ({pct(r.get(p + '2_ci_low'))}-{pct(r.get(p + '2_ci_high'))})"
                         if done and r.get(p + '2') is not None else '' for p in ('arc_prize_pass', 'arc_pass')]
                        if arc else [])
            md.append('| ' + ' | '.join([
                r['name'], r['family'], r['varied'], *plan_cells(r), *arc_cell,
                f"{pct(r['exact'])} ({pct(r['exact_ci_low'])}-{pct(r['exact_ci_high'])})" if done else '',
                pct(r.get('verified')) if done else '', pct(r.get('token')) if done else '',
                f"{pct(r['best_exact'])} ({r['best_step']}{subset_of(r)})"
                if done and r.get('best_exact') is not None else '',
                f"{r['minutes']:.1f}" if r.get('minutes') is not None else '',
                f"{r['device_hours']:.3g}" if r.get('device_hours') is not None else '', r['status']]) + ' |')
    else:
        head = ['name', 'family', 'varied', 'params', 'train FLOPs', 'steps',
                'exact %: mean ± std (min-max)', 'seeds done', 'exact % per seed (0, 1, ...)',
                'device-h (mean)', 'status']
        md += [f"Held-out exact accuracy after the final evaluation, {AT_STEPS}, over {seeds} seeds per "
               "experiment (seed s > 0 in <out_dir>-s<s>): mean, sample standard deviation and min-max of the "
               "finished seeds. report.csv has one row per seed run. planned: an experiment with no finished "
               "seed shows the training FLOPs and steps it is planned to reach.\n", '| ' + ' | '.join(head) + ' |',
               '|' + '---|' * len(head)]
        for p in points(rows, seeds):
            done = bool(p.get('seeds_done'))
            md.append('| ' + ' | '.join([
                p['name'], p['family'], p['varied'], *plan_cells(p),
                f"{pct(p['exact'])} ± {pct(p['exact_std']) or 'n/a'} ({pct(p['bar_lo'])}-{pct(p['bar_hi'])})"
                if done else '',
                f"{p['seeds_done']}/{seeds}", ', '.join(pct(v) or '–' for v in p['per_seed']),
                f"{p['device_hours']:.3g}" if p.get('device_hours') is not None else '', p['status']]) + ' |')
    md += fits_section(rows, seeds)
    md += views_section(views)
    md += [f"\nCurves: `tensorboard --logdir {opts.root}` shows every run's training, evaluation, speed and XLA "
           "scalars (each run as <name>/tb; TensorBoard reads a gs:// folder as well).\n"]
    # each file through a rename: a full disk leaves an earlier report's file whole, not cut where the disk filled
    write_atomic(os.path.join(folder, 'report.md'), lambda f: f.write('\n'.join(md) + '\n'))
    write_csv(rows, folder, seeds)
    if views:
        write_views_csv(views, folder)
    return '\n'.join(md)


def write_csv(rows, folder, seeds):
    """report.csv: one row per run (one per seed), its experiment's statistics over seeds repeated on each."""
    cols = ['name', 'seed', 'run', 'family', 'point', 'varied', 'status', 'out_dir', 'params',
            'flops_per_example_step',
            'train_flops', 'steps', 'planned', 'examples', 'exact', 'exact_ci_low', 'exact_ci_high', 'verified',
            'token',
            'q_halt', 'best_exact', 'best_step', 'best_subset', 'minutes', 'test_count', 'hidden_size', 'L_layers',
            'H_cycles',
            'L_cycles', 'puzzles', 'aug', 'lr', 'global_batch_size', 'device', 'world_size', 'wall_s_total',
            'wall_s_startup', 'wall_s_train', 'wall_s_eval', 'device_hours', 'exact_mean', 'exact_std',
            'exact_min',
            'exact_max', 'seeds_done']
    if any(r.get('kind') == 'arc' for r in rows):  # ARC's score beside exact (before the seed statistics)
        cols[cols.index('exact'):cols.index('exact')] = list(ARC_COLUMNS)
    stats = seed_stats(rows, seeds)
    def write(f):
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            r = dict(r, **dict(zip(cols[-5:], stats.get(r['name'], [None] * 5))))
            w.writerow(['' if r.get(c) is None else r.get(c) for c in cols])
    write_atomic(os.path.join(folder, 'report.csv'), write, newline='')


# -----------------------------------------------------------------------------
# test-time compute: accuracy against views and steps (the runs' evals/views{K}-steps{S}.json)

VIEW_COLS = ['run', 'family', 'point', 'views', 'steps', 'halt_max_steps', 'vote', 'verified',
             'oracle', 'accepted', 'vote_q_halt', 'verified_q_halt', 'oracle_q_halt', 'accepted_q_halt',
             'flops_per_puzzle', 'forward_flops_per_step', 'seconds', 'eval_views', 'checkpoint_step',
             'test_count', 'file']


def collect_views(exps):
    """One row per (run, steps S, views k) of the saved re-evaluations of the runs the report uses: for each
    S the file with the most views K (its first k views are a k-view evaluation). The accuracies at k are
    the by_views entry of k (K = 1: view 0's answer right, which vote, verified and oracle all are with one view:
    the verifier's accepting it where the count is known, else its exactness); flops_per_puzzle = the evaluation's
    forward FLOPs / puzzles x k / K = k x S x forward FLOPs per step; seconds: the whole K-view evaluation's.
    A file of another checkpoint than results.json's (a run extended, rolled back or overwritten since: another
    step or checkpoint_id) is left out, as study.py --eval_only leaves it."""
    rows = []
    for e in exps:
        res = None if e.same_as else read_results(e)[0]
        if res is None:  # unfinished or not reused: not compared
            continue
        best = {}
        for (K, S), path in saved_evals(e).items():
            if why := other_checkpoint(path, res):
                print(f"report: {path} {why}: left out (study.py --eval_only evaluates the run's checkpoint again)")
                continue
            if K >= best.get(S, (0, None))[0]:
                best[S] = (K, path)
        for S, (K, path) in sorted(best.items()):
            try:
                with open(path) as f:
                    rec = json.load(f)
                res = rec['eval']
                n = float(res['count'])
                per_view = float(res['eval_flops']) / max(n, 1) / K
                # one view: evaluate's headline figures are at min(halt_max_steps, S), its exact_by_steps runs to
                # S and its q_halt stop looks at all S; the verifier's count is known at S only within halt_max_steps
                last = (res.get('exact_by_steps') or [res['exact_accuracy']])[-1]
                deeper = S > int(rec['config']['halt_max_steps'])
                accepted = None if deeper else res.get('verified_accuracy')
                right = last if accepted is None else accepted  # a maze's other shortest path too, as k views
                by = res.get('by_views') or [dict(
                    views=1, vote=right, verified=right, oracle=right, accepted=accepted,
                    **{m + '_q_halt': res['exact_accuracy_q_halt'] for m in ('vote', 'verified', 'oracle')})]
                for v in by:
                    k = int(v['views'])
                    rows.append(dict(
                        run=e.run, family=e.family, point=e.point(), views=k, steps=S,
                        halt_max_steps=int(rec['config']['halt_max_steps']),
                        **{m: v.get(m) for m in VIEW_COLS[6:14]},
                        flops_per_puzzle=per_view * k, forward_flops_per_step=per_view / S,
                        seconds=rec.get('seconds'), eval_views=K, checkpoint_step=rec.get('step'),
                        test_count=int(n), file=path))
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as ex:
                print(f"report: {path} cannot be read ({type(ex).__name__}: {ex}); left out")
    return rows


def views_section(views):
    """report.md's test-time compute table."""
    if not views:
        return []
    lines = ["\n## Test-time compute: views and supervision steps\n",
             "Each finished run evaluated again (`--eval_only=True`) on every test puzzle in k views (view 0 "
             "the puzzle, the others seeded symmetries of it) for S supervision steps. vote@k: the answer most "
             "views agree on; verified@k: an answer the verifier accepts where a view found one, else the "
             "vote; oracle@k: any view right (the ceiling). These are scored after the last of the S steps; "
             "the q_halt columns take each view's answer where its q_halt stopped it, "
             "within the S steps. FLOPs per puzzle: k x S x forward FLOPs per step (what the evaluation ran); "
             "seconds: the whole evaluation in the most views (all k at once); checkpoint: the step of the "
             "weights evaluated. report_views.csv has every column (accepted@k too).\n",
             "| run | checkpoint | views k | steps S | vote@k % | verified@k % | oracle@k % | q_halt stop: "
             "vote / verified / oracle % | eval FLOPs per puzzle | seconds |", '|' + '---|' * 10]
    for r in views:
        lines.append('| ' + ' | '.join([
            r['run'], str(r['checkpoint_step'] if r['checkpoint_step'] is not None else '?'), str(r['views']),
            str(r['steps']), pct(r['vote']),
            pct(r['verified']), pct(r['oracle']),
            ' / '.join(pct(r[m + '_q_halt']) for m in ('vote', 'verified', 'oracle')),
            f"{r['flops_per_puzzle']:.3g}", '' if r['seconds'] is None else f"{r['seconds']:.1f}"]) + ' |')
    return lines


def write_views_csv(views, folder):
    def write(f):
        w = csv.writer(f)
        w.writerow(VIEW_COLS)
        for r in views:
            w.writerow(['' if r.get(c) is None else r[c] for c in VIEW_COLS])
    write_atomic(os.path.join(folder, 'report_views.csv'), write, newline='')


# -----------------------------------------------------------------------------
# fits: error = a * X^-b + c per family

FIT_AXES = (('params', 'parameters'), ('train_flops', 'training FLOPs'), ('puzzles', 'training puzzles'))


def fit_power_law(xs, errs):
    """Least-squares fit of err = a * x^-b + c with a >= 0, b in (0, 4], 0 <= c < min(err): a grid over b and
    c, a in closed form for each, then two finer grids around the best. With its R^2 and whether it means
    anything: >= 4 distinct x (3 parameters fit 3 points exactly), an error spread of at least 1 percentage
    point, and a fit better than the mean (R^2 > 0)."""
    import numpy as np
    x, y = np.asarray(xs, float), np.asarray(errs, float)
    n = len(set(xs))
    out = dict(n=n, a=None, b=None, c=None, r2=None, meaningful=False)
    if n < 4:
        out['why'] = (f"{n} distinct points: a, b and c fit them exactly, so the fit says nothing" if n == 3
                      else f"{n} distinct point(s): too few for a fit (4 needed)")
        return out
    u = x / x.min()  # x / x0: a * x^-b = (a * x0^-b) * u^-b, better conditioned
    tss = float(((y - y.mean()) ** 2).sum())
    lo_b, hi_b, lo_c, hi_c, best = 1e-3, 4.0, 0.0, float(y.min()), None
    for _ in range(3):
        bs = np.linspace(lo_b, hi_b, 200)
        cs = np.linspace(lo_c, hi_c, 80, endpoint=hi_c == lo_c or best is not None)
        cs = cs[(cs >= 0) & (cs < max(float(y.min()), 1e-12))] if float(y.min()) > 0 else np.zeros(1)
        f = u[None, :] ** -bs[:, None]                                    # [b, point]
        t = y[None, :] - cs[:, None]                                      # [c, point]
        a = np.clip((t @ f.T) / (f * f).sum(1)[None, :], 0, None)         # [c, b]
        rss = ((a[:, :, None] * f[None] - t[:, None, :]) ** 2).sum(-1)    # [c, b]
        i, j = np.unravel_index(int(rss.argmin()), rss.shape)
        best = (float(a[i, j]), float(bs[j]), float(cs[i]), float(rss[i, j]))
        db, dc = (hi_b - lo_b) / 20, (hi_c - lo_c) / 20
        lo_b, hi_b = max(1e-3, best[1] - db), min(4.0, best[1] + db)
        lo_c, hi_c = max(0.0, best[2] - dc), min(float(y.min()), best[2] + dc)
    a, b, c, rss = best
    out.update(a=a * float(x.min()) ** b, b=b, c=c, r2=1 - rss / tss if tss > 0 else 0.0)
    if float(y.max() - y.min()) < 0.01:
        out['why'] = "flat: the error varies by less than 1 percentage point"
    elif out['r2'] <= 0:
        out['why'] = "the fit is no better than the mean error"
    else:
        out.update(meaningful=True, why='')
    return out


def one_per_run(done):
    """The points of each family, one per run: experiments of one family that are one run (one out_dir, as
    size_L2 and size_d512) would weigh twice in its fit and be drawn twice; they are one point, labelled by
    each ('L2=d512'). Families sharing a run keep it each."""
    out, first = [], {}
    for p in done:
        key = (p['family'], p['out_dir'])
        if key in first:
            first[key]['point'] += '=' + p['point']
        else:
            first[key] = dict(p)
            out.append(first[key])
    return out


def family_fits(done):
    """(family, x key, x label, the points' names, xs, errors, fit) for every family with at least two distinct
    x on an axis, one point per run."""
    fits, done = [], one_per_run(done)
    for f in dict.fromkeys(r['family'] for r in done):
        for key, label in FIT_AXES:
            pts = [r for r in done if r['family'] == f and r.get(key) is not None]
            if len({r[key] for r in pts}) < 2:
                continue
            xs, errs = [r[key] for r in pts], [1 - r['exact'] for r in pts]
            fits.append((f, key, label, [r['point'] for r in pts], xs, errs, fit_power_law(xs, errs)))
    return fits


def fit_text(fit):
    return f"{fit['a']:.3g}·X^-{fit['b']:.3f} + {fit['c']:.4f}"


def fits_section(rows, seeds):
    done = [p for p in points(rows, seeds) if p['status'] == 'done' and p.get('exact') is not None]
    fits = family_fits(done)
    if not fits:
        return []
    lines = ["\n## Fits: error = a · X^-b + c\n",
             "Error = 1 - held-out exact accuracy" + (" (mean of the finished seeds)" if seeds > 1 else '')
             + ", per family against its parameters, training FLOPs and training puzzles (where the family "
               "has two or more distinct values). Least squares with b > 0 and 0 <= c < the smallest error; "
               "a fit is meaningful with 4 or more distinct points, an error spread of 1 percentage point or "
               "more, and R² > 0.\n", "| family | X | points | fit | R² | meaningful |",
             "|---|---|---|---|---|---|"]
    for f, key, label, _, xs, errs, fit in fits:
        r2 = '' if fit['r2'] is None else f"{fit['r2']:.3f}"
        lines.append(f"| {f}_* | {label} | {fit['n']} | {fit_text(fit) if fit['a'] is not None else ''} | "
                     f"{r2} | {'yes' if fit['meaningful'] else 'no: ' + fit['why']} |")
    return lines


# -----------------------------------------------------------------------------
# plots: accuracy against what a family studies

# every family, one figure each: (x key, x label, file, what the x is)
EVERY_FAMILY = (
    ('params', 'parameters (count, log scale)', 'acc_vs_params.png', 'model size'),
    ('train_flops', 'training compute (FLOPs, log scale)', 'acc_vs_flops.png', 'training compute'),
    ('device_hours', 'cost: device-hours (wall time x devices, log scale)', 'acc_vs_device_hours.png', 'cost'))
# figures of two panels, each panel: (x key, x label, log x, title)
PANELS = {
    'acc_vs_recursion.png': (
        ('L_cycles', 'n = L_cycles (z-updates per round)', False, 'Recursion depth n at T = 3'),
        ('calls', 'T x (n + 1) = H_cycles x (L_cycles + 1) (network calls per supervision step)', False,
         'Recursion T x (n + 1)')),
    'acc_vs_optimizer.png': (
        ('lr', 'learning rate (log scale)', True, 'Learning rate'),
        ('global_batch_size', 'global batch size (log scale; lr = 1e-4 x sqrt(B / 768))', True, 'Batch size')),
    'acc_vs_data.png': (
        ('puzzles', 'training puzzles (log scale)', True, 'Training puzzles'),
        ('per_puzzle', 'examples per training puzzle = 1 + augmentations (log scale)', True, 'Augmentations')),
}
ABLATIONS = 'acc_ablations.png'  # one bar per run
STEPS_PNG, FITS_PNG, VIEWS_PNG = 'acc_vs_supervision_steps.png', 'error_fits.png', 'acc_vs_test_compute.png'
# the files a report may write beside report.md and report.csv: one it does not write this time is an earlier
# report's, of runs this one may not compare (a config edited since, another --pattern), and is removed
OWN_FILES = (*(f for _, _, f, _ in EVERY_FAMILY), *PANELS, ABLATIONS, STEPS_PNG, FITS_PNG, VIEWS_PNG,
             'report_views.csv')
# Where each family is drawn beyond EVERY_FAMILY, the supervision steps, the fits and test-time compute:
# (figure, panel: 0 left, 1 right) of PANELS, or (ABLATIONS, 0). A new family that studies another axis adds
# its line here (and, for an axis no figure has, a figure in PANELS).
FAMILY_PANELS = {
    'rec': [('acc_vs_recursion.png', 0), ('acc_vs_recursion.png', 1)],
    'tn': [('acc_vs_recursion.png', 1)],
    'maze_rec': [('acc_vs_recursion.png', 0), ('acc_vs_recursion.png', 1)],
    'maze_tn': [('acc_vs_recursion.png', 1)],
    'lr': [('acc_vs_optimizer.png', 0)],
    'bs': [('acc_vs_optimizer.png', 1)],
    'data': [('acc_vs_data.png', 0)],
    'aug': [('acc_vs_data.png', 1)],
    'abl': [(ABLATIONS, 0)],
}


def drawn_in(family, figure, panel=0):
    return (figure, panel) in FAMILY_PANELS.get(family, ())


def not_drawn(rows, seeds):
    """The line each figure carries under it naming the experiments it does not draw (not finished, failed, not
    used), or '': a family's curve without them would read as the whole family."""
    names = [p['name'] for p in points(rows, seeds) if p['status'] != 'done' or p.get('exact') is None]
    return f"not drawn (not finished or not used; report.md says why): {listed(names)}" if names else ''


def listed(names, most=8):
    return ', '.join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else '')


def alone_line(names):
    """The line naming the finished experiments a figure leaves out because their family has one value of its x
    (a curve needs two), or '': a reader would take them for not finished, or the figure for the whole study."""
    return f"not drawn (finished, but the only value of this x in their family): {listed(names)}" if names else ''


def fewer_seeds(rows, seeds):
    """The line naming the experiments drawn from fewer finished seeds than `seeds`, or '': one finished seed is
    drawn with no bar, as if its seeds agreed."""
    few = [f"{p['name']} {p['seeds_done']}/{seeds}" for p in points(rows, seeds)
           if 0 < p.get('seeds_done', seeds) < seeds]
    return f"drawn from fewer seeds than {seeds} (the finished ones): {listed(few)}" if few else ''


def plot(rows, folder, opts, views=()):
    """The PNGs of the finished points (and of the saved evaluations, views) in folder; their paths."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("report: matplotlib is not installed, so no plots (pip install matplotlib); "
              "the tables are written")
        return []
    seeds = opts.seeds
    done = one_per_run([p for p in points(rows, seeds) if p['status'] == 'done' and p.get('exact') is not None])
    fams = list(dict.fromkeys(r['family'] for r in done))
    colors = {f: plt.get_cmap('tab10')(i % 10) for i, f in enumerate(fams)}
    title = f"scale {opts.scale}"
    ylabel = ('held-out exact accuracy (%)\nbars: 95% Wilson interval' if seeds == 1 else
              'held-out exact accuracy (%)\nmean of the finished seeds, bars: min-max')
    written, missing = [], '; '.join(filter(None, (not_drawn(rows, seeds), fewer_seeds(rows, seeds))))
    alone = []  # finished experiments the figure being drawn leaves out: their family has one value of its x

    def series(ax, xkey, label_x, fam_filter=None, logx=False, annotate=True):
        if not logx:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        used = 0
        for f in fams:
            pts = sorted((r for r in done if r['family'] == f and r.get(xkey) is not None),
                         key=lambda r: r[xkey])
            if fam_filter and not fam_filter(f):
                continue
            if len({r[xkey] for r in pts}) < 2:
                alone.extend(r['name'] for r in pts if r['name'] not in alone)
                continue
            xs = [r[xkey] for r in pts]
            ys = [100 * r['exact'] for r in pts]
            err = [[100 * (r['exact'] - r['bar_lo']) for r in pts],
                   [100 * (r['bar_hi'] - r['exact']) for r in pts]]
            ax.errorbar(xs, ys, yerr=err, marker='o', capsize=3, color=colors[f], label=f"{f}_*")
            if annotate:
                for r, x, y in zip(pts, xs, ys):  # families sharing a point: one label above, one below
                    ax.annotate(r['point'], (x, y), textcoords='offset points', fontsize=7, color=colors[f],
                                xytext=(4, 4 if used % 2 == 0 else -11))
            used += 1
        if logx:
            ax.set_xscale('log')
        ax.set_xlabel(label_x)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        if used:
            ax.legend(fontsize=8)
        return used

    def save(fig, name):
        path = os.path.join(folder, name)
        said = [line for line in (missing, alone_line(alone)) if line]
        if said:
            fig.text(0.005, 0.005, '\n'.join(said), fontsize=7, color='dimgrey', ha='left', va='bottom')
        # 0.2 inch for one line, 0.12 more for each further one
        fig.tight_layout(rect=(0, (0.08 + 0.12 * len(said)) / fig.get_figheight() if said else 0, 1, 1))
        write_atomic(path, lambda f: fig.savefig(f, dpi=120, format='png'), 'wb')
        plt.close(fig)
        written.append(path)

    for r in done:
        r['calls'] = r['H_cycles'] * (r['L_cycles'] + 1)
        r['per_puzzle'] = None if r.get('aug') is None else 1 + r['aug']
    for xkey, label, name, what in EVERY_FAMILY:
        alone.clear()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if series(ax, xkey, label, logx=True):
            ax.set_title(f"Exact accuracy vs {what} ({title})")
            save(fig, name)
        else:
            plt.close(fig)
    for name, panels in PANELS.items():
        alone.clear()
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        drawn = [series(ax, xkey, label, lambda f, name=name, i=i: drawn_in(f, name, i), logx=logx)
                 for i, (ax, (xkey, label, logx, _)) in enumerate(zip(axes, panels))]
        if any(drawn):
            for i, (ax, panel, n) in enumerate(zip(axes, panels, drawn)):
                ax.set_title(f"{panel[3]} ({title})")
                if not n:  # not a bare axis, which reads as a plot whose points failed to draw
                    ax.text(0.5, 0.5, empty_panel(rows, done, name, i, panel[0]), transform=ax.transAxes,
                            ha='center', va='center', color='dimgrey', wrap=True)
                    ax.set_xticks([])
                    ax.set_xticks([], minor=True)
            save(fig, name)
        else:
            plt.close(fig)
    alone.clear()
    for name, fig in ((ABLATIONS, plot_ablations(plt, done, title, colors, ylabel)),
                      (STEPS_PNG, plot_supervision_steps(plt, done, title, seeds)),
                      (FITS_PNG, plot_fits(plt, done, title, colors, seeds)),
                      (VIEWS_PNG, plot_views(plt, views, opts.scale))):
        if fig:
            save(fig, name)
    return written


def empty_panel(rows, done, figure, panel, xkey):
    """What a panel of a figure says in place of a curve: why its families draw none."""
    fams = [f for f in dict.fromkeys(r['family'] for r in rows) if drawn_in(f, figure, panel)]
    if not fams:
        return 'no run of ' + ', '.join(f + '_*' for f, at in FAMILY_PANELS.items() if (figure, panel) in at) + \
            ' in this report'
    said = []
    for f in fams:
        n = len({r[xkey] for r in done if r['family'] == f and r.get(xkey) is not None})
        said.append(f"no finished run of {f}_*" if n == 0 else f"one finished point of {f}_*: a curve needs two")
    return '\n'.join(said)


def plot_ablations(plt, done, title, colors, ylabel):
    """One bar per ablation run, with its error bars."""
    abl = [r for r in done if drawn_in(r['family'], ABLATIONS)]
    if not abl:
        return None
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(abl)), 4.5))  # a bar as wide as its longest key=value
    ys = [100 * r['exact'] for r in abl]
    err = [[100 * (r['exact'] - r['bar_lo']) for r in abl],
           [100 * (r['bar_hi'] - r['exact']) for r in abl]]
    ax.bar(range(len(abl)), ys, yerr=err, capsize=4, color=[colors[r['family']] for r in abl])
    ax.set_xticks(range(len(abl)), ['\n'.join([r['point'], *r['changes']]) for r in abl], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 103)
    ax.set_title(f"Ablations ({title})")
    return fig


def plot_fits(plt, done, title, colors, seeds):
    """One panel per axis (parameters, training FLOPs, training puzzles): each family's error against it,
    log-log, with its fit a * X^-b + c drawn where the fit is meaningful (report.md says why where it is
    not)."""
    import numpy as np
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):  # the ticks LogFormatter labels, as numbers: 40 and 0.1, not 4x10^1 and 1e-01
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:g}"

    fits = family_fits(done)
    axes_used = [a for a in FIT_AXES if any(f[1] == a[0] for f in fits)]
    if not axes_used:
        return None
    fig, axes = plt.subplots(1, len(axes_used), figsize=(6 * len(axes_used), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes.flat, axes_used):
        # a log axis has no 0: a run that solved every test puzzle is drawn at a floor below the others, marked
        positive = [e for _, k, _, _, _, errs, _ in fits if k == key for e in errs if e > 0]
        floor, solved = 100 * min(positive) / 2 if positive else 0.1, 0
        for f, k, _, names, xs, errs, fit in fits:
            if k != key:
                continue
            what = f"error {fit_text(fit)} (as a fraction), R² {fit['r2']:.2f}" if fit['meaningful'] else \
                'no meaningful fit (report.md says why)'
            ax.plot([x for x, e in zip(xs, errs) if e > 0], [100 * e for e in errs if e > 0], 'o', color=colors[f],
                    label=f"{f}_*: {what}")
            zeros = [x for x, e in zip(xs, errs) if e == 0]
            if zeros:
                ax.plot(zeros, [floor] * len(zeros), 'v', color=colors[f], mfc='none', ms=8)
                solved += len(zeros)
            for name, x, e in zip(names, xs, errs):
                ax.annotate(name, (x, 100 * e if e > 0 else floor), textcoords='offset points', fontsize=7,
                            color=colors[f], xytext=(4, 4))
            if fit['meaningful']:
                grid = np.geomspace(min(xs), max(xs), 100)
                ax.plot(grid, 100 * (fit['a'] * grid ** -fit['b'] + fit['c']), '-', color=colors[f], lw=1)
        if solved:
            ax.axhline(floor, color='grey', ls=':', lw=0.8)
            ax.plot([], [], 'v', color='grey', mfc='none', ms=8,
                    label=f"0 % error: {solved} point(s), drawn at the floor")
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))
        if solved:  # the floor inside the axis; with no other error the axis up to 100%
            ax.set_ylim(floor / 2, None if positive else 100)
        ax.set_xlabel(f"{label} (log scale)")
        ax.set_ylabel('error = 100% - exact accuracy (%, log scale)'
                      + ('\nmean of the finished seeds' if seeds > 1 else ''))
        ax.set_title(f"Error vs {label}: a·X^-b + c ({title})", fontsize=10)
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=7)
    return fig


def plot_supervision_steps(plt, done, title, seeds):
    """One panel per family: held-out exact accuracy against the supervision steps run at test time (with
    seeds, the mean of the finished seeds at each step)."""
    from matplotlib.ticker import MaxNLocator
    with_steps = [r for r in done if len(r.get('exact_by_steps') or []) > 0]
    if not with_steps:
        return None
    sfams = list(dict.fromkeys(r['family'] for r in with_steps))
    cols = min(3, len(sfams))
    nrow = math.ceil(len(sfams) / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(5.2 * cols, 4 * nrow), squeeze=False)
    for ax, f in zip(axes.flat, sfams):
        runs = [r for r in with_steps if r['family'] == f]
        cmap = plt.get_cmap('viridis')
        for i, r in enumerate(runs):
            ys = [100 * v for v in r['exact_by_steps']]
            ax.plot(range(1, len(ys) + 1), ys, marker='.', color=cmap(i / max(1, len(runs) - 1)),
                    label=f"{r['point']}")
            if r.get('halt_max_steps') and r['halt_max_steps'] < len(ys):
                ax.axvline(r['halt_max_steps'], color='grey', ls=':', lw=1)
        ax.set_title(f"{f}_* ({title})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel('supervision steps at test time (dotted: halt_max_steps)')
        ax.set_ylabel('held-out exact accuracy (%)' + ('\nmean of the finished seeds' if seeds > 1 else ''))
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(sfams):]:
        ax.axis('off')
    return fig


def plot_views(plt, views, scale):
    """acc_vs_test_compute.png: per family, accuracy against test-time FLOPs per puzzle (log), one colour per
    run, one marker per S, points labelled by k; verified@k solid, vote@k dashed, oracle@k dotted and
    lighter. Left: the answers after the last of the S steps; right: each view's answer where q_halt stopped
    it; both at the FLOPs of the S steps run (k x S x forward)."""
    if not views:
        return None
    from matplotlib.lines import Line2D
    fams = list(dict.fromkeys(r['family'] for r in views))
    fig, axes = plt.subplots(len(fams), 2, figsize=(14, 5.5 * len(fams)), squeeze=False)
    markers = 'osD^v<>p*h'
    for (left, right), f in zip(axes, fams):
        runs = list(dict.fromkeys(r['run'] for r in views if r['family'] == f))
        steps = sorted({r['steps'] for r in views if r['family'] == f})
        colors = {run: plt.get_cmap('tab10')(i % 10) for i, run in enumerate(runs)}
        for ax, suffix in ((left, ''), (right, '_q_halt')):
            placed, ys_all = set(), []  # label cells taken (log x, y): one k label a cell, the rest crowd
            for run in runs:
                for S in steps:
                    pts = sorted((r for r in views if r['run'] == run and r['steps'] == S), key=lambda r: r['views'])
                    if not pts:
                        continue
                    xs = [r['flops_per_puzzle'] for r in pts]
                    mk, c = markers[steps.index(S) % len(markers)], colors[run]
                    for m, ls, alpha in (('verified', '-', 1.0), ('vote', '--', 0.9), ('oracle', ':', 0.5)):
                        ys = [100 * r[m + suffix] for r in pts]
                        ys_all += ys
                        ax.plot(xs, ys, ls=ls, marker=mk, color=c, alpha=alpha,
                                ms=5 if m == 'verified' else 3, lw=1.6 if m == 'verified' else 1.1,
                                label=f"{run}, S={S}" if m == 'verified' else None)
                    for r, x in zip(pts, xs):
                        y = 100 * r['verified' + suffix]
                        cell = (round(math.log10(x) * 12), round(y / 2.5))
                        if cell not in placed:
                            placed.add(cell)
                            ax.annotate(f"k={r['views']}", (x, y), fontsize=7, color=c, textcoords='offset points',
                                        xytext=(3, -10))
            ax.set_xscale('log')
            # room below the lowest point for its k label (a run at 0 %: below 0, not on the x axis's numbers)
            ax.set_ylim(max(-5.0, min(ys_all) - 5) if ys_all else 0, 101.5)
            ax.grid(alpha=0.3, which='both')
            ax.set_ylabel('held-out accuracy (%)')
        left.set_xlabel('test-time FLOPs per puzzle (log): k views x S steps x forward FLOPs')
        right.set_xlabel('test-time FLOPs per puzzle (log): k views x S steps x forward FLOPs')
        left.set_title(f"{f}_*: answers after S steps (scale {scale})", fontsize=10)
        right.set_title(f"{f}_*: each view's answer where q_halt stopped it, within S steps (scale {scale})",
                        fontsize=10)
        handles, labels = left.get_legend_handles_labels()
        styles = [Line2D([], [], color='grey', ls=ls, alpha=a, label=t) for ls, a, t in
                  (('-', 1.0, 'verified@k'), ('--', 0.9, 'vote@k'), (':', 0.5, 'oracle@k (ceiling)'))]
        left.legend(handles=handles + styles, fontsize=7, loc='best')
    return fig


# -----------------------------------------------------------------------------

def make_report(exps, opts, folder, told=None):
    """The report of these experiments' runs into folder: report.md (printed), the CSVs and the plots; told: the
    study's status of each run, at its end (collect). One report at a time into a folder: another one's tables
    beside this one's plots, or a file written by both at once, would be no report of either."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, '.report.lock'), 'w') as lock:  # released by the OS if this process dies
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"report: another report is being written into {folder}; this one waits for it", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        rows, views = collect(exps, told), collect_views(exps)  # read once the folder is this report's: the newest
        beyond = more_seeds(exps, opts.seeds)
        print(write_tables(rows, folder, opts, views, beyond))
        pngs = plot(rows, folder, opts, views)
        written = pngs + ([os.path.join(folder, 'report_views.csv')] if views else [])
        stale = [p for p in (os.path.join(folder, f) for f in OWN_FILES) if p not in written and os.path.exists(p)]
        for p in stale:
            os.remove(p)
        print(f"\nreport: {os.path.join(folder, 'report.md')}, {os.path.join(folder, 'report.csv')}"
              + ''.join(f", {p}" for p in written)
              + (f"; removed an earlier report's {', '.join(stale)} (not written this time)" if stale else ''))
        for r in rows:
            if r.get('not_used'):
                print(f"report: {r['run']}: {r['not_used']}")
        missing = [r['run'] for r in rows if r['status'] != 'done' and not r.get('not_used')]
        if missing:
            print(f"report: not finished yet: {', '.join(missing)}")
