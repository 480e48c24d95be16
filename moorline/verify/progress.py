"""What a long Spark job is doing, on stderr, while the caller waits for it.

The caller names its steps (``step``); a thread reads the running stages' task counts from Spark's
status tracker. On a terminal that is a rich progress display; otherwise (a log, CI, a pipe) a
plain line at each step and every ``plain_every_s`` seconds within one, so a long run is never
silent and a log never fills with redraws.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

POLL_S = 0.5  # how often the status tracker is read


@dataclass(frozen=True)
class StageCounts:
    """Tasks of the stages running now."""

    stages: tuple[int, ...]
    done: int
    total: int

    def text(self) -> str:
        if not self.stages:
            return "no stage running"
        label = "stage" if len(self.stages) == 1 else "stages"
        return f"{label} {', '.join(str(s) for s in self.stages)}: {self.done}/{self.total} tasks"


def stage_counts(tracker: Any) -> StageCounts:
    """Running stages and their tasks from a pyspark ``StatusTracker`` (or anything shaped like it)."""
    ids, done, total = [], 0, 0
    for stage_id in sorted(tracker.getActiveStageIds()):
        info = tracker.getStageInfo(stage_id)
        if info is None:  # finished between the two calls
            continue
        ids.append(stage_id)
        done += int(info.numCompletedTasks)
        total += int(info.numTasks)
    return StageCounts(tuple(ids), done, total)


class SparkProgress:
    """``with SparkProgress(sc, "verify", STEPS) as p: ... p.step(name) ...``"""

    def __init__(
        self,
        spark_context: Any,
        label: str,
        steps: Sequence[str],
        *,
        stream: TextIO | None = None,
        plain_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracker = spark_context.statusTracker()
        self._label = label
        self._steps = list(steps)
        self._stream = stream if stream is not None else sys.stderr
        self._plain_every_s = plain_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._current = 0  # 1-based index of the running step; 0 before the first
        self._step_name = ""
        self._started = clock()
        self._last_line = float("-inf")
        self._rich: Any = None
        self._rich_steps: Any = None
        self._rich_tasks: Any = None

    @property
    def interactive(self) -> bool:
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> SparkProgress:
        if self.interactive:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed:.0f}/{task.total:.0f}"),
                TimeElapsedColumn(),
                console=Console(file=self._stream),
                transient=True,
            )
            self._rich.start()
            self._rich_steps = self._rich.add_task(f"{self._label}: starting", total=len(self._steps))
            self._rich_tasks = self._rich.add_task("  spark tasks", total=1)
        self._thread = threading.Thread(target=self._run, name=f"{self._label}-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._rich is not None:
            self._rich.stop()
        elif exc[0] is None and self._current:
            self._line(f"done in {self._clock() - self._started:.0f} s")

    def step(self, name: str) -> None:
        with self._lock:
            self._current = self._steps.index(name) + 1 if name in self._steps else self._current + 1
            self._step_name = name
        self.refresh(force_line=True)

    def refresh(self, force_line: bool = False) -> None:
        """Show the current state (the thread calls this every POLL_S)."""
        try:
            counts = stage_counts(self._tracker)
        except Exception:  # the context is stopping: nothing left to show
            return
        with self._lock:
            current, name = self._current, self._step_name
        if not current:
            return
        where = f"[{current}/{len(self._steps)}] {name}"
        if self._rich is not None:
            self._rich.update(self._rich_steps, completed=current - 1, description=f"{self._label}: {where}")
            self._rich.update(
                self._rich_tasks,
                completed=counts.done,
                total=max(1, counts.total),
                description=f"  {counts.text()}",
            )
            return
        now = self._clock()
        if force_line or now - self._last_line >= self._plain_every_s:
            self._line(f"{where} — {counts.text()}, {now - self._started:.0f} s")

    def _line(self, text: str) -> None:
        self._last_line = self._clock()
        print(f"{self._label}: {text}", file=self._stream, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.refresh()
