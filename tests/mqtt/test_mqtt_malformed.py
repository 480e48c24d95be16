"""Specific malformed / forbidden packets, each named, and split-feed behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mqtt_strategies import client_packets, normalise

from moorline.invariant import InvariantViolation
from moorline.mqtt.codec import Decoder, encode
from moorline.mqtt.errors import MalformedPacket, PacketTooLarge, ProtocolError, UnsupportedProtocol
from moorline.mqtt.packets import (
    Connack,
    Connect,
    Pingreq,
    Properties,
    Publish,
    Subscribe,
    SubscriptionOptions,
)
from moorline.mqtt.reasons import ReasonCode as RC

CONNECT_V5 = encode(Connect("MQTT", 5, "c"), 5)
CONNECT_V4 = encode(Connect("MQTT", 4, "c"), 4)


def s(text: str) -> bytes:
    b = text.encode()
    return len(b).to_bytes(2, "big") + b


def frame(first: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes((first, len(body))) + body


def decode(data: bytes, version: int | None = 5, role: str = "server") -> list:
    return Decoder(role=role, version=version).feed(data)  # type: ignore[arg-type]


def raises(data: bytes, reason: int = RC.MALFORMED_PACKET, version: int | None = 5, role: str = "server",
           kind: type[ProtocolError] = ProtocolError) -> ProtocolError:
    with pytest.raises(kind) as info:
        decode(data, version, role)
    assert info.value.reason_code == reason, info.value
    return info.value


# --- fixed header ----------------------------------------------------------------------------


@pytest.mark.parametrize("first", [0x41, 0x48, 0x60, 0x63, 0x80, 0xA0, 0xC1, 0xE2, 0x71])
def test_reserved_fixed_header_flags(first: int) -> None:
    raises(frame(first, b"\x00\x01"))


def test_reserved_packet_type_zero() -> None:
    raises(b"\x00\x00")


def test_remaining_length_longer_than_4_bytes() -> None:
    raises(b"\x30\xff\xff\xff\xff\x01", version=5)
    raises(b"\x30\x80\x80\x80\x80\x00", version=5)


def test_remaining_length_not_minimal() -> None:
    raises(b"\xc0\x80\x00")


def test_packet_too_large_is_rejected_from_the_header_alone() -> None:
    dec = Decoder(max_packet_size=100, version=5)
    with pytest.raises(PacketTooLarge) as info:
        dec.feed(b"\x30\xe8\x07")  # remaining length 1000, body not sent yet
    assert info.value.reason_code == RC.PACKET_TOO_LARGE
    assert info.value.size == 1003
    dec = Decoder(max_packet_size=1003, version=5)
    assert dec.feed(b"\x30\xe8\x07") == []  # exactly at the limit: waits for the body


def test_decoder_stays_failed() -> None:
    dec = Decoder(version=5)
    with pytest.raises(MalformedPacket):
        dec.feed(b"\x00\x00")
    with pytest.raises(MalformedPacket):
        dec.feed(encode(Pingreq(), 5))


# --- strings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"a\x00b", b"\xf4\x90\x80\x80", b"\xe2\x82"])
def test_invalid_utf8_or_nul_in_topic(bad: bytes) -> None:
    body = len(bad).to_bytes(2, "big") + bad + b"\x00"  # topic, empty properties
    raises(frame(0x30, body))
    raises(frame(0x30, body[:-1]), version=4)


def test_invalid_utf8_in_client_id_and_user_property() -> None:
    raises(frame(0x10, s("MQTT") + b"\x04\x02\x00\x00" + b"\x00\x01\xff"), version=None)
    prop = b"\x26" + s("k") + b"\x00\x01\x00"
    raises(frame(0x30, s("t") + bytes((len(prop),)) + prop))


def test_truncated_string_length() -> None:
    raises(frame(0x30, b"\x00\x09abc\x00"))


# --- QoS, packet ids, flags -----------------------------------------------------------------------


def test_publish_qos_3() -> None:
    raises(frame(0x36, s("t") + b"\x00\x01\x00"))


def test_publish_qos0_with_dup() -> None:
    raises(frame(0x38, s("t") + b"\x00"))


@pytest.mark.parametrize("data", [
    frame(0x32, s("t") + b"\x00\x00\x00"),  # PUBLISH QoS 1
    frame(0x40, b"\x00\x00"),  # PUBACK
    frame(0x62, b"\x00\x00"),  # PUBREL
    frame(0x82, b"\x00\x00\x00" + s("a") + b"\x00"),  # SUBSCRIBE
    frame(0xA2, b"\x00\x00\x00" + s("a")),  # UNSUBSCRIBE
])
def test_packet_id_zero(data: bytes) -> None:
    raises(data)


def test_truncated_packet_id() -> None:
    raises(frame(0x32, s("t") + b"\x01"))
    raises(frame(0x40, b"\x01"))


def test_subscription_qos3_reserved_bits_retain_handling() -> None:
    raises(frame(0x82, b"\x00\x01\x00" + s("a") + b"\x03"))
    raises(frame(0x82, b"\x00\x01\x00" + s("a") + b"\x40"))
    raises(frame(0x82, b"\x00\x01" + s("a") + b"\x04"), version=4)  # no-local bit is reserved in 3.1.1
    raises(frame(0x82, b"\x00\x01\x00" + s("a") + b"\x30"), reason=RC.PROTOCOL_ERROR)  # retain handling 3


def test_subscribe_and_unsubscribe_without_filters() -> None:
    raises(frame(0x82, b"\x00\x01\x00"), reason=RC.PROTOCOL_ERROR)
    raises(frame(0xA2, b"\x00\x01\x00"), reason=RC.PROTOCOL_ERROR)


def test_trailing_bytes() -> None:
    raises(frame(0xC0, b"\x00"))
    raises(frame(0x40, b"\x00\x01\x00"), version=4)  # 3.1.1 PUBACK is exactly 2 bytes
    raises(frame(0xE0, b"\x00"), version=4)


def test_invalid_reason_code() -> None:
    raises(frame(0x40, b"\x00\x01\x05"))
    raises(frame(0xE0, b"\x03"))


# --- properties ----------------------------------------------------------------------------------


def pub_with_props(props: bytes) -> bytes:
    return frame(0x30, s("t") + bytes((len(props),)) + props)


def test_duplicate_property() -> None:
    raises(pub_with_props(b"\x02\x00\x00\x00\x01" * 2), reason=RC.PROTOCOL_ERROR)
    raises(pub_with_props(b"\x01\x01\x01\x00"), reason=RC.PROTOCOL_ERROR)
    # subscription identifier may appear once in SUBSCRIBE
    raises(frame(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02" + s("a") + b"\x00"), reason=RC.PROTOCOL_ERROR)


def test_user_properties_and_subscription_ids_may_repeat() -> None:
    [p] = decode(pub_with_props(b"\x26" + s("a") + s("b") + b"\x26" + s("a") + s("c")))
    assert p.properties.user_properties == (("a", "b"), ("a", "c"))
    [p] = decode(pub_with_props(b"\x0b\x01\x0b\x02"), role="client")
    assert p.properties.subscription_identifiers == (1, 2)


def test_property_not_allowed_in_packet() -> None:
    raises(pub_with_props(b"\x11\x00\x00\x00\x01"))  # session expiry in PUBLISH
    raises(pub_with_props(b"\x7f\x00"))  # unknown identifier
    raises(frame(0x40, b"\x00\x01\x00\x03\x23\x00\x01"))  # topic alias in PUBACK


def test_subscription_identifier_from_client_is_protocol_error() -> None:
    raises(pub_with_props(b"\x0b\x01"), reason=RC.PROTOCOL_ERROR)


@pytest.mark.parametrize("props", [b"\x01\x02", b"\x21\x00\x00", b"\x0b\x00"])
def test_property_values_forbidden_by_spec(props: bytes) -> None:
    role = "client" if props[0] == 0x0B else "server"
    data = pub_with_props(props) if props[0] != 0x21 else None
    if data is None:  # receive maximum 0 in CONNECT
        body = s("MQTT") + b"\x05\x02\x00\x00" + bytes((len(props),)) + props + s("c")
        raises(frame(0x10, body), reason=RC.PROTOCOL_ERROR, version=None)
    else:
        raises(data, reason=RC.PROTOCOL_ERROR, role=role)


def test_truncated_properties() -> None:
    raises(pub_with_props(b"\x02\x00\x00"))  # u32 cut short
    raises(frame(0x30, s("t") + b"\x05\x01"))  # property length beyond packet
    raises(frame(0x30, s("t") + b"\x80\x00"))  # property length not minimal
    raises(frame(0x30, s("t")))  # v5 PUBLISH without property length


# --- CONNECT ---------------------------------------------------------------------------------------


def connect_body(name: str = "MQTT", level: int = 4, flags: int = 0x02, rest: bytes = s("c")) -> bytes:
    return frame(0x10, s(name) + bytes((level, flags)) + b"\x00\x3c" + rest)


@pytest.mark.parametrize("name,level", [("MQIsdp", 3), ("MQTT", 3), ("MQTT", 6), ("MQTX", 4), ("mqtt", 5)])
def test_unsupported_protocol_carries_level(name: str, level: int) -> None:
    e = raises(connect_body(name, level), reason=RC.UNSUPPORTED_PROTOCOL_VERSION, version=None, kind=UnsupportedProtocol)
    assert isinstance(e, UnsupportedProtocol)
    assert e.level == level


def test_version_known_even_when_the_rest_of_connect_is_malformed() -> None:
    dec = Decoder()
    with pytest.raises(MalformedPacket):
        dec.feed(connect_body(level=5, flags=0x03, rest=b"\x00" + s("c")))
    assert dec.version == 5  # so the broker can answer with a v5 CONNACK 0x81


def test_connect_reserved_flag() -> None:
    raises(connect_body(flags=0x03), version=None)


def test_connect_will_flags_without_will_and_will_qos3() -> None:
    raises(connect_body(flags=0x02 | 0x08), version=None)  # will QoS 1 without will flag
    raises(connect_body(flags=0x02 | 0x20), version=None)  # will retain without will flag
    raises(connect_body(flags=0x02 | 0x04 | 0x18, rest=s("c") + s("w") + s("x")), version=None)


def test_connect_v3_password_without_username() -> None:
    raises(connect_body(flags=0x42, rest=s("c") + s("pw")), version=None)
    [c] = decode(connect_body(level=5, flags=0x42, rest=b"\x00" + s("c") + s("pw")), version=None)
    assert c.password == b"pw" and c.username is None


def test_connect_truncated_and_trailing() -> None:
    raises(connect_body(rest=b"\x00"), version=None)
    raises(connect_body(rest=s("c") + b"x"), version=None)
    raises(frame(0x10, s("MQTT")), version=None)


# --- direction and ordering --------------------------------------------------------------------------


def test_server_only_packets_from_client() -> None:
    raises(encode(Connack(), 5), reason=RC.PROTOCOL_ERROR)
    raises(b"\x90\x03\x00\x01\x00", reason=RC.PROTOCOL_ERROR)  # SUBACK
    raises(b"\xb0\x02\x00\x01", reason=RC.PROTOCOL_ERROR, version=4)  # UNSUBACK
    raises(b"\xd0\x00", reason=RC.PROTOCOL_ERROR)  # PINGRESP


def test_client_only_packets_to_client() -> None:
    raises(CONNECT_V5, reason=RC.PROTOCOL_ERROR, role="client")
    raises(b"\xc0\x00", reason=RC.PROTOCOL_ERROR, role="client")
    raises(encode(Subscribe(1, (("a", SubscriptionOptions(0)),)), 5), reason=RC.PROTOCOL_ERROR, role="client")


def test_auth_does_not_exist_in_v3() -> None:
    raises(b"\xf0\x00", version=4)


def test_non_connect_before_version_known() -> None:
    raises(encode(Pingreq(), 4), reason=RC.PROTOCOL_ERROR, version=None)
    raises(encode(Publish("t"), 4), reason=RC.PROTOCOL_ERROR, version=None)


def test_client_role_needs_a_version() -> None:
    with pytest.raises(InvariantViolation):
        Decoder(role="client").feed(b"\xd0\x00")


def test_version_taken_from_connect_within_one_feed() -> None:
    dec = Decoder()
    pub = Publish("t", b"x", 0, False, False, None, Properties(content_type="c"))
    out = dec.feed(CONNECT_V5 + encode(pub, 5))
    assert out[1] == pub and dec.version == 5
    dec = Decoder()
    out = dec.feed(CONNECT_V4 + encode(Publish("t", b"x"), 4))
    assert out[1] == Publish("t", b"x") and dec.version == 4


# --- split feeds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [4, 5])
@given(data=st.data())
@settings(max_examples=50)
def test_split_feed_gives_same_packets(version: int, data: st.DataObject) -> None:
    packets = data.draw(st.lists(client_packets(version), min_size=1, max_size=8))
    connect = Connect("MQTT", version, "c")
    stream = encode(connect, version) + b"".join(encode(p, version) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    dec = Decoder()
    out = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        out += dec.feed(stream[prev:cut])
        prev = cut
    assert out == [connect] + [normalise(p, version) for p in packets]
    assert dec.buffered_bytes == 0


def test_one_byte_at_a_time() -> None:
    pubs = [Publish("a/b", bytes([i]) * 200, 1, False, False, i + 1) for i in range(5)]
    stream = CONNECT_V5 + b"".join(encode(p, 5) for p in pubs)
    dec = Decoder()
    out = []
    for i in range(len(stream)):
        out += dec.feed(stream[i:i + 1])
        assert dec.buffered_bytes < 211  # never more than one incomplete packet
    assert out[1:] == pubs


def test_large_packet_in_many_chunks_buffers_only_that_packet() -> None:
    big = Publish("t", b"z" * 500_000, 1, False, False, 1)
    data = encode(big, 5)
    dec = Decoder(version=5)
    out = []
    for i in range(0, len(data), 4096):
        out += dec.feed(data[i:i + 4096])
        assert dec.buffered_bytes <= len(data)
    assert out == [big] and dec.buffered_bytes == 0


def test_many_packets_in_one_feed() -> None:
    pubs = [Publish(f"t/{i}", b"p", 1, False, False, i + 1) for i in range(1000)]
    stream = b"".join(encode(p, 5) for p in pubs) + encode(Subscribe(9, (("a/#", SubscriptionOptions(1)),)), 5)
    out = Decoder(version=5).feed(stream)
    assert out[:-1] == pubs and isinstance(out[-1], Subscribe)


def test_wrong_direction_rejected_from_the_first_byte() -> None:
    # A CONNACK header from a client is refused before its (large) body arrives.
    raises(b"\x20\xff\x7f", reason=RC.PROTOCOL_ERROR)


def test_decode_one() -> None:
    from moorline.mqtt.codec import decode_one

    assert decode_one(encode(Publish("t", b"x"), 5), 5) == Publish("t", b"x")
    with pytest.raises(MalformedPacket):
        decode_one(encode(Pingreq(), 5) * 2, 5)
    with pytest.raises(MalformedPacket):
        decode_one(encode(Publish("t", b"x"), 5)[:-1], 5)
