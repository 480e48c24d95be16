"""The replica's log as Raft sees it: the host's stable ``Storage`` plus an unstable tail.

Unstable = entries (and possibly a snapshot) handed out in a ``Ready`` but not yet reported
durable through ``advance``. Reads combine both: indexes below ``unstable_offset`` come from
storage, the rest from the unstable list.
"""

from __future__ import annotations

from moorline.invariant import invariant
from moorline.raft.storage import Storage, limit_size
from moorline.raft.types import CompactedError, Entry, Snapshot, UnavailableError


class RaftLog:
    __slots__ = ("storage", "unstable", "unstable_offset", "unstable_snapshot", "committed", "applied")

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        first = storage.first_index()
        last = storage.last_index()
        self.unstable: list[Entry] = []
        self.unstable_offset = last + 1
        self.unstable_snapshot: Snapshot | None = None
        # Everything up to the snapshot is committed and applied by definition.
        self.committed = first - 1
        self.applied = first - 1

    # -- positions ---------------------------------------------------------------------------
    def first_index(self) -> int:
        if self.unstable_snapshot is not None:
            return self.unstable_snapshot.meta.index + 1
        return self.storage.first_index()

    def last_index(self) -> int:
        if self.unstable:
            return self.unstable_offset + len(self.unstable) - 1
        if self.unstable_snapshot is not None:
            return self.unstable_snapshot.meta.index
        return self.storage.last_index()

    def persisted_last_index(self) -> int:
        """Last index known durable (everything before the unstable tail)."""
        if self.unstable_snapshot is not None:
            return 0  # nothing is durable until the pending snapshot is
        return min(self.unstable_offset - 1, self.storage.last_index())

    def term(self, index: int) -> int:
        """Term at ``index``; raises CompactedError / UnavailableError outside the log."""
        off = self.unstable_offset
        if index >= off:
            i = index - off
            if i < len(self.unstable):
                return self.unstable[i].term
            if self.unstable_snapshot is not None and index == self.unstable_snapshot.meta.index:
                return self.unstable_snapshot.meta.term
            raise UnavailableError(f"term({index}) beyond last index {self.last_index()}")
        snap = self.unstable_snapshot
        if snap is not None:
            if index == snap.meta.index:
                return snap.meta.term
            raise CompactedError(f"term({index}) below pending snapshot {snap.meta.index}")
        return self.storage.term(index)

    def term_or_zero(self, index: int) -> int:
        try:
            return self.term(index)
        except (CompactedError, UnavailableError):
            return 0

    def last_term(self) -> int:
        return self.term(self.last_index())

    def match_term(self, index: int, term: int) -> bool:
        try:
            return self.term(index) == term
        except (CompactedError, UnavailableError):
            return False

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Is a candidate's log (last_index, last_term) at least as up to date as ours?"""
        my_term = self.last_term()
        return last_term > my_term or (last_term == my_term and last_index >= self.last_index())

    # -- reading -------------------------------------------------------------------------------
    def slice(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        """Entries [lo, hi) within ``max_bytes`` (at least one if lo < hi)."""
        if lo >= hi:
            return []
        invariant(hi <= self.last_index() + 1, "slice beyond last index")
        if lo < self.first_index():
            raise CompactedError(f"slice({lo}) compacted")
        off = self.unstable_offset
        if lo >= off:
            return limit_size(self.unstable[lo - off : hi - off], max_bytes)
        stable = self.storage.entries(lo, min(hi, off), max_bytes)
        if hi <= off or len(stable) < min(hi, off) - lo:
            return stable
        used = sum(len(e.data) + 24 for e in stable)
        if used >= max_bytes:
            return stable
        return stable + limit_size(self.unstable[: hi - off], max_bytes - used)

    def has_next_committed(self) -> bool:
        return self.unstable_snapshot is None and self.committed > self.applied

    def next_committed(self, max_bytes: int) -> list[Entry]:
        if not self.has_next_committed():
            return []
        lo = max(self.applied + 1, self.first_index())
        return self.slice(lo, self.committed + 1, max_bytes)

    # -- writing -------------------------------------------------------------------------------
    def find_conflict(self, entries: list[Entry]) -> int:
        """Index of the first entry not already in the log with the same term (0: none)."""
        last = self.last_index()
        for e in entries:
            if e.index > last or not self.match_term(e.index, e.term):
                return e.index
        return 0

    def find_conflict_by_term(self, index: int, term: int) -> int:
        """Largest index <= ``index`` whose term is <= ``term`` (for the fast back-off hint)."""
        first = self.first_index() - 1
        while index > first:
            t = self.term_or_zero(index)
            if t <= term:
                return index
            index -= 1
        return index

    def maybe_append(self, index: int, log_term: int, committed: int, entries: list[Entry]) -> int | None:
        """Append after (index, log_term) if it matches; returns the new last matched index."""
        if not self.match_term(index, log_term):
            return None
        last_new = index + len(entries)
        if entries:
            ci = self.find_conflict(entries)
            if ci:
                if not (ci > self.committed):
                    invariant(False, f"conflict at {ci} would rewrite committed {self.committed}")
                self.append(entries[ci - entries[0].index :])
        self.commit_to(min(committed, last_new))
        return last_new

    def append(self, entries: list[Entry]) -> int:
        """Add entries to the unstable tail, truncating any conflicting suffix first."""
        if not entries:
            return self.last_index()
        first = entries[0].index
        if not (first > self.committed):
            invariant(False, f"append at {first} would rewrite committed {self.committed}")
        invariant(entries[-1].index - first == len(entries) - 1, "appended entries are not contiguous")
        off = self.unstable_offset
        n = len(self.unstable)
        if first == off + n:
            self.unstable.extend(entries)
        elif first <= off:
            # Replaces the whole unstable tail; stable storage gets overwritten on the next Ready.
            self.unstable_offset = first
            self.unstable = list(entries)
        else:
            invariant(first <= off + n, "append leaves a gap")
            del self.unstable[first - off :]
            self.unstable.extend(entries)
        return self.last_index()

    def commit_to(self, index: int) -> bool:
        if index > self.committed:
            if not (index <= self.last_index()):
                invariant(False, f"commit {index} beyond last index {self.last_index()}")
            self.committed = index
            return True
        return False

    def applied_to(self, index: int) -> None:
        if not (index <= self.committed):
            invariant(False, f"applied {index} beyond committed {self.committed}")
        if index > self.applied:
            self.applied = index

    def restore(self, snap: Snapshot) -> None:
        """Replace the log by ``snap`` (it goes out in the next Ready)."""
        self.unstable_snapshot = snap
        self.unstable = []
        self.unstable_offset = snap.meta.index + 1
        self.committed = snap.meta.index

    # -- advance ---------------------------------------------------------------------------------
    def stable_to(self, index: int, term: int) -> None:
        """Entries up to (index, term) are durable; drop them from the unstable tail."""
        off = self.unstable_offset
        i = index - off
        if i < 0 or i >= len(self.unstable) or self.unstable[i].term != term:
            return  # superseded by a later truncation: those entries stay unstable
        del self.unstable[: i + 1]
        self.unstable_offset = index + 1

    def stable_snap_to(self, index: int) -> None:
        if self.unstable_snapshot is not None and self.unstable_snapshot.meta.index == index:
            self.unstable_snapshot = None
