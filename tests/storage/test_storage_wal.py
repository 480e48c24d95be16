"""WriteAheadLog: round trip, recovery, torn tails, corruption, truncation, snapshots, reclaim, threads."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from moorline.invariant import InvariantViolation
from moorline.storage.ledger import read_ledger
from moorline.storage.wal import (
    HEADER_BYTES,
    WalBackpressure,
    WalCorruption,
    WriteAheadLog,
    segment_name,
)


def ent(index: int, term: int = 1, data: bytes | None = None, etype: int = 0) -> tuple[int, int, int, bytes]:
    return (term, index, etype, data if data is not None else f"payload-{index}".encode())


def reopen(path: Path, **kw: int) -> tuple[WriteAheadLog, object]:
    w = WriteAheadLog(path, **kw)  # type: ignore[arg-type]
    return w, w.open()


def crash(w: WriteAheadLog) -> None:
    """Drop the log without syncing what is pending (the process died)."""
    if w._fd is not None:
        os.close(w._fd)
        w._fd = None
    w._closed = True


def test_round_trip_several_groups(tmp_path: Path) -> None:
    w = WriteAheadLog(tmp_path)
    rec = w.open()
    assert rec.groups == {} and rec.corrupted == [] and rec.torn_tail_truncated == []
    w.append_entries(1, [ent(1), ent(2), ent(3, etype=1)])
    w.append_entries(7, [ent(1, term=4, data=b"")])
    w.set_hard_state(1, 3, b"node-b", 2)
    w.set_hard_state(7, 4, b"", 0)
    seq = w.sync()
    assert seq == w.synced_seq() == w.appended_seq() == 4
    w.close()

    w2 = WriteAheadLog(tmp_path)
    rec = w2.open()
    assert set(rec.groups) == {1, 7}
    g1 = rec.groups[1]
    assert [tuple(e) for e in g1.entries] == [ent(1), ent(2), ent(3, etype=1)]
    assert g1.entries[2].index == 3 and g1.entries[2].type == 1
    assert g1.hard_state == (3, b"node-b", 2) and g1.hard_state.vote == b"node-b"
    assert (g1.snapshot_index, g1.snapshot_term) == (0, 0)
    assert [tuple(e) for e in rec.groups[7].entries] == [ent(1, term=4, data=b"")]
    assert rec.corrupted == [] and rec.torn_tail_truncated == []
    # Appending continues after recovery.
    w2.append_entries(1, [ent(4)])
    w2.sync()
    w2.close()
    rec = WriteAheadLog(tmp_path).open()
    assert [e.index for e in rec.groups[1].entries] == [1, 2, 3, 4]


def test_unsynced_appends_are_not_recovered(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.append_entries(1, [ent(1)])
    w.sync()
    w.append_entries(1, [ent(2)])
    assert w.pending_bytes() > 0 and w.appended_seq() > w.synced_seq()
    crash(w)
    rec = WriteAheadLog(tmp_path).open()
    assert [e.index for e in rec.groups[1].entries] == [1]


def test_implied_truncate_replaces_conflicting_suffix(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.append_entries(1, [ent(i) for i in range(1, 11)])
    w.sync()
    w.append_entries(1, [ent(5, term=2, data=b"new5"), ent(6, term=2, data=b"new6")])
    assert w.last_index(1) == 6
    w.append_entries(1, [ent(7, term=2)])
    w.truncate(1, 7)  # explicit truncation too
    w.sync()
    w.close()
    rec = WriteAheadLog(tmp_path).open()
    got = rec.groups[1].entries
    assert [(e.term, e.index) for e in got] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 5), (2, 6)]
    assert got[4].data == b"new5"


def test_append_invariants(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.append_entries(1, [ent(1), ent(2)])
    with pytest.raises(InvariantViolation):
        w.append_entries(1, [ent(5)])  # gap
    with pytest.raises(InvariantViolation):
        w.append_entries(1, [ent(3), ent(5)])  # not contiguous
    w.mark_snapshot(1, 2, 1)
    with pytest.raises(InvariantViolation):
        w.append_entries(1, [ent(2)])  # compacted


def test_backpressure_bound(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, max_pending_bytes=1000)
    w.append_entries(1, [ent(1, data=b"x" * 2000)])  # one batch may exceed the bound
    with pytest.raises(WalBackpressure):
        w.append_entries(1, [ent(2)])
    w.set_hard_state(1, 1, b"", 1)  # hard state is never refused
    w.sync()
    w.append_entries(1, [ent(2)])


def test_hard_state_latest_wins(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.sync()
    assert w.pending_bytes() == 0
    w.set_hard_state(3, 1, b"a", 0)  # a vote alone must make the node sync
    assert w.pending_bytes() > 0
    w.sync()
    assert w.pending_bytes() == 0
    w.set_hard_state(3, 2, b"", 0)
    w.set_hard_state(3, 5, b"\x00\x01vote", 0)
    w.sync()
    w.close()
    rec = WriteAheadLog(tmp_path).open()
    assert rec.groups[3].hard_state == (5, b"\x00\x01vote", 0)
    assert rec.groups[3].entries == []


def test_snapshot_mark_compacts_entries(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.append_entries(1, [ent(i) for i in range(1, 21)])
    w.mark_snapshot(1, 12, 1)
    w.append_entries(1, [ent(21)])
    w.mark_snapshot(2, 50, 3)  # a group that only installed a snapshot
    w.append_entries(2, [ent(51, term=3)])
    w.sync()
    w.close()
    rec = WriteAheadLog(tmp_path).open()
    g1, g2 = rec.groups[1], rec.groups[2]
    assert (g1.snapshot_index, g1.snapshot_term) == (12, 1)
    assert [e.index for e in g1.entries] == list(range(13, 22))
    assert (g2.snapshot_index, g2.snapshot_term, [e.index for e in g2.entries]) == (50, 3, [51])


def test_segment_rotation_and_reclaim(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, segment_bytes=2048)
    payload = b"p" * 60
    for i in range(1, 121):
        w.append_entries(1, [ent(i, data=payload)])
        w.append_entries(2, [ent(i, data=payload)])
        if i % 10 == 0:
            w.sync()
    w.sync()
    segs = sorted(p.name for p in tmp_path.iterdir())
    assert len(segs) > 10 and segs == [segment_name(i) for i in range(1, len(segs) + 1)]
    assert all(p.stat().st_size <= 2048 + 200 for p in tmp_path.iterdir())

    # Only group 1 snapshotted: group 2 pins every segment.
    w.mark_snapshot(1, 120, 1)
    w.sync()
    assert w.reclaim() == []
    assert w.groups_pinning_oldest_segment() == [2]
    # Group 2 snapshotted half-way: the segments whose group-2 entries are all <= 60 go.
    w.mark_snapshot(2, 60, 1)
    assert w.reclaim() == []  # the mark is not durable yet
    w.sync()
    removed = w.reclaim()
    assert removed and all(not p.exists() for p in removed)
    assert removed == [tmp_path / segment_name(i) for i in range(1, len(removed) + 1)]
    assert w.groups_pinning_oldest_segment() == [2]
    w.close()

    rec = WriteAheadLog(tmp_path, segment_bytes=2048).open()
    assert rec.corrupted == []
    g1, g2 = rec.groups[1], rec.groups[2]
    assert g1.snapshot_index == 120 and g1.entries == []
    assert g2.snapshot_index == 60 and [e.index for e in g2.entries] == list(range(61, 121))
    assert all(e.data == payload for e in g2.entries)


def test_reclaim_after_restart_keeps_hard_state(tmp_path: Path) -> None:
    """Old segments may hold a group's only hard-state record; checkpoints carry it forward."""
    w, _ = reopen(tmp_path, segment_bytes=1024)
    w.set_hard_state(9, 7, b"voted-for-3", 0)  # idle group: never written again
    for i in range(1, 80):
        w.append_entries(1, [ent(i, data=b"x" * 40)])
        w.sync()
    w.mark_snapshot(1, 79, 1)
    w.sync()
    assert w.reclaim()
    w.close()
    w2, rec = reopen(tmp_path, segment_bytes=1024)
    assert rec.groups[9].hard_state == (7, b"voted-for-3", 0)  # type: ignore[attr-defined]
    assert rec.groups[1].snapshot_index == 79  # type: ignore[attr-defined]
    w2.close()


def test_missing_middle_segment_refuses_to_start(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, segment_bytes=512)
    for i in range(1, 60):
        w.append_entries(1, [ent(i, data=b"y" * 30)])
        w.sync()
    w.close()
    (tmp_path / segment_name(3)).unlink()
    with pytest.raises(WalCorruption) as err:
        WriteAheadLog(tmp_path, segment_bytes=512).open()
    assert err.value.path == tmp_path / segment_name(4)


def test_lost_reclaimed_prefix_is_reported_for_the_group(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, segment_bytes=512)
    for i in range(1, 60):
        w.append_entries(1, [ent(i, data=b"y" * 30)])
        w.sync()
    w.close()
    (tmp_path / segment_name(1)).unlink()  # entries 1.. gone without a snapshot covering them
    rec = WriteAheadLog(tmp_path, segment_bytes=512).open()
    assert [r.group for r in rec.corrupted] == [1]
    assert rec.groups[1].corrupted and "missing" in rec.corrupted[0].message


def _write_simple_log(path: Path, n: int, payload_len: int = 20) -> list[int]:
    """n entries of group 1 in one segment, one sync each; returns each record's start offset."""
    w, _ = reopen(path)
    starts = []
    for i in range(1, n + 1):
        starts.append(w._seg_size)
        w.append_entries(1, [ent(i, data=bytes([i % 256]) * payload_len)])
        w.sync()
    w.close()
    return starts


def test_torn_tail_at_every_byte_of_last_record(tmp_path: Path) -> None:
    src = tmp_path / "src"
    starts = _write_simple_log(src, 4)
    seg = src / segment_name(1)
    full = seg.read_bytes()
    last_start = starts[-1]
    sealed_at = len(full) - HEADER_BYTES  # a clean close ends with an empty seal record
    for cut in range(last_start, sealed_at):
        for tail in (b"", b"\x00" * 3, b"\xff\x57\x4c") if cut % 3 == 0 else (b"",):
            d = tmp_path / f"c{cut}-{len(tail)}-{tail[:1].hex()}"
            shutil.copytree(src, d)
            (d / segment_name(1)).write_bytes(full[:cut] + tail)
            w = WriteAheadLog(d)
            rec = w.open()
            assert [e.index for e in rec.groups[1].entries] == [1, 2, 3], cut
            assert rec.corrupted == []
            if cut == last_start and not tail.strip(b"\x00"):
                # Nothing, or zeros only (preallocated space never written): cut, not called torn.
                assert rec.torn_tail_truncated == []
            else:
                assert rec.torn_tail_truncated == [(d / segment_name(1), last_start)]
            assert (d / segment_name(1)).stat().st_size == last_start
            if cut % 7 == 0:  # (a sample: each check costs fsyncs) the log is usable again
                w.append_entries(1, [ent(4)])
                w.sync()
                w.close()
                assert [e.index for e in WriteAheadLog(d).open().groups[1].entries] == [1, 2, 3, 4]
            shutil.rmtree(d)


def test_body_bit_flip_before_valid_records_names_group_and_offset(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    starts: dict[tuple[int, int], int] = {}
    for i in range(1, 6):
        for g in (1, 2):
            starts[(g, i)] = w._seg_size
            w.append_entries(g, [ent(i, data=b"z" * 40)])
    w.sync()
    w.close()
    seg = tmp_path / segment_name(1)
    raw = bytearray(seg.read_bytes())
    at = starts[(1, 3)]
    raw[at + HEADER_BYTES + 30] ^= 0x10  # inside the body of group 1's entry 3
    seg.write_bytes(bytes(raw))
    size = seg.stat().st_size
    rec = WriteAheadLog(tmp_path).open()
    assert len(rec.corrupted) == 1
    report = rec.corrupted[0]
    assert (report.path, report.offset, report.group) == (seg, at, 1)
    assert rec.groups[1].corrupted
    assert [e.index for e in rec.groups[1].entries] == [1, 2]  # nothing after the damage
    assert not rec.groups[2].corrupted
    assert [e.index for e in rec.groups[2].entries] == [1, 2, 3, 4, 5]
    assert rec.torn_tail_truncated == []
    assert seg.stat().st_size == size  # never truncated


def test_header_bit_flip_before_valid_records_refuses_to_start(tmp_path: Path) -> None:
    starts = _write_simple_log(tmp_path, 5)
    seg = tmp_path / segment_name(1)
    raw = bytearray(seg.read_bytes())
    raw[starts[2] + 5] ^= 0x01  # the length field of entry 3
    seg.write_bytes(bytes(raw))
    with pytest.raises(WalCorruption) as err:
        WriteAheadLog(tmp_path).open()
    assert (err.value.path, err.value.offset) == (seg, starts[2])
    assert str(seg) in str(err.value)
    assert seg.stat().st_size == len(raw)


def test_corruption_before_a_later_segment_is_not_a_torn_tail(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, segment_bytes=600)
    for i in range(1, 40):
        w.append_entries(1, [ent(i, data=b"q" * 30)])
        w.sync()
    w.close()
    seg1 = tmp_path / segment_name(1)
    raw = bytearray(seg1.read_bytes())
    raw[-3] ^= 0xFF  # the last record of segment 1: nothing valid after it *in this file*
    seg1.write_bytes(bytes(raw))
    rec = WriteAheadLog(tmp_path, segment_bytes=600).open()
    assert [r.group for r in rec.corrupted] == [1] and rec.corrupted[0].path == seg1
    assert rec.torn_tail_truncated == [] and seg1.stat().st_size == len(raw)


def test_commit_beyond_recovered_log_is_reported(tmp_path: Path) -> None:
    starts = _write_simple_log(tmp_path, 3)
    w, _ = reopen(tmp_path)
    w.set_hard_state(1, 1, b"", 3)
    w.sync()
    w.close()
    # Lose entry 3 and keep the hard state after it: synced data vanished.
    seg_old = tmp_path / segment_name(1)
    raw = seg_old.read_bytes()
    seg_old.write_bytes(raw[: starts[2]])
    rec = WriteAheadLog(tmp_path).open()
    assert [r.group for r in rec.corrupted] == [1]
    assert "commit index 3" in rec.corrupted[0].message


def test_concurrent_append_and_sync(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, segment_bytes=64 << 10)
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def syncer() -> None:
        try:
            while not stop.is_set():
                seen.append(w.sync())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=syncer)
    t.start()
    n = 3000
    for i in range(1, n + 1):
        for g in (0, 1, 2):
            w.append_entries(g, [ent(i, data=b"m" * (i % 50))])
        if i % 97 == 0:
            w.set_hard_state(0, i, b"", i - 1)
    stop.set()
    t.join()
    final = w.sync()
    assert not errors
    assert final == w.appended_seq()
    assert seen == sorted(seen)  # monotonic
    assert len(seen) > 1
    w.close()
    rec = WriteAheadLog(tmp_path, segment_bytes=64 << 10).open()
    assert rec.corrupted == [] and rec.torn_tail_truncated == []
    for g in (0, 1, 2):
        got = rec.groups[g].entries
        assert [e.index for e in got] == list(range(1, n + 1))
        assert all(e.data == b"m" * (e.index % 50) for e in got)
    assert rec.groups[0].hard_state == (2910, b"", 2909)


def test_ledger_records_synced_lengths(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    d = tmp_path / "wal"
    w = WriteAheadLog(d, segment_bytes=1024, ledger=ledger)
    w.open()
    for i in range(1, 40):
        w.append_entries(1, [ent(i, data=b"l" * 30)])
        w.sync()
        lengths = read_ledger(ledger)
        for path in d.iterdir():
            assert lengths[str(path)] == path.stat().st_size
    w.append_entries(1, [ent(40)])  # pending, not synced: ledger unchanged
    before = read_ledger(ledger)
    assert before == read_ledger(ledger)
    lines = ledger.read_text().splitlines()
    assert all('"synced_length"' in line for line in lines)
    crash(w)


def test_power_loss_after_sync_keeps_synced_prefix(tmp_path: Path) -> None:
    """Harness-style: truncate to the ledger's synced length plus garbage; synced data survives."""
    ledger = tmp_path / "ledger.jsonl"
    d = tmp_path / "wal"
    w = WriteAheadLog(d, segment_bytes=900, ledger=ledger)
    w.open()
    for i in range(1, 30):
        w.append_entries(1, [ent(i, data=b"s" * 25)])
        if i % 3 == 0:
            w.sync()
    synced_through = 27
    # A sync that wrote its bytes but crashed before fdatasync returned: simulate with a write.
    w.append_entries(1, [ent(30, data=b"s" * 25)])
    crash(w)
    # Only the segment being written can hold bytes beyond its synced length.
    last = max(Path(f) for f in read_ledger(ledger) if Path(f).exists())
    with open(last, "r+b") as f:
        f.truncate(read_ledger(ledger)[str(last)])
        f.seek(0, 2)
        f.write(b"\x57\x4c\x01\x00garbage")
    rec = WriteAheadLog(d, segment_bytes=900).open()
    assert rec.corrupted == []
    assert [e.index for e in rec.groups[1].entries] == list(range(1, synced_through + 1))
    assert len(rec.torn_tail_truncated) == 1


def test_empty_trailing_segment_from_a_crash_is_dropped(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.append_entries(1, [ent(1)])
    w.sync()
    w.close()
    # A crash right after a new segment file was created, before anything reached it.
    (tmp_path / segment_name(2)).write_bytes(b"")
    for _ in range(3):  # reopen repeatedly: numbering must stay contiguous
        w, rec = reopen(tmp_path)
        assert [e.index for e in rec.groups[1].entries] == [1]  # type: ignore[attr-defined]
        w.sync()
        w.close()
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == [segment_name(i) for i in range(1, len(names) + 1)]


def test_hard_states_are_coalesced_and_written_after_entries(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path)
    w.set_hard_state(1, 1, b"", 0)
    w.set_hard_state(1, 2, b"x", 0)
    w.set_hard_state(1, 2, b"x", 3)  # names entries appended after it, in the same batch
    w.append_entries(1, [ent(1), ent(2), ent(3)])
    w.sync()
    w.close()
    raw = (tmp_path / segment_name(1)).read_bytes()
    assert raw.count(b"\x57\x4c\x02") == 1  # one hard-state record (type 2)
    # Tear the segment anywhere: a surviving hard state never names a lost entry.
    for cut in range(0, len(raw), 3):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / segment_name(1)).write_bytes(raw[:cut])
        rec = WriteAheadLog(d).open()
        assert rec.corrupted == [], cut
        shutil.rmtree(d)


def test_concurrent_rotation_snapshots_and_reclaim(tmp_path: Path) -> None:
    """The node's shape: the loop appends and marks snapshots; a sync thread syncs and reclaims."""
    w, _ = reopen(tmp_path, segment_bytes=4096)
    stop = threading.Event()
    errors: list[BaseException] = []
    removed: list[Path] = []

    def syncer() -> None:
        try:
            while not stop.is_set():
                w.sync()
                removed.extend(w.reclaim())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=syncer)
    t.start()
    n = 2000
    for i in range(1, n + 1):
        for g in (0, 1):
            w.append_entries(g, [ent(i, data=b"r" * 40)])
        w.set_hard_state(0, 1, b"", i)
        if i % 150 == 0:
            w.mark_snapshot(0, i - 10, 1)
            w.mark_snapshot(1, i - 20, 1)
        w.groups_pinning_oldest_segment()  # must not block or race
    stop.set()
    t.join()
    assert not errors
    w.sync()
    removed.extend(w.reclaim())
    assert removed  # old segments went while appends ran
    w.close()
    rec = WriteAheadLog(tmp_path, segment_bytes=4096).open()
    assert rec.corrupted == []
    g0, g1 = rec.groups[0], rec.groups[1]
    last_mark = n // 150 * 150
    assert g0.snapshot_index == last_mark - 10
    assert [e.index for e in g0.entries] == list(range(last_mark - 9, n + 1))
    assert g1.snapshot_index == last_mark - 20
    assert [e.index for e in g1.entries] == list(range(last_mark - 19, n + 1))
    assert g0.hard_state == (1, b"", n)


def test_remove_group_unpins_segments_and_forgets_its_past(tmp_path: Path) -> None:
    w, _ = reopen(tmp_path, segment_bytes=1024)
    starts = {}
    for i in range(1, 60):
        for g in (1, 2):
            if (g, i) == (2, 5):
                starts[w._seg_seq] = w._seg_size
            w.append_entries(g, [ent(i, data=b"v" * 30)])
        w.sync()
    w.close()
    (seg_seq, at) = next(iter(starts.items()))
    seg = tmp_path / segment_name(seg_seq)
    raw = bytearray(seg.read_bytes())
    raw[at + HEADER_BYTES + 25] ^= 0x20  # group 2, entry 5
    seg.write_bytes(bytes(raw))

    w, rec = reopen(tmp_path, segment_bytes=1024)
    assert [r.group for r in rec.corrupted] == [2]  # type: ignore[attr-defined]
    w.mark_snapshot(1, 59, 1)
    w.sync()
    assert w.reclaim() == [] and w.groups_pinning_oldest_segment() == [2]
    w.remove_group(2)  # the node abandons the corrupted replica
    assert w.reclaim() == []  # not durable yet
    w.sync()
    shutil.copytree(tmp_path, tmp_path.parent / "before-reclaim")
    assert w.reclaim()  # group 2 pins nothing any more
    w.close()
    # With the damaged segment still there, the removal record makes recovery forget it.
    rec_kept = WriteAheadLog(tmp_path.parent / "before-reclaim", segment_bytes=1024).open()
    assert rec_kept.corrupted == [] and set(rec_kept.groups) == {1}

    w, rec = reopen(tmp_path, segment_bytes=1024)
    assert rec.corrupted == [] and set(rec.groups) == {1}  # type: ignore[attr-defined]
    # Re-added later as a new replica: starts from scratch.
    w.append_entries(2, [ent(1, term=7), ent(2, term=7)])
    w.sync()
    w.close()
    rec2 = WriteAheadLog(tmp_path, segment_bytes=1024).open()
    assert [(e.term, e.index) for e in rec2.groups[2].entries] == [(7, 1), (7, 2)]
    assert rec2.corrupted == []


def test_write_ahead_puts_large_batches_in_the_file_but_only_sync_makes_them_count(tmp_path: Path) -> None:
    """Past ``write_ahead_bytes`` pending bytes are written at once (while still in the CPU cache),
    unsynced: the ledger (synced lengths) does not move, a crash before ``sync`` loses them like
    any unsynced append, and ``sync`` still fdatasyncs them although nothing is pending any more."""
    ledger = tmp_path / "ledger.jsonl"
    d = tmp_path / "wal"
    w = WriteAheadLog(d, ledger=ledger, write_ahead_bytes=4096)
    w.open()
    w.append_entries(1, [ent(1)])
    w.sync()
    synced = read_ledger(ledger)
    (seg,) = d.iterdir()
    size_synced = seg.stat().st_size
    w.append_entries(1, [ent(i, data=bytes([i]) * 1500) for i in range(2, 8)])
    assert seg.stat().st_size > size_synced, "no write-ahead happened"
    assert read_ledger(ledger) == synced  # written is not synced
    assert w.appended_seq() > w.synced_seq()
    crash(w)
    # Power loss of what no sync covered: the harness cuts the file back to the ledger's length.
    os.truncate(seg, synced[str(seg)])
    rec = WriteAheadLog(d).open()
    assert [e.index for e in rec.groups[1].entries] == [1]

    w2 = WriteAheadLog(d, ledger=ledger, write_ahead_bytes=4096)
    w2.open()
    w2.append_entries(1, [ent(2, data=bytes([2]) * 1500)])
    w2.sync()  # after recovery the first sync opens the segment it writes to
    (seg,) = sorted(d.iterdir())[-1:]
    synced = read_ledger(ledger)
    w2.append_entries(1, [ent(i, data=bytes([i]) * 1500) for i in range(3, 8)])
    written = seg.stat().st_size
    assert written > synced[str(seg)]
    seq = w2.sync()  # everything was written ahead: this sync must still run fdatasync
    assert seq == w2.appended_seq() == w2.synced_seq()
    assert read_ledger(ledger)[str(seg)] == seg.stat().st_size >= written
    w2.close()
    rec = WriteAheadLog(d).open()
    got = rec.groups[1].entries
    assert [e.index for e in got] == list(range(1, 8))
    assert all(e.data == bytes([e.index]) * 1500 for e in got[1:])


def test_a_corrupted_groups_damaged_segment_is_never_reclaimed(tmp_path: Path) -> None:
    """Other groups snapshotting past it must not delete the segment that holds a corrupted group's
    damage: the next recovery would find that group whole, without its synced entries."""
    w, _ = reopen(tmp_path, segment_bytes=2048)
    at = (0, 0)
    for i in range(1, 30):
        w.append_entries(1, [ent(i, data=b"a" * 100)])
        if i == 3:
            at = (w._seg_seq, w._seg_size)
            w.append_entries(2, [ent(1, data=b"b" * 100)])  # group 2's only entry
        w.sync()
    w.close()
    seg = tmp_path / segment_name(at[0])
    raw = bytearray(seg.read_bytes())
    raw[at[1] + HEADER_BYTES + 30] ^= 0x01
    seg.write_bytes(bytes(raw))

    w, rec = reopen(tmp_path, segment_bytes=2048)
    assert [r.group for r in rec.corrupted] == [2]  # type: ignore[attr-defined]
    w.mark_snapshot(1, 29, 1)
    w.sync()
    assert w.reclaim() == [] and w.groups_pinning_oldest_segment() == [2]
    w.close()
    rec2 = WriteAheadLog(tmp_path, segment_bytes=2048).open()
    assert [r.group for r in rec2.corrupted] == [2] and rec2.groups[2].corrupted
