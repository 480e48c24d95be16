"""A will that fell due is owed by its session shard until its topic's shard applied it
(``SessionState.wills_owed``, cleared by ``WillPublished``); the session shard's leader publishes an
owed will again (sessions/followups.py). Found by sim --cluster seeds 31081 and 31214 (the will's
publish was refused: the topic shard's leader was changing, 8 proposals of the node already waited,
``raft.max_pending_proposals``) and 31187 (the node that proposed the ``SessionHousekeeping`` that
took the will out of the session shard's state was drained and stopped before it published it):
the apply had already dropped the will, so nothing ever published it. MQTT-3.1.2-8: the will is
published when the network connection ends without DISCONNECT."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.config import NodeConfig
from moorline.hashing import guid128
from moorline.mqtt.codec import encode
from moorline.mqtt.packets import Connect, Properties, Will
from moorline.node.errors import ShardUnavailable
from tests.node.served_node import served_node

pytestmark = pytest.mark.timeout(60)

HOUSEKEEPING_S = 0.05


async def _connack(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(2)
    assert head[0] == 0x20, f"CONNACK expected, got {head!r}"
    return await reader.readexactly(head[1])


async def _scenario(tmp_path: Path, how: str) -> tuple[bool, int, list[str]]:
    """``c1`` connects with a will on ``w/c1``; its connection ends without DISCONNECT: dropped
    (``publish_refused``, ``outcome_lost``); taken over by a clean start of the same client id on a
    second connection (``taken_over``: the node closes the first, its will due); or dropped with a
    will delay of 30 s, then a clean start ends the session, so the will is due at once and the
    session shard hands it to that open (``replaced``: ``OpenResult.replaced_will``). The first
    attempt to publish the will fails: the topic shard refuses the proposal, or (``outcome_lost``)
    the ``SessionHousekeeping`` that handed the will out commits but its proposer never learns its
    result. Returns whether the will is in its topic's shard within 3 s, how many wills the session
    shard then still owes (-1: not published), and the failures made."""
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.shard.housekeeping_interval_s = HOUSEKEEPING_S
    failed: list[str] = []
    async with served_node(cfg) as (node, port):
        writers: list[asyncio.StreamWriter] = []
        try:
            fail_publish = how != "outcome_lost"
            real_publish, real_propose = node.publish, node.propose

            async def publish(msg: StoredMessage, *args: Any, **kw: Any) -> Any:
                if fail_publish and msg.topic == "w/c1" and not failed:
                    failed.append("publish_refused")
                    raise ShardUnavailable("shard 0: 8 proposals of this node wait for a leader to commit them "
                                           "(raft.max_pending_proposals): refused, it entered no log")
                return await real_publish(msg, *args, **kw)

            def propose(shard: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any] | None:
                fut = real_propose(shard, cmd, want)
                if fail_publish or failed or not isinstance(cmd, c.SessionHousekeeping) or fut is None:
                    return fut
                lost: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

                def settle(f: asyncio.Future[Any]) -> None:
                    if f.exception() is None and any(s.client_id == "c1" for s, _ in f.result()[0]):
                        failed.append("outcome_lost")  # committed, but its proposer is gone
                        lost.set_exception(ShardUnavailable("outcome unknown (leadership changed)"))
                    elif f.exception() is not None:
                        lost.set_exception(f.exception())  # type: ignore[arg-type]
                    else:
                        lost.set_result(f.result())

                fut.add_done_callback(settle)
                return lost

            node.publish = publish  # type: ignore[method-assign]
            node.propose = propose  # type: ignore[method-assign]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writers.append(writer)
            delay = Properties(will_delay_interval=30) if how == "replaced" else Properties()
            writer.write(encode(Connect(protocol_level=5, client_id="c1", clean_start=True,
                                        properties=Properties(session_expiry_interval=60),
                                        will=Will("w/c1", b"gone", 1, properties=delay)), 5))
            assert (await asyncio.wait_for(_connack(reader), 5))[1] == 0
            sessions = node.hosts[node.session_shard("c1")].state.sessions
            sess = sessions.sessions["c1"]
            guid = guid128("c1", sess.incarnation, sess.epoch, "will")
            if how != "taken_over":
                writer.transport.abort()  # no DISCONNECT: the will is due (after its delay: replaced)
            if how in ("taken_over", "replaced"):
                if how == "replaced":
                    while sessions.sessions["c1"].connected:
                        await asyncio.sleep(0.01)  # the close applied: the will's delay runs
                reader2, writer2 = await asyncio.open_connection("127.0.0.1", port)
                writers.append(writer2)
                writer2.write(encode(Connect(protocol_level=5, client_id="c1", clean_start=True), 5))
                assert (await asyncio.wait_for(_connack(reader2), 5))[1] == 0
            topics = node.hosts[node.topic_shard("w/c1")].state.topics
            deadline = asyncio.get_running_loop().time() + 3
            while topics.dedup.get("", guid) is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(HOUSEKEEPING_S)
            published = topics.dedup.get("", guid) is not None
            while published and sessions.wills_owed and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(HOUSEKEEPING_S)  # its WillPublished on the way
            return published, len(sessions.wills_owed) if published else -1, failed
        finally:
            for w in writers:
                w.close()


@pytest.mark.parametrize("how", ["publish_refused", "outcome_lost", "taken_over", "replaced"])
def test_a_will_whose_first_publish_failed_is_published_later(tmp_path: Path, how: str) -> None:
    published, owed, failed = asyncio.run(_scenario(tmp_path, how))
    assert failed == (["outcome_lost"] if how == "outcome_lost" else ["publish_refused"])  # the fault happened
    assert published, "the will must reach its topic's shard"
    assert owed == 0, "published: no longer owed"


def test_owed_wills_survive_a_snapshot_and_go_once_published() -> None:
    s = ShardState(0, "inc0", TopicLimits(), 3600)
    open_res = s.apply(c.SessionOpen(1_000, "c1", True, 60, c.WillSpec("w/c1", b"gone", 1, False)), Effects())
    s.apply(c.SessionClose(2_000, "c1", open_res.epoch, True), Effects())
    wills, _ended = s.apply(c.SessionHousekeeping(3_000), Effects())
    assert [sess.client_id for sess, _ in wills] == ["c1"]
    key = ("c1", open_res.incarnation, open_res.epoch)
    restored = ShardState.restore(s.snapshot(), TopicLimits(), 3600)
    assert list(restored.sessions.wills_owed) == [key]
    assert restored.sessions.wills_owed[key].will.topic == "w/c1"
    assert s.apply(c.SessionHousekeeping(4_000), Effects())[0] == []  # handed out once
    assert restored.apply(c.WillPublished("c1", open_res.incarnation, open_res.epoch), Effects()) is True
    assert not restored.sessions.wills_owed
    assert restored.apply(c.WillPublished("c1", open_res.incarnation, open_res.epoch), Effects()) is False
