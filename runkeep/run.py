"""
One training run as train.py sees it: the rooms of this package composed behind plain verbs, so the learning
story reads as a story. Every method that more than rank 0 needs is called by every rank at the same point.
    run = Run(config, dev)                  start-up checks on every rank, host agreement, the out_dir's lock
    step, carry = run.resume(model, ...)    the newest checkpoint every rank can load (or init_from's weights);
                                            from here the watchdog and the bound on a stop request watch the run
    with run.evaluating(loader) as watch:   an evaluation, watched (stop requests between batches, the watchdog)
    run.step_done(step, host_s)             a training step finished
    run.stop_requested(step, ...)           every rank's verdict: stop now (SIGTERM, Ctrl-C, --max_minutes)
    run.log_train(...) / run.log_eval(...)  a line on the terminal, metrics.jsonl, W&B and TensorBoard
    run.save(step, ...)                     a checkpoint only of sane weights, written atomically, uploaded
    run.end(stopped)                        bounded waits for uploads and W&B, the out_dir's lock removed
launch(main, config) starts the process (or the processes) a run needs: signals, a launcher's workers, the
pre-flight.
"""
import contextlib
import errno
import functools
import os
import secrets
import sys
import time

import torch

from configurator import Tee
from data import load_metadata
from device import launch_tpu, launch_xla, resolve_device, stops_every_step, under_torchrun
from evaluate import format_eval
from puzzles import render_example
from step import format_train

from . import gcs
from .budget import Clock, TimeBudget
from .checkpoint import (MAX_WEIGHT, CheckpointError, check_resume, checkpoint_name, checkpoint_problems,
                         checkpoint_tensors, delete_all_checkpoints, find_resume_checkpoint, given_data,
                         identifiers_digest, identifiers_of, list_checkpoints, load_state, load_weights,
                         prune_checkpoints, resume_parts, set_aside_diverged, start_file_missing, write_checkpoint)
from .hub import all_config_beside
from .locks import lock_bucket, lock_local, mark_data, release_locks
from .records import RunRecords, drop_earlier_log, drop_earlier_records, drop_results, remove_unfinished, start_log
from .signals import (JOINING, PARENT, STOP, StopBound, die_with_parent, ended_abruptly, exit_if_orphaned,
                      follow_launcher, forward_signals, install_signal_handlers)
from .startup import (data_shape, fail_if_ranks_differ, fail_together, fetch_data, fingerprint, hosts_differ,
                      local_folder, sampled_rows, startup_problems)
from .watchdog import Watchdog


class Run:
    """One training run's folders, records and verdicts. cfg: train.py's config (a dict of its keys)."""

    def __init__(self, cfg, dev, started=None):
        """started: the process's start time (time.time()), for the start-up time in results.json."""
        self.cfg, self.dev, self.master = cfg, dev, dev.master
        JOINING['now'] = False  # dev has joined the other ranks
        Tee.install()
        gcs.default_client().retries = cfg['gcs_retries']  # every bucket request, uploads included
        out_dir = cfg['out_dir']
        self.gs_out = out_dir if gcs.is_gcs(out_dir) else ''
        self.local = (cfg['local_dir'] or local_folder(out_dir)) if self.gs_out else out_dir
        # a rank killed outright while the others read the data, build the model or load the checkpoint breaks
        # their next start-up agreement: one line naming the checkpoint to resume, as in the loop
        self.bound = StopBound(lambda: ('the start-up', 'nothing yet'), lambda: list_checkpoints(self.local),
                               bound=False)
        gcs.default_client().stop = lambda: STOP['requested']  # until resume(): a stop ends bucket waits
        self.best = dict(step=-1, exact_accuracy=-1.0)
        self.resumed_from = self.last_good = self.run_id = None
        # which save of the weights the run is at: results.json and an --eval_only record name it, so a study tells
        # an evaluation of a checkpoint rolled back or overwritten since from one of the new weights of that step
        self.checkpoint_id = None
        self.owed = False   # the checkpoint resumed was saved by a stop before its step's evaluation was done
        self.owed_final = False  # ... before its final evaluation, at a step short of the run's last
        self.corrupt = []   # checkpoints found unreadable: kept, but they hold no place among the kept ones
        self.verified = -1  # newest step whose weights gave a finite loss: checkpoints up to it train on
        self.results_dropped = False  # an older run's results.json removed, at this process's first save
        self.arc = None  # ARC's votes (its pool)
        self.watchdog = None  # from resume() on: the watchdog, and self.bound's bound on a stop request
        self.stop_every, self.t_calibrate = 1, None
        self.alone = stops_every_step(dev)  # a stop check reads this process's own flag, after every step
        self.timing = {}    # wall seconds by phase of this run's earlier processes (from the checkpoint)
        self.device_s = 0.0  # their device-seconds: each process's wall time x its world size
        self.clock = Clock(started or time.time())  # this process's wall seconds by phase
        self.budget = TimeBudget(cfg.get('max_minutes', 0), self.clock)  # --max_minutes
        self.data_path = fetch_data(cfg['data_path'], cfg['data_cache_dir'], dev)
        self.check_start()
        self.records = RunRecords(cfg, dev, self.local, self.gs_out)  # rank 0's metrics.jsonl, W&B, TensorBoard

    def check_start(self):
        """All start-up checks before the first step, then every host's config, data and code compared; then
        rank 0 takes the out_dir's lock (before it touches any file there) and logs the output to
        train.log."""
        cfg, dev = dict(self.cfg, data_path=self.data_path), self.dev
        fail_together(dev, startup_problems(cfg, dev) + checkpoint_problems(cfg, dev, self.local),
                      'start-up checks')
        self.data_digest = sampled_rows(self.data_path)  # which examples the run trains on: its checkpoints record it
        hosts_differ(dev, self.cfg, self.data_path, self.data_digest)
        self.meta = load_metadata(self.data_path, 'train')
        self.identifiers = identifiers_of(self.data_path, self.meta)  # what the puzzle embedding's rows are
        fail_if_ranks_differ(dev, [fingerprint(str(self.identifiers))], lambda _: (
            f"the hosts' copies of {self.data_path} hold different identifiers.json: copy the same dataset to "
            "every host"))
        if cfg['eval_only']:  # no lock, only its evals/ file: it may evaluate a running run's checkpoints
            return
        names = os.path.join(self.data_path, 'identifiers.json')
        if self.master and self.identifiers['sha256'] is None and os.path.isfile(names):  # damaged, not absent
            print(f"warning: {identifiers_digest(self.data_path)[1]}: this run's checkpoints record no digest of "
                  "its puzzles' names, so a resume or evaluation can check their count alone (a rebuild of the "
                  "dataset restores the file)")
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
            log_from = start_log(self.local, self.gs_out, resume_parts(cfg['init_from'])[0])
            mark_data(self.data_path, cfg['out_dir'])
            remove_unfinished(self.local)
        problems = []
        if self.master and cfg['overwrite'] and not resume_parts(cfg['init_from'])[0]:  # the old run's files go
            problems = delete_all_checkpoints([self.local] + ([self.gs_out] if self.gs_out else []))
            # its results too: a stop in this run's final evaluation would leave them beside this run's last step
            self.results_dropped = not problems and drop_results(self.local, self.gs_out, submission=True)
            if not problems:
                drop_earlier_records(self.local, self.gs_out)
                drop_earlier_log(self.local, log_from)
        fail_together(dev, problems, 'overwrite')

    def resume(self, model, ema_model, opt, loader, resume_fixed, last_step, arc=None):
        """The starting point: (step, the carry of this rank's rows or None). init_from='resume' loads the
        newest checkpoint every rank can read (never an older one in place of one at `last_step` or one to
        evaluate), refusing one saved with other `resume_fixed` keys or on other data; a file loads its
        weights (ours, or a state dict of the reference implementation), and so does 'resume:FILE' where there
        is nothing to resume yet. arc: ARC's votes, given its pool."""
        cfg, step, carry, ckpt, self.arc = self.cfg, 0, None, None, arc
        resume, init_file = resume_parts(cfg['init_from'])
        if resume:
            ckpt, self.resumed_from = find_resume_checkpoint(self.dev, self.local, self.gs_out, self.corrupt,
                                                             last_step, cfg['eval_only'])
            if ckpt is None and cfg['eval_only']:  # random weights are not a run's to evaluate
                raise SystemExit(f"init_from=resume: no checkpoint in {cfg['out_dir']} to evaluate")
            fail_together(self.dev, start_file_missing(cfg, ckpt is None), 'resuming')
            if ckpt is None and self.master:
                print(f"init_from={cfg['init_from']}: no checkpoint in {cfg['out_dir']} yet, starting from "
                      f"{init_file or 'scratch'}")
            if ckpt is not None:
                check_resume(self.dev, ckpt, self.resumed_from, cfg, resume_fixed, self.meta, self.data_path,
                             self.data_digest)
                carry = load_state(self.dev, ckpt, self.resumed_from, cfg, model, ema_model, opt, loader)
                if arc is not None:
                    arc.restore(ckpt.get('arc_pool'))
                step, self.best = ckpt['step'], ckpt['best']
                self.timing = dict(ckpt.get('timing') or {})
                # an older checkpoint's processes: taken to have had this world size
                self.device_s = ckpt.get('device_s', sum(self.timing.values()) * self.dev.world_size)
                self.run_id = ckpt.get('run_id') or ckpt.get('wandb_run_id') or None
                self.checkpoint_id = ckpt.get('checkpoint_id')
                self.verified = step
                self.owed = bool(ckpt.get('eval_owed')) and step < last_step and not cfg['eval_only']
                # a final evaluation short of last_step: the time budget's, which ended the run there
                self.owed_final = self.owed and ckpt.get('eval_owed') == 'final'
                if self.owed and self.master:  # at the last step: at_the_end evaluates it, results.json missing
                    print(f"{self.resumed_from}: a stop came before its evaluation at step {step} was done: "
                          + ("evaluating it as the run's final one (the time budget's last step; rerun with "
                             "--init_from=resume to train on)" if self.owed_final else
                             "evaluating it before training on"))
        if init_file and ckpt is None:  # a training run onto other identifiers adapts the network
            said, (saved_step, saved_id) = load_weights(
                init_file, model, ema_model, self.meta, self.data_path, adapt=not cfg['eval_only'],
                published=bool(all_config_beside(init_file)), given=given_data(cfg['data_path'], self.data_path))
            if cfg['eval_only']:  # its evals/ record names the file, step and save it evaluated, as a resume's
                self.resumed_from, step, self.checkpoint_id = init_file, saved_step or 0, saved_id
            if self.master:
                print(said)
        self.run_id = self.run_id or secrets.token_hex(4)
        self.last_good = self.resumed_from
        gcs.default_client().stop = None  # from here a stop saves a checkpoint, and its upload gets its time
        # a rank that stops making progress (a dead host, a stuck collective) ends, to be rerun; armed once the
        # first log line is past (the graphs of the first steps and of the log's reduction are compiled by then)
        self.watchdog = Watchdog(cfg['watchdog_minutes'], self.records.log_watchdog, warmup=cfg['log_interval'] + 1,
                                 folder=self.local, step=step or None)
        # the bound counts from the request or the watchdog's last report of finished work, whichever is later
        self.bound.arm(self.watchdog.waiting, lambda: self.watchdog.last)
        return step, carry

    # --- what the run is doing, for the watchdog, the stop's bound and the time budget --------------------

    def plan_budget(self, model, ema_model, final, subset, eval_steps, run_steps, batch):
        """--max_minutes: what the run's evaluations and saves will hold (TimeBudget.plan)."""
        self.budget.plan(model, ema_model, final, subset, eval_steps, run_steps, batch,
                         self.cfg.get('gradient_accumulation_steps', 1))

    def host_progress(self, what, batch_done=False):
        """An evaluation's host work finished (an EvalLoader's views built, a batch scored): the watchdog's."""
        self.watchdog.host(what, batch_done)

    @contextlib.contextmanager
    def evaluating(self, loader):
        """An evaluation of `loader` (an EvalLoader): its time counted as evaluation, the watchdog armed once its
        first batch (its views, compiles and steps) is done, that batch its yardstick. Yields what the evaluation
        asks between batches (should_stop(): every rank's verdict on a stop request) and after each supervision
        step (progress(i))."""
        self.watchdog.pause()
        t0 = time.time()
        with self.budget.evaluating(loader):
            yield Watched(self)
        self.watchdog.evaluated()
        self.records.window.skip(time.time() - t0)  # the next log line's pace is the training's alone

    def loop_started(self, step):
        """The training loop begins at `step`: its clock, and its first log line's window."""
        self.clock.loop_start = time.time()
        self.records.window.start(self.dev, step)

    def step_done(self, step, host_s):
        """A training step finished; host_s: the host's seconds in it (XLA: tracing and dispatch)."""
        self.watchdog.progress(f'step {step}', step)
        self.records.window.host_s += host_s

    @property
    def out_of_time(self):
        """--max_minutes: the step just agreed on is the run's last (TimeBudget.agree)."""
        return self.budget.out_of_time

    def save(self, step, model, ema_model, opt, carry, loader_state, tag='', owed=False):
        """Every rank calls it: the carry gather and the sanity check are collectives, read on every rank;
        then rank 0 writes, prunes and uploads, and every rank learns whether that worked. owed: a stop came
        before this step's evaluation was done (the checkpoint says so: its resume evaluates it first, so a
        pooled vote loses none). Returns the checkpoint's path."""
        with self.bound.save():  # a stop request that comes meanwhile waits for it
            dev, keys, t_start = self.dev, sorted(carry), time.time()
            sane, *gathered = dev.read(checkpoint_tensors(dev, model, ema_model, carry))  # carry in `keys` order
            rng_ranks = dev.rng_states()  # each rank's ACT exploration stream, where it goes on
            path, problems, t_save = os.path.join(self.local, checkpoint_name(step)), [], time.time()
            if sane[0] == 0:
                problems = [f"the weights diverged by step {step} (non-finite or above {MAX_WEIGHT:g}): nothing "
                            f"saved. The last good checkpoint is {self.last_good or 'none'}; continue from it "
                            f"with --init_from=resume and a lower --lr (now {self.cfg['lr']})"]
            elif self.master:
                timing, device_s = self.spent()
                checkpoint_id = secrets.token_hex(8)
                state = dict(model=model.state_dict(),
                             ema=ema_model.state_dict() if ema_model is not model else None,
                             optimizer=opt.state_dict(), step=step, loader=loader_state,
                             carry=dict(zip(keys, map(torch.from_numpy, gathered))), rng=dev.rng_state(),
                             rng_ranks=rng_ranks,
                             config=self.cfg, best=self.best, run_id=self.run_id, timing=timing, device_s=device_s,
                             data=data_shape(self.meta), identifiers=self.identifiers,
                             data_digest=self.data_digest, eval_owed=owed, checkpoint_id=checkpoint_id,
                             **(self.arc.pool_state() if self.arc else {}))
                try:
                    if self.resumed_from and not self.results_dropped:  # an earlier finish's would sit beside it
                        self.results_dropped = drop_results(self.local, self.gs_out, self.arc is not None)
                    write_checkpoint(state, path, tag, self.cfg['keep_last_n'], self.best['step'], self.corrupt,
                                     protect=self.verified)
                    self.checkpoint_id = checkpoint_id
                    uri = self.gs_out and f"{self.gs_out.rstrip('/')}/{checkpoint_name(step)}"
                    if uri in self.corrupt:  # its upload replaces the bucket's corrupt copy: the bucket's prune must
                        self.corrupt.remove(uri)  # not take the new one for it
                    self.records.uploaded(path)
                except CheckpointError as e:  # nothing of it is left: the checkpoints before it are as they were
                    # room helps a full disk or a file size limit only, not a read-only disk or a folder moved away
                    fix = 'make room there and' if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else \
                        f"once {self.local} is a folder this run can write again,"
                    kept = f"the last good checkpoint, {self.last_good}, is kept: {fix} continue from it with " \
                        "--init_from=resume" if self.last_good else \
                        f"no checkpoint was saved before it: {fix} run again"
                    problems = [f"{e}; {kept}"]
                except Exception as e:
                    problems = [f"saving {path} failed: {e}"]
            fail_together(dev, problems, f'checkpoint at step {step}')
            self.budget.saved(time.time() - t_save)
            self.records.window.skip(time.time() - t_start)  # the next log line's pace is the training's alone
            self.last_good = path
            return path

    def warm_save(self, model, ema_model, carry):
        """XLA: the save's graph compiled now, after the first step, not in a spot VM's last seconds."""
        if self.dev.type == 'xla':
            self.dev.read(checkpoint_tensors(self.dev, model, ema_model, carry))

    def spent(self):
        """(wall seconds by phase, device-seconds) over all of this run's processes, at one moment: the
        checkpoint's totals plus this process's (its wall time x its world size: a resume may run on another
        number of devices)."""
        now = self.clock()
        timing = {k: self.timing.get(k, 0.0) + now.get(k, 0.0) for k in dict.fromkeys([*self.timing, *now])}
        return timing, self.device_s + sum(now.values()) * self.dev.world_size

    def new_best(self, step, res, examples, compared, test_examples):
        """The best evaluation among those of the same measure, the same test examples after the same supervision
        steps: `compared` of the split's `test_examples`, the intermediate evaluations' (eval_subset's seeded
        subset, or all); examples: those `res` is of. A final evaluation of the whole split joins a subset's
        comparison never; a best of another measure (a resume with another eval_subset or eval_steps) gives way to
        the first evaluation of this one."""
        if examples != compared:
            return
        steps = self.cfg['eval_steps'] or self.cfg['halt_max_steps']
        # a best without them (a checkpoint of an older trainer, which compared every evaluation) is taken as of
        # this measure, as that trainer did: a resume keeps it, and the checkpoint it protects
        other = (self.best.get('examples', examples), self.best.get('eval_steps', steps)) != (examples, steps)
        if other or res['exact_accuracy'] > self.best['exact_accuracy']:
            self.best = dict(step=step, exact_accuracy=float(res['exact_accuracy']), examples=examples,
                             test_examples=test_examples, eval_steps=steps, eval=res)

    # --- stop requests and divergence -----------------------------------------------------------------

    def stop_requested(self, step, start_step, at_eval=False, at_save=False):
        """Whether any rank got SIGTERM or Ctrl-C: a host flag agreed every ~2 s of the slowest rank's steps
        (the pace measured over steps 5 to 10 after the start), so the agreement costs nothing measurable.
        With --max_minutes the same reduction also says whether the budget ends the run (TimeBudget.agree),
        agreed at every step that evaluates (at_eval) or saves (at_save: --checkpoint_interval) as well.
        A single process off XLA reads its own flag after every step too (self.alone)."""
        stop = False
        if self.budget.seconds and (step % self.stop_every == 0 or at_eval or at_save):
            stop = self.budget.agree(self.dev, step, self.stop_every, at_eval, at_save)
        elif step % self.stop_every == 0:
            stop = self.stop_agreed()
        stop = stop or (self.alone and STOP['requested'])
        if step == start_step + 5:
            self.t_calibrate = time.time()
        if step == start_step + 10:
            pace = self.dev.agree([(time.time() - self.t_calibrate) / 5], 'max')[0]
            self.stop_every = max(1, int(2.0 / pace))
        return self.bound.acted(stop)  # acted on now: the stop's bound ends

    def stop_agreed(self):
        """Whether any rank got SIGTERM or Ctrl-C: a reduction, so every rank calls it at the same point
        (between steps, between evaluation batches; the rank that got the signal said so at once)."""
        return self.dev.agree([float(STOP['requested'])], 'max')[0] > 0

    def check_divergence(self, bad_at, step):
        """bad_at: the first step up to `step` whose loss was not finite (every rank's read), or < 0. Divergence:
        the weights after step k-1 gave a non-finite loss at step k, so checkpoints from k-1 on are set aside;
        otherwise the checkpoints up to step - 1 are known good."""
        if bad_at < 0:
            self.verified = step - 1
            return
        k = int(bad_at)
        if self.master:
            self.last_good = set_aside_diverged(self.local, self.gs_out, self.records.uploads, k - 1)
        raise SystemExit(f"loss became NaN or inf at step {k}; stopping. Checkpoints from step {k - 1} on "
                         f"were set aside (*.diverged). Last good checkpoint: {self.last_good or 'none'}; "
                         f"continue from it with --init_from=resume and a lower --lr (now {self.cfg['lr']})")

    # --- records: metrics.jsonl, results.json, W&B, TensorBoard; uploads -------------------------------

    def open_records(self, step):
        """metrics.jsonl from `step` on, W&B, TensorBoard, and a gs:// run's uploads (rank 0; every rank learns
        whether it could), led by what its earlier processes left only in the local folder."""
        problems = self.records.open(step, self.run_id, self.prune_bucket)
        fail_together(self.dev, problems, 'opening the records')
        self.records.catch_up(self.resumed_from, False, self.prune_bucket)
        if self.records.uploads:  # rank 0 of a gs:// run: the end waits for the final checkpoint's upload
            self.budget.upload_s = self.records.uploads.checkpoint_s

    def prune_bucket(self):
        """After each upload: the bucket's checkpoints pruned like the local folder's."""
        prune_checkpoints(self.gs_out, self.cfg['keep_last_n'], self.best['step'], self.corrupt,
                          protect=self.verified)

    def log_train(self, sums, step, run_steps, epoch, lr, flops_per_example):
        """A training line over the steps since the last one (the metric sums of every rank): printed by rank 0
        (with a warning where XLA compiled past the warm-up), and in metrics.jsonl, W&B and TensorBoard."""
        line = self.records.train_line(sums, step, epoch, lr, flops_per_example)
        if self.master:
            print(format_train(line, run_steps, self.dev.xla_report()[0] if self.dev.type == 'xla' else None))
        self.records.log_train(line, step)

    def log_eval(self, step, res, raw=None, xla_before=None, log=True):
        """An evaluation's lines (the raw weights' too, when evaluated) printed by rank 0, and with `log` in
        metrics.jsonl, W&B and TensorBoard; xla_before: the device's counters before it."""
        if self.master:
            print(format_eval(res))
            if raw:
                print(format_eval(raw).replace('eval on', 'eval of the raw weights (not the EMA) on', 1))
        if log:
            self.records.log_eval(step, res, raw, xla_before)

    def upload_folder(self, path):
        """Rank 0: every file under the run's folder `path` (a profile) to the same place under out_dir."""
        self.records.upload_folder(path)

    def finish(self, step, final_eval, example, parameters, flops_per_example, arc=None):
        """Rank 0: a held-out puzzle with the model's answer, then results.json (what a study reads of a finished
        run: its cost included, wall seconds by phase over every process of the run and device-hours), with
        ARC's submission.json first."""
        if self.master and example:
            print(render_example(self.meta, *example))
        self.records.finish(step, final_eval, self.best, self.run_id, self.checkpoint_id, *self.spent(),
                            parameters, flops_per_example, arc)

    def evaluate_checkpoint(self, evaluate, step, arc=None):
        """--eval_only: init_from's weights on the whole test split (evaluate(): (results, example)), printed;
        rank 0 saves the result for a study (evals/<name>.json); then every rank leaves."""
        t_eval = time.time()
        res, example = evaluate()
        if self.master:
            print(format_eval(res) if res else "stopped during the evaluation")
            if example:
                print(render_example(self.meta, *example))
            if res:
                self.records.write_evaluation(res, step, time.time() - t_eval, self.resumed_from, self.checkpoint_id,
                                              arc)
        self.end(res is None)

    def finished_before(self, step, run_steps, ending, later=''):
        """A checkpoint at or past this run's last step (`ending`: the --key=value flags that set it; `later`:
        words on one that does not). Past it: nothing to train, said as an error. At it: False when its
        results.json is missing (the final evaluation is owed: a stop during it, a failed write, or an earlier
        finish's results.json), else True, said so."""
        end = ' and '.join(ending) + (f"; {later}" if later else '')
        keys = ' and '.join(k.split('=')[0] for k in ending)
        if step > run_steps:  # evaluating it again would change nothing
            self.end(False)
            raise SystemExit(f"{self.resumed_from} is at step {step}, past this run's last step {run_steps} "
                             f"({end}): nothing to train; raise {keys} to train on, or evaluate it with "
                             "--eval_only=True")
        if self.records.results_missing(step):
            self.open_records(step)
            if self.master:
                print(f"the checkpoint is at the last step {step}, but results.json of step {step} is missing: "
                      "evaluating")
            return False
        if self.master:
            print(f"the checkpoint is at step {step}, and this run ends at step {run_steps} ({end}): nothing to do "
                  f"(raise {keys} to train on)")
        self.records.catch_up(self.resumed_from, True, self.prune_bucket)  # a bucket down at its end: sent now
        return True

    def logged(self, kind, step):
        """Rank 0: whether metrics.jsonl holds a `kind` line of this step."""
        return self.records.logged(kind, step)

    def end(self, stopped):
        """The run's end on every rank: the watchdog and the stop's bound stopped, bounded waits for the uploads
        (after SIGTERM a spot VM has ~30 s: the checkpoint gets most of it) and for W&B, the out_dir's lock
        removed, the device's processes left together."""
        for watcher in (self.watchdog, self.bound):
            if watcher:
                watcher.stop()
        self.records.close(stopped)
        release_locks(quick=stopped)  # after a stop: 18 + 4 + 5 s at most, inside a spot VM's 30 s
        self.dev.shutdown()


class Watched:
    """What an evaluation under Run.evaluating asks of the run: should_stop() between batches and within one
    (every rank's verdict on a stop request), progress(i) after each supervision step (the watchdog's heartbeat)."""

    def __init__(self, run):
        self.run = run

    def should_stop(self, within=False):
        """Every rank's verdict, between batches and (within) inside one. A single process, asked after every
        supervision step, reads its own flag there: no reduction, no device read, no report (the step made one)."""
        if within and self.run.alone and not STOP['requested']:
            return False
        stop = self.run.stop_agreed()
        self.run.watchdog.progress('an evaluation batch')
        return self.run.bound.acted(stop)

    def progress(self, i):
        self.run.watchdog.progress(f'supervision step {i} of an evaluation batch')


# -----------------------------------------------------------------------------
# the run's process, or processes

def launch(main, config, started):
    """train.py's process: SIGTERM and Ctrl-C become stop requests; then with preflight=True two short runs of
    this command and a verdict instead (preflight.py); a TorchTPU run's launcher (one process per TPU device,
    through torchrun); torch_xla's launcher (one worker per local chip, each running main(index) and following
    the launcher); else main() itself, a message it exits with written as one line. started: the process's
    start (time.time()). Returns the exit code."""
    kind = resolve_device(config['device'])  # a device that cannot run here says so now, in one line
    install_signal_handlers()  # SIGTERM and Ctrl-C: save a checkpoint, then every rank exits together
    if under_torchrun():  # its agent ends at once when a study.py that started it is killed: its ranks save and stop
        die_with_parent(PARENT['pid'])
    if config['preflight']:
        from .preflight import preflight
        return preflight(config)
    if kind == 'tpu' and not under_torchrun():
        return launch_tpu(sys.argv)
    if kind == 'xla':
        from concurrent.futures.process import BrokenProcessPool
        forward_signals()  # to the worker processes, which train and hold the out_dir
        try:
            launch_xla(functools.partial(xla_worker, main))
        except BrokenProcessPool:  # a process ended abruptly (the watchdog, a kill): its output says why
            out_dir = config['out_dir']
            folder = (config['local_dir'] or local_folder(out_dir)) if gcs.is_gcs(out_dir) else out_dir
            return ended_abruptly(folder, started)  # the watchdog's code, when it fired
        return 0
    JOINING['now'] = under_torchrun()  # until Run starts: main() first joins the other ranks (Device)
    try:
        main()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # torchrun's ranks share one stderr, and Python writes an exit message and its newline apart, so another
        # rank's line could land between them: one write keeps each line whole
        sys.stderr.write(e.code + '\n')
        sys.stderr.flush()
        return 1
    return 0


def start_worker():
    """In a torch_xla worker, as it imports the script (its main thread): its stop requests come through the
    launcher, once, and it dies with the launcher."""
    install_signal_handlers()
    follow_launcher()


def xla_worker(main, index):
    """main(index) in a torch_xla worker; one whose launcher died then exits (not waiting for work)."""
    try:
        main(index)
    except BaseException:
        exit_if_orphaned(1)
        raise
    exit_if_orphaned(0)
