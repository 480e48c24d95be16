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


class ClientClosed(Exception):
    """The connection ended (broken, closed by the broker, or unusable)."""


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
                chunk = await asyncio.wait_for(self.stream.read(65536), timeout_s)
            except TimeoutError:
                return None
            except OSError as exc:
                self.closed = True
                raise ClientClosed(str(exc)) from None
            if not chunk:
                self.closed = True
                raise ClientClosed("closed by the broker")
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
