"""The cluster simulator's bug switches (testing/faults.py, docs/simulation.md "Bug switches"): each
changes the node's behaviour exactly as its bug would, and the default build behaves as before.

Every test runs the same scenario twice, switch on and off, and asserts both outcomes: the broken
one shows the bug, the default one does not (so each assertion is seen to be able to fail). The
cluster scenarios run real nodes in the simulator's World (virtual time, seeded), the others a
single in-process Node."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.topic_state import PublishResult, TopicLimits, TopicState
from moorline.config import NodeConfig
from moorline.node.node import Node, reg_key_for
from moorline.node.sessions.delivery import LiveSession, OutboundPublish
from moorline.sim.cluster.vloop import Deadlock
from moorline.sim.cluster.world import SimNode, World, quiet_logs, run_coro
from moorline.testing.faults import CLUSTER_SWITCHES, Faults

pytestmark = pytest.mark.timeout(180)


def _msg(topic: str, guid: bytes, qos: int = 1, ts_ms: int = 1_000) -> StoredMessage:
    return StoredMessage(topic, b"payload", qos, False, guid, ts_ms)


# --- the simulator's world --------------------------------------------------------------------------
@pytest.fixture
def world_factory(tmp_path: Path) -> Iterator[Any]:
    worlds: list[World] = []

    def make(*switches: str, seed: int = 5) -> World:
        quiet_logs()
        world = World(seed, tmp_path / f"w{len(worlds)}", switches=frozenset(switches))
        worlds.append(world)
        world.start_all()
        assert world.wait_ready(60), world.events
        world.run_for(2)  # the metadata group's record, leaders settled
        return world

    yield make
    for w in worlds:
        w.close()


def _node(sn: SimNode) -> Node:
    assert sn.node is not None
    return sn.node


def _leader_of(world: World, shard: int) -> SimNode:
    return next(sn for sn in world.nodes if _node(sn).hosts[shard].raft.is_leader)


def _isolate(world: World, sn: SimNode) -> None:
    for other in world.nodes:
        if other is not sn:
            world.net.cut(sn.host, other.host)


def _stored_guids(sn: SimNode, shard: int) -> list[bytes]:
    host = _node(sn).hosts[shard]
    out = []
    for offset in host.state.topics.meta:
        msg = host.message(offset)
        assert msg is not None
        out.append(msg.guid)
    return out


def test_every_cluster_switch_is_a_broken_fault_field() -> None:
    for name in CLUSTER_SWITCHES:
        assert getattr(Faults(), name) is False
        assert Faults(**{name: True}).any_broken
        assert Faults.from_json(Faults(**{name: True}).to_json()) == Faults(**{name: True})
    assert not Faults().any_broken


# --- 1. dedup_at_propose_only -------------------------------------------------------------------------
@pytest.mark.parametrize("broken", [False, True])
def test_apply_checks_guids_unless_dedup_is_at_propose_only(broken: bool) -> None:
    """The pure state machine: with the flag its apply does not consult the GUID history, in a
    run of publishes or across entries; without it a repeated GUID is a duplicate."""
    t = TopicState(0, "inc", TopicLimits(dedup_at_propose_only=broken))
    guid = b"g" * 16
    first = t.apply_publishes([c.Publish(_msg("a", guid)), c.Publish(_msg("a", guid))], Effects())
    later = t.apply_publish(c.Publish(_msg("a", guid)), Effects())
    if broken:
        assert [r.status for r in [*first, later]] == ["ok", "ok", "ok"] and t.next_offset == 3
        assert t.dedup.get("", guid) == (0, 1_000, t.dedup.get("", guid)[2])  # type: ignore[index]
    else:
        assert [r.status for r in [*first, later]] == ["ok", "duplicate", "duplicate"] and t.next_offset == 1


@pytest.mark.parametrize("broken", [False, True])
def test_dedup_at_propose_only_stores_a_copy_resent_through_another_node(world_factory: Any, broken: bool) -> None:
    """The same GUID through two nodes at once: the broken build stores it twice (each node found
    nothing in its own replica, the shard did not check); the default one once. A later copy
    through a third node, once its replica holds the GUID, is a duplicate in both."""
    world = world_factory(*(["dedup_at_propose_only"] if broken else []))
    n1, n2, n3 = world.nodes
    topic = "dedup/x"
    shard = _node(n1).topic_shard(topic)
    msg = _msg(topic, b"d" * 16, ts_ms=_node(n1).now_ms())
    tasks = [sn.loop.create_task(_node(sn).publish(msg)) for sn in (n1, n2)]
    world.run_for(3)
    results: list[PublishResult] = [t.result() for t in tasks]
    stored = _stored_guids(n3, shard).count(msg.guid)
    if broken:
        assert [r.status for r in results] == ["ok", "ok"] and results[0].offset != results[1].offset
        assert stored == 2
    else:
        assert sorted(r.status for r in results) == ["duplicate", "ok"]
        assert results[0].offset == results[1].offset and stored == 1
    again = run_coro(world, n3.loop, _node(n3).publish(msg), 5)
    assert again.status == "duplicate"
    world.run_for(1)
    assert _stored_guids(n1, shard).count(msg.guid) == (2 if broken else 1)


# --- 2. renumber_packet_ids_on_takeover -----------------------------------------------------------------
@pytest.mark.parametrize("broken", [False, True])
def test_resumed_session_resends_with_original_packet_ids_unless_renumbered(tmp_path: Path, broken: bool) -> None:
    async def body() -> tuple[list[OutboundPublish], list[OutboundPublish]]:
        cfg = NodeConfig()
        cfg.data_dir = str(tmp_path / "data")
        cfg.shard.count = 4
        node = Node(cfg, Faults(renumber_packet_ids_on_takeover=broken))
        node.open()
        await node.start()
        try:
            sent: list[OutboundPublish] = []
            _present, epoch, inc = await node.open_session("sub", False, 600, None, "")
            live = LiveSession(node, "sub", epoch, inc, 16, sent.extend, lambda pid: None)
            node.live["sub"] = live
            live.start()
            await node.subscribe(live, "t/#", 1, False, False, 0, None)
            for i in range(3):
                await node.publish(_msg(f"t/{i}", bytes([i]) * 16, ts_ms=node.now_ms()))
            for _ in range(100):
                if len(sent) == 3:
                    break
                await asyncio.sleep(0.01)
            await node.close_session(live, False, None)  # no PUBACK came: all three unacknowledged
            resent: list[OutboundPublish] = []
            _present, epoch2, inc2 = await node.open_session("sub", False, 600, None, "")
            again = LiveSession(node, "sub", epoch2, inc2, 16, resent.extend, lambda pid: None)
            node.live["sub"] = again
            again.start()
            await asyncio.sleep(0.05)
            await again.close()
            return sent, resent
        finally:
            await node.stop()

    sent, resent = asyncio.run(body())
    assert len(sent) == 3 and len(resent) == 3 and all(o.dup for o in resent)
    assert [o.msg.guid for o in resent] == [o.msg.guid for o in sent]
    original, again = [o.packet_id for o in sent], [o.packet_id for o in resent]
    if broken:
        assert not set(original) & set(again), (original, again)
    else:
        assert again == original


# --- 3. no_owner_lease ----------------------------------------------------------------------------------
class _FakeConnection:
    def __init__(self, live: LiveSession, world: World) -> None:
        self.live = live
        self.world = world
        self.closed_with: list[tuple[int, float]] = []  # (reason code, world time)

    def disconnect(self, code: int, reason: str) -> None:
        self.closed_with.append((code, self.world.scheduler.now))


@pytest.mark.parametrize("broken", [False, True])
def test_owner_lease_holds_a_takeover_and_closes_an_owner_cut_off(world_factory: Any, broken: bool) -> None:
    """A session owned by n1, then n1 cut off: a takeover on n2 waits for n1's lease to run out,
    and n1 closes its client before then. The broken build serves on n2 at once, and n1 keeps
    serving past its lease: two owners."""
    world = world_factory(*(["no_owner_lease"] if broken else []))
    n1, n2, _ = world.nodes
    node1, node2 = _node(n1), _node(n2)
    lease_s = node1.cfg.session.owner_lease_s
    _present, epoch, inc = run_coro(world, n1.loop, node1.open_session("c1", False, 600, None, ""), 5)
    live = LiveSession(node1, "c1", epoch, inc, 16, lambda outs: None, lambda pid: None)
    conn = _FakeConnection(live, world)
    node1.live["c1"], node1.connections["c1"] = live, conn
    _isolate(world, n1)
    started = world.scheduler.now
    task = n2.loop.create_task(node2.open_session("c1", False, 600, None, ""))
    world.run_for(2.5)
    if broken:
        assert task.done() and task.result()[1] > epoch  # serving on n2 while n1 still serves
    else:
        assert not task.done()
        world.run_for(lease_s)
        assert task.done() and world.scheduler.now - started > lease_s * 0.8
    world.run_for(max(0.0, started + lease_s + 2 - world.scheduler.now))  # n1's lease is over
    if broken:
        assert conn.closed_with == []
    else:
        code, at = conn.closed_with[0]
        assert code == 0x80 and at < started + lease_s  # closed before its lease could end


# --- 4. ack_before_quorum -------------------------------------------------------------------------------
@pytest.mark.parametrize("broken", [False, True])
def test_publish_answered_only_once_committed_unless_ack_before_quorum(world_factory: Any, broken: bool) -> None:
    """A shard's leader cut off from its followers: its publish never commits. The default build
    does not answer it; the broken one answers 'ok' once the leader's own log has it."""
    world = world_factory(*(["ack_before_quorum"] if broken else []))
    node = _node(world.nodes[0])
    topic = "ackq/x"
    shard = node.topic_shard(topic)
    leader = _leader_of(world, shard)
    lnode = _node(leader)
    _isolate(world, leader)
    msg = _msg(topic, b"q" * 16, ts_ms=lnode.now_ms())
    if broken:
        result = run_coro(world, leader.loop, lnode.publish(msg), 0.5)
        assert result.status == "ok"
        raft = lnode.hosts[shard].raft
        assert raft.log.committed < raft.log.last_index()  # acknowledged, not committed
    else:
        with pytest.raises(Deadlock):
            run_coro(world, leader.loop, lnode.publish(msg), 3)
    assert msg.guid not in _stored_guids(leader, shard)


# --- 5. forwarder_drops_on_leader_change ----------------------------------------------------------------
@pytest.mark.parametrize("broken", [False, True])
def test_forwarder_hands_pending_proposals_to_a_new_leader_unless_it_drops_them(world_factory: Any,
                                                                                broken: bool) -> None:
    """A follower forwards a publish to a leader that is cut off right then; a new leader is
    elected. The default follower hands the publish to it (answered, stored); the broken one
    forgets it: never answered, never stored, and its later proposals to that shard stall too."""
    world = world_factory(*(["forwarder_drops_on_leader_change"] if broken else []))
    topic = "fwd/x"
    shard = _node(world.nodes[0]).topic_shard(topic)
    leader = _leader_of(world, shard)
    follower = next(sn for sn in world.nodes if sn is not leader)
    fnode = _node(follower)
    _isolate(world, leader)
    first = _msg(topic, b"f" * 16, ts_ms=fnode.now_ms())
    task = follower.loop.create_task(fnode.publish(first))
    world.run_for(8)  # an election (1 s timeout) and the hand-over
    assert fnode.hosts[shard].raft.lead not in (None, leader.node.member if leader.node else None)
    later = follower.loop.create_task(fnode.publish(_msg(topic, b"h" * 16, ts_ms=fnode.now_ms())))
    world.run_for(5)
    if broken:
        assert not task.done() and not later.done()
        assert first.guid not in _stored_guids(follower, shard)
    else:
        assert task.done() and task.result().status == "ok" and later.done()
        assert first.guid in _stored_guids(follower, shard)


# --- 6. suback_before_all_shards ------------------------------------------------------------------------
@pytest.mark.parametrize("broken", [False, True])
def test_subscribe_returns_after_every_shard_registered_unless_suback_early(tmp_path: Path, broken: bool) -> None:
    """A wildcard filter over 8 shards, the cross-shard commands delayed and reordered (seeded):
    the default subscribe returns once every shard registered; the broken one after the first."""
    async def body() -> list[bool]:
        cfg = NodeConfig()
        cfg.data_dir = str(tmp_path / "data")
        cfg.shard.count = 8
        node = Node(cfg, Faults(cross_shard_chaos_seed=3, suback_before_all_shards=broken))
        node.open()
        await node.start()
        try:
            _present, epoch, inc = await node.open_session("sub", False, 600, None, "")
            live = LiveSession(node, "sub", epoch, inc, 16, lambda outs: None, lambda pid: None)
            node.live["sub"] = live
            await node.subscribe(live, "s/#", 1, False, False, 0, None)
            reg_key, _, _ = reg_key_for("sub", "s/#")
            registered = [reg_key in h.state.topics.regs for h in node.hosts]
            await asyncio.sleep(0.1)  # the rest do register, later
            assert all(reg_key in h.state.topics.regs for h in node.hosts)
            return registered
        finally:
            await node.stop()

    registered = asyncio.run(body())
    if broken:
        assert registered[0] and not all(registered), registered
    else:
        assert all(registered)
