"""A `$share` offset claimed for a member twice within one burst of applies (claimed, handed back,
claimed for it again before its pump ran) is sent once, not twice in one delivery batch (found by
the cluster simulator, seed 30007 as it ran at c55fa6b: a node re-added to a shard applied about
12 s of its log at once, with two claims of one offset for one member, and the member got the
message twice with DUP=0 and two packet ids). The test pauses the member's pump, lets two claims
apply, queues the first offset's notice again (its second claim), then lets the pump run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorline.config import NodeConfig
from moorline.mqtt.codec import encode
from moorline.mqtt.packets import (
    Connack,
    Connect,
    Properties,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from tests.node.served_node import served_node
from tests.node.test_node_share_reload_after_ack import GROUP_KEY, _Client, _message

pytestmark = pytest.mark.timeout(60)


async def _scenario(tmp_path: Path) -> list[Publish]:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.sys.interval_s = 0
    async with served_node(cfg) as (node, port):
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            client = _Client(reader, writer)
            writer.write(encode(Connect(protocol_level=5, client_id="m1", clean_start=True,
                                        properties=Properties(session_expiry_interval=0)), 5))
            connack = await client.next()
            assert isinstance(connack, Connack) and connack.reason_code == 0, connack
            writer.write(encode(Subscribe(1, (("$share/g/q/#", SubscriptionOptions(1)),)), 5))
            suback = await client.next()
            assert isinstance(suback, Suback) and suback.reason_codes == (1,), suback
            shard = node.topic_shard("q/1")
            live = node.live["m1"]
            live.writable = False  # the pump holds (as while the socket's buffer is full)
            await node.publish(_message("q/1", 1))
            await node.publish(_message("q/1", 2))
            reg = node.hosts[shard].state.topics.regs.get(GROUP_KEY)
            assert reg is not None
            for _ in range(200):  # the group's dispatcher claims both for m1 (proposals of its own)
                claimed = sorted(o for o, (m, _inc) in reg.claims.items() if m == "m1")
                if len(claimed) == 2 and len(live.pending.get(shard, ())) >= 2:
                    break
                await asyncio.sleep(0.01)
            first, _second = claimed
            # The first offset's second claim, applied after the second offset's: its notice comes
            # after (a notice right behind one of the same offset is taken as the same message).
            live.notify(shard, GROUP_KEY, first)
            live.writable = True
            live.wake()
            got: list[Publish] = []
            while (pk := await client.next(timeout=1.0)) is not None:
                if isinstance(pk, Publish):
                    got.append(pk)
            return got
        finally:
            if writer is not None:
                writer.close()


def test_a_share_offset_claimed_twice_in_one_burst_is_sent_once(tmp_path: Path) -> None:
    got = asyncio.run(_scenario(tmp_path))
    assert [p.payload for p in got] == [b"m1", b"m2"], [(p.payload, p.packet_id, p.dup) for p in got]
