"""A QoS 1 producer for drain and rolling-restart tests (tests/e2e/rawclient.py underneath).

It publishes a paced, pipelined stream (payload ``<client id>:<seq>``) and, when its connection
ends, connects again — to the node a Server Reference names (CONNACK or DISCONNECT 0x9C), else to
the next node — and resends every message not yet acknowledged (DUP), as an MQTT client that
follows redirects does. It records what happened to each message (acknowledged after how long,
refused) and to each connection (DISCONNECT reason and Server Reference, plain close, CONNACK
refusal)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from cluster_harness import ClusterNode
from rawclient import (
    DISCONNECT,
    P_SERVER_REFERENCE,
    PUBACK,
    ConnectionClosed,
    MalformedFromBroker,
    RawClient,
    encode_publish,
)

HOST = "127.0.0.1"


@dataclass
class ConnectionEnd:
    node: str
    how: str  # "disconnect", "closed", "connack", "unreachable"
    reason: int | None = None
    reference: str | None = None
    at: float = 0.0


@dataclass
class Producer:
    nodes: dict[str, ClusterNode]
    first: str
    cid: str
    topics: list[str]
    version: int = 5
    window: int = 16
    rate_per_s: float = 200.0
    reconnect: bool = True
    sent_at: dict[int, float] = field(default_factory=dict)  # seq -> first sent
    waits: dict[int, float] = field(default_factory=dict)  # seq -> seconds from first send to PUBACK
    refused: dict[int, int] = field(default_factory=dict)  # seq -> reason code >= 0x80
    ends: list[ConnectionEnd] = field(default_factory=list)
    connections: list[str] = field(default_factory=list)  # node of each accepted connection
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Producer:
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"producer-{self.cid}")
        self.thread.start()
        return self

    def finish(self, timeout: float) -> None:
        """Stop sending new messages; wait (bounded) until every one sent is answered."""
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.cid} still running {timeout} s after finish()"

    @property
    def acked(self) -> set[int]:
        return set(self.waits)

    def unanswered(self) -> list[int]:
        return sorted(s for s in self.sent_at if s not in self.waits and s not in self.refused)

    def payload_of(self, seq: int) -> bytes:
        return f"{self.cid}:{seq}".encode()

    def _node_of(self, reference: str | None) -> str | None:
        for name, nd in self.nodes.items():
            if reference == f"{HOST}:{nd.mqtt_port}":
                return name
        return None

    def _next_after(self, node: str) -> str:
        names = sorted(self.nodes)
        return names[(names.index(node) + 1) % len(names)]

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _loop(self) -> None:
        node = self.first
        next_seq = 0
        t0 = time.monotonic()
        while True:
            if self.stop.is_set() and not self.unanswered():
                return
            try:
                c = RawClient(HOST, self.nodes[node].mqtt_port, self.version, timeout=15)
                ack = c.connect(self.cid, clean=True, timeout=15)
            except (OSError, ConnectionClosed, MalformedFromBroker):
                self.ends.append(ConnectionEnd(node, "unreachable", at=time.monotonic()))
                if not self.reconnect:
                    return
                node = self._next_after(node)
                time.sleep(0.05)
                continue
            if ack.reason != 0:
                ref = ack.prop(P_SERVER_REFERENCE)
                self.ends.append(ConnectionEnd(node, "connack", ack.reason, ref, time.monotonic()))
                c.close()
                if not self.reconnect:
                    return
                node = self._node_of(ref) or self._next_after(node)
                time.sleep(0.02)
                continue
            self.connections.append(node)
            inflight: dict[int, int] = {}  # packet id -> seq
            resend = deque(self.unanswered())
            pid = 0
            try:
                while True:
                    while len(inflight) < self.window:
                        now = time.monotonic()
                        if resend:
                            seq, dup = resend.popleft(), True
                        elif not self.stop.is_set() and next_seq < (now - t0) * self.rate_per_s:
                            seq, dup = next_seq, False
                            next_seq += 1
                            self.sent_at[seq] = now
                        else:
                            break
                        pid = pid % 65535 + 1
                        c.send(encode_publish(self.topics[seq % len(self.topics)], self.payload_of(seq), 1, pid=pid,
                                              dup=dup, version=self.version))
                        inflight[pid] = seq
                    if self.stop.is_set() and not inflight and not resend:
                        c.disconnect()
                        return
                    try:
                        p = c.recv(0.005 if len(inflight) < self.window and not self.stop.is_set() else 0.5)
                    except TimeoutError:
                        continue
                    if p.type == DISCONNECT:
                        ref = p.prop(P_SERVER_REFERENCE)
                        self.ends.append(ConnectionEnd(node, "disconnect", p.reason, ref, time.monotonic()))
                        node = self._node_of(ref) or self._next_after(node)
                        break
                    assert p.type == PUBACK and p.pid in inflight, p
                    seq = inflight.pop(p.pid)  # type: ignore[arg-type]
                    if p.reason >= 0x80:
                        self.refused[seq] = p.reason
                    elif seq not in self.waits:
                        self.waits[seq] = time.monotonic() - self.sent_at[seq]
            except (ConnectionClosed, OSError, MalformedFromBroker):
                self.ends.append(ConnectionEnd(node, "closed", at=time.monotonic()))
                node = self._next_after(node)
            c.close()
            if not self.reconnect:
                return
