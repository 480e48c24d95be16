"""The metadata group (issue 21, items 1 and 3): a Raft group of its own next to the shards, on a
single node too. Its first leader records the cluster (members, shard layout, placement); the
Spark sink's commit markers live in it; it is recovered from the WAL after a restart like any
shard; and markers written by older versions into a session shard are still read."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.node.node import Node


def config(tmp_path: Path) -> NodeConfig:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 4
    return cfg


async def started(cfg: NodeConfig) -> Node:
    node = Node(cfg)
    node.open()
    await node.start()
    return node


async def wait_record(node: Node) -> c.ClusterRecord:
    assert node.meta_host is not None
    for _ in range(200):
        if node.meta_host.state.cluster is not None:
            return node.meta_host.state.cluster
        await asyncio.sleep(0.01)
    raise AssertionError("the metadata group recorded no cluster")


def test_single_node_records_itself_and_keeps_markers_across_restarts(tmp_path: Path) -> None:
    async def body() -> None:
        cfg = config(tmp_path)
        node = await started(cfg)
        try:
            record = await wait_record(node)
            assert [m[0] for m in record.members] == ["n1"] and record.members[0][2] == node.storage_id
            assert record.shard_count == 4 and record.placement == ((("n1",), ()),) * 4
            assert node.meta_group == 4 and node.groups[4] is node.meta_host and len(node.hosts) == 4
            status = node.cluster_status()["metadata"]
            assert status["leader"] == "n1" and status["voters"] == ["n1"] and status["record"]["replicas"] == 1
            fut = node.propose(node.meta_group, c.SetSinkMarker("q1", 7))
            assert fut is not None and await fut == 7
            # not in any shard: in the metadata group
            assert all("q1" not in h.state.sink_markers for h in node.hosts)
        finally:
            await node.stop()
        node = await started(cfg)  # recovered from snapshot + WAL like a shard
        try:
            assert node.sink_marker("q1") == 7
            assert (await wait_record(node)) == record
        finally:
            await node.stop()

    asyncio.run(body())


def test_markers_written_into_a_session_shard_by_older_versions_are_still_read(tmp_path: Path) -> None:
    async def body() -> None:
        node = await started(config(tmp_path))
        try:
            old_home = node.session_shard("$sink/q-old")
            fut = node.propose(old_home, c.SetSinkMarker("q-old", 12))  # where markers lived before
            assert fut is not None and await fut == 12
            assert node.sink_marker("q-old") == 12
            fut = node.propose(node.meta_group, c.SetSinkMarker("q-old", 13))
            assert fut is not None and await fut == 13
            assert node.sink_marker("q-old") == 13
            assert node.sink_marker("never") is None
        finally:
            await node.stop()

    asyncio.run(body())
