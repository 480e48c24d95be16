"""Five real nodes with ``shard.replicas = 3`` and ``shard.learners = "none"`` (issue 32): a shard lives
on its three voters only, and the two other nodes serve its sessions through reader feeds from its
leader (node/replication/reader*.py).

A pipelined QoS 1 publisher and a persistent QoS 1 subscriber sit on the two nodes that hold no
replica of their topics' shard; mid-stream the shard's leader, the node feeding both of them, is
killed with SIGKILL. Every PUBACKed message must be in the surviving voters' stores, once, in
publish order; the subscriber must get every one of them, nothing invented, no duplicate without
DUP=1, each topic in order, through the feed of the new leader. Afterwards the shards' files are on
their voters only: the other nodes hold no snapshot and no stored message of a shard they read."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
from cluster_clients import (
    Collector,
    StreamPublisher,
    connect,
    duplicates_without_dup,
    order_breaks,
    wait_acks,
)
from cluster_harness import ClusterFactory

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(300)]

TOTAL = 3000
CONFIG = '[shard]\nlearners = "none"\n\n[mqtt]\npublish_timeout_s = 5.0\n'


def _files(path: Path) -> list[Path]:
    return [f for f in path.rglob("*") if f.is_file() and f.stat().st_size > 0] if path.exists() else []


def test_subscriber_on_a_node_without_a_replica_survives_the_feeding_leaders_death(
        cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(5, CONFIG)
    cluster.wait_leaders(nodes=["n1"])
    views = cluster.shards("n1")
    shard = next(s["shard"] for s in views if len(s["voters"]) == 3 and not s["learners"])
    voters = set(views[shard]["voters"])
    outside = sorted(set(cluster.names) - voters)
    assert len(outside) == 2 and not any(s["learners"] for s in views), "shards must live on their voters only"
    pub_node, sub_node = outside
    topics = [t for k in range(400) if cluster.shard_of(t := f"feed/{k}") == shard][:4]
    assert len(topics) == 4
    leader = cluster.wait_leader_of(shard, nodes=sorted(voters))

    sub = Collector(cluster[sub_node], "feed-sub", [(t, 1) for t in topics])
    pub = StreamPublisher(connect(cluster[pub_node], "feed-pub", clean=True, expiry=0), topics, TOTAL).start()
    wait_acks(pub, TOTAL // 5, 60)
    fault_at = len(pub.acked)
    cluster.kill9(leader)
    pub.join(150)
    assert pub.error is None, f"publisher failed: {pub.error!r}"
    assert fault_at < TOTAL, "the stream ended before the fault: the test proved nothing"
    acked = set(pub.acked)

    # Durability, from the surviving voters' stores (a node that holds no replica answers 503).
    survivors = sorted(voters - {leader})
    cluster.wait_applied_equal(shard, survivors, timeout=30)
    stored = {name: [int(base64.b64decode(m["payload"])) for m in cluster[name].messages(shard)
                     if m["topic"] in topics] for name in survivors}
    assert sorted(stored[survivors[0]]) == sorted(stored[survivors[1]]), "the surviving voters differ"
    in_store = set(stored[survivors[0]])
    assert not acked - in_store, f"acknowledged, stored nowhere: {sorted(acked - in_store)[:20]}"
    assert len(stored[survivors[0]]) == len(in_store), "a message was committed twice"

    # The subscriber, reading the shard through a feed, across the death of the node feeding it.
    sub.wait_for(acked, quiet=5.0, timeout=90)
    sub.close()
    assert sub.error is None, f"subscriber failed: {sub.error!r}"
    seqs = [int(m.payload) for m in sub.got]
    delivered = set(seqs)
    assert delivered <= set(pub.sent), "delivered a message that was never published"
    missing = sorted(acked - delivered)
    assert not missing, f"{len(missing)} acknowledged messages never reached the subscriber on {sub_node}: " \
        f"{missing[:10]}\n{cluster.describe()}"
    unmarked = duplicates_without_dup(sub)
    assert not unmarked, f"duplicates without DUP=1: {unmarked[:10]}"
    broken = order_breaks(seqs, topics)
    assert not broken, f"order broken: {({t: b[:5] for t, b in broken.items()})}"
    assert len(acked) > fault_at, f"no PUBACK after the leader's death: the publisher ended by {pub.ended_by} " \
        f"({pub.disconnect_reason})\n{cluster[pub_node].log_tail(20)}"
    assert pub.ended_by == "done", f"the publisher on {pub_node} was cut off ({pub.ended_by}, reason " \
        f"{pub.disconnect_reason}) although its node stayed up"
    feeds = cluster[sub_node].shards()[shard]
    assert feeds["reads_remotely"] and feeds["leader"] not in (None, leader), feeds

    # The shard's files: on its voters only (the two nodes outside read it, they keep none of it).
    time.sleep(1.0)
    for name in outside:
        data = cluster[name].data_dir
        held = _files(data / "store" / f"shard-{shard}") + _files(data / "snapshots" / f"group-{shard}")
        assert not held, f"{name} holds files of shard {shard}, of which it is no replica: {held[:5]}"
    print(f"sent {len(pub.sent)}, acked {len(acked)} ({fault_at} before killing {leader}), delivered "
          f"{len(delivered)} distinct of {len(seqs)} on {sub_node}, subscriber reconnects {sub.reconnects}")
    cluster.assert_no_errors()
