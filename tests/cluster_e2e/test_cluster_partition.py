"""Partitions between nodes, cut with iptables on their 127.0.0.1x addresses (clients untouched).

- A shard leader cut from both other nodes acknowledges nothing: its publisher gets no PUBACK and
  is disconnected within mqtt.publish_timeout_s; the majority elects a leader and acknowledges;
  after healing, every replica's message store holds the same offsets and GUIDs.
- The owner of a session cut from its session shard's majority: the client reconnects to the
  majority side; the old node closes its socket before its lease runs out, the new owner serves
  after that, and no message is delivered by both.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
from cluster_clients import connect, drain, subscribe
from cluster_harness import SHARD_COUNT, Cluster, ClusterFactory
from rawclient import (
    DISCONNECT,
    PUBACK,
    PUBLISH,
    ConnectionClosed,
    MalformedFromBroker,
    Packet,
    RawClient,
    encode_ack,
)

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.iptables, pytest.mark.usefixtures("needs_iptables")]

PUBLISH_TIMEOUT_S = 3.0
CONFIG = f"[mqtt]\npublish_timeout_s = {PUBLISH_TIMEOUT_S}\n"
OWNER_LEASE_S = 4.0  # session.owner_lease_s (default 10 s): shorter, so the test waits less


def store_contents(cluster: Cluster, name: str, shard: int) -> list[tuple[int, str, str]]:
    return [(m["offset"], m["guid"], m["topic"]) for m in cluster[name].messages(shard)]


def wait_replicas_equal(cluster: Cluster, names: list[str], timeout: float = 30.0) -> None:
    """Every shard applied to the same index on every node of ``names``, led by one of them."""
    cluster.wait_leaders(nodes=names, timeout=timeout)
    for shard in range(SHARD_COUNT):
        cluster.wait_applied_equal(shard, names, timeout=timeout)


@pytest.mark.timeout(150)
def test_isolated_leader_acknowledges_nothing_and_replicas_converge(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, CONFIG)
    topic = cluster.topic_led_by("n1", "part/t")
    shard = cluster.shard_of(topic)
    on_leader = connect(cluster["n1"], "part-pub1", clean=True, expiry=0)
    assert on_leader.publish_and_wait(topic, b"before", 1).reason == 0

    cluster.isolate("n1")
    t_cut = time.monotonic()
    pid = on_leader.publish(topic, b"during-on-isolated-leader", 1)
    got: list[Packet] = []
    closed_after: float | None = None
    deadline = t_cut + PUBLISH_TIMEOUT_S + 5.0
    while time.monotonic() < deadline:
        try:
            p = on_leader.recv_or_none(0.2)
        except (ConnectionClosed, OSError, MalformedFromBroker):
            closed_after = time.monotonic() - t_cut
            break
        if p is not None:
            got.append(p)
            if p.type == DISCONNECT:
                closed_after = time.monotonic() - t_cut
                break
    on_leader.close()
    acks = [p for p in got if p.type == PUBACK and p.pid == pid]
    assert not acks, f"the isolated leader acknowledged a publish it cannot replicate: {acks}"
    assert closed_after is not None, f"the publisher's connection to the isolated leader is still open " \
        f"{PUBLISH_TIMEOUT_S + 5:.0f} s later (publish_timeout_s = {PUBLISH_TIMEOUT_S}); got {got}"
    assert closed_after <= PUBLISH_TIMEOUT_S + 1.5, f"closed only after {closed_after:.1f} s"
    disconnects = [p for p in got if p.type == DISCONNECT]
    assert all(p.reason == 0x89 for p in disconnects), disconnects

    new_leader = cluster.wait_leader_of(shard, nodes=["n2", "n3"], exclude=["n1"], timeout=15)
    majority = connect(cluster["n2"], "part-pub2", clean=True, expiry=0)
    ack = majority.publish_and_wait(topic, b"during-on-majority", 1, timeout=15)
    assert ack.reason == 0, ack
    majority.disconnect()

    cluster.heal_all()
    wait_replicas_equal(cluster, ["n1", "n2", "n3"])
    for s in range(SHARD_COUNT):
        views = {name: store_contents(cluster, name, s) for name in ("n1", "n2", "n3")}
        assert views["n1"] == views["n2"] == views["n3"], f"shard {s}: replicas differ: {views}"
    topics_on_shard = [t for _o, _g, t in store_contents(cluster, "n2", shard)]
    payloads = [m["payload"] for m in cluster["n3"].messages(shard) if m["topic"] == topic]
    assert len(payloads) in (2, 3), payloads  # before, during-on-majority, and perhaps the unacknowledged one
    print(f"isolated leader closed its publisher after {closed_after:.1f} s; new leader of shard {shard}: "
          f"{new_leader}; shard holds {len(topics_on_shard)} messages on every replica")
    cluster.assert_no_errors()


@dataclass
class Reader:
    """Reads a connection in a thread, timestamping every packet, acknowledging nothing by itself."""

    client: RawClient
    packets: list[tuple[float, Packet]] = field(default_factory=list)
    closed_at: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    ack_qos1: bool = False

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                p = self.client.recv_or_none(0.1)
                if p is None:
                    continue
                self.packets.append((time.monotonic(), p))
                if p.type == DISCONNECT:
                    break
                if self.ack_qos1 and p.type == PUBLISH and p.qos == 1:
                    self.client.send(encode_ack(PUBACK, p.pid, self.client.version))  # type: ignore[arg-type]
        except (ConnectionClosed, OSError, MalformedFromBroker):
            pass
        if not self.stop.is_set():
            self.closed_at = time.monotonic()

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        return t

    def payloads(self, after: float = 0.0) -> list[bytes]:
        return [p.payload for t, p in self.packets if p.type == PUBLISH and t >= after]


@pytest.mark.timeout(150)
def test_partitioned_session_owner_closes_before_new_owner_serves(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, CONFIG + f"[session]\nowner_lease_s = {OWNER_LEASE_S}\n")
    # The session shard is led on the majority side (n2); its owner, n1, is cut off from it.
    session_shard = cluster.shard_led_by("n2")
    cid = cluster.client_id_on_shard("owner-part", session_shard)
    topic = cluster.topic_led_by("n3", "owner-part/t")
    old = connect(cluster["n1"], cid, expect_present=False, receive_maximum=2)
    subscribe(old, [(topic, 1)])
    pub = connect(cluster["n3"], "owner-part-pub", clean=True, expiry=0)
    for i in range(10):
        assert pub.publish_and_wait(topic, f"m{i}".encode(), 1).reason == 0
    first = drain(old, quiet=1.0, until=2, ack=False, timeout=10)
    assert [m.payload for m in first] == [b"m0", b"m1"], first  # receive maximum 2: the rest wait

    old_reader = Reader(old)
    cluster.isolate("n1")
    t_cut = time.monotonic()
    old_thread = old_reader.start()
    for m in first:  # room for more: a node that still believed it owned the session would send them
        old.send(encode_ack(PUBACK, m.pid, old.version))  # type: ignore[arg-type]
    for i in range(10, 15):
        assert pub.publish_and_wait(topic, f"m{i}".encode(), 1, timeout=15).reason == 0
    pub.disconnect()

    new = connect(cluster["n2"], cid, expect_present=True, timeout=OWNER_LEASE_S + 20)
    t_served = time.monotonic()
    new_got = drain(new, quiet=5.0, until=15, timeout=30)
    t_drained = time.monotonic()
    new.disconnect()
    old_thread.join(max(0.0, t_cut + OWNER_LEASE_S + 3 - time.monotonic()))
    old_reader.stop.set()
    old_thread.join(5)
    old.close()

    assert old_reader.closed_at is not None, \
        f"the old owner (n1) kept the client's socket open {time.monotonic() - t_cut:.1f} s after it was cut off"
    assert old_reader.closed_at - t_cut <= OWNER_LEASE_S + 1.0, \
        f"n1 closed the socket {old_reader.closed_at - t_cut:.1f} s after the cut, after its lease"
    assert t_served >= old_reader.closed_at, \
        f"n2 served the session {old_reader.closed_at - t_served:.1f} s before n1 closed it"
    by_old_after_cut = set(old_reader.payloads(after=t_cut))
    by_new = {m.payload for m in new_got}
    assert not by_old_after_cut & by_new, f"delivered by both: {sorted(by_old_after_cut & by_new)}"
    assert {f"m{i}".encode() for i in range(15)} <= by_new | {m.payload for m in first}, \
        f"acknowledged messages missing: new owner got {sorted(by_new)} (served {t_served - t_cut:.1f} s after " \
        f"the cut, drained until {t_drained - t_cut:.1f} s)\n{cluster.describe()}"
