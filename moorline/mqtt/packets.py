"""MQTT control packets as frozen, slotted dataclasses (events in the h11 sense).

The packets of the publish hot path (PUBLISH and the four acks) are frozen msgspec Structs with
the same fields: one is built per message decoded, and a Struct costs a sixth of what a frozen
dataclass does. ``replace`` copies either kind with some fields changed.

The types are version-agnostic: a 3.1.1 packet is the same object with empty properties
(``NO_PROPERTIES``) and reason code 0. ``codec.encode(packet, version)`` drops what 3.1.1
cannot carry; the decoder fills the defaults in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Properties:
    """All MQTT 5 properties (section 2.2.2.2). ``None`` / empty tuple means absent."""

    payload_format_indicator: int | None = None  # 0x01, byte
    message_expiry_interval: int | None = None  # 0x02, seconds
    content_type: str | None = None  # 0x03
    response_topic: str | None = None  # 0x08
    correlation_data: bytes | None = None  # 0x09
    subscription_identifiers: tuple[int, ...] = ()  # 0x0B, may repeat in PUBLISH
    session_expiry_interval: int | None = None  # 0x11, seconds
    assigned_client_identifier: str | None = None  # 0x12
    server_keep_alive: int | None = None  # 0x13, seconds
    authentication_method: str | None = None  # 0x15
    authentication_data: bytes | None = None  # 0x16
    request_problem_information: int | None = None  # 0x17
    will_delay_interval: int | None = None  # 0x18, seconds
    request_response_information: int | None = None  # 0x19
    response_information: str | None = None  # 0x1A
    server_reference: str | None = None  # 0x1C
    reason_string: str | None = None  # 0x1F
    receive_maximum: int | None = None  # 0x21
    topic_alias_maximum: int | None = None  # 0x22
    topic_alias: int | None = None  # 0x23
    maximum_qos: int | None = None  # 0x24
    retain_available: int | None = None  # 0x25
    user_properties: tuple[tuple[str, str], ...] = ()  # 0x26, may repeat, order kept
    maximum_packet_size: int | None = None  # 0x27, bytes
    wildcard_subscription_available: int | None = None  # 0x28
    subscription_identifier_available: int | None = None  # 0x29
    shared_subscription_available: int | None = None  # 0x2A

    def __repr__(self) -> str:
        # Only the properties that are present: the full list of 27 fields drowns every log line.
        present = []
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and value != ():
                present.append(f"{name}={value!r}")
        return f"Properties({', '.join(present)})"


NO_PROPERTIES = Properties()


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connect:
    protocol_name: str = "MQTT"
    protocol_level: int = 4  # 4 = 3.1.1, 5 = 5.0
    client_id: str = ""
    clean_start: bool = True
    keepalive: int = 0  # seconds, 0 = off
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connack:
    session_present: bool = False
    reason_code: int = 0  # v5 reason code; the 3.1.1 encoding maps it to a return code
    properties: Properties = NO_PROPERTIES


class Publish(msgspec.Struct, frozen=True, gc=False):
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # present iff qos > 0
    properties: Properties = NO_PROPERTIES


class Puback(msgspec.Struct, frozen=True, gc=False):
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


class Pubrec(msgspec.Struct, frozen=True, gc=False):
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


class Pubrel(msgspec.Struct, frozen=True, gc=False):
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


class Pubcomp(msgspec.Struct, frozen=True, gc=False):
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class SubscriptionOptions:
    qos: int
    no_local: bool = False  # v5 only
    retain_as_published: bool = False  # v5 only
    retain_handling: int = 0  # v5 only: 0 send, 1 send if new subscription, 2 never


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    subscriptions: tuple[tuple[str, SubscriptionOptions], ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Suback:
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    filters: tuple[str, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsuback:
    packet_id: int
    reason_codes: tuple[int, ...] = ()  # 3.1.1 UNSUBACK carries none
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Pingreq:
    pass


@dataclass(frozen=True, slots=True)
class Pingresp:
    pass


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


Packet = (
    Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Suback
    | Unsubscribe | Unsuback | Pingreq | Pingresp | Disconnect | Auth
)

# Control packet type numbers (fixed header, bits 7-4).
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15

PACKET_TYPE_OF: dict[type, int] = {
    Connect: CONNECT, Connack: CONNACK, Publish: PUBLISH, Puback: PUBACK, Pubrec: PUBREC,
    Pubrel: PUBREL, Pubcomp: PUBCOMP, Subscribe: SUBSCRIBE, Suback: SUBACK, Unsubscribe: UNSUBSCRIBE,
    Unsuback: UNSUBACK, Pingreq: PINGREQ, Pingresp: PINGRESP, Disconnect: DISCONNECT, Auth: AUTH,
}


_T = TypeVar("_T")


def replace(packet: _T, **changes: Any) -> _T:
    """A copy of ``packet`` (a packet or ``Properties``) with ``changes`` applied."""
    if isinstance(packet, msgspec.Struct):
        return msgspec.structs.replace(packet, **changes)
    return dataclasses.replace(packet, **changes)  # type: ignore[type-var]
