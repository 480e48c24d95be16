"""The MQTT edge: one asyncio Protocol per client socket, around the sans-IO ``ProtocolState``.

Packets are handled in arrival order by one task per connection. A QoS>0 PUBLISH is proposed at
once and its acknowledgement queued: acks leave in the order the PUBLISHes arrived, each only
after the entry holding the message is synced. Control packets (SUBSCRIBE, ...) wait for their
commit before the next packet is handled, so a client's later publishes see its subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Any

from moorline.mqtt import packets as p
from moorline.mqtt.codec import MQTT_5, PublishBatchEncoder, encode, encode_properties
from moorline.mqtt.errors import ProtocolError, UnsupportedProtocol
from moorline.mqtt.protocol import SPLIT_PAYLOAD_BYTES, ProtocolState
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.reasons import v3_connack_applicable
from moorline.node.edge.auth import Principal
from moorline.node.edge.control import ConnectionControl, log_task_error
from moorline.node.edge.inbound import InboundPublishes
from moorline.node.errors import NodeFailure, ShardUnavailable
from moorline.node.sessions.delivery import LiveSession, OutboundPublish

if TYPE_CHECKING:
    from moorline.node.edge.server import MqttServer

log = logging.getLogger("moorline.conn")


# A User Property ("guid", 32 hex digits), so histories can match deliveries to publishes.
_GUID_PROPERTY_HEAD = b"\x26\x00\x04guid\x00\x20"
# A connection timer that fires this much later than due says the event loop stalled; it then
# checks again this long after, once the socket has been read.
LOOP_STALL_GRACE_S = 0.5
AFTER_STALL_RECHECK_S = 0.05


class Connection(asyncio.Protocol):
    def __init__(self, server: MqttServer) -> None:
        self.server = server
        self.node = server.node
        cfg = self.node.cfg.mqtt
        self.cfg = cfg
        self.state = ProtocolState(
            max_packet_size_in=cfg.max_packet_size,
            topic_alias_maximum_in=cfg.topic_alias_maximum,
            receive_maximum_in=cfg.receive_maximum,
            topic_bounds=server.topic_bounds,
            max_connect_packet_size=cfg.max_connect_packet_bytes,
        )
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.client_id = ""
        self.version = 4
        self.live: LiveSession | None = None
        self.principal = Principal(None, "")
        self.user: str | None = None  # the CONNECT's username, for the log
        self.close_reason = ""  # why this side closed the connection, for the disconnect log line
        self.will_on_close = True
        self.session_expiry_override: int | None = None
        self._queue: deque[p.Packet] = deque()
        self._queue_at: deque[float] = deque()  # when each queued packet was read (monotonic)
        self._current: p.Packet | None = None  # the packet the handler task is working on
        self._current_at = 0.0  # when it was read: publish_timeout counts from there
        self._queue_event = asyncio.Event()
        self._paused = False
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._out_large = False  # some queued piece is at least SPLIT_PAYLOAD_BYTES
        self._busy = False  # the handler task is in the middle of a packet: keep arrival order
        self.drain_stopped = False  # the node drains: this socket is read no more (node/edge/drain.py)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.last_rx = self.node.clock.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # monotonic time the timer was due: a late one means the loop stalled
        self.connected_at = self.node.clock.monotonic()
        self.inbound = InboundPublishes(self)  # the publish path and its acknowledgement queue
        self.control = ConnectionControl(self)  # CONNECT, SUBSCRIBE, UNSUBSCRIBE, DISCONNECT

    # --- transport callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        if len(self.server.connections) >= self.server.max_connections:
            log.warning("refusing connection from %s: %d connections open", self.peer, len(self.server.connections))
            self._closing = True
            transport.close()
            return
        if not self.server.admit(self, str(peer[0]) if peer else ""):  # per-address rate, pending cap
            self._closing = True
            transport.close()
            return
        self.server.connections[self] = None
        if self.server.reading_paused:
            transport.pause_reading()  # type: ignore[attr-defined]
        transport.set_write_buffer_limits(high=self.cfg.write_buffer_high_bytes)  # type: ignore[attr-defined]
        self._task = asyncio.get_running_loop().create_task(self._handle_loop())
        self.arm_timer(self.cfg.connect_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self.last_rx = self.node.clock.monotonic()
        try:
            packets = self.state.receive(data, self.last_rx)
        except UnsupportedProtocol as exc:
            level = exc.level
            code = RC.UNSUPPORTED_PROTOCOL_VERSION
            self.write(encode(p.Connack(False, code), MQTT_5 if level == MQTT_5 else 4))
            self.abort(f"unsupported protocol: {exc}")
            return
        except ProtocolError as exc:
            self.protocol_error(exc.reason_code, str(exc))
            return
        if packets:
            if not self._queue and not self._busy and self.live is not None:
                packets = self._handle_fast(packets)
                if not packets:
                    return
            self._queue.extend(packets)
            self._queue_at.extend(repeat(self.last_rx, len(packets)))
            self._queue_event.set()
            if len(self._queue) > self.cfg.max_queued_packets and not self._paused:
                self._paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]

    def set_reading(self, on: bool) -> None:
        """Node-wide back-pressure (event-loop lag): reading is what creates load."""
        if self.transport is None or self._closing:
            return
        if on and not self._paused and not self.inbound.paused and not self.drain_stopped:
            self.transport.resume_reading()
        elif not on:
            self.transport.pause_reading()

    def stop_reading_for_drain(self) -> None:
        """The node drains: read nothing more (what the client sends now stays unacknowledged in
        its socket, and is resent to the next node); what was read is still answered."""
        self.drain_stopped = True
        if self.transport is not None and not self._closing:
            self.transport.pause_reading()

    def close_session_for_drain(self) -> asyncio.Future[None] | None:
        """The node drains: end this connection's session in its shard now (its will as on any close
        by the server), before the client is sent elsewhere, so that its CONNECT there finds the
        session released rather than waiting out this node's lease (session.owner_lease_s). The
        future is done once the close is applied or failed; None: no session on this connection."""
        live = self.live
        if live is None:
            return None
        self.live = None
        log.info("disconnect: client %r user %r from %s: node draining", self.client_id, self.user, self.peer)
        if self.node.connections.get(self.client_id) is self:
            del self.node.connections[self.client_id]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def outcome(_fut: asyncio.Future[Any]) -> None:
            if not done.done():
                done.set_result(None)

        try:
            task = self.node.close_session(live, self.will_on_close, self.session_expiry_override, outcome)
        except ShardUnavailable as exc:
            log.warning("%r: session close not recorded: %s", self.client_id, exc)
            return None
        task.add_done_callback(log_task_error)
        return done

    @property
    def closing(self) -> bool:
        """Closed, or being closed: nothing more is read or handled."""
        return self._closing

    def send_disconnect(self, packet: p.Disconnect) -> None:
        """An MQTT 5 DISCONNECT from the server (the caller closes next)."""
        self.write(encode(packet, MQTT_5))

    def close_transport(self) -> None:
        """Close the socket now (after what is queued to be written)."""
        self._close_transport()

    def close_after_goodbye(self, why: str) -> None:
        """Close once what was written (acknowledgements, a DISCONNECT) can reach the client: our side
        is shut for writing (FIN after the data) and input is read again only to be dropped, so the
        socket's close is no reset, which would discard what the client has not read yet. The
        client closes on the FIN; the drain closes whoever has not (``_close_transport``)."""
        if self._closing:
            return
        self._closing = True
        self.close_reason = why
        transport = self.transport
        if transport is None:
            return
        self._flush()
        try:
            if transport.can_write_eof():
                transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            pass
        if not transport.is_closing():
            transport.resume_reading()  # data_received drops everything now (_closing)

    def has_unanswered_work(self) -> bool:
        """A packet read and not yet answered: an acknowledgement queued, a packet queued or in the
        handler (a CONNECT, a QoS 2 PUBLISH, a SUBSCRIBE being committed)."""
        return bool(self.inbound.acks) or bool(self._queue) or self._busy

    def pause_writing(self) -> None:
        """The client reads slower than we deliver: stop the pump (messages stay queued, owed)."""
        if self.live is not None:
            self.live.writable = False

    def resume_writing(self) -> None:
        if self.live is not None:
            self.live.writable = True
            self.live.wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.connections.pop(self, None)
        if self.server.sys_topics is not None:
            self.server.sys_topics.drop(self)
        if self._timer is not None:
            self._timer.cancel()
        self._queue_event.set()
        if self.live is not None:
            live = self.live
            self.live = None
            reason = self.close_reason or (f"connection lost: {exc}" if exc is not None else "connection closed")
            log.info("disconnect: client %r user %r from %s: %s", self.client_id, self.user, self.peer, reason)
            if self.node.connections.get(self.client_id) is self:
                del self.node.connections[self.client_id]
            self._end_now(live)

    def read_at(self) -> float:
        """When the packet being handled was read (monotonic): the handler task's current packet,
        else the latest read (the fast path in ``data_received``)."""
        return self._current_at if self._busy else self.last_rx

    def mark_closing(self, why: str) -> None:
        """Read and handle nothing more (the handler task and the delivery pump stop); ``why`` is
        the close reason the disconnect log line gives."""
        self._closing = True
        self.close_reason = why

    def ack_room_again(self) -> None:
        """The acknowledgement queue has room again (``InboundPublishes.paused`` cleared): read
        again, unless something else holds reading."""
        if (not self._paused and not self.server.reading_paused and not self.drain_stopped
                and self.transport is not None):
            self.transport.resume_reading()

    def _end_now(self, live: LiveSession) -> None:
        try:
            task = self.node.close_session(live, self.will_on_close, self.session_expiry_override)
        except ShardUnavailable as exc:
            log.warning("%r: session close not recorded: %s", self.client_id, exc)
            return
        task.add_done_callback(log_task_error)

    # --- output ----------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self._out.append(data)
        if len(data) >= SPLIT_PAYLOAD_BYTES:
            self._out_large = True
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    _write = write  # the name edge/server.py and admin/sys_topics.py still use (tests/test_layers.py)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.transport is None or self.transport.is_closing() or not self._out:
            self._out.clear()
            return
        if self._out_large:
            # Large payloads: uvloop hands the pieces to one writev instead of copying them once more.
            self._out_large = False
            self.transport.writelines(self._out)
        else:
            self.transport.write(b"".join(self._out))  # many small packets: one copy beats many iovecs
        self._out.clear()
        if self.transport.get_write_buffer_size() > self.cfg.max_write_buffer_bytes:
            # The client stopped reading: bounded buffer, then disconnect (unacked work is redelivered).
            # Reset, dropping the buffer: a close() would hold it, and the session, until the client
            # read it all, which a client that stopped reading never does.
            self.server.log_client(log, logging.INFO, self.peer_host(), "%s %r: disconnected: not reading (write buffer "
                                   "past mqtt.max_write_buffer_bytes)", self.peer, self.client_id)
            self._closing = True
            self.close_reason = "not reading (write buffer past mqtt.max_write_buffer_bytes)"
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:  # and the kernel's buffer too: linger 0 makes the close a reset
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            self.transport.abort()

    def send_packet(self, packet: p.Packet) -> None:
        data = self.state.encode_outbound(packet)
        if data is not None:
            self.write(data)

    def protocol_error(self, reason: int, text: str) -> None:
        self.server.log_client(log, logging.INFO, self.peer_host(), "%s %r: protocol error: %r", self.peer,
                               self.client_id, text)
        if self.state.awaiting_connect:
            version = self.state.version or 4
            if version == MQTT_5 or v3_connack_applicable(reason):
                self.write(encode(p.Connack(False, reason), version))
        elif self.version == MQTT_5:
            self.write(encode(p.Disconnect(reason, p.Properties(reason_string=text[:200])), MQTT_5))
        self.abort(text)

    def peer_host(self) -> str:
        return self.peer.rpartition(":")[0]

    def abort(self, why: str) -> None:
        if self._closing:
            return
        self._closing = True
        self.close_reason = why
        log.debug("closing %s (%r): %r", self.peer, self.client_id, why)
        if self.transport is not None:
            self._flush()
            self.transport.close()

    def disconnect(self, reason: int, text: str = "") -> None:
        if self.version == MQTT_5:
            props = p.Properties(reason_string=text) if text else p.NO_PROPERTIES
            self.write(encode(p.Disconnect(reason, props), MQTT_5))
        self.abort(text or f"disconnect 0x{reason:02x}")

    # --- timers ----------------------------------------------------------------------------------
    def arm_timer(self, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = self.node.clock.monotonic() + delay_s
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._check_timers)

    def _check_timers(self) -> None:
        self._timer = None
        if self._closing:
            return
        now = self.node.clock.monotonic()
        if now - self._timer_due > LOOP_STALL_GRACE_S:
            # The event loop itself stalled (a slow inline sync, a paused process or VM): this timer
            # runs before the packets that arrived meanwhile are read, so last_rx is stale. Judge
            # keepalive and timeouts only after the loop has polled the socket again.
            self.arm_timer(AFTER_STALL_RECHECK_S)
            return
        if self.server.reading_paused or self._paused or self.inbound.paused or self.drain_stopped:
            # We are not reading this socket (back-pressure): the silence is ours, not the client's.
            self.last_rx = now
            if self.state.partial_since is not None:
                self.state.partial_since = now  # nor is a packet we stopped reading half-way slow
        if self.state.awaiting_connect:
            if now - self.connected_at >= self.cfg.connect_timeout_s:
                self.abort("no CONNECT in time")
                return
        else:
            deadline = self.state.keepalive_deadline(self.last_rx)
            if deadline is not None and now >= deadline:
                self.disconnect(RC.KEEP_ALIVE_TIMEOUT, "keep alive timeout")
                return
            partial_since = self.state.partial_since
            if partial_since is not None and now - partial_since >= self.cfg.packet_read_timeout_s:
                # Keepalive counts any byte as life: without this a client sending one byte a minute
                # would hold its connection and a partial packet for ever.
                self.disconnect(RC.KEEP_ALIVE_TIMEOUT, "packet not completed within mqtt.packet_read_timeout_s")
                return
            if now - self._oldest_unanswered_publish(now) > self.cfg.publish_timeout_s:
                # Outcome unknown: close so the client retransmits (docs/design.md promise 6).
                self.disconnect(RC.SERVER_BUSY, "publish outcome unknown within publish_timeout")
                return
        self.arm_timer(self.timer_interval())

    def _oldest_unanswered_publish(self, now: float) -> float:
        """When the oldest QoS>0 PUBLISH still without its acknowledgement was read: queued for
        its sync, in the handler (a QoS 2 waiting on its packet-id commit), or queued behind
        another packet (a SUBSCRIBE in progress). ``now`` when there is none."""
        oldest = self.inbound.oldest_since(now)
        cur = self._current
        if cur is not None and type(cur) is p.Publish and cur.qos > 0:
            oldest = min(oldest, self._current_at)
        for pk, at in zip(self._queue, self._queue_at, strict=True):  # bounded: mqtt.max_queued_packets
            if type(pk) is p.Publish and pk.qos > 0:
                return min(oldest, at)
        return oldest

    def timer_interval(self) -> float:
        keep = self.state.keepalive
        return min(1.0, keep / 4) if keep else 1.0

    # --- packet handling -------------------------------------------------------------------------
    async def _handle_loop(self) -> None:
        try:
            while not self._closing:
                if not self._queue:
                    if self._paused and self.transport is not None:
                        self._paused = False
                        if not self.server.reading_paused and not self.inbound.paused and not self.drain_stopped:
                            self.transport.resume_reading()
                    self._queue_event.clear()
                    await self._queue_event.wait()
                    continue
                packet = self._queue.popleft()
                self._current, self._current_at = packet, self._queue_at.popleft()
                self._busy = True
                try:
                    await self._handle(packet)
                finally:
                    self._busy = False
                    self._current = None
        except NodeFailure as exc:
            # The session was taken over (or ended) while this connection's packet was in progress:
            # a race the client caused, not a fault of ours. The newer connection owns the session.
            self.abort(f"session changed hands: {exc}")
        except ShardUnavailable as exc:  # a SUBSCRIBE/UNSUBSCRIBE's session shard is unavailable
            self.disconnect(RC.UNSPECIFIED_ERROR, str(exc))
        except ProtocolError as exc:
            self.protocol_error(exc.reason_code, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s %s: connection handler failed", self.peer, self.client_id)
            self.disconnect(RC.UNSPECIFIED_ERROR, "internal error")

    def _handle_fast(self, packets: list[p.Packet]) -> list[p.Packet]:
        """Handle, right here, the leading packets that need no await (QoS 0/1 PUBLISH, acks, ping).
        Returns the rest, for the handler task. Saves a task switch per packet on the hot path."""
        room = False  # window room freed: $share groups may dispatch (once per read, not per ack)
        rest: list[p.Packet] = []
        i = 0
        n = len(packets)
        while i < n:
            packet = packets[i]
            kind = type(packet)
            try:
                if kind is p.Publish and packet.qos < 2:  # type: ignore[union-attr]
                    if packet.qos == 1 and packet.properties is p.NO_PROPERTIES:  # type: ignore[union-attr]
                        i = self.inbound.publish_group(packets, i)
                    else:
                        self.inbound.publish_sync(packet)  # type: ignore[arg-type]
                        i += 1
                elif kind is p.Puback or kind is p.Pubcomp:
                    assert self.live is not None
                    j = i + 1
                    while j < n and type(packets[j]) is kind:
                        j += 1
                    if self.live.on_pubacks([pk.packet_id for pk in packets[i:j]]):  # type: ignore[union-attr,misc]
                        room = True
                    i = j
                elif kind is p.Pingreq:
                    self.write(b"\xd0\x00")
                    i += 1
                else:
                    rest = packets[i:]
                    break
            except ShardUnavailable as exc:  # an acknowledgement for an unavailable session shard
                self.disconnect(RC.UNSPECIFIED_ERROR, str(exc))
                break
            except ProtocolError as exc:
                self.protocol_error(exc.reason_code, str(exc))
                break
            if self._closing:
                break
        if room:
            self.node.on_ack_room(self.client_id)
        return rest

    async def _handle(self, packet: p.Packet) -> None:
        if isinstance(packet, p.Publish):
            await self.inbound.on_publish(packet)
        elif isinstance(packet, (p.Puback, p.Pubcomp)):
            if self.live is not None and self.live.on_puback(packet.packet_id):
                self.node.on_ack_room(self.client_id)
        elif isinstance(packet, p.Pubrec):
            await self._on_pubrec(packet)
        elif isinstance(packet, p.Pubrel):
            self.inbound.on_pubrel(packet)
        elif isinstance(packet, p.Subscribe):
            await self.control.on_subscribe(packet)
        elif isinstance(packet, p.Unsubscribe):
            await self.control.on_unsubscribe(packet)
        elif isinstance(packet, p.Pingreq):
            self.write(b"\xd0\x00")
        elif isinstance(packet, p.Disconnect):
            self.control.on_disconnect(packet)
        elif isinstance(packet, p.Connect):
            await self.control.on_connect(packet)
        elif isinstance(packet, p.Auth):
            self.disconnect(RC.BAD_AUTH_METHOD, "enhanced authentication is not supported")

    async def _on_pubrec(self, pk: p.Pubrec) -> None:
        if self.live is None:
            return
        if pk.reason_code >= 0x80:
            if self.live.on_puback(pk.packet_id):  # the client refused it: the delivery is finished
                self.node.on_ack_room(self.client_id)
            return
        if await self.live.on_pubrec(pk.packet_id):
            self.send_pubrel(pk.packet_id)
        elif self.version == MQTT_5:
            self.send_packet(p.Pubrel(pk.packet_id, RC.PACKET_ID_NOT_FOUND))

    def _close_transport(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self.transport.close()

    # outbound (called by LiveSession)
    def send_publishes(self, outs: list[OutboundPublish]) -> None:
        """A delivery batch, in order, in one write. The common case (3.1.1, or 5.0 with no
        property but the GUID, no outbound topic alias, no packet size limit, a small payload) is
        encoded right here; anything else goes through ``_send_publish``."""
        state = self.state
        v5 = self.version == MQTT_5
        if (v5 and state.client_topic_alias_maximum and state.outbound_topic_aliases) or (
                state.client_maximum_packet_size is not None):
            for out in outs:
                self._send_publish(out)
            return
        stamp = v5 and self.cfg.stamp_guid_property
        batch = PublishBatchEncoder(self.version or 4)
        add = batch.add
        sent = 0
        for out in outs:
            msg = out.msg
            payload = msg.payload
            if (v5 and (msg.props is not None or msg.expiry_s is not None or out.sub_ids)) or (
                    len(payload) >= SPLIT_PAYLOAD_BYTES):
                if len(batch):
                    self.write(batch.take())
                self._send_publish(out)
                continue
            add(msg.topic, payload, out.qos, out.retain, out.dup, out.packet_id,
                _GUID_PROPERTY_HEAD + msg.guid.hex().encode() if stamp else b"")
            sent += 1
        if len(batch):
            self.write(batch.take())
        self.node.stats["delivered"] += sent

    def _send_publish(self, out: OutboundPublish) -> None:
        msg = out.msg
        props = b""
        if self.version == MQTT_5 and msg.props is None and msg.expiry_s is None and not out.sub_ids:
            if self.cfg.stamp_guid_property:  # the common case, without building Properties
                props = _GUID_PROPERTY_HEAD + msg.guid.hex().encode()
        elif self.version == MQTT_5:
            mp = msg.props
            expiry = None
            if msg.expiry_s is not None:
                left = (msg.ts_ms + msg.expiry_s * 1000 - self.node.now_ms()) // 1000
                expiry = max(1, int(left))
            ups = mp.user_properties if mp else ()
            if self.cfg.stamp_guid_property and not any(k == "guid" for k, _ in ups):
                ups = (*ups, ("guid", msg.guid.hex()))  # so histories can match deliveries to publishes
            props = encode_properties(p.Properties(
                payload_format_indicator=mp.payload_format if mp else None,
                message_expiry_interval=expiry,
                content_type=mp.content_type if mp else None,
                response_topic=mp.response_topic if mp else None,
                correlation_data=mp.correlation_data if mp else None,
                subscription_identifiers=out.sub_ids,
                user_properties=ups,
            ))
        data = self.state.encode_publish(
            msg.topic, msg.topic.encode(), msg.payload, out.qos, out.retain, out.dup, out.packet_id, props
        )
        if data is None:
            # Too large for this client (MQTT-3.1.2-25): behave as if sent and completed.
            if out.packet_id is not None and self.live is not None:
                self.live.on_puback(out.packet_id)
            return
        if isinstance(data, tuple):  # (header, large payload): written by writev, the payload not copied
            self.write(data[0])
            self.write(data[1])
        else:
            self.write(data)
        self.node.stats["delivered"] += 1

    def send_pubrel(self, pid: int) -> None:
        self.send_packet(p.Pubrel(pid))
