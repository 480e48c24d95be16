"""MQTT clients for the cluster tests, on tests/e2e/rawclient.py (an independent raw-socket client):
persistent sessions connected to a chosen node, a pipelined QoS 1 publisher that records what was
PUBACKed, a draining subscriber, and a QoS 2 "Method B" receiver."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from cluster_harness import ClusterNode
from rawclient import (
    DISCONNECT,
    P_RECEIVE_MAXIMUM,
    P_SESSION_EXPIRY,
    PUBACK,
    PUBLISH,
    ConnectionClosed,
    MalformedFromBroker,
    Packet,
    RawClient,
    encode_ack,
    encode_publish,
)

HOST = "127.0.0.1"


def connect(node: ClusterNode, cid: str, clean: bool = False, version: int = 5, expiry: int = 3600,
            receive_maximum: int | None = None, timeout: float = 30.0, expect_present: bool | None = None,
            ) -> RawClient:
    """A session of ``cid`` on ``node`` (retried while the node or its session shard is not ready).
    ``expect_present`` asserts CONNACK's session-present flag."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            c = RawClient(HOST, node.mqtt_port, version, timeout=10)
            props = [(P_SESSION_EXPIRY, expiry)] if version == 5 and expiry else []
            if receive_maximum is not None and version == 5:
                props.append((P_RECEIVE_MAXIMUM, receive_maximum))
            ack = c.connect(cid, clean=clean, props=props or None, timeout=10)
            if ack.reason == 0:
                break
            last = ack
            c.close()
        except (OSError, ConnectionClosed, MalformedFromBroker) as exc:  # TimeoutError is an OSError
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"{cid} could not connect to {node.name} within {timeout:.0f} s: {last!r}")
        time.sleep(0.2)
    if expect_present is not None:
        assert ack.session_present == expect_present, f"{cid} on {node.name}: session present? {ack}"
    return c


def subscribe(c: RawClient, filters: list[tuple[str, int]]) -> None:
    sub = c.subscribe(filters, timeout=15)
    assert sub.reasons == [q for _, q in filters], sub


def drain(c: RawClient, quiet: float = 2.0, limit: int = 1_000_000, ack: bool = True,
          until: int | None = None, timeout: float = 60.0) -> list[Packet]:
    """Read (and acknowledge, QoS 1) messages until ``quiet`` seconds pass without one, ``until``
    messages arrived, the connection closes, or ``timeout`` passes."""
    out: list[Packet] = []
    deadline = time.monotonic() + timeout
    while len(out) < limit and (until is None or len(out) < until) and time.monotonic() < deadline:
        try:
            m = c.recv_or_none(min(quiet, max(0.01, deadline - time.monotonic())))
        except (ConnectionClosed, OSError):
            break
        if m is None:
            break
        if m.type == DISCONNECT:
            break
        assert m.type == PUBLISH, m
        out.append(m)
        if ack and m.qos == 1:
            c.send(encode_ack(PUBACK, m.pid, c.version))  # type: ignore[arg-type]
    return out


@dataclass
class StreamPublisher:
    """Pipelined QoS 1 publisher (a window of PUBLISHes in flight) recording what was PUBACKed, in
    a thread. Payloads are sequence numbers; topics go round-robin. Ends at ``total`` acks, on a
    closed connection, or when ``stop`` is set."""

    client: RawClient
    topics: list[str]
    total: int
    window: int = 64
    sent: list[int] = field(default_factory=list)
    acked: set[int] = field(default_factory=set)
    refused: dict[int, int] = field(default_factory=dict)  # seq -> reason code >= 0x80
    error: BaseException | None = None
    ended_by: str = ""
    disconnect_reason: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    last_ack_at: float = 0.0

    def start(self) -> StreamPublisher:
        self.thread = threading.Thread(target=self.run, daemon=True, name="stream-publisher")
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"publisher still running after {timeout} s"

    def answered(self) -> int:
        return len(self.acked) + len(self.refused)

    def run(self) -> None:
        pid_to_seq: dict[int, int] = {}
        seq = 0
        try:
            while self.answered() < self.total and not self.stop.is_set():
                while seq < self.total and len(pid_to_seq) < self.window:
                    pid = seq % 65535 + 1
                    self.client.send(encode_publish(self.topics[seq % len(self.topics)], f"{seq}".encode(), 1,
                                                    pid=pid, version=self.client.version))
                    pid_to_seq[pid] = seq
                    self.sent.append(seq)
                    seq += 1
                try:
                    ack = self.client.recv(0.5)
                except TimeoutError:
                    continue
                if ack.type == DISCONNECT:
                    self.ended_by, self.disconnect_reason = "disconnect", ack.reason
                    return
                assert ack.type == PUBACK and ack.pid in pid_to_seq, ack
                s = pid_to_seq.pop(ack.pid)  # type: ignore[arg-type]
                if ack.reason >= 0x80:
                    self.refused[s] = ack.reason
                else:
                    self.acked.add(s)
                    self.last_ack_at = time.monotonic()
            self.ended_by = "stopped" if self.stop.is_set() else "done"
        except (ConnectionClosed, OSError, MalformedFromBroker):  # closed, reset, or a send timed out
            self.ended_by = "closed"
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def wait_acks(pub: StreamPublisher, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(pub.acked) < n and pub.thread is not None and pub.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(pub.acked) >= n, f"only {len(pub.acked)} of {n} acks within {timeout} s " \
        f"(ended by {pub.ended_by or 'nothing'}, error {pub.error!r})"


class Collector:
    """A persistent QoS 1 subscriber reading (and acknowledging) in a thread, reconnecting to its
    node (session present) whenever the connection closes, until ``close``."""

    def __init__(self, node: ClusterNode, cid: str, filters: list[tuple[str, int]]) -> None:
        self.node = node
        self.cid = cid
        self.got: list[Packet] = []
        self.reconnects = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.client = connect(node, cid, expect_present=False)
        subscribe(self.client, filters)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"collector-{cid}")
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    m = self.client.recv_or_none(0.2)
                except (ConnectionClosed, OSError, MalformedFromBroker):
                    m = None
                    self.client.close()
                if self.client.closed or (m is not None and m.type == DISCONNECT):
                    if self._stop.is_set():
                        return
                    self.client.close()
                    self.reconnects += 1
                    self.client = connect(self.node, self.cid, expect_present=True, timeout=60)
                    continue
                if m is None:
                    continue
                assert m.type == PUBLISH, m
                self.got.append(m)
                if m.qos == 1:
                    self.client.send(encode_ack(PUBACK, m.pid, self.client.version))  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_for(self, seqs: set[int], quiet: float, timeout: float) -> None:
        """Until every payload of ``seqs`` arrived, or nothing new came for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last_n, last_change = -1, time.monotonic()
        while time.monotonic() < deadline and self.thread.is_alive():
            have = {int(m.payload) for m in self.got}
            if seqs <= have:
                return
            if len(self.got) != last_n:
                last_n, last_change = len(self.got), time.monotonic()
            elif time.monotonic() - last_change > quiet:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(15)
        self.client.disconnect()


def duplicates_without_dup(sub: Collector) -> list[int]:
    """Payloads the subscriber got more than once of which no copy carried DUP=1 (MQTT allows a
    second copy of a QoS 1 message only as a resend)."""
    counts = Counter(int(m.payload) for m in sub.got)
    redelivered = {int(m.payload) for m in sub.got if m.dup}
    return sorted(q for q, k in counts.items() if k > 1 and q not in redelivered)


def order_breaks(seqs: list[int], topics: list[str]) -> dict[str, list[tuple[int, int]]]:
    """For each topic of a StreamPublisher (payload q went to topics[q % len(topics)]), the adjacent
    pairs of its first deliveries, in arrival order, where a later message came first."""
    out: dict[str, list[tuple[int, int]]] = {}
    for i, topic in enumerate(topics):
        first_seen: list[int] = []
        seen: set[int] = set()
        for q in seqs:
            if q % len(topics) == i and q not in seen:
                seen.add(q)
                first_seen.append(q)
        breaks = [(a, b) for a, b in zip(first_seen, first_seen[1:], strict=False) if a > b]
        if breaks:
            out[topic] = breaks
    return out
