"""MQTT 5 properties and reason codes, session expiry / session present, client identifiers, and
MQTT 3.1.1 clean session, checked on the wire with the raw client."""

from __future__ import annotations

import time

import pytest
from e2e_broker import BrokerFactory, BrokerProc
from rawclient import (
    CONNACK,
    DISCONNECT,
    P_ASSIGNED_CLIENT_ID,
    P_CONTENT_TYPE,
    P_CORRELATION_DATA,
    P_MAXIMUM_PACKET_SIZE,
    P_MESSAGE_EXPIRY,
    P_PAYLOAD_FORMAT,
    P_RECEIVE_MAXIMUM,
    P_RESPONSE_TOPIC,
    P_SESSION_EXPIRY,
    P_SUBSCRIPTION_ID,
    P_TOPIC_ALIAS,
    P_TOPIC_ALIAS_MAXIMUM,
    P_USER_PROPERTY,
    PUBACK,
    Packet,
    RawClient,
    encode_ack,
    encode_connect,
)

pytestmark = pytest.mark.e2e
HOST = "127.0.0.1"


def client(b: BrokerProc, cid: str, version: int = 5, **kw: object) -> RawClient:
    c = RawClient(HOST, b.mqtt_port, version)
    ack = c.connect(cid, **kw)  # type: ignore[arg-type]
    assert ack.reason == 0, ack
    return c


def test_topic_alias_client_to_server(shared_broker: BrokerProc, uniq: str) -> None:
    sub = client(shared_broker, f"{uniq}-s")
    sub.subscribe([(f"{uniq}/#", 1)])
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = pub.connect(f"{uniq}-p")
    alias_max = ack.prop(P_TOPIC_ALIAS_MAXIMUM, 0)
    assert alias_max >= 1, f"broker must accept topic aliases, CONNACK {ack}"
    t1, t2 = f"{uniq}/alias/one", f"{uniq}/alias/two"
    assert pub.publish_and_wait(t1, b"set", props=[(P_TOPIC_ALIAS, 1)]).type == PUBACK
    assert pub.publish_and_wait("", b"use", props=[(P_TOPIC_ALIAS, 1)]).type == PUBACK
    assert pub.publish_and_wait(t2, b"remap", props=[(P_TOPIC_ALIAS, 1)]).type == PUBACK
    assert pub.publish_and_wait("", b"use2", props=[(P_TOPIC_ALIAS, 1)]).type == PUBACK
    got = [sub.next_message() for _ in range(4)]
    for m in got:
        sub.ack(m)
    assert [(m.topic, m.payload) for m in got] == [(t1, b"set"), (t1, b"use"), (t2, b"remap"), (t2, b"use2")]
    # the broker does not forward the publisher's alias to the subscriber (it did not ask for aliases)
    assert all(m.prop(P_TOPIC_ALIAS) is None for m in got)
    pub.disconnect()
    sub.disconnect()


def test_topic_alias_above_maximum_closes_connection(shared_broker: BrokerProc, uniq: str) -> None:
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = pub.connect(f"{uniq}-p")
    alias_max = ack.prop(P_TOPIC_ALIAS_MAXIMUM, 0)
    pub.publish(f"{uniq}/x", b"bad", 1, props=[(P_TOPIC_ALIAS, alias_max + 1)])
    got = pub.wait_closed(5)
    discs = [p for p in got if p.type == DISCONNECT]
    if shared_broker.is_moorline:
        assert [d.reason for d in discs] == [0x94], got  # Topic Alias invalid
    assert not [p for p in got if p.type == PUBACK and p.reason < 0x80], got


def test_unknown_topic_alias_closes_connection(shared_broker: BrokerProc, uniq: str) -> None:
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    pub.connect(f"{uniq}-p")
    pub.publish("", b"no-mapping", 1, props=[(P_TOPIC_ALIAS, 1)])
    got = pub.wait_closed(5)
    assert not [p for p in got if p.type == PUBACK and p.reason < 0x80], got
    if shared_broker.is_moorline:
        assert [p.reason for p in got if p.type == DISCONNECT] in ([0x82], [0x94]), got


@pytest.mark.parametrize("qos", [1, 2])
def test_receive_maximum_is_respected(shared_broker: BrokerProc, uniq: str, qos: int) -> None:
    sub = client(shared_broker, f"{uniq}-s", props=[(P_RECEIVE_MAXIMUM, 3)])
    sub.subscribe([(f"{uniq}/rm", qos)])
    pub = client(shared_broker, f"{uniq}-p")
    n = 12
    for i in range(n):
        pub.publish_and_wait(f"{uniq}/rm", f"{i}".encode(), qos)
    first = [sub.next_message() for _ in range(3)]
    assert sub.recv_or_none(1.0) is None, "broker sent more than the client's Receive Maximum"
    # Now acknowledge one at a time and check the in-flight count never passes 3. mosquitto 2.0.11 sends
    # one too many after an ack (its issue #2301: db__message_delete_outgoing), so the bound is moorline's.
    strict = shared_broker.is_moorline
    got, unacked = list(first), list(first)
    while unacked:
        sub.ack(unacked.pop(0))
        while True:
            m = sub.recv_or_none(0.3 if len(got) < n else 0.1)
            if m is None:
                break
            got.append(m)
            unacked.append(m)
            if strict:
                assert len(unacked) <= 3, f"{len(unacked)} in flight with Receive Maximum 3"
    assert [m.payload for m in got] == [f"{i}".encode() for i in range(n)]
    assert sub.recv_or_none(0.5) is None
    sub.disconnect()
    pub.disconnect()


def test_maximum_packet_size_drops_too_large_message(shared_broker: BrokerProc, uniq: str) -> None:
    sub = client(shared_broker, f"{uniq}-s", props=[(P_MAXIMUM_PACKET_SIZE, 300)])
    sub.subscribe([(f"{uniq}/mps", 1)])
    pub = client(shared_broker, f"{uniq}-p")
    pub.publish_and_wait(f"{uniq}/mps", b"small-1")
    pub.publish_and_wait(f"{uniq}/mps", b"B" * 1000)
    pub.publish_and_wait(f"{uniq}/mps", b"small-2")
    got = []
    for _ in range(2):
        m = sub.next_message()
        assert len(m.raw) <= 300
        got.append(m.payload)
        sub.ack(m)
    assert got == [b"small-1", b"small-2"]
    assert sub.recv_or_none(0.5) is None
    sub.disconnect()
    pub.disconnect()


def test_message_expiry_while_queued(shared_broker: BrokerProc, uniq: str) -> None:
    cid = f"{uniq}-s"
    sub = client(shared_broker, cid, clean=True, props=[(P_SESSION_EXPIRY, 300)])
    sub.subscribe([(f"{uniq}/exp", 1)])
    sub.disconnect()
    pub = client(shared_broker, f"{uniq}-p")
    pub.publish_and_wait(f"{uniq}/exp", b"short", props=[(P_MESSAGE_EXPIRY, 1)])
    pub.publish_and_wait(f"{uniq}/exp", b"long", props=[(P_MESSAGE_EXPIRY, 60)])
    pub.publish_and_wait(f"{uniq}/exp", b"forever")
    time.sleep(2.3)
    sub = client(shared_broker, cid, clean=False, props=[(P_SESSION_EXPIRY, 300)])
    got = []
    for _ in range(2):
        m = sub.next_message()
        sub.ack(m)
        got.append(m)
    assert [m.payload for m in got] == [b"long", b"forever"], "expired message delivered"
    remaining = got[0].prop(P_MESSAGE_EXPIRY)
    assert remaining is not None and 1 <= remaining <= 58, f"remaining expiry {remaining}"
    assert got[1].prop(P_MESSAGE_EXPIRY) is None
    assert sub.recv_or_none(0.5) is None
    sub.disconnect(props=[(P_SESSION_EXPIRY, 0)])
    pub.disconnect()


def test_subscription_identifiers(shared_broker: BrokerProc, uniq: str) -> None:
    sub = client(shared_broker, f"{uniq}-s")
    sub.subscribe([(f"{uniq}/a/#", 1)], props=[(P_SUBSCRIPTION_ID, 7)])
    sub.subscribe([(f"{uniq}/a/b", 1)], props=[(P_SUBSCRIPTION_ID, 300)])
    sub.subscribe([(f"{uniq}/c", 1)])
    pub = client(shared_broker, f"{uniq}-p")
    pub.publish_and_wait(f"{uniq}/a/b", b"both")
    pub.publish_and_wait(f"{uniq}/a/z", b"seven")
    pub.publish_and_wait(f"{uniq}/c", b"none")
    msgs: list[Packet] = []
    while True:
        m = sub.recv_or_none(1.0)
        if m is None:
            break
        msgs.append(m)
        sub.ack(m)
    ids_by_payload: dict[bytes, list[int]] = {}
    for m in msgs:
        ids_by_payload.setdefault(m.payload, []).extend(m.props_all(P_SUBSCRIPTION_ID))
    assert sorted(ids_by_payload[b"both"]) == [7, 300]  # one copy with both ids, or one copy per subscription
    assert ids_by_payload[b"seven"] == [7]
    assert ids_by_payload[b"none"] == []
    assert sum(1 for m in msgs if m.payload == b"seven") == 1
    sub.disconnect()
    pub.disconnect()


def test_no_local(shared_broker: BrokerProc, uniq: str) -> None:
    me = client(shared_broker, f"{uniq}-me")
    me.subscribe([(f"{uniq}/nl", 1, {"no_local": True})])
    other = client(shared_broker, f"{uniq}-other")
    me.publish_and_wait(f"{uniq}/nl", b"mine")
    other.publish_and_wait(f"{uniq}/nl", b"theirs")
    m = me.next_message()
    me.ack(m)
    assert m.payload == b"theirs"
    assert me.recv_or_none(0.7) is None
    me.disconnect()
    other.disconnect()


def test_user_properties_and_request_response_round_trip(shared_broker: BrokerProc, uniq: str) -> None:
    sub = client(shared_broker, f"{uniq}-s")
    sub.subscribe([(f"{uniq}/req", 2)])
    pub = client(shared_broker, f"{uniq}-p")
    sent_user = [("a", "1"), ("a", "2"), ("z", "ünïcode"), ("b", "")]
    props = [(P_USER_PROPERTY, kv) for kv in sent_user] + [
        (P_RESPONSE_TOPIC, f"{uniq}/resp"), (P_CORRELATION_DATA, b"\x00\x01corr\xff"),
        (P_CONTENT_TYPE, "application/json"), (P_PAYLOAD_FORMAT, 1)]
    for qos in (0, 1, 2):
        if qos:
            pub.publish_and_wait(f"{uniq}/req", b'{"q": %d}' % qos, qos, props=props)
        else:
            pub.publish(f"{uniq}/req", b'{"q": 0}', 0, props=props)
        m = sub.next_message()
        sub.ack(m)
        assert m.payload == b'{"q": %d}' % qos
        assert m.user_properties == sent_user, "user properties are forwarded unaltered: order, duplicates"
        assert m.prop(P_RESPONSE_TOPIC) == f"{uniq}/resp"
        assert m.prop(P_CORRELATION_DATA) == b"\x00\x01corr\xff"
        assert m.prop(P_CONTENT_TYPE) == "application/json"
        assert m.prop(P_PAYLOAD_FORMAT) == 1
    sub.disconnect()
    pub.disconnect()


@pytest.mark.moorline_only
def test_stamp_guid_property_adds_one_guid_when_configured(broker_factory: BrokerFactory, uniq: str) -> None:
    """mqtt.stamp_guid_property: a delivered message without a `guid` user property gets exactly one (the
    shard's GUID of the message), after the publisher's own properties; one that has a guid keeps it."""
    b = broker_factory(config_text="[mqtt]\nstamp_guid_property = true\n")
    sub = RawClient(HOST, b.mqtt_port, 5)
    assert sub.connect(f"{uniq}-sub").reason == 0
    sub.subscribe([(f"{uniq}/#", 1)])
    pub = RawClient(HOST, b.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    pub.publish_and_wait(f"{uniq}/plain", b"p", 1)
    pub.publish_and_wait(f"{uniq}/props", b"q", 1, props=[(P_USER_PROPERTY, ("a", "1"))])
    own = "00112233445566778899aabbccddeeff"
    pub.publish_and_wait(f"{uniq}/own", b"r", 1, props=[(P_USER_PROPERTY, ("guid", own))])
    got = {}
    for _ in range(3):
        m = sub.next_message()
        sub.ack(m)
        got[m.topic.rsplit("/", 1)[1]] = m.user_properties
    [(k1, g1)] = got["plain"]
    assert k1 == "guid" and len(g1) == 32 and int(g1, 16) >= 0
    assert got["props"][0] == ("a", "1") and [k for k, _ in got["props"]] == ["a", "guid"]
    assert got["own"] == [("guid", own)]
    sub.disconnect()
    pub.disconnect()


@pytest.mark.moorline_only
def test_client_guid_is_delivered_unchanged(shared_broker: BrokerProc, uniq: str) -> None:
    sub = client(shared_broker, f"{uniq}-s")
    sub.subscribe([(f"{uniq}/g", 1)])
    pub = client(shared_broker, f"{uniq}-p")
    guid = "0123456789abcdef0123456789abcdef"
    pub.publish_and_wait(f"{uniq}/g", b"x", props=[(P_USER_PROPERTY, ("guid", guid))])
    m = sub.next_message()
    sub.ack(m)
    assert [v for k, v in m.user_properties if k == "guid"] == [guid]
    sub.disconnect()
    pub.disconnect()


def test_reason_codes_puback_suback_unsuback(shared_broker: BrokerProc, uniq: str) -> None:
    c = client(shared_broker, f"{uniq}-c")
    ack = c.publish_and_wait(f"{uniq}/nobody-listens", b"x", 1)
    assert ack.reason in (0x00, 0x10), ack  # 0x10 No matching subscribers is optional
    suback = c.subscribe([(f"{uniq}/q0", 0), (f"{uniq}/q1", 1), (f"{uniq}/q2", 2)])
    assert suback.reasons == [0, 1, 2]
    unsuback = c.unsubscribe([f"{uniq}/q1", f"{uniq}/never-subscribed"])
    assert unsuback.reasons[0] == 0x00
    assert unsuback.reasons[1] in (0x00, 0x11), unsuback
    if shared_broker.is_moorline:
        assert unsuback.reasons[1] == 0x11, "No subscription existed"
    rec = c.publish_and_wait(f"{uniq}/nobody-listens", b"x", 2)
    assert rec.reason in (0x00, 0x10), rec
    c.disconnect()


def test_session_expiry_and_session_present(shared_broker: BrokerProc, uniq: str) -> None:
    cid = f"{uniq}-c"
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert c.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 2)]).session_present is False
    c.subscribe([(f"{uniq}/se", 1)])
    c.disconnect()
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = c.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 2)])
    assert ack.session_present is True
    c.disconnect()
    time.sleep(3.2)
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert c.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 0)]).session_present is False, \
        "session outlived its expiry"
    # the expired session's subscription is gone
    pub = client(shared_broker, f"{uniq}-p")
    pub.publish_and_wait(f"{uniq}/se", b"x", 1)
    assert c.recv_or_none(0.7) is None
    c.disconnect()
    # expiry 0: the session ends with the connection
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert c.connect(cid, clean=False).session_present is False
    pub.disconnect()
    c.disconnect()


def test_clean_start_discards_session(shared_broker: BrokerProc, uniq: str) -> None:
    cid = f"{uniq}-c"
    c = client(shared_broker, cid, clean=False, props=[(P_SESSION_EXPIRY, 60)])
    c.subscribe([(f"{uniq}/cs", 1)])
    c.disconnect()
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = c.connect(cid, clean=True, props=[(P_SESSION_EXPIRY, 60)])
    assert ack.session_present is False
    pub = client(shared_broker, f"{uniq}-p")
    pub.publish_and_wait(f"{uniq}/cs", b"x", 1)
    assert c.recv_or_none(0.7) is None, "clean start must drop the old subscription"
    c.disconnect(props=[(P_SESSION_EXPIRY, 0)])
    pub.disconnect()


def test_assigned_client_identifier(shared_broker: BrokerProc) -> None:
    ids = []
    for _ in range(2):
        c = RawClient(HOST, shared_broker.mqtt_port, 5)
        ack = c.connect("")
        assert ack.reason == 0
        assigned = ack.prop(P_ASSIGNED_CLIENT_ID)
        assert isinstance(assigned, str) and assigned, ack
        ids.append(assigned)
        c.disconnect()
    assert ids[0] != ids[1]


def test_v311_empty_client_id(shared_broker: BrokerProc) -> None:
    c = RawClient(HOST, shared_broker.mqtt_port, 4)
    assert c.connect("", clean=True).reason == 0
    c.disconnect()
    c = RawClient(HOST, shared_broker.mqtt_port, 4)
    c.send(encode_connect("", 4, clean=False))
    got = c.wait_closed(5)
    assert [(p.type, p.reason) for p in got] == [(CONNACK, 0x02)], got  # identifier rejected


def test_v311_clean_session(shared_broker: BrokerProc, uniq: str) -> None:
    cid = f"{uniq}-c"
    c = RawClient(HOST, shared_broker.mqtt_port, 4)
    assert c.connect(cid, clean=False).session_present is False
    c.subscribe([(f"{uniq}/v3", 1)])
    c.disconnect()
    pub = client(shared_broker, f"{uniq}-p", version=4)
    pub.publish_and_wait(f"{uniq}/v3", b"while-away", 1)
    c = RawClient(HOST, shared_broker.mqtt_port, 4)
    assert c.connect(cid, clean=False).session_present is True
    m = c.next_message()
    assert m.payload == b"while-away"
    c.send(encode_ack(PUBACK, m.pid, 4))  # type: ignore[arg-type]
    c.disconnect()
    # clean session 1 discards the session, and a clean session leaves nothing behind
    c = RawClient(HOST, shared_broker.mqtt_port, 4)
    assert c.connect(cid, clean=True).session_present is False
    c.disconnect()
    pub.publish_and_wait(f"{uniq}/v3", b"nobody", 1)
    c = RawClient(HOST, shared_broker.mqtt_port, 4)
    assert c.connect(cid, clean=False).session_present is False
    assert c.recv_or_none(0.7) is None
    c.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_session_takeover(shared_broker: BrokerProc, uniq: str, version: int) -> None:
    cid = f"{uniq}-c"
    first = client(shared_broker, cid, version=version)
    second = client(shared_broker, cid, version=version)
    got = first.wait_closed(5)
    if version == 5 and shared_broker.is_moorline:  # mosquitto 2.0.11 just closes
        assert [p.reason for p in got if p.type == DISCONNECT] == [0x8E], got  # Session taken over
    second.ping()
    second.disconnect()
