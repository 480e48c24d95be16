"""``moorline.client.Client``: an asyncio MQTT 5 client that keeps every message until the broker
acknowledged it, across reconnects to any node of a cluster (and, with a spool, across a crash of
the process), with the broker's producer/sequence de-duplication making each resend apply once.
See docs/client.md for what each call promises."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, Literal

from moorline.client.buffer import BufferLimits, OutMessage, RetransmitBuffer
from moorline.client.errors import (
    BatchFailed,
    BufferFull,
    ClientClosed,
    MessageExpired,
    PublishRefused,
    PublishTimeout,
    SubscribeFailed,
)
from moorline.client.spool import Spool, SpooledMessage
from moorline.mqtt import packets as P
from moorline.mqtt.codec import Decoder, ProtocolError, encode, encode_ack, encode_publish_fast
from moorline.mqtt.topics import matches, parse_shared, topic_filter_error, topic_name_error

log = logging.getLogger("moorline.client")

_U16 = struct.Struct("!H")
_PROD_KEY = b"\x26" + _U16.pack(8) + b"producer" + _U16.pack(16)
_SEQ_KEY = b"\x26" + _U16.pack(3) + b"seq"
MetricHook = Callable[[str, float], None]


def _props_for(producer: bytes, seq: int) -> bytes:
    """The property body of ``producer`` (16 hex) and ``seq`` (decimal) user properties."""
    s = str(seq).encode()
    return _PROD_KEY + producer.hex().encode() + _SEQ_KEY + _U16.pack(len(s)) + s


def parse_server(text: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` to (host, port); ValueError with a clear text."""
    s = text.strip()
    if not s:
        raise ValueError("empty server address")
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif s.count(":") == 1:
        host, port = s.split(":")
    else:
        host, port = s, ""
    if not port:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port in server address {text!r}")
    return host, int(port)


class _ConnectRefused(Exception):
    def __init__(self, reason_code: int, reason: str) -> None:
        super().__init__(f"CONNACK 0x{reason_code:02X}{': ' + reason if reason else ''}")
        self.reason_code = reason_code


class Message:
    """A message received through a subscription. Call ``await msg.ack()`` once it is processed:
    until then the broker counts it as in flight (Receive Maximum) and resends it after a
    reconnect. An ack after the connection it came on was lost does nothing: it comes again."""

    __slots__ = ("topic", "payload", "qos", "retain", "dup", "properties", "_client", "_pid", "_gen", "_acked")

    def __init__(self, client: Client, pk: P.Publish, gen: int) -> None:
        self.topic = pk.topic
        self.payload = pk.payload
        self.qos = pk.qos
        self.retain = pk.retain
        self.dup = pk.dup
        self.properties = pk.properties
        self._client = client
        self._pid = pk.packet_id
        self._gen = gen
        self._acked = pk.qos == 0

    @property
    def user_properties(self) -> tuple[tuple[str, str], ...]:
        return self.properties.user_properties

    async def ack(self) -> None:
        if self._acked:
            return
        self._acked = True
        self._client._ack_inbound(self._pid, self.qos, self._gen)

    def __repr__(self) -> str:
        return f"<Message {self.topic!r} qos={self.qos} {len(self.payload)} B>"


class Subscription:
    """``async for msg in client.subscribe(filter)``: the messages whose topic the filter matches
    (a message two subscriptions match goes to the one made first)."""

    def __init__(self, client: Client, topic_filter: str, qos: int, no_local: bool, auto_ack: bool) -> None:
        self.client = client
        self.topic_filter = topic_filter
        shared = parse_shared(topic_filter)
        self.match_filter = shared[1] if shared else topic_filter
        self.qos = qos
        self.no_local = no_local
        self.auto_ack = auto_ack
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self.granted_qos: int | None = None
        self._ready: asyncio.Task[None] | None = None
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self.client._subscribe(self))
        if not self._ready.done():
            await self._ready
        self._ready.result()
        msg = await self.queue.get()
        if msg is None:
            raise StopAsyncIteration
        if self.auto_ack:
            await msg.ack()
        return msg

    async def start(self) -> Subscription:
        """Subscribe now (``async for`` does it on its first step); SubscribeFailed if refused."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self.client._subscribe(self))
        await self._ready
        return self

    async def unsubscribe(self) -> None:
        await self.client._unsubscribe(self)


class Batch:
    """``async with client.batch() as b: await b.publish(...)``: the publishes are sent as they come
    and waited for together at the end (``BatchFailed`` lists the ones that failed)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.futures: list[asyncio.Future[None]] = []

    async def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> None:
        self.futures.append(await self.client.enqueue(topic, payload, qos, retain))

    async def __aenter__(self) -> Batch:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None or not self.futures:
            return
        await asyncio.wait(self.futures)
        errors = {i: f.exception() for i, f in enumerate(self.futures) if f.exception() is not None}
        if errors:
            raise BatchFailed(errors, len(self.futures))  # type: ignore[arg-type]


class _Proto(asyncio.Protocol):
    def __init__(self, client: Client, decoder: Decoder) -> None:
        self.client = client
        self.decoder = decoder
        self.lost = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.server = ""  # "host:port", set before CONNECT is sent

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            packets = self.decoder.feed(data)
        except ProtocolError as exc:
            log.warning("closing the connection: the server sent a bad packet: %s", exc)
            if self.transport is not None:
                self.transport.abort()
            return
        self.client._last_rx = time.monotonic()
        handle = self.client._handle
        for pk in packets:
            handle(pk, self)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class Client:
    """One MQTT connection at a time to one of ``servers``; everything published is kept until
    acknowledged and resent after a reconnect. Use as ``async with Client([...]) as c:``."""

    def __init__(
        self,
        servers: Sequence[str] | str,
        *,
        client_id: str = "",
        username: str | None = None,
        password: str | bytes | None = None,
        tls: ssl.SSLContext | bool | None = None,
        protocol: Literal[4, 5] = 5,
        keepalive: int = 30,
        session_expiry: int = 0,
        clean_start: bool = True,
        receive_maximum: int = 100,
        max_inflight: int = 1000,
        publish_timeout: float = 30.0,
        connect_timeout: float = 15.0,
        close_timeout: float = 10.0,
        buffer: BufferLimits | None = None,
        spool: str | os.PathLike[str] | None = None,
        extras: bool = True,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
        on_metric: MetricHook | None = None,
    ) -> None:
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        if not self.servers:
            raise ValueError("at least one server address is needed")
        default_port = 8883 if tls else 1883
        self._addrs = [parse_server(s, default_port) for s in self.servers]
        if protocol not in (4, 5):
            raise ValueError("protocol must be 4 (MQTT 3.1.1) or 5")
        if not 1 <= receive_maximum <= 65535:
            raise ValueError("receive_maximum must be within 1..65535")
        if publish_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("publish_timeout and connect_timeout must be positive")
        if not 1 <= max_inflight <= 65000:
            raise ValueError("max_inflight must be within 1..65000 (MQTT packet identifiers)")
        self.client_id = client_id or "ml-" + os.urandom(8).hex()
        self.username = username
        self.password = password.encode() if isinstance(password, str) else password
        if tls is True:
            tls = ssl.create_default_context()
        self.tls: ssl.SSLContext | None = tls or None
        self.protocol = protocol
        self.keepalive = keepalive
        self.session_expiry = session_expiry
        self.clean_start = clean_start
        self.receive_maximum = receive_maximum
        self.max_inflight = max_inflight
        self.publish_timeout = publish_timeout
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.buffer = RetransmitBuffer(buffer or BufferLimits())
        self.spool_path = spool
        self.extras = extras and protocol == 5
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.on_metric = on_metric
        self.stats: dict[str, int] = dict.fromkeys(
            ("published", "acked", "refused", "timed_out", "expired", "resent", "connects", "disconnects",
             "received"), 0)
        self.connected = asyncio.Event()
        self.session_present = False
        self.server: str | None = None  # "host:port" of the current connection
        self._spool: Spool | None = None
        self._recovered: list[tuple[str, bytes]] = []
        self._streams: dict[str, list[Any]] = {}  # topic -> [producer, next seq]
        self._n = 0
        self._gen = 0
        self._proto: _Proto | None = None
        self._transport: asyncio.Transport | None = None
        self._inflight: dict[int, OutMessage] = {}
        self._unsent: deque[OutMessage] = deque()
        self._held: dict[str, int] = {}  # topic -> stale messages in flight
        self._deadlines: deque[tuple[float, OutMessage]] = deque()
        self._next_pid = 0
        self._server_rm = 65535
        self._max_qos = 2
        self._pump_scheduled = False
        self._pending_acks: dict[int, asyncio.Future[P.Packet]] = {}  # SUBSCRIBE/UNSUBSCRIBE pid -> ack
        self._in_qos2: set[int] = set()  # inbound QoS 2 pids with PUBREC sent
        self._subs: list[Subscription] = []
        self._unrouted: list[Message] = []
        self._server_idx = random.randrange(len(self._addrs))
        self._redirect: tuple[str, int] | None = None
        self._first = True
        self._closing = False
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._last_rx = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connack_waiter: asyncio.Future[P.Packet] | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def start(self, wait_connected: float | None = None) -> None:
        """Open the spool (if any), start connecting; with ``wait_connected``, wait that long for a
        first connection (the buffer holds publishes meanwhile)."""
        self._loop = asyncio.get_running_loop()
        if self.spool_path is not None:
            self._spool = Spool(self.spool_path)
            for sm in self._spool.open():
                self._recover(sm)
        self._tasks = [asyncio.ensure_future(self._supervise()), asyncio.ensure_future(self._ticker())]
        if wait_connected:
            try:
                await asyncio.wait_for(self.connected.wait(), wait_connected)
            except TimeoutError:
                pass

    def recovered(self) -> list[tuple[str, bytes]]:
        """The (topic, payload) of every message the spool held at start: sent again before anything new."""
        return list(self._recovered)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until the buffer is empty (True) or ``timeout`` passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.buffer.messages:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self.buffer.room.clear()
            try:
                await asyncio.wait_for(self.buffer.room.wait(), 0.05)
            except TimeoutError:
                pass
        return True

    async def close(self) -> None:
        """Wait up to ``close_timeout`` for the buffer to drain, then DISCONNECT. What is left is
        lost without a spool (a warning says how much) and kept in it with one."""
        if self._closed:
            return
        if self._loop is not None and self.buffer.messages and not self._closing:
            await self.flush(self.close_timeout)
        self._closing = True
        self._closed = True
        left = len(self.buffer)
        if left:
            if self._spool is not None:
                log.info("closing with %d unacknowledged messages kept in the spool", left)
            else:
                log.warning("closing with %d unacknowledged messages: they are lost (no spool)", left)
        if self._transport is not None:
            try:
                self._transport.write(encode(P.Disconnect(0), self.protocol))
            finally:
                self._transport.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        err = ClientClosed("client closed")
        for m in list(self.buffer.messages.values()):
            if m.future is not None and not m.future.done():
                m.future.set_exception(err)
                m.future.exception()  # retrieved: no "never retrieved" noise
        for sub in self._subs:
            sub.queue.put_nowait(None)
        for f in self._pending_acks.values():
            if not f.done():
                f.set_exception(err)
                f.exception()
        if self._spool is not None:
            self._spool.close()

    # ------------------------------------------------------------------------------------ publish
    async def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> None:
        """Resolves when the broker acknowledged (PUBACK, PUBCOMP; QoS 0: written to a connection);
        raises PublishRefused, PublishTimeout, MessageExpired, BufferFull or ClientClosed."""
        await (await self.enqueue(topic, payload, qos, retain))

    async def enqueue(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> asyncio.Future[None]:
        """Accept a message into the buffer (and spool) and return the future of its acknowledgement;
        ``publish`` is ``await (await enqueue(...))``. Returns once the message is accepted: with a
        spool, written to it (a crash of the process from then on loses nothing)."""
        if self._closing or self._loop is None:
            raise ClientClosed("client is closed" if self._closing else "client not started (use async with)")
        if isinstance(payload, str):
            payload = payload.encode()
        if qos not in (0, 1, 2):
            raise ValueError("qos must be 0, 1 or 2")
        err = topic_name_error(topic)
        if err:
            raise ValueError(f"bad topic {topic!r}: {err}")
        buf = self.buffer
        size = len(payload) + len(topic) + 64
        if not buf.fits(size):
            if buf.limits.when_full == "raise":
                raise BufferFull(f"retransmit buffer full ({len(buf)} messages, {buf.bytes} bytes)")
            deadline = self._loop.time() + self.publish_timeout
            while not buf.fits(size):
                left = deadline - self._loop.time()
                if left <= 0 or self._closing:
                    raise BufferFull(f"retransmit buffer full for {self.publish_timeout} s "
                                     f"({len(buf)} messages, {buf.bytes} bytes)")
                buf.room.clear()
                try:
                    await asyncio.wait_for(buf.room.wait(), left)
                except TimeoutError:
                    pass
        self._n += 1
        producer = seq = None
        if self.extras and qos > 0:
            st = self._streams.get(topic)
            if st is None:
                st = self._streams[topic] = [os.urandom(8), 1]
            producer, seq = st[0], st[1]
            st[1] = seq + 1
        loop = self._loop
        m = OutMessage(self._n, topic, payload, qos, retain, producer, seq, loop.time())
        if producer is not None:
            m.props = _props_for(producer, seq)  # type: ignore[arg-type]
        fut: asyncio.Future[None] = loop.create_future()
        m.future = fut
        if self._spool is not None and qos > 0:
            self._spool.append(SpooledMessage(m.n, topic, payload, qos, retain, producer, seq))
        buf.add(m)
        self._unsent.append(m)
        self._deadlines.append((m.accepted_at + self.publish_timeout, m))
        self.stats["published"] += 1
        if not self._pump_scheduled:
            self._pump_scheduled = True
            loop.call_soon(self._pump)
        return fut

    def batch(self) -> Batch:
        return Batch(self)

    def _recover(self, sm: SpooledMessage) -> None:
        self._n = max(self._n, sm.n)
        m = OutMessage(sm.n, sm.topic, sm.payload, sm.qos, sm.retain, sm.producer, sm.seq, asyncio.get_running_loop().time())
        m.sent = 1  # it may have been sent by the crashed process: DUP
        if sm.producer is not None and sm.seq is not None:
            if self.extras:
                m.props = _props_for(sm.producer, sm.seq)
                self._streams[sm.topic] = [sm.producer, sm.seq + 1]
            else:
                m.producer = m.seq = None
        self.buffer.add(m)
        self._unsent.append(m)
        self._recovered.append((sm.topic, sm.payload))

    # ------------------------------------------------------------------------------------ sending
    def _alloc_pid(self) -> int:
        pid = self._next_pid
        inflight = self._inflight
        while True:
            pid = pid % 65535 + 1
            if pid not in inflight and pid not in self._pending_acks:
                self._next_pid = pid
                return pid

    def _pump(self) -> None:
        """Send what is unsent, in order, while the server's Receive Maximum allows."""
        self._pump_scheduled = False
        t = self._transport
        if t is None or not self._unsent:
            return
        if self._spool is not None:
            self._spool.sync()
        limit = min(self._server_rm, self.max_inflight)
        inflight = self._inflight
        unsent = self._unsent
        held = self._held
        kept: deque[OutMessage] = deque()
        out: list[bytes] = []
        version = self.protocol
        resent = 0
        while unsent and len(inflight) < limit:
            m = unsent.popleft()
            if m.done or m.pid is not None:
                continue
            if held and m.topic in held:
                kept.append(m)
                continue
            if m.qos == 0:
                out.append(encode_publish_fast(m.topic.encode(), m.payload, 0, m.retain, False, None, version))
                self._complete(m)
                continue
            pid = self._alloc_pid()
            m.pid = pid
            inflight[pid] = m
            if m.sent:
                resent += 1
            out.append(encode_publish_fast(m.topic.encode(), m.payload, min(m.qos, self._max_qos), m.retain,
                                           m.sent > 0, pid, version, m.props))
            m.sent += 1
        if kept:
            kept.extend(unsent)
            self._unsent = kept
        if out:
            t.write(b"".join(out))
        if resent:
            self.stats["resent"] += resent
            self._metric("publish.resent", resent)

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _requeue(self, m: OutMessage) -> None:
        """Put a message back among the unsent, in its original place."""
        if m.done:
            return
        m.pid = None
        self._unsent = deque(x for x in self.buffer.messages.values() if x.pid is None and not x.done)
        self._schedule_pump()

    def _complete(self, m: OutMessage) -> None:
        if m.done:
            return
        m.done = True
        self.buffer.remove(m)
        if self._spool is not None and m.qos > 0:
            self._spool.acked(m.n)
        f = m.future
        if f is not None and not f.done():
            f.set_result(None)
        if m.qos > 0:
            self.stats["acked"] += 1
        if self.on_metric is not None:
            self.on_metric("publish.acked", self._loop.time() - m.accepted_at if self._loop else 0.0)

    def _drop(self, m: OutMessage, exc: Exception) -> None:
        m.done = True
        self.buffer.remove(m)
        if self._spool is not None and m.qos > 0:
            self._spool.acked(m.n)
        f = m.future
        if f is not None and not f.done():
            f.set_exception(exc)

    def _fail(self, m: OutMessage, exc: Exception, sent_may_apply: bool) -> None:
        """Give a message up. Later messages of its topic get a new producer sequence (the broker
        would refuse them as a gap): those that may have been applied under the old one are given up
        too when ``sent_may_apply`` (at most once), the others are re-sequenced in order."""
        if m.done:
            return
        self._drop(m, exc)
        if m.producer is None:
            return
        later = [x for x in self.buffer.messages.values() if x.topic == m.topic and x.n > m.n and not x.done]
        st = self._streams[m.topic] = [os.urandom(8), 1]
        for x in later:
            if sent_may_apply and x.sent:
                self.stats["expired"] += 1
                self._drop(x, MessageExpired(f"given up with an earlier message of {x.topic!r}"))
                continue
            x.producer, x.seq = st[0], st[1]
            st[1] += 1
            x.props = _props_for(x.producer, x.seq)
            if self._spool is not None:
                self._spool.append(SpooledMessage(x.n, x.topic, x.payload, x.qos, x.retain, x.producer, x.seq))
            if x.pid is not None and not x.stale:
                x.stale = True  # its old copy is in flight: held until its answer comes
                self._held[x.topic] = self._held.get(x.topic, 0) + 1

    # ------------------------------------------------------------------------------------ receiving
    def _handle(self, pk: P.Packet, proto: _Proto) -> None:
        if proto is not self._proto:
            return
        if isinstance(pk, P.Puback):
            m = self._inflight.pop(pk.packet_id, None)
            if m is not None:
                self._answered(m, pk.reason_code, pk.properties)
        elif isinstance(pk, P.Publish):
            self._on_publish(pk)
        elif isinstance(pk, P.Pubrec):
            pid = pk.packet_id
            m = self._inflight.get(pid)
            if pk.reason_code >= 0x80:
                self._inflight.pop(pid, None)
                if m is not None:
                    self._answered(m, pk.reason_code, pk.properties)
            else:
                if m is not None:
                    m.pubrec = True
                self._write(encode_ack(P.PUBREL, pid, 0 if m is not None else 0x92, self.protocol))
        elif isinstance(pk, P.Pubcomp):
            m = self._inflight.pop(pk.packet_id, None)
            if m is not None:
                self._answered(m, pk.reason_code, pk.properties)
        elif isinstance(pk, P.Pubrel):
            self._in_qos2.discard(pk.packet_id)
            self._write(encode_ack(P.PUBCOMP, pk.packet_id, 0, self.protocol))
        elif isinstance(pk, (P.Suback, P.Unsuback)):
            f = self._pending_acks.pop(pk.packet_id, None)
            if f is not None and not f.done():
                f.set_result(pk)
        elif isinstance(pk, P.Disconnect):
            ref = pk.properties.server_reference
            reason = pk.properties.reason_string or ""
            log.warning("%s disconnected us: 0x%02X %s%s", self.server, pk.reason_code, reason,
                        f" (use {ref})" if ref else "")
            self._take_reference(ref)
            if proto.transport is not None:
                proto.transport.close()
        elif isinstance(pk, P.Connack):
            w = self._connack_waiter
            if w is not None and not w.done():
                if pk.reason_code == 0:
                    self._connection_up(proto, pk)
                w.set_result(pk)

    def _answered(self, m: OutMessage, rc: int, props: P.Properties) -> None:
        m.pid = None
        if m.stale:
            m.stale = False
            n = self._held.get(m.topic, 0) - 1
            if n > 0:
                self._held[m.topic] = n
            else:
                self._held.pop(m.topic, None)
            if rc < 0x80:
                self._complete(m)  # applied under its old sequence after all
            else:
                self._requeue(m)  # refused as a gap, as expected: send it under the new one
            self._schedule_pump()
            return
        if rc < 0x80:
            self._complete(m)
        else:
            reason = props.reason_string or ""
            if rc == 0x97 and "gap" in reason and m.producer is not None:
                # An earlier message of the stream is not applied yet (it is on its way): again later.
                assert self._loop is not None
                self._loop.call_later(0.05, self._requeue, m)
            else:
                self.stats["refused"] += 1
                self._metric("publish.refused", 1)
                log.info("publish to %r refused: 0x%02X %s", m.topic, rc, reason)
                self._fail(m, PublishRefused(rc, reason), False)
        self._schedule_pump()

    def _on_publish(self, pk: P.Publish) -> None:
        self.stats["received"] += 1
        if pk.qos == 2 and pk.packet_id in self._in_qos2:
            self._write(encode_ack(P.PUBREC, pk.packet_id, 0, self.protocol))  # type: ignore[arg-type]
            return  # a resend of one already received and acknowledged
        msg = Message(self, pk, self._gen)
        for sub in self._subs:
            if matches(sub.match_filter, pk.topic):
                sub.queue.put_nowait(msg)
                return
        self._unrouted.append(msg)  # e.g. a resumed session's resends before subscribe() was called
        if len(self._unrouted) > 10_000:
            self._unrouted = [m for m in self._unrouted if m.qos > 0][-10_000:]

    def _ack_inbound(self, pid: int | None, qos: int, gen: int) -> None:
        if pid is None or gen != self._gen or self._transport is None:
            return
        if qos == 1:
            self._write(encode_ack(P.PUBACK, pid, 0, self.protocol))
        else:
            self._in_qos2.add(pid)
            self._write(encode_ack(P.PUBREC, pid, 0, self.protocol))

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _metric(self, name: str, value: float) -> None:
        if self.on_metric is not None:
            try:
                self.on_metric(name, value)
            except Exception:  # a hook's bug must not break the client
                log.exception("metrics hook failed for %s", name)

    # ------------------------------------------------------------------------------------ subscribe
    def subscribe(self, topic_filter: str, qos: int = 1, *, no_local: bool = False, auto_ack: bool = False) -> Subscription:
        """``async for msg in client.subscribe("a/#")``; each message needs ``await msg.ack()``
        unless ``auto_ack``."""
        err = topic_filter_error(topic_filter)
        if err:
            raise ValueError(f"bad topic filter {topic_filter!r}: {err}")
        if qos not in (0, 1, 2):
            raise ValueError("qos must be 0, 1 or 2")
        return Subscription(self, topic_filter, qos, no_local, auto_ack)

    async def _subscribe(self, sub: Subscription) -> None:
        if self._closing:
            raise ClientClosed("client is closed")
        if sub not in self._subs:
            self._subs.append(sub)
            keep = []
            for msg in self._unrouted:
                if matches(sub.match_filter, msg.topic):
                    sub.queue.put_nowait(msg)
                else:
                    keep.append(msg)
            self._unrouted = keep
        while True:
            await self.connected.wait()
            fut = self._send_subscribe(sub)
            try:
                ack = await asyncio.wait_for(fut, self.publish_timeout)
            except (TimeoutError, ConnectionError):
                continue  # the connection went: subscribe again on the next one
            assert isinstance(ack, P.Suback)
            rc = ack.reason_codes[0] if ack.reason_codes else 0x80
            if rc >= 0x80:
                self._subs.remove(sub)
                raise SubscribeFailed(sub.topic_filter, rc)
            sub.granted_qos = rc
            return

    def _send_subscribe(self, sub: Subscription) -> asyncio.Future[P.Packet]:
        assert self._loop is not None
        fut: asyncio.Future[P.Packet] = self._loop.create_future()
        pid = self._alloc_pid()
        self._pending_acks[pid] = fut
        opts = P.SubscriptionOptions(sub.qos, no_local=sub.no_local)
        self._write(encode(P.Subscribe(pid, ((sub.topic_filter, opts),)), self.protocol))
        return fut

    async def _unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
        sub.queue.put_nowait(None)
        if self._transport is not None and self._loop is not None:
            pid = self._alloc_pid()
            fut: asyncio.Future[P.Packet] = self._loop.create_future()
            self._pending_acks[pid] = fut
            self._write(encode(P.Unsubscribe(pid, (sub.topic_filter,)), self.protocol))
            try:
                await asyncio.wait_for(fut, self.publish_timeout)
            except (TimeoutError, ConnectionError):
                pass

    # ------------------------------------------------------------------------------------ connection
    def _take_reference(self, ref: str | None) -> None:
        if not ref:
            return
        try:
            self._redirect = parse_server(ref.split()[0], self._addrs[0][1])
        except ValueError:
            log.warning("ignoring a bad Server Reference %r", ref)

    def _next_addr(self) -> tuple[str, int]:
        if self._redirect is not None:
            addr, self._redirect = self._redirect, None
            return addr
        addr = self._addrs[self._server_idx % len(self._addrs)]
        return addr

    async def _supervise(self) -> None:
        delay = self.backoff_initial
        while not self._closing:
            host, port = self._next_addr()
            try:
                await self._connect(host, port)
            except (OSError, TimeoutError, _ConnectRefused, ProtocolError, EOFError) as exc:
                self._server_idx += 1  # the next server in the list
                log.warning("connecting to %s:%d failed: %s", host, port, str(exc) or type(exc).__name__)
                await asyncio.sleep(random.uniform(0, delay))  # full jitter
                delay = min(self.backoff_max, delay * 2)
                continue
            delay = self.backoff_initial
            proto = self._proto
            assert proto is not None
            self._on_lost(await proto.lost)
            if not self._closing:
                self._server_idx += 1  # after a lost connection: the next server
                await asyncio.sleep(random.uniform(0, self.backoff_initial))

    async def _connect(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        decoder = Decoder(256 * 1024 * 1024, role="client", version=self.protocol)
        proto = _Proto(self, decoder)
        self._connack_waiter = loop.create_future()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: proto, host, port, ssl=self.tls,
                                       server_hostname=host if self.tls else None),
                self.connect_timeout)
        except TimeoutError:
            raise TimeoutError(f"no TCP connection within {self.connect_timeout} s") from None
        self._proto = proto
        proto.server = f"{host}:{port}"
        props = P.NO_PROPERTIES
        if self.protocol == 5:
            props = P.Properties(session_expiry_interval=self.session_expiry or None,
                                 receive_maximum=self.receive_maximum if self.receive_maximum != 65535 else None)
        clean = self.clean_start if self._first else self.session_expiry == 0
        connect = P.Connect(protocol_level=self.protocol, client_id=self.client_id, clean_start=clean,
                            keepalive=self.keepalive, username=self.username, password=self.password,
                            properties=props)
        transport.write(encode(connect, self.protocol))  # type: ignore[attr-defined]
        try:
            waiter = self._connack_waiter
            assert waiter is not None
            done, _ = await asyncio.wait({waiter, proto.lost}, timeout=self.connect_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiter not in done:
                raise TimeoutError("no CONNACK" if not done else "connection closed before CONNACK")
            ack = waiter.result()
            assert isinstance(ack, P.Connack)
            if ack.reason_code != 0:
                self._take_reference(ack.properties.server_reference)
                raise _ConnectRefused(ack.reason_code, ack.properties.reason_string or "")
        except BaseException:
            self._proto = None
            transport.abort()
            raise
        finally:
            self._connack_waiter = None
        # Success: _connection_up ran as the CONNACK was read (see there).

    def _connection_up(self, proto: _Proto, ack: P.Connack) -> None:
        """A successful CONNACK, handled as it is read: the broker may send PUBLISHes (a resumed
        session's resends) right behind it, in the same read, and they belong to this connection
        (its generation, its transport), so their acks are sent."""
        self._first = False
        self._transport = proto.transport
        self.server = proto.server
        self.session_present = ack.session_present
        self._server_rm = ack.properties.receive_maximum or 65535
        self._max_qos = 2 if ack.properties.maximum_qos is None else ack.properties.maximum_qos
        self._gen += 1
        self._last_rx = time.monotonic()
        self.stats["connects"] += 1
        self._metric("connect", 1)
        log.info("connected to %s (session %s)", self.server, "resumed" if ack.session_present else "new")
        # Everything unacknowledged goes again, in its original order, before anything newer.
        self._inflight.clear()
        self._held.clear()
        self._in_qos2.clear()
        for m in self.buffer.messages.values():
            m.pid = None
            m.stale = False
            m.pubrec = False
        self._unsent = deque(self.buffer.messages.values())
        self._pump()
        self.connected.set()
        if not ack.session_present:
            for sub in self._subs:
                if sub._ready is not None and sub._ready.done() and sub.granted_qos is not None:
                    self._send_subscribe(sub).add_done_callback(self._resubscribed(sub))

    def _resubscribed(self, sub: Subscription) -> Callable[[asyncio.Future[P.Packet]], None]:
        def done(f: asyncio.Future[P.Packet]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            ack = f.result()
            if isinstance(ack, P.Suback) and ack.reason_codes and ack.reason_codes[0] >= 0x80:
                log.warning("subscription to %r refused on reconnect: 0x%02X", sub.topic_filter, ack.reason_codes[0])
        return done

    def _on_lost(self, exc: Exception | None) -> None:
        self.connected.clear()
        self._transport = None
        self._proto = None
        self._gen += 1  # acks of messages received on the lost connection are void
        for f in self._pending_acks.values():
            if not f.done():
                f.set_exception(ConnectionError("connection lost"))
                f.exception()
        self._pending_acks.clear()
        if not self._closing:
            self.stats["disconnects"] += 1
            self._metric("disconnect", 1)
            log.warning("connection to %s lost%s; %d messages unacknowledged", self.server,
                        f": {exc}" if exc else "", len(self.buffer))

    async def _ticker(self) -> None:
        """Publish timeouts, buffer age, keepalive."""
        loop = asyncio.get_running_loop()
        step = min(0.1, self.publish_timeout / 4)
        last_ping = time.monotonic()
        while True:
            await asyncio.sleep(step)
            now = loop.time()
            dl = self._deadlines
            while dl and (dl[0][1].done or dl[0][0] <= now):
                _, m = dl.popleft()
                f = m.future
                if not m.done and f is not None and not f.done():
                    self.stats["timed_out"] += 1
                    self._metric("publish.timeout", 1)
                    f.set_exception(PublishTimeout(f"not acknowledged within {self.publish_timeout} s "
                                                   f"(still buffered and resent until max_age)"))
            max_age = self.buffer.limits.max_age_s
            while True:
                m0 = self.buffer.oldest()
                if m0 is None or now - m0.accepted_at <= max_age:
                    break
                self.stats["expired"] += 1
                self._metric("publish.expired", 1)
                log.warning("message to %r not acknowledged within max_age %.0f s: given up", m0.topic, max_age)
                self._fail(m0, MessageExpired(f"not acknowledged within {max_age} s"), True)
                self._schedule_pump()
            mono = time.monotonic()
            if self.keepalive and self._transport is not None:
                if mono - self._last_rx > 1.5 * self.keepalive:
                    log.warning("no packet from %s for %.0f s: reconnecting", self.server, mono - self._last_rx)
                    self._transport.abort()
                elif mono - last_ping >= self.keepalive / 2:
                    last_ping = mono
                    self._write(b"\xc0\x00")  # PINGREQ



