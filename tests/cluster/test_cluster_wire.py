"""The inter-node framing (moorline/cluster/wire.py): round trips, arbitrary splits, bounds, garbage."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moorline.cluster.wire import (
    LENGTH_BYTES,
    PREAMBLE_BYTES,
    PROTOCOL_VERSION,
    Challenge,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    Heartbeats,
    Hello,
    Payload,
    Ping,
    Pong,
    Proof,
    ProtocolError,
    RaftMessages,
    Refused,
    VersionMismatch,
    encode_frame,
    preamble,
)
from moorline.raft.coalesce import HeartbeatBatch, HeartbeatItem
from moorline.raft.types import (
    ConfState,
    Entry,
    EntryType,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
    Stream,
)

pytestmark = pytest.mark.timeout(120)

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u63 = st.integers(0, 2**63 - 1)
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
small_bytes = st.binary(max_size=64)
member = st.tuples(u63, text)
group = st.one_of(st.integers(0, 2**31), text)

entries = st.lists(st.builds(Entry, u63, u63, st.sampled_from(EntryType), small_bytes), max_size=4)
snapshots = st.none() | st.builds(
    Snapshot,
    meta=st.builds(SnapshotMeta, index=u63, term=u63,
                   conf_state=st.builds(ConfState, voters=st.lists(member, max_size=3).map(tuple),
                                        learners=st.lists(member, max_size=2).map(tuple))),
    data=small_bytes,
)
messages = st.builds(
    Message,
    type=st.sampled_from(MessageType),
    from_=member,
    to=member,
    term=u63,
    log_term=u63,
    index=u63,
    entries=entries,
    commit=u63,
    reject=st.booleans(),
    reject_hint=u63,
    snapshot=snapshots,
    context=small_bytes,
)
heartbeat_items = st.builds(HeartbeatItem, group, st.booleans(), member, member, u63, u63, small_bytes)

frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(Hello, text, text, st.sampled_from(Stream), st.integers(0, 65535), small_bytes),
    st.builds(Challenge, text, small_bytes),
    st.builds(Proof, small_bytes),
    st.builds(Refused, text),
    st.builds(RaftMessages, st.lists(st.tuples(group, messages), max_size=4)),
    st.builds(Heartbeats, st.builds(HeartbeatBatch, u63, u63, st.lists(heartbeat_items, max_size=4))),
    st.builds(Payload, text, st.binary(max_size=2048)),
    st.just(Ping()),
    st.just(Pong()),
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points + [len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


@PROPS
@given(st.lists(frames, max_size=6), st.lists(st.integers(0, 10**6), max_size=12))
def test_round_trip_under_any_split(fs: list[Frame], cuts: list[int]) -> None:
    data = preamble() + b"".join(encode_frame(f) for f in fs)
    dec = FrameDecoder(max_frame_bytes=1 << 20)
    out: list[Frame] = []
    for piece in split(data, cuts):
        out += dec.feed(piece)
        # bounded: never more than one unfinished frame (and its length) is kept
        assert dec.buffered_bytes <= max(PREAMBLE_BYTES, LENGTH_BYTES + dec.max_frame_bytes)
    assert out == fs
    assert dec.buffered_bytes == 0


@PROPS
@given(st.binary(max_size=512), st.lists(st.integers(0, 10**6), max_size=8), st.booleans())
def test_garbage_raises_only_protocol_error(garbage: bytes, cuts: list[int], after_preamble: bool) -> None:
    data = (preamble() if after_preamble else b"") + garbage
    dec = FrameDecoder(max_frame_bytes=4096)
    try:
        for piece in split(data, cuts):
            dec.feed(piece)
    except ProtocolError:
        # once broken, always broken: the connection is finished
        with pytest.raises(ProtocolError):
            dec.feed(b"\x00" * 8)


@PROPS
@given(st.lists(frames, min_size=1, max_size=3), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                          min_size=1, max_size=6))
def test_corrupted_frames_raise_only_protocol_error(fs: list[Frame], flips: list[tuple[int, int]]) -> None:
    data = bytearray(preamble() + b"".join(encode_frame(f) for f in fs))
    for pos, value in flips:
        data[pos % len(data)] = value
    dec = FrameDecoder(max_frame_bytes=1 << 16)
    try:
        dec.feed(bytes(data))
    except ProtocolError:
        pass


def test_oversized_frame_is_refused_from_its_length_alone() -> None:
    dec = FrameDecoder(max_frame_bytes=1000)
    dec.feed(preamble())
    with pytest.raises(FrameTooLarge) as err:
        dec.feed(struct.pack(">I", 1001))  # no body needed: nothing is buffered for it
    assert err.value.size_bytes == 1001 and "1001 bytes" in str(err.value) and "1000" in str(err.value)
    with pytest.raises(FrameTooLarge):
        dec.feed(b"more")


def test_frame_at_the_limit_is_accepted() -> None:
    frame = Payload("k", b"x" * 100)
    encoded = encode_frame(frame)
    dec = FrameDecoder(max_frame_bytes=len(encoded) - LENGTH_BYTES)
    assert dec.feed(preamble() + encoded) == [frame]


def test_another_version_is_named() -> None:
    dec = FrameDecoder(max_frame_bytes=1000)
    with pytest.raises(VersionMismatch) as err:
        dec.feed(preamble(PROTOCOL_VERSION + 1))
    assert err.value.peer_version == PROTOCOL_VERSION + 1
    assert f"version {PROTOCOL_VERSION + 1}" in str(err.value) and f"version {PROTOCOL_VERSION}" in str(err.value)


def test_a_stranger_is_told_apart_at_once() -> None:
    dec = FrameDecoder(max_frame_bytes=1000)
    with pytest.raises(ProtocolError, match="not a moorline cluster connection"):
        dec.feed(b"\x10")  # an MQTT CONNECT's first byte: refused before the preamble is complete


def test_wrong_shape_is_a_protocol_error() -> None:
    import msgspec

    body = msgspec.msgpack.encode([5, "not a list of messages"])  # RaftMessages tag, wrong field type
    dec = FrameDecoder(max_frame_bytes=1000)
    with pytest.raises(ProtocolError, match="undecodable frame"):
        dec.feed(preamble() + struct.pack(">I", len(body)) + body)
