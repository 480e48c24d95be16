"""A minimal blocking MQTT 5 subscriber on a raw socket, recording every packet-level event.

Why not paho for subscribers: the checker needs what the application cannot see through paho's
callbacks (every received PUBLISH with its packet id and DUP flag, when PUBREL released a packet id),
and a QoS 2 receiver that follows "Method B" (MQTT 5 figure 4.3): it passes a message on when the
PUBLISH first arrives, remembers the packet id until PUBREL, and treats any PUBLISH with a remembered
packet id as a resend. A broker reusing a packet id too early makes such a receiver drop a message;
the history keeps that PUBLISH so verify reports the misuse.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from moorline.verify.history import HistoryWriter

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14
MAX_PACKET_BYTES = 1 << 20


class Endpoint(NamedTuple):
    """Where a client connects: a node's MQTT listener, and the node's name for the history."""

    host: str
    port: int
    node: str = "n1"


class WireError(Exception):
    """The connection is unusable (closed, timed out, or the peer sent something we cannot parse)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("!H", len(b)) + b


def _packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([(kind << 4) | flags]) + _varint(len(body)) + body


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    mult, value = 1, 0
    for _ in range(4):
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        value += (b & 0x7F) * mult
        if not b & 0x80:
            return value, pos
        mult *= 128
    raise WireError("varint too long")


def _user_properties(props: bytes) -> dict[str, str]:
    """Parse an MQTT 5 property block, keeping only user properties (0x26)."""
    out: dict[str, str] = {}
    pos = 0
    fixed = {0x01: 1, 0x02: 4, 0x23: 2, 0x0B: -1}  # payload format, expiry, topic alias, sub id (varint)
    while pos < len(props):
        pid = props[pos]
        pos += 1
        if pid == 0x26:
            k_len = struct.unpack_from("!H", props, pos)[0]
            k = props[pos + 2 : pos + 2 + k_len].decode()
            pos += 2 + k_len
            v_len = struct.unpack_from("!H", props, pos)[0]
            v = props[pos + 2 : pos + 2 + v_len].decode()
            pos += 2 + v_len
            out[k] = v
        elif pid in fixed:
            if fixed[pid] == -1:
                _, pos = _read_varint(props, pos)
            else:
                pos += fixed[pid]
        elif pid in (0x03, 0x08):  # content type, response topic: UTF-8 string
            pos += 2 + struct.unpack_from("!H", props, pos)[0]
        elif pid == 0x09:  # correlation data: binary
            pos += 2 + struct.unpack_from("!H", props, pos)[0]
        else:
            raise WireError(f"unexpected PUBLISH property 0x{pid:02x}")
    return out


@dataclass
class Subscription:
    filter: str
    qos: int
    share_group: str | None = None
    no_local: bool = False

    @property
    def wire_filter(self) -> str:
        return f"$share/{self.share_group}/{self.filter}" if self.share_group else self.filter


@dataclass
class Subscriber:
    """One persistent MQTT 5 session; ``run()`` keeps it connected until ``stop()`` returns True."""

    client_id: str
    endpoint: Callable[[], Endpoint]  # asked at every connect: a cluster's clients move between nodes
    history: HistoryWriter
    subscriptions: list[Subscription]
    session_expiry_s: int = 3600
    receive_maximum: int = 32
    keepalive_s: int = 20
    connect_timeout_s: float = 3.0
    node: str = "n1"
    deliveries: int = 0  # application deliveries seen (for drain detection)
    last_delivery_mono: float = field(default_factory=time.monotonic)
    connected: bool = False
    _sock: socket.socket | None = None
    _buf: bytes = b""
    _held: dict[int, str | None] = field(default_factory=dict)  # Method B: packet id -> guid until PUBREL
    _ever_connected: bool = False
    _last_send: float = 0.0

    # ---------------------------------------------------------------- recording helpers
    def _rec(self, type: str, op: str, **kw: object) -> None:
        self.history.record(type, op, process=self.client_id, session=self.client_id, node=self.node, **kw)

    # ---------------------------------------------------------------- socket helpers
    def _send(self, data: bytes) -> None:
        if self._sock is None:
            raise WireError("not connected")
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise WireError(str(exc)) from exc

    def _read_packet(self, timeout_s: float) -> tuple[int, int, bytes] | None:
        """One packet (type, flags, body), or None when nothing arrived within ``timeout_s``."""
        if self._sock is None:
            raise WireError("not connected")
        deadline = time.monotonic() + timeout_s
        while True:
            if len(self._buf) >= 2:
                try:
                    length, pos = _read_varint(self._buf, 1)
                except WireError:
                    if len(self._buf) < 5:
                        length, pos = -1, 0
                    else:
                        raise
                if length > MAX_PACKET_BYTES:
                    raise WireError("packet too large")
                if length >= 0 and len(self._buf) >= pos + length:
                    first = self._buf[0]
                    body = self._buf[pos : pos + length]
                    self._buf = self._buf[pos + length :]
                    return first >> 4, first & 0x0F, body
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                return None
            except OSError as exc:
                raise WireError(str(exc)) from exc
            if not chunk:
                raise WireError("connection closed by peer")
            self._buf += chunk

    def close(self, clean: bool) -> None:
        if self._sock is not None:
            if clean:
                try:
                    self._sock.sendall(_packet(DISCONNECT, 0, b"\x00\x00"))
                except OSError:
                    pass
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._buf = b""
        if self.connected:
            if clean:
                self._rec("ok", "disconnect")
            else:
                self._rec("info", "disconnect", reason="connection lost")
        self.connected = False

    # ---------------------------------------------------------------- protocol
    def connect(self) -> bool:
        """Connect (clean start only the very first time); subscribe when the session is new."""
        clean_start = not self._ever_connected
        host, port, self.node = self.endpoint()
        self._rec("invoke", "connect", clean_start=clean_start, session_expiry=self.session_expiry_s)
        try:
            self._sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            self._sock = None
            self._rec("fail", "connect", reason="refused", detail=str(exc))
            return False
        props = (
            b"\x11"
            + struct.pack("!I", self.session_expiry_s)
            + b"\x21"
            + struct.pack("!H", self.receive_maximum)
        )
        flags = 0x02 if clean_start else 0x00
        body = _str("MQTT") + bytes([5, flags]) + struct.pack("!H", self.keepalive_s)
        body += _varint(len(props)) + props + _str(self.client_id)
        try:
            self._send(_packet(CONNECT, 0, body))
            pkt = self._read_packet(self.connect_timeout_s)
        except WireError as exc:
            self.close(clean=False)
            self._rec("fail", "connect", reason="error", detail=str(exc))
            return False
        if pkt is None or pkt[0] != CONNACK or len(pkt[2]) < 2 or pkt[2][1] >= 0x80:
            reason = (
                "timeout" if pkt is None else f"connack {pkt[2][1:2].hex() if pkt[0] == CONNACK else pkt[0]}"
            )
            self.close(clean=False)
            self._rec("fail", "connect", reason=reason)
            return False
        present = bool(pkt[2][0] & 0x01)
        self.connected = True
        self._ever_connected = True
        self._rec("ok", "connect", session_present=present)
        self._last_send = time.monotonic()
        if not present:
            self._held.clear()  # a new session: nothing is in flight any more
            return self._subscribe()
        return True

    def _subscribe(self) -> bool:
        body = struct.pack("!H", 1) + b"\x00"  # packet id 1, no properties
        for s in self.subscriptions:
            self._rec(
                "invoke",
                "subscribe",
                filter=s.filter,
                qos=s.qos,
                share_group=s.share_group,
                no_local=s.no_local,
            )
            body += _str(s.wire_filter) + bytes([s.qos | (0x04 if s.no_local else 0)])
        try:
            self._send(_packet(SUBSCRIBE, 0x02, body))
            deadline = time.monotonic() + self.connect_timeout_s
            while time.monotonic() < deadline:
                pkt = self._read_packet(deadline - time.monotonic())
                if pkt is None:
                    break
                if pkt[0] == SUBACK:
                    return self._on_suback(pkt[2])
                self._handle(pkt)
        except WireError as exc:
            self.close(clean=False)
            for s in self.subscriptions:
                self._rec("info", "subscribe", filter=s.filter, share_group=s.share_group, reason=str(exc))
            return False
        self.close(clean=False)
        return False

    def _on_suback(self, body: bytes) -> bool:
        plen, pos = _read_varint(body, 2)
        codes = body[pos + plen :]
        ok = True
        for s, code in zip(self.subscriptions, codes, strict=False):
            if code < 0x80:
                self._rec(
                    "ok",
                    "subscribe",
                    filter=s.filter,
                    qos=code,
                    share_group=s.share_group,
                    no_local=s.no_local,
                )
            else:
                ok = False
                self._rec(
                    "fail", "subscribe", filter=s.filter, share_group=s.share_group, reason=f"0x{code:02x}"
                )
        return ok

    def _handle(self, pkt: tuple[int, int, bytes]) -> None:
        kind, flags, body = pkt
        if kind == PUBLISH:
            self._on_publish(flags, body)
        elif kind == PUBREL:
            pid = struct.unpack_from("!H", body)[0]
            # Released only once PUBCOMP is out: if the broker dies first, the send fails, the id
            # stays held, and the PUBREL that comes again after the restart finds its guid.
            self._send(_packet(PUBCOMP, 0, struct.pack("!H", pid)))
            guid = self._held.pop(pid, None)
            self._rec("ok", "ack", packet_id=pid, guid=guid, qos=2)
        elif kind == DISCONNECT:
            reason = f"server disconnect 0x{body[0]:02x}" if body else "server disconnect"
            raise WireError(reason)
        # PINGRESP, SUBACK (late), PUBACK: nothing to do.

    def _on_publish(self, flags: int, body: bytes) -> None:
        qos = (flags >> 1) & 0x03
        dup = bool(flags & 0x08)
        tlen = struct.unpack_from("!H", body)[0]
        topic = body[2 : 2 + tlen].decode("utf-8")
        pos = 2 + tlen
        pid = 0
        if qos:
            pid = struct.unpack_from("!H", body, pos)[0]
            pos += 2
        plen, pos = _read_varint(body, pos)
        guid = _user_properties(body[pos : pos + plen]).get("guid")
        if qos == 2:
            held = pid in self._held
            detail = None
            if held and self._held[pid] != guid:
                detail = f"method B dropped: packet id {pid} still held by {self._held[pid]}"
            self._rec("ok", "deliver", topic=topic, qos=qos, packet_id=pid, dup=dup, guid=guid, detail=detail)
            if not held:
                self._held[pid] = guid
                self._count_delivery()
            self._send(_packet(PUBREC, 0, struct.pack("!H", pid)))
            return
        self._rec("ok", "deliver", topic=topic, qos=qos, packet_id=pid if qos else None, dup=dup, guid=guid)
        self._count_delivery()
        if qos == 1:
            self._send(_packet(PUBACK, 0, struct.pack("!H", pid)))
            self._rec("ok", "ack", packet_id=pid, guid=guid, qos=1)

    def _count_delivery(self) -> None:
        self.deliveries += 1
        self.last_delivery_mono = time.monotonic()

    def poll(self, timeout_s: float) -> None:
        """Handle packets for up to ``timeout_s``; keeps the connection alive."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pkt = self._read_packet(min(left, 0.2))
            if pkt is not None:
                self._handle(pkt)
        if time.monotonic() - self._last_send > self.keepalive_s / 2:
            self._send(_packet(PINGREQ, 0, b""))
            self._last_send = time.monotonic()

    def run(
        self, stop: Callable[[], bool], *, retry_s: float = 0.2, offline: Callable[[], bool] | None = None
    ) -> None:
        """Stay connected and receive until ``stop()``; then disconnect cleanly if connected.
        While ``offline()`` is true the session stays disconnected (cleanly: it persists on the broker)."""
        while not stop():
            if offline is not None and offline():
                if self.connected:
                    self.close(clean=True)
                time.sleep(0.05)
                continue
            if not self.connected:
                if not self.connect():
                    time.sleep(retry_s)
                continue
            try:
                self.poll(0.5)
            except WireError:
                self.close(clean=False)
        if self.connected:
            self.close(clean=True)
