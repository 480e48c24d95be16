"""Failure paths leave no ghosts (issue 19 item 12): a SUBSCRIBE whose registration fails part-way is
undone everywhere it reached; Register/Unregister carry the subscription version so the latest wins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.topic_state import TopicLimits, TopicState
from moorline.config import NodeConfig
from moorline.node.node import Node, reg_key_for
from moorline.node.replication.shard_host import ShardUnavailable
from moorline.node.sessions.delivery import LiveSession


async def _node_with_session(tmp_path: Path) -> tuple[Node, LiveSession]:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 4
    node = Node(cfg)
    node.open()
    await node.start()
    _present, epoch, inc = await node.open_session("sub-1", False, 600, None, "")
    live = LiveSession(node, "sub-1", epoch, inc, 16, lambda outs: None, lambda pid: None)
    node.live["sub-1"] = live
    return node, live


def test_wildcard_subscribe_failing_in_one_shard_leaves_no_registration(tmp_path: Path) -> None:
    async def body() -> None:
        node, live = await _node_with_session(tmp_path)
        try:
            bad = 2
            node.hosts[bad].fail("test: shard unavailable")
            with pytest.raises(ShardUnavailable):
                await node.subscribe(live, "a/#", 1, False, False, 0, None)
            await asyncio.sleep(0.05)  # let the undo's cross-shard commands apply everywhere
            reg_key, _, _ = reg_key_for("sub-1", "a/#")
            left = [h.shard for h in node.hosts if h.shard != bad and reg_key in h.state.topics.regs]
            assert left == [], f"registration left behind in shards {left}"
            sess = live.session()
            assert sess is not None and "a/#" not in sess.subs
            # A publish to a healthy shard is then owed to nobody: nothing could deliver it.
            topic = next(f"a/{i}" for i in range(100) if node.topic_shard(f"a/{i}") != bad)
            await node.publish(StoredMessage(topic, b"x", 1, False, b"g" * 16, node.now_ms()))
            assert all(not reg.owed for h in node.hosts if h.shard != bad for reg in h.state.topics.regs.values())
        finally:
            await node.stop()

    asyncio.run(body())


def test_wildcard_subscribe_on_healthy_node_registers_everywhere(tmp_path: Path) -> None:
    """The check above can fail: the same subscribe without a failed shard registers in every shard."""
    async def body() -> None:
        node, live = await _node_with_session(tmp_path)
        try:
            await node.subscribe(live, "a/#", 1, False, False, 0, None)
            reg_key, _, _ = reg_key_for("sub-1", "a/#")
            assert all(reg_key in h.state.topics.regs for h in node.hosts)
        finally:
            await node.stop()

    asyncio.run(body())


def _register(version: int, qos: int) -> c.Register:
    return c.Register(1000, "cid\x00a/#", "cid", 1, "a/#", qos, False, False, None, version)


def test_register_and_unregister_of_an_older_version_lose_to_a_newer_one() -> None:
    t = TopicState(0, "inc", TopicLimits(shard_max_bytes=1 << 30, reserved_headroom_bytes=0))
    t.apply_register(_register(3, 2), Effects())
    t.apply_register(_register(2, 1), Effects())  # arrives late: an older SUBSCRIBE's options
    assert t.regs["cid\x00a/#"].qos == 2
    assert not t.apply_unregister(c.Unregister("cid\x00a/#", 1, "subscribe_failed", 2), Effects())
    assert "cid\x00a/#" in t.regs
    assert t.apply_unregister(c.Unregister("cid\x00a/#", 1, "subscribe_failed", 3), Effects())
    assert "cid\x00a/#" not in t.regs
    # Entries written before versions (-1) apply unchecked, as they did.
    t.apply_register(_register(5, 1), Effects())
    t.apply_register(_register(-1, 0), Effects())
    assert t.regs["cid\x00a/#"].qos == 0
