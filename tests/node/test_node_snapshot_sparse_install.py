"""A follower that installs a leader's snapshot gets every message the state keeps, including one
kept below the leader store's low-water mark (moorline sim --cluster, seed 203).

Retention releases messages out of offset order: one still owed to a subscriber stays while the
unowed ones after it go, so the store's low-water mark ("every offset from here up is present")
rises above a message the state keeps. A transfer that sent records from that mark installed a
replica whose state kept the message and whose store did not have it: lost on that replica, for
every subscriber it would serve."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from tests.node.inproc_cluster import InProcCluster

pytestmark = pytest.mark.timeout(120)


def tune(cfg: NodeConfig) -> None:
    cfg.shard.snapshot_every_entries = 10
    cfg.raft.follower_log_margin_entries = 5
    cfg.retention.min_age_s = 0.2
    cfg.shard.housekeeping_interval_s = 0.1
    cfg.cluster.snapshot_stall_timeout_s = 2.0


def leader_of(c_: InProcCluster, shard: int) -> str:
    return next(name for name, nd in c_.nodes.items() if nd.hosts[shard].raft.is_leader)


def test_a_message_kept_below_the_low_water_mark_is_installed_with_the_snapshot(tmp_path: Path) -> None:
    async def body() -> None:
        cl = InProcCluster(tmp_path, shards=1, tune=tune)
        try:
            await cl.start()
            await cl.wait_leaders()
            await cl.stop("n3")
            await cl.wait_leaders()
            lead = cl.nodes[leader_of(cl, 0)]
            # A subscription that never reads: what it is owed stays kept past retention.
            fut = lead.propose(0, c.Register(lead.now_ms(), "keeper\0keep/#", "keeper", 1, "keep/#", 1))
            assert fut is not None
            await fut
            await cl.publish(lead.cfg.cluster.node_id, 5)  # released by retention
            kept = StoredMessage("keep/1", b"owed", 1, False, b"K" * 16, lead.now_ms())
            await lead.publish(kept)
            await cl.publish(lead.cfg.cluster.node_id, 40)  # released too, so the mark passes `kept`
            t = lead.hosts[0].state.topics
            offset = next(o for o in t.meta if t.meta.guid_of(o) == b"K" * 16)
            await cl.wait("retention released the messages after the kept one",
                          lambda: lead.hosts[0].store.low_water > offset and len(t.meta) == 1)
            await cl.publish(lead.cfg.cluster.node_id, 20)  # the leader's log moves on past n3
            await cl.start("n3")
            await cl.wait("n3 caught up", cl.applied_equal)
            host = cl.nodes["n3"].hosts[0]
            assert host.installs == 1 and host.failed is None
            assert offset in host.state.topics.meta
            msg = host.message(offset)
            assert msg is not None, f"message {offset} is kept by the installed state but not in the store"
            assert msg.guid == b"K" * 16 and msg.payload == b"owed"
            for o in host.state.topics.meta:  # every kept message, from the first one
                assert host.message(o) is not None, f"kept message {o} missing after the install"
        finally:
            await cl.close()

    asyncio.run(body())
