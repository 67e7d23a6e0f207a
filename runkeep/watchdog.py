"""
A hung rank (a dead host, a stuck collective) leaves every chip of the slice idle without a word: the watchdog
ends it, with every thread's stack, so a person or a relaunch loop can act (exit code HUNG_EXIT, or
HUNG_AGAIN_EXIT when it fired on the same work last time).
"""
import faulthandler
import json
import os
import socket
import sys
import threading
import time

from configurator import Tee  # the script's output (and rank 0's train.log)


from .locks import boot_id, started
from .signals import HUNG_AGAIN_EXIT, HUNG_EXIT, hard_exit


class Watchdog:
    """Watchdog(minutes, record, folder, step: a resume's): when `minutes` pass with no progress() (a finished
    training step, evaluation batch or evaluation supervision step) or host() (an evaluation's work on the host: a
    batch's views, its scoring), every thread's stack goes to stderr and train.log, record(values) is called (rank
    0: a line of metrics.jsonl), the out_dir's lock is removed and the process exits with HUNG_EXIT, for a rerun.
    It is armed by the `warmup`-th report (the first steps compile their graphs; an evaluation's reports warm up
    only that evaluation); pause(), at an evaluation's start, disarms it until the evaluation's first batch is
    done (its views, its graphs, all its steps), and that batch is the evaluation's yardstick: for the rest of it,
    a unit of work up to SLOW_FACTOR x the slowest of that batch's is no hang, whatever `minutes` says (a batch of
    many views may take a step longer than the limit). minutes=0: off. A firing is remembered in
    <folder>/watchdog.json: one on the same work as the last one remembered (the same command, waiting at the same
    point) in an earlier launch exits with HUNG_AGAIN_EXIT instead, so a loop that reruns on HUNG_EXIT stops rather
    than repeat that work for ever; a sibling rank's firing in this launch (launch_id) gives its verdict. waiting()
    says what the run waits for and what it finished last (signals.StopBound names them when a stop cannot be acted
    on)."""
    SLOW_FACTOR = 3

    def __init__(self, minutes, record=None, warmup=2, folder=None, step=None):
        self.limit, self.record, self.warmup, self.folder = 60.0 * minutes, record, warmup, folder
        self.last, self.what, self.step, self.evaluating = time.time(), 'start-up', step, False
        self.paused, self.slowest = False, 0.0  # in an evaluation's first batch; its slowest unit (s)
        self.training_warmup = warmup  # the warm-up an evaluation interrupted
        self.launch = launch_id()  # now: a launcher gone by the firing has no start to read
        self.done = threading.Event()
        if self.limit > 0:
            threading.Thread(target=self.watch, daemon=True, name='watchdog').start()

    def progress(self, what, step=None):
        """`what` finished; a training step gives its `step` (the evaluation it may start is another wait)."""
        self.report(what)
        if not self.paused:
            self.warmup = max(0, self.warmup - 1)
        if step is not None:  # an evaluation, if any, is over
            self.step, self.evaluating, self.paused, self.slowest = step, False, False, 0.0

    def host(self, what, batch_done=False):
        """An evaluation's host work finished: the views of a batch built, or (batch_done) a batch scored,
        which ends it; the end of the first batch after pause() arms the watchdog."""
        self.report(what)
        if batch_done and self.paused:
            self.paused, self.warmup = False, max(0, self.warmup - 1)

    def report(self, what):
        now = time.time()
        if self.paused:
            self.slowest = max(self.slowest, now - self.last)
        self.last, self.what = now, what

    def pause(self):
        """At an evaluation's start: disarmed until its first batch is done (host(..., batch_done=True))."""
        self.paused, self.evaluating, self.slowest, self.last = True, True, 0.0, time.time()
        self.training_warmup, self.warmup = self.warmup, max(self.warmup, 1)

    def evaluated(self):
        """At an evaluation's end: the training's warm-up goes on where the evaluation found it (a resume's owed
        evaluation comes before the training's first steps, whose compiles its reports must not arm)."""
        self.warmup = self.training_warmup

    def allowed(self):
        """Seconds without a report that make a hang: the limit, or within an evaluation SLOW_FACTOR x the
        slowest unit of its first batch, when that is longer."""
        return max(self.limit, self.SLOW_FACTOR * self.slowest) if self.evaluating else self.limit

    def stop(self):
        self.done.set()

    def watch(self):
        while not self.done.wait(min(30.0, self.limit / 4)):
            if not self.warmup and not self.paused and time.time() - self.last > self.allowed():
                self.fire()

    def waiting(self):
        """(what the run waits for, the last thing it finished), in words."""
        return self.awaited(), self.what

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
        hard_exit(code)  # the main thread is stuck: only a hard exit ends the process (the locks, W&B first)

    def remember(self, work):
        """Whether this firing repeats the one remembered in the folder: one on `work` too in an earlier launch,
        or one of this launch that did (a sibling rank hung with this one: the launch's verdict, so every rank,
        and a torch_xla launcher reading the file, say the same); then `work` is remembered, with the launch and
        the exit code (for a torch_xla launcher: ended_abruptly)."""
        if not self.folder:
            return False
        path = os.path.join(self.folder, 'watchdog.json')
        try:
            with open(path) as f:
                last = json.load(f)
            if last.get('launch') == self.launch:
                again = last.get('exit_code') == HUNG_AGAIN_EXIT
            else:
                again = {k: v for k, v in last.items() if k in work} == work
        except (OSError, ValueError, AttributeError):
            again = False
        try:
            with open(f'{path}.{os.getpid()}.tmp', 'w') as f:
                json.dump(dict(work, launch=self.launch, exit_code=HUNG_AGAIN_EXIT if again else HUNG_EXIT), f)
            os.replace(f'{path}.{os.getpid()}.tmp', path)
        except OSError as e:
            print(f"watchdog: could not remember this firing in {path} ({e.strerror or e})", file=sys.stderr)
        return again


def launch_id():
    """This launch of the run, the same in each of its ranks on this host: the process that started them
    (torch_xla's launcher, TRM_LAUNCHER_PID; torchrun's agent, with its workers' restart count) or a lone
    process itself, by host, boot, pid and start (a pid outlives its process, a pid and its start do not)."""
    if os.environ.get('TRM_LAUNCHER_PID'):
        pid = int(os.environ['TRM_LAUNCHER_PID'])
    else:
        pid = os.getppid() if 'LOCAL_RANK' in os.environ else os.getpid()  # under torchrun: its agent
    return dict(host=socket.gethostname(), boot=boot_id(), pid=pid, started=started(pid),
                restart=os.environ.get('TORCHELASTIC_RESTART_COUNT'))
