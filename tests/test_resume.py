"""
Resuming and starting from weights: --init_from=resume continues exactly where the checkpoint stopped (the same
weights, EMA, puzzle embeddings, ACT carry and data position as a run never stopped; the same W&B run) or says in
one line why it cannot (another model shape, batch, dataset, a run already at its end), and init_from=FILE never
mixes into another run's folder. Real processes on real files.
    python -m pytest -q tests/test_resume.py
"""
import glob
import json
import os
import re
import shutil

import torch

from conftest import FAST, SUDOKU, TOY_ARGS, assert_user_error, ckpt_paths, ckpts, make_reverse_dataset, run, train
from runkeep.records import drop_earlier_records


def files(folder):
    return {n: open(os.path.join(folder, n), 'rb').read() for n in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, n))}


def assert_unlocked(out):
    assert not os.path.exists(os.path.join(out, 'run.lock')), 'the run left its lock behind'


def test_resume_continues_exactly(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=4', '--eval_every_epochs=100', '--log_interval=5',
              '--halt_exploration_prob=0.5'] + [a for a in TOY_ARGS if a != '--puzzle_emb_ndim=0'] + \
        ['--puzzle_emb_ndim=16']
    run(['train.py', f'--out_dir={tmp_path}/straight', '--max_steps=16'] + common)
    run(['train.py', f'--out_dir={tmp_path}/split', '--max_steps=8'] + common)
    assert os.path.exists(f'{tmp_path}/split/ckpt_00000008.pt')
    p = run(['train.py', f'--out_dir={tmp_path}/split', '--max_steps=16', '--init_from=resume'] + common)
    assert 'resuming from' in p.stdout and 'step 8' in p.stdout
    a = torch.load(f'{tmp_path}/straight/ckpt_00000016.pt', weights_only=True)
    b = torch.load(f'{tmp_path}/split/ckpt_00000016.pt', weights_only=True)
    for key in ('model', 'ema', 'carry'):
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    assert a['model']['puzzle_emb'].abs().sum() > 0  # the puzzle embeddings trained, and resumed exactly
    assert a['loader'] == b['loader'] and a['step'] == b['step'] == 16


def test_wandb_offline_run_is_continued_after_resume_and_replaced_after_overwrite(toy, tmp_path):
    out, home = tmp_path / 'o', tmp_path / 'home'
    home.mkdir()
    args = ['--epochs=1', '--log_interval=2', '--wandb_log=True', '--wandb_run_name=smoke']
    # not logged in: W&B's offline fallback, whose warning prints the `wandb sync` command that uploads it later
    env = dict(HOME=str(home), WANDB_MODE=None, WANDB_CONFIG_DIR=str(home / '.config'), WANDB_SILENT='true')

    def synced(p):
        """The run ids of the folders the printed `wandb sync` command would upload."""
        pattern, = re.findall(r'`wandb sync (\S+)`', p.stdout)
        return sorted(folder.rsplit('-', 1)[1] for folder in glob.glob(pattern))

    train(toy, out, '--max_steps=4', *args, env=env)
    p = train(toy, out, '--max_steps=6', '--init_from=resume', *args, env=env)
    old = torch.load(out / 'ckpt_00000006.pt', weights_only=True)['run_id']
    assert synced(p) == [old, old]  # the resumed run's history in two folders, one W&B run
    p = train(toy, out, '--max_steps=2', '--overwrite=True', *args, env=env)
    new = torch.load(out / 'ckpt_00000002.pt', weights_only=True)['run_id']
    assert new != old and synced(p) == [new]  # the replaced run is not uploaded beside this one


def test_an_earlier_run_s_w_and_b_folder_that_cannot_be_deleted_is_one_warning(tmp_path, capsys):
    (tmp_path / 'wandb').write_text('')  # not a folder: rmtree fails
    drop_earlier_records(str(tmp_path), None)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith('warning: could not delete') and 'wandb sync' in said[0], said


def test_init_from_a_file_into_a_folder_of_checkpoints_is_refused_unless_overwrite(sudoku4, trained, tmp_path):
    out = shutil.copytree(trained, tmp_path / 'o')
    before, src = files(out), os.path.join(out, 'ckpt_00000004.pt')
    p = train(sudoku4, out, f'--init_from={src}', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, str(out), 'already holds checkpoints', '--overwrite=True')
    p = train(sudoku4, out, f'--init_from={src}', '--max_steps=2', '--overwrite=True', args=SUDOKU, check=False)
    assert_user_error(p, src, 'copy it')  # --overwrite=True would delete the weights it starts from
    assert files(out) == before  # every checkpoint, metrics.jsonl and results.json as they were
    shutil.copy(src, tmp_path / 'src.pt')
    train(sudoku4, out, f'--init_from={tmp_path}/src.pt', '--max_steps=2', '--overwrite=True', args=SUDOKU)
    assert ckpts(out) == ['ckpt_00000002.pt']
    assert_unlocked(out)


def test_a_resume_onto_a_dataset_of_another_shape_is_one_line(toy, trained, tmp_path):
    out = shutil.copytree(trained, tmp_path / 'o')
    p = train(toy, out, '--init_from=resume', '--max_steps=8', args=SUDOKU, check=False)
    assert_user_error(p, 'ckpt_00000004.pt', 'seq_len', '16', '8')
    assert ckpts(out) == ['ckpt_00000004.pt']


def test_a_resume_onto_other_examples_is_one_line_and_onto_a_copy_of_its_dataset_trains_on(tmp_path):
    """A dataset rebuilt at its path (another seed: the same shape, identifiers and count), or another data_path
    of other examples: the run would train and evaluate on two datasets, its best checkpoint chosen across them;
    one line. A copy of the same dataset elsewhere trains on."""
    data, out = make_reverse_dataset(str(tmp_path / 'd')), tmp_path / 'o'
    train(data, out, '--max_steps=4', '--epochs=4')
    shutil.copytree(data, tmp_path / 'copy')
    shutil.rmtree(data)
    make_reverse_dataset(data, seed=1)
    p = train(data, out, '--init_from=resume', '--max_steps=6', '--epochs=4', check=False)
    assert_user_error(p, 'ckpt_00000004.pt', 'other examples', data, '--data_path', 'new run', one_line=True)
    other = make_reverse_dataset(str(tmp_path / 'other'), seed=2)
    p = train(other, out, '--init_from=resume', '--max_steps=6', '--epochs=4', check=False)
    assert_user_error(p, 'other examples', other, f"data_path was {data!r}", one_line=True)
    assert ckpts(out) == ['ckpt_00000004.pt']
    p = train(tmp_path / 'copy', out, '--init_from=resume', '--max_steps=6', '--epochs=4')
    assert 'other examples' not in p.stdout and ckpts(out)[-1] == 'ckpt_00000006.pt'


def test_a_resume_of_an_older_checkpoint_onto_a_dataset_rebuilt_at_its_path_says_what_changed(tmp_path):
    """A checkpoint of a trainer that recorded no digest of its examples: only a change of the group count
    can be seen, and is said."""
    data, out = make_reverse_dataset(str(tmp_path / 'd')), tmp_path / 'o'
    train(data, out, '--max_steps=4', '--epochs=4')
    path = ckpt_paths(out)[-1]
    ckpt = torch.load(path, weights_only=False)
    del ckpt['data_digest']
    torch.save(ckpt, path)
    shutil.rmtree(data)
    make_reverse_dataset(data, n_train=500, seed=1)  # the same kind and shape, half the groups
    p = train(data, out, '--init_from=resume', '--max_steps=6', '--epochs=4')
    said = [l for l in p.stdout.splitlines() if 'groups: 1000 -> 500' in l]
    assert said and 'rebuilt' in said[0], p.stdout[-2000:]
    assert ckpts(out)[-1] == 'ckpt_00000006.pt'


def test_max_steps_below_the_checkpoint_says_so_and_changes_nothing(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    before = {n: open(out / n, 'rb').read() for n in ('metrics.jsonl', 'ckpt_00000008.pt')}
    for _ in range(2):  # every rerun says the same, and evaluates nothing
        p = train(toy, out, '--init_from=resume', '--max_steps=4', check=False)
        assert_user_error(p, 'step 8', '--max_steps=4')
        assert 'eval on' not in p.stdout
    assert {n: open(out / n, 'rb').read() for n in before} == before
    assert not os.path.exists(out / 'run.lock')


def test_a_resume_of_an_older_checkpoint_says_that_the_records_past_it_are_dropped(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=4', '--log_interval=2')
    os.remove(out / 'ckpt_00000008.pt')  # rolled back: the resume takes ckpt_4, and the lines of steps 5-8 go
    p = train(toy, out, '--init_from=resume', '--max_steps=6', '--checkpoint_interval=4', '--log_interval=2')
    assert 'resuming from' in p.stdout and 'step 4' in p.stdout
    assert f"3 line(s) of {out}/metrics.jsonl past step 4 (up to step 8)" in p.stdout, p.stdout[-2000:]
    steps = [json.loads(l)['step'] for l in open(out / 'metrics.jsonl')]
    assert steps == [2, 4, 6, 6], steps  # (the train and the final eval lines of step 6)
    # a new run over it (--overwrite): the lines are another run's, not a step the run goes on from
    p = train(toy, out, '--max_steps=2', '--log_interval=2', '--overwrite=True')
    assert f"4 line(s) of an earlier run (up to step 6) dropped from {out}/metrics.jsonl: this run starts anew" \
        in p.stdout and 'goes on from step 0' not in p.stdout, p.stdout[-2000:]


def test_scratch_into_a_folder_with_checkpoints_is_refused_unless_overwrite(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8', '--profile_steps=1:2')
    p = train(toy, out, '--max_steps=4', check=False)
    assert_user_error(p, str(out), '--init_from=resume', '--overwrite=True')
    p = train(toy, out, '--max_steps=4', '--checkpoint_interval=4', '--overwrite=True')
    assert [os.path.basename(c) for c in ckpt_paths(out)] == ['ckpt_00000004.pt']  # the old run's ckpt_8 is gone
    assert not os.path.exists(out / 'profile')  # and its trace, which would pass for this run's


def test_train_log_after_overwrite_holds_this_run_s_lines_only_and_a_resume_appends(toy, tmp_path):
    out = tmp_path / 'o'

    def log():
        """train.log's process headers (their command lines) and step lines."""
        text = open(out / 'train.log').read()
        return ([l for l in text.splitlines() if l.startswith('--- ')],
                [l.split(' |')[0] for l in text.splitlines() if l.startswith('step ')])

    train(toy, out, '--max_steps=8', '--checkpoint_interval=8', '--log_interval=2')
    train(toy, out, '--max_steps=4', '--checkpoint_interval=4', '--log_interval=2', '--overwrite=True')
    heads, steps = log()
    assert len(heads) == 1 and '--overwrite=True' in heads[0], heads  # the earlier run's header is gone
    assert steps == ['step 2/4', 'step 4/4'], steps
    # a resume goes on in the same log
    train(toy, out, '--max_steps=6', '--checkpoint_interval=2', '--log_interval=2', '--init_from=resume')
    heads, steps = log()
    assert len(heads) == 2 and '--init_from=resume' in heads[1], heads
    assert steps == ['step 2/4', 'step 4/4', 'step 6/6'], steps
    # a log that cannot be rewritten (its temporary file's name taken): one warning, none of this run's lines lost
    os.mkdir(out / 'train.log.tmp')
    p = train(toy, out, '--max_steps=2', '--log_interval=2', '--overwrite=True')
    said = [l for l in p.stdout.splitlines() if 'train.log' in l]
    assert len(said) == 1 and said[0].startswith('warning: ') and str(out) in said[0], said
    heads, steps = log()
    assert len(heads) == 3 and '--overwrite=True' in heads[2] and steps[-1] == 'step 2/2', (heads, steps)
    assert said[0] in open(out / 'train.log').read()


def test_resume_refuses_another_model_shape_or_batch_size_and_allows_a_lower_lr(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    p = train(toy, out, '--init_from=resume', '--global_batch_size=20', check=False)
    assert_user_error(p, 'global_batch_size=50', 'global_batch_size=20')
    p = train(toy, out, '--init_from=resume', '--hidden_size=64', check=False)
    assert_user_error(p, 'hidden_size=32', 'hidden_size=64')
    p = train(toy, out, '--init_from=resume', '--lr=1e-4', '--max_steps=12')
    assert 'lr: 0.002 -> 0.0001' in p.stdout and 'saved' in p.stdout



def test_a_resume_with_more_epochs_says_how_its_cosine_schedule_stretches(toy, tmp_path):
    """A cosine run extended with more epochs: its schedule spans the new total, so the lr at the resume rises
    from the floor the run had reached; the resume says so with both values, and the schedule's new end."""
    out = tmp_path / 'o'
    train(toy, out, '--epochs=1', '--lr_min_ratio=0.1')  # 20 steps, down to 2e-4
    p = train(toy, out, '--init_from=resume', '--epochs=2', '--lr_min_ratio=0.1', '--max_steps=21')
    said = [l for l in p.stdout.splitlines() if 'LR schedule' in l]
    assert said and all(w in said[0] for w in ('step 21', '0.00147', '0.0002', 'step 40', 'step 20')), p.stdout[-2000:]
    assert 'lr 1.47e-03' in [l for l in p.stdout.splitlines() if l.startswith('step 21/')][0]  # as it said
    p = train(toy, out, '--init_from=resume', '--epochs=2', '--lr_min_ratio=0.1', '--max_steps=24')
    assert 'LR schedule' not in p.stdout  # the same schedule: nothing to say


def test_a_resume_that_turns_the_ema_off_or_on_says_what_becomes_of_it(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    p = train(toy, out, '--init_from=resume', '--max_steps=10', '--ema=False')
    said = [l for l in p.stdout.splitlines() if 'EMA' in l]
    assert said and 'dropped' in said[0] and 'raw weights' in said[0], p.stdout[-2000:]
    assert torch.load(ckpt_paths(out)[-1], weights_only=True)['ema'] is None
    p = train(toy, out, '--init_from=resume', '--max_steps=12', '--ema=True')
    said = [l for l in p.stdout.splitlines() if 'EMA' in l]
    assert said and 'starts from' in said[0] and 'step 10' in said[0], p.stdout[-2000:]
    p = train(toy, out, '--init_from=resume', '--max_steps=14')
    assert not [l for l in p.stdout.splitlines() if 'EMA' in l]  # it goes on: nothing to say


def test_an_eval_only_resume_says_nothing_of_training_on(toy, tmp_path):
    # an evaluation trains and saves nothing: no LR schedule to come, no EMA that averages on
    out = tmp_path / 'o'
    train(toy, out, '--epochs=1')
    p = train(toy, out, '--init_from=resume', '--eval_only=True', '--epochs=3', '--lr_min_ratio=0.1', '--ema=False')
    assert 'LR schedule' not in p.stdout and 'from here' not in p.stdout, p.stdout[-2000:]
    said = [l for l in p.stdout.splitlines() if 'EMA' in l]
    assert said and 'raw weights' in said[0] and 'evaluat' in said[0], p.stdout[-2000:]


def test_a_bfloat16_run_resumes_exactly_and_in_bfloat16(toy, tmp_path):
    """A checkpoint holds the ACT carry in float32 (the host has no bfloat16 arrays), and the network computes in
    its latents' dtype: resumed as it was, a bfloat16 run trained on in float32 to its end (a refill's mix of
    fresh bfloat16 rows and float32 ones is float32), neither as it said nor as the run never stopped. The same
    holds for a resume that changes forward_dtype: the latents are this run's dtype from its first step."""
    bf16 = [a for a in FAST if not a.startswith('--forward_dtype')] + ['--forward_dtype=bfloat16']
    train(toy, tmp_path / 'straight', '--max_steps=8', args=bf16)
    train(toy, tmp_path / 'split', '--max_steps=4', args=bf16)
    p = train(toy, tmp_path / 'split', '--max_steps=8', '--init_from=resume', args=bf16)
    assert 'resuming from' in p.stdout
    a, b = (torch.load(tmp_path / run / 'ckpt_00000008.pt', weights_only=True) for run in ('straight', 'split'))
    for key in ('model', 'ema', 'carry'):
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)


def test_a_checkpoint_saved_before_a_model_key_existed_resumes_only_with_that_key_s_default(toy, tmp_path):
    """A checkpoint of a trainer that had not the key yet (a fork's new model key, docs/forking.md; here
    rms_norm_eps, at its default, taken out of its config) ran the key's default: a resume that sets another value
    is refused in one line, as for a key it saved, not continued with another model on the same weights."""
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4', '--checkpoint_interval=4')
    path = ckpt_paths(out)[-1]
    ckpt = torch.load(path, weights_only=False)
    del ckpt['config']['rms_norm_eps']
    torch.save(ckpt, path)
    p = train(toy, out, '--init_from=resume', '--rms_norm_eps=0.001', check=False)
    assert_user_error(p, 'rms_norm_eps=1e-05', 'rms_norm_eps=0.001')
    p = train(toy, out, '--init_from=resume', '--max_steps=6')
    assert 'resuming from' in p.stdout and 'saved' in p.stdout, p.stdout[-2000:]

def test_a_checkpoint_of_a_trainer_without_the_ema_warm_up_resumes_only_where_the_warm_up_is_over(toy, tmp_path):
    """A trainer that averaged at ema_rate from step 0 (its checkpoints named 'wandb_run_id', not 'run_id'): a
    resume where this trainer's warm-up is still below ema_rate would average otherwise, so it is one line; past
    the warm-up the two agree, and an evaluation trains nothing."""
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    path = ckpt_paths(out)[-1]
    ckpt = torch.load(path, weights_only=False)
    ckpt['wandb_run_id'] = ckpt.pop('run_id') or ''
    torch.save(ckpt, path)
    p = train(toy, out, '--init_from=resume', '--max_steps=10', check=False)
    assert_user_error(p, path, 'ema_rate=0.95', 'new run', one_line=True)
    p = train(toy, out, '--init_from=resume', '--eval_only=True')
    assert 'resuming from' in p.stdout and 'eval on' in p.stdout, p.stdout[-2000:]
    p = train(toy, out, '--init_from=resume', '--max_steps=10', '--ema_rate=0.5')  # 9/18: the warm-up is at 0.5
    assert 'resuming from' in p.stdout and 'step 10/' in p.stdout, p.stdout[-2000:]


def test_resume_past_the_end_says_so(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8', '--checkpoint_interval=8')
    p = train(toy, out, '--init_from=resume', '--max_steps=8')
    assert 'nothing to do' in p.stdout and 'raise --max_steps to train on' in p.stdout, p.stdout[-2000:]
    # the run ends where its epochs end (FAST: 2 epochs of 20 steps); a larger max_steps moves nothing
    train(toy, out, '--init_from=resume', '--max_steps=40')
    p = train(toy, out, '--init_from=resume', '--max_steps=60')
    said = [l for l in p.stdout.splitlines() if 'nothing to do' in l]
    assert said and 'raise --epochs to train on' in said[0] and '--max_steps=60' in said[0], p.stdout[-2000:]
    # a max_steps at the epochs' end ends the run as well: raising either alone moves nothing
    p = train(toy, out, '--init_from=resume', '--max_steps=40')
    said = [l for l in p.stdout.splitlines() if 'nothing to do' in l]
    assert said and 'raise --epochs and --max_steps to train on' in said[0], p.stdout[-2000:]


def test_init_from_onto_another_length_and_width_names_the_width(toy, tmp_path):
    # another length alone is a fine-tune (a note); a model key that differs too is the user's to fix, not the data
    att = [a for a in FAST if not a.startswith(('--mlp_t', '--pos_encodings'))] + ['--mlp_t=False',
                                                                                    '--pos_encodings=rope']
    longer = make_reverse_dataset(str(tmp_path / 'len12'), n_train=100, n_test=20, L=12)
    train(toy, tmp_path / 'a', '--max_steps=1', args=att)
    p = train(longer, tmp_path / 'b', '--max_steps=1', f'--init_from={tmp_path}/a/ckpt_00000001.pt', '--hidden_size=16',
              args=att, check=False)
    said = assert_user_error(p, 'hidden_size=32 (here 16)', one_line=True)
    assert said.endswith('Check --hidden_size'), said


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
    other = ckpt_paths(tmp_path / 'c')[0]
    p = train(toy, tmp_path / 'd', f'--init_from={other}', '--hidden_size=64', '--max_steps=2', check=False)
    assert_user_error(p, 'the weights do not fit the model', 'hidden_size=32 (here 64)', '--hidden_size')
    p = train(toy, tmp_path / 'e', f'--init_from={tmp_path}/missing.pt', '--max_steps=2', check=False)
    assert_user_error(p, 'missing.pt')


def test_eval_only_needs_weights(toy, tmp_path):
    p = train(toy, tmp_path / 'o', '--eval_only=True', check=False)
    assert_user_error(p, 'eval_only=True needs')
