"""MQTT over WebSocket (``listeners.ws`` / ``listeners.wss``): aiohttp's WebSocket server on path
``/mqtt``, subprotocol ``mqtt``, feeding the same MQTT ``Connection`` as a TCP socket does.

The ``Connection`` is an asyncio Protocol, so ``WebSocketTransport`` gives it what it uses of a
transport over an aiohttp ``WebSocketResponse``. MQTT packets may be split across binary frames or
joined in one anywhere (MQTT-6.0.0-2): received frames are fed to the connection as stream bytes, and
what it writes leaves in frames of up to ``FRAME_BYTES``, joined as they queue. Back-pressure is the
TCP listener's: writes queue here while the socket drains; past the high-water mark the protocol's
``pause_writing`` stops deliveries, below a quarter of it ``resume_writing`` starts them again, and
``get_write_buffer_size`` (the queue plus the socket's own buffer) is what ``mqtt.max_write_buffer_bytes``
bounds (the queue counts while the socket's buffer is full, as a TCP transport counts what the kernel
did not take). ``pause_reading`` stops taking frames from aiohttp, whose bounded queue then stops
reading the socket. Text frames are refused (MQTT-6.0.0-1).

Each socket of these listeners is admitted (rate, pending cap) before its HTTP request is read and
must complete the upgrade within ``mqtt.connect_timeout_s`` (``moorline.node.edge.tls.AdmittingListener``).
Until its CONNECT is accepted a socket may send at most ``mqtt.max_connect_packet_bytes`` plus
``UPGRADE_ALLOWANCE`` (the upgrade request and frame headers) in all: aiohttp reads a whole frame
(up to twice ``mqtt.max_packet_size``) before handing it over, so the raw bytes are counted under it
(``PreConnectLimit``) and a socket past the bound is dropped.

The upgrade is refused (403) for a browser page of another site: an ``Origin`` header must be one of
``listeners.ws_allowed_origins`` ("*": any) or, when that is empty, name the host the request was sent
to; and the ``Host`` must be this node's (an IP address, ``localhost``, the listener's host or one of
``http.allowed_hosts``), so DNS rebinding cannot make a page same-host: checked for upgrades arriving
on a loopback address, and for all once ``http.allowed_hosts`` is set. Clients that send no Origin
(MQTT libraries, not browsers) are not affected.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

if TYPE_CHECKING:
    from moorline.node.edge.connection import Connection
    from moorline.node.edge.server import MqttServer

log = logging.getLogger("moorline.ws")

WS_PATH = "/mqtt"
SUBPROTOCOL = "mqtt"
FRAME_BYTES = 256 << 10  # queued writes are joined into binary frames of at most about this size
UPGRADE_ALLOWANCE = 16 << 10  # the HTTP upgrade request (aiohttp caps its headers at 8 KiB) and frame headers


def _host_of(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class PreConnectLimit(asyncio.Protocol):
    """Stands in front of aiohttp's request handler on one socket and counts the bytes read until the
    MQTT connection's CONNECT is accepted; past ``limit`` the socket is dropped (module docstring)."""

    def __init__(self, inner: asyncio.Protocol, conn: Connection, limit: int) -> None:
        self.inner = inner
        self.conn = conn
        self.limit = limit
        self.received = 0
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.limit:
            if self.conn.live is not None:
                self.limit = 0  # CONNECT accepted: from here the MQTT limits rule
            else:
                self.received += len(data)
                if self.received > self.limit:
                    self.conn.server.log_client(
                        log, logging.INFO, self.conn.peer.rpartition(":")[0], "%s: %d bytes over WebSocket before "
                        "CONNECT was accepted (limit %d): closing", self.conn.peer, self.received, self.limit)
                    self.limit = 0
                    self.conn._closing = True
                    if self.transport is not None:
                        self.transport.abort()  # type: ignore[attr-defined]
                    return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class WebSocketTransport(asyncio.Transport):
    """A transport for one MQTT ``Connection`` over one WebSocket (module docstring)."""

    def __init__(self, ws: Any, raw: asyncio.BaseTransport) -> None:
        super().__init__()
        self._ws = ws  # aiohttp WebSocketResponse (or a stand-in with send_bytes/close)
        self._raw = raw  # the TCP or TLS transport under the HTTP request
        self._protocol: asyncio.Protocol | None = None
        self._queue: deque[bytes] = deque()
        self._queued = 0  # bytes in _queue
        self._sending = False  # the pump waits for the socket to drain (frames handed over are in its buffer)
        self._high = 64 << 10
        self._low = 16 << 10
        self._writing_paused = False
        self._closing = False
        self._aborted = False
        self._wake = asyncio.Event()
        self.reading = asyncio.Event()  # set while the handler may take the next frame
        self.reading.set()
        self._pump_task: asyncio.Task[None] | None = None
        self.pump_done = asyncio.Event()

    def start(self, protocol: asyncio.Protocol) -> None:
        self._protocol = protocol
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        protocol.connection_made(self)

    # --- what Connection uses ------------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._raw.get_extra_info(name, default)  # peername, socket, peercert, ssl_object, ...

    def is_closing(self) -> bool:
        return self._closing or self._raw.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        if data:
            self._queue.append(bytes(data))
            self._queued += len(data)
            self._wake.set()
            self._check_high()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def get_write_buffer_size(self) -> int:
        # As a TCP transport counts only what the kernel did not take: the queue counts while the
        # socket's buffer is full (the pump waits for it to drain); otherwise it leaves this pass.
        return (self._queued if self._sending else 0) + self._raw_buffer()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 4 * low if low is not None else 64 << 10
        if low is None:
            low = high // 4
        self._high, self._low = high, low
        self._check_high()

    def pause_reading(self) -> None:
        self.reading.clear()

    def resume_reading(self) -> None:
        self.reading.set()

    def is_reading(self) -> bool:
        return self.reading.is_set()

    def close(self) -> None:
        """Send what is queued, then a close frame (the client's answer awaited listeners.ws_close_timeout_s)."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()

    def abort(self) -> None:
        """Drop what is queued and the socket at once."""
        self._closing = True
        self._aborted = True
        self._queue.clear()
        self._queued = 0
        self._raw.abort()  # type: ignore[attr-defined]
        self._wake.set()
        self.reading.set()  # the handler's wait ends; its receive sees the socket gone

    # --- internals -----------------------------------------------------------------------------
    def _raw_buffer(self) -> int:
        try:
            return int(self._raw.get_write_buffer_size())  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            return 0

    def _check_high(self) -> None:
        if not self._writing_paused and self._protocol is not None and self.get_write_buffer_size() > self._high:
            self._writing_paused = True
            self._protocol.pause_writing()

    def _check_low(self) -> None:
        if self._writing_paused and self._protocol is not None and self.get_write_buffer_size() <= self._low:
            self._writing_paused = False
            self._protocol.resume_writing()

    async def _pump(self) -> None:
        """The one task that sends frames, in order; ends after the close frame or on abort."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue and not self._aborted:
                    parts: list[bytes] = []
                    size = 0
                    while self._queue and size < FRAME_BYTES:
                        part = self._queue.popleft()
                        parts.append(part)
                        size += len(part)
                    self._queued -= size  # written to the socket's buffer before any wait
                    self._sending = True
                    self._check_high()  # the queue counts now, should the socket not take the frame
                    try:
                        await self._ws.send_bytes(parts[0] if len(parts) == 1 else b"".join(parts))  # drains
                    finally:
                        self._sending = False
                    if self._aborted:
                        return
                    self._check_low()
                if self._aborted:
                    return
                if self._closing:
                    await self._ws.close(code=1000)
                    return
        except (TimeoutError, ConnectionError, RuntimeError, OSError):
            self._closing = True  # the socket went away under a send: the handler's receive ends too
            if not self._raw.is_closing():
                self._raw.abort()  # type: ignore[attr-defined]
        finally:
            self.pump_done.set()
            self.reading.set()


class WebSocketListeners:
    """The aiohttp app behind ``listeners.ws`` and ``listeners.wss``: one route, ``GET /mqtt``."""

    def __init__(self, server: MqttServer) -> None:
        self.server = server
        cfg = server.node.cfg.mqtt
        # A frame may join packets: allow two of the largest packet, then close (1009) past that.
        self.max_frame_bytes = 2 * cfg.max_packet_size + 16
        self.close_timeout_s = server.node.cfg.listeners.ws_close_timeout_s
        self.pre_connect_limit = cfg.max_connect_packet_bytes + UPGRADE_ALLOWANCE
        ncfg = server.node.cfg
        self.any_origin = "*" in ncfg.listeners.ws_allowed_origins
        self.allowed_origins = {o.strip().lower().rstrip("/") for o in ncfg.listeners.ws_allowed_origins}
        self.own_names = {"localhost"} | {_host_of(h) for h in ncfg.http.allowed_hosts}
        self.check_all_hosts = bool(ncfg.http.allowed_hosts)
        for listener in (ncfg.listeners.ws, ncfg.listeners.wss):
            if listener:
                self.own_names.add(_host_of(listener.rpartition(":")[0].strip("[]") or "127.0.0.1"))
        # The MQTT connection admitted with each socket, by the socket's aiohttp request handler, until
        # the upgrade claims it (or the socket expires: AdmittingListener).
        self.admitted: dict[asyncio.BaseProtocol, Connection] = {}
        self.app = web.Application()
        self.app.router.add_get(WS_PATH, self.handle)
        self.handlers: Any = None  # the runner's web.Server, set once the runner is set up

    def make_protocol(self, conn: Connection) -> asyncio.BaseProtocol:
        handler: asyncio.Protocol = self.handlers()
        self.admitted[handler] = conn
        return PreConnectLimit(handler, conn, self.pre_connect_limit)

    def refusal(self, request: web.Request) -> str | None:
        """Why a browser page may not open this WebSocket (module docstring), or None."""
        from moorline.node.admin.http_api import arrived_on_loopback

        host = request.headers.get("Host")
        if (host and (self.check_all_hosts or arrived_on_loopback(request))
                and not (_host_of(host) in self.own_names or _is_ip(_host_of(host)))):
            return "this node does not serve that Host name (http.allowed_hosts)"
        origin = request.headers.get("Origin")
        if origin is None or self.any_origin:
            return None
        origin = origin.strip().lower().rstrip("/")
        if origin in self.allowed_origins:
            return None
        _, sep, authority = origin.partition("://")
        if not self.allowed_origins and sep and host and _host_of(authority) == _host_of(host):
            return None  # a page of the same host
        return "Origin not allowed (listeners.ws_allowed_origins)"

    def on_expired(self, conn: Connection) -> None:
        for handler, c in list(self.admitted.items()):
            if c is conn:
                del self.admitted[handler]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = request.transport
        conn = self.admitted.pop(request.protocol, None)
        if conn is None or conn._closing or raw is None:
            # A second request on a socket whose connection was used or expired.
            return web.Response(status=400, text="one MQTT connection per socket\n")
        if (why := self.refusal(request)) is not None:
            conn._closing = True
            self.server.log_client(log, logging.INFO, request.remote or "", "%s: WebSocket upgrade refused: %s "
                                   "(Origin %r, Host %r)", request.remote, why, request.headers.get("Origin"),
                                   request.headers.get("Host"))
            return web.Response(status=403, text=why + "\n")
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), compress=False, max_msg_size=self.max_frame_bytes,
                                   timeout=self.close_timeout_s, autoping=True, heartbeat=None)
        ready = ws.can_prepare(request)
        if not ready.ok or ready.protocol != SUBPROTOCOL:
            conn._closing = True
            return web.Response(status=400, text="expected a WebSocket upgrade offering subprotocol 'mqtt'\n")
        await ws.prepare(request)
        transport = WebSocketTransport(ws, raw)
        transport.start(conn)
        try:
            while not transport._aborted:
                await transport.reading.wait()
                if transport._aborted:
                    break
                msg = await ws.receive()
                if msg.type is WSMsgType.BINARY:
                    conn.data_received(msg.data)
                elif msg.type is WSMsgType.TEXT:
                    self.server.log_client(log, logging.INFO, conn.peer.rpartition(":")[0],
                                           "%s: text frame on MQTT over WebSocket: closing (MQTT-6.0.0-1)", conn.peer)
                    conn.abort("text frame")
                    break
                else:  # CLOSE, CLOSING, CLOSED, ERROR (an oversized frame: 1009 already sent)
                    break
        finally:
            transport._closing = True
            transport._wake.set()
            try:
                await asyncio.wait_for(transport.pump_done.wait(), self.close_timeout_s + 1.0)
            except TimeoutError:
                transport.abort()
            conn.connection_lost(None)
        return ws
