"""At stop, the node's assembly (node/assembly.py) waits (bounded) for the session closes that closing the connections
started and the cleanups they left (node.background), and for nothing else: a long-lived loop
does not hold the stop up to the bound (it did, 2 s every stop, before)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from moorline.node.assembly import wait_for_session_closes


class _Conn:
    def __init__(self) -> None:
        self.live: object | None = object()


class _Clock:
    def monotonic(self) -> float:
        return time.monotonic()


def _node(closes: list[asyncio.Task[Any]], background: dict[asyncio.Task[Any], None]) -> Any:
    lifecycle = SimpleNamespace(unfinished_closes=lambda: [t for t in closes if not t.done()])
    return SimpleNamespace(clock=_Clock(), lifecycle=lifecycle, background=background)


def test_waits_for_the_closes_and_their_cleanups_only() -> None:
    async def run() -> tuple[float, bool, bool, bool]:
        forever = asyncio.create_task(asyncio.sleep(3600))  # a node loop: never done before node.stop()
        background: dict[asyncio.Task[Any], None] = {}

        async def close() -> None:
            await asyncio.sleep(0.2)
            cleanup = asyncio.create_task(asyncio.sleep(0.2))  # e.g. an end_session left running
            background[cleanup] = None
            cleanup.add_done_callback(lambda t: background.pop(t, None))

        closing = asyncio.create_task(close())
        conn = _Conn()  # its transport reports the loss a little later
        asyncio.get_running_loop().call_later(0.05, setattr, conn, "live", None)
        server = SimpleNamespace(connections={conn: None})
        t0 = time.monotonic()
        await wait_for_session_closes(_node([closing], background), server, 2.0)
        took = time.monotonic() - t0
        done = closing.done() and not background
        forever_running = not forever.done()
        forever.cancel()
        return took, done, forever_running, conn.live is None

    took, done, forever_running, lost = asyncio.run(run())
    assert done and lost and forever_running
    assert 0.35 <= took < 1.5, took


def test_bounded_by_the_timeout() -> None:
    async def run() -> float:
        stuck = asyncio.create_task(asyncio.sleep(3600))
        server = SimpleNamespace(connections={_Conn(): None})
        t0 = time.monotonic()
        await wait_for_session_closes(_node([stuck], {}), server, 0.3)
        stuck.cancel()
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert 0.25 <= took < 1.0, took
