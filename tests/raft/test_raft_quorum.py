"""Quorum arithmetic against deliberately simple reference implementations (hypothesis)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.raft.quorum import VoteResult, committed_index, has_active_quorum, vote_result

MEMBERS = [(i, f"s{i}") for i in range(1, 8)]


def ref_committed(voters: list, match: dict) -> int:
    """The largest index such that more than half of the voters have matched at least it."""
    if not voters:
        return 0
    best = 0
    for candidate in {match.get(v, 0) for v in voters} | {0}:
        holders = sum(1 for v in voters if match.get(v, 0) >= candidate)
        if 2 * holders > len(voters):
            best = max(best, candidate)
    return best


def ref_vote(voters: list, votes: dict) -> VoteResult:
    """Try every way the missing votes could still go."""
    if not voters:
        return VoteResult.WON
    missing = [v for v in voters if v not in votes]
    outcomes = set()
    for fill in itertools.product([True, False], repeat=len(missing)):
        full = dict(votes)
        full.update(zip(missing, fill, strict=True))
        yes = sum(1 for v in voters if full[v])
        outcomes.add(2 * yes > len(voters))
    if outcomes == {True}:
        return VoteResult.WON
    if outcomes == {False}:
        return VoteResult.LOST
    return VoteResult.PENDING


voters_st = st.lists(st.sampled_from(MEMBERS), unique=True, max_size=7)


@settings(max_examples=200, deadline=None)
@given(voters=voters_st, data=st.data())
def test_committed_index_matches_reference(voters: list, data: st.DataObject) -> None:
    match = {v: data.draw(st.integers(0, 20)) for v in voters}
    # Some members have no progress entry at all (treated as 0).
    for v in list(match):
        if data.draw(st.integers(0, 4)) == 0:
            del match[v]
    assert committed_index(voters, match) == ref_committed(voters, match)


@settings(max_examples=200, deadline=None)
@given(voters=voters_st, data=st.data())
def test_vote_result_matches_reference(voters: list, data: st.DataObject) -> None:
    votes = {}
    for v in voters:
        choice = data.draw(st.sampled_from(["yes", "no", "missing"]))
        if choice != "missing":
            votes[v] = choice == "yes"
    # Votes from non-voters never count.
    votes[(99, "s99")] = True
    assert vote_result(voters, votes) == ref_vote(voters, votes)


@settings(max_examples=200, deadline=None)
@given(voters=voters_st, data=st.data())
def test_active_quorum_matches_reference(voters: list, data: st.DataObject) -> None:
    active = {v: data.draw(st.booleans()) for v in voters}
    expected = bool(voters) and 2 * sum(active.values()) > len(voters)
    assert has_active_quorum(voters, active) == expected


def test_known_values() -> None:
    a, b, c, d = MEMBERS[:4]
    assert committed_index([a, b, c], {a: 5, b: 3, c: 1}) == 3
    assert committed_index([a, b, c, d], {a: 5, b: 3, c: 1, d: 9}) == 3
    assert committed_index([a], {a: 7}) == 7
    assert vote_result([a, b, c], {a: True, b: False}) == VoteResult.PENDING
    assert vote_result([a, b, c], {a: False, b: False}) == VoteResult.LOST
    assert vote_result([a, b, c, d], {a: True, b: True}) == VoteResult.PENDING
