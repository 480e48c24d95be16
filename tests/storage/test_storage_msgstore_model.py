"""Random MessageStore operation sequences against a dict model, across restarts."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moorline.storage.msgstore import MessageStore

op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 12), st.integers(0, 80)),
    st.tuples(st.just("release"), st.lists(st.integers(0, 120), max_size=40)),
    st.tuples(st.just("release_below"), st.integers(0, 200)),
    st.tuples(st.just("release_most"), st.integers(0, 100), st.integers(2, 9)),
    st.tuples(st.just("reclaim")),
    st.tuples(st.just("truncate"), st.integers(0, 10)),
    st.tuples(st.just("sync")),
    st.tuples(st.just("restart")),
    st.tuples(st.just("check"), st.integers(0, 200), st.integers(1, 20), st.integers(1, 400)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=50), st.sampled_from([0, 200, 1 << 20]))
def test_store_matches_model(ops: list[tuple], cache_bytes: int) -> None:
    d = Path(tempfile.mkdtemp(prefix="storemodel-"))
    try:
        _run(d, ops, cache_bytes)
    finally:
        shutil.rmtree(d)


def _run(d: Path, ops: list[tuple], cache_bytes: int) -> None:
    def new() -> MessageStore:
        s = MessageStore(
            d, segment_bytes=300, cache_bytes=cache_bytes, write_buffer_bytes=100, compact_below_ratio=0.7
        )
        s.open()
        return s

    s = new()
    present: dict[int, bytes] = {}  # offset -> record, kept ones only
    next_offset = 0
    low_marks: list[int] = [s.low_water]
    for o in ops:
        kind = o[0]
        if kind == "append":
            _, count, size = o
            for _ in range(count):
                rec = bytes([next_offset % 251]) * size
                s.append(next_offset, rec)
                present[next_offset] = rec
                next_offset += 1
        elif kind == "release":
            offs = [x for x in o[1] if x < next_offset]
            s.release(offs)
            for x in offs:
                present.pop(x, None)
        elif kind == "release_most":  # sparse survivors: what copy-forward is for
            _, start, keep_every = o
            offs = [x for x in range(start, min(start + 40, next_offset)) if x % keep_every]
            s.release(offs)
            for x in offs:
                present.pop(x, None)
        elif kind == "release_below":
            s.release_below(o[1])
            for x in [x for x in present if x < o[1]]:
                del present[x]
        elif kind == "reclaim":
            s.reclaim()
        elif kind == "truncate":
            to = max(s.low_water, next_offset - o[1])
            if to <= next_offset:
                s.truncate_from(to)
                for x in [x for x in present if x >= to]:
                    del present[x]
                next_offset = to
        elif kind == "sync":
            s.sync()
        elif kind == "restart":
            s.sync()
            s.close()
            s = new()
            assert s.next_offset == next_offset
            # The released set is not durable: the owner re-releases after recovery.
            s.release([x for x in range(0, next_offset) if x not in present])
        elif kind == "check":
            _, frm, count, max_bytes = o
            want = [(x, present[x]) for x in sorted(present) if x >= frm][:count]
            got = s.scan(frm, count, max_bytes)
            assert got == want[: len(got)] and (got or not want)
            used = sum(len(r) for _, r in got)
            assert len(got) == 1 or used <= max_bytes
            if len(got) < len(want):
                assert len(got) == count or used + len(want[len(got)][1]) > max_bytes
        # Invariants after every step.
        assert s.next_offset == next_offset
        assert all(s.get(x) == r for x, r in present.items())
        assert all(s.get(x) is None for x in range(next_offset) if x not in present)
        assert all(x in present for x in range(s.low_water, next_offset))
        low_marks.append(s.low_water)
        assert low_marks[-1] >= low_marks[-2]  # only rises (truncate stays at or above it here)
    s.close()


def test_store_seeded_random_walks(monkeypatch: object) -> None:
    """Longer seeded walks than hypothesis tends to draw; asserts copy-forward really ran."""
    import random

    calls = {"copy": 0, "drop": 0}
    real_copy, real_drop = MessageStore._copy_forward, MessageStore._drop_segment

    def copy(self: MessageStore, seg: object) -> object:
        calls["copy"] += 1
        return real_copy(self, seg)  # type: ignore[arg-type]

    def drop(self: MessageStore, seg: object) -> None:
        calls["drop"] += 1
        real_drop(self, seg)  # type: ignore[arg-type]

    monkeypatch.setattr(MessageStore, "_copy_forward", copy)  # type: ignore[attr-defined]
    monkeypatch.setattr(MessageStore, "_drop_segment", drop)  # type: ignore[attr-defined]
    for seed in range(8):
        r = random.Random(seed)
        ops: list[tuple] = []
        for _ in range(50):
            k = r.choice(
                ["append", "append", "release_most", "release", "reclaim", "restart", "check", "truncate"]
            )
            if k == "append":
                ops.append(("append", r.randint(1, 12), r.randint(0, 80)))
            elif k == "release_most":
                ops.append(("release_most", r.randint(0, 100), r.randint(2, 9)))
            elif k == "release":
                ops.append(("release", [r.randint(0, 150) for _ in range(10)]))
            elif k == "truncate":
                ops.append(("truncate", r.randint(0, 10)))
            elif k == "check":
                ops.append(("check", r.randint(0, 200), r.randint(1, 20), r.randint(1, 400)))
            else:
                ops.append((k,))
        d = Path(tempfile.mkdtemp(prefix="storewalk-"))
        try:
            _run(d, ops, r.choice([0, 200, 1 << 20]))
        finally:
            shutil.rmtree(d)
    assert calls["copy"] > 0 and calls["drop"] > 0
