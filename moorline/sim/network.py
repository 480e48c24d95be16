"""A simulated network between sim nodes (and clients): delay, drop, duplicate, reorder, partitions.

Endpoints are small integers (node ids 1..n; clients use ids >= 1000). Every fault is drawn
from the seeded generator, so a seed replays the same deliveries. Reordering comes from the
random per-message delay (a later message may draw a shorter delay).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moorline.sim.loop import EventLoop
from moorline.sim.marks import Marks


@dataclass(slots=True)
class NetParams:
    """Per-seed network fault parameters (swarm testing draws them)."""

    delay_min_ms: int = 1
    delay_jitter_ms: int = 5
    drop_p: float = 0.0
    dup_p: float = 0.0
    # bounded per-endpoint in-flight messages: beyond it new messages are dropped (as a full
    # socket buffer would make the sender drop or block)
    max_in_flight_per_dst: int = 20_000


Handler = Callable[[int, Any], None]


class SimNetwork:
    """Delivers payloads between endpoints through the event loop."""

    def __init__(self, loop: EventLoop, rng: random.Random, params: NetParams, marks: Marks) -> None:
        self._loop = loop
        self._rng = rng
        self.params = params
        self._marks = marks
        self._handlers: dict[int, Handler] = {}
        self._blocked: set[tuple[int, int]] = set()  # directed (src, dst) links that lose everything
        # directed links that stall: what is sent before the time given arrives only after it (a
        # TCP connection waiting out a retransmission timeout delivers late, in a burst)
        self._stalled: dict[tuple[int, int], int] = {}
        self._in_flight: dict[int, int] = {}
        self.faults_enabled = True
        # drop messages this predicate selects (e.g. one stream of one link); None: off
        self.drop_filter: Callable[[int, int, Any], bool] | None = None
        # sees every message's fate: (src, dst, payload, fate); None: off (``--verbose``)
        self.watch: Callable[[int, int, Any, str], None] | None = None
        self.sent = 0
        self.dropped = 0
        self.duplicated = 0

    def attach(self, endpoint: int, handler: Handler) -> None:
        self._handlers[endpoint] = handler

    def detach(self, endpoint: int) -> None:
        """A crashed endpoint: messages already in flight to it are lost on arrival."""
        self._handlers.pop(endpoint, None)

    # -- partitions ------------------------------------------------------------------------
    def block(self, src: int, dst: int) -> None:
        self._blocked.add((src, dst))

    def heal(self) -> None:
        self._blocked.clear()

    def stall(self, src: int, dst: int, until_ms: int) -> None:
        self._stalled[(src, dst)] = max(until_ms, self._stalled.get((src, dst), 0))

    def clear_stalls(self) -> None:
        self._stalled.clear()

    def blocked_links(self) -> int:
        return len(self._blocked)

    def is_blocked(self, src: int, dst: int) -> bool:
        return (src, dst) in self._blocked

    # -- traffic ------------------------------------------------------------------------------
    def send(
        self,
        src: int,
        dst: int,
        payload: Any,
        reliable: bool = False,
        on_done: Callable[[bool], None] | None = None,
    ) -> None:
        """Send one message. ``reliable`` skips drop/duplicate (client links), not partitions.
        ``on_done(delivered)`` is called once the fate of the (first copy of the) message is known,
        as a streaming transport learns it (used to report snapshot transfers)."""
        self.sent += 1
        p = self.params
        rng = self._rng
        if (
            (src, dst) in self._blocked
            or (self.faults_enabled and not reliable and p.drop_p and rng.random() < p.drop_p)
            or self._in_flight.get(dst, 0) >= p.max_in_flight_per_dst
            or (self.drop_filter is not None and self.drop_filter(src, dst, payload))
        ):
            self.dropped += 1
            if self.watch is not None:
                self.watch(src, dst, payload, "partitioned" if (src, dst) in self._blocked else "dropped")
            if on_done is not None:
                self._loop.call_later(p.delay_min_ms, on_done, False)
            return
        copies = 1
        if self.faults_enabled and not reliable and p.dup_p and rng.random() < p.dup_p:
            copies = 2
            self.duplicated += 1
        if self.watch is not None:
            self.watch(src, dst, payload, "sent twice" if copies == 2 else "sent")
        stalled = self._stalled.get((src, dst), 0) - self._loop.now_ms if self._stalled else 0
        for _ in range(copies):
            delay = p.delay_min_ms + (int(rng.random() * p.delay_jitter_ms) if p.delay_jitter_ms else 0)
            if stalled > 0:
                delay += stalled
            self._in_flight[dst] = self._in_flight.get(dst, 0) + 1
            self._loop.call_later(delay, self._deliver, src, dst, payload, on_done)
            on_done = None

    def _deliver(self, src: int, dst: int, payload: Any, on_done: Callable[[bool], None] | None) -> None:
        self._in_flight[dst] -= 1
        handler = self._handlers.get(dst)
        if (src, dst) in self._blocked or handler is None:  # link broke in flight, or dst is down
            self.dropped += 1
            if self.watch is not None:
                self.watch(src, dst, payload, "lost in flight" if handler is not None else "lost: receiver down")
            if on_done is not None:
                on_done(False)
            return
        handler(src, payload)
        if on_done is not None:
            on_done(True)
