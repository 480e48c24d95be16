"""MQTT 5 property table: identifiers, wire types, and which packets may carry each.

One table drives decoding, encoding and the hypothesis strategies, so the three cannot
drift apart.
"""

from __future__ import annotations

from typing import Final

from moorline.mqtt import packets as P

# Wire types of property values (section 1.5 / 2.2.2.2).
BYTE: Final = 0
U16: Final = 1
U32: Final = 2
VARINT: Final = 3
STR: Final = 4
BIN: Final = 5
PAIR: Final = 6

# Property contexts: packet type numbers, plus the will properties inside CONNECT.
WILL: Final = 16

_ACKS = (P.PUBACK, P.PUBREC, P.PUBREL, P.PUBCOMP)
_PUB_WILL = (P.PUBLISH, WILL)
_ALL = tuple(range(1, 17))

# identifier -> (field name, wire type, contexts where allowed)
PROPERTY_TABLE: Final[dict[int, tuple[str, int, tuple[int, ...]]]] = {
    0x01: ("payload_format_indicator", BYTE, _PUB_WILL),
    0x02: ("message_expiry_interval", U32, _PUB_WILL),
    0x03: ("content_type", STR, _PUB_WILL),
    0x08: ("response_topic", STR, _PUB_WILL),
    0x09: ("correlation_data", BIN, _PUB_WILL),
    0x0B: ("subscription_identifiers", VARINT, (P.PUBLISH, P.SUBSCRIBE)),
    0x11: ("session_expiry_interval", U32, (P.CONNECT, P.CONNACK, P.DISCONNECT)),
    0x12: ("assigned_client_identifier", STR, (P.CONNACK,)),
    0x13: ("server_keep_alive", U16, (P.CONNACK,)),
    0x15: ("authentication_method", STR, (P.CONNECT, P.CONNACK, P.AUTH)),
    0x16: ("authentication_data", BIN, (P.CONNECT, P.CONNACK, P.AUTH)),
    0x17: ("request_problem_information", BYTE, (P.CONNECT,)),
    0x18: ("will_delay_interval", U32, (WILL,)),
    0x19: ("request_response_information", BYTE, (P.CONNECT,)),
    0x1A: ("response_information", STR, (P.CONNACK,)),
    0x1C: ("server_reference", STR, (P.CONNACK, P.DISCONNECT)),
    0x1F: ("reason_string", STR, (P.CONNACK, *_ACKS, P.SUBACK, P.UNSUBACK, P.DISCONNECT, P.AUTH)),
    0x21: ("receive_maximum", U16, (P.CONNECT, P.CONNACK)),
    0x22: ("topic_alias_maximum", U16, (P.CONNECT, P.CONNACK)),
    0x23: ("topic_alias", U16, (P.PUBLISH,)),
    0x24: ("maximum_qos", BYTE, (P.CONNACK,)),
    0x25: ("retain_available", BYTE, (P.CONNACK,)),
    0x26: ("user_properties", PAIR, _ALL),
    0x27: ("maximum_packet_size", U32, (P.CONNECT, P.CONNACK)),
    0x28: ("wildcard_subscription_available", BYTE, (P.CONNACK,)),
    0x29: ("subscription_identifier_available", BYTE, (P.CONNACK,)),
    0x2A: ("shared_subscription_available", BYTE, (P.CONNACK,)),
}

# Properties whose value is a boolean byte: any value but 0/1 is a Protocol Error.
BOOLEAN_BYTE_PROPERTIES: Final = frozenset({
    "payload_format_indicator", "request_problem_information", "request_response_information",
    "maximum_qos", "retain_available", "wildcard_subscription_available",
    "subscription_identifier_available", "shared_subscription_available",
})
# Properties for which 0 is a Protocol Error.
NONZERO_PROPERTIES: Final = frozenset({"receive_maximum", "maximum_packet_size", "subscription_identifiers"})

MAX_VARINT: Final = 268_435_455

# context -> {identifier -> (field name, wire type)}: the per-packet view the decoder uses.
ALLOWED: Final[dict[int, dict[int, tuple[str, int]]]] = {
    ctx: {pid: (name, kind) for pid, (name, kind, ctxs) in PROPERTY_TABLE.items() if ctx in ctxs}
    for ctx in _ALL
}
# Field name -> (identifier, wire type), in identifier order: the order the encoder writes.
BY_NAME: Final[dict[str, tuple[int, int]]] = {
    name: (pid, kind) for pid, (name, kind, _) in sorted(PROPERTY_TABLE.items())
}
# Field names allowed per context (for strategies and encode-side checks).
ALLOWED_NAMES: Final[dict[int, frozenset[str]]] = {
    ctx: frozenset(name for name, _ in table.values()) for ctx, table in ALLOWED.items()
}
