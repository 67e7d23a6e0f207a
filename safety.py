"""
The run's safety net: what keeps a training run's work when a spot VM is preempted, a bucket is down, a host
has other files, a checkpoint is corrupt or the loss diverges. train.py tells the learning story and calls
this for the rest:
    run = Run(config, dev)                  start-up checks on every rank, host agreement, the run's folders
    step, carry = run.resume(model, ...)    the newest checkpoint every rank can load (or init_from's weights)
    run.save(step, ...)                     a checkpoint only of sane weights, written atomically, uploaded
    run.log(kind, line, step, groups)       metrics.jsonl (+ the bucket's copy), W&B and TensorBoard, never
                                            fatal
    run.close()                             bounded waits for uploads and W&B at exit, the out_dir's lock
                                            removed
It also holds the checkpoint files themselves (save_atomic, load_checkpoint, list_checkpoints,
prune_checkpoints) for a local folder or a gs:// prefix; gcs.py is the storage client underneath.

Every method that more than rank 0 needs is called by every rank at the same point: verdicts are agreed
through Device.agree (a reduction every rank runs), so all ranks stop together with one message, and a
device value is read on every rank before rank 0 alone writes files (a TPU pod's ranks must run the same
graphs).
"""
import atexit
import contextlib
import faulthandler
import glob
import hashlib
import json
import numbers
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time

import torch

import gcs
from configurator import Output  # the script's output, installed at its first line
from data import IN_USE, check_split, load_metadata
from puzzles import puzzle_type

# a weight above this is divergence, not learning: trained TRM weights stay near their init scale (about 1 at
# most), and float32 activations overflow within a few blocks of weights this large
MAX_WEIGHT = 1e4
# the code whose copies every host must share (a pod runs one command on every host)
CODE_FILES = ('train.py', 'model.py', 'step.py', 'evaluate.py', 'safety.py', 'data.py', 'puzzles.py', 'device.py')
HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# checkpoint files, in a local folder or under a gs:// prefix

CKPT_RE = re.compile(r'ckpt_(\d{8})\.pt$')


def checkpoint_name(step):
    return f'ckpt_{step:08d}.pt'


class CheckpointError(RuntimeError):
    pass


def save_atomic(obj, path):
    """torch.save to path.tmp, then rename: readers see the old file or the whole new one, never half. A
    failure (a full disk) removes the .tmp and raises CheckpointError naming the path and the OS error."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = e.__cause__ or e.__context__ or e
        why = os.strerror(cause.errno) if getattr(cause, 'errno', None) else str(e)
        raise CheckpointError(f"could not write {path}: {why}") from e


def load_checkpoint(path, name=None):
    """A checkpoint as a dict of CPU tensors; weights_only refuses pickles that would run code. name: what
    errors call the file (the bucket URI of a downloaded copy)."""
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {name or path} is corrupt or truncated and was not loaded: "
                              f"{e}") from e


def weights_in(ckpt):
    """What a loaded checkpoint file holds: dict(weights in this model's names (the EMA's when there are),
    config: the training run's or None, step, data: the shape it trained on, ema: whether they are the
    EMA's), or None when it is neither a checkpoint of train.py nor a state dict (the reference's keys or
    ours)."""
    from model import from_reference_state_dict
    if isinstance(ckpt, dict) and isinstance(ckpt.get('model'), dict):
        saved = ckpt.get('config') if isinstance(ckpt.get('config'), dict) else {}
        return dict(weights=dict(ckpt.get('ema') or ckpt['model']), config=saved, step=ckpt.get('step'),
                    data=ckpt.get('data'), ema=bool(ckpt.get('ema')))
    if isinstance(ckpt, dict) and ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
        return dict(weights=from_reference_state_dict(ckpt), config=None, step=None, data=None, ema=False)
    return None


def list_checkpoints(folder):
    """{step: path} of the complete checkpoints in a local folder or gs:// prefix (temporary files and
    half-done uploads never match: local writes are renamed when whole, GCS objects appear when whole)."""
    if gcs.is_gcs(folder):
        names = [uri for uri, _ in gcs.list_objects(folder.rstrip('/') + '/ckpt_')]
    else:
        names = glob.glob(os.path.join(folder, 'ckpt_*.pt'))
    return {int(m.group(1)): n for n in names if (m := CKPT_RE.search(n))}


def prune_checkpoints(folder, keep_last_n, best_step, corrupt=(), protect=-1, delete_all=False):
    """Keep the newest keep_last_n checkpoints that are not known to be corrupt (0: keep all), the best, and
    `protect` (the newest one known to train on); a known-corrupt file holds no slot. delete_all: remove every
    checkpoint (a run started over)."""
    found = list_checkpoints(folder)
    good = sorted(s for s, p in found.items() if p not in corrupt)
    keep = set() if delete_all else \
        set(good if keep_last_n == 0 else good[-keep_last_n:]) | {best_step, protect}
    for step, path in found.items():
        if step not in keep:
            try:
                gcs.delete_object(path) if gcs.is_gcs(path) else os.remove(path)
            except Exception as e:
                print(f"warning: could not delete old checkpoint {path}: {e}")


# -----------------------------------------------------------------------------
# stop requests: SIGTERM (spot preemption) and Ctrl-C save a checkpoint, then every rank exits at the same
# step

STOP = dict(requested=False, signal=None, count=0)


def on_signal(signum, frame):
    """The first: a stop request, said at once; the loop saves a checkpoint at the ranks' next stop check (a
    few seconds at most) and exits. A second: said, and the save goes on; a third ends the process at once."""
    name = signal.Signals(signum).name
    STOP['count'] += 1
    if STOP['count'] == 1:
        STOP.update(requested=True, signal=name)
        say(f"pid {os.getpid()}: got {name}: saving a checkpoint within seconds, then exiting (a second "
            "signal does not stop the save; a third ends the process at once, without it)")
    else:
        say(f"pid {os.getpid()}: got {name} again: the save goes on; a third signal ends the process at "
            "once, without the checkpoint")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def say(line):
    """A line from a signal handler, written straight to stdout's and train.log's files: the handler may run
    in the middle of a print, and Python's streams refuse to be entered twice. A closed stdout: train.log."""
    for f in (sys.stdout, Output.log):
        try:
            os.write(f.fileno(), (line + '\n').encode())
        except (OSError, ValueError, AttributeError):
            pass


def install_signal_handlers():
    """In a process's main thread (torch_xla.launch runs the training in a worker thread)."""
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def forward_signals():
    """In torch_xla's launcher: SIGTERM and Ctrl-C go on to its worker processes, which save and stop (each
    says so); the launcher itself waits for them."""
    import multiprocessing

    def forward(signum, frame):
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    os.environ['TRM_LAUNCHER_PID'] = str(os.getpid())  # the workers' parent, for follow_launcher


def follow_launcher():
    """In a torch_xla worker: its own process group, so a Ctrl-C reaches it once (through the launcher), and
    a SIGTERM from the kernel when the launcher dies (even by SIGKILL): an orphan saves and stops instead of
    holding the chips and the out_dir."""
    import ctypes
    with contextlib.suppress(OSError):
        os.setpgrp()
    with contextlib.suppress(Exception):  # Linux only (TPU VMs); elsewhere the launcher's forwarding only
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if orphaned():  # gone before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def orphaned():
    return os.environ.get('TRM_LAUNCHER_PID', str(os.getppid())) != str(os.getppid())


def exit_if_orphaned(code):
    """In a torch_xla worker whose launcher is gone, at the end of its work: exit now (its process pool would
    wait for the next task forever)."""
    if orphaned():
        release_locks()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# -----------------------------------------------------------------------------
# an out_dir belongs to one run: a lock file in the local folder (and a lock object beside a gs:// out_dir's
# checkpoints), taken by rank 0 at the start and removed at every exit: the loop's end, a stop request, a
# failed check (fail_together), any other exit of the process (atexit)

LOCK_NAME = 'run.lock'
HELD = []  # the locks this process holds: local paths or gs:// URIs
# a gs:// lock's lease: its holder renews it every third of this; a run on another host (a replacement VM)
# takes over a lock whose lease ran out, and waits for one that has not, unless it is renewed meanwhile
LEASE_S = float(os.environ.get('TRM_LOCK_LEASE_S') or 120)


def boot_id():
    """This boot of this host ('' off Linux): a lock from before a restart is stale whatever its pid."""
    try:
        with open('/proc/sys/kernel/random/boot_id') as f:
            return f.read().strip()
    except OSError:
        return ''


def lock_record():
    return dict(host=socket.gethostname(), pid=os.getpid(), since=time.strftime('%Y-%m-%d %H:%M:%S %Z'),
                boot=boot_id(), renewed=time.time(), lease=LEASE_S)


def holder_gone(rec):
    """Whether the run holding a lock ran on this host and is gone (ended, killed, or the host restarted)."""
    if not isinstance(rec, dict) or rec.get('host') != socket.gethostname():
        return False  # another host's run: this host cannot tell
    if rec.get('boot') and rec['boot'] != boot_id():
        return True
    try:
        os.kill(int(rec['pid']), 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, TypeError, ValueError):  # PermissionError: alive, another user's
        pass
    return False


def in_use(where, rec, remove):
    who = f"the run on {rec.get('host')}, pid {rec.get('pid')}, since {rec.get('since')}" \
        if isinstance(rec, dict) else 'a run whose lock cannot be read'
    return (f"{where} is in use by {who} (lock {remove}): wait for it to end, pick another --out_dir, or "
            "remove the lock if that run is gone")


def taken_over(rec, where):
    """Whether the lock at `where`, holding rec, belongs to a run that is gone (and may be taken over: said
    so)."""
    if not holder_gone(rec):
        return False
    print(f"{where}: taking over the lock of a run that is gone (on {rec['host']}, pid {rec['pid']}, "
          f"since {rec['since']})")
    return True


def lock_local(folder):
    """Rank 0: this folder's lock, created atomically (O_CREAT|O_EXCL); [] or [the problem]."""
    path = os.path.join(folder, LOCK_NAME)
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as e:
            if not isinstance(e, FileExistsError):
                return [f"cannot create the lock {path}: {e.strerror}; out_dir must be a folder this run can "
                        "write"]
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                rec = None
            if attempt == 0 and taken_over(rec, path):
                os.remove(path)
                continue
            return [in_use(folder, rec, path)]
        try:
            with os.fdopen(fd, 'w') as f:
                json.dump(lock_record(), f)
        except OSError as e:  # a full disk: the lock's record does not fit
            os.remove(path)
            return [f"cannot write the lock {path}: {e.strerror or e}; free some space in {folder}"]
        HELD.append(path)
        return []


def read_lock(uri, local):
    """The record of the lock object at uri (None: unreadable); gcs.NotFoundError when there is none."""
    copy = os.path.join(local, f'.{LOCK_NAME}.{os.getpid()}')
    gcs.download_file(uri, copy)
    with open(copy) as f:
        text = f.read()
    os.remove(copy)
    try:
        return json.loads(text)
    except ValueError:
        return None


def lease_ran_out(rec, uri, local):
    """Whether the lock of a run on another host has outlived its lease (and may be taken over: said so).
    One still within it is waited for (a stop ends the wait); a renewal meanwhile means its run is alive."""
    if not isinstance(rec, dict) or rec.get('host') == socket.gethostname() or \
            not isinstance(rec.get('renewed'), (int, float)):
        return False  # this host's runs: holder_gone decides; a lock without a lease: its run's to remove
    left = rec['renewed'] + float(rec.get('lease', LEASE_S)) - time.time()
    if left > 0:
        age = time.time() - rec['renewed']
        print(f"{uri}: held by the run on {rec['host']}, pid {rec.get('pid')}, renewed {age:.0f} s ago: "
              f"waiting {left:.0f} s for its lease to run out", flush=True)
        end = time.time() + left
        while time.time() < end:
            if STOP['requested']:
                return False
            time.sleep(min(1.0, end - time.time()))
        try:
            now = read_lock(uri, local)
        except gcs.NotFoundError:
            return True
        if now != rec:
            return False  # renewed (or taken by another run): in use
    print(f"{uri}: taking over the lock of the run on {rec['host']}, pid {rec.get('pid')}, since "
          f"{rec.get('since')}: its lease ran out (last renewed {time.time() - rec['renewed']:.0f} s ago)")
    return True


def lock_bucket(prefix, local):
    """Rank 0: the lock object beside a gs:// out_dir's checkpoints, created only if absent (a generation
    precondition), then renewed on a thread; [] or [the problem]. A bucket that cannot be reached: a warning
    (its uploads are retried)."""
    uri, mine = f"{prefix.rstrip('/')}/{LOCK_NAME}", lock_record()
    try:
        for attempt in range(2):
            if gcs.create_if_absent(uri, json.dumps(mine).encode()):
                HELD.append(uri)
                renew_lock(uri, mine, local)
                return []
            rec = read_lock(uri, local)
            if rec == mine:  # our own create, whose reply was lost and retried
                HELD.append(uri)
                renew_lock(uri, mine, local)
                return []
            if attempt == 0 and (taken_over(rec, uri) or lease_ran_out(rec, uri, local)):
                gcs.delete_object(uri)
                continue
            return [in_use(prefix, rec, uri)]
    except gcs.NotFoundError:  # removed between the create and the read: its run just ended
        return lock_bucket(prefix, local)
    except gcs.GCSError as e:
        print(f"warning: cannot lock {prefix} ({e}); a second run into it would not be stopped")
        return []


def renew_lock(uri, rec, local):
    """Rank 0: a daemon thread that rewrites the lock object's `renewed` every third of its lease while this
    process holds it; a lock found taken over (this run stalled past its lease) is said once, then left."""
    def renew():
        client = gcs.GCS(retries=2, timeout=(5, 10))
        while True:
            time.sleep(LEASE_S / 3)
            if uri not in HELD:
                return
            try:
                now = read_lock(uri, local)
                if isinstance(now, dict) and (now.get('host'), now.get('pid')) != (rec['host'], rec['pid']):
                    print(f"warning: {uri} was taken over by the run on {now.get('host')}, pid "
                          f"{now.get('pid')} (this run's lease ran out): stop one of the two runs")
                    return
                client.put(uri, json.dumps(dict(rec, renewed=time.time())).encode())
            except Exception as e:  # the next renewal tries again; the lease outlasts two failures
                print(f"warning: could not renew the lock {uri} ({e})")
    threading.Thread(target=renew, daemon=True).start()


def mark_data(root, out_dir):
    """Rank 0: a mark in the dataset's folder while the run holds it, removed with the locks: a builder
    asked to replace the dataset says that this run goes on with the old one (a read-only folder: no mark)."""
    path = os.path.join(root, f"{IN_USE}{socket.gethostname()}.{os.getpid()}")
    try:
        with open(path, 'w') as f:
            json.dump(dict(host=socket.gethostname(), pid=os.getpid(), out_dir=out_dir), f)
        HELD.append(path)
    except OSError:
        pass


def release_locks(quick=False):
    """Remove the locks this process holds. A lock object gets a bounded wait, one short attempt after a stop
    request (a spot VM's notice is 30 s, the stop checkpoint's upload had most of it): one left behind
    expires with its lease."""
    while HELD:
        where = HELD.pop()
        try:
            if gcs.is_gcs(where):
                gcs.GCS(retries=0, timeout=(2, 3)).delete(where) if quick else \
                    gcs.GCS(retries=2, timeout=(5, 10)).delete(where)
            else:
                os.remove(where)
        except Exception as e:
            then = f"a run on another host takes it over once its lease ({LEASE_S:.0f} s) has run out" \
                if gcs.is_gcs(where) else "the next run on this host takes it over"
            print(f"warning: could not remove the lock {where} ({e}); {then}")


atexit.register(release_locks)


# -----------------------------------------------------------------------------
# a hung rank (a dead host, a stuck collective) leaves every chip of the slice idle without a word: the
# watchdog ends it, so a person or a relaunch loop can act

HUNG_EXIT = 75  # EX_TEMPFAIL: run the same command again (it resumes from the last checkpoint)
# tests only: the progress report that blocks for good, once armed ('step 25', 'an evaluation batch'), as a
# rank stuck in a collective would
TEST_HANG_AT = os.environ.get('TRM_TEST_HANG_AT', '')


class Watchdog:
    """Watchdog(minutes, record): when `minutes` pass with no progress() (a finished training step or
    evaluation batch), every thread's stack goes to stderr and train.log, record(values) is called (rank 0:
    a line of metrics.jsonl), the out_dir's lock is removed and the process exits with HUNG_EXIT. It is armed
    by the `warmup`-th report (the first steps compile their graphs) and pause(n) disarms it for the next n
    reports (an evaluation's first batch may compile); minutes=0: off."""

    def __init__(self, minutes, record=None, warmup=2):
        self.limit, self.record, self.waiting = 60.0 * minutes, record, warmup
        self.last, self.what, self.step = time.time(), 'start-up', None
        self.done = threading.Event()
        if self.limit > 0:
            threading.Thread(target=self.watch, daemon=True, name='watchdog').start()

    def progress(self, what, step=None):
        self.last, self.what, self.step = time.time(), what, self.step if step is None else step
        self.waiting = max(0, self.waiting - 1)
        if TEST_HANG_AT and what == TEST_HANG_AT and not self.waiting:
            threading.Event().wait()

    def pause(self, reports=1):
        self.waiting = max(self.waiting, reports)

    def stop(self):
        self.done.set()

    def watch(self):
        while not self.done.wait(min(30.0, self.limit / 4)):
            if not self.waiting and time.time() - self.last > self.limit:
                self.fire()

    def fire(self):
        idle = time.time() - self.last
        print(f"watchdog: nothing finished for {idle / 60:.1f} min (watchdog_minutes={self.limit / 60:g}; "
              f"the last: {self.what}) in pid {os.getpid()}: a hung host or collective. Every thread's stack "
              f"follows; exiting with code {HUNG_EXIT}: the same command with --init_from=resume continues "
              f"from the last checkpoint", file=sys.stderr, flush=True)
        for f in (sys.stderr, Output.log):
            try:
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            except (AttributeError, OSError, ValueError):  # no train.log (a rank > 0), or a closed stream
                pass
        try:
            if self.record:
                self.record(dict(step=self.step, idle_s=round(idle, 1), limit_min=self.limit / 60,
                                 last=self.what, pid=os.getpid(), host=socket.gethostname()))
        except Exception as e:
            print(f"watchdog: could not record it ({e})", file=sys.stderr)
        release_locks()
        os._exit(HUNG_EXIT)  # the main thread is stuck: only a hard exit ends the process


# -----------------------------------------------------------------------------
# verdicts shared by every rank

def fingerprint(text):
    """A 24-bit hash of text: exact in float32, so ranks can compare it with a min/max reduction."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], 'big')


def fail_together(dev, problems, what):
    """Every rank learns whether any rank has a problem, and then all exit with one message (the out_dir's
    lock removed first: a torch_xla worker process ends without running atexit)."""
    failed = dev.agree([float(r == dev.rank and bool(problems)) for r in range(dev.world_size)])
    ranks = [r for r in range(dev.world_size) if failed[r] > 0]
    if ranks:
        where = f" on rank(s) {ranks}" if dev.world_size > 1 else ''
        mine = '; '.join(problems) if problems else f"see rank {ranks[0]}'s output"
        release_locks()
        dev.shutdown()
        raise SystemExit(f"{what} failed{where}: {mine}")


def fail_if_ranks_differ(dev, values, problem):
    """fail_together when the ranks hold different values (fingerprints of what they loaded or read)."""
    lows, highs = dev.agree(values, 'min'), dev.agree(values, 'max')
    differ = [i for i, (lo, hi) in enumerate(zip(lows, highs)) if lo != hi]
    fail_together(dev, [problem(differ)] if differ and dev.master else [], 'host agreement')


def data_shape(meta):
    """What a model trained on a dataset is bound to: its puzzle kind, sequence length and vocabulary."""
    return dict(puzzle_type=puzzle_type(meta), seq_len=int(meta['seq_len']),
                vocab_size=int(meta['vocab_size']))


def describe_data(shape):
    kind = f"{shape['puzzle_type']} puzzles" if shape.get('puzzle_type') else 'puzzles'
    return f"{kind} of seq_len {shape['seq_len']}" + (f", vocab_size {shape['vocab_size']}"
                                                      if 'vocab_size' in shape
                                                        else '')


def startup_problems(cfg, dev, local):
    """Everything a run needs, checked before the first step on every rank: [message]. Each rank sees its own
    files (a pod's hosts each have their own disk), so each checks them."""
    problems, shapes, root = [], {}, cfg['data_path']
    for split in ('train', 'test'):
        found = check_split(root, split)
        problems += found
        if not found:
            shapes[split] = data_shape(load_metadata(root, split))
    if len(shapes) == 2 and shapes['train'] != shapes['test']:  # a half-done rebuild, or splits of two
                                                                # datasets
        problems.append(f"{root}: the train split holds {describe_data(shapes['train'])}, the test split "
                        f"{describe_data(shapes['test'])}; rebuild the dataset whole (prepare_sudoku.py / "
                        f"prepare_maze.py) or point data_path at one whose splits agree")
    init_from = cfg['init_from']
    if init_from not in ('scratch', 'resume') and not os.path.isfile(init_from):
        problems.append(f"init_from={init_from!r} is not 'scratch', 'resume' or a checkpoint file on this "
                        "host")
    for what in ('global_batch_size', 'eval_batch_size'):
        B = cfg[what] or cfg['global_batch_size']
        if B % dev.world_size:
            problems.append(f"{what}={B} is not divisible by the world size {dev.world_size}")
    k = cfg['gradient_accumulation_steps']
    if cfg['global_batch_size'] % (dev.world_size * k):
        problems.append(f"global_batch_size={cfg['global_batch_size']} is not divisible by the world size "
                        f"{dev.world_size} x gradient_accumulation_steps={k}")
    out_dir = cfg['out_dir']
    if dev.hosts > 1 and not gcs.is_gcs(out_dir):
        problems.append(f"out_dir={out_dir!r} is local, but the run spans {dev.hosts} hosts: only one would "
                        "hold the checkpoints; use --out_dir=gs://BUCKET/...")
    fresh = init_from != 'resume' and not cfg['eval_only']  # a new run's files: scratch, or a file's weights
    if fresh and cfg['overwrite'] and dev.master and os.path.isfile(init_from) and CKPT_RE.search(init_from) \
            and os.path.isdir(local) and os.path.samefile(os.path.dirname(os.path.abspath(init_from)), local):
        problems.append(f"init_from={init_from} lies in {local}, whose checkpoints --overwrite=True deletes: "
                        "copy it elsewhere first and start from the copy")
    new_run = fresh and not cfg['overwrite'] and dev.master
    held = {local: list_checkpoints(local)} if new_run else {}
    if gcs.is_gcs(out_dir) and dev.master:
        found, why = bucket_checkpoints(out_dir, init_from == 'resume')
        problems += why
        if new_run and found:
            held[out_dir] = found
    for folder, steps in held.items():
        if steps:
            problems.append(f"{folder} already holds checkpoints {sorted(steps)}: continue them with "
                            "--init_from=resume, pick another --out_dir, or replace them with "
                            "--overwrite=True")
    return problems


def bucket_checkpoints(out_dir, resume):
    """Rank 0 at start: ({step: uri} of out_dir's checkpoints or None, [problem]). The listing is also the
    check that the bucket lets this run in: a bucket that answers no (it does not exist, no permission: HTTP
    4xx) stops the run at start, as does one that cannot be reached when resuming (no checkpoint could be
    picked); a new run goes on without it (its uploads are retried)."""
    bucket = gcs.split_gcs(out_dir)[0]
    try:
        return list_checkpoints(out_dir), []
    except gcs.Stopped as e:
        return None, [f"{e}; nothing was started"]
    except gcs.GCSError as e:
        if e.refused:
            return None, [f"out_dir={out_dir}: the bucket {bucket} answered HTTP {e.status} ({e}): check "
                          "that the bucket exists and that this identity may read and write it"]
        if resume:
            return None, [f"cannot list the checkpoints in {out_dir} ({e}); retry when the bucket is "
                          "reachable"]
        print(f"warning: cannot list {out_dir} ({e}); not checked for an earlier run's checkpoints; training "
              "goes on, its uploads are retried")
        return None, []


# -----------------------------------------------------------------------------
# the run

class Clock:
    """This process's wall seconds by phase: start-up (to the first step), training (the loop, evaluations
    apart, checkpoint saves included) and evaluation."""

    def __init__(self, started):
        self.started, self.loop_start, self.eval = started, None, 0.0

    def __call__(self):
        now = time.time()
        start = self.loop_start or now
        return dict(startup=start - self.started, train=now - start - self.eval, eval=self.eval)

    @contextlib.contextmanager
    def evaluating(self):
        t = time.time()
        try:
            yield
        finally:
            self.eval += time.time() - t


def local_folder(out_dir):
    """The default local copy of a gs:// out_dir: out/BUCKET/PREFIX, one folder per out_dir (two runs ending
    in the same name never share one)."""
    bucket, prefix = gcs.split_gcs(out_dir)
    return os.path.join('out', bucket, *[p for p in prefix.split('/') if p not in ('', '.', '..')])


class Run:
    """One training run's folders, records and verdicts. cfg: train.py's config (a dict of its keys)."""

    def __init__(self, cfg, dev, started=None):
        """started: the process's start time (time.time()), for the start-up time in results.json."""
        self.cfg, self.dev, self.master = cfg, dev, dev.master
        Output.install()
        gcs.default_client().retries = cfg['gcs_retries']  # every bucket request of this run, uploads
                                                           # included
        out_dir = cfg['out_dir']
        self.gs_out = out_dir if gcs.is_gcs(out_dir) else ''
        self.local = (cfg['local_dir'] or local_folder(out_dir)) if self.gs_out else out_dir
        gcs.default_client().stop = lambda: STOP['requested']  # until resume(): a stop ends bucket waits at
                                                               # start
        self.best = dict(step=-1, exact_accuracy=-1.0)
        self.resumed_from = self.last_good = self.run_id = None
        self.corrupt = []        # checkpoints found unreadable: kept, but they hold no place among the kept
                                 # ones
        self.verified = -1       # newest checkpoint step whose next step's loss was seen finite
        self.records = self.wandb = self.uploader = self.board = None
        self.log_uploads = 0
        self.stop_every, self.t_calibrate = 1, None
        self.timing = {}         # wall seconds by phase of this run's earlier processes (from the checkpoint)
        self.clock = Clock(started or time.time())  # this process's wall seconds by phase
        self.data_path = self.fetch_data()
        self.check_start()

    def fetch_data(self):
        """The local copy of a gs:// data_path (one process per host fetches it, the others wait)."""
        path, dev = self.cfg['data_path'], self.dev
        if not gcs.is_gcs(path):
            return path
        problems = []
        if dev.local_rank == 0:
            try:
                gcs.fetch_tree(path, self.cfg['data_cache_dir'])
            except Exception as e:
                problems = [f"cannot fetch {path}: {e}"]
        fail_together(dev, problems, f'fetching {path}')
        dev.barrier()
        return gcs.fetch_tree(path, self.cfg['data_cache_dir'])  # complete now: returns the local copy

    def check_start(self):
        """All start-up checks before the first step, then every host's config, data and code compared; then
        rank 0 takes the out_dir's lock (before it touches any file there) and logs the output to
        train.log."""
        cfg, dev = dict(self.cfg, data_path=self.data_path), self.dev
        fail_together(dev, startup_problems(cfg, dev, self.local), 'start-up checks')
        code = ''.join(open(os.path.join(HERE, f)).read() for f in CODE_FILES)
        meta = ''.join(open(os.path.join(self.data_path, s, 'dataset.json')).read()
                       for s in ('train', 'test'))
        names = ('config', 'dataset metadata', 'code')
        fail_if_ranks_differ(dev, [fingerprint(json.dumps(self.cfg, sort_keys=True)), fingerprint(meta),
                                   fingerprint(code)],
                             lambda i: f"the hosts differ in their {', '.join(names[k] for k in i)}: copy "
                                       "the same files to every host")
        self.meta = load_metadata(self.data_path, 'train')
        if cfg['eval_only']:  # it writes nothing into out_dir: it may evaluate a running run's checkpoints
            return
        problems = []
        if self.master:
            try:
                os.makedirs(self.local, exist_ok=True)
            except OSError as e:  # a file, under a file, or where this user may not write
                problems = [f"out_dir={self.cfg['out_dir']}: cannot create the folder {self.local} "
                            f"({e.strerror}); out_dir must be a folder this run can write"]
            problems = problems or lock_local(self.local) or \
                (lock_bucket(self.gs_out, self.local) if self.gs_out else [])
        fail_together(dev, problems, 'out_dir lock')
        if self.master:
            log = os.path.join(self.local, 'train.log')
            if self.gs_out and cfg['init_from'] == 'resume' and not os.path.exists(log):  # a new machine
                gcs.download_if_there(f"{self.gs_out.rstrip('/')}/train.log", log,  # goes on with the log
                                      "train.log starts anew here, and its upload replaces the bucket's")
            Output.log_to(log)
            mark_data(self.data_path, cfg['out_dir'])
            for name in os.listdir(self.local):  # temporary files of saves and downloads that never finished
                if (name.endswith('.tmp') or name.startswith(('.rank',) + SNAPSHOTS)) and \
                        os.path.isfile(os.path.join(self.local, name)):
                    os.remove(os.path.join(self.local, name))
        problems = []
        if self.master and cfg['overwrite'] and cfg['init_from'] != 'resume':  # the old run's files go
            for folder in [self.local] + ([self.gs_out] if self.gs_out else []):
                try:
                    prune_checkpoints(folder, 0, -1, delete_all=True)
                except gcs.GCSError as e:  # nothing trained yet: stop here rather than mix two runs' files
                    problems.append(f"--overwrite=True cannot delete the checkpoints in {folder} ({e}); retry "
                                    "when the bucket is reachable")
        fail_together(dev, problems, 'overwrite')

    # --- the starting point ----------------------------------------------------------------------------

    def resume(self, model, ema_model, opt, loader, resume_fixed):
        """The starting point: (step, the carry of this rank's rows or None). init_from='resume' loads the
        newest checkpoint every rank can read, refusing one saved with other `resume_fixed` keys; a file loads
        its weights (ours, or a state dict of the reference implementation)."""
        cfg, dev, step, carry = self.cfg, self.dev, 0, None
        if cfg['init_from'] == 'resume':
            ckpt = self.find_resume_checkpoint()
            if ckpt is None and self.master:
                print(f"init_from=resume: no checkpoint in {cfg['out_dir']} yet, starting from scratch")
            if ckpt is not None:
                self.check_resume_config(ckpt['config'], resume_fixed, ckpt['step'])
                self.check_resume_data(ckpt)
                self.load_state(ckpt, model, ema_model, opt, loader)
                step, self.best = ckpt['step'], ckpt['best']
                self.timing = dict(ckpt.get('timing') or {})
                self.run_id = ckpt.get('run_id') or ckpt.get('wandb_run_id') or None
                lb = cfg['global_batch_size'] // dev.world_size  # the carry is saved for the global batch
                carry = {k: v[dev.rank * lb:(dev.rank + 1) * lb] for k, v in ckpt['carry'].items()}
                if dev.rank == 0:
                    dev.set_rng_state(ckpt['rng'])
                else:  # other ranks' exploration streams: reseeded deterministically from the step
                    dev.manual_seed(cfg['seed'] + dev.rank + 1000003 * step)
                weights = float(sum(p.double().nan_to_num().sum() for p in ckpt['model'].values()
                                    if p.is_floating_point()))  # a fingerprint of the loaded bytes, on the
                                                                # host
                fail_if_ranks_differ(dev, [weights], lambda _: "the ranks loaded different weights")
                self.verified = step
        elif cfg['init_from'] != 'scratch':
            load_weights(cfg['init_from'], model, ema_model)
            if self.master:
                print(f"loaded weights from {cfg['init_from']}")
        self.run_id = self.run_id or secrets.token_hex(4)
        self.last_good = self.resumed_from
        gcs.default_client().stop = None  # from here a stop saves a checkpoint, and its upload gets its time
        return step, carry

    def find_resume_checkpoint(self):
        """The newest checkpoint that every rank can load; rank 0 picks the step. Non-zero ranks read the
        bucket copy (the same bytes as rank 0's). Checkpoints found but none loadable, or a bucket that cannot
        be listed, is an error: never a fresh start that would overwrite them."""
        dev, local, remote = self.dev, self.local, self.gs_out
        found, problems = {}, []
        if os.path.isdir(local):
            found.update(list_checkpoints(local))
        if remote:
            try:
                for step, uri in list_checkpoints(remote).items():
                    if not dev.master or step not in found:
                        found[step] = uri
            except Exception as e:
                problems.append(f"cannot list the checkpoints in {remote} ({e}); retry when the bucket is "
                                "reachable")
        fail_together(dev, problems, 'init_from=resume')
        candidates = sorted(found, reverse=True) if dev.master else []
        for i in range(len(candidates) + 1 if dev.master else 10 ** 9):
            step = int(dev.agree([candidates[i] if i < len(candidates) else -1.0 if dev.master else 0.0])[0])
            if step < 0:
                break
            path = found.get(step) or f"{remote.rstrip('/')}/{checkpoint_name(step)}"
            ckpt = self.load_training_checkpoint(path, step)
            if dev.agree([float(ckpt is None)])[0] == 0:
                self.resumed_from = path
                return ckpt
        if found:
            fail_together(dev, [f"checkpoints found ({', '.join(found[s] for s in sorted(found))}) but none "
                                "could be loaded; nothing was overwritten"] if dev.master else [],
                          'init_from=resume')
        return None

    def load_training_checkpoint(self, path, step):
        """The checkpoint at path (downloaded first from a bucket, to a temporary file removed on every path),
        or None with a warning when it cannot be used."""
        dest = os.path.join(self.local, f'.rank{self.dev.rank}_{checkpoint_name(step)}')
        try:
            if gcs.is_gcs(path):
                os.makedirs(self.local, exist_ok=True)
                gcs.download_file(path, dest)
                ckpt = load_checkpoint(dest, name=path)
            else:
                ckpt = load_checkpoint(path)
            for k in ('model', 'step', 'carry', 'config', 'optimizer'):
                if k not in ckpt:
                    raise CheckpointError(f"{path} is not a training checkpoint of this trainer (no '{k}')")
            return ckpt
        except gcs.Stopped as e:
            raise SystemExit(f"{e}; nothing was changed")
        except Exception as e:
            print(f"warning: rank {self.dev.rank}: {e}; trying an older checkpoint")
            self.corrupt.append(path)
            return None
        finally:
            if os.path.exists(dest):
                os.remove(dest)

    def check_resume_config(self, saved, resume_fixed, step):
        cfg = self.cfg
        changed = [k for k in resume_fixed if k in saved and saved[k] != cfg[k]]
        fail_together(self.dev, [f"{self.resumed_from} was saved with "
                                 f"{', '.join(f'{k}={saved[k]!r}' for k in changed)}; this run has "
                                 f"{', '.join(f'{k}={cfg[k]!r}' for k in changed)}. A resume must keep them: "
                                 "start a new run (another out_dir) to change them"] if changed else [],
                      'resume')
        if self.master:
            other = {k: (saved[k], cfg[k]) for k in cfg if k in saved and saved[k] != cfg[k]}
            print(f"resuming from {self.resumed_from} (step {step})"
                  + ''.join(f"\n  {k}: {a!r} -> {b!r}" for k, (a, b) in other.items()))

    def check_resume_data(self, ckpt):
        """The dataset's shape must be the checkpoint's: its model and carry are bound to it. (Checkpoints
        from before `data` was saved: the carry's width is the sequence length.)"""
        saved = ckpt.get('data') or dict(seq_len=int(ckpt['carry']['inputs'].shape[-1]))
        now = {k: v for k, v in data_shape(self.meta).items() if k in saved}
        fail_together(self.dev, [f"{self.resumed_from} was trained on {describe_data(saved)} (data_path="
                                 f"{ckpt['config'].get('data_path')!r}); {self.data_path} holds "
                                 f"{describe_data(now)}. A resume keeps the data's shape: point --data_path "
                                 "at that dataset, or start a new run (another out_dir)"] if saved != now
                      else [], 'resume')

    def load_state(self, ckpt, model, ema_model, opt, loader):
        """A file that loads but whose parts do not fit this model (edited, or another trainer's): named."""
        try:
            model.load_state_dict(ckpt['model'])
            if ema_model is not model:
                ema_model.load_state_dict(ckpt['ema'] or ckpt['model'])
            opt.load_state_dict(ckpt['optimizer'])
            loader.load_state_dict(ckpt['loader'])
            problems = []
        except (RuntimeError, ValueError, KeyError) as e:
            problems = [f"{self.resumed_from} does not fit this run ({' '.join(str(e).split())[:300]}); the "
                        "file is kept. Move it aside to resume from the one before"]
        fail_together(self.dev, problems, 'resume')

    # --- checkpoints -----------------------------------------------------------------------------------

    def save(self, step, model, ema_model, opt, carry, loader_state, tag=''):
        """Every rank calls it: the carry gather and the sanity check are collectives, read on every rank;
        then rank 0 writes and uploads, and every rank learns whether that worked. Returns the checkpoint's
        path."""
        dev, keys = self.dev, sorted(carry)
        sane, *gathered = dev.read(self.checkpoint_tensors(model, ema_model, carry))  # the carry in `keys`
                                                                                      # order
        path, problems = os.path.join(self.local, checkpoint_name(step)), []
        if sane[0] == 0:
            problems = [f"the weights diverged by step {step} (non-finite or above {MAX_WEIGHT:g}): nothing "
                        f"saved. The last good checkpoint is {self.last_good or 'none'}; continue from it "
                        f"with --init_from=resume and a lower --lr (now {self.cfg['lr']})"]
        elif self.master:
            state = dict(model=model.state_dict(),
                         ema=ema_model.state_dict() if ema_model is not model else None,
                         optimizer=opt.state_dict(), step=step, loader=loader_state,
                         carry=dict(zip(keys, map(torch.from_numpy, gathered))), rng=dev.rng_state(),
                         config=self.cfg, best=self.best, run_id=self.run_id, timing=self.timing_total(),
                         data=data_shape(self.meta))
            try:
                self.write(state, path, tag)
            except Exception as e:
                problems = [f"saving {path} failed: {e}"]
        fail_together(dev, problems, f'checkpoint at step {step}')
        self.last_good = path
        return path

    def timing_total(self):
        """Wall seconds by phase over all of this run's processes: the checkpoint's totals plus this
        process's."""
        now = self.clock()
        return {k: self.timing.get(k, 0.0) + now.get(k, 0.0) for k in dict.fromkeys([*self.timing, *now])}

    def checkpoint_tensors(self, model, ema_model, carry):
        """[are the weights sane, the carry of the global batch...]: one reduction, collectives on every rank.
        Sane: finite and below MAX_WEIGHT (NaN fails the comparison too)."""
        params = list(model.parameters()) + (list(ema_model.parameters()) if ema_model is not model else [])
        largest = torch.stack([p.detach().abs().max().float() for p in params]).max()
        return [(largest <= MAX_WEIGHT).float().reshape(1)] + [self.dev.all_gather(carry[k])
                                                               for k in sorted(carry)]

    def write(self, state, path, tag):
        """Rank 0: the file, the pruning of older ones, the upload."""
        from device import to_cpu
        t_save = time.time()
        save_atomic(to_cpu(state), path)
        print(f"saved {path}{tag} ({os.path.getsize(path) / 1e6:.1f} MB in {time.time() - t_save:.1f} s)")
        if path in self.corrupt:  # a new, whole file under the name of a corrupt one
            self.corrupt.remove(path)
        prune_checkpoints(self.local, self.cfg['keep_last_n'], self.best['step'], self.corrupt,
                          protect=self.verified)
        if self.uploader:
            self.uploader.submit(path, f"{self.gs_out.rstrip('/')}/{os.path.basename(path)}")
            self.upload_log()
            self.upload_board()

    def upload_log(self):
        """Rank 0: train.log as it is now to the bucket (a preempted VM's disk goes with the VM). The log grows
        while it uploads, so a snapshot goes, `.train.log.N`, one per upload (they run in order: the newest
        wins); each is deleted once uploaded, what is left at exit too."""
        self.log_uploads += 1
        snapshot = os.path.join(self.local, f'.train.log.{self.log_uploads}')
        try:
            shutil.copyfile(os.path.join(self.local, 'train.log'), snapshot)
        except OSError:
            return
        self.uploader.submit(snapshot, f"{self.gs_out.rstrip('/')}/train.log")

    def uploaded(self, path, uri):
        """After each upload: a log snapshot goes; a checkpoint prunes the bucket's older ones."""
        if os.path.basename(path).startswith(SNAPSHOTS):
            with contextlib.suppress(OSError):  # already gone: removed at exit
                os.remove(path)
        else:
            prune_checkpoints(self.gs_out, self.cfg['keep_last_n'], self.best['step'])

    def new_best(self, step, res):
        if res['exact_accuracy'] > self.best['exact_accuracy']:
            self.best = dict(step=step, exact_accuracy=float(res['exact_accuracy']), eval=res)

    # --- stop requests and divergence -----------------------------------------------------------------

    def stop_requested(self, step, start_step):
        """Whether any rank got SIGTERM or Ctrl-C: a host flag agreed every ~2 s of the slowest rank's steps
        (the pace measured over steps 5 to 10 after the start), so the agreement costs nothing measurable."""
        dev = self.dev
        stop = self.stop_agreed() if step % self.stop_every == 0 else False
        if step == start_step + 5:
            self.t_calibrate = time.time()
        if step == start_step + 10:
            self.stop_every = max(1, int(2.0 / dev.agree([(time.time() - self.t_calibrate) / 5], 'max')[0]))
        return stop

    def stop_agreed(self):
        """Whether any rank got SIGTERM or Ctrl-C: a reduction, so every rank calls it at the same point
        (between steps, between evaluation batches; the rank that got the signal said so at once)."""
        return self.dev.agree([float(STOP['requested'])], 'max')[0] > 0

    def check_divergence(self, bad_at):
        """bad_at: the first step whose loss was not finite (every rank's read), or < 0. Divergence: the
        weights after step k-1 gave a non-finite loss at step k, so checkpoints from k-1 on are set aside."""
        if bad_at < 0:
            return
        k = int(bad_at)
        if self.master:
            self.last_good = set_aside_diverged(self.local, self.gs_out, self.uploader, k - 1)
        raise SystemExit(f"loss became NaN or inf at step {k}; stopping. Checkpoints from step {k - 1} on "
                         f"were set aside (*.diverged). Last good checkpoint: {self.last_good or 'none'}; "
                         f"continue from it with --init_from=resume and a lower --lr (now {self.cfg['lr']})")

    # --- records: metrics.jsonl, results.json, W&B; uploads ------------------------------------------

    def open_records(self, step):
        """Rank 0: metrics.jsonl from `step` on, W&B, and the uploader (after each upload the bucket is pruned
        like the local folder)."""
        problems = []
        if self.master:
            try:
                self.records = Records(self.local, self.gs_out, step)
            except OSError as e:  # a full disk: its metrics.jsonl is kept as it was
                problems = [f"cannot write {e.filename or self.local} ({e.strerror or e}); free some space "
                            f"and rerun with --init_from=resume"]
        fail_together(self.dev, problems, 'opening the records')
        if not self.master:
            return
        if self.cfg['wandb_log']:
            self.wandb = start_wandb(self.cfg, self.local, self.run_id)
        if self.cfg['tensorboard']:
            self.board = Board.open(self.local, step, self.cfg)
        if self.gs_out:
            self.uploader = gcs.Uploader(on_success=self.uploaded)

    def log(self, kind, values, step, groups):
        """Rank 0: a line of metrics.jsonl, and the scalars of `groups` ({prefix: dict}) in W&B and
        TensorBoard."""
        if not self.master:
            return
        self.records.log(kind, values)
        for prefix, vals in groups.items():
            wandb_log_safe(self.wandb, {f'{prefix}/{k}': v for k, v in flat_scalars(vals)}, step)
        if self.board:
            self.board.log(groups, step)

    def upload_folder(self, path):
        """Rank 0: every file under the run's folder `path` (a profile) to the same place under the bucket's
        out_dir."""
        if not (self.master and self.uploader and path and os.path.isdir(path)):
            return
        for folder, _, names in os.walk(path):
            for name in names:
                local = os.path.join(folder, name)
                rel = os.path.relpath(local, self.local).replace(os.sep, '/')
                self.uploader.submit(local, f"{self.gs_out.rstrip('/')}/{rel}")

    def upload_board(self):
        """Rank 0: the TensorBoard event file as it is now to <out_dir>/tb/ (a snapshot, as train.log's)."""
        if self.board and self.uploader:
            self.log_uploads += 1
            snap = self.board.snapshot(os.path.join(self.local, f'.tb.{self.log_uploads}'))
            if snap:
                self.uploader.submit(snap, f"{self.gs_out.rstrip('/')}/tb/{self.board.name}")

    def finish(self, step, final_eval, parameters, flops_per_example):
        """Rank 0: results.json, what a study reads of a finished run (its cost included: wall seconds by
        phase over every process of the run, resumes adding theirs, and device-hours)."""
        if not self.master:
            return
        cfg, wall = self.cfg, self.timing_total()
        wall['total'] = sum(wall.values())
        self.records.finish(dict(
            config=cfg, parameters=parameters, run_id=self.run_id, flops_per_example_step=flops_per_example,
            device=self.dev.name(), world_size=self.dev.world_size, final_eval=final_eval,
            best_eval=self.best,
            step=step, examples_seen=step * cfg['global_batch_size'],
            train_flops=flops_per_example * step * cfg['global_batch_size'], wall_s=wall,
            device_hours=wall['total'] * self.dev.world_size / 3600))

    def write_evaluation(self, res, step, seconds, name):
        """Rank 0, --eval_only: <out_dir>/evals/<name>.json, one re-evaluation of a checkpoint (what a study
        reads for its test-time views and steps), written atomically; a gs:// run uploads it, and a failed write
        or upload is a warning (the evaluation was printed)."""
        path = os.path.join(self.local, 'evals', name + '.json')
        record = dict(step=step, checkpoint=self.resumed_from, seconds=seconds, device=self.dev.name(),
                      world_size=self.dev.world_size, config=self.cfg, eval=res)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_json_atomic(path, record)
            if self.gs_out:
                gcs.GCS(retries=self.cfg['gcs_retries']).upload(path,
                                                                 f"{self.gs_out.rstrip('/')}/evals/{name}.json")
        except (OSError, gcs.GCSError) as e:
            print(f"warning: the evaluation was not saved to {path}{' or its bucket' if self.gs_out else ''} "
                  f"({getattr(e, 'strerror', None) or e})")
            return None
        print(f"evaluation saved to {path}")
        return path

    def results_missing(self):
        """Whether results.json is in neither the run's folder nor its bucket (rank 0 looks; every rank learns
        it): a run that reached its last step without it (a stop during the final evaluation, a failed
        write)."""
        missing = self.master and not os.path.exists(os.path.join(self.local, 'results.json'))
        if missing and self.gs_out:
            try:
                missing = not gcs.object_exists(f"{self.gs_out.rstrip('/')}/results.json")
            except gcs.GCSError as e:
                print(f"warning: cannot look for results.json in {self.gs_out} ({e}); evaluating again")
        return self.dev.agree([float(missing)], 'max')[0] > 0

    def logged(self, kind, step):
        """Rank 0: whether metrics.jsonl holds a `kind` line of this step."""
        return bool(self.records) and self.records.logged(kind, step)

    def close(self, interrupted):
        """Rank 0: bounded waits for the uploads (after SIGTERM a spot VM has ~30 s: the checkpoint gets most
        of it) and for W&B (what did not reach it stays for `wandb sync`)."""
        if self.board:
            self.board.close()
        if self.uploader:
            self.finish_uploads(interrupted)
        if self.wandb:
            finish = threading.Thread(target=self.wandb.finish, daemon=True)
            finish.start()
            finish.join(timeout=4 if interrupted else 60)
        release_locks(quick=interrupted)  # after a stop: 18 + 4 + 5 s at most, inside a spot VM's 30 s

    def finish_uploads(self, interrupted):
        """The records' uploads, then a wait bounded at 18 s after a stop request, else 30 s plus 1 s per 20
        MB to send, announced after 3 s; then the files that did not reach the bucket are named."""
        up = self.uploader
        if self.records:
            self.records.upload(up)
        self.upload_log()
        self.upload_board()
        size = sum(os.path.getsize(p) for p, _ in list(up.pending) if os.path.exists(p))
        limit = 18 if interrupted else 30 + size / 20e6
        if not up.wait(timeout=3):
            print(f"waiting up to {limit - 3:.0f} s for {len({uri for _, uri in up.pending})} upload(s) to "
                  f"{self.gs_out}", flush=True)
            up.wait(timeout=limit - 3)
        for what, jobs in (('still running at exit', list(up.pending)), ('failed', list(up.failed))):
            left = [p for p, _ in jobs if os.path.exists(p)]  # a file pruning deleted was replaced by a newer
                                                              # one
            names = list(dict.fromkeys(snapshot_of(p) for p in left))
            if names:
                print(f"warning: {len(names)} upload(s) to {self.gs_out} {what}; only in {self.local}: "
                      f"{', '.join(names)}")
        for name in os.listdir(self.local):
            if name.startswith(SNAPSHOTS):
                with contextlib.suppress(OSError):  # (the upload thread may remove it too)
                    os.remove(os.path.join(self.local, name))


# copies of growing files (train.log, TensorBoard's events) taken for an upload, removed once uploaded
SNAPSHOTS = ('.train.log.', '.tb.')


def snapshot_of(path):
    """What an upload's local file stands for (a snapshot: the file it copies)."""
    name = os.path.basename(path)
    return 'train.log' if name.startswith('.train.log.') else 'tb' if name.startswith('.tb.') else name


def load_weights(path, model, ema_model):
    """init_from=FILE: the weights of a checkpoint of ours (its EMA when there is one) or a reference state
    dict."""
    try:
        found = weights_in(load_checkpoint(path))
    except CheckpointError as e:
        raise SystemExit(f"init_from: {e}")
    if found is None:
        raise SystemExit(f"init_from={path} is neither a checkpoint of this trainer nor a state dict of the "
                         f"reference implementation")
    sd = found['weights']
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise SystemExit(f"init_from={path}: not weights of this model ({' '.join(str(e).split())[:300]}); "
                         f"check hidden_size, mlp_t, pos_encodings, L_layers against the run that saved it")
    ema_model.load_state_dict(sd)


def set_aside_diverged(local, remote, uploader, first_bad):
    """Rename local checkpoints of step >= first_bad to *.diverged (and drop their bucket copies), so a resume
    never picks weights that diverge. Returns the newest checkpoint left."""
    if uploader:
        uploader.wait()
    for folder in [local] + ([remote] if remote else []):
        for step, path in list_checkpoints(folder).items():
            if step >= first_bad:
                gcs.delete_object(path) if gcs.is_gcs(path) else os.replace(path, path + '.diverged')
    left = list_checkpoints(local)
    return left[max(left)] if left else None


class Records:
    """metrics.jsonl (one JSON line per log step and per evaluation) and results.json (written once, at the
    end), in the run's folder and mirrored to the bucket. A resumed run drops the lines past its checkpoint's
    step, so it appends without duplicates."""
    def __init__(self, local, remote, step):
        self.path, self.remote = os.path.join(local, 'metrics.jsonl'), remote
        lines = []
        try:
            for path in [self.path] + ([self.fetch(step)] if remote and step > 0 else []):
                if path and os.path.exists(path):
                    with open(path) as f:  # a torn last line goes
                        kept = [l for i, l in enumerate(f, 1)
                                if l.endswith('\n') and self.readable(l, i, path)
                                and json.loads(l).get('step', 0) <= step]
                    lines = max(lines, kept, key=len)  # the newest copy: the local one or (a new machine) the
                                                       # bucket's
        finally:
            if os.path.exists(self.path + '.bucket'):
                os.remove(self.path + '.bucket')
        try:
            with open(self.path + '.tmp', 'w') as f:
                f.writelines(lines)
        except OSError:
            os.remove(self.path + '.tmp')
            raise
        os.replace(self.path + '.tmp', self.path)
        self.results = os.path.join(local, 'results.json')

    def fetch(self, step):
        """The bucket's metrics.jsonl in a file beside the local one, or None (none there, or unreachable)."""
        return gcs.download_if_there(f"{self.remote.rstrip('/')}/metrics.jsonl", self.path + '.bucket',
                                     f"metrics.jsonl up to step {step} is rebuilt from {self.path} alone")

    @staticmethod
    def readable(line, number, path):
        """A line that is JSON; another (torn by a crash, then appended to) is dropped with a warning."""
        try:
            return isinstance(json.loads(line), dict)
        except ValueError:
            print(f"warning: {path} line {number} is not a JSON record (torn by a crash?): dropped: "
                  f"{line.strip()[:80]}")
            return False

    def log(self, kind, values):
        """A line of metrics.jsonl; a failed write (a full disk) is a warning and the run goes on."""
        try:
            with open(self.path, 'a') as f:
                f.write(json.dumps(dict(kind=kind, time=time.time(), **values), default=float) + '\n')
        except OSError as e:
            print(f"warning: could not append to {self.path} ({e.strerror or e}): this {kind} line is not "
                  f"recorded there")

    def logged(self, kind, step):
        try:
            with open(self.path) as f:
                return any((r := json.loads(l)).get('kind') == kind and r.get('step') == step for l in f)
        except (OSError, ValueError, AttributeError):
            return False

    def finish(self, results):
        """results.json; a failed write is a warning: the next --init_from=resume writes it."""
        try:
            write_json_atomic(self.results, results)
        except OSError as e:
            print(f"warning: could not write {self.results} ({e.strerror or e}); rerun with "
                  "--init_from=resume once the disk has room, and it is written")

    def upload(self, uploader):
        for path in (self.path, self.results):
            if os.path.exists(path):
                uploader.submit(path, f"{self.remote.rstrip('/')}/{os.path.basename(path)}")


def start_wandb(cfg, local, run_id):
    """A W&B run; where W&B cannot be reached or is not logged in, an offline one in the run's folder (one
    warning line, `wandb sync` later). W&B is never a reason to lose a run."""
    import wandb
    kw = dict(project=cfg['wandb_project'], name=cfg['wandb_run_name'] or None, id=run_id, resume='allow',
              config=cfg, dir=local)
    mode = os.environ.get('WANDB_MODE', 'online')
    try:
        if mode not in ('offline', 'disabled'):
            if not wandb.api.api_key:
                raise RuntimeError("not logged in (wandb login, or WANDB_API_KEY)")
            import requests  # a quick look first: wandb.init itself waits long for a server that is not there
            requests.head(os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai'), timeout=5)
        return wandb.init(settings=wandb.Settings(init_timeout=30), **kw)
    except Exception as e:
        print(f"warning: W&B unavailable ({str(e).splitlines()[0][:200]}); logging offline in {local}/wandb: "
              f"`wandb sync {local}/wandb/offline-run-*` uploads it later")
        try:
            return wandb.init(mode='offline', **kw)
        except Exception as e2:
            print(f"warning: W&B offline failed too ({e2}); training goes on without W&B")
            return None


class Board:
    """TensorBoard's event files of a run (rank 0), written by torch's SummaryWriter into <run>/tb: one file
    per process, which begins by purging the steps after the one it continues from (TensorBoard's reader drops
    them from the files before it), so a resumed run shows every step once, as metrics.jsonl does. A failure
    (a full disk) is a warning; the run goes on without it."""

    def __init__(self, writer):
        self.writer = writer
        self.name = os.path.basename(writer.file_writer.event_writer._file_name)

    @classmethod
    def open(cls, local, step, cfg):
        try:
            from torch.utils.tensorboard import SummaryWriter
            board = cls(SummaryWriter(os.path.join(local, 'tb'), purge_step=step + 1, flush_secs=30))
            if step == 0:  # the config once, as a table
                board.writer.add_text('config', '\n'.join(['| key | value |', '|---|---|'] + [
                    f'| {k} | {v!r} |' for k, v in cfg.items()]), 0)
            atexit.register(board.close)  # an exit by an error (divergence, a failed check) keeps its lines
            return board
        except Exception as e:
            print(f"warning: TensorBoard events cannot be written in {local}/tb ({e}); the run goes on "
                  "without them")
            return None

    def log(self, groups, step):
        try:
            for prefix, vals in groups.items():
                for k, v in flat_scalars(vals):
                    self.writer.add_scalar(f'{prefix}/{k}', v, step)
        except Exception as e:
            print(f"warning: TensorBoard log failed at step {step}: {e}")

    def snapshot(self, path):
        """A copy of the event file as written so far (flushed first), or None."""
        try:
            self.writer.flush()
            shutil.copyfile(os.path.join(self.writer.log_dir, self.name), path)
            return path
        except Exception as e:
            print(f"warning: cannot copy the TensorBoard events for their upload ({e})")
            return None

    def close(self):
        with contextlib.suppress(Exception):
            self.writer.close()


def write_json_atomic(path, obj):
    """obj as JSON in path, through path.tmp and a rename: readers see the old file or the whole new one. A
    failed write (a full disk) raises OSError and leaves no .tmp behind."""
    try:
        with open(path + '.tmp', 'w') as f:
            json.dump(obj, f, indent=1, default=float)
        os.replace(path + '.tmp', path)
    except OSError:
        if os.path.isfile(path + '.tmp'):
            os.remove(path + '.tmp')
        raise


def flat_scalars(vals):
    """(name, number) pairs of a metrics dict as W&B and TensorBoard chart them: the exact accuracy at each
    test-time step count (exact_at_steps_NN) and each view count's accuracies (vote@NN, ...) one by one."""
    for k, v in vals.items():
        if k == 'exact_by_steps':
            yield from ((f'exact_at_steps_{i + 1:02d}', a) for i, a in enumerate(v))
        elif k == 'by_views':
            yield from ((f'{m}@{row["views"]:02d}', a) for row in v for m, a in row.items() if m != 'views')
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):  # numpy's too
            yield k, v


def wandb_log_safe(run, values, step):
    if run is not None and values:
        try:
            run.log(values, step=step)
        except Exception as e:
            print(f"warning: W&B log failed at step {step}: {e}")
