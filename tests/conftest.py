"""
Shared fixtures and helpers for tests/: run() a script of the repo as a user would, the toy dataset,
the TINY model config, the GCS emulator, local HTTP servers; no process a test starts outlives it.
Run all:  python -m pytest -q tests/
"""
import contextlib
import functools
import glob
import http.server
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from data import write_split  # noqa: E402
from runkeep.locks import ended, proc_stat  # noqa: E402

# Every process a test starts computes in one thread. The suite runs in parallel (README: pytest -n auto, one
# worker per core), and processes with two threads each on a busy core wait on each other at every small op:
# a tiny model's 375 training steps took over 10 minutes instead of 2 on the 2-core CI machine.
os.environ.setdefault('OMP_NUM_THREADS', '1')

# The longest files first, so that the workers of pytest -n (--dist loadfile: a file runs whole on one worker)
# finish together instead of one running the pod test alone at the end. Order seen on the 2-core machine.
LONGEST_FIRST = ('test_pod.py', 'test_watchdog.py', 'test_learns.py', 'test_signals.py', 'test_solve.py',
                 'test_arc_twin.py', 'test_adapt.py', 'test_stop_bounded.py', 'test_arc_vote.py', 'test_limits.py',
                 'test_study_adapt.py', 'test_published.py', 'test_budget.py', 'test_xla_trace.py', 'test_dist.py',
                 'test_torchtpu.py', 'test_xla.py', 'test_study.py', 'test_reevaluate.py', 'test_study_faults.py',
                 'test_views.py', 'test_resume.py', 'test_smoke.py')


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def process_table():
    """parent pid -> [(pid, start time)] of each live process (zombies left out); empty without /proc."""
    table = {}
    for pid in filter(str.isdigit, os.listdir('/proc') if os.path.exists('/proc/self/stat') else []):
        fields = proc_stat(pid)  # the state, the parent's pid, ..., the start time (None: ended meanwhile)
        if fields and fields[0] not in ('Z', 'X'):
            table.setdefault(int(fields[1]), []).append((int(pid), fields[19]))
    return table


def children(pid):
    """The live processes whose parent is pid."""
    return [kid for kid, _ in process_table().get(pid, [])]


def below(pid):
    """Every live process descended from pid: its children, theirs, and so on (a launcher's workers, which may
    run in sessions of their own)."""
    table, found, parents = process_table(), [], [pid]
    while parents:
        kids = [kid for kid, _ in table.get(parents.pop(), [])]
        found += kids
        parents += kids
    return found


def alive(pid):
    """Whether process pid runs: it is there and not a zombie (ended, not yet waited for)."""
    return proc_stat(pid) is not None and not ended(pid)


def command(pid):
    """Process pid's command line, its arguments joined by spaces ('' once it has ended)."""
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read().replace(b'\0', b' ').decode(errors='replace').strip()
    except OSError:
        return ''


def descendants(spared=()):
    """(pid, start time) -> command of each live process descended from this one, but for those in `spared`
    and the processes under them."""
    table, found, parents = process_table(), {}, [os.getpid()]
    while parents:
        for key in table.get(parents.pop(), []):
            if key not in spared:
                text = command(key[0])[:200]
                if text and 'compile_worker' not in text:  # inductor's compile workers serve the whole session
                    found[key] = text
                    parents.append(key[0])
    return found


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """A test ends what it starts on its success path only: when an assertion or a timeout fails first, its
    train.py or study.py would go on holding a core through the tests after it. So at teardown every process the
    test started is killed, their children too; those running at its setup (a session's emulator), and what they
    start, are spared."""
    before = set(descendants())
    yield
    doomed = {}
    while new := {k: v for k, v in descendants(before).items() if k not in doomed}:
        for pid, _ in new:  # stopped first: a stopped process starts no other, and its children stay in the tree
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        doomed.update(new)
    for pid, _ in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if doomed:
        print('killed, left running by the test:', ', '.join(f'{pid} ({n})' for (pid, _), n in doomed.items()),
              file=sys.stderr)
    deadline = time.time() + 10
    for pid, _ in doomed:  # this process's own children; the others' are reaped by whoever inherits them
        with contextlib.suppress(ChildProcessError):
            while not os.waitpid(pid, os.WNOHANG)[0] and time.time() < deadline:
                time.sleep(0.01)


TINY = dict(vocab_size=6, seq_len=8, num_puzzle_identifiers=3, hidden_size=32, num_heads=2, expansion=2.0,
            H_cycles=2, L_cycles=2, halt_max_steps=4, puzzle_emb_ndim=32, puzzle_emb_len=2,
            forward_dtype='float32', loss_dtype='float32')

TOY_ARGS = ['--hidden_size=32', '--num_heads=2', '--mlp_t=True', '--pos_encodings=none', '--puzzle_emb_ndim=0',
            '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=4', '--global_batch_size=50', '--lr=2e-3',
            '--lr_warmup_steps=10', '--weight_decay=0.1', '--forward_dtype=float32', '--loss_dtype=float32',
            '--device=cpu', '--ema_rate=0.95', '--xla_cache_dir=', '--mlp_multiple=32']

XLA_ENV = dict(PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1')  # torch_xla on the CPU

BUCKET = "test-bucket"  # created in the GCS emulator
FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=100', '--log_interval=4']  # the toy task in seconds
SUDOKU = TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_every_epochs=1000', '--log_interval=4']


def script_env(env=None):
    """The environment of a script a test starts: the user's, less what would point it at their own W&B account
    (W&B is off unless `env` says otherwise) or at a TPU, plus `env` (where a value is None: without it)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith('WANDB_') and k != 'PJRT_DEVICE'}
    e.update(WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    e.update(env or {})
    return {k: v for k, v in e.items() if v is not None}


def run(args, timeout=600, env=None, check=True, cwd=None):
    """Run a script of this repo in a new process, as a user would: in the repository's root, or in `cwd` (where
    what a script writes under its current folder, a gs:// dataset's local build, should go)."""
    script = [os.path.join(ROOT, args[0])] + args[1:] if cwd else args  # (a script's path, not `-c CODE`)
    p = subprocess.run([sys.executable] + script, cwd=cwd or ROOT, env=script_env(env), capture_output=True,
                       text=True, timeout=timeout)
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


def site_hook(folder, body, root=ROOT):
    """The environment whose Python processes run `body` first (a sitecustomize.py in `folder` on PYTHONPATH),
    with the trainer in `root` importable: how a test puts an event into a real run (a step that never ends, a
    signal at a given step) without a line of the trainer changed."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'sitecustomize.py'), 'w') as f:
        f.write(f"import os, signal, sys, threading, time\nsys.path.insert(0, {str(root)!r})\n" + body)
    return dict(PYTHONPATH=str(folder))


def fresh_checkout(folder):
    """A folder that study.py, run from it (run(..., cwd=folder)), sees as a fresh checkout: the repository's
    config/, and no data/ or out/. A user's own checkout holds the datasets and runs they built there, which
    change what a dry run says (built, not 'missing; built first by')."""
    os.makedirs(folder, exist_ok=True)
    os.symlink(os.path.join(ROOT, 'config'), os.path.join(folder, 'config'))
    return str(folder)


def held_step(folder, at, go=None, argv=('',), slow=False):
    """The environment whose train.py processes (those with an argument containing one of `argv`) say 'test
    hook: step {at} waits' and wait in their training step `at` (counted from the process's start) until the
    file `go` exists or, without `go`, until a stop request: how a test acts on a run that is surely mid-run,
    however fast the machine. slow: steps 6 to 10 take 0.5 s more, the pace by which a run sets how often it
    agrees on a stop (every ~2 s of steps), so a stop requested later lands within a few steps."""
    ready = f'os.path.exists({str(go)!r})' if go else "STOP['requested']"
    return site_hook(folder, f'''
if sys.argv[0].endswith('train.py') and any(w in a for w in {list(argv)!r} for a in sys.argv):
    import step
    from runkeep.signals import STOP
    real, calls = step.train_step, [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        if {slow!r} and 6 <= calls[0] <= 10:
            time.sleep(0.5)
        if calls[0] == {at}:
            print('test hook: step {at} waits', flush=True)
            while not {ready}:
                time.sleep(0.05)
        return real(*args, **kwargs)

    step.train_step = train_step
''')


# where this Python's packages live (a .venv inside the checkout holds torch's files under the root too)
ENVIRONMENT = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix)}


def our_frames(text):
    """The traceback frames in `text` whose file is one of this repository's own, not the Python environment's
    (site-packages, the venv) wherever that lives."""
    def ours(path):
        path = os.path.realpath(path)
        return (path.startswith(os.path.realpath(ROOT) + os.sep) and {'site-packages', 'dist-packages'}.isdisjoint(
            path.split(os.sep)) and not any(path.startswith(env + os.sep) for env in ENVIRONMENT))
    return [f for f in re.findall(r'File "([^"]+)", line \d+', text) if os.path.isabs(f) and ours(f)]


def assert_user_error(p, *words, one_line=False):
    """Exit code != 0, a message naming the problem (the words), no traceback. one_line: the message is the one
    line on stderr, and the words are in that line. Returns the message (with one_line) or all the output."""
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert 'Traceback' not in out, out[-3000:]
    said = p.stderr.strip() if one_line else out
    assert not one_line or len(said.splitlines()) == 1, said[-3000:]
    for w in words:
        assert w in said, (w, said[-3000:])
    return said


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
    """The training log lines' fields, as numbers; a field a line says is n/a (no row halted in its steps) is
    absent from its row."""
    rows = []
    for l in out.splitlines():
        if l.startswith('step '):
            row = {}
            for field in l.split('|'):  # 'step 20/320', 'loss 1.23', 'acc n/a', ..., '456 ex/s'
                a, b = field.split()
                key, val = (b, a) if b == 'ex/s' else (a, b if b == 'n/a' else b.split('/')[0])
                if val != 'n/a':
                    row[key] = float(val)
            rows.append(row)
    return rows


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there afterwards


# -----------------------------------------------------------------------------
# GCS, against a real emulator server (pip package gcp-storage-emulator). Only 127.0.0.1 is ever
# contacted: every test runs with STORAGE_EMULATOR_HOST set, which also keeps credentials.get_token() away
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


# --- helpers shared by the run and fault tests ------------------------------------------------------------


@pytest.fixture(scope='module')
def sudoku4(tmp_path_factory):
    """Generated 4x4 Sudokus (the builder's output): 60 train, 10 test."""
    root = tmp_path_factory.mktemp('s4') / 'd'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(root)])
    return str(root)


@pytest.fixture(scope='module')
def trained(sudoku4, tmp_path_factory):
    """A finished 4-step run on the 4x4 Sudokus: ckpt_00000004.pt, metrics.jsonl, results.json. Read only."""
    out = tmp_path_factory.mktemp('trained') / 'o'
    train(sudoku4, out, '--max_steps=4', args=SUDOKU)
    return str(out)


def tree(root):
    """Every file under root: relative path -> bytes (a folder compared before and after a fault)."""
    out = {}
    for folder, _, names in os.walk(root):
        for n in names:
            path = os.path.join(folder, n)
            out[os.path.relpath(path, root)] = open(path, 'rb').read()
    return out


def write_like(root, kind, side, n=20, seed=0, splits=('train', 'test')):
    """A dataset that says it holds side x side puzzles of `kind` (random tokens: shapes are what matter)."""
    rng = np.random.default_rng(seed)
    vocab = side + 2 if kind == 'sudoku' else 6
    for split in splits:
        x = rng.integers(1, vocab, (n, side * side))
        write_split(str(root), split, x, x, np.zeros(n), np.arange(n + 1), np.arange(n + 1), vocab_size=vocab,
                    extra=dict(puzzle_type=kind, grid_size=side))
    return str(root)


def start(data, out, *extra, args=FAST, **kw):
    """train.py in the background (its own session, so a failed test can kill the whole group)."""
    kw = dict(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT), **kw)
    return subprocess.Popen([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={out}'] + args
                            + list(extra), cwd=ROOT, env=script_env(), text=True, start_new_session=True, **kw)


def read_until(proc, prefix, timeout=300):
    """The lines proc printed up to and including the first that starts with prefix."""
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return ''.join(lines)
        assert time.time() < deadline, ''.join(lines)[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no line starting with {prefix!r}:\n{''.join(lines)[-3000:]}")


def finish(proc, timeout):
    try:
        rest = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"train.py still running {timeout} s after the signal")
    return rest or ''


def popen_train(data, out, *extra, args=FAST, env=None):
    """train.py in the background, stdout and stderr on one raw pipe (read through Lines), its own session."""
    return subprocess.Popen([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={out}'] + args
                            + list(extra), cwd=ROOT, env=script_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)


def hold(proc, timeout=60):
    """SIGSTOP to proc, returning once every thread of it is stopped: the signal stops them only when each is next
    scheduled, so a thread may still write a file or a line meanwhile. SIGCONT is the caller's."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.time() + timeout
    while not all(state in 'Tt' for state in thread_states(proc.pid)):
        assert time.time() < deadline, f"pid {proc.pid} not stopped {timeout} s after SIGSTOP"
        time.sleep(0.01)


def thread_states(pid):
    """The state letter of each thread of process pid (/proc/<pid>/task/*/stat)."""
    states = []
    for task in os.listdir(f'/proc/{pid}/task'):
        try:
            states.append(open(f'/proc/{pid}/task/{task}/stat').read().rsplit(')', 1)[1].split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return states


def stopped_owing_an_evaluation(data, out, args, hook):
    """A run of `args` stopped by SIGTERM in step 20, an evaluation's (held there by a test hook in the folder
    `hook`): it saves ckpt_00000020.pt with that evaluation owed, and exits 0."""
    proc = popen_train(data, out, *args, env=held_step(hook, 20))
    lines = Lines(proc)
    lines.until('test hook: step 20 waits')
    proc.send_signal(signal.SIGTERM)
    text = lines.rest(120)
    assert proc.returncode == 0 and ckpts(out) == ['ckpt_00000020.pt'], text[-3000:]
    return text


class Lines:
    """The lines a process prints, read from its pipe's file descriptor without read-ahead: what has not been
    read is still in the pipe, and `drain` drops what the process has written so far."""

    def __init__(self, proc):
        self.proc, self.fd, self.buf, self.seen = proc, proc.stdout.fileno(), b'', []

    def _read(self, timeout):
        if not select.select([self.fd], [], [], max(0.0, timeout))[0]:
            return None
        chunk = os.read(self.fd, 1 << 16)
        self.buf += chunk
        return chunk

    def next(self, timeout=300):
        deadline = time.time() + timeout
        while b'\n' not in self.buf:
            chunk = self._read(deadline - time.time())
            if not chunk:  # EOF, or nothing within the time
                return None
        line, self.buf = self.buf.split(b'\n', 1)
        self.seen.append(line.decode())
        return self.seen[-1]

    def until(self, prefix, timeout=300):
        deadline = time.time() + timeout
        while True:
            line = self.next(deadline - time.time())
            if line is None:
                self.kill()
                raise AssertionError(f"no line starting with {prefix!r}:\n" + '\n'.join(self.seen)[-3000:])
            if line.startswith(prefix):
                return line

    def drain(self):
        while self._read(0):
            pass
        *lines, self.buf = self.buf.split(b'\n')
        self.seen += [l.decode() for l in lines]

    def rest(self, timeout):
        deadline = time.time() + timeout
        while self.next(deadline - time.time()) is not None:
            pass
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {timeout} s on:\n" + '\n'.join(self.seen)[-3000:])
        return '\n'.join(self.seen)

    def kill(self):
        with_group = lambda: os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            with_group()
        except ProcessLookupError:
            pass
        self.proc.wait()


class Preconditioned(BaseHTTPRequestHandler):
    objects = {}

    def log_message(self, *args):
        pass

    def reply(self, code, body=b'', kind='application/json'):
        self.send_response(code)
        self.send_header('Content-Type', kind)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def name(self):
        url = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(url.query)
        return q['name'][0] if 'name' in q else urllib.parse.unquote(url.path.split('/o/', 1)[1]), q

    def do_POST(self):  # a media upload
        name, q = self.name()
        data = self.rfile.read(int(self.headers['Content-Length']))
        if q.get('ifGenerationMatch') == ['0'] and name in self.objects:
            return self.reply(412, json.dumps(dict(error=dict(code=412, message='precondition'))).encode())
        self.objects[name] = data
        self.reply(200, json.dumps(dict(name=name, generation='1')).encode())

    def do_GET(self):
        name, _ = self.name()
        if name not in self.objects:
            return self.reply(404, json.dumps(dict(error=dict(code=404, message='no such object'))).encode())
        self.reply(200, self.objects[name], 'application/octet-stream')

    def do_DELETE(self):
        name, _ = self.name()
        self.reply(204 if self.objects.pop(name, None) is not None else 404)
