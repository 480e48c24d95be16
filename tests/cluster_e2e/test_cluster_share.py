"""$share groups in a cluster (a bug the cluster chaos run found): the group's dispatcher runs on
the leader of each shard, which is often not the node the members are connected to. Members on
other nodes must get the messages of a shard whose leader has none of them connected."""

from __future__ import annotations

import pytest
from cluster_clients import connect, drain, subscribe
from cluster_harness import ClusterFactory

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(180)]


def test_share_group_members_elsewhere_get_a_shard_led_by_a_third_node(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3)
    # Two members, on n1 and n2; the topics' shards all led by n3, where no member is connected.
    topics = [cluster.topic_led_by("n3", f"share/t{i}") for i in range(3)]
    m1 = connect(cluster["n1"], "share-m1", expect_present=False)
    m2 = connect(cluster["n2"], "share-m2", expect_present=False)
    subscribe(m1, [("$share/g/share/#", 1)])
    subscribe(m2, [("$share/g/share/#", 1)])
    pub = connect(cluster["n3"], "share-pub", clean=True, expiry=0)
    sent = []
    for i in range(300):
        payload = f"{i}".encode()
        ack = pub.publish_and_wait(topics[i % len(topics)], payload, 1, timeout=15)
        assert ack.reason == 0, ack
        sent.append(payload)
    got1 = drain(m1, quiet=3.0, timeout=60)
    got2 = drain(m2, quiet=3.0, timeout=60)
    received = [m.payload for m in got1 + got2]
    assert sorted(received) == sorted(sent), f"{len(received)} of {len(sent)} delivered ({len(got1)}/{len(got2)})"
    assert got1 and got2, "both members take part (round robin)"
    for c in (m1, m2, pub):
        c.disconnect()
    cluster.assert_no_errors()
