"""Random WAL operation sequences against a dumb in-memory model, with clean restarts and crashes.

Crashes lose what no sync covered in three ways: the unsynced write never reached the file (a few
garbage bytes may land after the synced end), or it reached the file with a page hole: its first
page zeroed (the page it shares with the synced records keeps those) while later pages survive, or
a page further in zeroed. Pages are ``PAGE`` bytes here, scaled to the walk's 400-byte segments."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moorline.storage.wal import WriteAheadLog

GROUPS = (0, 1, 2)
PAGE = 64
LOST, FIRST_PAGE_HOLE, LATER_PAGE_HOLE = 0, 1, 2


@dataclass
class ModelGroup:
    entries: dict[int, tuple[int, int, int, bytes]] = field(default_factory=dict)
    last: int = 0
    snap: int = 0
    snap_term: int = 0
    hard: tuple[int, bytes, int] | None = None

    def commit(self) -> int:
        return self.hard[2] if self.hard is not None else 0

    def copy(self) -> ModelGroup:
        return ModelGroup(dict(self.entries), self.last, self.snap, self.snap_term, self.hard)


op = st.one_of(
    st.tuples(
        st.just("append"),
        st.sampled_from(GROUPS),
        st.integers(0, 4),
        st.integers(1, 4),
        st.binary(max_size=40),
    ),
    st.tuples(st.just("hard"), st.sampled_from(GROUPS), st.integers(0, 9), st.binary(max_size=6)),
    st.tuples(st.just("snap"), st.sampled_from(GROUPS), st.integers(0, 5)),
    st.tuples(st.just("truncate"), st.sampled_from(GROUPS), st.integers(0, 4)),
    st.tuples(st.just("remove"), st.sampled_from(GROUPS)),
    st.tuples(st.just("sync")),
    st.tuples(st.just("reclaim")),
    st.tuples(st.just("restart")),
    st.tuples(st.just("crash"), st.integers(0, 30), st.sampled_from((LOST, FIRST_PAGE_HOLE, LATER_PAGE_HOLE))),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=60))
def test_wal_matches_model(ops: list[tuple]) -> None:
    d = Path(tempfile.mkdtemp(prefix="walmodel-"))
    try:
        _run(d, ops)
    finally:
        shutil.rmtree(d)


def _open(d: Path, preallocate: bool = False) -> tuple[WriteAheadLog, dict[int, ModelGroup]]:
    # Preallocated: the next segment is zero-filled after every sync of a segment's first.
    w = WriteAheadLog(d, segment_bytes=400, preallocate=preallocate, prepare_after_syncs=1)
    rec = w.open()
    assert rec.corrupted == []
    got: dict[int, ModelGroup] = {}
    for g, gr in rec.groups.items():
        m = ModelGroup()
        m.snap, m.snap_term, m.hard = gr.snapshot_index, gr.snapshot_term, gr.hard_state
        m.entries = {e.index: tuple(e) for e in gr.entries}  # type: ignore[misc]
        m.last = max([m.snap, *m.entries])
        got[g] = m
    return w, got


def _check(durable: dict[int, ModelGroup], got: dict[int, ModelGroup]) -> None:
    for g in GROUPS:
        want = durable.get(g, ModelGroup())
        have = got.get(g, ModelGroup())
        assert have.hard == want.hard, g
        assert have.snap == want.snap and have.snap_term == want.snap_term, g
        want_entries = {i: e for i, e in want.entries.items() if i > want.snap}
        assert have.entries == want_entries, g


def _run(d: Path, ops: list[tuple], preallocate: bool = False) -> int:
    """Returns how many zero-filled segments were prepared."""
    prepared = 0
    w, _ = _open(d, preallocate)
    live: dict[int, ModelGroup] = {g: ModelGroup() for g in GROUPS}
    durable: dict[int, ModelGroup] = {g: ModelGroup() for g in GROUPS}
    term = 1
    for o in ops:
        kind = o[0]
        if kind == "append":
            _, g, back, count, data = o
            m = live[g]
            first = max(m.snap + 1, m.last + 1 - back, m.commit() + 1)  # committed entries stay
            term += 1 if back else 0
            batch = [(term, i, i % 3, data) for i in range(first, first + count)]
            w.append_entries(g, batch)
            for i in list(m.entries):
                if i >= first:
                    del m.entries[i]
            for e in batch:
                m.entries[e[1]] = e
            m.last = first + count - 1
        elif kind == "hard":
            _, g, t, vote = o
            # As Raft writes them: term and commit index never go back (and nothing at or below a
            # commit index is ever truncated, see "append"). The WAL relies on it: a batch's hard
            # state is written after its entries, so a torn batch may keep a truncation and lose
            # the hard state that came with it; the previous one then still fits the log.
            prev = live[g].hard
            t = max(t, prev[0] if prev is not None else 0)
            commit = max(min(live[g].last, t), live[g].commit())
            w.set_hard_state(g, t, vote, commit)
            live[g].hard = (t, vote, commit)
        elif kind == "snap":
            _, g, behind = o
            m = live[g]
            index = max(m.snap, m.last - behind)
            if index > m.snap:
                w.mark_snapshot(g, index, term)
                m.snap, m.snap_term = index, term
                m.entries = {i: e for i, e in m.entries.items() if i > index}
        elif kind == "truncate":
            _, g, back = o
            m = live[g]
            frm = max(m.snap + 1, m.last + 1 - back, m.commit() + 1)
            w.truncate(g, frm)
            m.entries = {i: e for i, e in m.entries.items() if i < frm}
            m.last = min(m.last, frm - 1)
        elif kind == "remove":
            w.remove_group(o[1])
            live[o[1]] = ModelGroup()
        elif kind == "sync":
            w.sync()
            if w._preparer is not None:
                w._preparer.wait(10)  # not left to thread timing: the walk replays exactly
            durable = {g: m.copy() for g, m in live.items()}
        elif kind == "reclaim":
            w.reclaim()
        elif kind == "restart":
            prepared += w._preparer.prepared if w._preparer is not None else 0
            w.close()
            durable = {g: m.copy() for g, m in live.items()}
            w, got = _open(d, preallocate)
            _check(durable, got)
            live = {g: m.copy() for g, m in durable.items()}
        elif kind == "crash":
            _, garbage, how = o
            fd_seq = w._fd_seq
            end = w._fd_length
            # The unsynced write: what the next sync would have written, segment by segment.
            chunks = [(seq, bytes(chunk)) for seq, chunk in w._pending if chunk]
            if w._preparer is not None:
                prepared += w._preparer.prepared
                w._preparer.close()
            if w._fd is not None:
                os.close(w._fd)
                w._fd = None
            w._closed = True
            if how == LOST or not chunks:
                if fd_seq and garbage:
                    with open(d / f"wal-{fd_seq:016d}.log", "r+b") as f:  # over zeros, if preallocated
                        f.seek(end)
                        f.write(bytes((i * 37 + 0x4C) % 256 for i in range(garbage)))
                w, got = _open(d, preallocate)
                _check(durable, got)
            else:
                w, got = _page_hole_crash(d, chunks, fd_seq, end, garbage, how, preallocate)
                if how == FIRST_PAGE_HOLE and garbage % len(chunks) == 0:
                    _check(durable, got)  # the write's first page never arrived: none of it counts
                durable = {g: got.get(g, ModelGroup()).copy() for g in GROUPS}
            live = {g: m.copy() for g, m in durable.items()}
    prepared += w._preparer.prepared if w._preparer is not None else 0
    w.close()
    durable = {g: m.copy() for g, m in live.items()}
    _, got = _open(d)
    _check(durable, got)
    return prepared


def _page_hole_crash(
    d: Path, chunks: list[tuple[int, bytes]], fd_seq: int, end: int, pick: int, how: int, preallocate: bool
) -> tuple[WriteAheadLog, dict[int, ModelGroup]]:
    """The power loss hit a sync while it wrote chunk ``pick % len(chunks)``: the chunks before it are
    whole (each segment is synced before the next gets a byte), and of that chunk's write a page never
    arrived while the later pages did: its first (FIRST_PAGE_HOLE; the part of it the synced records
    share stays) or a later one. Recovery must give what losing the chunk from the first byte the
    hole changed gives: the old, trusted rule for a lost suffix. Returns the reopened log and state."""
    k = pick % len(chunks)
    cut = d.parent / (d.name + "-cut")
    shutil.copytree(d, cut)
    if fd_seq and chunks[k][0] != fd_seq:
        for root in (d, cut):  # leaving a segment cuts its unused zeros first (and syncs it)
            os.truncate(root / f"wal-{fd_seq:016d}.log", end)
    for i, (seq, chunk) in enumerate(chunks[: k + 1]):
        at = end if seq == fd_seq else 0
        if i < k:
            holed = kept = chunk
        else:
            first = -at % PAGE or PAGE  # the chunk's bytes in the page it starts in
            if how == FIRST_PAGE_HOLE or len(chunk) <= first + PAGE:
                lo, hi = 0, min(first, len(chunk))
            else:
                pages = (len(chunk) - first) // PAGE
                lo = first + PAGE * (pick % pages)
                hi = min(lo + PAGE, len(chunk))
            holed = chunk[:lo] + bytes(hi - lo) + chunk[hi:]
            changed = next((j for j in range(len(chunk)) if holed[j] != chunk[j]), len(chunk))
            kept = chunk[:changed]
        for root, data in ((d, holed), (cut, kept)):
            path = root / f"wal-{seq:016d}.log"
            with open(path, "r+b" if path.exists() else "wb") as f:  # a new segment: created by the sync
                f.seek(at)
                f.write(data)
                if root is cut and not (preallocate and seq == fd_seq):
                    f.truncate(at + len(data))
    _, want = _open(cut)
    shutil.rmtree(cut)
    w, got = _open(d, preallocate)
    _check(want, got)
    return w, got


@pytest.mark.parametrize("preallocate", [False, True], ids=["appending", "preallocated"])
def test_wal_seeded_random_walks(monkeypatch: object, preallocate: bool) -> None:
    """Longer seeded walks than hypothesis tends to draw; asserts rotation and reclaim really ran
    (and, preallocated, that zero-filled segments were used)."""
    import random

    removed: list[int] = []
    real_reclaim = WriteAheadLog.reclaim

    def reclaim(self: WriteAheadLog) -> list[Path]:
        out = real_reclaim(self)
        removed.append(len(out))
        return out

    monkeypatch.setattr(WriteAheadLog, "reclaim", reclaim)  # type: ignore[attr-defined]
    prepared = 0
    for seed in range(4):
        r = random.Random(seed)
        ops: list[tuple] = []
        for _ in range(120):
            k = r.choice(
                ["append"] * 5
                + ["hard", "snap", "truncate", "sync", "sync", "reclaim", "restart", "crash", "remove"]
            )
            g = r.choice(GROUPS)
            if k == "append":
                ops.append(
                    ("append", g, r.choice([0, 0, 0, 1, 3]), r.randint(1, 4), r.randbytes(r.randint(0, 40)))
                )
            elif k == "hard":
                ops.append(("hard", g, r.randint(0, 9), r.randbytes(r.randint(0, 6))))
            elif k == "snap":
                ops.append(("snap", g, r.randint(0, 5)))
            elif k == "truncate":
                ops.append(("truncate", g, r.randint(0, 4)))
            elif k == "crash":
                ops.append(("crash", r.randint(0, 30), r.choice((LOST, FIRST_PAGE_HOLE, LATER_PAGE_HOLE))))
            elif k == "remove":
                ops.append(("remove", g))
            else:
                ops.append((k,))
        d = Path(tempfile.mkdtemp(prefix="walwalk-"))
        try:
            prepared += _run(d, ops, preallocate)
        finally:
            shutil.rmtree(d)
    assert sum(removed) > 0
    assert (prepared > 0) == preallocate
