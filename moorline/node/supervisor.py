"""The one owner of a node's long-lived tasks.

Every loop that must run for the node's life (group commit, Raft ticks, leases, housekeeping, the
metadata bootstrap, the lag watcher) is started here, never with a bare ``create_task``: a loop that
raised used to end without a word, and the node limped on without it (no lease renewed, no
retention, no ticks). Now an exception is logged with its traceback and counted per task; then the
task is restarted after a bounded, growing backoff, or, for a task whose loss makes the node unsafe
(``critical``: ticks, leases, group commit), the node is stopped with an error so that its process
manager restarts it clean instead of serving without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from moorline.node.aio import cancel_all

log = logging.getLogger("moorline.node.supervisor")


class TaskFailed(Exception):
    """A critical task raised: the node stops (exit code non-zero) instead of limping on."""


@dataclass
class _Supervised:
    name: str
    factory: Callable[[], Awaitable[None]]
    critical: bool
    task: asyncio.Task[None] | None = None
    restarts: int = 0


@dataclass
class Supervisor:
    """Runs named loops; a loop that ends by returning is done, one that raises is restarted
    (``backoff_initial_s`` doubling up to ``backoff_max_s``) or, if critical, fails the node
    through ``on_fatal``."""

    on_fatal: Callable[[BaseException], None]
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    failures: dict[str, int] = field(default_factory=dict)  # moorline_task_failures_total{task}
    _tasks: dict[str, _Supervised] = field(default_factory=dict)
    _stopping: bool = False

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]], *, critical: bool) -> None:
        """Starts ``factory()`` as the task ``name`` (unique) under supervision."""
        if name in self._tasks:
            raise ValueError(f"task {name!r} is already supervised")
        sup = _Supervised(name, factory, critical)
        self._tasks[name] = sup
        sup.task = asyncio.get_running_loop().create_task(self._run(sup), name=name)

    def running(self, name: str) -> bool:
        sup = self._tasks.get(name)
        return sup is not None and sup.task is not None and not sup.task.done()

    async def _run(self, sup: _Supervised) -> None:
        backoff = self.backoff_initial_s
        while not self._stopping:
            try:
                await sup.factory()
                return  # a loop that ends by itself is finished (the node is stopping)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures[sup.name] = self.failures.get(sup.name, 0) + 1
                if self._stopping:
                    return
                if sup.critical:
                    log.critical("task %s failed; the node cannot run safely without it: stopping",
                                 sup.name, exc_info=exc)
                    self.on_fatal(TaskFailed(f"task {sup.name} failed: {exc!r}"))
                    return
                log.error("task %s failed (failure %d); restarting in %.1f s",
                          sup.name, self.failures[sup.name], backoff, exc_info=exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max_s)
            sup.restarts += 1

    async def stop(self, names: list[str] | None = None) -> None:
        """Cancels the named tasks (all when None) and waits for them to end."""
        if names is None:
            self._stopping = True
        chosen = [s for n, s in self._tasks.items() if names is None or n in names]
        await cancel_all([s.task for s in chosen if s.task is not None])
