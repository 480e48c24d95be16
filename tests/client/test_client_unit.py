"""moorline.client against a small in-process broker (moorline's codec on an asyncio server) that
applies producer sequences the way moorline's shard does (the next one or a new producer: applied;
an old one: a duplicate; a gap: refused 0x97), and refuses on demand. Fast; no processes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from moorline.client import BufferFull, BufferLimits, Client, PublishRefused, SpoolError
from moorline.client.spool import Spool, SpooledMessage
from moorline.mqtt import packets as P
from moorline.mqtt.codec import Decoder, encode


class FakeBroker:
    """Accepts one client at a time; ``applied`` is what a moorline shard would have stored."""

    def __init__(self, refuse: set[bytes] = frozenset(), redirect: str | None = None) -> None:  # type: ignore[assignment]
        self.refuse = refuse
        self.redirect = redirect
        self.connects = 0
        self.applied: list[bytes] = []
        self.producers: dict[str, int] = {}
        self.gaps = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        dec = Decoder(role="server")
        while data := await r.read(65536):
            for pk in dec.feed(data):
                if isinstance(pk, P.Connect):
                    self.connects += 1
                    if self.redirect is not None:  # 0x9D Server moved, with a Server Reference
                        w.write(encode(P.Connack(False, 0x9D, P.Properties(server_reference=self.redirect)), 5))
                        await w.drain()
                        w.close()
                        return
                    w.write(encode(P.Connack(False, 0, P.Properties(receive_maximum=50)), 5))
                elif isinstance(pk, P.Publish):
                    assert pk.packet_id is not None
                    w.write(encode(self._apply(pk), 5))
                elif isinstance(pk, P.Disconnect):
                    w.close()
                    return
            await w.drain()

    def _apply(self, pk: P.Publish) -> P.Puback:
        assert pk.packet_id is not None
        if pk.payload in self.refuse:
            return P.Puback(pk.packet_id, 0x87, P.Properties(reason_string="not authorized"))
        up = dict(pk.properties.user_properties)
        producer, seq = up["producer"], int(up["seq"])
        prev = self.producers.get(producer)
        if prev is not None and seq <= prev:
            return P.Puback(pk.packet_id)  # duplicate
        if prev is not None and seq != prev + 1:
            self.gaps += 1
            return P.Puback(pk.packet_id, 0x97, P.Properties(reason_string=f"sequence gap after {prev}"))
        self.producers[producer] = seq
        self.applied.append(pk.payload)
        return P.Puback(pk.packet_id)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_a_refused_message_does_not_block_the_ones_after_it() -> None:
    """Everything is in flight at once; the third is refused: the broker refuses the next ones as a
    gap, the client re-sequences them under a new producer and they are applied once, in order."""

    async def run() -> FakeBroker:
        b = FakeBroker({b"m2"})
        await b.start()
        try:
            async with Client([f"127.0.0.1:{b.port}"], publish_timeout=10) as c:
                await c.connected.wait()
                futs = [await c.enqueue("t/1", f"m{i}".encode()) for i in range(10)]
                await asyncio.wait(futs, timeout=10)
                assert all(f.done() for f in futs)
                exc = futs[2].exception()
                assert isinstance(exc, PublishRefused) and exc.reason_code == 0x87
                assert [i for i, f in enumerate(futs) if f.exception() is not None] == [2]
        finally:
            b.close()
        return b

    b = asyncio.run(run())
    assert b.applied == [f"m{i}".encode() for i in range(10) if i != 2]
    assert b.gaps > 0  # the path under test was taken: old copies in flight came back as gaps


def test_server_reference_is_followed() -> None:
    """The only server in the list answers CONNACK 0x9D naming another: the client goes there."""

    async def run() -> tuple[FakeBroker, FakeBroker]:
        target = FakeBroker()
        await target.start()
        mover = FakeBroker(redirect=f"127.0.0.1:{target.port}")
        await mover.start()
        try:
            async with Client([f"127.0.0.1:{mover.port}"], publish_timeout=5) as c:
                await c.publish("t/r", b"moved")
                assert c.server == f"127.0.0.1:{target.port}"
        finally:
            mover.close()
            target.close()
        return mover, target

    mover, target = asyncio.run(run())
    assert mover.connects >= 1 and target.applied == [b"moved"]


def test_buffer_full_raises_or_blocks_with_a_bound() -> None:
    async def run() -> None:
        # Nothing listens on this port: nothing is ever acknowledged.
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        limits = BufferLimits(max_messages=5, when_full="raise")
        async with Client([f"127.0.0.1:{port}"], buffer=limits, close_timeout=0.1, backoff_max=0.2) as c:
            for i in range(5):
                await c.enqueue("t", str(i))
            with pytest.raises(BufferFull):
                await c.enqueue("t", "6")
        limits = BufferLimits(max_bytes=1000, when_full="block")
        async with Client([f"127.0.0.1:{port}"], buffer=limits, publish_timeout=0.3, close_timeout=0.1) as c:
            await c.enqueue("t", b"x" * 900)
            with pytest.raises(BufferFull):
                await c.enqueue("t", b"x" * 200)

    asyncio.run(run())


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="port"):
        Client(["h:99999"])
    with pytest.raises(ValueError):
        BufferLimits(when_full="drop")  # type: ignore[arg-type]

    async def run() -> None:
        async with Client(["127.0.0.1:1"], close_timeout=0.1) as c:
            with pytest.raises(ValueError, match="bad topic"):
                await c.enqueue("a/+", b"")
            with pytest.raises(ValueError, match="topic filter"):
                c.subscribe("a/#/b")

    asyncio.run(run())


def test_spool_recovers_cuts_a_torn_tail_and_is_locked(tmp_path: Path) -> None:
    path = tmp_path / "s.spool"
    s = Spool(path)
    assert s.open() == []
    for n in range(1, 4):
        s.append(SpooledMessage(n, "t", f"p{n}".encode(), 1, False, bytes(8 - 1) + b"\x01", n))
    s.acked(2)
    with pytest.raises(SpoolError, match="in use"):
        Spool(path).open()
    s.close()
    with open(path, "ab") as f:
        f.write(b"\x00\x00\x00\x30torn")  # a record cut short by a crash
    size = os.path.getsize(path)
    s2 = Spool(path)
    got = s2.open()
    assert [(m.n, m.payload, m.seq) for m in got] == [(1, b"p1", 1), (3, b"p3", 3)]
    assert os.path.getsize(path) == size - 8
    s2.close()
    (tmp_path / "junk").write_bytes(b"not a spool")
    with pytest.raises(SpoolError, match="not a moorline client spool"):
        Spool(tmp_path / "junk").open()
