"""Issue 30 (hardening, round two) items 4 and Low, issue 36 item 8, against running nodes: who a
username proves to be, session takeover under certificate identities, Mosquitto password files,
credentials reloaded without a restart, SIGHUP on a node without TLS, revoked certificates, and the
temporary files of ``moorline passwd`` / ``moorline token``."""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from e2e_broker import REPO_ROOT, BrokerFactory, BrokerProc
from listener_support import client_tls_context, dev_certs, listener_ports, tls_config, wait_log
from rawclient import ConnectionClosed, RawClient

from moorline.certs import DevCertificates, write_dev_certificates

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]


def tls_raw(port: int, ctx: ssl.SSLContext, version: int = 4) -> RawClient:
    """A RawClient over TLS (its socket replaced by the wrapped one)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    client = RawClient.__new__(RawClient)
    client.version = version
    client.sock = ctx.wrap_socket(raw, server_hostname="localhost")
    client.buf = bytearray()
    client.next_pid = 1
    client.closed = False
    client.pending = []
    return client


def second_client(certs: DevCertificates, base: Path, name: str) -> tuple[Path, Path]:
    """Another client certificate (CN ``name``) from the same dev CA."""
    other = write_dev_certificates(base / f"client-{name}", ["localhost"], client=name,
                                   ca=(certs.ca_cert, certs.ca_key))
    return other.client_cert, other.client_key


def test_a_certificate_holder_cannot_take_over_another_users_session(broker_factory: BrokerFactory,
                                                                      tmp_path: Path) -> None:
    """Attack: with client certificates as logins and no password file, bob connects with alice's
    client id and is handed her session (her queued messages go to him, or to nothing)."""
    certs = dev_certs(tmp_path, client="alice")
    bob_cert, bob_key = second_client(certs, tmp_path, "bob")
    broker = broker_factory(config_text=tls_config(certs, require_client_cert=True, identity=True))
    port = listener_ports(broker)["mqtts"]
    alice = tls_raw(port, client_tls_context(certs.ca_cert, certs.client_cert, certs.client_key))
    assert alice.connect("alice-phone", clean=False).reason == 0
    assert alice.subscribe([("alice/inbox", 1)]).reasons == [1]
    alice.disconnect()
    bob = tls_raw(port, client_tls_context(certs.ca_cert, bob_cert, bob_key))
    ack = bob.connect("alice-phone", clean=False)
    assert ack.reason == 5, ack  # 3.1.1 "not authorized": the session is alice's
    bob.close()
    # alice still has her session
    alice = tls_raw(port, client_tls_context(certs.ca_cert, certs.client_cert, certs.client_key))
    ack = alice.connect("alice-phone", clean=False)
    assert ack.reason == 0 and ack.session_present, ack
    alice.disconnect()


CERT_IDENTITY_OPEN = """
[auth]
allow_anonymous = true
admin_users = ["alice"]

[[auth.acl]]
user = "alice"
action = "all"
pattern = "secret/#"

[[auth.acl]]
action = "all"
pattern = "%u/#"

[[auth.acl]]
action = "all"
pattern = "public/#"
"""


def test_an_unproven_username_on_a_plain_listener_gets_none_of_that_users_rights(
        broker_factory: BrokerFactory, tmp_path: Path) -> None:
    """Attack: with certificate identities and allow_anonymous, a client of the plain listener sends
    username "alice" and no password, and is given alice's ACL, %u space, admin $SYS and session."""
    certs = dev_certs(tmp_path, client="alice")
    broker = broker_factory(config_text=tls_config(certs, require_client_cert=True, identity=True,
                                                   auth=CERT_IDENTITY_OPEN))
    port = listener_ports(broker)["mqtts"]
    real = tls_raw(port, client_tls_context(certs.ca_cert, certs.client_cert, certs.client_key), version=5)
    assert real.connect("alice-laptop", clean=False, props=[(0x11, 3600)]).reason == 0
    assert real.subscribe([("secret/#", 1), ("alice/#", 1), ("$SYS/#", 0)]).reasons == [1, 1, 0]  # the real alice
    real.disconnect()

    fake = RawClient("127.0.0.1", broker.mqtt_port, version=5)
    assert fake.connect("fake-1", username="alice").reason == 0  # anonymous allowed: accepted, as a label
    assert fake.subscribe([("secret/#", 1), ("alice/#", 1), ("$SYS/#", 0), ("public/#", 1)]).reasons == [
        0x87, 0x87, 0x87, 1]
    assert fake.publish_and_wait("secret/plans", b"forged").reason == 0x87
    assert fake.publish_and_wait("public/news", b"ok").reason == 0
    fake.disconnect()
    # ... and never reaches the real alice's session
    fake = RawClient("127.0.0.1", broker.mqtt_port, version=5)
    ack = fake.connect("alice-laptop", clean=False, props=[(0x11, 3600)], username="alice")
    assert ack.reason == 0x87, ack
    fake.close()


OPEN_NODE_WITH_USERS = """
[auth]
admin_users = ["ops"]

[[auth.acl]]
user = "ops"
action = "all"
pattern = "ops/#"

[[auth.acl]]
action = "all"
pattern = "public/#"
"""


def test_a_username_and_password_on_an_open_node_are_accepted_but_carry_no_configured_rights(
        broker_factory: BrokerFactory) -> None:
    """Issue 36.8: on an open node without a password file, a CONNECT with a username and password is
    accepted (Mosquitto's allow_anonymous). Attack: naming a configured user ("ops") gains its rights."""
    broker = broker_factory(config_text=OPEN_NODE_WITH_USERS)
    c = RawClient("127.0.0.1", broker.mqtt_port, version=5)
    ack = c.connect("any-client", username="ops", password=b"anything")
    assert ack.reason == 0, ack
    assert c.subscribe([("ops/#", 1), ("public/#", 1), ("$SYS/#", 0)]).reasons == [0x87, 1, 0x87]
    c.disconnect()
    v3 = RawClient("127.0.0.1", broker.mqtt_port, version=4)
    assert v3.connect("any-client-3", username="someone", password=b"pw").reason == 0
    v3.disconnect()
    # over HTTP the unproven name is served as the anonymous caller of this open node is, no more
    auth = "Basic " + base64.b64encode(b"ops:anything").decode()
    req = urllib.request.Request(broker.http_url + "/v1/health", headers={"Authorization": auth})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _mosquitto_passwd(path: Path, user: str, password: str, algorithm: str) -> None:
    subprocess.run(["mosquitto_passwd", "-H", algorithm, *(["-c"] if not path.exists() else []), "-b", str(path),
                    user, password], check=True, capture_output=True, timeout=30)


@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd not installed")
def test_a_mosquitto_password_file_logs_its_users_in(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    """Issue 36.8: users bring their mosquitto_passwd file (PBKDF2-SHA512 $7$ and the older sha512 $6$)."""
    pw = tmp_path / "mosquitto.passwd"
    _mosquitto_passwd(pw, "alice", "wonderland", "sha512-pbkdf2")
    _mosquitto_passwd(pw, "bob", "builder", "sha512")
    broker = broker_factory(config_text=f'[auth]\npassword_file = "{pw}"\nallow_anonymous = false\n')
    for user, password, expected in (("alice", b"wonderland", 0), ("bob", b"builder", 0),
                                     ("alice", b"wrong", 0x86), ("bob", b"wonderland", 0x86)):
        c = RawClient("127.0.0.1", broker.mqtt_port, version=5)
        assert c.connect(f"c-{user}", username=user, password=password).reason == expected, (user, password)
        c.close()


def _login(broker: BrokerProc, user: str, password: bytes) -> int:
    c = RawClient("127.0.0.1", broker.mqtt_port, version=5)
    try:
        return c.connect(f"c-{user}-{time.monotonic_ns()}", username=user, password=password).reason
    finally:
        c.close()


def _moorline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moorline.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=str(REPO_ROOT), env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def _http_status(broker: BrokerProc, token: str) -> int:
    req = urllib.request.Request(broker.http_url + "/v1/drops", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_a_removed_user_or_reissued_token_stops_working_without_a_restart(broker_factory: BrokerFactory,
                                                                          tmp_path: Path) -> None:
    """Attack: a user whose password was removed, or whose token was re-issued, keeps logging in
    until the node restarts. Now: on SIGHUP, and when the file changes."""
    pw, tokens = tmp_path / "passwd", tmp_path / "tokens"
    for user in ("alice", "bob"):
        assert _moorline("passwd", str(pw), user, f"{user}-pw").returncode == 0
    old_token = _moorline("token", str(tokens), "ops").stdout.strip()
    broker = broker_factory(config_text=f'[auth]\npassword_file = "{pw}"\ntoken_file = "{tokens}"\n'
                                        f'allow_anonymous = false\nadmin_users = ["ops"]\ncredentials_poll_s = 0\n')
    assert _login(broker, "bob", b"bob-pw") == 0
    assert _http_status(broker, old_token) == 200
    # SIGHUP (polling is off in this node)
    pw.write_text("".join(line + "\n" for line in pw.read_text().splitlines() if not line.startswith("bob:")))
    new_token = _moorline("token", str(tokens), "ops").stdout.strip()
    broker.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_log(broker, "SIGHUP: password/token files reloaded")
    assert _login(broker, "bob", b"bob-pw") == 0x86
    assert _login(broker, "alice", b"alice-pw") == 0
    assert _http_status(broker, old_token) == 401
    assert _http_status(broker, new_token) == 200
    broker.stop_clean()

    # on file change, without a signal
    polled = broker_factory(config_text=f'[auth]\npassword_file = "{pw}"\nallow_anonymous = false\n'
                                        f'credentials_poll_s = 0.2\n')
    assert _login(polled, "alice", b"alice-pw") == 0
    assert _moorline("passwd", str(pw), "alice", "changed").returncode == 0
    assert wait_log(polled, "file changed: password/token files reloaded")
    assert _login(polled, "alice", b"alice-pw") == 0x86
    assert _login(polled, "alice", b"changed") == 0
    # a file that no longer parses keeps the users it had
    pw.write_text("garbage line without a hash\n")
    assert wait_log(polled, "password/token files not reloaded")
    assert _login(polled, "alice", b"changed") == 0


def test_sighup_does_not_kill_a_node_without_a_tls_listener(broker_factory: BrokerFactory) -> None:
    """Attack (or an operator's habit): SIGHUP to a node with no TLS listener ended it, with no log line."""
    broker = broker_factory()
    broker.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_log(broker, "SIGHUP: no TLS listener")
    time.sleep(0.3)
    assert broker.running
    assert _login(broker, "anyone", b"x") == 0  # still serving


@pytest.mark.parametrize("command", ["passwd", "token"])
def test_moorline_passwd_and_token_do_not_follow_a_planted_symlink(tmp_path: Path, command: str) -> None:
    """Attack: a local user plants FILE.tmp -> a file of theirs; `moorline passwd|token FILE ...` wrote
    the new secrets through the link (readable by them), and left FILE a symlink."""
    target = tmp_path / "secrets-file"
    stolen = tmp_path / "attacker-readable"
    stolen.write_text("")
    os.chmod(stolen, 0o666)
    (tmp_path / "secrets-file.tmp").symlink_to(stolen)
    args = [command, str(target), "alice"] + (["s3cret"] if command == "passwd" else [])
    old_umask = os.umask(0)
    try:
        proc = _moorline(*args)
    finally:
        os.umask(old_umask)
    assert proc.returncode == 0, proc.stderr
    assert stolen.read_text() == "", "the secrets went through the planted symlink"
    assert not target.is_symlink()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_text().startswith("alice:")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".secrets-file.")]  # no temp file left


def _revoke(certs: DevCertificates, cert_path: Path, out: Path) -> Path:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca_cert = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), password=None)
    revoked = x509.load_pem_x509_certificate(cert_path.read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    entry = x509.RevokedCertificateBuilder().serial_number(revoked.serial_number).revocation_date(now).build()
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
           .last_update(now - datetime.timedelta(minutes=5)).next_update(now + datetime.timedelta(days=1))
           .add_revoked_certificate(entry).sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    out.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    return out


def test_a_revoked_client_certificate_is_refused(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    """Attack: a client certificate the CA revoked (tls.crl_file) still logs in as its user."""
    certs = dev_certs(tmp_path, client="alice")
    bob_cert, bob_key = second_client(certs, tmp_path, "bob")
    crl = _revoke(certs, bob_cert, tmp_path / "ca.crl")
    broker = broker_factory(config_text=tls_config(certs, require_client_cert=True, identity=True).replace(
        "[tls]\n", f'[tls]\ncrl_file = "{crl}"\n'))
    port = listener_ports(broker)["mqtts"]
    alice = tls_raw(port, client_tls_context(certs.ca_cert, certs.client_cert, certs.client_key))
    assert alice.connect("alice-1").reason == 0
    alice.disconnect()
    with pytest.raises((ssl.SSLError, ConnectionClosed, ConnectionResetError, BrokenPipeError, TimeoutError)):
        bob = tls_raw(port, client_tls_context(certs.ca_cert, bob_cert, bob_key))
        bob.connect("bob-1")  # TLS 1.3: the refusal arrives after the client's Finished


def test_an_unproven_http_name_cannot_poison_the_real_users_producer(broker_factory: BrokerFactory,
                                                                     tmp_path: Path) -> None:
    """Attack (opened by accepting unproven names, issue 36.8): on a node whose HTTP users are proven
    by tokens, a Basic login naming "spark" (no password file checks it) publishes with the real
    spark's producer id and a high sequence, so the real spark's next messages are "duplicate"."""
    tokens = tmp_path / "tokens"
    token = _moorline("token", str(tokens), "spark").stdout.strip()
    broker = broker_factory(config_text=f'[auth]\ntoken_file = "{tokens}"\n')
    producer = "00000000000000aa"

    def publish(auth: str, seq: int) -> dict[str, object]:
        body = json.dumps({"messages": [{"topic": "sink/t", "payload": "", "producer": producer, "seq": seq}]})
        req = urllib.request.Request(broker.http_url + "/v1/publish", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": auth})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["results"][0]  # type: ignore[no-any-return]

    fake = "Basic " + base64.b64encode(b"spark:guess").decode()
    assert publish(fake, 1000)["status"] == "ok"  # accepted: an open loopback node, an unproven name
    assert publish(f"Bearer {token}", 1)["status"] == "ok"  # the real spark's sequence is its own
