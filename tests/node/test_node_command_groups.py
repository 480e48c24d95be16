"""Command groups on a shard host: one callback for a run of commands, with all their results.

The publish hot path proposes the QoS 1 PUBLISHes of one read as a group and sends their PUBACKs
when the group's callback runs. That is only correct if the callback runs exactly once, after the
last member is applied, with every member's result in order; if a group is never split over two
log entries; and if a failure reaches the group's waiter, so no PUBACK is sent for it.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost, ShardUnavailable
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog


def make_host(tmp_path: Path, max_entry_bytes: int = 4 << 20, shard_max_bytes: int = 1 << 30,
              wal: WriteAheadLog | None = None) -> ShardHost:
    limits = TopicLimits(shard_max_bytes=shard_max_bytes, reserved_headroom_bytes=0)
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    member = (1, "storage")
    raft, raft_log = build_replica(member, [member], [], 0, 0, [], None, 0, random.Random(0))
    host = ShardHost(
        0, ShardState(0, "inc", limits, 3600), raft, raft_log, store, SnapshotStore(tmp_path / "snap"),
        ApplyHooks(on_effects=lambda host, fx: None), snapshot_every_entries=1_000_000,
        max_entry_bytes=max_entry_bytes,
    )
    raft.campaign()  # one voter: leader at once
    rd = host.seal()  # its no-op
    if wal is not None and rd is not None:
        wal.append_entries(0, [(e.term, e.index, int(e.type), e.data) for e in rd.entries])
    synced(host)
    return host


def synced(host: ShardHost) -> None:
    """What the node's group commit does once the WAL synced the host's Ready."""
    while host.after_sync(lambda shard, hs: None):
        host.take_ready()


def publish(i: int, size: int = 100) -> c.Command:
    return c.Publish(StoredMessage("t/a", bytes(size), 1, False, i.to_bytes(16, "big"), 1_000 + i))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, BaseException | None]] = []

    def __call__(self, result: Any, exc: BaseException | None) -> None:
        self.calls.append((result, exc))


def commit_all(host: ShardHost) -> int:
    """Seal, persist and commit; returns how many entries the commands went into."""
    rd = host.seal()
    assert rd is not None
    synced(host)
    return len(rd.entries)


def test_group_callback_runs_once_with_every_result_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        host = make_host(tmp_path)
        before = host.propose(publish(0))
        group = Recorder()
        host.propose_group([publish(1), publish(2), publish(0), publish(3)], group)  # 0 again: a duplicate
        single = Recorder()
        host.propose_cb(publish(4), single)
        assert commit_all(host) == 1
        assert (await before).status == "ok"
        assert len(group.calls) == 1, group.calls
        results, exc = group.calls[0]
        assert exc is None
        assert [(r.status, r.offset) for r in results] == [("ok", 1), ("ok", 2), ("duplicate", 0), ("ok", 3)]
        assert [(r.status, r.offset) for r, _ in single.calls] == [("ok", 4)]

    asyncio.run(body())


def test_a_group_is_never_split_over_two_entries(tmp_path: Path) -> None:
    # Entries are cut at max_entry_bytes, but never inside a group: its results arrive together.
    host = make_host(tmp_path, max_entry_bytes=2_000)
    groups = [Recorder() for _ in range(4)]
    n = 0
    for g in groups:
        host.propose_group([publish(n + k, 300) for k in range(5)], g)  # ~2.8 kB a group: over the limit
        n += 5
    rd = host.seal()
    assert rd is not None
    assert len(rd.entries) == 4, "one entry per group: the limit cuts between groups, not inside one"
    assert [len(g.calls) for g in groups] == [0, 0, 0, 0]  # nothing before the sync
    synced(host)
    for k, g in enumerate(groups):
        (results, exc), = g.calls
        assert exc is None and [r.offset for r in results] == list(range(5 * k, 5 * k + 5))


def test_refusals_inside_a_group_come_back_per_message(tmp_path: Path) -> None:
    # The shard fills up in the middle of a group: the members after that are refused, in place.
    host = make_host(tmp_path, shard_max_bytes=3 * (100 + 3 + 64))
    g = Recorder()
    host.propose_group([publish(i) for i in range(5)], g)
    commit_all(host)
    (results, exc), = g.calls
    assert exc is None
    assert [r.status for r in results] == ["ok", "ok", "ok", "refused", "refused"]
    assert results[3].reason_code == 0x97


def test_a_failed_shard_fails_the_group_once(tmp_path: Path) -> None:
    host = make_host(tmp_path)
    g = Recorder()
    host.propose_group([publish(i) for i in range(3)], g)
    host.seal()
    host.fail("disk gone")
    assert len(g.calls) == 1
    result, exc = g.calls[0]
    assert result is None and isinstance(exc, ShardUnavailable)
    with pytest.raises(ShardUnavailable):
        host.propose_group([publish(9)], Recorder())


def test_an_apply_failure_inside_a_group_reaches_its_waiter(tmp_path: Path) -> None:
    host = make_host(tmp_path)
    g = Recorder()
    bad = c.Publish(StoredMessage("t/a", b"x", 1, False, b"short guid", 1))  # an apply invariant breaks
    host.propose_group([publish(0), bad, publish(2)], g)
    host.seal()
    with pytest.raises(Exception):  # noqa: B017 - any apply failure; the shard stops
        synced(host)
    assert host.failed is not None
    assert len(g.calls) == 1 and g.calls[0][0] is None and isinstance(g.calls[0][1], ShardUnavailable)


def test_a_proposal_its_own_log_refuses_waits_and_nothing_overtakes_it(tmp_path: Path) -> None:
    """A leader's log refuses a proposal (too many uncommitted bytes here; a leadership transfer in
    progress in the cluster simulator's seed 10993). It entered no log, but answering it as
    refused would let the client's next PUBLISHes of the same topic, read and proposed meanwhile,
    commit before its resend: it waits instead, and what follows waits behind it, until the log
    has room; then all commit, in the order they were proposed."""
    async def body() -> None:
        host = make_host(tmp_path)
        host.raft.cfg.max_uncommitted_bytes = 600
        host.raft._max_uncommitted = 600  # the core's copy for its hot path
        first = host.propose(publish(1, size=400))
        assert host.seal() is not None  # in the log, not committed yet
        second = host.propose(publish(2, size=400))
        host.seal()  # the log refuses it: 400 more bytes do not fit
        third = host.propose(publish(3, size=10))
        host.seal()  # would fit, but must not overtake the second
        assert first is not None and second is not None and third is not None
        assert not second.done() and not third.done()
        for _ in range(3):  # the first commits; the room it leaves takes the others, in order
            host.take_ready()
            synced(host)
        offsets = [f.result().offset for f in (first, second, third)]
        assert [f.result().status for f in (first, second, third)] == ["ok"] * 3
        assert offsets == sorted(offsets), offsets

    asyncio.run(body())
