"""
The study's ARC family (config/study/arc_*.py on config/arc1.py): its dry run costs every full run before any
dataset is built, with its build command; the cpu twin plans the synthetic build; the report shows pass@2.
Seconds, nothing trained.
"""
import json
import os
import re
import shutil

from conftest import ROOT, fresh_checkout, run

STUDY = os.path.join(ROOT, 'config', 'study')
ARC = sorted(f[:-3] for f in os.listdir(STUDY) if f.startswith('arc_') and f.endswith('.py'))
BASE_POINTS = {'arc_aug_1000', 'arc_rec_L4', 'arc_emb_len_16'}
ENV = {'OMP_NUM_THREADS': '1'}


def blocks_of(out):
    return {b.split()[0]: b for b in re.split(r'\n(?=\S)', out) if b.strip() and not b.startswith('config:')}


def test_the_family_files():
    assert ARC == sorted(['arc_aug_100', 'arc_aug_300', 'arc_aug_1000', 'arc_rec_L2', 'arc_rec_L4', 'arc_rec_L6',
                          'arc_emb_len_4', 'arc_emb_len_16', 'arc_emb_len_32'])
    p = run(['study.py'], env=ENV)
    for fam in ('arc_aug_*', 'arc_rec_*', 'arc_emb_len_*'):
        assert fam in p.stdout


def test_the_dry_run_costs_every_full_arc_run_without_building_anything(tmp_path):
    fresh = fresh_checkout(tmp_path / 'checkout')
    p = run(['study.py', "--pattern=arc_*", '--dry_run=True', '--pod=v4-32', f'--data_root={tmp_path}/d'], env=ENV,
            cwd=fresh)
    out, blocks = p.stdout, blocks_of(p.stdout)
    assert 'scale full: 9 experiment(s), 7 run(s)' in out
    for name in ARC:
        b = blocks[name]
        if name in BASE_POINTS and 'same run as' in b:
            continue
        assert f"python train.py config/study/{name}.py " in b, b
        assert re.search(r"6,829,058 parameters \| [\d.]+ GFLOPs per example-step \| [\d,]+ steps x batch 768", b), b
        # the 9 intermediate evaluations also evaluate the raw weights (train.py): 19 passes
        assert re.search(r"training [\d.e+]+ FLOPs \| 10 evaluation\(s\), 19 passes [^:|]*: [\d.e+]+ FLOPs", b), b
        assert 'on a v4-32: about ' in b and '(assumed MFU)' in b
        n = re.search(r"data/arc1concept-aug-(\d+)", b)[1]
        # no --concept_dir: a folder outside the repository is on no user's machine; ConceptARC is downloaded
        assert (f"built first by: python prepare_arc.py --version 1 --num_aug {n} "
                f"--output_dir data/arc1concept-aug-{n}") in b, b
    assert sum('same run as' in blocks[n] for n in BASE_POINTS) == 2  # the base point: one run for three files
    # ARC-AGI-1 at 1000 augmentations: 100,000 epochs x 960 tasks x 3,633,410 / 876,405 rows a puzzle / 768
    base = next(blocks[n] for n in BASE_POINTS if 'same run' not in blocks[n])
    assert '518,226 steps' in base and '398 GFLOPs per example-step' in base and '-> out/study/arc_base' in base
    assert '239 GFLOPs' in blocks['arc_rec_L2'] and '557 GFLOPs' in blocks['arc_rec_L6']
    assert re.search(r'total: 7 costed run\(s\)', out)
    assert 'ASSUMED, not measured: v4-32 = 16 chips x 275 TFLOP/s' in out
    assert not os.path.exists(tmp_path / 'd') and sorted(os.listdir(fresh)) == ['config']  # nothing built


def test_the_cpu_twin_of_the_base_run_plans_the_synthetic_build(tmp_path):
    p = run(['study.py', '--pattern=arc_rec_L4', '--dry_run=True', '--scale=cpu', f'--data_root={tmp_path}/d'],
            env=ENV)
    b = blocks_of(p.stdout)['arc_rec_L4']
    data = f'{tmp_path}/d/arc-synthetic-10-aug-100'
    assert (f"built first by: python prepare_arc.py --synthetic --canvas 10 --num_tasks 96 --num_eval_tasks 32 "
            f"--num_aug 100 --output_dir {data}") in b, b
    for flag in ('--hidden_size=32', '--puzzle_emb_ndim=32', '--num_heads=2', '--halt_max_steps=4', '--epochs=16',
                 f'--data_path={data}', '--device=cpu'):
        assert flag in b, (flag, b)
    assert 'cpu twin: synthetic 10x10 ARC tasks' in b
    assert re.search(r'240 steps x batch 32', b), b
    assert not os.path.exists(f'{tmp_path}/d')


def test_the_report_shows_an_arc_run_s_pass_at_2(tmp_path):
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    shutil.copy(os.path.join(STUDY, 'arc_rec_L2.py'), cfg)
    out = tmp_path / 'out' / 'arc_rec_L2'
    out.mkdir(parents=True)
    fe = dict(exact_accuracy=0.05, exact_ci_low=0.04, exact_ci_high=0.06, token_accuracy=0.9, q_halt_accuracy=0.8,
              **{'arc_pass@1': 0.3, 'arc_pass@2': 0.4, 'arc_pass@2_ci_low': 0.35, 'arc_pass@2_ci_high': 0.45,
                 'arc_tasks': 400})
    json.dump(dict(final_eval=fe, parameters=6829058, train_flops=9.5e19, flops_per_example_step=2.39e11,
                   step=518226), open(out / 'results.json', 'w'))
    run(['study.py', '--pattern=arc_*', f'--config_dir={cfg}', f'--out_root={tmp_path}/out', '--report=True'],
        env=ENV)
    md = open(tmp_path / 'out' / 'report.md').read()
    assert 'ARC pass@2 % (95% CI)' in md and '40.0 (35.0-45.0)' in md and '5.0 (4.0-6.0)' in md
    csv_head = open(tmp_path / 'out' / 'report.csv').readline()
    assert 'arc_pass2' in csv_head and 'arc_pass2_ci_low' in csv_head
