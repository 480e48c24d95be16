"""The storage interface the host implements over its WAL, and an in-memory implementation.

The core only *reads* stable state through ``Storage``; the host writes it while handling a
``Ready`` (append entries, set hard state, apply a snapshot) and tells the core through
``advance``. ``MemoryStorage`` is what the simulator and the tests use.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Protocol

from moorline.invariant import invariant
from moorline.raft.types import (
    CompactedError,
    ConfState,
    Entry,
    HardState,
    Snapshot,
    SnapshotMeta,
    SnapshotTemporarilyUnavailable,
    UnavailableError,
)

_DATA = attrgetter("data")


class Storage(Protocol):
    """Read access to a replica's stable log. All indexes are Raft indexes (first entry is 1)."""

    def initial_state(self) -> tuple[HardState, ConfState]:
        """Hard state, and the configuration as of the storage's snapshot (index first_index()-1).

        The core replays configuration entries stored after the snapshot by itself."""
        ...

    def entries(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        """Entries [lo, hi), at least one if lo < hi, stopping before ``max_bytes`` is exceeded.
        Raises CompactedError if lo < first_index(), UnavailableError if hi > last_index() + 1."""
        ...

    def term(self, index: int) -> int:
        """Term of entry ``index``; valid for first_index() - 1 (the snapshot) .. last_index()."""
        ...

    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def snapshot(self) -> Snapshot:
        """The most recent snapshot (may raise SnapshotTemporarilyUnavailable)."""
        ...


def limit_size(entries: list[Entry], max_bytes: int) -> list[Entry]:
    """The longest prefix within ``max_bytes``, but never empty if ``entries`` is not."""
    if len(entries) <= 1:
        return entries
    if sum(map(len, map(_DATA, entries))) + 24 * len(entries) <= max_bytes:
        return entries  # common case, summed without a Python-level loop
    total = 0
    for n, e in enumerate(entries):
        total += len(e.data) + 24
        if total > max_bytes and n > 0:
            return entries[:n]
    return entries


class MemoryStorage:
    """An in-memory ``Storage``. ``_ents[0]`` is a dummy entry holding the snapshot's index/term."""

    __slots__ = ("_hard_state", "_snapshot", "_ents", "_conf_state")

    def __init__(self, conf_state: ConfState | None = None) -> None:
        self._hard_state = HardState()
        self._conf_state = conf_state if conf_state is not None else ConfState()
        self._snapshot = Snapshot(meta=SnapshotMeta(conf_state=self._conf_state))
        self._ents: list[Entry] = [Entry(term=0, index=0)]

    # -- Storage protocol ------------------------------------------------------------------
    def initial_state(self) -> tuple[HardState, ConfState]:
        return self._hard_state, self._snapshot.meta.conf_state

    def entries(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        offset = self._ents[0].index
        if lo <= offset:
            raise CompactedError(f"entries({lo}) compacted at {offset}")
        if hi > self.last_index() + 1:
            raise UnavailableError(f"entries({hi}) beyond last index {self.last_index()}")
        return limit_size(self._ents[lo - offset : hi - offset], max_bytes)

    def term(self, index: int) -> int:
        offset = self._ents[0].index
        if index < offset:
            raise CompactedError(f"term({index}) compacted at {offset}")
        if index - offset >= len(self._ents):
            raise UnavailableError(f"term({index}) beyond last index")
        return self._ents[index - offset].term

    def first_index(self) -> int:
        return self._ents[0].index + 1

    def last_index(self) -> int:
        return self._ents[0].index + len(self._ents) - 1

    def snapshot_index(self) -> int:
        """The index of the last recorded snapshot (0: none)."""
        return self._snapshot.meta.index

    def snapshot(self) -> Snapshot:
        if self._snapshot.meta.index < self._ents[0].index:
            # The host compacted past its last snapshot (a group of one voter keeps no entries
            # nobody will ask for): that snapshot no longer joins up with the log. The host takes
            # a new one; until then a member that needs one waits.
            raise SnapshotTemporarilyUnavailable("log compacted past the last snapshot")
        return self._snapshot

    # -- host-side writes --------------------------------------------------------------------
    def hard_state(self) -> HardState:
        return self._hard_state

    def set_hard_state(self, hs: HardState) -> None:
        self._hard_state = hs

    def set_conf_state(self, cs: ConfState) -> None:
        """Record the configuration the host has applied (informational: ``initial_state``
        returns the snapshot's configuration, and the core replays later conf entries)."""
        self._conf_state = cs

    def conf_state(self) -> ConfState:
        return self._conf_state

    def append(self, entries: list[Entry]) -> None:
        """Append, replacing any existing suffix from the first new index on."""
        if not entries:
            return
        first = self.first_index()
        last_new = entries[-1].index
        if last_new < first:
            return  # entirely compacted already
        if entries[0].index < first:
            entries = entries[first - entries[0].index :]
        offset = self._ents[0].index
        at = entries[0].index - offset
        if not (at <= len(self._ents)):
            invariant(False, f"append leaves a gap: {entries[0].index} after {self.last_index()}")
        if at < len(self._ents):
            del self._ents[at:]
        self._ents.extend(entries)

    def apply_snapshot(self, snap: Snapshot) -> None:
        """Replace the whole log by ``snap`` (the host persisted it)."""
        invariant(snap.meta.index >= self._snapshot.meta.index, "snapshot out of date")
        self._snapshot = snap
        self._conf_state = snap.meta.conf_state
        self._ents = [Entry(term=snap.meta.term, index=snap.meta.index)]

    def create_snapshot(self, index: int, conf_state: ConfState, data: bytes) -> Snapshot:
        """Record a snapshot of the host's state at applied ``index`` (does not compact)."""
        invariant(index >= self._snapshot.meta.index, "snapshot index went back")
        invariant(index <= self.last_index(), "snapshot beyond last index")
        meta = SnapshotMeta(index=index, term=self.term(index), conf_state=conf_state)
        self._snapshot = Snapshot(meta=meta, data=data)
        return self._snapshot

    def compact(self, index: int) -> None:
        """Discard entries up to and including ``index`` (keeps its term as the dummy)."""
        offset = self._ents[0].index
        if index <= offset:
            return
        invariant(index <= self.last_index(), "compact beyond last index")
        at = index - offset
        dummy = Entry(term=self._ents[at].term, index=index)
        self._ents = [dummy, *self._ents[at + 1 :]]
