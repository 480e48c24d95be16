"""A simulated disk: a durable image plus pending (written, not yet synced) records.

The host writes one record per Ready (its entries and hard state) or per snapshot. ``sync()``
moves pending records to the durable image. A crash keeps a random prefix of the pending
records and may tear the last one kept (power loss mid-write). Bit flips hit synced records.

Every record carries a CRC32C of its body (a hard state inside also has its own CRC). The
durable length (``synced_count``) survives a crash like a file's synced size does: recovery
may truncate only an invalid record at or after it with no valid record after it (a torn
tail). Anything else is corruption: the replica must stop voting until it is re-added.
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
        """Power loss: keep a random prefix of the pending writes, maybe tear the last one.
        Returns (number of pending writes lost, torn)."""
        n = len(self.pending)
        if n == 0:
            return 0, False
        keep = rng.randint(0, n) if rng.random() < self.params.keep_pending_p * 2 else 0
        kept = self.pending[:keep]
        torn = False
        if kept and rng.random() < self.params.torn_write_p:
            last = kept[-1]
            cut = rng.randint(0, max(0, len(last.body) - 1))
            kept[-1] = Record(
                last.kind, last.body[:cut], last.crc, last.entries, last.hard_state, last.snapshot
            )
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
        self.durable[i] = Record(rec.kind, bytes(flipped), rec.crc, rec.entries, rec.hard_state, rec.snapshot)
        return True

    def recover(self, truncate_synced_corruption: bool = False) -> Recovery:
        """Read the image back, applying the torn-tail rule."""
        image = self.durable + self.pending
        synced = self.synced_count
        bad = [i for i, r in enumerate(image) if not r.valid()]
        if not bad:
            return Recovery(image, False, None, False)
        first = bad[0]
        only_tail = first == len(image) - 1
        if first >= synced and only_tail:
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
