"""
The reference's published layout (step_<N> + all_config.yaml beside it), written by publish.py from runs of
train.py and read back through --init_from: the files hold the reference's key names and config fields, round-trip
bit for bit, and give the outputs of the checkpoint they came from with no model key typed; a model key typed
against all_config.yaml, a broken or foreign all_config.yaml, and a file that is neither kind are one line each.
(The same files checked with the reference's own code: tests/against_reference.py, docs/published.md.)
    python -m pytest -q tests/test_published.py
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml

from conftest import FAST, ROOT, TOY_ARGS, assert_user_error, eval_lines, run, script_env, site_hook, train, tree
from data import load_metadata, write_split
from device import choose_dtype

# the reference's PretrainConfig fields: all_config.yaml holds exactly these
PRETRAIN_FIELDS = {'arch', 'data_paths', 'data_paths_test', 'evaluators', 'global_batch_size', 'epochs', 'lr',
                   'lr_min_ratio', 'lr_warmup_steps', 'weight_decay', 'beta1', 'beta2', 'puzzle_emb_lr',
                   'puzzle_emb_weight_decay', 'project_name', 'run_name', 'load_checkpoint', 'checkpoint_path',
                   'seed', 'checkpoint_every_eval', 'eval_interval', 'min_eval_interval', 'eval_save_outputs',
                   'ema', 'ema_rate', 'freeze_weights'}
ARCH_FIELDS = {'name', 'loss', 'H_cycles', 'H_layers', 'L_cycles', 'L_layers', 'expansion', 'forward_dtype',
               'halt_exploration_prob', 'halt_max_steps', 'hidden_size', 'mlp_t', 'no_ACT_continue', 'num_heads',
               'pos_encodings', 'puzzle_emb_len', 'puzzle_emb_ndim'}
# attention with RoPE and a puzzle table: the reference's ARC shape, tiny (its SwiGLUs rounded to 256, the reference's)
TABLE_ARGS = [a for a in FAST if a.split('=')[0] not in ('--mlp_t', '--pos_encodings', '--puzzle_emb_ndim',
                                                         '--mlp_multiple')] + \
    ['--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32', '--puzzle_emb_len=1', '--puzzle_emb_lr=0.1']
MODEL_FLAGS = [a for a in TABLE_ARGS if a.split('=')[0][2:] in
               ('hidden_size', 'num_heads', 'mlp_t', 'pos_encodings', 'puzzle_emb_ndim', 'puzzle_emb_len',
                'H_cycles', 'L_cycles', 'halt_max_steps', 'forward_dtype', 'loss_dtype')]
EVAL = ['--eval_only=True', '--device=cpu', '--xla_cache_dir=']


def make_ids_dataset(root, n=300, ids=12, L=8, seed=0):
    """The reverse task with `ids` puzzle identifiers, each puzzle one of them (so the table's rows matter)."""
    rng = np.random.default_rng(seed)
    for split in ('train', 'test'):
        x = rng.integers(2, 6, (n, L))
        write_split(root, split, x, x[:, ::-1], rng.integers(1, ids, n), np.arange(n + 1), np.arange(n + 1),
                    vocab_size=6, num_puzzle_identifiers=ids)
    return str(root)


def publish(*args, check=True):
    return run(['publish.py', *map(str, args)], check=check)


@pytest.fixture(scope='module')
def table_run(tmp_path_factory):
    """A 6-step run with a puzzle table of 12 rows, published with its train state. Read only."""
    tmp = tmp_path_factory.mktemp('table')
    data = make_ids_dataset(tmp / 'data')
    out = tmp / 'run'
    train(data, out, '--max_steps=6', args=TABLE_ARGS)
    ckpt = out / 'ckpt_00000006.pt'
    p = publish(f'--init_from={ckpt}', '--train_state=True')
    return dict(data=data, out=str(out), ckpt=str(ckpt), folder=str(out / 'published'), stdout=p.stdout,
                tmp=tmp)


def test_publish_writes_the_reference_layout_and_it_round_trips_bit_for_bit(table_run):
    from model import from_reference_state_dict
    folder, ckpt = table_run['folder'], torch.load(table_run['ckpt'], weights_only=True)
    assert sorted(os.listdir(folder)) == ['all_config.yaml', 'step_6', 'step_6_train_state.pt']
    assert f"--init_from={folder}/step_6" in table_run['stdout']
    sd = torch.load(os.path.join(folder, 'step_6'), weights_only=True)
    assert all(k.startswith('_orig_mod.model.inner.') for k in sd)  # the compiled, loss-wrapped model's names
    assert sd['_orig_mod.model.inner.puzzle_emb.weights'].shape == (12, 32)
    assert '_orig_mod.model.inner.L_level.layers.1.self_attn.qkv_proj.weight' in sd
    back = from_reference_state_dict(sd)
    assert back.keys() == ckpt['ema'].keys()
    for k, v in ckpt['ema'].items():  # the EMA's weights, as the reference saves them, bit for bit
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert not torch.equal(ckpt['ema']['lm_head.weight'], ckpt['model']['lm_head.weight'])  # (they differ)

    text = open(os.path.join(folder, 'all_config.yaml')).read()
    cfg = yaml.safe_load(text)
    assert set(cfg) == PRETRAIN_FIELDS and set(cfg['arch']) == ARCH_FIELDS
    tops = [line.split(':')[0] for line in text.splitlines() if line and not line.startswith((' ', '-'))]
    assert tops == sorted(tops)  # yaml.dump's order, as the reference writes it
    assert cfg['arch']['name'] == 'recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1'
    assert cfg['arch']['loss'] == dict(name='losses@ACTLossHead', loss_type='stablemax_cross_entropy')
    assert (cfg['arch']['hidden_size'], cfg['arch']['puzzle_emb_ndim'], cfg['arch']['puzzle_emb_len']) == (32, 32, 1)
    assert (cfg['arch']['mlp_t'], cfg['arch']['pos_encodings'], cfg['arch']['forward_dtype']) == \
        (False, 'rope', 'float32')
    assert cfg['data_paths'] == [table_run['data']] and cfg['ema'] is True and cfg['puzzle_emb_lr'] == 0.1

    state = torch.load(os.path.join(folder, 'step_6_train_state.pt'), weights_only=True)
    assert state['step'] == 6 and state['optimizer_lrs'] == [0.1, 2e-3]
    sign_sgd, adam = state['optimizers']
    assert sign_sgd['state'] == {} and len(adam['param_groups'][0]['params']) == len(state['param_names'])
    for i, moments in ckpt['optimizer']['state'].items():  # AdamATan2's moments, its `t` as torch's `step`
        assert torch.equal(adam['state'][i]['exp_avg'], moments['exp_avg'])
        assert torch.equal(adam['state'][i]['step'], moments['t'])
    raw = from_reference_state_dict(state['weights'])
    assert all(torch.equal(raw[k], ckpt['model'][k]) for k in raw) and 'puzzle_emb' not in raw  # step_6's table


def test_the_layout_gives_the_outputs_of_its_checkpoint_with_no_model_key_typed(table_run, tmp_path):
    from runkeep.checkpoint import load_weights
    from model import TRM, TRMConfig
    from runkeep.hub import model_keys, read_all_config
    data, folder = table_run['data'], table_run['folder']
    ours = run(['train.py', f'--data_path={data}', f'--out_dir={tmp_path}/a', f'--init_from={table_run["ckpt"]}',
                *MODEL_FLAGS, *EVAL])
    theirs = run(['train.py', f'--data_path={data}', f'--out_dir={tmp_path}/b', f'--init_from={folder}/step_6',
                  *EVAL])
    assert eval_lines(theirs.stdout) == eval_lines(ours.stdout) and eval_lines(ours.stdout)
    said = next(l for l in theirs.stdout.splitlines() if l.startswith(f'init_from={folder}/step_6'))
    assert f'model config from {folder}/all_config.yaml' in said and f"data_paths=['{data}']" in said
    assert 'hidden_size=32' in said and "pos_encodings='rope'" in said and 'puzzle_emb_len=1' in said
    # no --data_path: the published run's, found here, rather than train.py's default (another task's dataset)
    untyped = run(['train.py', f'--out_dir={tmp_path}/c', f'--init_from={folder}/step_6', *EVAL])
    assert eval_lines(untyped.stdout) == eval_lines(ours.stdout) and 'data_path taken from there' in untyped.stdout

    # the same predictions and halting logits, bit for bit, on every step of a test batch
    meta = load_metadata(data, 'train')
    ckpt = torch.load(table_run['ckpt'], weights_only=True)
    a = TRM(TRMConfig.for_data(meta, **{k: v for k, v in ckpt['config'].items()
                                        if k in TRMConfig.__dataclass_fields__}))
    a.load_state_dict(ckpt['ema'])
    keys = model_keys(read_all_config(f'{folder}/all_config.yaml'), 'all_config.yaml')
    b = TRM(TRMConfig.for_data(meta, **keys, loss_dtype='float32'))
    load_weights(f'{folder}/step_6', b, b, meta, data, adapt=False)
    inputs = torch.from_numpy(np.load(f'{data}/test/all__inputs.npy')[:32]).int()
    ids = torch.from_numpy(np.load(f'{data}/test/all__puzzle_identifiers.npy')[:32]).int()
    batch = dict(inputs=inputs, puzzle_identifiers=ids, labels=inputs)
    (pa, qa, _), (pb, qb, _) = a.eval().predict(batch, 4), b.eval().predict(batch, 4)
    assert torch.equal(pa, pb) and torch.equal(qa, qb)
    assert len(ids.unique()) > 5  # many rows of the table in play


def test_a_model_key_that_contradicts_all_config_is_refused_in_one_line(table_run, tmp_path):
    data, step = table_run['data'], f"{table_run['folder']}/step_6"
    base = ['train.py', f'--data_path={data}', f'--out_dir={tmp_path}/o', f'--init_from={step}', *EVAL]
    p = run(base + ['--L_cycles=3'], check=False)
    assert_user_error(p, 'L_cycles=3 (--L_cycles=3) but the published run has L_cycles=2', 'all_config.yaml')
    assert len(p.stderr.strip().splitlines()) == 1
    recipe = tmp_path / 'recipe.py'
    recipe.write_text("hidden_size = 64\nmlp_t = True\n")
    p = run(base + [str(recipe)], check=False)
    assert_user_error(p, f'hidden_size=64 ({recipe}) but the published run has hidden_size=32',
                      f'mlp_t=True ({recipe}) but the published run has mlp_t=False')
    # the same values typed agree; the number format may differ (a resume may change it too), and is said
    p = run(base + ['--L_cycles=2', '--hidden_size=32', '--expansion=4', '--forward_dtype=bfloat16'])
    assert "forward_dtype='bfloat16' as set (--forward_dtype=bfloat16), the run's 'float32'" in p.stdout
    # the run uses bfloat16 as typed: said as this machine says it ('as configured', or a warning where it is
    # emulated)
    assert f"forward dtype {choose_dtype('bfloat16', 'cpu')[1]}" in p.stdout and eval_lines(p.stdout)


def test_a_model_rounded_to_another_multiple_than_256_carries_it_into_the_layout(toy, tmp_path):
    """The toy's SwiGLUs round to 32 (--mlp_multiple=32), not the reference's 256: all_config.yaml holds
    arch.mlp_multiple, and the layout evaluates as its checkpoint does with no model key typed."""
    train(toy, tmp_path / 'run', '--max_steps=4')
    ckpt = tmp_path / 'run' / 'ckpt_00000004.pt'
    publish(f'--init_from={ckpt}')
    folder = tmp_path / 'run' / 'published'
    arch = yaml.safe_load(open(folder / 'all_config.yaml'))['arch']
    assert arch['mlp_multiple'] == 32 and set(arch) == ARCH_FIELDS | {'mlp_multiple'}, arch
    from model import MODEL_KEYS
    keys = [a for a in FAST if a.split('=')[0][2:] in MODEL_KEYS]
    ours = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/a', f'--init_from={ckpt}', *keys, *EVAL])
    theirs = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/b', f'--init_from={folder}/step_4',
                  *EVAL])
    assert eval_lines(theirs.stdout) == eval_lines(ours.stdout) and eval_lines(ours.stdout)
    assert 'mlp_multiple=32' in next(l for l in theirs.stdout.splitlines() if l.startswith('init_from='))


def test_without_all_config_the_keys_are_the_config_s_as_before(table_run, tmp_path):
    shutil.copy(f"{table_run['folder']}/step_6", tmp_path / 'step_6')
    base = ['train.py', f'--data_path={table_run["data"]}', f'--init_from={tmp_path}/step_6', *EVAL]
    p = run(base + [f'--out_dir={tmp_path}/a'] + MODEL_FLAGS)
    assert 'all_config.yaml' not in p.stdout and eval_lines(p.stdout)
    assert_user_error(run(base + [f'--out_dir={tmp_path}/b'], check=False), 'the weights do not fit the model')


def test_a_checkpoint_of_train_py_beside_an_all_config_keeps_its_own_config(table_run, tmp_path):
    """publish.py --out_dir=<the run folder> puts an all_config.yaml beside the run's checkpoints: it answers for
    the step files there, not for a checkpoint of train.py, which carries its run's config (a key set to another
    value is used and said, as without the YAML)."""
    folder = tmp_path / 'run'
    folder.mkdir()
    ckpt = shutil.copy(table_run['ckpt'], folder)
    publish(f'--init_from={ckpt}', f'--out_dir={folder}')
    p = run(['train.py', f'--data_path={table_run["data"]}', f'--out_dir={tmp_path}/o', f'--init_from={ckpt}',
             '--H_cycles=3', *EVAL])
    said = next(l for l in p.stdout.splitlines() if l.startswith(f'init_from={ckpt}:'))
    assert "a checkpoint of train.py (step 6)" in said and "H_cycles=3 as set (--H_cycles=3), the checkpoint's 2" \
        in said and eval_lines(p.stdout)


def test_a_file_neither_ours_nor_the_references_is_named_in_one_line(table_run, tmp_path, sudoku4):
    lightning = tmp_path / 'model.ckpt'
    torch.save({'state_dict': {'w': torch.zeros(2)}, 'epoch': 3}, lightning)
    state = f"{table_run['folder']}/step_6_train_state.pt"
    for path, words in ((lightning, "it holds a dict of 2 entries ('state_dict', 'epoch'), 0 of them tensors"),
                        (state, 'it holds a train state')):
        for script, extra in (('train.py', [f'--data_path={table_run["data"]}', f'--out_dir={tmp_path}/o',
                                            *EVAL]),
                              ('solve.py', [f'--data_path={sudoku4}', '--index=0'])):
            assert_user_error(run([script, f'--init_from={path}', *extra], check=False), str(path), words)
    p = publish(f'--init_from={table_run["folder"]}/step_6', check=False)
    assert_user_error(p, 'is not a checkpoint of train.py (no model, config, step)', 'a dict of')


@pytest.mark.parametrize('change,words', [
    (lambda c: c['arch'].update(name='hrm@HierarchicalReasoningModel_ACTV1'), "arch.name is 'hrm@"),
    (lambda c: c['arch'].update(puzzle_emb_ndim='${.hidden_size}'), "arch.puzzle_emb_ndim='${.hidden_size}' is not"),
    (lambda c: c['arch'].pop('L_cycles'), 'arch.L_cycles is missing'),
    (lambda c: c['arch']['loss'].update(loss_type='focal'), "loss_type stablemax_cross_entropy or"),
    (lambda c: c['arch'].update(puzzle_emb_ndim=0, puzzle_emb_len=16), 'puzzle_emb_ndim is 0 with puzzle_emb_len'),
    (lambda c: c.pop('arch'), 'has no `arch:` block'),
    # train.py's rules, as for the same keys on its command line (attention: num_heads divides hidden_size)
    (lambda c: c['arch'].update(num_heads=0), 'arch.num_heads=0 (allowed: > 0)'),
    (lambda c: c['arch'].update(L_cycles=-1), 'arch.L_cycles=-1 (allowed: > 0)'),
    (lambda c: c['arch'].update(halt_max_steps=0), 'arch.halt_max_steps=0 (allowed: > 0)'),
    (lambda c: c['arch'].update(hidden_size=30, num_heads=4), 'hidden_size=30 is not divisible by num_heads=4'),
])
def test_a_broken_or_foreign_all_config_is_one_line(table_run, tmp_path, change, words):
    shutil.copy(f"{table_run['folder']}/step_6", tmp_path / 'step_6')
    cfg = yaml.safe_load(open(f"{table_run['folder']}/all_config.yaml"))
    change(cfg)
    (tmp_path / 'all_config.yaml').write_text(yaml.safe_dump(cfg))
    p = run(['train.py', f'--data_path={table_run["data"]}', f'--out_dir={tmp_path}/o',
             f'--init_from={tmp_path}/step_6', *EVAL], check=False)
    assert_user_error(p, f'{tmp_path}/all_config.yaml', words)
    p = run(['solve.py', f'--init_from={tmp_path}/step_6', '--index=0', '--device=cpu'], check=False)
    assert_user_error(p, f'{tmp_path}/all_config.yaml', words)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_an_all_config_of_damaged_bytes_is_one_line(table_run, tmp_path):
    """A byte that is no UTF-8 (a damaged block of a copy) was a UnicodeDecodeError's traceback."""
    shutil.copy(f"{table_run['folder']}/step_6", tmp_path / 'step_6')
    text = open(f"{table_run['folder']}/all_config.yaml", 'rb').read()
    (tmp_path / 'all_config.yaml').write_bytes(text.replace(b'H_cycles: ', b'H_cycles: \xff', 1))
    p = run(['solve.py', f'--init_from={tmp_path}/step_6', '--index=0', '--device=cpu'], check=False)
    assert_user_error(p, f"{tmp_path}/all_config.yaml cannot be read as the reference's all_config.yaml", 'utf-8',
                      one_line=True)


def test_a_published_model_too_large_for_the_machine_is_refused_by_solve_in_one_line(trained, tmp_path):
    """all_config.yaml's hidden_size of ten million: weights of petabytes. solve.py's memory check refuses them
    in one line with the numbers, before anything is allocated (as train.py's does)."""
    publish(f'--init_from={trained}/ckpt_00000004.pt', f'--out_dir={tmp_path}/pub')
    cfg = yaml.safe_load(open(tmp_path / 'pub' / 'all_config.yaml'))
    cfg['arch']['hidden_size'] = 10_000_000
    (tmp_path / 'pub' / 'all_config.yaml').write_text(yaml.safe_dump(cfg))
    p = run(['solve.py', f'--init_from={tmp_path}/pub/step_4', '--count=1', '--device=cpu'], check=False)
    assert_user_error(p, 'of memory', 'weights', 'available', '--check_memory=False')
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_solve_names_the_all_config_a_published_model_was_built_from(trained, sudoku4, tmp_path):
    """The model keys of a step file come from the all_config.yaml beside it, which no flag may contradict: where
    the weights do not fit them (a YAML of another run: hidden_size 64 for weights of 32), or where it names no
    dataset, solve.py's one line names that file, not flags (--hidden_size) that it would then refuse."""
    publish(f'--init_from={trained}/ckpt_00000004.pt', f'--out_dir={tmp_path}/pub')
    yaml_path = tmp_path / 'pub' / 'all_config.yaml'
    cfg = yaml.safe_load(open(yaml_path))
    solve = ['solve.py', f'--init_from={tmp_path}/pub/step_4', '--count=1', '--device=cpu']
    yaml_path.write_text(yaml.safe_dump(dict(cfg, arch=dict(cfg['arch'], hidden_size=64))))
    said = assert_user_error(run(solve, check=False), f'built from {yaml_path} and dataset {sudoku4}',
                             'hidden_size=32 (here 64)', f'else {yaml_path} is not', one_line=True)
    assert '--hidden_size' not in said
    yaml_path.write_text(yaml.safe_dump(dict(cfg, data_paths=[])))
    said = assert_user_error(run(solve, check=False), '--data_path', f'{yaml_path} names no dataset', one_line=True)
    assert '--hidden_size' not in said


def test_a_table_of_other_rows_than_the_dataset_s_is_refused(table_run, tmp_path):
    """The published table has 12 rows; a dataset with 5 identifiers is refused where checkpoints of this
    trainer are (checkpoint.load_weights), in one line."""
    other = make_ids_dataset(tmp_path / 'five', ids=5)
    p = run(['train.py', f'--data_path={other}', f'--out_dir={tmp_path}/o',
             f'--init_from={table_run["folder"]}/step_6', *EVAL], check=False)
    assert_user_error(p, f'init_from={table_run["folder"]}/step_6', 'puzzle_emb')



def test_a_published_model_on_a_dataset_of_another_vocabulary_names_the_dataset(table_run, tmp_path):
    """The model keys come from all_config.yaml; the vocabulary from the dataset: a dataset of 8 tokens for weights
    of 6 is one line that says so and points at --data_path, not at model keys the user did not type."""
    rng = np.random.default_rng(0)
    root = str(tmp_path / 'vocab8')
    for split in ('train', 'test'):
        x = rng.integers(2, 8, (40, 8))
        write_split(root, split, x, x[:, ::-1], rng.integers(1, 12, 40), np.arange(41), np.arange(41),
                    vocab_size=8, num_puzzle_identifiers=12)
    p = run(['train.py', f'--data_path={root}', f'--out_dir={tmp_path}/o',
             f'--init_from={table_run["folder"]}/step_6', *EVAL], check=False)
    said = assert_user_error(p, 'vocab_size=6 (here 8)', '--data_path', one_line=True)
    assert '--hidden_size' not in said, said

def test_a_published_model_on_a_dataset_of_another_length_names_both_lengths(table_run, tmp_path):
    """Same vocabulary, puzzles of 16 tokens for weights trained on 8. Attention with RoPE runs on any length (a
    fine-tune to a new length is legitimate): one note names both lengths, in train.py and solve.py, for the
    published file and our own checkpoint alike. MLP-t's weights hold the length: one line naming both lengths
    and --data_path, not keys that all_config.yaml set (nor the checkpoint's)."""
    longer = make_ids_dataset(tmp_path / 'len16', L=16)
    step = f"{table_run['folder']}/step_6"
    note = f"seq_len 8 ({table_run['data']}); {longer} holds seq_len 16"
    p = run(['train.py', f'--data_path={longer}', f'--out_dir={tmp_path}/o', f'--init_from={step}', *EVAL])
    assert note in p.stdout and eval_lines(p.stdout), p.stdout[-3000:]
    p = run(['solve.py', f'--data_path={longer}', f'--init_from={step}', '--count=2', '--quiet=True'])
    assert note in p.stdout, p.stdout[-3000:]
    same = run(['train.py', f'--data_path={table_run["data"]}', f'--out_dir={tmp_path}/s', f'--init_from={step}',
                *EVAL])
    assert 'holds seq_len' not in same.stdout

    mlp = tmp_path / 'mlp'
    train(table_run['data'], mlp, '--max_steps=1')
    publish(f'--init_from={mlp}/ckpt_00000001.pt')
    p = run(['train.py', f'--data_path={longer}', f'--out_dir={tmp_path}/m', f'--init_from={mlp}/published/step_1',
             *EVAL], check=False)
    said = assert_user_error(p, 'seq_len 8', 'seq_len 16', '--data_path', one_line=True)
    assert '--puzzle_emb_len' not in said and '--puzzle_emb_ndim' not in said, said

    # our own checkpoint knows its data's kind, and 16 tokens of 6 symbols read as 4x4 Sudokus: 12 tokens do not
    other = make_ids_dataset(tmp_path / 'len12', L=12)
    ours = f"seq_len 8 ({table_run['data']}), {other} holds seq_len 12"
    p = run(['train.py', f'--data_path={other}', f'--out_dir={tmp_path}/c', f'--init_from={table_run["ckpt"]}',
             *EVAL])
    assert ours in p.stdout and eval_lines(p.stdout), p.stdout[-3000:]
    p = train(other, tmp_path / 'f', '--max_steps=1', f'--init_from={table_run["ckpt"]}', args=TABLE_ARGS)
    assert ours in p.stdout and os.path.exists(f'{tmp_path}/f/ckpt_00000001.pt'), p.stdout[-3000:]
    p = run(['train.py', f'--data_path={other}', f'--out_dir={tmp_path}/n', f'--init_from={mlp}/ckpt_00000001.pt',
             *EVAL], check=False)
    assert_user_error(p, 'seq_len 8', 'seq_len 12', '--data_path', one_line=True)


def test_a_model_without_puzzle_table_round_trips_and_solves_alike(trained, sudoku4, tmp_path):
    """No table (puzzle_emb_ndim 0, the quick start's): the reference has no puzzle_emb then, and no prefix
    (puzzle_emb_len 0); the state dict without it loads back, and solve.py answers alike with no key typed."""
    publish(f'--init_from={trained}/ckpt_00000004.pt', f'--out_dir={tmp_path}/pub')
    sd = torch.load(tmp_path / 'pub' / 'step_4', weights_only=True)
    assert not any('puzzle_emb' in k for k in sd)
    arch = yaml.safe_load(open(tmp_path / 'pub' / 'all_config.yaml'))['arch']
    assert (arch['puzzle_emb_ndim'], arch['puzzle_emb_len']) == (0, 0)
    ours = run(['solve.py', f'--init_from={trained}/ckpt_00000004.pt', '--count=5', '--quiet=True', '--eval_steps=4'])
    theirs = run(['solve.py', f'--init_from={tmp_path}/pub/step_4', '--count=5', '--quiet=True', '--eval_steps=4'])
    answers = lambda out: [l.split(' | ')[0] + l.split('answer')[-1] for l in out.splitlines()
                           if l.startswith('puzzle ')]
    assert answers(theirs.stdout) == answers(ours.stdout) and len(answers(ours.stdout)) == 5
    assert f"data_paths=['{sudoku4}']" in theirs.stdout  # the dataset came from all_config.yaml
    p = run(['train.py', f'--data_path={sudoku4}', f'--out_dir={tmp_path}/o', f'--init_from={tmp_path}/pub/step_4',
             *EVAL])
    assert 'loaded weights from' in p.stdout and eval_lines(p.stdout)


def test_publish_refuses_bad_input_in_one_line(tmp_path):
    assert_user_error(publish('--init_from=nowhere.pt', check=False), 'nowhere.pt', 'no such file')
    assert_user_error(publish(check=False), "init_from=''")
    assert_user_error(publish('--init_from=x.pt', '--weights=best', check=False), "weights='best'", "'ema'")
    assert_user_error(publish('--init_from=x.pt', '--repo=nobody', check=False), "repo='nobody'", 'OWNER/REPO')
    bad = tmp_path / 'bad.pt'
    bad.write_bytes(b'not a checkpoint')
    assert_user_error(publish(f'--init_from={bad}', check=False), str(bad), 'corrupt or truncated')


@pytest.mark.parametrize('out_dir', ['gs://bucket/pub', 'hf://owner/repo', ' '])
def test_an_out_dir_that_is_no_local_folder_is_refused_and_nothing_is_written(table_run, tmp_path, out_dir):
    """publish.py writes a local folder: a gs:// or hf:// out_dir was written under the working folder as 'gs:/...',
    and the line after it named the bucket's path to load from, where nothing was."""
    p = run(['publish.py', f'--init_from={table_run["ckpt"]}', f'--out_dir={out_dir}'], check=False, cwd=tmp_path)
    assert_user_error(p, f"out_dir={out_dir!r}", 'a local folder', one_line=True)
    assert not os.listdir(tmp_path)


def test_a_run_folder_given_as_init_from_names_its_newest_checkpoint(table_run, tmp_path):
    p = publish(f'--init_from={table_run["out"]}', check=False)
    assert_user_error(p, f'init_from={table_run["out"]} is a folder', f'--init_from={table_run["ckpt"]}',
                      one_line=True)
    p = publish(f'--init_from={tmp_path}', check=False)
    assert_user_error(p, f'init_from={tmp_path} is a folder', 'no ckpt_*.pt', one_line=True)


def test_a_folder_given_as_init_from_names_train_py_s_newest_checkpoint_by_its_step(tmp_path):
    # by the number (a run past step 99,999,999 writes one more digit), and train.py's own: a published step_<N>
    # beside it is not a checkpoint that publish.py publishes
    for name in ('ckpt_99999999.pt', 'ckpt_100000000.pt', 'step_200000000'):
        (tmp_path / name).write_bytes(b'')
    p = publish(f'--init_from={tmp_path}', check=False)
    assert_user_error(p, f'init_from={tmp_path} is a folder', f'--init_from={tmp_path / "ckpt_100000000.pt"}',
                      one_line=True)
    (tmp_path / 'published').mkdir()
    (tmp_path / 'published' / 'step_5').write_bytes(b'')
    p = publish(f'--init_from={tmp_path / "published"}', check=False)
    assert_user_error(p, f'init_from={tmp_path / "published"} is a folder', 'no ckpt_*.pt', one_line=True)


def test_a_checkpoint_of_an_earlier_trainer_without_newer_keys_is_published(table_run, tmp_path):
    """A checkpoint saved before a key existed (here rms_norm_eps and rope_theta) had its default: published."""
    ckpt = torch.load(table_run['ckpt'], weights_only=True)
    for k in ('rms_norm_eps', 'rope_theta', 'loss_type'):
        del ckpt['config'][k]
    torch.save(ckpt, tmp_path / 'old.pt')
    publish(f'--init_from={tmp_path}/old.pt', f'--out_dir={tmp_path}/pub')
    arch = yaml.safe_load(open(tmp_path / 'pub' / 'all_config.yaml'))['arch']
    assert arch['loss']['loss_type'] == 'stablemax_cross_entropy' and 'rope_theta' not in arch



def test_a_folder_holding_another_run_s_steps_is_refused_and_left_as_it_was(table_run, tmp_path):
    """all_config.yaml answers for every step_<N> beside it: a checkpoint of another run is refused in one line
    naming the folder, the run there and what to do, whether it brings another config (here L_cycles, which
    changes no weight's shape: the files there would load with it unnoticed; or the same model, another seed)
    or other weights under the same step (here the raw weights of the run's EMA step); the folder stays as it
    was, byte for byte. The steps of one run go side by side."""
    data = table_run['data']
    pub = tmp_path / 'pub'
    shutil.copytree(table_run['folder'], pub)  # step_6 (and its train state) of the run 'run'
    before = tree(pub)
    longer = tmp_path / 'longer'  # L_cycles 3: its step_4 and its step_6
    train(data, longer, '--max_steps=6', '--checkpoint_interval=2', '--L_cycles=3', args=TABLE_ARGS)
    seeded = tmp_path / 'seeded'  # the same model, another seed
    train(data, seeded, '--max_steps=6', '--seed=1', args=TABLE_ARGS)
    for ckpt, extra, words in ((longer / 'ckpt_00000004.pt', [], ['L_cycles=2', 'L_cycles=3']),
                               (longer / 'ckpt_00000006.pt', [], ['L_cycles=2', 'L_cycles=3']),
                               (seeded / 'ckpt_00000006.pt', [], ['seed=0', 'seed=1']),
                               (table_run['ckpt'], ['--weights=model'], ['step_6', 'other weights'])):
        p = publish(f'--init_from={ckpt}', f'--out_dir={pub}', *extra, check=False)
        assert_user_error(p, str(pub), "the run 'run ", '--out_dir', *words)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert tree(pub) == before, ckpt
    mine = tmp_path / 'mine'
    for ckpt in ('ckpt_00000004.pt', 'ckpt_00000006.pt', 'ckpt_00000004.pt'):  # the last: again, the same bytes
        publish(f'--init_from={longer / ckpt}', f'--out_dir={mine}')
    assert sorted(os.listdir(mine)) == ['all_config.yaml', 'step_4', 'step_6']
    assert yaml.safe_load(open(mine / 'all_config.yaml'))['arch']['L_cycles'] == 3


def limited(limit, *args):
    """publish.py under a file-size limit of `limit` bytes (what a full disk does to a write)."""
    code = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            "sys.argv = ['publish.py'] + sys.argv[1:]; runpy.run_path('publish.py', run_name='__main__')")
    return run(['-c', code] + [str(a) for a in args], check=False)


def test_a_publish_that_cannot_write_is_one_line_and_leaves_nothing_behind(table_run, tmp_path):
    ckpt, folder = table_run['ckpt'], table_run['folder']
    taken = tmp_path / 'afile'
    taken.write_text('mine')
    for out in (taken, taken / 'sub'):  # a file, a folder under a file
        p = publish(f'--init_from={ckpt}', f'--out_dir={out}', check=False)
        assert_user_error(p, str(out), 'not a folder')
        assert len(p.stderr.strip().splitlines()) == 1 and taken.read_text() == 'mine', p.stderr
    step = os.path.getsize(f'{folder}/step_6')
    state = os.path.getsize(f'{folder}/step_6_train_state.pt')
    assert step < state
    kept = tmp_path / 'kept'
    kept.mkdir()
    (kept / 'notes.txt').write_text('mine')
    for limit, failing in ((step // 2, 'step_6'), ((step + state) // 2, 'step_6_train_state.pt')):
        for out in (tmp_path / 'new' / 'pub', kept):  # a first publish (two folders made), a folder of the user's
            p = limited(limit, f'--init_from={ckpt}', f'--out_dir={out}', '--train_state=True')
            assert_user_error(p, f'{out}/{failing}', 'File too large')
            assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not (tmp_path / 'new').exists() and tree(kept) == {'notes.txt': b'mine'}


def test_a_folder_on_the_way_that_cannot_be_made_is_the_path_named(table_run, tmp_path):
    """A folder above out_dir that cannot be made (here a name longer than a file system takes; a read-only
    parent alike) is what the one line names, not a path inside out_dir."""
    long = tmp_path / ('x' * 300)
    p = publish(f'--init_from={table_run["ckpt"]}', f'--out_dir={long}/pub', check=False)
    said = assert_user_error(p, f'could not write {long}: ', 'nothing was published', one_line=True)
    assert f'{long}/pub/' not in said and not os.listdir(tmp_path)


def test_a_resume_that_changed_what_a_resume_may_change_publishes_beside_its_earlier_steps(table_run, tmp_path):
    """halt_exploration_prob and forward_dtype may change at a resume (train.py) and differ from the published
    run's (the loader): a later checkpoint of the same run goes beside step_6, all_config.yaml takes its values
    and says so, as for lr."""
    out, pub = tmp_path / 'x' / 'run', tmp_path / 'pub'  # the run's folder name: its run_name
    shutil.copytree(table_run['out'], out)
    shutil.copytree(table_run['folder'], pub)
    train(table_run['data'], out, '--init_from=resume', '--max_steps=8', '--halt_exploration_prob=0.5',
          '--forward_dtype=bfloat16', '--lr=1e-3', args=TABLE_ARGS)
    p = publish(f'--init_from={out}/ckpt_00000008.pt', f'--out_dir={pub}')
    assert sorted(os.listdir(pub)) == ['all_config.yaml', 'step_6', 'step_6_train_state.pt', 'step_8']
    cfg = yaml.safe_load(open(pub / 'all_config.yaml'))
    assert (cfg['arch']['halt_exploration_prob'], cfg['arch']['forward_dtype'], cfg['lr']) == (0.5, 'bfloat16', 1e-3)
    said = next(l for l in p.stdout.splitlines() if 'all_config.yaml replaced' in l)
    for words in ("arch.halt_exploration_prob 0.1 -> 0.5", "arch.forward_dtype 'float32' -> 'bfloat16'",
                  "lr 0.002 -> 0.001"):
        assert words in said, said


def test_all_config_records_freeze_weights_and_the_file_an_adaptation_started_from(table_run, tmp_path):
    """load_checkpoint is the file init_from started from, resume: or not (null from scratch); freeze_weights the
    run's."""
    ckpt = table_run['ckpt']
    for init, freeze in ((f'resume:{ckpt}', True), (ckpt, False)):
        out = tmp_path / f'frozen{freeze}'
        train(table_run['data'], out, f'--init_from={init}', '--max_steps=2', f'--freeze_weights={freeze}',
              args=TABLE_ARGS)
        publish(f'--init_from={out}/ckpt_00000002.pt')
        cfg = yaml.safe_load(open(out / 'published' / 'all_config.yaml'))
        assert (cfg['load_checkpoint'], cfg['freeze_weights']) == (ckpt, freeze), cfg
    assert yaml.safe_load(open(f"{table_run['folder']}/all_config.yaml"))['load_checkpoint'] is None


def test_a_publish_after_one_that_was_killed_midway_publishes(table_run, tmp_path):
    """A publish killed while it wrote (SIGKILL, a lost machine) leaves its staging folder with what it had
    written; the next publish into that folder (here without the train state the killed one was writing) is not
    stopped by those files, and leaves no staging folder."""
    pub = tmp_path / 'pub'
    (pub / '.publishing').mkdir(parents=True)
    (pub / '.publishing' / 'step_6_train_state.pt').write_bytes(b'half a file')
    p = publish(f'--init_from={table_run["ckpt"]}', f'--out_dir={pub}', check=False)
    assert p.returncode == 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert sorted(os.listdir(pub)) == ['all_config.yaml', 'step_6']


def test_a_second_publish_into_a_folder_being_published_is_refused_and_the_first_publishes(table_run, tmp_path):
    """Two publishes into one out_dir at once: the second, started while the first is surely midway (a test hook
    holds it, a file of its step staged, until the test lets go), is one line naming the publish that holds the
    folder and leaves that one's staged files alone; the first then publishes whole, leaving no lock or staging
    folder behind."""
    pub, reached, go = tmp_path / 'pub', tmp_path / 'reached', tmp_path / 'go'
    env = site_hook(tmp_path / 'hook', f'''
import yaml
real_dump = yaml.safe_dump

def safe_dump(*args, **kwargs):
    open({str(reached)!r}, 'w').close()
    while not os.path.exists({str(go)!r}):
        time.sleep(0.05)
    return real_dump(*args, **kwargs)

yaml.safe_dump = safe_dump
''')
    first = subprocess.Popen([sys.executable, 'publish.py', f'--init_from={table_run["ckpt"]}', f'--out_dir={pub}'],
                             cwd=ROOT, env=script_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        while not reached.exists():
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        second = publish(f'--init_from={table_run["ckpt"]}', f'--out_dir={pub}', check=False)
        assert_user_error(second, str(pub), 'in use by the publish', f'pid {first.pid}', one_line=True)
        go.touch()
        out, err = first.communicate(timeout=300)
    finally:
        go.touch()
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0 and 'Traceback' not in err, err[-3000:]
    assert sorted(os.listdir(pub)) == ['all_config.yaml', 'step_6']
    sd = torch.load(pub / 'step_6', weights_only=True)
    theirs = torch.load(os.path.join(table_run['folder'], 'step_6'), weights_only=True)
    assert sd.keys() == theirs.keys() and all(torch.equal(sd[k], theirs[k]) for k in sd)
    assert yaml.safe_load(open(pub / 'all_config.yaml')) == \
        dict(yaml.safe_load(open(os.path.join(table_run['folder'], 'all_config.yaml'))), checkpoint_path=str(pub))


@pytest.mark.parametrize('epochs,every,written', [(2, 100, 2), (12, 5, 4), (12, 4, 4), (12, 12, 12), (7, 3, 1)])
def test_all_config_s_eval_interval_divides_its_epochs_as_the_reference_asserts(table_run, tmp_path, epochs,
                                                                                 every, written):
    """The reference's pretrain.py asserts epochs % eval_interval == 0: a run whose eval_every_epochs does not
    divide its epochs is written with the divisor of its epochs nearest to it (of two as near, the smaller); one
    that divides is written as it is."""
    ckpt = torch.load(table_run['ckpt'], weights_only=True)
    ckpt['config'].update(epochs=epochs, eval_every_epochs=every)
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    publish(f'--init_from={tmp_path}/ckpt.pt', f'--out_dir={tmp_path}/pub')
    cfg = yaml.safe_load(open(tmp_path / 'pub' / 'all_config.yaml'))
    assert cfg['epochs'] == epochs and cfg['epochs'] % cfg['eval_interval'] == 0
    assert cfg['eval_interval'] == written
