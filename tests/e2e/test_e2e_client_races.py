"""Client-caused races and slow paths (issue 19 items 9 and 12): no traceback from client behaviour,
publish_timeout counted from when a PUBLISH was read, and no packet id reused while in flight."""

from __future__ import annotations

import time

import pytest
from e2e_broker import BrokerFactory, BrokerProc
from rawclient import (
    DISCONNECT,
    P_SESSION_EXPIRY,
    PUBLISH,
    ConnectionClosed,
    RawClient,
    encode_ack,
    encode_publish,
    encode_subscribe,
)

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
PUBACK_TYPE = 4


def _errors(b: BrokerProc) -> list[str]:
    text = b.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line or " CRITICAL " in line]


def test_qos2_publish_then_close_and_subscribe_racing_takeover_log_no_error(
        broker_factory: BrokerFactory, uniq: str) -> None:
    b = broker_factory()
    for i in range(20):
        c = RawClient(HOST, b.mqtt_port, 5)
        c.connect(f"{uniq}-q2-{i}", clean=False, props=[(P_SESSION_EXPIRY, 600)])
        c.send(encode_publish(f"{uniq}/q2", b"x", 2, False, 7, False, 5))
        c.abort()
    for i in range(20):
        a = RawClient(HOST, b.mqtt_port, 5)
        a.connect(f"{uniq}-race-{i}", clean=False, props=[(P_SESSION_EXPIRY, 600)])
        a.send(encode_subscribe(1, [(f"{uniq}/a/#", 1), (f"{uniq}/b/+", 2)], 5))
        c = RawClient(HOST, b.mqtt_port, 5)
        assert c.connect(f"{uniq}-race-{i}", clean=False, props=[(P_SESSION_EXPIRY, 600)]).reason == 0
        a.close()
        c.close()
    probe = RawClient(HOST, b.mqtt_port, 5)  # still serving
    assert probe.connect(f"{uniq}-probe").reason == 0
    probe.publish_and_wait(f"{uniq}/probe", b"ok", qos=1)
    probe.close()
    time.sleep(0.3)
    assert _errors(b) == []


def _closed_after(c: RawClient, started: float, timeout: float) -> tuple[float, list[int]]:
    """Seconds from ``started`` until the broker closed the connection, and DISCONNECT reasons seen."""
    reasons: list[int] = []
    deadline = started + timeout
    while time.monotonic() < deadline:
        try:
            pkt = c.recv(max(0.01, deadline - time.monotonic()))
        except (ConnectionClosed, TimeoutError):
            break
        if pkt.type == DISCONNECT:
            reasons.append(pkt.reason)
    return time.monotonic() - started, reasons


@pytest.mark.parametrize("case", ["qos2_waiting_on_packet_id_commit", "qos1_queued_behind_subscribe"])
def test_publish_timeout_counts_from_when_the_publish_was_read(broker_factory: BrokerFactory, uniq: str,
                                                                case: str) -> None:
    """With every sync taking 3 s, a publish whose outcome is unknown after publish_timeout (1 s)
    closes its connection about then (0x89), not seconds later once the earlier step finished."""
    b = broker_factory(faults={"slow_sync_s": 3.0}, config_text="[mqtt]\npublish_timeout_s = 1.0\n")
    c = RawClient(HOST, b.mqtt_port, 5, timeout=30)
    assert c.connect(f"{uniq}-c", timeout=20).reason == 0
    started = time.monotonic()
    if case == "qos2_waiting_on_packet_id_commit":
        c.send(encode_publish(f"{uniq}/t", b"x", 2, False, 1, False, 5))
    else:
        c.send(encode_subscribe(1, [(f"{uniq}/s", 1)], 5) + encode_publish(f"{uniq}/t", b"x", 1, False, 2, False, 5))
    took, reasons = _closed_after(c, started, timeout=8.0)
    assert took < 2.7, f"connection closed {took:.1f} s after the PUBLISH was read (publish_timeout 1 s)"
    assert reasons == [0x89]
    assert _errors(b) == []


def test_packet_id_of_an_unacknowledged_delivery_is_not_reused(broker_factory: BrokerFactory, uniq: str) -> None:
    """Packet ids are seqno mod 65535 + 1. One QoS 1 delivery left unacknowledged, then 65,534 QoS 0
    deliveries: the next QoS 1 delivery would get the same packet id, so it must wait for the PUBACK."""
    b = broker_factory()
    topic = f"{uniq}/t"
    sub = RawClient(HOST, b.mqtt_port, 5, timeout=30)
    assert sub.connect(f"{uniq}-sub", clean=False, props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    assert sub.subscribe([(topic, 1)]).reasons == [1]
    pub = RawClient(HOST, b.mqtt_port, 5, timeout=30)
    assert pub.connect(f"{uniq}-pub").reason == 0
    pub.publish_and_wait(topic, b"first", qos=1)
    first = sub.recv(10)
    assert first.type == PUBLISH and first.payload == b"first" and first.qos == 1
    n0 = 65_534
    pub.send(b"".join(encode_publish(topic, b"%d" % i, 0, False, None, False, 5) for i in range(n0)))
    pub.publish_and_wait(topic, b"last", qos=1, timeout=60)
    got0 = 0
    last = None
    deadline = time.monotonic() + 60
    while got0 < n0 and time.monotonic() < deadline:
        pkt = sub.recv(30)
        if pkt.payload == b"last":
            last = pkt
            break
        assert pkt.qos == 0
        got0 += 1
    assert got0 == n0, f"only {got0} of {n0} QoS 0 deliveries arrived"
    if last is None:
        last = sub.recv_or_none(1.5)
    assert last is None, (f"packet id {last.pid} sent again while the delivery that used it "
                          f"(packet id {first.pid}) is unacknowledged")
    sub.send(encode_ack(PUBACK_TYPE, first.pid or 0, 5))
    last = sub.recv(10)
    assert last.payload == b"last" and last.pid == first.pid  # now free again
    sub.send(encode_ack(PUBACK_TYPE, last.pid or 0, 5))
    sub.close()
    pub.close()
