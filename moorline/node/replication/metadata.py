"""The metadata group (group id shard.count): the cluster's record (members, layout,
placement), written once by its first leader, and the Spark sinks' committed batches."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from moorline.broker import commands as c
from moorline.node.errors import ShardUnavailable
from moorline.node.replication.proposer import outcome_within

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")


class MetadataGroup:
    """The metadata group's record and what it holds besides."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def cluster_record(self) -> c.ClusterRecord:
        """What this node computed of the cluster at bootstrap, as the metadata group records it."""
        names = self.node.link.spec.names if self.node.link is not None else (self.node.node_name(self.node.member[0]),)
        cluster_id = self.node.cfg.cluster.cluster_id if self.node.link is not None else ""
        return c.ClusterRecord(
            cluster_id=cluster_id,
            members=tuple((name, *self.node.member_ids[name]) for name in names),
            shard_count=self.node.shard_count,
            replicas=max(len(p.voters) for p in self.node.placement),
            placement=tuple((p.voters, p.learners) for p in self.node.placement),
        )

    def sink_marker(self, query_id: str) -> int | None:
        """A Spark sink query's last committed batch: in the metadata group, or (data written
        before it existed) in the session shard of ``$sink/<query id>``, whichever is later."""
        assert self.node.meta_host is not None
        now = self.node.meta_host.state.sink_markers.get(query_id)
        before = self.node.hosts[self.node.session_shard("$sink/" + query_id)].state.sink_markers.get(query_id)
        known = [b for b in (now, before) if b is not None]
        return max(known) if known else None

    async def bootstrap_loop(self) -> None:
        """The metadata group's first leader writes the cluster's record (members, layout,
        placement) once; every node then checks its own computation against it. It is what
        membership changes will rewrite (a later feature)."""
        host = self.node.meta_host
        assert host is not None
        mine = self.cluster_record()
        while host.state.cluster is None and not self.node.stopping.is_set():
            if host.raft.is_leader and host.failed is None:
                fut = self.node.propose(self.node.meta_group, c.ClusterBootstrap(mine))
                if fut is not None:
                    try:
                        await outcome_within(fut, 5.0)
                    except (TimeoutError, ShardUnavailable):
                        pass
            if host.state.cluster is None:
                await asyncio.sleep(0.5)
        record = host.state.cluster
        if record is not None and record != mine:
            log.error("the metadata group records another cluster layout than this node computed: this node "
                      "places shards as %s, the cluster as %s; was it started with other flags or config?",
                      mine, record)
