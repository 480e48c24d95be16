"""MessageStore: append/get/scan, release and low-water, reclaim and copy-forward, recovery."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moorline.invariant import InvariantViolation
from moorline.storage.ledger import SyncLedger, read_ledger
from moorline.storage.msgstore import (
    HEADER_BYTES,
    WRITEV_RECORD_BYTES,
    MessageStore,
    StoreCorruption,
    segment_name,
)


def msg(offset: int, size: int = 30) -> bytes:
    return (f"m{offset}-".encode() * size)[:size]


def fill(store: MessageStore, count: int, size: int = 30) -> None:
    for _ in range(count):
        o = store.next_offset
        store.append(o, msg(o, size))


def test_append_get_scan(tmp_path: Path) -> None:
    s = MessageStore(tmp_path, segment_bytes=1024, cache_bytes=0)
    s.open()
    assert (s.next_offset, s.low_water) == (0, 0)
    fill(s, 100)
    assert s.next_offset == 100
    assert s.get(0) == msg(0) and s.get(99) == msg(99)
    assert s.get(100) is None and s.get(-1) is None
    got = s.scan(10, max_count=5, max_bytes=1 << 20)
    assert got == [(i, msg(i)) for i in range(10, 15)]
    assert len(s.scan(0, 1000, max_bytes=95)) == 3  # 3 x 30 bytes fit, the 4th would not
    assert len(s.scan(0, 1000, max_bytes=1)) == 1  # always at least one
    assert s.scan(100, 10, 1000) == []
    assert len(s.segment_paths()) > 1
    with pytest.raises(InvariantViolation):
        s.append(5, b"x")  # offsets are dense and in order
    s.sync()
    s.close()

    s2 = MessageStore(tmp_path, segment_bytes=1024, cache_bytes=0)
    s2.open()
    assert s2.next_offset == 100 and s2.low_water == 0
    assert [o for o, _ in s2.scan(0, 1000, 1 << 20)] == list(range(100))
    assert all(s2.get(i) == msg(i) for i in range(100))
    s2.close()


def test_cache_is_bounded_and_reads_fall_back_to_disk(tmp_path: Path) -> None:
    s = MessageStore(tmp_path, cache_bytes=300, write_buffer_bytes=1 << 20)
    s.open()
    fill(s, 50, size=30)
    assert s._cache_used <= 300 and len(s._cache) == 10
    # Records not in the cache, not yet flushed (still in the write buffer), and flushed.
    assert s.get(0) == msg(0)
    s.sync()
    assert s.get(1) == msg(1) and s.get(49) == msg(49)


def test_release_low_water_and_scan_skips(tmp_path: Path) -> None:
    s = MessageStore(tmp_path, segment_bytes=1024)
    s.open()
    fill(s, 40)
    s.release([5, 7])
    assert s.get(5) is None and s.get(6) == msg(6)
    assert s.low_water == 8
    assert [o for o, _ in s.scan(4, 5, 1 << 20)] == [4, 6, 8, 9, 10]
    s.release([3])  # below the mark: the mark does not move back
    assert s.low_water == 8
    s.release_below(20)
    assert s.low_water == 20 and s.get(19) is None and s.get(20) == msg(20)
    s.release_below(10)
    assert s.low_water == 20
    s.release([20, 20, 20])  # idempotent
    assert s.low_water == 21
    with pytest.raises(InvariantViolation):
        s.release([40])


def test_reclaim_deletes_empty_segments_and_copies_forward(tmp_path: Path) -> None:
    ledger = SyncLedger(tmp_path / "ledger.jsonl")
    d = tmp_path / "shard-0"
    s = MessageStore(d, segment_bytes=1000, ledger=ledger, cache_bytes=0)
    s.open()
    fill(s, 100)  # 50-byte frames: 20 per segment
    assert len(s.segment_paths()) == 5
    first_two = s.segment_paths()[:2]
    s.release(range(0, 40))  # two whole segments
    s.release([o for o in range(40, 60) if o not in (45, 52)])  # sparse survivors
    size_before = s.size_bytes()
    reclaimed = s.reclaim()
    assert reclaimed == size_before - s.size_bytes() > 0
    assert all(not p.exists() for p in first_two)
    assert s.get(45) == msg(45) and s.get(52) == msg(52) and s.get(46) is None
    compacted = d / segment_name(40)
    assert compacted.stat().st_size == 2 * (HEADER_BYTES + 30)
    assert read_ledger(ledger.path)[str(compacted)] == compacted.stat().st_size
    assert [o for o, _ in s.scan(0, 10, 1 << 20)] == [45, 52, 60, 61, 62, 63, 64, 65, 66, 67]
    assert s.low_water == 60
    assert s.reclaim() == 0  # nothing more to do
    s.sync()
    s.close()

    s2 = MessageStore(d, segment_bytes=1000, cache_bytes=0)
    s2.open()
    assert s2.low_water == 60 and s2.next_offset == 100
    assert s2.get(45) == msg(45) and s2.get(52) == msg(52) and s2.get(46) is None and s2.get(10) is None
    assert [o for o, _ in s2.scan(40, 3, 1 << 20)] == [45, 52, 60]
    fill(s2, 5)
    assert s2.get(104) == msg(104)


def test_low_water_from_gaps_without_persisted_mark(tmp_path: Path) -> None:
    s = MessageStore(tmp_path, segment_bytes=1000, cache_bytes=0)
    s.open()
    fill(s, 60)
    s.release([o for o in range(0, 20) if o != 7])
    s.reclaim()  # copy-forward leaves offset 7 alone in its segment
    s.close()  # no sync: the low-water file is not written
    s2 = MessageStore(tmp_path, segment_bytes=1000)
    s2.open()
    # Every offset from 20 up is present; 8..19 are gone, so the mark is at least 20.
    assert s2.low_water == 20 and s2.get(7) == msg(7)


def test_truncate_from(tmp_path: Path) -> None:
    s = MessageStore(tmp_path, segment_bytes=1000, cache_bytes=1 << 20)
    s.open()
    fill(s, 70)
    s.truncate_from(25)
    assert s.next_offset == 25 and s.get(25) is None and s.get(24) == msg(24)
    assert [p.name for p in s.segment_paths()] == [segment_name(0), segment_name(20)]
    s.append(25, b"again")
    fill(s, 30)
    assert s.get(25) == b"again" and s.next_offset == 56
    s.truncate_from(20)  # exactly at a segment boundary
    fill(s, 3)
    s.sync()
    s.close()
    s2 = MessageStore(tmp_path, segment_bytes=1000)
    s2.open()
    assert s2.next_offset == 23
    assert [o for o, _ in s2.scan(0, 100, 1 << 20)] == list(range(23))
    s2.truncate_from(0)
    assert s2.next_offset == 0 and s2.scan(0, 10, 1000) == []
    fill(s2, 2)
    s2.sync()
    s2.close()
    s3 = MessageStore(tmp_path)
    s3.open()
    assert s3.next_offset == 2 and s3.get(1) == msg(1)


def test_reset_for_installed_snapshot(tmp_path: Path) -> None:
    s = MessageStore(tmp_path)
    s.open()
    fill(s, 10)
    s.reset(500)
    assert (s.next_offset, s.low_water, s.get(3)) == (500, 500, None)
    s.close()
    s2 = MessageStore(tmp_path)
    s2.open()
    assert (s2.next_offset, s2.low_water) == (500, 500)
    s2.append(500, b"x")


def _store_with(d: Path, count: int, synced: int) -> list[int]:
    """``count`` records in one segment, the first ``synced`` of them synced, the rest only written."""
    s = MessageStore(d, segment_bytes=1 << 20)
    s.open()
    fill(s, synced)
    s.sync()
    fill(s, count - synced)
    positions = [s._segments[0].positions[i] for i in range(count)]
    s.close()  # writes the buffer, no fsync, sync point stays at `synced`
    return positions


def test_torn_tail_every_byte(tmp_path: Path) -> None:
    src = tmp_path / "src"
    positions = _store_with(src, 4, synced=3)
    seg = src / segment_name(0)
    full = seg.read_bytes()
    for cut in range(positions[-1], len(full)):
        d = tmp_path / f"c{cut}"
        shutil.copytree(src, d)
        (d / segment_name(0)).write_bytes(full[:cut] + b"\x4d\x53\x00")
        s = MessageStore(d)
        s.open()
        assert s.next_offset == 3 and s.get(2) == msg(2)
        assert (d / segment_name(0)).stat().st_size == positions[-1]
        s.append(3, b"new")
        s.sync()
        s.close()
        shutil.rmtree(d)


def test_bit_flip_in_synced_records_is_corruption(tmp_path: Path) -> None:
    positions = _store_with(tmp_path, 5, synced=5)
    seg = tmp_path / segment_name(0)
    raw = bytearray(seg.read_bytes())
    raw[positions[2] + HEADER_BYTES + 3] ^= 0x04
    seg.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruption) as err:
        MessageStore(tmp_path).open()
    assert (err.value.path, err.value.offset) == (seg, positions[2])
    assert seg.stat().st_size == len(raw)  # never truncated
    # Even the last synced record: damage there is not a torn tail.
    raw[positions[2] + HEADER_BYTES + 3] ^= 0x04
    raw[positions[4] + HEADER_BYTES + 1] ^= 0x04
    seg.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruption) as err:
        MessageStore(tmp_path).open()
    assert err.value.offset == positions[4]


def test_sync_point_separates_synced_from_unsynced(tmp_path: Path) -> None:
    positions = _store_with(tmp_path / "a", 6, synced=3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    # Damage record 4 (after the sync point 3): an unsynced tail, cut even though record 5 after
    # it is valid (unsynced pages may reach the disk out of order).
    seg = tmp_path / "a" / segment_name(0)
    raw = bytearray(seg.read_bytes())
    raw[positions[4] + HEADER_BYTES] ^= 0x01
    seg.write_bytes(bytes(raw))
    s = MessageStore(tmp_path / "a")
    s.open()
    assert s.next_offset == 4
    # Records 0..2 were synced: losing record 1 is corruption, even with nothing valid after.
    seg = tmp_path / "b" / segment_name(0)
    seg.write_bytes(seg.read_bytes()[: positions[1] + 5])
    with pytest.raises(StoreCorruption):
        MessageStore(tmp_path / "b").open()
    # The snapshot's next offset raises the bar when it is higher than the store's own sync point.
    seg = tmp_path / "c" / segment_name(0)
    seg.write_bytes(seg.read_bytes()[: positions[4] + 5])
    MessageStore(tmp_path / "c").open()  # record 4 was never synced: cut
    with pytest.raises(StoreCorruption):
        MessageStore(tmp_path / "c").open(expected_next_offset=5)
    with pytest.raises(StoreCorruption):
        MessageStore(tmp_path / "d").open(expected_next_offset=3)  # store missing entirely


def test_truncate_below_sync_point_then_crash(tmp_path: Path) -> None:
    s = MessageStore(tmp_path)
    s.open()
    fill(s, 10)
    s.sync()  # sync point 10
    s.truncate_from(4)  # recovery re-applies from 4: the sync point must come down first
    s.append(4, b"re-applied")
    s._flush()
    seg = tmp_path / segment_name(0)
    seg.write_bytes(seg.read_bytes()[:-3])  # the unsynced re-applied record is torn
    s2 = MessageStore(tmp_path)
    s2.open()
    assert s2.next_offset == 4 and s2.get(3) == msg(3)


def test_ledger_tracks_store_syncs(tmp_path: Path) -> None:
    ledger = SyncLedger(tmp_path / "l.jsonl")
    d = tmp_path / "s"
    s = MessageStore(d, segment_bytes=500, ledger=ledger)
    s.open()
    fill(s, 30)
    s.sync()
    lengths = read_ledger(ledger.path)
    for p in d.glob("seg-*.dat"):
        assert lengths[str(p)] == p.stat().st_size
    s.release_below(5)
    s.sync()
    assert read_ledger(ledger.path)[str(d / "store.meta")] == 20


def test_large_records_are_written_from_their_own_buffer_in_order(tmp_path: Path) -> None:
    """Records of WRITEV_RECORD_BYTES or more go to the file at once (writev, no copy into the
    buffer), after whatever small records were buffered before them; reads, scans and recovery
    see one dense sequence either way."""
    s = MessageStore(tmp_path, segment_bytes=1 << 20, cache_bytes=0)
    s.open()
    sizes = [30, 30, WRITEV_RECORD_BYTES, 10, WRITEV_RECORD_BYTES * 3, 20, 25, WRITEV_RECORD_BYTES + 1, 30]
    for size in sizes:
        s.append(s.next_offset, msg(s.next_offset, size))
    # Before any flush: small records after the last large one are still buffered, the rest on disk.
    on_disk = (tmp_path / segment_name(0)).stat().st_size
    assert on_disk == sum(HEADER_BYTES + n for n in sizes[:8])
    assert all(s.get(i) == msg(i, n) for i, n in enumerate(sizes))
    assert [o for o, _ in s.scan(0, 100, 1 << 24)] == list(range(len(sizes)))
    s.sync()
    s.close()
    s2 = MessageStore(tmp_path, segment_bytes=1 << 20, cache_bytes=0)
    s2.open()
    assert s2.next_offset == len(sizes)
    assert all(s2.get(i) == msg(i, n) for i, n in enumerate(sizes))
    s2.close()


def test_one_append_many_across_segments_indexes_every_record(tmp_path: Path) -> None:
    """append_many indexes a call's records together, per segment: a call whose records roll over
    into new segments must leave the same index as single appends (reads, scans, released counts,
    and what recovery rebuilds from the files)."""
    many, single = tmp_path / "many", tmp_path / "single"
    stores = [MessageStore(d, segment_bytes=400, cache_bytes=0) for d in (many, single)]
    for s in stores:
        s.open()
    sizes = [30, 200, 10, 150, 150, 30, 300, 5, 60, 60, 60, 60]
    stores[0].append(0, msg(0))
    stores[0].append_many([(1 + i, msg(1 + i, n), None) for i, n in enumerate(sizes)])
    stores[0].append_many([(1 + len(sizes), msg(1 + len(sizes)), None)])
    for o, n in enumerate([30, *sizes, 30]):
        stores[1].append(o, msg(o, n))
    a, b = stores
    assert [(seg.first_offset, list(seg.offsets), list(seg.positions), list(seg.lengths), seg.kept_count,
             seg.kept_bytes, seg.size) for seg in a._segments] == [
        (seg.first_offset, list(seg.offsets), list(seg.positions), list(seg.lengths), seg.kept_count,
         seg.kept_bytes, seg.size) for seg in b._segments]
    assert len(a._segments) > 3
    assert a.scan(0, 100, 1 << 20) == b.scan(0, 100, 1 << 20) == [
        (o, msg(o, n)) for o, n in enumerate([30, *sizes, 30])]
    a.release([3, 4])
    assert a.get(3) is None and a.get(5) == msg(5, 150)
    a.sync()
    a.close()
    b.close()
    again = MessageStore(many, segment_bytes=400, cache_bytes=0)
    again.open()
    assert again.scan(0, 100, 1 << 20) == [(o, msg(o, n)) for o, n in enumerate([30, *sizes, 30])]
    again.close()


def test_a_page_hole_after_the_sync_point_is_cut_before_one_is_corruption(tmp_path: Path) -> None:
    """The store needs no sync batches: ``store.meta`` names its last sync point, so a 4 KiB page of
    unsynced records that never reached the disk, while later pages did, is cut with everything
    after it (the WAL re-applies those records); the same hole before the sync point is corruption."""
    page = 4096
    for where in ("unsynced", "synced"):
        d = tmp_path / where
        positions = _store_with(d, 500, synced=200)
        seg = d / segment_name(0)
        at = positions[300] if where == "unsynced" else positions[20]
        hole = (at // page + 1) * page
        assert hole + page < seg.stat().st_size
        with open(seg, "r+b") as f:
            f.seek(hole)
            f.write(bytes(page))
        first = max(i for i, p in enumerate(positions) if p <= hole)
        s = MessageStore(d)
        if where == "unsynced":
            s.open()
            assert s.next_offset == first and all(s.get(o) == msg(o) for o in range(first))
            assert seg.stat().st_size == positions[first]
        else:
            with pytest.raises(StoreCorruption) as err:
                s.open()
            assert (err.value.path, err.value.offset) == (seg, positions[first])


def test_damage_found_by_a_read_is_reported_to_the_owner_not_raised_into_the_reader(tmp_path: Path) -> None:
    positions = _store_with(tmp_path, 40, synced=40)
    s = MessageStore(tmp_path, segment_bytes=1 << 20, cache_bytes=0)
    s.open()
    seg = tmp_path / segment_name(0)
    with open(seg, "r+b") as f:  # bit rot while the store is open
        f.seek(positions[7] + HEADER_BYTES + 2)
        f.write(b"!")
    with pytest.raises(StoreCorruption):  # nobody listening: raised, as before
        s.get(7)
    heard: list[StoreCorruption] = []
    s.on_corruption = heard.append
    assert s.get(6) == msg(6) and s.get(7) is None
    assert s.scan(0, 100, 1 << 20) == [(o, msg(o)) for o in range(7)]  # stops before the damage
    assert [(e.path, e.offset) for e in heard] == [(seg, positions[7])] * 2
    assert s.corruption is not None and s.corruption.offset == positions[7]
    s.release(range(0, 40))
    assert s.reclaim() == 0 and seg.exists()  # a damaged store deletes and rewrites nothing
    s.close()


def test_a_store_that_fails_to_open_is_left_closed_and_empty(tmp_path: Path) -> None:
    positions = _store_with(tmp_path, 20, synced=20)
    seg = tmp_path / segment_name(0)
    raw = bytearray(seg.read_bytes())
    raw[positions[5] + HEADER_BYTES] ^= 0x01
    seg.write_bytes(bytes(raw))
    s = MessageStore(tmp_path)
    with pytest.raises(StoreCorruption) as err:
        s.open()
    assert s.corruption is err.value
    assert s.next_offset == 0 and s.get(3) is None and s.segment_paths() == []
    assert s.reclaim() == 0
    s.close()
    assert seg.read_bytes() == bytes(raw)  # untouched


def test_copy_forward_of_a_damaged_survivor_keeps_the_segment(tmp_path: Path) -> None:
    s = MessageStore(tmp_path, segment_bytes=600, cache_bytes=0)
    s.open()
    fill(s, 60)
    s.sync()
    first = s._segments[0]
    assert len(s._segments) > 2
    s.release([o for o in first.offsets if o != first.offsets[3]])  # one survivor: copied forward
    with open(first.path, "r+b") as f:
        f.seek(first.positions[3] + HEADER_BYTES)
        f.write(b"?")
    heard: list[StoreCorruption] = []
    s.on_corruption = heard.append
    before = first.path.read_bytes()
    s.reclaim()
    assert len(heard) == 1 and first.path.read_bytes() == before and s._segments[0] is first
    s.close()


def test_relocate_records_the_moved_files_synced_lengths_in_the_ledger(tmp_path: Path) -> None:
    """An installed store's files take the names of the replica's old ones (snapshot_install
    moves the old directory aside, the staged one into its place): the crash harness's ledger must
    hold the new files' synced lengths, or a crash cuts synced records to the old files' lengths."""
    ledger = SyncLedger(tmp_path / "ledger.jsonl")
    live = tmp_path / "store" / "shard-0"
    old = MessageStore(live, segment_bytes=1000, ledger=ledger, cache_bytes=0)
    old.open()
    fill(old, 10)  # seg 0 synced at 500 bytes
    old.sync()
    old.close()
    staged = tmp_path / "install" / "shard-0-x" / "store"
    new = MessageStore(staged, segment_bytes=1000, ledger=ledger, cache_bytes=0)
    new.open()
    fill(new, 50)  # seg 0 (1000 bytes), seg 20, seg 40
    new.sync()
    live.rename(tmp_path / "old-store")
    staged.rename(live)
    new.relocate(live)
    lengths = read_ledger(ledger.path)
    files = [*new.segment_paths(), live / "store.meta"]
    assert len(files) == 4
    for path in files:
        assert lengths.get(str(path)) == path.stat().st_size, path.name
    fill(new, 1)
    new.sync()  # later syncs record under the new names too
    assert read_ledger(ledger.path)[str(new.segment_paths()[-1])] == new.segment_paths()[-1].stat().st_size
    new.close()


def test_a_torn_first_segment_above_the_sync_point_is_cut_when_every_segment_below_was_reclaimed(
        tmp_path: Path) -> None:
    """The sync point (store.meta) says 10; records 10.. were written, never synced; everything
    below a later segment's first offset was released and its segments reclaimed (deleted). A
    crash tears that segment, now the first: its records are all above the sync point (its name
    says so), an unsynced tail the WAL re-applies, not corruption. (sim --cluster seed 40167: n2's
    shard 1 store refused to open, and the node did not start.)"""
    s = MessageStore(tmp_path, segment_bytes=256, cache_bytes=0)
    s.open()
    fill(s, 10)
    s.sync()  # sync point 10
    fill(s, 40)
    firsts = [seg.first_offset for seg in s._segments]
    keep_from = next(f for f in firsts if f > 10)
    assert keep_from != firsts[-1]
    s.release_below(keep_from)
    s.reclaim()
    assert s._segments[0].first_offset == keep_from
    s.close()  # writes the buffer, no fsync: the sync point stays 10
    seg = tmp_path / segment_name(keep_from)
    seg.write_bytes(seg.read_bytes()[:3])  # torn: a header's first bytes
    s2 = MessageStore(tmp_path, segment_bytes=256, cache_bytes=0)
    s2.open()
    assert s2.next_offset == keep_from and s2.get(keep_from) is None
    assert [p.name for p in s2.segment_paths()] == [segment_name(keep_from)]
    s2.truncate_from(10)  # recovery re-applies from the snapshot's next offset
    fill(s2, 5)
    s2.sync()
    assert s2.get(12) == msg(12)
    s2.close()
    # The same damage in a segment starting below the sync point is synced data lost.
    d = tmp_path / "below"
    s3 = MessageStore(d, segment_bytes=256, cache_bytes=0)
    s3.open()
    fill(s3, 30)
    s3.sync()
    first = s3._segments[1].first_offset
    s3.close()
    seg = d / segment_name(first)
    seg.write_bytes(seg.read_bytes()[:3])
    with pytest.raises(StoreCorruption):
        MessageStore(d, segment_bytes=256, cache_bytes=0).open()
