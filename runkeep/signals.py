"""
How a run's process ends: a stop request (SIGTERM from a spot preemption, Ctrl-C), the bound on a stop the run
cannot reach, a launcher's signals, an orphaned worker, a failed allocation.
    install_signal_handlers()   SIGTERM and Ctrl-C: a stop request (STOP), said at once; the loop saves a
                                checkpoint at the ranks' next stop check and every rank exits together; a
                                terminal's hangup (SIGHUP) is ignored, except by torchrun's ranks (a stop)
    StopBound(...)              a stop request not acted on while the run finishes nothing for STOP_GRACE_S
                                ends the process in one line naming the last checkpoint kept; a collective
                                broken by it or by a killed rank, or a failed allocation, is one line too
    tell_other_hosts_if_ending_early()  a torchrun spanning hosts: a rank that ends before joining the others leaves
                                its last line for them (device.watch_join), who end at once instead of waiting
    forward_signals()           torch_xla's launcher: the signals go on to its workers
    follow_launcher()           a torch_xla worker: its signals come through the launcher; it dies with it
    die_with_parent(pid)        a child of study.py or solve.py, before exec: it saves and stops when they end
Exit codes: 0 a finished or cleanly stopped run, HUNG_EXIT (75) run the same command again (it resumes),
HUNG_AGAIN_EXIT (70) the same work hung twice, 130 a person's Ctrl-C.
"""
import contextlib
import json
import os
import signal
import sys
import threading
import time

from configurator import Tee  # the script's output (and rank 0's train.log)


HUNG_EXIT = 75  # EX_TEMPFAIL: run the same command again (it resumes from the last checkpoint)
HUNG_AGAIN_EXIT = 70  # EX_SOFTWARE: the watchdog fired twice on the same work; a rerun would loop

# -----------------------------------------------------------------------------
# stop requests: SIGTERM (spot preemption) and Ctrl-C save a checkpoint, then every rank exits at the same
# step

STOP = dict(requested=False, signal=None, count=0, at=None, acted=False)
# the process this one must not outlive (a torch_xla worker's launcher, the study.py or solve.py that started a
# train.py), and whether its end was acted on
PARENT = dict(pid=os.getppid(), gone=False)
# what the kernel sends when the thread that started this process ends (PR_SET_PDEATHSIG). A parent with several
# threads, killed, sends one per thread as each ends, and a thread that simply finishes sends one while its process
# lives: so this signal only asks whether the parent process is gone, and that is one stop request. Not SIGTERM:
# three of those end the process without its checkpoint.
PARENT_GONE = signal.SIGUSR1
# a stop request that the run has not acted on this long after its signal and after the last thing it finished
# (the step under way never reaches its stop check) ends the process (StopBound): a spot VM's notice is about 30 s
STOP_GRACE_S = float(os.environ.get('TRM_STOP_GRACE_S') or 20)

# a torchrun rank until it has joined the others (Run's start): a stop request has nothing to save yet, and the join
# waits for a rank that ended before it (a config error on its host) for the process group's timeout
JOINING = dict(now=False)


class LastLine:
    """A stream that keeps the last line written to it (an exit message comes in two writes: it, then its
    newline)."""
    def __init__(self, stream):
        self.stream, self.line, self.part = stream, '', ''

    def write(self, text):
        *done, self.part = (self.part + text).split('\n')
        self.line = next((d for d in reversed(done) if d.strip()), self.line)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def tell_other_hosts_if_ending_early():
    """train.py's first call. Under a torchrun spanning hosts, a process that ends before it joined the others (a
    config error of its host's command or files, a package missing there) leaves the last line it wrote to stderr
    in torchrun's store: the other hosts' ranks, which would wait for it until the process group's timeout, read it
    there and end at once (device.watch_join). Torch-free: the config check still answers before torch loads."""
    if 'LOCAL_RANK' not in os.environ or \
            int(os.environ.get('WORLD_SIZE', 1)) <= int(os.environ.get('LOCAL_WORLD_SIZE', 1)):
        return
    JOINING['now'] = True
    sys.stderr = LastLine(sys.stderr)
    # not at exit: torch, which the note needs, cannot load once the interpreter runs its exit functions; a
    # thread the interpreter waits for still can, as soon as the main thread ended, all but the module of
    # concurrent.futures' threads (its import registers an exit function of its own): loaded now
    import concurrent.futures.thread  # noqa: F401
    threading.Thread(target=leave_note, args=(sys.stderr,), name='ending-early').start()


def leave_note(stderr):
    """When the main thread has ended: a rank that had not joined the others leaves its last stderr line for
    them (device.leave_join_note)."""
    threading.main_thread().join()
    if not JOINING['now']:
        return
    try:
        from device import leave_join_note
        leave_join_note(stderr.line)
    except BaseException:  # the note spares the other hosts a wait; its failure changes nothing here
        pass


# what a hard exit (os._exit: no atexit) runs first, each called with quick=True after a stop request: the
# out_dir's locks are removed (locks.py registers release_locks)
BEFORE_HARD_EXIT = []


def hard_exit(code, quick=False):
    """The process ended now (os._exit: the main thread may be stuck, or must not finish what it does), after
    BEFORE_HARD_EXIT and with stdout and stderr flushed: into a file or a pipe they are block-buffered, and the
    lines left in the buffer, the last before a hang, would be lost. The flush runs in a thread given 2 s: the
    thread stuck may hold a stream's lock for good."""
    for cleanup in BEFORE_HARD_EXIT:
        cleanup(quick=quick)
    flush = threading.Thread(target=flush_streams, daemon=True)
    flush.start()
    flush.join(2)
    os._exit(code)


def flush_streams():
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream, a reader gone
            stream.flush()


def stop_exit_code(name):
    """The exit code of a stop request (the signal `name`) that ends without a checkpoint: 130 after a person's
    Ctrl-C (a loop that reruns on HUNG_EXIT ends), else HUNG_EXIT (a preemption: a launcher may run it again)."""
    return 128 + signal.SIGINT if name == 'SIGINT' else HUNG_EXIT


def on_signal(signum, why=None):
    """The first: a stop request, said at once (why: its cause in words, else the signal's name); the loop saves
    a checkpoint at the ranks' next stop check (a few seconds at most) and exits. A second: said, and the save
    goes on; a third ends the process at once (exit code 128 + the signal's number, as the signal's own default
    would). A torchrun rank still joining the others ends at once: nothing is loaded, so nothing to save."""
    name = signal.Signals(signum).name
    if JOINING['now']:
        say(f"pid {os.getpid()}: {why or 'got ' + name} while joining the other ranks: nothing to save yet; ending "
            "now (a rank that ended before joining says why in its output)")
        hard_exit(stop_exit_code(name), quick=True)
    STOP['count'] += 1
    if STOP['count'] == 1:
        STOP.update(requested=True, signal=name, at=time.time())
        say(f"pid {os.getpid()}: {why or 'got ' + name}: saving a checkpoint within seconds, then exiting (a "
            "second signal does not stop the save; a third ends the process at once, without it)")
    elif STOP['count'] == 2:
        say(f"pid {os.getpid()}: got {name} again: the save goes on; a third signal ends the process at "
            "once, without the checkpoint")
    else:
        say(f"pid {os.getpid()}: got {name} a third time: ending now, without the checkpoint")
        hard_exit(128 + signum, quick=True)


def newly_orphaned():
    """At a PARENT_GONE: whether the parent process is gone and this is the first time it is seen so (the kernel
    sends one per thread of the parent, and one when a thread of a living parent ends)."""
    if PARENT['gone'] or not orphaned():
        return False
    PARENT['gone'] = True
    return True


def on_parent_gone():
    """PARENT_GONE: when the parent process is gone, the stop request a SIGTERM makes, once; a stop already
    under way goes on (the parent's end is not a person's second signal)."""
    if not newly_orphaned():
        return
    if STOP['requested']:
        say(f"pid {os.getpid()}: its parent process (pid {PARENT['pid']}) ended; the save goes on")
    else:
        on_signal(signal.SIGTERM, why=f"its parent process (pid {PARENT['pid']}) ended")


# who acts on the signals read_signals reads: None, the run (on_signal); torch_xla's launcher's forwarding
READER = dict(act=None)


def read_signals(fd):
    """A thread's loop: every SIGTERM, SIGINT, PARENT_GONE and a torchrun rank's SIGHUP, as the interpreter writes
    it to the wakeup pipe the moment it arrives, to on_signal. So a main thread blocked in one long call (a
    collective, a kernel, a wait for a lock: Python runs its own handlers only between calls, and only when the
    kernel gave the signal to that thread and not another) still has its stop request said at once, and
    bounded."""
    while True:
        try:
            got = os.read(fd, 64)
        except InterruptedError:
            continue
        for signum in got:
            if READER['act']:
                READER['act'](signum)
            elif signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                on_signal(signum)
            elif signum == PARENT_GONE:
                on_parent_gone()


def say(line):
    """A line from a signal handler, written straight to stdout's file: the handler may run in the middle of a
    print, and Python's streams refuse to be entered twice; train.log takes it whole, after the line being written
    (Tee.line_from_thread). A closed stdout: train.log (also where the parent that copied the output there is gone:
    Tee.parent_log)."""
    data, told = (line + '\n').encode(), False
    try:
        os.write(sys.stdout.fileno(), data)
        told = True
    except (OSError, ValueError, AttributeError):
        pass
    if Tee.log is not None:
        with contextlib.suppress(OSError, ValueError):
            Tee.line_from_thread(line)
    if not told and Tee.log is None and Tee.parent_log:
        with contextlib.suppress(OSError):
            fd = os.open(Tee.parent_log, os.O_WRONLY | os.O_APPEND)
            os.write(fd, data)
            os.close(fd)


def install_signal_handlers():
    """In a process's main thread (torch_xla.launch runs the training in a worker thread): SIGTERM, SIGINT and
    PARENT_GONE reach read_signals through the interpreter's wakeup pipe; their Python handlers do nothing (they
    only keep the signals' default actions, ending the process, away). A terminal's hangup (SIGHUP: an SSH session
    whose connection drops) is ignored, as under nohup: the run goes on, its output in train.log; but under
    torchrun, whose agent ends at a hangup and passes it on to its ranks (killing them 30 s later), it is a stop
    request too."""
    stops = [signal.SIGTERM, signal.SIGINT, PARENT_GONE]
    if 'LOCAL_RANK' in os.environ:  # a torchrun rank
        stops.append(signal.SIGHUP)
    else:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for signum in stops:
        signal.signal(signum, lambda signum, frame: None)
    threading.Thread(target=read_signals, args=(r,), daemon=True, name='signals').start()


def forward_signals():
    """In torch_xla's launcher: SIGTERM and Ctrl-C go on to its worker processes, which save and stop (each
    says so), and so does its own parent's end (PARENT_GONE: a study.py's, a solve.py's); the launcher itself
    waits for them. After install_signal_handlers, whose thread reads the signals that this passes on."""
    import multiprocessing

    def forward(signum):
        if STOP['at'] is None:
            STOP.update(requested=True, signal=signal.Signals(signum).name, at=time.time())
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)

    def act(signum):
        if signum in (signal.SIGTERM, signal.SIGINT):
            forward(signum)
        elif signum == PARENT_GONE and newly_orphaned():
            forward(signal.SIGTERM)

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
        hard_exit(HUNG_EXIT)
    # read as install_signal_handlers reads them (its thread, not the main one: that waits for the workers in a
    # lock, where a signal the kernel gives another thread would wait with it), then passed on, not acted on
    READER['act'] = act
    threading.Thread(target=backstop, daemon=True, name='stop-backstop').start()
    os.environ['TRM_LAUNCHER_PID'] = str(os.getpid())  # the workers' parent, for follow_launcher


def follow_launcher():
    """In a torch_xla worker: its own process group, so a Ctrl-C reaches it once (through the launcher), and
    the launcher's end (even by SIGKILL) a stop request: an orphan saves and stops instead of holding the chips
    and the out_dir."""
    with contextlib.suppress(OSError):
        os.setpgrp()
    die_with_parent(int(os.environ.get('TRM_LAUNCHER_PID') or os.getppid()))


def die_with_parent(parent):
    """The kernel's PARENT_GONE when the process parent (a pid) ends, even by SIGKILL; at once when it is gone
    already. In a child before exec (subprocess's preexec_fn), started from the parent's main thread: the signal
    also comes when the starting thread ends, and until the child has install_signal_handlers' handlers (a script
    without them, prepare_arc.py, never) it ends the child, as SIGTERM would."""
    PARENT['pid'] = parent
    with contextlib.suppress(Exception):  # Linux only (TPU VMs); elsewhere a parent's end goes unseen
        _LIBC.prctl(1, PARENT_GONE)  # PR_SET_PDEATHSIG
    if orphaned():
        os.kill(os.getpid(), PARENT_GONE)


def orphaned():
    return os.getppid() != PARENT['pid']


def _libc():
    with contextlib.suppress(Exception):
        import ctypes
        return ctypes.CDLL(None, use_errno=True)


_LIBC = _libc()  # looked up once, here: a child between fork and exec only calls it


def exit_if_orphaned(code):
    """In a torch_xla worker whose launcher is gone, at the end of its work: exit now (its process pool would
    wait for the next task forever)."""
    if orphaned():
        hard_exit(code)


def ended_abruptly(folder, since):
    """A torch_xla launcher whose worker ended abruptly (the watchdog, a kill): says so, and returns the exit
    code: the watchdog's, when it fired in `folder` after `since` (time.time()), else HUNG_EXIT (a damaged file's
    too: a launcher that exits 0 after a hang reads as a finished run)."""
    code = HUNG_EXIT
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if os.path.getmtime(os.path.join(folder, 'watchdog.json')) >= since:
            with open(os.path.join(folder, 'watchdog.json')) as f:
                code = HUNG_AGAIN_EXIT if json.load(f).get('exit_code') == HUNG_AGAIN_EXIT else HUNG_EXIT
    then = ('the same command with --init_from=resume continues from the last checkpoint' if code == HUNG_EXIT
            else 'the watchdog fired on the same work as in the last run: a rerun would repeat it')
    print(f"a training process ended abruptly; exiting with code {code}: {then}", file=sys.stderr)
    return code


# -----------------------------------------------------------------------------
# the bound on a stop request: a step or evaluation that never reaches its stop check (a machine thrashing out of
# memory, a collective waiting for a rank that is gone) must not hold a spot VM's last seconds

def out_of_memory(kind, value):
    """Whether an exception is a failed allocation: Python's or numpy's MemoryError, torch's CPU allocator
    (can't allocate memory), a GPU's out of memory."""
    text = str(value)
    return issubclass(kind, MemoryError) or (issubclass(kind, RuntimeError) and (
        "can't allocate memory" in text or 'out of memory' in text.lower()))


def in_collective(tb):
    """Whether a traceback ends inside torch.distributed (a collective whose peer is gone)."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f'torch{os.sep}distributed{os.sep}' in tb.tb_frame.f_code.co_filename


class StopBound:
    """A stop request that the run has not acted on STOP_GRACE_S after its signal and after the last thing the
    run finished (last(): its time, the watchdog's last report; acted(True) at a stop check says it was acted on)
    ends the process: nothing can be saved in the middle of a step, so a line names the last checkpoint kept
    (checkpoints(): the run's {step: path}), the out_dir's lock is removed, and the exit code is
    HUNG_EXIT after a SIGTERM (a preemption: a launcher may run it again), 130 after a Ctrl-C (a person stopped
    it: a loop that reruns on HUNG_EXIT ends). waiting(): (what the run waits for, the last thing it finished),
    in words. Also, as the process's excepthook: a collective broken by another rank's end (at its bound, or with
    no stop request: a rank killed outright), and a failed allocation, each one line."""

    def __init__(self, waiting, checkpoints=dict, last=lambda: 0.0, bound=True):
        """bound=False: the excepthook alone, until arm() (a start-up, which acts on a stop request at its first
        step)."""
        self.waiting, self.checkpoints, self.last = waiting, checkpoints, last
        self.done = threading.Event()
        self.saving, self.saved = False, 0.0  # a checkpoint under way; when the last one ended
        if bound:
            self.arm(waiting, last)
        previous = sys.excepthook

        def broken(kind, value, tb):
            if out_of_memory(kind, value):  # the estimate at start let it in: what failed, in one line
                return self.out_of_memory(value)
            if STOP['requested'] and not STOP['acted'] and not issubclass(kind, SystemExit):
                self.end_unanswered(f": {self.waiting()[0]} ended in {kind.__name__}: "
                                    f"{' '.join(str(value).split())} (another rank or host ended meanwhile)")
            if in_collective(tb):  # a rank killed unasked (OOM killer, a lost host): its launcher names it
                return self.collective_broke(kind, value)
            previous(kind, value, tb)
        sys.excepthook = broken

    def arm(self, waiting, last):
        """The bound on a stop request from now on, with what the run waits for and when it last finished work."""
        self.waiting, self.last = waiting, last
        threading.Thread(target=self.watch, daemon=True, name='stop-bound').start()

    @staticmethod
    def acted(stop):
        """The ranks' verdict at a stop check, passed on: True (they stop now, and save) ends the bound."""
        if stop:
            STOP['acted'] = True
        return stop

    def stop(self):
        self.done.set()

    @contextlib.contextmanager
    def save(self):
        """A checkpoint being written (on every rank: the others wait for rank 0's write): a stop request that
        comes meanwhile waits for it, however long it takes, and the grace counts from its end. Ended by the bound
        it would be lost, and with it the last checkpoint a large run had time for."""
        self.saving = True
        try:
            yield
        finally:
            self.saving, self.saved = False, time.time()

    def watch(self):
        while not self.done.wait(0.25):
            # a run that keeps finishing work (an evaluation batch's slow supervision steps) comes to its stop
            # check and saves; one that finishes nothing for the grace never will
            if STOP['requested'] and not STOP['acted'] and not self.saving and \
                    time.time() - max(STOP['at'], self.last(), self.saved) >= STOP_GRACE_S:
                awaited, last = self.waiting()
                self.end_unanswered(f" (nothing finished for {STOP_GRACE_S:g} s): {awaited} never came to its stop "
                                    f"check (the last thing finished: {last})")

    def end_unanswered(self, why):
        """The end of a stop request the run could not act on: said, the lock removed, the exit code."""
        kept = self.last_kept()
        code = stop_exit_code(STOP['signal'])
        say(f"pid {os.getpid()}: the stop request ({STOP['signal']}, {time.time() - STOP['at']:.0f} s ago) was not "
            f"reached{why}; ending now, with exit code {code}, without a checkpoint; the last checkpoint "
            f"kept: {kept or 'none'} (the same command with --init_from=resume continues from it)")
        hard_exit(code, quick=True)

    def last_kept(self):
        try:
            return (lambda found: found[max(found)] if found else None)(self.checkpoints())
        except Exception:  # an unreadable folder, or none (eval_only)
            return None

    def collective_broke(self, kind, value):
        """A collective that failed with no stop request: one line on stderr (and train.log) naming the last
        checkpoint kept; the process then ends with exit code 1."""
        print(f"pid {os.getpid()}: a collective in {self.waiting()[0]} failed ({kind.__name__}: "
              f"{' '.join(str(value).split())[:300]}): another rank or host ended (its launcher's lines say "
              f"which); the last checkpoint kept: {self.last_kept() or 'none'} (the same command with "
              "--init_from=resume continues from it)", file=sys.stderr, flush=True)

    def out_of_memory(self, error):
        """An allocation failed (on this machine, or this process's address-space limit): one line on stderr (and
        train.log), then the process ends with exit code 1; its checkpoints are as they were."""
        text = ' '.join(str(error).split())
        text = text[text.find('DefaultCPUAllocator'):] if 'DefaultCPUAllocator' in text else text  # its own words
        print(f"out of memory in {self.waiting()[0]}: {text[:300]}. The start-up estimate (--check_memory) let it "
              "in: lower global_batch_size (or raise gradient_accumulation_steps), eval_batch_size or eval_views, "
              "or run on a larger machine; the same command with --init_from=resume continues from the last "
              "checkpoint", file=sys.stderr, flush=True)
