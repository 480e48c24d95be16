"""The metadata leader's view of a group whose configuration no longer lists it: its replica applied
its own removal, and no later change of that group reaches it (the leader sends nothing to a
non-member). sim --cluster seed 40084 with joins: n1, the metadata leader, removed from shard 0 by
hand (its replica applied that: 2 voters and a learner, n4), planned promote n4 there every round
(each done at once on the real group, where n4 already voted) and never its own re-add: n1 followed
no replica of shard 0 for good (membership_not_converged)."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.node.replication.membership import MembershipDriver
from moorline.raft.types import ConfState
from tests.node.test_membership_driver import FakeNode, mid, run


def test_a_replica_that_applied_its_own_removal_plans_only_its_readdition() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n2", "n3"]], live={"n2", "n3", "n4", "n5"})
    drv = MembershipDriver(node)
    table = node.meta_host.state.membership
    started = run(drv.change_replica(0, "n1", "remove"))
    assert started.status == 202, started.body
    # n1's replica applied its removal (then heard nothing more of shard 0); the move ended
    node.hosts[0].raft.conf = ConfState.of([mid("n2"), mid("n3")], [mid("n4"), mid("n5")])
    assert table.apply_move_end(c.MoveEnd(0, started.body["move"]["id"], "done", 2000))
    views = {g.shard: g for g in drv._group_views(table)}
    assert views[0].stale and views[0].readd == mid("n1") and views[0].leader is None
    assert not views[1].stale
    moves = run(drv.reconcile(table, 0.0))
    assert [(m.shard, m.kind, m.node) for m in moves] == [(0, "add_learner", "n1")], moves


def test_the_configuration_alone_says_so_when_the_history_no_longer_has_the_removal() -> None:
    # the member table keeps the last MOVE_HISTORY moves only: the removal may have left it
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n2", "n3"]], live={"n2", "n3", "n4", "n5"})
    drv = MembershipDriver(node)
    table = node.meta_host.state.membership
    node.hosts[0].raft.conf = ConfState.of([mid("n2"), mid("n3")], [mid("n4"), mid("n5")])
    assert not table.history
    moves = run(drv.reconcile(table, 0.0))
    assert [(m.shard, m.kind, m.node) for m in moves] == [(0, "add_learner", "n1")], moves
