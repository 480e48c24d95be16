"""Crash-harness style: after a "crash", every file in the ledger keeps its synced prefix, and of what
was written after it whatever a power loss leaves: a length anywhere up to what was written, and,
since a disk writes the pages of an unfinished write back in any order, holes where single pages
never arrived (zeros, now and then garbage) while later pages did. Then recover: synced data must
survive, nothing may be reported corrupt, and recovery must continue where the synced state says."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from moorline.storage.ledger import SyncLedger, read_ledger
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog

PAGE = 4096


def power_loss(ledger: Path, rng: random.Random, keep_size: bool = False, page: int = PAGE) -> dict[str, int]:
    """Keep each file's synced prefix; of its unsynced bytes keep a prefix of random length, in
    which each ``page`` (aligned in the file; only its part past the synced length) is lost with
    probability 1/3, and at least one whenever a later page survives: it reads as zeros, or (one
    loss in ten) as garbage. ``keep_size``: half the time the file keeps its size and the lost tail
    reads as zeros instead, as in a preallocated segment whose overwrites never reached the disk.
    Returns, per file, the holes made in written data with surviving written data after them."""
    holes: dict[str, int] = {}
    for file, synced in read_ledger(ledger).items():
        p = Path(file)
        if not p.exists():
            continue
        size = p.stat().st_size
        if size <= synced:
            continue
        reached = rng.randint(synced, size)
        slots = [(max(start, synced), min(start + page, reached))
                 for start in range(synced // page * page, reached, page)]
        lost = [i for i in range(len(slots)) if rng.random() < 1 / 3]
        if len(slots) >= 2 and not any(i < len(slots) - 1 for i in lost):
            lost.append(rng.randrange(len(slots) - 1))  # a hole with a surviving page after it
        written = p.read_bytes()
        data = [any(written[lo:hi]) for lo, hi in slots]  # not preallocated zeros
        kept = [i for i in range(len(slots)) if i not in lost and data[i]]
        inner = sum(1 for i in set(lost) if data[i] and kept and i < kept[-1])
        if inner:
            holes[file] = inner
        with open(p, "r+b") as f:
            for i in lost:
                lo, hi = slots[i]
                f.seek(lo)
                f.write(rng.randbytes(hi - lo) if rng.random() < 0.1 else bytes(hi - lo))
            if keep_size and rng.random() < 0.5:
                f.seek(reached)
                f.write(bytes(size - reached))
            else:
                f.truncate(reached)
    return holes


def payload(i: int) -> bytes:
    return f"msg{i}".encode().ljust(300, b".")


@pytest.mark.parametrize("preallocate", [False, True], ids=["appending", "preallocated"])
@pytest.mark.parametrize("seed", range(12))
def test_node_shaped_power_loss(tmp_path: Path, seed: int, preallocate: bool) -> None:
    rng = random.Random(seed)
    ledger_path = tmp_path / "ledger.jsonl"
    ledger = SyncLedger(ledger_path)
    # Preallocated: the next segment is zero-filled after 3 syncs, and waited for (threads would
    # make the run depend on timing), so most segments are prepared ones, cut when left.
    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=4 * PAGE, ledger=ledger, preallocate=preallocate,
                        prepare_after_syncs=3)
    wal.open()
    store = MessageStore(
        tmp_path / "store" / "shard-0", segment_bytes=6 * PAGE, ledger=ledger, write_buffer_bytes=1024
    )
    store.open()
    snaps = SnapshotStore(tmp_path / "snap", ledger=ledger)

    # Node-shaped loop: an entry per message; apply writes the store; snapshot every 40 entries.
    acked = 0  # entries whose sync returned
    snap_next_offset = 0
    total = rng.randint(100, 200)
    for i in range(1, total + 1):
        wal.append_entries(0, [(1, i, 0, payload(i))])
        wal.set_hard_state(0, 1, b"", i - 1)
        if rng.random() < 0.5 or i == total:
            wal.sync()
            acked = i
            if wal._preparer is not None:
                wal._preparer.wait(10)
        store.append(i - 1, payload(i) * 2)  # apply
        if i % 40 == 0 and acked == i:
            store.sync()
            snaps.save(0, i, 1, str(store.next_offset).encode())
            snap_next_offset = store.next_offset
            wal.mark_snapshot(0, i, 1)
    # Unsynced tail: one last group commit whose write reached the file but whose fdatasync never
    # returned (several pages of it), and store writes without sync.
    for i in range(total + 1, total + rng.randint(2, 60)):
        wal.append_entries(0, [(1, i, 0, payload(i))])
        store.append(i - 1, payload(i) * 2)
    store._flush()  # written to the page cache, not synced
    if wal._fd is not None and wal._pending:  # written after the segment's records, not synced
        os.pwrite(wal._fd, bytes(wal._pending[0][1]), wal._fd_length)
    if preallocate:
        assert wal._preparer is not None and wal._preparer.prepared >= 2  # the test reached the feature
    holes = power_loss(ledger_path, rng, keep_size=preallocate)

    # Recovery, as the node does it.
    rec = WriteAheadLog(tmp_path / "wal", segment_bytes=4 * PAGE).open()
    assert rec.corrupted == []
    g = rec.groups[0]
    loaded = SnapshotStore(tmp_path / "snap").load_latest(0)
    snap_index = loaded[0] if loaded else 0
    assert g.snapshot_index == snap_index
    entries = [e.index for e in g.entries]
    assert entries[: acked - snap_index] == list(range(snap_index + 1, acked + 1))  # nothing acked lost
    assert entries == list(range(snap_index + 1, snap_index + 1 + len(entries)))  # a prefix, no gap
    assert all(e.data == payload(e.index) for e in g.entries)
    store2 = MessageStore(tmp_path / "store" / "shard-0", segment_bytes=6 * PAGE)
    # The store's own sync point suffices; the snapshot's next offset may be passed as well.
    store2.open(expected_next_offset=snap_next_offset if seed % 2 else None)
    assert store2.next_offset >= snap_next_offset
    store2.truncate_from(snap_next_offset)
    for e in g.entries:  # re-apply
        store2.append(e.index - 1, e.data * 2)
    assert all(store2.get(o) == payload(o + 1) * 2 for o in range(store2.next_offset))
    assert store2.next_offset >= acked
    wal_holes = [f for f in holes if "/wal/" in f]
    if wal_holes:  # a hole in the last write, pages of it after the hole: cut as a torn tail
        assert [str(t.path) for t in rec.torn_tails] == wal_holes


def test_the_power_loss_model_leaves_holes_before_surviving_pages(tmp_path: Path) -> None:
    written = bytes(range(1, 251)) * 100  # no zero byte anywhere
    ledger_path = tmp_path / "ledger.jsonl"
    f = tmp_path / "file"
    made = 0
    for seed in range(20):
        f.write_bytes(written)
        ledger = SyncLedger(ledger_path)
        ledger.forget(f)
        ledger.record(f, 1000)
        holes = power_loss(ledger_path, random.Random(seed))
        got = f.read_bytes()
        assert got[:1000] == written[:1000] and 1000 <= len(got) <= len(written)
        if holes:
            made += 1
            hole = next(i for i in range(1000, len(got)) if got[i] != written[i])  # a page that never arrived
            later = (hole // PAGE + 1) * PAGE
            assert any(got[q : q + PAGE] == written[q : min(q + PAGE, len(got))] for q in range(later, len(got), PAGE))
    assert made >= 10


def test_a_store_cut_to_zero_and_written_again_records_its_new_files(tmp_path: Path) -> None:
    """A store truncated to offset 0 (a node that dropped its copy of a shard writes a new one:
    node/boot.py leave_group) writes segment files under the names its old ones had. Each must be
    recorded in the ledger as it syncs again: found by sim --cluster --learners none seed 11 (the
    store skipped recording a new file no longer than the old one's synced length, so a power cut
    left a file the store's sync point said was whole: "invalid record before the sync point")."""
    ledger_path = tmp_path / "ledger.jsonl"
    ledger = SyncLedger(ledger_path)

    def sync_as_a_snapshot_does(store: MessageStore) -> None:
        job = store.begin_sync()
        store.run_sync_job(job)
        store.finish_sync(job)

    store = MessageStore(tmp_path / "s", segment_bytes=4000, ledger=ledger)
    store.open()
    for i in range(73):
        store.append_many([(i, b"x" * 100, None)])
        if i % 10 == 0:
            sync_as_a_snapshot_does(store)
    sync_as_a_snapshot_does(store)
    store.truncate_from(0)
    for i in range(89):
        store.append_many([(i, b"y" * 100, None)])
        if i % 7 == 0:
            sync_as_a_snapshot_does(store)
    sync_as_a_snapshot_does(store)
    store.close()
    for name, length in read_ledger(ledger_path).items():  # power loss: each file to its synced length
        if os.path.exists(name) and os.path.getsize(name) > length:
            os.truncate(name, length)
    again = MessageStore(tmp_path / "s", segment_bytes=4000, ledger=ledger)
    again.open()
    assert again.next_offset == 89
    assert again.get(0) == b"y" * 100 and again.get(88) == b"y" * 100
    again.close()
