"""A `$share` delivery resent on reconnect and acknowledged is not sent again when this node's
lagging replica of the topic shard applies, afterwards, the very claim it was (found by the cluster
simulator, default-mix seed 60344: member sh2 left a claim of shard 3 unacknowledged on n2 and
resumed on n3, whose replica of shard 3, re-added to the group, had the message but not yet its
claim; the resend went out with DUP=1 and was acknowledged, then the catch-up applied the claim and
the session took it for a new one: the message came again on the same connection, DUP=0, a new
packet id).

One node has no lagging replica, so the test plays its part: the shard is marked not yet confirmed
(its read barrier pending, as while the replica catches up), the claim's apply is notified after the
acknowledgement, and then the barrier passes. Ack reports are swallowed so the claim keeps naming
the member, as on the lagging replica before the report applied there. On daa6ef3 the message was
sent a second time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.mqtt.codec import encode
from moorline.mqtt.packets import (
    Connack,
    Connect,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from tests.node.served_node import served_node
from tests.node.test_node_share_reload_after_ack import GROUP_KEY, _Client, _message

pytestmark = pytest.mark.timeout(60)


async def _connect(port: int, clean_start: bool) -> tuple[_Client, asyncio.StreamWriter, Connack]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = _Client(reader, writer)
    writer.write(encode(Connect(protocol_level=5, client_id="m1", clean_start=clean_start,
                                properties=Properties(session_expiry_interval=600)), 5))
    connack = await client.next()
    assert isinstance(connack, Connack) and connack.reason_code == 0, connack
    return client, writer, connack


async def _scenario(tmp_path: Path) -> list[Publish]:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.sys.interval_s = 0
    async with served_node(cfg) as (node, port):
        real_lazy = node.propose_lazy

        def propose_lazy(shard: int, cmd: c.Command, want: bool = False) -> asyncio.Future[Any] | None:
            if isinstance(cmd, c.AckReport):
                return None  # not applied yet: the claim keeps naming the member
            return real_lazy(shard, cmd, want)

        node.propose_lazy = propose_lazy  # type: ignore[method-assign]
        writers: list[asyncio.StreamWriter] = []
        try:
            client, writer, _ = await _connect(port, clean_start=True)
            writers.append(writer)
            writer.write(encode(Subscribe(1, (("$share/g/q/#", SubscriptionOptions(1)),)), 5))
            suback = await client.next()
            assert isinstance(suback, Suback) and suback.reason_codes == (1,), suback
            shard = node.topic_shard("q/1")
            await node.publish(_message("q/1", 1))
            first = await client.next()
            assert isinstance(first, Publish) and first.payload == b"m1" and not first.dup, first
            writer.close()  # left unacknowledged: resent on the next connection
            for _ in range(200):
                if "m1" not in node.live:
                    break
                await asyncio.sleep(0.01)
            assert "m1" not in node.live

            client, writer, connack = await _connect(port, clean_start=False)
            writers.append(writer)
            assert connack.session_present
            live = node.live["m1"]
            live.unconfirmed.add(shard)  # this replica's read barrier has not passed yet
            resent = await client.next()
            assert isinstance(resent, Publish) and resent.payload == b"m1" and resent.dup, resent
            assert resent.packet_id == first.packet_id
            writer.write(encode(Puback(resent.packet_id), 5))  # type: ignore[arg-type]
            for _ in range(200):  # the acknowledgement committed: the claim is finished
                if live.inflight_out == 0 and not live._acks and live.share_finished:
                    break
                await asyncio.sleep(0.01)
            assert live.share_finished, "the acknowledged claim is kept as finished"
            (claim,) = live.share_finished
            assert claim[0] == shard
            reg = node.hosts[shard].state.topics.regs.get(GROUP_KEY)
            assert reg is not None and reg.claims.get(claim[1], ("", 0))[0] == "m1"
            # The lagging replica applies the claim the resend was, then its read barrier passes.
            live.notify(shard, GROUP_KEY, claim[1])
            live._shard_confirmed(shard)
            live.wake()
            await node.publish(_message("q/1", 2))
            got: list[Publish] = [first, resent]
            while (pk := await client.next(timeout=1.0)) is not None:
                if isinstance(pk, Publish):
                    got.append(pk)
                    if pk.packet_id is not None:
                        writer.write(encode(Puback(pk.packet_id), 5))
            return got
        finally:
            node.propose_lazy = real_lazy  # type: ignore[method-assign]
            for w in writers:
                w.close()


def test_a_resent_share_claim_applied_late_here_is_not_sent_again(tmp_path: Path) -> None:
    got = asyncio.run(_scenario(tmp_path))
    assert [(p.payload, p.dup) for p in got] == [(b"m1", False), (b"m1", True), (b"m2", False)], \
        [(p.payload, p.packet_id, p.dup) for p in got]
