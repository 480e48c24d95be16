"""An in-memory network with TCP's semantics, for whole nodes under the cluster simulator.

A connection delivers bytes in order or breaks. Each direction of a connection has a delivery
clock: bytes written at world time ``t`` arrive at ``max(t + delay, previous arrival)``, the delay
drawn per write from the seeded generator (so writes on different connections reorder, writes on
one never do). A partition is directional: bytes sent across a cut link wait (a cut TCP link hangs,
it does not reset) and arrive in order once it heals, unless the connection is reset meanwhile.
A crashed process's connections break: its peers read an error.

Two kinds of endpoints, matching what moorline uses:
- ``SimStream`` is the cluster transport's ``ByteStream`` (read / write / drain / close); model
  clients use it too;
- ``SimTransport`` is an ``asyncio.Transport`` driving a protocol, for the MQTT listener
  (``moorline.node.edge.connection.Connection`` is an asyncio protocol).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moorline.sim.cluster.vloop import Scheduler, VirtualLoop

Address = tuple[str, int]
CONNECT_TIMEOUT_S = 3.0  # a SYN across a cut link: refused after this, as a connect timeout would


@dataclass
class LinkDelay:
    base_s: float = 0.0005
    jitter_s: float = 0.002


@dataclass
class _Listener:
    loop: VirtualLoop
    address: Address
    on_stream: Callable[[SimStream], None] | None = None
    protocol_factory: Callable[[], asyncio.Protocol] | None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class SimNetwork:
    """Every process's view of the network. ``for_host(host, loop)`` is one process's seam."""

    def __init__(self, scheduler: Scheduler, rng: random.Random, delay: LinkDelay | None = None) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.delay = delay or LinkDelay()
        self.listeners: dict[Address, _Listener] = {}
        self.blocked: set[tuple[str, str]] = set()  # (from host, to host): bytes wait
        self.connections: list[_Connection] = []
        self._ports: dict[str, int] = {}
        self.bytes_delivered = 0

    # --- partitions -----------------------------------------------------------------------------
    def cut(self, a: str, b: str, both: bool = True) -> None:
        self.blocked.add((a, b))
        if both:
            self.blocked.add((b, a))

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        if a is None:
            self.blocked.clear()
        else:
            self.blocked.discard((a, b))  # type: ignore[arg-type]
            self.blocked.discard((b, a))  # type: ignore[arg-type]
        for conn in list(self.connections):
            conn.release_held()

    def release(self) -> None:
        """Bytes held on links no longer cut go on their way (after ``blocked`` changed)."""
        for conn in list(self.connections):
            conn.release_held()

    def is_blocked(self, a: str, b: str) -> bool:
        return (a, b) in self.blocked

    def crash_host(self, host: str) -> None:
        """Every connection with an end on ``host`` breaks; its listeners go."""
        for addr in [a for a in self.listeners if a[0] == host]:
            del self.listeners[addr]
        for conn in list(self.connections):
            if host in (conn.a.host, conn.b.host):
                conn.reset()

    def reset_random(self, rng: random.Random) -> None:
        live = [c for c in self.connections if not c.broken]
        if live:
            rng.choice(live).reset()

    # --- one process's seam ---------------------------------------------------------------------
    def for_host(self, host: str, loop: VirtualLoop) -> HostNetwork:
        return HostNetwork(self, host, loop)

    def _ephemeral_port(self, host: str) -> int:
        port = self._ports.get(host, 40000) + 1
        self._ports[host] = port
        return port

    def draw_delay(self) -> float:
        return self.delay.base_s + self.rng.random() * self.delay.jitter_s


class HostNetwork:
    """One process on one host: the cluster transport's ``Network`` (connect / listen), plus
    ``serve_protocol`` for an asyncio-protocol listener (the MQTT one)."""

    def __init__(self, net: SimNetwork, host: str, loop: VirtualLoop) -> None:
        self.net = net
        self.host = host
        self.loop = loop

    async def connect(self, host: str, port: int, local_host: str | None) -> SimStream:
        net = self.net
        me = local_host or self.host
        waited = 0.0
        while net.is_blocked(me, host) or net.is_blocked(host, me):
            if waited >= CONNECT_TIMEOUT_S:
                raise TimeoutError(f"connect {me} -> {host}:{port}: timed out (partitioned)")
            await asyncio.sleep(0.1)
            waited += 0.1
        await asyncio.sleep(net.draw_delay())  # the SYN's way there
        lst = net.listeners.get((host, port))
        if lst is None or lst.closed or lst.loop.crashed:
            raise ConnectionRefusedError(f"connect {me} -> {host}:{port}: refused")
        local: Address = (me, net._ephemeral_port(me))
        conn = _Connection(net)
        client = SimStream(conn, self.loop, local, (host, port))
        if lst.protocol_factory is not None:
            transport = SimTransport(conn, lst.loop, (host, port), local, lst.protocol_factory())
            conn.attach(client, transport)
            lst.loop.call_soon(transport.protocol.connection_made, transport)
        else:
            stream = SimStream(conn, lst.loop, (host, port), local)
            conn.attach(client, stream)
            assert lst.on_stream is not None
            lst.loop.call_soon(lst.on_stream, stream)
        net.connections.append(conn)
        return client

    async def listen(self, host: str, port: int, on_stream: Callable[[SimStream], None]) -> _Listener:
        lst = _Listener(self.loop, (host, port), on_stream=on_stream)
        self.net.listeners[(host, port)] = lst
        return lst

    def serve_protocol(self, host: str, port: int, factory: Callable[[], asyncio.Protocol]) -> _Listener:
        lst = _Listener(self.loop, (host, port), protocol_factory=factory)
        self.net.listeners[(host, port)] = lst
        return lst


class _End:
    """One side of a connection, living in one process's loop."""

    def __init__(self, conn: _Connection, loop: VirtualLoop, local: Address, remote: Address) -> None:
        self.conn = conn
        self.loop = loop
        self.local_address = local
        self.remote_address = remote
        self.host = local[0]
        self.closed = False  # this side closed it
        self.out = _Direction()  # what this side sends (set again by _Connection.attach)
        self.peer: _End = self

    def _deliver(self, data: bytes) -> None:
        raise NotImplementedError

    def _eof(self) -> None:
        raise NotImplementedError

    def _broken(self) -> None:
        raise NotImplementedError


@dataclass
class _Direction:
    arrive_at: float = 0.0
    held: deque[bytes | None] = field(default_factory=deque)  # None: the sender's close (EOF)
    # In flight, in order: (arrival world time, bytes). Each arrival's timer delivers the head of
    # this queue, never "its own" bytes: timers due at the same instant may run in any order.
    flight: deque[tuple[float, bytes | None]] = field(default_factory=deque)


class _Connection:
    def __init__(self, net: SimNetwork) -> None:
        self.net = net
        self.broken = False
        self.a: _End
        self.b: _End

    def attach(self, a: _End, b: _End) -> None:
        self.a, self.b = a, b
        a.peer, b.peer = b, a
        a.out, b.out = _Direction(), _Direction()

    def other(self, end: _End) -> _End:
        return end.peer

    def send(self, src: _End, data: bytes | None) -> None:
        """``data`` from ``src`` to its peer (``None``: end of stream)."""
        if self.broken:
            return
        d = src.out
        dst = src.peer
        if d.held or (src.host, dst.host) in self.net.blocked:
            d.held.append(data)
            return
        self._schedule(src, dst, d, data)

    def _schedule(self, src: _End, dst: _End, d: _Direction, data: bytes | None) -> None:
        net = self.net
        delay = net.delay
        at = net.scheduler.now + (delay.base_s + net.rng.random() * delay.jitter_s)  # draw_delay()
        if at < d.arrive_at:
            at = d.arrive_at
        d.arrive_at = at
        loop = dst.loop
        if loop.crashed:
            return
        d.flight.append((at, data))
        loop.call_at(at * loop.rate, self._arrive, dst, d)

    def _arrive(self, dst: _End, d: _Direction) -> None:
        if not d.flight:
            return
        _, data = d.flight.popleft()
        if self.broken or dst.closed:
            return
        if data is None:
            dst._eof()
        else:
            self.net.bytes_delivered += len(data)
            dst._deliver(data)

    def release_held(self) -> None:
        if self.broken:
            return
        for src in (self.a, self.b):
            d = src.out
            dst = src.peer
            while d.held and not self.net.is_blocked(src.host, dst.host):
                self._schedule(src, dst, d, d.held.popleft())

    def reset(self) -> None:
        if self.broken:
            return
        self.broken = True
        if self in self.net.connections:
            self.net.connections.remove(self)
        for end in (self.a, self.b):
            if not end.loop.crashed and not end.closed:
                end.loop.call_soon(end._broken)

    def closed_by(self, end: _End) -> None:
        self.send(end, None)
        if self.a.closed and self.b.closed and self in self.net.connections:
            self.net.connections.remove(self)


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SimStream(_End):
    """``moorline.cluster.net.ByteStream`` over the simulated network."""

    def __init__(self, conn: _Connection, loop: VirtualLoop, local: Address, remote: Address) -> None:
        super().__init__(conn, loop, local, remote)
        self._buf = bytearray()
        self._eof_seen = False
        self._error: OSError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _deliver(self, data: bytes) -> None:
        self._buf += data
        self._wake()

    def _eof(self) -> None:
        self._eof_seen = True
        self._wake()

    def _broken(self) -> None:
        self._error = ConnectionResetError("connection reset (simulated)")
        self._wake()

    async def read(self, max_bytes: int) -> bytes:
        while not self._buf:
            if self._error is not None:
                raise self._error
            if self._eof_seen or self.closed:
                return b""
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        buf = self._buf
        if len(buf) <= max_bytes:
            out = bytes(buf)
            buf.clear()
        else:
            out = bytes(buf[:max_bytes])
            del buf[:max_bytes]
        return out

    async def read_within(self, max_bytes: int, timeout_s: float) -> bytes | None:
        """``read``, or None when nothing came for ``timeout_s`` (``asyncio.wait_for`` on ``read``
        without its task and cancellation: a model client reads thousands of times a seed)."""
        if not self._buf and self._error is None and not self._eof_seen and not self.closed:
            waiter = self.loop.create_future()
            self._waiter = waiter
            timer = self.loop.call_later(timeout_s, _time_out, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._buf and self._error is None and not self._eof_seen and not self.closed:
                return None
        return await self.read(max_bytes)

    def write(self, data: bytes | memoryview) -> None:
        if self.closed or self._error is not None:
            return
        self.conn.send(self, bytes(data))

    async def drain(self) -> None:
        if self._error is not None:
            raise self._error
        await asyncio.sleep(0)

    def write_blocked(self) -> bool:
        # Never: the simulated network takes every byte at once (a cut link holds them, as a
        # socket's buffer would until it filled). As on a real socket with room, a frame written
        # is not followed by a drain; a reset shows on the next read or write. (It was always
        # True, a drain and a timer per frame sent: one scheduler step in six.)
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.closed_by(self)
            self._wake()


class SimTransport(_End, asyncio.Transport):
    """An ``asyncio.Transport`` over the simulated network, for a protocol-based listener."""

    def __init__(self, conn: _Connection, loop: VirtualLoop, local: Address, remote: Address,
                 protocol: asyncio.Protocol) -> None:
        _End.__init__(self, conn, loop, local, remote)
        asyncio.Transport.__init__(self)
        self.protocol = protocol
        self._paused = False
        self._pending: deque[bytes] = deque()
        self._lost = False
        self._eof_written = False

    # network side
    def _deliver(self, data: bytes) -> None:
        if self._lost:
            return
        if self._paused:
            self._pending.append(data)
        else:
            self.protocol.data_received(data)

    def _eof(self) -> None:
        if not self._lost:
            self.protocol.eof_received()
            self._lose(None)

    def _broken(self) -> None:
        self._lose(ConnectionResetError("connection reset (simulated)"))

    def _lose(self, exc: Exception | None) -> None:
        if not self._lost:
            self._lost = True
            self.closed = True
            self.protocol.connection_lost(exc)

    # asyncio.Transport
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.remote_address, "sockname": self.local_address}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.closed_by(self)
            self.loop.call_soon(self._lose, None)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.reset()
            self.loop.call_soon(self._lose, None)

    def write(self, data: Any) -> None:
        if not self.closed and not self._eof_written:
            self.conn.send(self, bytes(data))

    # A half-close, as TCP's shutdown(SHUT_WR): the peer reads what was written, then EOF; this
    # side still reads (a draining node closes connections so: Connection.close_after_goodbye).
    # Without it a drained 3.1.1 client saw no end until the node closed the socket for good
    # (seed 74186: 4.3 s later, a stale_owner production's FIN would not have shown).
    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if not self.closed and not self._eof_written:
            self._eof_written = True
            self.conn.send(self, None)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(bytes(d) for d in list_of_data))

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        while self._pending and not self._paused and not self._lost:
            self.protocol.data_received(self._pending.popleft())

    def is_reading(self) -> bool:
        return not self._paused

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        return None
