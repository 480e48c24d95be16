"""Where a session's delivery log lives (moorline only). A session that outlives its connection commits
every delivery batch before sending it (so a resend after a crash reuses the packet ids); a clean
session (expiry 0) keeps its log in memory only, since nothing can ever resume it."""

from __future__ import annotations

import re
import urllib.request

import pytest
from e2e_broker import BrokerProc
from rawclient import P_SESSION_EXPIRY, RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
N = 60


def metric(b: BrokerProc, name: str) -> int:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\d+)$", text, re.M)
    assert m is not None, f"{name} missing from /metrics"
    return int(m.group(1))


def receive_all(c: RawClient, n: int) -> list[bytes]:
    got = []
    for _ in range(n):
        m = c.next_message(10)
        got.append(m.payload)
        c.ack(m)
    return got


def test_clean_session_commits_no_delivery_batches_persistent_one_does(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/t"
    expected = [f"m{i}".encode() for i in range(N)]
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0

    clean = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert clean.connect(f"{uniq}-clean", clean=True).reason == 0
    clean.subscribe([(topic, 1)])
    before = metric(shared_broker, "moorline_delivery_batches_committed_total")
    for p in expected:
        assert pub.publish_and_wait(topic, p, 1).reason < 0x80
    assert receive_all(clean, N) == expected
    assert metric(shared_broker, "moorline_delivery_batches_committed_total") == before
    clean.disconnect()

    durable = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert durable.connect(f"{uniq}-durable", clean=True, props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    durable.subscribe([(topic, 1)])
    before = metric(shared_broker, "moorline_delivery_batches_committed_total")
    for p in expected:
        assert pub.publish_and_wait(topic, p, 1).reason < 0x80
    assert receive_all(durable, N) == expected
    assert metric(shared_broker, "moorline_delivery_batches_committed_total") > before
    durable.disconnect()
    pub.disconnect()


def test_clean_session_unacked_are_not_redelivered_to_a_new_session(shared_broker: BrokerProc, uniq: str) -> None:
    """A clean session that leaves with unacknowledged messages takes them with it (MQTT: its state ends
    with the connection), and a new clean session with the same client id starts empty."""
    topic = f"{uniq}/t"
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    sub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert sub.connect(f"{uniq}-sub", clean=True).reason == 0
    sub.subscribe([(topic, 1)])
    for i in range(10):
        assert pub.publish_and_wait(topic, f"a{i}".encode(), 1).reason < 0x80
    got = [sub.next_message(10) for _ in range(10)]
    for m in got[:5]:
        sub.ack(m)
    sub.close()  # five left unacknowledged
    again = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = again.connect(f"{uniq}-sub", clean=True)
    assert ack.reason == 0 and not ack.session_present
    again.subscribe([(topic, 1)])
    assert pub.publish_and_wait(topic, b"after", 1).reason < 0x80
    m = again.next_message(10)
    assert (m.payload, m.dup) == (b"after", False)
    again.ack(m)
    again.disconnect()
    pub.disconnect()
