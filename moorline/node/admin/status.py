"""The node's status as the admin API shows it: each group's Raft view, the cluster's
nodes, the metadata group's record, and the drops log."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")


class NodeStatus:
    """Status JSON for the admin API."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def raft_status(self, shard: int) -> dict[str, Any]:
        """The shard's Raft view from this replica, for GET /v1/shards: leader (None while there is
        none), voters, learners, term, commit/applied, and per replica its match (known on the leader).
        ``shard`` may be ``meta_group``, the metadata group."""
        host = self.node.groups[shard]
        raft = host.raft
        conf = host.group_conf()
        lead = raft.lead
        reader = host.reader if host.reads_remotely else None
        if reader is not None:  # no member: the leader feeding this node, once its feed started
            lead = (reader.lead, "") if reader.started and reader.lead else None
        replicas = {self.node.node_name(m[0]): {"match": (raft.progress[m].match if raft.is_leader and m in raft.progress
                                                     else None)} for m in conf.members()}
        # (this node may be in no configuration of the group: removed from it, or not added yet)
        replicas.setdefault(self.node.node_name(self.node.member[0]), {"match": None})["applied"] = host.state.applied_index
        return {
            "leader": self.node.node_name(lead[0]) if lead is not None else None,
            "preferred_leader": self.node.node_name(self.node.preferred_leader[shard][0]),
            "voters": [self.node.node_name(m[0]) for m in conf.voters],
            "learners": [self.node.node_name(m[0]) for m in conf.learners],
            "term": raft.term,
            "commit": raft.log.committed,
            "applied_index": host.state.applied_index,
            "replicas": replicas,
            "reads_remotely": reader is not None,  # shard.learners = "none": no replica here, a feed
        }

    def cluster_status(self) -> dict[str, Any]:
        """Nodes of the cluster (GET /v1/cluster): names, addresses, storage ids, reachability, and
        how many groups each leads as this node sees it; and the metadata group (its Raft view and
        the record it holds of the cluster)."""
        led: dict[str, int] = {}
        for h in self.node.groups:
            if h.raft.lead is not None:
                name = self.node.node_name(h.raft.lead[0])
                led[name] = led.get(name, 0) + 1
        metadata = self.metadata_status()
        if self.node.link is None:
            me = self.node.node_name(self.node.member[0])
            return {"nodes": [{"id": me, "storage_id": self.node.storage_id, "self": True, "reachable": True,
                               "groups_led": led.get(me, 0), "mqtt": self.node.cfg.listeners.mqtt,
                               "http": self.node.cfg.listeners.http}], "metadata": metadata}
        stats = self.node.link.stats().get("peers", {})
        nodes = []
        for name in self.node.link.spec.known:  # the initial members, then those that joined
            peer = stats.get(name, {})
            is_me = name == self.node.link.spec.me
            streams_up = peer.get("connected_streams") or []
            nodes.append({
                "id": name, "cluster": "{}:{}".format(*self.node.link.spec.addresses[name]),
                "storage_id": self.node.link.members.get(name), "self": is_me,
                "reachable": True if is_me else bool(streams_up),
                "groups_led": led.get(name, 0),
                **({"snapshot_transfers": self.node.link.snapshots.snapshot_stats()} if is_me else {"transport": peer}),
            })
        return {"nodes": nodes, "metadata": metadata}

    def metadata_status(self) -> dict[str, Any]:
        status = self.node.raft_status(self.node.meta_group)
        status.pop("preferred_leader", None)
        record = self.node.meta_host.state.cluster if self.node.meta_host is not None else None
        status["record"] = None if record is None else {
            "cluster_id": record.cluster_id, "members": [{"id": n, "node_id": i, "storage_id": sid}
                                                         for n, i, sid in record.members],
            "shard_count": record.shard_count, "replicas": record.replicas,
            "feature_level": record.feature_level,
        }
        return status

    def iter_drops(self) -> Iterable[dict[str, Any]]:
        for host in self.node.hosts:
            for d in host.state.topics.drops:
                yield {"guid": d.guid.hex(), "reason": d.reason, "shard": host.shard, "offset": d.offset,
                       "session": d.reg_key.partition("\x00")[0] if not self.node.is_share_key(d.reg_key) else None,
                       "subscription": d.reg_key.replace("\x00", "/")}
