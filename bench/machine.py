"""How fast this machine runs the two kinds of work the brokers do, measured at the start of a run.

Why: on the shared VMs this project is measured on, the speed of interpreted code and of system
calls drift apart from day to day (a plain Python loop took 1.2-1.8 s for 10M iterations on
2026-11-25's first VM and 0.17 s on its last), so a moorline/Mosquitto ratio from one day is not
comparable with another day's unless both probes are printed beside it.
"""

from __future__ import annotations

import os
import time
from typing import Any

LOOP_ITERATIONS = 10_000_000
SYSCALLS = 200_000


def _best_of(runs: int, probe: Any) -> float:
    return min(probe() for _ in range(runs))


def _python_loop_s() -> float:
    started = time.perf_counter()
    for _ in range(LOOP_ITERATIONS):
        pass
    return time.perf_counter() - started


def _syscall_us() -> float:
    getppid = os.getppid  # a system call every time (glibc caches no parent pid)
    started = time.perf_counter()
    for _ in range(SYSCALLS):
        getppid()
    return (time.perf_counter() - started) / SYSCALLS * 1e6


def probe() -> dict[str, float]:
    """Best of 3 each (the least disturbed run): seconds for 10M empty Python loop iterations, and
    microseconds per ``getppid`` system call made from Python."""
    return {
        "python_loop_10m_s": round(_best_of(3, _python_loop_s), 3),
        "syscall_us": round(_best_of(3, _syscall_us), 3),
    }
