"""Five nodes with the default three voters per shard (issue 21, "each shard gets shard.replicas
voters, placed deterministically and evenly, with leaders spread"): every node agrees on every
shard's voters and learners; voterships and leaderships are spread evenly; with two nodes killed,
exactly the shards that kept two of their three voters acknowledge, and a shard whose majority
is gone acknowledges nothing (its publisher is closed within mqtt.publish_timeout_s); a learner
node serves sessions and delivers as any other."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from cluster_clients import connect, drain, subscribe
from cluster_harness import SHARD_COUNT, ClusterError, ClusterFactory, ClusterNode, wait_for
from rawclient import DISCONNECT, PUBACK, ConnectionClosed, MalformedFromBroker, encode_publish
from test_cluster_quorum import one_topic_per_shard

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(240)]

PUBLISH_TIMEOUT_S = 3.0
CONFIG = f"[mqtt]\npublish_timeout_s = {PUBLISH_TIMEOUT_S}\n"
KILLED = ("n4", "n5")


def put_marker(node: ClusterNode, query: str, batch: int) -> int:
    def attempt() -> int | None:
        req = urllib.request.Request(f"{node.http_url}/v1/sink-markers/{query}", method="PUT",
                                     data=json.dumps({"batch_id": batch}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return int(json.loads(r.read())["batch_id"])
        except urllib.error.HTTPError as exc:
            if exc.code == 503:  # no metadata leader yet: retried
                return None
            raise

    return wait_for(f"a sink marker set through {node.name}", attempt, 30)


def test_three_voters_per_shard_on_five_nodes(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(5, CONFIG)
    views = {name: cluster.shards(name) for name in cluster.names}
    placement = {s["shard"]: (tuple(s["voters"]), tuple(s["learners"]), s["preferred_leader"])
                 for s in views["n1"]}
    for name, shards in views.items():  # one table, computed by every node alone
        assert {s["shard"]: (tuple(s["voters"]), tuple(s["learners"]), s["preferred_leader"])
                for s in shards} == placement, name
    for voters, learners, preferred in placement.values():
        assert len(voters) == 3 and len(learners) == 2 and preferred in voters
        assert sorted(voters + learners) == sorted(cluster.names)
    votes = Counter(v for voters, _, _ in placement.values() for v in voters)
    assert all(abs(votes[n] - 3 * SHARD_COUNT / 5) < 1 for n in cluster.names), votes
    preferred_counts = Counter(p for _, _, p in placement.values())
    assert all(abs(preferred_counts[n] - SHARD_COUNT / 5) < 1 for n in cluster.names), preferred_counts
    # Leaders settle on the preferred voters (fresh start, then the rebalancer).
    unsettled: list[tuple[int, str | None, str]] = []

    def settled() -> bool | None:
        unsettled[:] = [(s["shard"], s["leader"], s["preferred_leader"]) for s in cluster.shards("n1")
                        if s["leader"] != s["preferred_leader"]]
        return not unsettled or None

    try:
        wait_for("every shard led by its preferred leader", settled, 60)
    except ClusterError:
        views = {n: {s["shard"]: (s["leader"], s["term"], s["replicas"]) for s in cluster.shards(n)
                     if s["shard"] in {u[0] for u in unsettled}} for n in cluster.names}
        raise AssertionError(f"(shard, leader, preferred) not settled after 60 s: {unsettled}; "
                             f"every node's view (leader, term, replicas): {views}") from None

    # The metadata group: every initial node votes; its record is the placement every node computed.
    for name in cluster.names:  # the first leader writes the record once it leads (polled every 0.5 s)
        wait_for(f"{name} holds the cluster record",
                 lambda n=name: cluster[n].get("/v1/cluster")["metadata"]["record"] is not None or None, 20)
        meta = cluster[name].get("/v1/cluster")["metadata"]
        assert sorted(meta["voters"]) == sorted(cluster.names) and meta["learners"] == [], (name, meta)
        record = meta["record"]
        assert record is not None and record["replicas"] == 3 and record["shard_count"] == SHARD_COUNT, meta
        assert sorted(m["id"] for m in record["members"]) == sorted(cluster.names)

    lost = {shard for shard, (voters, _, _) in placement.items() if set(KILLED) <= set(voters)}
    live = set(range(SHARD_COUNT)) - lost
    assert lost and live, placement  # any two of five nodes share a voter majority of some shard
    topics = one_topic_per_shard("place/t")
    # Sessions whose own shard keeps its quorum; the subscriber on a node that is only a learner of
    # that session shard, so a learner replica is what serves it.
    sub_shard = next(s for s in sorted(live) if "n2" in placement[s][1])
    sub_cid = cluster.client_id_on_shard("place-sub", sub_shard)
    pub_cid = cluster.client_id_on_shard("place-pub", min(live))
    sub = connect(cluster["n2"], sub_cid, expect_present=False)
    subscribe(sub, [("place/t/#", 1)])

    for name in KILLED:
        cluster.kill9(name)
    pub = connect(cluster["n1"], pub_cid, clean=True, expiry=0)
    for shard in sorted(live):
        ack = pub.publish_and_wait(topics[shard], f"live:{shard}".encode(), 1, timeout=20)
        assert ack.reason == 0, f"shard {shard} (voters {placement[shard][0]}) with {KILLED} down: {ack}"
    got = drain(sub, quiet=2.0, until=len(live), timeout=30)
    assert sorted(m.payload for m in got) == sorted(f"live:{s}".encode() for s in live)
    # The metadata group (five voters) keeps its quorum with two down: a sink marker commits.
    assert put_marker(cluster["n1"], "placement-q", 5) == 5

    # A shard with two of its three voters gone acknowledges nothing: the publisher is closed.
    dead_shard = min(lost)
    t0 = time.monotonic()
    pub.send(encode_publish(topics[dead_shard], b"no-quorum", 1, pid=pub.alloc_pid(), version=pub.version))
    closed_after = None
    acked = []
    while time.monotonic() - t0 < PUBLISH_TIMEOUT_S + 10:
        try:
            p = pub.recv_or_none(0.2)
        except (ConnectionClosed, OSError, MalformedFromBroker):
            closed_after = time.monotonic() - t0
            break
        if p is not None and p.type == PUBACK and p.reason < 0x80:
            acked.append(p)
        if p is not None and p.type == DISCONNECT:
            closed_after = time.monotonic() - t0
            break
    pub.close()
    assert not acked, f"shard {dead_shard} acknowledged with voters {placement[dead_shard][0]} down to one"
    assert closed_after is not None and closed_after <= PUBLISH_TIMEOUT_S + 2.5, closed_after
    sub.disconnect()
    cluster.assert_no_errors()
