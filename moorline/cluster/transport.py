"""ClusterTransport: authenticated, framed, per-stream connections between the nodes of a cluster.

For each peer there are three outgoing connections, one per stream (control: votes, heartbeats,
timeout-now, read index; append; snapshot), so bulk appends or snapshot chunks never queue in
front of a heartbeat. Each connection carries frames one way: a node sends on the connections it
dialed and receives on the ones it accepted, so responses travel on the responder's own links.

``send`` never blocks and never waits for a peer: it queues the encoded frame on its link or drops
it (counted per peer and stream, and reported to ``on_undelivered``). Raft tolerates loss, and a
full queue means the peer is not keeping up: waiting for it would stall every group of this node.
The append stream drops too, rather than closing and redialing: a dropped append makes the
follower reject the next one, and the leader's probe resends from the gap within one round trip,
while a redial would also throw away everything queued and in the socket and add a handshake.

The transport reaches the world only through its seams: ``net`` (byte streams), ``clock`` (the
event loop's time by default), ``rng`` (backoff jitter) and ``nonce_source`` (handshake nonces,
``os.urandom`` by default: nonces must be unpredictable in production; a simulator passes a
seeded source). Timeouts are event-loop timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterable

from moorline.cluster import auth
from moorline.cluster.handshake import Identity
from moorline.cluster.incoming import Acceptor, Handler
from moorline.cluster.limits import TransportLimits
from moorline.cluster.links import LinkEnv, OutgoingLink, UndeliveredCallback
from moorline.cluster.net import Address, AsyncioNetwork, Listener, Network
from moorline.cluster.stats import (
    STREAM_NAMES,
    STREAMS,
    PeerState,
    PeerStats,
    StreamStats,
    TransportStats,
    fmt_address,
)
from moorline.cluster.tls import ClusterTls
from moorline.cluster.wire import (
    LENGTH_BYTES,
    DataFrame,
    FrameTooLarge,
    Heartbeats,
    RaftMessages,
    encode_frame,
)
from moorline.raft.coalesce import GroupId, HeartbeatBatch
from moorline.raft.types import Message, Stream

log = logging.getLogger("moorline.cluster")

_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


class ClusterTransport:
    def __init__(
        self,
        node_name: str,
        cluster_address: Address,
        peers: dict[str, Address],
        secret: bytes | None,
        handler: Handler,
        rng: random.Random,
        *,
        cluster_id: str = "",
        limits: TransportLimits | None = None,
        net: Network | None = None,
        clock: Callable[[], float] | None = None,
        nonce_source: Callable[[int], bytes] = os.urandom,
        on_undelivered: UndeliveredCallback | None = None,
        tls: ClusterTls | None = None,
    ) -> None:
        """``peers`` maps every other node's name to its --cluster address; ``handler(from node,
        frame)`` receives each authenticated data frame (RaftMessages, Heartbeats or Payload) on
        the event loop and must not block. ``on_undelivered(peer, stream, frame)`` hears of every
        frame dropped before it reached a socket (e.g. to call ``RaftNode.report_unreachable``).
        ``tls``: cluster TLS (``moorline.cluster.tls``); without it, on the TCP network, every
        cluster address must be loopback (``auth.require_tls_or_loopback``)."""
        if node_name in peers:
            raise ValueError(f"{node_name!r} is this node; it cannot also be a peer")
        self.limits = limits or TransportLimits()
        self.limits.validate()
        self.node_name = node_name
        self.cluster_address = cluster_address
        self.secret = secret
        self._clock_arg = clock
        host = cluster_address[0]
        # Outgoing connections leave from our own cluster host, so a test (or an operator) can cut
        # any link between two nodes by address. A wildcard listener has no single address to use.
        bind_host = None if host in _WILDCARD_HOSTS else host
        self._env = LinkEnv(
            me=Identity(node=node_name, cluster_id=cluster_id, secret=secret, nonce_source=nonce_source, tls=tls),
            limits=self.limits,
            net=net or AsyncioNetwork(),
            rng=rng,
            clock=clock or _no_clock_yet,
            bind_host=bind_host,
            on_undelivered=on_undelivered,
        )
        self._peers: dict[str, PeerState] = {name: PeerState(name, addr) for name, addr in peers.items()}
        self._links: dict[tuple[str, Stream], OutgoingLink] = {}
        self._acceptor = Acceptor(self._env, self._peers, handler)
        self._listener: Listener | None = None
        self._started = False
        self._closed = False
        self.dropped_unknown_peer = 0

    def quiet_failures_until(self, when: float) -> None:
        """Until ``when`` (this transport's clock), failures to reach a peer never heard from are
        logged at INFO, not WARNING (peers still starting)."""
        self._env.quiet_until = when

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on the cluster address and start dialing every peer. Raises ClusterConfigError
        when listening off loopback without a secret, OSError when the address cannot be bound."""
        if self._started:
            raise RuntimeError("transport already started")
        host, port = self.cluster_address
        if self._env.me.tls is None:
            auth.require_secret_or_loopback(host, self.secret)
            if isinstance(self._env.net, AsyncioNetwork):  # a virtual network never leaves the process
                auth.require_tls_or_loopback([host] + [p.address[0] for p in self._peers.values()])
        if self._clock_arg is None:
            self._env.clock = asyncio.get_running_loop().time
        self._listener = await self._env.net.listen(host, port, self._acceptor.on_stream)
        self._started = True
        for name in self._peers:
            self._start_links(name)

    @property
    def listen_address(self) -> Address:
        """The bound address (the real port when the configured one was 0)."""
        if self._listener is None:
            raise RuntimeError("transport not started")
        return self._listener.address

    async def close(self) -> None:
        """Stop listening, close every connection and end every task, within limits.close_timeout_s."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        self._acceptor.close()
        tasks: list[asyncio.Task[None]] = list(self._acceptor.tasks)
        for link in self._links.values():
            link.stop()
            if link.task is not None:
                tasks.append(link.task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.limits.close_timeout_s)
            if pending:
                log.warning("cluster: %d transport tasks did not end within %s s", len(pending),
                            self.limits.close_timeout_s)
        for task in tasks:
            if task.done() and not task.cancelled():
                with contextlib.suppress(asyncio.CancelledError):
                    exc = task.exception()
                    if exc is not None:
                        log.error("cluster: transport task failed", exc_info=exc)

    # --- membership -----------------------------------------------------------------------------

    def add_peer(self, name: str, address: Address) -> None:
        if name == self.node_name:
            raise ValueError(f"{name!r} is this node")
        if name in self._peers:
            raise ValueError(f"{name!r} is already a peer")
        self._peers[name] = PeerState(name, address)
        if self._started and not self._closed:
            self._start_links(name)

    def remove_peer(self, name: str) -> None:
        """Forget a peer: its links stop, its incoming connections close, its queued frames go."""
        if self._peers.pop(name, None) is None:
            return
        for kind in STREAMS:
            link = self._links.pop((name, kind), None)
            if link is not None:
                link.stop()
        self._acceptor.close_peer(name)

    def _start_links(self, name: str) -> None:
        peer = self._peers[name]
        for kind in STREAMS:
            link = OutgoingLink(self._env, peer, kind)
            self._links[(name, kind)] = link
            link.start()

    # --- sending --------------------------------------------------------------------------------

    def send(self, peer: str, stream: Stream, frame: DataFrame) -> bool:
        """Queue ``frame`` for ``peer`` on ``stream``; False when it was dropped (queue full, unknown
        peer, transport closed). Never blocks. Raises FrameTooLarge when the encoded frame is above
        limits.max_frame_bytes (a caller bug: nothing could ever receive it)."""
        encoded = encode_frame(frame)
        if len(encoded) - LENGTH_BYTES > self.limits.max_frame_bytes:
            raise FrameTooLarge(len(encoded) - LENGTH_BYTES, self.limits.max_frame_bytes)
        return self._offer(peer, stream, encoded, frame)

    def _offer(self, peer: str, stream: Stream, encoded: bytes, frame: DataFrame) -> bool:
        link = self._links.get((peer, stream))
        if link is None or self._closed:
            if peer not in self._peers:
                self.dropped_unknown_peer += 1
            return False
        return link.offer(encoded, frame)

    def send_raft(self, peer: str, messages: Iterable[tuple[GroupId, Message]]) -> int:
        """Send Raft messages (with their group ids) to ``peer``, each on its message's stream, in
        as few frames as fit below limits.max_frame_bytes. Returns how many messages were queued."""
        by_stream: dict[Stream, list[tuple[GroupId, Message]]] = {}
        for item in messages:
            by_stream.setdefault(item[1].stream, []).append(item)
        queued = 0
        for stream, items in by_stream.items():
            for encoded, frame in self._frames_of(items):
                if self._offer(peer, stream, encoded, frame):
                    queued += len(frame.messages)
        return queued

    def send_heartbeats(self, peer: str, batch: HeartbeatBatch) -> bool:
        """A coalesced heartbeat batch (``moorline.raft.coalesce``), on the control stream."""
        return self.send(peer, Stream.CONTROL, Heartbeats(batch))

    def _frames_of(self, items: list[tuple[GroupId, Message]]) -> list[tuple[bytes, RaftMessages]]:
        frame = RaftMessages(items)
        encoded = encode_frame(frame)
        size = len(encoded) - LENGTH_BYTES
        if size <= self.limits.max_frame_bytes:
            return [(encoded, frame)]
        if len(items) == 1:
            raise FrameTooLarge(size, self.limits.max_frame_bytes)
        half = len(items) // 2
        return self._frames_of(items[:half]) + self._frames_of(items[half:])

    # --- stats ----------------------------------------------------------------------------------

    def peer_names(self) -> list[str]:
        return list(self._peers)

    def stats(self) -> TransportStats:
        now = self._env.clock()
        peers: dict[str, PeerStats] = {}
        for name, state in self._peers.items():
            streams: dict[str, StreamStats] = {}
            for kind in STREAMS:
                c = state.streams[kind]
                link = self._links.get((name, kind))
                conn = self._acceptor.connections.get((name, kind))
                streams[STREAM_NAMES[kind]] = StreamStats(
                    outgoing_connected=bool(link and link.connected),
                    incoming_connected=conn is not None,
                    incoming_from=fmt_address(conn.remote) if conn is not None else None,
                    queued_frames=len(link.queue) if link else 0,
                    queued_bytes=link.queued_bytes if link else 0,
                    frames_sent=c.frames_sent,
                    bytes_sent=c.bytes_sent,
                    frames_received=c.frames_received,
                    bytes_received=c.bytes_received,
                    dropped_queue_full=c.dropped_queue_full,
                    dropped_disconnected=c.dropped_disconnected,
                    connects=c.connects,
                    connect_failures=c.connect_failures,
                )
            peers[name] = PeerStats(
                address=fmt_address(state.address),
                connected_streams=[n for n, s in streams.items() if s.outgoing_connected],
                incoming_streams=[n for n, s in streams.items() if s.incoming_connected],
                last_contact_age_s=None if state.last_contact_at is None else max(0.0, now - state.last_contact_at),
                last_error=state.last_error,
                last_error_age_s=None if state.last_error_at is None else max(0.0, now - state.last_error_at),
                auth_failures=state.auth_failures,
                frames_sent=sum(s.frames_sent for s in streams.values()),
                bytes_sent=sum(s.bytes_sent for s in streams.values()),
                frames_received=sum(s.frames_received for s in streams.values()),
                bytes_received=sum(s.bytes_received for s in streams.values()),
                dropped=sum(s.dropped_queue_full + s.dropped_disconnected for s in streams.values()),
                streams=streams,
            )
        return TransportStats(
            node=self.node_name,
            listen_address=fmt_address(self._listener.address) if self._listener is not None else None,
            peers=peers,
            refused_connections=self._acceptor.refused,
            last_refusal=self._acceptor.last_refusal,
            dropped_unknown_peer=self.dropped_unknown_peer,
        )


def _no_clock_yet() -> float:
    # Replaced by the running loop's time() in start(); stats before start() read 0.
    return 0.0
