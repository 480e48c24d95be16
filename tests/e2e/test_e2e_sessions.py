"""Persistent sessions: offline queueing in order, redelivery of unacknowledged messages with DUP=1 and
their original packet ids after reconnect, also across a clean broker restart."""

from __future__ import annotations

import pytest
from e2e_broker import BrokerProc
from e2e_support import Paho
from rawclient import P_SESSION_EXPIRY, PUBCOMP, PUBREC, PUBREL, RawClient, encode_ack

pytestmark = pytest.mark.e2e
HOST = "127.0.0.1"


def persistent(b: BrokerProc, cid: str, version: int) -> tuple[RawClient, bool]:
    c = RawClient(HOST, b.mqtt_port, version)
    props = [(P_SESSION_EXPIRY, 600)] if version == 5 else None
    ack = c.connect(cid, clean=False, props=props)
    assert ack.reason == 0, ack
    return c, ack.session_present


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
@pytest.mark.parametrize("qos", [1, 2])
def test_offline_queueing_in_order(shared_broker: BrokerProc, uniq: str, version: int, qos: int) -> None:
    cid = f"{uniq}-sub"
    c, present = persistent(shared_broker, cid, version)
    assert not present
    c.subscribe([(f"{uniq}/q/+", qos)])
    c.disconnect()
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    n = 100
    for i in range(n):
        pub.publish(f"{uniq}/q/{i % 2}", f"{i}".encode(), qos)  # two topics, one shard order each
    c, present = persistent(shared_broker, cid, version)
    assert present
    got = []
    for _ in range(n):
        m = c.next_message(10)
        c.ack(m)
        got.append(m)
    assert c.recv_or_none(0.5) is None
    for t in (0, 1):
        assert [int(m.payload) for m in got if m.topic.endswith(f"/{t}")] == list(range(t, n, 2))
    assert {m.qos for m in got} == {qos}
    c.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
@pytest.mark.parametrize("qos", [1, 2])
def test_unacked_redelivered_with_dup_and_same_packet_ids(shared_broker: BrokerProc, uniq: str, version: int,
                                                          qos: int) -> None:
    cid = f"{uniq}-sub"
    c, _ = persistent(shared_broker, cid, version)
    c.subscribe([(f"{uniq}/r", qos)])
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    for i in range(5):
        pub.publish(f"{uniq}/r", f"{i}".encode(), qos)
    first = [c.next_message() for _ in range(5)]
    assert [m.dup for m in first] == [False] * 5
    c.ack(first[0])  # acknowledge only the first; 1..4 stay in flight
    c.ping()  # the ack was processed
    c.abort()
    c, present = persistent(shared_broker, cid, version)
    assert present
    again = [c.next_message() for _ in range(4)]
    assert [(m.payload, m.pid) for m in again] == [(m.payload, m.pid) for m in first[1:]]
    assert all(m.dup for m in again), again
    for m in again:
        c.ack(m)
    assert c.recv_or_none(0.5) is None
    c.disconnect()
    pub.disconnect()


def test_qos2_pubrel_resent_after_reconnect(shared_broker: BrokerProc, uniq: str) -> None:
    """Subscriber sent PUBREC but not PUBCOMP: after reconnect the broker resends PUBREL, not the PUBLISH."""
    cid = f"{uniq}-sub"
    c, _ = persistent(shared_broker, cid, 5)
    c.subscribe([(f"{uniq}/r", 2)])
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(f"{uniq}/r", b"exactly-once", 2)
    m = c.next_message()
    c.send(encode_ack(PUBREC, m.pid, 5))  # type: ignore[arg-type]
    assert c.expect(PUBREL).pid == m.pid
    c.abort()
    c, present = persistent(shared_broker, cid, 5)
    assert present
    rel = c.recv(5)
    assert (rel.type, rel.pid) == (PUBREL, m.pid), rel
    c.send(encode_ack(PUBCOMP, m.pid, 5))  # type: ignore[arg-type]
    assert c.recv_or_none(0.7) is None, "the message must not be delivered a second time"
    c.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_session_and_queue_survive_clean_restart(shared_broker: BrokerProc, uniq: str, version: int) -> None:
    cid = f"{uniq}-sub"
    c, _ = persistent(shared_broker, cid, version)
    c.subscribe([(f"{uniq}/q", 1)])
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    for i in range(3):
        pub.publish(f"{uniq}/q", f"{i}".encode(), 1)
    first = [c.next_message() for _ in range(3)]
    c.ack(first[0])
    c.ping()
    c.abort()
    for i in range(3, 10):
        pub.publish(f"{uniq}/q", f"{i}".encode(), 1)
    pub.disconnect()
    shared_broker.restart(kill=False)
    c, present = persistent(shared_broker, cid, version)
    assert present
    got = []
    for _ in range(9):
        m = c.next_message(10)
        c.ack(m)
        got.append(m)
    assert [int(m.payload) for m in got] == list(range(1, 10))
    assert [(m.pid, m.dup) for m in got[:2]] == [(first[1].pid, True), (first[2].pid, True)]
    assert c.recv_or_none(0.5) is None
    c.disconnect()


@pytest.mark.parametrize("how", ["disconnect", "abort"])
def test_immediate_reconnect_with_same_client_id(shared_broker: BrokerProc, uniq: str, how: str) -> None:
    """Clients reconnect at once after a DISCONNECT or a dropped connection; the new connection with the
    same client id must be fully usable (SUBSCRIBE, PUBLISH), each time."""
    cid = f"{uniq}-c"
    for i in range(6):
        c = RawClient(HOST, shared_broker.mqtt_port, 5)
        props = [(P_SESSION_EXPIRY, 60)] if i % 2 else None
        ack = c.connect(cid, clean=i % 3 == 0, props=props)
        assert ack.reason == 0, (i, ack)
        suback = c.subscribe([(f"{uniq}/same/{i}", 1)])
        assert suback.reasons == [1], (i, suback)
        assert c.publish_and_wait(f"{uniq}/same/{i}", b"x", 1).reason < 0x80
        m = c.next_message()
        assert m.payload == b"x"
        c.ack(m)
        if how == "disconnect":
            c.disconnect()
        else:
            c.abort()


def test_takeover_mid_stream_keeps_order(shared_broker: BrokerProc, uniq: str) -> None:
    """A second connection takes over a persistent session while messages stream in. Counting each message
    at its first delivery (to either connection), the order is exactly the publish order, with no gap;
    the new connection starts with the old one's unacknowledged messages, marked DUP."""
    import threading

    cid, topic, n = f"{uniq}-sub", f"{uniq}/stream", 300
    a, _ = persistent(shared_broker, cid, 5)
    a.subscribe([(topic, 1)])
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            p = RawClient(HOST, shared_broker.mqtt_port, 5)
            assert p.connect(f"{uniq}-p").reason == 0
            for i in range(n):
                p.publish_and_wait(topic, f"{i}".encode(), 1)
            p.disconnect()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    seen_a: list[int] = []
    unacked_a: list[tuple[int, int]] = []  # (seq, pid) delivered to a, never acknowledged
    while len(seen_a) < 100:
        m = a.next_message(10)
        seen_a.append(int(m.payload))
        if len(seen_a) % 7 == 0:
            unacked_a.append((int(m.payload), m.pid))  # type: ignore[arg-type]
        else:
            a.send(encode_ack(4, m.pid, 5))  # type: ignore[arg-type]
    b, present = persistent(shared_broker, cid, 5)
    assert present
    a.wait_closed(5)
    seen_b: list[tuple[int, bool, int]] = []
    while True:
        m = b.recv_or_none(3.0)
        if m is None:
            break
        seen_b.append((int(m.payload), m.dup, m.pid))  # type: ignore[arg-type]
        b.ack(m)
    t.join(30)
    assert not errors, errors
    b.disconnect()
    firsts: list[int] = []
    for s in seen_a + [s for s, _, _ in seen_b]:
        if s not in firsts:
            firsts.append(s)
    assert firsts == list(range(n)), f"first-delivery order broken: {firsts[:20]}..."
    # the first deliveries on b are resends of a's unacknowledged messages, same packet ids, DUP set
    resent = [(s, pid) for s, dup, pid in seen_b if dup]
    assert [x for x in resent if x in unacked_a] == unacked_a, (unacked_a, resent[:20])
