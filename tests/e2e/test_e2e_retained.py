"""Retained messages: set, replace, clear, delivery on subscribe, MQTT 5 retain handling and
retain-as-published."""

from __future__ import annotations

import pytest
from e2e_broker import BrokerFactory, BrokerProc
from e2e_support import Paho, mosquitto_pub, mosquitto_sub, sub_lines
from paho.mqtt.subscribeoptions import SubscribeOptions

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_retained_set_replace_clear(shared_broker: BrokerProc, uniq: str, version: int) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/r"
    pub = Paho(port, f"{uniq}-p", version=version)
    pub.connect()
    pub.publish(topic, b"first", 1, retain=True)
    pub.publish(topic, b"second", 1, retain=True)

    s1 = Paho(port, f"{uniq}-s1", version=version)
    s1.connect()
    s1.subscribe(topic, 1)
    m = s1.get()
    assert (m.payload, m.retain, m.qos) == (b"second", True, 1)
    assert s1.drain(0.5) == [], "only the latest retained message is kept"

    # A live message on a subscribed topic arrives with retain=0 (no retain-as-published).
    pub.publish(topic, b"third", 1, retain=True)
    m = s1.get()
    assert (m.payload, m.retain) == (b"third", False)

    # Clear with an empty retained payload: it is delivered live, then nothing is retained any more.
    pub.publish(topic, b"", 1, retain=True)
    assert s1.get().payload == b""
    s2 = Paho(port, f"{uniq}-s2", version=version)
    s2.connect()
    s2.subscribe(topic, 1)
    assert s2.drain(0.7) == []
    for c in (pub, s1, s2):
        c.disconnect()


def test_retained_delivered_for_wildcard_subscription(shared_broker: BrokerProc, uniq: str) -> None:
    port = shared_broker.mqtt_port
    pub = Paho(port, f"{uniq}-p", version=4)
    pub.connect()
    topics = [f"{uniq}/w/{i}/x" for i in range(12)]
    for i, t in enumerate(topics):
        pub.publish(t, f"v{i}".encode(), 1, retain=True)
    pub.publish(f"{uniq}/w/0/y", b"other", 1, retain=True)  # must not match the filter
    sub = Paho(port, f"{uniq}-s", version=5)
    sub.connect()
    sub.subscribe(f"{uniq}/w/+/x", 2)
    got = sub.collect(len(topics), timeout=10)
    assert sorted((m.topic, m.payload) for m in got) == sorted((t, f"v{i}".encode()) for i, t in enumerate(topics))
    assert all(m.retain for m in got)
    assert sub.drain(0.5) == []
    # clean up so the shared broker does not carry these for other tests
    for t in topics + [f"{uniq}/w/0/y"]:
        pub.publish(t, b"", 1, retain=True)
    pub.disconnect()
    sub.disconnect()


def test_v5_retain_handling_0_1_2(shared_broker: BrokerProc, uniq: str) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/rh"
    pub = Paho(port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(topic, b"kept", 1, retain=True)

    # 0: send retained at every subscribe, also when the subscription already exists
    s0 = Paho(port, f"{uniq}-s0", version=5)
    s0.connect()
    s0.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=0))
    assert [m.payload for m in s0.collect(1)] == [b"kept"]
    s0.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=0))
    assert [m.payload for m in s0.collect(1)] == [b"kept"]

    # 1: only if the subscription did not exist yet
    s1 = Paho(port, f"{uniq}-s1", version=5)
    s1.connect()
    s1.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=1))
    assert [m.payload for m in s1.collect(1)] == [b"kept"]
    s1.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=1))
    assert s1.drain(0.7) == []

    # 2: never at subscribe time; live messages still flow
    s2 = Paho(port, f"{uniq}-s2", version=5)
    s2.connect()
    s2.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=2))
    assert s2.drain(0.7) == []
    pub.publish(topic, b"live", 1)
    assert [m.payload for m in s2.collect(1)] == [b"live"]
    assert s0.drain(0.3)[-1].payload == b"live"
    pub.publish(topic, b"", 1, retain=True)
    for c in (pub, s0, s1, s2):
        c.disconnect()


def test_v5_retain_as_published(shared_broker: BrokerProc, uniq: str) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/rap"
    rap = Paho(port, f"{uniq}-rap", version=5)
    rap.connect()
    rap.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=True))
    plain = Paho(port, f"{uniq}-plain", version=5)
    plain.connect()
    plain.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=False))
    pub = Paho(port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(topic, b"r1", 1, retain=True)
    pub.publish(topic, b"n1", 1, retain=False)
    assert [(m.payload, m.retain) for m in rap.collect(2)] == [(b"r1", True), (b"n1", False)]
    assert [(m.payload, m.retain) for m in plain.collect(2)] == [(b"r1", False), (b"n1", False)]
    pub.publish(topic, b"", 1, retain=True)
    for c in (pub, rap, plain):
        c.disconnect()


def test_retained_with_mosquitto_clients(shared_broker: BrokerProc, uniq: str) -> None:
    port, topic = shared_broker.mqtt_port, f"{uniq}/cli"
    assert mosquitto_pub(port, topic, "retained-hello", qos=1, retain=True).returncode == 0
    lines = sub_lines(mosquitto_sub(port, topic, 1, qos=1, timeout_s=10, extra=["--retained-only"]))
    assert lines == [f"{topic} retained-hello"]
    assert mosquitto_pub(port, topic, None, qos=1, retain=True).returncode == 0  # -n: clear
    proc = mosquitto_sub(port, topic, 1, qos=1, timeout_s=2, extra=["--retained-only"])
    assert sub_lines(proc) == []


def test_retained_survives_clean_restart(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/keep"
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(topic, b"durable-retained", 1, retain=True)
    pub.disconnect()
    shared_broker.restart(kill=False)
    sub = Paho(shared_broker.mqtt_port, f"{uniq}-s", version=5)
    sub.connect()
    sub.subscribe(topic, 1)
    m = sub.get()
    assert (m.payload, m.retain) == (b"durable-retained", True)
    sub.disconnect()


@pytest.mark.moorline_only
def test_retained_messages_on_subscribe_respect_the_inflight_window(broker_factory: BrokerFactory, uniq: str) -> None:
    """A SUBSCRIBE matching many retained QoS 1 messages gets at most the window
    (mqtt.max_inflight_out for 3.1.1) before it acknowledges any, then the rest as it does."""
    from rawclient import RawClient  # noqa: PLC0415 - the raw client reads what paho would ack

    b = broker_factory(config_text="[mqtt]\nmax_inflight_out = 10\n")
    pub = RawClient("127.0.0.1", b.mqtt_port, 4)
    assert pub.connect(f"{uniq}-p").reason == 0
    for i in range(40):
        pub.publish_and_wait(f"{uniq}/r/{i}", b"v%d" % i, qos=1, retain=True)
    sub = RawClient("127.0.0.1", b.mqtt_port, 4)
    assert sub.connect(f"{uniq}-s").reason == 0
    sub.send(__import__("rawclient").encode_subscribe(1, [(f"{uniq}/r/#", 1)], 4))
    got = []
    while (pkt := sub.recv_or_none(1.0)) is not None:
        if pkt.type == 3:
            got.append(pkt)
    assert len(got) == 10, f"{len(got)} retained QoS 1 messages in flight with a window of 10"
    for pkt in got:
        sub.ack(pkt)
    while (pkt := sub.recv_or_none(1.0)) is not None:
        if pkt.type == 3:
            got.append(pkt)
            sub.ack(pkt)
    assert sorted(p.topic for p in got) == sorted(f"{uniq}/r/{i}" for i in range(40))
    pub.close()
    sub.close()
