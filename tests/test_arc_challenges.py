"""
A dataset of new ARC tasks from a challenges file in the ARC Prize's layout (prepare_arc.py --challenges, with or
without --solutions), and the synthetic builder's new tasks that feed it (--new_tasks, --families,
--new_families): every task and test input is in the test split's stored views, test inputs without a solution
are built unscored, and a malformed file is one line that writes nothing.
    OMP_NUM_THREADS=1 python -m pytest -q tests/test_arc_challenges.py
"""
import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import run, tree
from data import check_split
from puzzles import ARC

SYNTHETIC = ['prepare_arc.py', '--synthetic', '--canvas=6', '--num_tasks=12', '--num_eval_tasks=4', '--num_aug=3']



def family(task_id):
    return re.match('[a-z]+', task_id.split('-', 1)[1]).group()


@pytest.fixture(scope='module')
def new_tasks(tmp_path_factory):
    """A synthetic build whose own tasks are of four families, with 8 new tasks of the other two beside it."""
    out = tmp_path_factory.mktemp('syn') / 'd'
    run(SYNTHETIC + ['--families=crop,recolour,gravity,tile', '--new_tasks=8', '--new_families=dihedral,scale',
                     f'--output_dir={out}'])
    return out


def test_new_tasks_come_from_a_stream_of_their_own_with_ids_that_never_clash(new_tasks, tmp_path):
    j = new_tasks / 'json'
    own = {i for s in ('training', 'evaluation') for i in json.load(open(j / f'arc-agi_{s}_challenges.json'))}
    new = json.load(open(j / 'arc-agi_new_challenges.json'))
    sols = json.load(open(j / 'arc-agi_new_solutions.json'))
    assert len(own) == 16 and {family(i) for i in own} == {'crop', 'recolour', 'gravity', 'tile'}
    assert [family(i) for i in new] == ['dihedral', 'scale'] * 4 and all(i.startswith('new') for i in new)
    assert not own & set(new) and list(sols) == list(new)
    for i, task in new.items():
        assert len(task['train']) == 3 and len(task['test']) == 1 and 'output' not in task['test'][0]
        assert len(sols[i]) == 1
    # the build's own tasks and dataset are the same with or without new tasks beside them
    run(SYNTHETIC + ['--families=crop,recolour,gravity,tile', f'--output_dir={tmp_path / "alone"}'])
    alone, beside = tree(tmp_path / 'alone'), tree(new_tasks)
    assert set(beside) - set(alone) == {'json/arc-agi_new_challenges.json', 'json/arc-agi_new_solutions.json'}
    assert all(beside[k] == v for k, v in alone.items() if not k.endswith('.npz'))


def test_the_default_synthetic_build_draws_all_six_families_as_before(tmp_path):
    run(SYNTHETIC + [f'--output_dir={tmp_path / "a"}'])
    run(SYNTHETIC + ['--families=dihedral,recolour,gravity,crop,tile,scale', f'--output_dir={tmp_path / "b"}'])
    a, b = tree(tmp_path / 'a'), tree(tmp_path / 'b')
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if not k.endswith('.npz'))
    ids = json.load(open(tmp_path / 'a' / 'json' / 'arc-agi_training_challenges.json'))
    assert [i.split('-')[1][:4] for i in ids][:6] == ['dihe', 'reco', 'grav', 'crop', 'tile', 'scal']


def rows_of(out):
    split = {k: np.load(out / 'test' / f'all__{k}.npy') for k in ('inputs', 'labels', 'puzzle_identifiers')}
    return split, np.load(out / 'test_views.npz'), json.load(open(out / 'test_puzzles.json'))


def test_a_challenges_file_with_its_solutions_is_a_dataset_of_its_demonstrations_and_test_inputs(new_tasks, tmp_path):
    j, out = new_tasks / 'json', tmp_path / 'new'
    p = run(['prepare_arc.py', f'--challenges={j}/arc-agi_new_challenges.json',
             f'--solutions={j}/arc-agi_new_solutions.json', '--canvas=6', '--num_aug=7', f'--output_dir={out}'])
    assert '8 of 8 test inputs with solutions' in p.stdout, p.stdout
    assert check_split(str(out), 'train') == [] and check_split(str(out), 'test') == []
    challenges = json.load(open(j / 'arc-agi_new_challenges.json'))
    solutions = json.load(open(j / 'arc-agi_new_solutions.json'))
    kind = ARC(6)
    test, views, puzzles = rows_of(out)
    assert sorted(puzzles) == sorted(challenges) and sorted(views['tasks']) == sorted(challenges)
    names = json.load(open(out / 'identifiers.json'))
    seen = set()
    for r in range(len(test['inputs'])):
        task_id = views['tasks'][views['task'][r]]
        k, t, colours = views['test_index'][r], views['dihedral'][r], views['colours'][r]
        back = kind.unaugment(kind.crop(test['inputs'][r]), t, colours)  # the row mapped back to its task
        assert (back == challenges[task_id]['test'][k]['input']).all()
        assert (kind.unaugment(kind.crop(test['labels'][r]), t, colours) == solutions[task_id][k]).all()
        assert puzzles[task_id]['test'][k]['output'] == solutions[task_id][k]
        name = names[test['puzzle_identifiers'][r]]  # the row's augmentation, by the identifier's name
        assert name == task_id if views['view'][r] == 0 else \
            name == f"{task_id}|||t{t}|||{''.join(map(str, colours))}"
        seen.add((task_id, k, views['view'][r]))
    assert len(seen) == len(test['inputs']) and {(i, k) for i, k, _ in seen} == {(i, 0) for i in challenges}
    # train: the demonstrations only, every one of them in every augmentation; no test output is trained
    train = json.load(open(out / 'train' / 'dataset.json'))
    assert train['total_groups'] == 8 and len(np.load(out / 'train' / 'all__inputs.npy')) == 3 * train['total_puzzles']
    train_labels = {r.tobytes() for r in np.load(out / 'train' / 'all__labels.npy')}
    assert not any(r.tobytes() in train_labels for r in test['labels'])
    assert set(names[1:]) >= {names[i] for i in test['puzzle_identifiers']}  # every test row's puzzle was trained


def test_a_rebuild_from_the_challenges_and_solutions_in_its_own_json_folder_keeps_them(new_tasks, tmp_path):
    """The twin's second build into the twin's folder: json/ holds the files it reads, so it stays, every file of it
    (an earlier build's sources it does not read would go, these never)."""
    out = tmp_path / 'twin'
    shutil.copytree(new_tasks, out)
    before = {k: v for k, v in tree(out).items() if k.startswith('json' + os.sep)}
    run(['prepare_arc.py', f'--challenges={out}/json/arc-agi_new_challenges.json',
         f'--solutions={out}/json/arc-agi_new_solutions.json', '--canvas=6', '--num_aug=7', f'--output_dir={out}'])
    after = tree(out)
    assert {k: v for k, v in after.items() if k.startswith('json' + os.sep)} == before, sorted(after)
    assert check_split(str(out), 'test') == [] and len(json.load(open(out / 'test_puzzles.json'))) == 8


def write_json(path, obj):
    with open(path, 'w') as f:
        json.dump(obj, f)
    return str(path)


def small_challenges(folder):
    """Three tasks: one test input, two test inputs, and one whose test input the solutions leave out."""
    pair = lambda a, b: dict(input=[[a, 0], [0, b]], output=[[b, 0], [0, a]])
    tasks = {'aa01': dict(train=[pair(1, 2), pair(3, 4)], test=[dict(input=[[5, 0], [0, 6]])]),
             'bb02': dict(train=[pair(2, 7)], test=[dict(input=[[1, 1, 0]]), dict(input=[[8], [0], [9]])]),
             'cc03': dict(train=[pair(4, 5), pair(6, 1)], test=[dict(input=[[7, 0, 3]])])}
    sols = {'aa01': [[[6, 0], [0, 5]]], 'bb02': [[[0, 1, 1]]]}  # bb02's second test input and cc03: no solution
    return write_json(folder / 'c.json', tasks), write_json(folder / 's.json', sols), tasks, sols


def test_test_inputs_without_solutions_are_built_without_outputs_and_with_ignored_labels(tmp_path):
    challenges, solutions, tasks, sols = small_challenges(tmp_path)
    for name, extra, solved in (('part', [f'--solutions={solutions}'], 2), ('hidden', [], 0)):
        out = tmp_path / name
        p = run(['prepare_arc.py', f'--challenges={challenges}', *extra, '--canvas=4', '--num_aug=5',
                 f'--output_dir={out}'])
        assert f'{solved} of 4 test inputs with solutions' in p.stdout, p.stdout
        test, views, puzzles = rows_of(out)
        assert list(views['tasks']) == list(puzzles) and sorted(puzzles) == sorted(tasks)
        for task_id, task in puzzles.items():
            assert [pair['input'] for pair in task['test']] == [pair['input'] for pair in tasks[task_id]['test']]
            known = sols.get(task_id, []) if extra else []
            assert [pair.get('output') for pair in task['test']] == known + [None] * (len(task['test']) - len(known))
            assert all('output' not in pair for pair in task['test'][len(known):])
        kind = ARC(4)
        for r in range(len(test['inputs'])):
            task_id, k = views['tasks'][views['task'][r]], views['test_index'][r]
            t, colours = views['dihedral'][r], views['colours'][r]
            back = kind.unaugment(kind.crop(test['inputs'][r]), t, colours)
            assert (back == tasks[task_id]['test'][k]['input']).all()
            if 'output' in puzzles[task_id]['test'][k]:
                assert (kind.unaugment(kind.crop(test['labels'][r]), t, colours) ==
                        puzzles[task_id]['test'][k]['output']).all()
            else:
                assert not test['labels'][r].any()  # all PAD: ignored by every metric
        assert {(views['tasks'][i], k) for i, k in zip(views['task'], views['test_index'])} == \
            {(i, k) for i, t in tasks.items() for k in range(len(t['test']))}
        assert check_split(str(out), 'test') == []


@pytest.mark.parametrize('case,words', [
    ('json', ['not complete JSON']),
    ('big', ['task bb02', 'test pair 1 input', 'a 1x31 grid, over the 30x30 canvas']),
    ('canvas', ['task aa01', 'over the 4x4 canvas']),
    ('colour', ['task cc03', 'train pair 2 output', "holds 10, not a colour 0-9"]),
    ('no_demos', ['task aa01', 'no demonstration pairs']),
    ('no_input', ['task bb02', 'test pair 2', 'expected an object with an input']),
    ('solution_colour', ['s.json', 'task aa01', 'solution 1', "holds -1, not a colour 0-9"]),
    ('solution_task', ['s.json', 'task zz99', 'does not hold']),
    ('solution_count', ['s.json', 'task bb02', '3 solution grids for its 2 test inputs']),
    ('duplicate', ['task id bb02 twice', 'keep only the last']),  # JSON readers keep the last of a key
    ('solution_duplicate', ['s.json', 'task id aa01 twice']),
])
def test_a_malformed_challenges_or_solutions_file_is_one_line_and_writes_nothing(tmp_path, case, words):
    challenges, solutions, tasks, sols = small_challenges(tmp_path)
    args = ['prepare_arc.py', f'--challenges={challenges}', f'--solutions={solutions}', '--num_aug=2']
    old = tmp_path / 'old'
    run(args + ['--canvas=4', f'--output_dir={old}'])
    before = tree(old)
    canvas = '--canvas=30'
    if case == 'json':
        open(challenges, 'w').write(json.dumps(tasks)[:40])
    elif case == 'big':
        tasks['bb02']['test'][0]['input'] = [[1] * 31]
    elif case == 'canvas':
        tasks['aa01']['train'][0]['input'] = [[1, 2, 3, 4, 5]]
        canvas = '--canvas=4'
    elif case == 'colour':
        tasks['cc03']['train'][1]['output'] = [[10]]
    elif case == 'no_demos':
        tasks['aa01']['train'] = []
    elif case == 'no_input':
        tasks['bb02']['test'][1] = dict(output=[[1]])
    elif case == 'solution_colour':
        sols['aa01'] = [[[-1]]]
    elif case == 'solution_task':
        sols['zz99'] = [[[1]]]
    elif case == 'solution_count':
        sols['bb02'] = [[[1]]] * 3
    if case != 'json':
        write_json(challenges, tasks)
        write_json(solutions, sols)
    twice = lambda obj, key, other: '{' + json.dumps(key) + ': ' + json.dumps(other) + ', ' + json.dumps(obj)[1:]
    if case == 'duplicate':  # bb02 first as another task, then as itself
        open(challenges, 'w').write(twice(tasks, 'bb02', tasks['aa01']))
    elif case == 'solution_duplicate':
        open(solutions, 'w').write(twice(sols, 'aa01', [[[1]]]))
    for out in (old, tmp_path / 'fresh'):
        p = run(args + [canvas, f'--output_dir={out}'], check=False)
        err = p.stderr.strip()
        assert p.returncode == 1 and 'Traceback' not in err and err.count('\n') == 0, err
        assert all(w in err for w in words), (words, err)
        assert os.path.basename(solutions if case.startswith('solution') else challenges) in err, err
    assert tree(old) == before and not os.path.exists(tmp_path / 'fresh')


def test_the_challenges_options_are_checked_at_start(tmp_path):
    challenges, solutions, _, _ = small_challenges(tmp_path)
    x = f'--output_dir={tmp_path}/x'
    for args, words in ((['--challenges', challenges], '--challenges needs --output_dir'),
                        (['--challenges', challenges, '--synthetic', x], '--synthetic builds its own tasks'),
                        (['--challenges', challenges, '--version=2', x], 'takes no --version'),
                        (['--solutions', solutions, x], '--solutions goes with --challenges'),
                        (['--synthetic', '--families=crop,spin', x], "'spin' is no family"),
                        (['--synthetic', '--new_families=crop', x], '--new_families needs --new_tasks'),
                        (['--new_tasks=3', x], 'it needs --synthetic'),
                        (['--synthetic', '--new_tasks=-1', x], '--new_tasks -1: must be at least 0'),
                        (['--synthetic', '--seed=-1', x], '--seed -1: must be from 0 to 4294967295')):
        p = run(['prepare_arc.py'] + args, check=False)
        err = p.stderr.strip()
        assert p.returncode == 2 and err.count('\n') == 0 and words in err, (args, err)
    assert not os.path.exists(tmp_path / 'x')
