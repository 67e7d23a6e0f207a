"""
solve.py --task=FILE.json: new ARC tasks adapted to by the trainer itself, each adaptation in a folder of its own.
    adapt(...)        the folder (default out/adapt/<file name>-<key>, the key a hash of the tasks, the checkpoint
                      and the settings, so two task files never share one), its dataset (prepare_arc.py
                      --challenges) and the adapted run (train.py --init_from=resume:CKPT): a rerun of the same
                      command solves with a finished adaptation, or continues a stopped one, and a folder that
                      holds another adaptation is refused, never replaced
    run_step(...)     prepare_arc.py or train.py in a process group of its own: a SIGINT or SIGTERM that reaches
                      solve.py is passed on to it once, it is waited for through its stop save, and its end is
                      said in one line; it dies with solve.py
The folder: adapt.json (what it adapts: the key, the task file, the checkpoint, the settings), challenges.json
(the tasks), data/ (their dataset), run/ (train.py's out_dir).
"""
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np

from configurator import fail
from data import load_metadata
from model import MODEL_KEYS
from puzzles import plural

from .checkpoint import list_checkpoints
from .hub import published_run
from .records import results_step, write_atomic
from .signals import HUNG_EXIT, die_with_parent

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
RECORD = 'adapt.json'
# train.py's keys an adaptation keeps from the checkpoint's run (besides the model's): how it learned
RECIPE = ('lr', 'lr_min_ratio', 'lr_warmup_steps', 'beta1', 'beta2', 'weight_decay', 'puzzle_emb_lr',
          'puzzle_emb_weight_decay', 'ema', 'ema_rate', 'grad_clip', 'global_batch_size', 'seed', 'compile')
ARC_SEQ_LEN = 900  # ARC-AGI's 30 x 30 canvas: a run that says nothing of its grid
STOPPED = []  # the stop signals (their names) that reached solve.py while it adapted
CHILD = []  # the step's process while it runs: where a stop signal goes


def _send(proc, name):
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.Signals[name])


@contextlib.contextmanager
def stop_requests():
    """While solve.py adapts, SIGINT and SIGTERM are a stop request: recorded in STOPPED and passed on to the
    step running (which saves and ends), instead of ending solve.py with the step left behind."""
    def on_signal(signum, frame):
        STOPPED.append(signal.Signals(signum).name)
        for p in CHILD:
            _send(p, STOPPED[-1])
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run_step(script, args):
    """`python script args` (prepare_arc.py, train.py) as a step of the adaptation, in a process group of its own
    (a terminal's Ctrl-C reaches it once, through stop_requests), waited for; its exit code."""
    parent, seen = os.getpid(), len(STOPPED)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *args], start_new_session=True,
                            preexec_fn=lambda: die_with_parent(parent))  # it ends with solve.py, saving first
    CHILD.append(proc)
    for name in STOPPED[seen:]:  # arrived while it started
        _send(proc, name)
    try:
        return proc.wait()
    finally:
        CHILD.clear()


def newest(out):
    """(step, path) of the newest checkpoint in the folder out, or None."""
    found = list_checkpoints(out) if os.path.isdir(out) else {}
    return (max(found), found[max(found)]) if found else None


def finished(out):
    """Whether the run in out ended with its final evaluation: results.json of its newest checkpoint."""
    last = newest(out)
    return bool(last) and results_step(os.path.join(out, 'results.json')) == last[0]


def kept_answers(out, steps):
    """The answers of the final evaluation of the run in out (train.py --arc_answers=True: answers.npz, the test
    rows, their answers' tokens and confidences, and the path), or None: no such file, an unreadable one, or one of
    another checkpoint than results.json's or of other supervision steps than `steps`."""
    path = os.path.join(out, 'answers.npz')
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as f:
            kept = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:  # cut short: said, then solved again
        print(f"note: {path} cannot be read ({str(e) or type(e).__name__}): the test views are solved again")
        return None
    same = kept.get('step') == results_step(os.path.join(out, 'results.json')) and kept.get('steps') == steps
    return dict(kept, path=path) if same and len(kept.get('rows', ())) else None


def submission_vote(out):
    """The vote the submission of the run in out follows, as its results.json says ('this checkpoint', 'pooled
    over the evaluations at steps ...'), or None (no such file, or no submission in it)."""
    try:
        with open(os.path.join(out, 'results.json')) as f:
            return json.load(f)['arc_submission']['vote']
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_submission(path, tasks, fallback=False):
    """The adapted run's submission (path) completed with every task of the file ({id: task}): a task left out of
    the adaptation answers each of its test inputs [[0]] (the submission's answer where the vote has none), one
    entry where it gives no list of them. Without a submission, nothing to do (train.py said why), or with
    `fallback` (no adapted run to solve with) one that answers every task so."""
    try:
        with open(path) as f:
            theirs = json.load(f)
        if not isinstance(theirs, dict):
            raise ValueError(f"{path} holds no {{task id: answers}}")
    except (OSError, ValueError):
        if not fallback:
            return
        theirs = {}
    none = {'attempt_1': [[0]], 'attempt_2': [[0]]}
    missing = {k: [dict(none) for _ in (t['test'] if isinstance(t, dict) and isinstance(t.get('test'), list)
                                        and t['test'] else [0])]
               for k, t in tasks.items() if k not in theirs}
    if missing:  # else left as train.py wrote it, at the time its budget planned
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {**theirs, **missing})


def fallback_submission(path, tasks):
    """A submission for an adaptation that failed (the ARC Prize scores a complete file only): the run's own where
    its final evaluation wrote one, completed, else every task of the file ({id: task}) answered [[0]]; what was
    written, in words."""
    try:
        complete_submission(path, tasks, fallback=True)
    except OSError as e:
        return f"and no submission could be written at {path} ({e.strerror or e})"
    return f"the submission answers every task [[0]] that it had no answer for, so that it is complete: {path}"


def run_of(init_from, saved, trained_on):
    """What an adaptation keeps of the checkpoint's run: (train.py's keys of its recipe and model, the side of its
    canvas, the data it learned: a data_shape or dataset.json dict, or None). A checkpoint of train.py carries its
    config (`saved`) and its data's shape (`trained_on`); a published step_<N> neither: the all_config.yaml beside
    it gives them (the data from the dataset its data_paths names, where that is on this machine, as for a
    checkpoint saved before it recorded its data). With neither: train.py's defaults, ARC-AGI's canvas."""
    if saved is None:
        saved = published_run(init_from)
    if saved and not trained_on and saved.get('data_path'):
        try:
            trained_on = load_metadata(saved['data_path'], 'train')
        except (OSError, ValueError):  # a dataset built elsewhere
            trained_on = None
    keep = {k: v for k, v in (saved or {}).items() if k in RECIPE or k in MODEL_KEYS}
    return keep, int(round(((trained_on or {}).get('seq_len') or ARC_SEQ_LEN) ** 0.5)), trained_on


def key_of(tasks, init_from, settings):
    """What makes an adaptation this one: the tasks (as read: the file's name and spacing do not count), the
    checkpoint it starts from (its path, size and time: another file at the same path is another checkpoint)
    and the settings. A hash of them, 12 hex digits."""
    st = os.stat(init_from)
    text = json.dumps(dict(tasks=tasks, init_from=os.path.abspath(init_from), size=st.st_size,
                           mtime_ns=st.st_mtime_ns, **settings), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_folder(folder, record):
    """A folder that holds another adaptation (its adapt.json's key is another), or a dataset or run that no
    adapt.json describes, is refused in one line: nothing in it is replaced."""
    path = os.path.join(folder, RECORD)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                theirs = json.load(f)
        except (OSError, ValueError) as e:
            fail(f"adapt_dir={folder}: its {RECORD} cannot be read ({e}): give another --adapt_dir, or remove the "
                 "folder to adapt there")
        if not isinstance(theirs, dict) or theirs.get('key') != record['key']:
            what = (f"{theirs.get('task')} from {theirs.get('init_from')}, adapt_aug={theirs.get('adapt_aug')}, "
                    f"adapt_args={theirs.get('adapt_args')!r}") if isinstance(theirs, dict) else 'unknown'
            fail(f"adapt_dir={folder} holds the adaptation of another task file, checkpoint or settings ({what}): "
                 "give another --adapt_dir (the default, out/adapt/<name>-<key>, keeps each apart), or remove "
                 "that folder to adapt there")
    elif any(os.path.exists(os.path.join(folder, n)) for n in ('challenges.json', 'data', 'run')):
        fail(f"adapt_dir={folder} holds a dataset or a run that no {RECORD} describes (an adaptation of an earlier "
             "solve.py, or other files): give another --adapt_dir, or remove them")


def write_json(path, obj):
    write_atomic(path, lambda f: json.dump(obj, f))


def stopped(task, script, out, rc):
    """The end of an adaptation that a stop signal interrupted, in one line; exit HUNG_EXIT after a SIGTERM (a
    job that a launcher may run again), 130 after a Ctrl-C: the adaptation is unfinished, though train.py, its
    checkpoint saved, exited 0."""
    name = STOPPED[0]
    code = HUNG_EXIT if name == 'SIGTERM' else 128 + signal.SIGINT
    last = newest(out)
    if script == 'prepare_arc.py':
        what = 'while its dataset was built (prepare_arc.py): nothing of the dataset kept'
    elif rc == 0 and last:
        what = f"while adapting: train.py saved {last[1]} (step {last[0]}) and ended"
    else:
        what = (f"while adapting: train.py ended with exit code {rc}; the last checkpoint kept: "
                f"{last[1] if last else 'none'}")
    print(f"task={task}: stopped by {name} {what}; rerun the same command to continue the adaptation (exit code "
          f"{code})", file=sys.stderr, flush=True)
    raise SystemExit(code)


def adapt(task, tasks, every, init_from, keep, canvas, minutes, aug, extra, adapt_dir, device, started):
    """The tasks ({id: task}) of the file `task` adapted to from the checkpoint init_from with the keys `keep`
    of its run (run_of) on a canvas of canvas x canvas, with adapt_aug `aug` and train.py flags `extra`, its
    submission written within `minutes` of `started` (solve.py's start, time.time()): train.py's budget is what
    the start and the dataset's build left of them. Returns (the adapted run's last checkpoint, its dataset). A
    finished adaptation of the same tasks, checkpoint and settings is used as it is; a stopped one goes on from
    its last checkpoint. One that fails still leaves a submission of the file's tasks (`every`), [[0]] where it
    has no answer."""
    settings = dict(adapt_aug=aug, adapt_args=' '.join(extra.split()))
    record = dict(key=key_of(tasks, init_from, settings), task=os.path.abspath(task),
                  init_from=os.path.abspath(init_from), tasks=list(tasks), **settings)
    name = re.sub(r'[^\w.-]+', '_', os.path.splitext(os.path.basename(task))[0])
    folder = adapt_dir or os.path.join('out', 'adapt', f"{name}-{record['key']}")
    data, out = os.path.join(folder, 'data'), os.path.join(folder, 'run')
    check_folder(folder, record)
    if finished(out):
        step, ckpt = newest(out)
        print(f"task={task}: adapted before in {folder} (from {init_from}, to step {step}): solving with {ckpt}; "
              "remove that folder to adapt again")
        return ckpt, data
    made = not os.path.exists(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        write_json(os.path.join(folder, RECORD), record)
        write_json(os.path.join(folder, 'challenges.json'), tasks)
    except OSError as e:
        fail(f"adapt_dir={folder}: cannot write there ({e.strerror or e})")
    steps = []
    if not all(os.path.isfile(os.path.join(data, s, 'dataset.json')) for s in ('train', 'test')):
        steps.append(('prepare_arc.py', lambda: [f"--challenges={os.path.join(folder, 'challenges.json')}",
                                                 f'--canvas={canvas}', f'--num_aug={aug}', f'--output_dir={data}']))
    # 0 would be no budget: a start that took it all still gets train.py's shortest run, two steps and the evaluation
    left = lambda: max(round(minutes - (time.time() - started) / 60, 4), 0.001)
    steps.append(('train.py', lambda: [*[f'--{k}={v}' for k, v in keep.items()], f'--init_from=resume:{init_from}',
                                       f'--data_path={data}', f'--out_dir={out}', f'--max_minutes={left():g}',
                                       '--epochs=1000000', '--eval_every_epochs=1000000', '--tensorboard=False',
                                       '--arc_answers=True', '--xla_cache_dir=']
                  + ([f'--device={device}'] if device != 'auto' else [])
                  + extra.split()))
    last = newest(out)
    print(f"task={task}: {plural(len(tasks), 'new task')} in {folder}: "
          + (f"its dataset built into {data} (prepare_arc.py --challenges), then " if len(steps) > 1 else '')
          + (f"the adaptation stopped at step {last[0]} goes on" if last else "the network adapted to it")
          + f" into {out} (train.py), its submission within {minutes:g} min of solve.py's start")
    with stop_requests():
        for script, args in steps:
            rc = run_step(script, args()) if not STOPPED else None
            if STOPPED:
                stopped(task, script, out, rc)
            if rc:
                if script == 'prepare_arc.py':  # a half-built dataset is built again by the rerun
                    shutil.rmtree(data, ignore_errors=True)
                fail(f"task={task}: {script} failed (its message is above), nothing adapted: "
                     + fallback_submission(os.path.join(out, 'submission.json'), every))
    if not finished(out):  # train.py stopped by a signal of its own
        last = newest(out)
        print(f"task={task}: train.py ended before its final evaluation (a stop request of its own?); the last "
              f"checkpoint kept: {last[1] if last else 'none'}; rerun the same command to continue the "
              f"adaptation (exit code {HUNG_EXIT})", file=sys.stderr, flush=True)
        raise SystemExit(HUNG_EXIT)
    return newest(out)[1], data
