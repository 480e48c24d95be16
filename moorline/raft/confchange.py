"""Single-member configuration changes, computed on a copy and validated before use (pure)."""

from __future__ import annotations

from moorline.raft.types import ConfChange, ConfChangeType, ConfState, MemberId, RaftError


class ConfChangeInvalid(RaftError):
    """The change does not make sense against the current configuration."""


def _node_taken(members: set[MemberId], member: MemberId) -> bool:
    """Another storage of the same node is still a member (a wiped node must be removed first)."""
    return any(m[0] == member[0] and m != member for m in members)


def apply_conf_change(cs: ConfState, cc: ConfChange) -> ConfState:
    """The configuration after ``cc``; raises ConfChangeInvalid and leaves ``cs`` untouched.

    Every valid change alters the voter set by at most one member, which is what makes two
    consecutive configurations' majorities overlap (see README.md)."""
    voters = set(cs.voters)
    learners = set(cs.learners)
    m = cc.member
    kind = cc.type
    if kind == ConfChangeType.ADD_VOTER:
        if m in voters:
            raise ConfChangeInvalid(f"{m} is already a voter")
        if _node_taken(voters | learners, m):
            raise ConfChangeInvalid(f"node {m[0]} is a member with another storage id")
        learners.discard(m)
        voters.add(m)
    elif kind == ConfChangeType.ADD_LEARNER:
        if m in voters or m in learners:
            raise ConfChangeInvalid(f"{m} is already a member")
        if _node_taken(voters | learners, m):
            raise ConfChangeInvalid(f"node {m[0]} is a member with another storage id")
        learners.add(m)
    elif kind == ConfChangeType.PROMOTE:
        if m not in learners:
            raise ConfChangeInvalid(f"{m} is not a learner")
        learners.discard(m)
        voters.add(m)
    elif kind == ConfChangeType.REMOVE:
        if m not in voters and m not in learners:
            raise ConfChangeInvalid(f"{m} is not a member")
        voters.discard(m)
        learners.discard(m)
        if not voters:
            raise ConfChangeInvalid("cannot remove the last voter")
    else:  # pragma: no cover - enum is closed
        raise ConfChangeInvalid(f"unknown change type {kind}")
    return ConfState.of(voters, learners)
