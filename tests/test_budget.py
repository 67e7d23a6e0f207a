"""
--max_minutes: a run that would overrun its wall-time budget stops training at a step early enough to run its
final evaluation there (results.json, and for ARC submission.json, as a finished run writes them) and exits 0,
saying so in one line; a resume with more time trains on from that step; SIGTERM during a budgeted run saves
and resumes as always (a negative budget is one of tests/test_config_errors.py's cases). About a minute on one
core.
    python -m pytest -q tests/test_budget.py
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import torch

from runkeep import gcs
from conftest import (BUCKET, ROOT, TOY_ARGS, Lines, ckpts, popen_train, run, script_env, site_hook,
                      stopped_owing_an_evaluation, train)
from test_dist import torchrun

TINY_ARC = ['--hidden_size=32', '--num_heads=2', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32',
            '--puzzle_emb_len=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=3', '--global_batch_size=8',
            '--eval_batch_size=6', '--lr=2e-3', '--lr_warmup_steps=1', '--forward_dtype=float32',
            '--loss_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--epochs=100000', '--eval_every_epochs=20',
            '--log_interval=10', '--tensorboard=False']
ENV = {'OMP_NUM_THREADS': '1'}
VERDICT = re.compile(r"time budget: stopping at step (\d+) of (\d+) after [\d.]+ min to leave ~([\d.]+) s for the "
                     r"final evaluation")


def test_a_time_budget_ends_the_run_with_its_final_evaluation_and_a_resume_trains_on(tmp_path):
    data, out = tmp_path / 'arc', tmp_path / 'o'
    run(['prepare_arc.py', '--synthetic', '--canvas=4', '--num_tasks=4', '--num_eval_tasks=2', '--num_aug=2',
         f'--output_dir={data}'], env=ENV)
    p = run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--max_minutes=0.15'] + TINY_ARC, env=ENV)
    said = [m for l in p.stdout.splitlines() if (m := VERDICT.fullmatch(l.split(' (--max_minutes')[0]))]
    assert len(said) == 1, p.stdout[-3000:]
    step, planned = int(said[0][1]), int(said[0][2])
    assert 0 < step < planned
    res = json.load(open(out / 'results.json'))  # the final evaluation of that step, as a finished run's
    assert res['step'] == step and res['final_eval']['count'] == 6
    assert set(json.load(open(out / 'submission.json'))) == set(json.load(open(data / 'test_puzzles.json')))
    assert ckpts(out)[-1] == f'ckpt_{step:08d}.pt' and 'stopped cleanly' not in p.stdout
    # more time: the run goes on from that step, and its next results.json is its own
    p = run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--max_minutes=0.25', '--init_from=resume']
            + TINY_ARC, env=ENV)
    later = [m for l in p.stdout.splitlines() if (m := VERDICT.fullmatch(l.split(' (--max_minutes')[0]))]
    assert len(later) == 1 and int(later[0][1]) > step, p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == int(later[0][1])


def test_a_stop_during_the_budget_s_final_evaluation_is_made_good_by_the_resume_alone(tmp_path):
    # the final evaluation waits for the stop request (a hook in the first process only), so the stop surely lands
    # in it; the same command again then evaluates that step once, as the run's final, and ends
    data, out = tmp_path / 'arc', tmp_path / 'o'
    run(['prepare_arc.py', '--synthetic', '--canvas=4', '--num_tasks=4', '--num_eval_tasks=2', '--num_aug=2',
         f'--output_dir={data}'], env=ENV)
    hook = site_hook(tmp_path / 'hook', """
if sys.argv[0].endswith('train.py'):
    import evaluate
    from runkeep.signals import STOP
    real = evaluate.evaluate

    def held(*args, **kwargs):
        print('test hook: the evaluation waits', flush=True)
        while not STOP['requested']:
            time.sleep(0.05)
        return real(*args, **kwargs)

    evaluate.evaluate = held
""")
    cmd = [sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={out}', '--max_minutes=0.05',
           '--init_from=resume'] + TINY_ARC + ['--eval_every_epochs=100000']
    proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env({**ENV, **hook}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
    lines = Lines(proc)
    said = VERDICT.fullmatch(lines.until('time budget:').split(' (--max_minutes')[0])
    lines.until('test hook: the evaluation waits')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    step = int(said[1])
    assert proc.returncode == 0 and 'stop requested' in text, text[-3000:]
    assert ckpts(out) == [f'ckpt_{step:08d}.pt'] and not os.path.exists(out / 'results.json'), text[-3000:]
    p = run(cmd[1:], env=ENV)
    evals = [l for l in p.stdout.splitlines() if l.startswith('eval ')]
    assert len(evals) == 1 and evals[0].startswith('eval on 6:'), p.stdout[-3000:]  # once, the whole test split
    assert 'time budget: stopping' not in p.stdout and ckpts(out) == [f'ckpt_{step:08d}.pt'], p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == step and os.path.exists(out / 'submission.json')
    logged = [json.loads(l) for l in open(out / 'metrics.jsonl')]
    assert [r['step'] for r in logged if r['kind'] == 'eval'] == [step], logged


def test_sigterm_during_a_budgeted_run_saves_and_resumes_as_always(toy, tmp_path):
    out = tmp_path / 'o'
    proc = popen_train(toy, out, '--epochs=200', '--log_interval=1', '--max_minutes=30')
    lines = Lines(proc)
    lines.until('step 30/')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    assert proc.returncode == 0, text[-3000:]
    saved = [l for l in text.splitlines() if l.startswith('saved') and '(stop requested)' in l]
    assert len(saved) == 1 and 'stopped cleanly' in text and 'time budget' not in text, text[-3000:]
    step = int(re.search(r'ckpt_(\d{8})\.pt', saved[0]).group(1))
    assert ckpts(out) == [f'ckpt_{step:08d}.pt'] and not os.path.exists(out / 'results.json')
    p = train(toy, out, '--init_from=resume', '--epochs=200', f'--max_steps={step + 4}', '--max_minutes=30',
              '--log_interval=1')
    assert f'step {step + 1}/{step + 4}' in p.stdout and 'time budget' not in p.stdout, p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == step + 4


def test_a_resume_whose_owed_evaluation_spent_the_budget_stops_at_its_first_step(toy, tmp_path):
    # SIGTERM in the step of an evaluation (20 of 40) saves it owed; the resume evaluates it first, which knows the
    # evaluation's pace, so its first check already finds a budget shorter than its start-up spent
    out, args = tmp_path / 'o', ['--epochs=2', '--eval_every_epochs=1', '--log_interval=1']
    text = stopped_owing_an_evaluation(toy, out, args, tmp_path / 'hook')
    assert torch.load(out / 'ckpt_00000020.pt', weights_only=True)['eval_owed'], text[-3000:]
    p = train(toy, out, *args, '--init_from=resume', '--max_minutes=0.001')
    said = [m for l in p.stdout.splitlines() if (m := VERDICT.fullmatch(l.split(' (--max_minutes')[0]))]
    assert 'evaluating it before training on' in p.stdout and len(said) == 1, p.stdout[-3000:]
    assert int(said[0][1]) == 21 and json.load(open(out / 'results.json'))['step'] == 21, p.stdout[-3000:]


def test_the_ranks_stop_at_the_same_step_when_one_of_them_is_out_of_time(toy, tmp_path):
    # rank 1's clock jumps a day ahead 10 s after its start: it alone finds the budget spent
    wrapper = ("import time\nif os.environ['RANK'] == '1':\n    _t0, _real = time.time(), time.time\n"
               "    time.time = lambda: _real() + (86400 if _real() - _t0 > 10 else 0)\n")
    p = torchrun(2, [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=500', '--log_interval=50',
                     '--eval_every_epochs=1000', '--global_batch_size=48', '--max_minutes=600', '--watchdog_minutes=0']
                 + TOY_ARGS, wrapper=wrapper)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    said = [m for l in p.stdout.splitlines() if (m := VERDICT.fullmatch(l.split(' (--max_minutes')[0]))]
    assert len(said) == 1, out[-3000:]  # rank 0 says it, for both
    step = int(said[0][1])
    assert json.load(open(tmp_path / 'o' / 'results.json'))['step'] == step < int(said[0][2])


def test_an_evaluation_before_the_loop_is_counted_once_and_no_phase_is_negative(toy, tmp_path):
    # a finished run whose results.json is gone evaluates again at start-up, in a process that trains nothing
    out = tmp_path / 'o'
    train(toy, out)
    os.remove(out / 'results.json')
    before = torch.load(out / ckpts(out)[-1], weights_only=False)['timing']  # the run's phases up to its last save
    t = time.time()
    p = train(toy, out, '--init_from=resume', '--eval_steps=64')
    took = time.time() - t
    assert 'results.json of step' in p.stdout and 'evaluating' in p.stdout, p.stdout[-3000:]
    wall = json.load(open(out / 'results.json'))['wall_s']
    assert wall['train'] == before['train'], (before, wall)  # this process trained nothing
    more = {k: wall[k] - before[k] for k in ('startup', 'eval')}  # this process's phases, which never overlap
    assert 0 < more['startup'] and 0 < more['eval'] and more['startup'] + more['eval'] <= took, (more, took)
    assert min(wall.values()) >= 0 and abs(wall['total'] - wall['startup'] - wall['train'] - wall['eval']) < 1e-6


def test_a_checkpoint_interval_save_is_made_only_where_the_budget_holds_it(toy, tmp_path):
    # the clock jumps a day ahead at step 36, after the pace is known: the saves every 7 steps are checked at their
    # own steps, as evaluations are, so the run ends by step 42 with its final evaluation in place of that save,
    # however far apart the ~2 s checks of the steps between them fall
    hook = site_hook(tmp_path / 'hook', """
if sys.argv[0].endswith('train.py'):
    import runkeep.run
    done, real = runkeep.run.Run.step_done, time.time

    def step_done(self, step, host_s):
        if step == 36:
            time.time = lambda: real() + 86400
        return done(self, step, host_s)

    runkeep.run.Run.step_done = step_done
""")
    out = tmp_path / 'o'
    p = train(toy, out, '--epochs=100', '--eval_every_epochs=1000', '--log_interval=50', '--checkpoint_interval=7',
              '--max_minutes=600', '--watchdog_minutes=0', env=hook)
    said = [m for l in p.stdout.splitlines() if (m := VERDICT.fullmatch(l.split(' (--max_minutes')[0]))]
    assert len(said) == 1 and 36 <= int(said[0][1]) <= 42, p.stdout[-3000:]
    step = int(said[0][1])
    assert json.load(open(out / 'results.json'))['step'] == step and ckpts(out)[-1] == f'ckpt_{step:08d}.pt'


def test_a_gs_run_keeps_time_for_its_final_checkpoint_s_upload(toy, emulator, tmp_path):
    # the first checkpoint's upload takes 6 s more; at step 30 (a save: checked), once it is done, 8 s of the budget
    # are left: the time kept for the end holds the final checkpoint's upload too (1.5 x the slowest one: 9 s at
    # least), which the end waits for, so the run stops there
    hook = site_hook(tmp_path / 'hook', """
if sys.argv[0].endswith('train.py'):
    import runkeep.gcs, runkeep.run
    upload, done = runkeep.gcs.GCS.upload, runkeep.run.Run.step_done

    def slow_upload(self, path, uri, *args, **kwargs):
        sent = upload(self, path, uri, *args, **kwargs)
        if uri.endswith('/ckpt_00000005.pt'):
            time.sleep(6)
        return sent

    def step_done(self, step, host_s):
        if step == 30:
            t = time.time()
            self.records.uploads.wait()
            self.clock.loop_start += time.time() - t  # the wait is not the training's: its pace stays the steps'
            self.budget.seconds = time.time() - self.clock.started + 8
        return done(self, step, host_s)

    runkeep.gcs.GCS.upload, runkeep.run.Run.step_done = slow_upload, step_done
""")
    out = f'gs://{BUCKET}/budget/up'
    p = train(toy, out, f'--local_dir={tmp_path / "l"}', '--epochs=100', '--eval_every_epochs=1000',
              '--log_interval=50', '--checkpoint_interval=5', '--max_minutes=600', '--watchdog_minutes=0',
              env=dict(hook, STORAGE_EMULATOR_HOST=emulator.replace('http://', '')))
    said = [m for l in p.stdout.splitlines() if (m := VERDICT.fullmatch(l.split(' (--max_minutes')[0]))]
    assert len(said) == 1 and int(said[0][1]) == 30 and float(said[0][3]) >= 9, p.stdout[-3000:]
    names = [uri.rsplit('/', 1)[1] for uri, _ in gcs.GCS(endpoint=emulator).list(out + '/')]
    assert f'ckpt_{int(said[0][1]):08d}.pt' in names and 'results.json' in names


def test_before_any_evaluation_the_budget_keeps_what_an_evaluation_of_small_batches_takes(toy, tmp_path):
    # an evaluation batch of 1 row against a training batch of 50: the final evaluation, the run's only one, makes
    # 200 x its supervision steps device calls of a row each; the time the budget keeps for it at its last check
    # before it (no evaluation's pace known yet) must hold what it then took in the same process: a run stopping on
    # less would begin a final evaluation that overruns its budget
    hook = site_hook(tmp_path / 'hook', """
if sys.argv[0].endswith('train.py'):
    import runkeep.budget
    late = runkeep.budget.TimeBudget.late

    def kept(self, *args, **kwargs):
        out = late(self, *args, **kwargs)
        if self.eval_pace is None and self.need:
            print(f'test hook: kept {self.need - self.save_estimate() - self.upload_estimate():.6f}', flush=True)
        return out

    runkeep.budget.TimeBudget.late = kept
""")
    out = tmp_path / 'o'
    p = train(toy, out, '--eval_batch_size=1', '--max_minutes=600', '--watchdog_minutes=0', env=dict(ENV, **hook))
    kept = [float(l.split()[-1]) for l in p.stdout.splitlines() if l.startswith('test hook: kept')]
    assert kept and 'time budget' not in p.stdout, p.stdout[-3000:]
    took = json.load(open(out / 'results.json'))['wall_s']['eval']
    assert kept[-1] >= took, (kept[-1], took)
