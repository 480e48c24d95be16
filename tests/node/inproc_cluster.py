"""Three (or five) moorline nodes in one process and one event loop, talking over real loopback TCP
through their cluster links: for tests of node-level cluster behaviour that need no MQTT client
(snapshot transfers). Every wait is bounded."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class InProcCluster:
    def __init__(self, base: Path, n: int = 3, shards: int = 4, tune: Callable[[NodeConfig], None] | None = None) -> None:
        self.base = base
        self.names = [f"n{i}" for i in range(1, n + 1)]
        self.ports = [free_port() for _ in self.names]
        self.shards = shards
        self.tune = tune
        self.nodes: dict[str, Node] = {}
        self._seq = 0

    def config(self, name: str) -> NodeConfig:
        cfg = NodeConfig()
        cfg.data_dir = str(self.base / f"{name}-data")
        cfg.cluster.node_id = name
        cfg.cluster.initial_cluster = ",".join(f"{nm}=127.0.0.1:{p}" for nm, p in zip(self.names, self.ports, strict=True))
        cfg.cluster.bootstrap_timeout_s = 20
        cfg.shard.count = self.shards
        cfg.sys.interval_s = 0
        if self.tune is not None:
            self.tune(cfg)
        cfg.validate()
        return cfg

    async def start(self, *names: str) -> None:
        async def one(name: str) -> None:
            node = Node(self.config(name))
            await node.open_async()
            await node.start()
            self.nodes[name] = node

        await asyncio.gather(*(one(n) for n in (names or self.names)))

    async def stop(self, name: str) -> None:
        node = self.nodes.pop(name)
        await node.stop()

    async def close(self) -> None:
        for name in list(self.nodes):
            await self.stop(name)

    async def wait(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            await asyncio.sleep(0.05)

    async def wait_leaders(self) -> None:
        await self.wait("a leader of every shard", lambda: all(
            sum(nd.hosts[s].raft.is_leader for nd in self.nodes.values()) == 1 for s in range(self.shards)))

    async def publish(self, via: str, count: int, one_by_one: bool = True, prefix: str = "t") -> list[bytes]:
        """``count`` QoS 1 messages through ``via`` (one log entry each when ``one_by_one``); their GUIDs."""
        guids = []
        futs = []
        for _ in range(count):
            self._seq += 1
            guid = self._seq.to_bytes(16, "big")
            guids.append(guid)
            msg = StoredMessage(f"{prefix}/{self._seq % 16}", f"m{self._seq}".encode(), 1, False, guid,
                                int(time.time() * 1000))
            if one_by_one:
                await self.nodes[via].publish(msg)
            else:
                futs.append(self.nodes[via].publish(msg))
        if futs:
            await asyncio.gather(*futs)
        return guids

    def applied_equal(self) -> bool:
        return all(len({nd.hosts[s].state.applied_index for nd in self.nodes.values()}) == 1
                   for s in range(self.shards))

    def stored(self, name: str, shard: int) -> list[tuple[int, bytes]]:
        """(offset, GUID) of every message the replica's state keeps, read from its store."""
        host = self.nodes[name].hosts[shard]
        t = host.state.topics
        out = []
        for offset in sorted(t.meta):  # every kept one: a message still owed may sit below the low-water mark
            msg = host.message(offset)
            assert msg is not None, f"{name} shard {shard}: message {offset} is kept but not in the store"
            out.append((offset, msg.guid))
        return out
