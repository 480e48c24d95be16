"""Shared subscriptions $share/group/filter: each message to one member; all messages over the group."""

from __future__ import annotations

import re
import urllib.request
from collections import Counter

import pytest
from e2e_broker import BrokerProc
from e2e_support import Paho, collect_group, wait_until
from rawclient import PUBREC, PUBREL, RawClient, encode_ack

pytestmark = pytest.mark.e2e
N = 60
HOST = "127.0.0.1"


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_shared_group_splits_messages(shared_broker: BrokerProc, uniq: str, version: int, qos: int) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/s"
    members = []
    for i in range(3):
        m = Paho(port, f"{uniq}-m{i}", version=version)
        m.connect()
        rcs = m.subscribe(f"$share/g1/{topic}", qos)
        assert [int(getattr(r, "value", r)) for r in rcs] == [qos]
        members.append(m)
    other_group = Paho(port, f"{uniq}-og", version=version)
    other_group.connect()
    other_group.subscribe(f"$share/g2/{topic}", qos)
    plain = Paho(port, f"{uniq}-plain", version=version)
    plain.connect()
    plain.subscribe(topic, qos)

    pub = Paho(port, f"{uniq}-p", version=version)
    pub.connect()
    sent = [f"m{i}".encode() for i in range(N)]
    for p in sent:
        pub.publish(topic, p, 1)

    per_member = collect_group(members, N)
    received = [msg.payload for got in per_member for msg in got]
    counts = Counter(received)
    if qos == 0:
        # QoS 0 may be lost, never duplicated; on loopback with no load everything arrives
        assert max(counts.values()) == 1
    assert sorted(received) == sorted(sent), "every message to exactly one member of the group"
    assert sum(1 for got in per_member if got) >= 2, "the group's messages are spread over members"
    assert sorted(msg.payload for msg in other_group.collect(N, timeout=10)) == sorted(sent)
    assert [msg.payload for msg in plain.collect(N, timeout=10)] == sent
    for c in members + [other_group, plain, pub]:
        c.disconnect()


def test_shared_group_member_leaving_keeps_group_whole(shared_broker: BrokerProc, uniq: str) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/s"
    a = Paho(port, f"{uniq}-a", version=5)
    a.connect()
    a.subscribe(f"$share/g/{topic}", 1)
    b = Paho(port, f"{uniq}-b", version=5)
    b.connect()
    b.subscribe(f"$share/g/{topic}", 1)
    pub = Paho(port, f"{uniq}-p", version=5)
    pub.connect()
    for i in range(10):
        pub.publish(topic, f"x{i}".encode(), 1)
    first = [m for got in collect_group([a, b], 10) for m in got]
    assert sorted(m.payload for m in first) == sorted(f"x{i}".encode() for i in range(10))
    b.disconnect()
    for i in range(10):
        pub.publish(topic, f"y{i}".encode(), 1)
    assert [m.payload for m in a.collect(10, timeout=10)] == [f"y{i}".encode() for i in range(10)]
    a.disconnect()
    pub.disconnect()


@pytest.mark.moorline_only
def test_member_gone_returns_qos1_and_never_sends_its_qos2_elsewhere(
        shared_broker: BrokerProc, uniq: str) -> None:
    """MQTT-4.8.2-5 for a member whose session ends with its connection (clean start, expiry 0):
    QoS 1 it had not acknowledged goes to another member; a QoS 2 message it was sent never goes
    to another member: one it never PUBREC'd is dropped and counted, a PUBREC'd one is the
    member's receipt and counts as delivered (sending it again would deliver it twice)."""
    port, topic, group = shared_broker.mqtt_port, f"{uniq}/q", f"$share/g{uniq}/{uniq}/q"
    a = RawClient(HOST, port, 5)
    assert a.connect(f"{uniq}-a", clean=True).reason == 0
    a.subscribe([(group, 2)])
    pub = RawClient(HOST, port, 5)
    assert pub.connect(f"{uniq}-p").reason == 0
    sent = {b"q1-0": 1, b"q2-unreceived": 2, b"q2-pubrecd": 2, b"q1-1": 1}
    for payload, qos in sent.items():
        assert pub.publish_and_wait(topic, payload, qos).reason < 0x80
    got = {m.payload: m for m in (a.next_message(10) for _ in sent)}  # a is the only member: all its own
    assert set(got) == set(sent)
    rec = got[b"q2-pubrecd"]
    a.send(encode_ack(PUBREC, rec.pid, 5))  # type: ignore[arg-type]
    assert a.expect(PUBREL, 10).pid == rec.pid  # and never PUBCOMP'd
    b = RawClient(HOST, port, 5)
    assert b.connect(f"{uniq}-b", clean=True).reason == 0
    b.subscribe([(group, 2)])
    drops_before = _drops(shared_broker, "share_qos2_member_gone")
    a.abort()  # its session ends: its QoS 1 claims return; no QoS 2 it was sent goes elsewhere
    returned = sorted(b.next_message(10).payload for _ in range(2))
    assert returned == [b"q1-0", b"q1-1"]
    assert b.recv_or_none(1.0) is None  # nothing else: neither QoS 2 message is sent to b
    assert wait_until(lambda: _drops(shared_broker, "share_qos2_member_gone") == drops_before + 1)
    b.disconnect()
    pub.disconnect()


def _drops(b: BrokerProc, reason: str) -> int:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'^moorline_dropped_total{{reason="{reason}"}} (\d+)$', text, re.M)
    return int(m.group(1)) if m else 0
