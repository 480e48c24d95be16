"""The will of a connection that a CONNECT on another node takes over (MQTT 5 §3.1.4, MQTT-3.1.4-3:
the existing client's network connection is closed, and its will published as §3.1.2.5 says).
A clean start ends the session, so the will is due at once whatever its delay (§3.1.3.2.2).

Two remote owners: n2 alive (it ends its connection when it applies the open: 0x8E), and n2
SIGKILLed (the new owner waits its lease out). The session shard hands the due will to the open,
which publishes it exactly once.

On 38673de neither will was published: the open discarded the replaced session with its will, and
the old connection's close, stale by then, found nothing."""

from __future__ import annotations

import time

import pytest
from cluster_clients import connect
from cluster_harness import ClusterFactory
from rawclient import (
    CONNACK,
    DISCONNECT,
    P_SESSION_EXPIRY,
    P_WILL_DELAY,
    PUBACK,
    PUBLISH,
    RawClient,
    encode_ack,
    encode_connect,
)

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(120)]

# As test_cluster_dead_owner_wills.py: a renewal waiting for a new session-shard leader still
# commits in time on a loaded machine. The dead owner's takeover waits at most this long.
LEASE_S = 6.0
WILL_DELAY_S = 600  # far beyond the test: only the session's end makes these wills due


def _granted_subscription(c: RawClient, flt: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        sub = c.subscribe([(flt, 1)], timeout=15)
        if sub.reasons == [1]:
            return
        assert time.monotonic() < deadline, f"{flt} not granted: {sub}"
        time.sleep(0.5)


def _with_will(port: int, cid: str, topic: str, payload: bytes) -> RawClient:
    """A persistent MQTT 5 session with a long-delayed will (retried while the cluster settles)."""
    deadline = time.monotonic() + 20
    while True:
        c = RawClient("127.0.0.1", port, 5, timeout=10)
        ack = c.connect(cid, clean=False, props=[(P_SESSION_EXPIRY, 3600)], will=(topic, payload, 1, False),
                        will_props=[(P_WILL_DELAY, WILL_DELAY_S)], timeout=15)
        if ack.reason == 0:
            return c
        c.close()
        assert time.monotonic() < deadline, f"{cid} not accepted: {ack}"
        time.sleep(0.5)


def _wills(sub: RawClient, n: int, timeout: float, quiet: float) -> list[tuple[str, bytes]]:
    """Every will publish within ``timeout`` (at least ``n``), then ``quiet`` s more."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = deadline - time.monotonic() if len(got) < n else quiet
        m = sub.recv_or_none(max(0.05, left))
        if m is None:
            if len(got) >= n:
                break
            continue
        assert m.type == PUBLISH, m
        got.append((m.topic, m.payload))  # type: ignore[arg-type]
        if m.qos == 1:
            sub.send(encode_ack(PUBACK, m.pid, sub.version))  # type: ignore[arg-type]
    return got


def test_clean_start_takeover_from_another_node_publishes_the_will(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=f"[session]\nowner_lease_s = {LEASE_S}\n")
    n1, n2 = cluster["n1"], cluster["n2"]
    sub = connect(n1, "tw-sub", clean=True, expiry=0)
    _granted_subscription(sub, "tw/#")

    # 1. The previous owner is alive: it closes its client (0x8E) on applying the open.
    live = _with_will(n2.mqtt_port, "tw-live", "tw/live", b"live owner")
    assert sub.recv_or_none(0.5) is None, "no will while connected"
    fresh = connect(n1, "tw-live", clean=True, expiry=0, expect_present=False)
    closed = live.wait_closed(10.0)
    assert [p.reason for p in closed if p.type == DISCONNECT] == [0x8E], closed
    assert _wills(sub, 1, 10.0, 1.0) == [("tw/live", b"live owner")], "the live owner's will, exactly once"
    fresh.disconnect()

    # 2. The previous owner is dead: the new owner waits its lease out, then serves.
    dead = _with_will(n2.mqtt_port, "tw-dead", "tw/dead", b"dead owner")
    cluster.kill9("n2")
    killed_at = time.monotonic()
    again = RawClient("127.0.0.1", n1.mqtt_port, 5, timeout=30)
    again.send(encode_connect("tw-dead", 5, True, 60, None, None, None, None, None))
    ack = again.expect(CONNACK, 30)
    assert ack.reason == 0 and not ack.session_present, ack
    got = _wills(sub, 1, 15.0, 2.0)
    assert got == [("tw/dead", b"dead owner")], f"the dead owner's will, exactly once: {got}"
    print(f"dead owner: CONNACK and will within {time.monotonic() - killed_at:.1f} s of the kill")
    again.disconnect()
    dead.close()
    live.close()
    sub.disconnect()
