"""Issue 33 item 1 across a leader failover: which member of a single-active $share group is
active is the topic shard's replicated state. The shard's leader (which runs the dispatcher) is
SIGKILLed: the new leader keeps serving the same active member only; when that member's session
ends, the standby continues from the first unacknowledged message, in order, nothing skipped."""

from __future__ import annotations

import threading
import time

import pytest
from cluster_clients import connect, subscribe
from cluster_harness import ClusterFactory, wait_for
from rawclient import PUBACK, encode_ack

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(240)]

CONFIG = '[queue]\nsingle_active = ["sa"]\n'


def test_single_active_survives_a_leader_kill_and_hands_over_in_order(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=CONFIG)
    topic = cluster.topic_led_by("n3", "sa/t")
    shard = cluster.shard_of(topic)
    m1 = connect(cluster["n1"], "sa-m1", clean=True, expiry=0)
    subscribe(m1, [(f"$share/sa/{topic}", 1)])
    m2 = connect(cluster["n2"], "sa-m2", clean=True, expiry=0)
    subscribe(m2, [(f"$share/sa/{topic}", 1)])
    pub = connect(cluster["n1"], "sa-pub", clean=True, expiry=0)

    def publish(lo: int, hi: int) -> list[bytes]:
        out = []
        for i in range(lo, hi):
            ack = pub.publish_and_wait(topic, f"{i:04}".encode(), 1, timeout=30)
            assert ack.reason == 0, ack
            out.append(f"{i:04}".encode())
        return out

    sent = publish(0, 100)
    got1 = [m1.next_message(20) for _ in range(100)]
    assert [m.payload for m in got1] == sent, "the active member receives everything, in order"
    for m in got1[:40]:
        m1.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
    m1.ping()
    assert m2.recv_or_none(2.0) is None, "the standby receives nothing"
    time.sleep(1.0)  # the acknowledgements reach the topic shard

    cluster.kill9("n3")  # the shard's leader: the dispatcher moves with the leadership
    new_leader = wait_for("a new leader", lambda: (ld := cluster.leader_of(shard, via=["n1", "n2"]))
                          and ld != "n3" and ld, 60)
    assert new_leader in ("n1", "n2")
    sent += publish(100, 150)
    got1b = [m1.next_message(30) for _ in range(50)]
    assert [m.payload for m in got1b] == sent[100:150], "still the same active member after the failover"
    assert m2.recv_or_none(2.0) is None, "the new leader gives the standby nothing"

    m1.abort()  # the active member's session ends (expiry 0): m2 takes over
    got2 = []
    while len(got2) < 110:
        m = m2.next_message(60)
        m2.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
        got2.append(m.payload)
    assert got2 == sent[40:], "from the first unacknowledged message, in order, nothing skipped"
    assert m2.recv_or_none(1.5) is None, "nothing twice"
    for c in (m2, pub):
        c.disconnect()


def test_single_active_member_node_killed_the_next_member_continues(cluster_factory: ClusterFactory) -> None:
    """The active member's node is SIGKILLed: its session's lease lapses (session.owner_lease_s),
    the session (expiry 0) ends, and the next member continues from the first unacknowledged
    message, in order."""
    cluster = cluster_factory(3, config_text=CONFIG + "[session]\nowner_lease_s = 4.0\n")
    topic = cluster.topic_led_by("n3", "sk/t")
    # The survivors' sessions in shards n1 does not lead: their leases outlive n1's death.
    m2_id = cluster.client_id_on_shard("sk-m2", cluster.shard_of(cluster.topic_led_by("n2", "sk/x")))
    pub_id = cluster.client_id_on_shard("sk-pub", cluster.shard_of(topic))
    m1 = connect(cluster["n1"], "sk-m1", clean=True, expiry=0)
    subscribe(m1, [(f"$share/sa/{topic}", 1)])
    m2 = connect(cluster["n2"], m2_id, clean=True, expiry=0)
    subscribe(m2, [(f"$share/sa/{topic}", 1)])
    pub = connect(cluster["n3"], pub_id, clean=True, expiry=0)
    sent = []
    for i in range(60):
        assert pub.publish_and_wait(topic, f"{i:04}".encode(), 1, timeout=30).reason == 0
        sent.append(f"{i:04}".encode())
    got1 = [m1.next_message(20) for _ in range(60)]
    assert [m.payload for m in got1] == sent
    for m in got1[:25]:
        m1.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
    m1.ping()
    assert m2.recv_or_none(1.5) is None, "the standby receives nothing"
    cluster.kill9("n1")  # the active member's node
    got2 = []
    while len(got2) < 35:
        m = m2.next_message(60)
        m2.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
        got2.append(m.payload)
    assert got2 == sent[25:], "from the first unacknowledged message, in order, nothing skipped"
    assert m2.recv_or_none(1.5) is None, "nothing twice"
    for c in (m2, pub):
        c.disconnect()


def test_three_members_on_three_nodes_5000_messages_active_node_killed_mid_stream(
        cluster_factory: ClusterFactory) -> None:
    """The issue's scale: three members, one per node; 5,000 messages published while the active
    member's node is SIGKILLed part-way. Only the active member receives; the next in join order
    continues from the first message the first did not acknowledge, in order, nothing skipped;
    the third receives nothing; the only repeats are deliveries the dead member had in flight."""
    total, kill_after = 5_000, 2_000
    cluster = cluster_factory(3, config_text=CONFIG + "[session]\nowner_lease_s = 4.0\n")
    topic = cluster.topic_led_by("n3", "sm/t")
    m2_id = cluster.client_id_on_shard("sm-m2", cluster.shard_of(cluster.topic_led_by("n2", "sm/x")))
    m3_id = cluster.client_id_on_shard("sm-m3", cluster.shard_of(topic))
    pub_id = cluster.client_id_on_shard("sm-pub", cluster.shard_of(topic))
    m1 = connect(cluster["n1"], "sm-m1", clean=True, expiry=0)
    subscribe(m1, [(f"$share/sa/{topic}", 1)])
    m2 = connect(cluster["n2"], m2_id, clean=True, expiry=0)
    subscribe(m2, [(f"$share/sa/{topic}", 1)])
    m3 = connect(cluster["n3"], m3_id, clean=True, expiry=0)
    subscribe(m3, [(f"$share/sa/{topic}", 1)])
    pub = connect(cluster["n3"], pub_id, clean=True, expiry=0)
    sent = [f"{i:05}".encode() for i in range(total)]
    refused: list[object] = []

    def publish_all() -> None:
        for body in sent:
            ack = pub.publish_and_wait(topic, body, 1, timeout=60)
            if ack.reason != 0:
                refused.append(ack)

    publisher = threading.Thread(target=publish_all, daemon=True)
    publisher.start()
    got1: list[bytes] = []
    while len(got1) < kill_after:
        m = m1.next_message(60)
        m1.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
        got1.append(m.payload)
    cluster.kill9("n1")  # mid-stream: the publisher is still publishing
    assert got1 == sent[:kill_after], "the active member receives in order"
    got2: list[bytes] = []
    while not got2 or got2[-1] != sent[-1]:
        m = m2.next_message(90)
        m2.send(encode_ack(PUBACK, m.pid, 5))  # type: ignore[arg-type]
        got2.append(m.payload)
    publisher.join(90)
    assert not publisher.is_alive() and not refused, refused[:3]
    first = sent.index(got2[0])
    assert got2 == sent[first:], "the next member continues in order, nothing skipped"
    assert first <= kill_after, "nothing the first member never received was skipped"
    # Repeats only of what the dead member had in flight (at most the session's outbound window).
    assert kill_after - first <= 256, f"{kill_after - first} messages delivered twice"
    print(f"single-active, {total} messages, active node killed after {kill_after}: "
          f"{kill_after - first} delivered again to the next member")
    assert m3.recv_or_none(1.5) is None, "the third member is standby throughout"
    assert m2.recv_or_none(1.0) is None, "nothing after the last message"
    for c in (m2, m3, pub):
        c.disconnect()
