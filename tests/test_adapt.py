"""
A checkpoint's puzzle-embedding table belongs to its dataset's identifiers: a resume, --eval_only and solve.py
refuse a dataset whose identifiers differ (rebuilt with another --seed or --num_aug), in one line naming the
dataset and both counts; a training run from the checkpoint onto such a dataset adapts instead (the network
from the checkpoint, a new table of the checkpoint's mean row), and freeze_weights=True trains only that table.
Tiny synthetic ARC sets on a 4x4 canvas, a few steps each: about two minutes on one core.
    python -m pytest -q tests/test_adapt.py
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import XLA_ENV, assert_user_error, ckpts, run
from model import to_reference_state_dict
from test_dist import assert_all_ranks_stopped_with, torchrun

TINY = ['--hidden_size=32', '--num_heads=2', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32',
        '--puzzle_emb_len=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=3', '--global_batch_size=8',
        '--eval_batch_size=6', '--lr=2e-3', '--lr_warmup_steps=1', '--forward_dtype=float32',
        '--loss_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--epochs=100', '--eval_every_epochs=1000',
        '--log_interval=1', '--tensorboard=False']
ENV = {'OMP_NUM_THREADS': '1'}


def build(out, *extra):
    """A synthetic ARC set: 4 trained and 2 evaluated tasks on a 4x4 canvas, 2 augmentations (19 identifiers
    at the default seed)."""
    run(['prepare_arc.py', '--synthetic', '--canvas=4', '--num_tasks=4', '--num_eval_tasks=2', '--num_aug=2',
         f'--output_dir={out}', *extra], env=ENV)
    return str(out)


def train(data, out, *extra, check=True):
    return run(['train.py', f'--data_path={data}', f'--out_dir={out}'] + TINY + list(extra), env=ENV, check=check)


def count(data):
    return json.load(open(os.path.join(data, 'train', 'dataset.json')))['num_puzzle_identifiers']


@pytest.fixture(scope='module')
def sets(tmp_path_factory):
    """(a: 19 identifiers, seed 42; b: 19 identifiers of other puzzles, --seed 1; c: 31, --num_aug 4; a run of
    3 steps on a: its checkpoint)."""
    root = tmp_path_factory.mktemp('adapt')
    a, b = build(root / 'a'), build(root / 'b', '--seed=1')
    c = build(root / 'c', '--num_aug=4')
    assert count(a) == count(b) == 19 and count(c) == 31
    train(a, root / 'run', '--max_steps=3')
    return a, b, c, str(root / 'run' / 'ckpt_00000003.pt')


def network(sd):
    return {k: v for k, v in sd.items() if k != 'puzzle_emb'}


def test_a_dataset_rebuilt_with_another_seed_is_refused_by_resume_eval_only_and_solve(tmp_path):
    data, out = build(tmp_path / 'd'), tmp_path / 'o'
    train(data, out, '--max_steps=3')
    build(data, '--seed=1')  # the same folder, the same count (19), other names: 18 of 19 rows mean others
    ckpt = str(out / 'ckpt_00000003.pt')
    p = train(data, out, '--init_from=resume', '--max_steps=5', check=False)
    assert_user_error(p, f"{ckpt} was trained on other puzzle identifiers than the dataset {data} holds")
    assert ckpts(out) == ['ckpt_00000003.pt'] and 'step 4/' not in p.stdout  # nothing trained, nothing lost
    for init in ('resume', ckpt):
        p = train(data, out, '--eval_only=True', f'--init_from={init}', check=False)
        assert_user_error(p, 'other puzzle identifiers', data, ckpt)
        assert 'eval on' not in p.stdout
    task = str(np.load(os.path.join(data, 'test_views.npz'))['tasks'][0])
    p = run(['solve.py', f'--init_from={ckpt}', f'--data_path={data}', f'--task={task}', '--device=cpu'],
            env=ENV, check=False)
    assert_user_error(p, 'other puzzle identifiers', data, ckpt)


@pytest.mark.parametrize('damage', ['missing', 'unreadable'])
def test_a_rebuilt_dataset_whose_identifiers_json_cannot_be_read_is_refused_not_only_counted(tmp_path, damage):
    data, out = build(tmp_path / 'd'), tmp_path / 'o'
    train(data, out, '--max_steps=3')
    build(data, '--seed=1')  # other names, the same count: only identifiers.json tells them apart
    ids, ckpt = os.path.join(data, 'identifiers.json'), str(out / 'ckpt_00000003.pt')
    if damage == 'missing':
        os.remove(ids)
    else:
        open(ids, 'w').write('["<blank>", "a0')  # cut short
    p = train(data, out, '--init_from=resume', '--max_steps=5', check=False)
    assert_user_error(p, f"{ckpt} records which puzzles", ids, 'cannot be checked')
    assert ckpts(out) == ['ckpt_00000003.pt'] and 'step 4/' not in p.stdout
    for init in ('resume', ckpt):
        p = train(data, out, '--eval_only=True', f'--init_from={init}', check=False)
        assert_user_error(p, f"{ckpt} records which puzzles", ids)
        assert 'eval on' not in p.stdout
    # a run trained on that dataset records no names: its resume checks only their count, and says so once
    fresh = tmp_path / 'fresh'
    p = train(data, fresh, '--max_steps=2')
    said = [l for l in p.stdout.splitlines() if l.startswith('warning') and ids in l]  # its start said nothing
    assert len(said) == (damage == 'unreadable') and all('cannot be read' in l for l in said), p.stdout[-3000:]
    p = train(data, fresh, '--init_from=resume', '--max_steps=3')
    said = [l for l in p.stdout.splitlines() if 'only their count is checked' in l]
    assert len(said) == 1 and 'identifiers.json' in said[0], p.stdout[-3000:]


def test_a_dataset_rebuilt_with_more_augmentations_is_refused_naming_both_counts(sets, tmp_path):
    a, _, c, ckpt = sets
    out = tmp_path / 'o'
    shutil.copytree(os.path.dirname(ckpt), out)
    mine = str(out / 'ckpt_00000003.pt')
    p = train(c, out, '--init_from=resume', '--max_steps=5', check=False)
    assert_user_error(p, f"{mine} holds a puzzle-embedding table of 19 identifiers; the dataset {c} has 31")
    assert 'Move it aside' not in p.stderr  # every older checkpoint has the same table
    p = train(c, out, '--eval_only=True', f'--init_from={mine}', check=False)
    assert_user_error(p, f"{mine} holds a puzzle-embedding table of 19 identifiers; the dataset {c} has 31")
    assert 'check hidden_size' not in p.stderr
    p = run(['solve.py', f'--init_from={ckpt}', f'--data_path={c}', '--index=0', '--device=cpu'], env=ENV,
            check=False)
    assert_user_error(p, 'table of 19 identifiers', f'the dataset {c} has 31')


def test_hosts_whose_copies_of_the_dataset_name_other_identifiers_stop_at_start(sets, tmp_path):
    a = sets[0]
    for host in ('h0', 'h1'):
        shutil.copytree(a, tmp_path / host / 'd')
    names = json.load(open(tmp_path / 'h1' / 'd' / 'identifiers.json'))
    json.dump(names[:1] + names[:0:-1], open(tmp_path / 'h1' / 'd' / 'identifiers.json', 'w'))  # only the names
    wrapper = f"os.chdir({str(tmp_path / 'h1')!r} if os.environ['RANK'] == '1' else {str(tmp_path / 'h0')!r})"
    p = torchrun(2, ['--data_path=d', f'--out_dir={tmp_path}/o', '--max_steps=2'] + TINY, wrapper=wrapper)
    assert_all_ranks_stopped_with(p, "the hosts' copies of d hold different identifiers.json")
    assert 'step 1/' not in p.stdout


def test_a_checkpoint_saved_before_the_identifiers_were_recorded_still_resumes_and_says_so_once(sets, tmp_path):
    a, _, c, ckpt = sets
    out = tmp_path / 'o'
    os.makedirs(out)
    old = torch.load(ckpt, weights_only=True)
    del old['identifiers']
    torch.save(old, out / 'ckpt_00000003.pt')
    p = train(a, out, '--init_from=resume', '--max_steps=4')
    said = [l for l in p.stdout.splitlines() if 'only their count is checked' in l]
    assert len(said) == 1 and 'was saved before checkpoints recorded' in said[0], p.stdout[-3000:]
    assert ckpts(out)[-1] == 'ckpt_00000004.pt'
    assert torch.load(out / 'ckpt_00000004.pt', weights_only=True)['identifiers']['count'] == 19
    p = train(c, out, '--eval_only=True', f"--init_from={out / 'ckpt_00000003.pt'}", check=False)
    assert_user_error(p, 'table of 19 identifiers', f'the dataset {c} has 31')


def test_training_from_a_checkpoint_onto_other_identifiers_starts_from_its_network_and_mean_row(sets, tmp_path):
    a, b, c, ckpt = sets
    src = torch.load(ckpt, weights_only=True)
    mean = src['model']['puzzle_emb'].double().mean(0).float()
    assert not torch.equal(mean, torch.zeros_like(mean))  # 3 steps of sign-SGD moved the rows
    # an LR too small to move a float32 weight, no embedding update: the weights saved after step 1 are the
    # ones the run started from
    still = ['--max_steps=1', '--lr=1e-30', '--weight_decay=0', '--puzzle_emb_lr=0', '--puzzle_emb_weight_decay=0']
    p = train(c, tmp_path / 'c', f'--init_from={ckpt}', *still)
    assert (f"init_from={ckpt}: network from step 3 (its EMA weights); puzzle-embedding table replaced: 19 -> 31 "
            "identifiers, every row the checkpoint's mean row") in p.stdout.splitlines(), p.stdout[-3000:]
    new = torch.load(tmp_path / 'c' / 'ckpt_00000001.pt', weights_only=True)
    for weights in ('model', 'ema'):  # both start from the checkpoint's EMA weights
        for k, v in network(src['ema']).items():
            torch.testing.assert_close(new[weights][k], v, rtol=1e-6, atol=0, msg=k)
    table = new['model']['puzzle_emb']
    assert table.shape == (31, 32)
    torch.testing.assert_close(table, mean.expand(31, 32), rtol=1e-6, atol=1e-7)
    assert new['identifiers']['count'] == 31  # the run is bound to its own dataset from now on
    # the same count, other puzzles: a new table too
    p = train(b, tmp_path / 'b', f'--init_from={ckpt}', *still)
    assert "puzzle-embedding table replaced: 19 -> 19 identifiers (of other puzzles)" in p.stdout, p.stdout[-3000:]
    table = torch.load(tmp_path / 'b' / 'ckpt_00000001.pt', weights_only=True)['model']['puzzle_emb']
    torch.testing.assert_close(table, mean.expand(19, 32), rtol=1e-6, atol=1e-7)
    # its own identifiers: the table as it was
    p = train(a, tmp_path / 'a', f'--init_from={ckpt}', *still)
    assert f"loaded weights from {ckpt}" in p.stdout and 'replaced' not in p.stdout
    table = torch.load(tmp_path / 'a' / 'ckpt_00000001.pt', weights_only=True)['model']['puzzle_emb']
    assert torch.equal(table, src['model']['puzzle_emb'])


def test_a_reference_state_dict_is_checked_by_its_table_s_rows(sets, tmp_path):
    a, _, c, ckpt = sets
    ref = tmp_path / 'step_3'  # the reference's published layout: no identifiers, the count in the table
    torch.save(to_reference_state_dict(torch.load(ckpt, weights_only=True)['ema']), ref)
    p = train(c, tmp_path / 'e', '--eval_only=True', f'--init_from={ref}', check=False)
    assert_user_error(p, f"{ref} holds a puzzle-embedding table of 19 identifiers; the dataset {c} has 31")
    p = train(a, tmp_path / 'e', '--eval_only=True', f'--init_from={ref}')
    assert 'is a state dict, which records no dataset identifiers: only their count is checked' in p.stdout
    assert 'eval on 6' in p.stdout
    p = train(c, tmp_path / 'o', f'--init_from={ref}', '--max_steps=1')
    assert (f"init_from={ref}: network from the reference state dict; puzzle-embedding table replaced: 19 -> 31 "
            "identifiers") in p.stdout, p.stdout[-3000:]


def frozen_run(c, ckpt, out, *extra, steps=4, env=None):
    """`steps` steps from ckpt onto c with only the puzzle embedding trained: (the process, its last
    checkpoint)."""
    p = run(['train.py', f'--data_path={c}', f'--out_dir={out}', f'--init_from={ckpt}', '--freeze_weights=True',
             '--puzzle_emb_lr=1e-2'] + TINY + [f'--max_steps={steps}'] + list(extra), env=dict(ENV, **(env or {})))
    return p, torch.load(os.path.join(out, f'ckpt_{steps:08d}.pt'), weights_only=True)


def test_freeze_weights_trains_only_the_puzzle_embedding(sets, tmp_path):
    a, _, c, ckpt = sets
    src = torch.load(ckpt, weights_only=True)
    p, new = frozen_run(c, ckpt, tmp_path / 'o')
    for weights in ('model', 'ema'):  # not a bit moved: no AdamATan2 step, no weight decay, no EMA rounding
        for k, v in network(src['ema']).items():
            assert torch.equal(new[weights][k], v), (weights, k)
    assert new['optimizer']['state'] == {}  # AdamATan2 never saw a gradient
    table = new['model']['puzzle_emb']
    assert table.shape == (31, 32) and (table != table[0]).any(dim=1).sum() >= 4  # trained rows moved apart
    p = train(c, tmp_path / 'z', '--freeze_weights=True', '--puzzle_emb_ndim=0', check=False)
    assert_user_error(p, 'freeze_weights=True trains only the puzzle embedding', 'puzzle_emb_ndim=0')


def test_freeze_weights_on_xla_leaves_the_network_and_compiles_once(sets, tmp_path):
    pytest.importorskip('torch_xla')
    a, _, c, ckpt = sets
    src = torch.load(ckpt, weights_only=True)
    p, new = frozen_run(c, ckpt, tmp_path / 'x', '--device=xla', steps=6, env=XLA_ENV)
    for weights in ('model', 'ema'):
        for k, v in network(src['ema']).items():
            assert torch.equal(new[weights][k], v), (weights, k)
    compiles = [int(l.rsplit('compiles ', 1)[1]) for l in p.stdout.splitlines() if l.startswith('step ')]
    assert len(compiles) == 6 and compiles[2:] == [compiles[1]] * 4, compiles  # no new graph after step 2
    assert 'CPU fallbacks: none' in p.stdout


def test_resume_or_start_from_a_file_starts_from_it_once_then_resumes_its_own_run(sets, tmp_path):
    """init_from=resume:FILE (what a study or a preempted job reruns unchanged): the first start adapts from FILE,
    every later one resumes the run's own newest checkpoint."""
    a, b, c, ckpt = sets
    out, again = tmp_path / 'c', f'--init_from=resume:{ckpt}'
    p = train(c, out, again, '--max_steps=2')
    lines = p.stdout.splitlines()
    assert f"init_from=resume:{ckpt}: no checkpoint in {out} yet, starting from {ckpt}" in lines, p.stdout[-3000:]
    assert any(l.startswith(f"init_from={ckpt}: network from step 3") and '19 -> 31 identifiers' in l for l in lines)
    assert ckpts(out) == ['ckpt_00000002.pt']
    p = train(c, out, again, '--max_steps=4')
    assert 'resuming from' in p.stdout and 'ckpt_00000002.pt' in p.stdout and 'mean row' not in p.stdout
    assert ckpts(out)[-1] == 'ckpt_00000004.pt'


def test_resume_from_a_file_that_is_gone_resumes_the_run_s_own_checkpoints_and_else_says_it_is_missing(sets,
                                                                                                      tmp_path):
    a, b, c, ckpt = sets
    src, out = tmp_path / 'pretrained.pt', tmp_path / 'c'
    shutil.copy(ckpt, src)
    again = f'--init_from=resume:{src}'
    train(c, out, again, '--max_steps=2')
    os.remove(src)  # the pretrained file is gone (a cleaned cache, a new VM): the run's own checkpoints go on
    p = train(c, out, again, '--max_steps=4')
    assert f"resuming from {out / 'ckpt_00000002.pt'}" in p.stdout and ckpts(out)[-1] == 'ckpt_00000004.pt'
    new = tmp_path / 'x'  # no checkpoint of its own yet, and the file gone: one line naming the file
    p = train(c, new, again, check=False)
    assert_user_error(p, f"init_from=resume:{src}: {src} is missing", f"{new} holds no checkpoint")
    assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, p.stderr
    assert 'step 1/' not in p.stdout and not ckpts(new)


@pytest.mark.parametrize('init', ['resume:resume', 'resume:', 'resume:scratch', 'resume:resume:{ckpt}'])
def test_resume_followed_by_no_file_is_refused_in_one_line(sets, tmp_path, init):
    a, b, c, ckpt = sets
    init = init.format(ckpt=ckpt)
    p = train(c, tmp_path / 'o', f'--init_from={init}', check=False)
    assert_user_error(p, f"init_from={init!r}", "'resume:' is followed by the checkpoint file", '--init_from=resume')
    assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, p.stderr
    assert 'corrupt' not in p.stderr and not os.path.exists(tmp_path / 'o')


def test_a_missing_or_folder_init_from_names_what_it_is(sets, tmp_path):
    a, b, c, ckpt = sets
    for init, what in ((tmp_path / 'none.pt', 'no such file'), (tmp_path, 'a folder, not a checkpoint file')):
        p = train(c, tmp_path / 'o', f'--init_from={init}', check=False)
        assert_user_error(p, f"init_from={init}: {what}")
