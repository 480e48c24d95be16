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

# Long enough that a lease renewal waiting for a new session-shard leader (n2 may have led the
# subscriber's own session shard) still commits in time: the owner closes its client when a
# renewal has not committed a second before the lease's end (it did, at 3 s, in a loaded full run).
LEASE_S = 6.0
# The lease runs out, the lapse grace (1 s) passes, then the next housekeeping round (every 1 s)
# of the session shard's leader ends the session; a new leader first needs an election (slower on
# a loaded machine: the bound is generous, the point is "published at all", which 5e679c4 never did).
WILL_BOUND_S = LEASE_S + 27.0


def _granted_subscription(c: RawClient, flt: str, timeout: float = 20.0) -> None:
    """SUBSCRIBE until granted: a wildcard needs every shard's leader (a shard without one refuses
    the filter rather than miss messages), which a loaded machine may still be electing."""
    deadline = time.monotonic() + timeout
    while True:
        sub = c.subscribe([(flt, 1)], timeout=15)
        if sub.reasons == [1]:
            return
        assert time.monotonic() < deadline, f"{flt} not granted: {sub}"
        time.sleep(0.5)


def _connect_with_will(port: int, version: int, cid: str, topic: str, payload: bytes, **kw: object) -> RawClient:
    deadline = time.monotonic() + 20
    while True:
        c = RawClient("127.0.0.1", port, version, timeout=10)
        ack = c.connect(cid, will=(topic, payload, 1, False), timeout=15, **kw)  # type: ignore[arg-type]
        if ack.reason == 0:
            return c
        c.close()
        assert time.monotonic() < deadline, f"{cid} not accepted: {ack}"
        time.sleep(0.5)


def test_wills_of_a_dead_nodes_sessions_are_published(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=f"[session]\nowner_lease_s = {LEASE_S}\n")
    sub = connect(cluster["n1"], "dead-owner-sub", clean=True, expiry=0)
    _granted_subscription(sub, "wills/#")

    n2 = cluster["n2"]
    v311 = _connect_with_will(n2.mqtt_port, 4, "dead-owner-v311", "wills/v311", b"v311 gone", clean=True)
    v5 = _connect_with_will(n2.mqtt_port, 5, "dead-owner-v5", "wills/v5", b"v5 gone", clean=False,
                            props=[(P_SESSION_EXPIRY, 600)])

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
