"""
Bad datasets: truncated or out-of-vocabulary files, invalid metadata, empty splits, train and test splits that do
not match, a rebuild that fails halfway or happens under a running run: one line naming the file, at start.
"""

import json
import os
import shutil

import numpy as np
import pytest

from conftest import SUDOKU, assert_user_error, Lines, held_step, popen_train, run, train, write_like
from data import building, check_split, write_split


@pytest.fixture(scope='module')
def sudoku4(tmp_path_factory):
    """Generated 4x4 Sudokus (the builder's output): 60 train, 10 test."""
    root = tmp_path_factory.mktemp('s4') / 'd'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(root)])
    return str(root)


def test_train_and_test_splits_of_another_shape_or_puzzle_fail_at_start(sudoku4, tmp_path):
    d = shutil.copytree(sudoku4, tmp_path / 'd')
    shutil.rmtree(os.path.join(d, 'test'))
    write_like(d, 'sudoku', 6, splits=('test',))  # a rebuild to 6x6 that stopped after the test split
    p = train(d, tmp_path / 'o', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, 'start-up checks failed', 'seq_len', '16', '36')
    shutil.rmtree(os.path.join(d, 'test'))
    write_like(d, 'maze', 4, splits=('test',))  # 4x4 mazes: the same shape and vocabulary, another puzzle
    p = train(d, tmp_path / 'o', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, 'start-up checks failed', 'sudoku', 'maze')


def test_test_identifiers_outside_the_train_split_s_table_fail_at_start(sudoku4, tmp_path):
    """The model's puzzle-embedding table is the train split's: a test split that names more puzzles (its own
    dataset.json agreeing) once trained up to the first evaluation and died there in an IndexError."""
    d = shutil.copytree(sudoku4, tmp_path / 'd')
    path = os.path.join(d, 'test', 'dataset.json')
    json.dump(dict(json.load(open(path)), num_puzzle_identifiers=5), open(path, 'w'))
    ids = os.path.join(d, 'test', 'all__puzzle_identifiers.npy')
    a = np.load(ids)
    a[7] = 3
    np.save(ids, a)
    p = train(d, tmp_path / 'o', '--max_steps=2', '--puzzle_emb_ndim=8', args=SUDOKU, check=False)
    assert_user_error(p, 'start-up checks failed', ids, 'identifier 3', 'num_puzzle_identifiers=1')
    assert 'step 1/' not in p.stdout


def files(folder):
    return {n: open(os.path.join(folder, n), 'rb').read() for n in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, n))}


def test_a_rebuild_that_fails_halfway_leaves_the_previous_dataset_whole(tmp_path):
    d, csv = tmp_path / 'd', tmp_path / 'csv'
    run(['prepare_sudoku.py', '--generate', '30', '--size', '4', '--num_test', '5', '--output_dir', str(d)])
    before = {s: files(d / s) for s in ('train', 'test')}
    os.makedirs(csv)
    shutil.copy(d / 'csv' / 'train.csv', csv / 'train.csv')
    (csv / 'test.csv').write_text(open(d / 'csv' / 'test.csv').read() + 'x,12,34,0\n')  # a bad last row
    p = run(['prepare_sudoku.py', '--csv_dir', str(csv), '--subsample_size', '10', '--output_dir', str(d)],
            check=False)
    assert_user_error(p, 'test.csv')
    assert {s: files(d / s) for s in ('train', 'test')} == before
    m = tmp_path / 'm'
    run(['prepare_maze.py', '--generate', '6', '--size', '6', '--num_test', '3', '--min_path_len', '2',
         '--output_dir', str(m)])
    before = {s: files(m / s) for s in ('train', 'test')}
    shutil.copy(m / 'csv' / 'train.csv', csv / 'train.csv')
    (csv / 'test.csv').write_text(open(m / 'csv' / 'test.csv').read() + 'x,#S,#G,1\n')
    p = run(['prepare_maze.py', '--csv_dir', str(csv), '--subsample_size', '3', '--output_dir', str(m)],
            check=False)
    assert_user_error(p, 'test.csv')
    assert {s: files(m / s) for s in ('train', 'test')} == before
    assert all(check_split(str(root), s) == [] for root in (d, m) for s in ('train', 'test'))


def test_a_rebuild_leaves_no_source_of_an_earlier_build_and_never_deletes_the_csvs_it_reads(tmp_path):
    """A --csv_dir rebuild over a --generate output (or an ARC synthetic one) takes away the earlier build's csv/
    (json/, ARC's test files): the folder holds one dataset and its own sources. CSVs the build reads inside the
    folder stay: csv/ is this dataset's source; in a split's folder, which the build replaces, they are refused."""
    d, csv = tmp_path / 'd', tmp_path / 'csv'
    gen = ['prepare_sudoku.py', '--generate', '30', '--size', '4', '--num_test', '5', '--output_dir', str(d)]
    run(gen)
    shutil.copytree(d / 'csv', csv)
    run(['prepare_sudoku.py', '--csv_dir', str(csv), '--output_dir', str(d)])
    assert sorted(os.listdir(d)) == ['identifiers.json', 'test', 'train']
    run(gen)
    run(['prepare_arc.py', '--synthetic', '--canvas=6', '--num_tasks=12', '--num_eval_tasks=4', '--num_aug=3',
         f'--output_dir={d}'])
    assert 'json' in os.listdir(d) and 'csv' not in os.listdir(d)
    run(gen)
    assert sorted(os.listdir(d)) == ['csv', 'identifiers.json', 'test', 'train']
    sources = files(d / 'csv')
    run(['prepare_sudoku.py', '--csv_dir', str(d / 'csv'), '--num_aug', '2', '--output_dir', str(d)])
    assert files(d / 'csv') == sources and json.load(open(d / 'train' / 'dataset.json'))['total_puzzles'] == 90
    m = tmp_path / 'm'
    run(['prepare_maze.py', '--generate', '6', '--size', '6', '--num_test', '3', '--min_path_len', '2',
         '--output_dir', str(m)])
    mazes = files(m / 'csv')
    run(['prepare_maze.py', '--csv_dir', str(m / 'csv'), '--aug', '--output_dir', str(m)])
    assert files(m / 'csv') == mazes and json.load(open(m / 'train' / 'dataset.json'))['total_puzzles'] == 48
    shutil.copytree(m / 'csv', m / 'train' / 'mine')  # CSVs in a folder the build replaces: refused, all kept
    before = {s: files(m / s) for s in ('train', 'test', 'train/mine')}
    p = run(['prepare_maze.py', '--csv_dir', str(m / 'train' / 'mine'), '--output_dir', str(m)], check=False)
    assert_user_error(p, str(m / 'train' / 'mine'), str(m / 'train'), one_line=True)
    assert {s: files(m / s) for s in ('train', 'test', 'train/mine')} == before
    run(['prepare_maze.py', '--csv_dir', str(m / 'csv'), '--output_dir', str(d)])
    assert sorted(os.listdir(d)) == ['identifiers.json', 'test', 'train']


def test_a_dataset_rebuilt_under_a_running_run_is_not_the_one_it_evaluates_and_the_builder_says_so(tmp_path):
    d, out = tmp_path / 'd', tmp_path / 'o'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(d)])
    go = tmp_path / 'go'
    proc = popen_train(d, out, '--max_steps=6', '--log_interval=1', args=SUDOKU,
                       env=held_step(tmp_path / 'hook', 3, go))  # its third step waits for `go`
    lines = Lines(proc)
    lines.until('test hook: step 3 waits')  # the rebuild happens mid-run, however far the run would have got
    try:
        p = run(['prepare_sudoku.py', '--generate', '40', '--size', '6', '--num_test', '7', '--output_dir', str(d)])
    finally:
        go.touch()
    warning = [l for l in p.stdout.splitlines() if l.startswith('warning')]
    assert warning and f'pid {proc.pid}' in warning[0] and str(out) in warning[0], p.stdout
    text = lines.rest(300)
    assert proc.returncode == 0 and 'Traceback' not in text, text[-3000:]
    assert 'eval on 10:' in text  # the 4x4 test split it started with, not the 7 6x6 ones now there
    assert json.load(open(out / 'results.json'))['final_eval']['count'] == 10
    assert json.load(open(d / 'test' / 'dataset.json'))['seq_len'] == 36  # the rebuild itself went through
    assert not [n for n in os.listdir(d) if n.startswith('.in_use')]  # the run's mark went with it


def copy_dataset(toy, dest):
    shutil.copytree(toy, dest)
    return str(dest)


def test_truncated_test_labels_fail_at_start(toy, tmp_path):
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'test', 'all__labels.npy')
    data = open(path, 'rb').read()
    open(path, 'wb').write(data[:len(data) // 2])
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, 'all__labels.npy', 'start-up checks failed')
    assert 'step 1/' not in p.stdout and not os.path.exists(tmp_path / 'o' / 'metrics.jsonl')


@pytest.mark.parametrize('content,said', [
    (b'', 'the file is empty'),  # a copy that stopped at 0 bytes: numpy's EOFError was a traceback
    (b'hello\n', "not a .npy file (it lacks numpy's header)"),  # numpy read it as a pickle: allow_pickle advised
])
def test_an_array_file_that_is_empty_or_no_npy_file_is_one_line_naming_it(toy, tmp_path, content, said):
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'train', 'all__inputs.npy')
    open(path, 'wb').write(content)
    assert check_split(d, 'train') == [f"cannot read {path}: {said}"]
    if not content:
        p = train(d, tmp_path / 'o', check=False)
        assert_user_error(p, 'start-up checks failed', path, said)
        assert 'step 1/' not in p.stdout


def test_out_of_vocabulary_tokens_are_reported_with_file_and_row(toy, tmp_path):
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'train', 'all__labels.npy')
    labels = np.load(path)
    labels[737, 3] = 99
    np.save(path, labels)
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, 'train/all__labels.npy row 737, position 3: token 99 is outside the vocabulary [0, 6)')


def test_invalid_dataset_json_names_the_file(toy, tmp_path):
    d = copy_dataset(toy, tmp_path / 'd')
    open(os.path.join(d, 'test', 'dataset.json'), 'w').write('{"pad_id": 0,')
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, os.path.join('test', 'dataset.json'))



def test_a_missing_dataset_names_every_builder(tmp_path):
    """An ARC recipe's missing dataset is not sent to the Sudoku and maze builders alone."""
    p = train(tmp_path / 'none', tmp_path / 'o', check=False)
    assert_user_error(p, 'no dataset at', 'prepare_sudoku.py', 'prepare_maze.py', 'prepare_arc.py')

@pytest.mark.parametrize('name,change,said', [
    ('puzzle_identifiers', lambda a: a[:-5], 'holds 995 puzzle identifiers; all__puzzle_indices.npy holds 1000 '
                                              'puzzles'),  # was blamed on all__puzzle_indices.npy
    ('puzzle_indices', lambda a: a[:, None], 'has shape (1001, 1); it must be one-dimensional, not empty'),  # a traceback
    ('puzzle_indices', lambda a: a[:0], 'has shape (0,); it must be one-dimensional, not empty'),  # a traceback
    ('group_indices', lambda a: a[:0], 'has shape (0,); it must be one-dimensional, not empty'),
    ('inputs', lambda a: a + 0.5, 'holds float64 values; it must hold integers'),  # trained on, truncated
])
def test_index_arrays_of_the_wrong_length_shape_or_type_are_one_line_naming_the_file(toy, tmp_path, name, change,
                                                                                     said):
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'train', f'all__{name}.npy')
    np.save(path, change(np.load(path)))
    assert check_split(d, 'train') == [f"{path} {said}"]


@pytest.mark.parametrize('field,value,allowed', [
    ('seq_len', '8', 'a whole number >= 1'),  # a string: the shape check read it as a shape it was not
    ('vocab_size', 6.0, 'a whole number >= 1'),
    ('num_puzzle_identifiers', '1', 'a whole number >= 1'),
    ('mean_puzzle_examples', 0, 'a number > 0'),  # was blamed on --epochs ("less than one step")
    ('pad_id', 99, 'a whole number in [0, 6)'),  # the padded rows of an evaluation: an IndexError there
    ('blank_identifier_id', 5, 'a whole number in [0, 1)'),
])
def test_a_dataset_json_field_of_the_wrong_type_or_range_is_one_line_naming_it(toy, tmp_path, field, value,
                                                                               allowed):
    """A hand-edited or foreign dataset.json: the file, the field, its value and what it may be, at start (a
    padding id outside its table once trained a run up to its first evaluation and died there in a traceback)."""
    d = copy_dataset(toy, tmp_path / 'd')
    path = os.path.join(d, 'test', 'dataset.json')
    meta = json.load(open(path))
    json.dump(dict(meta, **{field: value}), open(path, 'w'))
    assert check_split(d, 'test') == [f"{path}: the field {field} is {value!r}; it must be {allowed}"]
    if field == 'blank_identifier_id':
        p = train(d, tmp_path / 'o', '--puzzle_emb_ndim=8', '--max_steps=2', check=False)
        assert_user_error(p, 'start-up checks failed', path, field)
        assert 'step 1/' not in p.stdout


def test_a_dataset_json_whose_counts_disagree_with_its_arrays_is_one_line_naming_the_value_they_imply(sudoku4,
                                                                                                     tmp_path):
    """The run's length is epochs x groups x mean_puzzle_examples / batch: a mean_puzzle_examples of 3 over arrays of
    one example a puzzle trained three times the steps (and stretched the schedule) without a word. total_puzzles is
    not checked: the reference's builders write the group count there for augmented Sudoku and Maze sets."""
    d = shutil.copytree(sudoku4, tmp_path / 'd')
    path = os.path.join(d, 'train', 'dataset.json')
    meta = json.load(open(path))
    groups = np.arange(0, 61, 4)  # the reference's augmented layout: 15 groups of 4, total_puzzles the group count
    np.save(os.path.join(d, 'train', 'all__group_indices.npy'), groups.astype(np.int32))
    json.dump(dict(meta, total_groups=15, total_puzzles=15, mean_puzzle_examples=1), open(path, 'w'))
    assert check_split(d, 'train') == []
    json.dump(dict(meta, total_groups=15, mean_puzzle_examples=3), open(path, 'w'))
    assert check_split(d, 'train') == [f"{path}: the field mean_puzzle_examples is 3; the arrays hold 60 examples in "
                                       "60 puzzles, so it must be 1 (a run's length is taken from it)"]
    p = train(d, tmp_path / 'o', '--max_steps=2', args=SUDOKU, check=False)
    assert_user_error(p, 'start-up checks failed', path, 'mean_puzzle_examples is 3', 'must be 1')
    assert 'step 1/' not in p.stdout
    json.dump(dict(meta, total_groups=60), open(path, 'w'))
    assert check_split(d, 'train') == [f"{path}: the field total_groups is 60; all__group_indices.npy holds 15 "
                                       "groups, so it must be 15"]


def test_empty_splits_are_refused_by_the_builders_and_the_trainer(toy, tmp_path):
    p = run(['prepare_sudoku.py', '--generate', '0', '--size', '4', '--num_test', '10',
             '--output_dir', str(tmp_path / 'g')], check=False)
    assert_user_error(p, 'no examples')
    p = run(['prepare_sudoku.py', '--generate', '40', '--size', '4', '--num_test', '0',
             '--output_dir', str(tmp_path / 'h')], check=False)
    assert_user_error(p, 'no examples')
    # a dataset emptied by hand: the trainer stops at start with the path (it used to loop forever)
    d = copy_dataset(toy, tmp_path / 'd')
    meta = json.load(open(os.path.join(d, 'train', 'dataset.json')))
    z = np.zeros((0, 8), np.int32)
    np.save(os.path.join(d, 'train', 'all__inputs.npy'), z)
    np.save(os.path.join(d, 'train', 'all__labels.npy'), z)
    np.save(os.path.join(d, 'train', 'all__puzzle_identifiers.npy'), np.zeros(0, np.int32))
    np.save(os.path.join(d, 'train', 'all__puzzle_indices.npy'), np.zeros(1, np.int32))
    np.save(os.path.join(d, 'train', 'all__group_indices.npy'), np.zeros(1, np.int32))
    assert meta['vocab_size'] == 6
    p = train(d, tmp_path / 'o', check=False)
    assert_user_error(p, 'holds no examples')


def test_a_split_a_filter_leaves_empty_is_named_with_the_option_not_the_build_s_folder(tmp_path):
    """--min_difficulty above every rating, --subsample_size 0: one line naming the cause and the CSV or option;
    never the builder's .building folder (gone after the failure)."""
    g, out = tmp_path / 'g', tmp_path / 'o'
    run(['prepare_sudoku.py', '--generate', '20', '--size', '4', '--num_test', '5', '--output_dir', str(g)])
    top = max(int(line.rsplit(',', 1)[1]) for line in open(g / 'csv' / 'train.csv').read().splitlines()[1:])
    args = ['prepare_sudoku.py', '--csv_dir', str(g / 'csv'), '--output_dir', str(out)]
    p = run(args + ['--min_difficulty', str(top + 1)], check=False)
    err = assert_user_error(p, f'--min_difficulty {top + 1}', str(g / 'csv' / 'train.csv'), f'highest rating: {top}',
                            one_line=True)
    assert '.building' not in err and not os.path.exists(out)
    err = assert_user_error(run(args + ['--subsample_size', '0'], check=False), '--subsample_size 0', one_line=True)
    assert '.building' not in err and not os.path.exists(out)
    with pytest.raises(ValueError) as e:  # a builder that does not say why: the dataset's folder, as given
        with building(str(out)) as tmp:
            write_split(tmp, 'train', np.zeros((0, 4)), np.zeros((0, 4)), [], [0], [0], vocab_size=3)
    assert str(e.value) == f"the train split of {out} would hold no examples: a run could not use it"


def test_start_up_data_check_is_fast_on_a_sudoku_extreme_sized_dataset(tmp_path):
    """1M examples of 81 tokens (the full Sudoku-Extreme train split's scale): the check runs through every
    row and still finds a bad token in the last one. (Its time is printed by -s, never asserted.)"""
    import time

    from data import check_split
    n, L = 1_000_000, 81
    x = np.random.default_rng(0).integers(1, 11, (n, L), dtype=np.int32)
    idx = np.arange(n + 1, dtype=np.int32)
    write_split(str(tmp_path), 'train', x, x, np.zeros(n, np.int32), idx, idx, vocab_size=11)
    t0 = time.perf_counter()
    assert check_split(str(tmp_path), 'train') == []
    print(f"\ncheck_split on {n:,} x {L}: {time.perf_counter() - t0:.2f} s")
    labels = np.load(tmp_path / 'train' / 'all__labels.npy', mmap_mode='r+')
    labels[-1, -1] = 11
    labels.flush()
    assert 'row 999999, position 80: token 11' in check_split(str(tmp_path), 'train')[0]
