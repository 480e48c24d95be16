"""Commands nobody waits for (ack reports, QoS 1 session acks, housekeeping) never force a WAL sync
of their own: they ride on the next sync a proposer waits for, or go when the lazy timer ends.

Index 1 is the one-voter leader's no-op (make_host), so the first command is applied at index 2."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker import commands as c
from moorline.node.replication.group_commit import GroupCommit
from moorline.storage.wal import WriteAheadLog
from tests.node.test_node_command_groups import make_host, publish

DELAY_MS = 200


def _commit(tmp_path: Path) -> tuple[GroupCommit, list[int]]:
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    host = make_host(tmp_path, wal=wal)
    commits: list[int] = []
    gc = GroupCommit(wal, [host], on_fatal=lambda exc: None, after_commit=lambda: commits.append(1),
                     inline_sync_max_us=10_000_000, lazy_sync_delay_ms=DELAY_MS)
    return gc, commits


def test_lazy_commands_alone_wait_for_the_timer(tmp_path: Path) -> None:
    async def body() -> None:
        gc, commits = _commit(tmp_path)
        host = gc.hosts[0]
        runner = asyncio.create_task(gc.run())
        host.propose(c.Housekeeping(1_000, -1), False)
        gc.kick_lazy(0)
        await asyncio.sleep(DELAY_MS / 1000 / 4)
        assert gc.syncs == 0 and host.state.applied_index == 1, "a lazy command forced a sync of its own"
        await asyncio.sleep(DELAY_MS / 1000 * 2)
        assert gc.syncs == 1 and gc.lazy_syncs == 1 and commits == [1]
        assert host.state.applied_index == 2
        gc.stop()
        runner.cancel()

    asyncio.run(body())


def test_an_urgent_proposal_takes_the_lazy_ones_along_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        gc, _ = _commit(tmp_path)
        host = gc.hosts[0]
        runner = asyncio.create_task(gc.run())
        host.propose(c.AckReport("nobody\x00t/a", (0,)), False)
        gc.kick_lazy(0)
        await asyncio.sleep(0.01)
        fut = host.propose(publish(1))
        gc.kick(0)
        result = await asyncio.wait_for(fut, DELAY_MS / 1000 / 2)  # long before the lazy timer
        assert result.status == "ok"
        assert gc.syncs == 1 and gc.lazy_syncs == 0
        assert host.state.applied_index == 2  # one entry (after the no-op): the ack report, then the publish
        await asyncio.sleep(DELAY_MS / 1000 * 1.5)
        assert gc.syncs == 1, "the cancelled lazy timer still forced a sync"
        gc.stop()
        runner.cancel()

    asyncio.run(body())


def test_flush_syncs_lazy_commands_at_once(tmp_path: Path) -> None:
    """Shutdown does not wait for the lazy timer, nor lose what rides on it: Node.stop flushes."""

    async def body() -> None:
        gc, _ = _commit(tmp_path)
        host = gc.hosts[0]
        runner = asyncio.create_task(gc.run())
        assert await gc.flush(1.0)  # nothing proposed: nothing to wait for
        host.propose(c.Housekeeping(1_000, -1), False)
        gc.kick_lazy(0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await gc.flush(DELAY_MS / 1000 * 5)
        assert loop.time() - started < DELAY_MS / 1000 / 2, "flush waited for the lazy timer"
        assert gc.syncs == 1 and gc.lazy_syncs == 0 and host.state.applied_index == 2
        gc.stop()
        runner.cancel()

    asyncio.run(body())
