"""The MQTT edge: one asyncio Protocol per client socket, around the sans-IO ``ProtocolState``.

Packets are handled in arrival order by one task per connection. A QoS>0 PUBLISH is proposed at
once and its acknowledgement queued: acks leave in the order the PUBLISHes arrived, each only
after the entry holding the message is synced. Control packets (SUBSCRIBE, ...) wait for their
commit before the next packet is handled, so a client's later publishes see its subscriptions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import struct
import uuid
from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.messages import MessageProps, StoredMessage
from moorline.broker.share_policy import wants_single_active
from moorline.broker.topic_state import PublishResult
from moorline.mqtt import packets as p
from moorline.mqtt.codec import MQTT_5, PublishBatchEncoder, encode, encode_properties, encode_puback
from moorline.mqtt.errors import ProtocolError, UnsupportedProtocol
from moorline.mqtt.protocol import SPLIT_PAYLOAD_BYTES, ProtocolState
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.reasons import suback_v5_to_v3, v3_connack_applicable
from moorline.mqtt.topics import parse_shared
from moorline.node.admin.sys_topics import is_sys_filter
from moorline.node.edge.auth import Principal
from moorline.node.edge.drain import refusal_connack
from moorline.node.edge.tls import certificate_login
from moorline.node.node import NodeFailure, SessionOwnedByOther, SessionQuotaExceeded
from moorline.node.replication.shard_host import Callback, ShardUnavailable
from moorline.node.sessions.delivery import LiveSession, OutboundPublish, ReadFilter

if TYPE_CHECKING:
    from moorline.node.edge.server import MqttServer

log = logging.getLogger("moorline.conn")


class FailedLoginLog:
    """Failed logins, logged at INFO: the first at once, then at most one line per ``interval_s``
    (log.failed_login_interval_s), which counts the ones not logged since, so a password-guessing
    flood cannot flood the log. Network-derived values are logged with %r."""

    def __init__(self, interval_s: float, clock: Any) -> None:
        self.interval_s = interval_s
        self.clock = clock  # monotonic seconds
        self.last_logged: float | None = None
        self.unlogged = 0

    def note(self, username: str | None, client_id: str, peer: str, reason: int) -> None:
        now = self.clock()
        if self.last_logged is not None and now - self.last_logged < self.interval_s:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more failed logins not logged in the last {now - self.last_logged:.0f} s)" \
            if self.unlogged and self.last_logged is not None else ""
        log.info("login failed: user %r client %r from %s: CONNACK 0x%02x%s", username, client_id, peer, reason, more)
        self.last_logged = now
        self.unlogged = 0


# A User Property ("guid", 32 hex digits), so histories can match deliveries to publishes.
_GUID_PROPERTY_HEAD = b"\x26\x00\x04guid\x00\x20"
# A connection timer that fires this much later than due says the event loop stalled; it then
# checks again this long after, once the socket has been read.
LOOP_STALL_GRACE_S = 0.5
AFTER_STALL_RECHECK_S = 0.05


def _log_task_error(task: asyncio.Task[Any]) -> None:
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    if isinstance(exc, (ShardUnavailable, NodeFailure)):
        log.warning("closing a session: %s", exc)  # a shard reported unavailable: not a bug of ours
    else:
        log.error("closing a session failed", exc_info=exc)


def _guid_from(props: p.Properties) -> tuple[bytes | None, bytes | None, int | None]:
    guid = producer = None
    seq = None
    for k, v in props.user_properties:
        if k == "guid" and len(v) == 32:
            try:
                guid = bytes.fromhex(v)
            except ValueError:
                pass
        elif k == "producer" and len(v) == 16:
            try:
                producer = bytes.fromhex(v)
            except ValueError:
                pass
        elif k == "seq" and v.isdigit():
            seq = int(v)
    if producer is not None and seq is not None and guid is None:
        guid = producer + seq.to_bytes(8, "big")
    return guid, producer, seq if producer is not None else None


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
        self._acks: deque[list[Any]] = deque()
        self._acks_waiting = 0  # PUBLISHes whose acknowledgement is queued (a group slot counts each)
        self._q2_inprogress: set[int] = set()
        self._acks_paused = False  # reading paused because too many acknowledgements are pending
        self._busy = False  # the handler task is in the middle of a packet: keep arrival order
        self.drain_stopped = False  # the node drains: this socket is read no more (node/edge/drain.py)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.last_rx = self.node.clock.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # monotonic time the timer was due: a late one means the loop stalled
        self.connected_at = self.node.clock.monotonic()

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
        self.server.connections.add(self)
        if self.server.reading_paused:
            transport.pause_reading()  # type: ignore[attr-defined]
        transport.set_write_buffer_limits(high=self.cfg.write_buffer_high_bytes)  # type: ignore[attr-defined]
        self._task = asyncio.get_running_loop().create_task(self._handle_loop())
        self._arm_timer(self.cfg.connect_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self.last_rx = self.node.clock.monotonic()
        try:
            packets = self.state.receive(data, self.last_rx)
        except UnsupportedProtocol as exc:
            level = exc.level
            code = RC.UNSUPPORTED_PROTOCOL_VERSION
            self._write(encode(p.Connack(False, code), MQTT_5 if level == MQTT_5 else 4))
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
        if on and not self._paused and not self._acks_paused and not self.drain_stopped:
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
        task.add_done_callback(_log_task_error)
        return done

    @property
    def closing(self) -> bool:
        """Closed, or being closed: nothing more is read or handled."""
        return self._closing

    def send_disconnect(self, packet: p.Disconnect) -> None:
        """An MQTT 5 DISCONNECT from the server (the caller closes next)."""
        self._write(encode(packet, MQTT_5))

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
        return bool(self._acks) or bool(self._queue) or self._busy

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
        self.server.connections.discard(self)
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

    def _end_now(self, live: LiveSession) -> None:
        try:
            task = self.node.close_session(live, self.will_on_close, self.session_expiry_override)
        except ShardUnavailable as exc:
            log.warning("%r: session close not recorded: %s", self.client_id, exc)
            return
        task.add_done_callback(_log_task_error)

    # --- output ----------------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self._out.append(data)
        if len(data) >= SPLIT_PAYLOAD_BYTES:
            self._out_large = True
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

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
            self.server.log_client(log, logging.INFO, self._host(), "%s %r: disconnected: not reading (write buffer "
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
            self._write(data)

    def protocol_error(self, reason: int, text: str) -> None:
        self.server.log_client(log, logging.INFO, self._host(), "%s %r: protocol error: %r", self.peer, self.client_id,
                               text)
        if self.state.awaiting_connect:
            version = self.state.version or 4
            if version == MQTT_5 or v3_connack_applicable(reason):
                self._write(encode(p.Connack(False, reason), version))
        elif self.version == MQTT_5:
            self._write(encode(p.Disconnect(reason, p.Properties(reason_string=text[:200])), MQTT_5))
        self.abort(text)

    def _host(self) -> str:
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
            self._write(encode(p.Disconnect(reason, props), MQTT_5))
        self.abort(text or f"disconnect 0x{reason:02x}")

    # --- timers ----------------------------------------------------------------------------------
    def _arm_timer(self, delay_s: float) -> None:
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
            self._arm_timer(AFTER_STALL_RECHECK_S)
            return
        if self.server.reading_paused or self._paused or self._acks_paused or self.drain_stopped:
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
        self._arm_timer(self._timer_interval())

    def _oldest_unanswered_publish(self, now: float) -> float:
        """When the oldest QoS>0 PUBLISH still without its acknowledgement was read: queued for
        its sync, in the handler (a QoS 2 waiting on its packet-id commit), or queued behind
        another packet (a SUBSCRIBE in progress). ``now`` when there is none."""
        oldest = self._acks[0][4] if self._acks else now
        cur = self._current
        if cur is not None and type(cur) is p.Publish and cur.qos > 0:
            oldest = min(oldest, self._current_at)
        for pk, at in zip(self._queue, self._queue_at, strict=True):  # bounded: mqtt.max_queued_packets
            if type(pk) is p.Publish and pk.qos > 0:
                return min(oldest, at)
        return oldest

    def _timer_interval(self) -> float:
        keep = self.state.keepalive
        return min(1.0, keep / 4) if keep else 1.0

    # --- packet handling -------------------------------------------------------------------------
    async def _handle_loop(self) -> None:
        try:
            while not self._closing:
                if not self._queue:
                    if self._paused and self.transport is not None:
                        self._paused = False
                        if not self.server.reading_paused and not self._acks_paused and not self.drain_stopped:
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
                        i = self._publish_group(packets, i)
                    else:
                        self._publish_sync(packet)  # type: ignore[arg-type]
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
                    self._write(b"\xd0\x00")
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

    def _publish_group(self, packets: list[p.Packet], i: int) -> int:
        """The run of QoS 1 PUBLISHes from ``packets[i]`` on that carry no properties and go to
        one shard, proposed as one group: one acknowledgement slot, one completion when the entry
        holding them is synced and applied, their PUBACKs written together. The common case of a
        publishing client, with the per-message work cut to the message and its command. Returns
        the index after the run (a PUBLISH the ACL refuses takes the general path, alone)."""
        node = self.node
        first = packets[i]
        assert type(first) is p.Publish
        topic = first.topic
        shard = node.topic_shard(topic)
        who = self.principal
        can_publish = self.server.authorizer.can_publish
        principal = self.server.authorizer.owner_name(who)
        client_id = self.client_id
        ts_ms = node.now_ms()
        new_guid = node.new_guid
        topic_shard = node.topic_shard
        limit = self.cfg.max_packet_size  # keeps a group (and so its log entry) bounded in bytes
        no_props = p.NO_PROPERTIES
        cmds: list[c.Command] = []
        pids: list[int] = []
        resent = False  # a DUP=1 PUBLISH among them: a refusal would not be provably true
        size = 0
        n = len(packets)
        if not can_publish(who, topic):  # asked again only when the topic changes: same answer
            self._publish_sync(first)  # refused by the ACL: answered on the general path
            return i + 1
        while i < n and size < limit:
            pk = packets[i]
            if type(pk) is not p.Publish or pk.qos != 1 or pk.properties is not no_props:
                break
            if pk.topic != topic:
                if topic_shard(pk.topic) != shard or not can_publish(who, pk.topic):
                    break
                topic = pk.topic
            cmds.append(c.Publish(
                StoredMessage(topic, pk.payload, 1, pk.retain, new_guid(), ts_ms, None, None, client_id), principal
            ))
            pids.append(pk.packet_id)  # type: ignore[arg-type]
            resent = resent or pk.dup
            size += len(pk.payload)
            i += 1
        node.published["mqtt"] += len(cmds)
        try:
            node.propose_group(shard, cmds, self._queue_ack(("puback_group", pids, 0), len(pids)))
        except ShardUnavailable as exc:
            self._acks.pop()  # the group's slot, queued just above: its PUBLISHes are refused one by one
            self._acks_waiting -= len(pids)
            self._refuse_unavailable(pids, "puback", exc, resent=resent)
        return i

    async def _handle(self, packet: p.Packet) -> None:
        if isinstance(packet, p.Publish):
            await self._on_publish(packet)
        elif isinstance(packet, (p.Puback, p.Pubcomp)):
            if self.live is not None and self.live.on_puback(packet.packet_id):
                self.node.on_ack_room(self.client_id)
        elif isinstance(packet, p.Pubrec):
            await self._on_pubrec(packet)
        elif isinstance(packet, p.Pubrel):
            self._on_pubrel(packet)
        elif isinstance(packet, p.Subscribe):
            await self._on_subscribe(packet)
        elif isinstance(packet, p.Unsubscribe):
            await self._on_unsubscribe(packet)
        elif isinstance(packet, p.Pingreq):
            self._write(b"\xd0\x00")
        elif isinstance(packet, p.Disconnect):
            self._on_disconnect(packet)
        elif isinstance(packet, p.Connect):
            await self._on_connect(packet)
        elif isinstance(packet, p.Auth):
            self.disconnect(RC.BAD_AUTH_METHOD, "enhanced authentication is not supported")

    # CONNECT
    async def _on_connect(self, pk: p.Connect) -> None:
        self.version = pk.protocol_level
        v5 = self.version == MQTT_5
        drain = self.server.drain
        if drain is not None and drain.draining:  # told where to go (5.0), before any login work
            in_cluster = self.node.link is not None
            ref = self.server.client_address_of_live_peer(pk.client_id) if in_cluster else None
            self._write(encode(refusal_connack(self.version, ref, in_cluster), self.version))
            self.abort("connect refused: node draining")
            return
        props = pk.properties
        if v5 and props.authentication_method is not None:
            self._connack_refuse(RC.BAD_AUTH_METHOD)
            return
        client_id = pk.client_id
        assigned = None
        if not client_id:
            if not v5 and not pk.clean_start:
                self._connack_refuse(RC.CLIENT_IDENTIFIER_NOT_VALID)
                return
            client_id = assigned = f"auto-{uuid.uuid4().hex}"
        if len(client_id.encode()) > self.node.cfg.mqtt.max_client_id_bytes:
            # Kept per session, per registration key and per delivery batch, on every node.
            self._connack_refuse(RC.CLIENT_IDENTIFIER_NOT_VALID)  # 3.1.1: return code 2
            return
        cert_user = certificate_login(self.transport, self.node.cfg.tls)
        refusal: int | None
        if cert_user is not None:  # tls.use_identity_as_username: the verified certificate is the login
            pk = dataclasses.replace(pk, username=cert_user, password=None)
            refusal = None if cert_user else RC.NOT_AUTHORIZED  # a certificate without a CN names nobody
            proven = True
        else:
            refusal, proven = await self.server.authorizer.connect_login(  # scrypt off the loop, rate-limited
                pk.username, pk.password, self.peer.rpartition(":")[0], v5, lambda: not self._closing)
        if self._closing:
            return
        if refusal is not None:
            self.server.failed_logins.note(pk.username, client_id, self.peer, refusal)
            self._connack_refuse(refusal)
            return
        self.client_id = client_id
        self.principal = Principal(pk.username, client_id, proven)  # unproven: a label (auth.py)
        owner = self.server.authorizer.owner_name(self.principal)
        if v5:
            expiry = props.session_expiry_interval or 0
        else:
            expiry = 0 if pk.clean_start else self.node.cfg.session.max_expiry_s
        expiry = min(expiry, 0xFFFFFFFF)
        will = None
        if pk.will is not None:
            w = pk.will
            wp = w.properties
            mprops = self._message_props(wp)
            import msgspec

            will = c.WillSpec(
                w.topic, w.payload, w.qos, w.retain, wp.will_delay_interval or 0, wp.message_expiry_interval,
                msgspec.msgpack.encode(mprops) if mprops is not None else None,
            )
            if not self.server.authorizer.can_publish(self.principal, w.topic):
                self._connack_refuse(RC.NOT_AUTHORIZED)
                return
        if self.node.session_owned_by_other(client_id, owner):
            log.warning("%s: CONNECT as %r refused: session %r belongs to another user", self.peer,
                        pk.username, client_id)
            self._connack_refuse(RC.NOT_AUTHORIZED)  # 3.1.1: return code 5
            return
        if self.node.persistent_quota_exceeded(client_id, owner, expiry):
            log.warning("%s: CONNECT of %r refused: user %r holds session.max_persistent_per_user persistent "
                        "sessions", self.peer, client_id, owner)
            self._connack_refuse(RC.QUOTA_EXCEEDED)  # 3.1.1: return code 3
            return
        old = self.node.connections.get(client_id)
        if old is not None and old is not self:
            log.info("takeover: client %r user %r from %s takes its session over from the connection from %s",
                     client_id, pk.username, self.peer, old.peer)
            old.disconnect(RC.SESSION_TAKEN_OVER, "session taken over")
            if old.live is not None:
                log.info("disconnect: client %r user %r from %s: session taken over", client_id, old.user, old.peer)
                live_old = old.live
                old.live = None
                await self.node.close_session(live_old, old.will_on_close, old.session_expiry_override)
        self.node.connections[client_id] = self
        try:
            present, epoch, inc = await self.node.open_session(client_id, pk.clean_start, expiry, will,
                                                               owner)
        except SessionOwnedByOther:
            # Lost a race with the owner's own CONNECT: the session shard refused; nothing changed.
            if self.node.connections.get(client_id) is self:
                del self.node.connections[client_id]
            self._connack_refuse(RC.NOT_AUTHORIZED)
            return
        except SessionQuotaExceeded:  # the session shard's own count (a race the early check missed)
            if self.node.connections.get(client_id) is self:
                del self.node.connections[client_id]
            self._connack_refuse(RC.QUOTA_EXCEEDED)
            return
        except ShardUnavailable as exc:  # the session's shard has no quorum (or failed)
            if self.node.connections.get(client_id) is self:
                del self.node.connections[client_id]
            log.warning("%s: CONNECT of %r refused: %s", self.peer, client_id, exc)
            self._connack_refuse(RC.SERVER_UNAVAILABLE)  # 3.1.1: return code 3
            return
        if self._closing:
            # The client went away while its CONNECT was being committed: this node owns a session
            # nobody is connected to. Hand it back (no will: the client never got a CONNACK).
            self.node.abandon_session(client_id, epoch)
            return
        if not self.node.epoch_is_current(client_id, epoch):
            # A later CONNECT of this client (on another node) was committed right after ours:
            # the session is its now. Refused; the client connects again.
            if self.node.connections.get(client_id) is self:
                del self.node.connections[client_id]
            self._connack_refuse(RC.SERVER_UNAVAILABLE)
            return
        client_rm = props.receive_maximum if v5 and props.receive_maximum else self.cfg.max_inflight_out
        if not v5:
            client_rm = self.cfg.max_inflight_out
        self.live = LiveSession(self.node, client_id, epoch, inc, client_rm, self._send_publishes, self._send_pubrel,
                                self._read_filter())
        self.node.live[client_id] = self.live
        ack_props = p.NO_PROPERTIES
        keep = None
        if pk.keepalive > self.cfg.max_keepalive_s:
            # 5.0 is told (Server Keep Alive below); 3.1.1 cannot be, but the cap holds for it too.
            keep = self.cfg.max_keepalive_s
            self.state.keepalive = keep
        if v5:
            base = self.state.connack_properties()
            ack_props = p.Properties(
                receive_maximum=base.receive_maximum,
                topic_alias_maximum=base.topic_alias_maximum,
                maximum_packet_size=base.maximum_packet_size,
                assigned_client_identifier=assigned,
                server_keep_alive=keep,
                retain_available=None,
                wildcard_subscription_available=None,
                shared_subscription_available=None,
                subscription_identifier_available=None,
                session_expiry_interval=self.node.cfg.session.max_expiry_s
                if expiry > self.node.cfg.session.max_expiry_s else None,
            )
        self._write(encode(p.Connack(present, 0, ack_props), self.version))
        log.info("connect: client %r user %r from %s, MQTT %s, %s, keepalive %d s", client_id, pk.username,
                 self.peer, "5.0" if v5 else "3.1.1",
                 ("clean" if expiry == 0 else f"persistent (expiry {expiry} s)")
                 + (", session present" if present else ""), keep if keep is not None else pk.keepalive)
        self.user = pk.username
        self.live.start()
        self._arm_timer(self._timer_interval())

    def _read_filter(self) -> ReadFilter | None:
        """The read ACL for this principal's deliveries; None when no ACL is configured."""
        authorizer, who = self.server.authorizer, self.principal
        if not authorizer.rules:
            return None
        return ReadFilter(lambda flt: authorizer.read_check_needed(who, flt),
                          lambda topic: authorizer.can_read(who, topic))

    def _connack_refuse(self, reason: int) -> None:
        # The v5 reason code; the 3.1.1 encoder maps it to the return code.
        self._write(encode(p.Connack(False, reason), self.version))
        self.abort(f"connect refused 0x{reason:02x}")

    @staticmethod
    def _message_props(pp: p.Properties) -> MessageProps | None:
        if (pp.payload_format_indicator is None and pp.content_type is None and pp.response_topic is None
                and pp.correlation_data is None and not pp.user_properties):
            return None
        return MessageProps(pp.payload_format_indicator, pp.content_type, pp.response_topic, pp.correlation_data,
                            pp.user_properties)

    # PUBLISH (inbound)
    def _denied(self, pk: p.Publish) -> bool:
        if self.server.authorizer.can_publish(self.principal, pk.topic):
            return False
        v5 = self.version == MQTT_5
        log.warning("%s: publish to %r denied by ACL", self.client_id, pk.topic)
        self.node.publish_denied["mqtt"] += 1
        if pk.qos == 1:
            self._queue_ack(("puback", pk.packet_id, RC.NOT_AUTHORIZED if v5 else 0))(None, None)
        elif pk.qos == 2:
            self._queue_ack(("pubrec", pk.packet_id, RC.NOT_AUTHORIZED if v5 else 0))(None, None)
        return True

    def _publish_sync(self, pk: p.Publish) -> None:
        if not self._denied(pk):
            guid, producer, seq = _guid_from(pk.properties)
            self._propose_publish(pk, guid, producer, seq)

    async def _on_publish(self, pk: p.Publish) -> None:
        if self.live is None:
            raise ProtocolError(RC.PROTOCOL_ERROR, "PUBLISH before CONNECT completed")
        if pk.qos < 2:
            self._publish_sync(pk)
            return
        if pk.packet_id in self._q2_inprogress:
            return  # a resend while the first copy is still being committed: its PUBREC will come
        if self._denied(pk):
            return
        guid, producer, seq = _guid_from(pk.properties)
        if pk.qos == 2:
            sess = self.live.session()
            known = sess.inbound_qos2.get(pk.packet_id) if sess is not None else None  # type: ignore[arg-type]
            if known is not None:
                guid = known
            else:
                guid = guid or self.node.new_guid()
                fut = self.node.propose(self.live.shard, c.InboundQos2(self.client_id, self.live.epoch, pk.packet_id, guid))  # type: ignore[arg-type]
                assert fut is not None
                self._q2_inprogress.add(pk.packet_id)  # type: ignore[arg-type]
                try:
                    recorded = await fut  # pid -> GUID is durable before the message is proposed
                finally:
                    self._q2_inprogress.discard(pk.packet_id)  # type: ignore[arg-type]
                if recorded is None:
                    self.disconnect(RC.SESSION_TAKEN_OVER, "session taken over")
                    return
                if self._closing or self.live is None:
                    return  # closed meanwhile: the pid -> GUID binding stays, so a resend is de-duplicated
                guid = recorded
        self._propose_publish(pk, guid, producer, seq)

    def _propose_publish(self, pk: p.Publish, guid: bytes | None, producer: bytes | None, seq: int | None) -> None:
        assert self.live is not None
        v5 = self.version == MQTT_5
        msg = StoredMessage(
            pk.topic, pk.payload, pk.qos, pk.retain, guid or self.node.new_guid(), self.node.now_ms(),
            pk.properties.message_expiry_interval if v5 else None, self._message_props(pk.properties) if v5 else None,
            self.client_id,
        )
        shard = self.node.topic_shard(pk.topic)
        cmd = c.Publish(msg, self.server.authorizer.owner_name(self.principal), producer, seq)
        self.node.published["mqtt"] += 1
        kind = "puback" if pk.qos == 1 else "pubrec"
        if pk.qos == 0:
            try:
                self.node.propose(shard, cmd, want=False)
            except ShardUnavailable as exc:
                self._refuse_unavailable([], kind, exc)
            return
        done = self._queue_ack((kind, pk.packet_id, 0))
        try:
            self.node.propose_cb(shard, cmd, done)
        except ShardUnavailable as exc:
            # Its slot, queued just above, would never complete: every later acknowledgement (the
            # refusal too) would wait behind it until publish_timeout closed the connection, while
            # later PUBLISHes of the same topic committed; the client then resent the refused one
            # behind them (moorline sim --cluster seed 140, drawn configuration: out_of_order).
            self._acks.pop()
            self._acks_waiting -= 1
            self._refuse_unavailable([pk.packet_id], kind, exc, resent=pk.dup)

    def _refuse_unavailable(self, pids: list[Any], kind: str, exc: ShardUnavailable, resent: bool = False) -> None:
        """The shard refused before anything entered its log, so a refusal is true (promise 6):
        5.0 gets 0x80 per message and keeps the connection for the other shards; 3.1.1, which
        cannot refuse, is closed (the client resends later). QoS 0 is dropped, counted.

        Not so for a resend (DUP=1): its earlier copy may be in a log already (its connection was
        lost with the outcome unknown), so a refusal could be a lie (moorline sim --cluster seed
        123, drawn configuration: refused, then delivered). The outcome stays unknown: the
        connection is closed (0x89) and the client resends again."""
        self.node.stats["refused"] += max(1, len(pids))
        if not pids:
            return
        if resent:
            self.disconnect(RC.SERVER_BUSY, f"resent publish not taken now ({exc}); its earlier copy may be stored")
            return
        if self.version != MQTT_5:
            self.abort(f"publish refused: {exc}")
            return
        self.server.log_client(log, logging.INFO, self._host(), "%r: publish refused: %s", self.client_id, exc)
        for pid in pids:
            self._queue_ack((kind, pid, RC.UNSPECIFIED_ERROR, str(exc)[:200]))(None, None)

    @staticmethod
    def _reason_props(what: tuple[Any, ...]) -> p.Properties:
        """An acknowledgement's reason string, when its slot carries one (4th element)."""
        return p.Properties(reason_string=what[3]) if len(what) > 3 else p.NO_PROPERTIES

    def _queue_ack(self, what: tuple[Any, ...], count: int = 1) -> Callback:
        """Queue an acknowledgement (kind, packet id, forced reason) or a group of ``count`` PUBACKs
        ("puback_group", packet ids, 0); returns the callback that completes it. Acks leave in
        queue order, so a later one waits for an earlier one."""
        # done, result, error, what, since: when the PUBLISH was read (publish_timeout counts from there)
        slot: list[Any] = [False, None, None, what, self._current_at if self._busy else self.last_rx]
        self._acks.append(slot)
        self._acks_waiting += count
        if (self._acks_waiting >= self.cfg.receive_maximum and self.version != MQTT_5 and not self._acks_paused
                and self.transport is not None):
            # 3.1.1 has no Receive Maximum (v5 clients get 0x93 before this): stop reading instead.
            self._acks_paused = True
            self.transport.pause_reading()

        def complete(result: Any, exc: BaseException | None) -> None:
            slot[0], slot[1], slot[2] = True, result, exc
            if self._acks and self._acks[0] is slot:
                self._drain_acks()

        return complete

    def _drain_acks(self) -> None:
        """Acks leave in arrival order of their PUBLISHes (MQTT-4.6.0-2), each after its sync."""
        acks = self._acks
        latency = self.node.ack_latency
        now = self.node.clock.monotonic()
        while acks and acks[0][0]:
            _, result, exc, what, since = acks.popleft()
            kind, pid, forced = what[0], what[1], what[2]
            self._acks_waiting -= len(pid) if kind == "puback_group" else 1
            if self._closing:
                continue
            reason = forced
            if exc is not None:
                # Outcome unknown: never acknowledge; close so the client resends (DUP).
                self.disconnect(RC.SERVER_BUSY, f"publish outcome unknown: {exc}")  # 0x89
                return
            if kind == "puback_group":
                latency.observe(now - since, len(pid))
                if not self._send_group_pubacks(pid, result):
                    return
                continue
            if kind == "pubcomp":
                reason = 0 if result else RC.PACKET_ID_NOT_FOUND
                self.send_packet(p.Pubcomp(pid, reason if self.version == MQTT_5 else 0))
                continue
            if result is not None and result.status == "refused":
                if self.version != MQTT_5:
                    self.abort(f"publish refused: {result.reason}")  # 3.1.1 cannot say no: close
                    return
                reason = result.reason_code
            if kind == "puback":
                if reason == 0:
                    latency.observe(now - since)
                    self.state.note_inbound_acked(pid)
                    self._write(encode_puback(pid))
                else:
                    self.send_packet(p.Puback(pid, reason, self._reason_props(what)))
            else:
                if reason == 0:
                    latency.observe(now - since)
                self.send_packet(p.Pubrec(pid, reason, self._reason_props(what)))
                if reason >= 0x80:
                    self.state.note_inbound_acked(pid)
        if self._acks_paused and self._acks_waiting < self.cfg.receive_maximum // 2 and not self._closing:
            self._acks_paused = False
            if (not self._paused and not self.server.reading_paused and not self.drain_stopped
                    and self.transport is not None):
                self.transport.resume_reading()

    def _send_group_pubacks(self, pids: list[int], results: list[PublishResult]) -> bool:
        """PUBACKs of a committed group, in order, written together. A refused message (shard
        full, GUID reused) gets its reason code on 5.0; 3.1.1 cannot refuse, so the connection
        closes there, after the PUBACKs before it. False when the connection was closed."""
        out: list[bytes] = []
        inflight_done = self.state.note_inbound_acked
        for pid, result in zip(pids, results, strict=True):
            if result.status != "refused":
                inflight_done(pid)
                out.append(encode_puback(pid))
                continue
            if out:
                self._write(b"".join(out))
                out = []
            if self.version != MQTT_5:
                self.abort(f"publish refused: {result.reason}")
                return False
            self.send_packet(p.Puback(pid, result.reason_code))
        if out:
            self._write(b"".join(out))
        return True

    def _on_pubrel(self, pk: p.Pubrel) -> None:
        if self.live is None:
            return  # the session left this connection (closed or taken over)
        self.node.propose_cb(self.live.shard, c.InboundRelease(self.client_id, self.live.epoch, pk.packet_id),
                             self._queue_ack(("pubcomp", pk.packet_id, 0)))

    async def _on_pubrec(self, pk: p.Pubrec) -> None:
        if self.live is None:
            return
        if pk.reason_code >= 0x80:
            if self.live.on_puback(pk.packet_id):  # the client refused it: the delivery is finished
                self.node.on_ack_room(self.client_id)
            return
        if await self.live.on_pubrec(pk.packet_id):
            self._send_pubrel(pk.packet_id)
        elif self.version == MQTT_5:
            self.send_packet(p.Pubrel(pk.packet_id, RC.PACKET_ID_NOT_FOUND))

    # SUBSCRIBE / UNSUBSCRIBE
    async def _on_subscribe(self, pk: p.Subscribe) -> None:
        live = self.live
        if live is None:
            return  # the session left this connection (closed or taken over)
        v5 = self.version == MQTT_5
        sub_id = pk.properties.subscription_identifiers[0] if pk.properties.subscription_identifiers else None
        codes: list[int] = []
        failure = ""  # MQTT 5: why a filter failed (the SUBACK's reason string)
        sys_granted: list[str] = []  # $SYS filters granted: their current values follow the SUBACK
        for flt, opts in pk.subscriptions:
            if self.state.topic_filter_error(flt) is not None:  # syntax and mqtt.max_topic_*, before any split
                codes.append(RC.TOPIC_FILTER_INVALID if v5 else 0x80)
                continue
            check = parse_shared(flt)
            inner = check[1] if check else flt
            if is_sys_filter(inner) and self.server.sys_topics is not None:
                codes.append(self._subscribe_sys(flt, min(opts.qos, 2), check is not None, v5))
                if codes[-1] < 0x80:
                    sys_granted.append(flt)
                continue
            if not self.server.authorizer.can_subscribe(self.principal, inner):
                codes.append(RC.NOT_AUTHORIZED if v5 else 0x80)
                continue
            qos = min(opts.qos, 2)
            if self._closing or self.live is not live:
                return  # closed or taken over while an earlier filter registered: no SUBACK to send
            sess = live.session()
            if sess is not None and flt not in sess.subs and len(sess.subs) >= self.node.cfg.session.max_subscriptions:
                codes.append(RC.QUOTA_EXCEEDED if v5 else 0x80)
                continue
            try:
                await self.node.subscribe(
                    live, flt, qos, opts.no_local if v5 else False, opts.retain_as_published if v5 else False,
                    opts.retain_handling if v5 else 0, sub_id,
                    check is not None and v5 and wants_single_active(pk.properties.user_properties),
                )
            except ShardUnavailable as exc:  # a shard it needs has no quorum (or failed): never a silent gap
                codes.append(RC.UNSPECIFIED_ERROR if v5 else 0x80)
                failure = f"{flt}: {exc}"[:200]
                continue
            codes.append(qos)
        if self._closing or self.live is not live:
            return
        props = p.Properties(reason_string=failure) if v5 and failure else p.NO_PROPERTIES
        self.send_packet(p.Suback(pk.packet_id, tuple(codes if v5 else [suback_v5_to_v3(x) for x in codes]), props))
        for flt in sys_granted:
            self.server.sys_topics.send_current(self, flt)  # type: ignore[union-attr]

    def _subscribe_sys(self, flt: str, qos: int, shared: bool, v5: bool) -> int:
        """A $SYS filter is node-local (moorline/node/admin/sys_topics.py), never registered in a shard.
        Needs a grant; no $share group. Granted at the QoS asked (as Mosquitto): its messages are
        QoS 0, and a message is delivered at the lower of the two."""
        sys_topics = self.server.sys_topics
        assert sys_topics is not None
        if shared:
            return RC.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED if v5 else 0x80
        if not sys_topics.may_subscribe(self.principal, flt):
            return RC.NOT_AUTHORIZED if v5 else 0x80
        if not sys_topics.subscribe(self, flt):
            return RC.QUOTA_EXCEEDED if v5 else 0x80
        return qos

    async def _on_unsubscribe(self, pk: p.Unsubscribe) -> None:
        live = self.live
        if live is None:
            return
        codes = []
        for flt in pk.filters:
            if self._closing or self.live is not live:
                return
            if is_sys_filter(flt) and self.server.sys_topics is not None:
                existed = self.server.sys_topics.unsubscribe(self, flt)
            else:
                existed = await self.node.unsubscribe(live, flt)
            codes.append(0 if existed else RC.NO_SUBSCRIPTION_EXISTED)
        if self._closing or self.live is not live:
            return
        self.send_packet(p.Unsuback(pk.packet_id, tuple(codes) if self.version == MQTT_5 else ()))

    def _on_disconnect(self, pk: p.Disconnect) -> None:
        self.will_on_close = pk.reason_code == RC.DISCONNECT_WITH_WILL
        se = pk.properties.session_expiry_interval
        if se is not None and self.version == MQTT_5:
            if self.state.connect is not None and not self.state.connect.properties.session_expiry_interval and se:
                self.protocol_error(RC.PROTOCOL_ERROR, "session expiry set on DISCONNECT after 0 in CONNECT")
                return
            self.session_expiry_override = se
        why = f"client sent DISCONNECT (0x{pk.reason_code:02x})"
        live = self.live
        connect = self.state.connect
        if self.will_on_close or live is None or connect is None or connect.will is None:
            self.abort(why)
            return
        self._close_once_will_discarded(live, why)

    def _close_once_will_discarded(self, live: LiveSession, why: str) -> None:
        """A clean DISCONNECT discards the will (MQTT-3.14.4-3), but only once the session shard
        commits the close: until then, a majority that lost touch with this node ends the session
        when its owner's lease lapses and publishes the will. So the connection is closed only when
        the close is committed. If it fails, or is not committed within mqtt.publish_timeout_s, an
        MQTT 5 client gets DISCONNECT 0x80 first (the will may still be published); a 3.1.1 client,
        which has no way to be told, is left to close the connection itself (it is bound to, after
        its DISCONNECT), or it is closed at that timeout."""
        self._closing = True  # reads nothing more; the handler and the delivery pump stop
        self.close_reason = why
        self.live = None
        if self.transport is not None:
            self.transport.pause_reading()
        log.info("disconnect: client %r user %r from %s: %s", self.client_id, self.user, self.peer, why)
        if self.node.connections.get(self.client_id) is self:
            del self.node.connections[self.client_id]
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.cfg.publish_timeout_s, self._will_discard_unknown,
                                "session close not committed within mqtt.publish_timeout_s")

        def outcome(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                failed = "cancelled" if fut.cancelled() else f"{fut.exception()}"
                if self.version == MQTT_5:
                    timer.cancel()
                    self._will_discard_unknown(f"session close failed: {failed}")
                return  # 3.1.1: the client closes, or the timer does
            timer.cancel()
            self._close_transport()

        try:
            task = self.node.close_session(live, False, self.session_expiry_override, outcome)
        except ShardUnavailable as exc:
            log.warning("%r: session close not recorded: %s", self.client_id, exc)
            if self.version == MQTT_5:
                timer.cancel()
                self._will_discard_unknown(f"session close not recorded: {exc}")
            return
        task.add_done_callback(_log_task_error)

    def _will_discard_unknown(self, why: str) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        log.warning("%r: after its DISCONNECT: %s; its will may still be published", self.client_id, why)
        if self.version == MQTT_5:
            self._write(encode(p.Disconnect(RC.UNSPECIFIED_ERROR, p.Properties(
                reason_string="will discard not committed: the will may still be published")), MQTT_5))
        self._close_transport()

    def _close_transport(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self.transport.close()

    # outbound (called by LiveSession)
    def _send_publishes(self, outs: list[OutboundPublish]) -> None:
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
                    self._write(batch.take())
                self._send_publish(out)
                continue
            add(msg.topic, payload, out.qos, out.retain, out.dup, out.packet_id,
                _GUID_PROPERTY_HEAD + msg.guid.hex().encode() if stamp else b"")
            sent += 1
        if len(batch):
            self._write(batch.take())
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
            self._write(data[0])
            self._write(data[1])
        else:
            self._write(data)
        self.node.stats["delivered"] += 1

    def _send_pubrel(self, pid: int) -> None:
        self.send_packet(p.Pubrel(pid))
