"""
Test-time views (train.py --eval_views=K: each held-out puzzle in K symmetries, one batch of K x the rows) on a small
generated 4x4 Sudoku: on XLA (the CPU's) the K-view evaluation compiles its graphs in its first batches and then
nothing (the next evaluation none at all), as many as a 1-view one, with no CPU fallback; bench.py times it
(puzzles, not rows). On the CPU, view 0 of K gives exactly a 1-view evaluation's numbers: tests/test_views.py.
    python -m pytest -q tests/test_views_xla.py
"""
import json

import pytest

from conftest import TOY_ARGS, XLA_ENV, assert_user_error, make_reverse_dataset, run

SMALL = [a for a in TOY_ARGS if not a.startswith(('--device', '--global_batch_size'))] + ['--tensorboard=False']


@pytest.fixture(scope='module')
def sudoku4(tmp_path_factory):
    """600 generated 4x4 Sudoku puzzles to train on, 40 held out (3 evaluation batches of 16, the last padded)."""
    root = str(tmp_path_factory.mktemp('sudoku4'))
    run(['prepare_sudoku.py', '--generate', '600', '--num_test', '40', '--size', '4', '--output_dir', root])
    return root


def eval_records(out_dir):
    with open(f'{out_dir}/metrics.jsonl') as f:
        return [r for r in map(json.loads, f) if r['kind'] == 'eval']


def test_xla_views_evaluation_compiles_once(sudoku4, tmp_path):
    pytest.importorskip('torch_xla')
    # 4 steps an epoch, an evaluation after each of the two; no EMA: the same weights' graphs both times
    p = run(['train.py', f'--data_path={sudoku4}', f'--out_dir={tmp_path}', '--device=xla', '--global_batch_size=150',
             '--epochs=2', '--eval_every_epochs=1', '--log_interval=4', '--eval_batch_size=16', '--eval_views=4',
             '--ema=False'] + SMALL, env=XLA_ENV)
    first, second = eval_records(tmp_path)
    assert first['views'] == second['views'] == 4 and first['count'] == 40
    assert [v['views'] for v in first['by_views']] == [1, 2, 4]
    assert first['by_views'][0]['vote'] == first['exact_accuracy']  # one view's vote: view 0, the puzzle itself
    assert first['xla_compiles'] > 0 and second['xla_compiles'] == 0, (first['xla_compiles'], second['xla_compiles'])
    assert 'CPU fallbacks: none' in p.stdout


PER_BATCH = """
import json, sys
import torch_xla.debug.metrics as met
from data import EvalLoader, load_metadata
from device import Device
from model import TRM, TRMConfig
from puzzles import puzzle_for
from evaluate import evaluate
from step import compiled_predict
dev = Device('xla')
meta = load_metadata(sys.argv[1], 'test')
kind = puzzle_for(meta)
model = TRM(TRMConfig.for_data(meta, hidden_size=16, num_heads=1, mlp_t=True, pos_encodings='none', puzzle_emb_ndim=0,
                               H_cycles=1, L_cycles=1, halt_max_steps=2, forward_dtype='float32')).to(dev.device)
compiles = lambda: (met.metric_data('CompileTime') or [0])[0]

class Counted(EvalLoader):  # train.py's loader; notes the compilations so far as each batch is asked for
    def __iter__(self):
        for batch in super().__iter__():
            self.seen.append(compiles())
            yield batch
        self.seen.append(compiles())

out = {}
for K in (1, 4):
    for i in range(2):
        loader = Counted(sys.argv[1], 16, views=K, kind=kind)
        loader.seen, c0 = [], compiles()
        res, _ = evaluate(model, loader, dev, 2, 2, kind.correct, predict=compiled_predict(model))
        # compilations in each batch, then in the final reduction
        out[f'{K}-{i}'] = [b - a for a, b in zip([c0] + loader.seen, loader.seen + [compiles()])]
out['fallbacks'] = dev.xla_report()[1]
print(json.dumps(out))
"""


def test_xla_views_add_no_graphs(sudoku4):
    pytest.importorskip('torch_xla')
    p = run(['-c', PER_BATCH, sudoku4], env=XLA_ENV)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r.pop('fallbacks') == {}
    one, views = r['1-0'], r['4-0']
    assert len(views) == 3 + 2  # before the first batch (nothing), 3 batches, the reduction
    assert views == one, r  # K views: the same graphs as one view (K x the rows), in the same batches
    # the first batch compiles the predict and the batch's graph; the later ones nothing (each batch's sums are
    # read with its answers and added on the host: on the device, the second batch's running sum was a graph more)
    assert views[0] == 0 and views[1] > 0 and views[2] == views[3] == 0, r
    assert r['1-1'] == r['4-1'] == [0] * 5, r  # nor does the next evaluation


def test_bench_evaluates_views(sudoku4, tmp_path):
    args = ['bench.py', '--device=cpu', '--steps=1', '--warmup_steps=1', '--global_batch_size=16',
            '--eval_batch_size=16', '--eval_batches=2'] + SMALL
    p = run(args + [f'--data_path={sudoku4}', '--eval_views=4'])
    assert 'batch 16 x 4 views = 64 rows' in p.stdout
    bench = dict(kv.split('=') for kv in p.stdout.strip().splitlines()[-1].split()[1:])
    assert bench['eval_views'] == '4' and float(bench['eval_puzzles_per_s']) > 0
    p = run(args + ['--eval_views=2'])  # random batches of the default 9x9 Sudoku's shape, in views too
    assert 'batch 16 x 2 views = 32 rows' in p.stdout
    toy = make_reverse_dataset(str(tmp_path / 'toy'), n_train=20, n_test=10)  # no puzzle kind: no symmetries
    assert_user_error(run(args + [f'--data_path={toy}', '--eval_views=2'], check=False), 'eval_views=2',
                      'views must be 1')
