"""The connection handshake over a ByteStream: TLS (when configured), then preambles,
Hello / Challenge / Proof / Proof.

Both sides run under the caller's handshake timeout; nothing here reads a clock. On any failure
the side that noticed sends ``Refused(reason)`` (best effort) and raises, so both logs name the
same cause. With cluster TLS the peer's node name is the one its certificate proves
(``moorline.cluster.tls``): a Hello or Challenge naming another node is refused. Every value read
from the peer goes into messages with ``!r`` (escaped): it is unauthenticated input.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from moorline.cluster import auth
from moorline.cluster.net import AsyncioStream, ByteStream
from moorline.cluster.stats import escape
from moorline.cluster.tls import ClusterTls, peer_node_name
from moorline.cluster.wire import (
    PROTOCOL_VERSION,
    Challenge,
    Frame,
    FrameDecoder,
    Hello,
    Proof,
    ProtocolError,
    Refused,
    encode_frame,
    preamble,
)
from moorline.raft.types import Stream

# Handshake frames are tiny; until a peer is authenticated it may not make us buffer more.
MAX_HANDSHAKE_FRAME_BYTES = 4096


class HandshakeError(Exception):
    """The handshake failed; the message is the reason, fit for a log line and for stats.
    ``peer`` is the node name the dialer claimed, once its Hello was read (not authenticated)."""

    peer: str | None = None


class PeerRefused(HandshakeError):
    """The other side sent Refused(reason)."""


class FrameReader:
    """Reads whole frames from a stream through a FrameDecoder, keeping any extra frames a read
    completed for the next call. ``received_bytes`` counts every byte read (for stats)."""

    def __init__(self, stream: ByteStream, decoder: FrameDecoder, read_chunk_bytes: int) -> None:
        self.stream = stream
        self.decoder = decoder
        self.read_chunk_bytes = read_chunk_bytes
        self.pending: deque[Frame] = deque()
        self.received_bytes = 0

    async def read_frames(self, idle_timeout_s: float | None = None) -> list[Frame]:
        """Every frame available now (at least one); ``[]`` at end of stream. TimeoutError when no
        byte at all arrives for ``idle_timeout_s``: a large frame that keeps arriving, however
        slowly, is not idleness."""
        if self.pending:
            frames = list(self.pending)
            self.pending.clear()
            return frames
        while True:
            if idle_timeout_s is None:
                data = await self.stream.read(self.read_chunk_bytes)
            else:
                async with asyncio.timeout(idle_timeout_s):
                    data = await self.stream.read(self.read_chunk_bytes)
            if not data:
                return []
            self.received_bytes += len(data)
            frames = self.decoder.feed(data)
            if frames:
                return frames

    async def next_frame(self) -> Frame | None:
        if not self.pending:
            self.pending.extend(await self.read_frames())
        return self.pending.popleft() if self.pending else None


def send_frames(stream: ByteStream, *frames: Frame) -> None:
    stream.write(b"".join(encode_frame(f) for f in frames))


async def refuse(stream: ByteStream, reason: str) -> None:
    """Tell the peer why before closing (best effort: it may already be gone)."""
    try:
        send_frames(stream, Refused(reason[:1000]))
        await stream.drain()
    except OSError:
        pass


async def _expect(reader: FrameReader, kind: type, what: str) -> Frame:
    frame = await reader.next_frame()
    if frame is None:
        raise HandshakeError(f"connection closed during the handshake (waiting for {what})")
    if isinstance(frame, Refused):
        raise PeerRefused(escape(frame.reason))
    if not isinstance(frame, kind):
        raise HandshakeError(f"protocol error: expected {what}, got {type(frame).__name__}")
    return frame


@dataclass(frozen=True, slots=True)
class Identity:
    node: str
    cluster_id: str
    secret: bytes | None
    nonce_source: Callable[[int], bytes]
    tls: ClusterTls | None = None  # cluster TLS: the peer is who its certificate names


async def secure(stream: ByteStream, me: Identity, server_side: bool) -> str | None:
    """With cluster TLS: upgrade ``stream`` and return the node name the peer's certificate proves
    (HandshakeError when the TLS handshake fails or the certificate names no node). Without: None."""
    if me.tls is None:
        return None
    if not isinstance(stream, AsyncioStream):
        raise HandshakeError("cluster TLS needs the TCP network")
    try:
        await stream.start_tls(me.tls.server if server_side else me.tls.client)
    except ssl.SSLError as exc:
        raise HandshakeError(f"TLS handshake failed: {exc.reason or exc}") from None
    name = peer_node_name(stream.peer_certificate())
    if name is None:
        raise HandshakeError("the peer's certificate names no node (a subject alternative name "
                             "URI:urn:moorline:node:<name> is required)")
    return name


async def dial(stream: ByteStream, reader: FrameReader, me: Identity, peer: str, kind: Stream) -> None:
    """Dialer side. Returns when both sides have proven the secret (and, with TLS, the listener's
    certificate names ``peer``); raises HandshakeError otherwise, after telling the listener why."""
    proven = await secure(stream, me, server_side=False)
    try:
        if proven is not None and proven != peer:
            raise HandshakeError(f"the address of {peer} presented the certificate of node {proven!r}; check "
                                 "the cluster configuration (--initial-cluster) and certificates")
        await _dial(stream, reader, me, peer, kind)
    except PeerRefused:
        raise
    except ProtocolError as exc:
        await refuse(stream, f"protocol error: {exc}")
        raise HandshakeError(f"protocol error from {peer}: {exc}") from None
    except HandshakeError as exc:
        await refuse(stream, str(exc))
        raise


async def accept(
    stream: ByteStream, reader: FrameReader, me: Identity, is_peer: Callable[[str], bool]
) -> Hello:
    """Listener side. Returns the dialer's (authenticated) Hello; raises HandshakeError otherwise,
    after telling the dialer why. With cluster TLS the Hello must name the node the dialer's
    certificate names."""
    proven = await secure(stream, me, server_side=True)
    try:
        return await _accept(stream, reader, me, is_peer, proven)
    except PeerRefused:
        raise
    except ProtocolError as exc:
        await refuse(stream, f"protocol error: {exc}")
        raise HandshakeError(f"protocol error: {exc}") from None
    except HandshakeError as exc:
        await refuse(stream, str(exc))
        raise


async def _dial(stream: ByteStream, reader: FrameReader, me: Identity, peer: str, kind: Stream) -> None:
    nonce = me.nonce_source(auth.NONCE_BYTES)
    stream.write(preamble())
    send_frames(stream, Hello(node=me.node, cluster_id=me.cluster_id, stream=kind, version=PROTOCOL_VERSION,
                              nonce=nonce))
    await stream.drain()
    challenge = await _expect(reader, Challenge, "Challenge")
    assert isinstance(challenge, Challenge)
    if challenge.node != peer:
        raise HandshakeError(f"the address of {peer} answered as node {challenge.node!r}; check the cluster "
                             "configuration (--initial-cluster) of both nodes")
    if len(challenge.nonce) < auth.MIN_NONCE_BYTES:
        raise HandshakeError(f"{peer} sent a nonce of {len(challenge.nonce)} bytes, too short")
    t = auth.transcript(me.cluster_id, kind, me.node, peer, nonce, challenge.nonce)
    send_frames(stream, Proof(auth.make_proof(me.secret, t, auth.DIALER)))
    await stream.drain()
    proof = await _expect(reader, Proof, "Proof")
    assert isinstance(proof, Proof)
    if not auth.check_proof(me.secret, t, auth.LISTENER, proof.mac):
        raise HandshakeError(f"authentication failed: {peer} did not prove the cluster secret (do both "
                             "nodes use the same --cluster-secret-file?)")


async def _accept(
    stream: ByteStream, reader: FrameReader, me: Identity, is_peer: Callable[[str], bool], proven: str | None
) -> Hello:
    stream.write(preamble())
    hello = await _expect(reader, Hello, "Hello")
    assert isinstance(hello, Hello)
    try:
        if proven is not None and hello.node != proven:
            raise HandshakeError(f"the Hello claims node {hello.node!r}, but the certificate names {proven!r}")
        return await _challenge(stream, reader, me, is_peer, hello)
    except HandshakeError as exc:
        exc.peer = hello.node
        raise


async def _challenge(
    stream: ByteStream, reader: FrameReader, me: Identity, is_peer: Callable[[str], bool], hello: Hello
) -> Hello:
    reason = _hello_problem(hello, me, is_peer)
    if reason is not None:
        raise HandshakeError(reason)
    nonce = me.nonce_source(auth.NONCE_BYTES)
    send_frames(stream, Challenge(node=me.node, nonce=nonce))
    await stream.drain()
    proof = await _expect(reader, Proof, "Proof")
    assert isinstance(proof, Proof)
    t = auth.transcript(me.cluster_id, hello.stream, hello.node, me.node, hello.nonce, nonce)
    if not auth.check_proof(me.secret, t, auth.DIALER, proof.mac):
        raise HandshakeError(f"authentication failed: {hello.node!r} did not prove the cluster secret (do both "
                             "nodes use the same --cluster-secret-file?)")
    send_frames(stream, Proof(auth.make_proof(me.secret, t, auth.LISTENER)))
    await stream.drain()
    return hello


def _hello_problem(hello: Hello, me: Identity, is_peer: Callable[[str], bool]) -> str | None:
    if hello.version != PROTOCOL_VERSION:
        return f"protocol version {hello.version!r} in Hello; this node speaks {PROTOCOL_VERSION}"
    if hello.cluster_id != me.cluster_id:
        return (f"wrong cluster: {hello.node!r} belongs to cluster {hello.cluster_id!r}, {me.node} to "
                f"{me.cluster_id!r}")
    if hello.node == me.node:
        return f"a node named {hello.node!r} connected to itself (two nodes with the same --node-id?)"
    if not is_peer(hello.node):
        return f"{hello.node!r} is not a peer of {me.node} (not in its cluster configuration)"
    if len(hello.nonce) < auth.MIN_NONCE_BYTES:
        return f"nonce of {len(hello.nonce)} bytes is too short"
    return None
