"""Issue 33 item 3, against a real broker process (docs/queues.md, "Acknowledgement timeouts"):
a connected ``$share`` member that holds a message unacknowledged past ``queue.ack_timeout_s`` has
its connection closed (MQTT 5: DISCONNECT 0x83 "ack timeout"; 3.1.1: closed) within the timeout
plus one housekeeping round, and another member receives the message; a QoS 2 message the member
PUBREC'd stays its own; a member that acknowledges in time is never closed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_broker import BrokerProc, running_broker
from rawclient import DISCONNECT, PUBREC, PUBREL, RawClient, encode_ack
from test_e2e_work_queues import member, metric, publish

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
P_REASON_STRING = 0x1F
ACK_TIMEOUT_S = 1.0
TICK_S = 1.0  # shard.housekeeping_interval_s (default)

CONFIG = f"""
[queue]
limited_groups = ["to-*"]
ack_timeout_s = {ACK_TIMEOUT_S}
"""


@pytest.fixture(scope="module")
def q_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    with running_broker(Path(tmp_path_factory.mktemp("qto")), config_text=CONFIG) as b:
        yield b


@pytest.mark.parametrize("version", [5, 4])
def test_ack_timeout_closes_the_holders_connection(q_broker: BrokerProc, uniq: str, version: int) -> None:
    port, topic = q_broker.mqtt_port, f"{uniq}/jobs"
    flt = f"$share/to-{uniq}/{topic}"
    x = RawClient(HOST, port, version)
    assert x.connect(f"{uniq}-x", clean=True).reason == 0
    assert x.subscribe([(flt, 1)]).reasons == [1]  # type: ignore[attr-defined]
    y = member(port, f"{uniq}-y", flt)
    before = metric(q_broker, "moorline_share_ack_timeouts_total")
    publish(port, f"{uniq}-p", topic, [b"held"])
    first = x.recv_or_none(3.0)
    holder, other = (x, y) if first is not None else (y, x)
    held = first if first is not None else y.next_message(5)
    assert held.payload == b"held"
    t0 = time.monotonic()
    # Never acknowledged: the holder's connection is closed, on MQTT 5 with DISCONNECT 0x83.
    got = holder.wait_closed(ACK_TIMEOUT_S + TICK_S + 2.0)
    waited = time.monotonic() - t0
    if holder.version == 5:
        disc = [pk for pk in got if pk.type == DISCONNECT]
        assert disc, f"the holder got no DISCONNECT before its connection closed: {got!r}"
        assert disc[0].reason == 0x83 and disc[0].prop(P_REASON_STRING) == "ack timeout"
    else:
        assert not got, got  # 3.1.1 has no server DISCONNECT: closed
    assert ACK_TIMEOUT_S * 0.9 <= waited <= ACK_TIMEOUT_S + TICK_S + 0.5, waited
    again = other.next_message(5.0)  # the other member receives it
    assert again.payload == b"held"
    other.ack(again)
    other.ping()
    assert other.recv_or_none(1.0) is None, "once"
    assert metric(q_broker, "moorline_share_ack_timeouts_total") == before + 1
    other.disconnect()


def test_a_pubrecd_qos2_message_stays_with_its_member(q_broker: BrokerProc, uniq: str) -> None:
    """A QoS 2 message the member PUBREC'd (and never completes) is received: PUBREC is its receipt
    (MQTT-4.8.2-5). The member is not closed for it, and the message never goes to another member."""
    port, topic = q_broker.mqtt_port, f"{uniq}/jobs"
    flt = f"$share/to-{uniq}/{topic}"
    a = RawClient(HOST, port, 5)
    assert a.connect(f"{uniq}-a", clean=True).reason == 0
    assert a.subscribe([(flt, 2)]).reasons == [2]  # type: ignore[attr-defined]
    pub = RawClient(HOST, port, 5)
    assert pub.connect(f"{uniq}-p").reason == 0
    assert pub.publish_and_wait(topic, b"q2", 2).reason < 0x80
    m = a.next_message(5.0)
    assert m.payload == b"q2" and m.qos == 2
    a.send(encode_ack(PUBREC, m.pid, 5))  # type: ignore[arg-type]
    assert a.expect(PUBREL, 5).pid == m.pid  # never PUBCOMP'd
    b = member(port, f"{uniq}-b", flt)
    time.sleep(ACK_TIMEOUT_S + TICK_S + 0.5)
    a.ping()  # still connected: a PUBREC'd message is not held unacknowledged
    assert b.recv_or_none(0.5) is None, "a PUBREC'd QoS 2 message never goes to another member"
    pub.disconnect()
    b.disconnect()
    a.disconnect()


def test_ack_timeout_keeps_an_acknowledging_member(q_broker: BrokerProc, uniq: str) -> None:
    """A member that acknowledges each message within the timeout is never closed."""
    port, topic = q_broker.mqtt_port, f"{uniq}/jobs"
    a = member(port, f"{uniq}-a", f"$share/to-{uniq}/{topic}")
    for i in range(3):
        publish(port, f"{uniq}-p{i}", topic, [f"m{i}".encode()])
        m = a.next_message(5.0)
        time.sleep(ACK_TIMEOUT_S / 2)
        a.ack(m)
    time.sleep(ACK_TIMEOUT_S + TICK_S)
    a.ping()  # still connected
    a.disconnect()
