"""Preallocated WAL segments: records overwrite zeros a thread wrote ahead; only the last segment
may end in zeros, and only after a crash; recovery takes such a tail for unused space."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from moorline.storage import prealloc
from moorline.storage.prealloc import PREPARED_NAME
from moorline.storage.wal import WalRecovery, WriteAheadLog, segment_name

SEGMENT = 4096


def ent(index: int) -> tuple[int, int, int, bytes]:
    return (1, index, 0, f"payload-{index:05d}".encode() * 4)


def write_synced(w: WriteAheadLog, first: int, last: int) -> None:
    """One entry per sync, waiting for each preparation so the test does not depend on timing."""
    for i in range(first, last + 1):
        w.append_entries(3, [ent(i)])
        w.set_hard_state(3, 1, b"", i)
        w.sync()
        assert w._preparer is not None
        w._preparer.wait(10)


def open_wal(path: Path) -> WriteAheadLog:
    w = WriteAheadLog(path, segment_bytes=SEGMENT, preallocate=True, prepare_after_syncs=2)
    w.open()
    return w


def segment_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.glob("wal-*.log"))}


def recovered(path: Path, last_index: int, close: bool = True) -> WalRecovery:
    """Recovery by a plain WAL: nothing corrupted, and entries 1..last_index of group 3 all there.
    ``close=False`` leaves the directory as recovery left it (a close writes a new segment)."""
    w = WriteAheadLog(path, segment_bytes=SEGMENT)
    rec = w.open()
    assert rec.corrupted == []
    assert [e.index for e in rec.groups[3].entries] == list(range(1, last_index + 1))
    if close:
        w.close()
    return rec


def crash(w: WriteAheadLog) -> None:
    if w._fd is not None:
        os.close(w._fd)
        w._fd = None
    w._closed = True
    assert w._preparer is not None
    w._preparer.wait(10)


def test_busy_log_moves_to_zero_filled_segments_and_leaves_exact_files(tmp_path: Path) -> None:
    w = open_wal(tmp_path)
    write_synced(w, 1, 120)
    assert w._preparer is not None and w._preparer.prepared >= 3
    # The segment being written is a prepared one: full size, zeros after the records.
    current = tmp_path / segment_name(w._fd_seq)
    assert current.stat().st_size == SEGMENT > w._fd_length
    w.close()
    assert not (tmp_path / PREPARED_NAME).exists()
    sizes = segment_sizes(tmp_path)
    assert len(sizes) >= 4 and max(sizes.values()) < SEGMENT  # every one was cut to its records

    assert recovered(tmp_path, 120).torn_tail_truncated == []
    # Recovery cut nothing (it would cut a zero tail quietly): every file ended with its last record.
    assert {k: v for k, v in segment_sizes(tmp_path).items() if k in sizes} == sizes


def test_crash_leaves_a_zero_tail_that_recovery_cuts_without_calling_it_torn(tmp_path: Path) -> None:
    w = open_wal(tmp_path)
    write_synced(w, 1, 60)
    last = tmp_path / segment_name(w._fd_seq)
    records = w._fd_length
    assert last.stat().st_size == SEGMENT > records
    crash(w)

    assert recovered(tmp_path, 60).torn_tail_truncated == []
    assert last.stat().st_size == records  # the zeros are gone


def test_torn_record_before_the_zeros_is_still_reported(tmp_path: Path) -> None:
    w = open_wal(tmp_path)
    write_synced(w, 1, 40)
    last = tmp_path / segment_name(w._fd_seq)
    end = w._fd_length
    crash(w)
    with open(last, "r+b") as f:  # half a record was written over the zeros before the crash
        f.seek(end)
        f.write(b"\x57\x4c\x01\x00garbage")
    assert recovered(tmp_path, 40).torn_tail_truncated == [(last, end)]


def test_zero_filled_segment_that_never_got_a_record_is_dropped_quietly(tmp_path: Path) -> None:
    w = open_wal(tmp_path)
    write_synced(w, 1, 30)
    seq = w._fd_seq
    crash(w)
    # A crash right after the rename: the next segment exists and holds only zeros.
    (tmp_path / segment_name(seq + 1)).write_bytes(bytes(SEGMENT))
    assert recovered(tmp_path, 30, close=False).torn_tail_truncated == []
    assert not (tmp_path / segment_name(seq + 1)).exists()


def test_unfinished_preparation_is_never_taken_for_a_segment(tmp_path: Path) -> None:
    w = open_wal(tmp_path)
    write_synced(w, 1, 10)
    w.close()
    (tmp_path / PREPARED_NAME).write_bytes(b"\x57\x4c" + bytes(100))  # left by a crash mid-preparation
    w2 = open_wal(tmp_path)
    assert not (tmp_path / PREPARED_NAME).exists()
    write_synced(w2, 11, 20)
    w2.close()
    recovered(tmp_path, 20)


def test_full_disk_while_preparing_falls_back_to_appending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prealloc, "_pwrite", no_space)  # the preparer's writes only
    w = open_wal(tmp_path)
    write_synced(w, 1, 60)
    assert w._preparer is not None and w._preparer.failed is not None and w._preparer.prepared == 0
    assert not (tmp_path / PREPARED_NAME).exists()
    w.close()
    assert recovered(tmp_path, 60).torn_tail_truncated == []


def test_quiet_log_prepares_nothing(tmp_path: Path) -> None:
    w = WriteAheadLog(tmp_path, segment_bytes=SEGMENT, preallocate=True)  # the default threshold
    w.open()
    for i in range(1, 50):
        w.append_entries(3, [ent(i)])
        w.sync()
    assert w._preparer is not None and w._preparer.prepared == 0
    assert not (tmp_path / PREPARED_NAME).exists()
    w.close()


def test_log_of_large_syncs_keeps_appending(tmp_path: Path) -> None:
    """Zero-filling costs per byte and saves per sync: a log whose syncs average more than
    PREALLOCATE_MAX_SYNC_BYTES (batches of large payloads) never prepares a segment."""
    w = WriteAheadLog(tmp_path, segment_bytes=1 << 20, preallocate=True, prepare_after_syncs=2)
    w.open()
    big = bytes(range(256)) * 400  # 100 KiB an entry, one entry a sync
    for i in range(1, 12):
        w.append_entries(3, [(1, i, 0, big)])
        w.sync()
        assert w._preparer is not None
        w._preparer.wait(10)
    assert w._preparer.prepared == 0 and not (tmp_path / PREPARED_NAME).exists()
    w.close()
    assert [e.index for e in WriteAheadLog(tmp_path).open().groups[3].entries] == list(range(1, 12))
