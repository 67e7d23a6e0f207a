"""
Checkpoints: divergence keeps only sane ones, weights that give a NaN are set aside, corrupt and stale files are
named and never take a slot, a full disk keeps the previous checkpoint.
"""
import glob
import os

import torch

from conftest import FAST, assert_user_error, ckpt_paths, run, train


def test_divergence_keeps_only_sane_checkpoints_and_resume_with_lower_lr_trains_on(toy, tmp_path):
    out = tmp_path / 'o'
    p = train(toy, out, '--lr=1e6', '--checkpoint_interval=1', check=False)
    assert_user_error(p, 'diverged', 'init_from=resume')
    for path in ckpt_paths(out):  # whatever was kept is finite and sane
        sd = torch.load(path, weights_only=True)['model']
        assert all(torch.isfinite(v).all() and v.abs().max() <= 1e4 for v in sd.values()), path
    p = train(toy, out, '--lr=1e-3', '--init_from=resume')  # no crash loop: training goes on
    assert 'saved' in p.stdout and ckpt_paths(out)[-1].endswith('ckpt_00000040.pt')


def test_weights_that_give_a_nan_loss_are_set_aside_and_the_run_goes_on_from_the_one_before(toy, tmp_path):
    # weights that look saved but make the next loss NaN (a bit flip, a diverging step): the checkpoint that
    # produced them must not stay a resume candidate, or every resume dies the same way (a crash loop)
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=4')
    ck = torch.load(ckpt_paths(out)[-1], weights_only=True)
    for sd in (ck['model'], ck['ema']):
        next(v for k, v in sd.items() if k.endswith('down_proj.weight'))[0, 0] = float('nan')
    torch.save(ck, ckpt_paths(out)[-1])
    p = train(toy, out, '--init_from=resume', '--max_steps=16', '--checkpoint_interval=4', check=False)
    assert_user_error(p, 'loss became NaN or inf at step 9', 'ckpt_00000004.pt')
    assert [os.path.basename(c) for c in ckpt_paths(out)] == ['ckpt_00000004.pt']
    assert os.path.exists(out / 'ckpt_00000008.pt.diverged')
    p = train(toy, out, '--init_from=resume', '--max_steps=16', '--checkpoint_interval=4')
    assert 'resuming from' in p.stdout and 'ckpt_00000004.pt' in p.stdout and 'saved' in p.stdout


def test_resume_with_only_corrupt_checkpoints_is_an_error_that_keeps_them(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10')
    for c in ckpt_paths(out):
        open(c, 'wb').write(os.urandom(500))
    before = {c: open(c, 'rb').read() for c in ckpt_paths(out)}
    # at the run's last step the newest is refused outright (an older one would stand in for its final weights)
    p = train(toy, out, '--init_from=resume', check=False)
    assert_user_error(p, 'ckpt_00000040.pt', 'an older one is not used')
    # training on, the older ones are tried too
    p = train(toy, out, '--init_from=resume', '--epochs=3', check=False)
    assert_user_error(p, 'none could be loaded', 'ckpt_00000040.pt')
    assert {c: open(c, 'rb').read() for c in ckpt_paths(out)} == before  # nothing overwritten


def test_resume_from_a_checkpoint_whose_optimizer_state_does_not_fit_is_one_line_that_keeps_it(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4', '--checkpoint_interval=4')
    [c] = ckpt_paths(out)
    ck = torch.load(c, weights_only=True)
    ck['optimizer']['state'][0]['exp_avg'] = torch.zeros(3)  # loads as a file, does not fit the model
    torch.save(ck, c)
    before = open(c, 'rb').read()
    p = train(toy, out, '--init_from=resume', '--max_steps=6', check=False)
    assert_user_error(p, 'resume failed', os.path.basename(c), 'does not fit this run',
                      'optimizer state of parameter 0 has shape (3,)', 'the file is kept')
    assert open(c, 'rb').read() == before and ckpt_paths(out) == [c]


def test_a_known_corrupt_checkpoint_holds_no_slot_when_pruning(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--max_steps=20')
    assert [os.path.basename(c) for c in ckpt_paths(out)] == ['ckpt_00000010.pt', 'ckpt_00000020.pt']
    open(ckpt_paths(out)[-1], 'wb').write(b'garbage')  # the newest is corrupt: resume falls back to step 10
    p = train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--init_from=resume', '--max_steps=40')
    assert 'resuming from' in p.stdout and 'ckpt_00000010.pt' in p.stdout
    names = [os.path.basename(c) for c in ckpt_paths(out)]
    assert names == ['ckpt_00000030.pt', 'ckpt_00000040.pt'], names
    for c in ckpt_paths(out):
        torch.load(c, weights_only=True)  # every kept checkpoint loads


def test_keep_last_n_zero_keeps_everything(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--keep_last_n=0')
    assert len(ckpt_paths(out)) == 4


def test_a_full_disk_names_the_path_removes_the_tmp_and_keeps_the_previous_checkpoint(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    good = open(ckpt_paths(out)[0], 'rb').read()
    limit = len(good) // 2  # a file may grow to half a checkpoint: the next save cannot be written
    wrapper = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
               "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")
    p = run(['-c', wrapper, f'--data_path={toy}', f'--out_dir={out}', '--init_from=resume', '--max_steps=16',
             '--checkpoint_interval=8'] + FAST, check=False)
    assert_user_error(p, 'ckpt_00000016.pt', 'File too large')
    assert not glob.glob(str(out / '*.tmp'))
    assert [os.path.basename(c) for c in ckpt_paths(out)] == ['ckpt_00000008.pt']
    assert open(ckpt_paths(out)[0], 'rb').read() == good


def test_stale_tmp_files_are_removed_at_start(toy, tmp_path):
    out = tmp_path / 'o'
    os.makedirs(out)
    (out / 'ckpt_00000123.pt.tmp').write_bytes(b'half a file')
    train(toy, out, '--max_steps=4')
    assert not glob.glob(str(out / '*.tmp'))
