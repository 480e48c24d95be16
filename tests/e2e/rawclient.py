"""A small, independent raw-socket MQTT 3.1.1 / 5.0 client for end-to-end tests.

Deliberately separate from moorline's own codec, so a codec bug cannot hide itself in
both the broker and its tests. It gives byte-level control: send any bytes, choose when
(or whether) to acknowledge, read exactly the packets the broker sends.

Blocking sockets with timeouts; one client per socket; not thread-safe per client.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

# Packet types.
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15

PACKET_NAMES = {
    1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP",
    8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP",
    14: "DISCONNECT", 15: "AUTH",
}

# MQTT 5 property identifiers.
P_PAYLOAD_FORMAT = 0x01
P_MESSAGE_EXPIRY = 0x02
P_CONTENT_TYPE = 0x03
P_RESPONSE_TOPIC = 0x08
P_CORRELATION_DATA = 0x09
P_SUBSCRIPTION_ID = 0x0B
P_SESSION_EXPIRY = 0x11
P_ASSIGNED_CLIENT_ID = 0x12
P_SERVER_KEEP_ALIVE = 0x13
P_AUTH_METHOD = 0x15
P_AUTH_DATA = 0x16
P_REQUEST_PROBLEM_INFO = 0x17
P_WILL_DELAY = 0x18
P_REQUEST_RESPONSE_INFO = 0x19
P_RESPONSE_INFO = 0x1A
P_SERVER_REFERENCE = 0x1C
P_REASON_STRING = 0x1F
P_RECEIVE_MAXIMUM = 0x21
P_TOPIC_ALIAS_MAXIMUM = 0x22
P_TOPIC_ALIAS = 0x23
P_MAXIMUM_QOS = 0x24
P_RETAIN_AVAILABLE = 0x25
P_USER_PROPERTY = 0x26
P_MAXIMUM_PACKET_SIZE = 0x27
P_WILDCARD_SUB_AVAILABLE = 0x28
P_SUB_ID_AVAILABLE = 0x29
P_SHARED_SUB_AVAILABLE = 0x2A

_BYTE, _INT16, _INT32, _VARINT, _UTF8, _BINARY, _PAIR = "byte", "int16", "int32", "varint", "utf8", "binary", "pair"
PROPERTY_TYPES: dict[int, str] = {
    0x01: _BYTE, 0x02: _INT32, 0x03: _UTF8, 0x08: _UTF8, 0x09: _BINARY, 0x0B: _VARINT, 0x11: _INT32,
    0x12: _UTF8, 0x13: _INT16, 0x15: _UTF8, 0x16: _BINARY, 0x17: _BYTE, 0x18: _INT32, 0x19: _BYTE,
    0x1A: _UTF8, 0x1C: _UTF8, 0x1F: _UTF8, 0x21: _INT16, 0x22: _INT16, 0x23: _INT16, 0x24: _BYTE,
    0x25: _BYTE, 0x26: _PAIR, 0x27: _INT32, 0x28: _BYTE, 0x29: _BYTE, 0x2A: _BYTE,
}

Props = list[tuple[int, Any]]


class ConnectionClosed(Exception):
    """The broker closed the connection (EOF or reset)."""


class MalformedFromBroker(Exception):
    """The broker sent bytes this client cannot decode."""


# ---------------------------------------------------------------- encoding


def varint(n: int) -> bytes:
    if n < 0 or n > 268_435_455:
        raise ValueError(f"varint out of range: {n}")
    out = bytearray()
    while True:
        digit = n % 128
        n //= 128
        if n:
            out.append(digit | 0x80)
        else:
            out.append(digit)
            return bytes(out)


def utf8(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s  # bytes allowed so tests can send invalid UTF-8
    return struct.pack("!H", len(b)) + b


def binary(b: bytes) -> bytes:
    return struct.pack("!H", len(b)) + b


def encode_props(props: Props | None) -> bytes:
    body = bytearray()
    for pid, value in props or []:
        kind = PROPERTY_TYPES[pid]
        body += varint(pid)
        if kind == _BYTE:
            body.append(value)
        elif kind == _INT16:
            body += struct.pack("!H", value)
        elif kind == _INT32:
            body += struct.pack("!I", value)
        elif kind == _VARINT:
            body += varint(value)
        elif kind == _UTF8:
            body += utf8(value)
        elif kind == _BINARY:
            body += binary(value)
        elif kind == _PAIR:
            body += utf8(value[0]) + utf8(value[1])
    return varint(len(body)) + bytes(body)


def packet(ptype: int, flags: int, body: bytes) -> bytes:
    return bytes([(ptype << 4) | flags]) + varint(len(body)) + body


def encode_connect(
    client_id: str,
    version: int = 4,
    clean: bool = True,
    keepalive: int = 60,
    props: Props | None = None,
    will: tuple[str, bytes, int, bool] | None = None,
    will_props: Props | None = None,
    username: str | None = None,
    password: bytes | None = None,
    protocol_name: bytes = b"MQTT",
) -> bytes:
    flags = 0x02 if clean else 0
    if will is not None:
        flags |= 0x04 | (will[2] << 3) | (0x20 if will[3] else 0)
    if username is not None:
        flags |= 0x80
    if password is not None:
        flags |= 0x40
    body = utf8(protocol_name) + bytes([version, flags]) + struct.pack("!H", keepalive)
    if version == 5:
        body += encode_props(props)
    body += utf8(client_id)
    if will is not None:
        if version == 5:
            body += encode_props(will_props)
        body += utf8(will[0]) + binary(will[1])
    if username is not None:
        body += utf8(username)
    if password is not None:
        body += binary(password)
    return packet(CONNECT, 0, body)


def encode_publish(
    topic: str | bytes,
    payload: bytes,
    qos: int = 0,
    retain: bool = False,
    pid: int | None = None,
    dup: bool = False,
    version: int = 4,
    props: Props | None = None,
) -> bytes:
    flags = (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    body = utf8(topic)
    if qos > 0:
        assert pid is not None, "QoS>0 PUBLISH needs a packet id"
        body += struct.pack("!H", pid)
    if version == 5:
        body += encode_props(props)
    return packet(PUBLISH, flags, body + payload)


def encode_ack(ptype: int, pid: int, version: int = 4, reason: int = 0, props: Props | None = None) -> bytes:
    """PUBACK / PUBREC / PUBREL / PUBCOMP (PUBREL has the mandatory flags 0b0010)."""
    flags = 0x02 if ptype == PUBREL else 0
    body = struct.pack("!H", pid)
    if version == 5 and (reason != 0 or props):
        body += bytes([reason]) + encode_props(props)
    return packet(ptype, flags, body)


def encode_subscribe(
    pid: int,
    filters: list[tuple[str, int]] | list[tuple[str, int, dict[str, Any]]],
    version: int = 4,
    props: Props | None = None,
) -> bytes:
    """filters: (filter, qos) or (filter, qos, {no_local, rap, rh}) for MQTT 5 options."""
    body = struct.pack("!H", pid)
    if version == 5:
        body += encode_props(props)
    for item in filters:
        topic, qos = item[0], item[1]
        opts = item[2] if len(item) > 2 else {}  # type: ignore[misc]
        options = qos
        if opts.get("no_local"):
            options |= 0x04
        if opts.get("rap"):
            options |= 0x08
        options |= (opts.get("rh", 0) & 0x3) << 4
        body += utf8(topic) + bytes([options])
    return packet(SUBSCRIBE, 0x02, body)


def encode_unsubscribe(pid: int, filters: list[str], version: int = 4) -> bytes:
    body = struct.pack("!H", pid)
    if version == 5:
        body += encode_props(None)
    for f in filters:
        body += utf8(f)
    return packet(UNSUBSCRIBE, 0x02, body)


def encode_disconnect(version: int = 4, reason: int = 0, props: Props | None = None) -> bytes:
    if version == 5 and (reason or props):
        return packet(DISCONNECT, 0, bytes([reason]) + encode_props(props))
    return packet(DISCONNECT, 0, b"")


PINGREQ_BYTES = bytes([PINGREQ << 4, 0])


# ---------------------------------------------------------------- decoding


@dataclass
class Packet:
    type: int
    flags: int
    raw: bytes
    pid: int | None = None
    topic: str | None = None
    payload: bytes = b""
    qos: int = 0
    dup: bool = False
    retain: bool = False
    reason: int = 0  # CONNACK return code / ack reason / DISCONNECT reason
    reasons: list[int] = field(default_factory=list)  # SUBACK / UNSUBACK
    session_present: bool = False
    props: Props = field(default_factory=list)

    @property
    def name(self) -> str:
        return PACKET_NAMES.get(self.type, f"type{self.type}")

    def prop(self, pid: int, default: Any = None) -> Any:
        for k, v in self.props:
            if k == pid:
                return v
        return default

    def props_all(self, pid: int) -> list[Any]:
        return [v for k, v in self.props if k == pid]

    @property
    def user_properties(self) -> list[tuple[str, str]]:
        return [tuple(v) for k, v in self.props if k == P_USER_PROPERTY]  # type: ignore[misc]

    def __repr__(self) -> str:
        parts = [self.name]
        if self.pid is not None:
            parts.append(f"pid={self.pid}")
        if self.topic is not None:
            parts.append(f"topic={self.topic!r} qos={self.qos} dup={self.dup} retain={self.retain}")
            parts.append(f"payload={self.payload[:40]!r}")
        if self.type in (CONNACK, PUBACK, PUBREC, PUBREL, PUBCOMP, DISCONNECT):
            parts.append(f"reason=0x{self.reason:02x}")
        if self.reasons:
            parts.append("reasons=" + ",".join(f"0x{r:02x}" for r in self.reasons))
        if self.props:
            parts.append(f"props={self.props}")
        return "<" + " ".join(parts) + ">"


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        if self.left() < n:
            raise MalformedFromBroker(f"short packet: need {n}, have {self.left()}")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def byte(self) -> int:
        return self.take(1)[0]

    def int16(self) -> int:
        return int(struct.unpack("!H", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack("!I", self.take(4))[0])

    def varint(self) -> int:
        mult, value = 1, 0
        for _ in range(4):
            b = self.byte()
            value += (b & 0x7F) * mult
            if not b & 0x80:
                return value
            mult *= 128
        raise MalformedFromBroker("varint longer than 4 bytes")

    def utf8(self) -> str:
        return self.take(self.int16()).decode("utf-8")

    def binary(self) -> bytes:
        return self.take(self.int16())

    def props(self) -> Props:
        end = self.varint() + self.pos
        out: Props = []
        while self.pos < end:
            pid = self.varint()
            kind = PROPERTY_TYPES.get(pid)
            if kind == _BYTE:
                out.append((pid, self.byte()))
            elif kind == _INT16:
                out.append((pid, self.int16()))
            elif kind == _INT32:
                out.append((pid, self.int32()))
            elif kind == _VARINT:
                out.append((pid, self.varint()))
            elif kind == _UTF8:
                out.append((pid, self.utf8()))
            elif kind == _BINARY:
                out.append((pid, self.binary()))
            elif kind == _PAIR:
                out.append((pid, (self.utf8(), self.utf8())))
            else:
                raise MalformedFromBroker(f"unknown property 0x{pid:02x}")
        if self.pos != end:
            raise MalformedFromBroker("property length mismatch")
        return out


def decode_packet(first: int, body: bytes, version: int) -> Packet:
    ptype, flags = first >> 4, first & 0x0F
    p = Packet(type=ptype, flags=flags, raw=bytes([first]) + varint(len(body)) + body)
    r = _Reader(body)
    if ptype == CONNACK:
        p.session_present = bool(r.byte() & 1)
        p.reason = r.byte()
        if version == 5 and r.left():
            p.props = r.props()
    elif ptype == PUBLISH:
        p.dup, p.qos, p.retain = bool(flags & 8), (flags >> 1) & 3, bool(flags & 1)
        p.topic = r.utf8()
        if p.qos:
            p.pid = r.int16()
        if version == 5:
            p.props = r.props()
        p.payload = r.take(r.left())
    elif ptype in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        p.pid = r.int16()
        if version == 5 and r.left():
            p.reason = r.byte()
            if r.left():
                p.props = r.props()
    elif ptype in (SUBACK, UNSUBACK):
        p.pid = r.int16()
        if version == 5:
            p.props = r.props()
        p.reasons = list(r.take(r.left()))
    elif ptype == DISCONNECT or ptype == AUTH:
        if r.left():
            p.reason = r.byte()
            if r.left():
                p.props = r.props()
    elif ptype == PINGRESP:
        pass
    else:
        raise MalformedFromBroker(f"broker sent packet type {ptype}")
    return p


# ---------------------------------------------------------------- the client


class RawClient:
    """One TCP connection speaking MQTT by hand. Nothing is acknowledged unless the test says so."""

    def __init__(self, host: str, port: int, version: int = 4, timeout: float = 10.0) -> None:
        self.version = version
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.next_pid = 1
        self.closed = False
        # PUBLISHes read while waiting for another packet (SUBACK, PINGRESP), in arrival order.
        self.pending: list[Packet] = []

    # -- raw IO

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    def abort(self) -> None:
        """Close with RST (SO_LINGER 0): an abnormal disconnect, no DISCONNECT packet."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close()

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as e:
            raise ConnectionClosed(str(e)) from e
        if not chunk:
            raise ConnectionClosed("EOF")
        self.buf += chunk

    def _try_parse(self) -> Packet | None:
        if len(self.buf) < 2:
            return None
        mult, length, i = 1, 0, 1
        while True:
            if i >= len(self.buf):
                return None
            b = self.buf[i]
            length += (b & 0x7F) * mult
            i += 1
            if not b & 0x80:
                break
            mult *= 128
            if i > 4:
                raise MalformedFromBroker("remaining length longer than 4 bytes")
        if len(self.buf) < i + length:
            return None
        first = self.buf[0]
        body = bytes(self.buf[i : i + length])
        del self.buf[: i + length]
        return decode_packet(first, body, self.version)

    def recv(self, timeout: float = 5.0) -> Packet:
        """Next packet; TimeoutError if none in time; ConnectionClosed on EOF.

        PUBLISHes set aside while a helper waited for another packet come first (they arrived first).
        """
        if self.pending:
            return self.pending.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            pkt = self._try_parse()
            if pkt is not None:
                return pkt
            self._fill(deadline)

    def _recv_wire(self, timeout: float) -> Packet:
        deadline = time.monotonic() + timeout
        while True:
            pkt = self._try_parse()
            if pkt is not None:
                return pkt
            self._fill(deadline)

    def recv_or_none(self, timeout: float) -> Packet | None:
        try:
            return self.recv(timeout)
        except TimeoutError:
            return None

    def expect(self, ptype: int, timeout: float = 5.0) -> Packet:
        pkt = self.recv(timeout)
        if pkt.type != ptype:
            raise AssertionError(f"expected {PACKET_NAMES[ptype]}, got {pkt!r}")
        return pkt

    def wait_closed(self, timeout: float = 5.0) -> list[Packet]:
        """Read until the broker closes the connection; returns what it sent first.

        Raises TimeoutError if the connection is still open after `timeout`.
        """
        got: list[Packet] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                got.append(self.recv(max(0.0, deadline - time.monotonic())))
            except ConnectionClosed:
                return got
            except MalformedFromBroker:
                return got

    # -- protocol helpers

    def alloc_pid(self) -> int:
        pid = self.next_pid
        self.next_pid = self.next_pid % 65535 + 1
        return pid

    def connect(self, client_id: str, clean: bool = True, keepalive: int = 60, props: Props | None = None,
                will: tuple[str, bytes, int, bool] | None = None, will_props: Props | None = None,
                username: str | None = None, password: bytes | None = None,
                timeout: float = 10.0) -> Packet:
        self.send(encode_connect(client_id, self.version, clean, keepalive, props, will, will_props,
                                 username, password))
        return self.expect(CONNACK, timeout)

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, pid: int | None = None,
                dup: bool = False, props: Props | None = None) -> int | None:
        if qos and pid is None:
            pid = self.alloc_pid()
        self.send(encode_publish(topic, payload, qos, retain, pid, dup, self.version, props))
        return pid

    def publish_and_wait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                         props: Props | None = None, timeout: float = 10.0) -> Packet:
        """Full QoS 1/2 publisher flow; returns the PUBACK (QoS 1) or PUBCOMP (QoS 2).

        For QoS 2 a PUBREC with reason >= 0x80 is returned instead (no PUBREL is sent).
        """
        pid = self.publish(topic, payload, qos, retain, props=props)
        if qos == 1:
            return self._expect_ack(PUBACK, pid, timeout)
        rec = self._expect_ack(PUBREC, pid, timeout)
        if rec.reason >= 0x80:
            return rec
        self.send(encode_ack(PUBREL, pid, self.version))  # type: ignore[arg-type]
        return self._expect_ack(PUBCOMP, pid, timeout)

    def _expect_ack(self, ptype: int, pid: int | None, timeout: float) -> Packet:
        assert pid is not None
        return self._expect_skipping_publishes(ptype, pid, timeout)

    def subscribe(self, filters: list[Any], props: Props | None = None, timeout: float = 10.0) -> Packet:
        pid = self.alloc_pid()
        self.send(encode_subscribe(pid, filters, self.version, props))
        # Messages (e.g. retained) may arrive before the SUBACK is read; keep them for later.
        return self._expect_skipping_publishes(SUBACK, pid, timeout)

    def unsubscribe(self, filters: list[str], timeout: float = 10.0) -> Packet:
        pid = self.alloc_pid()
        self.send(encode_unsubscribe(pid, filters, self.version))
        return self._expect_skipping_publishes(UNSUBACK, pid, timeout)

    def _expect_skipping_publishes(self, ptype: int, pid: int, timeout: float) -> Packet:
        deadline = time.monotonic() + timeout
        while True:
            pkt = self._recv_wire(max(0.001, deadline - time.monotonic()))
            if pkt.type == PUBLISH:
                self.pending.append(pkt)
                continue
            if pkt.type != ptype or pkt.pid != pid:
                raise AssertionError(f"expected {PACKET_NAMES[ptype]} pid={pid}, got {pkt!r}")
            return pkt

    def next_message(self, timeout: float = 5.0) -> Packet:
        """The next PUBLISH (including ones buffered while waiting for a SUBACK)."""
        if self.pending:
            return self.pending.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            pkt = self.recv(max(0.001, deadline - time.monotonic()))
            if pkt.type == PUBLISH:
                return pkt
            if pkt.type == PINGRESP:
                continue
            raise AssertionError(f"expected PUBLISH, got {pkt!r}")

    def ack(self, msg: Packet) -> None:
        """Acknowledge a received PUBLISH the normal way (QoS 1: PUBACK; QoS 2: PUBREC, PUBREL, PUBCOMP)."""
        if msg.qos == 1:
            self.send(encode_ack(PUBACK, msg.pid, self.version))  # type: ignore[arg-type]
        elif msg.qos == 2:
            self.send(encode_ack(PUBREC, msg.pid, self.version))  # type: ignore[arg-type]
            self._expect_skipping_publishes(PUBREL, msg.pid, 10.0)  # type: ignore[arg-type]
            self.send(encode_ack(PUBCOMP, msg.pid, self.version))  # type: ignore[arg-type]

    def ping(self, timeout: float = 5.0) -> None:
        self.send(PINGREQ_BYTES)
        deadline = time.monotonic() + timeout
        while True:
            pkt = self._recv_wire(max(0.001, deadline - time.monotonic()))
            if pkt.type == PINGRESP:
                return
            if pkt.type == PUBLISH:
                self.pending.append(pkt)
                continue
            raise AssertionError(f"expected PINGRESP, got {pkt!r}")

    def disconnect(self, reason: int = 0, props: Props | None = None) -> None:
        try:
            self.send(encode_disconnect(self.version, reason, props))
        except OSError:
            pass
        self.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
