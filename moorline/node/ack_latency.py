"""Acknowledgement latency: from reading a QoS >= 1 PUBLISH to writing its PUBACK / PUBREC.

What a publisher waits for is the broker's promise made concrete (a quorum's fsync, forwarding, a
leader change on the way); operators watch its p99. Fixed memory whatever the rate: log-spaced
buckets (about 12 % wide, 100 us to 60 s), kept per second for the last ``WINDOW_S`` seconds for
the recent percentiles, and cumulatively for Prometheus.
"""

from __future__ import annotations

import math
from collections.abc import Callable

WINDOW_S = 60
_MIN_S = 1e-4
_MAX_S = 60.0
_RATIO = 1.125
BUCKETS = int(math.ceil(math.log(_MAX_S / _MIN_S) / math.log(_RATIO))) + 1
_LOG_RATIO = math.log(_RATIO)
# The /metrics histogram's buckets: the log buckets whose upper bounds are nearest these (seconds),
# so a scrape sums counts already kept instead of the hot path counting twice.
_PROMETHEUS_NEAR = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _bucket(seconds: float) -> int:
    if seconds <= _MIN_S:
        return 0
    return min(BUCKETS - 1, int(math.log(seconds / _MIN_S) / _LOG_RATIO) + 1)


def _upper(bucket: int) -> float:
    return _MIN_S * _RATIO ** bucket


PROMETHEUS_BUCKETS = tuple(sorted({_bucket(b) for b in _PROMETHEUS_NEAR}))


class AckLatency:
    """Record with ``observe``; read ``percentile_ms`` (recent) and ``prometheus_lines``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._slots = [[0] * BUCKETS for _ in range(WINDOW_S)]
        self._slot_second = [-1] * WINDOW_S
        self._all = [0] * BUCKETS  # since start, per bucket
        self.count = 0
        self.sum_s = 0.0

    def observe(self, seconds: float, n: int = 1) -> None:
        """``n`` acknowledgements that took ``seconds`` each (a group's PUBACKs leave together)."""
        second = int(self._clock())
        k = second % WINDOW_S
        if self._slot_second[k] != second:
            self._slots[k] = [0] * BUCKETS
            self._slot_second[k] = second
        b = _bucket(seconds)
        self._slots[k][b] += n
        self._all[b] += n
        self.count += n
        self.sum_s += seconds * n

    def percentile_ms(self, q: float, window_s: int = WINDOW_S) -> float | None:
        """The ``q`` quantile (0..1) of the last ``window_s`` seconds, in ms (a bucket's upper
        bound: at most 12.5 % above the truth); None when nothing was acknowledged then."""
        now = int(self._clock())
        totals = [0] * BUCKETS
        seen = 0
        for k in range(WINDOW_S):
            if now - self._slot_second[k] < min(window_s, WINDOW_S) and self._slot_second[k] >= 0:
                for b, c in enumerate(self._slots[k]):
                    if c:
                        totals[b] += c
                        seen += c
        if not seen:
            return None
        rank = q * seen
        running = 0
        for b, c in enumerate(totals):
            running += c
            if running >= rank:
                return round(_upper(b) * 1000, 3)
        return round(_MAX_S * 1000, 3)

    def prometheus_lines(self, name: str = "moorline_ack_latency_seconds") -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        running, b0 = 0, 0
        for b in PROMETHEUS_BUCKETS:
            running += sum(self._all[b0:b + 1])
            b0 = b + 1
            lines.append(f'{name}_bucket{{le="{_upper(b):.6g}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum_s:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines
