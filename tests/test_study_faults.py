"""
Nothing lost in a study (study.py): a closed stdout, the flags the runner owns, a FAILED run's reason, a
finished run recorded with another configuration, a pod host without an index, bad values in experiment files
and --extra, an unreadable results.json in the report, two studies on one out_root, a gs:// run's train.log
when a study resumes it on a new machine, and a study killed outright (its train.py or torchrun ranks save and stop;
a rerun waits for them). Real study.py
processes on tiny cpu-scale runs (4x4 Sudoku), real files.
    python -m pytest -q tests/test_study_faults.py
"""
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from runkeep import gcs
from conftest import BUCKET, ROOT, alive, assert_user_error, children, held_step, run, script_env, site_hook

STUDY = os.path.join(ROOT, 'config', 'study')
EXTRA = '--max_steps=20 --checkpoint_interval=10 --log_interval=10'


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    """One cpu-scale dataset for the whole file: the first study builds it, the others find it."""
    return str(tmp_path_factory.mktemp('study_data'))


@pytest.fixture
def grid(tmp_path):
    cfg = tmp_path / 'cfg'
    cfg.mkdir()
    for name in ('rec_L2', 'rec_L4'):
        shutil.copy(os.path.join(STUDY, name + '.py'), cfg)
    return str(tmp_path)


def args(tmp, data_root, pattern='rec_L2', extra=EXTRA, *more):
    return ['study.py', f'--pattern={pattern}', f'--config_dir={tmp}/cfg', f'--out_root={tmp}/out',
            f'--data_root={data_root}', '--scale=cpu', f'--extra={extra}'] + list(more)


def start(cmd, env=None, cwd=ROOT, **kw):
    kw = dict(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), **kw)
    return subprocess.Popen([sys.executable, os.path.join(ROOT, cmd[0])] + cmd[1:], cwd=cwd, env=script_env(env),
                            start_new_session=True, **kw)


def wait_for(cond, timeout=300):
    t = time.time()
    while not cond():
        assert time.time() - t < timeout
        time.sleep(0.05)


def summary(text):
    return text.split('study: summary')[1]


def test_a_study_whose_stdout_reader_is_gone_still_runs(grid, data_root):
    # stdout a pipe whose reader closed before study.py printed anything (`... | head -c 1`)
    r, w = os.pipe()
    os.close(r)
    with open(f'{grid}/err', 'w') as err:
        p = start(args(grid, data_root), stdout=w, stderr=err)
    os.close(w)
    assert p.wait(timeout=600) == 0, open(f'{grid}/err').read()[-3000:]
    assert 'Traceback' not in open(f'{grid}/err').read()
    assert json.load(open(f'{grid}/out/rec_L2/results.json'))['step'] == 20
    assert 'eval on' in open(f'{grid}/out/rec_L2/train.log').read()


def test_extra_may_not_set_what_the_runner_owns(grid, data_root):
    for key, value in (('out_dir', f'{grid}/x'), ('local_dir', f'{grid}/x'), ('init_from', 'scratch'),
                       ('eval_only', 'True')):
        p = run(args(grid, data_root, 'rec_*', f'{EXTRA} --{key}={value}'), check=False)
        assert_user_error(p, '--extra', key, '--out_root')
        assert len((p.stdout + p.stderr).strip().splitlines()[-1]) < 300
        assert not os.path.exists(f'{grid}/x') and not os.path.exists(f'{grid}/out/rec_L2')


def test_a_failed_runs_reason_is_its_error_not_its_last_line(grid, data_root):
    # a run that fails at start (eval_only with no checkpoint to evaluate): its one-line error, not a board
    with open(f'{grid}/cfg/rec_L2.py', 'a') as f:
        f.write("eval_only = True\n")
    p = run(args(grid, data_root), check=False)
    line = next(l for l in summary(p.stdout).splitlines() if 'rec_L2' in l)
    assert 'FAILED' in line and 'exit code 1' in line and 'no checkpoint' in line, line
    assert '|' not in line.split('(log:')[0], line  # not a board row
    # a run killed by a signal: the signal, not its last step line
    os.remove(f'{grid}/cfg/rec_L2.py')
    shutil.copy(os.path.join(STUDY, 'rec_L2.py'), f'{grid}/cfg')
    p = start(args(grid, data_root, extra='--max_steps=200 --checkpoint_interval=10 --log_interval=10'))
    wait_for(lambda: os.path.exists(f'{grid}/out/rec_L2/ckpt_00000010.pt') or p.poll() is not None)
    for kid in children(p.pid):
        os.kill(kid, signal.SIGKILL)
    text = p.communicate(timeout=300)[0]
    line = next(l for l in summary(text).splitlines() if 'rec_L2' in l)
    assert re.search(r'FAILED +exit code -9 \(killed by SIGKILL\)', line), line
    assert 'step ' not in line and 'saved ' not in line, line


def test_a_run_that_diverged_is_reported_failed_not_not_started(grid, data_root):
    # lr 1e-4 -> 10.0 (200 at the cpu scale): the run diverges by its first checkpoint, which is not saved
    with open(f'{grid}/cfg/rec_L2.py', 'a') as f:
        f.write("lr = 10.0\n")
    p = run(args(grid, data_root), check=False)
    line = next(l for l in summary(p.stdout).splitlines() if 'rec_L2' in l)
    assert 'FAILED' in line and re.search('NaN|diverged', line), line
    # the table under the summary, report.md and report.csv say it too
    for text in (summary(p.stdout), open(f'{grid}/out/report.md').read()):
        row = next(l for l in text.splitlines() if l.startswith('| rec_L2 |'))
        assert row.endswith('| FAILED |'), row
    assert next(csv.DictReader(open(f'{grid}/out/report.csv')))['status'] == 'FAILED'
    assert re.search(r'report: rec_L2: FAILED exit code 1: .*(NaN|diverged)', p.stdout), p.stdout[-3000:]
    # a report made later reads the study's word at the end of the run's train.log: failed, not started or running
    p = run(args(grid, data_root, 'rec_L2', EXTRA, '--report=True'))
    row = next(l for l in open(f'{grid}/out/report.md').read().splitlines() if l.startswith('| rec_L2 |'))
    assert row.endswith('| FAILED |'), row
    assert re.search(r'report: rec_L2: FAILED exit code 1: .*(NaN|diverged)', p.stdout), p.stdout[-3000:]


def test_a_result_recorded_with_another_configuration_is_not_reused(grid, data_root):
    out = f'{grid}/out'
    run(args(grid, data_root))
    before = open(f'{out}/rec_L2/results.json').read()
    # the experiment file changed since: L_cycles 2 -> 3
    path = f'{grid}/cfg/rec_L2.py'
    text = open(path).read()
    open(path, 'w').write(text.replace('L_cycles = 2', 'L_cycles = 3'))
    p = run(args(grid, data_root), check=False)
    assert p.returncode == 1, p.stdout[-3000:]
    line = next(l for l in summary(p.stdout).splitlines() if 'rec_L2' in l)
    assert 'done' not in line and 'L_cycles' in line and '2' in line and '3' in line, line
    assert 'not reused' in p.stdout and 'move ' in p.stdout, p.stdout[-3000:]
    assert open(f'{out}/rec_L2/results.json').read() == before  # nothing retrained over it
    # the report does not label the old result with the new value
    run(args(grid, data_root, 'rec_L2', EXTRA, '--report=True'))
    row = next(l for l in open(f'{out}/report.md').read().splitlines() if l.startswith('| rec_L2 |'))
    assert 'L_cycles=3' in row and 'other configuration' in row and '| done |' not in row, row
    # another --extra: the steps recorded are not the steps asked for
    open(path, 'w').write(text)
    p = run(args(grid, data_root, extra=EXTRA.replace('max_steps=20', 'max_steps=30')), check=False)
    line = next(l for l in summary(p.stdout).splitlines() if 'rec_L2' in l)
    assert p.returncode == 1 and 'max_steps' in line and 'done' not in line, line
    # what does not shape the result (how often it logs) reuses it
    p = run(args(grid, data_root, extra=EXTRA.replace('log_interval=10', 'log_interval=5')))
    assert re.search(r'rec_L2 +done before', summary(p.stdout)), p.stdout


def test_a_started_run_recorded_with_another_configuration_is_not_resumed(grid, data_root):
    out = f'{grid}/out/rec_L2'
    # a half-done run: its train.py waits in step 11 (checkpoint 10 saved) until the study is stopped
    p = start(args(grid, data_root), env=held_step(f'{grid}/hook', 11, argv=['/rec_L2']))
    wait_for(lambda: os.path.exists(f'{out}/ckpt_00000010.pt') or p.poll() is not None)
    p.send_signal(signal.SIGTERM)  # it saves a checkpoint and stops
    p.communicate(timeout=300)
    kept = sorted(f for f in os.listdir(out) if f.startswith('ckpt_'))
    assert kept and not os.path.exists(f'{out}/results.json'), os.listdir(out)
    # the experiment file changed since: lr 1e-4 -> 3e-4 (0.002 -> 0.006 at the cpu scale)
    path = f'{grid}/cfg/rec_L2.py'
    text = open(path).read()
    open(path, 'a').write("lr = 3e-4\n")
    p = run(args(grid, data_root), check=False)
    assert p.returncode == 1 and 'resuming' not in p.stdout, p.stdout[-3000:]
    line = next(l for l in summary(p.stdout).splitlines() if 'rec_L2' in l)
    assert 'NOT REUSED' in line and 'lr 0.002 there, 0.006 now' in line and kept[-1] in line, line
    assert 'move ' in line and '0 finished before, 1 not reused, 0 to run' in p.stdout, p.stdout[-3000:]
    assert sorted(f for f in os.listdir(out) if f.startswith('ckpt_')) == kept  # nothing trained over it
    assert not os.path.exists(f'{out}/results.json')
    p = run(args(grid, data_root, 'rec_L2', EXTRA, '--list_only=True'))
    assert 'not resumed' in p.stdout and 'lr 0.002 there' in p.stdout, p.stdout
    # the file as it was: the run resumes and finishes
    open(path, 'w').write(text)
    p = run(args(grid, data_root))
    assert re.search(r'rec_L2 \[.*\]: resuming from its checkpoint', p.stdout), p.stdout[-3000:]
    assert json.load(open(f'{out}/results.json'))['step'] == 20


def test_a_pod_host_without_an_index_is_told_to_give_one():
    env = {k: '' for k in ('TPU_WORKER_ID', 'CLOUD_TPU_TASK_ID', 'TPU_WORKER_HOSTNAMES')}
    share = ['study.py', '--pattern=rec_*', '--dry_run=True', '--hosts_mode=share']
    p = run(share + ['--num_hosts=2'], env=env, check=False)
    assert_user_error(p, '--host_index')
    p = run(share + ['--num_hosts=2', '--host_index=1'], env=env)
    assert '(this is host 1)' in p.stdout
    p = run(share + ['--num_hosts=2'], env=dict(env, TPU_WORKER_ID='abc'), check=False)
    assert_user_error(p, 'TPU_WORKER_ID', 'abc', '--host_index')


def test_bad_values_in_experiment_files_and_extra_are_one_line(grid, data_root):
    cfg = f'{grid}/cfg'
    for line, allowed in (("L_cycles = '3'", 'int'), ("out_dir = None", 'str'), ("epochs = 2.5", 'int')):
        key = line.split()[0]
        text = f"_base = 'config/baseline.py'\nout_dir = 'out/study/b'\n{line}\n"
        open(f'{cfg}/bad_one.py', 'w').write(text)
        p = run(args(grid, data_root, 'bad_*', EXTRA, '--dry_run=True'), check=False)
        assert_user_error(p, 'bad_one.py', key, allowed)
        assert 'parameters |' not in p.stdout  # refused before it is costed
    os.remove(f'{cfg}/bad_one.py')
    for extra, words in (('--epochs=abc', ('epochs', "'abc'", 'int')),
                         ("--seed='1", ('--extra', 'quotation'))):
        p = run(args(grid, data_root, 'rec_*', extra, '--dry_run=True'), check=False)
        assert_user_error(p, *words)
        assert len((p.stdout + p.stderr).strip().splitlines()[-1]) < 300


def test_the_report_says_which_results_cannot_be_read(grid, data_root):
    out = f'{grid}/out'
    run(args(grid, data_root, 'rec_L2'))
    text = open(f'{out}/rec_L2/results.json').read()
    os.makedirs(f'{out}/rec_L4')
    # rec_L4's results.json, cut short, empty, then with a list where train.py writes an object (hand-edited, or
    # another program's: each ended the report in an AttributeError's traceback)
    res = json.loads(text)
    for broken, said in ((text[:len(text) // 2], 'JSONDecodeError'), ('', 'empty'),
                         (json.dumps(dict(res, config=['L_cycles', 4])),
                          'its config is ["L_cycles", 4], not an object'),
                         (json.dumps(dict(res, config=None, best_eval=[])), 'its best_eval is [], not an object')):
        open(f'{out}/rec_L4/results.json', 'w').write(broken)
        p = run(args(grid, data_root, 'rec_*', EXTRA, '--report=True'))
        assert 'Traceback' not in p.stdout + p.stderr
        md = open(f'{out}/report.md').read()
        assert re.search(r'\| rec_L2 \|.*\| done \|', md), md
        row = next(l for l in md.splitlines() if l.startswith('| rec_L4 |'))
        assert 'unreadable' in row and 'results.json' in row, row
        assert f"report: rec_L4: unreadable results.json in {out}/rec_L4 ({said}" in p.stdout, p.stdout
    # rec_L2's metrics.jsonl with a line of another shape (hand-edited: its AttributeError's traceback ended the
    # report) and a torn one (its minutes were left blank without a word): said, and the minutes of the rest
    metrics = f'{out}/rec_L2/metrics.jsonl'
    n = len(open(metrics).readlines())
    open(metrics, 'a').write('[1]\n{"kind": "train", "st')
    p = run(args(grid, data_root, 'rec_*', EXTRA, '--report=True'))
    assert 'Traceback' not in p.stdout + p.stderr
    assert f"report: {metrics} line {n + 1} is not a record of numbers (torn by a crash?), 1 more line(s) too: " \
           "left out of its minutes" in p.stdout, p.stdout
    with open(f'{out}/report.csv') as f:
        assert float(next(r for r in csv.DictReader(f) if r['name'] == 'rec_L2')['minutes']) > 0
    # a study run ends with its report too: the unreadable run is named, not reused, and the report is made
    p = run(args(grid, data_root, 'rec_*'), check=False)
    assert p.returncode == 1 and 'Traceback' not in p.stdout + p.stderr, p.stdout[-3000:]
    assert re.search(r'rec_L4 +\S+ .*unreadable', summary(p.stdout)), p.stdout
    assert 'report: ' in p.stdout.split('study: summary')[1]


def test_a_dataset_json_cut_short_is_one_line_and_the_study_reports_on(grid, data_root, tmp_path):
    """A dataset copied in part (gsutil stopped): its dataset.json cut short was a JSONDecodeError's traceback in
    every study command, the dry run and the report of finished runs too."""
    run(args(grid, data_root, 'rec_L2'))
    copy = shutil.copytree(data_root, tmp_path / 'data')
    meta = next(copy.glob('*/test/dataset.json'))
    meta.write_text(meta.read_text()[:40])
    for more in ('--dry_run=True', '--report=True'):
        p = run(args(grid, str(copy), 'rec_L2', EXTRA, more))
        assert 'Traceback' not in p.stdout + p.stderr
        said = [l for l in p.stdout.splitlines() if 'warning' in l]
        assert len(said) == 1 and said[0].startswith(f"study: warning: cannot read {meta}: "), said
    assert re.search(r'\| rec_L2 \|.*\| done \|', open(f'{grid}/out/report.md').read())


def test_a_second_study_on_the_same_out_root_refuses_to_start(grid, data_root):
    out = f'{grid}/out'
    first = start(args(grid, data_root, 'rec_L2', EXTRA.replace('max_steps=20', 'max_steps=200')))
    try:
        wait_for(lambda: os.path.exists(f'{out}/rec_L2/ckpt_00000010.pt') or first.poll() is not None)
        assert first.poll() is None
        p = run(args(grid, data_root, 'rec_*'), check=False)
        assert_user_error(p, out, socket.gethostname(), f'pid {first.pid}')
        assert not os.path.exists(f'{out}/rec_L4')  # it ran nothing
    finally:
        first.send_signal(signal.SIGTERM)
        text = first.communicate(timeout=300)[0]
    assert 'rec_L2' in summary(text) and 'FAILED' not in summary(text), text[-3000:]
    # a lock whose holder is gone is taken over, with a line that says so
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    lock = os.path.join(out, 'study.lock')
    assert not os.path.exists(lock)  # the first one released it
    json.dump(dict(host=socket.gethostname(), pid=dead.pid, since='earlier'), open(lock, 'w'))
    p = run(args(grid, data_root, 'rec_L4'))
    assert 'taking over' in p.stdout and re.search(r'rec_L4 +done', summary(p.stdout)), p.stdout[-3000:]
    assert not os.path.exists(lock)  # released at the end


# two studies come to a stale study.lock together: each is slow between judging it stale and removing it (both at
# once where nothing orders them), and the one that takes it holds it a while (its runs' locks read slowly)
BOTH_AT_THE_STUDY_LOCK = """
if sys.argv[0].endswith('study.py'):
    from runkeep import locks
    holder_gone, local_record = locks.holder_gone, locks.local_record
    here = os.environ['AT_THE_LOCK']

    def slow(rec):
        gone = holder_gone(rec)
        if gone and isinstance(rec, dict) and rec.get('since') == 'earlier':  # the stale lock: both arrive before either goes on
            open(os.path.join(here, str(os.getpid())), 'w').close()
            t = time.time()
            while len(os.listdir(here)) < 2 and time.time() - t < 3:
                time.sleep(0.01)
            time.sleep(0.5)
        return gone

    def held(path):
        if path.endswith(locks.LOCK_NAME):
            time.sleep(3)
        return local_record(path)

    locks.holder_gone, locks.local_record = slow, held
"""


def test_two_studies_that_find_the_same_stale_lock_do_not_both_take_it_over(grid, data_root, tmp_path):
    out, here = f'{grid}/out', tmp_path / 'at_the_lock'
    os.makedirs(f'{out}/rec_L2')
    here.mkdir()
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    json.dump(dict(host=socket.gethostname(), pid=dead.pid, since='earlier'), open(f'{out}/study.lock', 'w'))
    json.dump(dict(host=socket.gethostname(), pid=dead.pid, since='earlier'), open(f'{out}/rec_L2/run.lock', 'w'))
    env = dict(site_hook(tmp_path / 'hook', BOTH_AT_THE_STUDY_LOCK), AT_THE_LOCK=str(here))
    studies = [start(args(grid, data_root, 'rec_L2', EXTRA, '--eval_only=True'), env=env) for _ in range(2)]
    said = [p.communicate(timeout=300)[0] for p in studies]
    assert sorted(p.returncode for p in studies) == [0, 1], said
    refused = said[[p.returncode for p in studies].index(1)]
    assert f'{out} is in use by the study on' in refused and 'Traceback' not in refused, refused[-3000:]
    assert not os.path.exists(f'{out}/study.lock')


def stopped_on_a_first_machine(emulator, grid, data_root, tmp_path, name):
    """A gs:// study of rec_L2 (30 steps) stopped at step 15 (a spot VM's notice) on a first machine (its own
    working folder): (the study's command, its environment, the bucket's run folder)."""
    out, env = f'gs://{BUCKET}/{name}', dict(STORAGE_EMULATOR_HOST=emulator.replace('http://', ''))
    cmd = [a if not a.startswith('--out_root=') else f'--out_root={out}'
           for a in args(grid, data_root, 'rec_L2', EXTRA.replace('max_steps=20', 'max_steps=30'))]
    first = tmp_path / 'first'
    first.mkdir()
    p = start(cmd, env=dict(env, **held_step(tmp_path / 'hook', 15, argv=('rec_L2',))), cwd=first)
    log = first / 'out' / BUCKET / name / 'rec_L2' / 'train.log'
    wait_for(lambda: p.poll() is not None or log.exists() and 'test hook: step 15 waits' in log.read_text())
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=300)[0]
    assert 'stopped; rerun the same command' in text, text[-3000:]
    return cmd, env, f'{out}/rec_L2'


def bucket_log(emulator, run, tmp_path):
    gcs.GCS(endpoint=emulator).download(f'{run}/train.log', str(tmp_path / 'bucket.log'))
    return (tmp_path / 'bucket.log').read_text()


def test_a_gs_run_resumed_by_a_study_on_a_new_machine_keeps_the_first_machine_s_log(emulator, grid, data_root,
                                                                                      tmp_path):
    """The study rerun on a new machine (an empty working folder) resumes the run from the bucket, and the
    bucket's train.log is the first machine's, continued by the second's (the study's header for the new process
    goes before train.py fetches the log)."""
    cmd, env, run_uri = stopped_on_a_first_machine(emulator, grid, data_root, tmp_path, 'study_log')
    second = tmp_path / 'second'
    second.mkdir()
    p = run(cmd, env=env, cwd=second)
    assert 'resuming from' in p.stdout and re.search(r'rec_L2 +done', summary(p.stdout)), p.stdout[-3000:]
    bucket = bucket_log(emulator, run_uri, tmp_path)
    assert bucket.count('\n=== ') == 2 and bucket.index('step 10/30') < bucket.index('test hook: step 15 waits') \
        < bucket.index('resuming from') < bucket.index('step 30/30'), bucket
    assert (second / 'out' / BUCKET / 'study_log' / 'rec_L2' / 'train.log').read_text() == bucket


def test_a_failed_start_of_a_study_run_on_a_new_machine_goes_after_the_bucket_s_log(emulator, grid, data_root,
                                                                                      tmp_path):
    """The study rerun on a new machine that lacks the dataset: the run fails at its start-up checks, before it
    fetched the bucket's log, and what it wrote goes after the bucket's train.log, not in its place; the study
    then run where the dataset is resumes the run, and the log holds all three processes."""
    cmd, env, run_uri = stopped_on_a_first_machine(emulator, grid, data_root, tmp_path, 'study_failed')
    second = tmp_path / 'second'
    second.mkdir()
    empty = tmp_path / 'empty'
    empty.mkdir()
    p = run([a if not a.startswith('--data_root=') else f'--data_root={empty}' for a in cmd] + ['--build_data=False'],
            env=env, cwd=second, check=False)
    assert re.search(r'rec_L2 +FAILED.*no dataset', summary(p.stdout)), p.stdout[-3000:]
    bucket = bucket_log(emulator, run_uri, tmp_path)
    assert bucket.count('\n=== ') == 2 and bucket.index('test hook: step 15 waits') \
        < bucket.index('start-up checks failed: no dataset'), bucket
    p = run(cmd, env=env, cwd=second)
    assert 'resuming from' in p.stdout and re.search(r'rec_L2 +done', summary(p.stdout)), p.stdout[-3000:]
    bucket = bucket_log(emulator, run_uri, tmp_path)
    assert bucket.count('\n=== ') == 3 and bucket.index('test hook: step 15 waits') \
        < bucket.index('start-up checks failed: no dataset') < bucket.index('resuming from') \
        < bucket.index('step 30/30'), bucket


def test_a_study_rerun_at_once_after_a_kill_waits_for_the_train_py_the_killed_one_left(grid, data_root):
    """study.py killed outright (SIGKILL, an OOM kill, a closed tmux pane) while its train.py is in a long step: that
    train.py saves and stops on its own (its parent is gone), and the same command rerun at once waits for it,
    in one line, then resumes the run from the checkpoint it saved, rather than failing on the run's lock."""
    out, go = f'{grid}/out/rec_L2', f'{grid}/go'
    cmd = args(grid, data_root, 'rec_L2', EXTRA.replace('max_steps=20', 'max_steps=30'))
    env = held_step(f'{grid}/hook', 11, go=go, argv=['/rec_L2'])  # step 11 ends once `go` exists
    first = start(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: first.poll() is not None or os.path.exists(f'{out}/train.log')
                 and 'test hook: step 11 waits' in open(f'{out}/train.log').read())
        orphan = json.load(open(f'{out}/run.lock'))['pid']
        first.kill()
        first.wait()
        with open(f'{grid}/rerun.out', 'w') as f:
            rerun = start(cmd, env=env, stdout=f)
        said = lambda: open(f'{grid}/rerun.out').read()
        wait_for(lambda: rerun.poll() is not None or f'pid {orphan}' in said())
    finally:
        open(go, 'w').close()
    assert rerun.wait(timeout=300) == 0, said()[-3000:]
    text = said()
    line = next(l for l in text.splitlines() if f'pid {orphan}' in l)
    assert 'waiting for' in line and 'rec_L2' in line, line
    assert 'lock failed' not in text and 'FAILED' not in text, text[-3000:]
    assert 'resuming from its checkpoint at step 11' in text, text[-3000:]  # the orphan's stop checkpoint
    assert re.search(r'rec_L2 +done', summary(text)), text[-3000:]
    assert json.load(open(f'{out}/results.json'))['step'] == 30
    assert not alive(orphan)


def test_a_killed_study_s_torchrun_ranks_save_and_stop_and_the_rerun_resumes_them(grid, data_root):
    """--nproc=2: study.py's child is torchrun's agent, which its end (even by SIGKILL) ends at once; the ranks it
    leaves save a checkpoint and stop as a lone train.py does, rather than train on to the end unseen, holding the
    devices and the run's folder."""
    out = f'{grid}/out/rec_L2'
    cmd = args(grid, data_root, 'rec_L2', EXTRA.replace('max_steps=20', 'max_steps=30'), '--nproc=2')
    first = start(cmd, env=held_step(f'{grid}/hook', 11, argv=['/rec_L2'], slow=True), stdout=subprocess.DEVNULL)
    ranks = []
    try:
        wait_for(lambda: first.poll() is not None or os.path.exists(f'{out}/train.log')
                 and open(f'{out}/train.log').read().count('test hook: step 11 waits') == 2)
        agent = children(first.pid)
        ranks = [rank for pid in agent for rank in children(pid)]
        assert len(ranks) == 2, (agent, ranks)
        first.kill()
        first.wait()
        wait_for(lambda: not any(alive(r) for r in ranks), timeout=120)
    finally:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r, signal.SIGKILL)
    log = open(f'{out}/train.log').read()
    assert f'its parent process (pid {agent[0]}) ended: saving' in log, log[-3000:]
    stop = re.search(r'saved .*ckpt_000000(\d\d)\.pt \(stop requested\)', log)
    assert stop and int(stop[1]) < 30 and not os.path.exists(f'{out}/results.json'), log[-3000:]
    p = run(cmd)
    assert f'resuming from its checkpoint at step {int(stop[1])}' in p.stdout, p.stdout[-3000:]
    assert re.search(r'rec_L2 +done', summary(p.stdout)), p.stdout[-3000:]
    assert json.load(open(f'{out}/results.json'))['step'] == 30


def test_ctrl_c_of_a_study_of_torchrun_runs_stops_its_ranks_without_torchrun_s_traceback(grid, data_root):
    """--nproc=2, Ctrl-C: the stop goes to torchrun's ranks, which save and exit 0, so that its agent ends quietly;
    asked itself, the agent raised a SignalException whose traceback filled the study's output and train.log."""
    out = f'{grid}/out/rec_L2'
    cmd = args(grid, data_root, 'rec_L2', EXTRA.replace('max_steps=20', 'max_steps=30'), '--nproc=2')
    first = start(cmd, env=held_step(f'{grid}/hook', 11, argv=['/rec_L2']))
    try:
        wait_for(lambda: first.poll() is not None or os.path.exists(f'{out}/train.log')
                 and open(f'{out}/train.log').read().count('test hook: step 11 waits') == 2)
        os.killpg(first.pid, signal.SIGINT)  # a terminal's Ctrl-C: study.py alone, its children have sessions
        text = first.communicate(timeout=300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    log = open(f'{out}/train.log').read()
    assert 'Traceback' not in text + log and 'SignalException' not in text + log, (text + log)[-3000:]
    assert re.search(r'saved .*ckpt_000000\d\d\.pt \(stop requested\)', log), log[-3000:]
    assert not os.path.exists(f'{out}/results.json')
    assert 'stopped' in summary(text) and 'FAILED' not in summary(text), text[-3000:]
