"""
Mazes learn: generated 6x6 mazes, the maze quick start's recipe at a smaller size, trained by train.py as a user
runs it, solve held-out mazes. Copying the input (the plateau a model that draws no path sits on) scores 0 exact.
    python -m pytest -q tests/test_maze_learns.py
"""
import json

from conftest import eval_lines, run


def test_a_small_maze_run_solves_held_out_mazes(tmp_path):
    data = tmp_path / 'maze6'
    run(['prepare_maze.py', '--generate', '2000', '--num_test', '200', '--size', '6', '--output_dir', str(data)])
    p = run(['train.py', 'config/maze_quickstart.py', f'--data_path={data}', f'--out_dir={tmp_path}/out',
             '--epochs=12', '--eval_every_epochs=12', '--log_interval=50'], timeout=900)
    final = eval_lines(p.stdout)[-1]
    exact = float(final.split('exact ')[1].split()[0])
    token = float(final.split('token ')[1].split()[0])
    assert final.startswith('eval on 200:'), final
    assert exact > 0.6, final  # copying the input: 0; drawing no path cell caps the token accuracy near 0.8
    assert token > 0.9, final
    with open(tmp_path / 'out' / 'results.json') as f:
        assert abs(json.load(f)['final_eval']['exact_accuracy'] - exact) < 1e-4
