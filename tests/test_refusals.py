"""
Requests that cannot be met are refused at start in one line: test-time views beyond what memory can hold
(train.py --eval_views, solve.py --views), and profile ranges that are not a range of ASCII digits or lie past the
run's last step; a profile that a full disk did not let through is not reported as written. Real processes on
a 4x4 Sudoku dataset built by prepare_sudoku.py.
    python -m pytest -q tests/test_refusals.py
"""
import glob
import os

import pytest

from conftest import TOY_ARGS, assert_user_error, run
from disks import small_disk

ARGS = TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_every_epochs=1000', '--log_interval=2']


@pytest.fixture(scope='module')
def sudoku(tmp_path_factory):
    """A 4x4 Sudoku dataset and a run of 4 steps on it: (data, out_dir)."""
    tmp = tmp_path_factory.mktemp('refusals')
    data, out = tmp / 's4', tmp / 'o'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(data)])
    run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--max_steps=4'] + ARGS)
    return data, out


def one_line(p):
    """The one line a refusal prints (after the config lines that echo the flags)."""
    lines = [l for l in (p.stdout + p.stderr).strip().splitlines() if not l.startswith('config: ')]
    assert len(lines) == 1, p.stdout + p.stderr
    return lines[0]


# -----------------------------------------------------------------------------
# fault 2: more views than memory holds

def test_eval_views_beyond_memory_are_refused_at_start_naming_the_bound(sudoku, tmp_path):
    data, _ = sudoku
    p = run(['train.py', f'--data_path={data}', f'--out_dir={tmp_path / "o"}', '--max_steps=2',
             '--eval_views=100000'] + ARGS, check=False, timeout=60)
    assert_user_error(p, 'eval_views=100000', 'at most')
    line = one_line(p)
    assert 'memory' in line and 'GB' in line, line
    assert not os.path.exists(tmp_path / 'o' / 'ckpt_00000002.pt')


def test_solve_views_beyond_memory_are_refused_at_start_naming_the_bound(sudoku):
    _, out = sudoku
    p = run(['solve.py', f'--init_from={out}/ckpt_00000004.pt', '--index=0', '--eval_views=10000000', '--device=cpu'],
            check=False, timeout=60)
    assert_user_error(p, 'views=10000000', 'at most')
    last = (p.stdout + p.stderr).strip().splitlines()[-1]  # after the line describing the checkpoint
    assert 'memory' in last and 'views=10000000' in last, p.stdout + p.stderr
    assert 'device cpu' not in p.stdout and 'puzzle 1' not in p.stdout  # refused before solving anything


# -----------------------------------------------------------------------------
# fault 5: profile ranges

def test_a_profile_range_of_non_ascii_digits_is_a_config_error(sudoku, tmp_path):
    data, _ = sudoku
    for bad in ('²:3', '1:³', '١:٣'):  # str.isdigit accepts these; int() does not (or reads another digit)
        p = run(['train.py', f'--data_path={data}', f'--out_dir={tmp_path / "o"}', '--max_steps=2',
                 f'--profile_steps={bad}'] + ARGS, check=False, timeout=60)
        assert_user_error(p, 'config error', 'profile_steps')
        one_line(p)


def test_a_profile_range_past_the_last_step_says_so_at_start(sudoku, tmp_path):
    data, _ = sudoku
    out = tmp_path / 'o'
    p = run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--max_steps=4', '--profile_steps=5:10']
            + ARGS, timeout=300)
    said = [l for l in p.stdout.splitlines() if 'profile_steps=5:10' in l]
    assert len(said) == 1 and 'step 4' in said[0], p.stdout
    assert p.stdout.index(said[0]) < p.stdout.index('step 2/'), p.stdout  # at start, before training
    assert not glob.glob(str(out / 'profile' / '*'))


def test_a_profile_a_full_disk_did_not_let_through_is_not_reported_written(sudoku, tmp_path):
    data, _ = sudoku
    out = tmp_path / 'o'
    with small_disk(out / 'profile', '64k'):
        p = run(['train.py', f'--data_path={data}', f'--out_dir={out}', '--max_steps=6', '--profile_steps=2:5']
                + ARGS, check=False, timeout=300)
        written = [l for l in p.stdout.splitlines() if l.startswith('profile of steps')]
        traces = [f for f in os.listdir(out / 'profile') if f.endswith('.json')]
        assert not traces, traces  # the trace did not fit
        assert not written, p.stdout
        assert 'profile' in p.stdout + p.stderr and str(out / 'profile') in p.stdout + p.stderr
    assert os.path.exists(out / 'results.json')  # a lost profile is no reason to lose the run
