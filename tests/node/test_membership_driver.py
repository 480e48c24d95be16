"""The membership driver's operator commands and shard-leader side against a fake node: forget
refuses (naming the shards and why) and --force says what it risks; a manual change racing another
on the same shard is refused; leave is refused when nobody could take the node's voters; a shard's
leader promotes only a caught-up learner, never proposes a second change while one is pending, and
ends a move once its configuration shows it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.config import NodeConfig
from moorline.node.replication.membership import MembershipDriver
from moorline.node.seams import PRODUCTION
from moorline.raft.types import ConfChange, ConfChangeType, ConfState
from moorline.testing.faults import NO_FAULTS

NAMES = ["n1", "n2", "n3", "n4", "n5"]


def mid(name: str) -> tuple[int, str]:
    i = int(name[1:])
    return (i, f"s{i}")


@dataclass
class FakeProgress:
    match: int


@dataclass
class FakeLog:
    last: int = 100
    applied: int = 100

    def last_index(self) -> int:
        return self.last


@dataclass
class FakeRaft:
    conf: ConfState
    leader: bool = False
    lead: tuple[int, str] | None = None
    progress: dict[tuple[int, str], FakeProgress] = field(default_factory=dict)
    log: FakeLog = field(default_factory=FakeLog)
    proposed: list[ConfChange] = field(default_factory=list)
    pending: ConfState | None = None
    lead_transferee: Any = None

    @property
    def is_leader(self) -> bool:
        return self.leader

    @property
    def conf_state(self) -> ConfState:
        return self.conf

    @property
    def active_conf_state(self) -> ConfState:
        return self.pending or self.conf

    def is_active(self, m: tuple[int, str]) -> bool:
        return m in self.progress

    def propose_conf_change(self, cc: ConfChange) -> int:
        self.proposed.append(cc)
        return 101


@dataclass
class FakeHost:
    shard: int
    raft: FakeRaft
    state: Any = None
    failed: str | None = None
    reader: Any = None  # a member's replica (no reader feed: node/replication/reader.py)

    def group_conf(self) -> Any:
        return self.raft.active_conf_state


class FakeTransport:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)


@dataclass
class FakeSpec:
    me: str
    addresses: dict[str, tuple[str, int]]


class FakeLink:
    def __init__(self, live: set[str]) -> None:
        self.spec = FakeSpec("n1", {n: (f"127.0.0.{10 + int(n[1:])}", 7000) for n in NAMES})
        self.live = live
        self.transport = FakeTransport()

    def stats(self) -> dict[str, Any]:
        return {"peers": {n: {"connected_streams": ["control"] if n in self.live else []} for n in NAMES
                          if n != "n1"}}


class FakeCommit:
    def kick(self, shard: int) -> None:
        pass


class FakeNode:
    """Two shards and the metadata group (group 2); n1 is this node."""

    def __init__(self, voters: list[list[str]], live: set[str]) -> None:
        self.cfg = NodeConfig()
        self.seams = PRODUCTION
        self.faults = NO_FAULTS
        self.clock = PRODUCTION.clock
        self.shard_count = len(voters)
        self.meta_group = len(voters)
        self.member = mid("n1")
        self.link = FakeLink(live)
        self.commit = FakeCommit()
        self.stopping = asyncio.Event()
        record = c.ClusterRecord("t", tuple((n, *mid(n)) for n in NAMES), len(voters), 3,
                                 tuple((tuple(v), tuple(n for n in NAMES if n not in v)) for v in voters))
        meta_state = ShardState(self.meta_group, "meta", TopicLimits(), 3600)
        meta_state.apply(c.ClusterBootstrap(record), Effects())
        self.hosts = [FakeHost(s, FakeRaft(ConfState.of([mid(n) for n in v], [mid(n) for n in NAMES if n not in v])))
                      for s, v in enumerate(voters)]
        self.meta_host = FakeHost(self.meta_group, FakeRaft(ConfState.of([mid(n) for n in NAMES])), meta_state)
        self.groups = [*self.hosts, self.meta_host]
        self.proposed: list[c.Command] = []

    def node_name(self, node_id: int) -> str:
        return f"n{node_id}"

    def now_ms(self) -> int:
        return 1000

    def propose(self, group: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any] | None:
        assert group == self.meta_group
        self.proposed.append(cmd)
        result = self.meta_host.state.apply(cmd, Effects())  # committed at once
        if not want:
            return None
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return fut


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_forget_refuses_a_live_node_and_a_lost_majority_and_force_says_what_it_risks() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n3", "n4", "n5"]], live={"n2", "n4", "n5"})
    drv = MembershipDriver(node)
    live = run(drv.forget("n2", force=False))
    assert live.status == 409 and any("n2 is live" in r for r in live.body["reasons"]), live.body
    # n3 is down: forgetting it leaves shard 0 with n1, n2 (both live) and shard 1 with n4, n5: fine
    ok = run(drv.forget("n3", force=False))
    assert ok.status == 200 and ok.body["state"] == "forgotten" and ok.body["shards"] == [0, 1, 2], ok.body  # 2: the metadata group
    assert node.meta_host.state.membership.members["n3"].state == "forgotten"


def test_forget_names_the_shards_left_without_a_live_majority() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n4", "n5"]], live={"n4", "n5"})  # n2, n3 down
    drv = MembershipDriver(node)
    refused = run(drv.forget("n2", force=False))
    assert refused.status == 409, refused.body
    assert any("shard 0: 1 of its 2 other voters are live; a majority is 2" in r for r in refused.body["reasons"])
    assert "force" in refused.body and "unavailable" in refused.body["force"]
    assert node.meta_host.state.membership.members["n2"].state == "active"  # nothing changed
    forced = run(drv.forget("n2", force=True))
    assert forced.status == 200 and forced.body["forced"] and forced.body["risks"], forced.body
    assert node.meta_host.state.membership.members["n2"].state == "forgotten"
    assert run(drv.forget("n9", force=False)).status == 404


def test_a_manual_change_racing_another_on_the_same_shard_is_refused() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n3", "n4", "n5"]], live=set(NAMES))
    drv = MembershipDriver(node)
    first = run(drv.change_replica(0, "n4", "add"))
    assert first.status == 202 and first.body["move"]["kind"] == "promote", first.body
    second = run(drv.change_replica(0, "n5", "add"))
    assert second.status == 409 and "change in progress" in second.body["error"], second.body
    assert run(drv.change_replica(1, "n4", "add")).status == 409  # a voter already
    assert run(drv.change_replica(7, "n4", "add")).status == 404
    assert run(drv.change_replica(1, "n1", "remove")).status == 202  # a learner of shard 1


def test_leave_is_refused_when_nobody_could_take_its_voters() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n3", "n4", "n5"]], live={"n2", "n3"})  # n4, n5 down
    drv = MembershipDriver(node)
    refused = run(drv.leave("n2"))
    assert refused.status == 409 and "2 live active node(s) remain" in refused.body["error"], refused.body
    assert run(drv.leave("n4")).status == 409  # not live: forget it instead
    node.link.live = set(NAMES)
    ok = run(drv.leave("n2"))
    assert ok.status == 202 and ok.body["shards"] == [0], ok.body


def test_shard_leader_promotes_only_a_caught_up_learner_one_change_at_a_time() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n4", "n5"]], live=set(NAMES))
    drv = MembershipDriver(node)
    table = node.meta_host.state.membership
    raft = node.hosts[0].raft
    raft.leader = True
    raft.progress = {mid(n): FakeProgress(100) for n in NAMES}
    raft.progress[mid("n4")] = FakeProgress(100 - node.cfg.cluster.promote_lag_entries - 1)
    assert run(drv.change_replica(0, "n4", "add")).status == 202
    drv._drive_moves(table, 0.0)
    assert raft.proposed == []  # n4 is too far behind
    raft.progress[mid("n4")] = FakeProgress(100)
    raft.pending = ConfState.of([*raft.conf.voters, (9, "x")], raft.conf.learners)  # another change pending
    drv._drive_moves(table, 1.0)
    assert raft.proposed == []
    raft.pending = None
    drv._drive_moves(table, 2.0)
    assert raft.proposed == [ConfChange(ConfChangeType.PROMOTE, mid("n4"))]
    # applied: the move ends (MoveEnd proposed to the metadata group)
    raft.conf = ConfState.of([*raft.conf.voters, mid("n4")], [m for m in raft.conf.learners if m != mid("n4")])
    drv._drive_moves(table, 3.0)
    assert 0 not in table.moves and table.history[-1].outcome == "done"


def test_forgotten_member_is_no_peer_any_more() -> None:
    node = FakeNode([["n1", "n2", "n3"], ["n3", "n4", "n5"]], live={"n2", "n3", "n4"})
    drv = MembershipDriver(node)
    assert run(drv.forget("n5", force=False)).status == 200
    drv._fence(node.meta_host.state.membership)
    assert node.link.transport.removed == ["n5"]


def test_a_node_whose_removal_committed_while_it_was_cut_off_plans_its_readdition() -> None:
    # sim --cluster seed 30007: remove-replica n1 of shard 0 committed on n2 and n3 while n1 was cut
    # off, so n1's replica never got the entry and still lists n1 as a voter (and never learns
    # otherwise: the leader sends nothing to a non-member). n1, the metadata leader, planned from that
    # replica: shard 0 at its target, nothing to do, 30 s after the heal still 2 of 3 voters.
    node = FakeNode([["n1", "n2", "n3"], ["n1", "n2", "n3"]], live={"n2", "n3"})  # n4, n5 down
    drv = MembershipDriver(node)
    table = node.meta_host.state.membership
    started = run(drv.change_replica(0, "n1", "remove"))
    assert started.status == 202, started.body
    # the shard's leader (another node) applied it and ended the move; this replica never saw it
    assert table.apply_move_end(c.MoveEnd(0, started.body["move"]["id"], "done", 2000))
    assert mid("n1") in node.hosts[0].raft.active_conf_state.voters
    views = {g.shard: g for g in drv._group_views(table)}
    assert views[0].voters == (mid("n2"), mid("n3")) and not views[0].busy and views[0].leader is None
    assert views[1].voters == (mid("n1"), mid("n2"), mid("n3"))  # untouched: no removal of n1 there
    moves = run(drv.reconcile(table, 0.0))
    assert [(m.shard, m.kind, m.node) for m in moves] == [(0, "add_learner", "n1")], moves
    assert table.moves[0].kind == "add_learner"
    # once re-added (a later done move of n1), its replica's configuration is believed again
    assert table.apply_move_end(c.MoveEnd(0, table.moves[0].id, "done", 3000))
    views = {g.shard: g for g in drv._group_views(table)}
    assert mid("n1") in views[0].voters
