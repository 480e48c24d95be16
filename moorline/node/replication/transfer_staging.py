"""The follower's side of a snapshot transfer, on the node's executor threads (one call of a
transfer at a time): the staging directory opened, each chunk checked and written (the snapshot
file, then the framed store records), and everything received made durable, checked against the
offer and decoded into a ``snapshot_install.StagedInstall`` (snapshot_transfer.py runs these)."""

from __future__ import annotations

import asyncio
import os
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c as _crc32c_module

from moorline.broker.shard import ShardState
from moorline.hashing import crc32c
from moorline.node.replication import snapshot_install
from moorline.storage.fsutil import ensure_dir, fsync_dir, write_all
from moorline.storage.msgstore import HEADER_BYTES as RECORD_HEADER_BYTES
from moorline.storage.msgstore import MAGIC as RECORD_MAGIC
from moorline.storage.msgstore import MAX_RECORD_BYTES, MessageStore
from moorline.storage.snapshots import read_snapshot_file

if TYPE_CHECKING:
    from moorline.node.replication.shard_host import ShardHost
    from moorline.node.replication.snapshot_transfer import Chunk, Done, Offer

PART_STATE = 0  # chunk of the snapshot file
PART_RECORDS = 1  # chunk of framed store records
_RECORD_HEADER = struct.Struct("<HHIIq")
_crc = _crc32c_module.crc32c  # takes any buffer (no copy of a record to check it)


@dataclass(eq=False)
class Incoming:
    """One snapshot transfer this node receives."""

    offer: Offer
    peer: str
    host: ShardHost
    directory: Path
    queue: asyncio.Queue[Chunk | Done | None]
    next_seq: int = 1
    task: asyncio.Task[None] | None = None
    handed: bool = False  # to the core: the install owns the staging directory from then on
    # Written only by the executor's calls of this transfer, one at a time.
    state_fd: int | None = None
    state_written: int = 0
    store: MessageStore | None = None
    received: array[int] = field(default_factory=lambda: array("q"))  # offsets of the records received


def open_staging(t: Incoming) -> None:
    directory = t.directory
    ensure_dir(directory.parent)
    if directory.exists():
        snapshot_install.discard_staging(directory)
    directory.mkdir()
    t.state_fd = os.open(directory / snapshot_install.STATE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    # The node's ledger of synced lengths (a test harness's, else None) follows the received store
    # into the live directory (``relocate``): a crash after the install cuts its files by their own lengths.
    store = MessageStore(directory / snapshot_install.STORE_DIR, segment_bytes=t.host.store.segment_bytes,
                         ledger=t.host.store.ledger, cache_bytes=0)
    store.open()
    store.reset(t.offer.low_water)
    t.store = store


def write_chunk(t: Incoming, chunk: Chunk) -> None:
    if crc32c(chunk.data) != chunk.crc:
        raise ValueError(f"chunk {chunk.seq} fails its checksum")
    if chunk.part == PART_STATE:
        if t.received:
            raise ValueError("snapshot file bytes after store records")
        if t.state_written + len(chunk.data) > t.offer.state_file_bytes:
            raise ValueError("more snapshot file bytes than offered")
        assert t.state_fd is not None
        write_all(t.state_fd, chunk.data)
        t.state_written += len(chunk.data)
        return
    if chunk.part != PART_RECORDS:
        raise ValueError(f"unknown chunk part {chunk.part}")
    if t.state_written != t.offer.state_file_bytes:
        raise ValueError("store records before the whole snapshot file")
    assert t.store is not None
    for offset, record in parse_records(chunk.data, t.offer.low_water, t.offer.next_offset):
        t.store.append_received(offset, record)
        t.received.append(offset)


def parse_records(data: bytes, low: int, high: int) -> list[tuple[int, bytes]]:
    """The framed records of a chunk, each checked as the store checks its own (magic, length,
    CRC over length, offset and payload) and within [``low``, ``high``)."""
    out: list[tuple[int, bytes]] = []
    mv = memoryview(data)
    p = 0
    n = len(data)
    while p < n:
        if p + RECORD_HEADER_BYTES > n:
            raise ValueError("a record header is cut off")
        magic, flags, crc, length, offset = _RECORD_HEADER.unpack_from(mv, p)
        end = p + RECORD_HEADER_BYTES + length
        if magic != RECORD_MAGIC or flags != 0 or length > MAX_RECORD_BYTES or end > n:
            raise ValueError(f"a malformed record at byte {p} of a chunk")
        if _crc(mv[p + 8 : end]) != crc:
            raise ValueError(f"record {offset} fails its checksum")
        if not low <= offset < high:
            raise ValueError(f"record {offset} is outside [{low}, {high})")
        out.append((offset, bytes(mv[p + RECORD_HEADER_BYTES : end])))
        p = end
    mv.release()
    return out


def close_staging(t: Incoming) -> None:
    if t.state_fd is not None:
        try:
            os.close(t.state_fd)
        except OSError:
            pass
        t.state_fd = None
    if t.store is not None:
        t.store.close()
        t.store = None


def finish_staging(t: Incoming) -> snapshot_install.StagedInstall:
    """Everything received, durable and checked; the state decoded (all off the event loop)."""
    offer = t.offer
    if t.state_written != offer.state_file_bytes:
        raise ValueError(f"{t.state_written} of {offer.state_file_bytes} snapshot file bytes arrived")
    assert t.state_fd is not None and t.store is not None
    os.fsync(t.state_fd)
    os.close(t.state_fd)
    t.state_fd = None
    saved = read_snapshot_file(t.directory / snapshot_install.STATE_FILE, (offer.shard, offer.index, offer.term))
    if saved.meta != offer.meta:
        raise ValueError("the snapshot file's configuration differs from the offer's")
    store = t.store
    store.end_received(offer.next_offset)
    store.sync()
    fsync_dir(t.directory)
    old = t.host.state
    state = ShardState.restore(saved.data, old.topics.limits, old.sessions.max_expiry_s)
    if (state.shard, state.applied_index, state.topics.next_offset) != (offer.shard, offer.index, offer.next_offset):
        raise ValueError(f"the state is of shard {state.shard} at index {state.applied_index} (next offset "
                         f"{state.topics.next_offset}); offered: shard {offer.shard} at {offer.index} ({offer.next_offset})")
    if state.topics.incarnation != old.topics.incarnation:
        raise ValueError(f"the state is of incarnation {state.topics.incarnation}, this shard's is {old.topics.incarnation}")
    meta = state.topics.meta
    received = set(t.received)
    missing = [o for o in meta if o not in received]
    if missing:
        # Installing would lose them here (a leader that started its records above them): refused.
        raise ValueError(f"the leader sent no record of {len(missing)} message(s) its state keeps "
                         f"(offsets {missing[0]}..{missing[-1]}, records sent from {offer.low_water})")
    gone = [o for o in t.received if o not in meta]  # released at the leader before its snapshot
    if gone:
        store.release(gone)
    t.store = None
    return snapshot_install.StagedInstall(offer.shard, offer.index, offer.term, offer.meta, t.directory, state,
                                          store, len(saved.data), (offer.leader[0], offer.leader[1]))
