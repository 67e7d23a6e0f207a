"""
A tiny TRM learns, trained by train.py as a user runs it: the toy task (write the input backwards), whose EMA
evaluates at least as well as its raw weights, and generated 6x6 mazes (the maze quick start's recipe at a smaller
size), which it solves held out. Copying the input (the plateau a model that draws no path sits on) scores 0 exact.
    python -m pytest -q tests/test_learns.py
"""
import json

from conftest import TOY_ARGS, eval_lines, run, step_lines


def test_a_tiny_trm_learns_and_its_ema_evaluates_at_least_as_well_as_its_raw_weights(toy, tmp_path):
    # 480 steps at ema_rate 0.999: an EMA without warm-up would still hold 79% of the initial weights at the
    # intermediate evaluation (step 240) and 62% at the end, and evaluate far below the raw weights
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/out', '--epochs=24', '--eval_every_epochs=12',
             '--log_interval=20'] + TOY_ARGS + ['--ema_rate=0.999'])
    rows = step_lines(p.stdout)
    print('\n'.join(l for l in p.stdout.splitlines() if l.startswith(('step', 'eval'))))
    assert rows[-1]['loss'] < 0.5 * rows[0]['loss']
    assert rows[-1]['acc'] > 0.9
    exact = lambda line: float(line.split('exact ')[1].split()[0])
    final = eval_lines(p.stdout)[-1]
    assert exact(final) > 0.5, final  # chance is 4^-8
    assert 'verified' not in final  # no verifier for a toy task
    ema_line = eval_lines(p.stdout)[0]
    raw_line = [l for l in p.stdout.splitlines() if l.startswith('eval of the raw weights (not the EMA) on')]
    assert len(raw_line) == 1  # intermediate evaluations only: the final one is the EMA's
    assert exact(raw_line[0]) > 0.15, raw_line  # the raw weights have learned something by step 240 (chance 4^-8)
    assert exact(ema_line) >= exact(raw_line[0]) - 0.1, (ema_line, raw_line)  # 200 examples: +-0.07 is noise
    with open(f'{tmp_path}/out/metrics.jsonl') as f:
        evals = [json.loads(l) for l in f if '"kind": "eval"' in l]
    assert 'raw' in evals[0] and 'raw' not in evals[-1]
    assert abs(evals[0]['raw']['exact_accuracy'] - exact(raw_line[0])) < 1e-4


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
