"""A restart re-releases every record its state no longer keeps, also those under the store's
low-water mark (which sits above every release, not below every kept record). On 5e679c4 records
released before the restart below that mark stayed kept in the store for good: their segments were
never reclaimed (a disk leak, found reading the snapshot-install path for moorline sim seed 203)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node


def _config(tmp_path: Path) -> NodeConfig:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 1
    cfg.retention.min_age_s = 0.0
    return cfg


def test_records_released_before_a_restart_are_released_after_it(tmp_path: Path) -> None:
    async def first_run() -> None:
        node = Node(_config(tmp_path))
        node.open()
        await node.start()
        try:
            now = node.now_ms()
            for i in range(10):  # owed to nobody
                await node.publish(StoredMessage(f"t/{i}", b"x", 1, False, i.to_bytes(16, "big"), now))
            # Retention (min age 0) releases all ten: the store's mark goes above them.
            await node.propose(0, c.Housekeeping(node.now_ms() + 1000, -1))  # type: ignore[misc]
            assert not node.hosts[0].state.topics.meta
            assert node.hosts[0].store.kept_below(10) == []
        finally:
            await node.stop()

    async def second_run() -> tuple[list[int], list[int]]:
        node = Node(_config(tmp_path))
        node.open()
        await node.start()
        try:
            host = node.hosts[0]
            state_keeps = sorted(host.state.topics.meta)
            store_keeps = host.store.kept_below(host.store.next_offset)
            return state_keeps, store_keeps
        finally:
            await node.stop()

    asyncio.run(first_run())
    state_keeps, store_keeps = asyncio.run(second_run())
    assert store_keeps == state_keeps, f"the store keeps {store_keeps}, the state {state_keeps}"
