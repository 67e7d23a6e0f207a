"""
Minimal Google Cloud Storage client for checkpoints and datasets (standard library + requests only).
The checkpoint files themselves (atomic saves, listing, pruning) are in checkpoint.py.

Spot TPU VMs can be preempted at any time, so checkpoints go to a GCS bucket:
    upload_file("out/ckpt_1000.pt", "gs://my-bucket/run1/ckpt_1000.pt")
    download_file("gs://my-bucket/run1/ckpt_1000.pt", "out/ckpt_1000.pt")
    list_objects("gs://my-bucket/run1/")  -> [("gs://my-bucket/run1/ckpt_1000.pt", 123456), ...]
    delete_object("gs://my-bucket/run1/ckpt_0500.pt")
Uploader() does uploads on a background thread so training never waits on the network.

Each request carries a token from credentials.py (none for a local emulator, STORAGE_EMULATOR_HOST).

Every request has bounded waits: 10 s to connect, then 30 s without a byte from the server (60 s for the bytes
of an upload or a download; GCS_READ_TIMEOUT=SECONDS sets the 30, the 60 is twice it). A request still not
done after ANNOUNCE_S says on stderr what it waits for, once per attempt, and GCS.stop (a callable) ends a
wait at once when it returns True (a stop request while a run starts).
"""
import base64
import fcntl
import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.parse

import requests

from . import credentials

GCS_ENDPOINT = "https://storage.googleapis.com"
MiB = 1 << 20
ANNOUNCE_S = 5.0  # a request not done after this long says what it waits for

# -----------------------------------------------------------------------------
# paths

def is_gcs(path):
    return isinstance(path, str) and path.startswith("gs://")

def split_gcs(uri):
    """'gs://bucket/a/b.pt' -> ('bucket', 'a/b.pt'); 'gs://bucket' -> ('bucket', '')."""
    if not is_gcs(uri):
        raise ValueError(f"not a gs:// path: {uri!r}")
    bucket, _, name = uri[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, name

def _quote(s):
    # object names may contain '/', spaces, unicode: every byte outside [A-Za-z0-9_.~-] is
    # escaped so 'a/b' stays one path segment ('a%2Fb') as the JSON API requires
    return urllib.parse.quote(s, safe="")

def _emulator_host():
    # same convention as Google's client libraries; accept the value with or without a scheme
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip().rstrip("/")
    if host and "://" not in host:
        host = "http://" + host
    return host or None

# -----------------------------------------------------------------------------
# errors, and the credentials each request carries

class GCSError(Exception):
    def __init__(self, msg, status=None, refused=False):
        super().__init__(msg)
        self.status = status  # HTTP status, or None for network / credential errors
        self._refused = refused

    @property
    def refused(self):
        """No retry changes the answer: the server said no (a 4xx: no such bucket, no permission), or the
        credentials cannot be used (a broken key file)."""
        return self._refused or self.status is not None and not _is_transient(self.status)

class NotFoundError(GCSError, FileNotFoundError):
    pass  # also a FileNotFoundError so callers can treat a missing object like a missing file

class Stopped(GCSError):
    pass  # GCS.stop() said to stop while a request waited

class Gone(GCSError):
    pass  # an upload's file was deleted before it was opened or while it waited to be retried (pruned: a newer
          # one replaces it)

class CredentialsFailed(GCSError):
    pass  # no token to send, and none to wait for (status: the token endpoint's): the bucket was not asked

def _auth_headers(force_refresh=False, stop=None):
    """The Authorization header for a request (none for an emulator). A token refused, or a key file that
    cannot work, is a GCSError like any other, so callers catch one kind of error; a token not had for now (the
    metadata server did not answer, the token endpoint's 5xx) is _NoToken, retried as a bucket's 503 is. A stop
    (stop() True) that ended the wait for a token is Stopped."""
    try:
        token = credentials.get_token(force_refresh, stop)
    except credentials.CredentialsError as e:
        if stop is not None and stop():
            raise Stopped("a stop was requested while waiting for a GCS token") from None
        if e.refused or e.status is not None and not _is_transient(e.status):
            raise CredentialsFailed(str(e), e.status, e.refused) from None
        raise _NoToken(str(e)) from None
    return {"Authorization": f"Bearer {token}"} if token else {}

# -----------------------------------------------------------------------------
# client

class _Transient(Exception):
    pass  # a problem worth retrying that isn't an HTTP status (bad checksum, stalled upload)

class _NoToken(_Transient):
    pass

class _BadStatus(Exception):
    def __init__(self, r):
        super().__init__(f"HTTP {r.status_code}")
        self.status = r.status_code
        try:  # GCS errors are JSON {"error": {"message": ...}}; the emulator often sends an empty body
            self.detail = r.json()["error"]["message"]
        except Exception:
            self.detail = r.text.strip()[:300]

def _check(r, ok=(200,)):
    if r.status_code not in ok:
        raise _BadStatus(r)
    return r

# dropped/refused connections, timeouts, a body cut off mid-download (ReadTimeout etc. subclass these)
_NETWORK_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)

def _is_transient(status):
    return status in (408, 429) or status >= 500

def _read_timeout():
    """GCS_READ_TIMEOUT's seconds (30 when unset); a value that is no such number ends the process in one line,
    as the first client is made at start."""
    value = os.environ.get("GCS_READ_TIMEOUT", "").strip()
    try:
        seconds = float(value or 30)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise SystemExit(f"GCS_READ_TIMEOUT={value!r}: expected the seconds to wait for GCS's answer, a number > 0 "
                         "(unset: 30)")
    return seconds

class GCS:
    """GCS JSON API client. Every call retries transient failures with exponential backoff and jitter."""

    def __init__(self, endpoint=None, retries=8, backoff=1.0, max_backoff=32.0,
                 timeout=None, chunk_size=32 * MiB):
        assert chunk_size % (256 * 1024) == 0, "GCS requires resumable chunks to be multiples of 256 KiB"
        self.endpoint = endpoint  # None: STORAGE_EMULATOR_HOST if set (read per call), else real GCS
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        # (connect, read) seconds; requests applies the read timeout to each wait for bytes, not to a whole
        # transfer, so a large file needs no larger one. Transfers get twice the read timeout.
        self.timeout = timeout or (10.0, _read_timeout())
        self.transfer_timeout = (self.timeout[0], 2 * self.timeout[1])
        self.chunk_size = chunk_size
        self.stop = None  # a callable: True ends every wait of this client with Stopped
        self._local = threading.local()  # requests.Session isn't guaranteed thread-safe: one per thread

    def _session(self):
        if not hasattr(self._local, "s"):
            self._local.s = requests.Session()
        return self._local.s

    def _url(self, path, **params):
        base = (self.endpoint or _emulator_host() or GCS_ENDPOINT).rstrip("/")
        # quote_via=quote writes spaces as %20, which no server can misread (unlike '+')
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None},
                                       quote_via=urllib.parse.quote)
        return base + path + ("?" + query if query else "")

    def _object_url(self, bucket, name, **params):
        return self._url(f"/storage/v1/b/{_quote(bucket)}/o/{_quote(name)}", **params)

    def _with_retries(self, what, attempt, watch=True, wanted=None):
        """Call attempt(auth_headers) until it returns; retry connection errors, 408/429/5xx and _Transient (a
        token not had for now among them); refresh the token once on 401; fail at once on other statuses.
        watch: a long attempt is a wait worth announcing (not so for a transfer, whose attempts take long when
        all is well). wanted: a callable asked while a retry waits; False ends the retries with Gone."""
        refreshed, refresh, err, t0, i = False, False, None, time.time(), 0
        while True:
            try:
                auth, refresh = _auth_headers(force_refresh=refresh, stop=self.stop), False
                return self._attempt(what, attempt, auth, watch or i > 0,
                                     f"attempt {i + 1} of {self.retries + 1}", err, t0)
            except _BadStatus as e:
                if e.status == 401 and not refreshed and not _emulator_host():
                    # token revoked or expired early: the same attempt again with a new one
                    refreshed = refresh = True
                    err = e
                    continue
                if not _is_transient(e.status):
                    cls = NotFoundError if e.status == 404 else GCSError
                    raise cls(f"GCS {what} failed: HTTP {e.status} {e.detail}".rstrip(), e.status) from None
                err = e
            except (*_NETWORK_ERRORS, _Transient) as e:
                err = e
            if i == self.retries:
                break
            delay = min(self.max_backoff, self.backoff * 2 ** i)
            self._sleep(what, delay * random.uniform(0.5, 1.0), wanted)  # jitter: not in lockstep with other hosts
            i += 1
        raise GCSError(f"GCS {what} failed after {self.retries + 1} attempts: {err}",
                       getattr(err, "status", None))

    def _attempt(self, what, attempt, auth, watch, which, last, t0):
        """attempt(auth). Watched (or while a stop hook is set), it runs on a helper thread that this one
        polls: past ANNOUNCE_S since the request began a line says what it waits for, and a stop ends the
        wait at once (the helper thread is left to its timeout, and the session it holds is dropped)."""
        def announce():
            why = last if isinstance(last, (_BadStatus, _Transient)) else type(last).__name__
            why = f", after {why}" if last else ""
            print(f"gcs: waiting for GCS {what} ({which}{why}; {time.time() - t0:.0f} s so far)",
                  file=sys.stderr, flush=True)
        if self.stop is None and not watch:
            return attempt(auth)
        box, session, said = {}, self._session(), False

        def call():
            self._local.s = session  # the caller's connection pool, idle while the caller polls
            try:
                box["value"] = attempt(auth)
            except BaseException as e:  # handed to the caller
                box["error"] = e
        helper = threading.Thread(target=call, name="gcs-request", daemon=True)
        helper.start()
        while helper.is_alive():
            if watch and not said and time.time() - t0 >= ANNOUNCE_S:
                announce()
                said = True
            helper.join(0.1)
            if self.stop is not None and self.stop():
                del self._local.s  # the helper may still be using it
                raise Stopped(f"a stop was requested while waiting for GCS {what}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _sleep(self, what, seconds, wanted=None):
        """time.sleep(seconds), ended by a stop request, and (Gone) once `wanted` says no: a pruned checkpoint's
        retry gives way to the newer one at once, not after its wait."""
        end = time.time() + seconds
        while True:
            if self.stop is not None and self.stop():
                raise Stopped(f"a stop was requested while waiting for GCS {what}")
            if wanted is not None and not wanted():
                raise Gone(f"GCS {what} given up: not wanted any more")
            if time.time() >= end:
                return
            time.sleep(max(0.0, min(0.1, end - time.time())))

    def upload(self, local_path, uri):
        """Upload a file with the resumable protocol; returns the object's metadata dict.

        GCS only creates the object when the last byte arrives (and then replaces any old one
        atomically), so a preempted or failed upload never leaves a half-written checkpoint
        visible in the bucket. Resumable (not single-request) so a dropped connection resumes
        from what GCS has already stored instead of resending the whole file. The file is
        opened once, so replacing local_path with os.replace() meanwhile is safe; writing into
        it in place is not (the md5 check below would then fail the upload). A local_path deleted
        meanwhile ends the retries (Gone): an outage would otherwise send a pruned checkpoint, ahead
        of the newer ones, once the bucket answers. One already gone is Gone too.
        """
        bucket, name = split_gcs(uri)
        what, there = f"upload {local_path} -> {uri}", lambda: os.path.exists(local_path)
        try:
            f = open(local_path, "rb")
        except FileNotFoundError:
            raise Gone(f"GCS {what} given up: no such file {local_path}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            md5 = hashlib.md5()
            for block in iter(lambda: f.read(8 * MiB), b""):
                md5.update(block)
            # sending the md5 makes GCS reject the upload if the bytes it got differ from the file
            meta = {"name": name, "contentType": "application/octet-stream",
                    "md5Hash": base64.b64encode(md5.digest()).decode()}

            def start(auth):
                r = self._session().post(
                    self._url(f"/upload/storage/v1/b/{_quote(bucket)}/o", uploadType="resumable"),
                    data=json.dumps(meta), timeout=self.timeout,
                    headers={**auth, "Content-Type": "application/json; charset=UTF-8",
                             "X-Upload-Content-Type": "application/octet-stream",
                             "X-Upload-Content-Length": str(size)})
                return _check(r).headers["Location"]

            def send(auth, session_url, resume):
                offset = 0
                if resume:  # an earlier attempt failed: ask GCS how many bytes it kept
                    r = self._session().put(session_url, headers={**auth, "Content-Range": f"bytes */{size}"},
                                            timeout=self.transfer_timeout, allow_redirects=False)
                    if r.status_code in (200, 201):
                        return r.json()  # it had everything; only the final reply was lost
                    offset = _persisted(_check(r, (308,)))
                while True:
                    f.seek(offset)
                    chunk = f.read(self.chunk_size)
                    crange = f"bytes {offset}-{offset + len(chunk) - 1}/{size}" if chunk \
                        else f"bytes */{size}"
                    # allow_redirects=False: requests would treat GCS's 308 "Resume Incomplete" as a redirect
                    r = self._session().put(session_url, data=chunk,
                                            headers={**auth, "Content-Range": crange},
                                            timeout=self.transfer_timeout, allow_redirects=False)
                    if r.status_code in (200, 201):
                        return r.json()
                    new_offset = _persisted(_check(r, (308,)))  # 308: stored so far, send the rest
                    if new_offset <= offset:
                        raise _Transient(f"resumable upload made no progress at byte {offset}")
                    offset = new_offset

            # 404/410 on the session URL means it expired or was aborted: start a new session (once)
            for session_try in range(2):
                session_url = self._with_retries(what, start, wanted=there)
                attempts = 0

                def attempt(auth):
                    nonlocal attempts
                    attempts += 1
                    return send(auth, session_url, resume=attempts > 1)
                try:
                    return self._with_retries(what, attempt, watch=False, wanted=there)
                except GCSError as e:
                    if e.status not in (404, 410) or session_try == 1:
                        raise

    def download(self, uri, local_path):
        """Download to a temp file next to local_path, then rename: readers never see a partial file."""
        bucket, name = split_gcs(uri)
        d = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(local_path) + ".", suffix=".part")
        os.close(fd)

        def attempt(auth):
            with self._session().get(self._object_url(bucket, name, alt="media"), headers=auth,
                                     stream=True, timeout=self.transfer_timeout) as r:
                _check(r)
                md5 = hashlib.md5()
                with open(tmp, "wb") as f:  # "wb": a retry starts the file over
                    for block in r.iter_content(MiB):
                        f.write(block)
                        md5.update(block)
                # x-goog-hash carries the stored object's md5 (absent for composite objects; it
                # describes the compressed bytes if GCS sent Content-Encoding, so skip then)
                want = _goog_hash(r.headers.get("x-goog-hash", ""), "md5")
                if want and not r.headers.get("Content-Encoding") and \
                        want != base64.b64encode(md5.digest()).decode():
                    raise _Transient(f"md5 mismatch downloading {uri}")
        try:
            self._with_retries(f"download {uri}", attempt, watch=False)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return local_path

    def list(self, uri_prefix, max_results=1000, generations=False):
        """All objects whose name starts with the prefix (recursive: no delimiter), sorted by name.
        Returns [(uri, size_bytes)], with generations [(uri, size_bytes, generation)]: a new one at every
        write of the object."""
        bucket, prefix = split_gcs(uri_prefix)
        out, page_token = [], None
        while True:  # GCS returns at most max_results per page plus a nextPageToken
            url = self._url(f"/storage/v1/b/{_quote(bucket)}/o", prefix=prefix or None,
                            maxResults=max_results, pageToken=page_token,
                            fields=f"items(name,size{',generation' if generations else ''}),nextPageToken")
            get = lambda auth: _check(self._session().get(url, headers=auth, timeout=self.timeout)).json()
            page = self._with_retries(f"list {uri_prefix}", get)
            out += [(f"gs://{bucket}/{it['name']}", int(it["size"]))
                    + ((str(it.get("generation")),) if generations else ()) for it in page.get("items") or []]
            page_token = page.get("nextPageToken")
            if not page_token:
                return out

    def delete(self, uri, missing_ok=True):
        """Delete one object. Returns False if it didn't exist (also what a retried, already-applied delete
        sees)."""
        bucket, name = split_gcs(uri)
        try:
            self._with_retries(f"delete {uri}", lambda auth: _check(
                self._session().delete(self._object_url(bucket, name), headers=auth, timeout=self.timeout),
                (200, 204)))
            return True
        except NotFoundError:
            if missing_ok:
                return False
            raise

    def create_if_absent(self, uri, data):
        """Create the object with `data` (bytes) only if it does not exist (the precondition
        ifGenerationMatch=0, checked by GCS itself): True when created, False when one was there (HTTP 412).
        For lock objects."""
        bucket, name = split_gcs(uri)

        def attempt(auth):
            r = self._session().post(self._url(f"/upload/storage/v1/b/{_quote(bucket)}/o", uploadType="media",
                                               name=name, ifGenerationMatch=0), data=data,
                                     timeout=self.timeout,
                                     headers={**auth, "Content-Type": "application/octet-stream"})
            return r.status_code != 412 and bool(_check(r))
        return self._with_retries(f"create {uri}", attempt)

    def put(self, uri, data):
        """Write `data` (bytes) to the object in one request, replacing it (a lock object's renewal)."""
        bucket, name = split_gcs(uri)
        self._with_retries(f"write {uri}", lambda auth: _check(self._session().post(
            self._url(f"/upload/storage/v1/b/{_quote(bucket)}/o", uploadType="media", name=name), data=data,
            timeout=self.timeout, headers={**auth, "Content-Type": "application/octet-stream"})))

    def exists(self, uri):
        bucket, name = split_gcs(uri)
        try:
            self._with_retries(f"stat {uri}", lambda auth: _check(
                self._session().get(self._object_url(bucket, name, fields="name"), headers=auth,
                                    timeout=self.timeout)))
            return True
        except NotFoundError:
            return False

def _persisted(r):
    # 308 reply: "Range: bytes=0-N" means bytes 0..N are stored; no Range header means none are.
    # (gcp-storage-emulator wrongly answers "bytes=0-0" when it holds nothing; the resumed PUT is
    # then rejected with a 400, so against the emulator that rare case fails, it never corrupts.)
    rng = r.headers.get("Range")
    return int(rng.rpartition("-")[2]) + 1 if rng else 0

def _goog_hash(header, kind):
    # "crc32c=AAAAAA==,md5=1B2M2Y8AsgTpgAmY7PhCfg==" -> value for kind, or None
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        if k == kind:
            return v
    return None

# -----------------------------------------------------------------------------
# background uploads

class Uploader:
    """Uploads on a daemon thread. submit() returns at once; errors are logged to stderr and
    kept in .failed, never raised into the training loop. Call wait() before exiting
    (and on SIGTERM: spot VMs get ~30 s) so queued checkpoints make it to the bucket.
    on_success(local_path, uri) runs on the upload thread after each upload (e.g. pruning old checkpoints).
    A file deleted before its turn or while its upload is retried (pruned: a newer one replaces it) is skipped,
    not a failure; so is a failed upload once a later one to the same object works. An outage is said once, at
    its first failure, and again when an upload works (a long one would otherwise print a line per file, per
    checkpoint). order(jobs) gives the waiting (local_path, uri) jobs in the order to send them (None: as
    submitted)."""

    def __init__(self, client=None, on_success=None, order=None):
        self.client = client  # None: the module's default client
        self.on_success, self.order = on_success, order
        self.pending = []  # [(local_path, uri)] submitted and not finished: the one under way first, then as
                           # submitted
        self.failed = []   # [(local_path, uri)] whose last upload failed
        self.unsaid = 0    # failures since the last upload that worked
        self.took = {}     # {uri: seconds} of its last upload that worked
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="gcs-uploader", daemon=True).start()

    @property
    def failures(self):
        return len(self.failed)

    def submit(self, local_path, uri):
        """Queue an upload. Don't modify local_path in place until wait() (os.replace of a new file is
        fine)."""
        with self._cv:
            self.pending.append((local_path, uri))
            self._cv.notify_all()

    def _run(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.pending)
                job = local_path, uri = (self.order or list)(self.pending)[0]
                self.pending.remove(job)
                self.pending.insert(0, job)
            ok = sent = False
            t = time.monotonic()
            try:
                (self.client or default_client()).upload(local_path, uri)
                sent = ok = True
                self.took[uri] = time.monotonic() - t
                if self.unsaid:
                    print(f"gcs: uploads work again ({uri} uploaded); {self.unsaid} failed meanwhile",
                          file=sys.stderr, flush=True)
                    self.unsaid = 0
                if self.on_success is not None:
                    try:
                        self.on_success(local_path, uri)
                    except Exception as e:
                        print(f"gcs: on_success callback after uploading {uri} failed: {e!r}",
                              file=sys.stderr, flush=True)
            except Gone:  # pruned: a newer file replaces it
                ok = True
            except Exception as e:
                if not self.unsaid:
                    print(f"gcs: upload of {local_path} to {uri} failed: {e} (the next uploads are tried; their "
                          "failures are said at the end)", file=sys.stderr, flush=True)
                self.unsaid += 1
            finally:
                with self._cv:
                    self.pending.remove(job)
                    if sent:  # it replaces what an earlier, failed upload of the same object would have sent
                        self.failed = [j for j in self.failed if j[1] != uri]
                    else:
                        self.failed = [j for j in self.failed if j != job] + ([] if ok else [job])
                    self._cv.notify_all()

    def wait(self, timeout=None):
        """Block until every submitted upload finished (ok or failed). Returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self.pending, timeout)

# -----------------------------------------------------------------------------
# module-level helpers over one shared client, so train.py needn't manage clients

_default = None

def default_client():
    global _default
    if _default is None:
        _default = GCS()
    return _default

def upload_file(local, uri):
    return default_client().upload(local, uri)

def download_file(uri, local):
    return default_client().download(uri, local)

def download_if_there(uri, local, otherwise):
    """The object `uri` downloaded to local: local, or None when there is none, or when it cannot be read
    (then a warning saying what happens `otherwise`: the caller goes on without it)."""
    try:
        return download_file(uri, local)
    except NotFoundError:
        return None
    except Exception as e:
        print(f"warning: cannot read {uri} ({e}); {otherwise}")
        return None

def list_objects(uri_prefix, generations=False):
    return default_client().list(uri_prefix, generations=generations)

def delete_object(uri):
    return default_client().delete(uri)

def create_if_absent(uri, data):
    return default_client().create_if_absent(uri, data)

def object_exists(uri):
    return default_client().exists(uri)

# -----------------------------------------------------------------------------
# whole folders: a dataset built on one machine, used on every host of a pod

def upload_tree(local_dir, uri):
    """Upload every file under local_dir to uri/<relative path>; returns how many."""
    n = 0
    for root, _, files in os.walk(local_dir):
        for name in sorted(files):
            path = os.path.join(root, name)
            upload_file(path, f"{uri.rstrip('/')}/{os.path.relpath(path, local_dir)}")
            n += 1
    return n


def upload_dataset(local_dir, uri):
    """upload_tree for a dataset a builder just wrote; any failure is a GCSError that says where the data
    is."""
    try:
        return upload_tree(local_dir, uri)
    except Exception as e:
        raise GCSError(f"the dataset was built in {local_dir}, but its upload to {uri} failed: {e}") from e


def build_folder(output_dir):
    """(the folder a builder writes into, the gs:// uri publish_dataset then uploads it to, or ''): a gs://
    output_dir is built in data/upload/BUCKET/PREFIX. Its bucket is listed first, so one that does not exist or
    refuses ends the builder in one line before it builds (one that does not answer is said, and the build goes
    on: the upload retries it). An empty one (a shell variable that is not set) names no folder: refused."""
    if not output_dir.strip():
        raise SystemExit("error: --output_dir is empty: name the folder to build the dataset in (a shell variable "
                         "that is not set?)")
    if not is_gcs(output_dir):
        return output_dir, ''
    try:
        split_gcs(output_dir)
        GCS(retries=2).list(output_dir.rstrip('/') + '/')
    except GCSError as e:
        if e.refused:
            raise SystemExit(f"error: --output_dir {output_dir}: {e}") from None
        print(f"warning: cannot list {output_dir} ({e}); building anyway, then uploading", file=sys.stderr)
    except ValueError as e:
        raise SystemExit(f"error: --output_dir {output_dir}: {e}") from None
    return os.path.join('data', 'upload', output_dir[len('gs://'):]), output_dir


def publish_dataset(local_dir, uri):
    """Where a dataset a builder just wrote ends up: local_dir, or with a gs:// uri the whole folder uploaded
    there for every host to fetch (said in one line)."""
    if not uri:
        return local_dir
    print(f"uploaded {upload_dataset(local_dir, uri)} files to {uri}")
    return uri


def cached_copy(uri, cache_dir):
    """Where fetch_tree keeps its copy of the folder under gs:// uri."""
    bucket, prefix = split_gcs(uri.rstrip('/') + '/')
    return os.path.join(os.path.expanduser(cache_dir), bucket, prefix.rstrip('/'))


def fetch_tree(uri, cache_dir):
    """A local copy of the folder under gs:// uri, made once per version of it: every object is downloaded into
    a temporary folder, its size checked against the listing, and only a complete copy is renamed to its final
    name, so an interrupted fetch is retried from scratch and never leaves a folder that looks whole. A copy
    whose listing (names, sizes, generations) is the bucket's is used as it is; a dataset rebuilt there with
    another seed keeps its names and sizes, not its generations. A bucket that cannot be listed, or holds
    nothing there now, leaves a complete copy in use, said. The runs of one host fetch one at a time (an flock
    of a file beside the copy; a stop ends the wait): a run that waited uses the copy the one before it fetched,
    and a copy replaced is moved aside before it is removed, never emptied under the name a run is reading."""
    dest = cached_copy(uri, cache_dir)
    complete = os.path.join(dest, '.complete')
    try:
        listing = list_objects(uri.rstrip('/') + '/', generations=True)
    except GCSError as e:
        if isinstance(e, Stopped) or not os.path.exists(complete):
            raise
        print(f"warning: cannot list {uri} ({e}); using the copy fetched earlier, {dest}", file=sys.stderr)
        return dest
    if copy_of(complete, listing):
        return dest
    # removed from the bucket since (a clean-up): a run on this host goes on with what it has
    if os.path.exists(complete) and not listing:
        print(f"warning: nothing under {uri} now; using the copy fetched earlier, {dest}", file=sys.stderr)
        return dest
    if not listing:
        raise FileNotFoundError(f"nothing under {uri}")
    import shutil
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(f"{dest}.lock", 'a') as guard:
        while True:  # polled, not blocked in flock: a stop (a preemption) must end the wait for another's fetch
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if (stop := default_client().stop) is not None and stop():
                    raise Stopped(f"a stop was requested while waiting for another run's fetch of {uri}") from None
                time.sleep(0.2)
        if copy_of(complete, listing):  # fetched by another run of this host meanwhile
            return dest
        tmp, old = f"{dest}.partial.{os.getpid()}", f"{dest}.old.{os.getpid()}"
        for left in (tmp, old):  # a killed fetch's, of a process of this pid (a container restarted reuses them)
            shutil.rmtree(left, ignore_errors=True)
        for obj, size, _ in listing:
            rel = obj[len(uri.rstrip('/')) + 1:]
            path = os.path.join(tmp, rel)
            download_file(obj, path)
            if os.path.getsize(path) != size:
                raise GCSError(f"{obj}: {os.path.getsize(path)} bytes downloaded, the bucket lists {size}")
        open(os.path.join(tmp, '.complete'), 'w').write(json.dumps(listing))
        if os.path.exists(dest):
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    return dest


def copy_of(complete, listing):
    """Whether the copy whose .complete is at `complete` is whole and of this listing of the bucket."""
    try:
        with open(complete) as f:
            return f.read() == json.dumps(listing)
    except OSError:
        return False
