"""
Evaluating a finished run again, and the weights a run starts from: --eval_only with more steps than the run
trained with (test-time scaling), a study's re-evaluation names the checkpoint step of every row and refuses a
corrupt final checkpoint (train.py's own refusal is in tests/test_checkpoints.py), weights of one puzzle kind are
refused on another kind's data on every path that loads them, results.json always belongs to the last checkpoint,
and a corrupt --init_from file is one line. Real processes on the toy task and on 4x4 Sudokus and mazes built by
prepare_sudoku.py and prepare_maze.py.
    python -m pytest -q tests/test_reevaluate.py
"""
import csv
import json
import os
import shutil
import signal

import pytest

from conftest import ROOT, TOY_ARGS, assert_user_error, eval_lines, run, site_hook, train


def corrupt(path):
    """Keep the first half of a file: a checkpoint cut short."""
    data = open(path, 'rb').read()
    open(path, 'wb').write(data[:len(data) // 2])


def test_eval_only_with_test_time_scaling(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=5', '--log_interval=5')
    p = train(toy, out, f'--init_from={out}/ckpt_00000005.pt', '--eval_only=True', '--eval_steps=6',
              '--log_interval=5')
    line = eval_lines(p.stdout)[-1]
    assert 'loaded weights from' in p.stdout and 'eval on 200' in line
    by_steps = line.split('exact by steps: ')[1].split()
    assert [s.split(':')[0] for s in by_steps] == ['1', '2', '3', '4', '5', '6']
    exact_at_4 = float(line.split('exact ')[1].split()[0])
    assert abs(float(by_steps[3].split(':')[1]) - exact_at_4) < 1e-3  # the headline is at halt_max_steps
    assert 'with q_halt stop' in line


# -----------------------------------------------------------------------------
# a study's re-evaluation

def test_a_study_re_evaluation_refuses_a_corrupt_final_checkpoint_and_names_each_row_s_step(tmp_path):
    tmp, out = str(tmp_path), tmp_path / 'out'
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'rec_L2.py'), tmp_path / 'cfg')
    study = ['study.py', '--pattern=rec_L2', f'--config_dir={tmp}/cfg', f'--out_root={out}',
             f'--data_root={tmp}/data', '--scale=cpu',
             '--extra=--max_steps=40 --checkpoint_interval=20 --log_interval=20']
    run(study)
    # the report's test-time rows name the checkpoint step they evaluated
    run(study + ['--eval_only=True', '--eval_views=1,2', '--eval_steps=4'])
    run(study + ['--report=True'])
    rows = list(csv.DictReader(open(out / 'report_views.csv')))
    assert rows and all(r.get('checkpoint_step') == '40' for r in rows), rows
    md = open(out / 'report.md').read().split('## Test-time compute')[1]
    table = [l for l in md.splitlines() if l.startswith('| rec_L2 ')]
    header = next(l for l in md.splitlines() if l.startswith('| run '))
    problems = [] if 'checkpoint' in header and table and all('| 40 |' in l for l in table) else [md]
    # the final checkpoint corrupt: the re-evaluation is refused, not made of step 20's weights
    shutil.rmtree(out / 'rec_L2' / 'evals')
    corrupt(out / 'rec_L2' / 'ckpt_00000040.pt')
    p = run(study + ['--eval_only=True', '--eval_views=1,2', '--eval_steps=4'], check=False)
    # the summary's lines, not the report printed after it (whose table says the training is done)
    summary = p.stdout.split('summary of the test-time evaluations')[-1].split('\n\n')[0]
    assert p.returncode != 0 and 'ckpt_00000040.pt' in p.stdout + p.stderr, p.stdout[-3000:] + p.stderr[-3000:]
    assert not any(' done' in l for l in summary.splitlines() if 'rec_L2' in l), summary
    assert not os.path.exists(out / 'rec_L2' / 'evals' / 'views2-steps4.json')
    assert not problems, problems[0]  # report.md's test-time rows without the checkpoint step


# -----------------------------------------------------------------------------
# fault 7: a checkpoint of one kind on another kind's data (4x4 Sudoku and 4x4 maze: the same shapes)

@pytest.fixture(scope='module')
def sudoku_and_maze(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('kinds')
    sudoku, maze, out = tmp / 's4', tmp / 'm4', tmp / 'o'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(sudoku)])
    run(['prepare_maze.py', '--generate', '20', '--size', '4', '--num_test', '5', '--min_path_len', '2',
         '--output_dir', str(maze)])
    train(sudoku, out, '--max_steps=4', args=TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_every_epochs=1000'])
    return sudoku, maze, out


def test_a_sudoku_checkpoint_is_refused_on_maze_data_on_every_path(sudoku_and_maze, tmp_path):
    sudoku, maze, out = sudoku_and_maze
    args = TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_every_epochs=1000']
    ckpt = out / 'ckpt_00000004.pt'
    p = train(maze, out, '--init_from=resume', '--eval_only=True', args=args, check=False)
    assert_user_error(p, 'maze')  # the resume path refuses it already
    for extra in (['--eval_only=True'], ['--max_steps=6']):  # evaluated, or trained on
        p = train(maze, tmp_path / 'new', f'--init_from={ckpt}', *extra, args=args, check=False)
        assert_user_error(p, 'maze', 'Sudoku')
        assert 'eval on' not in p.stdout


# -----------------------------------------------------------------------------
# fault 10: results.json of an older step beside a newer checkpoint

def test_results_json_always_belongs_to_the_last_checkpoint(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=8')
    assert json.load(open(out / 'results.json'))['step'] == 8
    # trained on, and killed right after a checkpoint past the finished step (SIGKILL, sent by the run itself:
    # however fast the machine, the run is gone before its end)
    kill = site_hook(tmp_path / 'hook', """from runkeep import checkpoint
real = checkpoint.write_checkpoint


def write_checkpoint(state, path, *args, **kwargs):
    real(state, path, *args, **kwargs)
    if str(path).endswith('ckpt_00000012.pt'):
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.write_checkpoint = write_checkpoint
""")
    p = train(toy, out, '--init_from=resume', '--max_steps=40', '--checkpoint_interval=12', check=False, env=kill)
    assert p.returncode == -signal.SIGKILL, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / 'ckpt_00000012.pt').exists()
    assert not (out / 'results.json').exists() or json.load(open(out / 'results.json'))['step'] == 12
    # the run ended at step 12 now: its results.json is rebuilt for that step
    p = train(toy, out, '--init_from=resume', '--max_steps=12')
    assert json.load(open(out / 'results.json'))['step'] == 12, p.stdout


# -----------------------------------------------------------------------------
# fault 11: a corrupt --init_from file

def test_a_corrupt_init_from_file_is_one_line_naming_it(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4')
    corrupt(out / 'ckpt_00000004.pt')
    garbage = tmp_path / 'garbage.pt'
    garbage.write_bytes(b'not a checkpoint at all\n' * 100)
    for f in (garbage, out / 'ckpt_00000004.pt'):
        for extra in (['--eval_only=True'], ['--max_steps=2']):
            p = train(toy, tmp_path / 'new', f'--init_from={f}', *extra, check=False)
            assert_user_error(p, str(f))
            text = p.stdout + p.stderr
            assert 'weights_only' not in text, text[-3000:]
            said = [l for l in text.strip().splitlines() if not l.startswith(('config: ', 'device '))]
            assert len(said) == 1, text[-3000:]  # after the flags echoed and the device line
