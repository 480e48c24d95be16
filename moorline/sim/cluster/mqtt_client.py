"""A model MQTT client for the cluster simulator: the real codec (moorline.mqtt) over a simulated
stream. It frames packets, answers the broker's QoS handshakes and hands every packet to its
owner; what to send and what to record is the workload's business (``workload.py``)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from moorline.mqtt.codec import Decoder, encode
from moorline.mqtt.errors import ProtocolError
from moorline.mqtt.packets import Packet
from moorline.sim.cluster.vnet import HostNetwork, SimStream

MAX_PACKET_BYTES = 1 << 20


CLOSED_BY_BROKER = "closed by the broker"  # the broker closed the connection in order (EOF), no reset


class ClientClosed(Exception):
    """The connection ended (broken, closed by the broker, or unusable)."""


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Changed:
    """A model client's "something happened" flag: ``asyncio.Event`` with a timed wait, at one
    loop callback per wake-up. (``asyncio.wait_for(event.wait(), t)`` wraps the wait in a task
    and cancels it on timeout: five or six callbacks each time, and the model clients wait
    hundreds of thousands of times a seed.)"""

    __slots__ = ("_flag", "_waiters")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[asyncio.Future[None]] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    def clear(self) -> None:
        self._flag = False

    async def wait(self, timeout_s: float) -> None:
        """Until set, or ``timeout_s`` passed (no error either way)."""
        if self._flag:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(timeout_s, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiters.remove(fut)


class ClientConnection:
    """One MQTT connection of a model client."""

    def __init__(self, stream: SimStream, version: int) -> None:
        self.stream = stream
        self.version = version
        # The codec's own incremental decoder frames what the broker sends.
        self._decoder = Decoder(MAX_PACKET_BYTES, role="client", version=version)
        self._packets: deque[Packet] = deque()
        self.closed = False

    @classmethod
    async def open(cls, net: HostNetwork, host: str, port: int, version: int = 5) -> ClientConnection:
        try:
            stream = await net.connect(host, port, None)
        except OSError as exc:
            raise ClientClosed(f"connect {host}:{port}: {exc}") from None
        return cls(stream, version)

    def send(self, packet: Packet) -> None:
        if self.closed:
            raise ClientClosed("closed")
        self.stream.write(encode(packet, self.version))

    async def recv(self, timeout_s: float) -> Packet | None:
        """The next packet, or None after ``timeout_s`` without one. ClientClosed when it ends."""
        while True:
            if self._packets:
                return self._packets.popleft()
            if self.closed:
                raise ClientClosed("closed")
            try:
                chunk = await self.stream.read_within(65536, timeout_s)
            except OSError as exc:
                self.closed = True
                raise ClientClosed(str(exc)) from None
            if chunk is None:
                return None  # timed out
            if not chunk:
                self.closed = True
                raise ClientClosed(CLOSED_BY_BROKER)
            try:
                self._packets.extend(self._decoder.feed(chunk))
            except ProtocolError as exc:
                self.close()
                raise ClientClosed(f"malformed packet from the broker: {exc}") from None

    async def expect(self, want: Callable[[Packet], bool], timeout_s: float,
                     other: Callable[[Packet], None]) -> Packet | None:
        """Packets until one ``want`` accepts (returned) or ``timeout_s`` passes (None); every
        other packet goes to ``other`` (deliveries arriving meanwhile)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return None
            p = await self.recv(left)
            if p is None:
                return None
            if want(p):
                return p
            other(p)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.close()
