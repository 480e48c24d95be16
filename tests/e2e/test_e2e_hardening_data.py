"""Issue 30, items 1-3, against a real broker process: no ordinary user can make another user's
acknowledged messages vanish, or fill a node.

- item 1: mallory, who may publish only to ``mallory/#``, publishes once to a topic of the victim's
  shard with the victim's producer id and ``seq = 2**62``; the victim's later messages must still
  be stored and delivered (they were answered PUBACK 0x00 and dropped as "duplicates").
- item 2: mallory, who may read only ``orders/public/#``, joins ``$share/g/orders/#`` with worker;
  every ``orders/secret/...`` message must reach worker (half of them vanished), and a message
  no member of a group (or a plain subscription) may read is a recorded drop, ``acl_no_reader``.
- item 3: one user with 60 KB client ids, many persistent sessions and many filters filled RAM and
  the WAL of every node: client ids over ``mqtt.max_client_id_bytes``, persistent sessions over
  ``session.max_persistent_per_user`` and filters over ``session.max_subscriptions`` are refused.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_broker import REPO_ROOT, BrokerProc, running_broker
from rawclient import RawClient

from moorline.hashing import shard_of

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
USERS = {"victim": "v-pass", "worker": "w-pass", "mallory": "m-pass", "spammer": "s-pass", "admin": "a-pass"}
USER_PROPERTY = 0x26
SESSION_EXPIRY = 0x11


def _passwd(file: Path, users: dict[str, str]) -> None:
    for user, password in users.items():
        r = subprocess.run([sys.executable, "-m", "moorline.cli", "passwd", str(file), user, password],
                           capture_output=True, cwd=str(REPO_ROOT), timeout=60)
        assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def hb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    tmp = tmp_path_factory.mktemp("hardening")
    pw = tmp / "passwords"
    _passwd(pw, USERS)
    config = f"""
[auth]
allow_anonymous = false
password_file = "{pw}"
admin_users = ["admin"]
max_failed_logins = 1000

[session]
max_persistent_per_user = 3
max_subscriptions = 5

[[auth.acl]]
user = "victim"
action = "all"
pattern = "orders/#"

[[auth.acl]]
user = "worker"
action = "all"
pattern = "orders/#"

[[auth.acl]]
user = "mallory"
action = "publish"
pattern = "mallory/#"

[[auth.acl]]
user = "mallory"
action = "subscribe"
pattern = "orders/public/#"

[[auth.acl]]
user = "spammer"
action = "all"
pattern = "s/#"
"""
    with running_broker(tmp, config_text=config) as b:
        yield b


def _client(b: BrokerProc, user: str, client_id: str, version: int = 5, clean: bool = True,
            props: list[tuple[int, object]] | None = None) -> RawClient:
    c = RawClient(HOST, b.mqtt_port, version)
    ack = c.connect(client_id, clean=clean, username=user, password=USERS[user].encode(), props=props)
    assert ack.reason == 0, f"{user}/{client_id}: CONNACK 0x{ack.reason:02x}"
    return c


def _drain(c: RawClient, quiet_s: float = 1.0, until: int = 0, deadline_s: float = 20.0) -> list[bytes]:
    """Payloads received (each acknowledged) until ``quiet_s`` passes without one, and at least
    ``until`` arrived (or ``deadline_s`` passed)."""
    got: list[bytes] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pkt = c.recv_or_none(quiet_s)
        if pkt is None:
            if len(got) >= until:
                break
            continue
        if pkt.topic is None:
            continue
        got.append(pkt.payload)
        if pkt.qos:
            c.ack(pkt)
    return got


def _admin_get(b: BrokerProc, path: str) -> bytes:
    req = urllib.request.Request(b.http_url + path)
    req.add_header("Authorization", "Basic " + base64.b64encode(f"admin:{USERS['admin']}".encode()).decode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()  # type: ignore[no-any-return]


def _drops(b: BrokerProc, reason: str) -> list[dict[str, object]]:
    return [d for d in json.loads(_admin_get(b, "/v1/drops"))["drops"] if d["reason"] == reason]


def _dropped_metric(b: BrokerProc, reason: str) -> float:
    for line in _admin_get(b, "/metrics").decode().splitlines():
        if line.startswith(f'moorline_dropped_total{{reason="{reason}"}} '):
            return float(line.split()[1])
    return 0.0


# --- item 1 -------------------------------------------------------------------------------------


def _seq_props(producer: bytes, seq: int) -> list[tuple[int, object]]:
    return [(USER_PROPERTY, ("producer", producer.hex())), (USER_PROPERTY, ("seq", str(seq)))]


def test_another_user_cannot_poison_a_sequenced_producer_with_a_huge_seq(hb: BrokerProc) -> None:
    producer = bytes.fromhex("00c0ffee00c0ffee")
    topic = "orders/p/x"
    shard = shard_of(topic, 16)
    evil_topic = next(t for t in (f"mallory/{i}" for i in range(10_000)) if shard_of(t, 16) == shard)
    sub = _client(hb, "worker", "hd-p-sub")
    assert sub.subscribe([("orders/p/#", 1)]).reasons == [1]
    victim = _client(hb, "victim", "hd-p-victim")
    mallory = _client(hb, "mallory", "hd-p-mallory")
    assert victim.publish_and_wait(topic, b"v1", props=_seq_props(producer, 1)).reason == 0
    # The attack: one publish to mallory's own topic, in the same shard, with the victim's producer id.
    assert mallory.publish_and_wait(evil_topic, b"evil", props=_seq_props(producer, 2**62)).reason == 0
    assert victim.publish_and_wait(topic, b"v2", props=_seq_props(producer, 2)).reason == 0
    assert victim.publish_and_wait(topic, b"v3", props=_seq_props(producer, 3)).reason == 0
    got = _drain(sub, until=3)
    assert got == [b"v1", b"v2", b"v3"], f"PUBACKed 0x00 but not delivered: {got}"
    # A sequence jumping beyond producer.max_seq_gap is refused (not applied, not a duplicate)...
    assert victim.publish_and_wait(topic, b"jump", props=_seq_props(producer, 2**62)).reason == 0x83
    # ...and the producer's sequence goes on from where it was.
    assert victim.publish_and_wait(topic, b"v4", props=_seq_props(producer, 4)).reason == 0
    assert _drain(sub, until=1) == [b"v4"]
    for c in (sub, victim, mallory):
        c.disconnect()


# --- item 2 -------------------------------------------------------------------------------------


def test_a_share_member_with_narrower_read_rights_does_not_make_the_group_lose_messages(hb: BrokerProc) -> None:
    worker = _client(hb, "worker", "hd-s-worker")
    mallory = _client(hb, "mallory", "hd-s-mallory")
    assert worker.subscribe([("$share/g/orders/#", 1)]).reasons == [1]
    assert mallory.subscribe([("$share/g/orders/#", 1)]).reasons == [1]  # overlaps orders/public/#
    victim = _client(hb, "victim", "hd-s-victim")
    sent = [f"secret {i}".encode() for i in range(20)]
    for payload in sent:
        assert victim.publish_and_wait("orders/secret/x", payload).reason == 0
    got = _drain(worker, until=20)
    assert sorted(got) == sorted(sent), f"worker got {len(got)} of 20"
    assert _drain(mallory, quiet_s=0.3) == []
    assert _drops(hb, "acl_no_reader") == []  # every message had a reader: none dropped
    for c in (worker, mallory, victim):
        c.disconnect()


def test_a_message_no_member_or_subscriber_may_read_is_a_recorded_drop(hb: BrokerProc) -> None:
    mallory = _client(hb, "mallory", "hd-d-mallory")
    assert mallory.subscribe([("$share/solo/orders/#", 1), ("orders/#", 1)]).reasons == [1, 1]
    before = _dropped_metric(hb, "acl_no_reader")
    victim = _client(hb, "victim", "hd-d-victim")
    assert victim.publish_and_wait("orders/secret/y", b"unreadable").reason == 0
    assert victim.publish_and_wait("orders/public/y", b"readable").reason == 0
    got = _drain(mallory, until=2)
    assert sorted(got) == [b"readable", b"readable"]  # the group's copy and the plain one
    deadline = time.monotonic() + 15
    subs: set[object] = set()
    while time.monotonic() < deadline:
        subs = {d["subscription"] for d in _drops(hb, "acl_no_reader")}
        if {"$share/solo/orders/#", "hd-d-mallory/orders/#"} <= subs:
            break
        time.sleep(0.2)
    assert {"$share/solo/orders/#", "hd-d-mallory/orders/#"} <= subs, subs
    assert _dropped_metric(hb, "acl_no_reader") >= before + 2
    mallory.disconnect()
    victim.disconnect()


# --- item 3 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version,code", [(5, 0x85), (4, 0x02)], ids=["v5", "v311"])
def test_a_60kb_client_id_is_refused_at_connect(hb: BrokerProc, version: int, code: int) -> None:
    for length, expected in ((60_000, code), (257, code), (256, 0)):
        c = RawClient(HOST, hb.mqtt_port, version)
        ack = c.connect("i" * length, username="spammer", password=USERS["spammer"].encode())
        assert ack.reason == expected, (length, hex(ack.reason))
        c.close()


@pytest.mark.parametrize("version,code", [(5, 0x97), (4, 0x03)], ids=["v5", "v311"])
def test_one_user_cannot_open_persistent_sessions_without_bound(hb: BrokerProc, version: int, code: int) -> None:
    props = [(SESSION_EXPIRY, 300)] if version == 5 else None
    for i in range(3):
        _client(hb, "spammer", f"hd-q{version}-{i}", version, clean=False, props=props).disconnect()
    c = RawClient(HOST, hb.mqtt_port, version)
    ack = c.connect(f"hd-q{version}-3", clean=False, props=props, username="spammer",
                    password=USERS["spammer"].encode())
    assert ack.reason == code
    c.close()
    # Resuming one of the user's sessions is no session more; a clean session is not persistent.
    _client(hb, "spammer", f"hd-q{version}-0", version, clean=False, props=props).disconnect()
    _client(hb, "spammer", f"hd-q{version}-clean", version, clean=True).disconnect()
    # Ending sessions gives the places back (clean start with expiry 0 ends them).
    for i in range(3):
        _client(hb, "spammer", f"hd-q{version}-{i}", version, clean=True).disconnect()


def test_one_session_cannot_register_filters_without_bound(hb: BrokerProc) -> None:
    c = _client(hb, "spammer", "hd-subs")
    filters = [(f"s/{i}/#", 1) for i in range(7)]
    assert c.subscribe(filters).reasons == [1] * 5 + [0x97] * 2
    assert c.subscribe([("s/0/#", 0)]).reasons == [0]  # replacing one of its own is no filter more
    c.disconnect()
