"""The node's one way to read time (a simulation seam).

Node code reads a monotonic clock for deadlines (leases, timeouts, keepalive) and a wall clock for
the times a leader stamps into entries; both through a ``Clock``, never ``time.*`` directly, so a
simulator can run whole nodes on virtual time. Production uses ``SYSTEM_CLOCK``: the monotonic
clock asyncio's default and uvloop's event loops schedule timers with, and the system's wall clock.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (the event loop's timer clock)."""
        ...

    def wall_ms(self) -> int:
        """Milliseconds since the epoch (may step: callers keep their own stamps non-decreasing)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return int(time.time() * 1000)


SYSTEM_CLOCK: Clock = SystemClock()
