"""
Minimal Google Cloud Storage client for checkpoints (standard library + requests only).

Spot TPU VMs can be preempted at any time, so checkpoints go to a GCS bucket:
    upload_file("out/ckpt_1000.pt", "gs://my-bucket/run1/ckpt_1000.pt")
    download_file("gs://my-bucket/run1/ckpt_1000.pt", "out/ckpt_1000.pt")
    list_objects("gs://my-bucket/run1/")  -> [("gs://my-bucket/run1/ckpt_1000.pt", 123456), ...]
    delete_object("gs://my-bucket/run1/ckpt_0500.pt")
Uploader() does uploads on a background thread so training never waits on the network.

Credentials, in order: none when STORAGE_EMULATOR_HOST is set (local emulator, used by
the tests), else the VM metadata server (TPU/GCE service account), else `gcloud auth
print-access-token` (a workstation).
"""
import base64
import hashlib
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import requests

GCS_ENDPOINT = "https://storage.googleapis.com"
METADATA_HOST = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
METADATA_TOKEN_URL = f"http://{METADATA_HOST}/computeMetadata/v1/instance/service-accounts/default/token"
MiB = 1 << 20

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
# credentials

class GCSError(Exception):
    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status  # HTTP status, or None for network / credential errors

class NotFoundError(GCSError, FileNotFoundError):
    pass  # also a FileNotFoundError so callers can treat a missing object like a missing file

_token_lock = threading.Lock()
_token = None
_token_expiry = 0.0

def _token_from_metadata():
    try:
        r = requests.get(METADATA_TOKEN_URL, headers={"Metadata-Flavor": "Google"}, timeout=2)
    except requests.RequestException:
        return None  # not on a GCE/TPU VM
    if r.status_code != 200:
        return None  # e.g. VM without a service account
    d = r.json()
    return d["access_token"], float(d.get("expires_in", 300))

def _token_from_gcloud():
    try:
        p = subprocess.run(["gcloud", "auth", "print-access-token"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0 or not p.stdout.strip():
        return None
    # gcloud doesn't report the expiry; tokens live ~1h but may be partly used, so re-ask soon
    return p.stdout.strip(), 300.0

def get_token(force_refresh=False):
    """OAuth2 access token for GCS, or None when talking to an emulator. Cached until ~2 min before expiry."""
    global _token, _token_expiry
    if _emulator_host():
        return None
    with _token_lock:
        if force_refresh or _token is None or time.time() > _token_expiry - 120:
            got = _token_from_metadata() or _token_from_gcloud()
            if got is None:
                raise GCSError("no GCS credentials: the VM metadata server is unreachable (not on a GCE/TPU VM?) "
                               "and `gcloud auth print-access-token` failed; run `gcloud auth login`, "
                               "or set STORAGE_EMULATOR_HOST to use a local emulator")
            _token, ttl = got
            _token_expiry = time.time() + ttl
        return _token

# -----------------------------------------------------------------------------
# client

class _Transient(Exception):
    pass  # a problem worth retrying that isn't an HTTP status (bad checksum, stalled upload)

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

class GCS:
    """GCS JSON API client. Every call retries transient failures with exponential backoff and jitter."""

    def __init__(self, endpoint=None, retries=8, backoff=1.0, max_backoff=32.0,
                 timeout=(10, 120), chunk_size=32 * MiB):
        assert chunk_size % (256 * 1024) == 0, "GCS requires resumable chunks to be multiples of 256 KiB"
        self.endpoint = endpoint  # None: STORAGE_EMULATOR_HOST if set (read per call), else real GCS
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.timeout, self.chunk_size = timeout, chunk_size
        self._local = threading.local()  # requests.Session isn't guaranteed thread-safe: one per thread

    def _session(self):
        if not hasattr(self._local, "s"):
            self._local.s = requests.Session()
        return self._local.s

    def _url(self, path, **params):
        base = (self.endpoint or _emulator_host() or GCS_ENDPOINT).rstrip("/")
        # quote_via=quote writes spaces as %20, which no server can misread (unlike '+')
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}, quote_via=urllib.parse.quote)
        return base + path + ("?" + query if query else "")

    def _object_url(self, bucket, name, **params):
        return self._url(f"/storage/v1/b/{_quote(bucket)}/o/{_quote(name)}", **params)

    def _with_retries(self, what, attempt):
        """Call attempt(auth_headers) until it returns; retry connection errors, 408/429/5xx and
        _Transient; refresh the token once on 401; fail at once on other statuses."""
        refreshed, err = False, None
        for i in range(self.retries + 1):
            try:
                token = get_token()
                return attempt({"Authorization": f"Bearer {token}"} if token else {})
            except _BadStatus as e:
                if e.status == 401 and not refreshed and not _emulator_host():
                    get_token(force_refresh=True)  # token revoked or expired early
                    refreshed, err = True, e
                    continue
                if not _is_transient(e.status):
                    cls = NotFoundError if e.status == 404 else GCSError
                    raise cls(f"GCS {what} failed: HTTP {e.status} {e.detail}".rstrip(), e.status) from None
                err = e
            except (*_NETWORK_ERRORS, _Transient) as e:
                err = e
            if i < self.retries:
                delay = min(self.max_backoff, self.backoff * 2 ** i)
                time.sleep(delay * random.uniform(0.5, 1.0))  # jitter: don't retry in lockstep with other hosts
        raise GCSError(f"GCS {what} failed after {self.retries + 1} attempts: {err}", getattr(err, "status", None))

    def upload(self, local_path, uri):
        """Upload a file with the resumable protocol; returns the object's metadata dict.

        GCS only creates the object when the last byte arrives (and then replaces any old one
        atomically), so a preempted or failed upload never leaves a half-written checkpoint
        visible in the bucket. Resumable (not single-request) so a dropped connection resumes
        from what GCS has already stored instead of resending the whole file. The file is
        opened once, so replacing local_path with os.replace() meanwhile is safe; writing into
        it in place is not (the md5 check below would then fail the upload).
        """
        bucket, name = split_gcs(uri)
        what = f"upload {local_path} -> {uri}"
        with open(local_path, "rb") as f:
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
                             "X-Upload-Content-Type": "application/octet-stream", "X-Upload-Content-Length": str(size)})
                return _check(r).headers["Location"]

            def send(auth, session_url, resume):
                offset = 0
                if resume:  # an earlier attempt failed: ask GCS how many bytes it kept
                    r = self._session().put(session_url, headers={**auth, "Content-Range": f"bytes */{size}"},
                                            timeout=self.timeout, allow_redirects=False)
                    if r.status_code in (200, 201):
                        return r.json()  # it had everything; only the final reply was lost
                    offset = _persisted(_check(r, (308,)))
                while True:
                    f.seek(offset)
                    chunk = f.read(self.chunk_size)
                    crange = f"bytes {offset}-{offset + len(chunk) - 1}/{size}" if chunk else f"bytes */{size}"
                    # allow_redirects=False: requests would treat GCS's 308 "Resume Incomplete" as a redirect
                    r = self._session().put(session_url, data=chunk, headers={**auth, "Content-Range": crange},
                                            timeout=self.timeout, allow_redirects=False)
                    if r.status_code in (200, 201):
                        return r.json()
                    new_offset = _persisted(_check(r, (308,)))  # 308: stored so far, send the rest
                    if new_offset <= offset:
                        raise _Transient(f"resumable upload made no progress at byte {offset}")
                    offset = new_offset

            # 404/410 on the session URL means it expired or was aborted: start a new session (once)
            for session_try in range(2):
                session_url = self._with_retries(what, start)
                attempts = 0

                def attempt(auth):
                    nonlocal attempts
                    attempts += 1
                    return send(auth, session_url, resume=attempts > 1)
                try:
                    return self._with_retries(what, attempt)
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
                                     stream=True, timeout=self.timeout) as r:
                _check(r)
                md5 = hashlib.md5()
                with open(tmp, "wb") as f:  # "wb": a retry starts the file over
                    for block in r.iter_content(MiB):
                        f.write(block)
                        md5.update(block)
                # x-goog-hash carries the stored object's md5 (absent for composite objects; it
                # describes the compressed bytes if GCS sent Content-Encoding, so skip then)
                want = _goog_hash(r.headers.get("x-goog-hash", ""), "md5")
                if want and not r.headers.get("Content-Encoding") and want != base64.b64encode(md5.digest()).decode():
                    raise _Transient(f"md5 mismatch downloading {uri}")
        try:
            self._with_retries(f"download {uri}", attempt)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return local_path

    def list(self, uri_prefix, max_results=1000):
        """All objects whose name starts with the prefix (recursive: no delimiter), sorted by name.
        Returns [(uri, size_bytes)]."""
        bucket, prefix = split_gcs(uri_prefix)
        out, page_token = [], None
        while True:  # GCS returns at most max_results per page plus a nextPageToken
            url = self._url(f"/storage/v1/b/{_quote(bucket)}/o", prefix=prefix or None, maxResults=max_results,
                            pageToken=page_token, fields="items(name,size),nextPageToken")
            get = lambda auth: _check(self._session().get(url, headers=auth, timeout=self.timeout)).json()
            page = self._with_retries(f"list {uri_prefix}", get)
            out += [(f"gs://{bucket}/{it['name']}", int(it["size"])) for it in page.get("items") or []]
            page_token = page.get("nextPageToken")
            if not page_token:
                return out

    def delete(self, uri, missing_ok=True):
        """Delete one object. Returns False if it didn't exist (also what a retried, already-applied delete sees)."""
        bucket, name = split_gcs(uri)
        try:
            self._with_retries(f"delete {uri}", lambda auth: _check(
                self._session().delete(self._object_url(bucket, name), headers=auth, timeout=self.timeout), (200, 204)))
            return True
        except NotFoundError:
            if missing_ok:
                return False
            raise

    def exists(self, uri):
        bucket, name = split_gcs(uri)
        try:
            self._with_retries(f"stat {uri}", lambda auth: _check(
                self._session().get(self._object_url(bucket, name, fields="name"), headers=auth, timeout=self.timeout)))
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
    counted in .failures, never raised into the training loop. Call wait() before exiting
    (and on SIGTERM: spot VMs get ~30 s) so queued checkpoints make it to the bucket.
    on_success(local_path, uri) runs on the upload thread after each upload (e.g. pruning old checkpoints)."""

    def __init__(self, client=None, on_success=None):
        self.client = client  # None: the module's default client
        self.on_success = on_success
        self.failures = 0
        self._queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="gcs-uploader", daemon=True).start()

    def submit(self, local_path, uri):
        """Queue an upload. Don't modify local_path in place until wait() (os.replace of a new file is fine)."""
        with self._cv:
            self._pending += 1
        self._queue.put((local_path, uri))

    def _run(self):
        while True:
            local_path, uri = self._queue.get()
            try:
                (self.client or default_client()).upload(local_path, uri)
                if self.on_success is not None:
                    try:
                        self.on_success(local_path, uri)
                    except Exception as e:
                        print(f"gcs: on_success callback after uploading {uri} failed: {e!r}",
                              file=sys.stderr, flush=True)
            except Exception as e:
                with self._cv:
                    self.failures += 1
                print(f"gcs: upload of {local_path} to {uri} failed: {e}", file=sys.stderr, flush=True)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def wait(self, timeout=None):
        """Block until every submitted upload finished (ok or failed). Returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

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

def list_objects(uri_prefix):
    return default_client().list(uri_prefix)

def delete_object(uri):
    return default_client().delete(uri)

def object_exists(uri):
    return default_client().exists(uri)
