"""
Access tokens for Google Cloud Storage: gcs.py asks get_token() before each request.

Sources, in order: none when STORAGE_EMULATOR_HOST is set (a local emulator, what the tests use), else the
service-account key file named by GOOGLE_APPLICATION_CREDENTIALS (any machine, e.g. a GPU cloud: google-auth
signs a JWT with the key and trades it at the key's token_uri for a token), else the VM metadata server (a
TPU/GCE VM's service account; at start, one that refuses connections while the VM boots is waited for, up to
METADATA_WAIT_S), else `gcloud auth print-access-token` (a workstation). A token is reused until
2 minutes before it expires. A key file that is named is used or reported in one line naming the file (never
its key), never replaced by another identity.
"""
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import requests

try:  # only a service-account key file needs google-auth; an environment made before it was required may lack it
    from google.auth import exceptions as auth_errors
    from google.auth.transport.requests import Request
    from google.oauth2 import service_account
except ImportError:
    service_account = None

METADATA_HOST = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
METADATA_TOKEN_URL = f"http://{METADATA_HOST}/computeMetadata/v1/instance/service-accounts/default/token"
GCS_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
DEFAULT_TOKEN_URI = "https://oauth2.googleapis.com/token"  # what every Google key file names anyway
TOKEN_TIMEOUT_S = 30  # one wait for the token endpoint's answer
METADATA_WAIT_S = 60  # how long a metadata server that refuses connections (a VM still starting) is waited for
_TOKEN_RETRY_DELAYS = (1.0, 2.0, 4.0)  # seconds between tries when the token endpoint is down or 5xx


class CredentialsError(Exception):
    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status  # the token endpoint's HTTP status, or None for a key file or network problem

    refused = False  # no retry changes it (a refusal with its status says so itself)


class NoCredentials(CredentialsError):
    """No source gave a token, and none will by waiting: no key file named, no metadata server (off a GCE/TPU VM,
    or a VM without a service account), no gcloud login."""
    refused = True


class KeyFileError(CredentialsError):
    """The key file itself is unusable (unreadable, not a service-account key, a key that cannot sign): as with
    a refusal, no retry mends it."""
    refused = True


_token_lock = threading.Lock()
_token = None
_token_expiry = 0.0
_token_source = None  # the key file the cached token came from (None: metadata/gcloud)


def _transient(status):
    return status in (408, 429) or status >= 500


def _resolves(url):
    # a GCE/TPU VM names its metadata server from the start (/etc/hosts); elsewhere the name does not resolve
    parts = urllib.parse.urlsplit(url)
    try:
        socket.getaddrinfo(parts.hostname, parts.port or 80)
    except (OSError, UnicodeError):
        return False
    return True


def _token_from_metadata():
    """(token, seconds it lives), or why there is none: 'absent' (off a GCE/TPU VM: the metadata server's name
    does not resolve; or a VM without a service account), 'down' (the name resolves but no connection is made:
    a VM still starting) or 'busy' (a timeout, a 5xx: it may answer when asked again)."""
    if not _resolves(METADATA_TOKEN_URL):
        return "absent"
    try:
        r = requests.get(METADATA_TOKEN_URL, headers={"Metadata-Flavor": "Google"}, timeout=2)
    except requests.Timeout:
        return "busy"
    except requests.ConnectionError:
        return "down"
    except requests.RequestException:
        return "absent"
    if r.status_code != 200:
        return "busy" if _transient(r.status_code) else "absent"
    try:
        d = r.json()
        return d["access_token"], float(d.get("expires_in", 300))
    except (ValueError, TypeError, KeyError):  # no metadata server's answer: a captive portal's page, a proxy's
        return "absent"


def _token_from_metadata_at_start(stop):
    """_token_from_metadata(), where a metadata server that refuses connections before any source gave a token
    is asked again for up to METADATA_WAIT_S (or until stop() is True), said in one line: a restart script may
    start the trainer while the VM still boots, and on a pod one host stopping stops every host."""
    got, end = _token_from_metadata(), time.time() + METADATA_WAIT_S
    if got == "down" and _token is None:
        print(f"gcs: waiting up to {METADATA_WAIT_S} s for the VM metadata server at "
              f"{urllib.parse.urlsplit(METADATA_TOKEN_URL).netloc}, which refuses connections (a VM still "
              "starting?), for a GCS token", file=sys.stderr, flush=True)
    while got == "down" and _token is None and time.time() < end and not (stop and stop()):
        time.sleep(1.0)
        got = _token_from_metadata()
    return got


def _token_from_gcloud():
    try:
        p = subprocess.run(["gcloud", "auth", "print-access-token"], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0 or not p.stdout.strip():
        return None
    # gcloud doesn't report the expiry; tokens live ~1h but may be partly used, so re-ask soon
    return p.stdout.strip(), 300.0

# -----------------------------------------------------------------------------
# service-account key files (GOOGLE_APPLICATION_CREDENTIALS)

def _load_service_account(path):
    """The key file's dict, checked; every error names the file (never the key's contents)."""
    where = f"GOOGLE_APPLICATION_CREDENTIALS={path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise KeyFileError(f"{where}: cannot read the key file: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"{where}: the key file is not UTF-8 text") from None
    try:
        info = json.loads(text)
    except ValueError as e:
        raise KeyFileError(f"{where}: the key file is not valid JSON ({e})") from None
    if not isinstance(info, dict):
        raise KeyFileError(f"{where}: the key file is not a JSON object")
    kind = info.get("type")
    if kind != "service_account":
        hint = (" (user credentials from `gcloud auth application-default login`: unset "
                "GOOGLE_APPLICATION_CREDENTIALS and the gcloud CLI's login is used instead)"
                if kind == "authorized_user" else "")
        raise KeyFileError(f"{where}: credentials of type {kind!r} are not supported; only service-account "
                           f"key files (\"type\": \"service_account\") are{hint}")
    missing = [k for k in ("client_email", "private_key", "private_key_id") if not info.get(k)]
    if missing:
        raise KeyFileError(f"{where}: the service-account key file lacks {', '.join(missing)}")
    wrong = [k for k in ("client_email", "private_key", "private_key_id", "token_uri")
             if k in info and not isinstance(info[k], str)]
    if wrong:
        raise KeyFileError(f"{where}: in the key file, {', '.join(wrong)} must be text")
    return {**info, "token_uri": info.get("token_uri") or DEFAULT_TOKEN_URI}


def _signing_credentials(info, where):
    """google-auth's credentials for the key, with the storage scope, checked by signing once: a key google-auth
    cannot sign with is named here rather than failing inside the token exchange."""
    if service_account is None:
        raise KeyFileError(f"{where}: a service-account key file needs the google-auth package "
                           "(pip install -r requirements.txt)")
    # the PEM block's name, read before google-auth parses the key, says what an unusable key is
    block = re.search(r"-----BEGIN ([A-Z ]+)-----", info["private_key"])
    if not block or block.group(1) not in ("PRIVATE KEY", "RSA PRIVATE KEY"):
        raise KeyFileError(f"{where}: private_key is not a usable RSA private key: expected a PEM 'PRIVATE "
                           f"KEY' or 'RSA PRIVATE KEY' block, found "
                           f"{repr(block.group(1)) if block else 'no PEM block'} (encrypted keys are not "
                           "supported)")
    try:
        creds = service_account.Credentials.from_service_account_info(info, scopes=[GCS_SCOPE])
    except (ValueError, auth_errors.GoogleAuthError) as e:
        raise KeyFileError(f"{where}: private_key is not a usable RSA private key: {e}") from None
    try:
        creds.sign_bytes(b"")  # google-auth takes any PEM key here and finds out only when it signs
    except TypeError:  # an EC or Ed25519 key's sign() takes other arguments than RSA's
        raise KeyFileError(f"{where}: private_key is not a usable RSA private key: not an RSA key "
                           "(RS256 needs RSA)") from None
    return creds


class _Answer(Exception):
    def __init__(self, status, body):
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


class _OneRequest:
    """The transport google-auth refreshes through: its own `requests` transport with a bounded wait, where
    every answer but a 200 comes back as _Answer before google-auth's retry loop sees it. So which answers are
    retried, how often, and what a refusal says (with its HTTP status, which google-auth's errors lack) are
    decided here, as gcs.py decides them for every GCS request."""

    def __init__(self):
        self.transport = Request()

    def __call__(self, url, method="GET", body=None, headers=None, timeout=None, **kwargs):
        r = self.transport(url, method=method, body=body, headers=headers, timeout=TOKEN_TIMEOUT_S, **kwargs)
        if r.status != 200:
            raise _Answer(r.status, r.data)
        return r


def _refusal(token_uri, answer):
    """One line for a token endpoint's answer other than 200 (OAuth2: {"error": ..., "error_description": ...})."""
    text = answer.body.decode("utf-8", "replace") if isinstance(answer.body, bytes) else str(answer.body)
    try:
        d = json.loads(text)
        detail = ": ".join(str(d[k]) for k in ("error", "error_description") if d.get(k)) or text
    except (ValueError, TypeError, AttributeError):
        detail = text
    detail = " ".join(detail.split())[:300]  # a body on several lines stays one line
    return f"{token_uri} refused the token request: HTTP {answer.status} {detail}".rstrip()


def _token_from_service_account(path):
    """(access token, seconds it lives) from a service-account key file (the JWT bearer grant, RFC 7523)."""
    where = f"GOOGLE_APPLICATION_CREDENTIALS={path}"
    info = _load_service_account(path)
    creds, token_uri = _signing_credentials(info, where), info["token_uri"]
    for i in range(len(_TOKEN_RETRY_DELAYS) + 1):
        if i:
            time.sleep(_TOKEN_RETRY_DELAYS[i - 1])
        try:
            creds.refresh(_OneRequest())
        except auth_errors.TransportError as e:  # network trouble: worth another try
            problem = f"cannot reach {token_uri}: {e}"
            continue
        except _Answer as a:
            problem = _refusal(token_uri, a)
            if not _transient(a.status):
                raise CredentialsError(f"{where}: {problem}", a.status) from None  # a revoked key, clock skew
            continue
        except (auth_errors.RefreshError, ValueError) as e:  # a 200 without a token, or an unreadable expiry
            raise CredentialsError(f"{where}: {token_uri} answered without a usable access token: "
                                   f"{e.args[0] if e.args else e}") from None
        if creds.expiry is None:
            return creds.token, 3600.0
        # google-auth's expiry is a naive datetime in UTC
        return creds.token, creds.expiry.replace(tzinfo=datetime.timezone.utc).timestamp() - time.time()
    raise CredentialsError(f"{where}: {problem} (after {len(_TOKEN_RETRY_DELAYS) + 1} tries)")


def get_token(force_refresh=False, stop=None):
    """OAuth2 access token for GCS, or None when talking to an emulator. Cached until ~2 min before expiry.
    stop: a callable; True ends a wait for the metadata server."""
    global _token, _token_expiry, _token_source
    if os.environ.get("STORAGE_EMULATOR_HOST", "").strip().rstrip("/"):
        return None
    key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip() or None
    with _token_lock:
        # a token is reused only while the same source would be asked (the variable can change)
        if force_refresh or _token is None or key_file != _token_source or time.time() > _token_expiry - 120:
            if key_file:  # set: use it or fail loudly, never fall back to another identity
                got = _token_from_service_account(key_file)
            else:
                metadata = _token_from_metadata_at_start(stop)
                if isinstance(metadata, tuple):
                    got = metadata
                elif metadata == "down" and stop is not None and stop():
                    got = None  # the caller says why; gcloud would wait for the same metadata server
                else:
                    got = _token_from_gcloud()
            if got is None:
                # said where no source ever gave one (a run then stops at start, before it trains with nothing
                # saved); a busy metadata server, or a source that gave one before, is asked again
                error = CredentialsError if metadata == "busy" or _token is not None else NoCredentials
                server = (f"the VM metadata server at {urllib.parse.urlsplit(METADATA_TOKEN_URL).netloc} refuses "
                          "connections" if metadata == "down" else
                          "the VM metadata server is unreachable (not on a GCE/TPU VM?)")
                raise error(f"no GCS credentials: GOOGLE_APPLICATION_CREDENTIALS is not set, {server} and `gcloud "
                            "auth print-access-token` failed; set GOOGLE_APPLICATION_CREDENTIALS to a "
                            "service-account key file, run `gcloud auth login`, or set STORAGE_EMULATOR_HOST to use "
                            "a local emulator")
            _token, ttl = got
            _token_expiry, _token_source = time.time() + ttl, key_file
        return _token
