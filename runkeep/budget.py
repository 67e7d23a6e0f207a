"""
A run's time: this process's wall seconds by phase (Clock: start-up, training, evaluation), and --max_minutes
(TimeBudget: training stops in time for the final evaluation and its save to end within the budget).
"""
import contextlib
import time

from .signals import STOP


class Clock:
    """This process's wall seconds by phase, which never overlap and add up to its time: evaluation, start-up (to
    the first step) and training (the loop, checkpoint saves included), these two without the evaluations in them
    (before the loop: a resume's owed evaluation, a finished run's missing results.json)."""

    def __init__(self, started):
        self.started, self.loop_start = started, None
        self.eval = self.eval_before = 0.0  # evaluation seconds, and those of them before the loop began

    def __call__(self):
        now = time.time()
        start = self.loop_start or now
        return dict(startup=start - self.started - self.eval_before, train=now - start - (self.eval - self.eval_before),
                    eval=self.eval)

    @contextlib.contextmanager
    def evaluating(self):
        t, before = time.time(), self.loop_start is None
        try:
            yield
        finally:
            spent = time.time() - t
            self.eval += spent
            if before:
                self.eval_before += spent


def eval_rows(loader):
    """The rows an evaluation of an EvalLoader runs, padding and test-time views included."""
    return len(loader) * loader.B * loader.views


def eval_cost_rows(loader, micro_batch):
    """The rows an evaluation of an EvalLoader costs at the training's FLOP rate: its batches (each a device call
    per supervision step) counted as at least `micro_batch` rows (the training's global rows per forward): a call
    of fewer rows costs no more than one of the micro-batch, and where its fixed costs (launches, the host's
    dispatch) rule, about as much: its FLOPs alone would count it far short."""
    return len(loader) * max(loader.B * loader.views, micro_batch)


class TimeBudget:
    """--max_minutes: whether training must stop at this step so that the final evaluation and its save still
    end within the budget, counted in wall seconds from the process's start. What they will take, erring
    long: this process's slowest evaluation per row (x 1.25), or before any evaluation, the final one's
    FLOPs at the training's measured FLOP rate (from the second step on: the first holds compilations and
    warm-up), each of its device calls counted as at least the training micro-batch's rows (eval_cost_rows),
    doubled, plus the first step's seconds (the evaluation's own compilation); and this process's
    slowest save (x 1.5), or before any, the checkpoint's bytes at 50 MB/s; in a gs:// run, the final
    checkpoint's upload, which the end waits for (upload_estimate). The steps to the next check
    (~2 s) and an intermediate evaluation and save due now are added to the wait: a step that evaluates or
    saves (--checkpoint_interval) is checked itself, as the pace counts them only as an average over the steps
    behind. The first check has no training pace: it decides only after an evaluation (a resume's owed one),
    taking those steps as free."""

    def __init__(self, minutes, clock):
        self.seconds, self.clock = minutes * 60, clock
        self.eval_pace = self.save_s = self.first = None
        self.upload_s = None  # rank 0 of a gs:// run: the slowest checkpoint upload so far (a callable)
        self.need, self.out_of_time = 0.0, False

    def plan(self, model, ema_model, final, subset, eval_steps, run_steps, batch, accumulation=1):
        """What a run's evaluations and saves hold: the final evaluation's and an intermediate one's loaders
        (EvalLoader; an intermediate one runs twice with an EMA: its weights and the raw ones), the
        supervision steps of an evaluation, the run's last step, the global batch and its micro-batches per
        step (gradient accumulation)."""
        twice = 2 if ema_model is not model else 1
        micro = batch / accumulation
        # (rows, rows as they cost before an evaluation's pace is known)
        self.rows = eval_rows(final), eval_cost_rows(final, micro)
        self.subset_rows = eval_rows(subset) * twice, eval_cost_rows(subset, micro) * twice
        self.run_steps, self.row_flops = run_steps, model.flops_per_example(train=False) * eval_steps
        self.step_flops = model.flops_per_example() * batch
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        carry = batch * model.config.latent_bytes(4)  # the latents, float32 at most
        self.state_bytes = 4 * params + buffers + carry  # raw, EMA, the two moments; the table once

    @contextlib.contextmanager
    def evaluating(self, loader):
        """An evaluation of `loader`'s rows (an EvalLoader): its time counted as evaluation (Clock), its pace
        per row kept."""
        t = time.time()
        with self.clock.evaluating():
            yield
        self.eval_pace = max(self.eval_pace or 0.0, (time.time() - t) / eval_rows(loader))

    def saved(self, seconds):
        self.save_s = max(self.save_s or 0.0, seconds)

    def evaluation_s(self, rows, pace):
        """An evaluation of `rows` (its rows, and its rows as they cost: plan), `pace` the training's seconds per
        step."""
        if self.eval_pace is not None:
            return 1.25 * self.eval_pace * rows[0]
        return 2 * rows[1] * self.row_flops * pace / self.step_flops + self.first[1]

    def save_estimate(self):
        return 1.5 * self.save_s if self.save_s is not None else self.state_bytes / 50e6

    def upload_estimate(self):
        """A gs:// run's final checkpoint upload: 1.5 x the slowest so far, or before any, its bytes at 20 MB/s;
        at most the end's wait for its uploads (30 s plus 1 s per 20 MB: Uploads.settle)."""
        if self.upload_s is None:
            return 0.0
        s, bound = self.upload_s(), 30 + self.state_bytes / 20e6
        return min(1.5 * s if s is not None else self.state_bytes / 20e6, bound)

    def late(self, step, check_every, at_eval, at_save=False):
        """Whether the wait to the next check, an intermediate evaluation (at_eval) and save (at_eval or at_save:
        --checkpoint_interval) due now, and the final evaluation and save would end past the budget."""
        if step >= self.run_steps:  # its final evaluation comes next in any case
            return False
        train_s = self.clock()['train']
        self.first = self.first or (step, train_s)
        s0, t0 = self.first
        if step == s0 and self.eval_pace is None:  # the compilations and warm-up: the pace is measured from here on
            return False
        pace = (train_s - t0) / (step - s0) if step > s0 else 0.0
        self.need = self.evaluation_s(self.rows, pace) + self.save_estimate() + self.upload_estimate()
        wait = (check_every + 1) * pace
        if at_eval:
            wait += self.evaluation_s(self.subset_rows, pace)
        if at_eval or at_save:
            wait += self.save_estimate()
        return time.time() - self.clock.started + wait + self.need >= self.seconds

    def agree(self, dev, step, check_every, at_eval, at_save=False):
        """Whether any rank got SIGTERM or Ctrl-C, and in the same reduction whether any rank is out of time:
        then, unless a stop was requested (it saves and exits as always), `out_of_time` is set on every rank
        at this step, the run's last. Called on every rank at the same steps (at evaluation and checkpoint steps
        too, `at_eval`, `at_save`: that evaluation or save must fit as well); rank 0 says why the run stops."""
        stop, late = dev.agree([float(STOP['requested']), float(self.late(step, check_every, at_eval, at_save))],
                               'max') > 0
        self.out_of_time = bool(late and not stop)
        if self.out_of_time and dev.master:
            print(self.verdict(step))
        return bool(stop)

    def verdict(self, step):
        minutes = (time.time() - self.clock.started) / 60
        return (f"time budget: stopping at step {step} of {self.run_steps} after {minutes:.1f} min to leave "
                f"~{self.need:.{0 if self.need >= 10 else 1}f} s for the final evaluation (--max_minutes="
                f"{self.seconds / 60:g})")
