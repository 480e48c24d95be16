"""Errors the MQTT layer raises when the *peer* misbehaves.

A ``ProtocolError`` always carries the MQTT 5 reason code the broker should put in its
DISCONNECT (or CONNACK) before closing; a 3.1.1 connection is just closed. Programming
errors (we misused our own API) are ``InvariantViolation`` from ``moorline.invariant``
and must never be confused with these.
"""

from __future__ import annotations

from moorline.mqtt.reasons import ReasonCode


class ProtocolError(Exception):
    """The peer broke the protocol; close the connection with ``reason_code``."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(f"{message} (reason 0x{int(reason_code):02X})")
        self.reason_code = int(reason_code)
        self.message = message


class MalformedPacket(ProtocolError):
    """The bytes cannot be parsed as the packet they claim to be (spec: Malformed Packet)."""

    def __init__(self, reason_code: int = ReasonCode.MALFORMED_PACKET, message: str = "malformed packet") -> None:
        super().__init__(reason_code, message)


class PacketTooLarge(ProtocolError):
    """A packet larger than the receiver's maximum packet size (total bytes, header included)."""

    def __init__(self, size: int, limit: int | None = None) -> None:
        text = f"packet of {size} bytes exceeds maximum packet size"
        if limit is not None:
            text += f" {limit}"
        super().__init__(ReasonCode.PACKET_TOO_LARGE, text)
        self.size = size
        self.limit = limit


class UnsupportedProtocol(ProtocolError):
    """CONNECT with a protocol name/level we do not speak.

    The broker answers with CONNACK return code 1 (3.1.1 format) or reason 0x84 (v5 format,
    when ``level == 5``) and closes; ``level`` tells it which format the client understands.
    """

    def __init__(self, level: int, protocol_name: str) -> None:
        super().__init__(
            ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
            f"unsupported protocol {protocol_name!r} level {level}",
        )
        self.level = level
        self.protocol_name = protocol_name
