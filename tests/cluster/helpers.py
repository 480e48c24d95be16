"""Shared pieces of the transport tests: loopback aliases, a recording handler, meshes, fake peers."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from moorline.cluster import ClusterTransport, TransportLimits, handshake
from moorline.cluster.net import AsyncioStream
from moorline.cluster.wire import DataFrame, FrameDecoder, Heartbeats, Payload, RaftMessages

HOSTS = ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"]
SECRET = b"a shared cluster secret for tests"
CLUSTER_ID = "test-cluster"

# Short backoff and timeouts so every test ends in seconds; each test overrides what it measures.
FAST = TransportLimits(backoff_base_s=0.05, backoff_cap_s=0.3, connect_timeout_s=1.0, handshake_timeout_s=1.0,
                       close_timeout_s=1.0)


def _aliases_bind() -> bool:
    # On Linux the whole of 127/8 is routed to lo; elsewhere (macOS) aliases must be configured.
    try:
        for host in HOSTS:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
    except OSError:
        return False
    return True


requires_loopback_aliases = pytest.mark.skipif(
    not _aliases_bind(), reason="cannot bind 127.0.0.11-14 (loopback aliases not routed here)"
)


@dataclass
class Inbox:
    """The frames a transport's handler received, in arrival order."""

    frames: list[tuple[str, DataFrame]] = field(default_factory=list)

    def __call__(self, peer: str, frame: DataFrame) -> None:
        self.frames.append((peer, frame))

    def raft(self, peer: str | None = None) -> list[RaftMessages]:
        return [f for p, f in self.frames if isinstance(f, RaftMessages) and (peer is None or p == peer)]

    def heartbeats(self, peer: str | None = None) -> list[Heartbeats]:
        return [f for p, f in self.frames if isinstance(f, Heartbeats) and (peer is None or p == peer)]

    def payloads(self, peer: str | None = None) -> list[Payload]:
        return [f for p, f in self.frames if isinstance(f, Payload) and (peer is None or p == peer)]


async def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition (the tests' only waiting primitive); fail naming what never happened."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}")
        await asyncio.sleep(0.01)


async def start_transport(i: int, secret: bytes | None = SECRET, limits: TransportLimits = FAST,
                          **kw: object) -> tuple[ClusterTransport, Inbox]:
    inbox = Inbox()
    t = ClusterTransport(f"n{i + 1}", (HOSTS[i], 0), {}, secret, inbox, random.Random(i), cluster_id=CLUSTER_ID,
                         limits=limits, **kw)  # type: ignore[arg-type]
    await t.start()
    return t, inbox


async def mesh(n: int, secrets: list[bytes | None] | None = None, limits: list[TransportLimits] | None = None
               ) -> list[tuple[ClusterTransport, Inbox]]:
    """n started transports on 127.0.0.11.., each a peer of every other (ports chosen by the OS)."""
    nodes = [await start_transport(i, secret=(secrets[i] if secrets else SECRET),
                                   limits=(limits[i] if limits else FAST)) for i in range(n)]
    for t, _ in nodes:
        for u, _ in nodes:
            if u is not t:
                t.add_peer(u.node_name, u.listen_address)
    return nodes


async def close_all(nodes: list[tuple[ClusterTransport, Inbox]]) -> None:
    await asyncio.gather(*(t.close() for t, _ in nodes))


class FakePeer:
    """A listener that authenticates dialers with the real handshake, then (when ``stall``) stops
    reading and never answers: a peer whose process is stuck."""

    def __init__(self, host: str, name: str, peers: set[str], stall: bool = True,
                 slow_read_bytes_per_100ms: int = 0) -> None:
        self.host = host
        self.me = handshake.Identity(name, CLUSTER_ID, SECRET, os.urandom)
        self.peers = peers
        self.stall = stall
        # > 0: instead of stalling, read this many bytes every 100 ms (a slow link), small socket buffer
        self.slow_read_bytes_per_100ms = slow_read_bytes_per_100ms
        self.frames_read: list[object] = []
        self.server: asyncio.Server | None = None
        self.streams: list[AsyncioStream] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.authenticated = 0

    async def start(self) -> tuple[str, int]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if self.slow_read_bytes_per_100ms:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # accepted sockets inherit it
        sock.bind((self.host, 0))
        self.server = await asyncio.start_server(self._accepted, sock=sock, limit=4 << 20)
        port = self.server.sockets[0].getsockname()[1]
        return self.host, port

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = AsyncioStream(reader, writer)
        self.streams.append(stream)
        self.writers.append(writer)
        fr = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES), 65536)
        try:
            await handshake.accept(stream, fr, self.me, lambda n: n in self.peers)
        except (handshake.HandshakeError, OSError):
            stream.close()
            return
        self.authenticated += 1
        if self.slow_read_bytes_per_100ms:
            fr.decoder.max_frame_bytes = 1 << 30
            while True:
                data = await reader.read(self.slow_read_bytes_per_100ms)
                if not data:
                    return
                self.frames_read += fr.decoder.feed(data)
                await asyncio.sleep(0.1)
        if self.stall:
            writer.transport.pause_reading()  # type: ignore[attr-defined]  # the kernel buffers fill, then the sender's drain blocks

    async def close(self) -> None:
        for s in self.streams:
            s.close()
        if self.server is not None:
            self.server.close()
