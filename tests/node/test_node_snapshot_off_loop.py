"""Shard snapshots are encoded off the event loop (ShardHost.start_snapshot): a forked child
encodes the state as it was when the snapshot started, while the loop goes on (and apply goes on
changing the state); a thread syncs the store and moves the file into place. Measured against the
same snapshot encoded on the loop, which stalls it for the whole encoding (a thread would too: the
encoder holds the GIL)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from pathlib import Path

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost, SnapshotSettings, decode_conf
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore, read_snapshot_file

pytestmark = pytest.mark.timeout(120)
LIMITS = TopicLimits(reserved_headroom_bytes=0)


def publishes(start: int, count: int) -> list[c.Publish]:
    return [c.Publish(StoredMessage(f"t/{(start + i) % 50}", b"x" * 10, 1, False, (start + i).to_bytes(16, "big"),
                                    1000 + start + i)) for i in range(count)]


def big_state(messages: int, subscribers: int = 20) -> ShardState:
    """A state whose encoding takes a while (every message owed to every subscriber)."""
    st = ShardState(0, "inc", LIMITS, 3600)
    fx = Effects()
    for i in range(subscribers):
        st.apply(c.Register(1000, f"sub-{i}\x00t/#", f"sub-{i}", 1, "t/#", 1), fx)
    for n in range(0, messages, 2000):
        fx.clear()
        st.apply_publishes(publishes(n, 2000), fx)
    return st


def make_host(tmp: Path, state: ShardState, settings: SnapshotSettings) -> ShardHost:
    store = MessageStore(tmp / "store", cache_bytes=0)
    store.open()
    store.reset(state.topics.next_offset)  # the records themselves play no part here
    member = (1, "storage")
    raft, raft_log = build_replica(member, [member], [], 0, 0, [], None, 0, random.Random(0))
    host = ShardHost(0, ShardState(0, "inc", LIMITS, 3600), raft, raft_log, store, SnapshotStore(tmp / "snap"),
                     ApplyHooks(on_effects=lambda host, fx: None), snapshot_every_entries=1_000_000)
    raft.campaign()
    host.seal()
    while host.after_sync(lambda shard, hs: None):
        host.take_ready()
    state.applied_index = host.state.applied_index
    host.state = state
    host.snapshot_settings = settings
    host.last_snapshot_bytes = 1 << 30  # as if the last one was large: encoded by a child
    return host


async def snapshot_while_applying(host: ShardHost, saved: list[tuple[int, int]]) -> float:
    """Start a snapshot, apply more publishes to the state meanwhile; the loop's longest stall (s)."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    done = asyncio.Event()
    host.snapshot_settings.on_saved = lambda h, index, term: (saved.append((index, term)), done.set())

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - t - 0.001)

    tick = loop.create_task(ticker())
    await asyncio.sleep(0.05)
    started = host.start_snapshot()
    assert started
    if host.snapshot_settings.executor is not None:
        assert host.snapshot_in_flight
        assert not host.start_snapshot(), "a second snapshot of the shard while one is in flight"
    fx = Effects()
    n = 10_000_000
    while not done.is_set():  # apply goes on while the snapshot is written
        fx.clear()
        host.state.apply_publishes(publishes(n, 50), fx)
        n += 50
        await asyncio.sleep(0.002)
    await tick
    return worst


def test_a_forked_snapshot_is_the_state_at_its_start_and_does_not_stall_the_loop(tmp_path: Path) -> None:
    executor = concurrent.futures.ThreadPoolExecutor(2)
    settings = SnapshotSettings(inline_max_bytes=0, executor=executor)
    host = make_host(tmp_path / "forked", big_state(100_000), settings)
    index = host.state.applied_index
    started = time.perf_counter()
    expected = host.state.snapshot()  # what the snapshot must hold: the state when it starts
    encode_s = time.perf_counter() - started
    saved: list[tuple[int, int]] = []
    worst_forked = asyncio.run(snapshot_while_applying(host, saved))
    assert settings.forked == 1 and saved == [(index, 1)]
    file = read_snapshot_file(host.snapshots.latest(0)[2], (0, index, 1))  # type: ignore[index]
    assert file.data == expected, "the snapshot is not the state at its start (apply changed it meanwhile?)"
    assert decode_conf(file.meta) == host.raft.conf_state
    assert host.raft_log.snapshot().meta.index == index

    # The same on the loop (what a shard whose snapshots are small gets, and what there was before).
    inline = make_host(tmp_path / "inline", big_state(100_000), SnapshotSettings(executor=None))
    worst_inline = asyncio.run(snapshot_while_applying(inline, []))
    executor.shutdown()
    print(f"encode {encode_s * 1000:.0f} ms; longest loop stall: forked {worst_forked * 1000:.1f} ms, "
          f"on the loop {worst_inline * 1000:.1f} ms")
    assert worst_inline >= 0.7 * encode_s
    assert worst_forked < worst_inline / 2, (worst_forked, worst_inline)
