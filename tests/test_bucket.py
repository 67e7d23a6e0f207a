"""
The bucket side (gs://): records and logs of a run resumed on a new machine, local folders of gs:// out_dirs,
buckets that do not exist, refuse, never answer or vanish, truncated checkpoints in the bucket, and the uploads
counted at exit. Real processes against a real emulator or small real servers.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runkeep import gcs
from studies.report import ENDED, last_line
from conftest import BUCKET, ROOT, TOY_ARGS, assert_user_error, Preconditioned, run, script_env

FAST = TOY_ARGS + ['--epochs=1', '--eval_every_epochs=100', '--log_interval=2', '--checkpoint_interval=2']


def train_args(toy, out, local, *extra):
    return ['train.py', f'--data_path={toy}', f'--out_dir={out}', f'--local_dir={local}'] + FAST + list(extra)


def host(url):
    return url.replace('http://', '')


@pytest.fixture(scope='module')
def trained(emulator, toy, tmp_path_factory):
    """A gs:// run trained to step 4 (checkpoints 2 and 4, metrics.jsonl, results.json in the bucket); each test
    copies it to a prefix of its own."""
    out = f'gs://{BUCKET}/lost/base'
    run(train_args(toy, out, tmp_path_factory.mktemp('base'), '--max_steps=4'),
        env=dict(STORAGE_EMULATOR_HOST=host(emulator)))
    return out


def copy_prefix(emulator, src, dst, tmp_path):
    client = gcs.GCS(endpoint=emulator)
    for uri, _ in client.list(src + '/'):
        path = str(tmp_path / 'copy' / uri.rsplit('/', 1)[1])
        client.download(uri, path)
        client.upload(path, dst + uri[len(src):])
    return dst


def test_a_resume_on_a_new_machine_keeps_the_bucket_s_metrics_history(emulator, trained, toy, tmp_path):
    out = copy_prefix(emulator, trained, f'gs://{BUCKET}/lost/r5', tmp_path)
    run(train_args(toy, out, tmp_path / 'new', '--max_steps=6', '--init_from=resume'),
        env=dict(STORAGE_EMULATOR_HOST=host(emulator)))
    gcs.GCS(endpoint=emulator).download(f'{out}/metrics.jsonl', str(tmp_path / 'm.jsonl'))
    lines = [json.loads(l) for l in open(tmp_path / 'm.jsonl')]
    assert [l['step'] for l in lines if l['kind'] == 'train'] == [2, 4, 6]  # the history before the resume too
    assert [l['step'] for l in lines if l['kind'] == 'eval'] == [4, 6]
    # train.log too: the bucket's copy of the first machine's log, continued by the second
    gcs.GCS(endpoint=emulator).download(f'{out}/train.log', str(tmp_path / 'train.log'))
    log = open(tmp_path / 'train.log').read()
    assert log.count(' pid ') == 2 and log.index('step 4/') < log.index('--max_steps=6') < log.index('step 6/'), log
    assert open(tmp_path / 'new' / 'train.log').read() == log


def test_a_resume_back_on_the_first_machine_goes_on_with_the_bucket_s_newer_metrics(emulator, toy, tmp_path):
    """The first machine trained to step 5 (a line every step), its checkpoints past step 2 never reached the
    bucket; a second machine resumed from step 2 to step 6 (a line every 2 steps); the first machine, back with its
    folder as it was, resumes step 6 from the bucket: the history is the second machine's up to step 6, though the
    first machine's older copy holds more lines."""
    out, env = f'gs://{BUCKET}/lost/back', dict(STORAGE_EMULATOR_HOST=host(emulator))
    client = gcs.GCS(endpoint=emulator)
    run(train_args(toy, out, tmp_path / 'a', '--max_steps=5', '--log_interval=1', '--keep_last_n=0'), env=env)
    for step in (4, 5):
        client.delete(f'{out}/ckpt_{step:08d}.pt')
    p = run(train_args(toy, out, tmp_path / 'b', '--max_steps=6', '--init_from=resume'), env=env)
    assert '(step 2)' in p.stdout, p.stdout[-3000:]
    p = run(train_args(toy, out, tmp_path / 'a', '--max_steps=8', '--init_from=resume'), env=env)
    assert '(step 6)' in p.stdout, p.stdout[-3000:]
    client.download(f'{out}/metrics.jsonl', str(tmp_path / 'm.jsonl'))
    lines = [json.loads(l) for l in open(tmp_path / 'm.jsonl')]
    assert [(l['kind'], l['step']) for l in lines] == [('train', 1), ('train', 2), ('train', 4), ('train', 6),
                                                       ('eval', 6), ('train', 8), ('eval', 8)], lines
    # train.log too: the bucket's (the first machine's log, continued by the second), continued by the third process
    client.download(f'{out}/train.log', str(tmp_path / 'train.log'))
    log = open(tmp_path / 'train.log').read()
    assert log.count(' pid ') == 3 and log.index('(step 2)') < log.index('(step 6)'), log


def test_a_run_started_over_an_earlier_one_leaves_none_of_its_evaluations_or_profiles(emulator, toy, tmp_path):
    """--overwrite=True: the earlier run's --eval_only records (evals/) and its profiler traces (profile/) go with
    its checkpoints, here and in the bucket; a study would otherwise take them for the new run's, at the same step
    and name, and a person the trace for this run's."""
    out, local, env = f'gs://{BUCKET}/lost/over', tmp_path / 'l', dict(STORAGE_EMULATOR_HOST=host(emulator))
    run(train_args(toy, out, local, '--max_steps=4', '--profile_steps=1:2'), env=env)
    run(train_args(toy, out, local, '--max_steps=4', '--eval_only=True', '--init_from=resume'), env=env)
    client = gcs.GCS(endpoint=emulator)
    assert [uri for uri, _ in client.list(f'{out}/evals/')] == [f'{out}/evals/views1-steps4.json']
    assert [uri for uri, _ in client.list(f'{out}/profile/')] == [f'{out}/profile/trace_1_2.json']
    run(train_args(toy, out, local, '--max_steps=4', '--lr=1e-3', '--overwrite=True'), env=env)
    assert not client.list(f'{out}/evals/') and not os.path.exists(local / 'evals')
    assert not client.list(f'{out}/profile/') and not os.path.exists(local / 'profile')


@pytest.mark.parametrize('start', ['overwrite', 'scratch', 'resume'])
def test_a_run_started_after_an_earlier_process_replaces_its_train_log_in_the_bucket_at_once(emulator, emu, toy,
                                                                                             tmp_path, start):
    """A gs:// run started on a new machine after a process a study saw fail: until this process's first upload of
    its train.log the bucket's was the earlier one's, whose last line (a study's word on how it ended) a report made
    where there is no local copy read as the running run's status. The new process puts its own there at its start:
    over an earlier run (--overwrite=True), from scratch where the earlier process saved no checkpoint
    (--init_from=resume, a study's rerun), or resumed from its checkpoint."""
    out, env = f'gs://{BUCKET}/lost/relog_{start}', dict(STORAGE_EMULATOR_HOST=host(emulator))
    client = gcs.GCS(endpoint=emulator)
    # no checkpoint before its end, where it uploads its train.log anyway: it is killed at step 100 of 200 at most
    args = ['--epochs=10', '--checkpoint_interval=1000']
    if start == 'scratch':  # the earlier process failed before its first checkpoint: its train.log alone is there
        (tmp_path / 'a').mkdir()
        with open(tmp_path / 'a' / 'train.log', 'w') as f:
            f.write('step 1/200 loss 2.0\n')
    else:
        run(train_args(toy, out, tmp_path / 'a', *args, '--max_steps=2'), env=env)
    with open(tmp_path / 'a' / 'train.log', 'a') as f:  # as a study ends a run it saw fail
        f.write(f"{ENDED}FAILED exited 1: out of memory\n")
    client.upload(str(tmp_path / 'a' / 'train.log'), f'{out}/train.log')
    extra = dict(overwrite=['--overwrite=True'], scratch=['--init_from=resume'], resume=['--init_from=resume'])[start]
    p = subprocess.Popen([sys.executable] + train_args(toy, out, tmp_path / 'b', *args, '--max_steps=200', *extra),
                         cwd=ROOT, env=script_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / 'b' / 'train.log'
    try:
        deadline = time.time() + 120
        while p.poll() is None and time.time() < deadline:
            client.download(f'{out}/train.log', str(tmp_path / 'bucket.log'))
            if '--max_steps=200' in open(tmp_path / 'bucket.log').read() or \
                    os.path.exists(log) and 'step 100/' in open(log).read():
                break
            time.sleep(0.2)
        alive = p.poll() is None  # its end uploads its train.log anyway: a run that failed early proves nothing
    finally:
        p.kill()
        p.wait()
    assert alive, open(log).read()[-3000:]
    elsewhere = types.SimpleNamespace(local=str(tmp_path / 'c'), out_dir=out)  # a report on a third machine
    end = last_line(elsewhere)
    assert end and not end.startswith(ENDED), end  # the new process's, not the earlier one's end


def test_two_bucket_runs_ending_in_the_same_name_have_their_own_local_folders(emulator, toy, tmp_path):
    def train_here(out, *extra):  # the default local_dir is relative: the processes run in tmp_path
        e = script_env(dict(STORAGE_EMULATOR_HOST=host(emulator)))
        p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), f'--data_path={toy}',
                            f'--out_dir={out}'] + FAST + list(extra), cwd=tmp_path, env=e, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p
    train_here(f'gs://{BUCKET}/lost6/expA/run1', '--max_steps=2')
    p = train_here(f'gs://{BUCKET}/lost6/expB/run1', '--max_steps=2', '--init_from=resume')
    assert 'no checkpoint in' in p.stdout and 'starting from scratch' in p.stdout  # not expA's weights
    assert 'step 2/' in p.stdout
    for exp in ('expA', 'expB'):
        assert os.path.exists(tmp_path / 'out' / BUCKET / 'lost6' / exp / 'run1' / 'ckpt_00000002.pt')


class Refuser(BaseHTTPRequestHandler):
    """Answers every request 403, as GCS does to an identity without access to the bucket."""
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps(dict(error=dict(code=403, message='the caller may not list this bucket'))).encode()
        self.send_response(403)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_PUT = do_DELETE = do_GET


def serve(handler):
    srv = ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
    return srv, f'127.0.0.1:{srv.server_address[1]}'


def test_a_bucket_that_does_not_exist_or_refuses_stops_the_run_at_start(emulator, toy, tmp_path):
    p = run(train_args(toy, 'gs://no-such-bucket-7/run', tmp_path / 'a', '--max_steps=2'), check=False,
            env=dict(STORAGE_EMULATOR_HOST=host(emulator)))
    assert_user_error(p, 'no-such-bucket-7', 'HTTP 404')
    assert 'step 1/' not in p.stdout
    srv, addr = serve(Refuser)
    try:
        p = run(train_args(toy, f'gs://{BUCKET}/r7', tmp_path / 'b', '--max_steps=2'), check=False,
                env=dict(STORAGE_EMULATOR_HOST=addr))
    finally:
        srv.shutdown()
        srv.server_close()
    assert_user_error(p, BUCKET, 'HTTP 403')
    assert 'step 1/' not in p.stdout


class Stall:
    """A TCP server on 127.0.0.1 that accepts connections and never answers them; it closes everything at
    close() or after `lifetime` seconds, whichever comes first."""

    def __init__(self, lifetime=180):
        self.sock = socket.socket()
        self.sock.bind(('127.0.0.1', 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.addr = f'127.0.0.1:{self.sock.getsockname()[1]}'
        self.end, self.held = time.time() + lifetime, []
        self.thread = threading.Thread(target=self.hold, daemon=True)
        self.thread.start()

    def hold(self):
        while time.time() < self.end:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:  # the 0.2 s accept timeout, or the socket closed by close()
                continue
        for c in self.held:
            c.close()
        self.sock.close()

    def close(self):
        self.end = 0
        self.thread.join(5)


@pytest.fixture
def stall():
    s = Stall()
    yield s
    s.close()


def test_a_bucket_that_never_answers_is_a_bounded_wait_that_says_what_it_waits_for(stall, toy, tmp_path):
    out = f'gs://{BUCKET}/r10'
    t0 = time.time()
    p = run(train_args(toy, out, tmp_path / 'l', '--init_from=resume', '--gcs_retries=1'), check=False,
            timeout=120, env=dict(STORAGE_EMULATOR_HOST=stall.addr, GCS_READ_TIMEOUT='4'))
    assert time.time() - t0 < 100
    assert_user_error(p, f'waiting for GCS list {out}', 'attempt 2 of 2', 'retry when the bucket is reachable')

    # --overwrite=True deletes the old run's checkpoints in the bucket too: the same bounded wait and one line
    p = run(train_args(toy, out, tmp_path / 'o', '--overwrite=True', '--gcs_retries=1'), check=False,
            timeout=120, env=dict(STORAGE_EMULATOR_HOST=stall.addr, GCS_READ_TIMEOUT='4'))
    assert_user_error(p, out, 'retry when the bucket is reachable')
    assert 'step 1/' not in p.stdout


def test_sigterm_ends_a_wait_for_the_bucket_at_start_within_seconds(stall, toy, tmp_path):
    e = script_env(dict(STORAGE_EMULATOR_HOST=stall.addr))
    p = subprocess.Popen([sys.executable] + train_args(toy, f'gs://{BUCKET}/r10b', tmp_path / 'l'), cwd=ROOT, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)  # until the pipe closes
    reader.start()
    try:
        deadline = time.time() + 90
        while not any('waiting for' in l for l in lines) and p.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert any('waiting for' in l for l in lines), ''.join(lines)[-3000:]
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(5)
    out = ''.join(lines)
    assert took < 10, out[-3000:]
    assert 'stop was requested while waiting for GCS list' in out and 'Traceback' not in out, out[-3000:]
    assert 'step 1/' not in out


class ListsButFailsUploads(BaseHTTPRequestHandler):
    """Lists an empty bucket and takes the lock object's one-request writes; every other request (the uploads)
    answers 503, the way an outage of the upload path does. (A lock the bucket refuses is retried for minutes,
    then warned of: test_failed_uploads_counted_at_exit_are_the_files_still_only_local, with fewer retries.)"""
    def log_message(self, *args):
        pass

    def do_GET(self):
        listing = self.command == 'GET' and self.path.split('?')[0].endswith('/o')
        body = b'{}' if listing or (self.command == 'POST' and 'uploadType=media' in self.path) else b''
        self.send_response(200 if body else 503)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_PUT = do_DELETE = do_GET


def test_uploads_at_exit_get_an_announced_bounded_wait_then_the_local_copies_are_named(toy, tmp_path):
    srv, addr = serve(ListsButFailsUploads)
    out, local = f'gs://{BUCKET}/r11', tmp_path / 'l'
    try:
        p = run(train_args(toy, out, local, '--max_steps=2'), timeout=180, env=dict(STORAGE_EMULATOR_HOST=addr))
    finally:
        srv.shutdown()
        srv.server_close()
    m = re.search(rf'waiting up to (\d+) s for 5 upload\(s\) to {out}', p.stdout)
    assert m and int(m.group(1)) <= 60, p.stdout[-3000:]
    # in the order they would go: train.log's of the start (being tried), then the checkpoint; the snapshots queued
    # with it gave way to the newer ones of the end
    assert f'5 upload(s) to {out} still running at exit; only in {local}: train.log, ckpt_00000002.pt, ' \
           f'metrics.jsonl, results.json, tb' in p.stdout, p.stdout[-3000:]
    assert sorted(os.listdir(local)) == ['ckpt_00000002.pt', 'metrics.jsonl', 'results.json', 'tb', 'train.log']
    assert 'waiting for GCS upload' in p.stderr  # the retries say what they wait for


def test_a_truncated_checkpoint_in_the_bucket_is_named_by_its_uri_and_leaves_no_file(emulator, trained, toy,
                                                                                       tmp_path):
    out = copy_prefix(emulator, trained, f'gs://{BUCKET}/lost/r13', tmp_path)
    client = gcs.GCS(endpoint=emulator)
    half = tmp_path / 'half.pt'
    client.download(f'{out}/ckpt_00000004.pt', str(half))
    half.write_bytes(half.read_bytes()[:half.stat().st_size // 2])
    client.upload(str(half), f'{out}/ckpt_00000004.pt')
    local = tmp_path / 'new'
    p = run(train_args(toy, out, local, '--max_steps=2', '--init_from=resume'),
            env=dict(STORAGE_EMULATOR_HOST=host(emulator)))
    assert f'checkpoint {out}/ckpt_00000004.pt is corrupt or truncated' in p.stdout, p.stdout[-3000:]
    assert f'resuming from {out}/ckpt_00000002.pt' in p.stdout
    assert not [n for n in os.listdir(local) if n.startswith('.rank')]  # no temporary download left behind
    # the run ends at step 2 now: the bucket's results.json (step 4's) is not its own, and is rebuilt
    assert json.load(open(local / 'results.json'))['step'] == 2


def test_failed_uploads_counted_at_exit_are_the_files_still_only_local(toy, tmp_path):
    # the autouse fixture points STORAGE_EMULATOR_HOST at a closed port: every upload fails
    out, local = f'gs://{BUCKET}/r13b', tmp_path / 'l'
    p = run(train_args(toy, out, local, '--max_steps=8', '--keep_last_n=1', '--gcs_retries=1'))
    m = re.search(rf'(\d+) upload\(s\) to {out} failed; only in {local}: (.*)', p.stdout)
    assert m, p.stdout[-3000:]
    assert f'warning: cannot lock {out} (' in p.stdout  # the run goes on, unlocked, and says so
    named = m.group(2).split(', ')
    kept = sorted(os.listdir(local))  # train.log too: its copy in the bucket failed as well
    assert sorted(named) == kept and int(m.group(1)) == len(named), (named, os.listdir(local))


class SlowBucket(Preconditioned):
    """A bucket that lists nothing and keeps the lock object, but whose uploads and deletes never finish (a
    minute without an answer): the exit after a stop must still fit inside a spot VM's 30 s."""
    def do_GET(self):
        if urllib.parse.urlparse(self.path).path.endswith('/o'):  # a listing
            return self.reply(200, b'{}')
        super().do_GET()

    def do_POST(self):
        if 'uploadType=resumable' in self.path:
            time.sleep(60)
            return self.reply(503)
        super().do_POST()

    def do_DELETE(self):
        time.sleep(60)
        self.reply(503)


def test_the_exit_after_a_stop_fits_in_a_spot_vm_s_notice_when_the_bucket_does_not_answer(toy, tmp_path):
    srv, addr = serve(SlowBucket)
    e = script_env(dict(STORAGE_EMULATOR_HOST=addr))
    p = subprocess.Popen([sys.executable] + train_args(toy, f'gs://{BUCKET}/r9x', tmp_path / 'l', '--epochs=200',
                                                        '--log_interval=1'),
                         cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith('step 5/'):
                break
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        rest = p.communicate(timeout=120)[0]
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        srv.shutdown()
        srv.server_close()
    out = ''.join(lines) + rest
    assert p.returncode == 0 and 'stopped cleanly' in out, out[-3000:]
    assert took < 30, (took, out[-3000:])
    assert 'could not remove the lock' in out and 'lease' in out, out[-3000:]
    saved = re.search(r'saved \S+(ckpt_\d{8}\.pt) \(stop requested\)', out)
    assert saved and re.search(rf'only in \S+: .*{saved.group(1)}', out), out[-3000:]


@pytest.mark.parametrize('out', ['gs://', 'gs:///run1'])
def test_a_gs_out_dir_without_a_bucket_is_one_line(toy, tmp_path, out):
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=2'] + TOY_ARGS, check=False)
    assert_user_error(p, f'out_dir={out!r}', 'gs://BUCKET', one_line=True)
