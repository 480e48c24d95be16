"""Virtual time for real asyncio code: one event loop per simulated process, one clock for all.

Each simulated node (and the model clients) runs on its own ``VirtualLoop``: a standard asyncio
selector loop whose ``time()`` is the world's virtual clock (optionally skewed per process) and
whose selector never waits. ``Scheduler`` owns the clock and the loops: each step it finds the
earliest instant at which some loop has work (a ready callback, or a timer due), moves the clock
there, draws one of the loops with work at that instant from the seeded generator, and runs one
iteration of it (``_run_once``, CPython's own loop step). So:

- the node code is unchanged asyncio (tasks, futures, timers, streams), on virtual time;
- the interleaving of processes is a seeded choice among the loops with ready callbacks, while
  within one process callbacks keep asyncio's FIFO order (its transports and futures rely on it);
- a crashed process is a loop that is never stepped again; a paused one is skipped until resumed
  (its overdue timers then fire at once, as a SIGCONT'd process's do).

Nothing here reads a real clock, and the only randomness is the seeded generator.
"""

from __future__ import annotations

import asyncio
import logging
import random
import selectors
from asyncio import events
from collections.abc import Callable, Coroutine
from typing import Any

from moorline.invariant import invariant


class _NoWaitSelector(selectors.BaseSelector):
    """Holds registrations (the loop's self-pipe) and never waits: the scheduler moves time."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on the scheduler's clock: ``time()`` is virtual seconds (scaled by
    ``rate`` for a process whose clock runs fast or slow, within the documented drift bound)."""

    def __init__(self, scheduler: Scheduler, name: str, rate: float = 1.0) -> None:
        super().__init__(_NoWaitSelector())
        self.scheduler = scheduler
        self.name = name
        self.rate = rate
        self.crashed = False
        self.paused_until: float | None = None  # world time it resumes at
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.scheduler.now * self.rate

    def world_time_of(self, loop_time: float) -> float:
        return loop_time / self.rate

    def has_ready(self) -> bool:
        return bool(self._ready)  # type: ignore[attr-defined]

    def next_timer_world_time(self) -> float | None:
        sched = self._scheduled  # type: ignore[attr-defined]
        while sched and sched[0]._cancelled:
            # Same as _run_once's own pruning; it keeps the scheduler from waking for nothing.
            import heapq
            handle = heapq.heappop(sched)
            handle._scheduled = False
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        if not sched:
            return None
        return self.world_time_of(sched[0]._when)

    def step(self) -> None:
        """One iteration of this loop, as the running loop (``asyncio.get_running_loop()``)."""
        events._set_running_loop(self)
        try:
            self._run_once()  # type: ignore[attr-defined]
        finally:
            events._set_running_loop(None)


class Deadlock(Exception):
    """No loop has anything left to do before the end of the run."""


class Scheduler:
    """The world's clock and the processes' loops; ``run_until(t)`` advances the world to ``t``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 0.0
        self.loops: list[VirtualLoop] = []
        self.all_loops: list[VirtualLoop] = []  # dropped ones too, disposed of at the end
        self.steps = 0
        self.on_error: Callable[[VirtualLoop, dict[str, Any]], None] | None = None

    def new_loop(self, name: str, rate: float = 1.0) -> VirtualLoop:
        loop = VirtualLoop(self, name, rate)
        loop.set_exception_handler(self._exception)
        self.loops.append(loop)
        self.all_loops.append(loop)
        return loop

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if self.on_error is not None:
            invariant(isinstance(loop, VirtualLoop), "a virtual loop")
            self.on_error(loop, context)  # type: ignore[arg-type]

    def drop(self, loop: VirtualLoop) -> None:
        """A crashed process: its loop never runs again (its callbacks and timers die with it)."""
        loop.crashed = True
        if loop in self.loops:
            self.loops.remove(loop)

    def dispose(self, loop: VirtualLoop) -> None:
        """After the run: end the loop's coroutines (their cleanup may no longer matter to the
        world) and release its resources (the self-pipe), quietly."""
        self.drop(loop)
        tasks = list(asyncio.all_tasks(loop))
        events._set_running_loop(loop)
        previous = logging.root.manager.disable
        logging.disable(logging.CRITICAL)  # what the closed coroutines' handlers say is not the world's
        try:
            for task in tasks:
                task._log_destroy_pending = False  # type: ignore[attr-defined]
                try:
                    task.get_coro().close()  # type: ignore[union-attr]
                except (RuntimeError, ValueError):
                    pass  # a coroutine that refuses to close: garbage collection ends it
        finally:
            events._set_running_loop(None)
            logging.disable(previous)
        loop._ready.clear()  # type: ignore[attr-defined]
        loop._scheduled.clear()  # type: ignore[attr-defined]
        if not loop.is_closed():
            loop.close()

    def _runnable(self, loop: VirtualLoop) -> bool:
        return loop.paused_until is None or loop.paused_until <= self.now

    def run_until(self, end: float) -> None:
        while True:
            ready: list[VirtualLoop] = []
            earliest = end
            for loop in self.loops:
                if loop.paused_until is not None:
                    if loop.paused_until <= self.now:
                        loop.paused_until = None
                    else:
                        earliest = min(earliest, loop.paused_until)
                        continue
                if loop.has_ready():
                    ready.append(loop)
                    continue
                t = loop.next_timer_world_time()
                if t is not None:
                    if t <= self.now:
                        ready.append(loop)
                    else:
                        earliest = min(earliest, t)
            if not ready:
                if earliest >= end:
                    self.now = max(self.now, end)
                    return
                self.now = earliest
                continue
            loop = ready[0] if len(ready) == 1 else self.rng.choice(ready)
            self.steps += 1
            loop.step()

    def run_task(self, loop: VirtualLoop, coro: Coroutine[Any, Any, Any], limit: float) -> Any:
        """Run ``coro`` on ``loop`` (the world moving along) until it finishes; Deadlock if it has
        not by world time ``limit``."""
        task = loop.create_task(coro)
        while not task.done():
            if self.now >= limit:
                task.cancel()
                raise Deadlock(f"{loop.name}: {coro!r} not done by t={limit:.3f}")
            self.run_until(min(limit, self.now + 0.05))
        return task.result()
