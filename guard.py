"""
The run's safety net: what keeps every rank of a training run together and its out_dir its own when a spot VM
is preempted, a host hangs, a host has other files or a second run starts into the same folder.
    signals          SIGTERM (spot preemption) and Ctrl-C: a stop request; the loop saves, every rank exits
                     together; a torch_xla worker follows its launcher and never outlives it
    locks            an out_dir belongs to one run: a lock file, and a lock object with a lease beside a
                     gs:// out_dir's checkpoints
    Watchdog         a rank that stops making progress ends with its stacks and HUNG_EXIT
    fail_together    verdicts every rank agrees on (Device.agree), so all ranks stop with one message
    startup_problems the checks before the first step; hosts_differ: every host's config, data and code
Every function that more than rank 0 needs is called by every rank at the same point: a device value is read
on every rank before rank 0 alone writes files (a TPU pod's ranks must run the same graphs).
"""
import atexit
import contextlib
import faulthandler
import glob
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time

from runkeep import gcs
from data import IN_USE, check_split, load_metadata
from runkeep.memory import (config_memory, config_shape, describe, latent_bytes, memory_headroom, memory_problem, need,
                    resident_bytes, size)
from puzzles import puzzle_for, puzzle_type, views_problem
from runkeep.records import Tee  # the script's output (and rank 0's train.log), installed at its first line

HERE = os.path.dirname(os.path.abspath(__file__))
# the code whose copies every host must share (a pod runs one command on every host): every file beside
# train.py and in its packages, so a new file is compared as soon as it is there
CODE_FILES = sorted(glob.glob(os.path.join(HERE, '*.py')) + [
    f for f in glob.glob(os.path.join(HERE, '*', '*.py')) if os.path.isfile(os.path.join(os.path.dirname(f), '__init__.py'))])
HUNG_EXIT = 75  # EX_TEMPFAIL: run the same command again (it resumes from the last checkpoint)
HUNG_AGAIN_EXIT = 70  # EX_SOFTWARE: the watchdog fired twice on the same work; a rerun would loop

# -----------------------------------------------------------------------------
# stop requests: SIGTERM (spot preemption) and Ctrl-C save a checkpoint, then every rank exits at the same
# step

STOP = dict(requested=False, signal=None, count=0, at=None, acted=False)
# a stop request that the run has not acted on this long after its signal (the step under way never reaches its
# stop check) ends the process (Watchdog.bound_stop): a spot VM's notice is about 30 s
STOP_GRACE_S = float(os.environ.get('TRM_STOP_GRACE_S') or 20)


def on_signal(signum):
    """The first: a stop request, said at once; the loop saves a checkpoint at the ranks' next stop check (a
    few seconds at most) and exits. A second: said, and the save goes on; a third ends the process at once
    (exit code 128 + the signal's number, as the signal's own default would)."""
    name = signal.Signals(signum).name
    STOP['count'] += 1
    if STOP['count'] == 1:
        STOP.update(requested=True, signal=name, at=time.time())
        say(f"pid {os.getpid()}: got {name}: saving a checkpoint within seconds, then exiting (a second "
            "signal does not stop the save; a third ends the process at once, without it)")
    elif STOP['count'] == 2:
        say(f"pid {os.getpid()}: got {name} again: the save goes on; a third signal ends the process at "
            "once, without the checkpoint")
    else:
        say(f"pid {os.getpid()}: got {name} a third time: ending now, without the checkpoint")
        release_locks(quick=True)
        os._exit(128 + signum)


def read_signals(fd):
    """A thread's loop: every SIGTERM and SIGINT, as the interpreter writes it to the wakeup pipe the moment
    it arrives, to on_signal. So a main thread blocked in one long call (a collective, a kernel: Python runs
    its own handlers only between calls) still has its stop request said at once, and bounded."""
    while True:
        try:
            got = os.read(fd, 64)
        except InterruptedError:
            continue
        for signum in got:
            if signum in (signal.SIGTERM, signal.SIGINT):
                on_signal(signum)


def say(line):
    """A line from a signal handler, written straight to stdout's and train.log's files: the handler may run
    in the middle of a print, and Python's streams refuse to be entered twice. A closed stdout: train.log (also
    where the parent that copied the output there is gone: Tee.parent_log)."""
    data, told = (line + '\n').encode(), False
    for f in (sys.stdout, Tee.log):
        try:
            os.write(f.fileno(), data)
            told = told or f is sys.stdout
        except (OSError, ValueError, AttributeError):
            pass
    if not told and Tee.log is None and Tee.parent_log:
        with contextlib.suppress(OSError):
            fd = os.open(Tee.parent_log, os.O_WRONLY | os.O_APPEND)
            os.write(fd, data)
            os.close(fd)


def acting(stop):
    """The ranks' verdict at a stop check, passed on: True (they stop now, and save) ends the stop's bound."""
    if stop:
        STOP['acted'] = True
    return stop


def install_signal_handlers():
    """In a process's main thread (torch_xla.launch runs the training in a worker thread): SIGTERM and SIGINT
    reach read_signals through the interpreter's wakeup pipe; their Python handlers do nothing (they only keep
    the signals' default actions, ending the process, away)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    threading.Thread(target=read_signals, args=(r,), daemon=True, name='signals').start()


def forward_signals():
    """In torch_xla's launcher: SIGTERM and Ctrl-C go on to its worker processes, which save and stop (each
    says so); the launcher itself waits for them."""
    import multiprocessing

    def forward(signum, frame):
        if STOP['at'] is None:
            STOP.update(requested=True, signal=signal.Signals(signum).name, at=time.time())
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)

    def backstop():
        """Workers end by themselves (a save, or their stop's bound); one still there a minute after that
        is beyond help (stuck in the kernel): killed, and the launcher leaves."""
        while STOP['at'] is None or time.time() - STOP['at'] < STOP_GRACE_S + 60:
            time.sleep(0.5)
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        say(f"pid {os.getpid()}: the training processes did not end {STOP_GRACE_S + 60:g} s after "
            f"{STOP['signal']}: killed; exiting with code {HUNG_EXIT} (the same command with "
            "--init_from=resume continues from the last checkpoint)")
        os._exit(HUNG_EXIT)
    signal.set_wakeup_fd(-1)  # the signals are the workers' to act on: no reading of its own here
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    threading.Thread(target=backstop, daemon=True, name='stop-backstop').start()
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

class Watchdog:
    """Watchdog(minutes, record, folder, checkpoints): when `minutes` pass with no progress() (a finished training step,
    evaluation batch or evaluation supervision step) or host() (an evaluation's work on the host: a batch's
    views, its scoring), every thread's stack goes to stderr and train.log, record(values) is called (rank 0: a
    line of metrics.jsonl), the out_dir's lock is removed and the process exits with HUNG_EXIT, for a rerun.
    It is armed by the `warmup`-th report (the first steps compile their graphs); pause(), at an evaluation's
    start, disarms it until the evaluation's first batch is done (its views, its graphs, all its steps), and
    that batch is the evaluation's yardstick: for the rest of it, a unit of work up to SLOW_FACTOR x the
    slowest of that batch's is no hang, whatever `minutes` says (a batch of many views may take a step longer
    than the limit). minutes=0: off. A firing is remembered in <folder>/watchdog.json: one on the same work as
    the last one remembered (the same command, waiting at the same point) exits with HUNG_AGAIN_EXIT instead,
    so a loop that reruns on HUNG_EXIT stops rather than repeat that work for ever. checkpoints() gives the
    run's {step: path}, to name the last one kept when a stop cannot be acted on."""
    SLOW_FACTOR = 3

    def __init__(self, minutes, record=None, warmup=2, folder=None, checkpoints=dict):
        self.limit, self.record, self.waiting, self.folder = 60.0 * minutes, record, warmup, folder
        self.checkpoints = checkpoints
        self.last, self.what, self.step, self.evaluating = time.time(), 'start-up', None, False
        self.paused, self.slowest = False, 0.0  # in an evaluation's first batch; its slowest unit (s)
        self.done = threading.Event()
        if self.limit > 0:
            threading.Thread(target=self.watch, daemon=True, name='watchdog').start()
        threading.Thread(target=self.bound_stop, daemon=True, name='stop-bound').start()
        previous = sys.excepthook

        def broken(kind, value, tb):  # a rank's collective broken by a rank that ended at its stop's bound
            if out_of_memory(kind, value):  # the estimate at start let it in: what failed, in one line
                return self.out_of_memory(value)
            if STOP['requested'] and not STOP['acted'] and not issubclass(kind, SystemExit):
                self.end_unanswered(f": {self.awaited()} ended in {kind.__name__}: {' '.join(str(value).split())} "
                                    "(another rank or host ended meanwhile)")
            previous(kind, value, tb)
        sys.excepthook = broken

    def progress(self, what, step=None):
        """`what` finished; a training step gives its `step` (the evaluation it may start is another wait)."""
        self.report(what)
        if not self.paused:
            self.waiting = max(0, self.waiting - 1)
        if step is not None:  # an evaluation, if any, is over
            self.step, self.evaluating, self.paused, self.slowest = step, False, False, 0.0

    def host(self, what, batch_done=False):
        """An evaluation's host work finished: the views of a batch built, or (batch_done) a batch scored,
        which ends it; the end of the first batch after pause() arms the watchdog."""
        self.report(what)
        if batch_done and self.paused:
            self.paused, self.waiting = False, max(0, self.waiting - 1)

    def report(self, what):
        now = time.time()
        if self.paused:
            self.slowest = max(self.slowest, now - self.last)
        self.last, self.what = now, what

    def checked(self, what, stop):
        """progress(what) at a stop check whose verdict (every rank's) is `stop`; returns it (guard.acting)."""
        self.progress(what)
        return acting(stop)

    def pause(self):
        """At an evaluation's start: disarmed until its first batch is done (host(..., batch_done=True))."""
        self.paused, self.evaluating, self.slowest, self.last = True, True, 0.0, time.time()
        self.waiting = max(self.waiting, 1)

    def allowed(self):
        """Seconds without a report that make a hang: the limit, or within an evaluation SLOW_FACTOR x the
        slowest unit of its first batch, when that is longer."""
        return max(self.limit, self.SLOW_FACTOR * self.slowest) if self.evaluating else self.limit

    def stop(self):
        self.done.set()

    def watch(self):
        while not self.done.wait(min(30.0, self.limit / 4)):
            if not self.waiting and not self.paused and time.time() - self.last > self.allowed():
                self.fire()

    def bound_stop(self):
        """A stop request that the run has not acted on STOP_GRACE_S after its signal (the step or evaluation
        under way never reaches its stop check: a step thrashing a machine out of memory, a collective waiting
        for a rank that is gone) ends the process: nothing can be saved in the middle of a step, so a line names
        the last checkpoint kept, the out_dir's lock is removed, and the exit code is HUNG_EXIT, for a rerun
        that resumes from it. A stop acted on in time saves and exits as it always did."""
        while not self.done.wait(0.25):
            if STOP['requested'] and not STOP['acted'] and time.time() - STOP['at'] >= STOP_GRACE_S:
                self.end_unanswered(f" in {STOP_GRACE_S:g} s: {self.awaited()} never came to its stop check (the "
                                    f"last thing finished: {self.what})")

    def end_unanswered(self, why):
        """The end of a stop request the run could not act on: said, the lock removed, exit HUNG_EXIT after a
        SIGTERM (a preemption: a launcher may run it again), 130 after a Ctrl-C (a person stopped it: a loop
        that reruns on HUNG_EXIT ends)."""
        try:
            kept = (lambda found: found[max(found)] if found else None)(self.checkpoints())
        except Exception:  # an unreadable folder, or none (eval_only)
            kept = None
        code = HUNG_EXIT if STOP['signal'] == 'SIGTERM' else 128 + signal.SIGINT
        say(f"pid {os.getpid()}: the stop request ({STOP['signal']}, {time.time() - STOP['at']:.0f} s ago) was not "
            f"reached{why}; ending now, with exit code {code}, without a checkpoint; the last checkpoint "
            f"kept: {kept or 'none'} (the same command with --init_from=resume continues from it)")
        release_locks(quick=True)
        flush = threading.Thread(target=lambda: [f.flush() for f in (sys.stdout, sys.stderr)], daemon=True)
        flush.start()
        flush.join(2)  # the main thread may hold a stream's lock for good
        os._exit(code)

    def out_of_memory(self, error):
        """An allocation failed (on this machine, or this process's address-space limit): one line on stderr (and
        train.log), then the process ends with exit code 1; its checkpoints are as they were."""
        text = ' '.join(str(error).split())
        text = text[text.find('DefaultCPUAllocator'):] if 'DefaultCPUAllocator' in text else text  # its own words
        print(f"out of memory in {self.awaited()}: {text[:300]}. The start-up estimate (--check_memory) let it "
              "in: lower global_batch_size (or raise gradient_accumulation_steps), eval_batch_size or eval_views, "
              "or run on a larger machine; the same command with --init_from=resume continues from the last "
              "checkpoint", file=sys.stderr, flush=True)

    def awaited(self):
        """What the run was waiting for, in words."""
        if self.evaluating:
            return 'the evaluation ' + (f'after step {self.step}' if self.step is not None else 'of the checkpoint')
        return f'step {self.step + 1}' if self.step is not None else 'the first step'

    def fire(self):
        idle, waiting = time.time() - self.last, self.awaited()
        again = self.remember(dict(command=sys.argv, waiting=waiting))
        code = HUNG_AGAIN_EXIT if again else HUNG_EXIT
        then = (f"it fired on this same work in the last run of this command too: a rerun would repeat it, so "
                f"the exit code is {code}, not {HUNG_EXIT}. A slow but healthy piece of work needs a larger "
                "--watchdog_minutes" if again else "the same command with --init_from=resume continues from the "
                "last checkpoint")
        floor = f", and {self.SLOW_FACTOR} x the {self.slowest:.0f} s of this evaluation's slowest first unit" \
            if self.allowed() > self.limit else ''
        print(f"watchdog: nothing finished for {idle / 60:.1f} min (watchdog_minutes={self.limit / 60:g}{floor}; "
              f"the last: {self.what}) in pid {os.getpid()}, waiting for {waiting}: a hung host or collective. "
              f"Every thread's stack follows; exiting with code {code}: {then}", file=sys.stderr, flush=True)
        for f in (sys.stderr, Tee.log):
            try:
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            except (AttributeError, OSError, ValueError):  # no train.log (a rank > 0), or a closed stream
                pass
        try:
            if self.record:
                self.record(dict(step=self.step, idle_s=round(idle, 1), limit_min=self.limit / 60,
                                 last=self.what, waiting=waiting, pid=os.getpid(), host=socket.gethostname(),
                                 exit_code=code))
        except Exception as e:
            print(f"watchdog: could not record it ({e})", file=sys.stderr)
        release_locks()
        os._exit(code)  # the main thread is stuck: only a hard exit ends the process

    def remember(self, work):
        """Whether the firing remembered in the folder was on `work` too; then `work` is remembered, with the
        exit code (for a torch_xla launcher: ended_abruptly)."""
        if not self.folder:
            return False
        path = os.path.join(self.folder, 'watchdog.json')
        try:
            with open(path) as f:
                again = {k: v for k, v in json.load(f).items() if k in work} == work
        except (OSError, ValueError, AttributeError):
            again = False
        try:
            with open(f'{path}.{os.getpid()}.tmp', 'w') as f:
                json.dump(dict(work, exit_code=HUNG_AGAIN_EXIT if again else HUNG_EXIT), f)
            os.replace(f'{path}.{os.getpid()}.tmp', path)
        except OSError as e:
            print(f"watchdog: could not remember this firing in {path} ({e.strerror or e})", file=sys.stderr)
        return again


def ended_abruptly(folder, since):
    """A torch_xla launcher whose worker ended abruptly (the watchdog, a kill): says so, and returns the exit
    code: the watchdog's, when it fired in `folder` after `since` (time.time()), else HUNG_EXIT."""
    code = HUNG_EXIT
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if os.path.getmtime(os.path.join(folder, 'watchdog.json')) >= since:
            with open(os.path.join(folder, 'watchdog.json')) as f:
                code = int(json.load(f).get('exit_code', HUNG_EXIT))
    then = ('the same command with --init_from=resume continues from the last checkpoint' if code == HUNG_EXIT
            else 'the watchdog fired on the same work as in the last run: a rerun would repeat it')
    print(f"a training process ended abruptly; exiting with code {code}: {then}", file=sys.stderr)
    return code


# -----------------------------------------------------------------------------
# verdicts shared by every rank

def fingerprint(text):
    """A 24-bit hash of text: exact in float32, so ranks can compare it with a min/max reduction."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], 'big')


def out_of_memory(kind, value):
    """Whether an exception is a failed allocation: Python's or numpy's MemoryError, torch's CPU allocator
    (can't allocate memory), a GPU's out of memory."""
    text = str(value)
    return issubclass(kind, MemoryError) or (issubclass(kind, RuntimeError) and (
        "can't allocate memory" in text or 'out of memory' in text.lower()))


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
    """A few words on data_shape's dict (or the part of it a checkpoint saved): '4x4 Sudokus of seq_len 16,
    vocab_size 6'."""
    kind = puzzle_for(shape) if shape.get('puzzle_type') else None
    return (f"{kind.titles if kind else 'puzzles'} of seq_len {shape['seq_len']}"
            + (f", vocab_size {shape['vocab_size']}" if 'vocab_size' in shape else ''))


def startup_problems(cfg, dev):
    """What a run needs of its data, batch sizes, init_from and out_dir, checked before the first step on
    every rank: [message]. Each rank sees its own files (a pod's hosts each have their own disk), so each checks
    them. (The checkpoints already in out_dir: checkpoint.checkpoint_problems.)"""
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
    problems += init_from_problems(cfg['init_from'])
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
    if len(shapes) == 2 and not problems:
        problems += memory_problems(cfg, dev, load_metadata(root, 'train'))
    return problems


def init_from_problems(init_from):
    """[message] when init_from names nothing a run can start from: a file missing on this host or a folder, or
    'resume:' followed by no file. A missing FILE of 'resume:FILE' is no problem yet: the run's own checkpoints,
    when out_dir holds any, are resumed without it (Run.resume says when it is needed and missing)."""
    allowed = "init_from is 'scratch', 'resume', a checkpoint file, 'resume:FILE' or hf://OWNER/REPO/PATH/step_<N>"
    if init_from.startswith('resume:'):
        after = init_from[len('resume:'):]
        if after in ('', 'scratch', 'resume') or after.startswith('resume:'):
            return [f"init_from={init_from!r}: 'resume:' is followed by the checkpoint file to start from while "
                    "out_dir holds no checkpoint of the run; to resume out_dir's checkpoints alone use "
                    "--init_from=resume"]
        return [f"init_from={init_from}: {after} is a folder, not a checkpoint file"] if os.path.isdir(after) else []
    if init_from in ('scratch', 'resume') or os.path.isfile(init_from):
        return []
    what = 'a folder, not a checkpoint file' if os.path.isdir(init_from) else 'no such file on this host'
    return [f"init_from={init_from}: {what} ({allowed})"]


def memory_problems(cfg, dev, meta):
    """A CPU or CUDA run this machine cannot carry, found before anything is allocated: memory.run_memory of its
    config, dataset and batch against what this process may still allocate (a CPU: the host's ranks share it)
    or its GPU's free memory; [message]. Rank 0 says the estimate in a line when it is over half of that.
    check_memory=False, XLA and TorchTPU: not checked."""
    if not cfg['check_memory'] or dev.kind not in ('cpu', 'cuda'):
        return []
    import torch
    views, train = cfg['eval_views'], not cfg['eval_only']
    eval_rows = (cfg['eval_batch_size'] or cfg['global_batch_size']) // dev.world_size
    shape = config_shape(cfg, meta, dev.kind)
    row_bytes = latent_bytes(shape)
    if views_problem(puzzle_for(meta), views, eval_rows, row_bytes):
        return []  # train.py refuses those views in their own words, before any allocation
    processes = int(os.environ.get('LOCAL_WORLD_SIZE', 1)) if dev.kind == 'cpu' else 1  # sharing its memory
    parts = config_memory(cfg, meta, dev.kind, dev.world_size)
    if dev.kind == 'cuda':
        give, total = torch.cuda.mem_get_info(dev.device)
        where = f"free on its GPU ({torch.cuda.get_device_name(dev.device)}, {size(total)})"
    else:
        give, where = memory_headroom()
    if dev.master and give is not None and give / 2 < processes * need(parts) <= give:  # a close fit, said
        print(f"memory: about {size(need(parts))} more than the {size(resident_bytes())} this process holds "
              f"({describe(parts)})" + (f", {processes} processes" if processes > 1 else '')
              + f"; {size(give)} {where}")
    problem = memory_problem(parts, processes, 'this run' if train else 'this evaluation', where, give,
                             '--check_memory=False')
    return [problem] if problem else []


def hosts_differ(dev, cfg, data_path):
    """fail_together when the hosts differ in their config, dataset metadata or code (CODE_FILES)."""
    code = ''.join(open(f).read() for f in CODE_FILES)
    meta = ''.join(open(os.path.join(data_path, s, 'dataset.json')).read() for s in ('train', 'test'))
    names = ('config', 'dataset metadata', 'code')
    values = [fingerprint(json.dumps(cfg, sort_keys=True)), fingerprint(meta), fingerprint(code)]
    fail_if_ranks_differ(dev, values, lambda i: f"the hosts differ in their {', '.join(names[k] for k in i)}: "
                                                "copy the same files to every host")


def fetch_data(path, cache, dev):
    """The local copy of a gs:// data_path (one process per host fetches it into `cache`, the others wait);
    a local path as it is."""
    if not gcs.is_gcs(path):
        return path
    problems = []
    if dev.local_rank == 0:
        try:
            gcs.fetch_tree(path, cache)
        except Exception as e:
            problems = [f"cannot fetch {path}: {e}"]
    fail_together(dev, problems, f'fetching {path}')
    dev.barrier()
    return gcs.fetch_tree(path, cache)  # complete now: returns the local copy


# -----------------------------------------------------------------------------
# a run's clock and its local folder

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
