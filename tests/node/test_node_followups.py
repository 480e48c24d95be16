"""Follow-ups derived from replicated state (issue 29 item 3, sessions/followups.py), on a running
node whose housekeeping rounds are fast: acknowledgements committed in a session's shard whose ack
report never reached the topic shard are reported again, and registrations no subscription stands
behind are unregistered, while everything that may still be wanted is left alone.

On 38673de neither happened outside ``reconcile_after_restart`` (a restart of a single node; never
in a cluster): the acknowledged messages stayed owed and the ghosts kept collecting messages."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node

WAIT_S = 5.0  # rounds run every 0.05 s; two are needed


def _config(tmp_path: Path) -> NodeConfig:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.shard.housekeeping_interval_s = 0.05
    cfg.sys.interval_s = 0
    return cfg


async def _run(node: Node, shard: int, cmd: c.Command) -> Any:
    fut = node.propose(shard, cmd)
    assert fut is not None
    return await asyncio.wait_for(fut, 10)


async def _open(node: Node, client_id: str, clean: bool = True) -> Any:
    return await _run(node, node.session_shard(client_id), c.SessionOpen(node.now_ms(), client_id, clean, 3600, None))


async def _subscribe(node: Node, client_id: str, epoch: int, flt: str) -> int:
    """The session's subscription (committed); returns its version. No registration."""
    shard = node.session_shard(client_id)
    await _run(node, shard, c.SessionSubscribe(client_id, epoch, flt, 1, False, False, 0, None))
    return int(node.hosts[shard].state.sessions.sessions[client_id].subs[flt].version)


async def _register(node: Node, client_id: str, inc: int, flt: str, version: int, group: str | None = None) -> str:
    rk = f"{c.SHARE_PREFIX}{group}\0{flt}" if group is not None else f"{client_id}\0{flt}"
    await _run(node, node.topic_shard(flt), c.Register(node.now_ms(), rk, client_id if group is None else "", inc,
                                                        flt, 1, share_group=group, sub_version=version))
    return rk


async def _publish(node: Node, topic: str, n: int) -> None:
    for i in range(n):
        await node.publish(StoredMessage(topic, b"x", 1, False, f"{topic}/{i}".encode().ljust(16, b"."), node.now_ms()))


async def _until(cond: Any, timeout: float = WAIT_S) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


def _metric(node: Node, name: str) -> int:
    followups = getattr(node.housekeeping, "followups", None)
    return int(getattr(followups, name, -1))


def test_acknowledgements_whose_report_was_lost_are_reported_again(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(_config(tmp_path))
        node.open()
        await node.start()
        try:
            topic = "acks/t"
            tshard = node.topic_shard(topic)
            opened = await _open(node, "sub")
            version = await _subscribe(node, "sub", opened.epoch, topic)
            rk = await _register(node, "sub", opened.incarnation, topic, version)
            await _publish(node, topic, 4)
            reg = node.hosts[tshard].state.topics.regs[rk]
            offsets = list(reg.owed)
            assert len(offsets) == 4
            sshard = node.session_shard("sub")
            # The first three delivered (committed), then the first two acknowledged (committed):
            # no AckReport follows, as when the node that proposed the acks crashed right then.
            items = tuple(c.DeliveryItem(tshard, o, 1, False, (), (rk,)) for o in offsets[:3])
            assert await _run(node, sshard, c.Deliver("sub", opened.epoch, 0, items))
            await _run(node, sshard, c.SessionAcks("sub", opened.epoch, ((0, 1), (1, 1))))
            released = await _until(lambda: list(reg.owed) == offsets[2:])
            assert released, f"acknowledged offsets still owed: {list(reg.owed)} (acked {offsets[:2]})"
            # In flight (offsets[2]) and not delivered (offsets[3]): still owed, rounds later.
            await asyncio.sleep(0.3)
            assert list(reg.owed) == offsets[2:]
            assert _metric(node, "acks_resent") == 2
            # A $share member's: its finished deliveries (share_done) are reported again.
            stopic = "acks/s"
            srk = await _register(node, "", -1, stopic, -1, group="grp")
            sshard_t = node.topic_shard(stopic)
            await _run(node, sshard_t, c.ShareMember(srk, "sub", True, opened.incarnation))
            await _publish(node, stopic, 2)
            sreg = node.hosts[sshard_t].state.topics.regs[srk]
            soffsets = list(sreg.owed)
            sitems = tuple(c.DeliveryItem(sshard_t, o, 1, False, (), (srk,)) for o in soffsets)
            assert await _run(node, sshard, c.Deliver("sub", opened.epoch, 3, sitems))
            await _run(node, sshard, c.SessionAcks("sub", opened.epoch, ((3, 1),)))
            released = await _until(lambda: list(sreg.owed) == soffsets[1:])
            assert released, f"a $share member's acknowledged offset still owed: {list(sreg.owed)} (acked {soffsets[0]})"
            assert _metric(node, "acks_resent") == 3
        finally:
            await node.stop()

    asyncio.run(main())


def test_registrations_no_subscription_stands_behind_are_unregistered(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moorline.node")

    async def main() -> None:
        node = Node(_config(tmp_path))
        node.open()
        await node.start()
        try:
            opened = await _open(node, "a")
            inc, epoch = opened.incarnation, opened.epoch
            wanted = await _register(node, "a", inc, "g/wanted", await _subscribe(node, "a", epoch, "g/wanted"))
            # The same incarnation without that subscription (a SUBSCRIBE undone, an UNSUBSCRIBE
            # whose Unregister was lost): the session has applied past the registration's version.
            sessions = node.hosts[node.session_shard("a")].state.sessions
            unsubscribed = await _register(node, "a", inc, "g/unsubscribed", sessions.sessions["a"].sub_version)
            # A registration of a version this replica has not seen yet: a SUBSCRIBE on its way.
            ahead = await _register(node, "a", inc, "g/ahead", sessions.sessions["a"].sub_version + 5)
            # Of an incarnation that is gone (a clean start replaced it; its end never unregistered).
            old = await _open(node, "b")
            ended = await _register(node, "b", old.incarnation, "g/ended", await _subscribe(node, "b", old.epoch, "g/ended"))
            await _open(node, "b", clean=True)
            # Of an incarnation the session shard's replica has not opened yet.
            bshard = node.hosts[node.session_shard("b")].state.sessions
            unborn = await _register(node, "b", bshard.incarnations + 1, "g/unborn", 0)
            # Of an incarnation a clean start on another node replaced while the previous owner's
            # lease runs (60 s): the new owner ends it after its wait, not the follow-ups.
            lshard = node.session_shard("t")
            first = await _run(node, lshard, c.SessionOpen(node.now_ms(), "t", False, 3600, None, owner_node=7,
                                                           lease_ms=60_000))
            taken = await _register(node, "t", first.incarnation, "g/taken", await _subscribe(node, "t", first.epoch, "g/taken"))
            await _run(node, lshard, c.SessionOpen(node.now_ms(), "t", True, 3600, None, owner_node=8, lease_ms=60_000))
            assert node.hosts[lshard].state.sessions.sessions["t"].prev_lease is not None
            # A $share group's, and a draining one (unsubscribed, finishing what is owed).
            share = await _register(node, "", -1, "g/share", -1, group="grp")
            draining = await _register(node, "a", inc, "g/draining", await _subscribe(node, "a", epoch, "g/draining"))
            await _run(node, node.session_shard("a"), c.SessionUnsubscribe("a", epoch, "g/draining"))
            await _publish(node, "g/draining", 1)
            await _run(node, node.topic_shard("g/draining"), c.Unregister(draining, inc, "unsubscribe"))

            def regs() -> dict[str, bool]:
                keys = (wanted, unsubscribed, ahead, ended, unborn, taken, share, draining)
                return {k.replace("\0", " "): k in node.hosts[node.topic_shard(k.rpartition("\0")[2])].state.topics.regs
                        for k in keys}

            gone = {unsubscribed.replace("\0", " "), ended.replace("\0", " ")}
            assert await _until(lambda: not any(v for k, v in regs().items() if k in gone)), regs()
            await asyncio.sleep(0.3)  # several rounds more: the others stay
            assert regs() == {k: k not in gone for k in regs()}
            assert _metric(node, "ghosts_unregistered") == 2
            assert "'a g/unsubscribed' (subscribe_failed" in caplog.text
            assert "'b g/ended' (session_expired" in caplog.text
        finally:
            await node.stop()

    asyncio.run(main())


def test_the_topic_shards_leader_follows_up_from_its_replicas_in_a_cluster(tmp_path: Path) -> None:
    """Three nodes in one process: commands proposed through a follower, the session's shard led
    by another node than the topic's. Only the topic shard's leader acts; every replica follows."""
    from tests.node.inproc_cluster import InProcCluster

    def tune(cfg: NodeConfig) -> None:
        cfg.shard.housekeeping_interval_s = 0.1

    async def main() -> None:
        c3 = InProcCluster(tmp_path, shards=4, tune=tune)
        await c3.start()
        try:
            await c3.wait_leaders()
            nodes = c3.nodes

            def leader(shard: int) -> str:
                return next(n for n, nd in nodes.items() if nd.hosts[shard].raft.is_leader)

            any_node = nodes["n1"]
            topic = next(f"cl/{i}" for i in range(1000)
                         if any_node.topic_shard(f"cl/{i}") != any_node.session_shard("cs"))
            tshard, sshard = any_node.topic_shard(topic), any_node.session_shard("cs")
            via = next(n for n in nodes if n != leader(tshard))  # proposals forwarded by a follower
            node = nodes[via]
            opened = await _open(node, "cs")
            version = await _subscribe(node, "cs", opened.epoch, topic)
            rk = await _register(node, "cs", opened.incarnation, topic, version)
            ghost = await _register(node, "cs", opened.incarnation, topic + "/ghost", version)
            gshard = node.topic_shard(topic + "/ghost")
            await _publish(node, topic, 2)
            await c3.wait("every replica applied", c3.applied_equal)
            leads = (leader(tshard), leader(gshard))
            offsets = list(node.hosts[tshard].state.topics.regs[rk].owed)
            items = tuple(c.DeliveryItem(tshard, o, 1, False, (), (rk,)) for o in offsets)
            assert await _run(node, sshard, c.Deliver("cs", opened.epoch, 0, items))
            await _run(node, sshard, c.SessionAcks("cs", opened.epoch, ((0, 1), (1, 1))))

            def followed_up() -> bool:
                return all(not nd.hosts[tshard].state.topics.regs[rk].owed
                           and ghost not in nd.hosts[gshard].state.topics.regs for nd in nodes.values())

            await c3.wait("acks reported and the ghost unregistered on every replica", followed_up, WAIT_S)
            acks = {n: _metric(nd, "acks_resent") for n, nd in nodes.items()}
            ghosts = {n: _metric(nd, "ghosts_unregistered") for n, nd in nodes.items()}
            assert sum(acks.values()) == 2 and sum(ghosts.values()) == 1, (acks, ghosts)
            # Only the shards' leaders acted (leadership may have moved since: then its leaders then).
            assert {n for n, k in acks.items() if k} <= {leads[0], leader(tshard)}, (leads, acks)
            assert {n for n, k in ghosts.items() if k} <= {leads[1], leader(gshard)}, (leads, ghosts)
        finally:
            await c3.close()

    asyncio.run(main())
