"""The cluster simulator's scheduler keeps the set of loops with work across steps instead of
rebuilding it after each one (moorline/sim/cluster/vloop.py). Its draws must be the ones a full
rescan every step makes: the same loops at the same instants, so the same interleavings."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from moorline.sim.cluster.vloop import Scheduler, VirtualLoop


class FullRescan(Scheduler):
    """The definition: every step looks at every loop (the scheduler before it kept its set)."""

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


def world(cls: type[Scheduler], seed: int) -> list[Any]:
    """Four processes that give each other work at the same instant (call_soon, due timers),
    set and cancel timers on one another, pause one another and run chains of same-instant
    callbacks: everything that can change which loops have work between two steps."""
    s = cls(random.Random(seed))
    program = random.Random(seed * 7919 + 1)
    loops = [s.new_loop(f"p{i}", rate=1.0 + (i - 2) * 0.004) for i in range(4)]
    log: list[Any] = []
    timers: list[asyncio.TimerHandle] = []

    def act(loop: VirtualLoop, depth: int) -> None:
        log.append((round(s.now, 9), loop.name, depth))
        if depth > 6:
            return
        other = program.choice(loops)
        r = program.random()
        if r < 0.3:
            other.call_soon(act, other, depth + 1)
        elif r < 0.5:
            other.call_at(other.time(), act, other, depth + 1)  # due at once, on another clock
        elif r < 0.65:
            timers.append(other.call_later(program.choice([0.0, 0.001, 0.01]), act, other, depth + 1))
        elif r < 0.75 and timers:
            timers.pop(program.randrange(len(timers))).cancel()
        elif r < 0.8 and other is not loop:
            other.paused_until = s.now + program.choice([0.0, 0.002, 0.02])
        if program.random() < 0.6:
            loop.call_soon(act, loop, depth + 1)  # a chain of same-instant work on this loop

    async def proc(loop: VirtualLoop) -> None:
        for _ in range(25):
            await asyncio.sleep(program.choice([0.0, 0.0, 0.001, 0.005]))
            act(loop, 0)

    for loop in loops:
        loop.create_task(proc(loop))
    s.run_until(1.0)
    log.append(("steps", s.steps, round(s.now, 9)))
    for loop in loops:
        s.dispose(loop)
    return log


def test_the_kept_set_draws_as_a_full_rescan_would() -> None:
    for seed in range(40):
        assert world(Scheduler, seed) == world(FullRescan, seed), f"seed {seed}"


def first_position_of_p1(seed: int) -> int:
    s = Scheduler(random.Random(seed))
    p0, p1 = s.new_loop("p0"), s.new_loop("p1")
    order: list[str] = []

    def chain(n: int) -> None:
        order.append("p0")
        if n < 30:
            p0.call_soon(chain, n + 1)

    def start() -> None:
        p1.call_soon(order.append, "p1")
        chain(1)

    p0.call_later(0.5, start)
    s.run_until(1.0)
    for loop in (p0, p1):
        s.dispose(loop)
    return order.index("p1")


def test_work_given_by_another_process_joins_the_draw_at_once() -> None:
    """p0 runs a chain of 30 same-instant callbacks; its first one gives p1 work. A scheduler that
    looked only at the loop it stepped would run p1's callback after the whole chain, every time."""
    positions = {first_position_of_p1(seed) for seed in range(30)}
    assert min(positions) < 5 and len(positions) > 3
