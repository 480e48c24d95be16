"""A proposal's outcome that arrives after its waiter gave up is taken, never left for asyncio to
report as "Future exception was never retrieved" (moorline sim --cluster --draw-config seed 142:
a SUBSCRIBE's SessionSubscribe timed out in Node.bounded on a node cut from its peers; when that
replica later installed the leader's snapshot, which had applied it, the future was settled
"outcome unknown" and nobody ever looked at it). And a shard that fails answers the commands
proposed to it but not sealed yet, instead of leaving their waiters forever."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.node.replication.shard_host import ShardUnavailable
from tests.node.inproc_cluster import InProcCluster

pytestmark = pytest.mark.timeout(120)


def quick_timeouts(cfg: NodeConfig) -> None:
    cfg.mqtt.control_timeout_s = 0.3


async def alone(tmp_path: Path) -> InProcCluster:
    """Three nodes with one shard, then n2 and n3 stopped: n1's group commits nothing."""
    c3 = InProcCluster(tmp_path, shards=1, tune=quick_timeouts)
    await c3.start()
    await c3.wait_leaders()
    await c3.stop("n2")
    await c3.stop("n3")
    return c3


def test_outcome_unknown_after_a_timed_out_wait_is_not_left_unretrieved(tmp_path: Path) -> None:
    async def body() -> list[str]:
        loop = asyncio.get_running_loop()
        reported: list[str] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(f"{ctx.get('message')}: "
                                                                      f"{ctx.get('exception')!r}"))
        c3 = await alone(tmp_path)
        try:
            node = c3.nodes["n1"]
            host = node.hosts[0]
            fut = node.propose(0, c.SessionHousekeeping(node.now_ms()))
            assert fut is not None
            with pytest.raises(ShardUnavailable, match="committed nothing"):
                await node.bounded(fut, 0)  # the SUBSCRIBE is answered with a failure
            assert not fut.done() and host.proposer._own, "the proposal waits, unapplied, to be resent"
            # The replica installs a leader's snapshot that applied it (its per-node sequence says
            # so, as _install's state would): the outcome here is unknown.
            host.state.proposals[host.node_id] = (host.boot, max(host.proposer._own))
            host.proposer.settle_after_install()
            # (read without fut.exception(), which would mark it retrieved)
            assert fut.done() and "outcome unknown" in repr(getattr(fut, "_exception", None))
            del fut
            gc.collect()
            await asyncio.sleep(0.05)
            return reported
        finally:
            await c3.close()

    reported = asyncio.run(body())
    assert not [r for r in reported if "never retrieved" in r], reported


def test_a_failed_shard_answers_the_commands_not_yet_sealed(tmp_path: Path) -> None:
    async def body() -> None:
        c3 = await alone(tmp_path)
        try:
            host = c3.nodes["n1"].hosts[0]
            results: list[Any] = []
            fut = host.propose(c.SessionHousekeeping(0))
            host.propose_cb(c.SessionHousekeeping(0), lambda res, exc: results.append(exc))
            assert fut is not None and host.has_batch()
            host.fail("a bug in an apply")  # before the group commit sealed them
            assert fut.done() and isinstance(fut.exception(), ShardUnavailable)
            assert len(results) == 1 and isinstance(results[0], ShardUnavailable), results
            assert not host.has_batch()
        finally:
            await c3.close()

    asyncio.run(body())
