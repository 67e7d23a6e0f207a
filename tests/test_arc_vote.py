"""
What decides an ARC number, and what a run leaves of it: a submission belongs to the last checkpoint's step or is
absent (in a bucket too); test_views.npz that does not match the test split is refused at start; ties go to a
grid before an empty crop (which otherwise ranks by its votes, as in the reference), then to the lowest view (the
confidence in float64, the order the same whatever the batches); the ARC Prize's score (per test output) beside
the reference's (per task); test inputs without a known solution are submitted but not scored; the vote pooled over
a run's evaluations, carried by its checkpoints so a resume continues it exactly. Tiny runs on synthetic tasks, a
minute or two in all.
    OMP_NUM_THREADS=1 python -m pytest -q -x tests/test_arc_vote.py
"""
import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch

from runkeep import gcs
from conftest import BUCKET, ROOT, assert_user_error, ckpts, finish, read_until, run, start
from arc import ARCVotes, rank_answers
from device import Device
from evaluate import format_eval
from puzzles import ARC

KIND = ARC(10)
ARGS = ['--hidden_size=32', '--num_heads=2', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32',
        '--puzzle_emb_len=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=3', '--global_batch_size=16',
        '--eval_batch_size=6', '--lr=2e-3', '--lr_warmup_steps=1', '--forward_dtype=float32',
        '--loss_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--log_interval=1', '--tensorboard=False']
ONCE = ARGS + ['--eval_every_epochs=1000']  # the synthetic set: 2.25 steps an epoch; one evaluation, at the end


@pytest.fixture(scope='module')
def synthetic(tmp_path_factory):
    """Synthetic ARC tasks on a 10x10 canvas: 6 trained, 4 evaluated, 3 augmentations (4 views a test input)."""
    out = tmp_path_factory.mktemp('arc') / 'syn'
    run(['prepare_arc.py', '--synthetic', '--canvas=10', '--num_tasks=6', '--num_eval_tasks=4', '--num_aug=3',
         f'--output_dir={out}'])
    return str(out)


def train(data, out, *extra, args=ONCE, **kw):
    return run(['train.py', f'--data_path={data}', f'--out_dir={out}'] + args + list(extra), **kw)


def arc_lines(stdout):
    return [l.strip() for l in stdout.splitlines() if l.strip().startswith('ARC ')]


# -----------------------------------------------------------------------------
# a submission belongs to the last checkpoint's step, or is absent

def trained_on_and_stopped(data, out, *extra):
    """A finished run (2 steps, its submission written) resumed with more epochs and stopped by SIGTERM."""
    proc = start(data, out, '--epochs=1000', '--init_from=resume', *extra, args=ONCE)
    read_until(proc, 'step 4/')
    proc.send_signal(signal.SIGTERM)
    text = finish(proc, 120)
    assert proc.returncode == 0 and 'stopped cleanly' in text, text[-3000:]
    return text


def test_a_finished_run_trained_on_and_stopped_keeps_no_earlier_submission(synthetic, tmp_path):
    out = tmp_path / 'o'
    train(synthetic, out, '--epochs=1')
    assert json.load(open(out / 'results.json'))['step'] == 2 and os.path.exists(out / 'submission.json')
    text = trained_on_and_stopped(synthetic, out)
    assert 'stopped cleanly, without a submission.json (the final evaluation writes it)' in text, text[-3000:]
    assert ckpts(out)[-1] > 'ckpt_00000004.pt'
    assert not os.path.exists(out / 'results.json') and not os.path.exists(out / 'submission.json')


def test_the_same_through_the_bucket(synthetic, emu, tmp_path):
    out, local = f'gs://{BUCKET}/vote/stale', tmp_path / 'local'
    client = gcs.GCS(endpoint=emu)
    names = lambda: sorted(uri.rsplit('/', 1)[1] for uri, _ in client.list(out + '/'))
    train(synthetic, out, '--epochs=1', f'--local_dir={local}')
    assert {'results.json', 'submission.json'} <= set(names())
    shutil.rmtree(local)  # a new machine: the bucket is all there is
    trained_on_and_stopped(synthetic, out, f'--local_dir={local}')
    assert 'results.json' not in names() and 'submission.json' not in names(), names()
    assert not os.path.exists(local / 'submission.json')


def test_results_json_and_an_eval_only_record_name_their_submission_s_step(synthetic, tmp_path):
    out = tmp_path / 'o'
    train(synthetic, out, '--epochs=1')
    res = json.load(open(out / 'results.json'))
    assert res['arc_submission'] == dict(file='submission.json', step=2, vote='this checkpoint')
    train(synthetic, out, '--epochs=1', '--init_from=resume', '--eval_only=True')
    rec = json.load(open(out / 'evals' / 'views1-steps3.json'))
    assert rec['submission'] == dict(file='evals/views1-steps3.submission.json', step=2, vote='this checkpoint')
    assert os.path.exists(out / 'evals' / 'views1-steps3.submission.json')


def test_an_overwrite_rerun_without_arc_answers_keeps_none_of_the_old_run_s_answers(synthetic, tmp_path):
    from runkeep.adapt import kept_answers
    out = tmp_path / 'o'
    train(synthetic, out, '--epochs=1', '--arc_answers=True')
    assert kept_answers(str(out), 3) is not None
    # another run to the same step: the old answers would pass as its own (kept_answers checks the step only)
    train(synthetic, out, '--epochs=1', '--overwrite=True', '--seed=7')
    assert json.load(open(out / 'results.json'))['step'] == 2
    assert not os.path.exists(out / 'answers.npz') and kept_answers(str(out), 3) is None


# -----------------------------------------------------------------------------
# test_views.npz must be the test split's

@pytest.mark.parametrize('change', [-3, 3])
def test_test_views_with_other_rows_than_the_split_are_refused_at_start(synthetic, tmp_path, change):
    data = tmp_path / 'd'
    shutil.copytree(synthetic, data)
    views = dict(np.load(data / 'test_views.npz'))
    n = len(views['task'])
    keep = np.arange(n + change) % n  # fewer rows (a build killed between its renames), or more (another's)
    np.savez(data / 'test_views.npz', tasks=views['tasks'], **{k: v[keep] for k, v in views.items() if k != 'tasks'})
    p = train(data, tmp_path / 'o', '--max_steps=3', '--epochs=100', check=False)
    assert_user_error(p, f"{data / 'test_views.npz'} holds {n + change} rows", f"{data / 'test'} holds {n}",
                      'prepare_arc.py')
    assert 'step 1' not in p.stdout
    assert len([l for l in (p.stdout + p.stderr).splitlines() if 'test_views.npz' in l]) == 1


def test_test_views_of_other_tasks_than_the_split_s_are_refused_at_start(synthetic, tmp_path):
    data = tmp_path / 'd'
    shutil.copytree(synthetic, data)
    views = dict(np.load(data / 'test_views.npz'))
    views['task'] = views['task'][::-1].copy()  # the same rows, in another build's order of tasks
    np.savez(data / 'test_views.npz', **views)
    p = train(data, tmp_path / 'o', '--max_steps=3', '--epochs=100', check=False)
    assert_user_error(p, str(data / 'test_views.npz'), 'prepare_arc.py')
    assert 'step 1' not in p.stdout


# -----------------------------------------------------------------------------
# ties: a grid before an empty crop, then the lowest view; sigmoid(q_halt) in float64; else votes, as the reference

RIGHT = np.array([[1, 2], [3, 4], [5, 6]], np.uint8)  # 3 rows: its bytes sort after a grid of fewer rows
WRONG = np.array([[9, 9]], np.uint8)
EMPTY = None  # an answer that crops to nothing (a canvas without a colour at its top-left)
# per test input of task 'a': its views' (view number, answer, q_halt logit); every logit a bfloat16 value
CASES = [
    [(0, WRONG, 17.0), (1, RIGHT, 20.0)],  # float32 rounds both sigmoids to 1.0; in float64 RIGHT is surer
    [(0, RIGHT, 2.0), (1, WRONG, 2.0)],  # a tie: view 0 first
    [(0, EMPTY, 2.0), (1, RIGHT, 2.0)],  # a tie: the grid before the empty crop, though that is view 0's
    # 3 votes each, the same confidences: a tie that a float sum would break by the order it added them in
    [(1, RIGHT, -4.0), (2, RIGHT, -3.75), (3, RIGHT, -2.75), (4, WRONG, -2.75), (5, WRONG, -3.75),
     (6, WRONG, -4.0)],
]
TIED = {'a': dict(train=[], test=[dict(input=[[0]], output=RIGHT.tolist()) for _ in CASES])}


def tied_votes(order, batch):
    """ARCVotes over CASES, each answer drawn in its row's augmentation on the canvas, read as evaluate() reads
    a batch (bfloat16 logits), the rows in `order`, `batch` rows at a time."""
    rows = [(i, v, a, q) for i, case in enumerate(CASES) for v, a, q in case]
    rng = np.random.default_rng(0)
    n = len(rows)
    views = dict(tasks=np.array(['a']), task=np.zeros(n, np.int32), test_index=np.array([r[0] for r in rows]),
                 view=np.array([r[1] for r in rows]), dihedral=rng.integers(0, 8, n).astype(np.uint8),
                 colours=np.stack([np.concatenate([[0], rng.permutation(9) + 1]) for _ in range(n)]).astype(np.uint8))
    canvas = np.stack([np.zeros(100, np.uint8) if a is None else
                       KIND.to_canvas(KIND.augment(a, views['dihedral'][j], views['colours'][j]))
                       for j, (_, _, a, _) in enumerate(rows)])
    logits = torch.tensor([r[3] for r in rows], dtype=torch.bfloat16)
    assert torch.equal(logits.float(), torch.tensor([r[3] for r in rows]))  # bfloat16 values, as a bf16 forward
    votes, dev = ARCVotes(KIND, views, TIED), Device('cpu')
    votes.start()
    order = np.array(order)  # a copy: torch takes no negative strides
    for b0 in range(0, n, batch):
        idx = order[b0:b0 + batch]
        preds = torch.from_numpy(canvas[idx]).long()[None]  # one supervision step
        q = logits[idx][None]
        flat = torch.zeros(1)
        votes.read(dev, preds, q, torch.zeros(len(idx), dtype=torch.long), idx, flat)
    return votes


def test_ties_go_to_the_lowest_view_and_to_a_grid_before_an_empty_crop_in_any_batch_order():
    n = sum(map(len, CASES))
    orders = [(np.arange(n), n), (np.arange(n)[::-1], 3), (np.random.default_rng(1).permutation(n), 5)]
    results = []
    for order, batch in orders:
        votes = tied_votes(order, batch)
        res = votes.score()['last']
        assert res['pass@1'] == 1.0 and res['outputs_pass@1'] == 1.0, res
        sub = votes.submission()
        assert [a['attempt_1'] for a in sub['a']] == [RIGHT.tolist()] * len(CASES)
        assert [a['attempt_2'] for a in sub['a']] == [WRONG.tolist(), WRONG.tolist(), [[0]], WRONG.tolist()]
        results.append((res, sub, votes.votes('last')))
    assert all(r == results[0] for r in results[1:])  # confidences summed exactly: the same in any order


def test_an_empty_crop_with_more_votes_leads_as_in_the_reference():
    """Only a tie puts an empty crop after a grid: with more votes it ranks first, as the reference's evaluator
    ranks every answer by (votes, mean confidence), so pass@1 misses and attempt 1 is the empty answer ([[0]])."""
    rows = [(0, RIGHT, 0.9), (1, EMPTY, 0.2), (2, EMPTY, 0.2), (3, WRONG, 0.5)]
    n = len(rows)
    views = dict(tasks=np.array(['a']), task=np.zeros(n, np.int32), test_index=np.zeros(n, np.int32),
                 view=np.arange(n), dihedral=np.zeros(n, np.uint8), colours=np.tile(np.arange(10, dtype=np.uint8),
                                                                                    (n, 1)))
    votes = ARCVotes(KIND, views, {'a': dict(train=[], test=[dict(input=[[0]], output=RIGHT.tolist())])})
    votes.start()
    canvas = np.stack([np.zeros(100, np.uint8) if a is None else KIND.to_canvas(a) for _, a, _ in rows])
    votes.add('last', np.arange(n), canvas, np.array([q for *_, q in rows]))
    tally = votes.votes('last')[('a', 0)]
    reference = [a for a, _ in sorted(tally.items(), key=lambda kv: [kv[1][0], kv[1][1] / kv[1][0]], reverse=True)]
    assert rank_answers(tally) == reference and reference[0] == bytes((0, 0))
    res = votes.score()['last']
    assert (res['pass@1'], res['pass@2']) == (0.0, 1.0), res
    assert votes.submission()['a'] == [dict(attempt_1=[[0]], attempt_2=RIGHT.tolist())]


def test_small_confidences_rank_as_the_reference_ranks_them_and_the_pool_keeps_them():
    """Answers of equal votes rank by mean sigmoid(q_halt), however small: the reference sums float64 confidences,
    whose relative precision holds at any size, so a q_halt logit of -30 outranks -40, and -30 the float32 just
    below it, where a fixed step of 2^-53 made both of each pair the same (0 below a logit of about -37): a tie,
    which the lowest view (the wrong answer here) won. A checkpoint's pool keeps them apart too."""
    below = float(np.nextafter(np.float32(-30.0), np.float32(-31.0)))
    rows = [(0, 0, WRONG, -40.0), (0, 1, RIGHT, -30.0), (1, 0, WRONG, below), (1, 1, RIGHT, -30.0)]
    n = len(rows)
    views = dict(tasks=np.array(['a']), task=np.zeros(n, np.int32), test_index=np.array([r[0] for r in rows]),
                 view=np.array([r[1] for r in rows]), dihedral=np.zeros(n, np.uint8),
                 colours=np.tile(np.arange(10, dtype=np.uint8), (n, 1)))
    puzzles = {'a': dict(train=[], test=[dict(input=[[0]], output=RIGHT.tolist())] * 2)}
    votes = ARCVotes(KIND, views, puzzles, pooling=True)
    votes.start()
    logits = torch.tensor([r[3] for r in rows])
    votes.read(Device('cpu'), torch.from_numpy(np.stack([KIND.to_canvas(r[2]) for r in rows])).long()[None],
               logits[None], torch.zeros(n, dtype=torch.long), np.arange(n), torch.zeros(1))
    res = votes.results(pool_at=1)
    assert res['arc_pass@1'] == 1.0 and res['arc_pooled_pass@1'] == 1.0, res
    resumed = ARCVotes(KIND, views, puzzles, pooling=True)
    resumed.restore(votes.pool_state()['arc_pool'])
    assert resumed.votes('pooled') == votes.votes('pooled')
    assert resumed.score(pooled=True)['pooled']['pass@1'] == 1.0
    # a checkpoint of an earlier trainer: the sums in units of 2^-53, in two int64 halves, read in that unit
    state = {k: v for k, v in votes.pool_state()['arc_pool'].items() if not k.startswith('confidence')}
    sums = [round(e[1] / 2 ** 64) for per in votes.pool.values() for e in per.values()]
    state.update(high=torch.tensor([t >> 32 for t in sums]), low=torch.tensor([t & 0xFFFFFFFF for t in sums]))
    earlier = ARCVotes(KIND, views, puzzles, pooling=True)
    earlier.restore(state)
    got = [e for per in earlier.votes('pooled').values() for e in per.values()]
    assert [c for c, _ in got] == [1] * 4 and [s for _, s in got] == [t / 2 ** 53 for t in sums]


# -----------------------------------------------------------------------------
# the ARC Prize's score (per test output) beside the reference's (per task); test inputs without a solution

R0, W0 = np.array([[1, 2, 3], [4, 5, 6]], np.uint8), np.array([[1, 2, 3]], np.uint8)
R1, W1 = np.array([[7, 0], [0, 7]], np.uint8), np.array([[0, 7], [7, 0]], np.uint8)
# task a: 2 test inputs, input 0 right at rank 2, input 1 at rank 1; task b: 1 test input, never answered
PUZZLES = {'a': dict(train=[], test=[dict(input=[[0]], output=R0.tolist()), dict(input=[[0]], output=R1.tolist())]),
           'b': dict(train=[], test=[dict(input=[[0]], output=[[5]])])}
ROWS = [(0, 0, 0, R0, 0.3), (0, 0, 1, W0, 0.6), (0, 0, 2, W0, 0.5), (0, 0, 3, W0, 0.1),
        (0, 1, 0, W1, 0.95), (0, 1, 1, R1, 0.9), (0, 1, 2, W1, 0.1), (0, 1, 3, R1, 0.7)]


def hand_made(puzzles):
    n = len(ROWS)
    views = dict(tasks=np.array(['a', 'b']), task=np.array([r[0] for r in ROWS]),
                 test_index=np.array([r[1] for r in ROWS]), view=np.array([r[2] for r in ROWS]),
                 dihedral=np.zeros(n, np.uint8), colours=np.tile(np.arange(10, dtype=np.uint8), (n, 1)))
    votes = ARCVotes(KIND, views, puzzles)
    votes.start()
    answers = np.stack([KIND.to_canvas(r[3]) for r in ROWS])
    conf = np.array([r[4] for r in ROWS])
    for mode in ('last', 'q_halt'):
        votes.add(mode, np.arange(n), answers, conf)
    return votes


def eval_res(votes):
    """What evaluate() returns around ARC's entries, for format_eval."""
    return dict(count=8.0, exact_accuracy=0.5, exact_ci_low=0.2, exact_ci_high=0.8, token_accuracy=0.9,
                q_halt_accuracy=0.7, steps=3.0, exact_accuracy_q_halt=0.5, steps_q_halt=2.0,
                exact_by_steps=[0.1, 0.3, 0.5], **votes.results())


def test_both_scores_are_reported_each_named():
    res = eval_res(hand_made(PUZZLES))
    # per task: a scores 1/2 at pass@1 and 1 at pass@2, b 0; per output: 1 of 3 at pass@1, 2 of 3 at pass@2
    assert res['arc_pass@1'] == pytest.approx(0.25) and res['arc_pass@2'] == pytest.approx(0.5)
    assert res['arc_prize_pass@1'] == pytest.approx(1 / 3) and res['arc_prize_pass@2'] == pytest.approx(2 / 3)
    assert res['arc_prize_pass@2_ci_low'] < 2 / 3 < res['arc_prize_pass@2_ci_high']
    assert res['arc_test_outputs'] == 3 and res['arc_unscored'] == 0
    line = arc_lines(format_eval(res))[0]
    assert line.startswith('ARC 2 tasks (3 test outputs, 4 views): ARC Prize score (per output) pass@1 0.3333 '
                           '(95% CI '), line
    assert 'pass@2 0.6667 (95% CI ' in line and '| per task (the reference\'s) pass@1 0.2500 (95% CI ' in line
    assert 'pass@2 0.5000 (95% CI ' in line


def test_test_inputs_without_a_solution_are_submitted_and_not_scored():
    some = json.loads(json.dumps(PUZZLES))
    del some['a']['test'][1]['output']  # its entry has no output: a hidden test set's
    votes = hand_made(some)
    res = eval_res(votes)
    # scored: a's input 0 (right at rank 2) and b's input (no answer): per task 0 and 0 at pass@1, 1 and 0 at 2
    assert res['arc_unscored'] == 1 and res['arc_test_outputs'] == 3
    assert res['arc_pass@1'] == 0 and res['arc_pass@2'] == pytest.approx(0.5)
    assert res['arc_prize_pass@2'] == pytest.approx(0.5)
    line = arc_lines(format_eval(res))[0]
    assert line.startswith('ARC 2 tasks (3 test outputs, 1 without a known solution: not scored; 4 views): ARC '
                           'Prize score (per output) pass@1 0.0000'), line
    sub = votes.submission()
    assert sub['a'][1] == dict(attempt_1=R1.tolist(), attempt_2=W1.tolist())  # the unscored input submitted too

    none = json.loads(json.dumps(PUZZLES))
    for t in none.values():
        for pair in t['test']:
            del pair['output']
    votes = hand_made(none)
    res = eval_res(votes)
    assert res['arc_unscored'] == 3 and all(res[k] is None for k in res if k.startswith(('arc_pass', 'arc_prize')))
    line = arc_lines(format_eval(res))[0]
    assert 'none with a known solution: no pass@K' in line and 'pass@1 ' not in line, line
    assert [len(v) for v in votes.submission().values()] == [2, 1]


def test_a_damaged_test_puzzles_json_fails_at_start_not_at_the_final_evaluation_s_scoring(synthetic, tmp_path):
    """A solution that is no grid (a hand edit, a damaged copy) in a task the first rows do not check: the run
    trained to its end, then died in the scoring's ValueError before its final checkpoint was saved."""
    data = tmp_path / 'd'
    shutil.copytree(synthetic, data)
    puzzles = json.load(open(data / 'test_puzzles.json'))
    last = list(puzzles)[-1]
    puzzles[last]['test'][0]['output'] = [[1, 2], [3]]
    json.dump(puzzles, open(data / 'test_puzzles.json', 'w'))
    p = train(data, tmp_path / 'o', '--epochs=1', check=False)
    assert_user_error(p, f"{data / 'test_puzzles.json'}: task {last}: test pair 1 output: row 2 has 1 cells, row 1 2: "
                         "not a rectangle", 'rebuild the dataset with prepare_arc.py')
    assert 'step 1/' not in p.stdout


def test_a_run_on_a_test_split_without_solutions_submits_every_task_and_claims_no_score(synthetic, tmp_path):
    data = tmp_path / 'd'
    shutil.copytree(synthetic, data)
    puzzles = json.load(open(data / 'test_puzzles.json'))
    for task in puzzles.values():
        for pair in task['test']:
            del pair['output']
    json.dump(puzzles, open(data / 'test_puzzles.json', 'w'))
    np.save(data / 'test' / 'all__labels.npy', np.zeros_like(np.load(data / 'test' / 'all__labels.npy')))
    out = tmp_path / 'o'
    p = train(data, out, '--epochs=1')
    line = arc_lines(p.stdout)[0]
    assert line.startswith('ARC 4 tasks (4 test outputs, none with a known solution: no pass@K'), line
    line = next(l for l in p.stdout.splitlines() if l.startswith('eval on'))  # no accuracy of no rows
    assert line.startswith('eval on 0 rows with a known answer: no exact') and 'CI' not in line, line
    sub = json.load(open(out / 'submission.json'))
    assert list(sub) == list(puzzles) and all(len(v) == len(puzzles[t]['test']) for t, v in sub.items())
    final = json.load(open(out / 'results.json'))['final_eval']
    assert final['arc_pass@2'] is None and final['arc_prize_pass@2'] is None and final['arc_unscored'] == 4
    # its cost is that of the same rows with solutions: every view of every test input ran
    train(synthetic, tmp_path / 'known', '--epochs=1')
    known = json.load(open(tmp_path / 'known' / 'results.json'))['final_eval']
    assert final['eval_flops'] == known['eval_flops'] > 0, (final['eval_flops'], known['eval_flops'])


def test_the_study_report_shows_both_scores(tmp_path):
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'arc_rec_L2.py'), cfg)
    out = tmp_path / 'out' / 'arc_rec_L2'
    out.mkdir(parents=True)
    fe = dict(exact_accuracy=0.05, exact_ci_low=0.04, exact_ci_high=0.06, token_accuracy=0.9, q_halt_accuracy=0.8,
              **{'arc_pass@1': 0.3, 'arc_pass@2': 0.4, 'arc_pass@2_ci_low': 0.35, 'arc_pass@2_ci_high': 0.45,
                 'arc_prize_pass@1': 0.31, 'arc_prize_pass@2': 0.42, 'arc_prize_pass@2_ci_low': 0.37,
                 'arc_prize_pass@2_ci_high': 0.47, 'arc_tasks': 400, 'arc_test_outputs': 419, 'arc_unscored': 0})
    json.dump(dict(final_eval=fe, parameters=6829058, train_flops=9.5e19, flops_per_example_step=2.39e11,
                   step=518226), open(out / 'results.json', 'w'))
    run(['study.py', '--pattern=arc_*', f'--config_dir={cfg}', f'--out_root={tmp_path}/out', '--report=True'],
        env={'OMP_NUM_THREADS': '1'})
    md = open(tmp_path / 'out' / 'report.md').read()
    assert 'ARC Prize score pass@2 % (per output, 95% CI)' in md and '42.0 (37.0-47.0)' in md
    assert "ARC pass@2 % (95% CI), per task (the reference's)" in md and '40.0 (35.0-45.0)' in md
    head = open(tmp_path / 'out' / 'report.csv').readline()
    assert 'arc_prize_pass2' in head and 'arc_pass2' in head and 'arc_unscored' in head


# -----------------------------------------------------------------------------
# the vote pooled over a run's evaluations (the reference's way)

def test_the_pool_adds_each_evaluation_once():
    votes = hand_made(PUZZLES)
    votes.pooling = True
    first = votes.results(pool_at=2)
    assert first['arc_pooled_pass@2'] == first['arc_pass@2'] and first['arc']['pooled_steps'] == [2]
    again = votes.results(pool_at=2)  # the same step evaluated again (a resume at the end): not counted twice
    assert again['arc']['pooled'] == first['arc']['pooled']
    votes.start()
    n = len(ROWS)  # the next checkpoint answers W0 and W1 everywhere
    wrong = np.stack([KIND.to_canvas(W0 if r[1] == 0 else W1) for r in ROWS])
    for mode in ('last', 'q_halt'):
        votes.add(mode, np.arange(n), wrong, np.full(n, 0.5))
    res = votes.results(pool_at=4)
    assert res['arc_pass@2'] == 0 and res['arc']['pooled_steps'] == [2, 4] and res['arc']['pooled']['views'] == 8
    # pooled, input 0: W0 7 votes, R0 1 -> rank 2; input 1: W1 6, R1 2 -> rank 2; b nothing
    assert res['arc_pooled_pass@1'] == 0 and res['arc_pooled_pass@2'] == pytest.approx(0.5)
    assert res['arc_pooled_prize_pass@2'] == pytest.approx(2 / 3)
    line = arc_lines(format_eval(dict(eval_res(votes), **res)))
    assert line[1].startswith('ARC pooled over 2 evaluations (steps 2, 4; 3 test outputs, 8 views): ARC Prize '
                              'score (per output) pass@1 0.0000'), line


POOL = ARGS + ['--arc_pool_votes=True', '--eval_every_epochs=1', '--epochs=100']  # evaluations every 2 steps


def test_the_pooled_vote_is_reported_beside_the_checkpoint_s_and_a_resume_continues_it_exactly(synthetic,
                                                                                               tmp_path):
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    p = train(synthetic, straight, '--max_steps=6', '--tensorboard=True', args=POOL)
    train(synthetic, split, '--max_steps=4', args=POOL)
    q = train(synthetic, split, '--max_steps=6', '--init_from=resume', args=POOL)
    a, b = (json.load(open(o / 'results.json')) for o in (straight, split))
    assert a['final_eval']['arc']['pooled_steps'] == [2, 4, 6] and a['final_eval']['arc']['pooled']['views'] == 12
    assert a['final_eval']['arc'] == b['final_eval']['arc']
    assert a['arc_submission'] == b['arc_submission'] == dict(file='submission.json', step=6,
                                                              vote='pooled over the evaluations at steps 2, 4, 6')
    assert json.load(open(straight / 'submission.json')) == json.load(open(split / 'submission.json'))
    pooled = [l for l in arc_lines(p.stdout) if l.startswith('ARC pooled')]
    assert [l.split(';')[0] for l in pooled] == ['ARC pooled over 1 evaluation (step 2', 'ARC pooled over 2 '
                                                 'evaluations (steps 2, 4', 'ARC pooled over 3 evaluations (steps 2, 4, 6']
    assert pooled[-1] == [l for l in arc_lines(q.stdout) if l.startswith('ARC pooled')][-1]
    evals = [json.loads(l) for l in open(straight / 'metrics.jsonl') if '"kind": "eval"' in l]
    assert [e['step'] for e in evals] == [2, 4, 6] and evals[-1]['arc_pooled_pass@2'] == a['final_eval'][
        'arc_pooled_pass@2']
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(straight / 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    for tag in ('eval/arc_pooled_pass@2', 'eval/arc_pooled_prize_pass@2', 'eval/arc_prize_pass@2', 'eval/arc_pass@2'):
        assert [e.step for e in acc.Scalars(tag)] == [2, 4, 6], tag
    pools = [torch.load(o / 'ckpt_00000006.pt', weights_only=True)['arc_pool'] for o in (straight, split)]
    assert pools[0]['steps'] == [2, 4, 6] and pools[0]['count'].sum() == 3 * 16  # every test row, thrice
    assert pools[0].keys() == pools[1].keys()
    for k, v in pools[0].items():
        assert torch.equal(v, pools[1][k]) if isinstance(v, torch.Tensor) else v == pools[1][k], k


def test_a_stop_during_a_pooled_evaluation_is_redone_by_the_resume_and_the_pool_is_whole(synthetic, tmp_path):
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(synthetic, straight, '--max_steps=6', args=POOL)
    train(synthetic, split, '--max_steps=2', args=POOL)
    # the evaluation at step 4 made long (one row a batch, 3000 supervision steps): SIGTERM once it has begun
    proc = start(synthetic, split, '--max_steps=6', '--init_from=resume', '--eval_batch_size=1',
                 '--eval_steps=3000', args=POOL)
    read_until(proc, 'step 4/6')
    proc.send_signal(signal.SIGTERM)
    text = finish(proc, 120)
    assert proc.returncode == 0 and 'stopped cleanly' in text and 'eval on' not in text, text[-3000:]
    assert torch.load(split / 'ckpt_00000004.pt', weights_only=True)['arc_pool']['steps'] == [2]
    # the resume evaluates step 4 first, then trains on: the pool holds every evaluation, as the straight run's
    p = train(synthetic, split, '--max_steps=6', '--init_from=resume', args=POOL)
    assert 'evaluating it before training on' in p.stdout and 'missing' not in p.stdout, p.stdout[-3000:]
    a, b = (json.load(open(o / 'results.json')) for o in (straight, split))
    assert b['final_eval']['arc']['pooled_steps'] == [2, 4, 6], b['final_eval']['arc']['pooled_steps']
    assert a['final_eval']['arc'] == b['final_eval']['arc'] and a['arc_submission'] == b['arc_submission']
    assert json.load(open(straight / 'submission.json')) == json.load(open(split / 'submission.json'))
    evals = [json.loads(l)['step'] for l in open(split / 'metrics.jsonl') if '"kind": "eval"' in l]
    assert evals == [2, 4, 6], evals


def test_a_pool_that_lacks_an_evaluation_says_so_in_one_line(synthetic, tmp_path):
    out = tmp_path / 'o'
    train(synthetic, out, '--max_steps=2', args=POOL + ['--arc_pool_votes=False'])  # evaluated at 2, not pooled
    p = train(synthetic, out, '--max_steps=4', '--init_from=resume', args=POOL)
    said = [l for l in p.stdout.splitlines() if 'ARC pooled vote' in l and 'misses' in l]
    assert len(said) == 1 and 'step 2' in said[0], p.stdout[-3000:]
    res = json.load(open(out / 'results.json'))
    assert res['final_eval']['arc']['pooled_steps'] == [4] and res['final_eval']['arc']['pooled_missing'] == [2]
    assert res['arc_submission']['vote'] == 'pooled over the evaluations at steps 4 (missing: step 2)'
