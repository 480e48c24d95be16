"""GuidHistory against an ordered-dict model: lookups, adds one at a time and in runs, eviction by
time and by count, compaction, principals kept apart, and snapshot columns."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.broker import guid_history as gh
from moorline.broker.guid_history import GuidHistory
from moorline.invariant import InvariantViolation

Model = OrderedDict[tuple[str, bytes], tuple[int, int, int]]


def _check(h: GuidHistory, model: Model, probes: list[tuple[str, bytes]]) -> None:
    assert len(h) == len(model)
    assert [(p, g, o, t, c) for p, g, o, t, c in h.items()] == [(p, g, *v) for (p, g), v in model.items()]
    for p, g in probes:
        assert h.get(p, g) == model.get((p, g))
    assert h.oldest_ts() == (next(iter(model.values()))[1] if model else None)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["", "alice", "bob"]), st.integers(0, 40),
                          st.integers(0, 30)), max_size=150))
def test_history_matches_an_ordered_dict(ops: list[tuple[int, str, int, int]]) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gh, "_COMPACT_MIN", 3)
        h = GuidHistory()
        model: Model = OrderedDict()
        ts = 0
        probes: list[tuple[str, bytes]] = []
        run: list[tuple[bytes, int, int, int]] = []  # kind 1 adds, made by one add_run

        def flush() -> None:
            if run:
                h.add_run(*(list(col) for col in zip(*run, strict=True)))  # type: ignore[arg-type]
                run.clear()

        for kind, principal, n, arg in ops:
            guid = n.to_bytes(16, "big")
            probes.append((principal, guid))
            if kind < 2:
                if (principal, guid) in model:
                    continue
                ts += arg % 3
                if kind == 0:
                    flush()
                    h.add(principal, guid, len(probes), ts, n * 7)
                else:
                    run.append((GuidHistory.key_of(principal, guid), len(probes), ts, n * 7))
                model[(principal, guid)] = (len(probes), ts, n * 7)
            else:
                flush()
                cutoff, cap = ts - arg % 10, arg
                expect = 0
                while model and (next(iter(model.values()))[1] < cutoff or len(model) > cap):
                    model.popitem(last=False)
                    expect += 1
                assert h.evict(cutoff, cap) == expect
        flush()
        _check(h, model, probes)
        _check(GuidHistory.from_columns(h.to_columns()), model, probes)


def test_same_guid_from_two_principals_are_two_entries() -> None:
    h = GuidHistory()
    g = bytes(range(16))
    h.add("", g, 1, 10, 99)
    h.add("alice", g, 2, 11, 98)
    assert h.get("", g) == (1, 10, 99)
    assert h.get("alice", g) == (2, 11, 98)
    assert h.get("bob", g) is None
    with pytest.raises(InvariantViolation):
        h.add("alice", g, 3, 12, 97)
    with pytest.raises(InvariantViolation):
        h.add("", b"short", 3, 12, 97)
    with pytest.raises(InvariantViolation):  # a run that repeats a key
        h.add_run([bytes(16), bytes(16)], [5, 6], [1, 1], [0, 0])


def test_from_columns_refuses_inconsistent_columns() -> None:
    h = GuidHistory()
    h.add("", bytes(16), 1, 1, 1)
    h.add("", bytes(15) + b"\x01", 2, 2, 2)
    keys, offsets, ts, crcs = h.to_columns()
    with pytest.raises(ValueError):
        GuidHistory.from_columns((keys, offsets[:-8], ts, crcs))
    with pytest.raises(ValueError):
        GuidHistory.from_columns(([keys[0], keys[0]], offsets, ts, crcs))
