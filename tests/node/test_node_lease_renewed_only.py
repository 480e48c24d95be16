"""A committed SessionRenew extends this node's own lease deadline only for the sessions the
session shard renewed (SessionState.apply_renew returns them). A session the shard ended or gave to
another owner meanwhile keeps its old deadline, so the lease check closes its client in time; before,
any committed renewal extended every session it named (a weakness found while fixing sim seed 20211)."""

from __future__ import annotations

from moorline.node.sessions.lifecycle import SessionLifecycle


def test_only_renewed_sessions_get_a_later_deadline() -> None:
    lifecycle = SessionLifecycle.__new__(SessionLifecycle)  # only its lease table is exercised
    lifecycle._lease_deadline = {("kept", 1): 10.0, ("ended", 2): 10.0}
    done = lifecycle._renewed((("kept", 1), ("ended", 2)), 20.0)
    done((("kept", 1),), None)  # the shard renewed "kept" only
    assert lifecycle._lease_deadline == {("kept", 1): 20.0, ("ended", 2): 10.0}


def test_a_failed_renewal_extends_nothing() -> None:
    lifecycle = SessionLifecycle.__new__(SessionLifecycle)
    lifecycle._lease_deadline = {("kept", 1): 10.0}
    lifecycle._renewed((("kept", 1),), 20.0)(None, TimeoutError("not committed"))
    assert lifecycle._lease_deadline == {("kept", 1): 10.0}
