"""A clean DISCONNECT discards the will only once the session shard commits the close (found by
the cluster simulator, drawn-configuration seed 116: a leader cut from its followers took a
client's DISCONNECT and closed the connection at once, the close never committed, the majority
ended the session when the owner's lease lapsed and published the will the client had been let
believe was discarded). The node closes the connection only after the close is committed; when
it is not, an MQTT 5 client is told (DISCONNECT 0x80) and a 3.1.1 connection is left to the client
until mqtt.publish_timeout_s."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorline.broker import commands as c
from moorline.config import NodeConfig
from moorline.mqtt.codec import encode
from moorline.mqtt.packets import Connect, Disconnect, Properties, Will
from tests.node.served_node import served_node

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.6  # mqtt.publish_timeout_s of these nodes


async def _read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """(first byte, body) of the next packet, or None at EOF."""
    head = await reader.read(1)
    if not head:
        return None
    length, shift = 0, 0
    while True:
        b = (await reader.readexactly(1))[0]
        length |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    return head[0], await reader.readexactly(length)


async def _scenario(tmp_path: Path, version: int, stall_close: bool) -> tuple[list[tuple[int, bytes]], float, Any]:
    """Connects ``c1`` with a will, sends DISCONNECT 0x00, and returns what the node sent after it
    (until EOF), how long the EOF took, and the session as the session shard held it at EOF.
    ``stall_close``: the session's close never commits (its proposal is lost, as on a leader that
    lost its followers)."""
    cfg = NodeConfig()
    cfg.data_dir = str(tmp_path / "data")
    cfg.shard.count = 2
    cfg.mqtt.publish_timeout_s = TIMEOUT_S
    async with served_node(cfg) as (node, port):
        writer: asyncio.StreamWriter | None = None
        try:
            if stall_close:
                real_propose = node.propose

                def propose(shard: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any] | None:
                    if isinstance(cmd, c.SessionClose):
                        return asyncio.get_running_loop().create_future()  # never committed
                    return real_propose(shard, cmd, want)

                node.propose = propose  # type: ignore[method-assign]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            props = Properties(session_expiry_interval=600) if version == 5 else Properties()
            writer.write(encode(Connect(protocol_level=version, client_id="c1", clean_start=True, properties=props,
                                        will=Will("w/c1", b"gone", 1)), version))
            connack = await asyncio.wait_for(_read_packet(reader), 5)
            assert connack is not None and connack[0] == 0x20 and connack[1][1] == 0, connack
            writer.write(encode(Disconnect(0), version))
            t0 = asyncio.get_running_loop().time()
            after: list[tuple[int, bytes]] = []
            while (pk := await asyncio.wait_for(_read_packet(reader), 5)) is not None:
                after.append(pk)
            took = asyncio.get_running_loop().time() - t0
            sess = node.hosts[node.session_shard("c1")].state.sessions.sessions.get("c1")
            return after, took, sess
        finally:
            if writer is not None:
                writer.close()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_connection_closed_only_once_the_will_discard_is_committed(tmp_path: Path, version: int) -> None:
    after, took, sess = asyncio.run(_scenario(tmp_path, version, stall_close=False))
    assert after == [], "nothing but the close after a clean DISCONNECT"
    assert took < TIMEOUT_S
    # Closed after the commit: the session shard already holds the session closed, its will gone
    # (a 3.1.1 clean session has ended altogether).
    if version == 5:
        assert sess is not None and not sess.connected and sess.will is None
    else:
        assert sess is None


def test_uncommitted_will_discard_is_told_to_a_v5_client(tmp_path: Path) -> None:
    after, took, sess = asyncio.run(_scenario(tmp_path, 5, stall_close=True))
    assert [first for first, _ in after] == [0xE0], "DISCONNECT from the node: the will may still be published"
    assert after[0][1][0] == 0x80
    assert took >= TIMEOUT_S * 0.9
    assert sess is not None and sess.will is not None  # indeed not discarded


def test_uncommitted_will_discard_leaves_a_v311_connection_open_until_the_timeout(tmp_path: Path) -> None:
    after, took, _sess = asyncio.run(_scenario(tmp_path, 4, stall_close=True))
    assert after == []  # 3.1.1 has no way to say it; the client closes (or this timeout does)
    assert took >= TIMEOUT_S * 0.9
