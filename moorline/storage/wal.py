"""Node-wide write-ahead log: every Raft group's entries and hard state in one stream of segments.

Why one log per node: one ``fdatasync`` then covers a batch of every group's writes (group commit),
which is what makes per-message fsync affordable.

Files: ``wal-<seq:016d>.log`` in one directory. Segment ``seq + 1`` is created only after segment
``seq`` was fully written and fdatasynced, so a valid record in a later segment proves every earlier
segment complete. Every segment starts with one *checkpoint* record per known group (hard state,
snapshot mark, last index), so no old segment ever holds the only copy of a group's hard state: a
segment can be deleted as soon as every group's entries in it are covered by a durable snapshot mark.

Record layout (little endian, 44-byte header, then the body)::

    magic u16 | type u8 | version u8 | body_len u32 | group i64 | segment u32 | position u32 |
    batch u64 | batch_start u32 | body_crc u32 | header_crc u32 | body

``header_crc`` is CRC32C of the 40 bytes before it and ``body_crc`` CRC32C of the body. Two
checksums let recovery name the group of a record whose body is damaged (its header is intact) and
step over it exactly. ``segment``/``position`` repeat where the record was written: a byte pattern
inside a payload that happens to look like a record is not taken for one. ``version`` is 1.
Version 0 (written before sync batches were recorded) has a 32-byte header without ``batch`` and
``batch_start``; such records are still read, and damage among them is judged by the old rule below.

Sync batches: ``batch`` numbers the group commit (``sync``) whose ``fdatasync`` made the record
durable, and ``batch_start`` is where that batch's first record in this segment starts. The records
of batch N + 1 are written only after batch N's ``fdatasync`` returned (the sync lock orders the
writes of ``sync`` and of the write-ahead), so after a power loss only the highest batch can be
damaged: the pages of its write may have reached the disk in any order, so a 4 KiB page of it can
read as zeros while later pages survive. Batch numbers rise across segments and restarts
(recovery continues above the highest one seen).

Bodies: entry ``term u64 | index u64 | entry_type u32 | payload``; hard state ``term u64 |
commit u64 | vote bytes``; truncate ``from_index u64``; snapshot mark ``index u64 | term u64``;
checkpoint ``has_hard_state u8 | term u64 | commit u64 | snapshot_index u64 | snapshot_term u64 |
last_index u64 | vote bytes``; remove (empty body): everything of the group before it is forgotten.

Recovery rule (docs/design.md, sharpened by sync batches): damage (a checksum failure, a zeroed page
hole, garbage) is a **torn tail** when nothing valid follows it, or when every record after it in
the segment belongs to the highest batch and that batch started at or before the damage (its
``batch_start``, and the damaged record's own header where it survived, say so): that batch's
``fdatasync`` cannot have returned, so nothing in it was acknowledged. A torn tail is cut from the
first damaged record on, and ``WalRecovery.torn_tails`` says which batch went and how many records.
Damage followed by a record of a later batch, or by any valid record in a later segment (a segment
is complete and synced before the next one gets a byte), is **corruption**: data that was synced.
If the invalid record's header is intact its group is reported corrupted and recovery goes on for
the other groups; otherwise ``WalCorruption`` names the file and offset and the node must not start.
Version-0 records carry no batch: damage followed by any valid one of them is corruption, as before.

Damage inside the highest batch cannot be told from bit rot in a batch whose ``fdatasync`` did
return just before the crash: such a batch is cut as torn (a replica catches up from its peers; a
single node loses what that last sync acknowledged). Once a later batch is written the earlier ones
are protected: the first sync after a restart writes a new segment, and a clean ``close`` ends
with a *seal* record (empty body, ignored by recovery) in a batch of its own. Two checks narrow the
gap: hard states are written once per sync *after* that sync's entries (so a surviving commit
index never names a lost entry), and recovery flags a group whose commit index is beyond its last
recovered entry.

A corrupted group's damaged segment pins itself (and so every later one) until the group is
removed: reclaiming it would erase the evidence and let the next recovery take the group for whole.

Every ``open`` starts a new segment (with checkpoints) rather than appending to the last one.

Preallocation (``preallocate=True``, the node's default): a busy log switches to segments that a
thread zero-filled and synced beforehand (``prealloc.py`` says why), and records overwrite the
zeros. A segment is cut to its records' length before the next one is used and on ``close``, so
only the last segment can end in zeros, and only after a crash: recovery takes an all-zero tail
for unused space, cuts it and does not report it as torn.

Threads: ``append_*``/``set_hard_state``/``mark_snapshot``/``truncate`` may run on one thread (the
event loop) while ``sync``/``reclaim`` run on another. Appends only encode into an in-memory buffer
under a short lock; ``sync`` swaps the buffer out and does the IO without holding that lock.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import crc32c as _crc32c_module

from moorline.hashing import crc32c
from moorline.invariant import invariant
from moorline.storage.fsutil import ensure_dir, fdatasync_path, fsync_dir, pwrite_all, truncate_durably
from moorline.storage.ledger import SyncLedger
from moorline.storage.prealloc import SegmentPreparer

# The same C function moorline.hashing.crc32c wraps, bound directly: it takes any buffer (no
# copy) and skips one Python call per record on the hot path. Checked equal at import.
_crc: Callable[[bytes | bytearray | memoryview], int] = _crc32c_module.crc32c
_crc_more: Callable[[bytes | bytearray | memoryview, int], int] = _crc32c_module.crc32c  # (data, crc so far)
invariant(_crc(b"123456789") == crc32c(b"123456789") == 0xE3069283, "CRC32C implementations disagree")


class Entry(NamedTuple):
    """A Raft log entry as stored; plain ``(term, index, type, data)`` tuples are accepted too."""

    term: int
    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: e.index reads well
    type: int
    data: bytes


class HardState(NamedTuple):
    term: int
    vote: bytes
    commit: int


MAGIC = 0x4C57
_MAGIC_BYTES = struct.pack("<H", MAGIC)
VERSION = 1  # records carry their sync batch; version 0 did not (read, never written)
_HDR_PRE = struct.Struct("<HBBIqIIQII")  # everything the header CRC covers
_HDR = struct.Struct("<HBBIqIIQIII")  # the whole header, header CRC last
_HDR_V0 = struct.Struct("<HBBIqIIII")  # version 0: no batch, no batch_start
_U32 = struct.Struct("<I")
HEADER_BYTES = _HDR_PRE.size + 4
V0_HEADER_BYTES = _HDR_V0.size
invariant(HEADER_BYTES == 44 and V0_HEADER_BYTES == 32, "WAL header layout changed")

T_ENTRY = 1
T_HARD_STATE = 2
T_TRUNCATE = 3
T_SNAPSHOT = 4
T_CHECKPOINT = 5
T_REMOVE = 6
T_SEAL = 7  # a clean close: its batch follows every data batch, so damage in any of them is corruption
_TYPES = frozenset({T_ENTRY, T_HARD_STATE, T_TRUNCATE, T_SNAPSHOT, T_CHECKPOINT, T_REMOVE, T_SEAL})
_V0_TYPES = frozenset({T_ENTRY, T_HARD_STATE, T_TRUNCATE, T_SNAPSHOT, T_CHECKPOINT, T_REMOVE})
SEAL_GROUP = -1  # the group field of a seal record (no group's)

_ENTRY = struct.Struct("<QQI")
_HARD = struct.Struct("<QQ")
_TRUNC = struct.Struct("<Q")
_SNAP = struct.Struct("<QQ")
_CKPT = struct.Struct("<BQQQQQ")

MAX_BODY_BYTES = 1 << 30
PINNED = 1 << 62  # above any index: a corrupted group's damaged segment is never reclaimed
# When the next segment is zero-filled ahead. Zero-filling costs per byte (here 20 ms of CPU per
# 64 MiB segment); preallocation saves per sync (about 37 µs at 20 KB a sync). So only a busy log
# of small syncs gets it: a segment that has seen this many syncs (the fill is repaid after about
# 540) ...
PREPARE_AFTER_SYNCS = 1024
# ... whose syncs averaged at most this (it pays below about 77 KB a sync; a log of 64 KiB payloads
# keeps appending) ...
PREALLOCATE_MAX_SYNC_BYTES = 64 << 10
# ... and, when it is itself a prepared one, that is half full: one fill per segment really used.
MAX_SEGMENT_BYTES = 2 << 30  # positions are u32
_SEGMENT_RE = re.compile(r"^wal-(\d+)\.log$")


def segment_name(seq: int) -> str:
    return f"wal-{seq:016d}.log"


class WalCorruption(Exception):
    """Damage the WAL cannot attribute to a group: the node must refuse to start."""

    def __init__(self, path: Path, offset: int, message: str) -> None:
        super().__init__(f"WAL corruption in {path} at offset {offset}: {message}")
        self.path = path
        self.offset = offset
        self.message = message


class WalBackpressure(Exception):
    """``append_entries`` refused: more than ``max_pending_bytes`` wait for ``sync``."""


@dataclass
class CorruptionReport:
    path: Path
    offset: int
    group: int | None
    message: str


@dataclass
class GroupRecovery:
    hard_state: HardState | None
    snapshot_index: int
    snapshot_term: int
    entries: list[Entry]  # after snapshot_index, in index order, truncations applied
    corrupted: bool = False  # see WalRecovery.corrupted; entries stop before the damage


@dataclass
class TornTail:
    """What recovery cut off the end of a segment, for the operator's log."""

    path: Path
    offset: int
    batch: int | None  # the sync batch it belonged to; None where no surviving header says
    records: int  # records that went: the damaged one and every one after it whose header survived
    bytes: int

    def describe(self) -> str:
        which = f"sync batch {self.batch}" if self.batch is not None else "the last sync batch"
        return (
            f"torn tail truncated: {self.path} at offset {self.offset}: {self.records} record(s) of "
            f"{which} ({self.bytes} bytes) were cut; that batch's fdatasync had not returned, so none "
            "of it was acknowledged"
        )


@dataclass
class WalRecovery:
    groups: dict[int, GroupRecovery]
    corrupted: list[CorruptionReport]
    torn_tail_truncated: list[tuple[Path, int]]
    torn_tails: list[TornTail] = field(default_factory=list)  # the same cuts, with batch and counts
    next_batch: int = 1  # the batch the records written from now on carry
    # Groups whose copy was abandoned (``remove_group``) in the segments still kept: a snapshot
    # file of one is valid only if a mark written after that says so (the copy before it is void).
    removed: set[int] = field(default_factory=set)


def _frame_header(rtype: int, group: int, seg: int, pos: int, batch: int, batch_start: int, body: bytes) -> bytes:
    """The 44-byte header of a record (the body follows it in the stream)."""
    pre = _HDR_PRE.pack(MAGIC, rtype, VERSION, len(body), group, seg, pos, batch, batch_start, _crc(body))
    return pre + _U32.pack(_crc(pre))


_OK, _BAD_HEADER, _BAD_BODY = 0, 1, 2
NO_BATCH = -1  # the batch of a version-0 record (and of a header that did not survive)


class _Parsed(NamedTuple):
    status: int
    type: int
    group: int
    start: int  # body start
    end: int
    batch: int  # NO_BATCH for version 0
    batch_start: int


_BAD = _Parsed(_BAD_HEADER, 0, 0, 0, 0, NO_BATCH, 0)


def _parse(mv: memoryview, p: int, seq: int) -> _Parsed:
    """The record claimed to start at ``p`` (either version)."""
    n = len(mv)
    if p + V0_HEADER_BYTES > n or mv[p + 3] > VERSION:
        return _BAD
    if mv[p + 3] == VERSION:
        if p + HEADER_BYTES > n:
            return _BAD
        magic, rtype, _v, blen, group, seg, pos, batch, bstart, bcrc, hcrc = _HDR.unpack_from(mv, p)
        hlen, types = HEADER_BYTES, _TYPES
    else:
        magic, rtype, _v, blen, group, seg, pos, bcrc, hcrc = _HDR_V0.unpack_from(mv, p)
        batch, bstart = NO_BATCH, 0
        hlen, types = V0_HEADER_BYTES, _V0_TYPES
    if (
        magic != MAGIC
        or seg != seq
        or pos != p
        or rtype not in types
        or blen > MAX_BODY_BYTES
        or bstart > p
        or hcrc != _crc(mv[p : p + hlen - 4])
    ):
        return _BAD
    start = p + hlen
    end = start + blen
    if end > n or _crc(mv[start:end]) != bcrc:
        return _Parsed(_BAD_BODY, rtype, group, start, end, batch, bstart)
    return _Parsed(_OK, rtype, group, start, end, batch, bstart)


def _zeros_from(data: bytes, start: int) -> bool:
    """Is everything from ``start`` on a zero byte? (Preallocated space no record was written to.)"""
    return data.count(0, start) == len(data) - start


def _has_valid_record(mv: memoryview, start: int, seq: int) -> bool:
    """Is there any valid record of segment ``seq`` starting at or after ``start``?"""
    data = mv.obj
    assert isinstance(data, bytes)
    q = data.find(_MAGIC_BYTES, start)
    while q != -1:
        if _parse(mv, q, seq).status == _OK:
            return True
        q = data.find(_MAGIC_BYTES, q + 1)
    return False


def _headers_from(mv: memoryview, start: int, seq: int) -> list[_Parsed]:
    """Every record of segment ``seq`` at or after ``start`` whose header is intact (body or not)."""
    data = mv.obj
    assert isinstance(data, bytes)
    found: list[_Parsed] = []
    q = data.find(_MAGIC_BYTES, start)
    while q != -1:
        r = _parse(mv, q, seq)
        if r.status != _BAD_HEADER:
            found.append(r)
        q = data.find(_MAGIC_BYTES, q + 1)
    return found


class RecordInfo(NamedTuple):
    """One record as ``segment_records`` finds it (for tools and tests)."""

    offset: int
    type: int
    group: int
    batch: int  # NO_BATCH for version 0
    batch_start: int
    valid: bool  # False: the header is intact, the body fails its checksum


def segment_records(path: Path) -> list[RecordInfo]:
    """The records of a segment file whose headers are intact, in file order (read-only)."""
    m = _SEGMENT_RE.match(path.name)
    invariant(m is not None, f"{path} is not a WAL segment")
    assert m is not None
    mv = memoryview(Path(path).read_bytes())
    return [
        RecordInfo(r.start - (HEADER_BYTES if r.batch != NO_BATCH else V0_HEADER_BYTES), r.type, r.group,
                   r.batch, r.batch_start, r.status == _OK)
        for r in _headers_from(mv, 0, int(m.group(1)))
    ]


def _torn_batch(p: int, damaged: _Parsed, after: list[_Parsed], before: int) -> int | None:
    """The batch whose unfinished write the damage at ``p`` lies in, or None if it is corruption.

    ``damaged`` is what parsing at ``p`` gave (its batch is known only if its header survived),
    ``after`` the intact headers after it (some valid), ``before`` the batch of the last valid record
    before it in this segment (``NO_BATCH``: none, or version 0). Torn only if every record after
    the damage is in one batch, numbered (version 1), not older than anything before the damage,
    and starting at or before the damage: then the damage is inside that batch's write, the last
    one, whose ``fdatasync`` had not returned (a later batch would prove it had)."""
    if not after:
        return None
    batch, start = after[0].batch, after[0].batch_start
    if batch == NO_BATCH or before > batch or start > p:
        return None
    if any(r.batch != batch or r.batch_start != start for r in after):
        return None  # a later batch follows the damage (or the headers disagree): it was synced
    if damaged.status == _BAD_BODY and (damaged.batch != batch or damaged.batch_start != start):
        return None  # its own header says it belongs to an earlier batch
    if before < batch and start != p:
        return None  # the last valid record before is of an earlier batch: this one must begin here
    return batch


@dataclass
class _GroupState:
    """What the writer must know per group (also what a checkpoint record carries)."""

    last_index: int = 0
    snapshot_index: int = 0
    snapshot_term: int = 0
    hard_state: HardState | None = None

    def checkpoint_body(self) -> bytes:
        term, vote, commit = self.hard_state if self.hard_state is not None else (0, b"", 0)
        has = 1 if self.hard_state is not None else 0
        return _CKPT.pack(has, term, commit, self.snapshot_index, self.snapshot_term, self.last_index) + vote


@dataclass
class _RecoveringGroup:
    state: _GroupState = field(default_factory=_GroupState)
    entries: list[Entry] = field(default_factory=list)
    corrupted: bool = False
    fresh: bool = True  # no record of this group replayed yet

    def first_index(self) -> int:
        return self.entries[0][1] if self.entries else self.state.last_index + 1

    def truncate_from(self, from_index: int) -> None:
        if self.entries and from_index <= self.entries[-1][1]:
            del self.entries[max(0, from_index - self.entries[0][1]) :]
        self.state.last_index = min(self.state.last_index, from_index - 1)

    def compact_to(self, index: int, term: int) -> None:
        if index <= self.state.snapshot_index:
            return
        self.state.snapshot_index = index
        self.state.snapshot_term = term
        if self.entries:
            drop = index - self.entries[0][1] + 1
            if drop > 0:
                del self.entries[:drop]
        self.state.last_index = max(self.state.last_index, index)


class WriteAheadLog:
    """One node's log. Usage: ``open()`` (recovery) once; then ``append_entries`` /
    ``set_hard_state`` / ``mark_snapshot`` / ``truncate`` buffer records; ``sync()`` (one
    fdatasync, usually on a worker thread) makes everything appended before it durable and
    returns its sequence number; nothing may be acknowledged or sent that depends on a record
    before ``synced_seq()`` covers it. ``append_entries`` raises ``WalBackpressure`` once
    ``pending_bytes()`` reaches ``max_pending_bytes``: stop taking work until a sync drains it.
    ``reclaim()`` deletes segments all of whose entries are below durable snapshot marks;
    ``groups_pinning_oldest_segment()`` names the groups to snapshot so the oldest can go."""

    def __init__(
        self,
        directory: Path,
        segment_bytes: int = 64 << 20,
        max_pending_bytes: int = 64 << 20,
        ledger: Path | str | SyncLedger | None = None,
        write_ahead_bytes: int = 256 << 10,
        preallocate: bool = False,
        prepare_after_syncs: int = PREPARE_AFTER_SYNCS,
    ) -> None:
        invariant(256 <= segment_bytes <= MAX_SEGMENT_BYTES, "segment_bytes must be in [256 B, 2 GiB]")
        invariant(max_pending_bytes > 0, "max_pending_bytes must be positive")
        invariant(write_ahead_bytes > 0, "write_ahead_bytes must be positive")
        # Pending bytes past this are written at once (not synced): a batch of large payloads goes
        # to the page cache while it is still in the CPU cache. Measured here, one 5 MB write cost
        # three times the CPU per byte of 1 MB ones.
        self.write_ahead_bytes = write_ahead_bytes
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.max_pending_bytes = max_pending_bytes
        self._ledger = SyncLedger(Path(ledger)) if isinstance(ledger, Path | str) else ledger
        self._opened = False
        self._closed = False
        self._failed: BaseException | None = None

        # Appender side, guarded by _lock.
        self._lock = threading.Lock()
        self._pending: list[tuple[int, bytearray]] = []  # (segment seq, bytes for that segment)
        self._pending_bytes = 0
        # Awaiting sync: (group, snapshot index, None) marks and (group, 0, {seq: top}) removals.
        self._pending_snapshots: list[tuple[int, int, dict[int, int] | None]] = []
        self._pending_hard: dict[int, HardState] = {}  # latest unwritten hard state per group
        self._pending_hard_bytes = 0
        self._seg_seq = 0  # segment the next record goes to
        self._seg_size = 0  # its size once everything pending is written
        # The sync batch the records appended now belong to: the next ``sync`` writes them, and the
        # one after it is a new batch. With it, where that batch's first record in the segment is.
        self._batch = 1
        self._batch_at: tuple[int, int] = (0, 0)  # (batch, segment) _batch_start belongs to
        self._batch_start = 0
        self._appended_seq = 0
        self._groups: dict[int, _GroupState] = {}
        # segment seq -> group -> highest entry index still live in that segment.
        self._seg_max: dict[int, dict[int, int]] = {}

        # Syncer side, guarded by _sync_lock (held during IO).
        self._sync_lock = threading.Lock()
        self._fd: int | None = None
        self._fd_seq = 0
        self._fd_path = self.directory  # the open segment's path (once one is open)
        self._fd_length = 0
        self._synced_seq = 0
        self._written_unsynced = False  # a write-ahead put bytes in the file that no sync covers yet
        self._fd_size = 0  # the file's size: above _fd_length while preallocated zeros are left
        self._syncs_in_segment = 0
        self._preparer = SegmentPreparer(self.directory, segment_bytes) if preallocate else None
        invariant(prepare_after_syncs >= 1, "prepare_after_syncs must be at least 1")
        self.prepare_after_syncs = prepare_after_syncs
        # Read by the event loop, changed by the syncer: mutated under both locks, read under _lock.
        self._disk_segments: list[int] = []
        self._durable_snapshot: dict[int, int] = {}

    # ------------------------------------------------------------------ recovery

    def open(self) -> WalRecovery:
        invariant(not self._opened, "WAL opened twice")
        self._opened = True
        ensure_dir(self.directory)
        if self._preparer is not None:
            self._preparer.discard_leftover()
        files = self._list_segments()
        for (a, _), (b, path) in zip(files, files[1:], strict=False):
            if b != a + 1:
                raise WalCorruption(path, 0, f"segments {a + 1}..{b - 1} are missing")

        groups: dict[int, _RecoveringGroup] = {}
        self._removed_seen: set[int] = set()
        corrupted: list[CorruptionReport] = []
        torn: list[TornTail] = []
        kept: list[int] = []
        self._max_batch = 0  # the highest batch of any intact header seen
        for i, (seq, path) in enumerate(files):
            self._seg_max[seq] = {}
            stop = self._recover_segment(seq, path, files[i + 1 :], groups, corrupted, torn)
            kept.append(seq)
            if stop:
                for later_seq, later_path in files[i + 1 :]:
                    data = later_path.read_bytes()
                    if not _zeros_from(data, 0):  # else a preallocated segment never written
                        records = len(_headers_from(memoryview(data), 0, later_seq))
                        torn.append(TornTail(later_path, 0, None, records, len(data)))
                    later_path.unlink()
                    if self._ledger is not None:
                        self._ledger.forget(later_path)
                fsync_dir(self.directory)
                break

        first_path = files[0][1] if files else self.directory
        last_path = files[-1][1] if files else self.directory
        result: dict[int, GroupRecovery] = {}
        for g in sorted(groups):
            result[g] = self._finish_group(g, groups[g], first_path, last_path, corrupted)
        for report in corrupted:
            # The damaged segment (and so every later one) stays until the group is removed
            # (``remove_group``): reclaiming it would erase the evidence, and the next recovery
            # would find the group whole but without its synced entries.
            m = _SEGMENT_RE.match(report.path.name)
            if report.group is not None and m is not None and int(m.group(1)) in self._seg_max:
                self._seg_max[int(m.group(1))][report.group] = PINNED

        # A trailing segment torn at 0 carries no checkpoint; drop it.
        while kept and (self.directory / segment_name(kept[-1])).stat().st_size == 0:
            seq = kept.pop()
            (self.directory / segment_name(seq)).unlink()
            if self._ledger is not None:
                self._ledger.forget(self.directory / segment_name(seq))
            self._seg_max.pop(seq, None)
        fsync_dir(self.directory)
        # What recovery accepted may still sit only in the page cache (the process died, the
        # machine did not). New records will build on it, so make it durable first: otherwise a
        # later power loss could lose this tail while keeping newer segments (corruption). Only
        # the last segment can hold unsynced bytes: a rotation syncs the old segment first.
        if kept:
            path = self.directory / segment_name(kept[-1])
            size = fdatasync_path(path)
            if self._ledger is not None:
                self._ledger.record(path, size)
        self._disk_segments = kept
        # Always write into a fresh segment that starts with checkpoints of every group: resuming a
        # segment whose checkpoint block was torn would leave old segments holding the only copy.
        self._seg_seq = kept[-1] if kept else (files[-1][0] if files else 0)
        # Above every batch a header names, cut ones included: numbers are never reused.
        self._batch = self._max_batch + 1
        with self._lock:
            self._start_segment_locked()
        return WalRecovery(result, corrupted, [(t.path, t.offset) for t in torn], torn, self._batch,
                           set(self._removed_seen))

    def _finish_group(
        self,
        g: int,
        rg: _RecoveringGroup,
        first_path: Path,
        last_path: Path,
        corrupted: list[CorruptionReport],
    ) -> GroupRecovery:
        """Final consistency checks of one recovered group; adopt its state for writing."""
        st = rg.state
        if not rg.corrupted and rg.first_index() > st.snapshot_index + 1:
            rg.corrupted = True
            missing = f"{st.snapshot_index + 1}..{rg.first_index() - 1}"
            corrupted.append(
                CorruptionReport(first_path, 0, g, f"entries {missing} of group {g} are missing")
            )
        top = rg.entries[-1][1] if rg.entries else st.snapshot_index
        if not rg.corrupted and st.hard_state is not None and st.hard_state.commit > top:
            # Raft never commits past its own last entry, and the hard state is written after the
            # entries of its sync: entries that were synced have been lost.
            rg.corrupted = True
            msg = f"group {g} commit index {st.hard_state.commit} is beyond its last entry {top}"
            corrupted.append(CorruptionReport(last_path, 0, g, msg))
        self._groups[g] = _GroupState(st.last_index, st.snapshot_index, st.snapshot_term, st.hard_state)
        self._durable_snapshot[g] = st.snapshot_index
        return GroupRecovery(st.hard_state, st.snapshot_index, st.snapshot_term, rg.entries, rg.corrupted)

    def _list_segments(self) -> list[tuple[int, Path]]:
        found: list[tuple[int, Path]] = []
        for entry in os.scandir(self.directory):
            m = _SEGMENT_RE.match(entry.name)
            if m:
                found.append((int(m.group(1)), Path(entry.path)))
        found.sort()
        return found

    def _recover_segment(
        self,
        seq: int,
        path: Path,
        later: Sequence[tuple[int, Path]],
        groups: dict[int, _RecoveringGroup],
        corrupted: list[CorruptionReport],
        torn: list[TornTail],
    ) -> bool:
        """Apply one segment's records; return True if a torn tail was cut here (stop)."""
        data = path.read_bytes()
        mv = memoryview(data)
        n = len(data)
        p = 0
        before = NO_BATCH  # batch of the last valid record in this segment
        while p < n:
            r = _parse(mv, p, seq)
            status, rtype, group, start, end = r.status, r.type, r.group, r.start, r.end
            if status != _BAD_HEADER and r.batch > self._max_batch:
                self._max_batch = r.batch
            if status == _OK and rtype == T_SEAL:
                before = r.batch
                p = end
                continue
            if status == _OK and rtype == T_REMOVE:
                self._removed_seen.add(group)
                groups.pop(group, None)
                corrupted[:] = [c for c in corrupted if c.group != group]
                for tops in self._seg_max.values():
                    tops.pop(group, None)
                before = r.batch
                p = end
                continue
            if status == _OK:
                rg = groups.get(group)
                if rg is None:
                    rg = groups[group] = _RecoveringGroup()
                if not rg.corrupted:
                    err = self._apply(seq, rg, group, rtype, mv, start, end)
                    rg.fresh = False
                    if err is not None:
                        rg.corrupted = True
                        corrupted.append(CorruptionReport(path, p, group, err))
                before = r.batch
                p = end
                continue
            resume = min(end, n) if status == _BAD_BODY else p + 1
            after = _headers_from(mv, resume, seq)
            for h in after:
                self._max_batch = max(self._max_batch, h.batch)
            valid_after = any(h.status == _OK for h in after)
            batch: int | None = None
            if valid_after and not self._later_has_valid(later):
                batch = _torn_batch(p, r, after, before)
                valid_after = batch is None  # inside the last batch's unfinished write: torn
            elif not valid_after and self._later_has_valid(later):
                valid_after = True
            if valid_after:
                if status == _BAD_HEADER:
                    raise WalCorruption(path, p, "record header fails its checksum and valid records follow")
                rg = groups.setdefault(group, _RecoveringGroup())
                rg.corrupted = True
                corrupted.append(
                    CorruptionReport(path, p, group, f"record of group {group} fails its checksum")
                )
                p = resume
                continue
            truncate_durably(path, p)
            if self._ledger is not None:
                self._ledger.record(path, p)
            if not _zeros_from(data, p):  # all zeros: preallocated space never written, not damage
                if batch is None:
                    known = [h.batch for h in ([r] if status == _BAD_BODY else []) + after if h.batch != NO_BATCH]
                    batch = known[0] if known else None
                torn.append(TornTail(path, p, batch, 1 + len(after), n - p))
            return True
        return False

    @staticmethod
    def _later_has_valid(later: Sequence[tuple[int, Path]]) -> bool:
        for seq, path in later:
            data = path.read_bytes()
            if _has_valid_record(memoryview(data), 0, seq):
                return True
        return False

    def _apply(
        self, seq: int, rg: _RecoveringGroup, group: int, rtype: int, mv: memoryview, start: int, end: int
    ) -> str | None:
        """Replay one valid record; return an error message if it makes the group inconsistent."""
        st = rg.state
        if rtype == T_ENTRY:
            term, index, etype = _ENTRY.unpack_from(mv, start)
            if index <= st.snapshot_index:
                return None  # compacted already (cannot happen with this writer; harmless)
            if index <= st.last_index:
                rg.truncate_from(index)
                self._note_truncate(group, index)
            elif index != st.last_index + 1:
                return f"entry {index} of group {group} follows {st.last_index}: entries missing"
            rg.entries.append(Entry(term, index, etype, bytes(mv[start + _ENTRY.size : end])))
            st.last_index = index
            seg = self._seg_max[seq]
            seg[group] = index
        elif rtype == T_HARD_STATE:
            term, commit = _HARD.unpack_from(mv, start)
            st.hard_state = HardState(term, bytes(mv[start + _HARD.size : end]), commit)
        elif rtype == T_TRUNCATE:
            (from_index,) = _TRUNC.unpack_from(mv, start)
            rg.truncate_from(from_index)
            self._note_truncate(group, from_index)
        elif rtype == T_SNAPSHOT:
            index, term = _SNAP.unpack_from(mv, start)
            rg.compact_to(index, term)
        elif rtype == T_CHECKPOINT:
            has, term, commit, snap_index, snap_term, last_index = _CKPT.unpack_from(mv, start)
            if has:
                st.hard_state = HardState(term, bytes(mv[start + _CKPT.size : end]), commit)
            rg.compact_to(snap_index, snap_term)
            if rg.fresh:
                # First sight of this group (older segments reclaimed): entries up to last_index
                # lived there; a later snapshot mark must cover them (checked at the end).
                st.last_index = max(st.last_index, last_index)
            elif last_index < st.last_index:
                rg.truncate_from(last_index + 1)
        return None

    # ------------------------------------------------------------------ appending (any thread)

    def append_entries(self, group: int, entries: Sequence[tuple[int, int, int, bytes]]) -> None:
        """Buffer entries of ``group``; entries at or below the group's last index replace the old ones."""
        if not entries:
            return
        with self._lock:
            self._check_open()
            if self._pending_bytes + self._pending_hard_bytes >= self.max_pending_bytes:
                raise WalBackpressure(f"{self._pending_bytes} bytes wait for sync")
            st = self._groups.get(group)
            if st is None:
                st = self._groups[group] = _GroupState()
            first = entries[0][1]
            invariant(first > st.snapshot_index, f"group {group}: entry {first} is compacted")
            invariant(
                first <= st.last_index + 1, f"group {group}: entry {first} leaves a gap after {st.last_index}"
            )
            if first <= st.last_index:
                self._emit(T_TRUNCATE, group, _TRUNC.pack(first))
                self._note_truncate(group, first)
                st.last_index = first - 1
            # Hot path: the framing of _emit inlined, with local names (a few µs per entry matter).
            pack_entry, pack_pre, pack_u32, crc, crc_more = _ENTRY.pack, _HDR_PRE.pack, _U32.pack, _crc, _crc_more
            limit = self.segment_bytes
            seg_seq = self._seg_seq
            seg_size = self._seg_size
            batch = self._batch
            batch_start = self._batch_start_locked()
            chunk = self._chunk_locked()
            expected = first
            for term, index, etype, data in entries:
                if index != expected:
                    invariant(False, f"group {group}: entries not contiguous at {index}")
                head = pack_entry(term, index, etype)
                blen = len(head) + len(data)  # framed as head + data without joining them: no copy of data
                if seg_size > 0 and seg_size + HEADER_BYTES + blen > limit:
                    # Rotate. The new segment's checkpoints must describe exactly the records
                    # before this entry, so publish the local state first.
                    self._pending_bytes += seg_size - self._seg_size
                    self._seg_size = seg_size
                    st.last_index = index - 1
                    if index > first:
                        self._seg_max.setdefault(seg_seq, {})[group] = index - 1
                    self._start_segment_locked()
                    seg_seq, seg_size = self._seg_seq, self._seg_size
                    batch_start = self._batch_start_locked()
                    chunk = self._chunk_locked()
                if blen > MAX_BODY_BYTES:
                    invariant(False, "WAL record too large")
                pre = pack_pre(MAGIC, T_ENTRY, VERSION, blen, group, seg_seq, seg_size, batch, batch_start,
                               crc_more(data, crc(head)))
                chunk += pre
                chunk += pack_u32(crc(pre))
                chunk += head
                chunk += data
                seg_size += HEADER_BYTES + blen
                expected += 1
                if len(chunk) >= self.write_ahead_bytes:
                    chunk = self._write_ahead_locked()
            self._pending_bytes += seg_size - self._seg_size
            self._seg_size = seg_size
            last = expected - 1
            st.last_index = last
            self._seg_max.setdefault(seg_seq, {})[group] = last
            self._appended_seq += 1

    def truncate(self, group: int, from_index: int) -> None:
        """Discard entries of ``group`` with index >= ``from_index`` (e.g. a conflicting snapshot)."""
        with self._lock:
            self._check_open()
            st = self._groups.setdefault(group, _GroupState())
            invariant(from_index > st.snapshot_index, f"group {group}: truncate below snapshot")
            if from_index > st.last_index:
                return
            self._emit(T_TRUNCATE, group, _TRUNC.pack(from_index))
            self._note_truncate(group, from_index)
            st.last_index = from_index - 1
            self._appended_seq += 1

    def set_hard_state(self, group: int, term: int, vote: bytes, commit: int) -> None:
        """Buffer the group's hard state. Only the latest per group and sync is written, and it is
        written after every entry appended before that sync: a torn tail can then never keep a
        commit index while losing the entries it covers (recovery checks that)."""
        with self._lock:
            self._check_open()
            self._groups.setdefault(group, _GroupState())
            old = self._pending_hard.get(group)
            if old is not None:
                self._pending_hard_bytes -= HEADER_BYTES + _HARD.size + len(old.vote)
            self._pending_hard[group] = HardState(term, bytes(vote), commit)
            self._pending_hard_bytes += HEADER_BYTES + _HARD.size + len(vote)
            self._appended_seq += 1

    def mark_snapshot(self, group: int, index: int, term: int) -> None:
        """Entries of ``group`` up to ``index`` are covered by a saved snapshot and may be dropped."""
        with self._lock:
            self._check_open()
            st = self._groups.setdefault(group, _GroupState())
            invariant(index >= st.snapshot_index, f"group {group}: snapshot index went back")
            if index == st.snapshot_index:
                return
            st.snapshot_index = index
            st.snapshot_term = term
            st.last_index = max(st.last_index, index)
            self._emit(T_SNAPSHOT, group, _SNAP.pack(index, term))
            self._pending_snapshots.append((group, index, None))
            self._appended_seq += 1

    def remove_group(self, group: int) -> None:
        """Abandon this node's copy of ``group`` (replica removed, or corrupted and to be re-added
        as a new member). Once synced its entries pin no segment, and recovery forgets everything
        of the group before this record, corruption reports included. The group may be written
        again afterwards as a new replica (from index 1 or a snapshot mark)."""
        with self._lock:
            self._check_open()
            self._emit(T_REMOVE, group, b"")
            self._groups.pop(group, None)
            old = self._pending_hard.pop(group, None)
            if old is not None:
                self._pending_hard_bytes -= HEADER_BYTES + _HARD.size + len(old.vote)
            unpin = {seq: tops[group] for seq, tops in self._seg_max.items() if group in tops}
            self._pending_snapshots.append((group, 0, unpin))
            self._appended_seq += 1

    def pending_bytes(self) -> int:
        """Bytes the next ``sync`` will write (0 means nothing to sync, hard states included)."""
        return self._pending_bytes + self._pending_hard_bytes

    def pending_hard_state_bytes(self) -> int:
        """The part of ``pending_bytes`` that is hard states. They need no sync of their own: a new
        commit index may ride on the next sync, and a new term or vote comes with a Ready that
        must sync anyway."""
        return self._pending_hard_bytes

    def appended_seq(self) -> int:
        return self._appended_seq

    def synced_seq(self) -> int:
        return self._synced_seq

    def last_index(self, group: int) -> int:
        with self._lock:
            st = self._groups.get(group)
            return st.last_index if st is not None else 0

    def snapshot_index(self, group: int) -> int:
        with self._lock:
            st = self._groups.get(group)
            return st.snapshot_index if st is not None else 0

    def _check_open(self) -> None:
        invariant(self._opened and not self._closed, "WAL is not open")
        if self._failed is not None:
            # After a failed write or fdatasync the file's contents are unknown (fsyncgate):
            # nothing more may be acknowledged from this log. The node must stop.
            raise OSError(f"WAL failed earlier: {self._failed!r}")

    def _emit(self, rtype: int, group: int, body: bytes) -> None:
        if self._seg_size > 0 and self._seg_size + HEADER_BYTES + len(body) > self.segment_bytes:
            self._start_segment_locked()
        self._emit_here(rtype, group, body)

    def _batch_start_locked(self) -> int:
        """Where the current batch's first record in the current segment starts (caller holds
        _lock, and calls this before appending a record at ``_seg_size``)."""
        at = (self._batch, self._seg_seq)
        if self._batch_at != at:
            self._batch_at = at
            self._batch_start = self._seg_size
        return self._batch_start

    def _emit_here(self, rtype: int, group: int, body: bytes) -> None:
        invariant(len(body) <= MAX_BODY_BYTES, "WAL record too large")
        start = self._batch_start_locked()
        header = _frame_header(rtype, group, self._seg_seq, self._seg_size, self._batch, start, body)
        chunk = self._chunk_locked()
        chunk += header
        chunk += body  # copied once, straight into the pending chunk (no framed copy first)
        size = len(header) + len(body)
        self._seg_size += size
        self._pending_bytes += size

    def _chunk_locked(self) -> bytearray:
        """The pending buffer of the current segment (created if the last one is older)."""
        pending = self._pending
        if pending and pending[-1][0] == self._seg_seq:
            return pending[-1][1]
        chunk = bytearray()
        pending.append((self._seg_seq, chunk))
        return chunk

    def _write_ahead_locked(self) -> bytearray:
        """Write the pending chunks now, unsynced, unless a sync is writing (caller holds _lock);
        returns the chunk to append to. Durability is unchanged: only ``sync`` makes bytes count."""
        if not self._sync_lock.acquire(blocking=False):
            return self._chunk_locked()  # a sync (on the thread) is writing: it takes the rest
        try:
            # Checked under both locks: the syncer changes the file only while holding _sync_lock.
            if self._fd is None or len(self._pending) != 1 or self._pending[0][0] != self._fd_seq:
                return self._chunk_locked()  # a segment switch takes _lock itself: leave it to sync
            ((_, chunk),) = self._pending
            self._pending = []
            try:
                self._write_at_end(chunk)
            except BaseException as exc:
                self._failed = exc
                raise
            self._written_unsynced = True
        finally:
            self._sync_lock.release()
        return self._chunk_locked()

    def _start_segment_locked(self) -> None:
        self._seg_seq += 1
        self._seg_size = 0
        self._seg_max[self._seg_seq] = {}
        for g in sorted(self._groups):
            self._emit_here(T_CHECKPOINT, g, self._groups[g].checkpoint_body())

    def _note_truncate(self, group: int, from_index: int) -> None:
        for seg in self._seg_max.values():
            top = seg.get(group)
            if top is not None and top >= from_index:
                seg[group] = from_index - 1

    # ------------------------------------------------------------------ syncing (one thread at a time)

    def sync(self) -> int:
        """Write and fdatasync everything appended before the call; return its sequence number."""
        with self._sync_lock:
            with self._lock:
                self._check_open()
                for group, hs in self._pending_hard.items():
                    # st.hard_state is what checkpoints carry: only hard states already in the stream.
                    self._groups[group].hard_state = hs
                    self._emit(T_HARD_STATE, group, _HARD.pack(hs.term, hs.commit) + hs.vote)
                self._pending_hard.clear()
                self._pending_hard_bytes = 0
                preparer = self._preparer
                if (preparer is not None and self._fd is not None and self._fd_seq == self._seg_seq
                        and self._fd_size <= self._fd_length and preparer.ready()):
                    # A busy log still appending (its first segment, or preallocation was late):
                    # move to the zero-filled segment now rather than when this one is full.
                    self._start_segment_locked()
                chunks = self._pending
                self._pending = []
                self._pending_bytes = 0
                snapshots = self._pending_snapshots
                self._pending_snapshots = []
                seq = self._appended_seq
                # Everything appended from now on is written only after this sync's fdatasync has
                # returned (this lock is held until then; the write-ahead needs it too): a new batch.
                self._batch += 1
            if not chunks and not self._written_unsynced:
                invariant(not snapshots, "snapshot marks pending without bytes")
                self._synced_seq = max(self._synced_seq, seq)
                return self._synced_seq
            try:
                for seg_seq, chunk in chunks:
                    if seg_seq != self._fd_seq:
                        self._switch_segment(seg_seq)
                    self._write_at_end(chunk)
                assert self._fd is not None
                os.fdatasync(self._fd)
                self._written_unsynced = False
                self._syncs_in_segment += 1
                syncs = self._syncs_in_segment
                if (self._preparer is not None and syncs >= self.prepare_after_syncs
                        and not self._preparer.ready()
                        and self._fd_length <= syncs * PREALLOCATE_MAX_SYNC_BYTES
                        and (self._fd_size <= self._fd_length or 2 * self._fd_length >= self.segment_bytes)):
                    self._preparer.start()  # returns at once while a preparation runs
            except BaseException as exc:
                self._failed = exc
                raise
            with self._lock:
                for group, index, unpin in snapshots:
                    if unpin is None:
                        self._durable_snapshot[group] = max(self._durable_snapshot.get(group, 0), index)
                        continue
                    # A durable removal: the old entries pin nothing (unless re-added since and
                    # written into the same segment: then its top changed and it stays).
                    self._durable_snapshot.pop(group, None)
                    for seg_seq, top in unpin.items():
                        tops = self._seg_max.get(seg_seq)
                        if tops is not None and tops.get(group) == top:
                            del tops[group]
                invariant(seq >= self._synced_seq, "sync sequence went back")
                self._synced_seq = seq
            if self._ledger is not None:
                self._ledger.record(self._fd_path, self._fd_length)
            return seq

    def _write_at_end(self, chunk: bytearray) -> None:
        """Write ``chunk`` after the segment's records (over preallocated zeros, if any are left)."""
        assert self._fd is not None
        pwrite_all(self._fd, chunk, self._fd_length)
        self._fd_length += len(chunk)
        self._fd_size = max(self._fd_size, self._fd_length)

    def _cut_zero_tail(self) -> None:
        """Cut unused preallocated zeros off the segment being written (the caller syncs it): only
        the last segment may end in anything but a record (recovery)."""
        assert self._fd is not None
        if self._fd_size > self._fd_length:
            os.ftruncate(self._fd, self._fd_length)
            self._fd_size = self._fd_length

    def _switch_segment(self, seg_seq: int) -> None:
        invariant(seg_seq > self._fd_seq, "segments are written in order")
        if self._fd is not None:
            # The old segment must be complete on disk before the new one holds anything: a
            # valid record in a later segment then proves the earlier ones whole (recovery).
            self._cut_zero_tail()
            os.fdatasync(self._fd)
            os.close(self._fd)
            # Ledger lines are written as soon as each fact is durable: a harness that cuts files
            # after a SIGKILL in the middle of this sync must not cut what was already synced.
            if self._ledger is not None:
                self._ledger.record(self._fd_path, self._fd_length)
        path = self.directory / segment_name(seg_seq)
        preparer = self._preparer
        prepared = preparer.take() if preparer is not None else None
        if preparer is not None and prepared is not None:
            invariant(not path.exists(), f"segment {path} exists already")
            os.rename(prepared, path)  # zeros and size were synced before it was handed over
            self._fd = os.open(path, os.O_WRONLY)
            self._fd_size = preparer.size
        else:
            # O_APPEND as well: writes go to the end whatever the offset says (pwrite on Linux).
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            self._fd_size = 0
        fsync_dir(self.directory)
        self._fd_seq = seg_seq
        self._fd_path = path
        self._fd_length = 0
        self._syncs_in_segment = 0
        with self._lock:
            self._disk_segments.append(seg_seq)
        if self._ledger is not None:
            self._ledger.record(path, 0)

    # ------------------------------------------------------------------ reclaiming

    def reclaim(self, wait: bool = False) -> list[Path]:
        """Delete the oldest segments whose entries are all covered by durable snapshot marks.

        Does a little file IO (unlink, one directory fsync). If a sync is running it returns ``[]``
        at once unless ``wait`` is set, so the event loop may call it without stalling."""
        if not self._sync_lock.acquire(blocking=wait):
            return []
        try:
            return self._reclaim_locked()
        finally:
            self._sync_lock.release()

    def _reclaim_locked(self) -> list[Path]:
        removed: list[Path] = []
        while True:
            with self._lock:
                if len(self._disk_segments) < 2 or self._disk_segments[0] >= self._fd_seq:
                    break  # keep the segment being written and any whose successor is not durable
                seq = self._disk_segments[0]
                if self._pinning_locked(seq):
                    break
            path = self.directory / segment_name(seq)
            path.unlink()
            if self._ledger is not None:
                self._ledger.forget(path)
            removed.append(path)
            with self._lock:
                self._disk_segments.pop(0)
                self._seg_max.pop(seq, None)
        if removed:
            fsync_dir(self.directory)
        return removed

    def _pinning_locked(self, seq: int) -> list[int]:
        tops = self._seg_max.get(seq, {})
        return sorted(g for g, top in tops.items() if top > self._durable_snapshot.get(g, 0))

    def groups_pinning_oldest_segment(self) -> list[int]:
        """Groups whose entries above their durable snapshot keep the oldest segment alive.

        Cheap and non-blocking (no IO): fine to call from the event loop."""
        with self._lock:
            if not self._disk_segments:
                return []
            return self._pinning_locked(self._disk_segments[0])

    def segment_paths(self) -> list[Path]:
        with self._lock:
            return [self.directory / segment_name(s) for s in self._disk_segments]

    def close(self) -> None:
        """Sync what is pending, seal, then close. Idempotent."""
        if self._closed or not self._opened:
            self._closed = True
            return
        self.sync()
        if self._fd is not None and self._failed is None:
            # A batch of its own after the last data batch: recovery then takes damage anywhere
            # before it for corruption, never for the torn tail of an unfinished sync.
            with self._lock:
                self._emit(T_SEAL, SEAL_GROUP, b"")
            self.sync()
        with self._sync_lock:
            self._closed = True
            if self._fd is not None:
                if self._fd_size > self._fd_length:
                    self._cut_zero_tail()  # a clean close leaves exact files
                    os.fdatasync(self._fd)
                os.close(self._fd)
                self._fd = None
        if self._preparer is not None:
            self._preparer.close()
