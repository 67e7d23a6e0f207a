"""
The builders against a hostile user: a full disk or a file-size limit in the middle of a build (the previous
dataset stays whole, every file of it, and the one line names the file that could not be written), generator
options out of range, a bad solutions file, two tasks under one id, a second build into a folder being built, and
Ctrl-C.
    OMP_NUM_THREADS=1 python -m pytest -q tests/test_builder_faults.py
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, Lines, assert_user_error, run, script_env, site_hook, tree
from disks import small_disk

SYNTHETIC = ['--synthetic', '--canvas=6', '--num_tasks=12', '--num_eval_tasks=4', '--num_aug=3']
# a small build of each builder, in seconds
SMALL_BUILDS = [['prepare_sudoku.py', '--generate=30', '--size=4', '--num_test=5'],
                ['prepare_maze.py', '--generate=10', '--size=8', '--num_test=3', '--min_path_len=4'],
                ['prepare_arc.py'] + SYNTHETIC]


def limited(limit, script, *args):
    """`script` run as a user would, under a file-size limit of `limit` bytes (what a full disk does to a write)."""
    code = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            f"sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')")
    return run(['-c', code] + [str(a) for a in args], check=False)



def test_a_failed_synthetic_rebuild_keeps_every_file_of_the_previous_dataset(tmp_path):
    out = tmp_path / 'syn'
    run(['prepare_arc.py'] + SYNTHETIC + [f'--output_dir={out}'])
    before = tree(out)
    assert 'json/arc-agi_training_challenges.json' in before and 'train/all__inputs.npy' in before
    # 3,000 bytes: the tasks' JSON cannot be written; 7,000: it can, the train rows cannot
    for limit in (3000, 7000):
        p = limited(limit, 'prepare_arc.py', *SYNTHETIC, '--seed=5', f'--output_dir={out}')
        assert p.returncode == 1 and tree(out) == before, limit
        assert_user_error(p, 'cannot write', 'File too large', one_line=True)
        assert sorted(os.listdir(out)) == sorted({k.split(os.sep)[0] for k in before})  # no .building left


def test_prepare_arc_on_a_full_disk_or_under_a_size_limit_names_the_file(tmp_path):
    p = limited(7000, 'prepare_arc.py', *SYNTHETIC, f'--output_dir={tmp_path / "a"}')
    err = assert_user_error(p, 'cannot write', 'File too large', one_line=True)
    assert os.path.join(str(tmp_path / 'a'), '.building', 'train', 'all__inputs.npy') in err, err
    disk = tmp_path / 'disk'
    with small_disk(disk, '24k'):
        p = run(['prepare_arc.py'] + SYNTHETIC + [f'--output_dir={disk / "b"}'], check=False)
        err = assert_user_error(p, 'cannot write', 'No space left on device', str(disk / 'b'), one_line=True)
        assert err.split(':')[1].strip().endswith(('.json', '.npy', '.npz')), err  # a file, not a folder
        assert os.listdir(disk) == []  # nothing half-written stays: no partial folder


def test_prepare_maze_generate_on_a_full_disk_or_under_a_size_limit_names_the_file(tmp_path):
    gen = ['--generate=10', '--size=8', '--num_test=3', '--min_path_len=4']
    p = limited(300, 'prepare_maze.py', *gen, f'--output_dir={tmp_path / "a"}')
    err = assert_user_error(p, 'cannot write', 'File too large', 'train.csv', one_line=True)
    p = limited(2000, 'prepare_maze.py', *gen, f'--output_dir={tmp_path / "b"}')  # the CSVs fit, a split not
    assert_user_error(p, 'cannot write', 'File too large', 'all__inputs.npy', one_line=True)
    assert not os.path.exists(tmp_path / 'a') and not os.path.exists(tmp_path / 'b')
    disk = tmp_path / 'disk'
    with small_disk(disk, '8k'):
        p = run(['prepare_maze.py'] + gen + [f'--output_dir={disk / "c"}'], check=False)
        assert_user_error(p, 'cannot write', 'No space left on device', str(disk / 'c'), one_line=True)
        assert os.listdir(disk) == []


def test_prepare_sudoku_generate_under_a_size_limit_names_the_file(tmp_path):
    p = limited(300, 'prepare_sudoku.py', '--generate=30', '--size=4', '--num_test=5', f'--output_dir={tmp_path}/s')
    assert_user_error(p, 'cannot write', 'File too large', 'train.csv', one_line=True)
    assert not os.path.exists(tmp_path / 's')


def test_a_maze_generator_that_cannot_reach_the_path_length_is_one_line(tmp_path):
    p = run(['prepare_maze.py', '--generate=10', '--size=4', '--min_path_len=100', f'--output_dir={tmp_path}/m'],
            check=False)
    assert_user_error(p, '1000 mazes in a row', 'longer than 100 steps at size 4', 'lower --min_path_len',
                      one_line=True)
    assert not os.path.exists(tmp_path / 'm')


def test_a_maze_size_with_too_few_distinct_mazes_says_so_not_the_path_length(tmp_path):
    """4x4 mazes without loops: a few distinct ones, fewer than 210; the path length (0) is not what stopped it."""
    p = run(['prepare_maze.py', '--generate=200', '--num_test=10', '--size=4', '--min_path_len=0', '--loop_frac=0',
             f'--output_dir={tmp_path}/m'], check=False)
    err = assert_user_error(p, 'too few distinct', 'the 210 asked', 'fewer mazes', 'a larger --size',
                            'a higher --loop_frac', one_line=True)
    assert '--min_path_len' not in err and not os.path.exists(tmp_path / 'm')


@pytest.mark.parametrize('args', SMALL_BUILDS, ids=lambda a: a[0])
def test_an_output_dir_that_is_a_file_or_lies_below_one_is_one_line_and_the_file_stays(tmp_path, args):
    # said as the OS's 'File exists' or 'Not a directory' before, which did not say that output_dir was the problem
    (tmp_path / 'f').write_text('mine')
    for out in (tmp_path / 'f', tmp_path / 'f' / 'd'):
        p = run(args + [f'--output_dir={out}'], check=False)
        assert_user_error(p, str(out), f'{tmp_path / "f"} is a file, not a folder', one_line=True)
    assert tree(tmp_path) == {'f': b'mine'}


@pytest.mark.parametrize('args', SMALL_BUILDS, ids=lambda a: a[0])
def test_an_empty_output_dir_is_one_line_and_nothing_is_written(tmp_path, args):
    """`--output_dir=$OUT` with OUT unset: prepare_sudoku.py ended in the OS's "No such file or directory: ''",
    naming no option; prepare_maze.py and prepare_arc.py built into their default folder instead."""
    p = run(args + ['--output_dir='], check=False, cwd=tmp_path)
    assert_user_error(p, '--output_dir', 'empty', one_line=True)
    assert tree(tmp_path) == {} and not os.listdir(tmp_path)


@pytest.mark.parametrize('script', ['prepare_sudoku.py', 'prepare_maze.py'])
def test_a_csv_dir_without_its_csv_files_is_one_line_naming_the_option(tmp_path, script):
    (tmp_path / 'csv').mkdir()
    (tmp_path / 'csv' / 'test.csv').write_text('')
    for where in (tmp_path / 'none', tmp_path / 'csv'):  # no such folder; a folder without train.csv
        p = run([script, f'--csv_dir={where}', f'--output_dir={tmp_path}/out'], check=False)
        assert_user_error(p, f'--csv_dir {where}', 'train.csv', one_line=True)
        assert not os.path.exists(tmp_path / 'out')


@pytest.mark.parametrize('option,value,allowed', [
    ('seed', '-1', 'from 0 to 4294967295'), ('seed', str(2 ** 32), 'from 0 to 4294967295'),
    ('min_rating', '-1', 'must not be negative'),
])
def test_the_sudoku_generator_s_options_are_checked_at_start(tmp_path, option, value, allowed):
    p = run(['prepare_sudoku.py', '--generate=30', '--size=4', '--num_test=5', f'--{option}={value}',
             f'--output_dir={tmp_path}/s'], check=False)
    assert_user_error(p, f'--{option}', value, allowed)
    assert 'generated' not in p.stdout and not os.path.exists(tmp_path / 's')


@pytest.mark.parametrize('option,value,allowed', [
    ('min_path_len', '-3', 'at least 0'), ('loop_frac', '-1', 'from 0 to 1'), ('loop_frac', '5', 'from 0 to 1'),
    ('loop_frac', 'nan', 'from 0 to 1'), ('generate', '-5', 'at least 1'), ('seed', '-1', 'at least 0'),
    ('num_test', '0', 'at least 1'), ('size', '3', 'at least 4'), ('subsample_size', '-2', 'at least 1'),
])
def test_the_maze_generator_s_options_are_checked_at_start(tmp_path, option, value, allowed):
    args = dict(generate='10', size='8', num_test='3', min_path_len='4', seed='0')
    args[option] = value
    p = run(['prepare_maze.py'] + [f'--{k}={v}' for k, v in args.items()] + [f'--output_dir={tmp_path}/m'],
            check=False)
    assert_user_error(p, f'--{option}', value, allowed, one_line=True)
    assert 'generated' not in p.stdout and not os.path.exists(tmp_path / 'm')


def write_subset(folder, subset, tasks, solutions):
    os.makedirs(folder, exist_ok=True)
    for name, obj in (('challenges', tasks), ('solutions', solutions)):
        with open(os.path.join(folder, f'arc-agi_{subset}_{name}.json'), 'w') as f:
            json.dump(obj, f)


def task(colour):
    return dict(train=[dict(input=[[colour, 0]], output=[[0, colour]])], test=[dict(input=[[0, colour]])])


def subsets(folder, evaluation=None, concept=None):
    """Three subsets of one or two tasks each (training, evaluation, concept) with their solutions; the
    evaluation and concept tasks as given, to make clashes."""
    for subset, tasks in (('training', {'t1': task(1), 't2': task(2)}), ('evaluation', evaluation or {'e1': task(3)}),
                          ('concept', concept or {'c1': task(5)})):
        write_subset(folder, subset, tasks, {i: [[[9, 9]]] for i in tasks})  # one solution: identical copies
    return ['prepare_arc.py', f'--json_dir={folder}', '--num_aug=2', '--canvas=4']


def test_a_malformed_grid_in_the_solutions_file_is_named_in_the_solutions_file(tmp_path):
    args = subsets(tmp_path / 'j')
    write_subset(tmp_path / 'j', 'evaluation', {'e1': task(3)}, {'e1': [[[4, 12]]]})
    p = run(args + [f'--output_dir={tmp_path}/o'], check=False)
    err = assert_user_error(p, 'arc-agi_evaluation_solutions.json', 'task e1', '12', 'not a colour 0-9',
                            one_line=True)
    assert 'challenges' not in err, err
    write_subset(tmp_path / 'j', 'evaluation', {'e1': task(3)}, {'e1': [[[4, 0, 0, 0, 0]]]})
    p = run(args + [f'--output_dir={tmp_path}/o'], check=False)
    assert_user_error(p, 'arc-agi_evaluation_solutions.json', 'task e1', 'over the 4x4 canvas', one_line=True)
    assert not os.path.exists(tmp_path / 'o')


def test_two_tasks_under_one_id_in_two_files_are_refused(tmp_path):
    j = tmp_path / 'j'
    args = subsets(j, concept={'c1': task(5), 't2': task(7)})  # concept's t2 is another task than training's
    p = run(args + [f'--output_dir={tmp_path}/o'], check=False)
    assert_user_error(p, 'task t2', str(j / 'arc-agi_training_challenges.json'),
                      str(j / 'arc-agi_concept_challenges.json'), one_line=True)
    args = subsets(j, evaluation={'t1': task(1)})  # the very same task in training and evaluation
    p = run(args + [f'--output_dir={tmp_path}/o'], check=False)
    assert_user_error(p, 'task t1', str(j / 'arc-agi_training_challenges.json'),
                      str(j / 'arc-agi_evaluation_challenges.json'), one_line=True)
    assert not os.path.exists(tmp_path / 'o')
    run(subsets(j) + [f'--output_dir={tmp_path}/o'])  # no clash: built


def test_a_download_onto_a_full_disk_names_the_file(server, tmp_path):
    from conftest import FileHandler
    for split in ('train', 'test'):  # 100 kB each, over the 64 kB disk
        FileHandler.files[f'/m/{split}.csv'] = b'source,question,answer,rating\n' + b'x' * 100_000 + b'\n'
    disk = tmp_path / 'disk'
    with small_disk(disk, '64k'):
        p = run(['prepare_maze.py', f'--base_url={server}/m', f'--output_dir={disk / "m"}'], check=False)
        assert p.returncode == 1 and 'Traceback' not in p.stderr, p.stderr[-3000:]
        last = p.stderr.strip().splitlines()[-1]  # after the download's progress line
        assert last == f"error: cannot write {disk / 'm' / 'raw' / 'train.csv.part'}: No space left on device", last


# a build that says 'test hook: the build waits' as it comes to write its first array, and waits there until the
# file $TEST_GO exists: how a test acts on a build that is surely mid-way, however fast the machine. Ctrl-C is
# Python's KeyboardInterrupt, as in a terminal (a test runner started in the background may pass SIGINT ignored)
HELD_BUILD = """
import data
real, waited = data.save_array, []
signal.signal(signal.SIGINT, signal.default_int_handler)


def save_array(*args, **kwargs):
    if not waited:
        waited.append(print('test hook: the build waits', flush=True))
    while not os.path.exists(os.environ['TEST_GO']):
        time.sleep(0.05)
    return real(*args, **kwargs)


data.save_array = save_array
"""


def held_build(args, hook, go):
    """A builder run as a user would, in the background (its own session), held at its first array (HELD_BUILD)
    until the file `go` exists; returns (process, its Lines) once it waits there."""
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, env=script_env(dict(site_hook(hook, HELD_BUILD),
                            TEST_GO=str(go))), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            start_new_session=True)
    lines = Lines(proc)
    lines.until('test hook: the build waits')
    return proc, lines


def test_a_second_build_into_a_folder_being_built_is_refused_and_a_killed_build_s_leftover_is_not(tmp_path):
    out, go = tmp_path / 's', tmp_path / 'go'
    build = lambda folder, seed: ['prepare_sudoku.py', '--generate=30', '--size=4', '--num_test=5', f'--seed={seed}',
                                  f'--output_dir={folder}']
    first, lines = held_build(build(out, 1), tmp_path / 'hook', go)
    try:
        p = run(build(out, 2), check=False)
        assert_user_error(p, str(out), 'being built', f'pid {first.pid}', one_line=True)
        open(go, 'w').close()
        text = lines.rest(300)
    finally:
        lines.kill()
    assert first.returncode == 0, text[-3000:]
    run(build(tmp_path / 'alone', 1))
    assert tree(out) == tree(tmp_path / 'alone')  # the first build whole, nothing of the refused one
    # a build that was killed mid-way: the next one removes what it left and builds
    os.remove(go)
    killed, lines = held_build(build(out, 3), tmp_path / 'hook', go)
    lines.kill()
    assert killed.returncode == -signal.SIGKILL and os.path.isdir(out / '.building')
    run(build(out, 1))
    assert tree(out) == tree(tmp_path / 'alone')


@pytest.mark.parametrize('args', SMALL_BUILDS, ids=['sudoku', 'maze', 'arc'])
def test_ctrl_c_in_a_rebuild_is_one_line_and_leaves_the_previous_dataset_whole(tmp_path, args):
    out = tmp_path / 'd'
    run(args + ['--seed=1', f'--output_dir={out}'])
    before = tree(out)
    proc, lines = held_build(args + ['--seed=2', f'--output_dir={out}'], tmp_path / 'hook', tmp_path / 'go')
    try:
        proc.send_signal(signal.SIGINT)
        text = lines.rest(120)
    finally:
        lines.kill()
    assert proc.returncode == 128 + signal.SIGINT and 'Traceback' not in text, text[-3000:]
    said = lines.seen[lines.seen.index('test hook: the build waits') + 1:]
    assert said == [f"stopped by SIGINT: {out} is as it was before this build"], said
    assert tree(out) == before


SIGINT_IN_UPLOAD = """
from runkeep import gcs
signal.signal(signal.SIGINT, signal.default_int_handler)  # as HELD_BUILD's
def publish_dataset(local_dir, uri):  # Ctrl-C once the dataset is built, while it is uploaded
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
gcs.publish_dataset = publish_dataset
"""


@pytest.mark.parametrize('args', SMALL_BUILDS, ids=['sudoku', 'maze', 'arc'])
def test_ctrl_c_in_the_upload_of_a_built_dataset_says_it_is_built_and_not_uploaded(emu, tmp_path, args):
    """A gs:// output is built in data/upload/... (under the current folder, here tmp_path), then uploaded: a
    Ctrl-C in the upload leaves the new build there, not the folder as it was, and the line says so."""
    uri = 'gs://test-bucket/d'
    p = run(args + [f'--output_dir={uri}'], env=site_hook(tmp_path / 'hook', SIGINT_IN_UPLOAD), check=False,
            cwd=tmp_path)
    local = os.path.join('data', 'upload', 'test-bucket', 'd')
    assert p.returncode == 128 + signal.SIGINT and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert p.stderr.splitlines() == [f"stopped by SIGINT: {local} is built, but its upload to {uri} did not "
                                     "finish: the same command builds and uploads it again"], p.stderr
    assert os.path.isfile(tmp_path / local / 'train' / 'dataset.json')


@pytest.mark.parametrize('args', SMALL_BUILDS, ids=['sudoku', 'maze', 'arc'])
def test_a_gs_output_dir_the_bucket_refuses_stops_the_build_before_it_starts(emu, tmp_path, args):
    # a typo'd bucket said after a build of an hour is an hour lost
    for uri, words in (('gs://no-such-bucket-9/d', ['gs://no-such-bucket-9/d', 'HTTP 404']),
                       ('gs://', ["gs://", 'no bucket'])):
        p = run(args + [f'--output_dir={uri}'], check=False, cwd=tmp_path)
        assert_user_error(p, *words, one_line=True)
        assert not os.path.exists(tmp_path / 'data'), tree(tmp_path)  # nothing was built
