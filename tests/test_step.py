"""
One training step, however its batch is split: gradient accumulation gives the update of one batch, 2 torchrun
processes give the weights of 1, and the gradient's clipping scales it to its limit and no further. Real train.py
processes on the toy task (the clipping in-process).
    python -m pytest -q tests/test_step.py
"""
import json
import os

import numpy as np
import torch

from conftest import TINY, TOY_ARGS, run, step_lines
from data import write_split
from runkeep.checkpoint import load_checkpoint


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


def test_torchrun_two_processes_equal_one(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=2', '--eval_every_epochs=100', '--log_interval=10', '--max_steps=10',
              '--halt_exploration_prob=0.0'] + [a for a in TOY_ARGS if a != '--puzzle_emb_ndim=0'] + \
        ['--puzzle_emb_ndim=16']
    run(['train.py', f'--out_dir={tmp_path}/one'] + common)
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--out_dir={tmp_path}/two']
        + common, env=dict(OMP_NUM_THREADS='1'))
    a = torch.load(f'{tmp_path}/one/ckpt_00000010.pt', weights_only=True)
    b = torch.load(f'{tmp_path}/two/ckpt_00000010.pt', weights_only=True)
    for key in ('model', 'ema'):  # float noise ~1e-5; a step moves ~1e-3
        for k in a[key]:
            torch.testing.assert_close(a[key][k], b[key][k], rtol=1e-4, atol=5e-5, msg=f'{key} {k}')
    torch.testing.assert_close(a['model']['puzzle_emb'], b['model']['puzzle_emb'])
    assert b['carry']['inputs'].shape[0] == 50  # the whole global batch's carry is saved


def test_two_processes_train_as_one_process_of_two_micro_batches_and_resume_on_two(tmp_path):
    """torchrun's 2 ranks and 1 process with gradient_accumulation_steps=2 add the same two halves of the batch's
    gradients in the same order: the same weights, EMA, optimizer moments, ACT carry and puzzle-embedding table
    (40 puzzles: each row's sign-SGD step from the whole batch's gradients), bit for bit; the 1-process run's
    checkpoint resumed on 2 ranks (each its half of the saved carry) goes on as the 2-rank run did. ACT
    exploration off (each rank draws its own); rows halt from the first steps (no_ACT_continue=False), so the
    carry's rows matter."""
    rng = np.random.default_rng(0)
    root = str(tmp_path / 'd')
    for split, n, ids in (('train', 400, np.arange(1, 41)), ('test', 10, np.arange(1, 11))):
        x = rng.integers(2, 6, (n, 8))
        write_split(root, split, x, x[:, ::-1], ids, np.arange(0, n + 1, n // len(ids)), np.arange(len(ids) + 1),
                    vocab_size=6, num_puzzle_identifiers=41)
    common = [f'--data_path={root}', '--epochs=20', '--eval_every_epochs=1000', '--log_interval=1', '--max_steps=8',
              '--checkpoint_interval=4', '--keep_last_n=0', '--halt_exploration_prob=0.0', '--no_ACT_continue=False',
              '--puzzle_emb_len=2', '--puzzle_emb_lr=1e-2'] + \
        [a for a in TOY_ARGS if a != '--puzzle_emb_ndim=0'] + ['--puzzle_emb_ndim=16']
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--out_dir={tmp_path}/two']
        + common, env=dict(OMP_NUM_THREADS='1'))
    run(['train.py', f'--out_dir={tmp_path}/one', '--gradient_accumulation_steps=2'] + common)
    (tmp_path / 'resumed').mkdir()
    os.replace(tmp_path / 'one' / 'ckpt_00000004.pt', tmp_path / 'resumed' / 'ckpt_00000004.pt')
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
         f'--out_dir={tmp_path}/resumed', '--init_from=resume'] + common, env=dict(OMP_NUM_THREADS='1'))
    a, b, c = (torch.load(tmp_path / d / 'ckpt_00000008.pt', weights_only=True) for d in ('two', 'one', 'resumed'))
    for other in (b, c):
        for key in ('model', 'ema', 'carry'):
            for k in a[key]:
                assert torch.equal(a[key][k], other[key][k]), (key, k)
        for i, st in a['optimizer']['state'].items():
            assert all(torch.equal(v, other['optimizer']['state'][i][n]) for n, v in st.items()), i
    assert (a['model']['puzzle_emb'] != 0).any(1).sum() >= 20  # the table trained, row by row
    saved = torch.load(tmp_path / 'resumed' / 'ckpt_00000004.pt', weights_only=True)['carry']['halted']
    assert not saved[:25].all() and not saved[25:].all()  # rows mid-flight on both ranks' halves at the resume
    logs = [[(l['step'], l['loss'], l['grad_norm']) for l in map(json.loads, open(tmp_path / d / 'metrics.jsonl'))
             if l['kind'] == 'train'] for d in ('two', 'one')]
    assert len(logs[0]) == 8 and logs[0] == logs[1]


def test_grad_clip_scales_the_gradient_to_its_limit():
    """apply_update clips the global gradient norm (all parameters together) and returns the norm before
    clipping; below the limit the gradient is left as it is."""
    from model import TRM, TRMConfig
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
