"""
Checkpoints on a Hugging Face hub: publish.py commits the reference's layout to a repository, and
--init_from=hf://OWNER/REPO[@REVISION]/PATH/step_<N> downloads it once into the cache, resumes an interrupted
transfer, works from the cache when the hub is out of reach, and says in one line what is missing. Everything runs
against a local server (FakeHub) that answers the hub's endpoints the client (huggingface_hub) calls, picked with
HF_ENDPOINT: never the internet.
    python -m pytest -q tests/test_hub.py
"""
import base64
import hashlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from conftest import ROOT, assert_user_error, eval_lines, run, script_env, site_hook, train
from test_published import MODEL_FLAGS, TABLE_ARGS, make_ids_dataset

TOKEN = 'hf_test_writer'


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's endpoints, as the client uses them: HEAD/GET /{repo}/resolve/{revision}/{path} (a large file
    redirects to a storage host, here the second server at 127.0.0.2, serving byte ranges; a small one is served
    at once), POST /api/repos/create, POST /api/models/{repo}/preupload/{revision}, the LFS batch API and its
    upload URL, POST /api/models/{repo}/commit/{revision}. Private repositories answer only to TOKEN. Class
    state, reset per test: `repos` {repo: dict(private, branches {name: commit}, commits {commit: {path:
    ('lfs', oid) | ('regular', bytes)}})}, `objects` {oid: bytes}, `log` [(method, path, Range)], `drop_once`
    (storage paths that send half their bytes, then close), `stall` (path -> Event: send half, then wait) and
    `unavailable` (repository paths answered 503, as a hub in trouble does)."""
    repos, objects, log, drop_once, stall, unavailable, hub, cdn = {}, {}, [], set(), {}, set(), '', ''

    def log_message(self, *args):
        pass

    def reply(self, status, body=b'', headers=None, kind='application/json'):
        self.send_response(status)
        for k, v in {'Content-Type': kind, 'Content-Length': str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != 'HEAD':
            self.wfile.write(body)

    def error(self, status, code, message):
        self.reply(status, json.dumps(dict(error=message)).encode(), {'X-Error-Code': code})

    def authorized(self):
        return self.headers.get('Authorization') == f'Bearer {TOKEN}'

    def body(self):
        if self.headers.get('Transfer-Encoding') == 'chunked':
            data = b''
            while (size := int(self.rfile.readline().strip(), 16)):
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return data
        return self.rfile.read(int(self.headers.get('Content-Length') or 0))

    # --- downloads ---------------------------------------------------------------------------------------

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        self.log.append((self.command, url.path, self.headers.get('Range')))
        if url.path.startswith('/cdn/'):
            return self.serve(self.objects[url.path[5:]], url.path)
        m = re.fullmatch(r'/([^/]+/[^/]+)/resolve/([^/]+)/(.+)', url.path)
        if not m:
            return self.error(404, 'RepoNotFound', 'no such page')
        repo, rev, path = m[1], urllib.parse.unquote(m[2]), urllib.parse.unquote(m[3])
        if path in self.unavailable:
            return self.error(503, 'ServiceUnavailable', 'Service Unavailable')
        r = self.repos.get(repo)
        if r is None or r['private'] and not self.authorized():
            return self.error(401, 'RepoNotFound', 'Repository not found')
        commit = r['branches'].get(rev, rev if rev in r['commits'] else None)
        if commit is None:
            return self.error(404, 'RevisionNotFound', 'Invalid rev id')
        files = r['commits'][commit]
        if path not in files:
            return self.reply(404, b'{}', {'X-Error-Code': 'EntryNotFound', 'X-Repo-Commit': commit})
        kind, content = files[path]
        if kind == 'lfs':  # as the hub does for a large file: a redirect to a signed URL of a storage host
            return self.reply(302, b'', {'Location': f'{self.cdn}/cdn/{content}', 'X-Repo-Commit': commit,
                                         'X-Linked-Etag': f'"{content}"', 'ETag': f'"{content}"',
                                         'X-Linked-Size': str(len(self.objects[content]))})
        self.serve(content, url.path, {'X-Repo-Commit': commit,
                                       'ETag': f'"{hashlib.sha1(content).hexdigest()}"'})

    def serve(self, data, path, headers=None):
        headers, status = dict(headers or {}), 200
        m = re.fullmatch(r'bytes=(\d+)-', self.headers.get('Range') or '')
        if m:
            start = int(m[1])
            status, headers['Content-Range'] = 206, f'bytes {start}-{len(data) - 1}/{len(data)}'
            data = data[start:]
        if self.command == 'HEAD' or not (path in self.drop_once or path in self.stall) or m:
            return self.reply(status, data, headers, 'application/octet-stream')
        self.send_response(status)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data[:len(data) // 2])
        self.wfile.flush()
        if path in self.stall:  # a transfer that hangs until the test lets go (it kills the client first)
            self.stall.pop(path).wait(60)
        self.drop_once.discard(path)
        self.close_connection = True

    # --- uploads -------------------------------------------------------------------------------------------

    def do_POST(self):
        url, data = urllib.parse.urlsplit(self.path), self.body()
        self.log.append(('POST', url.path, None))
        if not self.authorized():
            return self.error(401, 'Unauthorized', 'Invalid credentials in Authorization header')
        if url.path == '/api/repos/create':
            req = json.loads(data)
            repo = f"{req['organization']}/{req['name']}"
            if repo in self.repos:
                return self.reply(409, json.dumps(dict(error='exists', url=f'{self.hub}/{repo}')).encode())
            empty = hashlib.sha1(repo.encode()).hexdigest()
            self.repos[repo] = dict(private=req.get('visibility', 'private') != 'public',
                                    branches=dict(main=empty), commits={empty: {}})
            return self.reply(200, json.dumps(dict(url=f'{self.hub}/{repo}')).encode())
        if m := re.fullmatch(r'/([^/]+/[^/]+)\.git/info/lfs/objects/batch', url.path):
            objects = [dict(o, actions=dict(upload=dict(href=f'{self.hub}/lfs-upload/{o["oid"]}')))
                       if o['oid'] not in self.objects else dict(o) for o in json.loads(data)['objects']]
            return self.reply(200, json.dumps(dict(transfer='basic', objects=objects)).encode())
        if url.path in self.stall:  # an answer the hub holds until the test lets go (it interrupts the client)
            self.stall.pop(url.path).wait(60)
            return self.error(503, 'Unavailable', 'held')
        m = re.fullmatch(r'/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)', url.path)
        if not m or m[1] not in self.repos:
            return self.error(404, 'RepoNotFound', 'Repository not found')
        repo, rev = self.repos[m[1]], urllib.parse.unquote(m[3])
        if rev not in repo['branches']:
            return self.error(404, 'RevisionNotFound', 'Invalid rev id')
        if m[2] == 'preupload':  # text files go into git, the rest to LFS (the hub decides by content)
            files = [dict(path=f['path'], shouldIgnore=False,
                          uploadMode='regular' if is_text(base64.b64decode(f['sample'])) else 'lfs')
                     for f in json.loads(data)['files']]
            return self.reply(200, json.dumps(dict(files=files)).encode())
        files = dict(repo['commits'][repo['branches'][rev]])
        for item in map(json.loads, data.decode().splitlines()):
            v = item['value']
            if item['key'] == 'file':
                files[v['path']] = ('regular', base64.b64decode(v['content']))
            elif item['key'] == 'lfsFile':
                if v['oid'] not in self.objects:
                    return self.error(400, 'BadRequest', f"LFS object {v['oid']} was never uploaded")
                files[v['path']] = ('lfs', v['oid'])
        commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        repo['commits'][commit], repo['branches'][rev] = files, commit
        self.reply(200, json.dumps(dict(commitUrl=f'{self.hub}/{m[1]}/commit/{commit}', commitOid=commit,
                                        pullRequestUrl=None)).encode())

    def do_PUT(self):
        url, data = urllib.parse.urlsplit(self.path), self.body()
        self.log.append(('PUT', url.path, None))
        oid = url.path.rsplit('/', 1)[-1]
        if hashlib.sha256(data).hexdigest() != oid:
            return self.reply(400, b'{"error": "checksum mismatch"}')
        self.objects[oid] = data
        self.reply(200)


def is_text(sample):
    try:
        return b'\0' not in sample and bool(sample.decode('utf-8'))
    except UnicodeDecodeError:
        return False


@pytest.fixture
def refused():
    """An endpoint that refuses every connection: a port held (bound, never listening) for the test, so that no
    other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        yield f'http://127.0.0.1:{s.getsockname()[1]}'


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """FakeHub on 127.0.0.1 (the hub) and 127.0.0.2 (its storage host); yields the environment that points the
    scripts at it, with a cache and a client home of their own (no token unless a test adds it)."""
    FakeHub.repos, FakeHub.objects, FakeHub.log, FakeHub.drop_once, FakeHub.stall = {}, {}, [], set(), {}
    FakeHub.unavailable = set()
    servers = [http.server.ThreadingHTTPServer((host, 0), FakeHub) for host in ('127.0.0.1', '127.0.0.2')]
    FakeHub.hub, FakeHub.cdn = (f'http://{s.server_address[0]}:{s.server_address[1]}' for s in servers)
    threads = [threading.Thread(target=s.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
               for s in servers]
    for t in threads:
        t.start()
    for k in ('HF_TOKEN', 'HUGGING_FACE_HUB_TOKEN', 'HF_HUB_OFFLINE'):
        monkeypatch.delenv(k, raising=False)
    env = dict(HF_ENDPOINT=FakeHub.hub, HF_HOME=str(tmp_path / 'hf_home'), TRM_HUB_CACHE=str(tmp_path / 'cache'),
               HF_HUB_DISABLE_TELEMETRY='1', HF_HUB_DISABLE_XET='1')  # (xet: a storage protocol of its own)
    try:
        yield env
    finally:
        for event in list(FakeHub.stall.values()):
            event.set()
        for s in servers:
            s.shutdown()
            s.server_close()


@pytest.fixture(scope='module')
def table_run(tmp_path_factory):
    """A 6-step run with a 12-row puzzle table. Read only."""
    tmp = tmp_path_factory.mktemp('hub_table')
    data = make_ids_dataset(tmp / 'data')
    train(data, tmp / 'run', '--max_steps=6', args=TABLE_ARGS)
    return dict(data=data, ckpt=str(tmp / 'run' / 'ckpt_00000006.pt'), tmp=tmp)


def publish_to(hub, table_run, *extra, token=TOKEN, check=True):
    env = dict(hub, **({'HF_TOKEN': token} if token else {}))
    return run(['publish.py', f"--init_from={table_run['ckpt']}", '--repo=alice/trm-toy', '--path_in_repo=toy',
                *extra], env=env, check=check)


def evaluate(hub, table_run, out, init_from, *extra, check=True, env=None):
    return run(['train.py', f"--data_path={table_run['data']}", f'--out_dir={out}', f'--init_from={init_from}',
                '--eval_only=True', '--device=cpu', '--xla_cache_dir=', *extra], env=dict(hub, **(env or {})),
               check=check)


def gets(path_part):
    return [e for e in FakeHub.log if e[0] == 'GET' and path_part in e[1]]


def test_publish_commits_the_layout_and_hf_downloads_it_once(hub, table_run, tmp_path, refused):
    p = publish_to(hub, table_run)
    commit = FakeHub.repos['alice/trm-toy']['branches']['main']
    assert f'committed to alice/trm-toy (revision main) as {commit}' in p.stdout
    assert '--init_from=hf://alice/trm-toy/toy/step_6' in p.stdout
    files = FakeHub.repos['alice/trm-toy']['commits'][commit]
    assert files['toy/step_6'][0] == 'lfs' and files['toy/all_config.yaml'][0] == 'regular'
    assert FakeHub.repos['alice/trm-toy']['private']  # created private: publish.py's default
    local = os.path.join(os.path.dirname(table_run['ckpt']), 'published')
    assert FakeHub.objects[files['toy/step_6'][1]] == open(f'{local}/step_6', 'rb').read()
    assert files['toy/all_config.yaml'][1] == open(f'{local}/all_config.yaml', 'rb').read()

    uri = 'hf://alice/trm-toy/toy/step_6'
    there = evaluate(hub, table_run, tmp_path / 'a', uri, env=dict(HF_TOKEN=TOKEN))
    here = evaluate(hub, table_run, tmp_path / 'b', f'{local}/step_6')
    assert eval_lines(there.stdout) == eval_lines(here.stdout) and eval_lines(here.stdout)
    cached = os.path.join(hub['TRM_HUB_CACHE'], 'alice--trm-toy', commit, 'toy', 'step_6')
    said = next(l for l in there.stdout.splitlines() if l.startswith(f'init_from={uri}:'))
    assert f'cached at {cached}' in said and 'model config from hf://alice/trm-toy/toy/all_config.yaml' in said
    assert f"data_paths=['{table_run['data']}']" in said
    assert 'downloading hf://alice/trm-toy@' in there.stdout and len(gets('/cdn/')) == 1

    again = evaluate(hub, table_run, tmp_path / 'c', uri, env=dict(HF_TOKEN=TOKEN))
    assert len(gets('/cdn/')) == 1 and 'downloading' not in again.stdout  # the cache: no second download
    assert eval_lines(again.stdout) == eval_lines(here.stdout)
    # the hub out of reach: the copy cached for the revision, said
    gone = evaluate(hub, table_run, tmp_path / 'd', uri, env=dict(HF_ENDPOINT=refused))
    assert f"warning: cannot reach {refused}" in gone.stdout and f"commit {commit[:12]} of 'main'" in gone.stdout
    assert eval_lines(gone.stdout) == eval_lines(here.stdout)


def test_a_revision_and_a_new_commit(hub, table_run, tmp_path):
    publish_to(hub, table_run)
    first = FakeHub.repos['alice/trm-toy']['branches']['main']
    # the raw weights, a second commit on main (from a folder of their own: the first one's step_6 stays)
    publish_to(hub, table_run, '--weights=model', f'--out_dir={tmp_path}/raw')
    second = FakeHub.repos['alice/trm-toy']['branches']['main']
    assert first != second
    a = evaluate(hub, table_run, tmp_path / 'a', f'hf://alice/trm-toy@{first}/toy/step_6', env=dict(HF_TOKEN=TOKEN))
    b = evaluate(hub, table_run, tmp_path / 'b', 'hf://alice/trm-toy/toy/step_6', env=dict(HF_TOKEN=TOKEN))
    assert len(gets('/cdn/')) == 2  # two commits, two files
    assert eval_lines(a.stdout) != eval_lines(b.stdout)  # the EMA's weights, then the raw ones
    heads = len(FakeHub.log)
    pinned = evaluate(hub, table_run, tmp_path / 'c', f'hf://alice/trm-toy@{first}/toy/step_6')
    assert len(FakeHub.log) == heads  # a commit's files are cached for good: no request at all
    assert eval_lines(pinned.stdout) == eval_lines(a.stdout)


def test_a_run_killed_while_it_records_a_branch_s_commit_leaves_the_cache_usable_offline(hub, table_run, tmp_path):
    """The commit a branch was last seen at (the cache's refs/) is what a run out of reach or offline loads: a run
    killed as it records a newer one (here at the moment the file is opened for writing) left it empty, written in
    place, and every later offline run refused the copy cached for that branch as "not cached"."""
    publish_to(hub, table_run, '--private=False')
    uri = 'hf://alice/trm-toy/toy/step_6'
    first = evaluate(hub, table_run, tmp_path / 'a', uri)
    publish_to(hub, table_run, '--weights=model', f'--out_dir={tmp_path}/raw')  # main moves on
    killed = site_hook(tmp_path / 'hook', 'import builtins\n_open = builtins.open\n'
                       'def open(file, mode="r", *a, **k):\n    f = _open(file, mode, *a, **k)\n'
                       f'    if "w" in mode and str(file).startswith({hub["TRM_HUB_CACHE"] + os.sep!r}) and '
                       f'{os.sep + "refs" + os.sep!r} in str(file):\n'
                       '        os._exit(9)\n    return f\nbuiltins.open = open\n')
    p = evaluate(hub, table_run, tmp_path / 'b', uri, check=False, env=killed)
    assert p.returncode == 9, p.stdout[-3000:] + p.stderr[-3000:]
    p = evaluate(hub, table_run, tmp_path / 'c', uri, check=False, env=dict(HF_HUB_OFFLINE='1'))
    assert p.returncode == 0 and 'using the copy of toy/step_6 cached from commit' in p.stdout, p.stderr[-3000:]
    assert eval_lines(p.stdout) == eval_lines(first.stdout) and eval_lines(p.stdout)


def test_a_publish_to_a_branch_prints_the_address_of_that_branch(hub, table_run, tmp_path):
    """Committed to a branch other than main, the printed load command names the branch (URL-encoded: it has a
    '/'), and followed it loads what was committed there, not main's file of the same path."""
    publish_to(hub, table_run)  # the EMA's weights on main
    repo = FakeHub.repos['alice/trm-toy']
    repo['branches']['exp/v1'] = repo['branches']['main']
    p = publish_to(hub, table_run, '--weights=model', f'--out_dir={tmp_path}/raw', '--revision=exp/v1')
    uri = re.search(r'committed to .*: load it with --init_from=(\S+)', p.stdout)[1]
    there = evaluate(hub, table_run, tmp_path / 'a', uri, env=dict(HF_TOKEN=TOKEN))
    here = evaluate(hub, table_run, tmp_path / 'b', f'{tmp_path}/raw/step_6')
    cached = os.path.join(hub['TRM_HUB_CACHE'], 'alice--trm-toy', repo['branches']['exp/v1'], 'toy', 'step_6')
    assert f'cached at {cached}' in there.stdout and repo['branches']['exp/v1'] != repo['branches']['main']
    assert eval_lines(there.stdout) == eval_lines(here.stdout) and eval_lines(here.stdout)
    assert uri == 'hf://alice/trm-toy@exp%2Fv1/toy/step_6'


def test_the_address_publish_prints_for_a_run_folder_with_an_at_sign_loads(hub, table_run, tmp_path):
    """path_in_repo defaults to the run folder's name, which may hold an '@' ('sudoku@h512'): the hf:// address
    publish.py printed for it was refused by train.py as no hub address at all."""
    import shutil
    run_dir = tmp_path / 'sudoku@h512'
    run_dir.mkdir()
    shutil.copy(table_run['ckpt'], run_dir)
    p = publish_to(hub, dict(ckpt=str(run_dir / os.path.basename(table_run['ckpt']))), '--path_in_repo=')
    uri = re.search(r'committed to .*: load it with --init_from=(\S+)', p.stdout)[1]
    assert uri == 'hf://alice/trm-toy/sudoku@h512/step_6', uri
    there = evaluate(hub, table_run, tmp_path / 'a', uri, env=dict(HF_TOKEN=TOKEN))
    here = evaluate(hub, table_run, tmp_path / 'b', f'{run_dir}/published/step_6')
    assert eval_lines(there.stdout) == eval_lines(here.stdout) and eval_lines(here.stdout)


def test_an_interrupted_download_resumes(hub, tmp_path):
    """A 5 MB checkpoint (a 40,000-row table): a connection that dies halfway is resumed within the run; a run
    killed during the download leaves what it fetched (written as it arrives, a megabyte at a time), and the
    next run asks only for the rest."""
    data = make_ids_dataset(tmp_path / 'data', ids=40000)
    train(data, tmp_path / 'run', '--max_steps=1', args=TABLE_ARGS)
    big = dict(data=data, ckpt=str(tmp_path / 'run' / 'ckpt_00000001.pt'))
    publish_to(hub, big)
    commit = FakeHub.repos['alice/trm-toy']['branches']['main']
    oid = FakeHub.repos['alice/trm-toy']['commits'][commit]['toy/step_1'][1]
    size, uri, env = len(FakeHub.objects[oid]), 'hf://alice/trm-toy/toy/step_1', dict(hub, HF_TOKEN=TOKEN)
    assert size > 5e6
    FakeHub.drop_once.add(f'/cdn/{oid}')
    p = evaluate(hub, big, tmp_path / 'a', uri, env=env)
    first, then = [r for _, _, r in gets('/cdn/')]
    assert first is None and 0 < int(then[6:-1]) <= size // 2 and eval_lines(p.stdout)  # whole megabytes kept
    cached = os.path.join(hub['TRM_HUB_CACHE'], 'alice--trm-toy', commit, 'toy', 'step_1')
    assert open(cached, 'rb').read() == FakeHub.objects[oid]
    assert 'of 5.' in p.stdout  # the progress lines of a download into a log, not a terminal

    cache = tmp_path / 'cache2'
    release = FakeHub.stall[f'/cdn/{oid}'] = threading.Event()
    proc = subprocess.Popen([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={tmp_path}/b',
                             f'--init_from={uri}', '--eval_only=True', '--device=cpu'],
                            cwd=ROOT, env=dict(os.environ, **dict(env, TRM_HUB_CACHE=str(cache))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    part = cache / 'alice--trm-toy' / commit / 'toy' / 'step_1.incomplete'
    deadline = time.time() + 120
    while not (part.exists() and part.stat().st_size >= 2 ** 21):  # the stall comes after 2.5 MB
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    release.set()
    have = part.stat().st_size
    p = evaluate(hub, big, tmp_path / 'c', uri, env=dict(env, TRM_HUB_CACHE=str(cache)))
    assert f'resuming after the {have / 1e6:.1f} MB fetched before' in p.stdout
    assert gets('/cdn/')[-1][2] == f'bytes={have}-' and not part.exists()
    assert open(part.with_suffix(''), 'rb').read() == FakeHub.objects[oid] and eval_lines(p.stdout)

    # Ctrl-C during the download: one line, the exit code of a SIGINT, and what arrived kept for the next run
    # (Python's KeyboardInterrupt, as in a terminal: a test runner in the background may pass SIGINT ignored)
    cache = tmp_path / 'cache3'
    part = cache / 'alice--trm-toy' / commit / 'toy' / 'step_1.incomplete'
    release = FakeHub.stall[f'/cdn/{oid}'] = threading.Event()
    hook = site_hook(tmp_path / 'hook', 'signal.signal(signal.SIGINT, signal.default_int_handler)\n')
    proc = subprocess.Popen([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={tmp_path}/d',
                             f'--init_from={uri}', '--eval_only=True', '--device=cpu'], cwd=ROOT,
                            env=script_env(dict(env, TRM_HUB_CACHE=str(cache), **hook)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    while not (part.exists() and part.stat().st_size >= 2 ** 21):
        assert time.time() < deadline + 120 and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    release.set()
    assert proc.returncode == 128 + signal.SIGINT and 'Traceback' not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and 'stopped by SIGINT' in err and 'resume' in err, err
    assert part.stat().st_size >= 2 ** 21


def test_what_is_missing_or_out_of_reach_is_one_line(hub, table_run, tmp_path, refused):
    publish_to(hub, table_run, '--private=False')
    for uri, words in (('hf://alice/trm-toy/toy/step_7', 'alice/trm-toy has no file toy/step_7 at revision main'),
                       ('hf://alice/trm-toy@v2/toy/step_6', "alice/trm-toy has no revision 'v2'"),
                       ('hf://bob/nothing/toy/step_6', 'no repository bob/nothing at http://127.0.0.1:'),
                       ('hf://alice/step_6', 'a hub checkpoint is hf://OWNER/REPO/PATH/step_<N>')):
        assert_user_error(evaluate(hub, table_run, tmp_path / 'o', uri, check=False), f'init_from={uri}', words)
    p = evaluate(hub, table_run, tmp_path / 'o', 'hf://alice/trm-toy/toy/step_6', check=False,
                 env=dict(HF_ENDPOINT=refused))
    assert_user_error(p, f'cannot reach {refused}', 'toy/step_6 is not cached in', 'check the network')
    # offline by choice: nothing was asked of the hub, and the network is not what to check
    p = evaluate(hub, table_run, tmp_path / 'o', 'hf://alice/trm-toy/toy/step_6', check=False,
                 env=dict(HF_HUB_OFFLINE='1'))
    said = assert_user_error(p, 'HF_HUB_OFFLINE is set', 'toy/step_6 is not cached in', 'unset HF_HUB_OFFLINE',
                             one_line=True)
    assert 'cannot reach' not in said and 'check the network' not in said
    assert not gets('/cdn/')


def test_an_address_the_hub_cannot_have_is_one_line_and_nothing_is_asked_or_written(hub, table_run, tmp_path):
    """A repository id against the hub's naming rules (a space, a leading '-') or a path with a '..' part, in an
    hf:// address or in publish.py's --repo and --path_in_repo, is one line naming it, before the hub is asked or a
    file written (the client's validation ended in its traceback; a '..' was resolved away by the HTTP client into
    another request: "no revision 'main'"). An upload with HF_HUB_OFFLINE set says so, not "cannot reach"."""
    publish_to(hub, table_run, '--private=False')
    asked = len(FakeHub.log)
    for uri, words in (('hf://alice/trm toy/toy/step_6', "'alice/trm toy' is not a repository id"),
                       ('hf://-alice/trm-toy/toy/step_6', "'-alice/trm-toy' is not a repository id"),
                       ('hf://alice/trm-toy@main/../toy/step_6', "'../toy/step_6' has a '..' part")):
        assert_user_error(evaluate(hub, table_run, tmp_path / 'o', uri, check=False), f'init_from={uri}', words,
                          one_line=True)
    for flag, words in (('--repo=alice/trm toy', "'alice/trm toy' is not a repository id"),
                        ('--path_in_repo=../toy', "'../toy' has a '..' part")):
        p = publish_to(hub, table_run, f'--out_dir={tmp_path}/pub', flag, check=False)
        assert_user_error(p, words, one_line=True)
        assert not (tmp_path / 'pub').exists()
    assert len(FakeHub.log) == asked
    # HF_HUB_OFFLINE set (a cluster's profile): an upload is not a network to check
    p = publish_to(dict(hub, HF_HUB_OFFLINE='1'), table_run, f'--out_dir={tmp_path}/pub', check=False)
    said = assert_user_error(p, 'HF_HUB_OFFLINE is set', 'alice/trm-toy', one_line=True)
    assert 'cannot reach' not in said and not (tmp_path / 'pub').exists() and len(FakeHub.log) == asked


@pytest.mark.parametrize('path_in_repo', ['.git', '.cache', 'runs/.git/toy', '.cache/toy'])
def test_a_path_in_repo_in_a_folder_the_hub_keeps_is_one_line_before_anything_is_written(hub, table_run, tmp_path,
                                                                                        path_in_repo):
    """The hub takes no file under .git/ or .cache/ (its client refuses them with a traceback, once the local
    files were written): --path_in_repo there is one line naming it, and nothing is written or asked."""
    p = publish_to(hub, table_run, f'--out_dir={tmp_path}/pub', f'--path_in_repo={path_in_repo}', check=False)
    assert_user_error(p, f"path_in_repo={path_in_repo!r}", "'.git'", "'.cache'", one_line=True)
    assert not (tmp_path / 'pub').exists() and not FakeHub.log


def test_a_missing_hub_package_is_one_line_naming_the_install(hub, table_run, tmp_path):
    # a TPU VM whose pip line installed torch, torch_xla and a few more, not requirements.txt
    def without(*modules):
        return site_hook(tmp_path / '_'.join(modules), ''.join(f'sys.modules[{m!r}] = None\n' for m in modules))
    uri = 'hf://alice/trm-toy/toy/step_6'
    for module, package in (('huggingface_hub', 'huggingface_hub'), ('yaml', 'PyYAML')):
        p = evaluate(hub, table_run, tmp_path / 'o', uri, check=False, env=without(module))
        assert_user_error(p, f'{uri} needs the {package} package', 'pip install -r requirements.txt', one_line=True)
    p = run(['publish.py', f"--init_from={table_run['ckpt']}", '--repo=alice/trm-toy', '--path_in_repo=toy'],
            env=dict(hub, HF_TOKEN=TOKEN, **without('yaml')), check=False)
    assert_user_error(p, 'needs the PyYAML package', 'pip install -r requirements.txt', one_line=True)
    assert not FakeHub.repos


def test_a_model_config_the_hub_did_not_answer_for_is_not_taken_for_none(hub, table_run, tmp_path, refused):
    """all_config.yaml gives the model keys of the checkpoint beside it: where the hub does not answer for it (a
    server error, out of reach, HF_HUB_OFFLINE) and no copy is cached, the run stops in one line naming it, not
    builds the model from this run's keys as for a repository without one (here H_cycles=3 against the
    published 2 would run unnoticed). A repository that has none is said so, online and from the cache."""
    publish_to(hub, table_run, '--private=False')
    uri = 'hf://alice/trm-toy/toy/step_6'
    typed = [a for a in MODEL_FLAGS if not a.startswith('--H_cycles')] + ['--H_cycles=3']
    FakeHub.unavailable.add('toy/all_config.yaml')
    for env in ({}, dict(HF_ENDPOINT=refused), dict(HF_HUB_OFFLINE='1')):  # the step file cached after the first
        p = evaluate(hub, table_run, tmp_path / 'a', uri, *typed, check=False, env=env)
        assert_user_error(p, f'init_from={uri}', 'toy/all_config.yaml', 'is not cached', one_line=True)
    FakeHub.unavailable.clear()
    assert_user_error(evaluate(hub, table_run, tmp_path / 'a', uri, *typed, check=False),
                      'H_cycles=3 (--H_cycles=3) but the published run has H_cycles=2', one_line=True)

    repo = FakeHub.repos['alice/trm-toy']
    files = {k: v for k, v in repo['commits'][repo['branches']['main']].items() if k != 'toy/all_config.yaml'}
    repo['commits']['b' * 40] = files
    bare = f"hf://alice/trm-toy@{'b' * 40}/toy/step_6"
    for env in ({}, dict(HF_ENDPOINT=refused)):
        p = evaluate(hub, table_run, tmp_path / 'b', bare, *MODEL_FLAGS, env=env)
        assert 'no all_config.yaml beside it in the repository' in p.stdout and eval_lines(p.stdout)


def test_a_private_repository_needs_the_token(hub, table_run, tmp_path):
    assert_user_error(publish_to(hub, table_run, token=None, check=False), 'upload to alice/trm-toy',
                      'HTTP 401', 'set HF_TOKEN to a token with write access')
    publish_to(hub, table_run)
    uri = 'hf://alice/trm-toy/toy/step_6'
    assert_user_error(evaluate(hub, table_run, tmp_path / 'a', uri, check=False),
                      'no repository alice/trm-toy', 'set HF_TOKEN')
    assert eval_lines(evaluate(hub, table_run, tmp_path / 'b', uri, env=dict(HF_TOKEN=TOKEN)).stdout)


def test_a_publish_into_a_hub_folder_of_another_run_s_steps_is_refused(hub, table_run, tmp_path):
    """One all_config.yaml answers for every step_<N> beside it, on the hub as in a local folder: a checkpoint of
    another run (here L_cycles 3, which changes no weight's shape) committed into a path_in_repo that holds a run's
    steps would make them load with its values. Refused in one line, nothing committed; another path takes it."""
    import torch
    publish_to(hub, table_run)
    first = FakeHub.repos['alice/trm-toy']['branches']['main']
    ckpt = torch.load(table_run['ckpt'], weights_only=True)
    ckpt['config']['L_cycles'] = 3
    torch.save(ckpt, tmp_path / 'other.pt')
    other = dict(ckpt=str(tmp_path / 'other.pt'))
    p = publish_to(hub, other, f'--out_dir={tmp_path}/pub', check=False)
    assert_user_error(p, 'alice/trm-toy', 'toy/', 'arch.L_cycles=2', 'arch.L_cycles=3', '--path_in_repo',
                      'nothing was committed', one_line=True)
    assert FakeHub.repos['alice/trm-toy']['branches']['main'] == first
    publish_to(hub, other, f'--out_dir={tmp_path}/pub', '--path_in_repo=toy3')
    assert 'toy3/all_config.yaml' in FakeHub.repos['alice/trm-toy']['commits'][
        FakeHub.repos['alice/trm-toy']['branches']['main']]


def test_solve_takes_a_hub_checkpoint(hub, table_run, tmp_path):
    """solve.py resolves hf:// the same way (here its dataset is not one solve.py knows: it says so after
    loading the layout's keys and data_path)."""
    publish_to(hub, table_run)
    p = run(['solve.py', '--init_from=hf://alice/trm-toy/toy/step_6', '--index=0'], env=dict(hub, HF_TOKEN=TOKEN),
            check=False)
    assert 'init_from=hf://alice/trm-toy/toy/step_6: a checkpoint in the reference' in p.stdout
    assert_user_error(p, f"dataset {table_run['data']} holds no puzzle kind that solve.py knows")


def test_a_resume_with_checkpoints_of_its_own_needs_not_the_published_file(hub, table_run, tmp_path):
    """init_from=resume:hf://... resumes out_dir's own checkpoints where it holds any, as resume:FILE does without
    FILE (startup.init_from_problems): the published file was fetched first all the same, so a run whose hub cache
    is gone (a cleared cache, another machine's) stopped offline or with the hub out of reach ("not cached"), and
    in reach downloaded the whole file for nothing. The resume is the one it would have been with the file here."""
    import shutil
    import torch
    publish_to(hub, table_run, '--private=False')
    uri = 'hf://alice/trm-toy/toy/step_6'
    untyped = [a for a in TABLE_ARGS if a not in MODEL_FLAGS]  # the model keys: all_config's, then the run's
    train(table_run['data'], tmp_path / 'a', f'--init_from=resume:{uri}', '--max_steps=2', args=untyped, env=hub)
    shutil.copytree(tmp_path / 'a', tmp_path / 'b')
    started = torch.load(tmp_path / 'b' / 'ckpt_00000002.pt', weights_only=True)['config']['init_from']
    train(table_run['data'], tmp_path / 'a', f'--init_from=resume:{uri}', '--max_steps=4', args=untyped, env=hub)
    shutil.rmtree(hub['TRM_HUB_CACHE'])
    fetched = len(gets('/cdn/'))
    # the same command less --data_path, which the first start took from all_config.yaml where it was not given
    p = run(['train.py', f"--out_dir={tmp_path / 'b'}", f'--init_from=resume:{uri}', '--max_steps=4', *untyped],
            env=dict(hub, HF_HUB_OFFLINE='1'), check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert 'hidden_size=32' in p.stdout and f"data_path='{table_run['data']}'" in p.stdout
    assert len(gets('/cdn/')) == fetched
    a, b = (torch.load(tmp_path / r / 'ckpt_00000004.pt', weights_only=True) for r in 'ab')
    assert all(torch.equal(a['model'][k], v) for k, v in b['model'].items()) and a['step'] == b['step'] == 4
    assert a['config']['init_from'] == b['config']['init_from'] == started  # its commit, for publish.py


def test_a_run_started_from_the_hub_publishes_the_hub_address_it_started_from(hub, table_run, tmp_path):
    # all_config.yaml's load_checkpoint is shared with the weights: the portable hf:// address (at the commit the
    # run started from), never the publisher's cache path
    publish_to(hub, table_run)
    commit = FakeHub.repos['alice/trm-toy']['branches']['main']
    train(table_run['data'], tmp_path / 'ft', '--init_from=hf://alice/trm-toy/toy/step_6', '--max_steps=2',
          args=TABLE_ARGS, env=dict(hub, HF_TOKEN=TOKEN))
    run(['publish.py', f"--init_from={tmp_path / 'ft' / 'ckpt_00000002.pt'}", f'--out_dir={tmp_path}/pub'])
    config = open(tmp_path / 'pub' / 'all_config.yaml').read()
    assert f'load_checkpoint: hf://alice/trm-toy@{commit}/toy/step_6\n' in config, config


def test_a_run_whose_folder_was_renamed_publishes_its_later_steps_beside_its_earlier_ones(hub, table_run, tmp_path):
    """What makes a run the same run is what it carries (its run id), not its folder's name: a run whose folder
    was tidied (renamed, then resumed there) publishes its later step into the hub path and the local folder its
    earlier step went to; all_config.yaml's run_name takes the new folder's name, said."""
    import shutil
    publish_to(hub, table_run)  # step_6 to toy/ and to published/ beside the run, as the run 'run'
    tidy = tmp_path / 'sudoku-tidy'
    shutil.copytree(os.path.dirname(table_run['ckpt']), tidy)
    train(table_run['data'], tidy, '--init_from=resume', '--max_steps=8', args=TABLE_ARGS)
    p = publish_to(hub, dict(ckpt=str(tidy / 'ckpt_00000008.pt')))
    assert sorted(os.listdir(tidy / 'published')) == ['all_config.yaml', 'step_6', 'step_8']
    assert "run_name 'run" in p.stdout and 'sudoku-tidy' in p.stdout
    files = FakeHub.repos['alice/trm-toy']['commits'][FakeHub.repos['alice/trm-toy']['branches']['main']]
    assert {'toy/step_6', 'toy/step_8'} <= set(files)


def test_a_run_name_of_an_earlier_publish_ending_in_a_word_of_8_letters_is_no_run_id(hub, table_run, tmp_path):
    """An earlier publish.py wrote run_name without the run id: 'sudoku baseline' ends in a word shaped like one,
    yet it is the name of this run, whose later publishes go beside its steps (on the hub and in the local folder).
    A run of another id is still refused there."""
    import torch
    import yaml
    from huggingface_hub import CommitOperationAdd, HfApi
    ckpt = torch.load(table_run['ckpt'], weights_only=True)
    ckpt['config']['wandb_run_name'] = 'sudoku baseline'
    torch.save(ckpt, tmp_path / 'sb.pt')
    ours, pub = dict(ckpt=str(tmp_path / 'sb.pt')), tmp_path / 'pub'
    publish_to(hub, ours, f'--out_dir={pub}')
    config = yaml.safe_load(open(pub / 'all_config.yaml'))
    assert config['run_name'] == f"sudoku baseline {ckpt['run_id']}", config['run_name']
    config['run_name'] = 'sudoku baseline'  # as an earlier publish.py wrote it, here and on the hub
    with open(pub / 'all_config.yaml', 'w') as f:
        yaml.safe_dump(config, f)
    HfApi(endpoint=hub['HF_ENDPOINT'], token=TOKEN).create_commit(
        'alice/trm-toy', [CommitOperationAdd('toy/all_config.yaml', str(pub / 'all_config.yaml'))],
        commit_message='earlier')
    publish_to(hub, ours, f'--out_dir={tmp_path}/fresh')  # the hub's check alone
    p = publish_to(hub, ours, f'--out_dir={pub}')  # the local folder's
    assert "run_name 'sudoku baseline' -> 'sudoku baseline " in p.stdout, p.stdout[-3000:]
    assert yaml.safe_load(open(pub / 'all_config.yaml'))['run_name'] == f"sudoku baseline {ckpt['run_id']}"
    ckpt['run_id'] = 'feedbeef' if ckpt['run_id'] != 'feedbeef' else 'deadbeef'
    torch.save(ckpt, tmp_path / 'other.pt')
    p = publish_to(hub, dict(ckpt=str(tmp_path / 'other.pt')), f'--out_dir={tmp_path}/other', check=False)
    assert_user_error(p, 'alice/trm-toy', 'toy/', f"run_name='sudoku baseline {ckpt['run_id']}'",
                      'nothing was committed', one_line=True)


def test_a_publish_to_a_branch_the_hub_lacks_creates_nothing(hub, table_run):
    """A branch that does not exist is refused in one line naming it before anything is made: no repository left
    behind, empty, by a commit that could not go in."""
    p = publish_to(hub, table_run, '--revision=exp/v1', check=False)
    assert_user_error(p, 'alice/trm-toy', "'exp/v1'", 'nothing was committed', one_line=True)
    assert 'alice/trm-toy' not in FakeHub.repos
    publish_to(hub, table_run)  # main, then a branch of it the hub has not got
    first = FakeHub.repos['alice/trm-toy']['branches']['main']
    p = publish_to(hub, table_run, '--revision=exp/v1', check=False)
    assert_user_error(p, 'alice/trm-toy', "'exp/v1'", 'nothing was committed', one_line=True)
    assert FakeHub.repos['alice/trm-toy']['branches'] == dict(main=first)


def test_ctrl_c_in_a_publish_is_one_line_and_the_same_command_then_publishes(hub, table_run, tmp_path):
    """Ctrl-C while the layout is written (the signal sent from inside it, as all_config.yaml is written) or while
    the hub is uploaded to (the hub holding its answer): one line, a SIGINT's exit code, no half-written folder and
    no commit; the same command then publishes. (SIGINT as a terminal gives it: a runner in the background may pass
    it on ignored.)"""
    pub = tmp_path / 'pub'
    cmd = [sys.executable, 'publish.py', f"--init_from={table_run['ckpt']}", f'--out_dir={pub}',
           '--repo=alice/trm-toy', '--path_in_repo=toy']
    interrupt = 'signal.signal(signal.SIGINT, signal.default_int_handler)\n'
    in_export = site_hook(tmp_path / 'hook1', interrupt + 'import yaml\n_dump = yaml.safe_dump\n'
                          'def safe_dump(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n'
                          '    return _dump(*a, **k)\n'
                          'yaml.safe_dump = safe_dump\n')
    p = subprocess.run(cmd, cwd=ROOT, env=script_env(dict(hub, HF_TOKEN=TOKEN, **in_export)), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 128 + signal.SIGINT and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert len(p.stderr.strip().splitlines()) == 1 and 'stopped by SIGINT' in p.stderr, p.stderr
    assert not pub.exists() and not FakeHub.repos

    held = '/api/models/alice/trm-toy/preupload/main'
    release = FakeHub.stall[held] = threading.Event()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env(dict(hub, HF_TOKEN=TOKEN, **site_hook(tmp_path / 'hook2',
                            interrupt))), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while ('POST', held, None) not in FakeHub.log:
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    release.set()
    assert proc.returncode == 128 + signal.SIGINT and 'Traceback' not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and 'stopped by SIGINT' in err and 'alice/trm-toy' in err, err
    repo = FakeHub.repos['alice/trm-toy']
    assert repo['commits'][repo['branches']['main']] == {} and sorted(os.listdir(pub)) == [
        'all_config.yaml', "step_6"]

    p = run(cmd[1:], env=dict(hub, HF_TOKEN=TOKEN))
    assert "toy/step_6" in repo['commits'][repo['branches']['main']], p.stdout


def test_a_corrupt_cached_copy_is_fetched_again_never_used(hub, table_run, tmp_path, refused):
    """A cached copy whose bytes differ from the sha256 the hub announces for its LFS file (a bit flipped on disk,
    a copy written over by hand), the size unchanged: online, it is fetched again, said in one line; out of reach
    or offline, the run stops in one line naming the file, never loads other weights as the published ones. A copy
    pinned to a commit (which asks the hub nothing) is checked against the sha256 the download recorded."""
    publish_to(hub, table_run, '--private=False')
    commit = FakeHub.repos['alice/trm-toy']['branches']['main']
    uri, pinned = 'hf://alice/trm-toy/toy/step_6', f'hf://alice/trm-toy@{commit}/toy/step_6'
    good = evaluate(hub, table_run, tmp_path / 'a', uri)
    cached = os.path.join(hub['TRM_HUB_CACHE'], 'alice--trm-toy', commit, 'toy', 'step_6')
    whole = open(cached, 'rb').read()

    def corrupt():  # the same size: bytes of the weights (the file's last 1000 are the zip's directory) flipped
        with open(cached, 'r+b') as f:
            f.seek(len(whole) - 3000)
            f.write(bytes(b ^ 0xFF for b in whole[-3000:-2000]))
    for env in (dict(HF_ENDPOINT=refused), dict(HF_HUB_OFFLINE='1')):
        with open(cached, 'wb') as f:
            f.write(whole)
        p = evaluate(hub, table_run, tmp_path / 'b', uri, env=env)  # the good copy: used, said
        assert 'warning: ' in p.stdout and eval_lines(p.stdout) == eval_lines(good.stdout)
        corrupt()
        p = evaluate(hub, table_run, tmp_path / 'b', uri, check=False, env=env)
        assert_user_error(p, cached, 'sha256', one_line=True)
    corrupt()
    assert_user_error(evaluate(hub, table_run, tmp_path / 'b', pinned, check=False, env=dict(HF_HUB_OFFLINE='1')),
                      cached, 'sha256', one_line=True)
    p = evaluate(hub, table_run, tmp_path / 'c', uri)
    assert 'sha256' in p.stdout and 'downloading' in p.stdout and len(gets('/cdn/')) == 2
    assert open(cached, 'rb').read() == whole and eval_lines(p.stdout) == eval_lines(good.stdout)
    corrupt()
    p = evaluate(hub, table_run, tmp_path / 'd', pinned)
    assert 'sha256' in p.stdout and len(gets('/cdn/')) == 3 and eval_lines(p.stdout) == eval_lines(good.stdout)
    # an interrupted download whose kept bytes were damaged since: resumed, found wrong, fetched from the start
    os.remove(cached)
    with open(cached + '.incomplete', 'wb') as f:
        f.write(bytes(b ^ 0xFF for b in whole[:len(whole) // 2]))
    p = evaluate(hub, table_run, tmp_path / 'e', uri)
    assert 'resuming after' in p.stdout and 'again from the start' in p.stdout and len(gets('/cdn/')) == 5
    assert open(cached, 'rb').read() == whole and eval_lines(p.stdout) == eval_lines(good.stdout)


@pytest.mark.parametrize('record', [b'', b'abc\n', b'\xff' * 64], ids=['empty', 'cut', 'garbled'])
def test_a_damaged_sha256_record_is_no_record_and_a_wrong_one_is_a_corrupt_copy(tmp_path, record):
    """The sha256 recorded beside a cached copy, cut to nothing or garbled (a crash while it was written, a
    damaged disk), made an offline run refuse the good copy as corrupt; it is read as no record (nothing to tell),
    while a well-formed record the copy does not match still is a corrupt copy."""
    from runkeep.hub import corrupt
    path = tmp_path / 'step_6'
    path.write_bytes(b'weights')
    (tmp_path / 'step_6.sha256').write_bytes(record)
    assert corrupt(str(path)) is None
    (tmp_path / 'step_6.sha256').write_text(hashlib.sha256(b'other').hexdigest())
    assert 'it is corrupt' in corrupt(str(path))
