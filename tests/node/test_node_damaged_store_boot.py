"""A shard whose message store fails its checksum when the node starts stops that shard only,
also when the shard's state had released records (boot.py): the node opens, the shard refuses
service. On ab9b510 the node did not start: boot released the records the state no longer kept
from the damaged store, which is closed and empty after the failure (next offset 0), and the
release of an offset above it broke an invariant (sim --cluster seed 40167: n2 never restarted,
its store falsely damaged there; the false damage is fixed in msgstore)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.node.node import Node
from tests.node.test_node_followups import _config, _open, _publish, _register, _subscribe, _until


def test_a_damaged_store_with_released_records_stops_its_shard_not_the_node(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    cfg.shard.count = 1
    cfg.retention.min_age_s = 0.1  # records nobody is owed are released within a few rounds

    async def first_run() -> None:
        node = Node(cfg)
        node.open()
        await node.start()
        try:
            opened = await _open(node, "sub")
            version = await _subscribe(node, "sub", opened.epoch, "kept")
            await _register(node, "sub", opened.incarnation, "kept", version)
            await _publish(node, "nobody", 3)  # offsets 0..2: owed to no one, released
            await _publish(node, "kept", 2)  # offsets 3..4: owed to "sub", kept
            topics = node.hosts[0].state.topics
            assert await _until(lambda: sorted(topics.meta) == [3, 4], 10), sorted(topics.meta)
            node.hosts[0].store.sync()
        finally:
            await node.stop()

    asyncio.run(first_run())
    store_dir = tmp_path / "data" / "store" / "shard-0"
    segs = sorted(store_dir.glob("seg-*.dat"))
    assert segs
    raw = bytearray(segs[-1].read_bytes())
    raw[-1] ^= 0x01  # the last record (synced) fails its checksum
    segs[-1].write_bytes(bytes(raw))

    async def second_run() -> None:
        node = Node(cfg)
        node.open()  # raised InvariantViolation('release of unwritten offset 0') on ab9b510
        await node.start()
        try:
            failed = node.hosts[0].failed
            assert failed is not None and "checksum failure in synced data" in failed, failed
        finally:
            await node.stop()

    asyncio.run(second_run())
