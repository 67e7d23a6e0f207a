"""
study.py --eval_only: test-time breadth (views) and depth (supervision steps) as a study axis. A tiny real study
at the cpu scale (one run of 40 steps), evaluated again in 4 views at two step counts: the evals files written,
a second call skipping them, an unfinished run listed as skipped, and the report's table and plot; a gs://
out_root's saved evaluations found in the bucket (GCS emulator).
    python -m pytest -q tests/test_study_views.py
"""
import csv
import json
import os
import re
import shutil
import time
from types import SimpleNamespace

from runkeep import gcs
from studies.plan import saved_evals
from conftest import BUCKET, ROOT, assert_user_error, run, train

STUDY = os.path.join(ROOT, 'config', 'study')
CPU_RUN = ['--scale=cpu', "--extra=--max_steps=40 --checkpoint_interval=20 --log_interval=20"]


def study_args(tmp, pattern, *more):
    return ['study.py', f'--pattern={pattern}', f'--config_dir={tmp}/cfg', f'--out_root={tmp}/out',
            f'--data_root={tmp}/data'] + CPU_RUN + list(more)


def test_finished_runs_are_evaluated_in_views_and_steps_once_and_compared(tmp_path):
    tmp, out = str(tmp_path), f'{tmp_path}/out'
    (tmp_path / 'cfg').mkdir()
    for name in ('rec_L2', 'rec_L4'):
        shutil.copy(os.path.join(STUDY, name + '.py'), tmp_path / 'cfg')
    run(study_args(tmp, 'rec_L2'))  # rec_L4 is never trained: unfinished
    evals = ['--eval_only=True', '--eval_views=1,2,4', '--eval_steps=2,4']
    p = run(study_args(tmp, 'rec_*', *evals))
    summary = p.stdout.split('summary of the test-time evaluations')[1]
    assert re.search(r'rec_L4 +skipped +not finished \(not started\)', summary), summary
    for S in (2, 4):
        assert re.search(rf'rec_L2 +steps {S} +done ', summary), summary
        assert f'--init_from=resume --eval_only=True --eval_views=4 --eval_steps={S}' in p.stdout
    assert sorted(os.listdir(f'{out}/rec_L2/evals')) == ['views4-steps2.json', 'views4-steps4.json']
    assert not os.path.exists(f'{out}/rec_L4/evals')
    recs = {S: json.load(open(f'{out}/rec_L2/evals/views4-steps{S}.json')) for S in (2, 4)}
    assert recs[4]['step'] == 40 and [v['views'] for v in recs[4]['eval']['by_views']] == [1, 2, 4]

    # again, and with fewer views: the saved evaluations (4 views) cover them; nothing runs
    for views in ('1,2,4', '1,2'):
        p = run(study_args(tmp, 'rec_*', '--eval_only=True', f'--eval_views={views}', '--eval_steps=2,4'))
        assert 'evaluating in' not in p.stdout and '0 to run' in p.stdout, p.stdout
        summary = p.stdout.split('summary of the test-time evaluations')[1]
        assert len(re.findall(r'rec_L2 +steps [24] +done before', summary)) == 2, summary
    # 0: the run's own steps (the cpu scale evaluates at twice halt_max_steps: 8), a new file
    p = run(study_args(tmp, 'rec_L2', '--eval_only=True', '--eval_views=2', '--eval_steps=0'))
    assert '--eval_views=2 --eval_steps=8' in p.stdout and os.path.exists(f'{out}/rec_L2/evals/views2-steps8.json')

    # the report: one row per (steps, views), the accuracies and FLOPs of the saved files; the plot
    run(study_args(tmp, 'rec_*', '--report=True'))
    rows = list(csv.DictReader(open(f'{out}/report_views.csv')))
    assert [(r['run'], r['steps'], r['views']) for r in rows] == \
        [('rec_L2', str(S), str(k)) for S in (2, 4) for k in (1, 2, 4)] + [('rec_L2', '8', '1'), ('rec_L2', '8', '2')]
    md = open(f'{out}/report.md').read()
    assert '## Test-time compute: views and supervision steps' in md
    for r in rows[:6]:
        res = recs[int(r['steps'])]['eval']
        v = next(v for v in res['by_views'] if v['views'] == int(r['views']))
        for m in ('vote', 'verified', 'oracle', 'vote_q_halt'):
            assert float(r[m]) == v[m], (r, m)
        flops = res['eval_flops'] / res['count'] / 4 * int(r['views'])
        assert float(r['flops_per_puzzle']) == flops and float(r['seconds']) == recs[int(r['steps'])]['seconds']
        assert r['checkpoint_step'] == str(recs[int(r['steps'])]['step'])  # the weights it evaluated
        line = f"| rec_L2 | {r['checkpoint_step']} | {r['views']} | {r['steps']} | {100 * v['vote']:.1f} | " \
               f"{100 * v['verified']:.1f} | {100 * v['oracle']:.1f} |"
        assert line in md, (line, md)
    assert int(rows[6]['steps']) == 8 and int(rows[6]['halt_max_steps']) == 4  # the run's own: twice its halt steps
    assert os.path.getsize(f'{out}/acc_vs_test_compute.png') > 5000


def test_view_counts_an_evaluation_does_not_report_are_refused():
    p = run(['study.py', '--pattern=rec_L2', '--eval_only=True', '--eval_views=1,3,4'], check=False)
    assert_user_error(p, 'eval_views', '[3]', 'powers of two')
    p = run(['study.py', '--pattern=rec_L2', '--eval_only=True', '--eval_steps=4,x'], check=False)
    assert_user_error(p, 'eval_steps', 'comma-separated integers')
    p = run(['study.py', '--pattern=rec_L2', '--eval_only=True', '--report=True'], check=False)
    assert_user_error(p, 'choose one of', 'eval_only')


def test_a_bucket_out_root_s_saved_evaluations_are_found_skipped_and_reported(emulator, tmp_path):
    """The evals files of a gs:// run are listed in its bucket: the runner skips them, the report reads them
    (a finished run made by hand, as train.py writes it: no training here)."""
    cfg, made = tmp_path / 'cfg', tmp_path / 'made'
    prefix = f"views_{os.getpid()}_{int(time.time() * 1000)}"
    out, local = f'gs://{BUCKET}/{prefix}', os.path.join(ROOT, 'out', BUCKET, prefix)  # local: runkeep.startup.local_folder
    cfg.mkdir()
    (cfg / 'up_p0.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/up_p0'\nhalt_max_steps = 4\n")
    (made / 'evals').mkdir(parents=True)
    fe = dict(exact_accuracy=0.5, exact_ci_low=0.4, exact_ci_high=0.6, token_accuracy=0.9, q_halt_accuracy=1.0,
              count=100)
    json.dump(dict(parameters=1000, train_flops=1e9, flops_per_example_step=1e3, step=10, final_eval=fe, config={}),
              open(made / 'results.json', 'w'))
    by = [dict(views=k, vote=v, verified=v + 0.125, oracle=v + 0.25, accepted=0.7, vote_q_halt=0.5,
               verified_q_halt=0.6, oracle_q_halt=0.7, accepted_q_halt=0.7)
          for k, v in ((1, 0.5), (2, 0.25), (4, 0.375))]
    json.dump(dict(step=10, checkpoint='ckpt_00000010.pt', seconds=12.5, device='cpu', world_size=1,
                   config=dict(halt_max_steps=4), eval=dict(fe, views=4, eval_flops=4 * 4 * 100 * 1e3, by_views=by)),
              open(made / 'evals' / 'views4-steps4.json', 'w'))
    client = gcs.GCS(endpoint=emulator)
    for name in ('results.json', 'evals/views4-steps4.json'):
        client.upload(str(made / name), f'{out}/up_p0/{name}')
    env = dict(STORAGE_EMULATOR_HOST=emulator.replace('http://', ''))
    try:
        p = run(['study.py', '--pattern=up_*', f'--config_dir={cfg}', f'--out_root={out}', '--eval_only=True',
                 '--eval_views=1,2,4', '--eval_steps=4', f'--report_dir={tmp_path}/report'], env=env)
        assert '1 done before, 0 to run' in p.stdout and 'evaluating in' not in p.stdout, p.stdout
        rows = list(csv.DictReader(open(tmp_path / 'report' / 'report_views.csv')))
        assert [(r['views'], r['vote'], r['verified'], r['oracle']) for r in rows] == \
            [('1', '0.5', '0.625', '0.75'), ('2', '0.25', '0.375', '0.5'), ('4', '0.375', '0.5', '0.625')]
        assert [float(r['flops_per_puzzle']) for r in rows] == [4e3, 8e3, 16e3] and rows[0]['seconds'] == '12.5'
    finally:  # the local copies of the bucket's files, in the repository's out/, and the folders above if empty
        shutil.rmtree(local, ignore_errors=True)
        try:
            os.removedirs(os.path.dirname(local))
        except OSError:
            pass


def one_view_report(tmp_path, verified, exact_by_steps):
    """The report_views.csv row of a finished run with halt_max_steps 4 (made by hand, as train.py writes it: no
    training here) and one saved one-view evaluation at len(exact_by_steps) steps: exact 0.5 at step 4."""
    cfg, out, S = tmp_path / 'cfg', tmp_path / 'out', len(exact_by_steps)
    cfg.mkdir()
    (cfg / 'one_p0.py').write_text("_base = 'config/baseline.py'\nout_dir = 'out/study/one_p0'\n"
                                   "halt_max_steps = 4\n")
    (out / 'one_p0' / 'evals').mkdir(parents=True)
    fe = dict(exact_accuracy=0.5, exact_ci_low=0.4, exact_ci_high=0.6, token_accuracy=0.9, q_halt_accuracy=1.0,
              count=100, exact_accuracy_q_halt=0.375, verified_accuracy=verified)
    json.dump(dict(parameters=1000, train_flops=1e9, flops_per_example_step=1e3, step=10, final_eval=fe,
                   config=dict(halt_max_steps=4)), open(out / 'one_p0' / 'results.json', 'w'))
    json.dump(dict(step=10, checkpoint='ckpt_00000010.pt', seconds=3.5, device='cpu', world_size=1,
                   config=dict(halt_max_steps=4), eval=dict(fe, views=1, eval_flops=S * 100 * 1e3,
                                                            exact_by_steps=exact_by_steps)),
              open(out / 'one_p0' / 'evals' / f'views1-steps{S}.json', 'w'))
    run(['study.py', '--pattern=one_*', f'--config_dir={cfg}', f'--out_root={out}', '--report=True'])
    row, = csv.DictReader(open(out / 'report_views.csv'))
    return row


def test_one_view_beyond_halt_max_steps_is_reported_after_its_last_step(tmp_path):
    """A one-view evaluation at S > halt_max_steps: evaluate's headline figures are at halt_max_steps, its
    exact_by_steps runs to S. The report's row at S steps takes the accuracy after the S-th (a finished run made
    by hand, as train.py writes it: no training here)."""
    row = one_view_report(tmp_path, 0.5, [0.125, 0.25, 0.375, 0.5, 0.5, 0.5, 0.5, 0.75])
    assert (row['views'], row['steps'], row['halt_max_steps']) == ('1', '8', '4')
    assert (row['vote'], row['verified'], row['oracle']) == ('0.75', '0.75', '0.75'), row
    assert row['vote_q_halt'] == '0.375' and row['accepted'] == '', row  # the verifier's count is at step 4


def test_one_view_within_halt_max_steps_counts_what_the_verifier_accepts_as_more_views_do(tmp_path):
    """A one-view evaluation of a maze run: a valid shortest path other than the label's is solved in a k-view
    evaluation's vote, verified and oracle; the one-view row takes verified_accuracy so, not exact (which would
    read lower than the k=1 row of a larger evaluation)."""
    row = one_view_report(tmp_path, 0.625, [0.125, 0.25, 0.375, 0.5])
    assert (row['vote'], row['verified'], row['oracle'], row['accepted']) == ('0.625',) * 4, row


def test_a_saved_evaluation_of_another_checkpoint_than_results_json_s_is_left_out_of_the_report(tmp_path):
    """A run extended past an earlier finish: evals/ still holds a 4-view evaluation of the earlier checkpoint
    (step 5) beside a 1-view one of results.json's (step 10), at the same steps; the report takes step 10's, as
    study.py --eval_only does, and says why the other is left out (made by hand, as train.py writes them)."""
    out = tmp_path / 'out'
    one_view_report(tmp_path, 0.5, [0.125, 0.25, 0.375, 0.5])
    fe = dict(exact_accuracy=0.25, count=100, exact_accuracy_q_halt=0.25, verified_accuracy=0.25, views=4,
              eval_flops=16 * 100 * 1e3,
              by_views=[dict(views=k, **{m + q: 0.25 for m in ('vote', 'verified', 'oracle') for q in ('', '_q_halt')})
                        for k in (1, 2, 4)])
    stale = out / 'one_p0' / 'evals' / 'views4-steps4.json'
    json.dump(dict(step=5, seconds=1.0, config=dict(halt_max_steps=4), eval=fe), open(stale, 'w'))
    p = run(['study.py', '--pattern=one_*', f'--config_dir={tmp_path / "cfg"}', f'--out_root={out}',
             '--report=True'])
    rows = list(csv.DictReader(open(out / 'report_views.csv')))
    assert [(r['views'], r['checkpoint_step'], r['vote']) for r in rows] == [('1', '10', '0.5')], rows
    assert f"{stale} evaluated step 5, not results.json's 10: left out" in p.stdout, p.stdout
    cut = out / 'one_p0' / 'evals' / 'views8-steps4.json'  # a copy cut short: it was told as of step None
    cut.write_text(stale.read_text()[:30])
    p = run(['study.py', '--pattern=one_*', f'--config_dir={tmp_path / "cfg"}', f'--out_root={out}',
             '--report=True'])
    said = next(l for l in p.stdout.splitlines() if str(cut) in l)
    assert said.startswith(f"report: {cut} cannot be read (Unterminated string") and 'left out' in said, said
    assert [r['vote'] for r in csv.DictReader(open(out / 'report_views.csv'))] == ['0.5']


def test_an_evaluation_of_a_rolled_back_checkpoint_of_the_same_step_is_not_the_new_run_s(toy, tmp_path):
    """Roll-back: step 10's checkpoint deleted and the run resumed from step 5 with a lower lr, to step 10 again.
    The old evals file names step 10 too, but other weights: it is not results.json's (study.py --eval_only
    evaluates again, the report leaves it out); the new checkpoint's evaluation is."""
    out = tmp_path / 'o'
    steps = ['--max_steps=10', '--checkpoint_interval=5', '--log_interval=5']
    train(toy, out, *steps)
    train(toy, out, *steps, '--init_from=resume', '--eval_only=True')
    old = json.load(open(out / 'evals' / 'views1-steps4.json'))
    os.remove(out / 'ckpt_00000010.pt')
    train(toy, out, *steps, '--init_from=resume', '--lr=5e-4')
    res = json.load(open(out / 'results.json'))
    assert res['step'] == old['step'] == 10 and res['final_eval']['loss'] != old['eval']['loss']  # other weights
    e = SimpleNamespace(out_dir=str(out), local=str(out))
    assert saved_evals(e, res) == {}
    train(toy, out, *steps, '--init_from=resume', '--eval_only=True')
    assert saved_evals(e, res) == {(1, 4): str(out / 'evals' / 'views1-steps4.json')}


def test_the_test_compute_plot_keeps_points_and_labels_at_0_percent_inside_its_axes():
    """Runs that solve nothing yet (a first tiny study): their points and k labels are drawn inside the panel,
    not on its frame and over the x axis's numbers."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from studies.report import plot_views
    views = [dict(run=run, family='rec', steps=S, views=k, flops_per_puzzle=1e7 * k * S * (1 + i),
                  **{m + q: 0.0 for m in ('vote', 'verified', 'oracle') for q in ('', '_q_halt')})
             for i, run in enumerate(('rec_L2', 'rec_L4')) for S in (2, 8) for k in (1, 2, 4)]
    fig = plot_views(plt, views, 'cpu')
    fig.tight_layout()
    fig.canvas.draw()
    for ax in fig.axes:
        frame = ax.get_window_extent()
        assert ax.get_ylim()[0] < 0, ax.get_ylim()  # a point at 0 % is above the frame's bottom
        labels = [t for t in ax.texts if t.get_text().startswith('k=')]
        assert labels and all(t.get_window_extent().y0 > frame.y0 for t in labels), \
            [(t.get_text(), t.get_window_extent().y0, frame.y0) for t in labels]
    plt.close(fig)
