"""Sync batches in the WAL: a power loss is not corruption.

A group commit writes its records and then runs one ``fdatasync``; the next batch is written only
after that returned. After a power loss the pages of the last, unfinished write can have reached
the disk in any order: a 4 KiB page of it may read as zeros while later pages of the same write
survive. That is a torn tail (nothing in it was acknowledged), not corruption. Damage in an earlier
batch, which was synced, still is corruption.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import pytest

from moorline.hashing import crc32c
from moorline.storage.wal import (
    HEADER_BYTES,
    NO_BATCH,
    T_ENTRY,
    T_HARD_STATE,
    T_SEAL,
    WalCorruption,
    WriteAheadLog,
    segment_name,
    segment_records,
)

PAGE = 4096


def ent(index: int, size: int = 200) -> tuple[int, int, int, bytes]:
    return (1, index, 0, bytes([index % 251]) * size)


def write_batches(d: Path, synced: int, last: int, size: int = 200) -> tuple[list[int], int, int]:
    """Entries 1..synced of group 1 in syncs of three, then entries synced+1..last in one final
    batch (its hard state last). Returns (each entry's record start, where the final batch starts,
    where it ends), all in segment 1."""
    w = WriteAheadLog(d)
    w.open()
    starts = [0]  # index 0 unused
    for i in range(1, synced + 1):
        starts.append(w._seg_size)
        w.append_entries(1, [ent(i, size)])
        w.set_hard_state(1, 1, b"", i - 1)
        if i % 3 == 0 or i == synced:
            w.sync()
    batch_start = w._seg_size
    for i in range(synced + 1, last + 1):
        starts.append(w._seg_size)
        w.append_entries(1, [ent(i, size)])
    w.set_hard_state(1, 1, b"", last)
    w.sync()  # its fdatasync "did not return": the power loss below hits its write
    end = w._seg_size
    crash(w)
    return starts, batch_start, end


def crash(w: WriteAheadLog) -> None:
    """The process is gone (no clean close, which would seal the log)."""
    if w._fd is not None:
        os.close(w._fd)
        w._fd = None
    w._closed = True


def zero(path: Path, start: int, end: int) -> int:
    """Zero ``[start, end)`` of the file; returns where the first record the zeros changed starts."""
    raw = path.read_bytes()
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(end - start))
    p = 0
    while p < len(raw):  # walk the intact records (body length at byte 4 of every header)
        rec_end = p + HEADER_BYTES + int.from_bytes(raw[p + 4 : p + 8], "little")
        if rec_end > start and raw[max(p, start) : min(rec_end, end)].strip(b"\0"):
            return p
        p = rec_end
    raise AssertionError("the zeros changed no record")


def record_at(starts: list[int], pos: int) -> int:
    """The entry whose record starts at or last before ``pos``."""
    return max(i for i in range(1, len(starts)) if starts[i] <= pos)


def test_page_hole_in_the_last_batch_is_a_torn_tail(tmp_path: Path) -> None:
    """One 4 KiB page of the last group commit's write zeroed, later pages of it intact: today's
    rule ("an invalid record followed by a valid one is corruption") refused to start here."""
    starts, batch_start, end = write_batches(tmp_path, 30, 120)
    seg = tmp_path / segment_name(1)
    hole = (batch_start // PAGE + 2) * PAGE  # the batch's third page: pages before and after it survive
    assert batch_start < hole and hole + 2 * PAGE < end
    at = zero(seg, hole, hole + PAGE)
    damaged = record_at(starts, at)
    assert starts[damaged] == at  # the final batch holds entries only, then its hard state

    rec = WriteAheadLog(tmp_path).open()
    assert rec.corrupted == []
    assert [e.index for e in rec.groups[1].entries] == list(range(1, damaged))
    assert rec.groups[1].hard_state == (1, b"", 29)  # the final batch's hard state went with it
    assert rec.torn_tail_truncated == [(seg, at)]
    assert seg.stat().st_size == at
    (tail,) = rec.torn_tails
    assert (tail.path, tail.offset, tail.bytes) == (seg, at, end - at)
    # The damaged record, and every later one whose header survived (the hole swallowed the rest):
    # the entries after the hole and the batch's hard state.
    assert tail.records == 1 + sum(1 for i in range(damaged, 121) if starts[i] >= hole + PAGE) + 1
    assert tail.batch == rec.next_batch - 1  # the highest batch seen


def test_hole_in_the_page_the_last_batch_shares_with_the_synced_one(tmp_path: Path) -> None:
    """The last batch's first page also holds the end of the batch before it (synced): unwritten,
    it keeps those bytes and reads as zeros after them, and the batch's first header is gone."""
    starts, batch_start, end = write_batches(tmp_path, 30, 90)
    seg = tmp_path / segment_name(1)
    assert batch_start % PAGE != 0
    assert zero(seg, batch_start, (batch_start // PAGE + 1) * PAGE) == batch_start
    rec = WriteAheadLog(tmp_path).open()
    assert rec.corrupted == []
    assert [e.index for e in rec.groups[1].entries] == list(range(1, 31))
    assert rec.torn_tail_truncated == [(seg, batch_start)]


def test_page_hole_in_an_earlier_synced_batch_is_still_corruption(tmp_path: Path) -> None:
    starts, batch_start, _end = write_batches(tmp_path, 60, 90)
    seg = tmp_path / segment_name(1)
    hole = (starts[20] // PAGE + 1) * PAGE
    assert hole + PAGE < batch_start  # wholly inside batches that were synced
    at = zero(seg, hole, hole + PAGE)
    size = seg.stat().st_size
    with pytest.raises(WalCorruption) as err:
        WriteAheadLog(tmp_path).open()
    # The first record whose header the zeros destroyed (one whose body alone they hit is reported
    # for its group first): it cannot be attributed, so the node must not start.
    assert err.value.path == seg and at <= err.value.offset < hole + PAGE
    assert seg.stat().st_size == size  # never truncated


def test_damage_in_the_last_batch_followed_by_a_later_batch_is_corruption(tmp_path: Path) -> None:
    """Records of a later batch after the damage prove the damaged batch was synced."""
    starts, batch_start, end = write_batches(tmp_path, 30, 90)
    w = WriteAheadLog(tmp_path)  # a restart: the next batch goes to a new segment ...
    w.open()
    w.append_entries(1, [ent(91)])
    w.sync()
    crash(w)
    seg = tmp_path / segment_name(1)
    hole = (batch_start // PAGE + 2) * PAGE
    zero(seg, hole, hole + PAGE)
    with pytest.raises(WalCorruption) as err:  # ... so segment 1 was complete (its batch synced)
        WriteAheadLog(tmp_path).open()
    assert err.value.path == seg


def test_body_damage_in_the_last_batch_is_a_torn_tail_but_in_an_earlier_one_stops_the_group(
    tmp_path: Path,
) -> None:
    """A header intact and its body damaged: the header says which batch the record was in."""
    for where, torn in (("last", True), ("earlier", False)):
        d = tmp_path / where
        starts, _batch_start, _end = write_batches(d, 30, 60)
        seg = d / segment_name(1)
        victim = 45 if torn else 20
        raw = bytearray(seg.read_bytes())
        raw[starts[victim + 1] - 10] ^= 0x08  # the end of the entry's payload
        seg.write_bytes(bytes(raw))
        rec = WriteAheadLog(d).open()
        if torn:
            assert rec.corrupted == [] and rec.torn_tail_truncated == [(seg, starts[victim])]
            assert [e.index for e in rec.groups[1].entries] == list(range(1, victim))
        else:
            assert [(r.group, r.offset) for r in rec.corrupted] == [(1, starts[victim])]
            assert rec.groups[1].corrupted and rec.torn_tail_truncated == []


def test_the_report_names_the_batch(tmp_path: Path) -> None:
    starts, batch_start, end = write_batches(tmp_path, 6, 40)
    seg = tmp_path / segment_name(1)
    hole = (batch_start // PAGE + 1) * PAGE
    zero(seg, hole, hole + PAGE)
    rec = WriteAheadLog(tmp_path).open()
    (tail,) = rec.torn_tails
    text = tail.describe()
    assert re.search(rf"sync batch {tail.batch}\b", text) and str(seg) in text
    assert f"{tail.records} record" in text


# --- batch numbers as written ------------------------------------------------------------------


def test_batch_numbers_rise_across_syncs_segments_and_restarts(tmp_path: Path) -> None:
    seen: list[int] = []
    for run in range(3):
        w = WriteAheadLog(tmp_path, segment_bytes=2048, write_ahead_bytes=600)
        rec = w.open()
        assert rec.next_batch == (max(seen) + 1 if seen else 1)
        for i in range(1, 40):
            w.append_entries(run, [ent(i, 90)])  # rotates segments inside batches, writes ahead
            if i % 4 == 0:
                w.sync()
        if run < 2:
            crash(w)  # pending appends lost; no seal
        else:
            w.close()
        seen = []
        for seg in sorted(tmp_path.glob("wal-*.log")):
            records = segment_records(seg)
            assert all(r.valid and r.batch >= 1 for r in records)
            for r in records:
                # Every record of a batch in a segment names where that batch starts in it.
                first = next(q for q in records if q.batch == r.batch)
                assert r.batch_start == first.offset
            seen += [r.batch for r in records]
        assert seen == sorted(seen)  # never back, across segments and restarts
    assert len(set(seen)) >= 25
    last = segment_records(sorted(tmp_path.glob("wal-*.log"))[-1])[-1]
    assert last.type == T_SEAL and last.batch == max(seen)  # a clean close seals in a batch of its own


def test_bytes_written_ahead_belong_to_the_next_sync(tmp_path: Path) -> None:
    w = WriteAheadLog(tmp_path, write_ahead_bytes=1024)
    w.open()
    w.append_entries(1, [ent(1)])
    w.sync()
    w.append_entries(1, [ent(i, 600) for i in range(2, 8)])  # written to the file now, unsynced
    seg = tmp_path / segment_name(1)
    ahead = segment_records(seg)
    assert len(ahead) >= 3  # entry 1 (synced), then entries written ahead before any sync
    first_batch = ahead[0].batch
    assert all(r.batch == first_batch + 1 for r in ahead[1:])
    w.sync()
    assert {r.batch for r in segment_records(seg)[1:]} == {first_batch + 1}
    crash(w)


def test_a_batch_that_spans_two_segments(tmp_path: Path) -> None:
    """The old segment is synced before the new one gets a byte: damage in the batch's part in the
    old segment, with valid records in the new one, is corruption; in the new one's part, torn."""
    for where in ("old", "new"):
        d = tmp_path / where
        w = WriteAheadLog(d, segment_bytes=4096)
        w.open()
        w.append_entries(1, [ent(i) for i in range(1, 10)])
        w.sync()
        w.append_entries(1, [ent(i) for i in range(10, 40)])  # one batch over several segments
        w.sync()
        crash(w)
        one, two = sorted(d.glob("wal-*.log"))[-2:]
        last = segment_records(two)[-1]
        assert segment_records(one)[-1].batch == last.batch  # the batch really spans both
        if where == "old":
            r = segment_records(one)[-3]
            zero(one, r.offset, r.offset + 50)
            with pytest.raises(WalCorruption) as err:
                WriteAheadLog(d).open()
            assert (err.value.path, err.value.offset) == (one, r.offset)
        else:
            r = segment_records(two)[3]
            zero(two, r.offset, r.offset + 50)
            rec = WriteAheadLog(d).open()
            assert rec.corrupted == [] and rec.torn_tail_truncated == [(two, r.offset)]
            assert rec.torn_tails[0].batch == last.batch


# --- the format before sync batches ------------------------------------------------------------

_V0_PRE = struct.Struct("<HBBIqIII")


def v0_record(rtype: int, group: int, seg: int, pos: int, body: bytes) -> bytes:
    """A record as the WAL wrote it before records carried their sync batch (32-byte header)."""
    pre = _V0_PRE.pack(0x4C57, rtype, 0, len(body), group, seg, pos, crc32c(body))
    return pre + struct.pack("<I", crc32c(pre)) + body


def write_v0_log(d: Path, n: int) -> list[int]:
    """Segment 1 in the old format: entries 1..n of group 1, then a hard state. Returns starts."""
    d.mkdir(parents=True, exist_ok=True)
    raw = bytearray()
    starts = []
    for i in range(1, n + 1):
        starts.append(len(raw))
        raw += v0_record(T_ENTRY, 1, 1, len(raw), struct.pack("<QQI", 1, i, 0) + bytes([i]) * 100)
    starts.append(len(raw))
    raw += v0_record(T_HARD_STATE, 1, 1, len(raw), struct.pack("<QQ", 1, n))
    (d / segment_name(1)).write_bytes(bytes(raw))
    return starts


def test_a_log_in_the_old_format_is_read_and_continued(tmp_path: Path) -> None:
    write_v0_log(tmp_path, 20)
    w = WriteAheadLog(tmp_path)
    rec = w.open()
    assert rec.corrupted == [] and rec.torn_tail_truncated == []
    assert [e.index for e in rec.groups[1].entries] == list(range(1, 21))
    assert rec.groups[1].entries[4].data == bytes([5]) * 100
    assert rec.groups[1].hard_state == (1, b"", 20)
    assert all(r.batch == NO_BATCH for r in segment_records(tmp_path / segment_name(1)))
    w.append_entries(1, [ent(21)])
    w.sync()
    w.close()
    assert all(r.batch >= 1 for r in segment_records(tmp_path / segment_name(2)))  # new records: new format
    rec = WriteAheadLog(tmp_path).open()
    assert rec.corrupted == [] and [e.index for e in rec.groups[1].entries] == list(range(1, 22))


def test_damage_in_the_old_format_follows_the_old_rule(tmp_path: Path) -> None:
    """Old records carry no batch: damage with any valid record after it is corruption; with
    nothing valid after it, a torn tail."""
    starts = write_v0_log(tmp_path / "hole", 30)
    seg = tmp_path / "hole" / segment_name(1)
    zero(seg, starts[10], starts[12])
    with pytest.raises(WalCorruption) as err:
        WriteAheadLog(tmp_path / "hole").open()
    assert (err.value.path, err.value.offset) == (seg, starts[10])

    starts = write_v0_log(tmp_path / "tail", 30)
    seg = tmp_path / "tail" / segment_name(1)
    with open(seg, "r+b") as f:
        f.truncate(starts[29] + 40)  # entry 30 torn, the hard state after it lost
    rec = WriteAheadLog(tmp_path / "tail").open()
    assert rec.corrupted == [] and rec.torn_tail_truncated == [(seg, starts[29])]
    assert [e.index for e in rec.groups[1].entries] == list(range(1, 30))
    assert rec.torn_tails[0].batch is None
