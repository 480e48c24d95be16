"""Storage pieces of snapshots taken off the event loop and sent to followers:

- snapshot files carry the Raft metadata (the membership configuration) under the header's
  checksum; version-1 files are still read; a file written elsewhere is adopted atomically, and an
  unfinished one is removed at startup only (a forked child may be writing it meanwhile);
- the message store's sync in three steps (the IO on another thread), reads for a transfer
  (released records included, nothing reclaimed while held), and a store rebuilt from a leader's
  records (sparse offsets, the next offset past the last record) that reopens as it was written.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import pytest

from moorline.hashing import crc32c
from moorline.storage.ledger import SyncLedger, read_ledger
from moorline.storage.msgstore import HEADER_BYTES, META_FILE, MessageStore
from moorline.storage.snapshots import (
    PENDING_SUFFIX,
    SnapshotCorruption,
    SnapshotStore,
    read_snapshot_file,
    write_snapshot_file,
)


def test_meta_is_stored_checked_and_old_files_still_read(tmp_path: Path) -> None:
    s = SnapshotStore(tmp_path)
    path = s.save(1, 10, 2, b"state", meta=b"conf-bytes")
    saved = s.load_latest_full(1)
    assert saved is not None and (saved.index, saved.term, saved.meta, saved.data) == (10, 2, b"conf-bytes", b"state")
    assert s.loaded_meta(1) == b"conf-bytes" and s.load_latest(1) == (10, 2, b"state")
    raw = bytearray(path.read_bytes())
    raw[52 + 2] ^= 0x01  # a byte of the meta: covered by the header checksum
    path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotCorruption, match="header fails its checksum"):
        s.load_latest_full(1)
    # A version-1 file (no meta): magic | group | index | term | length | data_crc | header_crc | data
    v1 = tmp_path / "group-2" / "snap-00000000000000000007-00000000000000000001.snap"
    v1.parent.mkdir()
    pre = struct.pack("<8sqQQQI", b"MLSNAP01", 2, 7, 1, 4, crc32c(b"old!"))
    v1.write_bytes(pre + struct.pack("<I", crc32c(pre)) + b"old!")
    old = s.load_latest_full(2)
    assert old is not None and (old.index, old.meta, old.data) == (7, b"", b"old!")


def test_written_elsewhere_then_adopted_and_unfinished_ones_removed_only_at_startup(tmp_path: Path) -> None:
    s = SnapshotStore(tmp_path)
    s.save(3, 5, 1, b"five")
    pending = s.temp_path(3, "job")
    assert pending.name.endswith(PENDING_SUFFIX)
    size = write_snapshot_file(pending, 3, 9, 1, b"nine", b"m")
    s.save(3, 6, 1, b"six")  # another save meanwhile must not remove the one being written
    assert pending.exists()
    path = s.adopt(3, 9, 1, pending, size)
    assert not pending.exists() and read_snapshot_file(path, (3, 9, 1)).data == b"nine"
    assert [i for i, _, _ in s.list_snapshots(3)] == [6, 9]  # pruned to two
    leftover = s.temp_path(3, "killed")
    leftover.write_bytes(b"half a snapshot")
    s.latest(3)
    assert leftover.exists()
    assert s.load_latest_full(3) is not None  # startup
    assert not leftover.exists()


def framed(records: bytes) -> list[tuple[int, bytes]]:
    out, p = [], 0
    while p < len(records):
        length, offset = struct.unpack_from("<Iq", records, p + 8)
        out.append((offset, records[p + HEADER_BYTES:p + HEADER_BYTES + length]))
        p += HEADER_BYTES + length
    return out


def test_transfer_reads_include_released_records_and_a_hold_stops_reclaim(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "s", segment_bytes=256, cache_bytes=0)
    store.open()
    for i in range(40):
        store.append(i, f"record-{i:02d}".encode())
    store.release(range(0, 20))  # whole segments released
    store.hold_reclaim()
    assert store.reclaim() == 0
    got: list[tuple[int, bytes]] = []
    offset = 0
    while (plan := store.plan_read(offset, 30, 100)) is not None:
        assert plan.length <= 100 or plan.records == 1
        got += framed(MessageStore.read_plan(plan))
        offset = plan.next_offset
    assert got == [(i, f"record-{i:02d}".encode()) for i in range(30)]
    store.release_reclaim()
    assert store.reclaim() > 0
    plan = store.plan_read(0, 30, 1 << 20)
    assert plan is not None and framed(MessageStore.read_plan(plan))[0][0] > 0  # the released ones went
    store.close()


def test_a_store_rebuilt_from_a_leaders_records_reopens_as_written(tmp_path: Path) -> None:
    staged = tmp_path / "staging" / "store"
    store = MessageStore(staged, segment_bytes=200, cache_bytes=0)
    store.open()
    store.reset(100)  # the leader's low-water mark
    kept = [102, 103, 107, 130, 131, 150]
    for o in kept:
        store.append_received(o, f"m{o}".encode() * 3)
    with pytest.raises(ValueError, match="below the next offset"):
        store.append_received(120, b"going back")
    store.end_received(160)  # the snapshot's next offset: the last records were released at the leader
    store.sync()
    assert store.next_offset == 160
    live = tmp_path / "store" / "shard-0"
    live.parent.mkdir()
    staged.rename(live)
    store.relocate(live)
    store.append(160, b"after the install")  # the replica goes on appending at the new place
    assert store.get(107) == b"m107" * 3 and store.get(160) == b"after the install"
    store.sync()
    store.close()
    again = MessageStore(live, segment_bytes=200, cache_bytes=0)
    again.open(expected_next_offset=160)
    assert again.next_offset == 161
    assert [o for o in range(100, 161) if again.get(o) is not None] == [*kept, 160]
    again.close()


def test_sync_in_three_steps_with_the_io_on_another_thread(tmp_path: Path) -> None:
    ledger = SyncLedger(tmp_path / "ledger")
    store = MessageStore(tmp_path / "s", segment_bytes=256, cache_bytes=0, ledger=ledger)
    store.open()
    for i in range(30):
        store.append(i, b"x" * 20)
    job = store.begin_sync()
    assert job.meta == (0, 30) and job.dir_dirty and len(job.segments) > 1
    for i in range(30, 35):  # appends go on while the job runs
        store.append(i, b"y" * 20)
    t = threading.Thread(target=store.run_sync_job, args=(job,))
    t.start()
    t.join()
    store.finish_sync(job)
    low, sync_point, _ = struct.unpack("<qqI", (tmp_path / "s" / META_FILE).read_bytes())
    assert (low, sync_point) == (0, 30)  # the sync point of the job, not of what came after it
    for i in range(35, 60):  # more segments
        store.append(i, b"z" * 20)
    failed = store.begin_sync()
    store.abort_sync(failed)  # its IO failed: what it listed is synced by the next sync
    store.sync()
    low, sync_point, _ = struct.unpack("<qqI", (tmp_path / "s" / META_FILE).read_bytes())
    assert sync_point == 60
    synced = read_ledger(ledger.path)
    for path in store.segment_paths():
        assert synced.get(str(path)) == path.stat().st_size, f"{path.name} was never synced"
    store.close()
