"""A retained message sent for a new SUBSCRIBE does not overtake live messages of its topic that
its shard applied before the Register and still owes the session through another filter.

Found by ``moorline sim --cluster`` seed 70463 (default mix): csub1, subscribed to ``r/#`` at
QoS 0, subscribed ``r/+`` at QoS 1 while retpub published ``r/0`` #4 and #5 (both retained). The
shard applied #4, #5 and then the Register in one batch of effects; the node handed the Register's
retained copy (#5) to the session's pump first and the live #4, #5 after it, and the pump served
retained messages before everything pending: the client got #5, #4, #5 (checker: out_of_order,
"first delivery of publisher retpub #4 after #5"). The pump now serves a retained message after
the live offsets its shard applied before the Register, and before the rest.

Here the pump is held in its read-ahead while two retained messages of one topic are owed through
``r/#`` and ``r/+`` is subscribed; on 1755ed0 the client got m1 (retained), m0, m1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.mqtt.codec import Decoder, encode
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

pytestmark = pytest.mark.timeout(60)

CLIENT = "rb1"
TOPIC = "r/0"


class _Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = Decoder(role="client", version=5)
        self.packets: list[object] = []

    async def next(self, timeout: float = 5.0) -> object | None:
        """The next packet from the node; None when none comes within ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.packets:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            try:
                data = await asyncio.wait_for(self.reader.read(65536), left)
            except TimeoutError:
                return None
            if not data:
                return None
            self.packets.extend(self.decoder.feed(data))
        return self.packets.pop(0)


async def _scenario(tmp_path: Path) -> list[tuple[bytes, bool]]:
    """(payload, retain flag) of each PUBLISH the client got after the second SUBSCRIBE."""
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.sys.interval_s = 0
    async with served_node(cfg) as (node, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            client = _Client(reader, writer)
            writer.write(encode(Connect(protocol_level=5, client_id=CLIENT, clean_start=True,
                                        properties=Properties(session_expiry_interval=3600)), 5))
            connack = await client.next()
            assert isinstance(connack, Connack) and connack.reason_code == 0, connack
            writer.write(encode(Subscribe(1, (("r/#", SubscriptionOptions(0)),)), 5))
            suback = await client.next()
            assert isinstance(suback, Suback) and suback.reason_codes == (0,), suback
            live = node.live[CLIENT]
            real_read_ahead = live._read_ahead
            pump_gate, in_read_ahead = asyncio.Event(), asyncio.Event()

            async def read_ahead() -> dict[int, StoredMessage]:  # the pump's await before a batch, held
                in_read_ahead.set()
                await pump_gate.wait()
                return await real_read_ahead()

            live._read_ahead = read_ahead  # type: ignore[method-assign]
            for i in range(2):
                await node.publish(StoredMessage(TOPIC, f"m{i}".encode(), 1, True,
                                                 f"rbl-{i}".encode().ljust(16, b"."), node.now_ms()))
            await asyncio.wait_for(in_read_ahead.wait(), 5)
            # m0 and m1 are owed through r/# and wait in the pump; r/+ registers behind them with
            # m1 as its retained message.
            writer.write(encode(Subscribe(2, (("r/+", SubscriptionOptions(1)),)), 5))
            shard = node.topic_shard(TOPIC)
            deadline = asyncio.get_running_loop().time() + 5
            while shard not in live.retained_first and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert shard in live.retained_first, "the Register's retained message never reached the session"
            pump_gate.set()
            got: list[tuple[bytes, bool]] = []
            while (pk := await client.next(timeout=0.5)) is not None:
                if isinstance(pk, Publish):
                    got.append((pk.payload, pk.retain))
                else:
                    assert isinstance(pk, Suback), pk
            return got
        finally:
            writer.close()


def test_a_retained_copy_does_not_overtake_older_live_messages_of_its_topic(tmp_path: Path) -> None:
    got = asyncio.run(_scenario(tmp_path))
    # Live m0, m1 (applied before the Register), then the r/+ subscription's retained m1. On
    # 1755ed0: [(m1, retained), (m0, live), (m1, live)], m1 before m0.
    assert [p for p, _ in got] == [b"m0", b"m1", b"m1"], got
    assert got[2][1] is True, got
