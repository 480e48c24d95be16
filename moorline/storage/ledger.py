"""Test-only record of how much of each file is known durable (fsynced).

The crash harness kills a node with SIGKILL, then truncates every file named here back to its
last recorded synced length plus a few random bytes: that is what power loss would have left.
The node passes a ledger only when a test harness injects ``Faults.sync_ledger``; production code never
pays for it.

One JSON object per line: ``{"file": "<absolute path>", "synced_length": N}``. Later lines win.
A file that was deleted keeps its old lines; the harness skips paths that no longer exist.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path


class SyncLedger:
    """Appends ``(file, synced_length)`` lines; safe to share between threads and stores."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        # Remember the last length written per file so unchanged files add no lines.
        self._last: dict[str, int] = {}

    def record(self, file: Path, synced_length: int) -> None:
        self.record_many([(file, synced_length)])

    def record_many(self, items: Iterable[tuple[Path, int]]) -> None:
        with self._lock:
            lines: list[str] = []
            for file, length in items:
                key = os.path.abspath(file)
                if self._last.get(key) == length:
                    continue
                self._last[key] = length
                lines.append(json.dumps({"file": key, "synced_length": length}) + "\n")
            if not lines:
                return
            # Plain append: the page cache survives SIGKILL, and the harness reads this file
            # only after the process is dead, so no fsync is needed here.
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(lines))

    def forget(self, file: Path) -> None:
        """Forget a deleted file so a new file with the same name is recorded afresh."""
        with self._lock:
            self._last.pop(os.path.abspath(file), None)


def read_ledger(path: Path) -> dict[str, int]:
    """The latest synced length per file (used by crash harnesses and tests)."""
    result: dict[str, int] = {}
    if not Path(path).exists():
        return result
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            result[str(obj["file"])] = int(obj["synced_length"])
    return result
