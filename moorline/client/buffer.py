"""The retransmit buffer: every message the client accepted and has not seen acknowledged, in the
order it was accepted, bounded by bytes, count and age."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

OVERHEAD = 64  # bytes counted per message besides topic and payload


@dataclass(slots=True, eq=False)
class OutMessage:
    """One message in the buffer."""

    n: int  # local number: the order messages were accepted in
    topic: str
    payload: bytes
    qos: int
    retain: bool
    producer: bytes | None
    seq: int | None
    accepted_at: float  # loop time
    future: asyncio.Future[None] | None = None
    pid: int | None = None  # packet id while in flight on the current connection
    pubrec: bool = False  # QoS 2: PUBREC seen, PUBREL sent
    stale: bool = False  # in flight under a producer sequence since replaced (its topic is held)
    sent: int = 0  # how many times sent
    done: bool = False
    props: bytes = field(default=b"", repr=False)  # encoded property body (producer, seq)

    @property
    def size(self) -> int:
        return len(self.payload) + len(self.topic) + OVERHEAD


@dataclass(frozen=True, slots=True)
class BufferLimits:
    """``max_bytes``/``max_messages``: what the buffer holds at most; ``max_age_s``: how long a message
    may wait for its acknowledgement before it is given up; ``when_full``: ``"block"`` (wait for room,
    at most ``publish_timeout``) or ``"raise"`` (``BufferFull`` at once)."""

    max_bytes: int = 64 * 1024 * 1024
    max_messages: int = 100_000
    max_age_s: float = 300.0
    when_full: Literal["block", "raise"] = "block"

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_messages <= 0 or self.max_age_s <= 0:
            raise ValueError("buffer bounds must be positive")
        if self.when_full not in ("block", "raise"):
            raise ValueError("when_full must be 'block' or 'raise'")


class RetransmitBuffer:
    """Ordered by local number; ``bytes``/``count`` kept current; ``room`` wakes blocked publishers."""

    def __init__(self, limits: BufferLimits) -> None:
        self.limits = limits
        self.messages: dict[int, OutMessage] = {}  # insertion order = local order
        self.bytes = 0
        self.room = asyncio.Event()
        self.room.set()

    def __len__(self) -> int:
        return len(self.messages)

    def fits(self, size: int) -> bool:
        lim = self.limits
        if not self.messages:
            return True  # one message alone always fits (a too-large one fails at the broker)
        return len(self.messages) < lim.max_messages and self.bytes + size <= lim.max_bytes

    def add(self, m: OutMessage) -> None:
        self.messages[m.n] = m
        self.bytes += m.size
        if not self.fits(0):
            self.room.clear()

    def remove(self, m: OutMessage) -> None:
        if self.messages.pop(m.n, None) is not None:
            self.bytes -= m.size
            self.room.set()

    def oldest(self) -> OutMessage | None:
        for m in self.messages.values():
            return m
        return None
