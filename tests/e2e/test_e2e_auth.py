"""Authentication and ACLs (moorline only): password file made with `moorline passwd`, [[auth.acl]] rules.

Config format (moorline/config.py): [auth] allow_anonymous, password_file; [[auth.acl]] user / client_id,
action = "publish" | "subscribe" | "all", allow, pattern (topic filter with %u / %c). With any rule present,
what no rule allows is denied. Topics beginning with `$` are publishable only through a rule whose own
pattern begins with `$`, and `$SYS` never; failed logins are rate-limited per source address.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_broker import REPO_ROOT, BrokerProc, running_broker
from rawclient import CONNACK, PUBACK, PUBREC, RawClient, encode_connect, encode_publish

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"


def passwd(file: Path, user: str, password: str) -> None:
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "passwd", str(file), user, password],
                       capture_output=True, cwd=str(REPO_ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    assert password.encode() not in file.read_bytes(), "password stored in clear text"


@pytest.fixture(scope="module")
def auth_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    tmp_path = tmp_path_factory.mktemp("auth")
    pw = tmp_path / "passwords"
    passwd(pw, "alice", "wonderland")
    passwd(pw, "bob", "builder")
    config = f"""
[auth]
allow_anonymous = false
password_file = "{pw}"
max_failed_logins = 1000  # the rate limit has its own broker below

[[auth.acl]]
user = "alice"
action = "all"
pattern = "u/%u/#"

[[auth.acl]]
user = "alice"
action = "all"
pattern = "$dev/#"

[[auth.acl]]
user = "alice"
action = "publish"
pattern = "$SYS/#"

[[auth.acl]]
user = "bob"
action = "subscribe"
pattern = "u/alice/#"

[[auth.acl]]
action = "subscribe"
pattern = "public/#"

[[auth.acl]]
action = "publish"
pattern = "public/#"

[[auth.acl]]
action = "publish"
allow = false
pattern = "u/#"
"""
    with running_broker(tmp_path, config_text=config) as b:
        yield b


def login(b: BrokerProc, version: int, cid: str, user: str | None, password: bytes | None) -> RawClient:
    c = RawClient(HOST, b.mqtt_port, version)
    ack = c.connect(cid, username=user, password=password)
    assert ack.reason == 0, ack
    return c


def refused(b: BrokerProc, version: int, user: str | None, password: bytes | None) -> int:
    with RawClient(HOST, b.mqtt_port, version) as c:
        c.send(encode_connect("refused", version, username=user, password=password))
        got = c.wait_closed(10)
    assert [p.type for p in got] == [CONNACK], got
    return got[0].reason


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_failed_logins(auth_broker: BrokerProc, version: int) -> None:
    bad_pw = refused(auth_broker, version, "alice", b"wrong")
    unknown = refused(auth_broker, version, "mallory", b"wonderland")
    anonymous = refused(auth_broker, version, None, None)
    no_password = refused(auth_broker, version, "alice", None)
    if version == 4:
        # 3.1.1: 0x04 bad user name or password, 0x05 not authorized
        assert bad_pw in (0x04, 0x05) and unknown in (0x04, 0x05) and no_password in (0x04, 0x05)
        assert anonymous == 0x05
    else:
        assert (bad_pw, unknown, no_password) == (0x86, 0x86, 0x86)
        assert anonymous in (0x86, 0x87)
    good = login(auth_broker, version, f"alice-{version}", "alice", b"wonderland")
    good.ping()
    good.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_subscribe_acl(auth_broker: BrokerProc, version: int) -> None:
    alice = login(auth_broker, version, f"alice-{version}", "alice", b"wonderland")
    suback = alice.subscribe([("u/alice/#", 1), ("u/bob/#", 1), ("public/news", 2), ("#", 0), ("u/+/x", 1)])
    denied = 0x80 if version == 4 else 0x87
    # "#" and "u/+/x" reach topics alice may read as well as ones she may not: granted, and the
    # messages on denied topics are filtered out when delivering. "u/bob/#" reaches none she may read.
    assert suback.reasons == [1, denied, 2, 0, 1], suback
    bob = login(auth_broker, version, f"bob-{version}", "bob", b"builder")
    assert bob.subscribe([("u/alice/+", 1), ("u/bob/#", 1)]).reasons == [1, denied]
    # allowed traffic flows: alice publishes to her own tree, bob (allowed to read it) receives
    assert alice.publish_and_wait("u/alice/diary", b"dear diary", 1).reason == 0
    m = bob.next_message(10)
    assert (m.topic, m.payload) == ("u/alice/diary", b"dear diary")
    bob.ack(m)
    alice.disconnect()
    bob.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_publish_acl(auth_broker: BrokerProc, version: int) -> None:
    alice = login(auth_broker, version, f"alice-{version}", "alice", b"wonderland")
    alice.subscribe([("u/alice/#", 1), ("public/#", 1)])
    bob = login(auth_broker, version, f"bob-{version}", "bob", b"builder")
    # bob may not publish into alice's tree (the explicit deny on u/#)
    ack = bob.publish_and_wait("u/alice/forged", b"forged", 1)
    rec = bob.publish_and_wait("u/alice/forged2", b"forged2", 2)
    if version == 5:
        assert (ack.type, ack.reason) == (PUBACK, 0x87), ack
        assert (rec.type, rec.reason) == (PUBREC, 0x87), rec
    else:
        # 3.1.1 allows only a positive ack (then drop) or closing the connection; moorline acks and drops
        assert ack.type == PUBACK
    bob.send(encode_publish("u/alice/forged0", b"forged0", 0, version=version))
    # bob may publish to public/
    if version == 4 and bob.closed:
        bob = login(auth_broker, version, f"bob-{version}", "bob", b"builder")
    assert bob.publish_and_wait("public/hello", b"hi", 1).reason == 0
    m = alice.next_message(10)
    assert (m.topic, m.payload) == ("public/hello", b"hi"), "a denied publish was delivered"
    alice.ack(m)
    assert alice.recv_or_none(0.7) is None
    alice.disconnect()
    bob.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_denied_publish_between_allowed_ones_in_one_write(auth_broker: BrokerProc, version: int) -> None:
    # Publishes read together are proposed as a group; a denied one in the middle is answered on
    # its own (0x87 on 5.0, acknowledged and dropped on 3.1.1) without reordering the PUBACKs.
    alice = login(auth_broker, version, f"alice-w-{version}", "alice", b"wonderland")
    alice.subscribe([("public/#", 1)])
    bob = login(auth_broker, version, f"bob-w-{version}", "bob", b"builder")
    topics = ["public/1", "public/2", "u/alice/forged", "public/3", "public/4"]
    bob.send(b"".join(encode_publish(t, t.encode(), 1, pid=i, version=version) for i, t in enumerate(topics, 1)))
    acks = [bob.expect(PUBACK, 10) for _ in topics]
    denied = 0x87 if version == 5 else 0
    assert [(a.pid, a.reason) for a in acks] == [(1, 0), (2, 0), (3, denied), (4, 0), (5, 0)]
    got = []
    for _ in range(4):
        m = alice.next_message(10)
        alice.ack(m)
        got.append(m.topic)
    assert got == ["public/1", "public/2", "public/3", "public/4"]
    assert alice.recv_or_none(0.7) is None, "the denied publish was delivered"
    alice.disconnect()
    bob.disconnect()


def test_will_to_denied_topic_refused(auth_broker: BrokerProc) -> None:
    with RawClient(HOST, auth_broker.mqtt_port, 5) as c:
        c.send(encode_connect("bob-will", 5, username="bob", password=b"builder",
                              will=("u/alice/will", b"x", 1, False)))
        got = c.wait_closed(10)
    assert [(p.type, p.reason) for p in got] == [(CONNACK, 0x87)], got


def test_password_logins_hash_off_the_loop_and_unknown_users_cost_the_same(auth_broker: BrokerProc) -> None:
    # The metrics count every scrypt run: an unknown user and a known one without the right password
    # each pay one (no username enumeration by timing); a remembered good login pays none.
    before = metric(auth_broker, "moorline_login_hashes_total")
    assert refused(auth_broker, 5, "nobody-here", b"x") == 0x86
    assert refused(auth_broker, 5, "alice", b"not-hers") == 0x86
    assert metric(auth_broker, "moorline_login_hashes_total") == before + 2
    login(auth_broker, 5, "alice-hash-1", "alice", b"wonderland").disconnect()
    after_first = metric(auth_broker, "moorline_login_hashes_total")
    login(auth_broker, 5, "alice-hash-2", "alice", b"wonderland").disconnect()
    assert metric(auth_broker, "moorline_login_hashes_total") == after_first


def metric(b: BrokerProc, name: str) -> float:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_dollar_topics_need_an_explicit_dollar_grant(auth_broker: BrokerProc, version: int) -> None:
    alice = login(auth_broker, version, f"alice-dollar-{version}", "alice", b"wonderland")
    assert alice.subscribe([("$dev/#", 1)]).reasons == [1]
    denied = 0x87 if version == 5 else 0  # 3.1.1: acknowledged and dropped
    # public/# allows publishing, yet no wildcard pattern grants a $-topic; $SYS is never a client's
    for topic in ("$public/x", "$SYS/broker/uptime", "$SYS"):
        ack = alice.publish_and_wait(topic, b"forged", 1, retain=True)
        assert (ack.type, ack.reason) == (PUBACK, denied), (topic, ack)
    # a rule whose own pattern begins with $ grants it
    assert alice.publish_and_wait(f"$dev/{version}", b"ok", 1).reason == 0
    m = alice.next_message(10)
    assert (m.topic, m.payload) == (f"$dev/{version}", b"ok")
    alice.ack(m)
    assert alice.recv_or_none(0.5) is None
    alice.disconnect()
    again = login(auth_broker, 5, f"alice-dollar-again-{version}", "alice", b"wonderland")
    assert again.subscribe([("$SYS/#", 1), ("$public/#", 1)]).reasons == [0x87, 0x87]  # no read rule either
    again.disconnect()
    with RawClient(HOST, auth_broker.mqtt_port, 5) as c:
        c.send(encode_connect(f"alice-will-{version}", 5, username="alice", password=b"wonderland",
                              will=("$SYS/fake", b"x", 1, True)))
        got = c.wait_closed(10)
    assert [(p.type, p.reason) for p in got] == [(CONNACK, 0x87)], got


@pytest.fixture(scope="module")
def open_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """The default configuration: anonymous on loopback, no ACL."""
    with running_broker(tmp_path_factory.mktemp("open")) as b:
        yield b


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_dollar_topics_without_any_acl(open_broker: BrokerProc, version: int) -> None:
    sub = login(open_broker, 5, f"dollar-sub-{version}", None, None)
    # the forged $SYS topic itself: the broker's own $SYS statistics (sys_topics.py) never use it
    assert sub.subscribe([(f"$x{version}/#", 1), (f"$SYS/x{version}", 1), (f"n{version}/#", 1)]).reasons == [1, 1, 1]
    pub = login(open_broker, version, f"dollar-pub-{version}", None, None)
    denied = 0x87 if version == 5 else 0
    for topic in (f"$x{version}/t", f"$SYS/x{version}"):
        ack = pub.publish_and_wait(topic, b"forged", 1, retain=True)
        assert (ack.type, ack.reason) == (PUBACK, denied), (topic, ack)
        rec = pub.publish_and_wait(topic, b"forged2", 2)
        assert rec.reason == denied or rec.type != PUBREC, rec
    pub.send(encode_publish(f"$x{version}/q0", b"forged0", 0, version=version))
    assert pub.publish_and_wait(f"n{version}/t", b"fine", 1).reason == 0
    m = sub.next_message(10)
    assert (m.topic, m.payload) == (f"n{version}/t", b"fine"), "a $-topic publish was delivered"
    sub.ack(m)
    assert sub.recv_or_none(0.7) is None
    pub.disconnect()
    sub.disconnect()
    late = login(open_broker, 5, f"dollar-late-{version}", None, None)
    late.subscribe([(f"$x{version}/#", 1), (f"$SYS/x{version}", 1)])
    assert late.recv_or_none(0.7) is None, "a refused retained $-topic publish was retained"
    late.disconnect()


def test_failed_logins_are_rate_limited_per_address(broker_factory: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pw = tmp_path / "passwords"
    passwd(pw, "alice", "wonderland")
    b = broker_factory(config_text=f"""
[auth]
allow_anonymous = false
password_file = "{pw}"
max_failed_logins = 3
failed_login_window_s = 600
limit_loopback_logins = true  # the test's clients are all on loopback
""")
    assert [refused(b, 5, "alice", b"guess") for _ in range(3)] == [0x86] * 3
    # the address is out of failures: even the right password is not checked (0x9F; 3.1.1: code 5)
    assert refused(b, 5, "alice", b"wonderland") == 0x9F
    assert refused(b, 4, "alice", b"wonderland") == 0x05
    assert refused(b, 5, "mallory", b"x") == 0x9F
    # another address still logs in: connect from 127.0.0.2 (all of 127.0.0.0/8 is loopback)
    plain = socket.create_connection
    monkeypatch.setattr(socket, "create_connection",
                        lambda addr, timeout=None: plain(addr, timeout, source_address=("127.0.0.2", 0)))
    with RawClient(HOST, b.mqtt_port, 5) as c:
        assert c.sock.getsockname()[0] == "127.0.0.2"
        assert c.connect("alice-elsewhere", username="alice", password=b"wonderland").reason == 0
        c.disconnect()


def test_password_file_survives_restart(auth_broker: BrokerProc) -> None:
    auth_broker.restart(kill=True)
    assert refused(auth_broker, 5, "alice", b"nope") == 0x86
    c = login(auth_broker, 5, "alice-again", "alice", b"wonderland")
    c.disconnect()
