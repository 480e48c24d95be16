"""Will messages: published on abnormal disconnect, not on a clean DISCONNECT, MQTT 5 will delay."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from e2e_broker import BrokerFactory, BrokerProc
from e2e_support import Paho
from rawclient import P_SESSION_EXPIRY, P_WILL_DELAY, PINGREQ_BYTES, PINGRESP, RawClient

pytestmark = pytest.mark.e2e


def _watch(port: int, topic: str, uniq: str) -> Paho:
    w = Paho(port, f"{uniq}-watch", version=5)
    w.connect()
    w.subscribe(topic, 1)
    return w


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_will_on_abnormal_disconnect(shared_broker: BrokerProc, uniq: str, version: int) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, version)
    assert c.connect(f"{uniq}-c", will=(topic, b"gone", 1, False)).reason == 0
    c.abort()  # TCP reset, no DISCONNECT
    m = watch.get(timeout=10)
    assert (m.topic, m.payload, m.qos) == (topic, b"gone", 1)
    assert watch.drain(0.5) == [], "exactly one will"
    watch.disconnect()


def test_will_on_keepalive_timeout(shared_broker: BrokerProc, uniq: str) -> None:
    """A client that goes silent (socket open, no packets) past 1.5 x keepalive is disconnected; will sent."""
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, 4)
    assert c.connect(f"{uniq}-c", keepalive=1, will=(topic, b"silent", 0, False)).reason == 0
    t0 = time.monotonic()
    m = watch.get(timeout=10)
    assert m.payload == b"silent"
    assert time.monotonic() - t0 >= 1.0
    c.close()
    watch.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_no_will_on_clean_disconnect(shared_broker: BrokerProc, uniq: str, version: int) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, version)
    assert c.connect(f"{uniq}-c", will=(topic, b"must-not-appear", 1, False)).reason == 0
    c.disconnect()
    assert watch.drain(1.5) == []
    watch.disconnect()


def test_v5_disconnect_with_will_message_reason_sends_will(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    assert c.connect(f"{uniq}-c", will=(topic, b"asked-for", 1, False)).reason == 0
    c.disconnect(reason=0x04)  # Disconnect with Will Message
    assert [m.payload for m in watch.collect(1)] == [b"asked-for"]
    watch.disconnect()


def test_will_retained_flag(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/will"
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, 4)
    assert c.connect(f"{uniq}-c", will=(topic, b"status:offline", 1, True)).reason == 0
    c.abort()
    time.sleep(0.5)
    late = Paho(shared_broker.mqtt_port, f"{uniq}-late", version=4)
    late.connect()
    late.subscribe(topic, 1)
    m = late.get()
    assert (m.payload, m.retain) == (b"status:offline", True)
    late.publish(topic, b"", 1, retain=True)
    late.disconnect()


def test_v5_will_delay_interval(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    assert c.connect(f"{uniq}-c", props=[(P_SESSION_EXPIRY, 60)], will=(topic, b"delayed", 1, False),
                     will_props=[(P_WILL_DELAY, 2)]).reason == 0
    c.abort()
    t0 = time.monotonic()
    assert watch.drain(1.2) == [], "will published before its delay"
    m = watch.get(timeout=10)
    assert m.payload == b"delayed"
    assert time.monotonic() - t0 >= 1.8
    watch.disconnect()


def test_v5_will_delay_cancelled_by_reconnect(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    assert c.connect(f"{uniq}-c", clean=False, props=[(P_SESSION_EXPIRY, 60)],
                     will=(topic, b"cancelled", 1, False), will_props=[(P_WILL_DELAY, 3)]).reason == 0
    c.abort()
    time.sleep(0.5)
    c2 = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    ack = c2.connect(f"{uniq}-c", clean=False, props=[(P_SESSION_EXPIRY, 60)])
    assert ack.reason == 0 and ack.session_present
    assert watch.drain(4.0) == [], "will sent although the client came back within the delay"
    c2.disconnect()
    watch.disconnect()


def test_v5_will_sent_at_session_expiry_if_shorter_than_delay(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    assert c.connect(f"{uniq}-c", props=[(P_SESSION_EXPIRY, 1)], will=(topic, b"expired", 1, False),
                     will_props=[(P_WILL_DELAY, 30)]).reason == 0
    c.abort()
    m = watch.get(timeout=8)
    assert m.payload == b"expired"
    watch.disconnect()


@pytest.mark.moorline_only
def test_keepalive_survives_a_stalled_broker(broker_factory: BrokerFactory, uniq: str) -> None:
    """A client that keeps pinging is not timed out because the broker itself stalled (SIGSTOP here; a
    slow inline sync or a paused VM alike): after the stall its keepalive timer fires before the pings
    that arrived meanwhile are read, and must not take that for silence."""
    b = broker_factory()
    topic = f"{uniq}/will"
    watch = _watch(b.mqtt_port, topic, uniq)
    c = RawClient("127.0.0.1", b.mqtt_port, 4)
    assert c.connect(f"{uniq}-c", keepalive=1, will=(topic, b"timed-out", 0, False)).reason == 0
    stop = threading.Event()

    def ping() -> None:
        while not stop.wait(0.25):
            c.send(PINGREQ_BYTES)

    pinger = threading.Thread(target=ping, daemon=True)
    pinger.start()
    try:
        time.sleep(0.5)
        os.kill(b.pid, signal.SIGSTOP)  # our own broker process
        time.sleep(3.0)  # twice 1.5 x keepalive, pings queued in the socket meanwhile
        os.kill(b.pid, signal.SIGCONT)
        time.sleep(2.0)
    finally:
        stop.set()
        pinger.join(5)
        os.kill(b.pid, signal.SIGCONT)
    c.send(PINGREQ_BYTES)
    got = [c.recv(timeout=5).type for _ in range(3)]
    assert PINGRESP in got, f"connection gone after the stall: {got}"
    assert watch.drain(0.5) == [], "the will was published: keepalive timed out a pinging client"
    c.disconnect()
    watch.disconnect()
