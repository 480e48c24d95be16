"""Issue 29, items 1 and 2: no long-lived loop of a node dies silently, and one shard's bug stops
that shard only.

Each node-level test below failed on 5e679c4: the lease loop ended for good on the first
ShardUnavailable from a full proposal queue, the housekeeping loop on the first failed will
publish (retention and WAL reclaim stopped with it), an apply bug in one shard killed the
group-commit task (every shard stopped), and an InvariantViolation inside the Raft core's step was
logged as a warning while the group went on."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.invariant import InvariantViolation
from moorline.node.node import Node, NodeFailure
from moorline.node.replication.shard_host import ShardUnavailable
from moorline.node.sessions.delivery import LiveSession
from moorline.node.supervisor import Supervisor, TaskFailed
from moorline.raft import Message, MessageType


def _task(name: str) -> asyncio.Task[Any] | None:
    return next((t for t in asyncio.all_tasks() if t.get_name() == name), None)


async def _node(tmp_path: Path, tune: Any = None) -> Node:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 4
    if tune is not None:
        tune(cfg)
    node = Node(cfg)
    node.open()
    await node.start()
    return node


# --- the supervisor itself ---------------------------------------------------------------------------
def test_a_failing_task_is_logged_counted_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        fatal: list[BaseException] = []
        sup = Supervisor(fatal.append, backoff_initial_s=0.01, backoff_max_s=0.02)
        runs = 0
        done = asyncio.Event()

        async def flaky() -> None:
            nonlocal runs
            runs += 1
            if runs < 3:
                raise RuntimeError(f"planted failure {runs}")
            done.set()
            await asyncio.sleep(3600)

        sup.spawn("flaky", flaky, critical=False)
        await asyncio.wait_for(done.wait(), 2)
        assert runs == 3 and sup.failures == {"flaky": 2} and fatal == []
        assert sup.running("flaky")
        await sup.stop()
        assert not sup.running("flaky")

    with caplog.at_level(logging.ERROR, logger="moorline.node.supervisor"):
        asyncio.run(body())
    failed = [r for r in caplog.records if "task flaky failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info for r in failed)  # with the traceback


def test_a_failing_critical_task_stops_the_node() -> None:
    async def body() -> None:
        fatal: list[BaseException] = []
        sup = Supervisor(fatal.append, backoff_initial_s=0.01, backoff_max_s=0.02)

        async def ticks() -> None:
            raise RuntimeError("planted tick bug")

        sup.spawn("raft-ticks", ticks, critical=True)
        for _ in range(50):
            if fatal:
                break
            await asyncio.sleep(0.01)
        assert len(fatal) == 1 and isinstance(fatal[0], TaskFailed) and "raft-ticks" in str(fatal[0])
        assert sup.failures == {"raft-ticks": 1} and not sup.running("raft-ticks")  # not restarted
        await sup.stop()

    asyncio.run(body())


# --- the node's loops ---------------------------------------------------------------------------------
def test_lease_loop_survives_a_full_proposal_queue(tmp_path: Path) -> None:
    """A long minority partition fills raft.max_pending_proposals: renewing a lease raises
    ShardUnavailable. The lease loop must go on (it is what closes clients whose lease lapses)."""
    async def body() -> None:
        node = await _node(tmp_path, lambda cfg: setattr(cfg.session, "owner_lease_s", 1.5))
        try:
            _present, epoch, inc = await node.open_session("c1", False, 600, None, "")
            node.live["c1"] = LiveSession(node, "c1", epoch, inc, 16, lambda outs: None, lambda pid: None)
            refused = 0
            real = node.propose_cb

            def full_queue(shard: int, cmd: Any, callback: Any) -> None:
                nonlocal refused
                if refused < 3:
                    refused += 1
                    raise ShardUnavailable("planted: raft.max_pending_proposals reached")
                real(shard, cmd, callback)

            node.propose_cb = full_queue  # type: ignore[method-assign]
            await asyncio.sleep(2.0)
            assert refused == 3, "the lease loop never tried to renew"
            task = _task("session-leases")
            assert task is not None and not task.done(), "the lease loop died"
            assert node.fatal is None
        finally:
            await node.stop()

    asyncio.run(body())


def test_housekeeping_survives_a_failed_will_publish(tmp_path: Path) -> None:
    async def body() -> None:
        node = await _node(tmp_path, lambda cfg: setattr(cfg.shard, "housekeeping_interval_s", 0.05))
        try:
            _present, epoch, inc = await node.open_session("gone", False, 600, None, "")
            live = LiveSession(node, "gone", epoch, inc, 16, lambda outs: None, lambda pid: None)
            node.live["gone"] = live
            await node.close_session(live, send_will=False, expiry_s=600)  # a disconnected session
            failures = 0
            reclaims = 0

            async def will_fails(shard: int) -> None:
                nonlocal failures
                failures += 1
                raise NodeFailure("planted: will publish failed")

            real_reclaim = node.housekeeping.reclaim

            def counted_reclaim() -> None:
                nonlocal reclaims
                reclaims += 1
                real_reclaim()

            node.lifecycle.session_housekeeping = will_fails  # type: ignore[method-assign]
            node.housekeeping.reclaim = counted_reclaim  # type: ignore[method-assign]
            await asyncio.sleep(0.6)
            assert failures >= 3, f"housekeeping stopped after {failures} failed will publish(es)"
            assert reclaims >= 3, "retention / WAL reclaim stopped"
        finally:
            await node.stop()

    asyncio.run(body())


def test_an_apply_bug_stops_its_shard_only(tmp_path: Path) -> None:
    async def body() -> None:
        node = await _node(tmp_path)
        try:
            bad = 1
            topics = {node.topic_shard(f"t/{i}"): f"t/{i}" for i in range(200)}
            bad_host = node.hosts[bad]

            def broken(*args: Any) -> Any:
                raise RuntimeError("planted apply bug")

            bad_host.state.apply_publishes = broken  # type: ignore[method-assign]
            with pytest.raises(ShardUnavailable, match="planted apply bug"):
                await asyncio.wait_for(node.publish(StoredMessage(topics[bad], b"x", 1, False, b"a" * 16, node.now_ms())), 3)
            assert bad_host.failed is not None and "planted apply bug" in bad_host.failed
            for shard, topic in sorted(topics.items()):
                if shard == bad:
                    continue
                res = await asyncio.wait_for(
                    node.publish(StoredMessage(topic, b"y", 1, False, bytes([shard]) * 16, node.now_ms())), 3)
                assert res is not None
            task = _task("group-commit")
            assert task is not None and not task.done(), "the group-commit task died"
            assert node.fatal is None
        finally:
            await node.stop()

    asyncio.run(body())


def test_an_invariant_violation_in_raft_step_stops_the_group(tmp_path: Path) -> None:
    async def body() -> None:
        node = await _node(tmp_path)
        try:
            host = node.hosts[2]

            def broken_step(m: Message) -> None:
                raise InvariantViolation("planted: the core broke its own rule")

            host.raft.step = broken_step  # type: ignore[method-assign]
            me = host.raft.id
            node.router.on_raft_message(2, Message(type=MessageType.HEARTBEAT, from_=me, to=me, term=1))
            assert host.failed is not None and "planted" in host.failed
            assert all(h.failed is None for h in node.hosts if h is not host)
        finally:
            await node.stop()

    asyncio.run(body())
