"""
gcs.py against a real GCS emulator server (gcp-storage-emulator, on 127.0.0.1 only): paths, round trips,
pagination and a lost upload reply (through a proxy), md5 checks, delete, errors, the background uploader,
and training to a bucket then resuming from it on a "new machine" (after a kill too), a divergence's checkpoints in
the bucket, reachable or not, and what an upload outage at a run's end left only local sent by its rerun.
    python -m pytest -q tests/test_gcs.py
"""
import json
import os
import re
import shutil
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

from runkeep import checkpoint
from runkeep import credentials
from runkeep import gcs
from conftest import BUCKET, TOY_ARGS, assert_user_error, ckpts, make_reverse_dataset, run, site_hook
from test_checkpoints import NAN_AT_STEP_9


class Proxy:
    """A real HTTP proxy in front of the emulator adding what the emulator lacks: list pagination
    (it ignores maxResults) and, on request, losing the reply to one resumable upload chunk, an outage of
    uploads (every resumable upload answers 503 from the first of a checkpoint of a given step or later on, while
    `refusing`), or of the downloads of the objects whose names hold `fail_downloads`."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.list_pages = 0
        self.drop_reply_at = None  # byte offset of the chunk whose reply is replaced by a 503
        self.corrupt_uploads = False  # flip the first byte of every upload chunk in transit
        self.dropped = 0
        self.outage_from_step, self.refusing = None, False
        self.refused = 0  # uploads refused so far
        self.started = []  # the object names of the uploads asked to start (refused too), in order
        self.fail_downloads = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.handle(self)
            do_PUT = do_POST = do_DELETE = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, h):
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        # Host is passed on so the emulator's upload session URLs point back at the proxy
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "content-length")}
        url = urlsplit(h.path)
        query = parse_qs(url.query)
        if self.corrupt_uploads and h.command == "PUT" and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        starts_upload = h.command == "POST" and query.get("uploadType") == ["resumable"]
        if starts_upload:
            self.started.append(json.loads(body)["name"])
            step = re.search(r'ckpt_(\d+)\.pt$', self.started[-1])
            if self.outage_from_step is not None and step and int(step.group(1)) >= self.outage_from_step:
                self.refusing = True
        if h.command == "GET" and url.path.endswith("/o") and "maxResults" in query:
            status, resp_headers, content = self.paginate(url.path, query)
        elif starts_upload and self.refusing or \
                self.fail_downloads and query.get("alt") == ["media"] and self.fail_downloads in h.path:
            status, resp_headers, content = 503, {}, b""
            self.refused += starts_upload
        else:
            r = requests.request(h.command, self.upstream + h.path, data=body, headers=headers,
                                 allow_redirects=False, timeout=10)
            status, resp_headers, content = r.status_code, r.headers, r.content
            if h.command == "PUT" and self.drop_reply_at is not None and \
                    h.headers.get("Content-Range", "").startswith(f"bytes {self.drop_reply_at}-"):
                # the emulator stored the chunk, but the client sees a failure: it must ask
                # where to resume instead of resending or skipping bytes
                self.drop_reply_at = None
                self.dropped += 1
                status, resp_headers, content = 503, {}, b""
        h.send_response(status)
        for k, v in resp_headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(content)))
        h.end_headers()
        h.wfile.write(content)

    def paginate(self, path, query):
        params = {k: v[0] for k, v in query.items() if k not in ("maxResults", "pageToken")}
        items = requests.get(self.upstream + path, params=params, timeout=10).json().get("items") or []
        n, start = int(query["maxResults"][0]), int(query.get("pageToken", ["0"])[0])
        page = {"items": items[start:start + n]}
        if start + n < len(items):
            page["nextPageToken"] = str(start + n)
        self.list_pages += 1
        return 200, {"Content-Type": "application/json"}, json.dumps(page).encode()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(emulator):
    p = Proxy(emulator)
    yield p
    p.close()


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _until(done, seconds=60):
    """Whether done() came true within `seconds`."""
    end = time.time() + seconds
    while not done() and time.time() < end:
        time.sleep(0.01)
    return done()

# -----------------------------------------------------------------------------
# the client

def test_paths():
    assert gcs.is_gcs("gs://b/x") and not gcs.is_gcs("/tmp/x") and not gcs.is_gcs(None)
    assert gcs.split_gcs("gs://b/run 1/ckpt.pt") == ("b", "run 1/ckpt.pt")
    assert gcs.split_gcs("gs://b") == ("b", "")
    assert gcs.split_gcs("gs://b/") == ("b", "")
    for bad in ("gs://", "/local/path", "s3://b/x"):
        with pytest.raises(ValueError):
            gcs.split_gcs(bad)
    # the JSON API needs '/' inside an object name escaped (the emulator accepts it raw, so check the URL)
    url = gcs.GCS(endpoint="http://127.0.0.1:1")._object_url("b", "run 1/ckpt #1?.pt", alt="media")
    assert url == "http://127.0.0.1:1/storage/v1/b/b/o/run%201%2Fckpt%20%231%3F.pt?alt=media"


def test_no_token_with_emulator(emu):
    assert credentials.get_token() is None


def test_roundtrip(emu, tmp_path):
    # 256 KiB chunks so the 3 MB file takes the multi-chunk resumable path
    client = gcs.GCS(chunk_size=256 * 1024)
    files = {
        "rt/run 1/sub dir/ckpt #1+x?&=%.pt": os.urandom(3 * 1024 * 1024 + 123),
        "rt/run 1/état.json": "{\"step\": 1}".encode(),
        "rt/empty.bin": b"",
    }
    for name, data in files.items():
        client.upload(_write(tmp_path / "up" / "f", data), f"gs://{BUCKET}/{name}")
    # the module-level helper works too, and re-uploading replaces the object
    gcs.upload_file(_write(tmp_path / "up" / "g", b"v2"), f"gs://{BUCKET}/rt/empty.bin")
    files["rt/empty.bin"] = b"v2"

    listed = gcs.list_objects(f"gs://{BUCKET}/rt/")
    assert sorted(listed) == sorted((f"gs://{BUCKET}/{n}", len(d)) for n, d in files.items())
    odd = "rt/run 1/sub dir/ckpt #1+x?&=%.pt"
    assert gcs.list_objects(f"gs://{BUCKET}/rt/run 1/sub") == [(f"gs://{BUCKET}/{odd}", len(files[odd]))]
    for i, (uri, _) in enumerate(listed):
        dst = tmp_path / "down" / f"{i}" / "file.pt"  # parent dirs are created
        assert gcs.download_file(uri, str(dst)) == str(dst)
        assert _read(dst) == files[gcs.split_gcs(uri)[1]]
        assert gcs.object_exists(uri)
    assert not [p for p in (tmp_path / "down").rglob("*.part")]  # temp files renamed away


def test_list_pagination(emu, proxy, tmp_path):
    src = _write(tmp_path / "f", b"x")
    names = [f"page/obj {i:02d}" for i in range(7)]
    for n in names:
        gcs.upload_file(src, f"gs://{BUCKET}/{n}")
    want = [(f"gs://{BUCKET}/{n}", 1) for n in names]
    assert gcs.GCS(endpoint=proxy.url).list(f"gs://{BUCKET}/page/", max_results=3) == want
    assert proxy.list_pages == 3  # 3 + 3 + 1, following nextPageToken
    assert gcs.GCS().list(f"gs://{BUCKET}/page/", max_results=3) == want  # straight to the emulator


def test_upload_resumes_after_lost_reply(emu, proxy, tmp_path):
    data = os.urandom(1024 * 1024 + 7)
    proxy.drop_reply_at = 256 * 1024  # the second chunk
    client = gcs.GCS(endpoint=proxy.url, chunk_size=256 * 1024, backoff=0.01)
    client.upload(_write(tmp_path / "f", data), f"gs://{BUCKET}/resume/ckpt.pt")
    assert proxy.dropped == 1
    client.download(f"gs://{BUCKET}/resume/ckpt.pt", str(tmp_path / "back"))
    assert _read(tmp_path / "back") == data


def test_corrupted_upload_is_rejected(emu, proxy, tmp_path):
    # gcs.py sends the file's md5 up front, so GCS refuses to create an object from bad bytes
    proxy.corrupt_uploads = True
    uri = f"gs://{BUCKET}/corrupt/ckpt.pt"
    with pytest.raises(gcs.GCSError, match="corrupt/ckpt.pt.*400"):
        gcs.GCS(endpoint=proxy.url).upload(_write(tmp_path / "f", os.urandom(1000)), uri)
    assert not gcs.object_exists(uri)


def test_delete(emu, tmp_path):
    uri = f"gs://{BUCKET}/del/ckpt.pt"
    gcs.upload_file(_write(tmp_path / "f", b"abc"), uri)
    assert gcs.object_exists(uri)
    assert gcs.delete_object(uri) is True
    assert not gcs.object_exists(uri)
    assert gcs.list_objects(f"gs://{BUCKET}/del/") == []
    assert gcs.delete_object(uri) is False  # already gone is not an error (idempotent retries)
    with pytest.raises(gcs.NotFoundError):
        gcs.GCS().delete(uri, missing_ok=False)


def test_download_missing_names_object(emu, tmp_path):
    uri = f"gs://{BUCKET}/nope/missing ckpt.pt"
    with pytest.raises(gcs.NotFoundError, match="missing ckpt.pt.*404") as exc:
        gcs.download_file(uri, str(tmp_path / "out.pt"))
    assert isinstance(exc.value, FileNotFoundError) and exc.value.status == 404
    assert os.listdir(tmp_path) == []  # neither the target nor a temp file left behind


def test_client_error_fails_fast(emu, tmp_path):
    client = gcs.GCS(retries=1, backoff=64.0, max_backoff=64.0)  # a retry would wait >= 32 s
    t0 = time.time()
    with pytest.raises(gcs.GCSError, match="gs://no-such-bucket/x.pt.*404"):
        client.upload(_write(tmp_path / "f", b"x"), "gs://no-such-bucket/x.pt")
    assert time.time() - t0 < 16


def test_uploader_background(emu, tmp_path):
    done = []
    up = gcs.Uploader(on_success=lambda local, uri: done.append(uri))
    uris = [f"gs://{BUCKET}/bg/ckpt_{i}.pt" for i in range(3)]
    for i, uri in enumerate(uris):
        up.submit(_write(tmp_path / f"c{i}", os.urandom(200_000)), uri)
    assert up.wait(timeout=30)
    assert up.failures == 0 and done == uris  # one thread: uploads finish in submit order
    assert [u for u, _ in gcs.list_objects(f"gs://{BUCKET}/bg/")] == uris
    assert up.wait(timeout=0)  # nothing pending: returns at once


def test_uploader_unreachable_logs_and_counts(tmp_path, capfd):
    # autouse fixture: STORAGE_EMULATOR_HOST is a closed 127.0.0.1 port -> connection refused
    done = []
    up = gcs.Uploader(client=gcs.GCS(retries=2, backoff=2.0), on_success=lambda *a: done.append(a))  # >= 3 s
    up.submit(_write(tmp_path / "f", b"x"), f"gs://{BUCKET}/unreachable/ckpt.pt")
    assert not up.wait(timeout=0)  # submit returned with its upload still under way: it does not block on it
    assert up.wait(timeout=60)
    assert up.failures == 1 and done == []
    err = capfd.readouterr().err
    assert "gs://test-bucket/unreachable/ckpt.pt" in err and "failed" in err


def test_uploader_says_an_outage_once_and_forgets_failures_a_newer_upload_replaced(emulator, tmp_path, capfd):
    # credentials refused mid-run (every upload fails at once), then working again: one line when the failures
    # begin, one when an upload works again, and what the end names as only local is what the bucket lacks
    from conftest import free_port
    client = gcs.GCS(endpoint=f"http://127.0.0.1:{free_port()}", retries=0)  # nothing listens: each upload fails
    up = gcs.Uploader(client=client)
    log, ckpt = f"gs://{BUCKET}/outage/train.log", f"gs://{BUCKET}/outage/ckpt_00000002.pt"
    for i, uri in enumerate([ckpt, log, log]):
        up.submit(_write(tmp_path / f"f{i}", b"x" * (i + 1)), uri)
    assert up.wait(timeout=30) and up.failures == 3
    assert len(capfd.readouterr().err.splitlines()) == 1
    client.endpoint = emulator
    up.submit(_write(tmp_path / "f3", b"newest"), log)
    assert up.wait(timeout=30)
    assert "work again" in capfd.readouterr().err
    assert [uri for _, uri in up.failed] == [ckpt]  # train.log's newest copy is in the bucket


def test_an_upload_retried_through_an_outage_ends_once_its_file_is_pruned(emu, proxy, tmp_path, capfd):
    # a checkpoint's upload under way when the bucket stops answering, its file pruned meanwhile (newer ones replace
    # it): its retries end, so once the bucket answers it is not sent ahead of the newer one, nor said as failed
    out = f'gs://{BUCKET}/pruned'
    up = gcs.Uploader(client=gcs.GCS(endpoint=proxy.url, retries=10 ** 6, backoff=0.01, max_backoff=0.05))
    old = (_write(tmp_path / 'ckpt_00000002.pt', b'2'), f'{out}/ckpt_00000002.pt')
    proxy.refusing = True
    up.submit(*old)
    assert _until(lambda: proxy.refused)
    os.remove(old[0])
    refused = proxy.refused  # one more try after the prune, or the end of the retries
    assert _until(lambda: proxy.refused > refused or old not in up.pending)
    up.submit(_write(tmp_path / 'ckpt_00000004.pt', b'4'), f'{out}/ckpt_00000004.pt')
    proxy.refusing = False
    assert up.wait(timeout=60) and up.failures == 0
    assert [u for u, _ in gcs.list_objects(f'{out}/')] == [f'{out}/ckpt_00000004.pt']
    assert 'failed' not in capfd.readouterr().err


def test_a_file_pruned_while_its_upload_waits_to_retry_gives_way_at_once(emu, proxy, tmp_path):
    # the prune lands while the retries of a pruned checkpoint wait (up to max_backoff, 32 s by default): the newer
    # checkpoint goes once the bucket answers, not after that wait, which a stop's bounded wait for the uploads
    # (or a VM lost meanwhile) would leave the bucket without it
    out = f'gs://{BUCKET}/pruned-waiting'
    up = gcs.Uploader(client=gcs.GCS(endpoint=proxy.url, backoff=600, max_backoff=600))
    old = _write(tmp_path / 'ckpt_00000002.pt', b'2')
    proxy.refusing = True
    up.submit(old, f'{out}/ckpt_00000002.pt')
    assert _until(lambda: proxy.refused)  # its first try refused: its retry waits 300 s or more
    os.remove(old)
    up.submit(_write(tmp_path / 'ckpt_00000004.pt', b'4'), f'{out}/ckpt_00000004.pt')
    proxy.refusing = False
    assert up.wait(timeout=60) and up.failures == 0
    assert [u for u, _ in gcs.list_objects(f'{out}/')] == [f'{out}/ckpt_00000004.pt']


def test_a_file_pruned_as_its_upload_opens_it_is_a_skip_not_a_failure(emu, tmp_path, capfd):
    # the prune (on the training thread) lands after the uploader saw the file and before the upload opened it
    class PrunedAtOpen(gcs.GCS):
        def upload(self, local_path, uri):
            os.remove(local_path)
            return super().upload(local_path, uri)
    out = f'gs://{BUCKET}/pruned-at-open'
    up = gcs.Uploader(client=PrunedAtOpen())
    up.submit(_write(tmp_path / 'ckpt_00000002.pt', b'2'), f'{out}/ckpt_00000002.pt')
    assert up.wait(timeout=60) and up.failures == 0 and up.unsaid == 0
    assert 'failed' not in capfd.readouterr().err and gcs.list_objects(f'{out}/') == []
    with pytest.raises(gcs.Gone, match=f'{tmp_path}/gone.pt'):  # so does a direct upload, a GCSError as any other
        gcs.upload_file(str(tmp_path / 'gone.pt'), f'{out}/gone.pt')


# -----------------------------------------------------------------------------
# checkpoint files, local and in a bucket

def test_checkpoint_files_locally_and_in_a_bucket(emu, tmp_path):
    import torch
    local = str(tmp_path / 'run')
    os.makedirs(local)
    for step in (2, 4, 6):
        checkpoint.save_atomic({'step': step, 'w': torch.full((3,), float(step))}, os.path.join(local, f'ckpt_{step:08d}.pt'))
    assert sorted(os.listdir(local)) == [f'ckpt_{s:08d}.pt' for s in (2, 4, 6)]  # no .tmp left behind
    _write(os.path.join(local, 'ckpt_00000008.pt.tmp'), b'half')  # an interrupted save: never listed
    _write(os.path.join(local, 'notes.pt'), b'x')
    ck = checkpoint.load_checkpoint(os.path.join(local, 'ckpt_00000004.pt'))
    assert ck['step'] == 4 and torch.equal(ck['w'], torch.full((3,), 4.0))
    assert checkpoint.list_checkpoints(local) == {s: os.path.join(local, f'ckpt_{s:08d}.pt') for s in (2, 4, 6)}
    remote = f'gs://{BUCKET}/ckpts/r1'
    for step, path in checkpoint.list_checkpoints(local).items():
        gcs.upload_file(path, f'{remote}/ckpt_{step:08d}.pt')
    gcs.upload_file(os.path.join(local, 'notes.pt'), f'{remote}/notes.pt')
    gcs.upload_file(os.path.join(local, 'notes.pt'), f'gs://{BUCKET}/ckpts/r10/ckpt_00000099.pt')  # another run
    assert checkpoint.list_checkpoints(remote) == {s: f'{remote}/ckpt_{s:08d}.pt' for s in (2, 4, 6)}
    # keep the newest keep_last_n plus the best, in both places
    for folder in (local, remote):
        checkpoint.prune_checkpoints(folder, keep_last_n=1, best_step=2)
        assert sorted(checkpoint.list_checkpoints(folder)) == [2, 6]
    assert gcs.object_exists(f'{remote}/notes.pt') and os.path.exists(os.path.join(local, 'notes.pt'))
    with open(os.path.join(local, 'bad.pt'), 'wb') as f:
        f.write(b'not a checkpoint')
    with pytest.raises(checkpoint.CheckpointError, match='bad.pt is corrupt or truncated'):
        checkpoint.load_checkpoint(os.path.join(local, 'bad.pt'))


# -----------------------------------------------------------------------------
# training to a bucket

def test_training_to_a_bucket_resumes_from_it(emu, toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/runs/r1', f'--local_dir={tmp_path}/local',
            '--epochs=1', '--eval_every_epochs=100', '--log_interval=2', '--checkpoint_interval=2', '--keep_last_n=2'] + TOY_ARGS
    env = dict(STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    run(args + ['--max_steps=6'], env=env)
    names = sorted(u for u, _ in gcs.list_objects(f'gs://{BUCKET}/runs/r1/ckpt_'))  # the run's records are there too
    assert names == [f'gs://{BUCKET}/runs/r1/ckpt_0000000{i}.pt' for i in (4, 6)]  # pruned to keep_last_n (+ best)
    # a new VM: nothing local; resume finds the newest complete checkpoint in the bucket
    shutil.rmtree(f'{tmp_path}/local')
    p = run(args + ['--max_steps=8', '--init_from=resume'], env=env)
    assert f'resuming from gs://{BUCKET}/runs/r1/ckpt_00000006.pt (step 6)' in p.stdout  # the bucket's copy
    assert 'step 8/' in p.stdout
    assert f'gs://{BUCKET}/runs/r1/ckpt_00000008.pt' in [u for u, _ in gcs.list_objects(f'gs://{BUCKET}/runs/r1/')]


def test_a_resume_onto_other_examples_in_a_bucket_names_the_gs_data_path_given(emu, toy, tmp_path):
    """A gs:// data_path is trained on from its copy in data_cache_dir: the refusal names the path the user gave
    (the cache's was one the user never typed, beside the checkpoint's gs:// one as if the two differed)."""
    data = f'gs://{BUCKET}/datasets/resumed-onto'
    gcs.upload_tree(toy, f'{data}/a')
    gcs.upload_tree(make_reverse_dataset(str(tmp_path / 'b'), seed=1), f'{data}/b')
    args = [f'--out_dir={tmp_path}/o', f'--data_cache_dir={tmp_path}/cache', '--epochs=1', '--eval_every_epochs=100',
            '--max_steps=2'] + TOY_ARGS
    env = dict(STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    run(['train.py', f'--data_path={data}/a'] + args, env=env)
    p = run(['train.py', f'--data_path={data}/b', '--init_from=resume', '--max_steps=4'] + args, env=env, check=False)
    said = assert_user_error(p, 'other examples', one_line=True)
    assert f'the dataset at {data}/b (its copy in ' in said and f"data_path was '{data}/a'" in said, said


def test_a_resume_onto_other_puzzle_identifiers_in_a_bucket_names_the_gs_data_path_given(emu, toy, tmp_path):
    """The same examples, other names in identifiers.json (a rebuild with another seed): the refusal names the
    gs:// path the user gave and its copy, as the refusals of other examples and of another shape do."""
    data = f'gs://{BUCKET}/datasets/renamed'
    for name, ids in (('a', ['<blank>', 'task0']), ('b', ['<blank>', 'task1'])):
        shutil.copytree(toy, tmp_path / name)
        json.dump(ids, open(tmp_path / name / 'identifiers.json', 'w'))
        gcs.upload_tree(str(tmp_path / name), f'{data}/{name}')
    args = [f'--out_dir={tmp_path}/o', f'--data_cache_dir={tmp_path}/cache', '--epochs=1', '--eval_every_epochs=100',
            '--max_steps=2'] + TOY_ARGS + ['--puzzle_emb_ndim=16']
    env = dict(STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    run(['train.py', f'--data_path={data}/a'] + args, env=env)
    p = run(['train.py', f'--data_path={data}/b', '--init_from=resume', '--max_steps=4'] + args, env=env, check=False)
    said = assert_user_error(p, 'other puzzle identifiers', one_line=True)
    assert f'the dataset {data}/b (its copy in ' in said, said
    p = run(['train.py', f'--data_path={data}/b', '--eval_only=True', f'--init_from={tmp_path}/o/ckpt_00000002.pt']
            + args, env=env, check=False)
    said = assert_user_error(p, 'other puzzle identifiers', one_line=True)
    assert f'the dataset {data}/b (its copy in ' in said, said


def test_failed_uploads_do_not_stop_training(toy, tmp_path):
    # the autouse fixture points STORAGE_EMULATOR_HOST at a closed port: every upload fails
    p = run(['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/down', f'--local_dir={tmp_path}/local',
             '--epochs=1', '--eval_every_epochs=100', '--log_interval=2', '--checkpoint_interval=2', '--max_steps=4',
             '--gcs_retries=2'] + TOY_ARGS)
    assert 'step 4/' in p.stdout and 'upload(s) to gs://test-bucket/down failed' in p.stdout
    # the first failure is logged with its object (train.log's at the start), the end names every file not sent
    assert 'to gs://test-bucket/down/train.log failed' in p.stderr, p.stderr[-3000:]
    assert re.search(r'failed; only in .*ckpt_00000002\.pt', p.stdout), p.stdout[-3000:]
    assert 'cannot list gs://test-bucket/down' in p.stdout  # the start-up check of the bucket says it could not look
    assert sorted(os.listdir(f'{tmp_path}/local')) == ['ckpt_00000002.pt', 'ckpt_00000004.pt', 'metrics.jsonl',
                                                        'results.json', 'tb', 'train.log']  # all stays local


@pytest.mark.parametrize('value', ['60s', '0', 'nan'])
def test_a_gcs_read_timeout_that_is_no_number_of_seconds_is_one_line(emu, toy, tmp_path, value):
    p = run(['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/rt', f'--local_dir={tmp_path}/local',
             '--max_steps=2'] + TOY_ARGS, check=False, env=dict(GCS_READ_TIMEOUT=value))
    assert_user_error(p, f'GCS_READ_TIMEOUT={value!r}', 'seconds', one_line=True)


def bucket_run(toy, out, local, *extra):
    return ['train.py', f'--data_path={toy}', f'--out_dir={out}', f'--local_dir={local}', '--epochs=1',
            '--eval_every_epochs=100'] + TOY_ARGS + list(extra)


def test_a_checkpoint_the_bucket_does_not_send_stops_the_resume_and_stays(emu, proxy, toy, tmp_path):
    # a new machine, and the download of the newest checkpoint fails (an outage): the file may be whole, so the resume
    # stops, rather than train its steps again from an older one whose first save would delete it from the bucket
    out, args = f'gs://{BUCKET}/runs/unsent', ['--log_interval=2', '--keep_last_n=2']
    run(bucket_run(toy, out, tmp_path / 'a', '--max_steps=4', '--checkpoint_interval=2', *args),
        env=dict(STORAGE_EMULATOR_HOST=emu.replace('http://', '')))
    proxy.fail_downloads = 'ckpt_00000004.pt'
    p = run(bucket_run(toy, out, tmp_path / 'b', '--max_steps=8', '--checkpoint_interval=3', '--gcs_retries=1',
                       '--init_from=resume', *args), env=dict(STORAGE_EMULATOR_HOST=proxy.url.replace('http://', '')),
            check=False)
    assert_user_error(p, f'{out}/ckpt_00000004.pt', 'HTTP 503')
    assert 'resuming from' not in p.stdout
    assert sorted(u for u, _ in gcs.list_objects(f'{out}/ckpt_')) == [f'{out}/ckpt_0000000{i}.pt' for i in (2, 4)]


def test_a_divergence_keeps_the_newest_checkpoint_known_to_train_on_in_the_bucket(emu, toy, tmp_path):
    out, local = f'gs://{BUCKET}/runs/nan', tmp_path / 'local'
    env = dict(site_hook(tmp_path / 'hook', NAN_AT_STEP_9), STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    p = run(bucket_run(toy, out, local, '--max_steps=16', '--log_interval=4', '--checkpoint_interval=4',
                       '--keep_last_n=1'), env=env, check=False)
    assert_user_error(p, 'loss became NaN or inf at step 9', f'Last good checkpoint: {local}/ckpt_00000004.pt')
    assert [u for u, _ in gcs.list_objects(f'{out}/ckpt_')] == [f'{out}/ckpt_00000004.pt']
    assert ckpts(local) == ['ckpt_00000004.pt']


def test_a_divergence_while_the_bucket_is_unreachable_is_its_one_line_and_a_warning(toy, tmp_path):
    # the autouse fixture points STORAGE_EMULATOR_HOST at a closed port: the bucket cannot be listed or changed
    out, local = f'gs://{BUCKET}/nan-down', tmp_path / 'local'
    p = run(bucket_run(toy, out, local, '--max_steps=16', '--log_interval=4', '--checkpoint_interval=4',
                       '--keep_last_n=1', '--gcs_retries=1'), env=site_hook(tmp_path / 'hook', NAN_AT_STEP_9),
            check=False)
    said = assert_user_error(p, 'loss became NaN or inf at step 9', f'Last good checkpoint: {local}/ckpt_00000004.pt')
    warning = [l for l in said.splitlines() if l.startswith('warning') and 'set aside' in l]
    assert len(warning) == 1 and out in warning[0] and 'from step 8 on' in warning[0], said[-3000:]
    assert ckpts(local) == ['ckpt_00000004.pt'] and os.path.exists(local / 'ckpt_00000008.pt.diverged')


# the run is killed (SIGKILL: a lost VM) once its checkpoint of step 4 and what went up with it are in the bucket
KILLED_AFTER_STEP_4 = """
if sys.argv[0].endswith('train.py'):
    from runkeep import records
    real = records.RunRecords.uploaded

    def uploaded(self, path):
        real(self, path)
        if path.endswith('ckpt_00000004.pt'):
            self.uploads.wait(120)
            os.kill(os.getpid(), signal.SIGKILL)

    records.RunRecords.uploaded = uploaded
"""


def test_a_run_killed_after_a_save_leaves_its_metrics_in_the_bucket_for_a_new_machine(emu, toy, tmp_path):
    out, env = f'gs://{BUCKET}/runs/killed', dict(STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    args = ['--log_interval=2', '--checkpoint_interval=2', '--keep_last_n=2']
    p = run(bucket_run(toy, out, tmp_path / 'a', '--max_steps=8', *args), check=False,
            env=dict(env, **site_hook(tmp_path / 'hook', KILLED_AFTER_STEP_4)))
    assert p.returncode == -signal.SIGKILL, p.stdout[-3000:] + p.stderr[-3000:]
    steps = lambda path: [json.loads(l)['step'] for l in open(path) if json.loads(l)['kind'] == 'train']
    gcs.download_file(f'{out}/metrics.jsonl', str(tmp_path / 'bucket.jsonl'))
    assert steps(tmp_path / 'bucket.jsonl') == [2, 4]
    # a new machine: nothing local; the resume goes on with the bucket's history
    run(bucket_run(toy, out, tmp_path / 'b', '--max_steps=6', '--init_from=resume', *args), env=env)
    assert steps(tmp_path / 'b' / 'metrics.jsonl') == [2, 4, 6]
    gcs.download_file(f'{out}/metrics.jsonl', str(tmp_path / 'bucket.jsonl'))
    assert steps(tmp_path / 'bucket.jsonl') == [2, 4, 6]


# the upload of the run's last checkpoint (step 4) holds on until the exit's wait for the uploads begins: what the
# end queues then finds the snapshots queued with that checkpoint still waiting, as when a large checkpoint uploads
LAST_UPLOAD_HELD_TO_THE_END = """
if sys.argv[0].endswith('train.py'):
    from runkeep import records
    settling, uploaded, settle = threading.Event(), records.Uploads.uploaded, records.Uploads.settle

    def held(self, path, uri):
        if path.endswith('ckpt_00000004.pt'):
            settling.wait(60)
        uploaded(self, path, uri)

    records.Uploads.uploaded = held
    records.Uploads.settle = lambda self, interrupted: settling.set() or settle(self, interrupted)
"""


def test_a_run_s_end_sends_each_record_once_its_newest_copy(emu, proxy, toy, tmp_path):
    out, local = f'gs://{BUCKET}/runs/once', tmp_path / 'local'
    run(bucket_run(toy, out, local, '--max_steps=4', '--log_interval=2', '--checkpoint_interval=2'),
        env=dict(STORAGE_EMULATOR_HOST=proxy.url.replace('http://', ''),
                 **site_hook(tmp_path / 'hook', LAST_UPLOAD_HELD_TO_THE_END)))
    names = [n[len('runs/once/'):] for n in proxy.started]
    end = names[names.index('ckpt_00000004.pt') + 1:]
    assert len(end) == len(set(end)) and 'metrics.jsonl' in end and 'results.json' in end, names
    for name in ('metrics.jsonl', 'train.log'):
        gcs.download_file(f'{out}/{name}', str(tmp_path / name))
        assert _read(tmp_path / name) == _read(local / name), name


@pytest.mark.parametrize('results_lost', [False, True])
def test_a_rerun_uploads_what_a_bucket_outage_at_the_end_left_only_local(emu, proxy, toy, tmp_path, results_lost):
    # uploads refused from the first of a checkpoint of step 4 or later to the end (the newest checkpoint goes
    # first: when the training outruns the uploads, that of step 6 may be it): the checkpoints, results.json and
    # history past step 2 stay local; the same command with the bucket back finds the run done (or, results.json
    # lost, evaluates it)
    out, local = f'gs://{BUCKET}/runs/outage-{results_lost}', tmp_path / 'local'
    args = bucket_run(toy, out, local, '--max_steps=8', '--log_interval=2', '--checkpoint_interval=2',
                      '--keep_last_n=2', '--gcs_retries=1', '--init_from=resume')
    env = dict(STORAGE_EMULATOR_HOST=proxy.url.replace('http://', ''))
    proxy.outage_from_step = 4
    p = run(args, env=env)
    proxy.outage_from_step = None
    assert re.search(rf'upload\(s\) to {out} (failed|still running at exit); only in .*ckpt_00000008.pt', p.stdout) \
        and proxy.refusing, p.stdout[-3000:]
    in_bucket = lambda: dict((u[len(out) + 1:], size) for u, size in gcs.list_objects(f'{out}/'))
    assert 'ckpt_00000008.pt' not in in_bucket() and 'results.json' not in in_bucket()
    sent = sorted(n for n in in_bucket() if n.startswith('ckpt_'))
    assert sent in (['ckpt_00000002.pt'], []), sent  # none: step 4's upload went first, step 2's still waiting
    if results_lost:
        os.remove(local / 'results.json')
    proxy.refusing = False
    p = run(args, env=env)
    assert ('results.json of step 8 is missing: evaluating' if results_lost else 'nothing to do') in p.stdout
    bucket = in_bucket()
    assert sorted(n for n in bucket if n.startswith('ckpt_')) == sent + ['ckpt_00000008.pt'], bucket
    for name in ['metrics.jsonl', 'results.json'] + [f'tb/{n}' for n in os.listdir(local / 'tb')]:
        assert bucket.get(name) == os.path.getsize(local / name), (name, bucket)
    gcs.download_file(f'{out}/results.json', str(tmp_path / 'results.json'))
    assert json.load(open(tmp_path / 'results.json'))['step'] == 8
    gcs.download_file(f'{out}/train.log', str(tmp_path / 'train.log'))
    assert 'step 8/' in open(tmp_path / 'train.log').read()
    assert f'{out} lacks what an earlier process left in {local}: uploading ckpt_00000008.pt' in p.stdout


def _queued_behind_a_held_upload(local, out, on_checkpoint, held):
    """Uploads to out whose sent files are listed in order (names under out): checkpoint 1 submitted, its
    on_checkpoint holding the upload thread (held set), then checkpoints 2-4, each with a train.log snapshot,
    queued behind it as in an outage. Returns (the Uploads, the list of names sent)."""
    from runkeep.records import Uploads
    ups = Uploads(str(local), out, on_checkpoint)
    sent, uploaded = [], ups.uploader.on_success
    ups.uploader.on_success = lambda path, uri: sent.append(uri[len(out) + 1:]) or uploaded(path, uri)
    ups.submit(_write(local / 'ckpt_00000001.pt', b'1'))
    assert held.wait(60)
    for step in (2, 3, 4):
        ups.submit(_write(local / f'ckpt_{step:08d}.pt', b'%d' % step))
        _write(local / 'train.log', b'log to step %d' % step)
        ups.log()
    return ups, sent


def test_an_outage_s_stale_log_snapshots_are_dropped_not_sent_ahead_of_the_newest_checkpoint(emu, tmp_path):
    # the upload thread held inside its first checkpoint's upload (the bucket's prune) while three more
    # checkpoints and their train.log snapshots queue behind it, as in an outage: once it goes on, only the newest
    # train.log is sent, and the older snapshots are not left on disk meanwhile
    local, out, held, go = tmp_path / 'local', f'gs://{BUCKET}/stale', threading.Event(), threading.Event()
    ups, sent = _queued_behind_a_held_upload(local, out, lambda: held.set() or go.wait(60), held)
    assert sorted(n for n in os.listdir(local) if n.startswith('.train.log.')) == ['.train.log.3']
    go.set()
    assert ups.wait(60) and ups.uploader.failures == 0
    assert sent == ['ckpt_00000001.pt', 'ckpt_00000004.pt', 'train.log', 'ckpt_00000003.pt', 'ckpt_00000002.pt']
    gcs.download_file(f'{out}/train.log', str(tmp_path / 'train.log'))
    assert _read(tmp_path / 'train.log') == b'log to step 4'


def test_after_an_outage_the_newest_checkpoint_goes_first_then_its_records_then_the_older_ones_kept(emu, tmp_path):
    # as above, with the bucket's real prune (keep_last_n=2) and the oldest queued checkpoint pruned here meanwhile:
    # once the upload thread goes on, the newest checkpoint goes first (a VM lost then leaves the bucket the one a
    # resume needs), its train.log next, then the older one still kept here; the bucket's prune never deletes the
    # newest
    local, out, held, go = tmp_path / 'local', f'gs://{BUCKET}/newest', threading.Event(), threading.Event()
    newest = []

    def prune():
        held.set()
        go.wait(60)
        checkpoint.prune_checkpoints(out, 2, -1)
        newest.append(max(checkpoint.list_checkpoints(out)))
    ups, sent = _queued_behind_a_held_upload(local, out, prune, held)
    os.remove(local / 'ckpt_00000002.pt')
    go.set()
    assert ups.wait(60) and ups.uploader.failures == 0
    assert sent == ['ckpt_00000001.pt', 'ckpt_00000004.pt', 'train.log', 'ckpt_00000003.pt']
    assert newest == [1, 4, 4] and sorted(checkpoint.list_checkpoints(out)) == [3, 4]
