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

import pytest

from conftest import ROOT, run
from configurator import config_files, read_config_block

STUDY = os.path.join(ROOT, 'config', 'study')
BASE = {'config/baseline.py': 'data/sudoku-extreme-1k-aug-1000', 'config/maze.py': 'data/maze-30x30-hard-1k'}
# the grid of the issue: family -> {point: the keys it changes from its base recipe (the base point: none)}
SUDOKU_SIZE = {**{f'd{d}': {'hidden_size': d} for d in (256, 384, 768, 1024)}, 'd512': {},
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
            'attn': {'mlp_t': False, 'pos_encodings': 'rope'}, 'actcont': {'no_ACT_continue': False}},
    'maze_size': SUDOKU_SIZE,
    'maze_rec': {f'L{n}': ({'L_cycles': n} if n != 4 else {}) for n in (2, 4, 6, 8, 10)},
    'maze_tn': {f'T{t}n{n}': {k: v for k, v in (('H_cycles', t), ('L_cycles', n)) if v != {'H_cycles': 3, 'L_cycles': 4}[k]}
                for t, n in TN},
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
        assert scope['_base'] == ('config/maze.py' if fam.startswith('maze') else 'config/baseline.py'), name
        diff = {k: cfg[k] for k in cfg if cfg[k] != base_cfg[k] and k not in ('out_dir', 'wandb_run_name')}
        assert diff == GRID[fam][point], (name, diff)
        # the file holds only what the run changes: nothing it repeats from its base
        assert {k for k in scope if not k.startswith('_')} == {'out_dir', 'wandb_run_name'} | set(diff), name
        shared = 'maze_base' if fam.startswith('maze') else 'base'
        same = {'tn_T3n4': 'rec_L4', 'maze_tn_T3n6': 'maze_rec_L6'}  # one configuration in two families: one run
        assert cfg['out_dir'] == f"out/study/{shared if not diff else same.get(name, name)}", name
        out_dirs.setdefault(cfg['out_dir'], []).append(name)
    # one out_dir per distinct run: only the base points share one
    assert {d: n for d, n in out_dirs.items() if len(n) > 1} == {
        'out/study/base': ['size_d512', 'size_L2', 'rec_L6', 'tn_T3n6', 'data_1000', 'aug_1000', 'abl_halt16'],
        'out/study/maze_base': ['maze_size_d512', 'maze_size_L2', 'maze_rec_L4', 'maze_tn_T3n4'],
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


def test_dry_run_of_the_full_grid_prints_every_command_and_cost():
    p = run(['study.py', "--pattern=*", '--dry_run=True', '--examples_per_s=1000'])
    out = p.stdout
    blocks = {b.split()[0]: b for b in re.split(r'\n(?=\S)', out) if b.strip() and not b.startswith('config:')}
    # four groups of experiments that are one configuration: each group's first name (in order) runs, the others
    # say 'same run as'
    groups = [{'size_L2', 'rec_L6', 'tn_T3n6', 'data_1000', 'aug_1000', 'abl_halt16', 'size_d512'},
              {'maze_size_L2', 'maze_rec_L4', 'maze_tn_T3n4', 'maze_size_d512'}, {'rec_L4', 'tn_T3n4'},
              {'maze_rec_L6', 'maze_tn_T3n6'}]
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
    base = next(blocks[n] for n in ('abl_halt16', 'size_d512') if 'same run' not in blocks[n])
    assert '5,028,866 parameters' in base and '42.7 GFLOPs' in base and '65,104 steps' in base
    assert '325,520 steps' in blocks['data_5000']  # 5,000 puzzles: 5x the steps at the same epochs
    assert 'prepare_sudoku.py --output_dir data/sudoku-extreme-5000-aug-1000 --subsample_size 5000 --num_aug 1000' \
        in blocks['data_5000']
    assert 'prepare_maze.py --output_dir data/maze-30x30-hard-1k' in blocks['maze_rec_L2']
    assert '6,828,034 parameters' in blocks['abl_attn']
    assert re.search(r'total: 42 costed run\(s\), training [\d.e+]+ FLOPs.*about', out)  # 53 files, 42 runs
    # without a speed figure it says so; the other scales print their flags
    p = run(['study.py', '--pattern=rec_L2', '--dry_run=True', '--scale=gpu'])
    assert 'no speed figure given' in p.stdout and '--epochs=5000' in p.stdout
    p = run(['study.py', '--pattern=maze_rec_L2', '--dry_run=True', '--scale=cpu'])
    assert '--hidden_size=32' in p.stdout and 'prepare_maze.py --generate' in p.stdout and '--max_steps' not in p.stdout


def children(pid):
    """Process ids whose parent is pid (Linux /proc)."""
    kids = []
    for d in os.listdir('/proc'):
        if d.isdigit():
            try:
                stat = open(f'/proc/{d}/stat').read()
            except OSError:
                continue
            if int(stat.rsplit(')', 1)[1].split()[1]) == pid:
                kids.append(int(d))
    return kids


def study_args(tmp, pattern, *more):
    return ['study.py', f'--pattern={pattern}', f'--config_dir={tmp}/cfg', f'--out_root={tmp}/out',
            f'--data_root={tmp}/data'] + CPU_RUN + list(more)


def start(args):
    env = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    env.pop('PJRT_DEVICE', None)
    return subprocess.Popen([sys.executable] + args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(cond, timeout=300):
    t = time.time()
    while not cond():
        assert time.time() - t < timeout
        time.sleep(0.02)


@pytest.fixture
def tiny_grid(tmp_path):
    """Two families of two runs each, the real files, plus two that fail: a bad value and a dataset nothing
    can build."""
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    for name in ('rec_L2', 'rec_L4', 'size_d256', 'size_d384'):
        shutil.copy(os.path.join(STUDY, name + '.py'), cfg)
    (cfg / 'bad_value.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_value'\n"
                                      "data_path = 'data/sudoku-extreme-1k-aug-1000'\nL_cycles = 0\n")
    (cfg / 'bad_nodata.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_nodata'\n"
                                       "data_path = 'data/no-such-dataset'\n")
    return str(tmp_path)


def test_a_study_runs_skips_resumes_reports_failures_and_compares(tiny_grid):
    tmp = tiny_grid
    out = f'{tmp}/out'
    # 1: kill the first run's train.py (SIGKILL) once it has saved a checkpoint; the study goes on
    p = start(study_args(tmp, 'rec_*,bad_*,size_*'))
    wait_for(lambda: os.path.exists(f'{out}/rec_L2/ckpt_00000010.pt') or p.poll() is not None)
    assert not os.path.exists(f'{out}/rec_L2/results.json')
    for kid in children(p.pid):
        os.kill(kid, signal.SIGKILL)
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 1, text
    assert 'building ' in text and 'prepare_sudoku.py --generate 1000 --size 4' in text
    summary = text.split('study: summary')[1]
    assert re.search(r'rec_L2 +FAILED +exit code -9', summary), summary
    assert re.search(r'bad_value +FAILED +exit code 1: .*L_cycles=0', summary), summary
    assert re.search(r'bad_nodata +FAILED +dataset data/no-such-dataset is missing and no rule builds it', summary)
    for name in ('rec_L4', 'size_d256', 'size_d384'):  # after the failures, the others ran
        assert re.search(rf'{name} +done', summary), summary
        res = json.load(open(f'{out}/{name}/results.json'))
        assert res['step'] == 40 and 0 <= res['final_eval']['exact_accuracy'] <= 1
    assert json.load(open(f'{out}/size_d256/results.json'))['config']['hidden_size'] == 16  # 256 / 16 at cpu scale
    assert json.load(open(f'{out}/rec_L4/results.json'))['config']['L_cycles'] == 4

    # 2: rerun: finished runs skipped, the killed one resumed from its checkpoint, the failures again reported
    p = run(study_args(tmp, 'rec_*,bad_*,size_*'), check=False)
    assert p.returncode == 1
    assert '3 finished before, 3 to run' in p.stdout
    assert re.search(r'rec_L2 \[L_cycles=2\]: resuming from its checkpoint at step (10|20|30)', p.stdout), p.stdout
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
    assert rows[2]['varied'] == 'hidden_size=256' and rows[0]['family'] == 'rec'
    for png in ('acc_vs_params.png', 'acc_vs_flops.png', 'acc_vs_recursion.png', 'acc_vs_supervision_steps.png'):
        assert os.path.getsize(f'{out}/{png}') > 5000, png
    assert 'acc_vs_data.png' not in os.listdir(out)  # no data or aug family selected


def test_a_stop_request_to_the_study_saves_the_run_and_a_rerun_finishes_it(tiny_grid):
    tmp = tiny_grid
    out = f'{tmp}/out'
    p = start(study_args(tmp, 'rec_L2'))
    wait_for(lambda: os.path.exists(f'{out}/rec_L2/ckpt_00000010.pt') or p.poll() is not None)
    p.send_signal(signal.SIGTERM)  # to study.py only: it asks train.py to save and stop
    text = p.communicate(timeout=300)[0]
    assert p.returncode == 1 and 'got signal' in text and 'stopped; rerun the same command' in text, text
    assert not os.path.exists(f'{out}/rec_L2/results.json') or 'rec_L2           done' in text
    p = run(study_args(tmp, 'rec_L2'))
    assert json.load(open(f'{out}/rec_L2/results.json'))['step'] == 40
