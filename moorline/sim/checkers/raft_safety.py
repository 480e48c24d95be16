"""Online Raft safety checks, fed by the sim hosts as things happen.

- Election safety: at most one leader per term.
- Log matching: an (index, term) pair names one entry everywhere, with one predecessor term.
  Since one leader per term creates entries, this gives "same (index, term) => same prefix".
- Leader completeness: a new leader's log holds the highest entry known committed.
- State machine safety: every replica applies the same entry at each index, and snapshots of
  the same index are byte-identical.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from moorline.hashing import crc32c

Member = tuple[int, str]


@dataclass(slots=True)
class RaftObserver:
    violations: list[str] = field(default_factory=list)
    leaders: dict[int, Member] = field(default_factory=dict)  # term -> leader
    entries: dict[tuple[int, int], tuple[int, int]] = field(
        default_factory=dict
    )  # (idx, term) -> (crc, prev term)
    applied: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (term, crc of data)
    snapshots: dict[int, int] = field(default_factory=dict)  # index -> crc of state bytes
    committed_max: tuple[int, int] = (0, 0)  # (index, term) of the highest applied entry
    # (commit-term bound, highest index first applied under it), in index order. The bound is
    # the highest leader term known when the entry was first applied: the leader that
    # committed it was seen leading (the hosts report leadership before it can commit), so
    # the entry was committed in a term <= the bound.
    commit_marks: list[tuple[int, int]] = field(default_factory=list)
    max_leader_term: int = 0
    max_violations: int = 20

    def _fail(self, msg: str) -> None:
        if len(self.violations) < self.max_violations:
            self.violations.append(msg)

    def on_leader(
        self, term: int, member: Member, term_at: Callable[[int], int | None], snap_index: int
    ) -> None:
        """A member is leader in ``term`` (reported each time the host sees it lead)."""
        cur = self.leaders.get(term)
        if cur is None:
            self.leaders[term] = member
            self.max_leader_term = max(self.max_leader_term, term)
            self._check_completeness(term, member, term_at, snap_index)
        elif cur != member:
            self._fail(f"election safety: two leaders in term {term}: {cur} and {member}")

    def _check_completeness(
        self, term: int, member: Member, term_at: Callable[[int], int | None], snap_index: int
    ) -> None:
        # Leader completeness: an entry committed in term c is in every leader's log of a term
        # > c. Take the highest entry surely committed before ``term`` (a member may become
        # leader long after it won the votes, e.g. it was paused holding them; entries
        # committed meanwhile by a newer term's leader are not owed to it).
        at = bisect.bisect_left(self.commit_marks, (term, -1)) - 1
        if at < 0:
            return
        _bound, idx = self.commit_marks[at]
        t = self.applied[idx][0]
        if idx <= snap_index:
            return
        have = term_at(idx)
        if have != t:
            self._fail(
                f"leader completeness: leader {member} of term {term} lacks committed entry "
                f"{idx} (term {t}); has term {have}"
            )

    def on_persist(
        self, member: Member, entries: list[tuple[int, int, bytes]], prev_term: int | None
    ) -> None:
        """Entries (index, term, data) a member made durable; ``prev_term`` is the term of the
        entry before the first (None when unknown, e.g. right after a snapshot)."""
        known = self.entries
        for index, term, data in entries:
            c = crc32c(data)
            prev = known.get((index, term))
            if prev is None:
                known[(index, term)] = (c, prev_term if prev_term is not None else -1)
            else:
                if prev[0] != c:
                    self._fail(f"log matching: entry ({index}, term {term}) differs on {member}")
                if prev_term is not None and prev[1] != -1 and prev[1] != prev_term:
                    self._fail(
                        f"log matching: entry ({index}, term {term}) on {member} follows term "
                        f"{prev_term}, elsewhere term {prev[1]}"
                    )
                elif prev[1] == -1 and prev_term is not None:
                    known[(index, term)] = (c, prev_term)
            prev_term = term

    def on_apply(self, member: Member, index: int, term: int, data: bytes) -> None:
        c = crc32c(data)
        ref = self.applied.get(index)
        if ref is None:
            self.applied[index] = (term, c)
            if index > self.committed_max[0]:
                prev_term = self.committed_max[1]
                self.committed_max = (index, term)
                marks = self.commit_marks
                bound = max(self.max_leader_term, term)  # committed in a term >= its own
                if marks and marks[-1][0] == bound:
                    marks[-1] = (bound, index)
                else:
                    marks.append((bound, index))
                if term < prev_term:
                    self._fail(
                        f"state machine safety: applied index {index} has term {term} below an earlier entry's"
                    )
        elif ref != (term, c):
            self._fail(
                f"state machine safety: {member} applied index {index} term {term}, "
                f"another replica applied term {ref[0]} (different entry)"
            )

    def on_snapshot_state(self, member: Member, index: int, state: bytes) -> None:
        """A replica's state machine bytes at applied ``index`` (made or installed)."""
        c = crc32c(state)
        ref = self.snapshots.get(index)
        if ref is None:
            self.snapshots[index] = c
        elif ref != c:
            self._fail(
                f"state machine safety: snapshot of {member} at index {index} differs from another replica's"
            )
