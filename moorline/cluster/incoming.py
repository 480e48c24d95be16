"""The listener's side: authenticate each incoming connection, then deliver its frames.

No frame reaches the handler before the dialer has proven the cluster secret. A peer has at most
one incoming connection per stream: a newer authenticated one replaces the older (the dialer
redials only after giving up on the old one, which may hang forever behind a cut link).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from moorline.cluster import handshake
from moorline.cluster.links import LinkEnv, stop_tasks
from moorline.cluster.net import Address, ByteStream
from moorline.cluster.stats import STREAM_NAMES, PeerState, escape, fmt_address
from moorline.cluster.wire import (
    DATA_FRAMES,
    DataFrame,
    FrameDecoder,
    Ping,
    Pong,
    ProtocolError,
    Refused,
    encode_frame,
)
from moorline.raft.types import Stream

log = logging.getLogger("moorline.cluster")

PONG_BYTES = encode_frame(Pong())

Handler = Callable[[str, DataFrame], None]

# A refusal reason logged once is repeated in the log at most this often (a misconfigured or
# hostile dialer retries every backoff interval).
_REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass(slots=True, eq=False)
class IncomingConn:
    peer: str
    kind: Stream
    stream: ByteStream
    remote: Address
    reader: handshake.FrameReader
    idle: bool = False  # closed by _pong_loop: no byte arrived for idle_timeout_s


class Acceptor:
    def __init__(self, env: LinkEnv, peers: dict[str, PeerState], handler: Handler) -> None:
        self.env = env
        self.peers = peers
        self.handler = handler
        self.connections: dict[tuple[str, Stream], IncomingConn] = {}
        # Insertion-ordered (not sets of objects): closing goes through them in the order they came,
        # the same in every run, not by object address (the simulator replays a seed exactly).
        self.tasks: dict[asyncio.Task[None], None] = {}
        self.streams: dict[ByteStream, None] = {}
        self.pending_handshakes = 0  # from hosts that are not a member's
        self.pending_by_host: dict[str, int] = {}
        self.refused = 0
        self.last_refusal: str | None = None
        self._logged_refusals: dict[str, float] = {}
        self._logged_protocol_errors: dict[str, float] = {}
        self.closed = False

    def on_stream(self, stream: ByteStream) -> None:
        """Network.listen callback: must not block, so the work goes to a task.

        Slots for connections not yet authenticated: at most max_pending_handshakes_per_address
        from any one host, and at most max_pending_handshakes from hosts that are not a member's
        cluster host; a member's host is never refused for the global bound (a restarted peer
        always gets in, however many idle sockets others hold)."""
        if self.closed:
            stream.close()
            return
        limits = self.env.limits
        host = stream.remote_address[0]
        member = host in self._member_hosts()
        if self.pending_by_host.get(host, 0) >= limits.max_pending_handshakes_per_address:
            stream.close()
            self._refusal(stream.remote_address, "too many connections in the handshake from "
                          f"this address (max_pending_handshakes_per_address = "
                          f"{limits.max_pending_handshakes_per_address})", None)
            return
        if not member and self.pending_handshakes >= limits.max_pending_handshakes:
            stream.close()
            self._refusal(stream.remote_address, "too many connections in the handshake "
                          f"(max_pending_handshakes = {limits.max_pending_handshakes})", None)
            return
        if not member:
            self.pending_handshakes += 1
        self.pending_by_host[host] = self.pending_by_host.get(host, 0) + 1
        self.streams[stream] = None
        task = asyncio.get_running_loop().create_task(self._serve(stream, member))
        self.tasks[task] = None
        task.add_done_callback(lambda t: self.tasks.pop(t, None))

    def _member_hosts(self) -> set[str]:
        return {p.address[0] for p in self.peers.values()}

    def _release_slot(self, host: str, member: bool) -> None:
        if not member:
            self.pending_handshakes -= 1
        left = self.pending_by_host.get(host, 0) - 1
        if left > 0:
            self.pending_by_host[host] = left
        else:
            self.pending_by_host.pop(host, None)

    def close_peer(self, name: str) -> None:
        for (peer, _), conn in list(self.connections.items()):
            if peer == name:
                conn.stream.close()

    def close(self) -> None:
        self.closed = True
        goodbye = encode_frame(Refused(f"{self.env.me.node} is shutting down"))
        for conn in self.connections.values():
            # Best effort, before the abort below: the dialer's log then says why, not just "closed".
            try:
                conn.stream.write(goodbye)
            except OSError:
                pass
        for stream in list(self.streams):
            stream.close()
        for task in list(self.tasks):
            task.cancel()

    async def _serve(self, stream: ByteStream, member: bool) -> None:
        try:
            conn = await self._authenticate(stream, member)
            if conn is not None:
                await self._receive(conn)
        finally:
            stream.close()
            self.streams.pop(stream, None)

    async def _authenticate(self, stream: ByteStream, member: bool) -> IncomingConn | None:
        env = self.env
        reader = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES),
                                       env.limits.read_chunk_bytes)
        try:
            async with asyncio.timeout(env.limits.preauth_timeout_s):
                hello = await handshake.accept(stream, reader, env.me, lambda name: name in self.peers)
        except (handshake.HandshakeError, OSError, TimeoutError, ValueError) as exc:
            # (ValueError: asyncio's TLS upgrade of a stream that a peer reset at once)
            what = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            self._refusal(stream.remote_address, what, getattr(exc, "peer", None))
            return None
        finally:
            self._release_slot(stream.remote_address[0], member)
        peer = self.peers.get(hello.node)
        if peer is None:  # removed while we were talking
            return None
        reader.decoder.max_frame_bytes = env.limits.max_frame_bytes
        conn = IncomingConn(hello.node, hello.stream, stream, stream.remote_address, reader)
        old = self.connections.get((conn.peer, conn.kind))
        if old is not None:
            old.stream.close()
        self.connections[(conn.peer, conn.kind)] = conn
        peer.last_contact_at = env.clock()
        log.info("cluster: %s connected its %s stream from %s", conn.peer, STREAM_NAMES[conn.kind],
                 fmt_address(conn.remote))
        return conn

    async def _receive(self, conn: IncomingConn) -> None:
        env = self.env
        reader = conn.reader
        peer = self.peers[conn.peer]
        counters = peer.streams[conn.kind]
        idle_s = env.limits.idle_timeout_s
        handler = self.handler
        pong = asyncio.get_running_loop().create_task(self._pong_loop(conn))
        seen = reader.received_bytes
        reason: str | None = None
        protocol_error = False
        try:
            while True:
                # Idleness is _pong_loop's to notice (a timer per read cost more than the read).
                frames = await reader.read_frames()
                if not frames:
                    if conn.idle:
                        reason = f"no byte from {conn.peer} ({STREAM_NAMES[conn.kind]} stream) for {idle_s} s"
                    break  # else the dialer closed: it says why on its side
                counters.bytes_received += reader.received_bytes - seen
                seen = reader.received_bytes
                peer.last_contact_at = env.clock()
                for f in frames:
                    if isinstance(f, DATA_FRAMES):
                        counters.frames_received += 1
                        try:
                            handler(conn.peer, f)
                        except Exception:
                            log.exception("cluster: the frame handler failed on a %s from %s",
                                          type(f).__name__, conn.peer)
                    elif isinstance(f, Refused):
                        reason = f"{conn.peer} closed its {STREAM_NAMES[conn.kind]} stream: {escape(f.reason)}"
                        return
                    elif not isinstance(f, Ping):
                        raise ProtocolError(f"unexpected {type(f).__name__} after the handshake")
        except ProtocolError as exc:
            reason = f"closed the {STREAM_NAMES[conn.kind]} stream from {conn.peer}: {escape(str(exc))}"
            protocol_error = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(env.limits.handshake_timeout_s):
                    await handshake.refuse(conn.stream, str(exc))
        except OSError as exc:
            if conn.idle:
                reason = f"no byte from {conn.peer} ({STREAM_NAMES[conn.kind]} stream) for {idle_s} s"
            else:
                reason = f"{STREAM_NAMES[conn.kind]} stream from {conn.peer} broke: {os.strerror(exc.errno) if exc.errno else exc}"
        finally:
            if self.connections.get((conn.peer, conn.kind)) is conn:
                del self.connections[(conn.peer, conn.kind)]
            if reason is not None:
                now = env.clock()
                peer.note_error(reason, now)
                # A peer breaking the protocol again and again is logged once per interval.
                last = self._logged_protocol_errors.get(conn.peer)
                if not protocol_error or last is None or now - last >= _REFUSAL_LOG_INTERVAL_S:
                    if protocol_error:
                        self._logged_protocol_errors[conn.peer] = now
                    log.warning("cluster: %s", reason)
                else:
                    log.debug("cluster: %s", reason)
            await stop_tasks(pong)

    async def _pong_loop(self, conn: IncomingConn) -> None:
        """The dialer's proof that we are alive and reading; it redials when they stop. Also the
        idle watch: a connection that brought no byte at all for idle_timeout_s is closed (a
        frame that keeps arriving, however slowly, is not idleness)."""
        limits = self.env.limits
        clock = self.env.clock
        seen, since = conn.reader.received_bytes, clock()
        try:
            while True:
                await asyncio.sleep(limits.keepalive_interval_s)
                now = clock()
                if conn.reader.received_bytes != seen:
                    seen, since = conn.reader.received_bytes, now
                elif now - since >= limits.idle_timeout_s:
                    conn.idle = True
                    conn.stream.close()
                    return
                conn.stream.write(PONG_BYTES)
                async with asyncio.timeout(limits.idle_timeout_s):
                    await conn.stream.drain()
        except (OSError, TimeoutError):
            conn.stream.close()

    def _refusal(self, source: Address, reason: str, peer_name: str | None = None) -> None:
        message = f"from {fmt_address(source)}: {reason}"
        self.refused += 1
        self.last_refusal = message
        now = self.env.clock()
        peer = self.peers.get(peer_name) if peer_name else None
        if peer is not None:
            peer.note_error(f"refused an incoming connection {message}", now)
            if "authentication failed" in message:
                peer.auth_failures += 1
        # At most one line per source host per interval: a hostile dialer chooses the text (every
        # variant would be logged), not the address it connects from.
        key = source[0]
        last = self._logged_refusals.get(key)
        if last is None or now - last >= _REFUSAL_LOG_INTERVAL_S:
            if len(self._logged_refusals) > 1000:
                self._logged_refusals.clear()
            self._logged_refusals[key] = now
            log.warning("cluster: refused a peer connection %s", message)
