"""
One training run as train.py sees it: the rooms below composed, so the learning story calls plain verbs.
    run = Run(config, dev)                  start-up checks on every rank, host agreement, the out_dir's lock
    step, carry = run.resume(model, ...)    the newest checkpoint every rank can load (or init_from's weights)
    run.save(step, ...)                     a checkpoint only of sane weights, written atomically, uploaded
    run.log(kind, line, step, groups)       metrics.jsonl (+ the bucket's copy), W&B and TensorBoard
    run.close()                             bounded waits for uploads and W&B, the out_dir's lock removed
checkpoint.py holds the files and the resume, records.py the records and uploads, guard.py the safety net
(signals, locks, watchdog, verdicts every rank agrees on, start-up checks). Every method that more than rank 0
needs is called by every rank at the same point.
"""
import contextlib
import os
import secrets
import threading
import time

import torch

from . import gcs
from .checkpoint import (MAX_WEIGHT, check_resume, resume_parts, checkpoint_name, checkpoint_problems, checkpoint_tensors,
                        delete_all_checkpoints, find_resume_checkpoint, identifiers_of, load_state,
                        load_weights, prune_checkpoints, set_aside_diverged, start_file_missing, write_checkpoint)
from data import load_metadata
from evaluate import format_eval
from puzzles import render_example
from guard import (STOP, Clock, data_shape, fail_if_ranks_differ, fail_together, fetch_data, fingerprint,
                   hosts_differ, local_folder, lock_bucket, lock_local, mark_data, release_locks,
                   startup_problems)
from .records import (Records, TensorBoardWriter, Tee, Uploads, drop_results, flat_scalars, remove_unfinished,
                     results_of_step, save_evaluation, save_submission, start_log, start_wandb,
                     wandb_log_safe)


class Run:
    """One training run's folders, records and verdicts. cfg: train.py's config (a dict of its keys)."""

    def __init__(self, cfg, dev, started=None):
        """started: the process's start time (time.time()), for the start-up time in results.json."""
        self.cfg, self.dev, self.master = cfg, dev, dev.master
        Tee.install()
        gcs.default_client().retries = cfg['gcs_retries']  # every bucket request, uploads included
        out_dir = cfg['out_dir']
        self.gs_out = out_dir if gcs.is_gcs(out_dir) else ''
        self.local = (cfg['local_dir'] or local_folder(out_dir)) if self.gs_out else out_dir
        gcs.default_client().stop = lambda: STOP['requested']  # until resume(): a stop ends bucket waits
        self.best = dict(step=-1, exact_accuracy=-1.0)
        self.resumed_from = self.last_good = self.run_id = None
        self.owed = False   # the checkpoint resumed was saved by a stop before its step's evaluation was done
        self.corrupt = []   # checkpoints found unreadable: kept, but they hold no place among the kept ones
        self.verified = -1  # newest checkpoint step whose next step's loss was seen finite
        self.results_dropped = False  # an older run's results.json removed, at this process's first save
        self.records = self.wandb = self.uploads = self.board = self.arc = None  # arc: ARC's votes (its pool)
        self.stop_every, self.t_calibrate = 1, None
        self.timing = {}    # wall seconds by phase of this run's earlier processes (from the checkpoint)
        self.clock = Clock(started or time.time())  # this process's wall seconds by phase
        self.budget = TimeBudget(cfg.get('max_minutes', 0), self.clock)  # --max_minutes
        self.data_path = fetch_data(cfg['data_path'], cfg['data_cache_dir'], dev)
        self.check_start()

    def check_start(self):
        """All start-up checks before the first step, then every host's config, data and code compared; then
        rank 0 takes the out_dir's lock (before it touches any file there) and logs the output to
        train.log."""
        cfg, dev = dict(self.cfg, data_path=self.data_path), self.dev
        fail_together(dev, startup_problems(cfg, dev) + checkpoint_problems(cfg, dev, self.local),
                      'start-up checks')
        hosts_differ(dev, self.cfg, self.data_path)
        self.meta = load_metadata(self.data_path, 'train')
        self.identifiers = identifiers_of(self.data_path, self.meta)  # what the puzzle embedding's rows are
        fail_if_ranks_differ(dev, [fingerprint(str(self.identifiers))], lambda _: (
            f"the hosts' copies of {self.data_path} hold different identifiers.json: copy the same dataset to "
            "every host"))
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
            start_log(self.local, self.gs_out, resume_parts(cfg['init_from'])[0])
            mark_data(self.data_path, cfg['out_dir'])
            remove_unfinished(self.local)
        problems = []
        if self.master and cfg['overwrite'] and not resume_parts(cfg['init_from'])[0]:  # the old run's files go
            problems = delete_all_checkpoints([self.local] + ([self.gs_out] if self.gs_out else []))
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
                check_resume(self.dev, ckpt, self.resumed_from, cfg, resume_fixed, self.meta, self.data_path)
                carry = load_state(self.dev, ckpt, self.resumed_from, cfg, model, ema_model, opt, loader)
                if arc is not None:
                    arc.restore(ckpt.get('arc_pool'))
                step, self.best = ckpt['step'], ckpt['best']
                self.timing = dict(ckpt.get('timing') or {})
                self.run_id = ckpt.get('run_id') or ckpt.get('wandb_run_id') or None
                self.verified = step
                self.owed = bool(ckpt.get('eval_owed')) and step < last_step and not cfg['eval_only']
                if self.owed and self.master:  # at the last step: at_the_end evaluates it, results.json missing
                    print(f"{self.resumed_from}: a stop came before its evaluation at step {step} was done: "
                          "evaluating it before training on")
        if init_file and ckpt is None:  # a training run onto other identifiers adapts the network
            said = load_weights(init_file, model, ema_model, self.meta, self.data_path,
                                adapt=not cfg['eval_only'])
            if self.master:
                print(said)
        self.run_id = self.run_id or secrets.token_hex(4)
        self.last_good = self.resumed_from
        gcs.default_client().stop = None  # from here a stop saves a checkpoint, and its upload gets its time
        return step, carry

    def save(self, step, model, ema_model, opt, carry, loader_state, tag='', owed=False):
        """Every rank calls it: the carry gather and the sanity check are collectives, read on every rank;
        then rank 0 writes, prunes and uploads, and every rank learns whether that worked. owed: a stop came
        before this step's evaluation was done (the checkpoint says so: its resume evaluates it first, so a
        pooled vote loses none). Returns the checkpoint's path."""
        dev, keys = self.dev, sorted(carry)
        sane, *gathered = dev.read(checkpoint_tensors(dev, model, ema_model, carry))  # carry in `keys` order
        path, problems, t_save = os.path.join(self.local, checkpoint_name(step)), [], time.time()
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
                         data=data_shape(self.meta), identifiers=self.identifiers, eval_owed=owed,
                         **(self.arc.pool_state() if self.arc else {}))
            try:
                if self.resumed_from and not self.results_dropped:  # an earlier finish's would sit beside it
                    self.results_dropped = drop_results(self.local, self.gs_out, self.arc is not None)
                write_checkpoint(state, path, tag, self.cfg['keep_last_n'], self.best['step'], self.corrupt,
                                 protect=self.verified)
                if self.uploads:
                    self.uploads.submit(path)
                    self.uploads.log()
                    self.uploads.board(self.board)
            except Exception as e:
                problems = [f"saving {path} failed: {e}"]
        fail_together(dev, problems, f'checkpoint at step {step}')
        self.budget.saved(time.time() - t_save)
        self.last_good = path
        return path

    def timing_total(self):
        """Wall seconds by phase over all of this run's processes: the checkpoint's totals plus this
        process's."""
        now = self.clock()
        return {k: self.timing.get(k, 0.0) + now.get(k, 0.0) for k in dict.fromkeys([*self.timing, *now])}

    def new_best(self, step, res):
        if res['exact_accuracy'] > self.best['exact_accuracy']:
            self.best = dict(step=step, exact_accuracy=float(res['exact_accuracy']), eval=res)

    # --- stop requests and divergence -----------------------------------------------------------------

    def stop_requested(self, step, start_step, at_eval=False):
        """Whether any rank got SIGTERM or Ctrl-C: a host flag agreed every ~2 s of the slowest rank's steps
        (the pace measured over steps 5 to 10 after the start), so the agreement costs nothing measurable.
        With --max_minutes the same reduction also says whether the budget ends the run (TimeBudget.agree)."""
        stop = False
        if self.budget.seconds and (step % self.stop_every == 0 or at_eval):
            stop = self.budget.agree(self.dev, step, self.stop_every, at_eval)
        elif step % self.stop_every == 0:
            stop = self.stop_agreed()
        if step == start_step + 5:
            self.t_calibrate = time.time()
        if step == start_step + 10:
            pace = self.dev.agree([(time.time() - self.t_calibrate) / 5], 'max')[0]
            self.stop_every = max(1, int(2.0 / pace))
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
            self.last_good = set_aside_diverged(self.local, self.gs_out, self.uploads, k - 1)
        raise SystemExit(f"loss became NaN or inf at step {k}; stopping. Checkpoints from step {k - 1} on "
                         f"were set aside (*.diverged). Last good checkpoint: {self.last_good or 'none'}; "
                         f"continue from it with --init_from=resume and a lower --lr (now {self.cfg['lr']})")

    # --- records: metrics.jsonl, results.json, W&B, TensorBoard; uploads -------------------------------

    def open_records(self, step):
        """Rank 0: metrics.jsonl from `step` on, W&B, TensorBoard, and a gs:// run's uploads (after each
        upload of a checkpoint the bucket is pruned like the local folder)."""
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
            self.board = TensorBoardWriter.open(self.local, step, self.cfg)
        if self.gs_out:
            self.uploads = Uploads(self.local, self.gs_out, lambda: prune_checkpoints(
                self.gs_out, self.cfg['keep_last_n'], self.best['step']))

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
        """Rank 0: every file under the run's folder `path` (a profile) to the same place under out_dir."""
        if self.master and self.uploads:
            self.uploads.folder(path)

    def finish(self, step, final_eval, parameters, flops_per_example, arc=None):
        """Rank 0: results.json, what a study reads of a finished run (its cost included: wall seconds by
        phase over every process of the run, resumes adding theirs, and device-hours); ARC's submission.json
        first, which results.json names with its step and vote (the file itself is the ARC Prize's format)."""
        if not self.master:
            return
        cfg, wall, local = self.cfg, self.timing_total(), self.local
        sub = arc and save_submission(local, self.gs_out, 'submission.json', arc, step, cfg['gcs_retries'])
        wall['total'] = sum(wall.values())
        self.records.finish(dict(
            config=cfg, parameters=parameters, run_id=self.run_id, flops_per_example_step=flops_per_example,
            device=self.dev.name(), world_size=self.dev.world_size, final_eval=final_eval,
            best_eval=self.best, **(dict(arc_submission=sub) if sub else {}),
            step=step, examples_seen=step * cfg['global_batch_size'],
            train_flops=flops_per_example * step * cfg['global_batch_size'], wall_s=wall,
            device_hours=wall['total'] * self.dev.world_size / 3600))

    def evaluate_checkpoint(self, run_eval, meta, step, arc=None):
        """--eval_only: init_from's weights on the whole test split (run_eval(0, show_example=True)), printed;
        rank 0 saves the result for a study (write_evaluation)."""
        cfg, t_eval = self.cfg, time.time()
        res, example = run_eval(0, show_example=True)
        if self.master:
            print(format_eval(res) if res else "stopped during the evaluation")
            if example:
                print(render_example(meta, *example))
            if res:
                name = f"views{cfg['eval_views']}-steps{cfg['eval_steps'] or cfg['halt_max_steps']}"
                self.write_evaluation(res, step, time.time() - t_eval, name, arc)
        self.dev.shutdown()

    def write_evaluation(self, res, step, seconds, name, arc=None):
        """Rank 0, --eval_only: <out_dir>/evals/<name>.json, one re-evaluation of a checkpoint (what a study
        reads for its test-time views and steps), and with an ARC evaluation's votes its submission beside it
        (<name>.submission.json, which the record names with its step and vote); a failed write or upload is a
        warning."""
        sub = arc and save_submission(self.local, self.gs_out, f'evals/{name}.submission.json', arc, step,
                                      self.cfg['gcs_retries'])
        record = dict(step=step, checkpoint=self.resumed_from, seconds=seconds, device=self.dev.name(),
                      world_size=self.dev.world_size, config=self.cfg, eval=res)
        record.update(dict(submission=sub) if sub else {})
        return save_evaluation(self.local, self.gs_out, f'evals/{name}.json', record, self.cfg['gcs_retries'])

    def results_missing(self, step):
        """Whether the run lacks a results.json of checkpoint `step` in its folder and its bucket (rank 0
        looks; every rank learns it): a run that reached its last step without it (a stop during the final
        evaluation, a failed write), or one whose results.json is an earlier finish's (trained on, then
        stopped)."""
        missing = self.master and not results_of_step(self.local, self.gs_out, step)
        return self.dev.agree([float(missing)], 'max')[0] > 0

    def at_the_end(self, step, run_steps, end, evaluate):
        """A checkpoint at or past this run's last step (`end`: the key that sets it): past it, nothing to
        train, said as an error; at it, evaluate() (which writes results.json) when results.json is missing,
        else nothing to do. Then the records are closed and every rank leaves."""
        done = True
        if step > run_steps:  # evaluating it again would change nothing
            self.close(False)
            self.dev.shutdown()
            raise SystemExit(f"{self.resumed_from} is at step {step}, past this run's last step {run_steps} "
                             f"({end}): nothing to train; raise {end.split('=')[0]} to train on, or evaluate "
                             "it with --eval_only=True")
        if self.results_missing(step):
            self.open_records(step)
            if self.master:
                print(f"the checkpoint is at the last step {step}, but results.json of step {step} is missing: "
                      "evaluating")
            done = evaluate()
        elif self.master:
            print(f"the checkpoint is at step {step}, and this run ends at step {run_steps}: nothing to do "
                  f"(raise --max_steps or --epochs to train on)")
        self.close(not done)
        self.dev.shutdown()

    def logged(self, kind, step):
        """Rank 0: whether metrics.jsonl holds a `kind` line of this step."""
        return bool(self.records) and self.records.logged(kind, step)

    def close(self, interrupted):
        """Rank 0: bounded waits for the uploads (after SIGTERM a spot VM has ~30 s: the checkpoint gets most
        of it) and for W&B (what did not reach it stays for `wandb sync`)."""
        if self.board:
            self.board.close()
        if self.uploads:
            self.uploads.finish(interrupted, self.records, self.board)
        if self.wandb:
            finish = threading.Thread(target=self.wandb.finish, daemon=True)
            finish.start()
            finish.join(timeout=4 if interrupted else 60)
        release_locks(quick=interrupted)  # after a stop: 18 + 4 + 5 s at most, inside a spot VM's 30 s



def eval_rows(loader):
    """The rows an evaluation of an EvalLoader runs, padding and test-time views included."""
    return len(loader) * loader.B * loader.views


class TimeBudget:
    """--max_minutes: whether training must stop at this step so that the final evaluation and its save still
    end within the budget, counted in wall seconds from the process's start. What they will take, erring
    long: this process's slowest evaluation per row (x 1.25), or before any evaluation, the final one's
    FLOPs at the training's measured FLOP rate (from the second step on: the first holds compilations and
    warm-up), doubled, plus the first step's seconds (the evaluation's own compilation); and this process's
    slowest save (x 1.5), or before any, the checkpoint's bytes at 50 MB/s. The steps to the next check
    (~2 s) and an intermediate evaluation and save due now are added to the wait."""

    def __init__(self, minutes, clock):
        self.seconds, self.clock = minutes * 60, clock
        self.eval_pace = self.save_s = self.first = None
        self.need, self.out_of_time = 0.0, False

    def plan(self, model, ema_model, final, subset, eval_steps, run_steps, batch):
        """What a run's evaluations and saves hold: the final evaluation's and an intermediate one's loaders
        (EvalLoader; an intermediate one runs twice with an EMA: its weights and the raw ones), the
        supervision steps of an evaluation, the run's last step, the global batch."""
        self.rows = eval_rows(final)
        self.subset_rows = eval_rows(subset) * (2 if ema_model is not model else 1)
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
        """An evaluation of `rows` rows, `pace` the training's seconds per step."""
        if self.eval_pace is not None:
            return 1.25 * self.eval_pace * rows
        return 2 * rows * self.row_flops * pace / self.step_flops + self.first[1]

    def save_estimate(self):
        return 1.5 * self.save_s if self.save_s is not None else self.state_bytes / 50e6

    def late(self, step, check_every, at_eval):
        """Whether the wait to the next check, an intermediate evaluation and save due now, and the final
        evaluation and save would end past the budget."""
        if step >= self.run_steps:  # its final evaluation comes next in any case
            return False
        train_s = self.clock()['train']
        self.first = self.first or (step, train_s)
        s0, t0 = self.first
        if step == s0:  # its seconds hold the compilations and warm-up: the pace is measured from here on
            return False
        pace = (train_s - t0) / (step - s0)
        self.need = self.evaluation_s(self.rows, pace) + self.save_estimate()
        wait = (check_every + 1) * pace
        if at_eval:
            wait += self.evaluation_s(self.subset_rows, pace) + self.save_estimate()
        return time.time() - self.clock.started + wait + self.need >= self.seconds

    def agree(self, dev, step, check_every, at_eval):
        """Whether any rank got SIGTERM or Ctrl-C, and in the same reduction whether any rank is out of time:
        then, unless a stop was requested (it saves and exits as always), `out_of_time` is set on every rank
        at this step, the run's last. Called on every rank at the same steps (at evaluation steps too,
        `at_eval`: that evaluation must fit as well); rank 0 says why the run stops."""
        stop, late = dev.agree([float(STOP['requested']), float(self.late(step, check_every, at_eval))],
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
