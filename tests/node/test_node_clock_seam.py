"""The clock seam (issue 21 item 8): a node reads time only through its ``Clock``, so a simulator can
run it on virtual time. A node given a clock far from the system's stamps its entries, session
leases and HTTP pins with that clock's times, not the machine's."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node
from moorline.node.seams import Seams

VIRTUAL_WALL_MS = 4_000_000_000_000  # year 2096: nothing the machine's clock could say today


class VirtualClock:
    def __init__(self) -> None:
        self.t = 50.0

    def monotonic(self) -> float:
        return self.t

    def wall_ms(self) -> int:
        return VIRTUAL_WALL_MS + int(self.t * 1000)


def test_entries_and_leases_carry_the_nodes_clock(tmp_path: Path) -> None:
    async def body() -> None:
        cfg = NodeConfig()
        cfg.data_dir = str(tmp_path / "data")
        cfg.shard.count = 4
        clock = VirtualClock()
        node = Node(cfg, seams=Seams(clock=clock))
        node.open()
        await node.start()
        try:
            await node.open_session("c1", False, 600, None, "")
            sess = node.hosts[node.session_shard("c1")].state.sessions.sessions["c1"]
            assert sess.lease_until_ms >= VIRTUAL_WALL_MS  # the lease runs on the node's clock
            await node.publish(StoredMessage("t/x", b"p", 1, False, b"g" * 16, node.now_ms()))
            host = node.hosts[node.topic_shard("t/x")]
            assert host.state.topics.last_ts_ms >= VIRTUAL_WALL_MS
            assert node.cluster_meta["created_ms"] >= VIRTUAL_WALL_MS
        finally:
            await node.stop()

    asyncio.run(body())
