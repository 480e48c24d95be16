"""Membership across restarts (issue 21 item 3): a node restarted on its own data directory rejoins
its groups and catches up (its applied index reaches the others', its store holds the same
messages); a node started on a wiped data directory is refused as a voter, with an error that says
its storage is new or wiped, and the others go on serving."""

from __future__ import annotations

import shutil

import pytest
from cluster_clients import StreamPublisher, connect
from cluster_harness import SHARD_COUNT, ClusterFactory

from moorline.hashing import shard_of

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(150)]


def test_restarted_node_rejoins_and_catches_up(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3)
    topics = [f"rejoin/t/{i}" for i in range(32)]  # every shard, several topics each
    first = StreamPublisher(connect(cluster["n1"], "rejoin-pub", clean=True, expiry=0), topics, 1500).start()
    first.join(60)
    assert first.error is None and first.ended_by == "done", (first.error, first.ended_by)
    cluster.kill9("n3")
    # Published while n3 is down (after the shards it led moved): all of it n3 must catch up on.
    cluster.wait_leaders(nodes=["n1", "n2"], exclude_leaders=["n3"])
    more = StreamPublisher(connect(cluster["n2"], "rejoin-pub2", clean=True, expiry=0), topics, 1500).start()
    more.join(60)
    assert more.error is None and more.ended_by == "done", (more.error, more.ended_by)
    behind = {s["shard"]: s["applied_index"] for s in cluster.shards("n1")}

    cluster.start_node("n3")
    cluster.wait_leaders(nodes=["n1", "n2", "n3"])
    for shard in range(SHARD_COUNT):
        applied = cluster.wait_applied_equal(shard, ["n1", "n2", "n3"], timeout=30)
        assert applied >= behind[shard]
    for shard in range(SHARD_COUNT):
        views = {n: [(m["offset"], m["guid"]) for m in cluster[n].messages(shard)] for n in ("n1", "n2", "n3")}
        assert views["n3"] == views["n1"] == views["n2"], f"shard {shard}: n3 did not catch up"
    held = sum(len(cluster["n3"].messages(s)) for s in range(SHARD_COUNT))
    assert held >= 3000, f"n3 holds {held} messages"
    # n3 serves again: a publish through it is acknowledged and stored on every replica.
    c = connect(cluster["n3"], "rejoin-pub3", clean=True, expiry=0)
    assert c.publish_and_wait("rejoin/after", b"x", 1, timeout=15).reason == 0
    c.disconnect()
    cluster.wait_applied_equal(shard_of("rejoin/after", SHARD_COUNT), ["n1", "n2", "n3"])
    cluster.assert_no_errors()


def test_node_with_wiped_storage_is_refused(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3)
    c = connect(cluster["n1"], "wiped-pub", clean=True, expiry=0)
    assert c.publish_and_wait("wiped/t", b"before", 1).reason == 0
    assert cluster.stop("n3") == 0
    shutil.rmtree(cluster["n3"].data_dir)
    # The peers say (ERROR) that n3 came back with another storage id: this test provokes it.
    cluster.allow_errors(r"ERROR moorline\.cluster\.link: node n3 now has storage id")
    cluster.start_node("n3", wait_ready=False)
    rc = cluster["n3"].wait_exit(timeout=30)
    out = cluster["n3"].log(since_start=True)
    assert rc == 2, f"exit code {rc}:\n{out[-2000:]}"
    assert "storage is new or wiped" in out, out[-2000:]
    assert "moorline ready" not in out
    assert "Traceback" not in out, out[-3000:]
    # The two others still form a majority of every group.
    assert c.publish_and_wait("wiped/t", b"after", 1, timeout=15).reason == 0
    c.disconnect()
    cluster.assert_no_errors()
