"""Unit tests of the online Raft safety observer on handcrafted event sequences."""

from __future__ import annotations

from moorline.raft import Message, MessageType
from moorline.sim.checkers.raft_safety import Member, RaftObserver
from moorline.sim.simulation import majorities_may_be_disjoint

A, B, C = (1, "s0"), (2, "s0"), (3, "s0")


def no_log(_i: int) -> int | None:
    return None


def test_one_leader_per_term() -> None:
    o = RaftObserver()
    o.on_leader(2, A, no_log, 0)
    o.on_leader(2, A, no_log, 0)
    o.on_leader(3, B, no_log, 0)
    assert not o.violations
    o.on_leader(3, C, no_log, 0)
    assert o.violations and "two leaders in term 3" in o.violations[0]


def test_log_matching() -> None:
    o = RaftObserver()
    o.on_persist(A, [(1, 1, b"x"), (2, 1, b"y")], 0)
    o.on_persist(B, [(1, 1, b"x"), (2, 1, b"y")], 0)
    assert not o.violations
    o.on_persist(C, [(2, 1, b"other")], 1)  # same (index, term), other data
    assert any("log matching" in v for v in o.violations)
    o2 = RaftObserver()
    o2.on_persist(A, [(3, 2, b"z")], 1)
    o2.on_persist(B, [(3, 2, b"z")], 2)  # same entry, different predecessor term
    assert any("follows term" in v for v in o2.violations)


def test_state_machine_safety() -> None:
    o = RaftObserver()
    o.on_apply(A, 1, 1, b"x")
    o.on_apply(B, 1, 1, b"x")
    assert not o.violations
    o.on_apply(C, 1, 2, b"y")
    assert any("state machine safety" in v for v in o.violations)


def test_applied_terms_never_decrease() -> None:
    o = RaftObserver()
    o.on_apply(A, 1, 3, b"x")
    o.on_apply(A, 2, 2, b"y")
    assert o.violations


def test_snapshot_states_must_match() -> None:
    o = RaftObserver()
    o.on_snapshot_state(A, 10, b"state")
    o.on_snapshot_state(B, 10, b"state")
    assert not o.violations
    o.on_snapshot_state(C, 10, b"other")
    assert o.violations


def test_leader_completeness() -> None:
    o = RaftObserver()
    o.on_leader(1, A, no_log, 0)
    o.on_apply(A, 1, 1, b"a")
    o.on_leader(2, A, {1: 1}.get, 0)
    o.on_apply(A, 2, 2, b"b")
    log_ok = {1: 1, 2: 2}
    log_missing = {1: 1}
    o.on_leader(3, A, log_ok.get, 0)
    assert not o.violations
    o.on_leader(4, B, log_missing.get, 0)
    assert o.violations and "leader completeness" in o.violations[0]


def test_leader_completeness_only_owes_entries_committed_before_the_term() -> None:
    o = RaftObserver()
    o.on_leader(2, A, no_log, 0)
    o.on_apply(A, 1, 2, b"a")  # committed in term 2
    o.on_leader(4, C, {1: 2}.get, 0)
    o.on_apply(C, 2, 2, b"b")  # a term-2 entry committed by the term-4 leader
    # B won term 3 before that commit (it was paused holding the votes) and shows up late:
    # it owes entry 1 (committed in term 2), not entry 2 (committed in term 4)
    o.on_leader(3, B, {1: 2}.get, 0)
    assert not o.violations
    o.on_leader(5, (4, "s0"), {1: 2}.get, 0)  # a term-5 leader owes both
    assert o.violations and "lacks committed entry 2" in o.violations[0]


def test_leader_completeness_skips_compacted_entries() -> None:
    o = RaftObserver()
    o.on_leader(1, A, no_log, 0)
    o.on_apply(A, 1, 1, b"a")
    o.on_apply(A, 2, 1, b"b")
    # compacted past the committed entry: covered by the snapshot checks instead
    o.on_leader(6, C, no_log, 2)
    assert not o.violations


# -- the ledger: promises made in messages ----------------------------------------------------
def _msg(t: MessageType, frm: Member, to: Member, term: int, **kw: object) -> Message:
    return Message(type=t, from_=frm, to=to, term=term, **kw)  # type: ignore[arg-type]


def test_one_vote_per_term_and_member() -> None:
    o = RaftObserver()
    assert o.on_send(_msg(MessageType.VOTE_RESP, A, B, 5))  # A votes for B in term 5
    assert not o.on_send(_msg(MessageType.VOTE_RESP, A, B, 5))  # again for B: the same vote
    o.on_send(_msg(MessageType.VOTE_RESP, A, C, 5, reject=True))  # a refusal is no vote
    o.on_send(_msg(MessageType.PRE_VOTE_RESP, A, C, 5))  # a pre-vote is no vote
    assert not o.violations
    o.on_send(_msg(MessageType.VOTE_RESP, A, C, 5))
    assert o.violations and "voted for (2, 's0') and then for (3, 's0') in term 5" in o.violations[0]


def test_a_candidate_votes_for_itself() -> None:
    o = RaftObserver()
    o.on_send(_msg(MessageType.VOTE, A, B, 3))  # A campaigns in term 3
    o.on_send(_msg(MessageType.VOTE_RESP, A, C, 3))  # and grants C a vote in the same term
    assert o.violations and "one vote per term" in o.violations[0]


def test_a_restart_keeps_the_promises_made() -> None:
    o = RaftObserver()
    o.on_send(_msg(MessageType.VOTE_RESP, A, B, 4))
    o.on_send(_msg(MessageType.APP_RESP, A, B, 4, index=12))
    o.on_boot(A, 4, B, 12)  # everything kept
    o.on_boot(A, 6, None, 3)  # a higher term frees the vote and the old acknowledgements
    assert not o.violations
    o.on_boot(A, 4, None, 12)
    assert "restarted with vote None" in o.violations[-1]
    o.on_boot(A, 4, B, 11)
    assert "acknowledged entries up to 12 in term 4 and restarted with its log ending at 11" in o.violations[-1]
    o.on_boot(A, 3, None, 12)
    assert "sent messages in term 4 and restarted in term 3" in o.violations[-1]


def test_pre_votes_promise_no_term() -> None:
    o = RaftObserver()
    o.on_send(_msg(MessageType.PRE_VOTE, A, B, 9))  # the future term a pre-candidate asks about
    o.on_boot(A, 2, None, 0)
    assert not o.violations


def test_acknowledged_entries_are_never_dropped_within_the_term() -> None:
    o = RaftObserver()
    o.on_send(_msg(MessageType.APP_RESP, A, B, 4, index=12))
    o.on_truncate(A, 4, [(13, 3), (14, 3)])  # beyond what it acknowledged: fine
    o.on_truncate(A, 5, [(10, 4)])  # a newer term's leader may replace it
    assert not o.violations
    o.on_truncate(A, 4, [(12, 3)])
    assert "dropped entries from index 12 that it acknowledged (up to 12)" in o.violations[0]


def test_a_committed_entry_is_never_overwritten() -> None:
    o = RaftObserver()
    o.on_leader(3, B, no_log, 0)
    o.on_apply(B, 1, 3, b"x")  # (1, 3) committed, by term 3 at the latest
    o.on_truncate(C, 2, [(1, 3)])  # a replica still in term 2 may (a stale leader's partition)
    assert not o.violations
    o.on_truncate(C, 3, [(1, 3)])
    assert "committed entry overwritten" in o.violations[0]


def test_majorities_may_be_disjoint() -> None:
    def s(*ids: int) -> set[Member]:
        return {(i, "s0") for i in ids}

    assert not majorities_may_be_disjoint(s(1, 2, 3), s(1, 2, 3))
    assert not majorities_may_be_disjoint(s(1, 2, 3), s(1, 2, 3, 4))  # one change apart
    assert not majorities_may_be_disjoint(s(1, 2, 3), s(1, 2))
    assert majorities_may_be_disjoint(s(1, 2, 3), s(1, 4, 5))
    assert majorities_may_be_disjoint(s(1, 2, 3, 4, 5), s(1, 2, 4))  # two removals: {3, 5, x} vs {1, 2}
    assert majorities_may_be_disjoint(s(1, 2, 3), s(1, 2, 3, 4, 5))  # two additions: {1, 2} vs {3, 4, 5}
    assert not majorities_may_be_disjoint(s(1, 2, 3, 4), s(1, 2, 3, 4, 5, 6))  # 3 + 4 > 6: they meet
