"""Issue 33 item 2 across a leader failover: a poison message's delivery count is the topic
shard's replicated state. With queue.max_deliveries = 3, the shard's leader is SIGKILLed between
the second and third attempts; after the third the message is on the dead-letter topic exactly
once (its copy's GUID is derived from group, shard and offset) and the group moves on."""

from __future__ import annotations

import time
import urllib.request

import pytest
from cluster_clients import connect, subscribe
from cluster_harness import ClusterFactory, wait_for
from rawclient import PUBACK, encode_ack

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(240)]

CONFIG = "[queue]\nmax_deliveries = 3\n"


def test_poison_count_survives_a_leader_kill_and_dead_letters_once(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=CONFIG)
    topic = cluster.topic_led_by("n3", "dl/t")
    shard = cluster.shard_of(topic)
    flt = f"$share/dl/{topic}"
    admin = connect(cluster["n2"], "dl-admin", clean=True, expiry=0)
    subscribe(admin, [("$dlq/dl/#", 1)])
    pub = connect(cluster["n2"], "dl-pub", clean=True, expiry=0)

    def attempt(publish: bool = False) -> None:
        c = connect(cluster["n1"], "dl-c", clean=True, expiry=0)
        subscribe(c, [(flt, 1)])
        if publish:  # once the group exists: it is owed what is published from then on
            assert pub.publish_and_wait(topic, b"poison", 1, timeout=30).reason == 0
        assert c.next_message(30).payload == b"poison"
        c.abort()  # the consumer crashes without acknowledging: its session ends
        time.sleep(1.0)  # the claim's return is committed

    attempt(publish=True)
    attempt()
    cluster.kill9("n3")  # the shard's leader, holding the count of 2 in its state
    wait_for("a new leader", lambda: (ld := cluster.leader_of(shard, via=["n1", "n2"])) and ld != "n3" and ld, 60)
    attempt()

    dead = admin.next_message(60)
    assert dead.payload == b"poison" and dead.topic == f"$dlq/dl/{topic}"  # type: ignore[attr-defined]
    props = dict(dead.user_properties)  # type: ignore[attr-defined]
    assert props["moorline-deliveries"] == "3" and props["moorline-original-topic"] == topic
    admin.send(encode_ack(PUBACK, dead.pid, 5))  # type: ignore[arg-type]
    assert admin.recv_or_none(3.0) is None, "dead-lettered exactly once"

    c = connect(cluster["n1"], "dl-c", clean=True, expiry=0)
    subscribe(c, [(flt, 1)])
    assert c.recv_or_none(2.0) is None, "the poison message is not handed out again"
    assert pub.publish_and_wait(topic, b"next", 1, timeout=30).reason == 0
    nxt = c.next_message(30)
    assert nxt.payload == b"next"
    c.send(encode_ack(PUBACK, nxt.pid, 5))  # type: ignore[arg-type]
    with urllib.request.urlopen(cluster["n1"].http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "moorline_share_dlq_total 1\n" in text, "one drop delivery_limit in the replicated state"
    for x in (c, admin, pub):
        x.disconnect()
