"""A $share delivery the member acknowledged is not delivered again when the session's pending
notices are reloaded from the topic shard's state before the shard applied the ack report (found
by the cluster simulator, drawn-configuration seed 20116: a shard's leader cut from its followers
never committed the ack report of an expiry-0 member; once the cut healed, snapshot installs on
the member's node reloaded every live session's pending notices, and the claim, still naming the
member, was sent again on the same connection with a new packet id and DUP=0, twice).

The reload is what ``Housekeeping.snapshot_installed`` does after an install; the ack report is
lost as on that leader (the test swallows it), so the claim keeps naming the member. On
38673de the acknowledged message came again after the reload."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.mqtt.codec import Decoder, encode
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

pytestmark = pytest.mark.timeout(60)

GROUP_KEY = "$share\x00g\x00q/#"


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


def _message(topic: str, i: int) -> StoredMessage:
    return StoredMessage(topic, f"m{i}".encode(), 1, False, f"share-ack-{i}".encode().ljust(16, b"."), 0)


async def _scenario(tmp_path: Path) -> list[Publish]:
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.sys.interval_s = 0
    async with served_node(cfg) as (node, port):
        writer: asyncio.StreamWriter | None = None
        real_lazy = node.propose_lazy

        def propose_lazy(shard: int, cmd: c.Command, want: bool = False) -> asyncio.Future[Any] | None:
            if isinstance(cmd, c.AckReport):
                return None  # lost, as on a leader cut from its followers: the claim keeps naming the member
            return real_lazy(shard, cmd, want)

        node.propose_lazy = propose_lazy  # type: ignore[method-assign]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            client = _Client(reader, writer)
            # Session expiry 0: the member's delivery log lives only on its node.
            writer.write(encode(Connect(protocol_level=5, client_id="m1", clean_start=True,
                                        properties=Properties(session_expiry_interval=0)), 5))
            connack = await client.next()
            assert isinstance(connack, Connack) and connack.reason_code == 0, connack
            writer.write(encode(Subscribe(1, (("$share/g/q/#", SubscriptionOptions(1)),)), 5))
            suback = await client.next()
            assert isinstance(suback, Suback) and suback.reason_codes == (1,), suback
            shard = node.topic_shard("q/1")
            await node.publish(_message("q/1", 1))
            first = await client.next()
            assert isinstance(first, Publish) and first.payload == b"m1" and first.packet_id is not None, first
            writer.write(encode(Puback(first.packet_id), 5))
            live = node.live["m1"]
            for _ in range(200):  # the acknowledgement flushed (and its ack report dropped)
                if live.inflight_out == 0 and not live._acks:
                    break
                await asyncio.sleep(0.01)
            assert live.inflight_out == 0
            await asyncio.sleep(0.05)
            reg = node.hosts[shard].state.topics.regs.get(GROUP_KEY)
            assert reg is not None
            assert [m for m, _inc in reg.claims.values()] == ["m1"], "the claim still names the member (no ack report)"
            node.housekeeping.snapshot_installed(node.hosts[shard])  # what an install does: reload
            await node.publish(_message("q/1", 2))
            got: list[Publish] = [first]
            while (pk := await client.next(timeout=1.0)) is not None:
                if isinstance(pk, Publish):
                    got.append(pk)
                    if pk.packet_id is not None:
                        writer.write(encode(Puback(pk.packet_id), 5))
            # Once the ack reports apply, the claims end and the session forgets what it finished.
            node.propose_lazy = real_lazy  # type: ignore[method-assign]
            done = [o for o, (m, _inc) in reg.claims.items() if m == "m1"]
            fut = node.propose(shard, c.AckReport(GROUP_KEY, tuple(done)))
            assert fut is not None
            await asyncio.wait_for(fut, 10)
            assert not reg.claims
            node.housekeeping.snapshot_installed(node.hosts[shard])
            assert not getattr(live, "share_finished", {}), "finished claims no longer held are forgotten"
            return got
        finally:
            if writer is not None:
                writer.close()


def test_acknowledged_share_claim_is_not_sent_again_by_a_reload(tmp_path: Path) -> None:
    got = asyncio.run(_scenario(tmp_path))
    assert [p.payload for p in got] == [b"m1", b"m2"], [(p.payload, p.packet_id, p.dup) for p in got]
