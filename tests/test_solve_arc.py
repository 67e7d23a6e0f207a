"""
solve.py --task=ID on an ARC dataset: a tiny synthetic ARC set, 3 steps of a tiny attention TRM, then one
evaluation task solved in all its stored views and voted (the vote table, the two attempts, --png); and the
refusals (a training task, a task never trained, an unknown ID, --views > 1), each in one line. Seconds.
"""
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, Lines, assert_user_error, ckpts, run, script_env

TINY_ARC = ['--hidden_size=32', '--num_heads=2', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=32',
            '--puzzle_emb_len=2', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=3', '--global_batch_size=16',
            '--eval_batch_size=6', '--lr=2e-3', '--lr_warmup_steps=1', '--forward_dtype=float32',
            '--loss_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--max_steps=3', '--epochs=100',
            '--eval_every_epochs=1000', '--log_interval=1', '--tensorboard=False']
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
    return preds[None], q[None], (q > 0)[None], np.zeros(1)

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
    p = solve(ckpt, f'--task={test_tasks[0]}', '--eval_views=4', check=False)
    assert_user_error(p, 'views=4', 'stored augmentations', 'views must be 1')
    refused.append(p)
    for source in ('--index=0', '--count=2', '--puzzle=[[1,2],[3,4]]'):  # ARC has no verifier: tasks, not grids
        p = solve(ckpt, source, check=False)
        assert_user_error(p, source.split('=')[0], 'no verifier', '--task=ID', test_tasks[0], '--task=FILE.json')
        refused.append(p)
    for q in refused:  # the refusal is one line (stdout holds only the config and the checkpoint's line)
        assert len([l for l in q.stderr.splitlines() if l.strip()]) == 1, q.stderr
        assert 'demonstration' not in q.stdout


# solve.py, its reads of a dataset's test_puzzles.json counted (Python's audit hook sees every open)
COUNT_READS = '''
import os, runpy, sys
sys.path.insert(0, os.getcwd())
reads = []
sys.addaudithook(lambda event, args: event == 'open' and str(args[0]).endswith('test_puzzles.json')
                 and reads.append(args[0]))
sys.argv = ['solve.py'] + sys.argv[1:]
runpy.run_path('solve.py', run_name='__main__')
print(f"test_puzzles.json read {len(reads)} time(s)")
'''


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
    # the budget counts from solve.py's start: train.py gets what the start and the dataset's build left of it
    assert 0 < float(re.search(r'config: max_minutes = (\S+)', out)[1]) < 0.1, out[-3000:]
    assert 'task mine: 3 demonstrations, 1 test input; 4 stored views' in out, out[-3000:]
    assert 'the vote: ' in out and 'attempt 1' in out and 'solution' in out
    assert ('PASS@2' in out) or ('not solved in two attempts' in out)
    assert os.path.exists(tmp_path / 'a' / 'run' / 'submission.json')
    # the file to hand in, named at the end (train.py named it once, above every task's vote table)
    assert out.strip().splitlines()[-1] == (f"submission (the ARC Prize's format, every task of {mine}): "
                                            f"{tmp_path / 'a' / 'run' / 'submission.json'}"), out[-3000:]

    unsolved = tmp_path / 'hidden.json'  # the ARC Prize's layout, no solution: solved, not scored
    unsolved.write_text(json.dumps({t: dict(train=demos, test=[dict(input=[[2, 1, 1]])]) for t in ('t1', 't2')}))
    p = run(['-c', COUNT_READS, f'--init_from={ckpt}', '--device=cpu', '--threads=1', f'--task={unsolved}',
             '--adapt_minutes=0.1', '--adapt_aug=1', f'--adapt_dir={tmp_path}/b'], env=ENV)
    assert 'task t1: 3 demonstrations, 1 test input; 2 stored views' in p.stdout, p.stdout[-3000:]
    assert 'task t2: 3 demonstrations, 1 test input; 2 stored views' in p.stdout, p.stdout[-3000:]
    assert 'solution not known' in p.stdout and 'no solution known' in p.stdout
    # the adapted dataset's test split is read once for all its tasks, not once a task (hundreds in a hidden set)
    assert p.stdout.strip().splitlines()[-1] == 'test_puzzles.json read 1 time(s)', p.stdout[-3000:]

    bad = tmp_path / 'bad.json'  # a colour outside 0-9: the builder's line, naming the user's file, before it runs
    bad.write_text(json.dumps(dict(train=[dict(input=[[12]], output=[[1]])], test=[dict(input=[[1]])])))
    p = solve(ckpt, f'--task={bad}', f'--adapt_dir={tmp_path}/c', check=False)
    assert_user_error(p, f'task={bad}: task bad: train pair 1 input', 'not a colour 0-9', one_line=True)
    assert not os.path.exists(tmp_path / 'c')


# solve.py, its model's predict calls counted (the real predict runs)
COUNT_PREDICTS = '''
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import model
calls, predict = [], model.TRM.predict
model.TRM.predict = lambda self, *args, **kw: calls.append(1) or predict(self, *args, **kw)
sys.argv = ['solve.py'] + sys.argv[1:]
runpy.run_path('solve.py', run_name='__main__')
print(f"model.predict called {len(calls)} time(s)")
'''


def test_the_votes_of_new_tasks_are_the_final_evaluation_s_shown_without_solving_again(arc_run, tmp_path):
    """--task=FILE.json: the adapted run's final evaluation, which wrote the submission, answered every view;
    showing the votes solves none of them again (for hundreds of tasks that took minutes beyond the budget), and
    shows what solving them again shows: the same vote tables, attempts and verdicts, line for line."""
    data, ckpt = arc_run
    task = json.load(open(write_task(tmp_path / 'one.json', [[2, 1, 1]])))
    two = tmp_path / 'two.json'
    two.write_text(json.dumps({'t1': task, 't2': dict(task, test=task['test'] + [dict(input=[[1, 0]])])}))
    args = ['-c', COUNT_PREDICTS, f'--init_from={ckpt}', '--device=cpu', '--threads=1', f'--task={two}',
            '--adapt_minutes=0.05', '--adapt_aug=1', f'--adapt_dir={tmp_path}/a']
    shown = run(args, env=ENV).stdout
    assert shown.strip().splitlines()[-1] == 'model.predict called 0 time(s)', shown[-3000:]
    kept = tmp_path / 'a' / 'run' / 'answers.npz'
    whole = kept.read_bytes()
    os.remove(kept)  # an adaptation that kept no answers: solved again
    again = run(args, env=ENV).stdout
    assert again.strip().splitlines()[-1] == 'model.predict called 2 time(s)', again[-3000:]
    kept.write_bytes(whole[:len(whole) // 2])  # kept, but cut short (a partial copy): solved again, and said
    cut = run(args, env=ENV).stdout
    assert cut.strip().splitlines()[-1] == 'model.predict called 2 time(s)', cut[-3000:]
    assert f"note: {kept} cannot be read (File is not a zip file): the test views are solved again" in cut, cut
    votes = lambda out: [re.sub(r' \| (\d+ views) (in .* s on cpu|answered by the final evaluation)$', r' | \1', l)
                         for l in out[out.index('\ntask t1: '):out.rindex('\nmodel.predict')].splitlines()
                         if not l.startswith(('device cpu', "the views as the adapted run's final evaluation"))]
    assert votes(shown) == votes(again) and 'the vote: ' in shown, shown[-3000:]


def test_the_votes_shown_of_a_pooling_adaptation_are_the_pooled_ones_its_submission_followed(arc_run, tmp_path):
    """--task=FILE.json with --arc_pool_votes=True: the submission follows the vote pooled over the adaptation's
    evaluations; the vote table shows that vote (every evaluation's answers counted), not the last one's alone."""
    data, ckpt = arc_run
    task = write_task(tmp_path / 'one.json', [[2, 1, 1], [0, 2, 1]])
    out = solve(ckpt, f'--task={task}', '--adapt_minutes=1', '--adapt_aug=3', f'--adapt_dir={tmp_path}/a',
                '--adapt_args=--arc_pool_votes=True --epochs=32 --eval_every_epochs=16').stdout
    assert 'ARC pooled over 2 evaluations (steps 3, 6;' in out, out[-3000:]
    results = json.load(open(tmp_path / 'a' / 'run' / 'results.json'))
    assert results['arc_submission']['vote'] == 'pooled over the evaluations at steps 3, 6', results
    assert 'the vote pooled over the evaluations at steps 3, 6 (the submission\'s): ' in out, out[-3000:]
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split()[:3] == ['rank', 'answer', 'votes'])
    votes = []
    for l in lines[head + 1:]:
        if not l.split() or not l.split()[0].isdigit():
            break
        votes.append(int(l.split()[2]))
    assert sum(votes) == 2 * 4, lines[head:head + 12]  # two evaluations of 4 views each
    assert '4 views answered by the final evaluation' in lines[-3] and 'note: ' not in out, out[-3000:]
    os.remove(tmp_path / 'a' / 'run' / 'answers.npz')  # no answers kept (a failed write): solved again, and said
    again = solve(ckpt, f'--task={task}', '--adapt_minutes=1', '--adapt_aug=3', f'--adapt_dir={tmp_path}/a',
                  '--adapt_args=--arc_pool_votes=True --epochs=32 --eval_every_epochs=16').stdout
    note = (f"note: the submission follows the vote pooled over the evaluations at steps 3, 6 "
            f"({tmp_path / 'a' / 'run' / 'results.json'}); the votes shown below are the last evaluation's alone")
    assert note in again.splitlines() and 'the vote: ' in again, again[-3000:]


def write_task(path, test_input):
    """A task file of three recolouring demonstrations and one test input (its solution given)."""
    recolour = lambda g: [[{1: 3, 2: 4}.get(v, v) for v in row] for row in g]
    demos = [dict(input=g, output=recolour(g)) for g in ([[1, 2, 0], [0, 1, 2]], [[2, 2], [1, 0]], [[0, 1], [1, 1]])]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(dict(train=demos, test=[dict(input=test_input, output=recolour(test_input))]), f)
    return str(path)


def solve_in(cwd, ckpt, *args, check=True):
    """solve.py run from the folder cwd (its default adaptation folder, out/adapt/..., lies there)."""
    e = script_env(ENV)
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'solve.py'), f'--init_from={ckpt}', '--device=cpu',
                        '--threads=1', *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=600)
    if check and p.returncode:
        raise AssertionError(f"solve.py {args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def files(folder):
    """Every file under folder: relative path -> bytes."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            out[os.path.relpath(os.path.join(d, n), folder)] = open(os.path.join(d, n), 'rb').read()
    return out


def test_an_adaptation_from_a_published_step_keeps_the_run_s_recipe_and_grid(arc_run, tmp_path):
    """A published step_<N> carries no config: the adaptation takes the run's recipe and model from the
    all_config.yaml beside it, and the canvas from the dataset its data_paths names, as from the run's own
    checkpoint (loss_dtype has no field there)."""
    import torch
    from model import MODEL_KEYS
    from runkeep.adapt import RECIPE
    data, ckpt = arc_run
    run(['publish.py', f'--init_from={ckpt}', f'--out_dir={tmp_path}/pub'])
    task = write_task(tmp_path / 'task.json', [[2, 1, 1]])
    p = solve(f'{tmp_path}/pub/step_3', f'--task={task}', '--adapt_minutes=1', '--adapt_aug=1',
              '--adapt_args=--max_steps=1', f'--adapt_dir={tmp_path}/a')
    assert 'task task: ' in p.stdout, p.stdout[-3000:]
    keys = [k for k in (*RECIPE, *MODEL_KEYS) if k != 'loss_dtype']
    theirs = torch.load(ckpt, weights_only=True)['config']
    adapted = torch.load(os.path.join(tmp_path, 'a', 'run', ckpts(tmp_path / 'a' / 'run')[-1]),
                         weights_only=True)['config']
    assert {k: adapted[k] for k in keys} == {k: theirs[k] for k in keys}
    assert json.load(open(tmp_path / 'a' / 'data' / 'train' / 'dataset.json'))['seq_len'] == 100  # 10 x 10
    for field, value, words in (('lr', 'fast', "lr='fast' is not a float"),
                                ('global_batch_size', 0, 'global_batch_size=0 (allowed: ')):
        text = open(tmp_path / 'pub' / 'all_config.yaml').read()
        bad = tmp_path / f'bad_{field}'
        bad.mkdir()
        os.link(tmp_path / 'pub' / 'step_3', bad / 'step_3')
        (bad / 'all_config.yaml').write_text(re.sub(rf'(?m)^{field}: .*$', f'{field}: {value}', text))
        p = solve(bad / 'step_3', f'--task={task}', f'--adapt_dir={tmp_path}/b', check=False)
        assert_user_error(p, f"{bad / 'all_config.yaml'}: {words}", one_line=True)
        assert not os.path.exists(tmp_path / 'b')


def test_task_files_of_one_name_keep_their_own_adaptations(arc_run, tmp_path):
    """a/task.json and b/task.json: each gets its own adaptation folder (out/adapt/ names it from the file's
    content and the checkpoint), so neither replaces the other; the same command again solves with the
    adaptation it made, training nothing; an --adapt_dir that holds another task's adaptation is refused in one
    line and left as it was."""
    data, ckpt = arc_run
    a, b = write_task(tmp_path / 'a' / 'task.json', [[2, 1, 1]]), write_task(tmp_path / 'b' / 'task.json', [[1, 1]])
    adapt = ['--adapt_minutes=0.05', '--adapt_aug=1']
    first = solve_in(tmp_path, ckpt, f'--task={a}', *adapt)
    adaptations = tmp_path / 'out' / 'adapt'
    (mine,) = os.listdir(adaptations)
    kept = files(adaptations / mine)
    assert ckpts(adaptations / mine / 'run'), first.stdout[-3000:]
    solve_in(tmp_path, ckpt, f'--task={b}', *adapt)
    assert len(os.listdir(adaptations)) == 2 and files(adaptations / mine) == kept
    again = solve_in(tmp_path, ckpt, f'--task={a}', *adapt)
    assert f'adapted before in {os.path.join("out", "adapt", mine)}' in again.stdout, again.stdout[-3000:]
    assert 'step 1/' not in again.stdout and files(adaptations / mine) == kept
    verdict = lambda out: [l.split(' | ')[0] for l in out.splitlines() if l.startswith('task task: ')]
    assert verdict(again.stdout) == verdict(first.stdout) and verdict(first.stdout)
    p = solve_in(tmp_path, ckpt, f'--task={b}', *adapt, f'--adapt_dir={adaptations / mine}', check=False)
    assert_user_error(p, f'adapt_dir={adaptations / mine}', 'holds the adaptation of another')
    assert len(p.stderr.strip().splitlines()) == 1 and files(adaptations / mine) == kept, p.stderr


def test_a_task_id_twice_in_a_task_file_is_refused_before_anything_is_built(arc_run, tmp_path):
    data, ckpt = arc_run
    task = json.dumps(dict(train=[dict(input=[[1]], output=[[2]])], test=[dict(input=[[1]])]))
    twice = tmp_path / 'twice.json'
    twice.write_text('{"t1": ' + task + ', "t2": ' + task + ', "t1": ' + task + '}')
    p = solve(ckpt, f'--task={twice}', '--adapt_minutes=0.05', f'--adapt_dir={tmp_path}/a', check=False)
    assert_user_error(p, str(twice), "the key 't1' twice")
    assert not os.path.exists(tmp_path / 'a')



def test_an_adaptation_folder_whose_write_fails_midway_is_left_without_a_half_written_file(arc_run, tmp_path):
    """A write that fails part way (a full disk: here a file-size limit of 2 KiB, which adapt.json passes and the
    task file's copy does not) is the one line naming the folder, and leaves no .tmp of it behind."""
    import resource
    data, ckpt = arc_run
    task = json.load(open(write_task(tmp_path / 'one.json', [[2, 1, 1]])))
    big = tmp_path / 'big.json'
    big.write_text(json.dumps({f't{i}': task for i in range(24)}))
    assert big.stat().st_size > 4096
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
    p = subprocess.run([sys.executable, 'solve.py', f'--init_from={ckpt}', '--device=cpu', '--threads=1',
                        f'--task={big}', '--adapt_minutes=0.05', f'--adapt_dir={tmp_path}/a'], cwd=ROOT,
                       env=script_env(ENV), preexec_fn=limit, capture_output=True, text=True, timeout=600)
    assert_user_error(p, f'adapt_dir={tmp_path}/a: cannot write there', 'File too large', one_line=True)
    assert not [n for n in os.listdir(tmp_path / 'a') if n.endswith('.tmp')], os.listdir(tmp_path / 'a')


def test_what_solving_refuses_is_refused_before_a_task_file_is_adapted_to(arc_run, tmp_path):
    """--task=FILE.json adapts for minutes before it solves: views above 1 and a checkpoint of another puzzle kind,
    which solving refuses, are refused first, in one line, and nothing is built."""
    data, ckpt = arc_run
    task = write_task(tmp_path / 'task.json', [[2, 1, 1]])
    p = solve(ckpt, f'--task={task}', '--eval_views=2', '--adapt_minutes=0.05', f'--adapt_dir={tmp_path}/a',
              check=False)
    assert_user_error(p, 'eval_views=2', 'stored augmentations', 'views must be 1', one_line=True)
    assert not os.path.exists(tmp_path / 'a') and 'prepare_arc' not in p.stdout
    sudoku, out = tmp_path / 's4', tmp_path / 'o4'
    run(['prepare_sudoku.py', '--generate', '40', '--size', '4', '--num_test', '4', '--output_dir', str(sudoku)],
        env=ENV)
    run(['train.py', f'--data_path={sudoku}', f'--out_dir={out}', '--hidden_size=32', '--num_heads=2',
         '--puzzle_emb_ndim=0', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=2', '--global_batch_size=8',
         '--max_steps=1', '--forward_dtype=float32', '--device=cpu', '--xla_cache_dir=', '--tensorboard=False'],
        env=ENV)
    p = solve(out / 'ckpt_00000001.pt', f'--task={task}', '--adapt_minutes=0.05', f'--adapt_dir={tmp_path}/b',
              check=False)
    assert_user_error(p, f'task={task}: --task solves ARC tasks', '4x4 Sudokus', one_line=True)
    assert not os.path.exists(tmp_path / 'b')


def test_a_task_without_its_test_inputs_is_named_as_the_user_s_file(arc_run, tmp_path):
    data, ckpt = arc_run
    lone = tmp_path / 'lone.json'
    lone.write_text(json.dumps(dict(train=[dict(input=[[1]], output=[[2]])])))
    p = solve(ckpt, f'--task={lone}', '--adapt_minutes=0.05', f'--adapt_dir={tmp_path}/a', check=False)
    assert_user_error(p, f"task={lone}: ", "no 'test'", one_line=True)
    assert not os.path.exists(tmp_path / 'a')


def test_a_grid_over_the_checkpoint_s_canvas_is_named_in_the_user_s_file_before_anything_is_built(arc_run, tmp_path):
    data, ckpt = arc_run
    big = write_task(tmp_path / 'big.json', [[1] * 11] * 2)  # the run's canvas is 10x10
    p = solve(ckpt, f'--task={big}', '--adapt_minutes=0.05', f'--adapt_dir={tmp_path}/a', check=False)
    assert_user_error(p, f"task={big}: ", 'test pair 1 input: a 2x11 grid, over the 10x10 canvas', one_line=True)
    assert 'challenges.json' not in p.stderr and not os.path.exists(tmp_path / 'a')
    assert 'prepare_arc' not in p.stdout


def bytes_read(script, *args):
    """The bytes that a script read (read(2) calls: the page cache counts too), run in a process that says its
    /proc/self/io at exit: (that count, the process)."""
    code = ('import atexit, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0]); '
            'atexit.register(lambda: print(open("/proc/self/io").read().split()[1])); '
            'runpy.run_path(sys.argv[0], run_name="__main__")')
    p = run(['-c', code, os.path.join(ROOT, script), *map(str, args)], env=ENV, check=False)
    return int(p.stdout.split()[-1]), p


def refused_before_adapting(ckpt, task, tmp_path):
    """The bytes read by solve.py --task=FILE.json refused at its last check before adapting."""
    n, p = bytes_read('solve.py', f'--init_from={ckpt}', '--device=cpu', '--threads=1', f'--task={task}',
                      f'--adapt_dir={tmp_path}/a')
    assert 'over the 10x10 canvas' in p.stderr and not os.path.exists(tmp_path / 'a'), p.stderr[-3000:]
    return n


def adapting(ckpt, data, out):
    """The bytes read by the adaptation's train.py (as solve.py starts it) through one step."""
    n, p = bytes_read('train.py', f'--init_from=resume:{ckpt}', f'--data_path={data}', f'--out_dir={out}',
                      *[a for a in TINY_ARC if not a.startswith('--max_steps')], '--max_steps=1')
    assert p.returncode == 0 and ckpts(out), p.stdout[-3000:] + p.stderr[-3000:]
    return n


@pytest.mark.skipif(not os.path.exists('/proc/self/io'), reason="a process's bytes read: Linux's /proc/self/io")
def test_a_task_file_reads_only_the_config_of_the_checkpoint_before_adapting(arc_run, tmp_path):
    """Before it adapts, --task=FILE.json needs only the checkpoint's config (the run's recipe, model and canvas):
    the tensors (the weights, the optimizer's moments, the ACT carry, the puzzle table: gigabytes at ARC size)
    are mapped, not read, whether in a checkpoint of train.py or a published step_<N> (config from its
    all_config.yaml); the adaptation's train.py reads the weights it starts from, not the rest. A truncated
    checkpoint is still one line."""
    import torch
    data, ckpt = arc_run
    big = write_task(tmp_path / 'big.json', [[1] * 11] * 2)  # over the run's canvas: refused before adapting
    size = 48_000_000  # floats: 192 MB
    ours = torch.load(ckpt, weights_only=True)
    ours['carry']['z'] = torch.ones(size)
    torch.save(ours, tmp_path / 'ours.pt')
    run(['publish.py', f'--init_from={ckpt}', f'--out_dir={tmp_path}/pub'])
    published = torch.load(tmp_path / 'pub' / 'step_3', weights_only=True)
    table = next(k for k in published if k.endswith('puzzle_emb.weights'))
    published[table] = torch.ones(size // published[table].shape[1], published[table].shape[1])
    torch.save(published, tmp_path / 'pub' / 'step_3')
    small = refused_before_adapting(ckpt, big, tmp_path)
    for path in (tmp_path / 'ours.pt', tmp_path / 'pub' / 'step_3'):
        assert os.path.getsize(path) > size * 4
        assert refused_before_adapting(path, big, tmp_path) - small < size * 4 / 10, path
    # the adaptation itself needs the weights, not the optimizer's moments nor the carry
    assert adapting(tmp_path / 'ours.pt', data, tmp_path / 'o1') - adapting(ckpt, data, tmp_path / 'o2') < size * 4 / 10
    cut = tmp_path / 'cut.pt'
    cut.write_bytes((tmp_path / 'ours.pt').read_bytes()[:size])
    p = solve(cut, f'--task={big}', f'--adapt_dir={tmp_path}/a', check=False)
    assert_user_error(p, f'init_from: checkpoint {cut} is corrupt or truncated', one_line=True)

def start_adapting(cwd, ckpt, task, folder):
    """solve.py adapting to a task for minutes, in its own session (a terminal's process group): (its process,
    its output's Lines), once train.py has done a step."""
    e = script_env(ENV)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, 'solve.py'), f'--init_from={ckpt}', '--device=cpu',
                             '--threads=1', f'--task={task}', '--adapt_minutes=10', '--adapt_aug=1',
                             '--adapt_args=--log_interval=1', f'--adapt_dir={folder}'], cwd=cwd, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
    lines = Lines(proc)
    lines.until('step ')
    return proc, lines


def test_ctrl_c_while_adapting_saves_the_adaptation_says_so_in_one_line_and_a_rerun_goes_on(arc_run, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while train.py adapts: train.py gets it once, saves its
    stop checkpoint and ends; solve.py says so in one line and exits 130, with no traceback and no lock left;
    the same command again continues the adaptation from that checkpoint, then solves."""
    data, ckpt = arc_run
    task, folder = write_task(tmp_path / 'task.json', [[2, 1, 1]]), tmp_path / 'ad'
    proc, lines = start_adapting(tmp_path, ckpt, task, folder)
    os.killpg(proc.pid, signal.SIGINT)
    text = lines.rest(120)
    assert proc.returncode == 130 and 'Traceback' not in text, (proc.returncode, text[-3000:])
    saved = ckpts(folder / 'run')
    assert saved and not os.path.exists(folder / 'run' / 'run.lock'), text[-3000:]
    assert text.count('got SIGINT') == 1, text[-3000:]  # once: not a second signal that ends the save
    end = text.strip().splitlines()[-1]
    assert 'SIGINT' in end and saved[-1] in end and 'rerun' in end, end
    p = solve_in(tmp_path, ckpt, f'--task={task}', '--adapt_minutes=0.05', '--adapt_aug=1',
                 '--adapt_args=--log_interval=1', f'--adapt_dir={folder}')
    assert f'resuming from {folder / "run" / saved[-1]}' in p.stdout, p.stdout[-3000:]
    assert 'task task: ' in p.stdout


def test_sigterm_to_solve_alone_reaches_train_py_which_saves_and_ends_with_it(arc_run, tmp_path):
    """A SIGTERM to solve.py only (a job scheduler's): train.py gets it, saves and ends before solve.py does
    (no orphan left training), and solve.py exits 75, as a stopped train.py's stop that a rerun continues."""
    data, ckpt = arc_run
    task, folder = write_task(tmp_path / 'task.json', [[2, 1, 1]]), tmp_path / 'ad'
    proc, lines = start_adapting(tmp_path, ckpt, task, folder)
    trainer = json.load(open(folder / 'run' / 'run.lock'))['pid']
    try:
        os.kill(proc.pid, signal.SIGTERM)
        text = lines.rest(120)
        assert proc.returncode == 75 and 'Traceback' not in text, (proc.returncode, text[-3000:])
        assert not os.path.exists(f'/proc/{trainer}'), 'train.py still runs after solve.py ended'
        assert ckpts(folder / 'run') and not os.path.exists(folder / 'run' / 'run.lock'), text[-3000:]
        assert 'SIGTERM' in text.strip().splitlines()[-1], text[-3000:]
    finally:
        try:
            os.kill(trainer, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_stop_while_the_tasks_are_shown_names_the_submission_already_written(arc_run, tmp_path):
    """Ctrl-C or SIGTERM after the adaptation, while the tasks' votes are shown: the submission is complete, so
    solve.py ends with one line naming it (exit 128 + the signal), no traceback and no silent end."""
    data, ckpt = arc_run
    task = json.load(open(write_task(tmp_path / 'one.json', [[2, 1, 1]])))
    many = tmp_path / 'many.json'
    many.write_text(json.dumps({f't{i:02d}': task for i in range(40)}))
    folder = tmp_path / 'ad'
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, 'solve.py'), f'--init_from={ckpt}',
                                 '--device=cpu', '--threads=1', f'--task={many}', '--adapt_minutes=0.05',
                                 '--adapt_aug=1', f'--adapt_dir={folder}'], cwd=tmp_path, env=script_env(ENV),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
        lines = Lines(proc)
        lines.until('task t01: ')
        os.killpg(proc.pid, sig)
        text = lines.rest(120)
        assert proc.returncode == 128 + sig and 'Traceback' not in text, (proc.returncode, text[-3000:])
        assert text.strip().splitlines()[-1] == (
            f"stopped by {sig.name} while showing the tasks' votes; submission (the ARC Prize's format, every task "
            f"of {many}): {folder / 'run' / 'submission.json'}"), text[-3000:]
        assert len(json.load(open(folder / 'run' / 'submission.json'))) == 40


def test_a_task_that_cannot_be_adapted_to_is_left_out_in_one_line_and_the_submission_still_has_every_task(arc_run,
                                                                                                         tmp_path):
    """A challenges file (the ARC Prize's hidden tasks: no second chance to mend it) with tasks that cannot be
    built (no demonstrations, a colour 10, a ragged grid, a grid over the canvas) among good ones: each such task
    is named in one line and left out; the others are adapted to and solved, and the submission holds every task
    of the file, a left-out one's test inputs answered [[0]], so that it is complete."""
    data, ckpt = arc_run
    good = json.load(open(write_task(tmp_path / 'one.json', [[2, 1, 1]])))
    hidden = {'g1': dict(good, test=[dict(input=[[2, 1]])]),
              'notrain': dict(train=[], test=[dict(input=[[1, 2]]), dict(input=[[1]])]),
              'ten': dict(good, test=[dict(input=[[10]])]),
              'ragged': dict(train=[dict(input=[[1, 2], [1]], output=[[3]])], test=[dict(input=[[2]])]),
              'huge': dict(good, test=[dict(input=[[1] * 11])]),
              'g2': good}
    path = tmp_path / 'hidden.json'
    path.write_text(json.dumps(hidden))
    p = solve(ckpt, f'--task={path}', '--adapt_minutes=0.05', '--adapt_aug=1', f'--adapt_dir={tmp_path}/a')
    left = [l for l in p.stderr.splitlines() if 'left out' in l]
    for t, words in (('notrain', "no demonstration pairs"), ('ten', 'holds 10, not a colour 0-9'),
                     ('ragged', 'not a rectangle'), ('huge', 'over the 10x10 canvas')):
        assert any(f"task {t}: " in l and words in l for l in left), p.stderr[-3000:]
    assert len(left) == 4 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert 'task g1: ' in p.stdout and 'task g2: ' in p.stdout and 'task ten: ' not in p.stdout
    sub = json.load(open(tmp_path / 'a' / 'run' / 'submission.json'))
    assert sorted(sub) == sorted(hidden)
    for t, task in hidden.items():
        assert len(sub[t]) == len(task['test']) and all(set(a) == {'attempt_1', 'attempt_2'} for a in sub[t])
    assert sub['notrain'] == [{'attempt_1': [[0]], 'attempt_2': [[0]]}] * 2 and sub['g1'][0]['attempt_1'] != []
    assert p.stdout.strip().splitlines()[-1].endswith(str(tmp_path / 'a' / 'run' / 'submission.json'))


def test_an_adaptation_whose_train_py_fails_still_leaves_a_complete_submission(arc_run, tmp_path):
    """train.py failing in an adaptation (here a key it refuses; on a hidden set as well an OOM kill or a bug)
    leaves no adapted run to solve with; the ARC Prize scores a complete file only, so solve.py still writes one,
    every task of the file answered [[0]], names it and the failure in one line, and exits 1. Mended, the
    adaptation writes its own."""
    data, ckpt = arc_run
    good = json.load(open(write_task(tmp_path / 'one.json', [[2, 1, 1]])))
    hidden = {'g1': dict(good, test=[dict(input=[[2, 1]]), dict(input=[[1]])]), 'g2': good,
              'ten': dict(good, test=[dict(input=[[10]])])}
    path = tmp_path / 'hidden.json'
    path.write_text(json.dumps(hidden))
    sub_path = tmp_path / 'a' / 'run' / 'submission.json'
    p = solve(ckpt, f'--task={path}', '--adapt_minutes=0.05', '--adapt_aug=1', f'--adapt_dir={tmp_path}/a',
              '--adapt_args=--no_such_key=1', check=False)
    assert p.returncode == 1 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"task={path}: train.py failed (its message is above), nothing adapted: the submission answers every task "
        f"[[0]] that it had no answer for, so that it is complete: {sub_path}"), p.stderr[-3000:]
    none = {'attempt_1': [[0]], 'attempt_2': [[0]]}
    assert json.load(open(sub_path)) == {'g1': [none, none], 'g2': [none], 'ten': [none]}
    p = solve(ckpt, f'--task={path}', '--adapt_minutes=0.05', '--adapt_aug=1', f'--adapt_dir={tmp_path}/b')
    sub = json.load(open(tmp_path / 'b' / 'run' / 'submission.json'))
    assert sorted(sub) == ['g1', 'g2', 'ten'] and sub['ten'] == [none] and len(sub['g1']) == 2


def test_a_submission_that_is_not_a_dict_is_read_as_none(tmp_path):
    """The adapted run's submission.json completed with the file's tasks: one that holds JSON of another shape (a
    list) ended solve.py in a TypeError after the adaptation's minutes; it is read as no submission (left as it is,
    or, where nothing was adapted, replaced by one that answers every task)."""
    from runkeep.adapt import complete_submission
    path = tmp_path / 'submission.json'
    path.write_text('[1, 2]')
    tasks = {'a': dict(train=[], test=[dict(input=[[1]])]), 'b': {}}
    complete_submission(str(path), tasks)
    assert path.read_text() == '[1, 2]'
    complete_submission(str(path), tasks, fallback=True)
    none = {'attempt_1': [[0]], 'attempt_2': [[0]]}
    assert json.load(open(path)) == {'a': [none], 'b': [none]}
