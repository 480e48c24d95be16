"""Public types, storage and membership-change validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.raft import (
    CompactedError,
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    HardState,
    HardStateCorrupt,
    MemoryStorage,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
    SnapshotTemporarilyUnavailable,
    Stream,
    UnavailableError,
)
from moorline.raft.confchange import ConfChangeInvalid, apply_conf_change

A, B, C, D = (1, "s1"), (2, "s2"), (3, "s3"), (4, "s4")


@settings(max_examples=150, deadline=None)
@given(
    term=st.integers(0, 2**63 - 1),
    commit=st.integers(0, 2**63 - 1),
    vote=st.none() | st.tuples(st.integers(1, 2**62), st.text(max_size=20)),
)
def test_hard_state_roundtrip(term: int, commit: int, vote: tuple[int, str] | None) -> None:
    hs = HardState(term=term, vote=vote, commit=commit)
    assert HardState.decode(hs.encode()) == hs


@settings(max_examples=150, deadline=None)
@given(pos=st.integers(0, 200), bit=st.integers(0, 7))
def test_hard_state_detects_any_bit_flip(pos: int, bit: int) -> None:
    raw = bytearray(HardState(term=7, vote=(3, "abc"), commit=12).encode())
    raw[pos % len(raw)] ^= 1 << bit
    with pytest.raises(HardStateCorrupt):
        HardState.decode(bytes(raw))


def test_hard_state_detects_truncation() -> None:
    raw = HardState(term=7, vote=(3, "abc"), commit=12).encode()
    for n in range(len(raw)):
        with pytest.raises(HardStateCorrupt):
            HardState.decode(raw[:n])


def test_message_streams() -> None:
    def s(t: MessageType) -> Stream:
        return Message(type=t, from_=A, to=B).stream

    assert s(MessageType.APP) == Stream.APPEND
    assert s(MessageType.APP_RESP) == Stream.APPEND
    assert s(MessageType.SNAP) == Stream.SNAPSHOT
    for t in (
        MessageType.VOTE,
        MessageType.PRE_VOTE,
        MessageType.HEARTBEAT,
        MessageType.TIMEOUT_NOW,
        MessageType.READ_INDEX,
    ):
        assert s(t) == Stream.CONTROL


def test_memory_storage_append_truncate_compact() -> None:
    st_ = MemoryStorage()
    st_.append([Entry(1, i) for i in range(1, 6)])
    assert (st_.first_index(), st_.last_index()) == (1, 5)
    st_.append([Entry(2, 4), Entry(2, 5), Entry(2, 6)])  # replaces 4..5
    assert [st_.term(i) for i in range(1, 7)] == [1, 1, 1, 2, 2, 2]
    st_.create_snapshot(4, ConfState.of([A]), b"s")
    st_.compact(4)
    assert st_.first_index() == 5 and st_.term(4) == 2
    with pytest.raises(CompactedError):
        st_.term(3)
    with pytest.raises(CompactedError):
        st_.entries(4, 6, 1 << 20)
    with pytest.raises(UnavailableError):
        st_.entries(5, 8, 1 << 20)
    assert [e.index for e in st_.entries(5, 7, 1 << 20)] == [5, 6]
    assert len(st_.entries(5, 7, 1)) == 1  # at least one entry even over the byte limit
    st_.apply_snapshot(Snapshot(meta=SnapshotMeta(index=10, term=3, conf_state=ConfState.of([A, B]))))
    assert (st_.first_index(), st_.last_index()) == (11, 10)
    assert st_.initial_state()[1] == ConfState.of([A, B])


def test_a_snapshot_older_than_the_compacted_log_is_not_handed_out() -> None:
    """A group of one voter compacts past its last snapshot; grown again, its leader must not send
    that snapshot (it does not join up with the log): the storage says to wait for a new one."""
    st_ = MemoryStorage()
    st_.append([Entry(1, i) for i in range(1, 9)])
    st_.create_snapshot(3, ConfState.of([A]), b"s")
    assert st_.snapshot().meta.index == 3
    st_.compact(6)
    assert st_.snapshot_index() == 3
    with pytest.raises(SnapshotTemporarilyUnavailable):
        st_.snapshot()
    st_.create_snapshot(7, ConfState.of([A]), b"t")
    assert st_.snapshot().meta.index == 7


def test_conf_change_validation() -> None:
    cs = ConfState.of([A, B, C])
    assert apply_conf_change(cs, ConfChange(ConfChangeType.ADD_LEARNER, D)) == ConfState.of([A, B, C], [D])
    with_d = ConfState.of([A, B, C], [D])
    assert apply_conf_change(with_d, ConfChange(ConfChangeType.PROMOTE, D)) == ConfState.of([A, B, C, D])
    assert apply_conf_change(cs, ConfChange(ConfChangeType.REMOVE, C)) == ConfState.of([A, B])
    bad = [
        (cs, ConfChange(ConfChangeType.ADD_VOTER, A)),
        (cs, ConfChange(ConfChangeType.ADD_LEARNER, A)),
        (cs, ConfChange(ConfChangeType.PROMOTE, A)),
        (cs, ConfChange(ConfChangeType.REMOVE, D)),
        (ConfState.of([A]), ConfChange(ConfChangeType.REMOVE, A)),
        (cs, ConfChange(ConfChangeType.ADD_LEARNER, (3, "new-storage"))),  # node 3 still a member
    ]
    for conf, cc in bad:
        with pytest.raises(ConfChangeInvalid):
            apply_conf_change(conf, cc)
    assert ConfChange.decode(ConfChange(ConfChangeType.PROMOTE, D, b"x").encode()) == ConfChange(
        ConfChangeType.PROMOTE, D, b"x"
    )
