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
    # (term, highest applied index of that term), in index order: terms only grow along the log
    term_marks: list[tuple[int, int]] = field(default_factory=list)
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
            self._check_completeness(term, member, term_at, snap_index)
        elif cur != member:
            self._fail(f"election safety: two leaders in term {term}: {cur} and {member}")

    def _check_completeness(
        self, term: int, member: Member, term_at: Callable[[int], int | None], snap_index: int
    ) -> None:
        # The highest committed entry of an older term (entries of this term or later were
        # not necessarily known when this member won: e.g. it was paused holding the votes).
        at = bisect.bisect_left(self.term_marks, (term, -1)) - 1
        if at < 0:
            return
        t, idx = self.term_marks[at]
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
                self.committed_max = (index, term)
                marks = self.term_marks
                if marks and marks[-1][0] == term:
                    marks[-1] = (term, index)
                elif not marks or marks[-1][0] < term:
                    marks.append((term, index))
                else:
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
