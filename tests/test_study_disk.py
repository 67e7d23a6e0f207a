"""
study.py --eval_only on a full disk: the child's output that cannot be copied is one line naming the path, and
the summary still prints (no traceback, no output stopped mid-line). A real tiny study at the cpu scale whose
out_root is a small tmpfs, filled once the run is trained (root; skipped where it cannot be mounted). A report
that does not fit (a file-size limit) names its file and leaves the earlier report's files as they were.
    python -m pytest -q tests/test_study_disk.py
"""
import os
import shutil


from conftest import ROOT, run
from disks import fill_up, small_disk


def test_a_study_re_evaluation_on_a_full_disk_names_the_path_and_prints_its_summary(tmp_path):
    tmp, out = str(tmp_path), tmp_path / 'out'
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'rec_L2.py'), tmp_path / 'cfg')
    study = ['study.py', '--pattern=rec_L2', f'--config_dir={tmp}/cfg', f'--out_root={out}',
             f'--data_root={tmp}/data', '--scale=cpu', '--extra=--max_steps=20 --log_interval=10']
    with small_disk(out, '64m'):
        run(study)
        fill_up(out)
        p = run(study + ['--eval_only=True', '--eval_views=1,2', '--eval_steps=4'], check=False)
    text = p.stdout + p.stderr
    assert 'Traceback' not in text, text[-3000:]
    assert 'summary of the test-time evaluations' in p.stdout, text[-3000:]
    full = [l for l in text.splitlines() if 'No space left' in l]
    assert full and str(out) in full[0], text[-3000:]


def test_a_report_that_does_not_fit_names_its_file_and_leaves_the_earlier_report_whole(tmp_path):
    tmp, out = str(tmp_path), tmp_path / 'out'
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'rec_L2.py'), tmp_path / 'cfg')
    study = ['--pattern=rec_L2', f'--config_dir={tmp}/cfg', f'--out_root={out}', f'--data_root={tmp}/data',
             '--scale=cpu', '--extra=--max_steps=20 --log_interval=10', '--report=True']
    run(['study.py'] + study[:-1])
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if n.startswith('report') or n.endswith('.png')}
    limit = len(before['report.md']) // 2  # a full disk, as a file-size limit: the new report.md does not fit
    p = run(['-c', "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
             "sys.argv = ['study.py'] + sys.argv[1:]; runpy.run_path('study.py', run_name='__main__')"] + study,
            check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 1 and 'Traceback' not in text, text[-3000:]
    said = [l for l in text.splitlines() if 'File too large' in l]
    assert len(said) == 1 and str(out / 'report.md') in said[0], text[-3000:]
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not [n for n in os.listdir(out) if n.endswith('.tmp')]
