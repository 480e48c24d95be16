"""``shard.learners = "none"`` on real nodes (five in one process): a cluster created so starts each
shard on its voters only, and the reconciler adds no learner to it; a cluster created with "all"
and restarted with "none" keeps its groups' initial configuration (cluster.json records what the
cluster was created with: every replica must start a group from the same one), and the reconciler
removes its learners through the member table until each shard is its voters alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from moorline.config import NodeConfig
from moorline.node.replication.placement import place_shards
from tests.node.inproc_cluster import InProcCluster

SHARDS = 4


def _tune(learners: str) -> object:
    def tune(cfg: NodeConfig) -> None:
        cfg.shard.learners = learners
        cfg.cluster.reconcile_interval_s = 0.3
        cfg.cluster.reconcile_after_event_s = 0.1
        cfg.cluster.max_concurrent_moves = 4

    return tune


def _confs(cl: InProcCluster) -> dict[int, object]:
    """Each shard's configuration as its leader has it (None: no leader now)."""
    out: dict[int, object] = {}
    for s in range(SHARDS):
        lead = next((nd for nd in cl.nodes.values() if nd.hosts[s].raft.is_leader), None)
        out[s] = None if lead is None else lead.hosts[s].raft.active_conf_state
    return out


def _voters_only(cl: InProcCluster, placed: list[set[str]]) -> bool:
    for s, conf in _confs(cl).items():
        if conf is None or conf.learners or {f"n{v[0]}" for v in conf.voters} != placed[s]:  # type: ignore[attr-defined]
            return False
    return True


def test_a_cluster_created_with_none_has_no_learners(tmp_path: Path) -> None:
    async def main() -> None:
        cl = InProcCluster(tmp_path, n=5, shards=SHARDS, tune=_tune("none"))  # type: ignore[arg-type]
        key = f"{cl.config('n1').cluster.cluster_id}/{','.join(cl.names)}"
        placed = [set(p.voters) for p in place_shards(key, cl.names, SHARDS, 3)]
        await cl.start()
        try:
            await cl.wait_leaders()
            for name, nd in cl.nodes.items():
                assert json.loads((tmp_path / f"{name}-data" / "cluster.json").read_text())["learners"] == "none"
                for s in range(SHARDS):
                    conf = nd.hosts[s].raft.active_conf_state
                    assert conf.learners == () and {f"n{v[0]}" for v in conf.voters} == placed[s], (name, s, conf)
            runs = sum(nd.membership.reconcile_runs for nd in cl.nodes.values())
            await cl.wait("three reconciler rounds", lambda: sum(
                nd.membership.reconcile_runs for nd in cl.nodes.values()) >= runs + 3, timeout=20.0)
            assert _voters_only(cl, placed), _confs(cl)
            assert sum(nd.membership.moves_started for nd in cl.nodes.values()) == 0
        finally:
            await cl.close()

    asyncio.run(main())


def test_a_cluster_created_with_all_and_restarted_with_none_loses_its_learners(tmp_path: Path) -> None:
    async def main() -> None:
        cl = InProcCluster(tmp_path, n=5, shards=SHARDS, tune=_tune("all"))  # type: ignore[arg-type]
        key = f"{cl.config('n1').cluster.cluster_id}/{','.join(cl.names)}"
        placed = [set(p.voters) for p in place_shards(key, cl.names, SHARDS, 3)]
        await cl.start()
        try:
            await cl.wait_leaders()
            assert all(len(c.learners) == 2 for c in _confs(cl).values() if c is not None)  # type: ignore[attr-defined]
        finally:
            await cl.close()
        cl.tune = _tune("none")  # type: ignore[assignment]
        await cl.start()
        try:
            await cl.wait_leaders()
            for name in cl.nodes:  # the groups start as created (learners everywhere), whatever the setting
                assert json.loads((tmp_path / f"{name}-data" / "cluster.json").read_text())["learners"] == "all"
            try:
                await cl.wait("every shard its three voters alone", lambda: _voters_only(cl, placed), timeout=60.0)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {_confs(cl)}") from None
            meta_host = cl.nodes["n1"].meta_host
            assert meta_host is not None and meta_host.state.membership is not None
            meta = meta_host.state.membership

            def ended() -> bool:  # (a move ends once its shard's leader saw it applied: a little later)
                return not meta.moves and len(meta.history) >= 2 * SHARDS

            await cl.wait("every move ended", ended, timeout=20.0)
            assert [(mv.kind, mv.outcome) for mv in meta.history] == [("remove", "done")] * (2 * SHARDS), meta.history
        finally:
            await cl.close()

    asyncio.run(main())
