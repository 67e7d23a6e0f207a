"""
Training runs as a user runs them (train.py in a new process, on the CPU): a tiny TRM learns, resume is
bit-exact, 2-process torchrun equals 1 process, SIGTERM (also to one rank), NaN stop, corrupt checkpoints,
W&B offline runs, eval_only with test-time scaling, and the configurator's errors and overrides. Minutes.
    python -m pytest -q tests/test_train.py
"""
import glob
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TOY_ARGS, eval_lines, run, step_lines
from runkeep.checkpoint import CheckpointError, load_checkpoint


def test_a_tiny_trm_learns_and_its_ema_evaluates_at_least_as_well_as_its_raw_weights(toy, tmp_path):
    # 320 steps at ema_rate 0.999: an EMA without warm-up would still hold 85% of the initial weights at the
    # intermediate evaluation (step 160) and 73% at the end, and evaluate far below the raw weights
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/out', '--epochs=16', '--eval_every_epochs=8',
             '--log_interval=20'] + TOY_ARGS + ['--ema_rate=0.999'])
    rows = step_lines(p.stdout)
    print('\n'.join(l for l in p.stdout.splitlines() if l.startswith(('step', 'eval'))))
    assert rows[-1]['loss'] < 0.5 * rows[0]['loss']
    assert rows[-1]['acc'] > 0.9
    exact = lambda line: float(line.split('exact ')[1].split()[0])
    final = eval_lines(p.stdout)[-1]
    assert exact(final) > 0.5, final  # chance is 4^-8
    assert 'verified' not in final  # no verifier for a toy task
    ema_line = eval_lines(p.stdout)[0]
    raw_line = [l for l in p.stdout.splitlines() if l.startswith('eval of the raw weights (not the EMA) on')]
    assert len(raw_line) == 1  # intermediate evaluations only: the final one is the EMA's
    assert exact(raw_line[0]) > 0.15, raw_line  # the raw weights have learned something by step 160 (chance 4^-8)
    assert exact(ema_line) >= exact(raw_line[0]) - 0.1, (ema_line, raw_line)  # 200 examples: +-0.07 is noise
    with open(f'{tmp_path}/out/metrics.jsonl') as f:
        evals = [json.loads(l) for l in f if '"kind": "eval"' in l]
    assert 'raw' in evals[0] and 'raw' not in evals[-1]
    assert abs(evals[0]['raw']['exact_accuracy'] - exact(raw_line[0])) < 1e-4


def final_state(path):
    ck = torch.load(path, weights_only=True)
    return ck


def assert_same_state(a, b, exact=True):
    for key in ('model', 'ema'):
        for k in a[key]:
            if exact:
                assert torch.equal(a[key][k], b[key][k]), (key, k)
            else:
                torch.testing.assert_close(a[key][k], b[key][k], rtol=1e-4, atol=5e-5, msg=f'{key} {k}')  # float noise ~1e-5; a step moves ~1e-3


def test_resume_continues_exactly(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=4', '--eval_every_epochs=100', '--log_interval=5', '--puzzle_emb_ndim=16',
              '--halt_exploration_prob=0.5'] + TOY_ARGS
    common = [a for a in common if not a.startswith('--puzzle_emb_ndim=0')]
    run(['train.py', f'--out_dir={tmp_path}/straight', '--max_steps=16'] + common)
    run(['train.py', f'--out_dir={tmp_path}/split', '--max_steps=8'] + common)
    assert os.path.exists(f'{tmp_path}/split/ckpt_00000008.pt')
    p = run(['train.py', f'--out_dir={tmp_path}/split', '--max_steps=16', '--init_from=resume'] + common)
    assert 'resuming from' in p.stdout and 'step 8' in p.stdout
    a = final_state(f'{tmp_path}/straight/ckpt_00000016.pt')
    b = final_state(f'{tmp_path}/split/ckpt_00000016.pt')
    assert_same_state(a, b, exact=True)
    assert torch.equal(a['model']['puzzle_emb'], b['model']['puzzle_emb']) and a['model']['puzzle_emb'].abs().sum() > 0
    for k in a['carry']:
        assert torch.equal(a['carry'][k], b['carry'][k]), k
    assert a['loader'] == b['loader'] and a['step'] == b['step'] == 16


def test_torchrun_two_processes_equal_one(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=2', '--eval_every_epochs=100', '--log_interval=10', '--max_steps=10',
              '--halt_exploration_prob=0.0', '--puzzle_emb_ndim=16'] + TOY_ARGS
    common = [a for a in common if not a.startswith('--puzzle_emb_ndim=0')]
    run(['train.py', f'--out_dir={tmp_path}/one'] + common)
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--out_dir={tmp_path}/two']
        + common, env=dict(OMP_NUM_THREADS='1'))
    a = final_state(f'{tmp_path}/one/ckpt_00000010.pt')
    b = final_state(f'{tmp_path}/two/ckpt_00000010.pt')
    assert_same_state(a, b, exact=False)
    torch.testing.assert_close(a['model']['puzzle_emb'], b['model']['puzzle_emb'])
    assert b['carry']['inputs'].shape[0] == 50  # the whole global batch's carry is saved


def test_sigterm_saves_and_resume_continues(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=200', '--eval_every_epochs=1000',
            '--log_interval=1'] + TOY_ARGS
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith('step 3/'):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    out = ''.join(out) + rest
    assert proc.returncode == 0, out
    assert 'stopped cleanly' in out
    ckpts = glob.glob(f'{tmp_path}/o/ckpt_*.pt')
    assert len(ckpts) == 1
    step = torch.load(ckpts[0], weights_only=True)['step']
    assert step >= 3
    p = run(args + ['--init_from=resume', f'--max_steps={step + 2}'])
    assert 'resuming from' in p.stdout and f'step {step + 2}/' in p.stdout


def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(toy, tmp_path):
    args = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--data_path={toy}',
            f'--out_dir={tmp_path}/o', '--epochs=200', '--eval_every_epochs=1000', '--log_interval=2'] + TOY_ARGS
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith('step 4/'):
            workers = subprocess.run(['pgrep', '-P', str(proc.pid)], capture_output=True, text=True).stdout.split()
            assert len(workers) == 2, workers
            os.kill(int(workers[1]), signal.SIGTERM)  # rank 1 only: as when one host is told first
            break
    try:
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    out = ''.join(out) + rest
    assert proc.returncode == 0, out
    assert 'stopped cleanly' in out
    ckpts = glob.glob(f'{tmp_path}/o/ckpt_*.pt')
    assert len(ckpts) == 1 and torch.load(ckpts[0], weights_only=True)['carry']['inputs'].shape[0] == 50


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_every_epochs=100',
            '--log_interval=5', '--checkpoint_interval=5'] + TOY_ARGS
    run(args + ['--max_steps=5'])
    p = run(args + ['--init_from=resume', '--lr=1e30', '--lr_warmup_steps=1'], check=False)
    assert p.returncode != 0
    assert 'loss became NaN or inf at step' in p.stdout + p.stderr
    assert sorted(os.path.basename(c) for c in glob.glob(f'{tmp_path}/o/ckpt_*')) == ['ckpt_00000005.pt']


def test_truncated_checkpoint_is_reported_and_not_loaded(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_every_epochs=100',
            '--log_interval=2', '--checkpoint_interval=2'] + TOY_ARGS
    run(args + ['--max_steps=4', '--keep_last_n=3'])
    newest = f'{tmp_path}/o/ckpt_00000004.pt'
    data = open(newest, 'rb').read()
    open(newest, 'wb').write(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match='ckpt_00000004.pt is corrupt or truncated'):
        load_checkpoint(newest)
    # resume reports it and continues from the newest good one
    p = run(args + ['--init_from=resume', '--max_steps=6'])
    assert 'ckpt_00000004.pt is corrupt or truncated' in p.stdout
    assert 'resuming from' in p.stdout and '(step 2)' in p.stdout


def test_wandb_offline_run_is_continued_after_resume(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_every_epochs=100',
            '--log_interval=2', '--wandb_log=True', '--wandb_run_name=smoke'] + TOY_ARGS
    env = dict(WANDB_MODE='offline', WANDB_SILENT='true')
    run(args + ['--max_steps=4'], env=env)
    run(args + ['--max_steps=6', '--init_from=resume'], env=env)
    runs = sorted(glob.glob(f'{tmp_path}/o/wandb/offline-run-*'))
    assert len(runs) == 2
    ids = {r.rsplit('-', 1)[1] for r in runs}
    assert len(ids) == 1  # the same run id both times
    ck = torch.load(f'{tmp_path}/o/ckpt_00000006.pt', weights_only=True)
    assert ck['run_id'] == ids.pop()


def test_eval_only_with_test_time_scaling(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_every_epochs=100',
            '--log_interval=5'] + TOY_ARGS
    run(args + ['--max_steps=5'])
    p = run(args + [f'--init_from={tmp_path}/o/ckpt_00000005.pt', '--eval_only=True', '--eval_steps=6'])
    line = eval_lines(p.stdout)[-1]
    assert 'loaded weights from' in p.stdout and 'eval on 200' in line
    by_steps = line.split('exact by steps: ')[1].split()
    assert [s.split(':')[0] for s in by_steps] == ['1', '2', '3', '4', '5', '6']
    exact_at_4 = float(line.split('exact ')[1].split()[0])
    assert abs(float(by_steps[3].split(':')[1]) - exact_at_4) < 1e-3  # the headline is at halt_max_steps
    assert 'with q_halt stop' in line


# -----------------------------------------------------------------------------
# configurator

def test_configurator_errors_and_overrides(toy, tmp_path):
    p = run(['train.py', '--L_cycle=4'], check=False)
    assert p.returncode != 0 and "unknown key 'L_cycle'" in p.stderr and 'L_cycles' in p.stderr
    p = run(['train.py', '--L_cycles=four'], check=False)
    assert p.returncode != 0 and 'L_cycles' in p.stderr and 'int' in p.stderr
    cfg = tmp_path / 'bad.py'
    cfg.write_text("lr = 1e-3\nhiden_size = 8\n")
    p = run(['train.py', str(cfg)], check=False)
    assert "unknown key 'hiden_size'" in p.stderr and str(cfg) in p.stderr and 'hidden_size' in p.stderr
    cfg.write_text("lr = 1e-3\nx = (\n")
    p = run(['train.py', str(cfg)], check=False)
    assert p.returncode != 0 and 'bad.py' in p.stderr and 'line 2' in p.stderr
    p = run(['train.py', '--no_such_file.py'], check=False)
    assert p.returncode != 0
    # an int where a float is expected, a value containing '=', a file then an override
    good = tmp_path / 'good.py'
    good.write_text(f"data_path = '{toy}'\nmax_steps = 1\nlr = 1\n")
    p = run(['train.py', str(good), f'--out_dir={tmp_path}/a=b', '--max_steps=2', '--init_from=scratch',
             '--wandb_run_name=x=y'] + TOY_ARGS)
    assert "out_dir = '" + f'{tmp_path}/a=b' in p.stdout and "wandb_run_name = 'x=y'" in p.stdout
    assert 'eval on 200' in p.stdout


def test_gradient_accumulation_gives_the_update_of_one_batch(toy, tmp_path):
    """gradient_accumulation_steps=2: each half of the batch with its half of the ACT carry, the gradients added
    up before one update: the same losses, gradient norms and weights as one batch up to float rounding over the
    first steps (ACT exploration off: its random draws come in another order); later, Adam's normalised updates
    and ACT's discrete halting let that rounding grow, so the learning curves are compared (within 5%)."""
    common = [f'--data_path={toy}', '--max_steps=40', '--log_interval=2', '--eval_every_epochs=1000',
              '--halt_exploration_prob=0.0', '--checkpoint_interval=4', '--keep_last_n=0'] + TOY_ARGS
    run(['train.py', f'--out_dir={tmp_path}/one'] + common)
    two = run(['train.py', f'--out_dir={tmp_path}/two', '--gradient_accumulation_steps=2'] + common)
    a, b = ([json.loads(l) for l in open(f'{tmp_path}/{d}/metrics.jsonl')] for d in ('one', 'two'))
    a, b = ([l for l in x if l['kind'] == 'train'] for x in (a, b))
    assert len(a) == len(b) == 20 and len(step_lines(two.stdout)) == 20  # the log line carries grad_norm too
    for x, y in zip(a[:2], b[:2]):  # steps 1-4
        assert abs(x['loss'] - y['loss']) <= 1e-5 * x['loss'], (x, y)
        assert abs(x['grad_norm'] - y['grad_norm']) <= 1e-4 * x['grad_norm'] and x['grad_norm'] > 0, (x, y)
    wa = load_checkpoint(f'{tmp_path}/one/ckpt_00000004.pt')['model']
    wb = load_checkpoint(f'{tmp_path}/two/ckpt_00000004.pt')['model']
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
    for x, y in zip(a, b):  # the learning curves: every window's loss
        assert abs(x['loss'] - y['loss']) <= 0.05 * x['loss'], (x['step'], x['loss'], y['loss'])
    assert b[-1]['loss'] < 0.8 * b[0]['loss']  # and it learns
    p = run(['train.py', f'--out_dir={tmp_path}/bad', '--gradient_accumulation_steps=3'] + common, check=False)
    assert p.returncode == 1 and 'global_batch_size=50 is not divisible by the world size 1 x ' \
        'gradient_accumulation_steps=3' in p.stderr, p.stderr


def test_grad_clip_scales_the_gradient_to_its_limit():
    """apply_update clips the global gradient norm (all parameters together) and returns the norm before
    clipping; below the limit the gradient is left as it is."""
    from model import TRM, TRMConfig
    from conftest import TINY
    from step import AdamATan2, StepConfig, apply_update
    model = TRM(TRMConfig(**TINY))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    want = 0.5 * sum(p.numel() for p in model.parameters()) ** 0.5
    sc = StepConfig(lr=1e-3, puzzle_emb_lr=0.0, puzzle_emb_weight_decay=0.0, warmup_steps=1, total_steps=10,
                    min_ratio=1.0, global_batch_size=1, grad_clip=1.0)
    seen = []
    opt = AdamATan2(model.parameters(), lr=1e-3)
    opt.step = lambda grads, lr: seen.extend(g.clone() for g in grads)  # what the optimizer sees
    norm = apply_update(model, opt, [], [p.grad for p in opt.params], None, None, torch.zeros(()), sc)
    assert abs(float(norm) - want) < 1e-3 * want
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen]))
    assert abs(float(clipped) - 1.0) < 1e-4, float(clipped)
    seen.clear()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    apply_update(model, opt, [], [p.grad for p in opt.params], None, None, torch.zeros(()),
                 StepConfig(**{**sc.__dict__, 'grad_clip': 1e6}))
    assert seen and all(torch.equal(g, torch.full_like(g, 0.5)) for g in seen)
