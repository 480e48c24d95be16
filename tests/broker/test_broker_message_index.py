"""MessageIndex against a plain dict model: same answers after any mix of adds and discards,
across column compaction, and through snapshot columns (canonical bytes for equal contents)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.broker import message_index as mi
from moorline.broker.message_index import MessageIndex, MessageMeta
from moorline.invariant import InvariantViolation


def _meta(offset: int) -> MessageMeta:
    return MessageMeta(1_000 + offset, 100 + offset % 7, offset.to_bytes(16, "big"), f"t/{offset % 5}",
                       offset % 3, None if offset % 4 else 5_000 + offset)


def _add(index: MessageIndex, offset: int) -> None:
    m = _meta(offset)
    index.add(offset, m.ts_ms, m.size, m.guid, m.topic, m.qos, m.expires_at_ms)


def _check(index: MessageIndex, model: dict[int, MessageMeta], universe: range) -> None:
    assert len(index) == len(model)
    assert list(index) == sorted(model)
    assert list(reversed(index)) == sorted(model, reverse=True)
    assert dict(index.items()) == model
    assert [(o, t, e) for o, t, e in index.times()] == [(o, m.ts_ms, m.expires_at_ms) for o, m in sorted(model.items())]
    for o in universe:
        m = model.get(o)
        assert (o in index) == (m is not None)
        assert index.get(o) == m
        assert index.size_of(o) == (m.size if m else None)
        assert index.ts_of(o) == (m.ts_ms if m else None)
        assert index.expires_at(o) == (m.expires_at_ms if m else None)
        assert index.guid_of(o) == (m.guid if m else None)
    # The run form of ts_of: absent offsets skipped, the order of the request kept (repeats too).
    ask = [o for o in universe if o % 3] + [o for o in universe if not o % 3] + list(universe)[:3]
    assert index.time_keys(ask, 20) == [(model[o].ts_ms << 20) | o for o in ask if o in model]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 10_000)), max_size=120))
def test_index_matches_a_dict_model(ops: list[tuple[bool, int, int]]) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mi, "_COMPACT_MIN", 4)  # compaction happens within small examples
        index = MessageIndex()
        model: dict[int, MessageMeta] = {}
        next_offset = 0
        for is_add, gap, pick in ops:
            if is_add or not model:
                next_offset += gap
                if pick % 3:
                    _add(index, next_offset)
                    model[next_offset] = _meta(next_offset)
                    next_offset += 1
                else:  # a run of consecutive offsets, added by one add_run
                    run = [_meta(o) for o in range(next_offset, next_offset + 1 + pick % 5)]
                    index.add_run(next_offset, [m.ts_ms for m in run], [m.size for m in run],
                                  b"".join(m.guid for m in run), [m.topic for m in run], [m.qos for m in run],
                                  [mi.NO_EXPIRY if m.expires_at_ms is None else m.expires_at_ms for m in run])
                    for m in run:
                        model[next_offset] = m
                        next_offset += 1
            else:
                victim = sorted(model)[pick % len(model)]
                assert index.discard(victim)
                del model[victim]
                assert not index.discard(victim)
        _check(index, model, range(next_offset + 2))
        restored = MessageIndex.from_columns(index.to_columns())
        _check(restored, model, range(next_offset + 2))


def test_snapshot_columns_are_canonical() -> None:
    # Same present messages, reached through different histories (one compacted), give equal columns.
    a, b = MessageIndex(), MessageIndex()
    for o in range(10_000):
        _add(a, o)
    for o in range(9_000):
        a.discard(o)
    for o in range(9_000, 10_000):
        _add(b, o)
    a.discard(9_999)
    b.discard(9_999)
    assert a.to_columns() == b.to_columns()
    assert MessageIndex.from_columns(a.to_columns()).to_columns() == a.to_columns()


def test_topics_are_shared_not_copied() -> None:
    index = MessageIndex()
    for o in range(3):
        index.add(o, 1, 1, bytes(16), "".join(["a/", "b"]), 1, None)  # three distinct equal strings
    topics = [index.get(o).topic for o in range(3)]  # type: ignore[union-attr]
    assert topics[0] is topics[1] is topics[2]


def test_offsets_only_grow_and_guids_are_16_bytes() -> None:
    index = MessageIndex()
    _add(index, 5)
    with pytest.raises(InvariantViolation):
        _add(index, 5)
    with pytest.raises(InvariantViolation):
        index.add(6, 1, 1, b"short", "t", 1, None)
    index.discard(5)
    with pytest.raises(InvariantViolation):
        _add(index, 3)  # emptied, yet still never below what was added
    _add(index, 6)
    assert list(index) == [6]


def test_from_columns_refuses_inconsistent_columns() -> None:
    index = MessageIndex()
    for o in range(3):
        _add(index, o)
    base, ts, size, exp, flags, guid, topics = index.to_columns()
    with pytest.raises(ValueError):
        MessageIndex.from_columns((base, ts[:-8], size, exp, flags, guid, topics))
    with pytest.raises(ValueError):
        MessageIndex.from_columns((base, ts, size, exp, flags, guid[:-1], topics))
    with pytest.raises(ValueError):
        MessageIndex.from_columns((base, ts, size, exp, b"\x00" + flags[1:], guid, topics))
