"""
Shared fixtures and helpers for tests/: run() a script of the repo as a user would, the toy dataset,
the TINY model config, the GCS emulator, local HTTP servers. Run all:  python -m pytest -q tests/
"""
import functools
import glob
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from data import write_split  # noqa: E402

# Every process a test starts computes in one thread. The suite runs in parallel (README: pytest -n auto, one
# worker per core), and processes with two threads each on a busy core wait on each other at every small op:
# a tiny model's 375 training steps took over 10 minutes instead of 2 on the 2-core CI machine.
os.environ.setdefault('OMP_NUM_THREADS', '1')

# The longest files first, so that the workers of pytest -n (--dist loadfile: a file runs whole on one worker)
# finish together instead of one running the pod test alone at the end. Order seen on the 2-core machine.
LONGEST_FIRST = ('test_pod.py', 'test_watchdog.py', 'test_train.py', 'test_signals.py', 'test_solve.py',
                 'test_xla_trace.py', 'test_dist.py', 'test_torchtpu.py', 'test_xla.py', 'test_study.py',
                 'test_reevaluate.py', 'test_study_faults.py', 'test_views.py', 'test_resume.py', 'test_smoke.py')


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order

TINY = dict(vocab_size=6, seq_len=8, num_puzzle_identifiers=3, hidden_size=32, num_heads=2, expansion=2.0,
            H_cycles=2, L_cycles=2, halt_max_steps=4, puzzle_emb_ndim=32, puzzle_emb_len=2,
            forward_dtype='float32', loss_dtype='float32')

TOY_ARGS = ['--hidden_size=32', '--num_heads=2', '--mlp_t=True', '--pos_encodings=none', '--puzzle_emb_ndim=0',
            '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=4', '--global_batch_size=50', '--lr=2e-3',
            '--lr_warmup_steps=10', '--weight_decay=0.1', '--forward_dtype=float32', '--loss_dtype=float32',
            '--device=cpu', '--ema_rate=0.95', '--xla_cache_dir=']

XLA_ENV = dict(PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1')  # torch_xla on the CPU

BUCKET = "test-bucket"  # created in the GCS emulator
FAST = TOY_ARGS + ['--epochs=2', '--eval_interval=100', '--log_interval=4']  # the toy task in seconds
SUDOKU = TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_interval=1000', '--log_interval=4']


def run(args, timeout=600, env=None, check=True):
    """Run a script of this repo in a new process (cwd = repository root), as a user would."""
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    e.pop('PJRT_DEVICE', None)
    e.update(env or {})
    p = subprocess.run([sys.executable] + args, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}")
    return p


def train(data, out, *extra, args=FAST, check=True, env=None):
    """train.py on the dataset `data` into `out`, with the toy task's fast flags unless `args` says otherwise."""
    return run(['train.py', f'--data_path={data}', f'--out_dir={out}'] + args + list(extra), check=check, env=env)


def ckpts(folder):
    """The checkpoint files' names in `folder`, oldest first."""
    return sorted(os.path.basename(c) for c in glob.glob(os.path.join(folder, 'ckpt_*.pt')))


def ckpt_paths(folder):
    return sorted(glob.glob(os.path.join(folder, 'ckpt_*.pt')))


def assert_user_error(p, *words):
    """Exit code != 0, a message naming the problem (the words), no traceback."""
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert 'Traceback' not in out, out[-3000:]
    for w in words:
        assert w in out, (w, out[-3000:])


def make_reverse_dataset(root, n_train=1000, n_test=200, L=8, seed=0):
    """A toy task a tiny TRM learns in a minute: write the input sequence backwards."""
    rng = np.random.default_rng(seed)
    for split, n in (('train', n_train), ('test', n_test)):
        x = rng.integers(2, 6, (n, L))
        write_split(root, split, x, x[:, ::-1], np.zeros(n), np.arange(n + 1), np.arange(n + 1), vocab_size=6)
    return root


@pytest.fixture(scope='session')
def toy(tmp_path_factory):
    """The reverse task, 1000 train and 200 test examples; read only."""
    return make_reverse_dataset(str(tmp_path_factory.mktemp('toy')))


def eval_lines(out):
    return [l for l in out.splitlines() if l.startswith('eval on')]


def step_lines(out):
    rows = []
    for l in out.splitlines():
        if l.startswith('step '):
            row = {}
            for field in l.split('|'):  # 'step 20/320', 'loss 1.23', ..., '456 ex/s'
                a, b = field.split()
                key, val = (b, a) if b == 'ex/s' else (a, b.split('/')[0])
                row[key] = float(val)
            rows.append(row)
    return rows


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there afterwards


# -----------------------------------------------------------------------------
# GCS, against a real emulator server (pip package gcp-storage-emulator). Only 127.0.0.1 is ever
# contacted: every test runs with STORAGE_EMULATOR_HOST set, which also keeps gcs.get_token() away
# from the metadata server and gcloud.

@pytest.fixture(autouse=True)
def _no_real_gcs(monkeypatch):
    # default for every test: an emulator address where nothing listens, so no test can
    # ever reach real GCS, the metadata server or gcloud by accident
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{free_port()}")


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    port = free_port()
    workdir = tmp_path_factory.mktemp("emulator")
    log = open(workdir / "emulator.log", "wb")
    # --in-memory and cwd=workdir: it keeps nothing on disk, and nothing in the repo
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory", "-q"], cwd=workdir, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 20
        while True:
            try:
                if requests.get(url + "/", timeout=1).status_code == 200:  # emulator's health check
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("gcp-storage-emulator did not start:\n" + (workdir / "emulator.log").read_text())
            time.sleep(0.1)
        r = requests.post(url + "/storage/v1/b", params={"project": "test"}, json={"name": BUCKET}, timeout=5)
        assert r.status_code == 200, r.text
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def emu(emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.replace("http://", ""))  # gcs.py must add the scheme
    return emulator


# -----------------------------------------------------------------------------
# local HTTP servers for the dataset downloads

class FileHandler(http.server.BaseHTTPRequestHandler):
    """Serves `files` (path -> bytes) with Range support; `/status/N` answers N; `fail_once` paths answer 503
    once; `drop_once` paths send half the body once, then close. Every request is appended to `log`."""
    files, log, fail_once, drop_once = {}, [], set(), set()

    def log_message(self, *args):
        pass

    def do_GET(self):
        status, body, headers = 200, b'', {}
        if self.path.startswith('/status/'):
            status = int(self.path.split('/')[2])
        elif self.path in self.fail_once:
            self.fail_once.discard(self.path)
            status = 503
        elif self.path not in self.files:
            status = 404
        else:
            body = self.files[self.path]
            m = re.fullmatch(r'bytes=(\d+)-', self.headers.get('Range', ''))
            if m:
                start = int(m.group(1))
                status, headers['Content-Range'] = 206, f'bytes {start}-{len(body) - 1}/{len(body)}'
                body = body[start:]
        self.log.append((self.path, self.headers.get('Range'), status))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if self.path in self.drop_once and status == 200:  # the connection dies halfway through
            self.drop_once.discard(self.path)
            body = body[:len(body) // 2]
            self.close_connection = True
        self.wfile.write(body)


@pytest.fixture
def server():
    """A FileHandler server on 127.0.0.1; yields its base URL. Its class-level state is reset per test."""
    FileHandler.files, FileHandler.log, FileHandler.fail_once, FileHandler.drop_once = {}, [], set(), set()
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), FileHandler)
    thread = threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{srv.server_address[1]}'
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)
        assert not thread.is_alive()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path):
    """Serve a temporary folder on 127.0.0.1; yields (folder, base URL of its 'maze' subfolder)."""
    root = tmp_path / 'srv'
    root.mkdir()
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0),
                                             functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    try:
        yield root, f'http://127.0.0.1:{server.server_port}/maze'
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
