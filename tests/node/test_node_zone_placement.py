"""Zones on real nodes: five nodes in one process, on three "machines" (zones a, a, b, b, c, as
``--zone`` gives them), bootstrapped with a placement that knows no zones. The membership driver
moves voters until no shard has two in one zone, each shard keeping three voters and every node
following every shard."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.config import NodeConfig
from moorline.node.replication.placement import place_shards
from tests.node.inproc_cluster import InProcCluster

ZONES = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "c"}
SHARDS = 6


def _zones(voters: tuple[tuple[int, str], ...]) -> list[str]:
    return sorted(ZONES[f"n{v[0]}"] for v in voters)


def test_voters_move_apart_by_zone(tmp_path: Path) -> None:
    def tune(cfg: NodeConfig) -> None:
        assert cfg.cluster.node_id is not None
        cfg.cluster.zone = ZONES[cfg.cluster.node_id]
        cfg.cluster.reconcile_interval_s = 0.5
        cfg.cluster.reconcile_after_event_s = 0.2
        cfg.cluster.max_concurrent_moves = 4

    async def main() -> None:
        cl = InProcCluster(tmp_path, n=5, shards=SHARDS, tune=tune)
        key = f"{cl.config('n1').cluster.cluster_id}/{','.join(cl.names)}"
        placed = place_shards(key, cl.names, SHARDS, 3)
        crowded = [s for s, p in enumerate(placed) if len({ZONES[v] for v in p.voters}) < 3]
        assert crowded, "the bootstrap placement must break the zone rule for this test to mean anything"
        await cl.start()
        try:
            await cl.wait_leaders()

            seen: dict[int, object] = {}

            def settled() -> bool:
                done = True
                for s in range(SHARDS):
                    lead = next((nd for nd in cl.nodes.values() if nd.hosts[s].raft.is_leader), None)
                    if lead is None:
                        seen[s] = "no leader"
                        done = False
                        continue
                    conf = seen[s] = lead.hosts[s].raft.active_conf_state
                    done = done and _zones(conf.voters) == ["a", "b", "c"] and len(conf.members()) == 5
                return done

            try:
                await cl.wait("every shard's voters in three zones, every node following it", settled, timeout=60.0)
            except AssertionError as exc:
                table = cl.nodes["n1"].hosts[cl.nodes["n1"].meta_group].state.membership
                history = list(table.history)[-12:] if table is not None else None
                raise AssertionError(f"{exc}: {seen}; moves ended: {history}") from None
        finally:
            await cl.close()

    asyncio.run(main())
