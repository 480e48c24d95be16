"""Virtual time: a heap-driven event loop, deterministic from a seed.

Events at the same instant run in an order drawn from the seeded generator (trio-style
shuffling): each scheduled event carries a random tie-breaker, so code that silently relies on
"same-time events run in scheduling order" is exercised in both orders across seeds, while one
seed always replays the same order.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any

from moorline.invariant import invariant


class Timer:
    """A handle to a scheduled event; ``cancel()`` makes the loop skip it."""

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = True

    def cancel(self) -> None:
        self.alive = False


class EventLoop:
    """Runs callbacks in virtual-time order. Time is an integer number of milliseconds."""

    def __init__(self, rng: random.Random, max_events: int = 50_000_000) -> None:
        self.now_ms = 0
        self.events_run = 0
        self._rng = rng
        self._seq = 0
        self._max_events = max_events
        self._heap: list[tuple[int, float, int, Timer, Callable[..., Any], tuple[Any, ...]]] = []

    def call_at(self, when_ms: int, fn: Callable[..., Any], *args: Any) -> Timer:
        if when_ms < self.now_ms:
            invariant(False, f"event scheduled in the past: {when_ms} < {self.now_ms}")
        self._seq += 1
        timer = Timer()
        heapq.heappush(self._heap, (when_ms, self._rng.random(), self._seq, timer, fn, args))
        return timer

    def call_later(self, delay_ms: int, fn: Callable[..., Any], *args: Any) -> Timer:
        return self.call_at(self.now_ms + max(0, delay_ms), fn, *args)

    def pending(self) -> int:
        return len(self._heap)

    def run_until(self, end_ms: int, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to ``end_ms`` (inclusive) or until ``stop()`` turns true."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= end_ms:
            when, _r, _s, timer, fn, args = pop(heap)
            if not timer.alive:
                continue
            self.now_ms = when
            self.events_run += 1
            if self.events_run > self._max_events:
                invariant(False, "event budget exhausted (runaway schedule?)")
            fn(*args)
            if stop is not None and stop():
                return
        self.now_ms = max(self.now_ms, end_ms)
