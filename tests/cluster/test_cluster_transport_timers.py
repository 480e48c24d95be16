"""The transport's liveness checks cost no timer per frame (issue 21, cluster W1's CPU).

A timeout around every read, every drain and every idle wait of a link started and cancelled three
loop timers per frame; in a three-node W1 they were about 5 % of each node's CPU. Idleness is now
watched once per keepalive interval (the listener's Pong loop, the dialer's keepalive timer), and a
drain that would not wait is not awaited. What those checks catch is tested in
test_cluster_transport.py (idle connections on both sides, slow frames, stalls, pings).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from moorline.cluster.wire import Payload
from moorline.raft.types import Stream
from tests.cluster.helpers import FAST, close_all, mesh, requires_loopback_aliases

pytestmark = [pytest.mark.timeout(60), requires_loopback_aliases]

FRAMES = 200


def test_frames_one_at_a_time_start_no_timer_each() -> None:
    async def body() -> None:
        # Long liveness intervals: any timer counted below is one per frame, not a keepalive.
        limits = replace(FAST, keepalive_interval_s=5.0, idle_timeout_s=20.0)
        nodes = await mesh(2, limits=[limits, limits])
        (a, _), (_, inbox) = nodes
        loop = asyncio.get_running_loop()
        timers: list[float] = []
        try:
            assert a.send("n2", Stream.APPEND, Payload("warm", b"up"))  # connect and authenticate first
            while not inbox.payloads():
                await asyncio.sleep(0.01)
            real_call_at = loop.call_at

            def counting_call_at(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
                timers.append(when)
                return real_call_at(when, *args, **kwargs)

            loop.call_at = counting_call_at  # type: ignore[method-assign]
            try:
                for i in range(FRAMES):  # one frame in flight at a time, like a replication round
                    assert a.send("n2", Stream.APPEND, Payload("f", i.to_bytes(4, "big")))
                    while len(inbox.payloads()) < i + 2:
                        await asyncio.sleep(0)  # no timer of the test's own
            finally:
                loop.call_at = real_call_at  # type: ignore[method-assign]
            assert len(inbox.payloads()) == FRAMES + 1
            assert len(timers) < FRAMES // 10, f"{len(timers)} timers for {FRAMES} frames"
        finally:
            await close_all(nodes)

    async def bounded() -> None:
        async with asyncio.timeout(30):
            await body()

    asyncio.run(bounded())
