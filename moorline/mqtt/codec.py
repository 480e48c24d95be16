"""MQTT 3.1.1 / 5.0 wire codec: bytes in, packets out, and back. No IO.

``encode(packet, version)`` turns a packet into bytes (version 4 = 3.1.1, 5 = 5.0).
``Decoder.feed(data)`` returns every complete packet in the bytes seen so far and keeps at
most one incomplete packet buffered (bounded by ``max_packet_size``). Anything the
specification calls a Malformed Packet or a Protocol Error raises a ``ProtocolError``
subclass carrying the v5 reason code; after that the decoder stays failed.

Hot paths (PUBLISH and the 4-byte acks) are written out inline with no per-byte loops;
``encode_publish_fast`` and ``encode_ack`` let the broker skip building packet objects.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable
from typing import Any, Final, Literal

from moorline.invariant import invariant
from moorline.mqtt import packets as P
from moorline.mqtt.errors import MalformedPacket, PacketTooLarge, ProtocolError, UnsupportedProtocol
from moorline.mqtt.packets import (
    NO_PROPERTIES,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from moorline.mqtt.properties import (
    ALLOWED,
    BOOLEAN_BYTE_PROPERTIES,
    BY_NAME,
    BYTE,
    MAX_VARINT,
    NONZERO_PROPERTIES,
    PAIR,
    STR,
    U16,
    U32,
    VARINT,
    WILL,
)
from moorline.mqtt.reasons import (
    AUTH_REASONS,
    CONNACK_REASONS,
    DISCONNECT_REASONS,
    PUBACK_REASONS,
    PUBREL_REASONS,
    SUBACK_REASONS,
    UNSUBACK_REASONS,
    V3_SUBACK_CODES,
    ReasonCode,
    connack_v3_to_v5,
    connack_v5_to_v3,
    suback_v5_to_v3,
)

__all__ = [
    "Decoder", "encode", "encode_publish_fast", "PublishBatchEncoder", "encode_ack", "encode_puback", "encode_pubrec",
    "encode_pubrel", "encode_pubcomp", "encode_properties", "encode_varint", "ProtocolError",
    "MalformedPacket", "PacketTooLarge", "UnsupportedProtocol", "MQTT_3_1_1", "MQTT_5",
    "DEFAULT_MAX_PACKET_SIZE",
]

MQTT_3_1_1: Final = 4
MQTT_5: Final = 5
DEFAULT_MAX_PACKET_SIZE: Final = 1024 * 1024
PROTOCOL_NAME: Final = "MQTT"

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_ACK4 = struct.Struct("!BBH")  # fixed header byte, remaining length 2, packet id
_ACK5 = struct.Struct("!BBHB")  # ... remaining length 3, packet id, reason code

RC = ReasonCode
_MALFORMED = RC.MALFORMED_PACKET
_PROTOCOL = RC.PROTOCOL_ERROR

# ---------------------------------------------------------------------------------------------
# Encoding primitives


_SMALL_VARINTS: Final = tuple(bytes((i,)) for i in range(128))


def encode_varint(value: int) -> bytes:
    """Variable Byte Integer (section 1.5.5), minimal length."""
    if value < 128:
        invariant(value >= 0, "varint must not be negative")
        return _SMALL_VARINTS[value]
    invariant(value <= MAX_VARINT, "varint too large")
    out = bytearray()
    while True:
        digit = value & 0x7F
        value >>= 7
        if value:
            out.append(digit | 0x80)
        else:
            out.append(digit)
            return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    invariant(len(b) <= 0xFFFF, "UTF-8 string longer than 65535 bytes")
    return _U16.pack(len(b)) + b


def _bin(b: bytes) -> bytes:
    invariant(len(b) <= 0xFFFF, "binary data longer than 65535 bytes")
    return _U16.pack(len(b)) + bytes(b)


def _fixed(first_byte: int, body: bytes) -> bytes:
    return bytes((first_byte,)) + encode_varint(len(body)) + body


_PROPERTY_FIELDS: Final = tuple((name, pid, kind) for name, (pid, kind) in BY_NAME.items())
_get_all_properties = operator.attrgetter(*(name for name, _, _ in _PROPERTY_FIELDS))
_EMPTY_PROPERTY_VALUES: Final = _get_all_properties(NO_PROPERTIES)


def encode_properties(props: Properties) -> bytes:
    """The property *body* (without its length prefix), in identifier order.

    Cache the result when the same properties go to many subscribers and pass it as
    ``props_bytes`` to ``encode_publish_fast``.
    """
    if props is NO_PROPERTIES:
        return b""
    values = _get_all_properties(props)
    if values == _EMPTY_PROPERTY_VALUES:  # one C-level tuple compare instead of 27 checks
        return b""
    out: list[bytes] = []
    for (name, pid, kind), value in zip(_PROPERTY_FIELDS, values, strict=True):
        if value is None or value == ():
            continue
        if kind == PAIR:
            for k, v in value:
                out.append(bytes((pid,)) + _str(k) + _str(v))
        elif name == "subscription_identifiers":
            for sid in value:
                out.append(bytes((pid,)) + encode_varint(sid))
        elif kind == BYTE:
            out.append(bytes((pid, value)))
        elif kind == U16:
            out.append(bytes((pid,)) + _U16.pack(value))
        elif kind == U32:
            out.append(bytes((pid,)) + _U32.pack(value))
        elif kind == VARINT:
            out.append(bytes((pid,)) + encode_varint(value))
        elif kind == STR:
            out.append(bytes((pid,)) + _str(value))
        else:
            out.append(bytes((pid,)) + _bin(value))
    return b"".join(out)


def _props_block(props: Properties, version: int) -> bytes:
    """The property length + body for a v5 packet; nothing for 3.1.1."""
    if version != MQTT_5:
        return b""
    if props is NO_PROPERTIES:
        return b"\x00"
    body = encode_properties(props)
    return encode_varint(len(body)) + body


# ---------------------------------------------------------------------------------------------
# Fast encoders for the hot path


def encode_publish_header(
    topic_bytes: bytes,
    payload_len: int,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    version: int,
    props_bytes: bytes = b"",
) -> bytes:
    """A PUBLISH up to (not including) its payload of ``payload_len`` bytes, from pre-encoded parts.
    ``props_bytes`` is a property *body* from ``encode_properties`` (ignored for 3.1.1); b"" means
    no properties. Header + payload is the whole packet; a large payload can then be handed to the
    socket without being copied."""
    first = 0x30 | (qos << 1) | (8 if dup else 0) | (1 if retain else 0)
    if version == MQTT_5:
        plen = len(props_bytes)
        pblock = (_SMALL_VARINTS[plen] if plen < 128 else encode_varint(plen)) + props_bytes
    else:
        pblock = b""
    head = _U16.pack(len(topic_bytes)) + topic_bytes
    if qos:
        head += _U16.pack(packet_id)  # type: ignore[arg-type]
    rl = len(head) + len(pblock) + payload_len
    if rl < 128:
        return b"".join((bytes((first, rl)), head, pblock))
    return b"".join((bytes((first,)), encode_varint(rl), head, pblock))


def encode_publish_fast(
    topic_bytes: bytes,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    version: int,
    props_bytes: bytes = b"",
) -> bytes:
    """The whole PUBLISH from pre-encoded parts (see ``encode_publish_header``)."""
    return encode_publish_header(topic_bytes, len(payload), qos, retain, dup, packet_id, version, props_bytes) + payload


class PublishBatchEncoder:
    """A run of PUBLISH packets encoded into one buffer, for one write: the same bytes as
    ``encode_publish_fast`` for each, without its per-packet joins and temporaries. A delivery batch
    is mostly one topic, whose length-prefixed name is encoded once per run of it."""

    __slots__ = ("_out", "_v5", "_topic", "_topic_part")

    def __init__(self, version: int) -> None:
        self._out = bytearray()
        self._v5 = version == MQTT_5
        self._topic: str | None = None
        self._topic_part = b""

    def __len__(self) -> int:
        return len(self._out)

    def add(self, topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int | None,
            props_bytes: bytes = b"") -> None:
        """One PUBLISH; ``props_bytes`` as for ``encode_publish_header``."""
        if topic is not self._topic and topic != self._topic:
            self._topic = topic
            tb = topic.encode()
            self._topic_part = _U16.pack(len(tb)) + tb
        topic_part = self._topic_part
        out = self._out
        rl = len(topic_part) + len(payload)
        if qos:
            rl += 2
        plen = len(props_bytes)
        if self._v5:
            rl += plen + (1 if plen < 128 else len(encode_varint(plen)))
        first = 0x30 | (qos << 1) | (8 if dup else 0) | (1 if retain else 0)
        if rl < 128:
            out += _U16.pack((first << 8) | rl)
        else:
            out.append(first)
            out += encode_varint(rl)
        out += topic_part
        if qos:
            out += _U16.pack(packet_id)  # type: ignore[arg-type]
        if self._v5:
            out += _SMALL_VARINTS[plen] if plen < 128 else encode_varint(plen)
            out += props_bytes
        out += payload

    def take(self) -> bytes:
        """Everything added since the last ``take``."""
        data = bytes(self._out)
        self._out.clear()
        return data


_ACK_FIRST_BYTE: Final = {P.PUBACK: 0x40, P.PUBREC: 0x50, P.PUBREL: 0x62, P.PUBCOMP: 0x70}


def encode_ack(packet_type: int, packet_id: int, reason_code: int = 0, version: int = MQTT_5) -> bytes:
    """PUBACK/PUBREC/PUBREL/PUBCOMP without properties (4 bytes, or 5 with a v5 reason)."""
    first = _ACK_FIRST_BYTE[packet_type]
    if reason_code == 0 or version != MQTT_5:
        return _ACK4.pack(first, 2, packet_id)
    return _ACK5.pack(first, 3, packet_id, reason_code)


def encode_puback(packet_id: int, reason_code: int = 0, version: int = MQTT_5) -> bytes:
    if reason_code == 0 or version != MQTT_5:
        return _ACK4.pack(0x40, 2, packet_id)
    return _ACK5.pack(0x40, 3, packet_id, reason_code)


def encode_pubrec(packet_id: int, reason_code: int = 0, version: int = MQTT_5) -> bytes:
    return encode_ack(P.PUBREC, packet_id, reason_code, version)


def encode_pubrel(packet_id: int, reason_code: int = 0, version: int = MQTT_5) -> bytes:
    return encode_ack(P.PUBREL, packet_id, reason_code, version)


def encode_pubcomp(packet_id: int, reason_code: int = 0, version: int = MQTT_5) -> bytes:
    return encode_ack(P.PUBCOMP, packet_id, reason_code, version)


PINGREQ_BYTES: Final = b"\xc0\x00"
PINGRESP_BYTES: Final = b"\xd0\x00"
DISCONNECT_BYTES: Final = b"\xe0\x00"


# ---------------------------------------------------------------------------------------------
# Full encoder


def _enc_connect(p: Connect, version: int) -> bytes:
    invariant(p.protocol_level == version, "CONNECT protocol_level must equal the encode version")
    will = p.will
    flags = 0x02 if p.clean_start else 0
    if will is not None:
        invariant(0 <= will.qos <= 2, "will QoS out of range")
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if p.password is not None:
        invariant(version == MQTT_5 or p.username is not None, "3.1.1 forbids a password without a username")
        flags |= 0x40
    if p.username is not None:
        flags |= 0x80
    parts = [_str(p.protocol_name), bytes((version, flags)), _U16.pack(p.keepalive), _props_block(p.properties, version),
             _str(p.client_id)]
    if will is not None:
        parts += [_props_block(will.properties, version), _str(will.topic), _bin(will.payload)]
    if p.username is not None:
        parts.append(_str(p.username))
    if p.password is not None:
        parts.append(_bin(p.password))
    return _fixed(0x10, b"".join(parts))


def _enc_connack(p: Connack, version: int) -> bytes:
    if version == MQTT_5:
        body = bytes((1 if p.session_present else 0, p.reason_code)) + _props_block(p.properties, version)
        return _fixed(0x20, body)
    return bytes((0x20, 2, 1 if p.session_present else 0, connack_v5_to_v3(p.reason_code)))


def _enc_publish(p: Publish, version: int) -> bytes:
    invariant(0 <= p.qos <= 2, "PUBLISH QoS out of range")
    invariant((p.packet_id is not None and 0 < p.packet_id <= 0xFFFF) == (p.qos > 0),
              "PUBLISH packet_id must be 1..65535 iff qos > 0")
    props = encode_properties(p.properties) if version == MQTT_5 else b""
    return encode_publish_fast(p.topic.encode("utf-8"), p.payload, p.qos, p.retain, p.dup, p.packet_id, version, props)


def _enc_pub_ack(first: int) -> Callable[[Any, int], bytes]:
    def enc(p: Puback | Pubrec | Pubrel | Pubcomp, version: int) -> bytes:
        invariant(0 < p.packet_id <= 0xFFFF, "packet_id must be 1..65535")
        if version != MQTT_5 or (p.reason_code == 0 and p.properties is NO_PROPERTIES):
            return _ACK4.pack(first, 2, p.packet_id)
        body = encode_properties(p.properties)
        if not body:
            if p.reason_code == 0:
                return _ACK4.pack(first, 2, p.packet_id)
            return _ACK5.pack(first, 3, p.packet_id, p.reason_code)
        return _fixed(first, _U16.pack(p.packet_id) + bytes((p.reason_code,)) + encode_varint(len(body)) + body)
    return enc


def _enc_subscribe(p: Subscribe, version: int) -> bytes:
    invariant(len(p.subscriptions) > 0, "SUBSCRIBE needs at least one filter")
    parts = [_U16.pack(p.packet_id), _props_block(p.properties, version)]
    for topic_filter, o in p.subscriptions:
        opts = o.qos
        if version == MQTT_5:
            opts |= (0x04 if o.no_local else 0) | (0x08 if o.retain_as_published else 0) | (o.retain_handling << 4)
        parts += [_str(topic_filter), bytes((opts,))]
    return _fixed(0x82, b"".join(parts))


def _enc_suback(p: Suback, version: int) -> bytes:
    codes = p.reason_codes if version == MQTT_5 else tuple(suback_v5_to_v3(c) for c in p.reason_codes)
    return _fixed(0x90, _U16.pack(p.packet_id) + _props_block(p.properties, version) + bytes(codes))


def _enc_unsubscribe(p: Unsubscribe, version: int) -> bytes:
    invariant(len(p.filters) > 0, "UNSUBSCRIBE needs at least one filter")
    body = _U16.pack(p.packet_id) + _props_block(p.properties, version) + b"".join(_str(f) for f in p.filters)
    return _fixed(0xA2, body)


def _enc_unsuback(p: Unsuback, version: int) -> bytes:
    if version != MQTT_5:
        return _ACK4.pack(0xB0, 2, p.packet_id)
    return _fixed(0xB0, _U16.pack(p.packet_id) + _props_block(p.properties, version) + bytes(p.reason_codes))


def _enc_reason_only(first: int) -> Callable[[Any, int], bytes]:
    def enc(p: Disconnect | Auth, version: int) -> bytes:
        if version != MQTT_5:
            invariant(first == 0xE0, "AUTH does not exist in MQTT 3.1.1")
            return DISCONNECT_BYTES
        if p.reason_code == 0 and p.properties is NO_PROPERTIES:
            return bytes((first, 0))
        body = encode_properties(p.properties)
        if not body:
            return bytes((first, 1, p.reason_code)) if p.reason_code else bytes((first, 0))
        return _fixed(first, bytes((p.reason_code,)) + encode_varint(len(body)) + body)
    return enc


_ENCODERS: Final[dict[type, Callable[[Any, int], bytes]]] = {
    Connect: _enc_connect,
    Connack: _enc_connack,
    Publish: _enc_publish,
    Puback: _enc_pub_ack(0x40),
    Pubrec: _enc_pub_ack(0x50),
    Pubrel: _enc_pub_ack(0x62),
    Pubcomp: _enc_pub_ack(0x70),
    Subscribe: _enc_subscribe,
    Suback: _enc_suback,
    Unsubscribe: _enc_unsubscribe,
    Unsuback: _enc_unsuback,
    Pingreq: lambda p, v: PINGREQ_BYTES,
    Pingresp: lambda p, v: PINGRESP_BYTES,
    Disconnect: _enc_reason_only(0xE0),
    Auth: _enc_reason_only(0xF0),
}


def encode(packet: Packet, version: int) -> bytes:
    """Wire bytes of ``packet`` for protocol ``version`` (4 = 3.1.1, 5 = 5.0).

    3.1.1 drops what it cannot carry: properties, reason codes of acks/DISCONNECT/UNSUBACK;
    CONNACK and SUBACK reason codes map to 3.1.1 return codes.
    """
    invariant(version in (MQTT_3_1_1, MQTT_5), "version must be 4 or 5")
    return _ENCODERS[type(packet)](packet, version)


# ---------------------------------------------------------------------------------------------
# Decoding primitives. All take (buf, pos, end) and return (value, new pos); ``end`` is the end
# of the current packet, never of the buffer, so a field can never read into the next packet.


def _truncated(what: str) -> MalformedPacket:
    return MalformedPacket(_MALFORMED, f"truncated {what}")


def _read_u16(buf: bytes, pos: int, end: int, what: str) -> int:
    if pos + 2 > end:
        raise _truncated(what)
    return (buf[pos] << 8) | buf[pos + 1]


def _read_str(buf: bytes, pos: int, end: int, what: str) -> tuple[str, int]:
    if pos + 2 > end:
        raise _truncated(what)
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise _truncated(what)
    try:
        s = buf[pos + 2:stop].decode("utf-8")  # strict: rejects surrogates and overlongs
    except UnicodeDecodeError:
        raise MalformedPacket(_MALFORMED, f"{what} is not valid UTF-8") from None
    if "\x00" in s:
        raise MalformedPacket(_MALFORMED, f"{what} contains U+0000")  # MQTT-1.5.4-2
    return s, stop


def _read_bin(buf: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise _truncated(what)
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise _truncated(what)
    return buf[pos + 2:stop], stop


def _read_varint(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    value = 0
    shift = 0
    for i in range(4):
        if pos + i >= end:
            raise _truncated(what)
        b = buf[pos + i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if b == 0 and i > 0:
                raise MalformedPacket(_MALFORMED, f"{what} is not minimally encoded")  # MQTT-1.5.5-1
            return value, pos + i + 1
        shift += 7
    raise MalformedPacket(_MALFORMED, f"{what} longer than 4 bytes")


# Fast construction of frozen slotted dataclasses: their __init__ goes through
# object.__setattr__ once per field (27 for Properties); setting the slots through their
# descriptors is markedly cheaper and gives an equal object.
_new = object.__new__
_PROPERTY_SLOT_SETTERS: Final = {name: Properties.__dict__[name].__set__ for name in Properties.__dataclass_fields__}
_PROPERTY_DEFAULTS: Final = tuple((_PROPERTY_SLOT_SETTERS[name], getattr(NO_PROPERTIES, name))
                                  for name in Properties.__dataclass_fields__)


def _make_properties(values: dict[str, Any]) -> Properties:
    props = _new(Properties)
    for setter, default in _PROPERTY_DEFAULTS:
        setter(props, default)
    for name, value in values.items():
        _PROPERTY_SLOT_SETTERS[name](props, value)
    return props  # type: ignore[no-any-return]


def _read_properties(buf: bytes, pos: int, end: int, context: int) -> tuple[Properties, int]:
    if pos < end and buf[pos] < 0x80:
        length = buf[pos]
        pos += 1
    else:
        length, pos = _read_varint(buf, pos, end, "property length")
    if length == 0:
        return NO_PROPERTIES, pos
    stop = pos + length
    if stop > end:
        raise _truncated("properties")
    allowed = ALLOWED[context]
    values: dict[str, Any] = {}
    sub_ids: list[int] = []
    user: list[tuple[str, str]] = []
    while pos < stop:
        ident = buf[pos]  # identifiers are varints but all defined ones are < 128
        entry = allowed.get(ident)
        if entry is None:
            raise MalformedPacket(_MALFORMED, f"property 0x{ident:02X} not allowed in this packet")
        name, kind = entry
        pos += 1
        value: Any
        if kind == PAIR:  # user properties first: by far the most common here (GUIDs)
            k, pos = _read_str(buf, pos, stop, "user property name")
            v, pos = _read_str(buf, pos, stop, "user property value")
            user.append((k, v))
            continue
        if kind == BYTE:
            if pos >= stop:
                raise _truncated(name)
            value = buf[pos]
            pos += 1
        elif kind == U16:
            value = _read_u16(buf, pos, stop, name)
            pos += 2
        elif kind == U32:
            if pos + 4 > stop:
                raise _truncated(name)
            value = int.from_bytes(buf[pos:pos + 4], "big")
            pos += 4
        elif kind == VARINT:
            value, pos = _read_varint(buf, pos, stop, name)
        elif kind == STR:
            value, pos = _read_str(buf, pos, stop, name)
        else:
            value, pos = _read_bin(buf, pos, stop, name)
        if name in BOOLEAN_BYTE_PROPERTIES and value > 1:
            raise ProtocolError(_PROTOCOL, f"{name} must be 0 or 1")
        if value == 0 and name in NONZERO_PROPERTIES:
            raise ProtocolError(_PROTOCOL, f"{name} must not be 0")
        if name == "subscription_identifiers":
            if sub_ids and context != P.PUBLISH:
                raise ProtocolError(_PROTOCOL, "subscription identifier more than once")
            sub_ids.append(value)
            continue
        if name in values:
            raise ProtocolError(_PROTOCOL, f"{name} included more than once")
        values[name] = value
    if pos != stop:
        raise _truncated("property")  # the last property ran past the property length
    if sub_ids:
        values["subscription_identifiers"] = tuple(sub_ids)
    if user:
        values["user_properties"] = tuple(user)
    return _make_properties(values), stop


def _expect_end(pos: int, end: int, what: str) -> None:
    if pos != end:
        raise MalformedPacket(_MALFORMED, f"{end - pos} unexpected bytes at end of {what}")


# First byte of the 4-byte acks -> their class.
_FAST_ACKS: Final[dict[int, type[Puback | Pubrec | Pubrel | Pubcomp]]] = {
    0x40: Puback, 0x50: Pubrec, 0x62: Pubrel, 0x70: Pubcomp,
}

# Which packet types each side may receive. Index = packet type.
_SERVER_RECEIVES: Final = frozenset({P.CONNECT, P.PUBLISH, P.PUBACK, P.PUBREC, P.PUBREL, P.PUBCOMP, P.SUBSCRIBE,
                                     P.UNSUBSCRIBE, P.PINGREQ, P.DISCONNECT, P.AUTH})
_CLIENT_RECEIVES: Final = frozenset({P.CONNACK, P.PUBLISH, P.PUBACK, P.PUBREC, P.PUBREL, P.PUBCOMP, P.SUBACK,
                                     P.UNSUBACK, P.PINGRESP, P.DISCONNECT, P.AUTH})
# Required fixed-header flags (bits 3-0) for every type except PUBLISH.
_FIXED_FLAGS: Final = {P.PUBREL: 2, P.SUBSCRIBE: 2, P.UNSUBSCRIBE: 2}

_ACK_CLASSES: Final[dict[int, Callable[..., Packet]]] = {P.PUBACK: Puback, P.PUBREC: Pubrec, P.PUBREL: Pubrel, P.PUBCOMP: Pubcomp}
_ACK_REASONS: Final = {P.PUBACK: PUBACK_REASONS, P.PUBREC: PUBACK_REASONS, P.PUBREL: PUBREL_REASONS,
                       P.PUBCOMP: PUBREL_REASONS}


class Decoder:
    """Incremental MQTT decoder for one connection.

    ``role="server"`` decodes what a client sends (CONNECT, PUBLISH, SUBSCRIBE, ...);
    ``role="client"`` decodes what a server sends and needs ``version`` set up front.
    ``version`` is None until a CONNECT is decoded (server role); the owner may also set it.
    """

    __slots__ = ("version", "role", "max_packet_size", "_chunks", "_have", "_need", "_receives", "_error")

    def __init__(self, max_packet_size: int = DEFAULT_MAX_PACKET_SIZE, *,
                 role: Literal["server", "client"] = "server", version: int | None = None) -> None:
        invariant(role in ("server", "client"), "role must be 'server' or 'client'")
        invariant(max_packet_size >= 2, "max_packet_size must allow at least a 2-byte packet")
        invariant(version in (None, MQTT_3_1_1, MQTT_5), "version must be None, 4 or 5")
        self.version: int | None = version
        self.role = role
        self.max_packet_size = max_packet_size
        # Bytes of the incomplete packet at the head of the stream: kept as a list of chunks so a
        # large packet arriving in many small reads is joined once (linear, not quadratic).
        self._chunks: list[bytes] = []
        self._have = 0
        self._need = 0  # total bytes needed before parsing is worth retrying; 0 = unknown
        self._receives = _SERVER_RECEIVES if role == "server" else _CLIENT_RECEIVES
        self._error: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for an incomplete packet (at most max_packet_size + 4)."""
        return self._have

    def feed(self, data: bytes) -> list[Packet]:
        """Decode every complete packet in the stream so far, in order."""
        if self._error is not None:
            raise self._error
        if self._chunks:
            self._chunks.append(bytes(data))
            self._have += len(data)
            if self._have < self._need:
                return []
            buf = b"".join(self._chunks)
            self._chunks = []
        else:
            buf = bytes(data)
        try:
            out, pos = self._decode_all(buf)
        except ProtocolError as e:
            self._error = e
            self._chunks = []
            self._have = 0
            raise
        rest = len(buf) - pos
        if rest:
            self._chunks = [buf[pos:] if pos else buf]
        self._have = rest
        return out

    def _decode_all(self, buf: bytes) -> tuple[list[Packet], int]:
        out: list[Packet] = []
        n = len(buf)
        pos = 0
        max_size = self.max_packet_size
        receives = self._receives
        self._need = 0
        while n - pos >= 2:
            first = buf[pos]
            ptype = first >> 4
            if ptype not in receives:
                self._reject_type(ptype)  # before waiting for a body we would refuse anyway
            b = buf[pos + 1]
            if b < 0x80:
                rl = b
                start = pos + 2
            else:
                rl = b & 0x7F
                i = pos + 2
                shift = 7
                while True:
                    if i >= n:
                        return out, pos  # remaining length itself incomplete
                    b = buf[i]
                    rl |= (b & 0x7F) << shift
                    i += 1
                    if b < 0x80:
                        if b == 0:
                            raise MalformedPacket(_MALFORMED, "remaining length not minimally encoded")
                        break
                    if i - pos > 4:
                        raise MalformedPacket(_MALFORMED, "remaining length longer than 4 bytes")
                    shift += 7
                start = i
            end = start + rl
            if end - pos > max_size:
                raise PacketTooLarge(end - pos, max_size)
            if end > n:
                self._need = end - pos
                return out, pos
            version = self.version
            if ptype == P.PUBLISH and version is not None:
                # Hot path, written out: topic, packet id, properties, payload.
                flags = first & 0x0F
                qos = (flags >> 1) & 3
                if qos == 3:
                    raise MalformedPacket(_MALFORMED, "PUBLISH with QoS 3")
                if start + 2 > end:
                    raise _truncated("topic name")
                p = start + 2 + ((buf[start] << 8) | buf[start + 1])
                if p > end:
                    raise _truncated("topic name")
                try:
                    topic = buf[start + 2:p].decode("utf-8")
                except UnicodeDecodeError:
                    raise MalformedPacket(_MALFORMED, "topic name is not valid UTF-8") from None
                if "\x00" in topic:
                    raise MalformedPacket(_MALFORMED, "topic name contains U+0000")
                if qos:
                    if p + 2 > end:
                        raise _truncated("packet identifier")
                    pid: int | None = (buf[p] << 8) | buf[p + 1]
                    if not pid:
                        raise MalformedPacket(_MALFORMED, "PUBLISH with packet identifier 0")
                    p += 2
                else:
                    pid = None
                    if flags & 8:
                        raise MalformedPacket(_MALFORMED, "PUBLISH QoS 0 with DUP set")  # MQTT-3.3.1-2
                if version == MQTT_5:
                    if p < end and buf[p] == 0:
                        props = NO_PROPERTIES
                        p += 1
                    else:
                        props, p = _read_properties(buf, p, end, P.PUBLISH)
                        if props.subscription_identifiers and self.role == "server":
                            raise ProtocolError(_PROTOCOL, "client PUBLISH with subscription identifier")
                else:
                    props = NO_PROPERTIES
                out.append(Publish(topic, buf[p:end], qos, bool(flags & 1), bool(flags & 8), pid, props))
            elif rl == 2 and first in _FAST_ACKS and version is not None:
                # Hot path: PUBACK/PUBREC/PUBREL/PUBCOMP with success and no properties.
                pid = (buf[start] << 8) | buf[start + 1]
                if not pid:
                    raise MalformedPacket(_MALFORMED, "packet identifier 0")
                out.append(_FAST_ACKS[first](pid, 0, NO_PROPERTIES))
            else:
                out.append(self._decode_other(ptype, first & 0x0F, buf, start, end))
            pos = end
        return out, pos

    def _reject_type(self, ptype: int) -> None:
        if ptype == 0:
            raise MalformedPacket(_MALFORMED, "reserved packet type 0")
        raise ProtocolError(_PROTOCOL, f"packet type {ptype} is not allowed from the {'client' if self.role == 'server' else 'server'}")

    def _decode_other(self, ptype: int, flags: int, buf: bytes, start: int, end: int) -> Packet:
        if ptype != P.PUBLISH and flags != _FIXED_FLAGS.get(ptype, 0):
            raise MalformedPacket(_MALFORMED, f"reserved flags 0x{flags:X} in packet type {ptype}")
        if ptype == P.CONNECT:
            return _decode_connect(buf, start, end, self)
        version = self.version
        if version is None:
            if self.role == "server":
                raise ProtocolError(_PROTOCOL, "first packet must be CONNECT")
            invariant(False, "a client-role Decoder needs its version set before decoding")
            raise AssertionError  # unreachable; keeps type checkers satisfied
        if ptype == P.AUTH and version != MQTT_5:
            raise MalformedPacket(_MALFORMED, "AUTH does not exist in MQTT 3.1.1")
        return _DECODERS[ptype](buf, start, end, version)


def _decode_connect(buf: bytes, pos: int, end: int, decoder: Decoder) -> Connect:
    name, pos = _read_str(buf, pos, end, "protocol name")
    if pos >= end:
        raise _truncated("protocol level")
    level = buf[pos]
    if name != PROTOCOL_NAME or level not in (MQTT_3_1_1, MQTT_5):
        raise UnsupportedProtocol(level, name)
    if decoder.version is None:
        # Known as soon as the level is read, so that a CONNECT malformed further on can still
        # be answered with a CONNACK in the client's own format.
        decoder.version = level
    if pos + 4 > end:
        raise _truncated("CONNECT variable header")
    flags = buf[pos + 1]
    keepalive = (buf[pos + 2] << 8) | buf[pos + 3]
    pos += 4
    if flags & 0x01:
        raise MalformedPacket(_MALFORMED, "CONNECT reserved flag set")  # MQTT-3.1.2-3
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 3
    will_retain = bool(flags & 0x20)
    if will_qos == 3:
        raise MalformedPacket(_MALFORMED, "will QoS 3")
    if not will_flag and (will_qos or will_retain):
        raise MalformedPacket(_MALFORMED, "will QoS/retain set without will flag")  # MQTT-3.1.2-11/13/15
    has_password = bool(flags & 0x40)
    has_username = bool(flags & 0x80)
    if level == MQTT_3_1_1 and has_password and not has_username:
        raise MalformedPacket(_MALFORMED, "password flag without username flag")  # MQTT-3.1.2-22
    props = NO_PROPERTIES
    if level == MQTT_5:
        props, pos = _read_properties(buf, pos, end, P.CONNECT)
    client_id, pos = _read_str(buf, pos, end, "client identifier")
    will = None
    if will_flag:
        will_props = NO_PROPERTIES
        if level == MQTT_5:
            will_props, pos = _read_properties(buf, pos, end, WILL)
        will_topic, pos = _read_str(buf, pos, end, "will topic")
        will_payload, pos = _read_bin(buf, pos, end, "will payload")
        will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
    username = password = None
    if has_username:
        username, pos = _read_str(buf, pos, end, "user name")
    if has_password:
        password, pos = _read_bin(buf, pos, end, "password")
    _expect_end(pos, end, "CONNECT")
    return Connect(name, level, client_id, bool(flags & 0x02), keepalive, username, password, will, props)


def _dec_connack(buf: bytes, pos: int, end: int, version: int) -> Connack:
    if pos + 2 > end:
        raise _truncated("CONNACK")
    ack_flags, code = buf[pos], buf[pos + 1]
    if ack_flags & 0xFE:
        raise MalformedPacket(_MALFORMED, "CONNACK reserved flags set")
    if version == MQTT_5:
        if code not in CONNACK_REASONS:
            raise MalformedPacket(_MALFORMED, f"invalid CONNACK reason 0x{code:02X}")
        props, pos = _read_properties(buf, pos + 2, end, P.CONNACK)
    else:
        if code > 5:
            raise MalformedPacket(_MALFORMED, f"invalid CONNACK return code {code}")
        code = connack_v3_to_v5(code)
        props, pos = NO_PROPERTIES, pos + 2
    _expect_end(pos, end, "CONNACK")
    return Connack(bool(ack_flags & 1), code, props)


def _dec_pub_ack(ptype: int) -> Callable[[bytes, int, int, int], Packet]:
    cls: Callable[..., Packet] = _ACK_CLASSES[ptype]
    reasons = _ACK_REASONS[ptype]

    def dec(buf: bytes, pos: int, end: int, version: int) -> Packet:
        rl = end - pos
        if rl < 2:
            raise _truncated("packet identifier")
        pid = (buf[pos] << 8) | buf[pos + 1]
        if not pid:
            raise MalformedPacket(_MALFORMED, "packet identifier 0")
        if rl == 2:
            return cls(pid)
        if version != MQTT_5:
            raise MalformedPacket(_MALFORMED, "3.1.1 acknowledgement longer than 2 bytes")
        code = buf[pos + 2]
        if code not in reasons:
            raise MalformedPacket(_MALFORMED, f"invalid reason code 0x{code:02X}")
        if rl == 3:
            return cls(pid, code)
        props, p = _read_properties(buf, pos + 3, end, ptype)
        _expect_end(p, end, "acknowledgement")
        return cls(pid, code, props)
    return dec


def _read_packet_id(buf: bytes, pos: int, end: int) -> int:
    pid = _read_u16(buf, pos, end, "packet identifier")
    if not pid:
        raise MalformedPacket(_MALFORMED, "packet identifier 0")
    return pid


def _dec_subscribe(buf: bytes, pos: int, end: int, version: int) -> Subscribe:
    pid = _read_packet_id(buf, pos, end)
    pos += 2
    props = NO_PROPERTIES
    if version == MQTT_5:
        props, pos = _read_properties(buf, pos, end, P.SUBSCRIBE)
    subs: list[tuple[str, SubscriptionOptions]] = []
    while pos < end:
        topic_filter, pos = _read_str(buf, pos, end, "topic filter")
        if pos >= end:
            raise _truncated("subscription options")
        o = buf[pos]
        pos += 1
        qos = o & 3
        if qos == 3:
            raise MalformedPacket(_MALFORMED, "subscription QoS 3")
        if version == MQTT_5:
            if o & 0xC0:
                raise MalformedPacket(_MALFORMED, "subscription options reserved bits set")
            retain_handling = (o >> 4) & 3
            if retain_handling == 3:
                raise ProtocolError(_PROTOCOL, "retain handling 3")
            subs.append((topic_filter, SubscriptionOptions(qos, bool(o & 4), bool(o & 8), retain_handling)))
        else:
            if o & 0xFC:
                raise MalformedPacket(_MALFORMED, "subscription options reserved bits set")  # MQTT-3-8.3-4
            subs.append((topic_filter, SubscriptionOptions(qos)))
    if not subs:
        raise ProtocolError(_PROTOCOL, "SUBSCRIBE without topic filters")  # MQTT-3.8.3-3
    return Subscribe(pid, tuple(subs), props)


def _dec_suback(buf: bytes, pos: int, end: int, version: int) -> Suback:
    pid = _read_packet_id(buf, pos, end)
    pos += 2
    props = NO_PROPERTIES
    if version == MQTT_5:
        props, pos = _read_properties(buf, pos, end, P.SUBACK)
    codes = tuple(buf[pos:end])
    allowed = SUBACK_REASONS if version == MQTT_5 else V3_SUBACK_CODES
    if not codes or not allowed.issuperset(codes):
        raise MalformedPacket(_MALFORMED, "invalid or missing SUBACK reason codes")
    return Suback(pid, codes, props)


def _dec_unsubscribe(buf: bytes, pos: int, end: int, version: int) -> Unsubscribe:
    pid = _read_packet_id(buf, pos, end)
    pos += 2
    props = NO_PROPERTIES
    if version == MQTT_5:
        props, pos = _read_properties(buf, pos, end, P.UNSUBSCRIBE)
    filters: list[str] = []
    while pos < end:
        f, pos = _read_str(buf, pos, end, "topic filter")
        filters.append(f)
    if not filters:
        raise ProtocolError(_PROTOCOL, "UNSUBSCRIBE without topic filters")  # MQTT-3.10.3-2
    return Unsubscribe(pid, tuple(filters), props)


def _dec_unsuback(buf: bytes, pos: int, end: int, version: int) -> Unsuback:
    pid = _read_packet_id(buf, pos, end)
    pos += 2
    if version != MQTT_5:
        _expect_end(pos, end, "UNSUBACK")
        return Unsuback(pid)
    props, pos = _read_properties(buf, pos, end, P.UNSUBACK)
    codes = tuple(buf[pos:end])
    if not codes or not UNSUBACK_REASONS.issuperset(codes):
        raise MalformedPacket(_MALFORMED, "invalid or missing UNSUBACK reason codes")
    return Unsuback(pid, codes, props)


def _dec_empty(cls: Callable[[], Packet], name: str) -> Callable[[bytes, int, int, int], Packet]:
    def dec(buf: bytes, pos: int, end: int, version: int) -> Packet:
        _expect_end(pos, end, name)
        return cls()
    return dec


def _dec_reason_only(ptype: int, cls: Callable[..., Packet], reasons: frozenset[int]) -> Callable[[bytes, int, int, int], Packet]:
    name = "DISCONNECT" if ptype == P.DISCONNECT else "AUTH"

    def dec(buf: bytes, pos: int, end: int, version: int) -> Packet:
        if pos == end:
            return cls()
        if version != MQTT_5:
            raise MalformedPacket(_MALFORMED, f"3.1.1 {name} must be empty")
        code = buf[pos]
        if code not in reasons:
            raise MalformedPacket(_MALFORMED, f"invalid reason code 0x{code:02X}")
        if pos + 1 == end:
            return cls(code)
        props, p = _read_properties(buf, pos + 1, end, ptype)
        _expect_end(p, end, name)
        return cls(code, props)
    return dec


_DECODERS: Final[dict[int, Callable[[bytes, int, int, int], Packet]]] = {
    P.CONNACK: _dec_connack,
    P.PUBLISH: lambda buf, s, e, v: _decode_publish_slow(buf, s, e, v),
    P.PUBACK: _dec_pub_ack(P.PUBACK),
    P.PUBREC: _dec_pub_ack(P.PUBREC),
    P.PUBREL: _dec_pub_ack(P.PUBREL),
    P.PUBCOMP: _dec_pub_ack(P.PUBCOMP),
    P.SUBSCRIBE: _dec_subscribe,
    P.SUBACK: _dec_suback,
    P.UNSUBSCRIBE: _dec_unsubscribe,
    P.UNSUBACK: _dec_unsuback,
    P.PINGREQ: _dec_empty(Pingreq, "PINGREQ"),
    P.PINGRESP: _dec_empty(Pingresp, "PINGRESP"),
    P.DISCONNECT: _dec_reason_only(P.DISCONNECT, Disconnect, DISCONNECT_REASONS),
    P.AUTH: _dec_reason_only(P.AUTH, Auth, AUTH_REASONS),
}


def _decode_publish_slow(buf: bytes, s: int, e: int, v: int) -> Packet:
    # Never reached: the decoder loop handles PUBLISH inline once the version is known, and a
    # PUBLISH before it is known is rejected earlier.
    invariant(False, "PUBLISH goes through the inline fast path")
    raise AssertionError


def decode_one(data: bytes, version: int, role: Literal["server", "client"] = "server") -> Packet:
    """Decode exactly one complete packet (tests and tools)."""
    dec = Decoder(max_packet_size=MAX_VARINT + 5, role=role, version=version)
    out = dec.feed(data)
    if len(out) != 1 or dec.buffered_bytes:
        raise MalformedPacket(_MALFORMED, f"expected exactly one packet, got {len(out)} (+{dec.buffered_bytes} bytes)")
    return out[0]
