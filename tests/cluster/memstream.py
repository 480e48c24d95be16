"""A connected pair of in-memory byte streams (the ByteStream seam) for handshake unit tests."""

from __future__ import annotations

import asyncio


class MemStream:
    def __init__(self, local: tuple[str, int], remote: tuple[str, int]) -> None:
        self.local_address = local
        self.remote_address = remote
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.other: MemStream | None = None
        self.closed = False
        self.written: list[bytes] = []

    async def read(self, max_bytes: int) -> bytes:
        if self.closed:
            raise OSError("closed")
        data = await self.inbox.get()
        if len(data) > max_bytes:
            self.inbox._queue.appendleft(data[max_bytes:])  # type: ignore[attr-defined]
            data = data[:max_bytes]
        return data

    def write(self, data: bytes) -> None:
        self.written.append(data)
        if self.other is not None and not self.other.closed and not self.closed:
            self.other.inbox.put_nowait(bytes(data))

    async def drain(self) -> None:
        if self.closed:
            raise OSError("closed")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.other is not None:
                self.other.inbox.put_nowait(b"")  # end of stream for the other side


def pair() -> tuple[MemStream, MemStream]:
    a = MemStream(("127.0.0.11", 40000), ("127.0.0.12", 7000))
    b = MemStream(("127.0.0.12", 7000), ("127.0.0.11", 40000))
    a.other, b.other = b, a
    return a, b
