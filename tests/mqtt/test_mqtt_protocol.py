"""Per-connection protocol state: CONNECT ordering, topic aliases, receive maximum, maximum
packet size, flow control and keepalive."""

from __future__ import annotations

import pytest

from moorline.invariant import InvariantViolation
from moorline.mqtt.codec import Decoder, encode, encode_properties, encode_publish_fast
from moorline.mqtt.errors import ProtocolError
from moorline.mqtt.packets import (
    NO_PROPERTIES,
    Auth,
    Connect,
    Disconnect,
    Pingreq,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from moorline.mqtt.protocol import SPLIT_PAYLOAD_BYTES, ProtocolState
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.topics import TopicBounds


def connected(version: int = 5, connect_props: Properties = NO_PROPERTIES, **kw: int) -> ProtocolState:
    state = ProtocolState(**kw)  # type: ignore[arg-type]
    [c] = state.receive(encode(Connect("MQTT", version, "cid", True, 30, properties=connect_props), version))
    assert isinstance(c, Connect) and not state.awaiting_connect and state.version == version
    return state


def pub(topic: str, qos: int = 0, pid: int | None = None, alias: int | None = None, **props: object) -> Publish:
    p = Properties(topic_alias=alias, **props) if (alias is not None or props) else NO_PROPERTIES  # type: ignore[arg-type]
    return Publish(topic, b"x", qos, False, False, pid, p)


def expect_error(state: ProtocolState, data: bytes, reason: int) -> None:
    with pytest.raises(ProtocolError) as info:
        state.receive(data)
    assert info.value.reason_code == reason
    with pytest.raises(ProtocolError):  # stays failed
        state.receive(encode(Pingreq(), 5))


# --- CONNECT ordering ---------------------------------------------------------------------------------


def test_first_packet_must_be_connect() -> None:
    state = ProtocolState()
    assert state.awaiting_connect
    expect_error(state, encode(Pingreq(), 4), RC.PROTOCOL_ERROR)


def test_second_connect_is_protocol_error() -> None:
    state = connected(4)
    expect_error(state, encode(Connect("MQTT", 4, "again"), 4), RC.PROTOCOL_ERROR)


def test_connect_then_packets_in_one_read() -> None:
    state = ProtocolState()
    data = encode(Connect("MQTT", 4, "c"), 4) + encode(pub("a/b"), 4) + encode(Pingreq(), 4)
    out = state.receive(data)
    assert [type(p) for p in out] == [Connect, Publish, Pingreq]


def test_invalid_will_topic() -> None:
    state = ProtocolState()
    bad = Connect("MQTT", 5, "c", will=Will("a/#", b""))
    expect_error(state, encode(bad, 5), RC.TOPIC_NAME_INVALID)
    assert state.awaiting_connect  # the broker answers with CONNACK 0x90


def test_auth_data_without_method_in_connect() -> None:
    state = ProtocolState()
    expect_error(state, encode(Connect("MQTT", 5, "c", properties=Properties(authentication_data=b"x")), 5),
                 RC.PROTOCOL_ERROR)


# --- PUBLISH validation and inbound topic aliases -------------------------------------------------------


@pytest.mark.parametrize("topic", ["a/+", "#", "a/#/b"])
def test_wildcard_in_publish_topic(topic: str) -> None:
    expect_error(connected(5), encode(pub(topic), 5), RC.TOPIC_NAME_INVALID)


def test_empty_topic_v3() -> None:
    expect_error(connected(4), encode(pub(""), 4), RC.TOPIC_NAME_INVALID)


def test_empty_topic_without_alias_v5() -> None:
    expect_error(connected(5, topic_alias_maximum_in=4), encode(pub(""), 5), RC.PROTOCOL_ERROR)


def test_topic_alias_resolution() -> None:
    state = connected(5, topic_alias_maximum_in=4)
    out = state.receive(encode(pub("a/b", alias=2), 5) + encode(pub("", alias=2), 5)
                        + encode(pub("c/d", alias=2, content_type="t"), 5) + encode(pub("", alias=2), 5))
    assert [p.topic for p in out] == ["a/b", "a/b", "c/d", "c/d"]  # type: ignore[union-attr]
    assert all(p.properties.topic_alias is None for p in out)  # type: ignore[union-attr]
    assert out[0].properties == NO_PROPERTIES  # type: ignore[union-attr]
    assert out[2].properties == Properties(content_type="t")  # type: ignore[union-attr]


@pytest.mark.parametrize("alias", [0, 5, 65535])
def test_topic_alias_out_of_range(alias: int) -> None:
    expect_error(connected(5, topic_alias_maximum_in=4), encode(pub("a", alias=alias), 5), RC.TOPIC_ALIAS_INVALID)


def test_topic_alias_when_none_allowed() -> None:
    expect_error(connected(5), encode(pub("a", alias=1), 5), RC.TOPIC_ALIAS_INVALID)


def test_unknown_alias_with_empty_topic() -> None:
    expect_error(connected(5, topic_alias_maximum_in=4), encode(pub("", alias=3), 5), RC.PROTOCOL_ERROR)


# --- inbound receive maximum ------------------------------------------------------------------------------


def test_receive_maximum_exceeded_and_acks_free_slots() -> None:
    state = connected(5, receive_maximum_in=2)
    state.receive(encode(pub("t", 1, 1), 5) + encode(pub("t", 2, 2), 5) + encode(pub("t", 0), 5))
    assert state.inbound_inflight == 2  # QoS 0 does not count
    state.receive(encode(pub("t", 2, 2), 5))  # a resend of an in-flight id does not count again
    assert state.encode_outbound(Puback(1)) is not None
    assert state.inbound_inflight == 1
    state.receive(encode(pub("t", 1, 3), 5))
    state.note_inbound_acked(2)
    state.note_inbound_acked(2)  # idempotent
    state.receive(encode(pub("t", 1, 4), 5))
    assert state.inbound_inflight == 2
    expect_error(state, encode(pub("t", 1, 5), 5), RC.RECEIVE_MAXIMUM_EXCEEDED)


def test_qos2_slot_freed_by_pubcomp_or_failed_pubrec() -> None:
    state = connected(5, receive_maximum_in=1)
    state.receive(encode(pub("t", 2, 9), 5))
    state.encode_outbound(Pubrec(9))  # success PUBREC keeps the slot until PUBCOMP
    assert state.inbound_inflight == 1
    state.encode_outbound(Pubcomp(9))
    assert state.inbound_inflight == 0
    state.receive(encode(pub("t", 2, 10), 5))
    state.encode_outbound(Pubrec(10, RC.QUOTA_EXCEEDED))
    assert state.inbound_inflight == 0


def test_receive_maximum_not_enforced_for_v3() -> None:
    state = connected(4, receive_maximum_in=1)
    state.receive(encode(pub("t", 1, 1), 4) + encode(pub("t", 1, 2), 4))
    assert state.inbound_inflight == 2  # the broker applies back-pressure from this count


def test_connack_properties_advertise_limits() -> None:
    state = ProtocolState(max_packet_size_in=5000, topic_alias_maximum_in=7, receive_maximum_in=100)
    assert state.connack_properties() == Properties(receive_maximum=100, topic_alias_maximum=7, maximum_packet_size=5000)


# --- SUBSCRIBE / AUTH rules --------------------------------------------------------------------------------


def test_no_local_on_shared_subscription() -> None:
    sub = Subscribe(1, (("$share/g/a", SubscriptionOptions(1, no_local=True)),))
    expect_error(connected(5), encode(sub, 5), RC.PROTOCOL_ERROR)
    ok = Subscribe(1, (("$share/g/a", SubscriptionOptions(1)), ("a", SubscriptionOptions(1, no_local=True))))
    assert connected(5).receive(encode(ok, 5)) == [ok]


def test_auth_rules() -> None:
    expect_error(connected(5), encode(Auth(RC.REAUTH), 5), RC.PROTOCOL_ERROR)  # no method at all
    state = connected(5, Properties(authentication_method="SCRAM"))
    expect_error(state, encode(Auth(RC.REAUTH, Properties(authentication_method="OTHER")), 5), RC.PROTOCOL_ERROR)
    state = connected(5, Properties(authentication_method="SCRAM"))
    a = Auth(RC.REAUTH, Properties(authentication_method="SCRAM", authentication_data=b"d"))
    assert state.receive(encode(a, 5)) == [a]


# --- outbound: maximum packet size, aliases, flow control ------------------------------------------------


def test_outbound_drops_reason_string_then_packet_when_too_large() -> None:
    state = connected(5, Properties(maximum_packet_size=40))
    small = Suback(1, (0,), Properties(reason_string="r" * 60))
    data = state.encode_outbound(small)
    assert data is not None and len(data) <= 40
    assert Decoder(role="client", version=5).feed(data) == [Suback(1, (0,))]
    big = Suback(1, (0,) * 50)
    assert state.encode_outbound(big) is None
    assert state.encode_outbound(pub("t" * 50)) is None
    assert state.encode_outbound(pub("t")) is not None
    disc = Disconnect(RC.SERVER_SHUTTING_DOWN, Properties(user_properties=(("k", "v" * 50),)))
    data = state.encode_outbound(disc)
    assert data is not None
    assert Decoder(role="client", version=5).feed(data) == [Disconnect(RC.SERVER_SHUTTING_DOWN)]


def test_no_client_limit_means_no_drop_and_v3_ignores_limits() -> None:
    state = connected(5)
    assert state.encode_outbound(Publish("t", b"x" * 100_000)) is not None
    state = connected(4)
    assert state.encode_outbound(Suback(1, (0x87,))) == encode(Suback(1, (0x80,)), 4)


def test_outbound_topic_aliases() -> None:
    state = connected(5, Properties(topic_alias_maximum=2))
    client = Decoder(role="client", version=5)
    stream = b""
    for topic in ["a", "b", "a", "c", "b", "c"]:
        data = state.encode_outbound(pub(topic))
        assert data is not None
        stream += data
    got = client.feed(stream)
    # first use carries topic + alias, later uses only the alias; "c" found no free alias.
    assert [(p.topic, p.properties.topic_alias) for p in got] == [  # type: ignore[union-attr]
        ("a", 1), ("b", 2), ("", 1), ("c", None), ("", 2), ("c", None)]


def test_outbound_alias_not_recorded_for_dropped_publish() -> None:
    state = connected(5, Properties(topic_alias_maximum=2, maximum_packet_size=30))
    assert state.encode_publish("big", b"big", b"x" * 100, 0, False, False, None) is None
    data = state.encode_publish("big", b"big", b"x", 0, False, False, None)
    [p] = Decoder(role="client", version=5).feed(data)  # type: ignore[arg-type]
    assert p.topic == "big" and p.properties.topic_alias == 1  # type: ignore[union-attr]


def test_outbound_alias_with_cached_properties() -> None:
    state = connected(5, Properties(topic_alias_maximum=1))
    props = Properties(user_properties=(("guid", "00" * 16),))
    body = encode_properties(props)
    client = Decoder(role="client", version=5)
    out = []
    for _ in range(2):
        data = state.encode_publish("t/x", b"t/x", b"p", 1, False, False, 7, body)
        assert data is not None
        out += client.feed(data)
    assert out[0].properties == Properties(user_properties=props.user_properties, topic_alias=1)  # type: ignore[union-attr]
    assert out[1].topic == "" and out[1].properties.topic_alias == 1  # type: ignore[union-attr]


def test_outbound_aliases_can_be_turned_off() -> None:
    state = ProtocolState(outbound_topic_aliases=False)
    state.receive(encode(Connect("MQTT", 5, "c", properties=Properties(topic_alias_maximum=5)), 5))
    assert state.encode_outbound(pub("a")) == encode(pub("a"), 5)


def test_outbound_flow_control() -> None:
    state = connected(5, Properties(receive_maximum=2))
    assert state.outbound_quota_available() == 2
    state.on_outbound_publish_sent(1)
    state.on_outbound_publish_sent(0)  # QoS 0 is not counted
    state.on_outbound_publish_sent(2)
    assert state.outbound_quota_available() == 0
    with pytest.raises(InvariantViolation):
        state.on_outbound_publish_sent(1)
    state.on_outbound_ack()
    assert state.outbound_quota_available() == 1 and state.outbound_inflight == 1
    state.on_outbound_ack()
    with pytest.raises(InvariantViolation):
        state.on_outbound_ack()


def test_outbound_flow_control_defaults_to_spec_maximum() -> None:
    assert connected(4).outbound_quota_available() == 65535
    assert connected(5).outbound_quota_available() == 65535


# --- keepalive --------------------------------------------------------------------------------------------


def test_keepalive_deadline_one_and_a_half_times() -> None:
    state = connected(4)  # keepalive 30 s
    assert state.keepalive_deadline(100.0) == pytest.approx(145.0)
    state.keepalive = 10  # e.g. the broker sent Server Keep Alive = 10
    assert state.keepalive_deadline(0.0) == pytest.approx(15.0)
    state.keepalive = 0
    assert state.keepalive_deadline(100.0) is None


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("size", [SPLIT_PAYLOAD_BYTES - 1, SPLIT_PAYLOAD_BYTES, 200_000])
def test_large_outbound_payload_comes_as_header_and_payload_of_the_same_packet(version: int, qos: int,
                                                                               size: int) -> None:
    state = connected(version, Properties())
    payload = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    props = encode_properties(Properties(user_properties=(("k", "v"),))) if version == 5 else b""
    data = state.encode_publish("t/big", b"t/big", payload, qos, True, False, 9 if qos else None, props)
    assert data is not None
    whole = encode_publish_fast(b"t/big", payload, qos, True, False, 9 if qos else None, version, props)
    if size >= SPLIT_PAYLOAD_BYTES:
        assert isinstance(data, tuple) and data[1] is payload and data[0] + data[1] == whole
    else:
        assert data == whole
    [p] = Decoder(role="client", version=version).feed(whole)  # type: ignore[arg-type]
    assert p.payload == payload and p.topic == "t/big" and p.qos == qos  # type: ignore[union-attr]


def test_large_outbound_payload_still_respects_the_clients_maximum_packet_size() -> None:
    state = connected(5, Properties(maximum_packet_size=SPLIT_PAYLOAD_BYTES + 10))
    assert state.encode_publish("t", b"t", b"x" * (SPLIT_PAYLOAD_BYTES + 20), 1, False, False, 1) is None
    fits = state.encode_publish("t", b"t", b"x" * SPLIT_PAYLOAD_BYTES, 1, False, False, 1)
    assert isinstance(fits, tuple) and len(fits[0]) + len(fits[1]) <= SPLIT_PAYLOAD_BYTES + 10


# --- the broker's topic bounds (mqtt.max_topic_levels / max_topic_length) ------------------------------


BOUNDED = TopicBounds(max_levels=3, max_bytes=16)


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("topic", ["a/b/c/d", "/a/b/", "x" * 17, "é" * 9])
def test_publish_topic_beyond_the_bounds_is_topic_name_invalid(version: int, topic: str) -> None:
    # 0x90: MQTT 5 gets DISCONNECT 0x90, 3.1.1 a close (it has no way to refuse a PUBLISH).
    expect_error(connected(version, topic_bounds=BOUNDED), encode(pub(topic, 1, 1), version), RC.TOPIC_NAME_INVALID)  # type: ignore[arg-type]


def test_publish_topic_within_the_bounds_passes() -> None:
    state = connected(5, topic_bounds=BOUNDED)  # type: ignore[arg-type]
    out = state.receive(encode(pub("a/b/c"), 5) + encode(pub("x" * 16), 5) + encode(pub("é" * 8), 5))
    assert [p.topic for p in out] == ["a/b/c", "x" * 16, "é" * 8]  # type: ignore[union-attr]


def test_default_bounds_are_the_brokers_defaults() -> None:
    state = connected(5)
    expect_error(state, encode(pub("/".join("l" * 33)), 5), RC.TOPIC_NAME_INVALID)
    assert connected(5).receive(encode(pub("/".join("l" * 32)), 5))
    expect_error(connected(5), encode(pub("x" * 1025), 5), RC.TOPIC_NAME_INVALID)


def test_topic_alias_to_a_topic_beyond_the_bounds_is_refused() -> None:
    state = connected(5, topic_alias_maximum_in=4, topic_bounds=BOUNDED)  # type: ignore[arg-type]
    expect_error(state, encode(pub("a/b/c/d", alias=1), 5), RC.TOPIC_NAME_INVALID)


def test_will_topic_beyond_the_bounds_is_refused_at_connect() -> None:
    state = ProtocolState(topic_bounds=BOUNDED)
    expect_error(state, encode(Connect("MQTT", 5, "c", will=Will("a/b/c/d", b"w")), 5), RC.TOPIC_NAME_INVALID)
    assert state.awaiting_connect  # answered with CONNACK 0x90


def test_subscribe_filters_are_checked_against_the_bounds() -> None:
    state = connected(5, topic_bounds=BOUNDED)  # type: ignore[arg-type]
    assert state.topic_filter_error("a/+/#") is None
    assert state.topic_filter_error("$share/g/a/+/#") is None  # the bound is on the filter matched
    assert state.topic_filter_error("a/+/c/#") == "topic filter has 4 levels, more than 3"
    assert state.topic_filter_error("a/#/b") == "invalid topic filter"


# --- bytes before CONNECT (mqtt.max_connect_packet_bytes) ----------------------------------------------


def connect_bytes(version: int, will_payload: int) -> bytes:
    return encode(Connect("MQTT", version, "c", will=Will("w", b"w" * will_payload)), version)


@pytest.mark.parametrize("version", [4, 5])
def test_oversized_connect_is_refused_from_its_fixed_header(version: int) -> None:
    state = ProtocolState(max_connect_packet_size=1024)
    data = connect_bytes(version, 5000)
    with pytest.raises(ProtocolError) as info:
        for i in range(12):  # byte by byte: refused once the header shows the size, long before the body
            state.receive(data[i:i + 1])
    assert info.value.reason_code == RC.PACKET_TOO_LARGE
    assert "more than the 1024 accepted before CONNECT" in str(info.value)
    assert state.decoder.buffered_bytes < 12
    # MQTT 5 (level visible in the header) gets CONNACK 0x95; 3.1.1 has no code: a plain close.
    assert state.awaiting_connect and state.version == (5 if version == 5 else None)


def test_first_packet_of_any_type_is_held_to_the_connect_bound() -> None:
    state = ProtocolState(max_connect_packet_size=1024)
    expect_error(state, encode(pub("t", 0, payload_format_indicator=0), 4)[:1] + b"\xff\xff\x01", RC.PACKET_TOO_LARGE)


def test_connect_up_to_the_bound_is_accepted_and_later_packets_get_the_full_size() -> None:
    connect = connect_bytes(5, 900)
    state = ProtocolState(max_connect_packet_size=len(connect), max_packet_size_in=1 << 20)
    big = encode(Publish("t", b"x" * 100_000, 0, False, False, None), 5)
    out = state.receive(connect + big)  # pipelined in one read: the CONNECT bound is for the CONNECT only
    assert [type(p) for p in out] == [Connect, Publish]
    expect_error(ProtocolState(max_connect_packet_size=len(connect) - 1), connect, RC.PACKET_TOO_LARGE)


def test_connect_bound_never_exceeds_the_maximum_packet_size() -> None:
    assert ProtocolState(max_packet_size_in=500, max_connect_packet_size=4096).max_connect_packet_size == 500


# --- partial packets (mqtt.packet_read_timeout_s) ---------------------------------------------------------


def test_partial_since_is_when_the_incomplete_packet_began() -> None:
    state = connected(4)
    assert state.partial_since is None
    data = encode(pub("a/b"), 4)
    state.receive(data[:3], now=10.0)
    assert state.partial_since == 10.0
    state.receive(data[3:5], now=11.0)
    assert state.partial_since == 10.0  # still the same packet: trickling bytes do not reset the clock
    state.receive(data[5:] + data[:2], now=12.0)
    assert state.partial_since == 12.0  # that one completed; the next began in this read
    state.receive(data[2:], now=13.0)
    assert state.partial_since is None
