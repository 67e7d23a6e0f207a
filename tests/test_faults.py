"""
Nothing lost: divergence, corrupt or foreign checkpoints, a full disk, bad data and bad config values, each
tried on real processes with real files. Every user error ends in a message that names the problem, never a
traceback, and no good checkpoint is lost.
    python -m pytest -q tests/test_faults.py
"""
import glob
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import TOY_ARGS, assert_user_error, run
from data import write_split

FAST = TOY_ARGS + ['--epochs=2', '--eval_interval=100', '--log_interval=4']  # 40 steps of batch 50 on the toy task


def train(toy, out, *extra, check=True, env=None):
    return run(['train.py', f'--data_path={toy}', f'--out_dir={out}'] + FAST + list(extra), check=check, env=env)


def ckpts(folder):
    return sorted(glob.glob(os.path.join(folder, 'ckpt_*.pt')))


# -----------------------------------------------------------------------------
# divergence

def test_divergence_keeps_only_sane_checkpoints_and_resume_with_lower_lr_trains_on(toy, tmp_path):
    out = tmp_path / 'o'
    p = train(toy, out, '--lr=1e6', '--checkpoint_interval=1', check=False)
    assert_user_error(p, 'diverged', 'init_from=resume')
    for path in ckpts(out):  # whatever was kept is finite and sane
        sd = torch.load(path, weights_only=True)['model']
        assert all(torch.isfinite(v).all() and v.abs().max() <= 1e4 for v in sd.values()), path
    p = train(toy, out, '--lr=1e-3', '--init_from=resume')  # no crash loop: training goes on
    assert 'saved' in p.stdout and ckpts(out)[-1].endswith('ckpt_00000040.pt')


def test_weights_that_give_a_nan_loss_are_set_aside_and_the_run_goes_on_from_the_one_before(toy, tmp_path):
    # weights that look saved but make the next loss NaN (a bit flip, a diverging step): the checkpoint that
    # produced them must not stay a resume candidate, or every resume dies the same way (a crash loop)
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=4')
    ck = torch.load(ckpts(out)[-1], weights_only=True)
    for sd in (ck['model'], ck['ema']):
        next(v for k, v in sd.items() if k.endswith('down_proj.weight'))[0, 0] = float('nan')
    torch.save(ck, ckpts(out)[-1])
    p = train(toy, out, '--init_from=resume', '--max_steps=16', '--checkpoint_interval=4', check=False)
    assert_user_error(p, 'loss became NaN or inf at step 9', 'ckpt_00000004.pt')
    assert [os.path.basename(c) for c in ckpts(out)] == ['ckpt_00000004.pt']
    assert os.path.exists(out / 'ckpt_00000008.pt.diverged')
    p = train(toy, out, '--init_from=resume', '--max_steps=16', '--checkpoint_interval=4')
    assert 'resuming from' in p.stdout and 'ckpt_00000004.pt' in p.stdout and 'saved' in p.stdout


# -----------------------------------------------------------------------------
# resume that refuses rather than guesses

def test_resume_with_only_corrupt_checkpoints_is_an_error_that_keeps_them(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10')
    for c in ckpts(out):
        open(c, 'wb').write(os.urandom(500))
    before = {c: open(c, 'rb').read() for c in ckpts(out)}
    # at the run's last step the newest is refused outright (an older one would stand in for its final weights)
    p = train(toy, out, '--init_from=resume', check=False)
    assert_user_error(p, 'ckpt_00000040.pt', 'an older one is not used')
    # training on, the older ones are tried too
    p = train(toy, out, '--init_from=resume', '--epochs=3', check=False)
    assert_user_error(p, 'none could be loaded', 'ckpt_00000040.pt')
    assert {c: open(c, 'rb').read() for c in ckpts(out)} == before  # nothing overwritten


def test_resume_from_a_checkpoint_whose_optimizer_state_does_not_fit_is_one_line_that_keeps_it(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4', '--checkpoint_interval=4')
    [c] = ckpts(out)
    ck = torch.load(c, weights_only=True)
    ck['optimizer']['state'][0]['exp_avg'] = torch.zeros(3)  # loads as a file, does not fit the model
    torch.save(ck, c)
    before = open(c, 'rb').read()
    p = train(toy, out, '--init_from=resume', '--max_steps=6', check=False)
    assert_user_error(p, 'resume failed', os.path.basename(c), 'does not fit this run',
                      'optimizer state of parameter 0 has shape (3,)', 'the file is kept')
    assert open(c, 'rb').read() == before and ckpts(out) == [c]


def test_a_known_corrupt_checkpoint_holds_no_slot_when_pruning(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--max_steps=20')
    assert [os.path.basename(c) for c in ckpts(out)] == ['ckpt_00000010.pt', 'ckpt_00000020.pt']
    open(ckpts(out)[-1], 'wb').write(b'garbage')  # the newest is corrupt: resume falls back to step 10
    p = train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--init_from=resume', '--max_steps=40')
    assert 'resuming from' in p.stdout and 'ckpt_00000010.pt' in p.stdout
    names = [os.path.basename(c) for c in ckpts(out)]
    assert names == ['ckpt_00000030.pt', 'ckpt_00000040.pt'], names
    for c in ckpts(out):
        torch.load(c, weights_only=True)  # every kept checkpoint loads


def test_keep_last_n_zero_keeps_everything(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--keep_last_n=0')
    assert len(ckpts(out)) == 4


def test_scratch_into_a_folder_with_checkpoints_is_refused_unless_overwrite(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    p = train(toy, out, '--max_steps=4', check=False)
    assert_user_error(p, str(out), '--init_from=resume', '--overwrite=True')
    p = train(toy, out, '--max_steps=4', '--checkpoint_interval=4', '--overwrite=True')
    assert [os.path.basename(c) for c in ckpts(out)] == ['ckpt_00000004.pt']  # the old run's ckpt_8 is gone


def test_resume_refuses_another_model_shape_or_batch_size_and_allows_a_lower_lr(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    p = train(toy, out, '--init_from=resume', '--global_batch_size=20', check=False)
    assert_user_error(p, 'global_batch_size=50', 'global_batch_size=20')
    p = train(toy, out, '--init_from=resume', '--hidden_size=64', check=False)
    assert_user_error(p, 'hidden_size=32', 'hidden_size=64')
    p = train(toy, out, '--init_from=resume', '--lr=1e-4', '--max_steps=12')
    assert 'lr: 0.002 -> 0.0001' in p.stdout and 'saved' in p.stdout


def test_resume_past_the_end_says_so(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    p = train(toy, out, '--init_from=resume', '--max_steps=8')
    assert 'nothing to do' in p.stdout


# -----------------------------------------------------------------------------
# a failed save

def test_a_full_disk_names_the_path_removes_the_tmp_and_keeps_the_previous_checkpoint(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    good = open(ckpts(out)[0], 'rb').read()
    limit = len(good) // 2  # a file may grow to half a checkpoint: the next save cannot be written
    wrapper = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
               "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")
    p = run(['-c', wrapper, f'--data_path={toy}', f'--out_dir={out}', '--init_from=resume', '--max_steps=16',
             '--checkpoint_interval=8'] + FAST, check=False)
    assert_user_error(p, 'ckpt_00000016.pt', 'File too large')
    assert not glob.glob(str(out / '*.tmp'))
    assert [os.path.basename(c) for c in ckpts(out)] == ['ckpt_00000008.pt']
    assert open(ckpts(out)[0], 'rb').read() == good


def test_stale_tmp_files_are_removed_at_start(toy, tmp_path):
    out = tmp_path / 'o'
    os.makedirs(out)
    (out / 'ckpt_00000123.pt.tmp').write_bytes(b'half a file')
    train(toy, out, '--max_steps=4')
    assert not glob.glob(str(out / '*.tmp'))


# -----------------------------------------------------------------------------
# --init_from files that are not what they should be

def test_init_from_files_that_are_not_checkpoints_of_this_model(toy, tmp_path):
    text = tmp_path / 'notes.txt'
    text.write_text('not a checkpoint')
    p = train(toy, tmp_path / 'a', f'--init_from={text}', '--max_steps=2', check=False)
    assert_user_error(p, 'notes.txt', 'corrupt or truncated')
    lst = tmp_path / 'list.pt'
    torch.save([1, 2, 3], lst)
    p = train(toy, tmp_path / 'b', f'--init_from={lst}', '--max_steps=2', check=False)
    assert_user_error(p, 'neither a checkpoint of this trainer nor a state dict')
    train(toy, tmp_path / 'c', '--max_steps=4', '--checkpoint_interval=4')
    other = ckpts(tmp_path / 'c')[0]
    p = train(toy, tmp_path / 'd', f'--init_from={other}', '--hidden_size=64', '--max_steps=2', check=False)
    assert_user_error(p, 'not weights of this model', 'hidden_size')
    p = train(toy, tmp_path / 'e', f'--init_from={tmp_path}/missing.pt', '--max_steps=2', check=False)
    assert_user_error(p, 'missing.pt')


def test_eval_only_needs_weights(toy, tmp_path):
    p = train(toy, tmp_path / 'o', '--eval_only=True', check=False)
    assert_user_error(p, 'eval_only=True needs')


# -----------------------------------------------------------------------------
# bad data: found at start, before the first step

def copy_dataset(toy, dest):
    shutil.copytree(toy, dest)
    return str(dest)


def test_truncated_test_labels_fail_at_start(toy, tmp_path):
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'test', 'all__labels.npy')
    data = open(path, 'rb').read()
    open(path, 'wb').write(data[:len(data) // 2])
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, 'all__labels.npy', 'start-up checks failed')
    assert 'step 1/' not in p.stdout and not os.path.exists(tmp_path / 'o' / 'metrics.jsonl')


def test_out_of_vocabulary_tokens_are_reported_with_file_and_row(toy, tmp_path):
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'train', 'all__labels.npy')
    labels = np.load(path)
    labels[737, 3] = 99
    np.save(path, labels)
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, 'train/all__labels.npy row 737, position 3: token 99 is outside the vocabulary [0, 6)')


def test_invalid_dataset_json_names_the_file(toy, tmp_path):
    d = copy_dataset(toy, tmp_path / 'd')
    open(os.path.join(d, 'test', 'dataset.json'), 'w').write('{"pad_id": 0,')
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, os.path.join('test', 'dataset.json'))


def test_empty_splits_are_refused_by_the_builders_and_the_trainer(toy, tmp_path):
    p = run(['prepare_sudoku.py', '--generate', '0', '--size', '4', '--num_test', '10',
             '--output_dir', str(tmp_path / 'g')], check=False)
    assert_user_error(p, 'no examples')
    p = run(['prepare_sudoku.py', '--generate', '40', '--size', '4', '--num_test', '0',
             '--output_dir', str(tmp_path / 'h')], check=False)
    assert_user_error(p, 'no examples')
    # a dataset emptied by hand: the trainer stops at start with the path (it used to loop forever)
    d = copy_dataset(toy, tmp_path / 'd')
    meta = json.load(open(os.path.join(d, 'train', 'dataset.json')))
    z = np.zeros((0, 8), np.int32)
    np.save(os.path.join(d, 'train', 'all__inputs.npy'), z)
    np.save(os.path.join(d, 'train', 'all__labels.npy'), z)
    np.save(os.path.join(d, 'train', 'all__puzzle_identifiers.npy'), np.zeros(0, np.int32))
    np.save(os.path.join(d, 'train', 'all__puzzle_indices.npy'), np.zeros(1, np.int32))
    np.save(os.path.join(d, 'train', 'all__group_indices.npy'), np.zeros(1, np.int32))
    assert meta['vocab_size'] == 6
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, 'holds no examples')


def test_start_up_data_check_is_fast_on_a_sudoku_extreme_sized_dataset(tmp_path):
    """1M examples of 81 tokens (the full Sudoku-Extreme train split's scale): the check runs through every
    row and still finds a bad token in the last one. (Its time is printed by -s, never asserted.)"""
    import time
    from data import check_split
    n, L = 1_000_000, 81
    x = np.random.default_rng(0).integers(1, 11, (n, L), dtype=np.int32)
    idx = np.arange(n + 1, dtype=np.int32)
    write_split(str(tmp_path), 'train', x, x, np.zeros(n, np.int32), idx, idx, vocab_size=11)
    t0 = time.perf_counter()
    assert check_split(str(tmp_path), 'train') == []
    print(f"\ncheck_split on {n:,} x {L}: {time.perf_counter() - t0:.2f} s")
    labels = np.load(tmp_path / 'train' / 'all__labels.npy', mmap_mode='r+')
    labels[-1, -1] = 11
    labels.flush()
    assert 'row 999999, position 80: token 11' in check_split(str(tmp_path), 'train')[0]


# -----------------------------------------------------------------------------
# config values: one table of rules, each broken once

RULE_CASES = [('--lr=-1', 'lr=-1'), ('--H_cycles=0', 'H_cycles=0'), ('--L_cycles=0', 'L_cycles=0'),
              ('--ema_rate=2.0', 'ema_rate=2.0'), ('--halt_exploration_prob=5', 'halt_exploration_prob=5'),
              ('--eval_interval=0', 'eval_interval=0'), ('--global_batch_size=0', 'global_batch_size=0'),
              ('--global_batch_size=-4', 'global_batch_size=-4'), ('--hidden_size=-1', 'hidden_size=-1'),
              ('--halt_max_steps=0', 'halt_max_steps=0'), ('--pos_encodings=alibi', "pos_encodings='alibi'"),
              ('--keep_last_n=-1', 'keep_last_n=-1'), ('--forward_dtype=int8', "forward_dtype='int8'")]


@pytest.mark.parametrize('flag,words', RULE_CASES)
def test_each_config_rule_names_key_value_and_what_is_allowed(toy, tmp_path, flag, words):
    p = train(toy, tmp_path / 'o', flag, check=False)
    assert_user_error(p, 'config error', words, 'allowed')


def test_config_keys_is_not_a_key(toy, tmp_path):
    p = train(toy, tmp_path / 'o', '--config_keys=[]', check=False)
    assert_user_error(p, "unknown key 'config_keys'")
