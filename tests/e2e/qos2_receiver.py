"""QoS 2 receiver that holds packet ids until PUBREL (MQTT 5, 4.3.3 "Method B"), for the durability
and cluster tests: it records every protocol violation a broker makes across reconnects."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rawclient import (
    DISCONNECT,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    ConnectionClosed,
    MalformedFromBroker,
    Packet,
    RawClient,
    encode_ack,
)


@dataclass
class MethodBSubscriber:
    """QoS 2 receiver, MQTT 5 spec 4.3.3 "Method B": keeps the packet ids it has not yet released and
    treats a PUBLISH with such an id as a resend (not delivered again). State survives reconnects,
    to any node. ``withhold_every``: every n-th new message gets no PUBREC, so a crash finds
    messages the broker must resend (with their original packet ids)."""

    cid: str
    delivered: list[bytes] = field(default_factory=list)
    unreleased: dict[int, bytes] = field(default_factory=dict)  # pid -> payload
    first_pid: dict[bytes, int] = field(default_factory=dict)
    resends: int = 0
    violations: list[str] = field(default_factory=list)
    withhold_every: int = 0
    withheld: set[int] = field(default_factory=set)
    withheld_total: int = 0

    def on_packet(self, c: RawClient, p: Packet) -> None:
        if p.type == PUBLISH:
            assert p.qos == 2 and p.pid is not None, p
            orig = self.first_pid.get(p.payload)
            if orig is not None and orig != p.pid:
                self.violations.append(f"{p.payload!r} resent with pid {p.pid}, first sent with {orig}")
            if p.pid in self.unreleased:
                self.resends += 1
                self.withheld.discard(p.pid)
                if not p.dup:
                    self.violations.append(f"resend of pid {p.pid} without DUP")
                if self.unreleased[p.pid] != p.payload:
                    self.violations.append(f"pid {p.pid} reused for {p.payload!r} before release "
                                           f"(holds {self.unreleased[p.pid]!r})")
            else:
                if p.payload in self.first_pid:
                    self.violations.append(f"{p.payload!r} delivered again under new pid {p.pid}")
                self.unreleased[p.pid] = p.payload
                self.first_pid.setdefault(p.payload, p.pid)
                self.delivered.append(p.payload)
                if self.withhold_every and len(self.delivered) % self.withhold_every == 0:
                    self.withheld.add(p.pid)
                    self.withheld_total += 1
                    return
            c.send(encode_ack(PUBREC, p.pid, c.version))
        elif p.type == PUBREL:
            self.unreleased.pop(p.pid, None)  # type: ignore[arg-type]
            c.send(encode_ack(PUBCOMP, p.pid, c.version))  # type: ignore[arg-type]
        elif p.type == DISCONNECT:
            return
        else:
            self.violations.append(f"unexpected {p!r}")

    def consume(self, c: RawClient, quiet: float = 2.0, delay: float = 0.0, timeout: float = 60.0) -> str:
        """Handles packets until ``quiet`` seconds pass without one ("quiet"), the broker sends
        DISCONNECT ("disconnect") or closes the connection ("closed"), or ``timeout`` ("timeout")."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                p = c.recv_or_none(quiet)
                if p is None:
                    return "quiet"
                if p.type == DISCONNECT:
                    return "disconnect"
                if delay:
                    time.sleep(delay)
                self.on_packet(c, p)
        except (ConnectionClosed, MalformedFromBroker, OSError):
            return "closed"
        return "timeout"
