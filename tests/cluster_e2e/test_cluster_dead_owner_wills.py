"""Issue 29 item 3: follow-ups derived from replicated state. A node that dies for good leaves its
sessions marked connected in their session shards; nothing on that node will ever end them. The
session shard's leader, wherever it is after the crash, ends them once their owner lease ran out
unrenewed: their wills are published after the will delay, and clean sessions end.

On 5e679c4: a 3.1.1 clean-session client and a 5.0 persistent-session client, both with wills,
connected to n2; n2 SIGKILLed and left down; a subscriber on n1 received neither will within 60 s."""

from __future__ import annotations

import time

import pytest
from cluster_clients import connect
from cluster_harness import ClusterFactory
from rawclient import P_SESSION_EXPIRY, PUBACK, PUBLISH, ConnectionClosed, RawClient, encode_ack

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(150)]

LEASE_S = 3.0
# The lease runs out, the lapse grace (1 s) passes, then the next housekeeping round (every 1 s)
# of the session shard's leader ends the session; a new leader first needs an election.
WILL_BOUND_S = LEASE_S + 12.0


def test_wills_of_a_dead_nodes_sessions_are_published(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=f"[session]\nowner_lease_s = {LEASE_S}\n")
    sub = connect(cluster["n1"], "dead-owner-sub", clean=True, expiry=0)
    sub.subscribe([("wills/#", 1)], timeout=15)

    n2 = cluster["n2"]
    v311 = RawClient("127.0.0.1", n2.mqtt_port, 4, timeout=10)
    ack = v311.connect("dead-owner-v311", clean=True, will=("wills/v311", b"v311 gone", 1, False), timeout=15)
    assert ack.reason == 0, ack
    v5 = RawClient("127.0.0.1", n2.mqtt_port, 5, timeout=10)
    ack = v5.connect("dead-owner-v5", clean=False, props=[(P_SESSION_EXPIRY, 600)],
                     will=("wills/v5", b"v5 gone", 1, False), timeout=15)
    assert ack.reason == 0, ack

    # Control: nothing was published while both are connected.
    assert sub.recv_or_none(1.0) is None

    cluster.kill9("n2")
    killed_at = time.monotonic()
    got: dict[str, tuple[bytes, float]] = {}
    deadline = killed_at + WILL_BOUND_S
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            m = sub.recv_or_none(max(0.05, deadline - time.monotonic()))
        except ConnectionClosed:
            break
        if m is None:
            break
        assert m.type == PUBLISH, m
        got[m.topic] = (m.payload, time.monotonic() - killed_at)  # type: ignore[assignment]
        if m.qos == 1:
            sub.send(encode_ack(PUBACK, m.pid, sub.version))  # type: ignore[arg-type]
    for c in (v311, v5):
        c.close()
    assert set(got) == {"wills/v311", "wills/v5"}, f"wills received within {WILL_BOUND_S:.0f} s: {got}"
    assert got["wills/v311"][0] == b"v311 gone" and got["wills/v5"][0] == b"v5 gone"

    # The persistent session survives its dead owner (only its connection ended): it resumes on n3.
    again = connect(cluster["n3"], "dead-owner-v5", clean=False, expiry=600, expect_present=True)
    again.disconnect()
    # The clean (3.1.1) session ended: it does not come back.
    fresh = RawClient("127.0.0.1", cluster["n3"].mqtt_port, 4, timeout=10)
    ack = fresh.connect("dead-owner-v311", clean=False, timeout=15)
    assert ack.reason == 0 and not ack.session_present, ack
    fresh.close()
    sub.disconnect()
