"""encode -> decode gives the packet back (3.1.1: after normalisation), for every packet type."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mqtt_strategies import (
    auths,
    client_packets,
    connacks,
    connects,
    disconnects,
    normalise,
    publishes,
    server_packets,
    subacks,
    unsubacks,
)

from moorline.mqtt.codec import (
    Decoder,
    PublishBatchEncoder,
    encode,
    encode_ack,
    encode_properties,
    encode_puback,
    encode_publish_fast,
    encode_varint,
)
from moorline.mqtt.packets import (
    NO_PROPERTIES,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Unsuback,
    replace,
)
from moorline.mqtt.reasons import ReasonCode, connack_v5_to_v3, suback_v5_to_v3, v3_connack_applicable

VERSIONS = [4, 5]


def roundtrip(packet: Packet, version: int, role: str) -> Packet:
    data = encode(packet, version)
    dec = Decoder(role=role, version=None if isinstance(packet, Connect) else version)  # type: ignore[arg-type]
    out = dec.feed(data)
    assert dec.buffered_bytes == 0
    assert len(out) == 1, out
    return out[0]


@pytest.mark.parametrize("version", VERSIONS)
@given(data=st.data())
@settings(max_examples=100)
def test_connect_roundtrip(version: int, data: st.DataObject) -> None:
    c = data.draw(connects(version))
    dec = Decoder()
    assert dec.feed(encode(c, version)) == [normalise(c, version)]
    assert dec.version == version  # the decoder learns the version from CONNECT


@pytest.mark.parametrize("version", VERSIONS)
@given(data=st.data())
@settings(max_examples=150)
def test_client_to_server_packets_roundtrip(version: int, data: st.DataObject) -> None:
    p = data.draw(client_packets(version))
    assert roundtrip(p, version, "server") == normalise(p, version)


@pytest.mark.parametrize("version", VERSIONS)
@given(data=st.data())
@settings(max_examples=150)
def test_server_to_client_packets_roundtrip(version: int, data: st.DataObject) -> None:
    p = data.draw(server_packets(version))
    assert roundtrip(p, version, "client") == normalise(p, version)


# Each packet type on its own too, so a rare type cannot hide behind one_of's choices.
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("strategy,role", [
    (publishes(), "client"), (connacks, "client"), (subacks, "client"), (unsubacks, "client"),
    (disconnects, "server"),
])
@given(data=st.data())
@settings(max_examples=60)
def test_each_type_roundtrip(version: int, strategy: st.SearchStrategy[Packet], role: str, data: st.DataObject) -> None:
    p = data.draw(strategy)
    assert roundtrip(p, version, role) == normalise(p, version)


@given(p=auths)
def test_auth_roundtrip_v5(p: Packet) -> None:
    assert roundtrip(p, 5, "server") == p
    assert roundtrip(p, 5, "client") == p


@pytest.mark.parametrize("version", VERSIONS)
def test_ping_roundtrip(version: int) -> None:
    assert encode(Pingreq(), version) == b"\xc0\x00"
    assert encode(Pingresp(), version) == b"\xd0\x00"
    assert roundtrip(Pingreq(), version, "server") == Pingreq()
    assert roundtrip(Pingresp(), version, "client") == Pingresp()


@given(p=publishes(), version=st.sampled_from(VERSIONS))
def test_fast_publish_encoder_equals_full_encoder(p: Publish, version: int) -> None:
    props = encode_properties(p.properties) if version == 5 else b""
    fast = encode_publish_fast(p.topic.encode(), p.payload, p.qos, p.retain, p.dup, p.packet_id, version, props)
    assert fast == encode(p, version)


@given(ps=st.lists(publishes(), max_size=8), version=st.sampled_from(VERSIONS), repeat_topic=st.booleans())
def test_publish_batch_encoder_equals_full_encoder(ps: list[Publish], version: int, repeat_topic: bool) -> None:
    # A batch is the packets' full encodings back to back, and decodes to the same packets, whatever
    # mix of topics (one repeated, as in a delivery batch, or each its own), sizes, flags and properties.
    if repeat_topic and ps:
        ps = [replace(p, topic=ps[0].topic) for p in ps]
    batch = PublishBatchEncoder(version)
    for p in ps:
        props = encode_properties(p.properties) if version == 5 else b""
        batch.add(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, props)
    assert len(batch) == sum(len(encode(p, version)) for p in ps)
    data = batch.take()
    assert data == b"".join(encode(p, version) for p in ps)
    assert len(batch) == 0 and batch.take() == b""
    decoder = Decoder(version=version, role="client")  # a delivery batch is what a client reads
    assert decoder.feed(data) == [normalise(p, version) for p in ps]


@given(pid=st.integers(1, 0xFFFF), version=st.sampled_from(VERSIONS), rc=st.sampled_from([0, 0x10, 0x80, 0x97]))
def test_fast_ack_encoders(pid: int, version: int, rc: int) -> None:
    assert encode_puback(pid, rc, version) == encode(Puback(pid, rc), version)
    assert encode_ack(5, pid, rc, version) == encode(Pubrec(pid, rc), version)
    assert encode_ack(6, pid, 0, version) == encode(Pubrel(pid), version)
    assert encode_ack(7, pid, 0, version) == encode(Pubcomp(pid), version)


def test_known_wire_bytes() -> None:
    # Hand-checked against the specification's layouts.
    assert encode(Puback(10), 4) == b"\x40\x02\x00\x0a"
    assert encode(Puback(10, 0x10), 5) == b"\x40\x03\x00\x0a\x10"
    assert encode(Pubrel(1), 4) == b"\x62\x02\x00\x01"
    assert encode(Publish("a/b", b"hi", 1, False, False, 7), 4) == b"\x32\x09\x00\x03a/b\x00\x07hi"
    assert encode(Publish("a/b", b"hi", 0, True), 5) == b"\x31\x08\x00\x03a/b\x00hi"
    assert encode(Connack(True, 0), 4) == b"\x20\x02\x01\x00"
    assert encode(Connack(False, ReasonCode.NOT_AUTHORIZED), 4) == b"\x20\x02\x00\x05"
    assert encode(Connack(False, ReasonCode.NOT_AUTHORIZED), 5) == b"\x20\x03\x00\x87\x00"
    assert encode(Disconnect(), 5) == b"\xe0\x00"
    assert encode(Disconnect(ReasonCode.SERVER_SHUTTING_DOWN), 4) == b"\xe0\x00"
    assert encode(Unsuback(3, (0x11,)), 4) == b"\xb0\x02\x00\x03"
    assert encode(Suback(3, (0x01, 0x87)), 4) == b"\x90\x04\x00\x03\x01\x80"
    assert encode(Connect("MQTT", 4, "c", True, 60), 4) == b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01c"


@pytest.mark.parametrize("value,wire", [
    (0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x01"), (16383, b"\xff\x7f"), (16384, b"\x80\x80\x01"),
    (2097151, b"\xff\xff\x7f"), (2097152, b"\x80\x80\x80\x01"), (268435455, b"\xff\xff\xff\x7f"),
])
def test_varint_boundaries(value: int, wire: bytes) -> None:
    assert encode_varint(value) == wire


@pytest.mark.parametrize("size", [0, 127 - 7, 128, 16383, 16384, 200_000])
@pytest.mark.parametrize("version", VERSIONS)
def test_publish_sizes_across_remaining_length_boundaries(size: int, version: int) -> None:
    p = Publish("t", b"x" * size, 1, False, False, 1)
    assert roundtrip(p, version, "server") == p


def test_v3_connack_and_suback_mapping() -> None:
    assert connack_v5_to_v3(ReasonCode.SUCCESS) == 0
    assert connack_v5_to_v3(ReasonCode.UNSUPPORTED_PROTOCOL_VERSION) == 1
    assert connack_v5_to_v3(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID) == 2
    assert connack_v5_to_v3(ReasonCode.SERVER_UNAVAILABLE) == 3
    assert connack_v5_to_v3(ReasonCode.SERVER_BUSY) == 3
    assert connack_v5_to_v3(ReasonCode.BAD_USERNAME_OR_PASSWORD) == 4
    assert connack_v5_to_v3(ReasonCode.NOT_AUTHORIZED) == 5
    assert connack_v5_to_v3(ReasonCode.BANNED) == 5
    assert suback_v5_to_v3(ReasonCode.GRANTED_QOS_2) == 2
    assert suback_v5_to_v3(ReasonCode.TOPIC_FILTER_INVALID) == 0x80
    assert len(ReasonCode) == 43
    assert v3_connack_applicable(ReasonCode.NOT_AUTHORIZED) and v3_connack_applicable(ReasonCode.SERVER_BUSY)
    assert not v3_connack_applicable(ReasonCode.MALFORMED_PACKET)
    assert not v3_connack_applicable(ReasonCode.PROTOCOL_ERROR)


def test_properties_with_every_field_roundtrip_in_its_packets() -> None:
    props = Properties(session_expiry_interval=7, receive_maximum=5, maximum_packet_size=1000,
                       topic_alias_maximum=3, request_problem_information=0, request_response_information=1,
                       authentication_method="SCRAM", authentication_data=b"\x00\x01",
                       user_properties=(("k", "v"), ("k", "v2")))
    c = Connect("MQTT", 5, "id", False, 10, None, b"pw", None, props)
    assert Decoder().feed(encode(c, 5)) == [c]
    assert NO_PROPERTIES == Properties()


def test_ack_wrappers() -> None:
    from moorline.mqtt.codec import encode_pubcomp, encode_pubrec, encode_pubrel

    assert encode_pubrec(5, 0x10) == encode(Pubrec(5, 0x10), 5)
    assert encode_pubrel(5, 0x92) == encode(Pubrel(5, 0x92), 5)
    assert encode_pubcomp(5, 0, 4) == encode(Pubcomp(5), 4)
    assert encode(Puback(1, 0, Properties()), 5) == b"\x40\x02\x00\x01"  # empty but not NO_PROPERTIES
