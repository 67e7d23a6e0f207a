"""
solve.py --task=ID on an ARC dataset: a tiny synthetic ARC set, 3 steps of a tiny attention TRM, then one
evaluation task solved in all its stored views and voted (the vote table, the two attempts, --png); and the
refusals (a training task, a task never trained, an unknown ID, --views > 1), each in one line. Seconds.
"""
import json
import os

import numpy as np
import pytest

from conftest import assert_user_error, run

TINY_ARC = ['--hidden_size=32', '--num_heads=2', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32',
            '--puzzle_emb_len=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=3', '--global_batch_size=16',
            '--eval_batch_size=6', '--lr=2e-3', '--lr_warmup_steps=1', '--forward_dtype=float32',
            '--loss_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--max_steps=3', '--epochs=100',
            '--eval_interval=1000', '--log_interval=1', '--tensorboard=False']
ENV = {'OMP_NUM_THREADS': '1'}


@pytest.fixture(scope='module')
def arc_run(tmp_path_factory):
    """Synthetic ARC tasks on a 10x10 canvas (6 trained, 4 evaluated, 3 augmentations: 4 views a test input)
    and a 3-step tiny run on them: (dataset root, checkpoint)."""
    root = tmp_path_factory.mktemp('arcsolve')
    data, out = root / 'syn', root / 'o'
    run(['prepare_arc.py', '--synthetic', '--canvas=10', '--num_tasks=6', '--num_eval_tasks=4', '--num_aug=3',
         f'--output_dir={data}'], env=ENV)
    run(['train.py', f'--data_path={data}', f'--out_dir={out}'] + TINY_ARC, env=ENV)
    return str(data), str(out / 'ckpt_00000003.pt')


def solve(ckpt, *args, check=True):
    return run(['solve.py', f'--init_from={ckpt}', '--device=cpu', '--threads=1'] + list(args), env=ENV,
               check=check)


def test_one_evaluation_task_is_solved_in_all_its_views_and_voted(arc_run, tmp_path):
    data, ckpt = arc_run
    puzzles = json.load(open(os.path.join(data, 'test_puzzles.json')))
    views = np.load(os.path.join(data, 'test_views.npz'))
    task = str(views['tasks'][0])
    n_views = int((views['task'] == 0).sum())
    assert n_views == 4
    png = tmp_path / 'task.png'
    p = solve(ckpt, f'--task={task}', f'--png={png}')
    out = p.stdout
    t = puzzles[task]
    # the demonstrations, as digits
    for k, pair in enumerate(t['train']):
        assert f"demonstration {k + 1}: " in out
        first_row = ''.join(map(str, pair['input'][0]))
        assert first_row in out
    assert f"{n_views} stored views" in out
    # the vote table: its votes add up to the task's views
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split()[:3] == ['rank', 'answer', 'votes'])
    votes = 0
    for l in lines[head + 1:]:
        parts = l.split()
        if not parts or not parts[0].isdigit():
            break
        votes += int(parts[2])
        assert parts[4] in ('yes', 'no')  # the solution is known
    assert votes == n_views
    assert 'attempt 1 (' in out and 'attempt 2' in out and 'solution' in out
    assert f"task {task}: " in lines[-2] + lines[-1] and 'test inputs solved in two attempts' in out
    assert png.exists() and png.stat().st_size > 1000
    assert f"wrote {png}" in out


# solve.py with its model replaced by an oracle: each view answers its own row's label (so every view, mapped back,
# gives the solution), except views 2, 5, 8, ... of a batch, which answer the batch's first row's label as drawn
# (a wrong answer once mapped back through their own augmentation)
ORACLE = '''
import os, runpy, sys
import numpy as np
sys.path.insert(0, os.getcwd())
root, sys.argv = sys.argv[1], ['solve.py'] + sys.argv[2:]
g = runpy.run_path('solve.py', run_name='solve')
from data import load_arrays
a = load_arrays(root, 'test')
inputs, labels = np.asarray(a['inputs']).astype(np.int32), np.asarray(a['labels']).astype(np.int32)

def oracle(model, dev, x, ids, n_steps, every_step):
    rows = [int(np.flatnonzero((inputs == r).all(1))[0]) for r in np.asarray(x)]
    preds, q = labels[rows].copy(), np.full(len(rows), 2.2)
    for j in range(2, len(rows), 3):
        preds[j], q[j] = preds[0], 0.4
    return preds[None], q[None], np.zeros(1)

g['main'].__globals__['reason'] = oracle
g['main']()
'''


def test_each_view_is_mapped_back_to_the_task_before_the_vote(arc_run):
    data, ckpt = arc_run
    views = np.load(os.path.join(data, 'test_views.npz'))
    for t, task in enumerate(views['tasks']):
        n = int((views['task'] == t).sum())
        p = run(['-c', ORACLE, data, f'--init_from={ckpt}', f'--task={task}', '--device=cpu', '--threads=1'],
                env=ENV)
        lines = p.stdout.splitlines()
        head = next(i for i, l in enumerate(lines) if l.split()[:3] == ['rank', 'answer', 'votes'])
        first = lines[head + 1].split()
        # the views that answered their own label all give the solution: the vote's first answer, right
        assert first[0] == '1' and int(first[2]) == n - len(range(2, n, 3)) and first[4] == 'yes', p.stdout
        assert f"{first[3]}" == '0.900'
        assert 'test input 1: PASS@2 (the solution is answer 1 of' in p.stdout
        assert 'attempt 1 (right)' in p.stdout
        assert f"task {task}: 1/1 test inputs solved in two attempts (score 1.00)" in p.stdout


def test_the_refusals_are_one_line(arc_run):
    data, ckpt = arc_run
    views = np.load(os.path.join(data, 'test_views.npz'))
    test_tasks = [str(t) for t in views['tasks']]
    names = json.load(open(os.path.join(data, 'identifiers.json')))
    training = next(n for n in names[1:] if '|||' not in n and n not in test_tasks)
    refused = []
    p = solve(ckpt, f'--task={training}', check=False)
    assert_user_error(p, training, 'training task', 'no stored test views', test_tasks[0])
    refused.append(p)
    p = solve(ckpt, '--task=007bbfb7', check=False)  # an ARC-AGI-1 training task this set never saw
    assert_user_error(p, '007bbfb7', 'never trained', 'puzzle embedding', '--task=TASK.json')
    refused.append(p)
    p = solve(ckpt, '--task=no-such-task', check=False)
    assert_user_error(p, 'no-such-task', 'no such task', test_tasks[0])
    refused.append(p)
    p = solve(ckpt, f'--task={test_tasks[0]}', '--views=4', check=False)
    assert_user_error(p, 'views=4', 'stored augmentations', 'views must be 1')
    refused.append(p)
    for q in refused:  # the refusal is one line (stdout holds only the config and the checkpoint's line)
        assert len([l for l in q.stderr.splitlines() if l.strip()]) == 1, q.stderr
        assert 'demonstration' not in q.stdout


def test_a_new_task_file_is_adapted_to_then_solved_in_its_views(arc_run, tmp_path):
    """--task=FILE.json: a task never trained (here a user's own, its solution given, and a second file without
    one) gets its own dataset and an adaptation of the checkpoint's network in a small budget; then its test
    input is solved in all the new dataset's views and voted, as --task does for the test split's tasks."""
    data, ckpt = arc_run
    grid = [[1, 2, 0], [0, 1, 2]]
    recolour = lambda g: [[{1: 3, 2: 4}.get(v, v) for v in row] for row in g]
    demos = [dict(input=g, output=recolour(g)) for g in (grid, [[2, 2], [1, 0]], [[0, 1], [1, 1], [2, 0]])]
    mine = tmp_path / 'mine.json'
    mine.write_text(json.dumps(dict(train=demos, test=[dict(input=[[2, 1, 1]], output=[[4, 3, 3]])])))
    p = solve(ckpt, f'--task={mine}', '--adapt_minutes=0.1', '--adapt_aug=3', f'--adapt_dir={tmp_path}/a')
    out = p.stdout
    assert 'task=' in out and 'new task' in out and 'puzzle-embedding table replaced' in out, out[-3000:]
    assert 'time budget' in out, out[-3000:]  # the adaptation ended by its budget, with its evaluation
    assert 'task mine: 3 demonstrations, 1 test input; 4 stored views' in out, out[-3000:]
    assert 'the vote: ' in out and 'attempt 1' in out and 'solution' in out
    assert ('PASS@2' in out) or ('not solved in two attempts' in out)
    assert os.path.exists(tmp_path / 'a' / 'run' / 'submission.json')

    unsolved = tmp_path / 'hidden.json'  # the ARC Prize's layout, no solution: solved, not scored
    unsolved.write_text(json.dumps({'t1': dict(train=demos, test=[dict(input=[[2, 1, 1]])])}))
    p = solve(ckpt, f'--task={unsolved}', '--adapt_minutes=0.1', '--adapt_aug=1', f'--adapt_dir={tmp_path}/b')
    assert 'task t1: 3 demonstrations, 1 test input; 2 stored views' in p.stdout, p.stdout[-3000:]
    assert 'solution not known' in p.stdout and 'no solution known' in p.stdout

    bad = tmp_path / 'bad.json'  # a colour outside 0-9: the builder's one line
    bad.write_text(json.dumps(dict(train=[dict(input=[[12]], output=[[1]])], test=[dict(input=[[1]])])))
    p = solve(ckpt, f'--task={bad}', f'--adapt_dir={tmp_path}/c', check=False)
    assert_user_error(p, 'bad', 'not a colour 0-9', 'prepare_arc.py failed')
