"""WebSocketTransport: the transport the MQTT Connection sees over a WebSocket keeps the TCP
listener's back-pressure (pause_writing past the high-water mark, resume_writing below the low one),
reports what it holds as its write buffer (what mqtt.max_write_buffer_bytes bounds), joins queued
writes into frames, and drops everything on abort."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from moorline.node.edge.ws_transport import FRAME_BYTES, WebSocketTransport

pytestmark = pytest.mark.timeout(30)


class FakeRaw:
    def __init__(self) -> None:
        self.aborted = False
        self.buffered = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 4242)}.get(name, default)

    def is_closing(self) -> bool:
        return self.aborted

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def abort(self) -> None:
        self.aborted = True


class SlowWebSocket:
    """send_bytes blocks until the test lets a frame go, like a socket that does not drain."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.gate = asyncio.Semaphore(0)
        self.closed_with: int | None = None

    async def send_bytes(self, data: bytes) -> None:
        await self.gate.acquire()
        self.frames.append(bytes(data))

    async def close(self, code: int = 1000) -> bool:
        self.closed_with = code
        return True


class Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_back_pressure_follows_the_buffer() -> None:
    async def body() -> None:
        ws, raw, proto = SlowWebSocket(), FakeRaw(), Recorder()
        t = WebSocketTransport(ws, raw)  # type: ignore[arg-type]
        t.start(proto)
        assert proto.transport is t and t.get_extra_info("peername") == ("127.0.0.1", 4242)
        t.set_write_buffer_limits(high=1000)
        assert t.get_write_buffer_limits() == (250, 1000)
        t.write(b"a" * 600)
        await _settle()  # the pump hands the frame over; the socket does not take it (gate closed)
        assert t.get_write_buffer_size() == 0 and proto.events == []
        t.write(b"b" * 900)  # queued behind a socket that does not drain: counted
        assert proto.events == [] and t.get_write_buffer_size() == 900
        raw.buffered = 200  # the socket's own buffer counts too
        t.write(b"c")
        assert proto.events == ["pause"] and t.get_write_buffer_size() == 1101
        raw.buffered = 0
        ws.gate.release()  # the socket drains: the queued writes leave as one frame
        await _settle()
        assert ws.frames == [b"a" * 600] and proto.events == ["pause", "resume"]
        ws.gate.release()
        await _settle()
        assert ws.frames == [b"a" * 600, b"b" * 900 + b"c"] and t.get_write_buffer_size() == 0
        # while the socket takes what it is given, the queue is in transit, not a backlog (as on TCP)
        t.write(b"d" * 5000)
        assert t.get_write_buffer_size() == 0
        ws.gate.release()
        await _settle()
        assert ws.frames[-1] == b"d" * 5000
        n = len(ws.frames)
        # writes larger than a frame are cut at about FRAME_BYTES, in order
        big = [bytes([i]) * (FRAME_BYTES // 2 + 1) for i in range(3)]
        t.writelines(big)
        ws.gate.release()
        ws.gate.release()
        await _settle()
        assert b"".join(ws.frames[n:]) == b"".join(big) and len(ws.frames) == n + 2
        # close sends what is queued, then the close frame
        t.write(b"last")
        t.close()
        t.write(b"after close: dropped")
        assert t.is_closing()
        ws.gate.release()
        await asyncio.wait_for(t.pump_done.wait(), 5)
        assert ws.frames[-1] == b"last" and ws.closed_with == 1000

    asyncio.run(body())


def test_abort_drops_the_queue_and_the_socket() -> None:
    async def body() -> None:
        ws, raw, proto = SlowWebSocket(), FakeRaw(), Recorder()
        t = WebSocketTransport(ws, raw)  # type: ignore[arg-type]
        t.start(proto)
        t.set_write_buffer_limits(high=10)
        t.write(b"x" * 5)
        await _settle()  # blocked in its first send
        t.write(b"x" * 100)
        assert proto.events == ["pause"]
        t.pause_reading()
        assert not t.is_reading()
        t.abort()
        assert raw.aborted and t.get_write_buffer_size() == 0 and t.is_reading()  # the reader's wait ends
        ws.gate.release()
        await asyncio.wait_for(t.pump_done.wait(), 5)
        assert ws.closed_with is None  # no close handshake after an abort
        assert t.get_write_buffer_size() == 0

    asyncio.run(body())
