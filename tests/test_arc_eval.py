"""
ARC's evaluation: the vote over a task's stored views (arc.ARCVotes, score_arc), pass@K averaged per task,
the nested curve over the first k views, submission.json, whole-task subsets, and a tiny training run whose
final evaluation scores and submits every evaluation task. Seconds.
"""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import XLA_ENV, assert_user_error, run
from arc import ARCVotes, score_arc
from data import EvalLoader
from evaluate import wilson_interval
from puzzles import ARC

KIND = ARC(10)


# -----------------------------------------------------------------------------
# the scorer on hand-made answers

RIGHT0, WRONG0 = np.array([[1, 2, 3], [4, 5, 6]], np.uint8), np.array([[1, 2, 3]], np.uint8)
RIGHT1, WRONG1 = np.array([[7, 0], [0, 7]], np.uint8), np.array([[0, 7], [7, 0]], np.uint8)
PUZZLES = {'a': dict(train=[], test=[dict(input=[[0]], output=RIGHT0.tolist()),
                                      dict(input=[[0]], output=RIGHT1.tolist())]),
           'b': dict(train=[], test=[dict(input=[[0]], output=[[5]])])}
# task a's test input 0: the majority (3 of 4 views) is wrong, the right answer second; input 1: 2 against 2,
# the right answer the more confident on average (0.8 against 0.525); task b's input: no answer at all
ROWS = [  # (task, test index, view, answer, confidence)
    (0, 0, 0, RIGHT0, 0.3), (0, 0, 1, WRONG0, 0.6), (0, 0, 2, WRONG0, 0.5), (0, 0, 3, WRONG0, 0.1),
    (0, 1, 0, WRONG1, 0.95), (0, 1, 1, RIGHT1, 0.9), (0, 1, 2, WRONG1, 0.1), (0, 1, 3, RIGHT1, 0.7),
    (1, 0, 0, np.array([[5]], np.uint8), 0.5)]


def hand_made_votes():
    """ARCVotes over ROWS, each answer given as the model would draw it: in its row's augmentation, on the
    canvas. Task b's row is in the split but never answered."""
    rng = np.random.default_rng(0)
    n = len(ROWS)
    views = dict(tasks=np.array(['a', 'b']), task=np.array([r[0] for r in ROWS]),
                 test_index=np.array([r[1] for r in ROWS]), view=np.array([r[2] for r in ROWS]),
                 dihedral=rng.integers(0, 8, n).astype(np.uint8),
                 colours=np.stack([np.concatenate([[0], rng.permutation(9) + 1]) for _ in range(n)]).astype(np.uint8))
    votes = ARCVotes(KIND, views, PUZZLES)
    answers = np.stack([KIND.to_canvas(KIND.augment(r[3], views['dihedral'][i], views['colours'][i]))
                        for i, r in enumerate(ROWS)])
    answered = np.arange(n - 1)  # task b's row stays unanswered
    votes.add('last', answered, answers[answered], [r[4] for r in ROWS[:-1]])
    right = np.stack([KIND.to_canvas(KIND.augment(np.array(PUZZLES['ab'[r[0]]]['test'][r[1]]['output'], np.uint8),
                                                  views['dihedral'][i], views['colours'][i]))
                      for i, r in enumerate(ROWS)])
    votes.add('q_halt', answered, right[answered], np.full(n - 1, 0.5))  # every answered row right
    return votes


def test_the_vote_ranks_by_count_then_confidence_and_averages_over_tasks():
    votes = hand_made_votes()
    res = votes.score()
    last = res['last']
    assert (last['tasks'], last['test_outputs'], last['answered'], last['views']) == (2, 3, 2, 4)
    # task a: input 0 right at rank 2, input 1 at rank 1 -> pass@1 1/2, pass@2 1; task b: none -> 0
    assert last['pass@1'] == pytest.approx(0.25) and last['pass@2'] == pytest.approx(0.5)
    assert last['outputs_pass@1'] == pytest.approx(1 / 3) and last['outputs_pass@2'] == pytest.approx(2 / 3)
    assert (last['pass@2_ci_low'], last['pass@2_ci_high']) == pytest.approx(wilson_interval(1.0, 2))
    assert 'pass@5' not in last  # 4 views: K capped
    ranks = score_arc(PUZZLES, votes.votes('last'))['ranks']
    assert ranks == {'a': [2, 1], 'b': [0]}
    q = res['q_halt']  # the other mode's answers, counted apart: every answered input right
    assert q['pass@1'] == pytest.approx(0.5) and q['pass@2'] == pytest.approx(0.5)
    # the first k views: k=1 holds view 0 only (input 0 right, input 1 wrong); at k=2 both inputs' right answer
    # is second (a tie of one vote each, the wrong one more confident); all 4 views as above
    curve = {row['views']: (row['pass@1'], row['pass@2']) for row in res['by_views']}
    want = {1: (0.25, 0.25), 2: (0.0, 0.5), 4: (0.25, 0.5)}
    assert sorted(curve) == sorted(want)
    for k in want:  # entry by entry: pytest 9.2's approx refuses a dict of tuples
        assert curve[k] == pytest.approx(want[k]), (k, curve[k], want[k])


def test_the_submission_holds_the_two_best_answers_of_every_test_input():
    sub = hand_made_votes().submission()
    assert list(sub) == ['a', 'b'] and [len(v) for v in sub.values()] == [2, 1]
    assert sub['a'][0] == dict(attempt_1=WRONG0.tolist(), attempt_2=RIGHT0.tolist())
    assert sub['a'][1] == dict(attempt_1=RIGHT1.tolist(), attempt_2=WRONG1.tolist())
    assert sub['b'][0] == dict(attempt_1=[[0]], attempt_2=[[0]])  # no answer
    json.dumps(sub)  # plain JSON: lists of ints


# -----------------------------------------------------------------------------
# a synthetic dataset's own labels, voted

@pytest.fixture(scope='module')
def synthetic(tmp_path_factory):
    """Synthetic ARC tasks on a 10x10 canvas: 6 trained, 4 evaluated, 3 augmentations (4 views a test input)."""
    out = tmp_path_factory.mktemp('arc') / 'syn'
    run(['prepare_arc.py', '--synthetic', '--canvas=10', '--num_tasks=6', '--num_eval_tasks=4', '--num_aug=3',
         f'--output_dir={out}'])
    return str(out)


def vote_on(root, answers, confidence, subset=0):
    """ARCVotes of the dataset at root, fed `answers` [rows of the test split] in EvalLoader's batches."""
    votes = ARCVotes.open(root, KIND)
    loader = EvalLoader(root, 3, subset=subset, kind=KIND)  # 16 rows: the last batch padded
    votes.start(loader.example_idx)
    for batch in loader:
        i = batch['example_index']
        assert ((i >= 0) == batch['valid']).all()
        for mode in ('last', 'q_halt'):
            votes.add(mode, i, answers[np.maximum(i, 0)], confidence[np.maximum(i, 0)])
    return votes


def test_the_labels_of_the_test_rows_score_one_and_scrambled_rows_lower_it_as_counted(synthetic):
    labels = np.load(os.path.join(synthetic, 'test', 'all__labels.npy'))
    inputs = np.load(os.path.join(synthetic, 'test', 'all__inputs.npy'))
    views = np.load(os.path.join(synthetic, 'test_views.npz'))
    conf = np.full(len(labels), 0.5)
    res = vote_on(synthetic, labels, conf).score()
    for mode in ('last', 'q_halt'):
        assert res[mode]['tasks'] == 4 and res[mode]['views'] == 4
        assert res[mode]['pass@1'] == 1.0 and res[mode]['pass@2'] == 1.0
    assert all(row['pass@1'] == 1.0 for row in res['by_views'])

    # wrong answers: a row's input (its task's test input, once mapped back), where that differs from the output
    puzzles = json.load(open(os.path.join(synthetic, 'test_puzzles.json')))
    differs = [t for t, name in enumerate(views['tasks']) if puzzles[name]['test'][0]['input']
               != puzzles[name]['test'][0]['output']]
    assert len(differs) >= 2
    t0, t1 = differs[:2]
    rows0, rows1 = np.flatnonzero(views['task'] == t0), np.flatnonzero(views['task'] == t1)
    answers, conf = labels.copy(), conf.copy()
    wrong0, wrong1 = rows0[views['view'][rows0] >= 1], rows1[views['view'][rows1] >= 2]
    answers[wrong0], conf[wrong0] = inputs[wrong0], 0.9  # 3 against 1
    answers[wrong1], conf[wrong1] = inputs[wrong1], 0.9  # 2 against 2, the wrong ones more confident
    res = vote_on(synthetic, answers, conf).score()
    assert res['last']['pass@1'] == 0.5 and res['last']['pass@2'] == 1.0  # 2 of 4 tasks first, all second
    curve = {row['views']: row['pass@1'] for row in res['by_views']}
    assert curve == {1: 1.0, 2: 0.75, 4: 0.5}  # view 0 right everywhere; views 0-1: t0's 1 against 1, wrong surer


def test_a_subset_of_an_arc_split_is_whole_tasks_and_only_they_are_scored(synthetic):
    views = np.load(os.path.join(synthetic, 'test_views.npz'))
    loader = EvalLoader(synthetic, 3, subset=5, seed=1, kind=KIND)
    tasks = np.unique(views['task'][loader.example_idx])
    assert len(tasks) == 2  # 4 rows a task: 5 rows need 2 of them
    assert sorted(loader.example_idx) == sorted(np.flatnonzero(np.isin(views['task'], tasks)))
    assert np.array_equal(EvalLoader(synthetic, 3, subset=5, seed=1, kind=KIND).example_idx, loader.example_idx)
    labels = np.load(os.path.join(synthetic, 'test', 'all__labels.npy'))
    votes = vote_on(synthetic, labels, np.full(len(labels), 0.5), subset=5)
    assert votes.score()['last']['tasks'] == 2 and len(votes.submission()) == 2


# -----------------------------------------------------------------------------
# a tiny training run on it

TINY_ARC = ['--hidden_size=32', '--num_heads=2', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32',
            '--puzzle_emb_len=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=3', '--global_batch_size=16',
            '--eval_batch_size=6', '--lr=2e-3', '--lr_warmup_steps=1', '--forward_dtype=float32',
            '--loss_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--max_steps=3', '--epochs=100',
            '--eval_every_epochs=1000', '--log_interval=1', '--tensorboard=False']


@pytest.fixture(scope='module')
def tiny_run(synthetic, tmp_path_factory):
    """3 steps of a tiny attention TRM on the synthetic tasks, one process: (its output, its folder)."""
    out = tmp_path_factory.mktemp('run') / 'o'
    return run(['train.py', f'--data_path={synthetic}', f'--out_dir={out}'] + TINY_ARC), out


def test_a_tiny_arc_run_reports_pass_at_k_and_submits_every_evaluation_task(synthetic, tiny_run):
    p, out = tiny_run
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith('ARC '))
    assert line.strip().startswith('ARC 4 tasks (4 test outputs, 4 views): ARC Prize score (per output) pass@1 ')
    assert "| per task (the reference's) pass@1 " in line and 'pass@2 by views (per task): 1:' in line
    assert line.count('(95% CI ') == 4
    puzzles = json.load(open(os.path.join(synthetic, 'test_puzzles.json')))
    sub = json.load(open(out / 'submission.json'))
    assert list(sub) == list(puzzles)
    for task_id, attempts in sub.items():
        assert len(attempts) == len(puzzles[task_id]['test'])
        for a in attempts:
            for grid in (a['attempt_1'], a['attempt_2']):
                g = np.array(grid)
                assert g.ndim == 2 and g.size > 0 and ((0 <= g) & (g <= 9)).all()
    results = json.load(open(out / 'results.json'))['final_eval']
    assert set(results['arc']) == {'last', 'q_halt', 'by_views'} and results['arc_tasks'] == 4
    assert 0 <= results['arc_pass@1'] <= results['arc_pass@2'] <= 1
    assert results['arc_pass@2_ci_low'] <= results['arc_pass@2'] <= results['arc_pass@2_ci_high']
    evals = [json.loads(l) for l in open(out / 'metrics.jsonl') if '"kind": "eval"' in l]
    assert evals[-1]['arc_pass@2'] == results['arc_pass@2']


def test_two_ranks_vote_as_one(synthetic, tiny_run, tmp_path):
    """torchrun, gloo: each rank's answers gathered to every rank give the one-process run's vote exactly."""
    out = tmp_path / 'o'
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--data_path={synthetic}',
         f'--out_dir={out}'] + TINY_ARC)
    one = tiny_run[1]
    assert json.load(open(out / 'submission.json')) == json.load(open(one / 'submission.json'))
    arc = [json.load(open(o / 'results.json'))['final_eval']['arc'] for o in (out, one)]
    assert arc[0] == arc[1]


def test_an_arc_dataset_without_its_test_views_is_refused_in_one_line(synthetic, tmp_path):
    data = tmp_path / 'd'
    shutil.copytree(synthetic, data)
    os.remove(data / 'test_views.npz')
    p = run(['train.py', f'--data_path={data}', f'--out_dir={tmp_path}/o'] + TINY_ARC, check=False)
    assert_user_error(p, 'test_views.npz is missing', 'prepare_arc.py')
    assert 'step 1' not in p.stdout  # refused before training


def damage_views(path, how):
    """test_views.npz as a stopped copy or a hand edit leaves it: empty, cut in half, or without its 'tasks'."""
    if how == 'no tasks':
        with np.load(path) as f:
            kept = {k: f[k] for k in f.files if k != 'tasks'}
        np.savez(path, **kept)
    else:
        data = open(path, 'rb').read()
        open(path, 'wb').write(data[:len(data) // 2] if how == 'truncated' else b'')


@pytest.mark.parametrize('how', ['empty', 'truncated', 'no tasks'])
def test_a_damaged_test_views_file_is_one_line_in_train_and_solve(synthetic, tiny_run, tmp_path, how):
    data = tmp_path / 'd'
    shutil.copytree(synthetic, data)
    views = data / 'test_views.npz'
    task = str(np.load(views)['tasks'][0])
    damage_views(views, how)
    ckpt = str(tiny_run[1] / 'ckpt_00000003.pt')
    for args in (['train.py', f'--data_path={data}', f'--out_dir={tmp_path}/o'] + TINY_ARC,
                 ['solve.py', f'--init_from={ckpt}', f'--data_path={data}', f'--task={task}', '--device=cpu'],
                 ['solve.py', f'--init_from={ckpt}', f'--data_path={data}', '--index=0', '--device=cpu']):
        p = run(args, check=False)
        said = ['rebuild the dataset with prepare_arc.py'] + ([str(views)] if how != 'no tasks' else [])
        if '--index=0' in args:  # refused on ARC anyway (no verifier): the damage is said in the same line
            said = ['--index', '--task=ID'] + (said if how != 'no tasks' else [])
        assert_user_error(p, *said, one_line=True)
        assert 'step 1' not in p.stdout


# -----------------------------------------------------------------------------
# on XLA (the CPU's): the answers' gather and read add no graph after the first batch

XLA_ARC = """
import json, sys
import torch_xla.debug.metrics as met
from arc import ARCVotes
from data import EvalLoader, load_metadata
from device import Device
from evaluate import evaluate
from model import TRM, TRMConfig
from puzzles import puzzle_for
from step import compiled_predict
dev = Device('xla')
meta = load_metadata(sys.argv[1], 'test')
kind = puzzle_for(meta)
model = TRM(TRMConfig.for_data(meta, hidden_size=16, num_heads=1, mlp_t=False, pos_encodings='rope', puzzle_emb_ndim=16,
                               puzzle_emb_len=1, H_cycles=1, L_cycles=1, halt_max_steps=2,
                               forward_dtype='float32')).to(dev.device)
compiles = lambda: (met.metric_data('CompileTime') or [0])[0]

class Counted(EvalLoader):  # notes the compilations so far as each batch is asked for
    def __iter__(self):
        for batch in super().__iter__():
            self.seen.append(compiles())
            yield batch
        self.seen.append(compiles())

out, arc = {}, ARCVotes.open(sys.argv[1], kind)
for i in range(2):
    loader = Counted(sys.argv[1], 6, kind=kind)
    loader.seen, c0 = [], compiles()
    res, _ = evaluate(model, loader, dev, 2, 2, predict=compiled_predict(model), arc=arc)
    out[i] = [b - a for a, b in zip([c0] + loader.seen, loader.seen + [compiles()])]
    out[f'score{i}'] = res['arc']['last']
out['fallbacks'] = dev.xla_report()[1]
print(json.dumps(out))
"""


def test_xla_arc_evaluation_adds_no_graphs_after_its_first_batch(synthetic):
    pytest.importorskip('torch_xla')
    p = run(['-c', XLA_ARC, synthetic], env=XLA_ENV)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r.pop('fallbacks') == {}
    first, second = r['0'], r['1']
    assert len(first) == 3 + 2  # before the first batch, 3 batches of 6 rows (the last padded), the reduction
    assert first[0] == 0 and first[1] > 0 and first[2] == first[3] == 0, r
    assert second == [0] * 5, r  # nor does the next evaluation
    assert r['score0'] == r['score1'] and r['score0']['tasks'] == 4 and r['score0']['views'] == 4


def test_the_checkpoint_evaluated_on_xla_votes_as_on_the_cpu(synthetic, tiny_run, tmp_path):
    """The tiny run's last checkpoint re-evaluated with --eval_only on CPU-XLA: the same pass@K and submission."""
    pytest.importorskip('torch_xla')
    one = tiny_run[1]
    out = tmp_path / 'x'
    args = [a for a in TINY_ARC if a != '--device=cpu'] + ['--device=xla']
    run(['train.py', f'--data_path={synthetic}', f'--out_dir={out}', f'--init_from={one}/ckpt_00000003.pt',
         '--eval_only=True'] + args, env=XLA_ENV)
    record = json.load(open(out / 'evals' / 'views1-steps3.json'))['eval']['arc']
    assert record == json.load(open(one / 'results.json'))['final_eval']['arc']
    assert (json.load(open(out / 'evals' / 'views1-steps3.submission.json'))
            == json.load(open(one / 'submission.json')))


def test_an_arc_checkpoint_on_a_sudoku_dataset_is_refused_in_one_line(tiny_run, sudoku4, tmp_path):
    for script in (['train.py', f'--data_path={sudoku4}', f'--out_dir={tmp_path}/o', '--eval_only=True'],
                   ['solve.py', f'--data_path={sudoku4}', '--count=2']):
        p = run(script + [f'--init_from={tiny_run[1]}/ckpt_00000003.pt'], check=False)
        assert_user_error(p, str(sudoku4))
