"""Unit tests of the online Raft safety observer on handcrafted event sequences."""

from __future__ import annotations

from moorline.sim.checkers.raft_safety import RaftObserver

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
