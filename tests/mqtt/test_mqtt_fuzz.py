"""Random and mutated bytes: the decoder (and the protocol state on top of it) may only ever
raise ProtocolError subclasses, must return, and must keep its buffer bounded."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mqtt_strategies import client_packets, connects, server_packets

from moorline.mqtt.codec import Decoder, encode
from moorline.mqtt.errors import ProtocolError
from moorline.mqtt.packets import Packet
from moorline.mqtt.protocol import ProtocolState
from moorline.mqtt.topics import TopicBounds

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def feed_all(dec: Decoder, chunks: list[bytes]) -> list[Packet]:
    """Feed chunks until the first ProtocolError; anything else propagates and fails the test."""
    out: list[Packet] = []
    for chunk in chunks:
        try:
            out += dec.feed(chunk)
        except ProtocolError:
            return out
        # Never more than one incomplete packet (or an incomplete fixed header) is held.
        assert dec.buffered_bytes <= max(dec.max_packet_size - 1, 4)
    return out


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, prev = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[prev:p])
        prev = p
    return pieces


@FUZZ
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 10_000), max_size=6),
       max_size=st.integers(2, 700), version=st.sampled_from([None, 4, 5]), role=st.sampled_from(["server", "client"]))
def test_random_bytes_only_raise_protocol_errors(data: bytes, cuts: list[int], max_size: int, version: int | None,
                                                role: str) -> None:
    if role == "client" and version is None:
        version = 5
    dec = Decoder(max_packet_size=max_size, role=role, version=version)  # type: ignore[arg-type]
    feed_all(dec, chunked(data, cuts))


@st.composite
def mutated_streams(draw: st.DrawFn) -> tuple[bytes, int, str]:
    version = draw(st.sampled_from([4, 5]))
    role = draw(st.sampled_from(["server", "client"]))
    if role == "server":
        packets = [draw(connects(version))] + draw(st.lists(client_packets(version), max_size=5))
    else:
        packets = draw(st.lists(server_packets(version), min_size=1, max_size=6))
    stream = bytearray(b"".join(encode(p, version) for p in packets))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(len(stream) - 1, 0)))
        if op == "flip" and stream:
            stream[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and stream:
            stream[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x03, 0xC0]))
        elif op == "insert":
            stream[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and stream:
            del stream[i:i + draw(st.integers(1, 4))]
        elif op == "truncate":
            del stream[i:]
    return bytes(stream), version, role


@FUZZ
@given(case=mutated_streams(), cuts=st.lists(st.integers(0, 10_000), max_size=5), max_size=st.integers(16, 5000))
def test_mutated_streams_only_raise_protocol_errors(case: tuple[bytes, int, str], cuts: list[int], max_size: int) -> None:
    data, version, role = case
    dec = Decoder(max_packet_size=max_size, role=role, version=None if role == "server" else version)  # type: ignore[arg-type]
    feed_all(dec, chunked(data, cuts))
    if role == "server":
        # The protocol state adds its own checks (aliases, receive maximum, ordering, the CONNECT
        # size bound, topic bounds) on top; before CONNECT it never holds more than the bound.
        connect_bound = max(16, max_size // 3)
        state = ProtocolState(topic_alias_maximum_in=5, receive_maximum_in=3, max_connect_packet_size=connect_bound,
                              topic_bounds=TopicBounds(max_levels=3, max_bytes=20))
        for chunk in chunked(data, cuts):
            try:
                state.receive(chunk)
            except ProtocolError:
                break
            if state.awaiting_connect:
                assert state.decoder.buffered_bytes <= connect_bound


def test_fuzz_harness_can_see_a_good_stream() -> None:
    # Guard against a harness that swallows everything: an unmutated stream decodes fully.
    from moorline.mqtt.packets import Connect, Pingreq

    dec = Decoder(max_packet_size=100)
    out = feed_all(dec, [encode(Connect("MQTT", 5, "x"), 5) + encode(Pingreq(), 5)])
    assert out == [Connect("MQTT", 5, "x"), Pingreq()]
