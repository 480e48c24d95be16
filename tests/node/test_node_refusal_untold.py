"""A PUBLISH refused by its shard (raft.max_pending_proposals: it entered no log) whose 0x80 still
waits in the connection's acknowledgement queue behind an older PUBLISH refuses the later
PUBLISHes of that shard too, until it is written (found by the cluster simulator, default mix seed
71213: PUBLISH #27 of race/5/3 refused on n2 behind two older acknowledgements; #29 and #31 of the
same topic committed meanwhile; mqtt.publish_timeout_s closed the connection for the older ones
before the 0x80 was written, so the client resent #27, which committed after #29 and #31:
out_of_order for every subscriber)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.mqtt.codec import encode
from moorline.mqtt.packets import Connect, Properties, Publish
from tests.node.served_node import served_node

pytestmark = pytest.mark.timeout(60)

WAIT_S = 2.0  # far below mqtt.publish_timeout_s of this node


async def _read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readexactly(1)
    length, shift = 0, 0
    while True:
        b = (await reader.readexactly(1))[0]
        length |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    return head[0], await reader.readexactly(length)


async def _read_acks(reader: asyncio.StreamReader, n: int) -> list[tuple[int, int, int]]:
    """(type, packet id, reason) of the next ``n`` packets (fewer if none comes within WAIT_S)."""
    acks: list[tuple[int, int, int]] = []
    try:
        while len(acks) < n:
            first, body = await asyncio.wait_for(_read_packet(reader), WAIT_S)
            acks.append((first, int.from_bytes(body[:2], "big"), body[2] if len(body) > 2 else 0))
    except (TimeoutError, asyncio.IncompleteReadError):
        pass
    return acks


async def _scenario(tmp_path: Path) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], list[bytes]]:
    """PUBLISH 1 (topic A) waits for its commit; PUBLISH 2 (topic B, another shard) is refused;
    PUBLISHes 3 (general path) and 4 (a bare QoS 1 PUBLISH: a command group) of B come while the
    refusal of 2 is not written yet. Then 1 commits, and PUBLISH 5 of B comes. Returns the
    acknowledgements of 1-4, that of 5, and the payloads shard B stored."""
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.mqtt.publish_timeout_s = 30.0
    async with served_node(cfg) as (node, port):
        writer: asyncio.StreamWriter | None = None
        try:
            topic_a = "a/0"
            topic_b = next(f"b/{i}" for i in range(100) if node.topic_shard(f"b/{i}") != node.topic_shard(topic_a))
            shard_a, shard_b = node.topic_shard(topic_a), node.topic_shard(topic_b)
            host_b = node.hosts[shard_b]
            held: list[tuple[int, c.Command, Any]] = []
            propose_cb = node.propose_cb

            def holding_propose_cb(shard: int, cmd: c.Command, callback: Any) -> None:
                if shard == shard_a and not held:
                    held.append((shard, cmd, callback))  # proposed later: its acknowledgement waits
                    return
                propose_cb(shard, cmd, callback)

            node.propose_cb = holding_propose_cb  # type: ignore[method-assign]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(encode(Connect(protocol_level=5, client_id="c1", clean_start=True,
                                        properties=Properties(session_expiry_interval=600)), 5))
            connack = await asyncio.wait_for(_read_packet(reader), 5)
            assert connack[0] == 0x20 and connack[1][1] == 0, connack
            props = Properties(user_properties=(("k", "v"),))  # the general publish path
            writer.write(encode(Publish(topic_a, b"one", 1, packet_id=1, properties=props), 5))
            await writer.drain()
            await asyncio.sleep(0.2)
            assert held, "PUBLISH 1 was not proposed"
            cap = host_b.max_pending_proposals
            host_b.max_pending_proposals = 0  # refused: it entered no log
            writer.write(encode(Publish(topic_b, b"two", 1, packet_id=2, properties=props), 5))
            await writer.drain()
            await asyncio.sleep(0.2)
            host_b.max_pending_proposals = cap  # the shard takes proposals again
            writer.write(encode(Publish(topic_b, b"three", 1, packet_id=3, properties=props), 5))
            writer.write(encode(Publish(topic_b, b"four", 1, packet_id=4), 5))
            await writer.drain()
            await asyncio.sleep(0.3)
            node.propose_cb = propose_cb  # type: ignore[method-assign]
            propose_cb(*held[0])  # PUBLISH 1 commits: the acknowledgements behind it go out
            first = await _read_acks(reader, 4)
            writer.write(encode(Publish(topic_b, b"five", 1, packet_id=5, properties=props), 5))
            await writer.drain()
            then = await _read_acks(reader, 1)
            stored = []
            for offset in range(host_b.state.topics.next_offset):
                m = host_b.message(offset)
                if m is not None:
                    stored.append(m.payload)
            return first, then, stored
        finally:
            if writer is not None:
                writer.close()


def test_later_publishes_of_a_shard_are_refused_until_its_refusal_is_written(tmp_path: Path) -> None:
    first, then, stored = asyncio.run(_scenario(tmp_path))
    # 3 and 4 committing while the client did not know 2 was refused: had the connection ended
    # before the 0x80 of 2 was written, its resend would have committed behind them.
    assert first == [(0x40, 1, 0), (0x40, 2, 0x80), (0x40, 3, 0x80), (0x40, 4, 0x80)]
    assert stored == [b"five"]  # refused ones entered no log; once told, the shard takes PUBLISHes again
    assert then == [(0x40, 5, 0)]
