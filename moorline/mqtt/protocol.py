"""Per-connection MQTT protocol state (server side), sans-IO.

Bytes in through ``receive(data)`` -> validated packets out; packets in through
``encode_outbound(packet)`` -> bytes (or None when the client's maximum packet size forbids
sending it). The broker's connection edge owns one ``ProtocolState`` per socket. Every rule
of the connection-level protocol that is not about routing or storage lives here:

- the first packet is CONNECT, a second CONNECT is a Protocol Error;
- inbound topic aliases (v5) are resolved, so the broker only ever sees full topic names;
- inbound Receive Maximum: QoS>0 PUBLISHes we have not finished acknowledging are counted
  and exceeding our advertised maximum is 0x93 (v5);
- PUBLISH and will topics are validated (wildcards, and more levels or bytes than the broker's
  ``TopicBounds``, -> 0x90); AUTH needs the CONNECT's method;
- until CONNECT is accepted, the first packet may be at most ``max_connect_packet_size`` bytes: it is
  refused as soon as its fixed header says it is larger, before its body is buffered;
- ``partial_since``: when the incomplete packet now buffered began to arrive (the caller's clock,
  passed to ``receive``), so the broker can close a connection that never finishes a packet;
- outbound: topic aliases (optional), the client's Maximum Packet Size (MQTT-3.1.2-25) and
  the client's Receive Maximum (flow control counters the broker drives).

Errors are ``ProtocolError`` with the v5 reason code. While ``awaiting_connect`` is true the
broker answers an error with CONNACK(reason) (CONNACK return code on 3.1.1), afterwards with
DISCONNECT(reason) on v5 or a plain close on 3.1.1.
"""

from __future__ import annotations

from moorline.invariant import invariant
from moorline.mqtt.codec import (
    DEFAULT_MAX_PACKET_SIZE,
    MQTT_5,
    Decoder,
    encode,
    encode_properties,
    encode_publish_header,
)
from moorline.mqtt.errors import ProtocolError
from moorline.mqtt.packets import (
    NO_PROPERTIES,
    Auth,
    Connect,
    Packet,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Subscribe,
    replace,
)
from moorline.mqtt.reasons import ReasonCode
from moorline.mqtt.topics import (
    DEFAULT_TOPIC_BOUNDS,
    TopicBounds,
    is_shared,
    topic_filter_error,
    topic_name_error,
)

RC = ReasonCode
SPEC_RECEIVE_MAXIMUM = 65535  # what a client may assume when we advertise nothing

SPLIT_PAYLOAD_BYTES = 16 * 1024  # outbound payloads this large are not joined to their header
# A CONNECT's fixed header (at most 5 bytes) plus its protocol name (6) and level (1): enough to know
# its size and, when refusing it, whether to answer in MQTT 5.
_CONNECT_HEAD_BYTES = 12


class ProtocolState:
    """One client connection's protocol state, seen from the server."""

    def __init__(
        self,
        *,
        max_packet_size_in: int = DEFAULT_MAX_PACKET_SIZE,
        topic_alias_maximum_in: int = 0,
        receive_maximum_in: int = SPEC_RECEIVE_MAXIMUM,
        outbound_topic_aliases: bool = True,
        topic_bounds: TopicBounds = DEFAULT_TOPIC_BOUNDS,
        max_connect_packet_size: int | None = None,
    ) -> None:
        invariant(0 <= topic_alias_maximum_in <= 0xFFFF, "topic_alias_maximum_in must be 0..65535")
        invariant(1 <= receive_maximum_in <= 0xFFFF, "receive_maximum_in must be 1..65535")
        self.decoder = Decoder(max_packet_size_in, role="server")
        self.topic_bounds = topic_bounds
        # Bytes buffered before CONNECT is accepted: a CONNECT is small, and a socket that has not
        # authenticated must be cheap. None = the maximum packet size.
        self.max_connect_packet_size = min(max_connect_packet_size or max_packet_size_in, max_packet_size_in)
        self._connect_head = b""  # the stream's first bytes, until the first packet's size is known
        self._connect_size_known = False
        self._refused_connect_level: int | None = None
        self.partial_since: float | None = None  # see receive()
        self.topic_alias_maximum_in = topic_alias_maximum_in
        self.receive_maximum_in = receive_maximum_in
        self.outbound_topic_aliases = outbound_topic_aliases
        self.connect: Connect | None = None  # the accepted CONNECT
        self.keepalive = 0  # seconds; the broker may override it (v5 Server Keep Alive)
        # Limits the client announced in CONNECT (spec defaults until then).
        self.client_receive_maximum = SPEC_RECEIVE_MAXIMUM
        self.client_maximum_packet_size: int | None = None  # None = no limit beyond the protocol's
        self.client_topic_alias_maximum = 0
        self._aliases_in: dict[int, str] = {}  # bounded by topic_alias_maximum_in
        self._inflight_in: set[int] = set()  # packet ids; bounded by receive_maximum_in (v5) / 65535
        self._aliases_out: dict[str, int] = {}  # bounded by client_topic_alias_maximum
        self._inflight_out = 0
        self._error: ProtocolError | None = None

    # -- inbound ---------------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The protocol level of the accepted CONNECT (of a refused one, when its header showed it)."""
        return self.decoder.version or self._refused_connect_level

    @property
    def awaiting_connect(self) -> bool:
        return self.connect is None

    def connack_properties(self) -> Properties:
        """The limits this state enforces, for the v5 CONNACK (so the client knows them)."""
        return Properties(
            receive_maximum=self.receive_maximum_in if self.receive_maximum_in != SPEC_RECEIVE_MAXIMUM else None,
            topic_alias_maximum=self.topic_alias_maximum_in or None,
            maximum_packet_size=self.decoder.max_packet_size,
        )

    def receive(self, data: bytes, now: float = 0.0) -> list[Packet]:
        """Validated packets from the client's bytes; raises ProtocolError (and stays failed).

        ``now`` is the caller's clock (any scale): ``partial_since`` becomes the ``now`` of the call
        in which the incomplete packet left buffered began to arrive, None when nothing is left."""
        if self._error is not None:
            raise self._error
        decoder = self.decoder
        had_partial = decoder.buffered_bytes > 0
        try:
            if not self._connect_size_known:
                self._check_connect_size(data)
            packets = decoder.feed(data)
            for i, packet in enumerate(packets):
                kind = type(packet)
                if kind is Publish:
                    packets[i] = self._inbound_publish(packet)  # type: ignore[arg-type]
                elif self.connect is None:
                    if kind is not Connect:
                        raise ProtocolError(RC.PROTOCOL_ERROR, "first packet must be CONNECT")
                    self.on_connect(packet)  # type: ignore[arg-type]
                elif kind is Connect:
                    raise ProtocolError(RC.PROTOCOL_ERROR, "second CONNECT")  # MQTT-3.1.0-2
                elif kind is Subscribe:
                    self._inbound_subscribe(packet)  # type: ignore[arg-type]
                elif kind is Auth:
                    self._inbound_auth(packet)  # type: ignore[arg-type]
        except ProtocolError as e:
            self._error = e
            raise
        if decoder.buffered_bytes:
            if packets or not had_partial:
                self.partial_since = now
        else:
            self.partial_since = None
        return packets

    def _check_connect_size(self, data: bytes) -> None:
        """Refuse the stream's first packet as soon as its fixed header says it is larger than
        ``max_connect_packet_size``, before the decoder buffers its body (at most
        ``_CONNECT_HEAD_BYTES`` are held, to see a CONNECT's protocol level)."""
        head = self._connect_head + data[:_CONNECT_HEAD_BYTES - len(self._connect_head)]
        self._connect_head = head
        size = 0
        for i in range(1, min(len(head), 5)):
            size |= (head[i] & 0x7F) << (7 * (i - 1))
            if head[i] < 0x80:
                total = i + 1 + size
                break
        else:
            if len(head) >= 5:  # a remaining length longer than 4 bytes: the decoder says malformed
                self._connect_decided()
            return
        if total <= self.max_connect_packet_size:
            self._connect_decided()
            return
        level_at = i + 1 + 6  # after the protocol name "MQTT" (2-byte length, 4 bytes)
        name = head[i + 1:level_at]
        if head[0] >> 4 == 1 and b"\x00\x04MQTT".startswith(name) and len(head) <= level_at:
            return  # a few bytes more show a CONNECT's level: an MQTT 5 client is answered in kind
        self._connect_decided()
        # MQTT 5 gets CONNACK 0x95; 3.1.1 has no code for it: the connection just closes.
        if head[0] >> 4 == 1 and name == b"\x00\x04MQTT" and head[level_at] == MQTT_5:
            self._refused_connect_level = MQTT_5
        raise ProtocolError(RC.PACKET_TOO_LARGE, f"first packet of {total} bytes, more than the "
                            f"{self.max_connect_packet_size} accepted before CONNECT")

    def _connect_decided(self) -> None:
        self._connect_size_known = True
        self._connect_head = b""

    def on_connect(self, connect: Connect) -> None:
        """Accept ``connect``: version and the client's limits. ``receive`` calls this itself;
        calling it again with the same packet is harmless."""
        if self.connect is connect:
            return
        invariant(self.connect is None, "on_connect called for a second CONNECT")
        if self.decoder.version is None:
            self.decoder.version = connect.protocol_level
        props = connect.properties
        if props.authentication_data is not None and props.authentication_method is None:
            raise ProtocolError(RC.PROTOCOL_ERROR, "authentication data without method")
        if connect.will is not None:
            error = topic_name_error(connect.will.topic, self.topic_bounds)
            if error is not None:
                raise ProtocolError(RC.TOPIC_NAME_INVALID, f"will: {error}")
        if connect.protocol_level == MQTT_5:
            if props.receive_maximum is not None:
                self.client_receive_maximum = props.receive_maximum
            self.client_maximum_packet_size = props.maximum_packet_size
            self.client_topic_alias_maximum = props.topic_alias_maximum or 0
        self.keepalive = connect.keepalive
        self.connect = connect

    def _inbound_publish(self, p: Publish) -> Publish:
        if self.connect is None:
            raise ProtocolError(RC.PROTOCOL_ERROR, "first packet must be CONNECT")
        topic = p.topic
        alias = p.properties.topic_alias
        if alias is not None:
            if alias == 0 or alias > self.topic_alias_maximum_in:
                raise ProtocolError(RC.TOPIC_ALIAS_INVALID, f"topic alias {alias} out of range")
            if topic:
                self._aliases_in[alias] = topic
            else:
                known = self._aliases_in.get(alias)
                if known is None:
                    raise ProtocolError(RC.PROTOCOL_ERROR, f"unknown topic alias {alias}")
                topic = known
            # The broker sees the full topic and never forwards the sender's alias.
            p = replace(p, topic=topic, properties=replace(p.properties, topic_alias=None))
        elif not topic and self.decoder.version == MQTT_5:
            raise ProtocolError(RC.PROTOCOL_ERROR, "empty topic without topic alias")
        error = topic_name_error(topic, self.topic_bounds)
        if error is not None:
            raise ProtocolError(RC.TOPIC_NAME_INVALID, error)  # MQTT-3.3.2-2, and the broker's bounds
        if p.qos:
            pid = p.packet_id
            if pid not in self._inflight_in:
                # 3.1.1 has no Receive Maximum: there the broker applies back-pressure instead.
                if len(self._inflight_in) >= self.receive_maximum_in and self.decoder.version == MQTT_5:
                    raise ProtocolError(RC.RECEIVE_MAXIMUM_EXCEEDED, "receive maximum exceeded")  # MQTT-3.3.4-9
                self._inflight_in.add(pid)  # type: ignore[arg-type]
        return p

    def topic_filter_error(self, topic_filter: str) -> str | None:
        """Why a SUBSCRIBE must refuse this filter (0x8F; 0x80 on 3.1.1), or None. Checks the
        broker's bounds before the filter is split, so a deep filter allocates nothing."""
        return topic_filter_error(topic_filter, self.topic_bounds)

    def _inbound_subscribe(self, s: Subscribe) -> None:
        for topic_filter, options in s.subscriptions:
            if options.no_local and is_shared(topic_filter):
                raise ProtocolError(RC.PROTOCOL_ERROR, "no local on a shared subscription")  # MQTT-3.8.3-4

    def _inbound_auth(self, a: Auth) -> None:
        method = a.properties.authentication_method
        if method is None:
            raise ProtocolError(RC.PROTOCOL_ERROR, "AUTH without authentication method")
        assert self.connect is not None
        if method != self.connect.properties.authentication_method:
            raise ProtocolError(RC.PROTOCOL_ERROR, "AUTH method differs from CONNECT's")  # MQTT-4.12.0-5

    @property
    def inbound_inflight(self) -> int:
        """QoS>0 PUBLISHes received and not yet finished by our PUBACK/PUBCOMP."""
        return len(self._inflight_in)

    def note_inbound_acked(self, packet_id: int) -> None:
        """We sent the final acknowledgement for ``packet_id`` (PUBACK, PUBCOMP, or a PUBREC
        with a failure code). ``encode_outbound`` calls this itself for ack packets; calling
        it twice is harmless."""
        self._inflight_in.discard(packet_id)

    # -- outbound --------------------------------------------------------------------------------

    def encode_outbound(self, packet: Packet) -> bytes | None:
        """Bytes for ``packet``, or None if it must not be sent (too large for the client)."""
        version = self.decoder.version
        invariant(version is not None, "encode_outbound before CONNECT")
        assert version is not None
        kind = type(packet)
        if kind is Publish:
            p: Publish = packet  # type: ignore[assignment]
            body = encode_properties(p.properties) if version == MQTT_5 else b""
            data = self.encode_publish(p.topic, p.topic.encode("utf-8"), p.payload, p.qos, p.retain, p.dup,
                                       p.packet_id, body)
            return b"".join(data) if isinstance(data, tuple) else data
        if isinstance(packet, (Puback, Pubcomp)) or (isinstance(packet, Pubrec) and packet.reason_code >= 0x80):
            self.note_inbound_acked(packet.packet_id)
        data = encode(packet, version)
        limit = self.client_maximum_packet_size
        if limit is None or len(data) <= limit:
            return data
        # MQTT-3.1.2-25: first drop what is optional (reason string, user properties) ...
        props: Properties = getattr(packet, "properties", NO_PROPERTIES)
        if props.reason_string is not None or props.user_properties:
            slim = replace(props, reason_string=None, user_properties=())
            if slim == NO_PROPERTIES:
                slim = NO_PROPERTIES
            slim_packet: Packet = replace(packet, properties=slim)
            data = encode(slim_packet, version)
            if len(data) <= limit:
                return data
        return None  # ... then the packet itself

    def encode_publish(
        self,
        topic: str,
        topic_bytes: bytes,
        payload: bytes,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        props_bytes: bytes = b"",
    ) -> bytes | tuple[bytes, bytes] | None:
        """Hot path for outbound PUBLISH from pre-encoded parts (``props_bytes`` is a property body
        from ``encode_properties``, without a topic alias). Applies outbound topic aliases and the
        client's maximum packet size. None = too large: the broker must then behave as if it had
        sent and completed the message (MQTT-3.1.2-25) and not count it as in flight. A payload of
        ``SPLIT_PAYLOAD_BYTES`` or more comes back as (header, payload), to be written without
        joining them (the payload is not copied)."""
        version = self.decoder.version
        new_alias = 0
        if version == MQTT_5 and self.client_topic_alias_maximum and self.outbound_topic_aliases:
            alias = self._aliases_out.get(topic)
            if alias is not None:
                topic_bytes = b""
                props_bytes = props_bytes + b"\x23" + alias.to_bytes(2, "big")
            elif len(self._aliases_out) < self.client_topic_alias_maximum:
                # First use: send the topic and the new alias; later ones send only the alias.
                new_alias = len(self._aliases_out) + 1
                props_bytes = props_bytes + b"\x23" + new_alias.to_bytes(2, "big")
        head = encode_publish_header(topic_bytes, len(payload), qos, retain, dup, packet_id, version or 4, props_bytes)
        limit = self.client_maximum_packet_size
        if limit is not None and len(head) + len(payload) > limit:
            return None  # a new alias is not recorded: the client never learned it
        if new_alias:
            self._aliases_out[topic] = new_alias
        return (head, payload) if len(payload) >= SPLIT_PAYLOAD_BYTES else head + payload

    def outbound_quota_available(self) -> int:
        """How many more QoS>0 PUBLISHes the client's Receive Maximum allows right now."""
        return self.client_receive_maximum - self._inflight_out

    def on_outbound_publish_sent(self, qos: int) -> None:
        if qos:
            invariant(self._inflight_out < self.client_receive_maximum,
                      "sent a QoS>0 PUBLISH beyond the client's receive maximum")
            self._inflight_out += 1

    def on_outbound_ack(self) -> None:
        """The client finished one of our QoS>0 PUBLISHes (PUBACK, PUBCOMP, or PUBREC >= 0x80)."""
        invariant(self._inflight_out > 0, "outbound ack with nothing in flight")
        self._inflight_out -= 1

    @property
    def outbound_inflight(self) -> int:
        return self._inflight_out

    # -- time ------------------------------------------------------------------------------------

    def keepalive_deadline(self, last_packet_time: float) -> float | None:
        """When the connection must be closed if nothing arrives: 1.5 x keepalive after the
        last packet (MQTT-3.1.2-24). None when keepalive is 0 (off)."""
        if not self.keepalive:
            return None
        return last_packet_time + 1.5 * self.keepalive
