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
import contextvars
import heapq
import itertools
import logging
import random
import selectors
from asyncio import events, format_helpers
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


_new_handle = events.Handle.__new__
_copy_context = contextvars.copy_context


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on the scheduler's clock: ``time()`` is virtual seconds (scaled by
    ``rate`` for a process whose clock runs fast or slow, within the documented drift bound).

    Besides the clock it overrides the parts of ``BaseEventLoop`` the scheduler leans on, same
    behaviour, less cost: ``_run_once`` (no selector poll), and ``_call_soon`` / ``call_at`` /
    ``_timer_handle_cancelled``, which also tell the scheduler when code of one process gives
    another process work (``Scheduler.dirty``). Its timer heap holds ``(when, seq, handle)``
    (asyncio's holds handles, compared by a Python ``__lt__``): timers due at the same instant
    fire in the order they were set."""

    def __init__(self, scheduler: Scheduler, name: str, rate: float = 1.0) -> None:
        super().__init__(_NoWaitSelector())
        self.scheduler = scheduler
        self.name = name
        self.rate = rate
        self.crashed = False
        self._paused_until: float | None = None
        self._clock_resolution = 1e-9
        self._timer_seq = itertools.count()

    @property
    def paused_until(self) -> float | None:
        """World time it resumes at (None: running)."""
        return self._paused_until

    @paused_until.setter
    def paused_until(self, value: float | None) -> None:
        self._paused_until = value
        self.scheduler.dirty = True

    def time(self) -> float:
        return self.scheduler.now * self.rate

    def world_time_of(self, loop_time: float) -> float:
        return loop_time / self.rate

    def has_ready(self) -> bool:
        return bool(self._ready)  # type: ignore[attr-defined]

    def next_timer_world_time(self) -> float | None:
        sched = self._scheduled  # type: ignore[has-type]
        while sched and sched[0][2]._cancelled:
            # Same as _run_once's own pruning; it keeps the scheduler from waking for nothing.
            heapq.heappop(sched)[2]._scheduled = False
            self._timer_cancelled_count -= 1  # type: ignore[has-type]
        if not sched:
            return None
        return self.world_time_of(sched[0][0])

    # --- asyncio.BaseEventLoop internals, same behaviour ------------------------------------------
    def _call_soon(self, callback: Any, args: Any, context: Any) -> asyncio.Handle:
        if self._debug:  # type: ignore[attr-defined]
            handle = events.Handle(callback, args, self, context)
            if handle._source_traceback:  # type: ignore[attr-defined]
                del handle._source_traceback[-1]  # type: ignore[attr-defined]
        else:  # Handle.__init__ without its two calls (a quarter of a million handles a seed)
            handle = _new_handle(events.Handle)
            handle._context = _copy_context() if context is None else context  # type: ignore[attr-defined]
            handle._loop = self  # type: ignore[attr-defined]
            handle._callback = callback  # type: ignore[attr-defined]
            handle._args = args  # type: ignore[attr-defined]
            handle._cancelled = False  # type: ignore[attr-defined]
            handle._repr = None  # type: ignore[attr-defined]
            handle._source_traceback = None  # type: ignore[attr-defined]
        self._ready.append(handle)  # type: ignore[attr-defined]
        if self is not self.scheduler.current:
            self.scheduler.dirty = True  # another process's code gave this one work
        return handle

    def call_at(  # type: ignore[override]
            self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        if self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")  # as _check_closed
        if self._debug:  # type: ignore[attr-defined]
            self._check_thread()  # type: ignore[attr-defined]
            self._check_callback(callback, "call_at")  # type: ignore[attr-defined]
            timer = events.TimerHandle(when, callback, args, self, context)
            if timer._source_traceback:  # type: ignore[attr-defined]
                del timer._source_traceback[-1]  # type: ignore[attr-defined]
        else:  # TimerHandle.__init__ without its three calls
            timer = _new_handle(events.TimerHandle)
            timer._context = _copy_context() if context is None else context  # type: ignore[attr-defined]
            timer._loop = self  # type: ignore[attr-defined]
            timer._callback = callback  # type: ignore[attr-defined]
            timer._args = args  # type: ignore[attr-defined]
            timer._cancelled = False  # type: ignore[attr-defined]
            timer._repr = None  # type: ignore[attr-defined]
            timer._source_traceback = None  # type: ignore[attr-defined]
            timer._when = when  # type: ignore[attr-defined]
        heapq.heappush(self._scheduled, (when, next(self._timer_seq), timer))  # type: ignore[has-type]
        timer._scheduled = True  # type: ignore[attr-defined]
        scheduler = self.scheduler
        if self is not scheduler.current and when / self.rate <= scheduler.now:
            scheduler.dirty = True  # due at once, set by another process's code
        return timer

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        if handle._scheduled:  # type: ignore[attr-defined]
            self._timer_cancelled_count += 1  # type: ignore[has-type]
            if self is not self.scheduler.current:
                self.scheduler.dirty = True

    def step(self) -> None:
        """One iteration of this loop, as the running loop (``asyncio.get_running_loop()``)."""
        previous = events._get_running_loop()
        events._set_running_loop(self)
        try:
            self._run_once()
        finally:
            events._set_running_loop(previous)

    def _run_once(self) -> None:
        """CPython's ``BaseEventLoop._run_once`` (3.11-3.13) without the selector poll: the
        selector never has events here, so this is the same iteration (prune cancelled timers,
        move the due ones to the ready queue, run the callbacks ready now, in FIFO order, each as
        ``Handle._run`` would) at a fraction of the cost. The scheduler runs hundreds of
        thousands of these per seed."""
        sched = self._scheduled  # type: ignore[has-type]
        count = len(sched)
        if count > 100 and self._timer_cancelled_count / count > 0.5:  # type: ignore[has-type]
            # asyncio's own rebuild when most timers are cancelled (same constants)
            kept = []
            for entry in sched:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._scheduled = sched = kept
            self._timer_cancelled_count = 0
        else:
            while sched and sched[0][2]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(sched)[2]._scheduled = False
        ready = self._ready  # type: ignore[attr-defined]
        if sched:
            end_time = self.scheduler.now * self.rate + self._clock_resolution
            heappop = heapq.heappop
            while sched and sched[0][0] < end_time:
                handle = heappop(sched)[2]
                handle._scheduled = False
                ready.append(handle)
        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if handle._cancelled:
                continue
            try:  # Handle._run, inline (one frame less per callback)
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._callback_failed(handle, exc)
        handle = None  # breaks a cycle when an exception occurs (as asyncio does)

    def _callback_failed(self, handle: asyncio.Handle, exc: BaseException) -> None:
        """What ``Handle._run`` does with a callback's exception."""
        cb = format_helpers._format_callback_source(handle._callback, handle._args)  # type: ignore[attr-defined]
        context: dict[str, Any] = {"message": f"Exception in callback {cb}", "exception": exc, "handle": handle}
        if handle._source_traceback:  # type: ignore[attr-defined]
            context["source_traceback"] = handle._source_traceback  # type: ignore[attr-defined]
        self.call_exception_handler(context)


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
        self.current: VirtualLoop | None = None  # the loop whose callbacks are running
        # Set when a process may have been given work other than by its own callbacks (another
        # process's code, a pause, a loop added or dropped): the next step looks at every loop.
        self.dirty = True

    def new_loop(self, name: str, rate: float = 1.0) -> VirtualLoop:
        loop = VirtualLoop(self, name, rate)
        loop.set_exception_handler(self._exception)
        self.loops.append(loop)
        self.all_loops.append(loop)
        self.dirty = True
        return loop

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if self.on_error is not None:
            invariant(isinstance(loop, VirtualLoop), "a virtual loop")
            self.on_error(loop, context)  # type: ignore[arg-type]

    def drop(self, loop: VirtualLoop) -> None:
        """A crashed process: its loop never runs again (its callbacks and timers die with it)."""
        loop.crashed = True
        self.dirty = True
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
                except OSError:
                    # Its cleanup touched a file the simulated kernel closed when its node crashed
                    # (world.crash): a snapshot transfer's staging store, whose receive was pending
                    # when its node died and is ended only now (seen with installs aimed at).
                    pass
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
        """The world to time ``end``. Each step: every loop with work at the current instant (a
        ready callback, or a timer due), one of them drawn from the seeded generator and run once
        (``_run_once``); when none has, the clock moves to the earliest timer or pause end.

        The hot loop of the simulator, so the set of loops with work is not rebuilt after every
        step: at one instant only the loop just stepped can have changed, unless its callbacks
        gave another process work, which sets ``dirty`` (``VirtualLoop._call_soon`` / ``call_at`` /
        ``_timer_handle_cancelled``; a pause, a new or dropped loop). The draws are those a full
        rescan every step would make: the same loops, in the same order."""
        loops = self.loops  # mutated in place by new_loop / drop, never replaced
        choice = self.rng.choice
        previous = running = events._get_running_loop()
        outer = self.current
        ready: list[VirtualLoop] = []
        now = self.now
        self.dirty = True
        try:
            while True:
                if self.dirty or not ready:
                    self.dirty = False
                    now = self.now
                    ready = []
                    earliest = end
                    for loop in loops:
                        paused = loop._paused_until
                        if paused is not None:
                            if paused <= now:
                                loop._paused_until = None
                            else:
                                if paused < earliest:
                                    earliest = paused
                                continue
                        if loop._ready:  # type: ignore[attr-defined]
                            ready.append(loop)
                            continue
                        sched = loop._scheduled  # type: ignore[attr-defined]
                        if not sched:
                            continue
                        if sched[0][2]._cancelled:
                            t = loop.next_timer_world_time()
                            if t is None:
                                continue
                        else:
                            t = sched[0][0] / loop.rate
                        if t <= now:
                            ready.append(loop)
                        elif t < earliest:
                            earliest = t
                    if not ready:
                        if earliest >= end:
                            if end > now:
                                self.now = end
                            return
                        self.now = earliest
                        continue
                loop = ready[0] if len(ready) == 1 else choice(ready)
                self.steps += 1
                if loop is not running:
                    events._set_running_loop(loop)
                    running = loop
                self.current = loop
                loop._run_once()
                self.current = outer
                if self.dirty or loop._ready:  # type: ignore[attr-defined]
                    continue
                # Has the loop just stepped still a timer due now? (Else it leaves the set.)
                sched = loop._scheduled  # type: ignore[attr-defined]
                if sched and sched[0][2]._cancelled:
                    t = loop.next_timer_world_time()
                    due = t is not None and t <= now
                else:
                    due = bool(sched) and sched[0][0] / loop.rate <= now
                if not due:
                    ready.remove(loop)
        finally:
            self.current = outer
            if running is not previous:
                events._set_running_loop(previous)

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
