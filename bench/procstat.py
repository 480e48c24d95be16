"""CPU time and peak memory of a process tree, read from /proc (Linux only).

Why the whole tree: a broker may fork helpers (moorline shards, amqtt's interpreter under a launcher script);
the figure we compare is the cost of the broker, whatever its process layout.
"""

from __future__ import annotations

import os
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 3 ("state") starts after the LAST ')', so index 0 here is field 3 of proc(5).
    return raw[raw.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree: list[int] = []
    pending = [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def tree_cpu_seconds(root: int) -> float:
    """user+sys of the live tree, plus what its members already collected from reaped children.

    Summing utime+stime+cutime+cstime over the live members counts every CPU second once: a process's own
    times only move into its parent's cutime/cstime when it is reaped, and then it is no longer live.
    """
    ticks = 0
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is None:
            continue
        # proc(5) fields 14..17 (utime, stime, cutime, cstime) are indexes 11..14 here.
        ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return ticks / _CLOCK_TICKS


def _status_kib(pid: int, key: str) -> int:
    try:
        text = (_PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def tree_peak_rss_bytes(root: int) -> int:
    """Sum of VmHWM (each process's peak resident set) over the live tree."""
    return sum(_status_kib(pid, "VmHWM") for pid in process_tree(root)) * 1024
