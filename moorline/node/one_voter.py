"""A one-voter stand-in for the Raft core, with the same propose / ready / advance shape.

A single node runs each shard as a group of one voter: an entry is committed as soon as the
node's own WAL sync covers it (the node is the whole quorum). Keeping the Raft shape — terms,
indexes, hard state, entries persisted before anything depends on them — means replication slots
in later without a new storage format (DESIGN.md, "Interfaces the issues share").
"""

from __future__ import annotations

from dataclasses import dataclass

from moorline.invariant import invariant

ENTRY_NORMAL = 0


@dataclass(frozen=True, slots=True)
class LogEntry:
    term: int
    index: int
    type: int
    data: bytes


@dataclass(slots=True)
class OneVoterReady:
    hard_state: tuple[int, int] | None  # (term, commit) to persist, when changed
    entries: list[LogEntry]  # to append to the WAL before advance()


class OneVoterRaft:
    def __init__(self, term: int, last_index: int, commit: int) -> None:
        invariant(commit <= last_index, "commit never passes the log")
        self.term = term
        self.last_index = last_index
        self.commit = commit
        self._unstable: list[LogEntry] = []
        self._persisted_index = last_index
        self._hs_dirty = False

    def campaign(self) -> None:
        """Becoming leader of a one-voter group starts a new term (persisted with the next Ready)."""
        self.term += 1
        self._hs_dirty = True

    def propose(self, data: bytes) -> int:
        self.last_index += 1
        self._unstable.append(LogEntry(self.term, self.last_index, ENTRY_NORMAL, data))
        return self.last_index

    def has_ready(self) -> bool:
        return bool(self._unstable) or self._hs_dirty

    def ready(self) -> OneVoterReady:
        entries, self._unstable = self._unstable, []
        hs = None
        if entries or self._hs_dirty:
            hs = (self.term, self.commit)
            self._hs_dirty = False
        return OneVoterReady(hs, entries)

    def advance(self, synced_index: int) -> tuple[int, int]:
        """The host synced everything up to ``synced_index``: with one voter that is the quorum.

        Returns the (from, to] range of newly committed indexes.
        """
        invariant(synced_index >= self._persisted_index, "sync point never goes back")
        self._persisted_index = synced_index
        old = self.commit
        self.commit = max(self.commit, synced_index)
        invariant(self.commit <= self.last_index, "commit never passes the log")
        return old, self.commit
