"""Majority-quorum arithmetic (pure). Property-tested against a dumb reference in tests/raft.

moorline uses single-member configuration changes, so a configuration is one majority group;
there is no joint quorum.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from moorline.raft.types import MemberId


class VoteResult(enum.IntEnum):
    PENDING = 0
    LOST = 1
    WON = 2


def majority(n: int) -> int:
    """Smallest number of members that is a majority of ``n``."""
    return n // 2 + 1


def committed_index(voters: Sequence[MemberId], match: Mapping[MemberId, int]) -> int:
    """Largest index acknowledged by a majority of ``voters`` (0 for an empty configuration).

    Sorted descending, the majority-th value is held by at least a majority of voters."""
    n = len(voters)
    if n == 0:
        return 0
    if n == 1:
        return match.get(voters[0], 0)
    acked = sorted((match.get(v, 0) for v in voters), reverse=True)
    return acked[majority(n) - 1]


def vote_result(voters: Sequence[MemberId], votes: Mapping[MemberId, bool]) -> VoteResult:
    """WON once a majority granted, LOST once a majority can no longer be reached."""
    n = len(voters)
    if n == 0:
        return VoteResult.WON  # nothing to ask; callers never campaign without voters
    granted = missing = 0
    for v in voters:
        got = votes.get(v)
        if got is None:
            missing += 1
        elif got:
            granted += 1
    q = majority(n)
    if granted >= q:
        return VoteResult.WON
    if granted + missing >= q:
        return VoteResult.PENDING
    return VoteResult.LOST


def has_active_quorum(voters: Sequence[MemberId], active: Mapping[MemberId, bool]) -> bool:
    """True when a majority of voters were recently heard from (check-quorum)."""
    n = len(voters)
    if n == 0:
        return False
    return sum(1 for v in voters if active.get(v, False)) >= majority(n)
