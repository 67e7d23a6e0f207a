"""
credentials.get_token() with GOOGLE_APPLICATION_CREDENTIALS service-account key files, end to end without
mocks: a real RSA key made by the openssl CLI, the JWT google-auth signs with it, and a real OAuth2 token
server on 127.0.0.1 that verifies the JWT's signature with openssl before it answers. Nothing outside
127.0.0.1 is contacted. Needs pytest, requests, google-auth and `openssl`.
"""
import base64
import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from runkeep import credentials  # noqa: E402
from runkeep import gcs  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
# the audience Google's token endpoint requires of a JWT, wherever the key file's token_uri points
AUDIENCE = "https://oauth2.googleapis.com/token"
EMAIL = "trainer@my-project.iam.gserviceaccount.com"
KEY_ID = "0123456789abcdef0123456789abcdef01234567"
METADATA_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
NO_VM = "metadata.invalid"  # a metadata host name that never resolves (RFC 6761): off a GCE/TPU VM


def _openssl(*args, input=None):
    p = subprocess.run(["openssl", *args], input=input, capture_output=True)
    assert p.returncode == 0, f"openssl {' '.join(args)} failed: {p.stderr.decode()}"
    return p.stdout


@pytest.fixture(scope="module")
def rsa_key(tmp_path_factory):
    """A fresh 2048-bit RSA key: paths of its PKCS#8 PEM, the same key as PKCS#1 PEM, and its public key."""
    d = tmp_path_factory.mktemp("rsa")
    pkcs8, pkcs1, pub = d / "key_pkcs8.pem", d / "key_pkcs1.pem", d / "pub.pem"
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pkcs8))
    _openssl("rsa", "-in", str(pkcs8), "-traditional", "-out", str(pkcs1))
    _openssl("rsa", "-in", str(pkcs8), "-pubout", "-out", str(pub))
    assert "BEGIN PRIVATE KEY" in pkcs8.read_text() and "BEGIN RSA PRIVATE KEY" in pkcs1.read_text()
    return dict(pkcs8=pkcs8, pkcs1=pkcs1, pub=pub, dir=d)


def _openssl_verifies(pub, message, signature, workdir):
    """True when openssl accepts signature as RS256 (RSA PKCS#1 v1.5, SHA-256) of message."""
    sig = workdir / f"sig-{threading.get_ident()}-{time.monotonic_ns()}.bin"
    sig.write_bytes(signature)
    try:
        p = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(pub), "-signature", str(sig)],
                           input=message, capture_output=True)
    finally:
        sig.unlink()
    return p.returncode == 0 and b"Verified OK" in p.stdout


def _b64url_decode(s):
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


class TokenServer:
    """A real OAuth2 token endpoint (JWT bearer grant, RFC 7523) on 127.0.0.1.

    POST /token verifies the JWT's RS256 signature with the public key (openssl) and its header and
    claims; it answers {"access_token": ...} or 400 {"error": "invalid_grant", ...} saying why.
    `refuse` (True: 400, or a status) makes it answer invalid_grant anyway; `fail_next` answers that many requests
    with 503.
    GET /metadata (or the real metadata path, for GCE_METADATA_HOST=127.0.0.1:port) plays the GCE metadata server's
    token URL, to test the order of credential sources;
    `metadata_fail_next` answers that many of its requests with 503; the stand-in bucket answers 401 to a token
    in `revoked`."""

    def __init__(self, pub, workdir, port=0):
        self.pub, self.workdir = pub, workdir
        self.hits, self.metadata_hits, self.rejections, self.claims, self.gcs_auth = 0, 0, [], [], []
        self.refuse, self.fail_next, self.expires_in, self.metadata_fail_next = False, 0, 3600, 0
        self.revoked = set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path in ("/metadata", METADATA_PATH) and self.headers.get("Metadata-Flavor") == "Google":
                    outer.metadata_hits += 1
                    if outer.metadata_fail_next:
                        outer.metadata_fail_next -= 1
                        return self.reply(503, {"error": "unavailable"})
                    return self.reply(200, {"access_token": "from-metadata", "expires_in": 3600})
                if self.path.startswith("/storage/v1/b/"):  # a stand-in bucket: records who asked
                    outer.gcs_auth.append(self.headers.get("Authorization"))
                    if self.headers.get("Authorization") in outer.revoked:
                        return self.reply(401, {"error": {"message": "Invalid Credentials"}})
                    return self.reply(200, {"name": "ckpt_00000100.pt"})
                self.reply(404, {"error": "not_found"})

            def do_POST(self):
                outer.hits += 1
                form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                if outer.fail_next:
                    outer.fail_next -= 1
                    return self.reply(503, {"error": "temporarily_unavailable"})
                why = outer.check(self.path, form)
                if why:
                    outer.rejections.append(why)
                    return self.reply(400, {"error": "invalid_grant", "error_description": why})
                if outer.refuse:
                    return self.reply(400 if outer.refuse is True else outer.refuse,
                                      {"error": "invalid_grant", "error_description": "Invalid JWT Signature."})
                self.reply(200, {"access_token": f"token-{outer.hits}", "expires_in": outer.expires_in,
                                 "token_type": "Bearer"})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.token_uri = self.url + "/token"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
        self.thread.start()

    def check(self, path, form):
        """Why the request is invalid, or None when it is a good JWT-bearer request."""
        if path != "/token":
            return f"wrong path {path}"
        if form.get("grant_type") != ["urn:ietf:params:oauth:grant-type:jwt-bearer"]:
            return f"wrong grant_type {form.get('grant_type')}"
        parts = form.get("assertion", [""])[0].split(".")
        if len(parts) != 3:
            return "assertion is not a JWT"
        header, claims = json.loads(_b64url_decode(parts[0])), json.loads(_b64url_decode(parts[1]))
        if not _openssl_verifies(self.pub, (parts[0] + "." + parts[1]).encode(), _b64url_decode(parts[2]),
                                 self.workdir):
            return "bad signature"
        if header != {"alg": "RS256", "typ": "JWT", "kid": KEY_ID}:
            return f"bad header {header}"
        if (claims.get("iss"), claims.get("scope"), claims.get("aud")) != (EMAIL, SCOPE, AUDIENCE):
            return f"bad iss/scope/aud {claims}"
        if claims["exp"] - claims["iat"] != 3600 or abs(claims["iat"] - time.time()) > 60:
            return f"bad iat/exp {claims}"
        self.claims.append(claims)
        return None

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def clean_env(monkeypatch):
    """No emulator (it would skip credentials), an empty token cache, and no way to reach a real
    credential source: the metadata server's name does not resolve (off a VM) and gcloud must not be run."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setattr(credentials, "_token", None)
    monkeypatch.setattr(credentials, "_token_expiry", 0.0)
    monkeypatch.setattr(credentials, "_token_source", None)
    monkeypatch.setattr(credentials, "METADATA_TOKEN_URL", f"http://{NO_VM}{METADATA_PATH}")
    monkeypatch.setattr(credentials, "_token_from_gcloud",
                        lambda: pytest.fail("gcloud must not be asked in these tests"))
    return monkeypatch


@pytest.fixture
def token_server(rsa_key):
    srv = TokenServer(rsa_key["pub"], rsa_key["dir"])
    try:
        yield srv
    finally:
        srv.close()


def write_key(path, pem_path=None, token_uri=None, **overrides):
    """A key file shaped like the ones the Cloud console downloads."""
    info = {"type": "service_account", "project_id": "my-project", "private_key_id": KEY_ID,
            "private_key": pem_path.read_text() if pem_path else "", "client_email": EMAIL,
            "client_id": "123456789012345678901", "token_uri": token_uri,
            "auth_uri": "https://accounts.google.com/o/oauth2/auth"}
    info.update(overrides)
    path.write_text(json.dumps({k: v for k, v in info.items() if v is not None}, indent=2))
    return str(path)


def test_service_account_token_is_fetched_and_cached(clean_env, token_server, rsa_key, tmp_path):
    key = write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri)
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", key)
    assert credentials.get_token() == "token-1", token_server.rejections
    assert credentials.get_token() == "token-1"  # cached: the endpoint was asked once
    assert token_server.hits == 1 and token_server.rejections == []
    assert credentials._token_expiry - time.time() == pytest.approx(3600, abs=30)
    assert credentials.get_token(force_refresh=True) == "token-2"
    assert token_server.hits == 2 and len(token_server.claims) == 2
    assert token_server.metadata_hits == 0


def test_gcs_client_sends_the_service_account_token(clean_env, token_server, rsa_key, tmp_path):
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri))
    client = gcs.GCS(endpoint=token_server.url, retries=0)
    assert client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert token_server.gcs_auth == ["Bearer token-1", "Bearer token-1"] and token_server.hits == 1


def test_a_metadata_server_that_fails_once_is_retried_by_the_client(clean_env, token_server):
    # a VM's metadata server answers 503 now and then: the client's own retries wait it out, as for the bucket
    clean_env.setattr(credentials, "METADATA_TOKEN_URL", token_server.url + "/metadata")
    clean_env.setattr(credentials, "_token_from_gcloud", lambda: None)
    token_server.metadata_fail_next = 1
    client = gcs.GCS(endpoint=token_server.url, retries=2, backoff=0.01)
    assert client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert token_server.metadata_hits == 2 and token_server.gcs_auth == ["Bearer from-metadata"]


def test_a_revoked_token_is_replaced_once_and_the_request_made_again(clean_env, token_server, rsa_key, tmp_path):
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri))
    client = gcs.GCS(endpoint=token_server.url, retries=0)
    assert client.exists("gs://bucket/run1/ckpt_00000100.pt")
    token_server.revoked.add("Bearer token-1")  # the bucket refuses the cached token before its expiry
    assert client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert token_server.gcs_auth == ["Bearer token-1", "Bearer token-1", "Bearer token-2"]
    token_server.revoked.add("Bearer token-2")
    token_server.refuse = True  # and the key no longer gets a token: one line naming the key file, no loop
    with pytest.raises(gcs.GCSError, match="sa.json"):
        client.exists("gs://bucket/run1/ckpt_00000100.pt")


def test_token_refreshed_shortly_before_expiry(clean_env, token_server, rsa_key, tmp_path):
    token_server.expires_in = 60  # inside get_token's 2-minute safety margin: every call asks again
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri))
    assert [credentials.get_token(), credentials.get_token()] == ["token-1", "token-2"], token_server.rejections


def test_pkcs1_key_in_key_file_works(clean_env, token_server, rsa_key, tmp_path):
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     write_key(tmp_path / "sa.json", rsa_key["pkcs1"], token_server.token_uri))
    assert credentials.get_token() == "token-1", token_server.rejections


def test_refused_exchange_names_key_file_and_error(clean_env, token_server, rsa_key, tmp_path):
    token_server.refuse = True
    key = write_key(tmp_path / "refused.json", rsa_key["pkcs8"], token_server.token_uri)
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", key)
    with pytest.raises(credentials.CredentialsError) as e:
        credentials.get_token()
    msg = str(e.value)
    assert key in msg and "HTTP 400" in msg and "invalid_grant" in msg and "Invalid JWT Signature" in msg, msg
    assert "\n" not in msg
    assert e.value.status == 400
    assert token_server.hits == 1  # a refusal is final: not retried
    assert credentials._token is None


def test_wrong_key_is_refused_by_a_verifying_server(clean_env, token_server, tmp_path):
    # a key the server doesn't know: the signature check on the server side must fail
    other = tmp_path / "other.pem"
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:1024", "-out", str(other))
    key = write_key(tmp_path / "other.json", other, token_server.token_uri)
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", key)
    with pytest.raises(credentials.CredentialsError, match="bad signature") as e:
        credentials.get_token()
    assert key in str(e.value) and token_server.rejections == ["bad signature"]


def test_token_endpoint_outage_is_retried(clean_env, token_server, rsa_key, tmp_path):
    clean_env.setattr(credentials, "_TOKEN_RETRY_DELAYS", (0.01, 0.01, 0.01))
    key = write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri)
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", key)
    token_server.fail_next = 2
    assert credentials.get_token() == "token-3", token_server.rejections
    token_server.fail_next = 10
    with pytest.raises(credentials.CredentialsError) as e:
        credentials.get_token(force_refresh=True)
    assert key in str(e.value) and "HTTP 503" in str(e.value) and "4 tries" in str(e.value)
    assert token_server.hits == 3 + 4


def test_unreachable_token_endpoint(clean_env, rsa_key, tmp_path):
    clean_env.setattr(credentials, "_TOKEN_RETRY_DELAYS", (0.01,))
    key = write_key(tmp_path / "sa.json", rsa_key["pkcs8"], "http://127.0.0.1:9/token")
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", key)
    with pytest.raises(credentials.CredentialsError, match="cannot reach http://127.0.0.1:9/token") as e:
        credentials.get_token()
    assert key in str(e.value)


def one_line_error(path):
    """The CredentialsError get_token() raises for the key file at path: one line that names the file and no key
    material."""
    with pytest.raises(credentials.CredentialsError) as e:
        credentials.get_token()
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    assert "BEGIN PRIVATE KEY" not in msg and "MII" not in msg  # never echo key material
    return msg


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read the key file"),
    ("{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"type": "authorized_user", "client_id": "x", "client_secret": "y", "refresh_token": "z"}),
     "type 'authorized_user' are not supported; only service-account key files"),
    (json.dumps({"type": "external_account"}), "type 'external_account' are not supported"),
    (json.dumps({"private_key": "x"}), "type None are not supported"),
    (json.dumps({"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\n"}),
     "lacks client_email, private_key_id"),
    (json.dumps({"type": "service_account", "client_email": EMAIL, "private_key_id": KEY_ID}),
     "lacks private_key"),
    (json.dumps({"type": "service_account", "client_email": EMAIL, "private_key_id": KEY_ID, "private_key": 5}),
     "private_key must be text"),
])
def test_bad_key_files_say_what_is_wrong(clean_env, tmp_path, content, expected):
    path = tmp_path / "key.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    assert expected in one_line_error(path)


def test_a_bad_key_file_is_one_gcs_error_for_the_client(clean_env, token_server, rsa_key, tmp_path):
    # the GCS client's callers catch gcs.GCSError: a credential problem reaches them as one, with its status
    client = gcs.GCS(endpoint=token_server.url, retries=0)
    path = tmp_path / "key.json"
    path.write_text("{not json")
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    with pytest.raises(gcs.GCSError, match="not valid JSON") as e:
        client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert str(path) in str(e.value) and e.value.status is None and e.value.refused  # no retry mends the file
    token_server.refuse = True
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri))
    with pytest.raises(gcs.GCSError, match="Invalid JWT Signature") as e:
        client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert e.value.status == 400 and e.value.refused and token_server.gcs_auth == []


def test_authorized_user_message_says_what_to_do(clean_env, tmp_path):
    path = tmp_path / "adc.json"
    path.write_text(json.dumps({"type": "authorized_user", "refresh_token": "secret-refresh-token"}))
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    with pytest.raises(credentials.CredentialsError) as e:
        credentials.get_token()
    msg = str(e.value)
    assert '"type": "service_account"' in msg and "unset GOOGLE_APPLICATION_CREDENTIALS" in msg
    assert "secret-refresh-token" not in msg


def test_unusable_private_keys(clean_env, rsa_key, tmp_path):
    ec = tmp_path / "ec.pem"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(ec))
    truncated = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n"
    for pem, expected in [(ec.read_text(), "not an RSA key"),
                          ("hello", "no PEM block"),
                          ("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n",
                           "'ENCRYPTED PRIVATE KEY'"),
                          (truncated, ""),  # google-auth's own words say what is wrong with the bytes
                          (rsa_key["pkcs8"].read_text()[:200] + "\n-----END PRIVATE KEY-----\n", "")]:
        path = tmp_path / "k.json"
        write_key(path, private_key=pem, token_uri="http://127.0.0.1:9/token")
        clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
        msg = one_line_error(path)
        assert "private_key is not a usable RSA private key" in msg and expected in msg, msg


def test_credential_order(clean_env, token_server, rsa_key, tmp_path):
    clean_env.setattr(credentials, "METADATA_TOKEN_URL", token_server.url + "/metadata")
    # no key file: the metadata server is used
    assert credentials.get_token() == "from-metadata" and token_server.metadata_hits == 1
    # a key file comes before the metadata server (and replaces the token cached from it)
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     write_key(tmp_path / "sa.json", rsa_key["pkcs8"], token_server.token_uri))
    assert credentials.get_token() == "token-1" and token_server.metadata_hits == 1
    # a broken key file is an error, never a silent fall-back to another identity
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(credentials.CredentialsError, match="missing.json"):
        credentials.get_token()
    assert token_server.metadata_hits == 1
    # the emulator comes first of all: no token, the key file isn't even read
    clean_env.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")
    assert credentials.get_token() is None
    # an empty variable counts as unset
    clean_env.delenv("STORAGE_EMULATOR_HOST")
    clean_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
    assert credentials.get_token() == "from-metadata" and token_server.metadata_hits == 2


@pytest.mark.parametrize("content", [None, "{not json",
                                     json.dumps({"type": "service_account", "client_email": EMAIL,
                                                 "private_key_id": KEY_ID})])
def test_a_broken_key_file_stops_a_new_run_at_start(toy, tmp_path, content):
    # the key file cannot mend itself while the run trains: training on would upload nothing, and a spot VM's
    # preemption would take every checkpoint with it
    from conftest import TOY_ARGS, assert_user_error, run
    key = tmp_path / "key.json"
    if content is not None:
        key.write_text(content)
    p = run(["train.py", f"--data_path={toy}", "--out_dir=gs://bucket/run1", f"--local_dir={tmp_path / 'l'}",
             "--max_steps=2"] + TOY_ARGS, check=False,
            env=dict(STORAGE_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=str(key)))
    assert_user_error(p, f"GOOGLE_APPLICATION_CREDENTIALS={key}")
    assert "step 1" not in p.stdout and "step 2" not in p.stdout and "HTTP None" not in p.stdout + p.stderr


@pytest.mark.parametrize("where", ["out_dir", "data_path"])
def test_no_credentials_at_all_stop_a_gs_run_at_start(toy, tmp_path, where):
    # no key file, no metadata server, gcloud (if installed) without a login: no retry finds credentials, and a run
    # trained on would save nothing in the bucket
    from conftest import TOY_ARGS, assert_user_error, run
    paths = dict(out_dir=f"--out_dir={tmp_path / 'out'}", data_path=f"--data_path={toy}")
    paths[where] = f"--{where}=gs://bucket/run1"
    p = run(["train.py", *paths.values(), f"--local_dir={tmp_path / 'l'}", "--max_steps=2", "--gcs_retries=1"]
            + TOY_ARGS, check=False,
            env=dict(STORAGE_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=None,
                     GCE_METADATA_HOST=NO_VM, CLOUDSDK_CONFIG=str(tmp_path / "gcloud")))
    said = assert_user_error(p, "no GCS credentials", "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key "
                             "file", one_line=True)
    assert "gs://bucket/run1" in said and "attempts" not in said
    assert "step 1" not in p.stdout and "warning" not in p.stdout + p.stderr


def test_no_credentials_are_final_only_before_any_source_gave_a_token(clean_env, token_server):
    clean_env.setattr(credentials, "_token_from_gcloud", lambda: None)
    client = gcs.GCS(endpoint=token_server.url, retries=3, backoff=0.01)
    with pytest.raises(gcs.GCSError, match="no GCS credentials") as e:  # nothing to wait for: said at once
        client.exists("gs://bucket/run1/ckpt_00000100.pt")
    assert e.value.refused and "attempts" not in str(e.value)
    clean_env.setattr(credentials, "METADATA_TOKEN_URL", token_server.url + "/metadata")
    assert client.exists("gs://bucket/run1/ckpt_00000100.pt")
    # the metadata server that gave the token stops answering: the run's uploads retry it, as any outage
    clean_env.setattr(credentials, "METADATA_TOKEN_URL", "http://127.0.0.1:9/unreachable")
    with pytest.raises(credentials.CredentialsError) as e:
        credentials.get_token(force_refresh=True)
    assert not e.value.refused


@pytest.mark.parametrize("status", [400, 401])
def test_a_revoked_key_stops_a_run_at_start_naming_the_key_not_the_bucket(token_server, rsa_key, toy, tmp_path,
                                                                           status):
    # the token endpoint refused the key: no request reached the bucket, whose name and permissions are not in doubt
    from conftest import TOY_ARGS, assert_user_error, free_port, run
    token_server.refuse = status
    key = write_key(tmp_path / "revoked.json", rsa_key["pkcs8"], token_server.token_uri)
    p = run(["train.py", f"--data_path={toy}", "--out_dir=gs://bucket/run1", f"--local_dir={tmp_path / 'l'}",
             "--max_steps=2"] + TOY_ARGS, check=False,
            env=dict(STORAGE_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=key,
                     GCE_METADATA_HOST=f"127.0.0.1:{free_port()}"))
    said = assert_user_error(p, f"GOOGLE_APPLICATION_CREDENTIALS={key}", f"HTTP {status}", one_line=True)
    assert "bucket bucket" not in said and "check that the bucket exists" not in said, said
    assert "step 1" not in p.stdout


def run_while_the_metadata_server_refuses(emulator, toy, tmp_path, out_dir, when_waiting):
    """train.py to out_dir on the emulator as on real GCS (no STORAGE_EMULATOR_HOST: its requests carry a token, sent
    to the emulator by a site hook) with GCE_METADATA_HOST at a port where nothing listens: (its line on stderr
    saying what it waits for, the rest of its stderr, its exit code). when_waiting(port, process) is called once it
    says so (or it ended without waiting)."""
    from conftest import TOY_ARGS, free_port, script_env, site_hook
    port = free_port()
    hook = site_hook(tmp_path / "hook", f"import runkeep.gcs\nrunkeep.gcs.GCS_ENDPOINT = {emulator!r}\n")
    env = script_env(dict(STORAGE_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=None,
                          GCE_METADATA_HOST=f"127.0.0.1:{port}", CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), **hook))
    with open(tmp_path / "stdout.txt", "w") as stdout:
        p = subprocess.Popen([sys.executable, "train.py", f"--data_path={toy}", f"--out_dir={out_dir}",
                              f"--local_dir={tmp_path / 'l'}", "--max_steps=2"] + TOY_ARGS, cwd=ROOT, env=env,
                             stdout=stdout, stderr=subprocess.PIPE, text=True)
        try:
            said = ""
            for said in p.stderr:
                if "waiting" in said:
                    break
            with when_waiting(port, p):
                rest = p.stderr.read()
                p.wait(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
    assert f"metadata server at 127.0.0.1:{port}" in said and "waiting up to" in said, said + rest
    return said, rest, p.returncode


def test_a_metadata_server_that_refuses_connections_at_first_is_waited_for_at_start(emulator, rsa_key, toy, tmp_path):
    # a VM's metadata server may refuse connections for some seconds while the VM boots (a spot VM's restart script
    # starts train.py early); on a pod every host starts at once, and one host stopping would stop them all
    from conftest import BUCKET
    out_dir, servers = f"gs://{BUCKET}/refused_at_first", []

    @contextlib.contextmanager
    def serve(port, p):  # only now does anything listen there
        servers.append(TokenServer(rsa_key["pub"], rsa_key["dir"], port=port))
        try:
            yield
        finally:
            servers[0].close()
    said, rest, code = run_while_the_metadata_server_refuses(emulator, toy, tmp_path, out_dir, serve)
    assert code == 0 and servers[0].metadata_hits > 0, said + rest
    saved = [uri for uri, _ in gcs.GCS(endpoint=emulator, retries=0).list(out_dir + "/")]
    assert f"{out_dir}/ckpt_00000002.pt" in saved, saved


def test_a_stop_ends_the_wait_for_the_metadata_server(emulator, toy, tmp_path):
    # a spot VM preempted while it boots: the run stops at once, as in any other wait at start, and says so
    from conftest import BUCKET

    @contextlib.contextmanager
    def stop(port, p):
        p.send_signal(signal.SIGTERM)
        yield
    said, rest, code = run_while_the_metadata_server_refuses(emulator, toy, tmp_path, f"gs://{BUCKET}/stopped", stop)
    assert code != 0 and "a stop was requested" in rest and "no GCS credentials" not in rest, said + rest


def test_a_metadata_server_that_keeps_refusing_ends_in_no_credentials(clean_env, capsys):
    from conftest import free_port
    clean_env.setattr(credentials, "METADATA_TOKEN_URL", f"http://127.0.0.1:{free_port()}{METADATA_PATH}")
    clean_env.setattr(credentials, "_token_from_gcloud", lambda: None)
    clean_env.setattr(credentials, "METADATA_WAIT_S", 0.1)
    with pytest.raises(credentials.NoCredentials, match="refuses connections") as e:
        credentials.get_token()
    assert "\n" not in str(e.value) and "not on a GCE/TPU VM" not in str(e.value)
    waited = capsys.readouterr().err.splitlines()
    assert len(waited) == 1 and "metadata server at 127.0.0.1" in waited[0], waited
    # off a VM (the metadata server's name does not resolve) there is nothing to wait for: said at once
    clean_env.setattr(credentials, "METADATA_TOKEN_URL", f"http://{NO_VM}{METADATA_PATH}")
    with pytest.raises(credentials.NoCredentials, match="not on a GCE/TPU VM"):
        credentials.get_token()
    assert capsys.readouterr().err == ""


def test_a_page_that_is_no_metadata_servers_answer_is_no_credentials(server, toy, tmp_path):
    # off a VM, a captive portal or a proxy may answer for the metadata server's name with a page of its own
    from conftest import FileHandler, TOY_ARGS, assert_user_error, run
    FileHandler.files[METADATA_PATH] = b"<html>Sign in to the hotel's Wi-Fi</html>"
    p = run(["train.py", f"--data_path={toy}", "--out_dir=gs://bucket/run1", f"--local_dir={tmp_path / 'l'}",
             "--max_steps=2"] + TOY_ARGS, check=False,
            env=dict(STORAGE_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=None,
                     GCE_METADATA_HOST=server.replace("http://", ""), CLOUDSDK_CONFIG=str(tmp_path / "gcloud")))
    assert_user_error(p, "no GCS credentials", "not on a GCE/TPU VM", one_line=True)
    assert (METADATA_PATH, None, 200) in FileHandler.log
