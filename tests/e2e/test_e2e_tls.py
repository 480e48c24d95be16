"""MQTT over TLS (listeners.mqtts): mosquitto clients with the dev CA, a wrong CA refused, client
certificates as logins (tls.use_identity_as_username) with their ACLs, certificates reloaded on
SIGHUP without dropping connections, handshakes bounded in time and counted as pending connections."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from e2e_broker import BrokerFactory
from e2e_support import wait_until
from listener_support import (
    broker_errors,
    client_tls_context,
    dev_certs,
    listener_ports,
    paho_client,
    tls_config,
    wait_log,
    ws_raw_client,
)

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]


def _tls_args(certs_dir: Path, port: int, *, ca: Path | None = None, client: bool = False) -> list[str]:
    args = ["-h", "127.0.0.1", "-p", str(port), "--cafile", str(ca or certs_dir / "ca.crt")]
    if client:
        args += ["--cert", str(certs_dir / "client.crt"), "--key", str(certs_dir / "client.key")]
    return args


@pytest.mark.parametrize("version", ["311", "5"])
def test_mosquitto_clients_over_tls_with_the_dev_ca(broker_factory: BrokerFactory, tmp_path: Path,
                                                    uniq: str, version: str) -> None:
    certs = dev_certs(tmp_path)
    broker = broker_factory(config_text=tls_config(certs))
    port = listener_ports(broker)["mqtts"]
    args = _tls_args(certs.ca_cert.parent, port)
    # retained, so the subscriber started next gets it whenever its subscription lands
    pub = subprocess.run(["mosquitto_pub", *args, "-t", f"{uniq}/t0", "-q", "1", "-r", "-m", "m0", "-V", version],
                         capture_output=True, timeout=30)
    assert pub.returncode == 0, pub.stderr
    sub = subprocess.Popen(["mosquitto_sub", *args, "-t", f"{uniq}/#", "-q", "1", "-v", "-C", "2", "-W", "30",
                            "-V", version], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert sub.stdout is not None
        assert sub.stdout.readline().decode().strip() == f"{uniq}/t0 m0"  # subscribed over TLS
        pub = subprocess.run(["mosquitto_pub", *args, "-t", f"{uniq}/t1", "-q", "1", "-m", "m1", "-V", version],
                             capture_output=True, timeout=30)
        assert pub.returncode == 0, pub.stderr
        out, err = sub.communicate(timeout=40)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    lines = out.decode().splitlines()
    assert lines == [f"{uniq}/t1 m1"], (lines, err)
    # the plain listener is still there, and no TLS handshake logged an error
    assert subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.mqtt_port), "-t", f"{uniq}/p",
                           "-m", "x", "-q", "1"], capture_output=True, timeout=30).returncode == 0
    assert broker_errors(broker) == []


def test_a_wrong_ca_is_refused(broker_factory: BrokerFactory, tmp_path: Path, uniq: str) -> None:
    certs = dev_certs(tmp_path)
    other = dev_certs(tmp_path, "other")
    broker = broker_factory(config_text=tls_config(certs))
    port = listener_ports(broker)["mqtts"]
    pub = subprocess.run(["mosquitto_pub", *_tls_args(certs.ca_cert.parent, port, ca=other.ca_cert), "-t", uniq,
                          "-m", "x", "-q", "1"], capture_output=True, timeout=30)
    assert pub.returncode != 0
    assert b"certificate verify failed" in pub.stderr or b"TLS" in pub.stderr, pub.stderr
    # the same with Python's ssl, and a client that speaks plain MQTT to the TLS port
    with pytest.raises(ssl.SSLCertVerificationError):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            client_tls_context(other.ca_cert).wrap_socket(raw, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")  # a plain CONNECT, no TLS
        raw.settimeout(10)
        try:
            while raw.recv(100):  # perhaps a TLS alert, then the close: never a CONNACK
                pass
        except ConnectionResetError:
            pass
    ok = subprocess.run(["mosquitto_pub", *_tls_args(certs.ca_cert.parent, port), "-t", uniq, "-m", "x", "-q", "1"],
                        capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert broker_errors(broker) == []


ACL_FOR_CERT_USERS = """
[auth]
allow_anonymous = false

[[auth.acl]]
action = "all"
pattern = "%u/#"
"""


@pytest.mark.parametrize("version", [4, 5])
def test_client_certificate_is_the_login_and_its_acl_applies(broker_factory: BrokerFactory, tmp_path: Path,
                                                              uniq: str, version: int) -> None:
    certs = dev_certs(tmp_path, client="sensor-7")
    broker = broker_factory(config_text=tls_config(certs, listeners=("mqtts", "wss"), require_client_cert=True,
                                                   identity=True, auth=ACL_FOR_CERT_USERS))
    port = listener_ports(broker)["mqtts"]
    ctx = client_tls_context(certs.ca_cert, certs.client_cert, certs.client_key)
    sub = paho_client(port, version, tls=ctx)
    sub.connect()  # no username, no password: the certificate's CN is the login
    codes = sub.subscribe("sensor-7/#", qos=1)
    assert _code(codes[0]) == 1, codes
    denied = sub.subscribe(f"{uniq}/#", qos=1)  # another user's space: the ACL says no
    assert _code(denied[0]) in (0x80, 0x87), denied
    pub = paho_client(port, version, tls=ctx)
    pub.connect()
    assert _code(pub.publish(f"sensor-7/{uniq}", b"reading", qos=1)) == 0
    msg = sub.get()
    assert (msg.topic, msg.payload) == (f"sensor-7/{uniq}", b"reading")
    if version == 5:
        refused = pub.publish(f"{uniq}/x", b"no", qos=1)
        assert _code(refused) == 0x87, refused  # publish ACL for the certificate's user
    sub.disconnect()
    pub.disconnect()
    # A username in CONNECT does not override the certificate.
    spoof = paho_client(port, version, tls=ctx, username=uniq, password="x")
    spoof.connect()
    assert _code(spoof.subscribe(f"{uniq}/#", qos=1)[0]) in (0x80, 0x87)
    spoof.disconnect()
    # The same certificate over secure WebSocket: the same login, the same ACL.
    ws_client, _ = ws_raw_client(listener_ports(broker)["wss"], version, tls=ctx)
    assert ws_client.connect(f"{uniq}-ws").reason == 0
    assert ws_client.subscribe([("sensor-7/#", 1), (f"{uniq}/#", 1)]).reasons == [1, 0x87 if version == 5 else 0x80]
    ws_client.disconnect()
    # Without a client certificate the handshake is refused (tls.require_client_cert).
    bare = client_tls_context(certs.ca_cert)
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            tls_sock = bare.wrap_socket(raw, server_hostname="localhost")
            tls_sock.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")
            if not tls_sock.recv(10):  # TLS 1.3: the refusal arrives after the client's Finished
                raise ConnectionResetError("closed")
    assert broker_errors(broker) == []


def _code(rc: object) -> int:
    return int(getattr(rc, "value", rc))  # type: ignore[call-overload]


def _served_certificate(port: int, ca: Path) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with client_tls_context(ca).wrap_socket(raw, server_hostname="localhost") as tls_sock:
            der = tls_sock.getpeercert(binary_form=True)
            assert der is not None
            return der


def test_sighup_reloads_certificates_and_keeps_connections(broker_factory: BrokerFactory, tmp_path: Path,
                                                           uniq: str) -> None:
    first = dev_certs(tmp_path, "first")
    second = dev_certs(tmp_path, "second")
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key", "ca.crt"):
        shutil.copy(first.ca_cert.parent / name, live / name)
    config = tls_config(first, listeners=("mqtts", "wss")).replace(str(first.server_cert), str(live / "server.crt"))
    config = config.replace(str(first.server_key), str(live / "server.key"))
    broker = broker_factory(config_text=config)
    ports = listener_ports(broker)
    old_cert = _served_certificate(ports["mqtts"], first.ca_cert)
    kept = paho_client(ports["mqtts"], 5, tls=client_tls_context(first.ca_cert))
    kept.connect()
    kept.subscribe(f"{uniq}/#", qos=1)
    # A bad file: the reload fails, the old certificate stays.
    (live / "server.crt").write_text("not a certificate")
    broker.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_log(broker, "TLS certificates not reloaded")
    assert _served_certificate(ports["mqtts"], first.ca_cert) == old_cert
    for name in ("server.crt", "server.key"):
        shutil.copy(second.ca_cert.parent / name, live / name)
    broker.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_log(broker, "TLS certificates reloaded")
    # New connections get the new certificate (on every TLS listener), the old CA no longer verifies it.
    new_cert = _served_certificate(ports["mqtts"], second.ca_cert)
    assert new_cert != old_cert
    assert _served_certificate(ports["wss"], second.ca_cert) == new_cert
    with pytest.raises(ssl.SSLCertVerificationError):
        _served_certificate(ports["mqtts"], first.ca_cert)
    fresh = paho_client(ports["mqtts"], 5, tls=client_tls_context(second.ca_cert))
    fresh.connect()
    fresh.publish(f"{uniq}/after", b"reload", qos=1)
    # The connection made before the reload is still up and delivers.
    msg = kept.get()
    assert (msg.topic, msg.payload) == (f"{uniq}/after", b"reload")
    assert not kept.disconnected.is_set()
    kept.disconnect()
    fresh.disconnect()


def test_handshakes_are_bounded_and_count_as_pending(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    certs = dev_certs(tmp_path)
    extra = "max_pending_connections = 2\n[mqtt]\nconnect_timeout_s = 1.5\n"
    broker = broker_factory(config_text=tls_config(certs, extra=extra))
    port = listener_ports(broker)["mqtts"]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    time.sleep(0.3)  # both accepted: two handshakes pending, the cap
    third = socket.create_connection(("127.0.0.1", port), timeout=10)
    third.settimeout(1.0)
    t0 = time.monotonic()
    try:
        assert third.recv(10) == b""  # refused at once: a handshake holds a pending slot
    except ConnectionResetError:
        pass
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    for s in silent:
        s.settimeout(10)
        try:
            assert s.recv(10) == b""  # closed: no handshake within mqtt.connect_timeout_s
        except ConnectionResetError:
            pass
    assert time.monotonic() - t0 < 5.0
    for s in (*silent, third):
        s.close()
    # The slots are free again.
    assert wait_until(lambda: _served_certificate(port, certs.ca_cert) != b"", timeout=10)
    assert broker_errors(broker) == []


def test_https_serves_the_http_api(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    import json
    import urllib.error
    import urllib.request

    certs = dev_certs(tmp_path)
    broker = broker_factory(config_text=tls_config(certs, listeners=("https",)))
    port = listener_ports(broker)["https"]
    ctx = client_tls_context(certs.ca_cert)
    with urllib.request.urlopen(f"https://localhost:{port}/v1/health", context=ctx, timeout=10) as resp:
        assert json.load(resp)["ok"] is True
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/v1/shards", context=ctx, timeout=10) as resp:
        assert json.load(resp)["shard_count"] == 16  # the whole API, as on the plain listener
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=10)  # no plain HTTP there
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://localhost:{port}/v1/health",
                               context=client_tls_context(dev_certs(tmp_path, "other").ca_cert), timeout=10)
    with urllib.request.urlopen(f"{broker.http_url}/v1/health", timeout=10) as resp:  # plain HTTP stays
        assert resp.status == 200
    assert broker_errors(broker) == []


def test_https_off_loopback_needs_authentication(tmp_path: Path) -> None:
    from listener_support import run_moorline

    certs = dev_certs(tmp_path)
    done = run_moorline(tmp_path, ["--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0"],
                        {"MOORLINE_LISTENERS__HTTPS": "0.0.0.0:0", "MOORLINE_TLS__CERT_FILE": str(certs.server_cert),
                         "MOORLINE_TLS__KEY_FILE": str(certs.server_key)})
    assert done.returncode == 2 and "without authentication" in done.stderr, done.stderr
    assert not (tmp_path / "data").exists()


def test_a_tls_listener_off_loopback_still_needs_a_login(broker_factory: BrokerFactory, tmp_path: Path,
                                                         uniq: str) -> None:
    from moorline.node.edge.credentials import hash_password

    certs = dev_certs(tmp_path)
    passwd = tmp_path / "passwd"
    passwd.write_text(f"alice:{hash_password('secret')}\n")
    config = tls_config(certs, auth=f'[auth]\npassword_file = "{passwd}"\n').replace(
        'mqtts = "127.0.0.1:0"', 'mqtts = "0.0.0.0:0"')
    broker = broker_factory(config_text=config)
    port = listener_ports(broker)["mqtts"]
    ctx = client_tls_context(certs.ca_cert)
    anonymous = paho_client(port, 5, tls=ctx)
    assert _code(anonymous.connect(expect_success=False)) == 0x87  # TLS is no login
    anonymous.client.loop_stop()
    alice = paho_client(port, 5, tls=ctx, username="alice", password="secret")
    alice.connect()
    assert _code(alice.publish(f"{uniq}/t", b"x", qos=1)) == 0
    alice.disconnect()
