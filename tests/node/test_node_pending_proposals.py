"""raft.max_pending_proposals: a node whose shard has no reachable leader keeps what it proposed (to
hand it to the next leader) only up to a bound; past it new proposals are refused — truthfully,
since they entered no log — instead of the node holding every publish sent meanwhile."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost, ShardUnavailable
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore


def leaderless_host(tmp_path: Path, cap: int) -> ShardHost:
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    me, peer = (1, "a"), (2, "b")
    raft, raft_log = build_replica(me, [me, peer], [], 0, 0, [], None, 0, random.Random(0))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), ApplyHooks(on_effects=lambda h, fx: None),
                     snapshot_every_entries=1_000_000, max_entry_bytes=1 << 20)
    host.max_pending_proposals = cap
    return host


def publish(i: int) -> c.Command:
    return c.Publish(StoredMessage("t", b"x", 1, False, i.to_bytes(16, "big"), 1))


def test_proposals_beyond_the_bound_are_refused_while_no_leader_takes_them(tmp_path: Path) -> None:
    async def body() -> None:
        host = leaderless_host(tmp_path, cap=3)
        futs = []
        for i in range(3):  # one entry each: sealed, kept for a leader that does not come
            futs.append(host.propose(publish(i)))
            host.seal()
        with pytest.raises(ShardUnavailable, match="max_pending_proposals"):
            host.propose(publish(99))
        with pytest.raises(ShardUnavailable, match="entered no log"):
            host.propose_group([publish(100)], lambda results, exc: None)
        assert host.propose(c.AckReport("k", (1,)), want_result=False) is None  # nobody waits: dropped
        assert not any(f is not None and f.done() for f in futs)  # the kept ones still wait for a leader

    asyncio.run(body())


def test_below_the_bound_proposals_are_kept(tmp_path: Path) -> None:
    async def body() -> None:
        host = leaderless_host(tmp_path, cap=256)
        for i in range(10):
            host.propose(publish(i))
            host.seal()
        assert host.propose(publish(10)) is not None

    asyncio.run(body())
