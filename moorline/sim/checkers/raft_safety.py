"""Online Raft safety checks, fed by the sim hosts as things happen.

- Election safety: at most one leader per term.
- Log matching: an (index, term) pair names one entry everywhere, with one predecessor term.
  Since one leader per term creates entries, this gives "same (index, term) => same prefix".
- Leader completeness: a new leader's log holds the highest entry known committed.
- State machine safety: every replica applies the same entry at each index, and snapshots of
  the same index are byte-identical.
- Promises kept (the ledger): every message a member sends is a promise about its durable
  state. One vote per (term, member), across restarts: two different candidates voted for by
  one member in one term is a violation (a candidate votes for itself). After a restart a member
  runs in a term at least as high as any term it sent, keeps the vote it granted in that term,
  and still holds every entry it acknowledged in that term; within one term it never drops an
  entry it acknowledged. A committed entry is never replaced on a replica whose term is at least
  the term that committed it.

``simulation.py`` adds the checks that need every replica's log at once (a committed entry
that a replica lacking it could be elected over; configurations whose majorities may not
intersect).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from moorline.hashing import crc32c
from moorline.raft import Message, MessageType

Member = tuple[int, str]

_MT = MessageType
_PRE_VOTE_TYPES = frozenset({_MT.PRE_VOTE, _MT.PRE_VOTE_RESP})  # carry a future term: no promise


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
    # the ledger of promises (see the module docstring)
    votes: dict[tuple[Member, int], Member] = field(default_factory=dict)  # (voter, term) -> candidate
    term_sent: dict[Member, int] = field(default_factory=dict)  # highest term in a message sent
    acked: dict[Member, tuple[int, int]] = field(default_factory=dict)  # (term, highest index acked in it)
    # called with (index, term) when an index is applied for the first time (= known committed)
    on_first_commit: Callable[[int, int], None] | None = None

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
            if self.on_first_commit is not None:
                self.on_first_commit(index, term)
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

    # -- the ledger: promises made in messages -----------------------------------------------
    def on_vote(self, voter: Member, term: int, candidate: Member) -> bool:
        """``voter`` voted for ``candidate`` in ``term`` (a grant sent, or its own candidacy).
        Returns True the first time this vote is recorded."""
        key = (voter, term)
        prev = self.votes.get(key)
        if prev is None:
            self.votes[key] = candidate
            return True
        if prev != candidate:
            self._fail(
                f"one vote per term: {voter} voted for {prev} and then for {candidate} in term {term}"
            )
        return False

    def on_send(self, m: Message) -> bool:
        """A member sent ``m`` (after the persistence its Ready asked for). Returns True when
        it records a new vote (a grant or a candidacy)."""
        t = m.type
        if t in _PRE_VOTE_TYPES:
            return False
        member = m.from_
        if m.term > self.term_sent.get(member, 0):
            self.term_sent[member] = m.term
        if t == _MT.APP_RESP:
            if not m.reject:
                prev = self.acked.get(member)
                if prev is None or m.term > prev[0] or (m.term == prev[0] and m.index > prev[1]):
                    self.acked[member] = (m.term, m.index)
        elif t == _MT.VOTE:
            return self.on_vote(member, m.term, member)
        elif t == _MT.VOTE_RESP and not m.reject:
            return self.on_vote(member, m.term, m.to)
        return False

    def on_boot(self, member: Member, term: int, vote: Member | None, last_index: int) -> None:
        """A replica of ``member`` started from its storage (after a crash, or the first time)."""
        sent = self.term_sent.get(member, 0)
        if term < sent:
            self._fail(f"promise broken: {member} sent messages in term {sent} and restarted in term {term}")
            return
        granted = self.votes.get((member, term))
        if granted is not None and vote != granted:
            self._fail(
                f"one vote per term: {member} voted for {granted} in term {term} and restarted "
                f"with vote {vote} (free to vote again)"
            )
        ack = self.acked.get(member)
        if ack is not None and ack[0] == term and last_index < ack[1]:
            self._fail(
                f"promise broken: {member} acknowledged entries up to {ack[1]} in term {term} and "
                f"restarted with its log ending at {last_index}"
            )

    def on_truncate(self, member: Member, term: int, replaced: list[tuple[int, int]]) -> None:
        """``member`` (in ``term``) replaced its stored entries ``replaced`` ((index, term), in
        index order) with others."""
        ack = self.acked.get(member)
        if ack is not None and ack[0] == term and replaced[0][0] <= ack[1]:
            self._fail(
                f"promise broken: {member} dropped entries from index {replaced[0][0]} that it "
                f"acknowledged (up to {ack[1]}) in its current term {term}"
            )
        for index, old_term in replaced:
            ref = self.applied.get(index)
            if ref is not None and ref[0] == old_term and term >= self._commit_bound(index):
                self._fail(
                    f"committed entry overwritten: {member} (term {term}) replaced committed entry "
                    f"({index}, term {old_term})"
                )
                return

    def _commit_bound(self, index: int) -> int:
        """The highest term in which ``index`` could have been committed (see commit_marks)."""
        at = bisect.bisect_left(self.commit_marks, index, key=_mark_index)
        if at < len(self.commit_marks):
            return self.commit_marks[at][0]
        return self.max_leader_term


def _mark_index(mark: tuple[int, int]) -> int:
    return mark[1]
