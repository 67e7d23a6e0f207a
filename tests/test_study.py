"""
study.py: the experiment grid as config files, its dry run (commands and costs of the full grid), and a tiny
study run for real at the cpu scale (2 families x 2 runs, a few dozen steps each): results written, finished
runs skipped, a run killed mid-way resumed from its checkpoint, a failing run reported while the others
run, a stop request to study.py passed on to train.py, and the report's table and plots.
    python -m pytest -q tests/test_study.py
"""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from runkeep import gcs
from conftest import BUCKET, ROOT, alive, children, fresh_checkout, held_step, run, script_env, site_hook
from configurator import config_files, read_config_block
from studies.plan import Options, load_experiments
from studies.report import collect, plot_ablations, plot_fits, plot_supervision_steps, points

STUDY = os.path.join(ROOT, 'config', 'study')
BASE = {'config/baseline.py': 'data/sudoku-extreme-1k-aug-1000', 'config/maze.py': 'data/maze-30x30-hard-1k'}
# the grid of the issue: family -> {point: the keys it changes from its base recipe (the base point: none)}
# a width point's puzzle embedding is as wide as its model, as the reference's (puzzle_emb_ndim: ${.hidden_size})
SUDOKU_SIZE = {**{f'd{d}': {'hidden_size': d, 'puzzle_emb_ndim': d} for d in (256, 384, 768, 1024)}, 'd512': {},
               'L1': {'L_layers': 1}, 'L2': {}, 'L4': {'L_layers': 4}}
SUDOKU_REC = {f'L{n}': ({'L_cycles': n} if n != 6 else {}) for n in (2, 4, 6, 8, 10)}
TN = {(2, 2), (2, 6), (3, 4), (3, 6), (4, 6)}
GRID = {
    'size': SUDOKU_SIZE,
    'rec': SUDOKU_REC,
    'tn': {f'T{t}n{n}': {k: v for k, v in (('H_cycles', t), ('L_cycles', n)) if v != {'H_cycles': 3, 'L_cycles': 6}[k]}
           for t, n in TN},
    'data': {str(k): ({'data_path': f'data/sudoku-extreme-{k}-aug-1000'} if k != 1000 else {})
             for k in (100, 250, 500, 1000, 2000, 5000)},
    'aug': {str(a): ({'data_path': f'data/sudoku-extreme-1k-aug-{a}'} if a != 1000 else {})
            for a in (10, 100, 500, 1000, 2000)},
    'abl': {'noema': {'ema': False}, 'halt8': {'halt_max_steps': 8}, 'halt16': {}, 'halt32': {'halt_max_steps': 32},
            'attn': {'mlp_t': False, 'pos_encodings': 'rope'}, 'actcont': {'no_ACT_continue': False},
            'halt1': {'halt_max_steps': 1}, 'halt2': {'halt_max_steps': 2}, 'noemb': {'puzzle_emb_ndim': 0}},
    'lr': {'3e-5': {'lr': 3e-5}, '1e-4': {}, '3e-4': {'lr': 3e-4}, '1e-3': {'lr': 1e-3}},
    # square-root lr scaling with the batch, rounded to 3 digits in the files
    'bs': {str(b): ({'global_batch_size': b, 'lr': float(f"{1e-4 * (b / 768) ** 0.5:.3g}")} if b != 768 else {})
           for b in (256, 512, 768, 1536, 3072, 6144)},
    'maze_size': SUDOKU_SIZE,
    'maze_rec': {f'L{n}': ({'L_cycles': n} if n != 4 else {}) for n in (2, 4, 6, 8, 10)},
    'maze_tn': {f'T{t}n{n}': {k: v for k, v in (('H_cycles', t), ('L_cycles', n)) if v != {'H_cycles': 3, 'L_cycles': 4}[k]}
                for t, n in TN},
    'arc_aug': {str(a): ({'data_path': f'data/arc1concept-aug-{a}'} if a != 1000 else {}) for a in (100, 300, 1000)},
    'arc_rec': {f'L{n}': ({'L_cycles': n} if n != 4 else {}) for n in (2, 4, 6)},
    'arc_emb_len': {str(k): ({'puzzle_emb_len': k} if k != 16 else {}) for k in (4, 16, 32)},
}
NAMES = [f'{fam}_{p}' for fam, pts in GRID.items() for p in pts]
CPU_RUN = ['--scale=cpu', "--extra=--max_steps=40 --checkpoint_interval=10 --log_interval=10"]


def effective(path):
    """(train.py's config as configurator.py applies the file: defaults, its _base, the file), its own names)"""
    d = {k: v for k, (v, _) in read_config_block(os.path.join(ROOT, 'train.py')).items()}
    for _, keys in config_files(os.path.join(ROOT, path)):
        d.update(keys)
    scope = {}
    exec(open(os.path.join(ROOT, path)).read(), {}, scope)
    return d, scope


def test_the_grid_is_one_file_per_experiment_each_its_base_plus_the_studied_keys():
    files = sorted(f[:-3] for f in os.listdir(STUDY) if f.endswith('.py'))
    assert sorted(NAMES) == files
    train_keys = set(read_config_block(os.path.join(ROOT, 'train.py')))
    out_dirs = {}
    for name in NAMES:
        fam, point = name.rsplit('_', 1)
        cfg, scope = effective(f'config/study/{name}.py')
        assert set(k for k in scope if not k.startswith('_')) <= train_keys, name
        base_cfg, _ = effective(scope['_base'])
        assert scope['_base'] == ('config/maze.py' if fam.startswith('maze') else 'config/arc1.py'
                                  if fam.startswith('arc') else 'config/baseline.py'), name
        diff = {k: cfg[k] for k in cfg if cfg[k] != base_cfg[k] and k not in ('out_dir', 'wandb_run_name')}
        assert diff == GRID[fam][point], (name, diff)
        # the file holds only what the run changes: nothing it repeats from its base
        assert {k for k in scope if not k.startswith('_')} == {'out_dir', 'wandb_run_name'} | set(diff), name
        shared = 'maze_base' if fam.startswith('maze') else 'arc_base' if fam.startswith('arc') else 'base'
        same = {'tn_T3n4': 'rec_L4', 'maze_tn_T3n6': 'maze_rec_L6'}  # one configuration in two families: one run
        assert cfg['out_dir'] == f"out/study/{shared if not diff else same.get(name, name)}", name
        out_dirs.setdefault(cfg['out_dir'], []).append(name)
    # one out_dir per distinct run: only the base points share one
    assert {d: n for d, n in out_dirs.items() if len(n) > 1} == {
        'out/study/base': ['size_d512', 'size_L2', 'rec_L6', 'tn_T3n6', 'data_1000', 'aug_1000', 'abl_halt16',
                           'lr_1e-4', 'bs_768'],
        'out/study/maze_base': ['maze_size_d512', 'maze_size_L2', 'maze_rec_L4', 'maze_tn_T3n4'],
        'out/study/arc_base': ['arc_aug_1000', 'arc_rec_L4', 'arc_emb_len_16'],
        'out/study/rec_L4': ['rec_L4', 'tn_T3n4'], 'out/study/maze_rec_L6': ['maze_rec_L6', 'maze_tn_T3n6']}
    # and no configuration is trained twice under two out_dirs
    runs = {}
    for name in NAMES:
        cfg, _ = effective(f'config/study/{name}.py')
        runs.setdefault(json.dumps({k: v for k, v in cfg.items() if k not in ('out_dir', 'wandb_run_name')},
                                   sort_keys=True), set()).add(cfg['out_dir'])
    assert all(len(dirs) == 1 for dirs in runs.values()), [d for d in runs.values() if len(d) > 1]


def test_help_and_the_list_of_families():
    p = run(['study.py', '--help'])
    for key in ('--pattern=', '--scale=', '--dry_run=', '--report=', '--nproc=', '--examples_per_s=', '--out_root='):
        assert key in p.stdout
    p = run(['study.py'])
    for fam in GRID:
        assert f"{fam}_*" in p.stdout
    p = run(['study.py', '--pattern=nothing_*'], check=False)
    assert p.returncode != 0 and 'no experiment matches' in p.stderr + p.stdout


def test_dry_run_of_the_full_grid_prints_every_command_and_cost(tmp_path):
    fresh = fresh_checkout(tmp_path / 'checkout')
    p = run(['study.py', "--pattern=*", '--dry_run=True', '--examples_per_s=1000'], cwd=fresh)
    out = p.stdout
    blocks = {b.split()[0]: b for b in re.split(r'\n(?=\S)', out) if b.strip() and not b.startswith('config:')}
    # four groups of experiments that are one configuration: each group's first name (in order) runs, the others
    # say 'same run as'
    groups = [{'size_L2', 'rec_L6', 'tn_T3n6', 'data_1000', 'aug_1000', 'abl_halt16', 'size_d512', 'lr_1e-4', 'bs_768'},
              {'maze_size_L2', 'maze_rec_L4', 'maze_tn_T3n4', 'maze_size_d512'}, {'rec_L4', 'tn_T3n4'},
              {'maze_rec_L6', 'maze_tn_T3n6'}, {'arc_aug_1000', 'arc_rec_L4', 'arc_emb_len_16'}]
    shared = set().union(*groups)
    for name in NAMES:
        b = blocks[name]
        if 'same run as' in b:
            assert name in shared, name
            continue
        assert f"python train.py config/study/{name}.py " in b and '--init_from=resume' in b, b
        assert re.search(r"[\d,]+ parameters \| [\d.e+]+ GFLOPs per example-step \| [\d,]+ steps", b), b
        assert re.search(r"training [\d.e+]+ FLOPs", b) and 'about ' in b, b
    assert sum('same run as' in blocks[n] for n in NAMES) == len(shared) - len(groups)  # one of each group runs
    assert 'same run as rec_L4' in blocks['tn_T3n4'] and 'same run as maze_rec_L6' in blocks['maze_tn_T3n6']
    # the paper's figures: 5,028,866 parameters, 65,104 steps (50,000 epochs x 1,000 puzzles / 768)
    base = next(blocks[n] for n in ('abl_halt16', 'size_d512', 'bs_768', 'lr_1e-4') if 'same run' not in blocks[n])
    assert '5,028,866 parameters' in base and '42.7 GFLOPs' in base and '65,104 steps' in base
    assert '325,520 steps' in blocks['data_5000']  # 5,000 puzzles: 5x the steps at the same epochs
    assert 'prepare_sudoku.py --output_dir data/sudoku-extreme-5000-aug-1000 --subsample_size 5000 --num_aug 1000' \
        in blocks['data_5000']
    assert 'prepare_maze.py --output_dir data/maze-30x30-hard-1k' in blocks['maze_rec_L2']
    assert '6,828,034 parameters' in blocks['abl_attn']
    assert re.search(r'total: 60 costed run\(s\), training [\d.e+]+ FLOPs.*about', out)  # 75 files, 60 runs
    assert '195,312 steps x batch 256' in blocks['bs_256'] and '--lr=5.77e-05' not in blocks['bs_256']  # in the file
    # without a speed figure it says so; the other scales print their flags
    p = run(['study.py', '--pattern=rec_L2', '--dry_run=True', '--scale=gpu'], cwd=fresh)
    assert 'no speed figure given' in p.stdout and '--epochs=5000' in p.stdout
    p = run(['study.py', '--pattern=maze_rec_L2', '--dry_run=True', '--scale=cpu'], cwd=fresh)
    assert '--hidden_size=32' in p.stdout and 'prepare_maze.py --generate' in p.stdout and '--max_steps' not in p.stdout


def test_the_cost_of_a_run_with_frozen_weights_counts_the_step_train_py_runs(tmp_path):
    # freeze_weights=True (config/adapt's adapt_emb_*): train.py's step computes no weight gradients, and its
    # results.json counts that step; the plan counts the same one, so planned and finished runs share one axis.
    # Sudoku mlp_t, 3 x (6 + 1) net calls: 21 forward, 7 backward (activations 1x, the weights' gradients 1x
    # more when they train), so the frozen step is about 28/35 of the trained one
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    for name, frozen in (('fz_off', False), ('fz_on', True)):
        (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n"
                                        f"hidden_size = 32\npuzzle_emb_ndim = 32\nfreeze_weights = {frozen}\n")
    p = run(['study.py', '--pattern=fz_*', f'--config_dir={cfg}', f'--out_root={tmp_path}/out', '--dry_run=True'])
    blocks = {b.split()[0]: b for b in re.split(r'\n(?=\S)', p.stdout) if b.startswith('fz_')}
    fpe = {name: re.search(r'([\d.e+]+) GFLOPs per example-step', b).group(1) for name, b in blocks.items()}
    assert fpe.keys() == {'fz_off', 'fz_on'}, p.stdout
    assert abs(float(fpe['fz_on']) / float(fpe['fz_off']) - 0.8) < 0.01, fpe


def study_args(tmp, pattern, *more):
    return ['study.py', f'--pattern={pattern}', f'--config_dir={tmp}/cfg', f'--out_root={tmp}/out',
            f'--data_root={tmp}/data'] + CPU_RUN + list(more)


def start(args, env=None):
    return subprocess.Popen([sys.executable] + args, cwd=ROOT, env=script_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(cond, timeout=300):
    t = time.time()
    while not cond():
        assert time.time() - t < timeout
        time.sleep(0.02)


def held_after_step_10(tmp, *names, slow=False):
    """The study's train.py runs of these experiments wait in step 11 (their checkpoint at 10 written) until a
    stop request: a test kills them there however fast the machine (slow: see held_step)."""
    return held_step(f'{tmp}/hook', 11, argv=[f'/{n}' for n in names], slow=slow)


@pytest.fixture
def tiny_grid(tmp_path):
    """Two families of two runs each, the real files, plus two that fail: a value only train.py refuses (only the
    puzzle embedding trains, and the cpu scale has none; the study refuses what configurator.py's rules do) and a
    dataset nothing can build."""
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    for name in ('rec_L2', 'rec_L4', 'size_d256', 'size_d384'):
        shutil.copy(os.path.join(STUDY, name + '.py'), cfg)
    (cfg / 'bad_value.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_value'\n"
                                      "data_path = 'data/sudoku-extreme-1k-aug-1000'\nfreeze_weights = True\n")
    (cfg / 'bad_nodata.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_nodata'\n"
                                       "data_path = 'data/no-such-dataset'\n")
    return str(tmp_path)


def test_an_experiment_file_is_one_scope_its_comprehensions_read_its_names(tmp_path):
    (tmp_path / 'cfg').mkdir()
    (tmp_path / 'cfg' / 'rec_x.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/rec_x'\n_n = 2\n"
                                               "L_cycles = [_n * i for i in range(3)][-1]\n")
    p = run(study_args(tmp_path, 'rec_x', '--dry_run=True'))
    assert 'rec_x  [rec: L_cycles=4]' in p.stdout, p.stdout


def test_a_study_runs_skips_resumes_reports_failures_and_compares(tiny_grid):
    tmp = tiny_grid
    out = f'{tmp}/out'
    # 1: kill the first run's train.py (SIGKILL) once it has saved a checkpoint; the study goes on
    p = start(study_args(tmp, 'rec_*,bad_*,size_*'), env=held_after_step_10(tmp, 'rec_L2'))
    wait_for(lambda: os.path.exists(f'{out}/rec_L2/ckpt_00000010.pt') or p.poll() is not None)
    assert not os.path.exists(f'{out}/rec_L2/results.json')
    for kid in children(p.pid):
        os.kill(kid, signal.SIGKILL)
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 1, text
    assert 'building ' in text and 'prepare_sudoku.py --generate 1000 --size 4' in text
    summary = text.split('study: summary')[1]
    assert re.search(r'rec_L2 +FAILED +exit code -9', summary), summary
    assert re.search(r'bad_value +FAILED +exit code 1: .*freeze_weights=True', summary), summary
    assert re.search(r'bad_nodata +FAILED +dataset data/no-such-dataset is missing and no rule builds it', summary)
    for name in ('rec_L4', 'size_d256', 'size_d384'):  # after the failures, the others ran
        assert re.search(rf'{name} +done', summary), summary
        res = json.load(open(f'{out}/{name}/results.json'))
        assert res['step'] == 40 and 0 <= res['final_eval']['exact_accuracy'] <= 1
    assert json.load(open(f'{out}/size_d256/results.json'))['config']['hidden_size'] == 16  # 256 / 16 at cpu scale
    assert json.load(open(f'{out}/rec_L4/results.json'))['config']['L_cycles'] == 4

    # a later report tells the failed runs from running ones: the study ended each one's train.log with its word
    p = run(study_args(tmp, 'rec_*,bad_*', '--report=True'))
    md = open(f'{out}/report.md').read()
    for name in ('rec_L2', 'bad_value', 'bad_nodata'):
        assert re.search(rf'\| {name} \|.*\| FAILED \|$', md, re.M), md
    assert 'report: rec_L2: FAILED exit code -9 (killed by SIGKILL)' in p.stdout, p.stdout
    assert re.search(r'report: bad_value: FAILED exit code 1: .*freeze_weights=True', p.stdout), p.stdout

    # 2: rerun: finished runs skipped, the killed one resumed from its checkpoint, the failures again reported
    p = run(study_args(tmp, 'rec_*,bad_*,size_*'), check=False)
    assert p.returncode == 1
    assert '3 finished before, 3 to run' in p.stdout
    assert re.search(r'rec_L2 \[L_cycles=2\]: resuming from its checkpoint at step 10\b', p.stdout), p.stdout
    assert 'resuming from' in open(f'{out}/rec_L2/train.log').read()
    for name in ('rec_L4', 'size_d256', 'size_d384'):
        assert f'study: {name} [' not in p.stdout  # not started again
    summary = p.stdout.split('study: summary')[1]
    assert re.search(r'rec_L2 +done', summary) and re.search(r'rec_L4 +done before', summary)
    assert json.load(open(f'{out}/rec_L2/results.json'))['step'] == 40

    # 3: the good ones alone: all finished, exit code 0
    p = run(study_args(tmp, 'rec_*,size_*'))
    assert '4 finished before, 0 to run' in p.stdout

    # the comparison: table rows match results.json; CSV and plots written
    p = run(study_args(tmp, 'rec_*,size_*', '--report=True'))
    md = open(f'{out}/report.md').read()
    rows = list(csv.DictReader(open(f'{out}/report.csv')))
    assert [r['name'] for r in rows] == ['rec_L2', 'rec_L4', 'size_d256', 'size_d384']
    for r in rows:
        res = json.load(open(f"{out}/{r['name']}/results.json"))
        fe = res['final_eval']
        assert float(r['exact']) == fe['exact_accuracy'] and float(r['exact_ci_low']) == fe['exact_ci_low']
        assert float(r['token']) == fe['token_accuracy'] and int(r['params']) == res['parameters']
        assert float(r['train_flops']) == res['train_flops'] and r['status'] == 'done'
        line = next(l for l in md.splitlines() if l.startswith(f"| {r['name']} |"))
        assert f"{100 * fe['exact_accuracy']:.1f} ({100 * fe['exact_ci_low']:.1f}-{100 * fe['exact_ci_high']:.1f})" \
            in line, line
        assert f"{res['parameters']:,}" in line
    assert rows[2]['varied'] == 'hidden_size=256, puzzle_emb_ndim=256' and rows[0]['family'] == 'rec'
    for png in ('acc_vs_params.png', 'acc_vs_flops.png', 'acc_vs_recursion.png', 'acc_vs_supervision_steps.png'):
        assert os.path.getsize(f'{out}/{png}') > 5000, png
    assert 'acc_vs_data.png' not in os.listdir(out)  # no data or aug family selected


def test_a_report_removes_its_own_earlier_files_it_does_not_write_again(tmp_path):
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    for i in range(2):
        name = f'w_p{i}'
        (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n"
                                        f"hidden_size = {64 * (i + 1)}\n")
        fake_run(out, name, 10 ** 5 * (i + 1), 0.5 + 0.2 * i)
    # w_p1 evaluated again in 2 views (train.py --eval_only's record)
    os.makedirs(f'{out}/w_p1/evals')
    json.dump(dict(step=100, seconds=1.0, config=dict(halt_max_steps=16),
                   eval=dict(count=1000, eval_flops=1e12, exact_accuracy=0.7, verified_accuracy=0.7,
                             exact_accuracy_q_halt=0.7)), open(f'{out}/w_p1/evals/views2-steps16.json', 'w'))
    report = ['study.py', '--pattern=w_*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True']
    run(report)
    drawn = ('acc_vs_params.png', 'acc_vs_flops.png', 'acc_vs_device_hours.png', 'error_fits.png',
             'acc_vs_test_compute.png', 'report_views.csv')
    assert all(os.path.exists(f'{out}/{f}') for f in drawn), os.listdir(out)
    # w_p1's result recorded with another configuration: the report leaves it out, and its files that showed it
    res = json.load(open(f'{out}/w_p1/results.json'))
    json.dump(dict(res, config=dict(hidden_size=999)), open(f'{out}/w_p1/results.json', 'w'))
    p = run(report)
    assert re.search(r'\| w_p1 \|.*other configuration', open(f'{out}/report.md').read())
    assert not [f for f in drawn if os.path.exists(f'{out}/{f}')], os.listdir(out)
    assert f'{out}/acc_vs_params.png' in p.stdout.split('removed')[1], p.stdout[-2000:]


def test_two_reports_into_one_folder_at_once_leave_the_later_one_whole(tmp_path):
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    for fam, size in (('w', 1), ('v', 3)):
        for i in range(2):
            name = f'{fam}_p{i}'
            (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n"
                                            f"hidden_size = {64 * (i + 1)}\n")
            fake_run(out, name, 10 ** 5 * size * (i + 1), 0.5 + 0.2 * i)

    def report(pattern, folder):
        return ['study.py', f'--pattern={pattern}', f'--config_dir={cfg}', f'--out_root={out}', '--report=True',
                f'--report_dir={folder}']

    def files(folder):
        return {f: open(os.path.join(folder, f), 'rb').read() for f in os.listdir(folder) if not f.startswith('.')}

    run(report('*', f'{tmp_path}/alone'))
    # the w_* report waits between its tables and its plots while a report of every family is made into its folder
    ready, go, shared = f'{tmp_path}/ready', f'{tmp_path}/go', f'{tmp_path}/shared'
    hook = site_hook(f'{tmp_path}/hook', f"""
if '--pattern=w_*' in sys.argv:
    import studies.report
    real = studies.report.plot

    def plot(*args, **kwargs):
        open({ready!r}, 'w').close()
        while not os.path.exists({go!r}):
            time.sleep(0.05)
        return real(*args, **kwargs)

    studies.report.plot = plot
""")
    first = start(report('w_*', shared), env=hook)
    wait_for(lambda: os.path.exists(ready) or first.poll() is not None)
    with open(f'{tmp_path}/second.log', 'w') as log:
        second = subprocess.Popen([sys.executable] + report('*', shared), cwd=ROOT, env=script_env(), stdout=log,
                                  stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: second.poll() is not None or 'waits' in open(f'{tmp_path}/second.log').read())
        open(go, 'w').close()
        assert first.communicate(timeout=300)[0] and first.returncode == 0
        assert second.wait(timeout=300) == 0
    # the folder holds the report that ended last, every file of it whole: none of the first's plots beside it
    assert files(shared) == files(f'{tmp_path}/alone'), sorted(files(shared))


def test_a_run_not_finished_shows_its_planned_flops_and_steps_as_planned(tmp_path):
    cfg, out = width_family(tmp_path, 2)
    fake_run(out, 'w_p0', 10 ** 5, 0.5)  # w_p1 not run: what the table shows of it is the plan's, not a record
    run(['study.py', '--pattern=w_*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True'])
    md = open(f'{out}/report.md').read()
    assert re.search(r'\| w_p0 \| w \| [^|]+ \| 100,000 \| 1e\+11 \| 100 \|', md), md
    assert re.search(r'\| w_p1 \| w \| [^|]+ \| [\d,]+ \| [\d.e+]+ planned \| [\d,]+ planned \|.*\| not started \|',
                     md), md
    assert 'planned: ' in md  # and the table says what that means
    rows = {r['name']: r for r in csv.DictReader(open(f'{out}/report.csv'))}
    assert rows['w_p1']['planned'] == 'True' and rows['w_p0']['planned'] == '', rows


def test_the_plots_name_the_runs_they_do_not_draw(tmp_path):
    cfg, out = width_family(tmp_path, 3)
    for i in range(2):
        fake_run(out, f'w_p{i}', 10 ** 5 * (i + 1), 0.5 + 0.2 * i)
    # w_p2 not finished: the family's curve without it must not read as the whole family
    report = ['study.py', f'--config_dir={cfg}', f'--out_root={out}', '--report=True']
    run(report + ['--pattern=w_p0,w_p1', f'--report_dir={tmp_path}/two'])
    run(report + ['--pattern=w_*', f'--report_dir={tmp_path}/three'])
    pngs = [f for f in os.listdir(f'{tmp_path}/two') if f.endswith('.png')]
    assert 'acc_vs_params.png' in pngs
    same = [f for f in pngs if open(f'{tmp_path}/two/{f}', 'rb').read() == open(f'{tmp_path}/three/{f}', 'rb').read()]
    assert not same, same
    from studies.report import not_drawn
    rows = fake_study(tmp_path, 'w_*', {})
    assert not_drawn(rows, 1) == 'not drawn (not finished or not used; report.md says why): w_p2'
    assert not_drawn([r for r in rows if r['name'] != 'w_p2'], 1) == ''


def test_the_plots_name_a_finished_run_whose_family_has_one_value_of_their_x(tmp_path):
    # v_p0 is finished, but its family has one point: no curve of it in acc_vs_params.png; unnamed, a reader takes
    # the figure for every finished run of the study
    cfg, out = width_family(tmp_path, 2)
    (cfg / 'v_p0.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/v_p0'\nhidden_size = 320\n")
    for i, name in enumerate(('w_p0', 'w_p1', 'v_p0')):
        fake_run(out, name, 10 ** 5 * (i + 1), 0.5 + 0.2 * i)
    report = ['study.py', f'--config_dir={cfg}', f'--out_root={out}', '--report=True']
    run(report + ['--pattern=w_*', f'--report_dir={tmp_path}/w'])
    run(report + ['--pattern=w_*,v_*', f'--report_dir={tmp_path}/wv'])
    png = 'acc_vs_params.png'
    assert open(f'{tmp_path}/w/{png}', 'rb').read() != open(f'{tmp_path}/wv/{png}', 'rb').read()
    from studies.report import alone_line
    assert alone_line(['v_p0']) == 'not drawn (finished, but the only value of this x in their family): v_p0'


@pytest.mark.parametrize('seeds', [1, 2])
def test_the_table_says_at_how_many_supervision_steps_its_exact_accuracy_is(tmp_path, seeds):
    # a run evaluated to eval_steps (the cpu twin: twice halt_max_steps) records its exact accuracy at
    # halt_max_steps, the curve's end elsewhere: a reader comparing the two must be told which the table holds
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    (cfg / 'w_p0.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/w_p0'\nhidden_size = 64\n")
    fake_run(out, 'w_p0', 10 ** 5, 0.5, by_steps=[0.3, 0.5, 0.6])
    run(['study.py', '--pattern=w_*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True', f'--seeds={seeds}'])
    intro = open(f'{out}/report.md').read().split('\n| name |')[0]
    assert 'at halt_max_steps supervision steps' in intro and 'acc_vs_supervision_steps.png' in intro, intro


def test_a_speed_figure_gives_a_real_run_its_estimate_beside_its_measured_time(tiny_grid):
    # the dry run's estimate, said again where the measured time is, so a bench can be judged against it
    tmp = tiny_grid
    (Path(tmp) / 'bench.txt').write_text("bench: device=cpu batch=32 seq_len=16 params=74178 dtype=float32 "
                                         "examples_per_s=300.0 flops_per_example=47204736\n")
    p = run(study_args(tmp, 'rec_L2', f'--bench_file={tmp}/bench.txt'))
    assert re.search(r'rec_L2 \[L_cycles=2\]: starting \(estimated about \d+ s from the bench\)', p.stdout), p.stdout
    assert re.search(r'rec_L2 +done +in \d+ s measured \(estimated about \d+ s\)', p.stdout), p.stdout
    # a speed figure that cannot be read is said in one line, and stops no run
    p = run(study_args(tmp, 'rec_L2', f'--bench_file={tmp}/none.txt'))
    said = [l for l in p.stdout.splitlines() if 'none.txt' in l and not l.startswith('config:')]
    assert len(said) == 1 and 'no time estimates' in said[0] and 'No such file' in said[0], p.stdout
    assert '1 finished before, 0 to run' in p.stdout and 'estimated' not in p.stdout


def test_a_stop_request_to_the_study_saves_the_run_and_a_rerun_finishes_it(tiny_grid):
    tmp = tiny_grid
    out = f'{tmp}/out'
    p = start(study_args(tmp, 'rec_L2'))
    wait_for(lambda: os.path.exists(f'{out}/rec_L2/ckpt_00000010.pt') or p.poll() is not None)
    p.send_signal(signal.SIGTERM)  # to study.py only: it asks train.py to save and stop
    text = p.communicate(timeout=300)[0]
    assert p.returncode == 1 and 'got signal' in text and 'stopped; rerun the same command' in text, text
    assert not os.path.exists(f'{out}/rec_L2/results.json') or 'rec_L2           done' in text
    if not os.path.exists(f'{out}/rec_L2/results.json'):  # a later report: stopped, not running
        run(study_args(tmp, 'rec_L2', '--report=True'))
        step = int(sorted(f for f in os.listdir(f'{out}/rec_L2') if f.startswith('ckpt_'))[-1][5:13])
        assert re.search(rf'\| rec_L2 \|.*\| stopped at step {step} \|$', open(f'{out}/report.md').read(), re.M)
    p = run(study_args(tmp, 'rec_L2'))
    assert json.load(open(f'{out}/rec_L2/results.json'))['step'] == 40


def test_a_file_edited_while_the_study_runs_is_not_run_as_another_configuration(tiny_grid, tmp_path):
    # the study costs, checks and prints the command of the file as it was at its start; train.py would read the
    # file as it is when the run starts: a run of neither, and the study's own report would not use it
    tmp = tiny_grid
    out, go = f'{tmp}/out', tmp_path / 'go'
    p = start(study_args(tmp, 'rec_*'), env=held_step(f'{tmp}/hook', 3, go=go, argv=['/rec_L2']))
    wait_for(lambda: 'test hook: step 3 waits' in (open(f'{out}/rec_L2/train.log').read()
                                                   if os.path.exists(f'{out}/rec_L2/train.log') else '')
             or p.poll() is not None)
    edited = f'{tmp}/cfg/rec_L4.py'
    text = open(edited).read()
    open(edited, 'w').write(text.replace('L_cycles = 4 ', 'L_cycles = 5 '))
    go.write_text('')
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 1, text
    summary = text.split('study: summary')[1]
    assert re.search(r'rec_L2 +done', summary), summary
    assert re.search(rf'rec_L4 +NOT RUN +{re.escape(edited)} changed since the study started \(L_cycles 4 then, 5 '
                     r'now\)', summary), summary
    assert not os.path.exists(f'{out}/rec_L4/results.json')
    p = run(study_args(tmp, 'rec_*'))  # as the file is now
    assert '1 finished before, 1 to run' in p.stdout, p.stdout
    assert json.load(open(f'{out}/rec_L4/results.json'))['config']['L_cycles'] == 5


def results_of(out, names):
    """What must not depend on how the runs were scheduled: steps, accuracies, parameters, FLOPs."""
    got = {}
    for n in names:
        res = json.load(open(f'{out}/{n}/results.json'))
        fe = res['final_eval']
        got[n] = (res['step'], res['parameters'], res['train_flops'], fe['exact_accuracy'], fe['token_accuracy'],
                  fe['q_halt_accuracy'], fe['count'])
        # the run's wall time by phase and its device-hours (wall time x devices) are recorded
        w = res['wall_s']
        assert w['total'] > 0 and abs(w['total'] - w['startup'] - w['train'] - w['eval']) < 1e-6, w
        assert res['device_hours'] == pytest.approx(w['total'] * res['world_size'] / 3600)
    return got


def test_a_study_started_from_another_folder_builds_and_trains_with_the_repository_s_scripts(tiny_grid):
    tmp = tiny_grid
    elsewhere = os.path.join(tmp, 'elsewhere')
    os.mkdir(elsewhere)
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'study.py')] + study_args(tmp, 'rec_L2')[1:], cwd=elsewhere,
                       env=script_env(None), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "can't open file" not in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    assert json.load(open(f'{tmp}/out/rec_L2/results.json'))['step'] == 40


def test_parallel_slots_give_the_sequential_results_and_a_killed_study_resumes(tiny_grid):
    tmp = tiny_grid
    names = ['rec_L2', 'rec_L4']
    one = study_args(tmp, 'rec_*')
    p = run(one)
    assert '2 to run' in p.stdout
    sequential = results_of(f'{tmp}/out', names)
    # two at once, each on its own core; study.py killed outright (SIGKILL) once both have saved a checkpoint: the
    # kernel's signal on their parent's end makes each train.py save and stop; the same command then finishes only
    # what is missing
    two = [a.replace(f'{tmp}/out', f'{tmp}/out2') for a in one] + ['--slots=2', '--status_every=1']
    p = start(two, env=held_after_step_10(tmp, *names, slow=True))
    wait_for(lambda: all(os.path.exists(f'{tmp}/out2/{n}/ckpt_00000010.pt') for n in names) or p.poll() is not None)
    kids = children(p.pid)
    assert len(kids) == 2, kids  # both runs at once
    p.kill()
    p.communicate(timeout=60)
    wait_for(lambda: not any(alive(k) for k in kids), timeout=120)
    for n in names:  # the study copied each run's output to its train.log; once gone, the run writes it itself
        log = open(f'{tmp}/out2/{n}/train.log').read()
        assert f'its parent process (pid {p.pid}) ended: saving' in log, log[-3000:]
        assert re.search(r'saved .*ckpt_\d+\.pt .*\(stop requested\)', log), log[-3000:]
    p = run(two)
    assert '0 finished before, 2 to run' in p.stdout or '1 finished before, 1 to run' in p.stdout, p.stdout
    assert 'resuming from its checkpoint' in p.stdout
    assert re.search(r'study: \d\d:\d\d:\d\d, 2 running, 0 waiting:\n  rec_L\d +slot \d', p.stdout), p.stdout
    assert re.search(r'rec_L2 +done', p.stdout.split('study: summary')[1])
    # the same flags, so the same results; a run killed and resumed included
    assert results_of(f'{tmp}/out2', names) == sequential


def test_seeds_run_each_point_in_its_own_folder_and_the_report_gives_mean_and_spread(tiny_grid):
    tmp = tiny_grid
    out = f'{tmp}/out'
    p = run(study_args(tmp, 'rec_L2', '--seeds=2', '--slots=2'))
    assert re.search(r'rec_L2 +done', p.stdout) and re.search(r'rec_L2-s1 +done', p.stdout)
    assert json.load(open(f'{out}/rec_L2/results.json'))['config']['seed'] == 0  # seed 0: today's folder
    assert json.load(open(f'{out}/rec_L2-s1/results.json'))['config']['seed'] == 1
    rows = list(csv.DictReader(open(f'{out}/report.csv')))
    assert [(r['name'], r['seed']) for r in rows] == [('rec_L2', '0'), ('rec_L2', '1')]
    vals = [json.load(open(f'{out}/{d}/results.json'))['final_eval']['exact_accuracy'] for d in ('rec_L2', 'rec_L2-s1')]
    mean = sum(vals) / 2
    for r in rows:
        assert float(r['exact_mean']) == pytest.approx(mean) and r['seeds_done'] == '2'
        assert float(r['exact_min']) == min(vals) and float(r['exact_max']) == max(vals)
        assert float(r['exact_std']) == pytest.approx(abs(vals[0] - vals[1]) / 2 ** 0.5)
    md = open(f'{out}/report.md').read()
    assert 'mean ± std (min-max)' in md and '| 2/2 |' in md
    p = run(study_args(tmp, 'rec_L2', '--seeds=2', "--extra=--seed=3"), check=False)
    assert p.returncode != 0 and '--seeds' in p.stderr + p.stdout


def test_seeds_refuse_a_file_that_sets_its_own_seed(tmp_path):
    # its seed-0 run would train the file's seed and seed 1 with --seed=1: with seed = 1 the two are one run,
    # reported as two seeds
    (tmp_path / 'cfg').mkdir()
    (tmp_path / 'cfg' / 'sd_a.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/sd_a'\nseed = 1\n")
    p = run(study_args(tmp_path, 'sd_a', '--seeds=2', '--dry_run=True'), check=False)
    out = p.stderr + p.stdout
    assert p.returncode != 0 and 'python train.py' not in out, out
    assert re.search(r'sd_a\.py, line 3.*seed = 1.*--seeds=2', out), out
    assert 'Traceback' not in out, out


def width_family(tmp_path, n):
    """A family w_p0 .. w_p<n-1> of config files, each wider than the one before: (their folder, the out_root)."""
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    for i in range(n):
        (cfg / f'w_p{i}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/w_p{i}'\n"
                                        f"hidden_size = {64 * (i + 1)}\n")
    return cfg, str(tmp_path / 'out')


def fake_run(out, name, params, exact, by_steps=None):
    """A finished run's results.json, as train.py writes it (the keys the report reads)."""
    os.makedirs(f'{out}/{name}', exist_ok=True)
    fe = dict(exact_accuracy=exact, exact_ci_low=max(0, exact - 0.02), exact_ci_high=min(1, exact + 0.02),
              token_accuracy=exact, q_halt_accuracy=1.0, count=1000, exact_by_steps=[exact / 2, exact] if by_steps is None else by_steps)
    json.dump(dict(parameters=params, train_flops=params * 1e6, flops_per_example_step=params, step=100,
                   final_eval=fe, best_eval=None, config={}, wall_s=dict(total=params / 1e4), device_hours=params / 1e7,
                   world_size=1), open(f'{out}/{name}/results.json', 'w'))


def test_fits_recover_a_power_law_and_say_when_they_mean_nothing(tmp_path):
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    law = lambda x: 0.5 * x ** -0.3 + 0.05  # error = a X^-b + c
    xs = [10 ** k for k in (5, 5.5, 6, 6.5, 7, 7.5)]
    families = dict(law=xs, few=xs[:3], flat=xs[:5])
    for fam, pts in families.items():
        for i, x in enumerate(pts):
            name = f'{fam}_p{i}'
            (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n"
                                            f"hidden_size = {64 * (i + 1)}\n")
            fake_run(out, name, int(x), 1 - (law(x) if fam != 'flat' else 0.5 + 0.001 * i))
    run(['study.py', '--pattern=*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True'])
    md = open(f'{out}/report.md').read()
    assert f'`tensorboard --logdir {out}`' in md  # every run's curves, one command
    line = next(l for l in md.splitlines() if l.startswith('| law_* | parameters |'))
    a, b, c = map(float, re.search(r'\| ([\d.e+-]+)·X\^-([\d.]+) \+ ([\d.]+) \|', line).groups())
    assert a == pytest.approx(0.5, rel=0.05) and b == pytest.approx(0.3, rel=0.02) and c == pytest.approx(0.05, abs=2e-3)
    assert line.endswith('| yes |'), line
    assert re.search(r'\| few_\* \| parameters \| 3 \|.*no: 3 distinct points: a, b and c fit them exactly', md), md
    assert re.search(r'\| flat_\* \| parameters \| 5 \|.*no: flat', md), md
    assert os.path.getsize(f'{out}/error_fits.png') > 5000 and os.path.getsize(f'{out}/acc_vs_device_hours.png') > 5000


def pyplot():
    import matplotlib
    matplotlib.use('Agg')  # no display: as the report draws
    import matplotlib.pyplot as plt
    return plt


def fake_study(tmp_path, pattern, runs, seeds=1):
    """A study's experiment files and finished runs, runs = {folder: (params, exact[, exact_by_steps])} (folder:
    the experiment's name, <name>-s<seed> for seed > 0); the report's rows of the pattern, as make_report
    collects them."""
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir(exist_ok=True)
    for i, name in enumerate(dict.fromkeys(folder.split('-s')[0] for folder in runs)):
        (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n"
                                        f"hidden_size = {64 * (i + 1)}\n")
    for folder, run_ in runs.items():
        fake_run(out, folder, *run_)
    opts = Options(scale='full', root=out, local_root=out, data_root=str(tmp_path / 'data'), config_dir=str(cfg),
                   extra={}, extra_args=[], nproc=1, seeds=seeds)
    return collect(load_experiments([pattern], opts)[1])


def fit_points(tmp_path, exacts):
    """The report's finished points of family w, one run per exact accuracy."""
    return points(fake_study(tmp_path, 'w_*', {f'w_p{i}': (10 ** 5 * 2 ** i, x) for i, x in enumerate(exacts)}), 1)


@pytest.mark.parametrize('exacts', [(0.5, 0.7, 0.85, 0.95, 1.0), (1.0, 1.0, 1.0, 1.0)])
def test_error_fits_draw_a_run_that_solved_everything(tmp_path, exacts):
    # a log axis cannot show an error of 0: such a run is drawn at the floor, marked so, and matplotlib says nothing
    plt = pyplot()
    done = fit_points(tmp_path, exacts)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        fig = plot_fits(plt, done, 'test', {'w': 'C0'}, 1)
        fig.savefig(tmp_path / 'error_fits.png')
    assert [ax.get_xlabel() for ax in fig.axes] == ['parameters (log scale)', 'training FLOPs (log scale)']
    for ax, per_param in zip(fig.axes, (1, 10 ** 6)):  # fake_run: train_flops = 1e6 x params
        drawn = {(x, y) for l in ax.get_lines() if l.get_linestyle() == 'None' for x, y in l.get_xydata()}
        assert sorted(x for x, _ in drawn) == [per_param * 10 ** 5 * 2 ** i for i in range(len(exacts))], drawn
        lo, hi = ax.get_ylim()
        assert all(lo < y < hi for _, y in drawn) and hi >= 10 * lo, (drawn, lo, hi)  # at least a decade shown
        floor = [t.get_text() for t in ax.get_legend().get_texts() if '0 % error' in t.get_text()]
        assert floor == [f"0 % error: {exacts.count(1.0)} point(s), drawn at the floor"], floor
    plt.close(fig)


def test_error_fits_label_each_point_and_an_axis_within_a_decade_in_plain_numbers(tmp_path):
    # errors of 30-60 %: matplotlib's log axis would read 3x10^1 ... 6x10^1
    plt = pyplot()
    fig = plot_fits(plt, fit_points(tmp_path, (0.4, 0.5, 0.6, 0.7, 1.0)), 'test', {'w': 'C0'}, 1)
    fig.savefig(tmp_path / 'error_fits.png')  # the tick labels are made when drawn
    for ax in fig.axes:
        ticks = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
        assert ticks and all(re.fullmatch(r'[\d.]+', t) for t in ticks), ticks
        assert sorted(t.get_text() for t in ax.texts) == ['p0', 'p1', 'p2', 'p3', 'p4'], ax.texts  # p4: at the floor
    plt.close(fig)


def test_a_panel_with_no_curve_says_why_in_it(tmp_path):
    # lr_* finished, bs_* not: acc_vs_optimizer.png's batch panel was a bare 1-10 log axis
    from studies.report import empty_panel, plot
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    for name, key in (('lr_p0', 'lr = 3e-4'), ('lr_p1', 'lr = 1e-3'), ('bs_p0', 'global_batch_size = 256')):
        (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n{key}\n")
    opts = Options(scale='full', root=out, local_root=out, data_root=str(tmp_path / 'data'), config_dir=str(cfg),
                   extra={}, extra_args=[], nproc=1, seeds=1)

    def said(panel, xkey):
        rows = collect(load_experiments(['lr_*', 'bs_*'], opts)[1])
        done = [p for p in points(rows, 1) if p['status'] == 'done']
        assert f'{out}/acc_vs_optimizer.png' in plot(rows, out, opts)
        return empty_panel(rows, done, 'acc_vs_optimizer.png', panel, xkey)

    fake_run(out, 'lr_p0', 10 ** 5, 0.5)
    fake_run(out, 'lr_p1', 10 ** 5, 0.7)
    assert said(1, 'global_batch_size') == 'no finished run of bs_*'
    fake_run(out, 'bs_p0', 10 ** 5, 0.6)
    assert said(1, 'global_batch_size') == 'one finished point of bs_*: a curve needs two'
    assert empty_panel([], [], 'acc_vs_data.png', 1, 'per_puzzle') == 'no run of aug_* in this report'


# seed 1 of s_a not run, s_c only seed 0; each seed's exact accuracy by supervision steps its own
SEED_RUNS = {'s_a': (10 ** 5, 0.5, [0.1, 0.5]), 's_a-s2': (10 ** 5, 0.9, [0.3, 0.9]),
             's_b': (2 * 10 ** 5, 0.6, [0.2, 0.6]), 's_b-s1': (2 * 10 ** 5, 0.8, [0.4, 0.8]),
             's_b-s2': (2 * 10 ** 5, 0.7, [0.3, 0.7]), 's_c': (4 * 10 ** 5, 0.9, [0.5, 0.9])}


def test_with_seeds_the_supervision_steps_curve_is_the_mean_of_the_finished_seeds(tmp_path):
    plt = pyplot()
    done = points(fake_study(tmp_path, 's_*', SEED_RUNS, seeds=3), 3)
    assert [(p['name'], p['exact']) for p in done] == [('s_a', pytest.approx(0.7)), ('s_b', pytest.approx(0.7)),
                                                       ('s_c', 0.9)]
    assert [p['exact_by_steps'] for p in done] == [pytest.approx([0.2, 0.7]), pytest.approx([0.3, 0.7]), [0.5, 0.9]]
    fig = plot_supervision_steps(plt, done, 'test', 3)
    ax = fig.axes[0]
    assert [list(l.get_ydata()) for l in ax.get_lines()] == [pytest.approx([100 * y for y in p['exact_by_steps']])
                                                             for p in done]
    assert 'mean of the finished seeds' in ax.get_ylabel(), ax.get_ylabel()
    plt.close(fig)
    # a seed whose results hold no curve (an earlier trainer's) leaves the curve to the seeds that have one
    older = {'s_d': (8 * 10 ** 5, 0.6, []), 's_d-s1': (8 * 10 ** 5, 0.8, [0.4, 0.8])}
    (tmp_path / 'older').mkdir()
    [p] = points(fake_study(tmp_path / 'older', 's_d', older, seeds=3), 3)
    assert p['exact'] == pytest.approx(0.7) and p['exact_by_steps'] == [0.4, 0.8]


def test_with_seeds_the_plots_name_the_points_of_fewer_finished_seeds(tmp_path):
    # s_c's one finished seed is drawn with no bar, as if its seeds agreed: the line under each figure says so
    from studies.report import fewer_seeds
    rows = fake_study(tmp_path, 's_*', SEED_RUNS, seeds=3)
    assert fewer_seeds(rows, 3) == 'drawn from fewer seeds than 3 (the finished ones): s_a 2/3, s_c 1/3'
    assert fewer_seeds([r for r in rows if r['name'] == 's_b'], 3) == '' and fewer_seeds(rows[:1], 1) == ''


def test_a_seed_report_keeps_each_seed_in_its_place_and_gives_no_spread_of_one_seed(tmp_path):
    plt = pyplot()
    rows = fake_study(tmp_path, 's_*', SEED_RUNS, seeds=3)
    out = str(tmp_path / 'out')
    p = run(['study.py', '--pattern=s_*', '--seeds=3', f'--config_dir={tmp_path}/cfg', f'--out_root={out}',
             '--report=True'])
    assert 'report: not finished yet: s_a-s1, s_c-s1, s_c-s2\n' in p.stdout, p.stdout[-500:]  # each run once
    md = open(f'{out}/report.md').read()
    assert '| 70.0 ± 28.3 (50.0-90.0) | 2/3 | 50.0, –, 90.0 |' in md, md  # seed 1 of s_a not run
    assert '| 70.0 ± 10.0 (60.0-80.0) | 3/3 | 60.0, 80.0, 70.0 |' in md, md
    assert '| 90.0 ± n/a (90.0-90.0) | 1/3 | 90.0, –, – |' in md, md  # one value has no standard deviation
    assert 'mean of the finished seeds' in md and 'mean of 3 seeds' not in md, md
    std = {r['run']: r['exact_std'] for r in csv.DictReader(open(f'{out}/report.csv'))}
    assert std['s_c'] == std['s_c-s1'] == '' and float(std['s_a-s1']) == pytest.approx(0.2828, abs=1e-4), std
    fig = plot_fits(plt, points(rows, 3), 'test', {'s': 'C0'}, 3)
    assert all('mean of the finished seeds' in ax.get_ylabel() for ax in fig.axes)
    plt.close(fig)


def test_a_report_of_fewer_seeds_than_the_study_s_names_the_finished_seeds_it_leaves_out(tmp_path):
    # a report made later without the study's --seeds shows seed 0 alone: the table must say it is not the mean
    fake_study(tmp_path, 's_*', SEED_RUNS, seeds=3)
    out = str(tmp_path / 'out')
    for seeds, left_out in ((1, 's_b-s1'), (2, 's_a-s2, s_b-s2')):
        p = run(['study.py', '--pattern=s_*', f'--seeds={seeds}', f'--config_dir={tmp_path}/cfg', f'--out_root={out}',
                 '--report=True'])
        assert f'**Seeds left out:** {left_out} finished too' in open(f'{out}/report.md').read(), p.stdout[-800:]
    run(['study.py', '--pattern=s_*', '--seeds=3', f'--config_dir={tmp_path}/cfg', f'--out_root={out}',
         '--report=True'])
    assert 'Seeds left out' not in open(f'{out}/report.md').read()


def test_a_bucket_out_root_s_report_reads_each_run_s_results_from_the_bucket(emulator, tmp_path):
    cfg, made, out = tmp_path / 'cfg', str(tmp_path / 'made'), f'gs://{BUCKET}/study_report'
    cfg.mkdir()
    for i, name in enumerate(['up_p0', 'up_p1', 'never_p0']):  # never_p0 has nothing in the bucket
        (cfg / f'{name}.py').write_text(f"_base = 'config/baseline.py'\nout_dir = 'out/study/{name}'\n")
        fake_run(made, name, 10 ** 5 * (i + 1), 0.25 * (i + 1))
    client = gcs.GCS(endpoint=emulator)
    for name in ('up_p0', 'up_p1'):
        client.upload(f'{made}/{name}/results.json', f'{out}/{name}/results.json')
    p = run(['study.py', '--pattern=*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True',
             f'--report_dir={tmp_path}/report'], env=dict(STORAGE_EMULATOR_HOST=emulator.replace('http://', '')))
    assert 'cannot read' not in p.stdout, p.stdout
    md = open(tmp_path / 'report' / 'report.md').read()
    assert re.search(r'\| up_p0 \|.*\| 25\.0 \(23\.0-27\.0\) \|.*\| done \|', md), md
    assert re.search(r'\| up_p1 \|.*\| 50\.0 \(48\.0-52\.0\) \|.*\| done \|', md), md
    assert re.search(r'\| never_p0 \|.*\| not started \|', md), md

def test_hosts_share_a_fixed_partition_balanced_by_cost():
    shares = []
    for h in range(3):
        p = run(['study.py', '--pattern=*', '--dry_run=True', '--examples_per_s=1000', '--hosts_mode=share',
                 '--num_hosts=3', f'--host_index={h}', '--slots=1'])
        plan = p.stdout.split('\nplan: ')[1]
        assert f'(this is host {h})' in plan
        shares.append(re.findall(r'^  host (\d) slot 0: (\S+)', plan, re.M))
    assert shares[0] == shares[1] == shares[2]  # every host computes the same partition
    hosts = {name: int(h) for h, name in shares[0]}
    assert len(hosts) == 60 and set(hosts.values()) == {0, 1, 2}
    # balanced: the greedy longest-first puts the hosts' loads within one run's time of each other
    ends, longest = {}, 0
    for h, start, end in re.findall(r'^  host (\d) slot 0: \S+  starts about (.+), ends about (.+)$', plan, re.M):
        ends[int(h)] = max(ends.get(int(h), 0), seconds(end))
        longest = max(longest, seconds(end) - seconds(start))
    times = wall_times(plan)
    assert max(ends.values()) - min(ends.values()) <= longest * 1.05  # rounding of the printed times
    assert times['share'] < times['sequential'] and times['share'] == pytest.approx(max(ends.values()), rel=0.05)


def seconds(text):
    v, unit = text.split()
    return float(v) * dict(s=1, min=60, h=3600, days=86400)[unit]


def wall_times(plan):
    m = re.search(r'\(hosts_mode=all, slots=1\): ([\d.]+ \w+)\n.*\n  hosts_mode=share, \d host\(s\) x \d slot\(s\): '
                  r'([\d.]+ \w+)', plan)
    return dict(sequential=seconds(m[1]), share=seconds(m[2]))


def test_a_dry_run_without_a_speed_spreads_the_runs_over_the_slots():
    # without --examples_per_s no time is printed, but the runs are placed by their FLOPs, as the runner does
    # on the CPU, which any host has (a visible GPU would be one slot), each slot given its share of the cores
    p = run(['study.py', "--pattern=rec_*", '--slots=2', '--dry_run=True'], env=dict(CUDA_VISIBLE_DEVICES=''))
    slots = re.findall(r'host 0 slot (\d) \(cpu [\d,-]+\): (rec_L\d+)', p.stdout)
    assert len(slots) == 5 and {s for s, _ in slots} == {'0', '1'}, p.stdout
    assert 'starts about' not in p.stdout


def test_new_families_keep_their_variation_at_the_cpu_scale():
    p = run(['study.py', "--pattern=lr_*,bs_*,abl_halt1,abl_halt2,abl_noemb", '--scale=cpu', '--dry_run=True'])
    blocks = {b.split()[0]: b for b in re.split(r'\n(?=\S)', p.stdout) if b.strip()}
    flag = lambda name, key: re.search(rf'--{key}=(\S+)', blocks[name])[1]
    assert [flag(n, 'lr') for n in ('lr_3e-5', 'lr_1e-4', 'lr_3e-4', 'lr_1e-3')] == ['0.0006', '0.002', '0.006', '0.02']
    assert [flag(n, 'global_batch_size') for n in ('bs_256', 'bs_512', 'bs_1536', 'bs_6144')] == ['11', '21', '64', '256']
    assert flag('bs_256', 'lr') == '0.00115' and 'same run as lr_1e-4' in blocks['bs_768']
    assert '--halt_max_steps' not in blocks['abl_halt1'] and '--eval_steps=2 ' in blocks['abl_halt1']
    assert flag('abl_noemb', 'puzzle_emb_ndim') == '32' and 'embedding ON against the cpu base' in blocks['abl_noemb']


def test_the_ablation_bars_are_labelled_each_by_what_its_run_changes(tmp_path):
    plt = pyplot()
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    names = ['abl_actcont', 'abl_attn', 'abl_halt1', 'abl_halt2', 'abl_halt8', 'abl_noema', 'abl_noemb']
    for i, name in enumerate(names):  # abl_halt16 is the base run
        shutil.copy(os.path.join(STUDY, name + '.py'), cfg)
        fake_run(out, name, 10 ** 5, 0.5 + 0.05 * i)
    opts = Options(scale='cpu', root=out, local_root=out, data_root=str(tmp_path / 'data'), config_dir=str(cfg),
                   extra={}, extra_args=[], nproc=1, seeds=1)
    done = points(collect(load_experiments(['abl_*'], opts)[1]), 1)
    fig = plot_ablations(plt, done, 'test', {'abl': 'C0'}, 'exact')
    fig.tight_layout()
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = {t.get_text().split('\n')[0]: t for t in ax.get_xticklabels()}
    text = {p: t.get_text() for p, t in labels.items()}
    # what each run trains at this scale, and nothing another run changes (the cpu twin of halt8 trains 2 steps,
    # of noemb a 32-wide embedding)
    assert 'no_ACT_continue=False' in text['actcont'] and 'halt_max_steps' not in text['actcont'], text
    assert 'mlp_t=False' in text['attn'] and "pos_encodings='rope'" in text['attn'], text
    assert 'no_ACT_continue' not in text['attn'] and 'halt_max_steps=2' in text['halt8'], text
    assert 'puzzle_emb_ndim=32' in text['noemb'] and 'ema=False' in text['noema'], text
    boxes = sorted((t.get_window_extent() for t in labels.values()), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [(b.x0, b.x1) for b in boxes]  # none overlap
    plt.close(fig)
