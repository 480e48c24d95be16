"""A simulated disk: a durable image plus pending (written, not yet synced) records.

The host writes one record per Ready (its entries and hard state) or per snapshot. ``sync()``
moves pending records to the durable image. Each record carries the number of the sync batch it
was written in (``batch``), as the WAL's records do. A crash keeps a random prefix of the pending
records and may tear the last one kept (power loss mid-write); or it leaves a *page hole*: one
kept record other than the last is zeroed while the records after it survive, as when the pages
of an unfinished write reach the disk out of order. Bit flips hit synced records.

Every record carries a CRC32C of its body (a hard state inside also has its own CRC). Recovery
follows the WAL's rule: damage is a torn tail, and truncated from the first damaged record on, when
every record from there on belongs to the highest batch present (the write whose sync had not
returned; a record of a later batch would prove the damaged one synced). The simulator also knows
the durable length (``synced_count``, surviving a crash like a file's synced size), which the
WAL cannot: damage before it is always corruption here, so a bit flip in the last synced batch is
caught too. Corruption means the replica must stop voting until it is re-added.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import IntEnum

import msgspec

from moorline.hashing import crc32c
from moorline.raft import Entry, HardState, Snapshot

_ENTRIES = msgspec.msgpack.Encoder()
_SNAP_DEC = msgspec.msgpack.Decoder(Snapshot)


class RecordKind(IntEnum):
    BATCH = 1  # entries (possibly none) + optional hard state of one Ready
    SNAPSHOT = 2


@dataclass(slots=True)
class Record:
    """One WAL record. ``obj`` is the decoded form, trusted only when the CRC matches."""

    kind: RecordKind
    body: bytes
    crc: int
    entries: list[Entry] = field(default_factory=list)
    hard_state: HardState | None = None
    snapshot: Snapshot | None = None
    batch: int = 0  # the sync batch it was written in (set by SimDisk.write)

    def damaged(self, body: bytes) -> Record:
        """The same record, read back with ``body`` (its CRC and decoded form as written)."""
        return Record(self.kind, body, self.crc, self.entries, self.hard_state, self.snapshot, self.batch)

    def valid(self) -> bool:
        if crc32c(self.body) != self.crc:
            return False
        if self.hard_state is not None:
            # the hard state's own trailer is the last bytes of the body
            try:
                HardState.decode(self.body[len(self.body) - len(self.hard_state.encode()) :])
            except ValueError:
                return False
        return True


def batch_record(entries: list[Entry], hard_state: HardState | None) -> Record:
    body = _ENTRIES.encode(entries) if entries else b""
    if hard_state is not None:
        body += hard_state.encode()
    return Record(RecordKind.BATCH, body, crc32c(body), entries=entries, hard_state=hard_state)


def snapshot_record(snap: Snapshot) -> Record:
    body = _ENTRIES.encode(snap)
    return Record(RecordKind.SNAPSHOT, body, crc32c(body), snapshot=snap)


@dataclass(slots=True)
class DiskParams:
    sync_latency_ms_min: int = 0
    sync_latency_ms_max: int = 2
    torn_write_p: float = 0.5  # a crash tears the last kept pending write with this chance
    keep_pending_p: float = 0.5  # mean fraction of pending writes a crash keeps
    page_hole_p: float = 0.5  # a crash that keeps two or more pending writes, the last one whole,
    # zeroes one before it with this chance


@dataclass(slots=True)
class Recovery:
    records: list[Record]
    torn_tail_truncated: bool
    corrupt_at: int | None  # record number of the first corrupt record (replica must quarantine)
    synced_corruption_truncated: bool  # only with the bug switch: a synced bad record was cut
    readable: list[Record] = field(default_factory=list)  # on corruption: every valid record, in order


class SimDisk:
    """The storage device of one sim node (all of its replicas' records)."""

    def __init__(self, params: DiskParams) -> None:
        self.params = params
        self.durable: list[Record] = []
        self.pending: list[Record] = []
        self.synced_count = 0  # records known durable (the file's synced length)
        # durable "this replica's data was corrupt" marker (a marker file): a later rewrite of
        # the image (compaction) must not make the replica forget it may not vote
        self.corrupt_marker = False
        self.writes = 0
        self.syncs = 0

    def write(self, rec: Record) -> None:
        # Written after sync number ``syncs`` returned, durable with the next: that sync's batch.
        rec.batch = self.syncs
        self.pending.append(rec)
        self.writes += 1

    def sync(self) -> None:
        self.durable.extend(self.pending)
        self.pending.clear()
        self.synced_count = len(self.durable)
        self.syncs += 1

    def sync_latency_ms(self, rng: random.Random) -> int:
        p = self.params
        return rng.randint(p.sync_latency_ms_min, p.sync_latency_ms_max)

    def rewrite(self, records: list[Record]) -> None:
        """Replace the image atomically (write new file, fsync, rename, fsync dir). Only when
        nothing is pending, so no unsynced write is hidden by the rewrite."""
        assert not self.pending, "rewrite with pending writes"
        self.durable = list(records)
        self.synced_count = len(self.durable)

    def wipe(self) -> None:
        self.corrupt_marker = False
        self.durable = []
        self.pending = []
        self.synced_count = 0

    def crash(self, rng: random.Random) -> tuple[int, bool]:
        """Power loss: keep a random prefix of the pending writes, maybe tear the last one, maybe
        zero one before it (a page hole). Returns (number of pending writes lost, torn)."""
        n = len(self.pending)
        if n == 0:
            return 0, False
        keep = rng.randint(0, n) if rng.random() < self.params.keep_pending_p * 2 else 0
        kept = self.pending[:keep]
        torn = False
        if kept and rng.random() < self.params.torn_write_p:
            last = kept[-1]
            cut = rng.randint(0, max(0, len(last.body) - 1))
            kept[-1] = last.damaged(last.body[:cut])
            torn = True
        if not torn and len(kept) >= 2 and rng.random() < self.params.page_hole_p:
            # One damaged spot per crash (the last write torn, or a hole before it): enough for
            # the rule, since recovery cuts from the first damage on either way.
            i = rng.randrange(len(kept) - 1)
            kept[i] = kept[i].damaged(bytes(len(kept[i].body)))
            torn = True
        # kept writes reached the platter but are not known durable: they stay "pending"
        # until the restarted host syncs them.
        self.pending = kept
        return n - keep, torn

    def flip_bit(self, rng: random.Random) -> bool:
        """Flip one bit of a synced record (bit rot / misdirected write). False if none."""
        candidates = [i for i, r in enumerate(self.durable) if r.body]
        if not candidates:
            return False
        i = rng.choice(candidates)
        rec = self.durable[i]
        pos = rng.randrange(len(rec.body))
        flipped = bytearray(rec.body)
        flipped[pos] ^= 1 << rng.randrange(8)
        self.durable[i] = rec.damaged(bytes(flipped))
        return True

    def peek(self) -> list[Record] | None:
        """What ``recover()`` would read back now, without changing the image (None: it would
        find corruption). The simulator's checks use it to see a crashed node's durable log."""
        image = self.durable + self.pending
        bad = [i for i, r in enumerate(image) if not r.valid()]
        if not bad:
            return image
        first = bad[0]
        top = max(r.batch for r in image)
        if first >= self.synced_count and all(r.batch == top for r in image[first:]):
            return image[:first]
        return None

    def recover(self, truncate_synced_corruption: bool = False) -> Recovery:
        """Read the image back, applying the torn-tail rule."""
        image = self.durable + self.pending
        synced = self.synced_count
        bad = [i for i, r in enumerate(image) if not r.valid()]
        if not bad:
            return Recovery(image, False, None, False)
        first = bad[0]
        top = max(r.batch for r in image)
        if first >= synced and all(r.batch == top for r in image[first:]):
            # Confined to the last batch's unfinished write: a torn tail, wherever in it the damage
            # is (a page hole before records that survived included).
            self._truncate(first)
            return Recovery(image[:first], True, None, False)
        if truncate_synced_corruption:
            # BUG (test-only): treat corruption of synced data as if it were a torn tail.
            self._truncate(first)
            return Recovery(image[:first], True, None, True)
        bad_set = set(bad)
        readable = [r for i, r in enumerate(image) if i not in bad_set]
        return Recovery(image[:first], False, first, False, readable)

    def _truncate(self, at: int) -> None:
        image = self.durable + self.pending
        image = image[:at]
        self.durable = image[: min(at, self.synced_count)]
        self.pending = image[len(self.durable) :]
        self.synced_count = len(self.durable)
