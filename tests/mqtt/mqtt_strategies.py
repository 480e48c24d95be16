"""Hypothesis strategies for valid MQTT packets, and the 3.1.1 normalisation of a packet
(what a v5-shaped packet looks like after a trip through the 3.1.1 encoding)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from moorline.mqtt import packets as P
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
    replace,
)
from moorline.mqtt.properties import (
    ALLOWED_NAMES,
    BIN,
    BOOLEAN_BYTE_PROPERTIES,
    BY_NAME,
    BYTE,
    MAX_VARINT,
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
    connack_v3_to_v5,
    connack_v5_to_v3,
    suback_v5_to_v3,
)

# Valid MQTT strings: any code point except U+0000 and lone surrogates (not encodable).
mqtt_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12)
level = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00/+#"), max_size=6)
topic_names = st.lists(level, min_size=1, max_size=5).map("/".join).filter(bool)
packet_ids = st.integers(1, 0xFFFF)
small_bytes = st.binary(max_size=40)


def _value(name: str, kind: int, context: int) -> st.SearchStrategy[Any]:
    if name == "subscription_identifiers":
        one = st.integers(1, MAX_VARINT)
        if context == P.PUBLISH:
            return st.lists(one, min_size=1, max_size=3).map(tuple)
        return one.map(lambda v: (v,))
    if kind == PAIR:
        return st.lists(st.tuples(mqtt_text, mqtt_text), min_size=1, max_size=3).map(tuple)
    if name in BOOLEAN_BYTE_PROPERTIES:
        return st.integers(0, 1)
    low = 1 if name in ("receive_maximum", "maximum_packet_size") else 0
    if kind == BYTE:
        return st.integers(low, 0xFF)
    if kind == U16:
        return st.integers(low, 0xFFFF)
    if kind == U32:
        return st.integers(low, 0xFFFFFFFF)
    if kind == VARINT:
        return st.integers(low, MAX_VARINT)
    if kind == STR:
        return mqtt_text
    assert kind == BIN
    return small_bytes


def properties(context: int, exclude: frozenset[str] = frozenset()) -> st.SearchStrategy[Properties]:
    names = sorted(ALLOWED_NAMES[context] - exclude)
    optional = {name: _value(name, BY_NAME[name][1], context) for name in names}
    return st.fixed_dictionaries({}, optional=optional).map(lambda d: Properties(**d) if d else NO_PROPERTIES)


def wills(version: int) -> st.SearchStrategy[Will]:
    return st.builds(Will, topic_names, small_bytes, st.integers(0, 2), st.booleans(), properties(WILL))


@st.composite
def connects(draw: st.DrawFn, version: int) -> Connect:
    username = draw(st.none() | mqtt_text)
    password = draw(st.none() | small_bytes)
    if version == 4 and username is None:
        password = None  # 3.1.1 forbids a password without a user name
    props = draw(properties(P.CONNECT))
    if props.authentication_data is not None and props.authentication_method is None:
        props = dataclasses.replace(props, authentication_method="m")
    return Connect("MQTT", version, draw(mqtt_text), draw(st.booleans()), draw(st.integers(0, 0xFFFF)),
                   username, password, draw(st.none() | wills(version)), props)


def publishes(exclude: frozenset[str] = frozenset()) -> st.SearchStrategy[Publish]:
    def build(topic: str, payload: bytes, qos: int, retain: bool, dup: bool, pid: int, props: Properties) -> Publish:
        return Publish(topic, payload, qos, retain, dup and qos > 0, pid if qos else None, props)
    return st.builds(build, topic_names, st.binary(max_size=300), st.integers(0, 2), st.booleans(), st.booleans(),
                     packet_ids, properties(P.PUBLISH, exclude))


def _acks(cls: type, ptype: int, reasons: frozenset[int]) -> st.SearchStrategy[Packet]:
    return st.builds(cls, packet_ids, st.sampled_from(sorted(reasons)), properties(ptype))


sub_options = st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2))
subscribes = st.builds(Subscribe, packet_ids, st.lists(st.tuples(mqtt_text, sub_options), min_size=1, max_size=4).map(tuple),
                       properties(P.SUBSCRIBE))
subacks = st.builds(Suback, packet_ids, st.lists(st.sampled_from(sorted(SUBACK_REASONS)), min_size=1, max_size=4).map(tuple),
                    properties(P.SUBACK))
unsubscribes = st.builds(Unsubscribe, packet_ids, st.lists(mqtt_text, min_size=1, max_size=4).map(tuple),
                         properties(P.UNSUBSCRIBE))
unsubacks = st.builds(Unsuback, packet_ids, st.lists(st.sampled_from(sorted(UNSUBACK_REASONS)), min_size=1, max_size=4).map(tuple),
                      properties(P.UNSUBACK))
connacks = st.builds(Connack, st.booleans(), st.sampled_from(sorted(CONNACK_REASONS)), properties(P.CONNACK))
disconnects = st.builds(Disconnect, st.sampled_from(sorted(DISCONNECT_REASONS)), properties(P.DISCONNECT))
auths = st.builds(Auth, st.sampled_from(sorted(AUTH_REASONS)), properties(P.AUTH))

# Server-role decoders see client packets; the client role sees server packets.
NO_SUB_IDS = frozenset({"subscription_identifiers"})


def client_packets(version: int) -> st.SearchStrategy[Packet]:
    """Packets a client sends (after CONNECT)."""
    options: list[st.SearchStrategy[Packet]] = [
        publishes(NO_SUB_IDS), _acks(Puback, P.PUBACK, PUBACK_REASONS), _acks(Pubrec, P.PUBREC, PUBACK_REASONS),
        _acks(Pubrel, P.PUBREL, PUBREL_REASONS), _acks(Pubcomp, P.PUBCOMP, PUBREL_REASONS), subscribes,
        unsubscribes, st.just(Pingreq()), disconnects,
    ]
    if version == 5:
        options.append(auths)
    return st.one_of(options)


def server_packets(version: int) -> st.SearchStrategy[Packet]:
    options: list[st.SearchStrategy[Packet]] = [
        connacks, publishes(), _acks(Puback, P.PUBACK, PUBACK_REASONS), _acks(Pubrec, P.PUBREC, PUBACK_REASONS),
        _acks(Pubrel, P.PUBREL, PUBREL_REASONS), _acks(Pubcomp, P.PUBCOMP, PUBREL_REASONS), subacks, unsubacks,
        st.just(Pingresp()),
    ]
    if version == 5:
        options += [disconnects, auths]
    return st.one_of(options)


def normalise(packet: Packet, version: int) -> Packet:
    """What ``packet`` decodes to after encoding with ``version``."""
    if version == 5:
        return packet
    np = NO_PROPERTIES
    if isinstance(packet, Connect):
        will = packet.will and dataclasses.replace(packet.will, properties=np)
        return dataclasses.replace(packet, will=will, properties=np)
    if isinstance(packet, Connack):
        return Connack(packet.session_present, connack_v3_to_v5(connack_v5_to_v3(packet.reason_code)))
    if isinstance(packet, Publish):
        return replace(packet, properties=np)
    if isinstance(packet, (Puback, Pubrec, Pubrel, Pubcomp)):
        return type(packet)(packet.packet_id)
    if isinstance(packet, Subscribe):
        return Subscribe(packet.packet_id, tuple((f, SubscriptionOptions(o.qos)) for f, o in packet.subscriptions))
    if isinstance(packet, Suback):
        return Suback(packet.packet_id, tuple(suback_v5_to_v3(c) for c in packet.reason_codes))
    if isinstance(packet, Unsubscribe):
        return Unsubscribe(packet.packet_id, packet.filters)
    if isinstance(packet, Unsuback):
        return Unsuback(packet.packet_id)
    if isinstance(packet, Disconnect):
        return Disconnect()
    return packet
