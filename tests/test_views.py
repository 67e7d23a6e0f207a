"""
Test-time views (eval_views): each held-out puzzle shown in K symmetries of its kind, the answers mapped back
and combined by vote, by the verifier, and the oracle's ceiling. Properties of the views on real puzzles of
every kind and size, then a small trained 4x4 Sudoku model evaluated in views.
"""
import csv
import json
import os
import re
import shutil
import tempfile

import numpy as np
import pytest
import torch

import prepare_maze as pm
import prepare_sudoku as ps
from runkeep import checkpoint
from conftest import TOY_ARGS, assert_user_error, make_reverse_dataset, run
from data import EvalLoader, load_arrays, load_metadata, write_split
from device import Device
from model import TRM, TRMConfig
from puzzles import Grid, Maze, Sudoku, puzzle_for, views_problem, vote
from evaluate import evaluate, format_eval, score_views, view_counts


def sudoku_tokens(n, count, seed):
    """count generated n x n Sudokus with their solutions, as tokens (blank 1, digit d -> d + 1)."""
    kind, rows = Sudoku(n), ps.generate_puzzles(count, n, seed=seed)
    return (kind, kind.encode([q for q, _, _ in rows]).astype(np.int64),
            kind.encode([a for _, a, _ in rows]).astype(np.int64))


def maze_tokens(n, count, seed):
    """count generated n x n mazes with their shortest paths, as tokens."""
    with tempfile.TemporaryDirectory() as d:
        pm.generate_csvs(d, count, 1, size=n, seed=seed)
        with open(os.path.join(d, 'train.csv')) as f:
            rows = list(csv.reader(f))[1:]
    kind = Maze(n)
    return (kind, kind.encode([q for _, q, _, _ in rows]).astype(np.int64),
            kind.encode([a for _, _, a, _ in rows]).astype(np.int64))


@pytest.mark.parametrize('make', [lambda: sudoku_tokens(4, 30, 1), lambda: sudoku_tokens(6, 20, 2),
                                  lambda: sudoku_tokens(9, 6, 3), lambda: maze_tokens(9, 20, 4)],
                         ids=['sudoku4', 'sudoku6', 'sudoku9', 'maze9'])
def test_views_keep_answers_valid_and_invert(make):
    kind, q, a = make()
    assert kind.correct(q, a).all()
    B, K = len(q), 8
    sym = kind.views(K, B, seed=5, batch=2)
    assert sym[0].shape == (K * B, kind.L)
    # view 0 is the puzzle itself
    assert (kind.apply(q, (sym[0][:B], sym[1][:B])) == q).all()
    qv, av = kind.apply(np.tile(q, (K, 1)), sym), kind.apply(np.tile(a, (K, 1)), sym)
    assert kind.correct(qv, av).all()  # a valid answer stays valid in every view
    assert (qv[B:] != np.tile(q, (K - 1, 1))).any(1).mean() > 0.6  # the other views do move the puzzle
    inv = kind.invert(sym)
    assert (kind.apply(av, inv) == np.tile(a, (K, 1))).all() and (kind.apply(qv, inv) == np.tile(q, (K, 1))).all()
    # labels: ignored ones (negative) move with their cell and keep their value
    lab = np.tile(a, (K, 1))
    lab[:, ::3] = -100
    moved = kind.apply_labels(lab, sym)
    assert ((moved < 0) == (np.take_along_axis(lab, sym[0], 1) < 0)).all()
    assert (kind.apply_labels(moved, inv) == lab).all()
    # nested: the first k views of K are a k-view evaluation's; the same on every call
    small = kind.views(3, B, seed=5, batch=2)
    assert (small[0] == sym[0][:3 * B]).all() and (small[1] == sym[1][:3 * B]).all()
    other = kind.views(K, B, seed=5, batch=3)
    assert (other[0][B:] != sym[0][B:]).any()  # another batch, other views


def test_a_kind_without_symmetries_refuses_views():
    class Plain(Grid):
        name, chars = 'plain', 'ab'
    assert views_problem(Plain(3), 1) is None
    assert 'no symmetries' in views_problem(Plain(3), 4) and 'views must be 1' in views_problem(Plain(3), 4)
    assert 'unknown' in views_problem(None, 2)
    assert views_problem(Sudoku(6), 16) is None and views_problem(Maze(8), 8) is None


def test_views_that_need_more_memory_than_there_is_say_both_figures_apart():
    # 104.5 MB against 50 MB: not '0.1 GB' twice, which reads as a need no larger than what there is
    problem = views_problem(Sudoku(9), 100, rows=64, row_bytes=13_000, memory=50_000_000)
    need, have = re.search(r'need (\S+ [MG]B) of memory .* than the (\S+ [MG]B) available', problem).groups()
    assert need != have and (need, have) == ('105 MB', '50 MB'), problem
    big = views_problem(Sudoku(9), 1000, rows=64, row_bytes=13_000, memory=1_000_000_000)  # 1.04 GB against 1
    assert 'need 1.1 GB' in big and 'the 1.0 GB available' in big, big


def test_vote_counts_answers_breaks_ties_by_confidence_and_prefers_accepted():
    A, B_, C = [1, 2, 3], [1, 2, 4], [3, 3, 3]
    answers = np.array([[A], [B_], [A], [B_], [C]])  # [K=5, B=1, L=3]: A and B_ twice each, C once
    conf = np.array([[0.0], [2.0], [-1.0], [0.5], [9.0]])
    picked, choice, count = vote(answers, conf)
    assert list(count[:, 0]) == [2, 2, 2, 2, 1]
    assert picked[0] in (1, 3)  # the tie goes to the answer one of whose views is most confident (2.0)
    accepted = np.array([[False], [False], [False], [False], [True]])
    picked, choice, _ = vote(answers, conf, accepted)
    assert picked[0] in (1, 3) and choice[0] == 4  # the verifier's answer beats a larger vote
    picked, choice, _ = vote(answers, conf, np.zeros((5, 1), bool))
    assert choice[0] == picked[0]  # nothing accepted: the vote
    assert view_counts(16) == [1, 2, 4, 8, 16] and view_counts(6) == [1, 2, 4, 6] and view_counts(1) == [1]


def test_a_maze_solved_by_another_shortest_path_in_a_view_counts_as_solved(tmp_path):
    """A solver that answers every view with a shortest path (the generator's BFS on the turned maze, so often
    not the label's path once mapped back): every answer is accepted, and vote@k, verified@k and oracle@k say
    solved as the one-view verified accuracy does, not only where the path is the label's."""
    data = str(tmp_path / 'maze')
    pm.generate_csvs(str(tmp_path / 'csv'), 4, 30, size=9, seed=3, loop_frac=0.3)
    pm.build_dataset(str(tmp_path / 'csv'), data)
    kind = puzzle_for(load_metadata(data, 'test'))

    def shortest(row):
        text = kind.decode(row).encode()
        dist, parent, _ = pm._bfs(text, kind.n, text.index(b'S'))
        out, v = np.array(row), parent[text.index(b'G')]
        while dist[v] > 0:
            out[v], v = 5, parent[v]  # 'o'
        return out

    def predict(b, n_steps, **_):
        x = b['inputs'].numpy()
        answers = torch.from_numpy(np.stack([shortest(r) for r in x]).astype(np.int32))
        zeros = torch.zeros(n_steps, len(x))
        return answers.expand(n_steps, -1, -1), zeros, zeros.bool(), zeros[0]

    model = TRM(TRMConfig.for_data(load_metadata(data, 'test'), hidden_size=16, num_heads=1, puzzle_emb_ndim=0,
                                   H_cycles=1, L_cycles=1, halt_max_steps=1))
    res = evaluate(model, EvalLoader(data, 30, views=8, kind=kind), Device('cpu'), 1, 1, kind.correct,
                   predict=predict)[0]
    assert res['verified_accuracy'] == 1
    q = np.asarray(load_arrays(data, 'test')['inputs']).astype(np.int64)
    sym = kind.views(8, len(q), seed=0, batch=0)
    back = kind.apply(np.stack([shortest(r) for r in kind.apply(np.tile(q, (8, 1)), sym)]), kind.invert(sym))
    assert (back != np.tile(np.asarray(load_arrays(data, 'test')['labels']), (8, 1))).any()  # other paths, too
    for v in res['by_views']:
        assert v['accepted'] == v['verified'] == v['oracle'] == v['vote'] == 1, v


# -----------------------------------------------------------------------------
# a small trained model

ARGS = ['--hidden_size=64', '--num_heads=2', '--puzzle_emb_ndim=0', '--H_cycles=2', '--L_cycles=2',
        '--halt_max_steps=4', '--global_batch_size=50', '--lr=3e-3', '--lr_warmup_steps=10', '--weight_decay=0.1',
        '--forward_dtype=float32', '--loss_dtype=float32', '--device=cpu', '--ema_rate=0.95', '--xla_cache_dir=',
        '--tensorboard=False']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A 4x4 Sudoku model trained 96 steps (some puzzles right, many not: views have something to fix)."""
    d = tmp_path_factory.mktemp('views')
    data, out = str(d / 'sudoku4'), str(d / 'run')
    run(['prepare_sudoku.py', '--generate', '400', '--size', '4', '--num_test', '100', '--num_aug', '3',
         '--seed', '0', '--output_dir', data])
    run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--epochs=12', '--eval_every_epochs=12', '--eval_views=2']
        + ARGS + ['--tensorboard=True'])
    path = os.path.join(out, sorted(f for f in os.listdir(out) if f.startswith('ckpt_'))[-1])
    ck = checkpoint.weights_in(checkpoint.load_checkpoint(path))
    meta = load_metadata(data, 'test')
    keys = {k: v for k, v in ck['config'].items() if k in TRMConfig.__dataclass_fields__}
    keys.update(forward_dtype='float32', loss_dtype='float32')
    model = TRM(TRMConfig.for_data(meta, **keys))
    model.load_state_dict(ck['weights'])
    return dict(data=data, out=out, ckpt=path, model=model.eval(), meta=meta)


def evaluate_in(t, K, data=None, batch=40):
    data = data or t['data']
    loader = EvalLoader(data, batch, views=K, kind=puzzle_for(t['meta']))
    return evaluate(t['model'], loader, Device('cpu'), 4, 4, puzzle_for(t['meta']).correct)[0]


def test_view_zero_of_four_is_a_one_view_evaluation_exactly_and_the_views_help(trained, tmp_path):
    """train.py --eval_only of one checkpoint in 1 and in 4 views: view 0 (the puzzle itself) in a 4 x B batch
    gives the 1-view numbers exactly; the other views find more."""
    res = {}
    for K in (1, 4):
        run(['train.py', f'--data_path={trained["data"]}', f'--out_dir={tmp_path}/v{K}', '--eval_only=True',
             f'--init_from={trained["ckpt"]}', f'--eval_views={K}', '--eval_batch_size=16'] + ARGS)
        res[K] = json.load(open(f'{tmp_path}/v{K}/evals/views{K}-steps4.json'))['eval']
    one, four = res[1], res[4]
    assert 'by_views' not in one and one['views'] == 1
    for key in ('count', 'exact_accuracy', 'token_accuracy', 'exact_by_steps', 'q_halt_accuracy',
                'exact_accuracy_q_halt', 'steps_q_halt', 'verified_accuracy', 'loss'):
        assert four[key] == one[key], (key, four[key], one[key])  # exactly: view 0's rows are computed alike
    rows = {v['views']: v for v in four['by_views']}
    assert sorted(rows) == [1, 2, 4]
    assert rows[1]['vote'] == rows[1]['verified'] == rows[1]['oracle'] == one['exact_accuracy']
    assert rows[1]['accepted'] == one['verified_accuracy']
    assert 0 < one['exact_accuracy'] < rows[4]['verified'] <= rows[4]['oracle']  # the views found more
    assert rows[2]['oracle'] <= rows[4]['oracle'] and 0 <= rows[4]['vote'] <= rows[4]['oracle']
    assert four['eval_flops'] == 4 * one['eval_flops'] > 0
    assert '4 views: vote' in format_eval(four) and 'views' not in format_eval(one)


def test_a_views_answer_is_the_direct_answer_of_its_transformed_puzzle_mapped_back(trained):
    kind, model = puzzle_for(trained['meta']), trained['model']
    arrays = load_arrays(trained['data'], 'test')
    q = np.asarray(arrays['inputs'][:20]).astype(np.int64)
    B, K = len(q), 4
    sym = kind.views(K, B, seed=0, batch=0)
    qv = kind.apply(np.tile(q, (K, 1)), sym)
    pid = torch.zeros(K * B, dtype=torch.int32)
    together = model.predict(dict(inputs=torch.from_numpy(qv.astype(np.int32)), puzzle_identifiers=pid), 4)[0][-1]
    back = kind.apply(together.numpy(), kind.invert(sym))
    for j in range(1, K):  # view j alone, as a plain batch of its transformed puzzles
        rows = slice(j * B, (j + 1) * B)
        alone = model.predict(dict(inputs=torch.from_numpy(qv[rows].astype(np.int32)),
                                   puzzle_identifiers=pid[rows]), 4)[0][-1]
        alone_back = kind.apply(alone.numpy(), kind.invert((sym[0][rows], sym[1][rows])))
        assert (alone_back == back[rows]).all()


def test_the_verifiers_choice_never_reads_the_labels(trained, tmp_path):
    """The same evaluation with every label replaced: the views picked are the same; an accepted answer stays
    right (the verifier's rule), and without a verifier the scores move with the labels."""
    kind, model = puzzle_for(trained['meta']), trained['model']
    arrays = load_arrays(trained['data'], 'test')
    q, a = np.asarray(arrays['inputs']).astype(np.int64), np.asarray(arrays['labels']).astype(np.int64)
    B, K = len(q), 4
    sym = kind.views(K, B, seed=0, batch=0)
    qv = kind.apply(np.tile(q, (K, 1)), sym)
    preds, q_halt, _ = model.predict(dict(inputs=torch.from_numpy(qv.astype(np.int32)),
                                          puzzle_identifiers=torch.zeros(K * B, dtype=torch.int32)), 4)
    wrong = np.where(a > 1, (a - 2 + 1) % kind.n + 2, a)  # every digit of every label shifted: all wrong
    rows, ks = np.ones(B, bool), [1, 2, 4]
    true, picks = score_views(preds[-1].numpy(), q_halt[-1].numpy(), kind.invert(sym), q, a, rows, kind.correct, ks)
    moved, picks2 = score_views(preds[-1].numpy(), q_halt[-1].numpy(), kind.invert(sym), q, wrong, rows,
                                kind.correct, ks)
    for (v1, c1), (v2, c2) in zip(picks, picks2):
        assert (v1 == v2).all() and (c1 == c2).all()
    assert (true['accepted'] == moved['accepted']).all() and true['accepted'][-1] > 0
    assert (true['verified'] == true['accepted']).all() and (moved['verified'] == true['verified']).all()
    plain, _ = score_views(preds[-1].numpy(), q_halt[-1].numpy(), kind.invert(sym), q, wrong, rows, None, ks)
    assert true['vote'][-1] > 0 and plain['vote'][-1] == 0 == plain['oracle'][-1]
    # and through evaluate: a copy of the dataset with the shifted labels
    wrong_data = str(tmp_path / 'wrong')
    shutil.copytree(trained['data'], wrong_data)
    meta = json.load(open(os.path.join(wrong_data, 'test', 'dataset.json')))
    write_split(wrong_data, 'test', q, wrong, np.asarray(arrays['puzzle_identifiers']),
                np.asarray(arrays['puzzle_indices']), np.asarray(arrays['group_indices']),
                vocab_size=meta['vocab_size'], extra=dict(puzzle_type='sudoku', grid_size=4))
    res_true, res_wrong = evaluate_in(trained, 4), evaluate_in(trained, 4, data=wrong_data)
    for r1, r2 in zip(res_true['by_views'], res_wrong['by_views']):
        assert r1['accepted'] == r2['accepted'] == r1['verified'] == r2['verified'] > 0
    assert res_wrong['exact_accuracy'] == 0 < res_true['exact_accuracy']  # one view's exact: the labels'


def test_train_refuses_views_where_a_puzzle_has_no_symmetries(tmp_path):
    make_reverse_dataset(str(tmp_path / 'rev'), n_train=100, n_test=20)
    p = run(['train.py', f'--data_path={tmp_path / "rev"}', f'--out_dir={tmp_path / "out"}', '--eval_views=4',
             '--epochs=1'] + TOY_ARGS, check=False)
    assert_user_error(p, 'eval_views=4', 'views must be 1')
    p = run(['train.py', f'--data_path={tmp_path / "rev"}', f'--out_dir={tmp_path / "out"}', '--eval_views=0']
            + TOY_ARGS, check=False)
    assert_user_error(p, 'eval_views=0', '> 0')


def test_a_runs_evaluations_in_views_are_charted_and_costed(trained):
    """Training's evaluations in views: TensorBoard charts each view count's accuracies; results.json holds
    them and their cost (forward FLOPs x steps x views x puzzles)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(trained['out'], 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    tags = acc.Tags()['scalars']
    for tag in ('eval/vote@01', 'eval/verified@02', 'eval/oracle@02', 'eval/accepted@02', 'eval/vote_q_halt@02'):
        assert tag in tags, (tag, tags)
    res = json.load(open(os.path.join(trained['out'], 'results.json')))
    final = res['final_eval']
    assert acc.Scalars('eval/verified@02')[-1].value == pytest.approx(final['by_views'][1]['verified'])
    assert final['views'] == 2 and final['eval_flops'] == pytest.approx(
        trained['model'].flops_per_example(train=False) * 4 * 2 * 100)  # 4 steps, 2 views, 100 puzzles


def test_eval_only_in_views_saves_its_evaluation(trained):
    p = run(['train.py', f'--data_path={trained["data"]}', f'--out_dir={trained["out"]}', '--init_from=resume',
             '--eval_only=True', '--eval_views=4', '--eval_steps=6', '--epochs=12'] + ARGS)
    assert ' 4 views: vote' in p.stdout
    rec = json.load(open(os.path.join(trained['out'], 'evals', 'views4-steps6.json')))
    assert rec['step'] == 96 and rec['eval']['views'] == 4 and len(rec['eval']['exact_by_steps']) == 6
    assert [v['views'] for v in rec['eval']['by_views']] == [1, 2, 4] and rec['seconds'] > 0
    # views count with the steps: their answers are the last step's (6), view 0's exact_accuracy is at halt_max_steps
    assert rec['eval']['by_views'][0]['vote'] == rec['eval']['exact_by_steps'][-1]
