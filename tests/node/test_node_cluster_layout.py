"""Bootstrap refuses a peer that places shards differently (another shard.count or shard.replicas):
the two would count different majorities for one shard."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from moorline.config import ClusterConfig
from moorline.node.replication.cluster_link import ClusterLink, LayoutMismatch
from moorline.node.replication.cluster_spec import parse_cluster
from moorline.node.replication.placement import layout_fingerprint

CFG = ClusterConfig(node_id="n1", listen="127.0.0.1:1", initial_cluster="n1=127.0.0.1:1,n2=127.0.0.1:2,n3=127.0.0.1:3")


def announce(name: str, sid: str, layout: str) -> dict[str, object]:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(
        {"name": name, "storage_id": sid, "members": {name: sid}, "layout": layout}))  # type: ignore[no-any-return]


def run_bootstrap(peer_layouts: dict[str, str]) -> dict[str, str]:
    async def go() -> dict[str, str]:
        spec = parse_cluster(CFG)
        assert spec is not None
        link = ClusterLink(spec, CFG, "sid-1", None, random.Random(0), layout_fingerprint(16, 3, 3))
        for peer, layout in peer_layouts.items():
            link._on_member(peer, announce(peer, f"sid-{peer}", layout))
        return await link.wait_for_members(1.0)

    return asyncio.run(go())


def test_same_layout_completes_bootstrap() -> None:
    same = layout_fingerprint(16, 3, 3)
    assert run_bootstrap({"n2": same, "n3": same}) == {"n1": "sid-1", "n2": "sid-n2", "n3": "sid-n3"}


def test_other_shard_count_is_refused_with_a_reason() -> None:
    with pytest.raises(LayoutMismatch, match="shard.count and shard.replicas"):
        run_bootstrap({"n2": layout_fingerprint(16, 3, 3), "n3": layout_fingerprint(32, 3, 3)})
