"""
A study family of adaptations (config/adapt/*.py at the twin's scale; here the same shape, tiny): each run starts
from a pretrained checkpoint (the file's init_from, passed on as --init_from=resume:FILE, so a rerun of the study
resumes the run's own checkpoints), on a dataset of new tasks the file's _prepare builds, in a time budget; the
report lists the family's ARC scores. About a minute on one core.
    python -m pytest -q tests/test_study_adapt.py
"""
import csv
import json
import os
import re

from conftest import ROOT, run

ENV = {'OMP_NUM_THREADS': '1'}
TINY = dict(hidden_size=32, num_heads=2, mlp_t=False, pos_encodings='rope', puzzle_emb_ndim=32, puzzle_emb_len=2,
            H_cycles=1, L_cycles=1, halt_max_steps=3, global_batch_size=8, eval_batch_size=6, lr=2e-3,
            lr_warmup_steps=1, forward_dtype='float32', loss_dtype='float32', device='cpu', xla_cache_dir='',
            tensorboard=False, log_interval=5)


def test_a_family_of_adaptations_starts_each_run_from_the_checkpoint_and_reports_it(tmp_path):
    data, cfg, out = tmp_path / 'pre', tmp_path / 'cfg', tmp_path / 'out'
    run(['prepare_arc.py', '--synthetic', '--canvas=4', '--num_tasks=4', '--num_eval_tasks=2', '--num_aug=2',
         '--new_tasks=3', f'--output_dir={data}'], env=ENV)
    base = tmp_path / 'tiny.py'
    base.write_text(''.join(f"{k} = {v!r}\n" for k, v in TINY.items()))
    run(['train.py', str(base), f'--data_path={data}', f'--out_dir={tmp_path}/pre_run', '--max_steps=3',
         '--epochs=100', '--eval_every_epochs=1000'], env=ENV)
    ckpt = f'{tmp_path}/pre_run/ckpt_00000003.pt'
    new = tmp_path / 'new'
    prepare = (f"prepare_arc.py --challenges {data}/json/arc-agi_new_challenges.json --solutions "
               f"{data}/json/arc-agi_new_solutions.json --canvas 4 --num_aug 2 --output_dir {new}")
    cfg.mkdir()
    for name, extra in (('ad_full_1', ''), ('ad_emb_1', 'freeze_weights = True\n')):
        (cfg / f'{name}.py').write_text(
            f"_base = {str(base)!r}\n_prepare = {prepare!r}\nout_dir = 'out/{name}'\ninit_from = {ckpt!r}\n"
            f"data_path = {str(new)!r}\nepochs = 100000\neval_every_epochs = 20\narc_pool_votes = True\n"
            f"max_minutes = 0.15\n{extra}")
    args = ['study.py', f'--config_dir={cfg}', '--pattern=ad_*', f'--out_root={out}']
    p = run(args, env=ENV, timeout=600)
    assert os.path.exists(new / 'test_views.npz')  # built by the files' _prepare before the first run
    for name in ('ad_full_1', 'ad_emb_1'):
        log = open(out / name / 'train.log').read()
        assert f"init_from=resume:{ckpt}: no checkpoint in {out}/{name} yet, starting from {ckpt}" in log, log[-2000:]
        assert "puzzle-embedding table replaced: 19 -> 10 identifiers, every row the checkpoint's mean row" in log
        assert 'time budget: stopping at step' in log
        res = json.load(open(out / name / 'results.json'))
        assert res['final_eval']['arc_tasks'] == 3
    # the same command again: both runs are done, nothing trains
    p = run(args, env=ENV)
    assert p.stdout.count('done before') == 2 and 'time budget' not in p.stdout, p.stdout[-2000:]
    run(args + ['--report=True'], env=ENV)
    rows = {r['name']: r for r in csv.DictReader(open(out / 'report.csv'))}
    assert set(rows) == {'ad_full_1', 'ad_emb_1'}
    assert all(r['arc_prize_pass2'] != '' and r['arc_pooled_pass2'] != '' for r in rows.values()), rows


def test_a_dry_run_times_a_run_with_a_budget_by_its_max_minutes_not_by_its_epochs(tmp_path):
    """An adaptation's epochs are more than any budget lets it train (config/adapt/*: 100000): its time is at
    most its max_minutes, which is what the estimate says (a speed figure slow enough that its epochs would take
    hours)."""
    data = tmp_path / 'pre'
    run(['prepare_arc.py', '--synthetic', '--canvas=4', '--num_tasks=4', '--num_eval_tasks=2', '--num_aug=2',
         f'--output_dir={data}'], env=ENV)
    base, cfg = tmp_path / 'tiny.py', tmp_path / 'cfg'
    base.write_text(''.join(f"{k} = {v!r}\n" for k, v in TINY.items()))
    cfg.mkdir()
    for name, budget in (('ad_full_1', 0.1), ('ad_full_2', 0.2)):
        (cfg / f'{name}.py').write_text(
            f"_base = {str(base)!r}\nout_dir = 'out/{name}'\ninit_from = '{tmp_path}/pre_run/ckpt_00000003.pt'\n"
            f"data_path = {str(data)!r}\nepochs = 100000\neval_every_epochs = 20\nmax_minutes = {budget}\n")
    p = run(['study.py', f'--config_dir={cfg}', '--pattern=ad_*', f'--out_root={tmp_path}/out', '--dry_run=True',
             '--examples_per_s=1'], env=ENV)
    about = re.findall(r'\| about (.+)$', p.stdout, re.M)
    assert about == ['6 s (its max_minutes)', '12 s (its max_minutes)'], p.stdout[-3000:]
    assert 'sequential, each run on 1 device(s) (hosts_mode=all, slots=1): 18 s' in p.stdout, p.stdout[-3000:]


def test_a_file_that_changes_an_adaptation_keeps_its_base_s_dataset_builder(tmp_path):
    """_base applies a file's recipe first, so a point that changes only its minutes is one line more: the base's
    _prepare builds its dataset too, unless the point names a dataset of its own (the base's builder makes the
    base's)."""
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    base, new = cfg / 'ad_full_1.py', tmp_path / 'new'
    base.write_text(''.join(f"{k} = {v!r}\n" for k, v in TINY.items()) +
                    f"_prepare = 'prepare_arc.py --challenges c.json --canvas 4 --output_dir {new}'\n"
                    f"out_dir = 'out/ad_full_1'\ndata_path = {str(new)!r}\nmax_minutes = 0.1\n")
    (cfg / 'ad_full_3.py').write_text(f"_base = {str(base)!r}\nout_dir = 'out/ad_full_3'\nmax_minutes = 0.3\n")
    (cfg / 'ad_other_1.py').write_text(f"_base = {str(base)!r}\nout_dir = 'out/ad_other_1'\n"
                                       f"data_path = '{tmp_path}/other'\n")
    p = run(['study.py', f'--config_dir={cfg}', '--pattern=ad_*', f'--out_root={tmp_path}/out', '--dry_run=True'],
            env=ENV)
    built = re.findall(r'^  data (\S+): (.*)$', p.stdout, re.M)
    builder = f'missing; built first by: python prepare_arc.py --challenges c.json --canvas 4 --output_dir {new}'
    assert built == [(str(new), builder)] * 2 + [(f'{tmp_path}/other', 'MISSING, and no rule builds it')], \
        p.stdout[-3000:]
