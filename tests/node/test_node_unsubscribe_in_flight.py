"""A message the session has not been sent yet when its subscription goes is not sent after the
unsubscribe applied: ``Subscriptions.unsubscribe`` reports everything owed past the session's
cursor as acknowledged (no longer wanted), so a delivery of one of those would stay in flight
with its message no longer owed by anyone, released by retention and never resent (found by
``moorline sim --cluster`` seed 30574: an UNSUBSCRIBE of ``race/#`` raced the session's pump,
which sent ``race/5/1`` after the unwanted offsets were decided; the client did not acknowledge
it, and every later connection logged "message 5/77 of an unacknowledged delivery is gone").

Here the pump is held in its read-ahead (an await: store reads off the loop) while the
unsubscribe applies and decides what is no longer wanted; that report is held until the pump has
gone on. On f451631 the pump then sent all three messages, in flight and owed by nobody."""

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
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
)
from tests.node.served_node import served_node

pytestmark = pytest.mark.timeout(60)

CLIENT = "u1"
FILTER = "u/#"
REG_KEY = f"{CLIENT}\x00{FILTER}"


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


async def _until(cond: Any, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return bool(cond())


async def _scenario(tmp_path: Path) -> tuple[list[bytes], list[tuple[int, bool]]]:
    """(payloads sent to the client, (offset, still owed) of each delivery in flight at the end)."""
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.sys.interval_s = 0
    async with served_node(cfg) as (node, port):
        loop = asyncio.get_running_loop()
        report_gate, pump_gate = asyncio.Event(), asyncio.Event()
        held: list[asyncio.Task[None]] = []
        real_cross = node.propose_cross

        def propose_cross(shard: int, cmd: c.Command) -> asyncio.Future[Any]:
            if not (isinstance(cmd, c.AckReport) and cmd.reg_key == REG_KEY) or report_gate.is_set():
                return real_cross(shard, cmd)
            out: asyncio.Future[Any] = loop.create_future()

            async def later() -> None:  # the unsubscribe's "no longer wanted" report, held back
                await report_gate.wait()
                try:
                    out.set_result(await real_cross(shard, cmd))
                except Exception as exc:  # noqa: BLE001 - handed to the unsubscribe as it came
                    out.set_exception(exc)

            held.append(loop.create_task(later()))
            return out

        node.propose_cross = propose_cross  # type: ignore[method-assign]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            client = _Client(reader, writer)
            writer.write(encode(Connect(protocol_level=5, client_id=CLIENT, clean_start=True,
                                        properties=Properties(session_expiry_interval=3600)), 5))
            connack = await client.next()
            assert isinstance(connack, Connack) and connack.reason_code == 0, connack
            writer.write(encode(Subscribe(1, ((FILTER, SubscriptionOptions(1)),)), 5))
            suback = await client.next()
            assert isinstance(suback, Suback) and suback.reason_codes == (1,), suback
            live = node.live[CLIENT]
            real_read_ahead = live._read_ahead
            in_read_ahead = asyncio.Event()

            async def read_ahead() -> Any:  # the pump's await before it takes a batch, held
                in_read_ahead.set()
                await pump_gate.wait()
                return await real_read_ahead()

            live._read_ahead = read_ahead  # type: ignore[method-assign]
            topic = "u/a"
            for i in range(3):
                await node.publish(StoredMessage(topic, f"m{i}".encode(), 1, False,
                                                 f"unsub-{i}".encode().ljust(16, b"."), node.now_ms()))
            await asyncio.wait_for(in_read_ahead.wait(), 5)
            # The subscription goes while the pump waits; what it owes past the cursor (all three)
            # is decided no longer wanted, and that report held.
            writer.write(encode(Unsubscribe(2, (FILTER,)), 5))
            sshard = node.session_shard(CLIENT)
            assert await _until(lambda: bool(held)), "the unsubscribe reported nothing as no longer wanted"
            assert FILTER not in node.hosts[sshard].state.sessions.sessions[CLIENT].subs
            pump_gate.set()  # the pump goes on, with the draining registration's offsets pending
            sent: list[bytes] = []
            while (pk := await client.next(timeout=0.5)) is not None:
                assert isinstance(pk, Publish), pk
                sent.append(pk.payload)  # not acknowledged: it should be resendable later
            report_gate.set()
            await asyncio.gather(*held)
            unsuback = await client.next()
            assert isinstance(unsuback, Unsuback), unsuback
            topics = node.hosts[node.topic_shard(topic)].state.topics
            sess = node.hosts[sshard].state.sessions.sessions[CLIENT]
            inflight = []
            for d in sess.inflight.values():
                reg = topics.regs.get(REG_KEY)
                inflight.append((d.item.offset, reg is not None and d.item.offset in reg.owed))
            return sent, inflight
        finally:
            node.propose_cross = real_cross  # type: ignore[method-assign]
            writer.close()


def test_unsent_messages_of_an_unsubscribed_filter_are_not_sent_after_the_unsubscribe(tmp_path: Path) -> None:
    sent, inflight = asyncio.run(_scenario(tmp_path))
    # Every unacknowledged delivery keeps its message owed (resendable); on f451631 all three were
    # sent after the unsubscribe had reported them no longer wanted: in flight, owed by nobody.
    assert all(owed for _, owed in inflight), f"in flight but no longer owed (never resendable): {inflight}"
    assert sent == [], sent
