"""The leader stamps replicated time (issue 21, item 7): an entry another member forwards carries
that member's clock, which may be skewed; the leader replaces every time in it with its own before
it enters the log, so lease ends, session expiry and message times move with the leaders' clocks
only, and every replica applies the same times."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore

LEADER_NOW = 1_700_000_000_000
SKEW_MS = 3_600_000  # the forwarding node's clock is an hour ahead


def leader_host(tmp_path: Path) -> ShardHost:
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    member = (1, "storage")
    raft, raft_log = build_replica(member, [member], [], 0, 0, [], None, 0, random.Random(0))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), ApplyHooks(on_effects=lambda h, fx: None,
                                                                  now_ms=lambda: LEADER_NOW),
                     snapshot_every_entries=1_000_000, max_entry_bytes=1 << 20)
    raft.campaign()
    host.seal()
    synced(host)
    return host


def synced(host: ShardHost) -> None:
    while host.after_sync(lambda shard, hs: None):
        host.take_ready()


def test_forwarded_entries_carry_the_leaders_time(tmp_path: Path) -> None:
    async def body() -> None:
        host = leader_host(tmp_path)
        skewed = LEADER_NOW + SKEW_MS
        entry = c.encode_entry([
            c.SessionOpen(skewed, "cid", False, 600, None, owner_node=2, lease_ms=10_000),
            c.Publish(StoredMessage("t/a", b"x", 1, False, bytes(16), skewed)),
        ], origin=2, boot=1, seq=1)
        host.propose_forwarded([entry])
        rd = host.take_ready()
        assert rd is not None and rd.entries
        logged = c.decode_entry(rd.entries[-1].data)
        assert [getattr(cmd, "ts_ms", None) or cmd.msg.ts_ms for cmd in logged] == [LEADER_NOW, LEADER_NOW]  # type: ignore[union-attr]
        synced(host)
        sess = host.state.sessions.sessions["cid"]
        assert sess.lease_until_ms == LEADER_NOW + 10_000  # not an hour and ten seconds from now
        assert host.state.topics.last_ts_ms == LEADER_NOW
        stored = host.message(0)
        assert stored is not None and stored.ts_ms == LEADER_NOW

    asyncio.run(body())


def test_the_leaders_stamps_never_go_back(tmp_path: Path) -> None:
    async def body() -> None:
        host = leader_host(tmp_path)
        clock = iter([LEADER_NOW, LEADER_NOW - 5_000])  # the leader's wall clock stepped back
        host.hooks.now_ms = lambda: next(clock)
        for seq in (1, 2):
            host.propose_forwarded([c.encode_entry([c.SessionHousekeeping(0)], origin=2, boot=1, seq=seq)])
        rd = host.take_ready()
        assert rd is not None
        stamps = [c.decode_entry(e.data)[0].ts_ms for e in rd.entries if e.data]  # type: ignore[attr-defined]
        assert stamps == [LEADER_NOW, LEADER_NOW]

    asyncio.run(body())
