"""A cluster in the middle of a rolling upgrade across log-entry format 2: one node proposes format
1 (``cluster.entry_format = 1``, what nodes before format 2 read), the others format 2. One log holds
both, forwarded either way and restamped by leaders of either kind; every replica applies the same."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker import commands as c
from moorline.config import NodeConfig
from tests.node.inproc_cluster import InProcCluster

SHARDS = 2


def test_a_log_of_both_formats_applies_the_same_on_every_replica(tmp_path: Path) -> None:
    def tune(cfg: NodeConfig) -> None:
        if cfg.cluster.node_id == "n1":
            cfg.cluster.entry_format = 1

    async def main() -> None:
        cl = InProcCluster(tmp_path, n=3, shards=SHARDS, tune=tune)
        await cl.start()
        try:
            await cl.wait_leaders()
            guids = []
            for via in ("n1", "n2", "n3", "n1"):  # each node's proposals reach leaders on the others
                guids += await cl.publish(via, 12)
            await cl.wait("every replica applied the same", cl.applied_equal)
            formats: dict[str, set[int]] = {}
            for name, node in cl.nodes.items():
                for s in range(SHARDS):
                    log = node.hosts[s].raft_log
                    for entry in log.entries(log.first_index(), log.last_index() + 1, 1 << 30):
                        data = entry.data
                        if data:
                            formats.setdefault(name, set()).add(
                                c.ENTRY_VERSION if data[0] == c.ENTRY_VERSION else c.LEGACY_ENTRY_VERSION)
            assert all(f == {1, 2} for f in formats.values()), formats  # both formats in every log
            for s in range(SHARDS):
                stored = [cl.stored(name, s) for name in cl.names]
                assert stored[0] == stored[1] == stored[2]
                times = [[(o, m.ts_ms) for o, _ in stored[0] if (m := cl.nodes[name].hosts[s].message(o)) is not None]
                         for name in cl.names]
                assert times[0] == times[1] == times[2] and len(times[0]) == len(stored[0])
            assert sorted(g for s in range(SHARDS) for _, g in cl.stored("n2", s)) == sorted(guids)
        finally:
            await cl.close()

    asyncio.run(main())
