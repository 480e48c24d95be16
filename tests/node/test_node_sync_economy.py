"""What the group commit does not sync, and what it does not hurry (cluster W1's CPU, issue 21).

- A hard state alone (a new commit index: a follower gets one after every replication round, a
  leader after every quorum) needs no fdatasync of its own; it is written with the next sync.
  Anything else pending in the WAL (entries, a snapshot mark) still syncs at once.
- In a group of several members, an entry costs a replication round on every member, so lazy
  proposals (ack reports, housekeeping) wait for an urgent proposal to the same shard or for the
  lazy timer; other shards' syncs and the group's own Raft traffic do not take them along.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from moorline.broker import commands as c
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.group_commit import GroupCommit
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost
from moorline.raft import Message, MessageType
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog
from tests.node.test_node_command_groups import make_host, publish

DELAY_MS = 200
ME, LEADER, OTHER = (1, "s1"), (2, "s2"), (3, "s3")


def _one_voter(tmp_path: Path) -> tuple[GroupCommit, WriteAheadLog]:
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    host = make_host(tmp_path, wal=wal)
    gc = GroupCommit(wal, [host], on_fatal=lambda exc: None, after_commit=lambda: None,
                     inline_sync_max_us=10_000_000, lazy_sync_delay_ms=DELAY_MS)
    return gc, wal


def _follower(tmp_path: Path) -> tuple[GroupCommit, ShardHost, list[bytes]]:
    """A shard host that follows LEADER in a group of three voters; what it forwards is recorded."""
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    raft, raft_log = build_replica(ME, [ME, LEADER, OTHER], [], 0, 0, [], None, 0, random.Random(0))
    forwarded: list[bytes] = []
    hooks = ApplyHooks(on_effects=lambda host, fx: None,
                       forward=lambda host, node, entries: forwarded.extend(entries))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), hooks, snapshot_every_entries=1_000_000)
    raft.step(Message(type=MessageType.HEARTBEAT, from_=LEADER, to=ME, term=1))
    assert raft.lead == LEADER
    gc = GroupCommit(wal, [host], on_fatal=lambda exc: None, after_commit=lambda: None,
                     inline_sync_max_us=10_000_000, lazy_sync_delay_ms=DELAY_MS)
    return gc, host, forwarded


def test_a_commit_index_alone_costs_no_sync(tmp_path: Path) -> None:
    async def body() -> None:
        gc, wal = _one_voter(tmp_path)
        host = gc.hosts[0]
        runner = asyncio.create_task(gc.run())
        fut = host.propose(publish(1))
        gc.kick(0)
        await asyncio.wait_for(fut, 5)
        assert gc.syncs == 1
        # The entry's commit index came in the Ready after the sync: staged, not synced.
        assert wal.pending_hard_state_bytes() > 0 and wal.pending_bytes() == wal.pending_hard_state_bytes()
        gc.kick(0)  # a pass with nothing else to write (a tick, a heartbeat)
        await asyncio.sleep(0.05)
        assert gc.syncs == 1, "a commit index alone cost an fdatasync"
        fut = host.propose(publish(2))
        gc.kick(0)
        await asyncio.wait_for(fut, 5)
        assert gc.syncs == 2
        applied = host.state.applied_index
        gc.stop()
        runner.cancel()
        wal.close()
        # The commit index rode on the later sync: recovery finds it, up to the entry it covered.
        reopened = WriteAheadLog(tmp_path / "wal")
        hs = reopened.open().groups[0].hard_state
        assert hs is not None and hs.commit >= applied - 1
        reopened.close()

    asyncio.run(body())


def test_other_pending_records_still_sync_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        gc, wal = _one_voter(tmp_path)
        host = gc.hosts[0]
        runner = asyncio.create_task(gc.run())
        fut = host.propose(publish(1))
        gc.kick(0)
        await asyncio.wait_for(fut, 5)
        assert gc.syncs == 1
        wal.mark_snapshot(0, 1, 1)  # written outside the group commit, as the node does
        gc.kick(0)
        await asyncio.sleep(0.05)
        assert gc.syncs == 2 and wal.pending_bytes() == 0
        gc.stop()
        runner.cancel()
        wal.close()

    asyncio.run(body())


def test_lazy_proposals_of_a_multi_member_group_wait_for_the_timer(tmp_path: Path) -> None:
    async def body() -> None:
        gc, host, forwarded = _follower(tmp_path)
        runner = asyncio.create_task(gc.run())
        host.propose(c.AckReport("sub\x00t/a", (0, 1)), False)
        gc.kick_lazy(0)
        for _ in range(3):  # the group's own Raft traffic (appends, heartbeats) wakes the group commit
            host.raft.step(Message(type=MessageType.HEARTBEAT, from_=LEADER, to=ME, term=1))
            gc.kick(0)
            await asyncio.sleep(0.01)
        assert forwarded == [] and host.batch_len() == 1, "a lazy proposal went with the group's Raft traffic"
        await asyncio.sleep(DELAY_MS / 1000 * 2)
        assert host.batch_len() == 0 and gc.lazy_syncs == 1
        assert [type(cmd) for cmd in c.decode_entry(forwarded[0])] == [c.AckReport]
        gc.stop()
        runner.cancel()

    asyncio.run(body())


def test_an_urgent_proposal_to_the_same_shard_takes_held_ones_along_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        gc, host, forwarded = _follower(tmp_path)
        runner = asyncio.create_task(gc.run())
        host.propose(c.AckReport("sub\x00t/a", (0,)), False)
        gc.kick_lazy(0)
        await asyncio.sleep(0.01)
        assert forwarded == []
        host.propose(publish(1), False)
        gc.kick(0)
        await asyncio.sleep(0.02)  # long before the lazy timer
        assert len(forwarded) == 1 and host.batch_len() == 0
        assert [type(cmd) for cmd in c.decode_entry(forwarded[0])] == [c.AckReport, c.Publish]
        gc.stop()
        runner.cancel()

    asyncio.run(body())


def test_flush_forwards_held_lazy_proposals_at_once(tmp_path: Path) -> None:
    """Node.stop flushes: held proposals are not left behind for a timer that never runs."""

    async def body() -> None:
        gc, host, forwarded = _follower(tmp_path)
        runner = asyncio.create_task(gc.run())
        host.propose(c.Housekeeping(1_000, -1), False)
        gc.kick_lazy(0)
        await asyncio.sleep(0.01)  # a pass ran and held it
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await gc.flush(DELAY_MS / 1000 * 5)
        assert loop.time() - started < DELAY_MS / 1000 / 2, "flush waited for the lazy timer"
        assert len(forwarded) == 1 and host.batch_len() == 0
        gc.stop()
        runner.cancel()

    asyncio.run(body())
