"""
Checkpoints: a diverging run keeps only sane ones (weights that give a NaN loss are set aside), corrupt files are
named, never loaded and never take a slot, stale files are removed, a full disk keeps the previous checkpoint.
    python -m pytest -q tests/test_checkpoints.py
"""
import glob
import json
import os

import numpy as np
import pytest
import torch

from conftest import FAST, assert_user_error, ckpt_paths, ckpts, eval_lines, run, site_hook, train
from runkeep.checkpoint import CheckpointError, load_checkpoint


def test_a_diverging_run_keeps_only_sane_checkpoints_and_a_resume_with_a_lower_lr_trains_on(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=4')
    # weights that look saved but make the next loss NaN (a bit flip, a diverging step): the checkpoint that
    # produced them must not stay a resume candidate, or every resume dies the same way (a crash loop)
    ck = torch.load(ckpt_paths(out)[-1], weights_only=True)
    for sd in (ck['model'], ck['ema']):
        next(v for k, v in sd.items() if k.endswith('down_proj.weight'))[0, 0] = float('nan')
    torch.save(ck, ckpt_paths(out)[-1])
    p = train(toy, out, '--init_from=resume', '--max_steps=16', '--checkpoint_interval=4', check=False)
    assert_user_error(p, 'loss became NaN or inf at step 9', 'ckpt_00000004.pt')
    assert ckpts(out) == ['ckpt_00000004.pt']
    assert os.path.exists(out / 'ckpt_00000008.pt.diverged')
    # an update that overflows (lr 1e30) makes the loss NaN: the last good checkpoint is kept, nothing set aside
    p = train(toy, out, '--init_from=resume', '--max_steps=16', '--checkpoint_interval=4', '--lr=1e30',
              '--lr_warmup_steps=1', check=False)
    assert 'resuming from' in p.stdout and 'ckpt_00000004.pt' in p.stdout  # not the one set aside
    assert_user_error(p, 'loss became NaN or inf at step')
    assert ckpts(out) == ['ckpt_00000004.pt']
    # weights that grow without bound (lr 1e6), a save every step: whatever was kept is finite and sane
    p = train(toy, out, '--init_from=resume', '--lr=1e6', '--checkpoint_interval=1', check=False)
    assert_user_error(p, 'the weights diverged by step 5', 'init_from=resume')
    for path in ckpt_paths(out):
        sd = torch.load(path, weights_only=True)['model']
        assert all(torch.isfinite(v).all() and v.abs().max() <= 1e4 for v in sd.values()), path
    p = train(toy, out, '--lr=1e-3', '--init_from=resume')  # no crash loop: training goes on
    assert 'resuming from' in p.stdout and 'saved' in p.stdout and ckpt_paths(out)[-1].endswith('ckpt_00000040.pt')


# the loss that train.py reads of the run's 9th step is NaN (its weights stay finite): the weights saved at step 8
# gave it, so ckpt_8 is set aside, and the newest checkpoint before it is the one a resume needs
NAN_AT_STEP_9 = """
if sys.argv[0].endswith('train.py'):
    import step
    real, calls = step.train_step, [0]

    def train_step(*args, **kwargs):
        carry, loss, metrics = real(*args, **kwargs)
        calls[0] += 1
        return carry, loss * float('nan') if calls[0] == 9 else loss, metrics

    step.train_step = train_step
"""


def test_a_divergence_with_keep_last_n_1_keeps_the_newest_checkpoint_known_to_train_on(toy, tmp_path):
    out = tmp_path / 'o'
    p = train(toy, out, '--max_steps=16', '--checkpoint_interval=4', '--keep_last_n=1', check=False,
              env=site_hook(tmp_path / 'hook', NAN_AT_STEP_9))
    assert_user_error(p, 'loss became NaN or inf at step 9', f'Last good checkpoint: {out}/ckpt_00000004.pt')
    assert ckpts(out) == ['ckpt_00000004.pt'] and os.path.exists(out / 'ckpt_00000008.pt.diverged')
    p = train(toy, out, '--init_from=resume', '--max_steps=12', '--checkpoint_interval=4', '--keep_last_n=1')
    assert f'resuming from {out}/ckpt_00000004.pt (step 4)' in p.stdout
    # trained on past it, the run keeps its newest one and the newest one known to train on
    assert ckpts(out) == ['ckpt_00000008.pt', 'ckpt_00000012.pt']


def test_overwrite_also_deletes_the_checkpoints_an_earlier_run_set_aside_as_diverged(toy, tmp_path):
    out = tmp_path / 'o'
    p = train(toy, out, '--max_steps=12', '--checkpoint_interval=4', check=False,
              env=site_hook(tmp_path / 'hook', NAN_AT_STEP_9))
    assert_user_error(p, 'loss became NaN or inf at step 9')
    assert os.path.exists(out / 'ckpt_00000008.pt.diverged')
    train(toy, out, '--max_steps=4', '--overwrite=True')
    assert sorted(n for n in os.listdir(out) if n.startswith('ckpt_')) == ['ckpt_00000004.pt']


def test_a_corrupt_checkpoint_is_named_never_loaded_and_holds_no_slot(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--max_steps=20')
    assert ckpts(out) == ['ckpt_00000010.pt', 'ckpt_00000020.pt']
    newest = ckpt_paths(out)[-1]
    data = open(newest, 'rb').read()
    open(newest, 'wb').write(data[:len(data) // 2])  # a save cut short
    with pytest.raises(CheckpointError, match='ckpt_00000020.pt is corrupt or truncated'):
        load_checkpoint(newest)
    # evaluated again: refused, never step 10's weights evaluated in its place
    p = train(toy, out, '--init_from=resume', '--eval_only=True', check=False)
    assert_user_error(p, 'ckpt_00000020.pt')
    assert 'trying an older checkpoint' not in p.stdout  # none is tried: the warning must not say so
    assert 'eval on' not in p.stdout and not os.path.exists(out / 'evals')
    # trained on: named, the run goes on from step 10, and the corrupt file holds no slot when pruning
    p = train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--init_from=resume', '--max_steps=40')
    assert 'ckpt_00000020.pt is corrupt or truncated' in p.stdout
    assert 'resuming from' in p.stdout and 'ckpt_00000010.pt (step 10)' in p.stdout
    assert ckpts(out) == ['ckpt_00000030.pt', 'ckpt_00000040.pt']
    for c in ckpt_paths(out):
        torch.load(c, weights_only=True)  # every kept checkpoint loads
    # every checkpoint corrupt
    for c in ckpt_paths(out):
        open(c, 'wb').write(os.urandom(500))
    before = {c: open(c, 'rb').read() for c in ckpt_paths(out)}
    # at the run's last step the newest is refused outright (an older one would stand in for its final weights)
    p = train(toy, out, '--init_from=resume', check=False)
    assert_user_error(p, 'ckpt_00000040.pt', 'an older one is not used')
    assert 'trying an older checkpoint' not in p.stdout
    # training on, the older ones are tried too
    p = train(toy, out, '--init_from=resume', '--epochs=3', check=False)
    assert_user_error(p, 'none could be loaded', 'ckpt_00000040.pt')
    assert {c: open(c, 'rb').read() for c in ckpt_paths(out)} == before  # nothing overwritten


# the script after it, run as this user but reading files as their mode says, root included (CAP_DAC_OVERRIDE and
# CAP_DAC_READ_SEARCH left out of the bounding set before the exec; another user cannot drop them, nor needs to)
MODE_BOUND = ("import ctypes, os, sys; libc = ctypes.CDLL(None); [libc.prctl(24, cap, 0, 0, 0) for cap in (1, 2)]; "
              "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def test_a_checkpoint_that_cannot_be_read_stops_the_resume_and_is_kept(toy, tmp_path):
    """A whole checkpoint the OS will not read (its mode, another user's file; an I/O error) is not corrupt: a
    resume that went on from an older one would train those steps again and delete it at its first save."""
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--keep_last_n=2', '--max_steps=20')
    newest = ckpt_paths(out)[-1]
    before = {c: open(c, 'rb').read() for c in ckpt_paths(out)}
    os.chmod(newest, 0)
    if run(['-c', MODE_BOUND, '-c', f'open({newest!r}, "rb")'], check=False).returncode == 0:
        pytest.skip('this user reads files whatever their mode')
    p = run(['-c', MODE_BOUND, 'train.py', f'--data_path={toy}', f'--out_dir={out}', '--init_from=resume',
             '--max_steps=40', '--checkpoint_interval=15', '--keep_last_n=2'] + FAST, check=False)
    assert os.path.exists(newest), 'the checkpoint that could not be read was deleted'
    os.chmod(newest, 0o644)
    assert_user_error(p, 'ckpt_00000020.pt', 'Permission denied', one_line=True)
    assert 'corrupt' not in p.stdout + p.stderr and 'resuming from' not in p.stdout
    assert {c: open(c, 'rb').read() for c in ckpt_paths(out)} == before  # nothing trained again, nothing deleted


def test_an_empty_checkpoint_and_a_file_of_another_kind_are_each_named_with_what_is_wrong(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--checkpoint_interval=10', '--max_steps=10')
    open(out / 'ckpt_00000015.pt', 'wb').close()  # a file created, never written
    torch.save(torch.zeros(3), out / 'ckpt_00000016.pt')  # a tensor saved under a checkpoint's name
    p = train(toy, out, '--init_from=resume', '--max_steps=12')
    warnings = [l for l in p.stdout.splitlines() if l.startswith('warning:')]
    assert any('ckpt_00000015.pt is corrupt or truncated and was not loaded: the file is empty' in l
               for l in warnings), warnings
    assert any('ckpt_00000016.pt is not a training checkpoint of this trainer (it holds a Tensor)' in l
               for l in warnings), warnings
    assert 'ckpt_00000010.pt (step 10)' in p.stdout


def test_a_file_that_is_no_pytorch_file_is_called_so_and_a_cut_checkpoint_truncated(tmp_path):
    # what a user may type for --init_from by mistake: a config file, a JSON, an array, a CSV, a picture
    files = {'run.py': b"# a config\nlr = 1e-3\n", 'dataset.json': b'{"seq_len": 81}', 'rows.csv': b'a,b\n1,2\n',
             'steps.png': b'\x89PNG\r\n\x1a\n' + bytes(40)}
    np.save(tmp_path / 'inputs.npy', np.zeros(4))
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    for name in list(files) + ['inputs.npy']:
        with pytest.raises(CheckpointError, match=f'{name} is corrupt or truncated and was not loaded: '
                                                  'not a PyTorch file$'):
            load_checkpoint(str(tmp_path / name))
    for legacy in (False, True):  # torch's zip format and its legacy pickle, each cut short
        path = tmp_path / f'ckpt_{legacy}.pt'
        torch.save({'model': {'w': torch.ones(100)}}, path, _use_new_zipfile_serialization=not legacy)
        path.write_bytes(path.read_bytes()[:60])
        with pytest.raises(CheckpointError, match='corrupt or truncated') as e:
            load_checkpoint(str(path))
        assert 'not a PyTorch file' not in str(e.value)


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


@pytest.mark.parametrize('part,edit,said', [
    ('rng', lambda ck: ck.pop('rng'), "its 'rng' is missing"),  # another version's: a KeyError's traceback
    ('carry', lambda ck: ck.update(carry=[1]), "its 'carry' is 'list', not 'dict'"),  # an AttributeError's
    ('config', lambda ck: ck.update(config=[1]), "its 'config' is 'list', not 'dict'"),  # a TypeError's
    ('step', lambda ck: ck.update(step='4'), "its 'step' is 'str', not 'int'"),
])
def test_a_checkpoint_whose_parts_are_missing_or_of_another_type_is_one_line_that_keeps_it(toy, tmp_path, part,
                                                                                        edit, said):
    """A file that loads but is another trainer's or version's, or edited: never passed over for an older one
    (it may be whole, and the resume's first save would delete it), never a traceback."""
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4', '--checkpoint_interval=2')
    c = ckpt_paths(out)[-1]
    ck = torch.load(c, weights_only=True)
    edit(ck)
    torch.save(ck, c)
    before = open(c, 'rb').read()
    p = train(toy, out, '--init_from=resume', '--max_steps=6', check=False)
    assert_user_error(p, 'resume failed', f"{c} does not hold what this trainer resumes from ({said})",
                      'the file is kept')
    assert open(c, 'rb').read() == before and len(ckpt_paths(out)) == 2


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


def test_a_checkpoint_file_gives_the_model_keys_its_run_had_unless_set_and_a_set_one_is_said(toy, tmp_path):
    """init_from=FILE (not a resume) of train.py: the model keys that no config file or flag sets come from the run
    that saved it (H_cycles, L_cycles, halt_max_steps change no weight's shape: the defaults would load and
    evaluate another recursion); a key set to another value is used (more H_cycles at test time), and said."""
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4')
    ckpt = ckpt_paths(out)[-1]
    bare = ['train.py', f'--data_path={toy}', f'--init_from={ckpt}', '--eval_only=True', '--device=cpu',
            '--global_batch_size=50', '--xla_cache_dir=']
    typed = train(toy, tmp_path / 'a', f'--init_from={ckpt}', '--eval_only=True')  # the run's keys, all typed
    p = run(bare + [f'--out_dir={tmp_path}/b'])
    assert eval_lines(p.stdout) == eval_lines(typed.stdout) and eval_lines(typed.stdout), p.stdout[-3000:]
    # its evals/ record names the file, the step and the save it evaluated, as that of a resume's does
    record, = [json.load(open(f)) for f in glob.glob(str(tmp_path / 'a' / 'evals' / '*.json'))]
    saved = load_checkpoint(ckpt)
    assert (record['checkpoint'], record['step'], record['checkpoint_id']) == (
        str(ckpt), 4, saved['checkpoint_id']) and saved['checkpoint_id'], record
    said = next(l for l in p.stdout.splitlines() if l.startswith(f'init_from={ckpt}: '))
    assert 'hidden_size=32' in said and 'H_cycles=2' in said and 'halt_max_steps=4' in said, said
    recipe = tmp_path / 'deeper.py'
    recipe.write_text('H_cycles = 3\n')
    p = run(bare + [f'--out_dir={tmp_path}/c', str(recipe), '--halt_max_steps=6'])
    said = next(l for l in p.stdout.splitlines() if l.startswith(f'init_from={ckpt}: '))
    assert f"H_cycles=3 as set ({recipe}), the checkpoint's 2" in said, said
    assert "halt_max_steps=6 as set (--halt_max_steps=6), the checkpoint's 4" in said, said
    assert eval_lines(p.stdout), p.stdout[-3000:]


def test_checkpoints_past_step_99_999_999_are_found_by_the_resume_the_pruning_and_solve_py_s_hint(toy, tmp_path):
    # a run's checkpoint renumbered to just below 10^8 steps: the writer's names grow a ninth digit from there on
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=2')
    ck = torch.load(out / 'ckpt_00000002.pt', weights_only=True)
    ck['step'] = 99_999_998
    torch.save(ck, out / 'ckpt_99999998.pt')
    os.remove(out / 'ckpt_00000002.pt')
    many = ['--init_from=resume', '--epochs=6000000', '--checkpoint_interval=1', '--keep_last_n=2', '--log_interval=1']
    train(toy, out, *many, '--max_steps=100000001')
    assert ckpts(out) == ['ckpt_100000000.pt', 'ckpt_100000001.pt'], ckpts(out)
    p = train(toy, out, *many, '--max_steps=100000002')
    assert f'resuming from {out}/ckpt_100000001.pt (step 100000001)' in p.stdout, p.stdout[-3000:]
    p = run(['solve.py', f'--init_from={out}', f'--data_path={toy}', '--index=0', '--device=cpu'], check=False)
    assert_user_error(p, f'--init_from={out}/ckpt_100000002.pt', one_line=True)


def test_the_best_evaluation_compares_only_evaluations_of_the_same_test_examples(toy, tmp_path):
    # the intermediate evaluations see a seeded subset whose answers no model gives (token 1 is never a target in
    # training): exact 0 there, while the final evaluation of the whole split scores what the model learned
    import shutil
    from data import EvalLoader, load_arrays, write_split
    data = tmp_path / 'd'
    shutil.copytree(toy, data)
    test = load_arrays(str(data), 'test')  # memory-mapped: copied before the split is written anew
    labels = np.array(test['labels'])
    labels[EvalLoader(str(data), 50, subset=20, seed=0).example_idx] = 1
    n = len(labels)
    write_split(str(data), 'test', np.array(test['inputs']), labels, np.zeros(n), np.arange(n + 1), np.arange(n + 1),
                vocab_size=6)
    train(data, tmp_path / 'o', '--epochs=7', '--eval_every_epochs=4', '--eval_subset=20')
    res = json.load(open(tmp_path / 'o' / 'results.json'))
    assert res['final_eval']['count'] == n and res['final_eval']['exact_accuracy'] > 0, res['final_eval']
    best = res['best_eval']
    assert (best['step'], best['exact_accuracy'], best['eval']['count']) == (80, 0.0, 20), best
    assert (best['examples'], best['test_examples']) == (20, n), best


def test_a_best_saved_before_best_eval_recorded_its_examples_survives_a_resume(toy, tmp_path):
    # an older trainer's best (no 'examples': it compared every evaluation, all of the same test split here) at
    # step 4, better than anything this run reaches: the resume keeps it, and its checkpoint, as that trainer would
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=4')
    path = ckpt_paths(out)[-1]
    ckpt = torch.load(path, weights_only=False)
    ckpt['best'] = dict(step=4, exact_accuracy=1.0, eval=dict(count=100.0, exact_accuracy=1.0))
    torch.save(ckpt, path)
    train(toy, out, '--init_from=resume', '--max_steps=12', '--checkpoint_interval=4')
    best = json.load(open(out / 'results.json'))['best_eval']
    assert (best['step'], best['exact_accuracy']) == (4, 1.0), best
    assert ckpts(out) == ['ckpt_00000004.pt', 'ckpt_00000008.pt', 'ckpt_00000012.pt'], ckpts(out)


def test_a_resume_with_other_eval_steps_starts_the_best_anew(toy, tmp_path):
    # exact accuracy after 2 supervision steps is another measure than after 4: a best measured at eval_steps=2
    # (here a perfect one at step 4) gives way to the first evaluation of the resumed run's eval_steps, and its
    # record says which steps it was measured at
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=4', '--eval_steps=2')
    path = ckpt_paths(out)[-1]
    ckpt = torch.load(path, weights_only=False)
    assert ckpt['best']['eval_steps'] == 2, ckpt['best']
    ckpt['best'] = dict(ckpt['best'], step=4, exact_accuracy=1.0)
    torch.save(ckpt, path)
    train(toy, out, '--init_from=resume', '--max_steps=12', '--checkpoint_interval=4')
    best = json.load(open(out / 'results.json'))['best_eval']
    assert best['step'] == 12 and best['eval_steps'] == 4 and best['exact_accuracy'] < 1, best
