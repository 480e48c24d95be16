"""The network seam: open, accept and close byte streams. Nothing else in the cluster package
touches a socket, so the simulator can substitute an in-memory network with the same semantics
(in order, or broken).

``AsyncioNetwork`` is the production implementation over asyncio streams.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import Any, Protocol

Address = tuple[str, int]


class ByteStream(Protocol):
    """One connected, bidirectional byte stream."""

    @property
    def local_address(self) -> Address: ...

    @property
    def remote_address(self) -> Address: ...

    async def read(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes, at least one; ``b""`` at end of stream. Raises OSError when broken."""
        ...

    def write(self, data: bytes | memoryview) -> None:
        """Queue ``data`` for sending (the stream copies what it cannot send at once); never blocks
        (pair with ``drain``)."""
        ...

    async def drain(self) -> None:
        """Wait until the queued bytes are below the stream's buffer bound. Raises OSError when broken."""
        ...

    def write_blocked(self) -> bool:
        """Whether ``drain`` would wait now (the queued bytes are above the stream's bound)."""
        ...

    def close(self) -> None:
        """Close at once, discarding unsent bytes (a stalled peer must not keep the stream alive)."""
        ...


class Listener(Protocol):
    @property
    def address(self) -> Address: ...

    def close(self) -> None:
        """Stop accepting; streams already handed out stay open."""
        ...


class Network(Protocol):
    async def connect(self, host: str, port: int, local_host: str | None) -> ByteStream:
        """Open a stream to (host, port), its local side bound to ``local_host`` when given."""
        ...

    async def listen(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Listener:
        """Accept streams on (host, port), calling ``on_stream`` for each (it must not block)."""
        ...


# --- asyncio implementation ---------------------------------------------------------------------

# StreamReader buffer bound: above it asyncio stops reading the socket until we catch up.
_READER_LIMIT_BYTES = 1 << 20


class AsyncioStream:
    __slots__ = ("_reader", "_writer", "local_address", "remote_address")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        local = writer.get_extra_info("sockname")
        remote = writer.get_extra_info("peername")
        self.local_address: Address = (str(local[0]), int(local[1])) if local else ("", 0)
        self.remote_address: Address = (str(remote[0]), int(remote[1])) if remote else ("", 0)

    async def read(self, max_bytes: int) -> bytes:
        return await self._reader.read(max_bytes)

    async def start_tls(self, context: ssl.SSLContext) -> None:
        """Upgrade to TLS in place (the side follows who opened the connection); raises ssl.SSLError
        or OSError when the handshake fails. Nothing may have been read or written before."""
        await self._writer.start_tls(context)

    def peer_certificate(self) -> dict[str, Any] | None:
        """The peer's verified certificate once TLS is up (None before, or without one)."""
        ssl_object = self._writer.get_extra_info("ssl_object")
        return ssl_object.getpeercert() if ssl_object is not None else None

    def write(self, data: bytes | memoryview) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def write_blocked(self) -> bool:
        transport = self._writer.transport
        return bool(transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1])

    def close(self) -> None:
        # abort(), not close(): close() waits to flush the buffer, forever if the peer stopped reading.
        self._writer.transport.abort()


class AsyncioListener:
    def __init__(self, server: asyncio.Server) -> None:
        self._server = server
        sock = server.sockets[0].getsockname()
        self.address: Address = (str(sock[0]), int(sock[1]))

    def close(self) -> None:
        self._server.close()


class AsyncioNetwork:
    async def connect(self, host: str, port: int, local_host: str | None) -> ByteStream:
        reader, writer = await asyncio.open_connection(
            host,
            port,
            limit=_READER_LIMIT_BYTES,
            local_addr=(local_host, 0) if local_host else None,
        )
        _set_nodelay(writer)
        return AsyncioStream(reader, writer)

    async def listen(self, host: str, port: int, on_stream: Callable[[ByteStream], None]) -> Listener:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            _set_nodelay(writer)
            on_stream(AsyncioStream(reader, writer))

        server = await asyncio.start_server(accepted, host, port, limit=_READER_LIMIT_BYTES, reuse_address=True)
        return AsyncioListener(server)


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    # Heartbeats and votes are tiny: Nagle would hold them back waiting for an ACK.
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):  # uvloop's socket stand-in may lack it (and sets it itself)
            pass
