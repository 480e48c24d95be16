"""Crash-harness style: after a "crash", cut every file in the ledger back to its synced length plus
a random part of what was written after it, then recover. Synced data must survive, nothing may be
reported corrupt, and recovery must continue where the synced state says."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from moorline.storage.ledger import SyncLedger, read_ledger
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog


def power_loss(ledger: Path, rng: random.Random, keep_size: bool = False) -> None:
    """Keep each file's synced prefix plus 0..all of its unsynced bytes (never more than was written).
    ``keep_size``: half the time the file keeps its size and the lost bytes read as zeros instead,
    as in a preallocated segment whose overwrites never reached the disk."""
    for file, synced in read_ledger(ledger).items():
        p = Path(file)
        if not p.exists():
            continue
        size = p.stat().st_size
        if size > synced:
            keep = synced + rng.randint(0, min(size - synced, 64))
            if keep_size and rng.random() < 0.5:
                with open(p, "r+b") as f:
                    f.seek(keep)
                    f.write(bytes(size - keep))
            else:
                os.truncate(p, keep)


@pytest.mark.parametrize("preallocate", [False, True], ids=["appending", "preallocated"])
@pytest.mark.parametrize("seed", range(12))
def test_node_shaped_power_loss(tmp_path: Path, seed: int, preallocate: bool) -> None:
    rng = random.Random(seed)
    ledger_path = tmp_path / "ledger.jsonl"
    ledger = SyncLedger(ledger_path)
    # Preallocated: the next segment is zero-filled after 3 syncs, and waited for (threads would
    # make the run depend on timing), so most segments are prepared ones, cut when left.
    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=2048, ledger=ledger, preallocate=preallocate,
                        prepare_after_syncs=3)
    wal.open()
    store = MessageStore(
        tmp_path / "store" / "shard-0", segment_bytes=700, ledger=ledger, write_buffer_bytes=64
    )
    store.open()
    snaps = SnapshotStore(tmp_path / "snap", ledger=ledger)

    # Node-shaped loop: an entry per message; apply writes the store; snapshot every 40 entries.
    acked = 0  # entries whose sync returned
    snap_next_offset = 0
    total = rng.randint(60, 160)
    for i in range(1, total + 1):
        wal.append_entries(0, [(1, i, 0, f"msg{i}".encode())])
        wal.set_hard_state(0, 1, b"", i - 1)
        if rng.random() < 0.5 or i == total:
            wal.sync()
            acked = i
            if wal._preparer is not None:
                wal._preparer.wait(10)
        store.append(i - 1, f"msg{i}".encode() * 5)  # apply
        if i % 40 == 0 and acked == i:
            store.sync()
            snaps.save(0, i, 1, str(store.next_offset).encode())
            snap_next_offset = store.next_offset
            wal.mark_snapshot(0, i, 1)
    # Unsynced tail: more entries whose sync never returns, and store writes without sync.
    for i in range(total + 1, total + rng.randint(1, 20)):
        wal.append_entries(0, [(1, i, 0, f"msg{i}".encode())])
        store.append(i - 1, f"msg{i}".encode() * 5)
    store._flush()  # written to the page cache, not synced
    if wal._fd is not None and wal._pending:  # written after the segment's records, not synced
        os.pwrite(wal._fd, bytes(wal._pending[0][1]), wal._fd_length)
    if preallocate:
        assert wal._preparer is not None and wal._preparer.prepared >= 2  # the test reached the feature
    power_loss(ledger_path, rng, keep_size=preallocate)

    # Recovery, as the node does it.
    rec = WriteAheadLog(tmp_path / "wal", segment_bytes=2048).open()
    assert rec.corrupted == []
    g = rec.groups[0]
    loaded = SnapshotStore(tmp_path / "snap").load_latest(0)
    snap_index = loaded[0] if loaded else 0
    assert g.snapshot_index == snap_index
    entries = [e.index for e in g.entries]
    assert entries[: acked - snap_index] == list(range(snap_index + 1, acked + 1))  # nothing acked lost
    store2 = MessageStore(tmp_path / "store" / "shard-0", segment_bytes=700)
    # The store's own sync point suffices; the snapshot's next offset may be passed as well.
    store2.open(expected_next_offset=snap_next_offset if seed % 2 else None)
    assert store2.next_offset >= snap_next_offset
    store2.truncate_from(snap_next_offset)
    for e in g.entries:  # re-apply
        store2.append(e.index - 1, e.data * 5)
    assert all(store2.get(o) == f"msg{o + 1}".encode() * 5 for o in range(store2.next_offset))
    assert store2.next_offset >= acked
