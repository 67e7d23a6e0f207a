"""
More of what a study (study.py) must not lose: an ARC run evaluated again in its stored views (fresh ones are
refused by train.py), a run's train.log with every line once, a re-evaluation under a file-size limit (EFBIG)
that still prints its summary. Real study.py processes on one tiny cpu-scale ARC run (synthetic tasks, 4 steps).
    python -m pytest -q tests/test_study_faults2.py
"""
import os
import re
import shutil

import pytest

from conftest import ROOT, run

STUDY = os.path.join(ROOT, 'config', 'study')
ENV = {'OMP_NUM_THREADS': '1'}


def study(tmp, *more):
    return ['study.py', '--pattern=arc_aug_100', '--scale=cpu', f'--config_dir={tmp}/cfg', f'--out_root={tmp}/out',
            f'--data_root={tmp}/data', '--extra=--max_steps=4 --log_interval=2'] + list(more)


@pytest.fixture(scope='module')
def arc_run(tmp_path_factory):
    """A finished cpu-scale ARC run of 4 steps (its synthetic dataset built by the study): the folder holding
    cfg/, data/ and out/arc_aug_100."""
    tmp = tmp_path_factory.mktemp('arcstudy')
    (tmp / 'cfg').mkdir()
    shutil.copy(os.path.join(STUDY, 'arc_aug_100.py'), tmp / 'cfg')
    run(study(tmp), env=ENV)
    return tmp


def test_a_study_run_s_train_log_holds_each_line_once(arc_run):
    log = open(arc_run / 'out' / 'arc_aug_100' / 'train.log').read().splitlines()
    for line in ('step 4/4 ', 'saved ', 'eval on '):
        found = [l for l in log if l.startswith(line)]
        assert len(found) == 1, (line, found)


def test_an_arc_run_is_evaluated_again_in_its_stored_views(arc_run):
    p = run(study(arc_run, '--eval_only=True'), env=ENV, check=False)  # the default views: 1,2,4,8,16
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert '--eval_only=True --eval_views=1 --eval_steps=8' in p.stdout
    assert 'evaluating in 1 view(s) (its views are the stored augmentations' in p.stdout
    assert re.search(r'arc_aug_100 +steps 8 +done ', p.stdout), p.stdout[-3000:]
    assert os.path.exists(arc_run / 'out' / 'arc_aug_100' / 'evals' / 'views1-steps8.json')
    again = run(study(arc_run, '--eval_only=True'), env=ENV)  # saved: nothing to run
    assert re.search(r'arc_aug_100 +steps 8 +done before', again.stdout), again.stdout[-3000:]


def test_a_re_evaluation_under_a_file_size_limit_prints_its_summary(arc_run):
    # a limit of 1500 bytes per file, as a container or a shared host may set: the logs, the evaluation's
    # record and the report outgrow it
    p = run(['-c', 'import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500)); '
             'os.execv(sys.executable, [sys.executable] + sys.argv[1:])']
            + study(arc_run, '--eval_only=True', '--eval_steps=2'), env=ENV, check=False)
    text = p.stdout + p.stderr
    assert 'Traceback' not in text, text[-3000:]
    assert 'summary of the test-time evaluations' in p.stdout, text[-3000:]
    big = [l for l in text.splitlines() if 'File too large' in l]
    assert big and all(str(arc_run) in l for l in big), big
