"""The few MQTT packets the lean load generator needs, encoded once up front (3.1.1 = level 4, 5.0 = level 5).

Deliberately tiny and separate from moorline.mqtt: the benchmark must not depend on the code it measures.
"""

from __future__ import annotations

import struct

PUBLISH = 0x3
PUBACK = 0x4
CONNACK = 0x2
SUBACK = 0x9

_PROP_RECEIVE_MAXIMUM = 0x21


def varint(n: int) -> bytes:
    """MQTT variable byte integer."""
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _utf8(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">H", len(raw)) + raw


def _packet(first_byte: int, body: bytes) -> bytes:
    return bytes([first_byte]) + varint(len(body)) + body


def connect_packet(
    client_id: str, protocol: int, keepalive: int = 60, receive_maximum: int | None = None
) -> bytes:
    """CONNECT with clean session/start; on 5.0 optionally a Receive Maximum (our consumer-side credit)."""
    header = _utf8("MQTT") + bytes([protocol, 0x02]) + struct.pack(">H", keepalive)
    if protocol == 5:
        props = (
            b""
            if receive_maximum is None
            else bytes([_PROP_RECEIVE_MAXIMUM]) + struct.pack(">H", receive_maximum)
        )
        header += varint(len(props)) + props
    return _packet(0x10, header + _utf8(client_id))


def subscribe_packet(packet_id: int, topic_filter: str, qos: int, protocol: int) -> bytes:
    body = (
        struct.pack(">H", packet_id)
        + (b"\x00" if protocol == 5 else b"")
        + _utf8(topic_filter)
        + bytes([qos])
    )
    return _packet(0x82, body)


def publish_qos1_packet(topic: str, packet_id: int, payload: bytes, protocol: int) -> bytes:
    body = _utf8(topic) + struct.pack(">H", packet_id) + (b"\x00" if protocol == 5 else b"") + payload
    return _packet(0x32, body)


def puback_packet(packet_id: int) -> bytes:
    """A 2-byte PUBACK is valid in both versions (5.0: reason 'success' and no properties may be omitted)."""
    return b"\x40\x02" + struct.pack(">H", packet_id)


def disconnect_packet() -> bytes:
    return b"\xe0\x00"


def split_packets(buf: bytes | bytearray, start: int = 0) -> tuple[list[tuple[int, int, int]], int]:
    """Complete packets in ``buf[start:]`` as (first byte, body start, body end), and where the rest begins."""
    packets: list[tuple[int, int, int]] = []
    pos = start
    end = len(buf)
    while pos + 2 <= end:
        length = 0
        shift = 0
        i = pos + 1
        while True:
            if i >= end:
                return packets, pos
            byte = buf[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                break
            shift += 7
        if i + length > end:
            return packets, pos
        packets.append((buf[pos], i, i + length))
        pos = i + length
    return packets, pos


def publish_packet_id(buf: bytes | bytearray, body_start: int) -> int:
    """The packet id of a QoS>0 PUBLISH whose body starts at ``body_start``."""
    topic_len = (buf[body_start] << 8) | buf[body_start + 1]
    at = body_start + 2 + topic_len
    return (buf[at] << 8) | buf[at + 1]
