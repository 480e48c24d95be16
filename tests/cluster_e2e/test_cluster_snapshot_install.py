"""A follower too far behind its leaders' logs catches up by snapshot (issue 21 items 1 and 7).

Three nodes snapshot every 20 entries and keep only 20 entries below a snapshot for followers that
lag. n3 is stopped (SIGKILL, or SIGSTOP), enough is published through n1 that every shard's
leaders compact their logs past it, and n3 comes back: it is sent each shard's snapshot and
message store (snapshot_transfer.py), installs them, and ends with every shard available, the same
(offset, GUID) in every store, and a persistent subscriber connected to it then receives every
message published for it. Before snapshot installs existed, n3 failed each such shard ("not
supported yet") and served nothing from it."""

from __future__ import annotations

import time

import pytest
from cluster_clients import StreamPublisher, connect, drain, subscribe
from cluster_harness import SHARD_COUNT, ClusterFactory, wait_for

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(240)]

CONFIG = """
[shard]
snapshot_every_entries = 20
[raft]
follower_log_margin_entries = 20
[storage]
snapshot_inline_max_bytes = 0
[cluster]
snapshot_chunk_bytes = 16384
"""


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_lagging_follower_catches_up_by_snapshot(cluster_factory: ClusterFactory, how: str) -> None:
    cluster = cluster_factory(3, CONFIG)
    topics = [f"snapinst/t/{i}" for i in range(48)]  # every shard, several topics each
    sub = connect(cluster["n1"], "snapinst-sub", clean=True, expiry=3600)
    subscribe(sub, [("snapinst/#", 1)])
    sub.disconnect()
    before = {s["shard"]: s["applied_index"] for s in cluster.shards("n1")}

    if how == "kill":
        cluster.kill9("n3")
    else:
        cluster.pause("n3")
    cluster.wait_leaders(nodes=["n1", "n2"], exclude_leaders=["n3"])
    # A small window: one publish is about one log entry, so every shard's log grows far past the
    # margin while n3 is away.
    # A paused n3 keeps its connections: its leaders go on pipelining appends to it (up to the
    # Raft core's 256 unacknowledged ones) into the socket buffers, and on resume it catches up
    # from those where it can. Past 256 appends per shard the rest is only in a snapshot.
    count = 2400 if how == "kill" else 6400
    pub = StreamPublisher(connect(cluster["n1"], "snapinst-pub", clean=True, expiry=0), topics, count, window=4)
    pub.start().join(180)
    assert pub.error is None and pub.ended_by == "done", (pub.error, pub.ended_by, pub.answered())
    assert len(pub.acked) == count and not pub.refused
    after = {s["shard"]: s for s in cluster.shards("n1")}
    for shard in range(SHARD_COUNT):
        # Every shard's log moved on by more than snapshot_every + margin: entries n3 lacks are gone.
        assert after[shard]["applied_index"] - before[shard] > 60, (shard, before[shard], after[shard])

    if how == "kill":
        cluster.start_node("n3")
    else:
        cluster.resume("n3")
    cluster.wait_leaders(nodes=["n1", "n2", "n3"])
    for shard in range(SHARD_COUNT):
        cluster.wait_applied_equal(shard, ["n1", "n2", "n3"], timeout=60)
    n3 = {s["shard"]: s for s in cluster.shards("n3")}
    failed = {shard: s.get("error") for shard, s in n3.items() if not s["available"]}
    assert not failed, f"n3 failed shards: {failed}"
    installs = cluster["n3"].log(since_start=how == "kill").count("installed the leader's snapshot")
    assert installs >= SHARD_COUNT // 2, f"n3 installed {installs} snapshots:\n{cluster['n3'].log_tail(40)}"
    for shard in range(SHARD_COUNT):
        views = {n: [(m["offset"], m["guid"]) for m in cluster[n].messages(shard)] for n in ("n1", "n2", "n3")}
        assert views["n3"] == views["n1"] == views["n2"], f"shard {shard}: stores differ"
    held = sum(len(cluster["n3"].messages(s)) for s in range(SHARD_COUNT))
    assert held >= count, f"n3 holds {held} messages"

    # The persistent subscriber, on n3 now, gets everything published while it was away.
    c = connect(cluster["n3"], "snapinst-sub", clean=False, expiry=3600, expect_present=True)
    got = drain(c, quiet=3.0, timeout=90)
    c.disconnect()
    payloads = {int(m.payload) for m in got}
    missing = set(range(count)) - payloads
    assert not missing, f"{len(missing)} messages not delivered through n3, e.g. {sorted(missing)[:10]}"

    # n3 goes on serving: a publish through it is acknowledged and stored on every replica.
    p = connect(cluster["n3"], "snapinst-after", clean=True, expiry=0)
    assert p.publish_and_wait("snapinst/after", b"x", 1, timeout=15).reason == 0
    p.disconnect()
    wait_for("stores to agree after a publish through n3", lambda: all(
        cluster.shards(n)[cluster.shard_of("snapinst/after")]["next_offset"]
        == cluster.shards("n1")[cluster.shard_of("snapinst/after")]["next_offset"] for n in ("n2", "n3")), 15)
    time.sleep(0.1)
    cluster.assert_no_errors()
