"""Per-shard message store: accepted publishes by dense message offset, written at apply.

Files (``directory`` is the shard's own directory, e.g. ``<data>/shard-<n>``):
``seg-<first_offset:020d>.dat`` segments, and ``store.meta`` (low-water mark and sync point,
CRC-protected, rewritten atomically by ``sync``). A segment covers offsets from its name up to the
next segment's name; after copy-forward a segment holds only the sparse survivors of its range.

Record layout (little endian, 20-byte header)::

    magic u16 | flags u16 | crc u32 | length u32 | offset i64 | payload

``crc`` is CRC32C of everything after it (length, offset, payload).

Durability: appends are buffered and written without fsync; ``sync`` (called when the node takes a
snapshot) makes them durable and records the *sync point* (next offset at that sync) in
``store.meta``. After a crash the WAL re-applies entries after the snapshot, so recovery treats
damage at or after the sync point (or ``expected_next_offset``, the snapshot's next offset, if that
is higher) as a lost unsynced tail and cuts it with everything after it; damage before it is
corruption (``StoreCorruption``), as is a store that ends before it. Only data after the last sync
point is ever truncated (docs/design.md).

What is durable across restart: the records themselves, reclaimed segments (gone), the low-water
mark as of the last ``sync`` (and as implied by missing offsets). What is *not*: the set of
released offsets. The shard state machine is the authority on what is kept; after recovery it calls
``release``/``release_below`` again for everything it no longer keeps. The low-water mark only rises,
except that ``truncate_from`` during recovery may lower it (with no snapshot yet, the WAL re-applies
from offset 0).

Damage found by a read (``get``, ``scan``, copy-forward in ``reclaim``) is reported through
``on_corruption`` when the owner set it (the shard host stops the shard: one bad store stops one
shard, never the node, and never raises into a reader); the read then gives None (``scan`` stops
before it). Without it, ``StoreCorruption`` is raised. A store that found damage, at ``open`` or on
a read, rewrites and deletes nothing from then on (``corruption`` says what): the damaged files stay
as they are for the operator.

Not thread-safe: one thread (the node's event loop) calls everything, ``sync`` included (or the
node serialises calls itself). The one exception is a sync split in three so its fdatasyncs run
off that thread: ``begin_sync`` (owner's thread: writes the buffer, lists what to sync),
``run_sync_job`` (any thread: only system calls on paths) and ``finish_sync`` / ``abort_sync``
(owner's thread: the bookkeeping). A new segment's directory entry is made durable by the next
sync, not at once: its records are not durable before that sync either.

Reading records for delivery off the owner's thread: ``plan_get`` (owner's thread) says where a
record lies when only the disk has it, ``read_records`` (any thread, its own descriptors) reads
and checks it while the store is held (``hold_reclaim``). A record it cannot confirm (moved,
truncated, damaged) comes back as None, and the owner reads it with ``get``, the authority that
reports damage.

For a snapshot sent to another replica: ``hold_reclaim`` keeps every segment (released records
included) until the transfer ends, and ``plan_read`` / ``read_plan`` read records as stored,
released or not, the reading itself off the owner's thread.
For one received: ``append_received`` stores a leader's records (sparse offsets allowed),
``end_received`` says where the next offset is, and ``relocate`` follows the directory's rename
when the staged store replaces the live one.
"""

from __future__ import annotations

import bisect
import os
import re
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c as _crc32c_module

from moorline.hashing import crc32c
from moorline.invariant import invariant, violated
from moorline.storage.fsutil import (
    ensure_dir,
    fdatasync_path,
    fsync_dir,
    truncate_durably,
    write_all,
    write_file_atomically,
    writev_all,
)
from moorline.storage.ledger import SyncLedger

# The same C function moorline.hashing.crc32c wraps, bound directly: it takes any buffer (no
# copy) and skips one Python call per record on the hot path. Checked equal at import.
_crc: Callable[[bytes | bytearray | memoryview], int] = _crc32c_module.crc32c
invariant(_crc(b"123456789") == crc32c(b"123456789") == 0xE3069283, "CRC32C implementations disagree")

MAGIC = 0x534D
_MAGIC_BYTES = struct.pack("<H", MAGIC)
_HDR = struct.Struct("<HHIIq")
_AFTER_CRC = struct.Struct("<Iq")  # the part of the header the CRC covers
HEADER_BYTES = _HDR.size
WRITEV_RECORD_BYTES = 16 << 10  # records this large are written from their own buffer (no copy)
invariant(HEADER_BYTES == 20, "store header layout changed")
_META = struct.Struct("<qqI")  # low_water, sync point, crc of the 16 bytes before
MAX_RECORD_BYTES = 256 << 20
_SEGMENT_RE = re.compile(r"^seg-(\d+)\.dat$")
META_FILE = "store.meta"


def segment_name(first_offset: int) -> str:
    return f"seg-{first_offset:020d}.dat"


class StoreCorruption(Exception):
    def __init__(self, path: Path, offset: int, message: str) -> None:
        super().__init__(f"message store corruption in {path} at byte {offset}: {message}")
        self.path = path
        self.offset = offset
        self.message = message


def record_header(offset: int, payload: bytes) -> bytes:
    """The 20-byte header of a record; the CRC covers the rest of the header and the payload."""
    n = len(payload)
    return _HDR.pack(MAGIC, 0, _crc32c_module.crc32c(payload, _crc(_AFTER_CRC.pack(n, offset))), n, offset)


def encode_record(offset: int, payload: bytes) -> bytes:
    return record_header(offset, payload) + payload


@dataclass(eq=False)  # identity semantics: segments are compared with `is`/`in`
class _Segment:
    first_offset: int
    path: Path
    offsets: array = field(default_factory=lambda: array("q"))  # record offsets, increasing
    positions: array = field(default_factory=lambda: array("Q"))  # file position of each header
    lengths: array = field(default_factory=lambda: array("I"))  # payload length of each record
    released: bytearray = field(default_factory=bytearray)  # 1 = no longer kept
    kept_count: int = 0
    kept_bytes: int = 0  # framed bytes of kept records
    size: int = 0  # file size including the unflushed buffer
    read_fd: int | None = None

    def index_of(self, offset: int) -> int:
        """Position of ``offset`` in this segment's arrays, or -1."""
        n = len(self.offsets)
        if n == 0:
            return -1
        i = offset - self.offsets[0]
        if 0 <= i < n and self.offsets[i] == offset:
            return i  # dense segment: direct
        i = bisect.bisect_left(self.offsets, offset)
        return i if i < n and self.offsets[i] == offset else -1

    def add(self, offset: int, position: int, length: int) -> None:
        self.offsets.append(offset)
        self.positions.append(position)
        self.lengths.append(length)
        self.released.append(0)
        self.kept_count += 1
        self.kept_bytes += HEADER_BYTES + length

    def add_run(self, first_offset: int, positions: list[int], lengths: list[int]) -> None:
        """``add`` of the records ``first_offset``, ``first_offset + 1``, ... at once (one call
        per column instead of an append per record and column)."""
        count = len(positions)
        self.offsets.fromlist(list(range(first_offset, first_offset + count)))
        self.positions.fromlist(positions)
        self.lengths.fromlist(lengths)
        self.released.extend(bytes(count))
        self.kept_count += count
        self.kept_bytes += HEADER_BYTES * count + sum(lengths)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """A run of framed records in one segment file (``MessageStore.plan_read``)."""

    path: Path
    position: int
    length: int
    records: int
    next_offset: int  # the offset after the run's last record


@dataclass(frozen=True, slots=True)
class RecordRead:
    """Where one record lies in a segment file (``MessageStore.plan_get``)."""

    path: Path
    position: int  # of its header
    length: int  # of its payload
    offset: int


@dataclass(eq=False)
class StoreSyncJob:
    """What one ``begin_sync`` found to make durable; see ``MessageStore.run_sync_job``."""

    directory: Path
    segments: list[tuple[_Segment, Path, int]]  # (segment, its path, size written at begin)
    dir_dirty: bool
    meta: tuple[int, int] | None  # (low-water mark, sync point) to persist; None: unchanged


class MessageStore:
    def __init__(
        self,
        directory: Path,
        segment_bytes: int = 16 << 20,
        ledger: SyncLedger | Path | str | None = None,
        cache_bytes: int = 64 << 20,
        write_buffer_bytes: int = 1 << 20,
        compact_below_ratio: float = 0.25,
    ) -> None:
        invariant(segment_bytes >= 64, "segment_bytes too small")
        invariant(cache_bytes >= 0 and write_buffer_bytes > 0, "bad buffer bounds")
        invariant(0.0 <= compact_below_ratio < 1.0, "compact_below_ratio must be in [0, 1)")
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.cache_bytes = cache_bytes
        self.write_buffer_bytes = write_buffer_bytes
        self.compact_below_ratio = compact_below_ratio
        self._ledger = SyncLedger(Path(ledger)) if isinstance(ledger, Path | str) else ledger
        self.next_offset = 0
        self.low_water = 0
        self._segments: list[_Segment] = []
        self._firsts: list[int] = []  # first_offset of each segment, for bisect
        self._write_fd: int | None = None  # the last segment's, opened lazily
        self._flushed = 0  # bytes of the last segment already written to its file
        self._buffer = bytearray()
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_used = 0
        self._synced_low_water = 0  # as written in store.meta
        self._synced_next = 0  # sync point as written in store.meta: offsets below are durable
        self._unsynced: list[_Segment] = []  # earlier segments written since the last sync
        self._synced_sizes: dict[Path, int] = {}  # known durable length per segment file
        self._opened = False
        self.corruption: StoreCorruption | None = None  # the damage found, at open or on a read
        # Told about damage a read finds (instead of raising into the reader); see the module doc.
        self.on_corruption: Callable[[StoreCorruption], None] | None = None
        self._dir_dirty = False  # a segment was created since the directory was last fsynced
        self._reclaim_holds = 0  # snapshot transfers reading this store: nothing is reclaimed

    # ------------------------------------------------------------------ recovery

    def open(self, expected_next_offset: int | None = None) -> None:
        """Recover: index every segment, verify every CRC, cut an unsynced damaged tail.

        ``expected_next_offset`` (the snapshot's next offset) is optional: the store's own sync
        point already says which records were durable. Raises ``StoreCorruption``, after which the
        store is closed and empty (``get`` finds nothing, ``reclaim`` does nothing) and touches no
        file again."""
        try:
            self._open(expected_next_offset)
        except StoreCorruption as exc:
            self.close()
            self._segments, self._firsts, self._unsynced = [], [], []
            self.next_offset = self.low_water = 0
            self.corruption = exc
            raise

    def _open(self, expected_next_offset: int | None) -> None:
        invariant(not self._opened, "store opened twice")
        self._opened = True
        ensure_dir(self.directory)
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # unfinished copy-forward or meta write
        files = []
        for entry in os.scandir(self.directory):
            m = _SEGMENT_RE.match(entry.name)
            if m:
                files.append((int(m.group(1)), Path(entry.path)))
        files.sort()
        persisted_low, persisted_next = self._read_meta()
        self._synced_low_water, self._synced_next = persisted_low, persisted_next
        sync_point = max(expected_next_offset or 0, persisted_next)

        if not files:
            if sync_point:
                raise StoreCorruption(
                    self.directory, 0, f"no segments, but offsets below {sync_point} were synced"
                )
            self.next_offset = self.low_water = persisted_low
            return

        prev = -1  # last valid offset seen
        gap_top = files[0][0]  # every offset below this is missing
        for i, (first, path) in enumerate(files):
            limit = files[i + 1][0] if i + 1 < len(files) else None
            seg = _Segment(first, path)
            cut = self._recover_segment(seg, limit, prev, sync_point)
            self._segments.append(seg)
            self._firsts.append(first)
            if seg.offsets:
                lo = seg.offsets[0]
                if lo != prev + 1:
                    gap_top = lo
                if seg.offsets[-1] - lo != len(seg.offsets) - 1:  # sparse (offsets strictly increase)
                    for j in range(1, len(seg.offsets)):
                        if seg.offsets[j] != seg.offsets[j - 1] + 1:
                            gap_top = seg.offsets[j]
                prev = seg.offsets[-1]
            if cut:
                for _first, later in files[i + 1 :]:
                    later.unlink()
                    if self._ledger is not None:
                        self._ledger.forget(later)
                fsync_dir(self.directory)
                break
        last = self._segments[-1]
        self.next_offset = max(prev + 1, last.first_offset)
        if prev + 1 < last.first_offset:
            gap_top = last.first_offset
        if self.next_offset < sync_point:
            raise StoreCorruption(
                last.path,
                last.size,
                f"store ends at offset {self.next_offset}, offsets below {sync_point} were synced",
            )
        self.low_water = min(max(gap_top, persisted_low), self.next_offset)
        self._flushed = last.size
        # Records recovered from the page cache of a killed process may not be durable yet; make
        # them so before anything builds on them (see WriteAheadLog.open). Segments wholly below
        # the sync point were synced by that sync already.
        for seg in self._segments:
            if seg is not last and seg.offsets and seg.offsets[-1] < persisted_next:
                self._synced_sizes[seg.path] = seg.size
                continue
            fdatasync_path(seg.path)
            self._mark_synced(seg)

    def _recover_segment(self, seg: _Segment, limit: int | None, prev: int, sync_point: int) -> bool:
        """Index one segment; return True if its tail was cut (later segments are then dropped)."""
        data = seg.path.read_bytes()
        mv = memoryview(data)
        n = len(data)
        p = 0
        last_valid = prev
        while p < n:
            end = self._valid_end(mv, p, max(last_valid, seg.first_offset - 1), limit)
            if end > 0:
                offset = _HDR.unpack_from(mv, p)[4]
                seg.add(offset, p, end - p - HEADER_BYTES)
                last_valid = offset
                p = end
                continue
            # The damaged record's offset is above the last valid one and, in this segment, at
            # least its first offset (every segment below it may have been reclaimed, its
            # records all released: then the segment's name is the only lower bound).
            if max(last_valid, seg.first_offset - 1) + 1 < sync_point:
                # The damaged record may hold an offset below the sync point: synced data.
                raise StoreCorruption(seg.path, p, f"invalid record before the sync point {sync_point}")
            # Unsynced tail: pages may have reached the disk out of order, so valid-looking
            # records after the damage are cut too; the WAL re-applies all of them.
            truncate_durably(seg.path, p)
            if self._ledger is not None:
                self._ledger.record(seg.path, p)
            seg.size = p
            return True
        seg.size = n
        return False

    @staticmethod
    def _valid_end(mv: memoryview, p: int, after: int, limit: int | None) -> int:
        """End of a valid record at ``p`` whose offset is above ``after`` (and below ``limit``), or 0."""
        if p + HEADER_BYTES > len(mv):
            return 0
        magic, flags, crc, length, offset = _HDR.unpack_from(mv, p)
        if magic != MAGIC or flags != 0 or length > MAX_RECORD_BYTES or offset <= after:
            return 0
        if limit is not None and offset >= limit:
            return 0
        end = p + HEADER_BYTES + length
        if end > len(mv) or _crc(mv[p + 8 : end]) != crc:
            return 0
        return end

    def _read_meta(self) -> tuple[int, int]:
        """(low_water, sync point) as of the last ``sync``; (0, 0) if never synced."""
        path = self.directory / META_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return (0, 0)
        if len(raw) != _META.size:
            raise StoreCorruption(path, 0, "store meta file has the wrong size")
        low, synced_next, crc = _META.unpack(raw)
        if _crc(raw[:16]) != crc:
            raise StoreCorruption(path, 0, "store meta file fails its checksum")
        return (int(low), int(synced_next))

    # ------------------------------------------------------------------ writing

    def append(self, offset: int, record: bytes) -> None:
        """Store ``record`` at ``offset``, which must be ``next_offset`` (buffered, not synced)."""
        self.append_many(((offset, record, None),))

    def append_many(self, appends: Iterable[tuple[int, bytes, Any]]) -> None:
        """Store the records of one apply, in order: (offset, record, anything) as ``Effects.appends``
        lists them. Each offset must be the next one (buffered, not synced)."""
        crc_more = _crc32c_module.crc32c
        pack_after, pack_header = _AFTER_CRC.pack, _HDR.pack
        seg = self._segments[-1] if self._segments else None
        # The index entries of the records added to ``seg`` by this call, added at once at the end
        # (or when a new segment starts): records from ``first`` on, dense.
        first = -1
        positions: list[int] = []
        lengths: list[int] = []
        for offset, record, _ in appends:
            n = len(record)
            if offset != self.next_offset or not self._opened or n > MAX_RECORD_BYTES:
                violated(f"append at {offset} (expected {self.next_offset}) of {n} bytes to a store "
                         f"{'open' if self._opened else 'not open'} (records up to {MAX_RECORD_BYTES} bytes)")
            # record_header(offset, record), inlined: once per stored message
            header = pack_header(MAGIC, 0, crc_more(record, _crc(pack_after(n, offset))), n, offset)
            size = HEADER_BYTES + n
            if seg is None or ((seg.offsets or positions) and seg.size + size > self.segment_bytes):
                if positions:
                    assert seg is not None
                    seg.add_run(first, positions, lengths)
                    positions, lengths = [], []
                seg = self._new_segment(offset)
            if not positions:
                first = offset
            positions.append(seg.size)
            lengths.append(n)
            seg.size += size
            self.next_offset = offset + 1
            if n >= WRITEV_RECORD_BYTES:
                self._flush(header, record)  # from its own buffer, after what is buffered before it
            else:
                buffer = self._buffer
                buffer += header
                buffer += record  # copied once, straight into the write buffer
                if len(buffer) >= self.write_buffer_bytes:
                    self._flush()
            if self.cache_bytes:
                self._cache[offset] = record
                self._cache_used += n
                while self._cache_used > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self._cache_used -= len(old)
        if positions:
            assert seg is not None
            seg.add_run(first, positions, lengths)

    def _new_segment(self, first_offset: int) -> _Segment:
        if self._segments and self._segments[-1].size > self._synced_size(self._segments[-1]):
            self._unsynced.append(self._segments[-1])
        self._close_writer()
        path = self.directory / segment_name(first_offset)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        # Its directory entry becomes durable with the next sync, with its records: nothing in it
        # is durable before that, and an fsync here would stall the apply that rolled the segment.
        self._dir_dirty = True
        if self._ledger is not None:
            self._ledger.record(path, 0)
        seg = _Segment(first_offset, path)
        self._segments.append(seg)
        self._firsts.append(first_offset)
        self._write_fd = fd
        self._flushed = 0
        return seg

    def _close_writer(self) -> None:
        """Flush the last segment's buffer and close its write descriptor (no fsync)."""
        self._flush()
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def _flush(self, *tail: bytes) -> None:
        """Write the buffer, then ``tail`` (a large record's header and body, written from their own
        buffers by one writev instead of being copied into the buffer first)."""
        if not self._buffer and not tail:
            return
        seg = self._segments[-1]
        if self._write_fd is None:
            self._write_fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND)
        if tail:
            self._flushed += writev_all(self._write_fd, [self._buffer, *tail])
        else:
            write_all(self._write_fd, self._buffer)
            self._flushed += len(self._buffer)
        self._buffer = bytearray()
        invariant(self._flushed == seg.size, "flushed size disagrees with the segment index")

    def _synced_size(self, seg: _Segment) -> int:
        return self._synced_sizes.get(seg.path, 0)

    def sync(self) -> None:
        """Write buffered records, fdatasync the written segments, persist the low-water mark."""
        invariant(self._opened, "store not open")
        self._flush()
        for old in self._unsynced:
            if old in self._segments:
                fdatasync_path(old.path)
                self._mark_synced(old)
        self._unsynced.clear()
        if self._segments:
            seg = self._segments[-1]
            fd = (
                self._write_fd if self._write_fd is not None else os.open(seg.path, os.O_WRONLY | os.O_APPEND)
            )
            os.fdatasync(fd)
            if fd != self._write_fd:
                os.close(fd)
            self._mark_synced(seg)
        if self._dir_dirty:
            fsync_dir(self.directory)
            self._dir_dirty = False
        if self.low_water != self._synced_low_water or self.next_offset != self._synced_next:
            self._write_meta(self.next_offset)

    def flush(self) -> None:
        """Write buffered records to their segment file (no fdatasync)."""
        invariant(self._opened, "store not open")
        self._flush()

    def begin_sync(self) -> StoreSyncJob:
        """``sync`` in three steps (module doc): write what is buffered and list what must become
        durable for every offset below ``next_offset`` (now) to be; ``run_sync_job`` does the IO
        on any thread, then ``finish_sync`` (or ``abort_sync`` if it failed) here."""
        invariant(self._opened, "store not open")
        self._flush()
        segs = [s for s in self._unsynced if s in self._segments]
        self._unsynced = []
        if self._segments and self._segments[-1] not in segs:
            segs.append(self._segments[-1])
        dir_dirty = self._dir_dirty
        self._dir_dirty = False
        meta = None
        if self.low_water != self._synced_low_water or self.next_offset != self._synced_next:
            meta = (self.low_water, self.next_offset)
        return StoreSyncJob(self.directory, [(s, s.path, s.size) for s in segs], dir_dirty, meta)

    def run_sync_job(self, job: StoreSyncJob) -> None:
        """The IO of a sync (any thread): fdatasync each listed segment (one reclaimed since holds
        nothing anyone keeps), fsync the directory, write ``store.meta``. Touches no state."""
        for _seg, path, _size in job.segments:
            try:
                fdatasync_path(path)
            except FileNotFoundError:
                pass
        if job.dir_dirty:
            fsync_dir(job.directory)
        if job.meta is not None:
            low, sync_point = job.meta
            head = struct.pack("<qq", low, sync_point)
            write_file_atomically(job.directory / META_FILE, head + struct.pack("<I", _crc(head)))

    def finish_sync(self, job: StoreSyncJob) -> None:
        """Record what ``run_sync_job`` made durable (owner's thread)."""
        for seg, path, size in job.segments:
            if seg in self._segments and seg.path == path and size > self._synced_size(seg):
                self._synced_sizes[path] = size
                if self._ledger is not None:
                    self._ledger.record(path, size)
        if job.meta is not None:
            self._synced_low_water, self._synced_next = job.meta
            if self._ledger is not None:
                self._ledger.record(job.directory / META_FILE, _META.size)

    def abort_sync(self, job: StoreSyncJob) -> None:
        """``run_sync_job`` failed: what it listed is still to be synced."""
        for seg, _path, _size in job.segments:
            if seg in self._segments and seg not in self._unsynced and seg is not self._segments[-1]:
                self._unsynced.append(seg)
        if job.dir_dirty:
            self._dir_dirty = True

    # ------------------------------------------------------------------ snapshot transfers

    def hold_reclaim(self) -> None:
        """Keep every segment until ``release_reclaim``: a snapshot being sent reads from them."""
        self._reclaim_holds += 1

    def release_reclaim(self) -> None:
        invariant(self._reclaim_holds > 0, "release_reclaim without hold_reclaim")
        self._reclaim_holds -= 1

    def plan_read(self, from_offset: int, to_offset: int, max_bytes: int) -> ReadPlan | None:
        """Where the records present in [``from_offset``, ``to_offset``) start, released ones
        included: one contiguous run of framed records in one segment file, at most ``max_bytes``
        (at least one record), to be read with ``read_plan`` on any thread while the store is
        held (``hold_reclaim``). None when no record is left in the range."""
        to_offset = min(to_offset, self.next_offset)
        k = max(0, bisect.bisect_right(self._firsts, from_offset) - 1)
        for seg in self._segments[k:]:
            if seg.first_offset >= to_offset:
                return None
            i = bisect.bisect_left(seg.offsets, from_offset)
            n = len(seg.offsets)
            if i >= n:
                continue
            if seg.offsets[i] >= to_offset:
                return None
            j = i
            length = HEADER_BYTES + seg.lengths[i]
            while j + 1 < n and seg.offsets[j + 1] < to_offset:
                more = HEADER_BYTES + seg.lengths[j + 1]
                if length + more > max_bytes:
                    break
                length += more
                j += 1
            start = seg.positions[i]
            if seg is self._segments[-1] and start + length > self._flushed:
                self._flush()  # the run must be in the file, not only in the write buffer
            return ReadPlan(seg.path, start, length, j - i + 1, seg.offsets[j] + 1)
        return None

    @staticmethod
    def read_plan(plan: ReadPlan) -> bytes:
        """The bytes of a ``plan_read`` run (any thread): framed records exactly as stored. Not
        checked here: whoever parses them checks each record's CRC."""
        fd = os.open(plan.path, os.O_RDONLY)
        try:
            data = os.pread(fd, plan.length, plan.position)
        finally:
            os.close(fd)
        if len(data) != plan.length:
            raise StoreCorruption(plan.path, plan.position, f"{len(data)} of {plan.length} bytes could be read")
        return data

    def append_received(self, offset: int, record: bytes) -> None:
        """Store a record received with a leader's snapshot: ``offset`` may skip offsets (released
        at the leader), never go back. ``ValueError`` for an offset that goes back."""
        if offset < self.next_offset:
            raise ValueError(f"record offset {offset} is below the next offset {self.next_offset}")
        self.next_offset = offset
        self.append_many(((offset, record, None),))

    def end_received(self, next_offset: int) -> None:
        """The received store's next offset is ``next_offset`` (the snapshot's): the files must say
        so even when the last records were released at the leader (an empty segment named after it)."""
        if next_offset < self.next_offset:
            raise ValueError(f"next offset {next_offset} is below the last record {self.next_offset - 1}")
        if next_offset == self.next_offset:
            return
        last = self._segments[-1] if self._segments else None
        self.next_offset = next_offset
        if last is None or last.first_offset != next_offset:
            self._new_segment(next_offset)

    def relocate(self, directory: Path) -> None:
        """The store's directory was renamed to ``directory`` (after ``sync``): its files are
        found there from now on. The ledger (when kept) learns their synced lengths under their
        new names, which may be those of another store's files it recorded before (the replica's
        store an install moved aside): a crash must cut these files to their own lengths."""
        self._close_writer()
        self.directory = Path(directory)
        moved: list[tuple[Path, int]] = []
        for seg in self._segments:
            if seg.read_fd is not None:
                os.close(seg.read_fd)
                seg.read_fd = None
            new_path = self.directory / seg.path.name
            if seg.path in self._synced_sizes:
                self._synced_sizes[new_path] = self._synced_sizes.pop(seg.path)
            seg.path = new_path
            moved.append((new_path, self._synced_sizes.get(new_path, 0)))
        if self._ledger is not None:
            meta = self.directory / META_FILE
            if meta.exists():
                moved.append((meta, _META.size))
            for path, _size in moved:
                self._ledger.forget(path)  # a new file under an old name: recorded afresh
            self._ledger.record_many(moved)

    @property
    def ledger(self) -> SyncLedger | None:
        """The test harness's record of synced lengths this store keeps (None in production)."""
        return self._ledger

    def _mark_synced(self, seg: _Segment) -> None:
        """``seg`` was just fdatasynced at its current size."""
        self._synced_sizes[seg.path] = seg.size
        if self._ledger is not None:
            self._ledger.record(seg.path, seg.size)

    def _write_meta(self, sync_point: int) -> None:
        """Persist the low-water mark and ``sync_point`` (every offset below it is durable)."""
        head = struct.pack("<qq", self.low_water, sync_point)
        path = self.directory / META_FILE
        write_file_atomically(path, head + struct.pack("<I", _crc(head)))
        self._synced_low_water, self._synced_next = self.low_water, sync_point
        if self._ledger is not None:
            self._ledger.record(path, _META.size)

    # ------------------------------------------------------------------ reading

    def _locate(self, offset: int) -> tuple[_Segment, int] | None:
        k = bisect.bisect_right(self._firsts, offset) - 1
        if k < 0:
            return None
        seg = self._segments[k]
        i = seg.index_of(offset)
        return (seg, i) if i >= 0 else None

    def get(self, offset: int) -> bytes | None:
        """The record at ``offset``; None if released, reclaimed or never written."""
        if offset < 0 or offset >= self.next_offset:
            return None
        hit = self._cache.get(offset)
        if hit is not None:
            return hit
        found = self._locate(offset)
        if found is None:
            return None
        seg, i = found
        if seg.released[i]:
            return None
        try:
            return self._read(seg, i)
        except StoreCorruption as exc:
            self._damaged(exc)
            return None

    def plan_get(self, offset: int) -> RecordRead | None:
        """Where the record at ``offset`` lies when ``get`` would read it from a segment file;
        None when it needs no disk read (cached, still in the write buffer) or is not there."""
        if offset < 0 or offset >= self.next_offset or offset in self._cache:
            return None
        found = self._locate(offset)
        if found is None:
            return None
        seg, i = found
        if seg.released[i]:
            return None
        pos = seg.positions[i]
        length = seg.lengths[i]
        if seg is self._segments[-1] and pos + HEADER_BYTES + length > self._flushed:
            return None
        return RecordRead(seg.path, pos, length, offset)

    @staticmethod
    def read_records(reads: list[RecordRead]) -> list[bytes | None]:
        """The payloads of ``plan_get`` results (any thread; one descriptor per file, opened
        here). None for a record that cannot be read or fails its checks: the owner reads that
        one with ``get`` (which reports damage) rather than trust a file that may have changed."""
        out: list[bytes | None] = []
        fds: dict[Path, int] = {}
        try:
            for r in reads:
                try:
                    fd = fds.get(r.path)
                    if fd is None:
                        fd = fds[r.path] = os.open(r.path, os.O_RDONLY)
                    frame = os.pread(fd, HEADER_BYTES + r.length, r.position)
                except OSError:
                    out.append(None)
                    continue
                if len(frame) != HEADER_BYTES + r.length:
                    out.append(None)
                    continue
                magic, _flags, crc, flen, offset = _HDR.unpack_from(frame, 0)
                ok = magic == MAGIC and offset == r.offset and flen == r.length and _crc(memoryview(frame)[8:]) == crc
                out.append(frame[HEADER_BYTES:] if ok else None)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def _damaged(self, exc: StoreCorruption) -> None:
        """A read found damage: remember it and tell the owner, or raise when nobody listens."""
        if self.corruption is None:
            self.corruption = exc
        if self.on_corruption is None:
            raise exc
        self.on_corruption(exc)

    def _read(self, seg: _Segment, i: int) -> bytes:
        pos = seg.positions[i]
        length = seg.lengths[i]
        end = pos + HEADER_BYTES + length
        last = self._segments[-1]
        if seg is last and end > self._flushed:
            start = pos - self._flushed
            frame = bytes(self._buffer[start : start + HEADER_BYTES + length])
        else:
            if seg.read_fd is None:
                seg.read_fd = os.open(seg.path, os.O_RDONLY)
            frame = os.pread(seg.read_fd, HEADER_BYTES + length, pos)
        magic, flags, crc, flen, offset = _HDR.unpack_from(frame, 0)
        if (
            len(frame) != HEADER_BYTES + length
            or magic != MAGIC
            or offset != seg.offsets[i]
            or flen != length
            or _crc(memoryview(frame)[8:]) != crc
        ):
            raise StoreCorruption(seg.path, pos, f"record {seg.offsets[i]} fails its checksum on read")
        return frame[HEADER_BYTES:]

    def scan(self, from_offset: int, max_count: int, max_bytes: int) -> list[tuple[int, bytes]]:
        """Present records at offsets >= ``from_offset`` in order; at least one if any (size bounds)."""
        out: list[tuple[int, bytes]] = []
        if max_count <= 0 or from_offset >= self.next_offset:
            return out
        used = 0
        k = max(0, bisect.bisect_right(self._firsts, from_offset) - 1)
        for seg in self._segments[k:]:
            i = bisect.bisect_left(seg.offsets, from_offset)
            n = len(seg.offsets)
            while i < n:
                if not seg.released[i]:
                    offset = seg.offsets[i]
                    record = self._cache.get(offset)
                    if record is None:
                        try:
                            record = self._read(seg, i)
                        except StoreCorruption as exc:
                            self._damaged(exc)
                            return out  # what came before the damage, in order
                    if out and used + len(record) > max_bytes:
                        return out
                    out.append((offset, record))
                    used += len(record)
                    if len(out) >= max_count:
                        return out
                i += 1
        return out

    # ------------------------------------------------------------------ retention

    def release(self, offsets: Iterable[int]) -> None:
        """Mark offsets as no longer kept; unknown or already gone offsets are ignored."""
        top = -1
        for offset in offsets:
            if offset >= self.next_offset:
                violated(f"release of unwritten offset {offset}")
            found = self._locate(offset)
            if found is None:
                continue
            seg, i = found
            if seg.released[i]:
                continue
            seg.released[i] = 1
            seg.kept_count -= 1
            seg.kept_bytes -= HEADER_BYTES + seg.lengths[i]
            old = self._cache.pop(offset, None)
            if old is not None:
                self._cache_used -= len(old)
            if offset > top:
                top = offset
        if top >= self.low_water:
            self.low_water = top + 1

    def kept_below(self, offset: int) -> list[int]:
        """Offsets below ``offset`` whose records this store still keeps, ascending. Recovery
        releases those its state no longer keeps: the low-water mark is above every release, not
        below every kept record, so records released before a restart can sit under it."""
        out: list[int] = []
        for seg in self._segments:
            if seg.first_offset >= offset:
                break
            if seg.kept_count == 0:
                continue
            released = seg.released
            for i, o in enumerate(seg.offsets):
                if o >= offset:
                    break
                if not released[i]:
                    out.append(o)
        return out

    def release_below(self, offset: int) -> None:
        """Release every offset below ``offset``."""
        offset = min(offset, self.next_offset)
        for seg in self._segments:
            if seg.first_offset >= offset:
                break
            stop = bisect.bisect_left(seg.offsets, offset)
            if stop == len(seg.offsets) and seg.kept_count == 0:
                continue
            for i in range(stop):
                if not seg.released[i]:
                    seg.released[i] = 1
                    seg.kept_count -= 1
                    seg.kept_bytes -= HEADER_BYTES + seg.lengths[i]
        while self._cache:
            first = next(iter(self._cache))
            if first >= offset:
                break
            self._cache_used -= len(self._cache.pop(first))
        if offset > self.low_water:
            self.low_water = offset

    def reclaim(self) -> int:
        """Delete segments with nothing kept; copy forward survivors of mostly released ones.
        Nothing while a snapshot transfer holds the store (``hold_reclaim``)."""
        if self._reclaim_holds:
            return 0
        reclaimed = 0
        survivors: list[_Segment] = []
        removed_any = False
        damage: StoreCorruption | None = None
        last = self._segments[-1] if self._segments else None
        for seg in self._segments:
            if seg is last or self.corruption is not None:
                survivors.append(seg)  # the segment being appended to stays; a damaged store too
            elif seg.kept_count == 0:
                self._drop_segment(seg)
                reclaimed += seg.size
                removed_any = True
            elif seg.kept_bytes < self.compact_below_ratio * seg.size:
                before = seg.size
                try:
                    survivors.append(self._copy_forward(seg))
                except StoreCorruption as exc:  # a survivor failed its checksum: keep the file
                    survivors.append(seg)
                    damage = self.corruption = exc
                    continue
                reclaimed += before - survivors[-1].size
            else:
                survivors.append(seg)
        if removed_any:
            fsync_dir(self.directory)
        self._segments = survivors
        self._firsts = [s.first_offset for s in survivors]
        if damage is not None:
            self._damaged(damage)  # the index is consistent again before anyone hears of it
        return reclaimed

    def _drop_segment(self, seg: _Segment) -> None:
        if seg.read_fd is not None:
            os.close(seg.read_fd)
            seg.read_fd = None
        seg.path.unlink()
        self._synced_sizes.pop(seg.path, None)  # a new file under this name starts from nothing
        if self._ledger is not None:
            self._ledger.forget(seg.path)

    def _copy_forward(self, seg: _Segment) -> _Segment:
        """Rewrite ``seg`` with only its kept records: tmp, fsync, rename over, fsync dir."""
        new = _Segment(seg.first_offset, seg.path)
        out = bytearray()
        for i in range(len(seg.offsets)):
            if seg.released[i]:
                continue
            record = self._read(seg, i)
            new.add(seg.offsets[i], len(out), len(record))
            out += encode_record(seg.offsets[i], record)
        new.size = len(out)
        tmp = seg.path.with_name(seg.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, out)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if seg.read_fd is not None:
            os.close(seg.read_fd)
            seg.read_fd = None
        os.replace(tmp, seg.path)
        fsync_dir(self.directory)
        if self._ledger is not None:
            self._ledger.record(seg.path, new.size)
        return new

    # ------------------------------------------------------------------ recovery helpers

    def truncate_from(self, offset: int) -> None:
        """Drop offsets >= ``offset`` (the WAL re-applies them after a snapshot). Durable."""
        invariant(self._opened, "store not open")
        invariant(offset <= self.next_offset, f"truncate_from({offset}) above next offset {self.next_offset}")
        if offset == self.next_offset:
            return
        # Recovery only (before anything is served): with no snapshot yet the WAL re-applies from
        # offset 0, possibly below a low-water mark that was never persisted by a snapshot.
        self.low_water = min(self.low_water, offset)
        if offset < self._synced_next:
            # Lower the sync point first: records re-written from here on are not synced yet, and
            # a crash must not find them "below the sync point" (false corruption).
            self._write_meta(offset)
        self._close_writer()
        while self._segments and self._segments[-1].first_offset >= offset and len(self._segments) > 1:
            self._drop_segment(self._segments.pop())
            self._firsts.pop()
        seg = self._segments[-1]
        cut = bisect.bisect_left(seg.offsets, offset)
        position = seg.positions[cut] if cut < len(seg.offsets) else seg.size
        for i in range(cut, len(seg.offsets)):
            if not seg.released[i]:
                seg.kept_count -= 1
                seg.kept_bytes -= HEADER_BYTES + seg.lengths[i]
        del seg.offsets[cut:], seg.positions[cut:], seg.lengths[cut:], seg.released[cut:]
        if seg.read_fd is not None:
            os.close(seg.read_fd)
            seg.read_fd = None
        truncate_durably(seg.path, position)
        fsync_dir(self.directory)
        if self._synced_sizes.get(seg.path, 0) > position:
            self._synced_sizes[seg.path] = position  # what follows is written again, synced again
        if self._ledger is not None:
            self._ledger.record(seg.path, position)
        seg.size = position
        self._flushed = position
        if seg.first_offset > offset:
            # Only one segment was left and it starts above `offset`: rename keeps names honest.
            invariant(not seg.offsets, "segment above the truncation point still holds records")
            self._drop_segment(self._segments.pop())
            self._firsts.pop()
            fsync_dir(self.directory)
        for k in [k for k in self._cache if k >= offset]:
            self._cache_used -= len(self._cache.pop(k))
        self.next_offset = offset
        last = self._segments[-1] if self._segments else None
        if last is None or (
            last.first_offset != offset and (not last.offsets or last.offsets[-1] != offset - 1)
        ):
            # The files must still say where the next offset is: the last segment's last record
            # (or its name, when empty). Copy-forward may have dropped released records just
            # below `offset`, so start an empty segment named after it.
            self._new_segment(offset)
            fsync_dir(self.directory)
            self._dir_dirty = False

    def reset(self, next_offset: int) -> None:
        """Drop everything and continue at ``next_offset`` (a replica that installed a snapshot)."""
        invariant(self._opened, "store not open")
        if next_offset < self._synced_next:
            self.low_water = min(self.low_water, next_offset)
            self._write_meta(next_offset)  # see truncate_from
        self._close_writer()
        for seg in self._segments:
            self._drop_segment(seg)
        self._segments = []
        self._firsts = []
        self._cache.clear()
        self._cache_used = 0
        fsync_dir(self.directory)
        self.next_offset = next_offset
        self.low_water = next_offset
        self._new_segment(next_offset)
        self._write_meta(next_offset)

    # ------------------------------------------------------------------ misc

    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def kept_count(self) -> int:
        return sum(s.kept_count for s in self._segments)

    def segment_paths(self) -> list[Path]:
        return [s.path for s in self._segments]

    def close(self) -> None:
        """Write buffered records (no fsync: ``sync`` is the durability point) and close files."""
        if not self._opened:
            return
        self._close_writer()
        for seg in self._segments:
            if seg.read_fd is not None:
                os.close(seg.read_fd)
                seg.read_fd = None
        self._opened = False
