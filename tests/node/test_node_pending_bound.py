"""Issue 29 item 5: a connected client that does not read cannot make its node hold one notice per
owed message without bound. Past session.max_pending_notices per shard the notices are dropped and
read again from the shard's state once the client takes what it has: every message still arrives,
in order. On 5e679c4 LiveSession.pending grew by one entry per message (no such key either)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node
from moorline.node.sessions.delivery import LiveSession, OutboundPublish

BOUND = 5
MESSAGES = 60



async def _subscribed(tmp_path: Path, client_id: str, receive_max: int) -> tuple[Node, LiveSession, list[OutboundPublish]]:
    """A node with session.max_pending_notices = BOUND and a live session of ``client_id``
    subscribed to q/t at QoS 1 whose deliveries go to the returned list."""
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 4
    cfg.session.max_pending_notices = BOUND
    node = Node(cfg)
    node.open()
    await node.start()
    _present, epoch, inc = await node.open_session(client_id, False, 600, None, "")
    got: list[OutboundPublish] = []
    live = LiveSession(node, client_id, epoch, inc, receive_max, got.extend, lambda pid: None)
    node.live[client_id] = live
    await node.subscribe(live, "q/t", 1, False, False, 0, None)
    live.start()
    return node, live, got


def test_a_client_that_does_not_read_holds_a_bounded_number_of_notices(tmp_path: Path) -> None:
    async def body() -> None:
        node, live, got = await _subscribed(tmp_path, "slow", 4)
        try:
            shard = node.topic_shard("q/t")
            peak = 0
            for i in range(MESSAGES):
                await node.publish(StoredMessage("q/t", str(i).encode(), 1, False, i.to_bytes(16, "big"), node.now_ms()))
                peak = max(peak, len(live.pending.get(shard, ())))
            await asyncio.sleep(0.05)
            assert len(got) == 4  # receive maximum 4: the client has taken nothing since
            assert peak <= BOUND + 1, f"{peak} notices held for a client that reads nothing"
            # The client now takes everything, acknowledging as it goes: nothing is missing.
            for _ in range(200):
                pids = [p.packet_id for p in got if p.packet_id is not None]
                live.on_pubacks([pid for pid in pids if pid not in acked])
                acked.update(pids)
                if len(got) >= MESSAGES:
                    break
                await asyncio.sleep(0.02)
            payloads = [int(p.msg.payload) for p in got]
            assert payloads == list(range(MESSAGES)), payloads
            assert not live.overflowed and not live.pending.get(shard)  # all taken, nothing left over
        finally:
            await live.close()
            await node.stop()

    acked: set[int] = set()
    asyncio.run(body())


def test_past_the_bound_a_reading_client_still_gets_everything_without_being_woken(tmp_path: Path) -> None:
    """The client reads (QoS 0 needs no acknowledgement) but the notices outran the pump: the part
    of the shard reloaded from its state is taken, and so is the rest, with no new notice or ack
    to wake the pump (it would otherwise sleep with 95 messages owed)."""
    async def body() -> None:
        node, live, got = await _subscribed(tmp_path, "reader", 16)
        try:
            await node.publish(StoredMessage("q/t", b"first", 1, False, (999).to_bytes(16, "big"), node.now_ms()))
            for i in range(100):
                await node.publish(StoredMessage("q/t", str(i).encode(), 0, False, i.to_bytes(16, "big"),
                                                 node.now_ms()), wait=False)
            for _ in range(100):
                if len(got) >= 101:
                    break
                await asyncio.sleep(0.02)
            assert [p.msg.payload for p in got[1:]] == [str(i).encode() for i in range(100)], len(got)
        finally:
            await live.close()
            await node.stop()

    asyncio.run(body())
