"""A shard leader carries out a planner's promotion only while no voter of the shard is on a gone node
(shrink before grow, also for a growth planned before the forget and carried out after). sim --cluster
seed 50054 with joins: the metadata leader planned a rebalance's promote n4 of shard 1 while n2 was
still active (crashed 0.2 s before); n2 was forgotten, and n3, shard 1's leader, then made n4 a fourth
voter beside the forgotten n2 (four voters, three live: a second failure takes the majority away).
An operator's add-replica is carried out as it was asked (it is not the reconciler's growth)."""

from __future__ import annotations

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.node.replication.membership import MembershipDriver
from moorline.raft.types import ConfChange, ConfChangeType
from tests.node.test_membership_driver import NAMES, FakeNode, FakeProgress, mid, run


def _leader_of_shard_0(node: FakeNode) -> None:
    raft = node.hosts[0].raft
    raft.leader = True
    raft.progress = {mid(n): FakeProgress(100) for n in NAMES}  # every member caught up


@pytest.mark.parametrize("origin", ["rebalance", "reconcile"])
def test_a_promotion_planned_before_a_voter_was_forgotten_ends_and_the_voter_goes_first(origin: str) -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n4", "n5"]], live={"n3", "n4", "n5"})  # n2 down
    _leader_of_shard_0(node)
    drv = MembershipDriver(node)
    meta = node.meta_host.state
    table = meta.membership
    assert not isinstance(meta.apply(c.MoveStart(0, "promote", "n4", *mid("n4"), origin, 1000), Effects()), str)
    # n2 is forgotten before shard 0's leader carries the promotion out
    assert run(drv.forget("n2", force=False)).status == 200
    drv._drive_moves(table, 0.0)
    assert node.hosts[0].raft.proposed == []  # no fourth voter beside the forgotten n2
    assert 0 not in table.moves and "shrink before grow" in table.history[-1].outcome, table.history[-1]
    moves = run(drv.reconcile(table, 1.0))
    assert (0, "remove", "n2") in [(m.shard, m.kind, m.node) for m in moves], moves


def test_an_operators_add_replica_is_carried_out_beside_a_forgotten_voter() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n4", "n5"]], live={"n3", "n4", "n5"})
    _leader_of_shard_0(node)
    drv = MembershipDriver(node)
    table = node.meta_host.state.membership
    assert run(drv.change_replica(0, "n4", "add")).status == 202
    assert run(drv.forget("n2", force=False)).status == 200
    drv._drive_moves(table, 0.0)
    assert node.hosts[0].raft.proposed == [ConfChange(ConfChangeType.PROMOTE, mid("n4"))]
