"""Issue 29 item 4 on three real nodes: a retention pin posted to n1 (as the Spark source does)
protects a shard that n2 leads. Retention is one second and housekeeping runs every 0.2 s, so the
leader releases unowed messages within about a second of their publish unless a pin holds them.
On 0cfae23 the pin lived in n1's memory only and n2's housekeeping released the pinned messages;
now it is shard state: n2 keeps them while it holds and releases them once it is removed."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from cluster_clients import connect
from cluster_harness import ClusterFactory, ClusterNode, wait_for

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(120)]

CONFIG = "[retention]\nmin_age_s = 1.0\n[shard]\nhousekeeping_interval_s = 0.2\n"
MESSAGES = 5


def call(node: ClusterNode, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(node.http_url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def stored(node: ClusterNode, shard: int) -> set[str]:
    """GUIDs of the messages ``node`` still stores for ``shard`` (from its low-water mark)."""
    try:
        return {m["guid"] for m in node.messages(shard)}
    except urllib.error.HTTPError as exc:
        if exc.code != 410:  # offset 0 is below the low-water mark: read from there
            raise
        low = json.loads(exc.read())["low_water"]
        return {m["guid"] for m in node.messages(shard, start=low)}


def test_a_pin_posted_to_one_node_holds_retention_on_a_shard_another_leads(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, CONFIG)
    topic = cluster.topic_led_by("n2", "pins/t")
    shard = cluster.shard_of(topic)
    n1, n2 = cluster["n1"], cluster["n2"]
    got = call(n1, "POST", "/v1/pins", {"reader": "query-1", "offsets": {str(shard): 0}, "ttl_ms": 60_000})
    assert got["ttl_ms"] == 60_000, got
    pub = connect(n1, "pins-pub", clean=True)
    try:
        for i in range(MESSAGES):
            pub.publish_and_wait(topic, b"m%d" % i)
    finally:
        pub.close()
    guids = stored(n2, shard)
    assert len(guids) >= MESSAGES
    # Nobody is owed them: only the pin keeps them past retention (1 s) on the leader, n2.
    time.sleep(3.0)
    assert cluster.leader_of(shard) == "n2", "the shard's leader moved: the check below would not be about n2"
    kept = stored(n2, shard)
    assert guids <= kept, f"{len(guids - kept)} pinned message(s) released by n2, the shard's leader"
    # Removed through n3: retention goes on, on the leader.
    assert call(cluster["n3"], "DELETE", "/v1/pins/query-1") == {"ok": True}
    wait_for("the unpinned messages released on n2",
             lambda: not (guids & stored(n2, shard)) or None, timeout=15)
