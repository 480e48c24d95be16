"""Seed 001 on three nodes (issue 21): a session survives the node it was on.

A persistent QoS 1 subscriber on n2 gets A and disconnects; B and C are published through n3; n2 is
killed with SIGKILL; the subscriber reconnects to n1 and gets B and C in order, then D and E
published after the reconnect: exactly A B C D E. The topic's shard and the session's shard are
both led by n2, so its death moves both leaderships."""

from __future__ import annotations

import pytest
from cluster_clients import connect, drain, subscribe
from cluster_harness import ClusterFactory

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(120)]


def test_seed001_session_survives_its_node(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3)
    topic = cluster.topic_led_by("n2", "seed001/t")
    cid = cluster.client_id_on_shard("seed001-sub", cluster.shard_of(topic))

    sub = connect(cluster["n2"], cid, expect_present=False)
    subscribe(sub, [(topic, 1)])
    pub1 = connect(cluster["n1"], "seed001-pub1", clean=True, expiry=0)
    assert pub1.publish_and_wait(topic, b"A", 1).reason == 0
    got = drain(sub, quiet=1.0, until=1, timeout=10)
    assert [m.payload for m in got] == [b"A"], got
    sub.disconnect()

    pub3 = connect(cluster["n3"], "seed001-pub3", clean=True, expiry=0)
    for payload in (b"B", b"C"):
        ack = pub3.publish_and_wait(topic, payload, 1, timeout=15)
        assert ack.reason == 0, ack
    pub3.disconnect()

    cluster.kill9("n2")
    sub = connect(cluster["n1"], cid, expect_present=True, timeout=30)
    got += drain(sub, quiet=3.0, until=3, timeout=30)
    for payload in (b"D", b"E"):
        ack = pub1.publish_and_wait(topic, payload, 1, timeout=15)
        assert ack.reason == 0, ack
    got += drain(sub, quiet=2.0, until=5, timeout=30)
    sub.disconnect()
    pub1.disconnect()
    assert [m.payload for m in got] == [b"A", b"B", b"C", b"D", b"E"], \
        f"{[(m.payload, m.dup) for m in got]}\n{cluster.describe()}"
    cluster.assert_no_errors()
