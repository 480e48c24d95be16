"""Issue 29 item 3: follow-ups derived from replicated state. A subscriber's acknowledgements are
committed in its session shard; the AckReport that releases the messages in the topic shard is a
second proposal, lost when its proposer crashes right after the first (or the proposal fails).
Here every node runs with the test instrument ``Faults.drop_ack_reports`` (no AckReport follows a
committed SessionAcks, ever): the topic shard's leader must report them again from its replicas,
so the acknowledged messages stop being owed.

On 38673de (with only the instrument added): the five acknowledged messages stayed owed (the
session's owed count on every node stayed 5 for the whole bound); retention would never free them."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from cluster_clients import connect, subscribe
from cluster_harness import ClusterFactory, ClusterNode
from rawclient import PUBACK, PUBLISH, encode_ack

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(150)]

FAULTS = json.dumps({"drop_ack_reports": True})
MESSAGES = 5
# Two housekeeping rounds (0.5 s each) of the topic shard's leader, then the AckReport's commit
# and apply on every replica; generous for a loaded machine.
RELEASE_BOUND_S = 20.0


def _followups_acted(node: ClusterNode) -> int:
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("moorline_followup_acks_resent_total "):
                return int(float(line.split()[1]))
    return 0  # not emitted (a build without follow-ups)


def _owed(node: ClusterNode, cid: str) -> int:
    return int(node.get(f"/v1/sessions/{cid}")["owed"])


def test_acknowledgements_whose_reports_were_lost_are_released(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text="[shard]\nhousekeeping_interval_s = 0.5\n", faults=FAULTS)
    topic = cluster.topic_led_by("n3", "followup")  # the topic shard led by neither client's node
    cid = "followup-sub"
    sub = connect(cluster["n1"], cid, clean=True, expiry=600)
    subscribe(sub, [(topic, 1)])
    pub = connect(cluster["n2"], "followup-pub", clean=True, expiry=0)
    for i in range(MESSAGES):
        assert pub.publish_and_wait(topic, f"m{i}".encode(), qos=1, timeout=15).reason == 0

    got: list[bytes] = []
    deadline = time.monotonic() + 20
    while len(got) < MESSAGES and time.monotonic() < deadline:
        m = sub.recv_or_none(max(0.05, deadline - time.monotonic()))
        if m is None:
            break
        if m.type == PUBLISH:
            got.append(m.payload)
            sub.send(encode_ack(PUBACK, m.pid, sub.version))  # type: ignore[arg-type]
    assert sorted(got) == [f"m{i}".encode() for i in range(MESSAGES)], got

    # Acknowledged in the session shard; never reported by the node serving the subscriber. Every
    # node's replicas must come to owe nothing to the session.
    deadline = time.monotonic() + RELEASE_BOUND_S
    owed = {nd.name: _owed(nd, cid) for nd in cluster.running()}
    while any(owed.values()) and time.monotonic() < deadline:
        time.sleep(0.25)
        owed = {nd.name: _owed(nd, cid) for nd in cluster.running()}
    assert not any(owed.values()), f"acknowledged messages still owed after {RELEASE_BOUND_S:.0f} s: {owed}"
    acted = {nd.name: _followups_acted(nd) for nd in cluster.running()}
    assert sum(acted.values()) >= MESSAGES, f"released, but not by the follow-ups? {acted}"
    leader_log = "".join(nd.log() for nd in cluster.running())
    assert "acknowledged offset(s) of 1 registration(s) again, their ack reports lost" in leader_log
    sub.disconnect()
    pub.disconnect()
