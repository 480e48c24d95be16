"""One outgoing connection per (peer, stream): a bounded send queue, dialing with backoff, liveness.

A link never blocks its caller: ``offer`` queues an encoded frame or drops it (counted). Its task
dials, authenticates, then writes queued frames while a watcher reads the listener's Pongs (or
its Refused) on the same connection. Links share nothing but the environment, so a dead or
stalled peer holds up only its own links.

Frames handed to the socket before a connection broke are lost silently, as with any TCP sender;
frames still queued when a connection breaks or cannot be made are dropped and counted
(``dropped_disconnected``), so what a new connection sends is at most one backoff interval old.
Raft repairs both kinds of loss (a follower rejects the append after a gap, a heartbeat comes again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from moorline.cluster import handshake
from moorline.cluster.limits import TransportLimits
from moorline.cluster.net import ByteStream, Network
from moorline.cluster.stats import STREAM_NAMES, PeerState, StreamCounters, escape, fmt_address
from moorline.cluster.wire import DataFrame, FrameDecoder, Ping, Pong, ProtocolError, Refused, encode_frame
from moorline.raft.types import Stream

log = logging.getLogger("moorline.cluster")

PING_BYTES = encode_frame(Ping())

UndeliveredCallback = Callable[[str, Stream, DataFrame], None]


def backoff_delay_s(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Delay before dial attempt ``attempt + 1``: jittered ("equal jitter") so links that failed
    together do not retry in lock step, and never above ``cap_s``."""
    ceiling = min(cap_s, base_s * (2 ** min(attempt, 32)))
    return ceiling * (0.5 + 0.5 * rng.random())


@dataclass(slots=True)
class LinkEnv:
    """What every link of one transport shares."""

    me: handshake.Identity
    limits: TransportLimits
    net: Network
    rng: random.Random
    clock: Callable[[], float]
    bind_host: str | None  # local side of outgoing connections (the host of our --cluster address)
    on_undelivered: UndeliveredCallback | None
    # Until then (clock()) a peer never heard from that cannot be reached is logged at INFO: at a
    # cluster's start peers are still starting (cluster.bootstrap_timeout_s), no cause for a warning.
    quiet_until: float = float("-inf")


async def stop_tasks(*tasks: asyncio.Task[None]) -> None:
    """Cancel ``tasks`` and wait for them to end. Not ``suppress(CancelledError): await task``: when
    the caller is itself being cancelled, that swallows the caller's own cancellation (it arrives
    as the child's CancelledError), and the caller runs on after close() gave up on it."""
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks)  # raises nothing of the children's, lets the caller's cancellation through
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved, so asyncio does not log it as never retrieved


class LinkBroken(Exception):
    """The connection ended; the message says how (for last_error)."""


class OutgoingLink:
    def __init__(self, env: LinkEnv, peer: PeerState, kind: Stream) -> None:
        self.env = env
        self.peer = peer
        self.kind = kind
        self.counters: StreamCounters = peer.streams[kind]
        self.queue: deque[tuple[bytes, DataFrame]] = deque()
        self.queued_bytes = 0
        self.connected = False
        self._wake = asyncio.Event()
        self._stream: ByteStream | None = None
        self._reader: handshake.FrameReader | None = None
        self._last_logged_error: str | None = None
        self._last_quiet_error: str | None = None  # the same, for what quiet_until logs at INFO
        self.task: asyncio.Task[None] | None = None
        # Keepalive without a timer per frame: one timer per keepalive interval checks when the
        # connection was last written to, and asks for a Ping when it was idle that long.
        self._last_write_at = 0.0
        self._ping_due = False
        self._keepalive: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return f"{self.peer.name}/{STREAM_NAMES[self.kind]}"

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"cluster-link-{self.name}")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self._stream is not None:
            self._stream.close()

    # --- the caller's side (synchronous, never blocks) ------------------------------------------

    def offer(self, encoded: bytes, frame: DataFrame) -> bool:
        limits = self.env.limits
        if self.queue and (
            len(self.queue) >= limits.max_queue_frames or self.queued_bytes + len(encoded) > limits.max_queue_bytes
        ):
            self.counters.dropped_queue_full += 1
            self._undelivered(frame)
            return False
        self.queue.append((encoded, frame))
        self.queued_bytes += len(encoded)
        self._wake.set()
        return True

    def _discard_queue(self) -> None:
        dropped = list(self.queue)
        self.queue.clear()
        self.queued_bytes = 0
        self.counters.dropped_disconnected += len(dropped)
        for _, frame in dropped:
            self._undelivered(frame)

    def _undelivered(self, frame: DataFrame) -> None:
        cb = self.env.on_undelivered
        if cb is not None:
            try:
                cb(self.peer.name, self.kind, frame)
            except Exception:
                log.exception("on_undelivered callback failed")

    # --- the link task --------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._dial_loop()
            except Exception:
                # A bug here must not leave the link dead for the life of the process.
                log.exception("cluster: link %s failed; restarting it", self.name)
                self.connected = False
                self._discard_queue()
                await asyncio.sleep(self.env.limits.backoff_cap_s)

    async def _dial_loop(self) -> None:
        env = self.env
        attempt = 0
        while True:
            dialed = await self._dial()
            if dialed is None:
                self._discard_queue()
                await asyncio.sleep(backoff_delay_s(attempt, env.limits.backoff_base_s, env.limits.backoff_cap_s,
                                                    env.rng))
                attempt += 1
                continue
            attempt = 0
            stream, self._reader = dialed
            self._stream = stream
            self.connected = True
            self.counters.connects += 1
            self._last_logged_error = None
            log.info("cluster: connected to %s (%s stream) at %s", self.peer.name, STREAM_NAMES[self.kind],
                     fmt_address(self.peer.address))
            try:
                await self._pump(stream, self._reader)
            except (LinkBroken, OSError, ProtocolError, TimeoutError) as exc:
                self._fail(_describe(exc, f"connection to {self.name}"))
            except RuntimeError as exc:
                # uvloop raises this for a write to a transport the peer's reset already closed:
                # a broken connection like any other, not a bug of ours.
                if "closed" not in str(exc):
                    raise
                self._fail(f"connection to {self.name} closed: {exc}")
            finally:
                self.connected = False
                self._stream = self._reader = None
                stream.close()
            self._discard_queue()
            # A short jittered pause even after a good connection, so a peer that accepts and
            # then drops us at once cannot make this a busy loop.
            await asyncio.sleep(backoff_delay_s(0, env.limits.backoff_base_s, env.limits.backoff_cap_s, env.rng))

    async def _dial(self) -> tuple[ByteStream, handshake.FrameReader] | None:
        env = self.env
        host, port = self.peer.address
        try:
            async with asyncio.timeout(env.limits.connect_timeout_s):
                stream = await env.net.connect(host, port, env.bind_host)
        except (OSError, TimeoutError) as exc:
            self.counters.connect_failures += 1
            self._fail(_describe(exc, f"cannot connect to {self.name} at {fmt_address(self.peer.address)}"))
            return None
        reader = handshake.FrameReader(stream, FrameDecoder(handshake.MAX_HANDSHAKE_FRAME_BYTES),
                                       env.limits.read_chunk_bytes)
        try:
            async with asyncio.timeout(env.limits.handshake_timeout_s):
                await handshake.dial(stream, reader, env.me, self.peer.name, self.kind)
        except (handshake.HandshakeError, OSError, TimeoutError) as exc:
            stream.close()
            self.counters.connect_failures += 1
            if isinstance(exc, handshake.PeerRefused):
                message = f"{self.peer.name} refused the {STREAM_NAMES[self.kind]} connection: {exc}"
            else:
                message = _describe(exc, f"handshake with {self.name}")
            if "authentication failed" in message:
                self.peer.auth_failures += 1
            self._fail(message)
            return None
        return stream, reader

    async def _pump(self, stream: ByteStream, reader: handshake.FrameReader) -> None:
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self._write_loop(stream))
        watcher = loop.create_task(self._watch(reader))
        try:
            done, _ = await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # re-raises what ended it
            raise LinkBroken(f"connection to {self.name} ended")
        finally:
            await stop_tasks(writer, watcher)

    async def _write_loop(self, stream: ByteStream) -> None:
        limits = self.env.limits
        loop = asyncio.get_running_loop()
        self._last_write_at = loop.time()
        self._ping_due = False
        self._keepalive = loop.call_later(limits.keepalive_interval_s, self._keepalive_check)
        try:
            await self._write_frames(stream, loop)
        finally:
            self._keepalive.cancel()

    def _keepalive_check(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.env.limits.keepalive_interval_s
        idle_s = loop.time() - self._last_write_at
        if idle_s >= interval:
            self._ping_due = True
            self._wake.set()
            idle_s = 0.0
        # Never a delay that rounds to nothing: on a virtual clock the timer would fire again at
        # the same instant forever (the cluster simulator found this).
        self._keepalive = loop.call_later(max(interval - idle_s, 1e-3), self._keepalive_check)

    async def _write_frames(self, stream: ByteStream, loop: asyncio.AbstractEventLoop) -> None:
        limits = self.env.limits
        counters = self.counters
        queue = self.queue
        while True:
            if not queue:
                if self._ping_due:
                    self._ping_due = False
                    stream.write(PING_BYTES)
                    self._last_write_at = loop.time()
                    counters.bytes_sent += len(PING_BYTES)
                    await self._drain(stream)
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            chunks: list[bytes] = []
            batch_bytes = 0
            while queue and batch_bytes < limits.write_batch_bytes:
                encoded, _ = queue.popleft()
                chunks.append(encoded)
                batch_bytes += len(encoded)
            self.queued_bytes -= batch_bytes
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            # A large frame goes out in slices of write_batch_bytes, each drained: the stall timeout
            # then bounds the time for one slice to leave, not for a whole snapshot chunk on a
            # slow link.
            self._last_write_at = loop.time()
            if len(data) <= limits.write_batch_bytes:
                stream.write(data)
                await self._drain(stream)
            else:
                view = memoryview(data)  # not released here: the stream may keep slices of immutable bytes
                for start in range(0, len(data), limits.write_batch_bytes):
                    stream.write(view[start : start + limits.write_batch_bytes])
                    await self._drain(stream)
            counters.frames_sent += len(chunks)
            counters.bytes_sent += batch_bytes

    async def _drain(self, stream: ByteStream) -> None:
        if not stream.write_blocked():
            return  # nothing to wait for: no timer (this runs for every frame sent)
        try:
            async with asyncio.timeout(self.env.limits.write_stall_timeout_s):
                await stream.drain()
        except TimeoutError:
            raise LinkBroken(f"{self.name} accepted no bytes for {self.env.limits.write_stall_timeout_s} s "
                             "(peer stalled or link cut)") from None

    async def _watch(self, reader: handshake.FrameReader) -> None:
        """Reads what the listener sends back: Pongs (liveness) or a Refused before it closes."""
        idle_s = self.env.limits.idle_timeout_s
        while True:
            try:
                frames = await reader.read_frames(idle_s)
            except TimeoutError:
                raise LinkBroken(f"no sign of life from {self.name} for {idle_s} s") from None
            if not frames:
                raise LinkBroken(f"{self.name} closed the connection")
            self.peer.last_contact_at = self.env.clock()
            for f in frames:
                if isinstance(f, Refused):
                    raise LinkBroken(f"{self.name} closed the connection: {escape(f.reason)}")
                if not isinstance(f, Pong):
                    raise ProtocolError(f"unexpected {type(f).__name__} from the listener")

    def _fail(self, message: str) -> None:
        self.peer.note_error(message, self.env.clock())
        if self.peer.last_contact_at is None and self.env.clock() < self.env.quiet_until:
            if message != self._last_quiet_error:  # once, not at every attempt; the first after it warns
                log.info("cluster: %s (peer not started yet?)", message)
                self._last_quiet_error = message
            return
        # The same failure repeating (a peer down for hours) is logged once, not at every attempt.
        if message != self._last_logged_error:
            log.warning("cluster: %s", message)
            self._last_logged_error = message
        else:
            log.debug("cluster: %s", message)


def _describe(exc: BaseException, what: str) -> str:
    if isinstance(exc, TimeoutError):
        return f"{what}: timed out"
    if isinstance(exc, LinkBroken | handshake.HandshakeError):
        return str(exc) if isinstance(exc, LinkBroken) else f"{what}: {exc}"
    if isinstance(exc, OSError):
        return f"{what}: {os.strerror(exc.errno) if exc.errno else exc}"
    return f"{what}: {exc}"

