"""
What a study (study.py) checks and counts: one point per run in a family's fit and plots (two experiments that
are one run weigh once), the evaluations a run really makes in its cost, keys that do not shape a result
leaving a finished run reused, bad experiment files and bench files refused in one line each before anything
runs, and a file name without a family. Fake results.json files, and one tiny real run at the cpu scale.
    python -m pytest -q tests/test_study_checks.py
"""
import json
import os
import re
import shutil

import pytest

from conftest import ROOT, assert_user_error, run

STUDY = os.path.join(ROOT, 'config', 'study')


def fake_results(out, leaf, params=10 ** 6, exact=0.5, config=None):
    """A finished run's results.json, as train.py writes it (the keys a study reads)."""
    os.makedirs(f'{out}/{leaf}', exist_ok=True)
    fe = dict(exact_accuracy=exact, exact_ci_low=max(0, exact - 0.02), exact_ci_high=min(1, exact + 0.02),
              token_accuracy=exact, q_halt_accuracy=1.0, count=1000)
    json.dump(dict(parameters=params, train_flops=params * 1e6, flops_per_example_step=params, step=100,
                   final_eval=fe, best_eval=None, config=config or {}, wall_s=dict(total=1.0), device_hours=1e-3,
                   world_size=1), open(f'{out}/{leaf}/results.json', 'w'))


def test_experiments_that_are_one_run_are_one_point_of_their_family(tmp_path):
    from studies.plan import Options, load_experiments
    from studies import report
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    for f in os.listdir(STUDY):
        if f.startswith('size_'):
            shutil.copy(os.path.join(STUDY, f), cfg)  # size_L2 and size_d512 are one run: out/study/base
    law = lambda p: 0.4 * (p / 1e6) ** -0.7 + 0.05
    sizes = dict(size_L1=2.6e6, base=5e6, size_L4=9.9e6, size_d256=1.3e6, size_d384=2.9e6, size_d768=11.3e6,
                 size_d1024=20e6)
    for i, (leaf, p) in enumerate(sizes.items()):  # off the law by turns, so how much each point weighs shows
        fake_results(out, leaf, int(p), 1 - law(p) * (1 + 0.15 * (-1) ** i))
    run(['study.py', '--pattern=size_*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True'])
    line = next(l for l in open(f'{out}/report.md').read().splitlines() if l.startswith('| size_* | parameters |'))
    want = report.fit_power_law([int(p) for p in sizes.values()], [1 - (1 - law(p) * (1 + 0.15 * (-1) ** i))
                                                             for i, p in enumerate(sizes.values())])
    assert f"| 7 | {report.fit_text(want)} |" in line, (line, report.fit_text(want))
    # the plots draw the shared run once, labelled by both points
    opts = Options(scale='full', root=out, local_root=out, data_root='', config_dir=str(cfg), extra={},
                   extra_args=[], nproc=1, seeds=1)
    drawn = report.one_per_run(report.points(report.collect(load_experiments(['size_*'], opts)[1]), 1))
    assert sorted(r['point'] for r in drawn) == ['L1', 'L2=d512', 'L4', 'd1024', 'd256', 'd384', 'd768']
    assert os.path.getsize(f'{out}/acc_vs_params.png') > 5000


def eval_cost(text):
    """(passes, FLOPs) of the dry run's line of a run's evaluations."""
    m = re.search(r'\| (\d+) evaluation\(s\)(?:, (\d+) passes)?[^:|]*:? ([\d.e+]+) FLOPs', text)
    assert m, text
    return int(m[2] or m[1]), float(m[3])


def test_the_dry_run_counts_the_evaluations_train_py_makes(tmp_path):
    tmp, out = str(tmp_path), f'{tmp_path}/out'
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(STUDY, 'rec_L2.py'), tmp_path / 'cfg')
    # an evaluation every 4 epochs of 40 steps: one in the middle, of the EMA and of the raw weights, then the
    # final one (the EMA's), each in 2 views
    study = ['study.py', '--pattern=rec_L2', '--scale=cpu', f'--config_dir={tmp}/cfg', f'--out_root={out}',
             f'--data_root={tmp}/data', '--extra=--max_steps=40 --eval_every_epochs=4 --eval_views=2']
    run(study)
    log = open(f'{out}/rec_L2/train.log').read()
    passes = len(re.findall(r'^eval (on|of the raw weights)', log, re.M))
    evals = [json.loads(l) for l in open(f'{out}/rec_L2/metrics.jsonl') if '"eval_flops"' in l]
    flops = sum(e['eval_flops'] + e.get('raw', {}).get('eval_flops', 0) for e in evals)
    assert passes == 3 and all(e['views'] == 2 for e in evals)
    got = eval_cost(run(study + ['--dry_run=True']).stdout)
    assert got[0] == passes and got[1] == pytest.approx(flops, rel=5e-3), (got, passes, flops)


def test_keys_that_do_not_shape_a_result_leave_a_finished_run_reused(tmp_path):
    cfg, out = tmp_path / 'cfg', str(tmp_path / 'out')
    cfg.mkdir()
    shutil.copy(os.path.join(STUDY, 'rec_L2.py'), cfg)
    fake_results(out, 'rec_L2', config=dict(L_cycles=2, max_steps=0, tensorboard=True, watchdog_minutes=30.0,
                                            profile_steps='', kernels='auto'))
    listing = ['study.py', '--pattern=rec_L2', f'--config_dir={cfg}', f'--out_root={out}', '--list_only=True']
    for extra in ('', '--tensorboard=False --watchdog_minutes=0 --profile_steps=1:2 --kernels=off'):
        p = run(listing + [f'--extra={extra}'])
        assert re.search(r'^rec_L2 .*\[done\]$', p.stdout, re.M), (extra, p.stdout)
    p = run(listing + ['--extra=--tensorboard=False --max_steps=7'])  # a key that does shape it
    line = next(l for l in p.stdout.splitlines() if l.startswith('rec_L2 '))
    assert 'done, not used' in line and 'max_steps' in line and 'tensorboard' not in line, line


@pytest.mark.parametrize('lines, words', [
    (['global_batch_size = 0'], ['global_batch_size=0', '(allowed: > 0)']),
    (['expansion = 0.0'], ['expansion=0.0', '(allowed: > 0)']),
    (['epochs = 0'], ['epochs=0', '(allowed: > 0)']),
    (['L_layers = 0'], ['L_layers=0', '(allowed: > 0)']),
    (['L_cycle = 3'], ["unknown key 'L_cycle'", 'did you mean L_cycles']),
    (['eval_interval = 3'], ["'eval_interval'", 'is now called eval_every_epochs', 'write eval_every_epochs = ...']),
    (["L_cycles = '3'"], ["L_cycles='3'", 'is a str, but L_cycles is an int']),
    (["pos_encodings = 'rotary'"], ["pos_encodings='rotary'", "'rope' | 'learned' | 'none'"]),
])
def test_bad_values_in_an_experiment_file_are_refused_before_anything_runs(tmp_path, lines, words):
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    (cfg / 'bad_one.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_one'\n"
                                    + '\n'.join(lines) + '\n')
    study = ['study.py', '--pattern=bad_*', f'--config_dir={cfg}', f'--out_root={tmp_path}/out',
             f'--data_root={tmp_path}/data']
    for more in (['--dry_run=True', '--examples_per_s=1000'], ['--scale=cpu']):
        p = run(study + more, check=False)
        said = assert_user_error(p, f'{cfg}/bad_one.py, line 3', *words, one_line=True)
        assert said.startswith('config error: ') and 'parameters |' not in p.stdout, said
        assert not os.path.exists(f'{tmp_path}/data') and not os.path.exists(f'{tmp_path}/out')


def test_every_problem_of_every_experiment_is_its_own_line(tmp_path):
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    (cfg / 'bad_one.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_one'\n"
                                    "global_batch_size = 0\nlr = 'fast'\n")
    (cfg / 'bad_two.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/bad_two'\nhidden_sise = 8\n")
    p = run(['study.py', '--pattern=bad_*', f'--config_dir={cfg}', '--dry_run=True'], check=False)
    said = assert_user_error(p).strip()
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 3 and all(l.startswith('config error: ') for l in lines), said
    one = [l for l in lines if 'bad_one.py, line' in l]
    assert any('line 3' in l and 'global_batch_size=0' in l for l in one), lines
    assert any('line 4' in l and "lr='fast'" in l for l in one), lines
    assert 'bad_two.py, line 3' in lines[2] and 'did you mean hidden_size' in lines[2], lines


def test_a_config_file_whose_name_has_no_family_is_listed(tmp_path):
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    shutil.copy(os.path.join(STUDY, 'rec_L2.py'), cfg)
    (cfg / 'mybase.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/mybase'\n")
    p = run(['study.py', f'--config_dir={cfg}'])
    assert re.search(r'^  rec_\* +L2$', p.stdout, re.M) and re.search(r'^  mybase +mybase$', p.stdout, re.M), p.stdout


def test_a_bench_file_that_cannot_give_a_speed_is_one_line(tmp_path):
    dry = ['study.py', '--pattern=rec_L2', '--dry_run=True']
    p = run(dry + [f'--bench_file={tmp_path}/none.txt'], check=False)
    assert_user_error(p, 'bench_file=', 'none.txt', 'No such file', "'bench:'", 'examples_per_s', one_line=True)
    (tmp_path / 'cut.txt').write_text("bench: device=cpu batch=32 ms_per_step=12.0\n")
    p = run(dry + [f'--bench_file={tmp_path}/cut.txt'], check=False)
    assert_user_error(p, 'bench_file=', 'cut.txt', 'examples_per_s', 'flops_per_example', one_line=True)
    # a speed of no finite size (a step timed at 0 ms) would estimate every run at 0 s
    (tmp_path / 'inf.txt').write_text("bench: device=cpu examples_per_s=inf flops_per_example=4.27e10\n")
    p = run(dry + [f'--bench_file={tmp_path}/inf.txt'], check=False)
    assert_user_error(p, 'bench_file=', 'inf.txt', 'examples_per_s', one_line=True)


def test_a_bench_of_another_shape_dtype_or_device_than_the_runs_is_said(tmp_path):
    # the bench's FLOP rate is carried over to each run's FLOPs; measured at another batch, width or dtype it
    # can be several times off, so the dry run says what was benched against what the runs are
    bench = run(['bench.py', 'config/quickstart.py', '--steps=2', '--warmup_steps=1', '--eval_batches=1'])
    line = next(l for l in bench.stdout.splitlines() if l.startswith('bench:'))
    dry = ['study.py', '--pattern=rec_L2', '--scale=cpu', '--dry_run=True']
    (tmp_path / 'other.txt').write_text(bench.stdout)
    out = run(dry + [f'--bench_file={tmp_path}/other.txt']).stdout
    note = [l for l in out.splitlines() if 'bench' in l and 'not the shape' in l]
    assert len(note) == 1 and 'batch=128' in note[0] and 'batch=32' in note[0], out
    assert 'seq_len=36' in note[0] and 'seq_len=16' in note[0] and 'device=cpu dtype=float32' in out, out
    params = re.search(r'not the shape of these runs \(.*(params=\d+)\)', note[0]).group(1)
    same = re.sub(r'batch=\d+', 'batch=32', re.sub(r'seq_len=\d+', 'seq_len=16', re.sub(r'params=\d+', params, line)))
    (tmp_path / 'same.txt').write_text(same + '\n')
    out = run(dry + [f'--bench_file={tmp_path}/same.txt']).stdout
    assert 'not the shape' not in out and 'about ' in out, out
    (tmp_path / 'bf16.txt').write_text(same.replace('dtype=float32', 'dtype=bfloat16') + '\n')
    out = run(dry + [f'--bench_file={tmp_path}/bf16.txt']).stdout
    assert re.search(r'^note: the bench timed device=cpu dtype=bfloat16 .*not the shape.*dtype=float32', out, re.M), out


@pytest.mark.parametrize('flag,words', [
    ('--examples_per_s=-5', ['examples_per_s=-5.0', '0: none']),
    ('--examples_per_s=1e999', ['examples_per_s=inf', 'not a finite number']),
    ('--host_index=-5', ['host_index=-5', '-1']),
    ('--num_hosts=-3', ['num_hosts=-3', '0']),
    ('--status_every=-1', ['status_every=-1.0', '> 0']),
])
def test_a_negative_count_or_speed_is_refused_not_taken_as_none(tmp_path, flag, words):
    """A key whose 0 or -1 means 'none' or 'from the environment' takes no other value below it (nor an infinite
    speed): each is one line with the allowed values, before any run or plan."""
    p = run(['study.py', '--pattern=rec_L2', '--dry_run=True', f'--out_root={tmp_path}/out', flag], check=False)
    said = assert_user_error(p, 'config error: ', *words, 'allowed', one_line=True)
    assert 'parameters |' not in p.stdout, said


def test_a_dataset_built_by_the_reference_counts_its_augmentations_from_its_arrays(tmp_path):
    """The reference's Sudoku and Maze builders write the group count as total_puzzles: a study over datasets it
    built (given by path) counted every one as 0 augmentations (acc_vs_data.png drew them at one x); the arrays
    hold the count."""
    from studies.plan import Options, dataset_for
    d = tmp_path / 'sudoku4-aug-2'
    run(['prepare_sudoku.py', '--generate', '30', '--size', '4', '--num_test', '6', '--num_aug', '2',
         '--output_dir', str(d)])
    meta = json.load(open(d / 'train' / 'dataset.json'))
    json.dump(dict(meta, total_puzzles=meta['total_groups']), open(d / 'train' / 'dataset.json', 'w'))
    opts = Options(scale='full', root=str(tmp_path), local_root=str(tmp_path), data_root='', config_dir='',
                   extra={}, extra_args=[], nproc=1, seeds=1)
    got = dataset_for(dict(data_path=str(d)), {}, opts)
    assert (got['puzzles'], got['aug'], got['test']) == (30, 2, 6), got


@pytest.mark.parametrize('flag,words', [
    ('--pod=v4-1', ["pod='v4-1'", 'TensorCores', 'v4-8']),
    ('--pod=v6e-0', ["pod='v6e-0'", 'at least 1 chip']),
    ('--out_root=gs://', ["out_root='gs://'", 'gs://BUCKET/prefix']),
    ('--out_root=gs:///study', ["out_root='gs:///study'", 'gs://BUCKET/prefix']),
])
def test_a_pod_of_no_chips_or_a_bucket_without_its_name_is_refused_in_one_line(flag, words):
    """A slice name that counts no chip would divide the dry run's FLOPs by a rate of 0, and a gs:// root without
    a bucket's name would send the runs to a local folder named 'gs:': each is one line before anything runs."""
    p = run(['study.py', '--pattern=rec_L2', '--dry_run=True', flag], check=False)
    said = assert_user_error(p, 'config error: ', *words, one_line=True)
    assert 'parameters |' not in p.stdout, said


def test_torchtpu_runs_go_one_at_a_time_and_their_memory_is_not_taken_for_the_host_s(tmp_path):
    """train.py --device=tpu (TorchTPU) starts one process per TPU device of its host itself: two such runs at once
    (--slots) or one under study.py's torchrun (--nproc) would each take every chip, so either is one line before
    anything runs. Its model is on the chips: the host's memory is no limit of it (as for torch_xla's TPU runs)."""
    study = ['study.py', '--pattern=rec_L2', '--scale=cpu', '--extra=--device=tpu', f'--out_root={tmp_path}/out',
             f'--data_root={tmp_path}/data']
    for flag in ('--slots=2', '--nproc=2'):
        p = run(study + ['--dry_run=True', flag], check=False)
        assert_user_error(p, "device='tpu'", flag, '--slots=1 --nproc=1', one_line=True)
    p = run(study, env=dict(TRM_MEMORY_AVAILABLE='1e8'), check=False)  # a host of 100 MB: a CPU run is refused
    assert 'not run (its dataset not built either)' not in p.stdout, p.stdout[-3000:]
    assert "device='tpu' needs TorchTPU" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]  # its train.py ran
