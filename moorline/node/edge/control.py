"""The control packets of a connection: CONNECT (login, takeover, the session opened in its
shard, CONNACK), SUBSCRIBE / UNSUBSCRIBE (each waits for its commit before the connection's next
packet is handled, so a client's later publishes see its subscriptions; $SYS filters stay on this
node) and DISCONNECT (a clean one discards the will only once the session shard commits the close)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.share_policy import wants_single_active
from moorline.mqtt import packets as p
from moorline.mqtt.codec import MQTT_5, encode
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.mqtt.reasons import suback_v5_to_v3
from moorline.mqtt.topics import parse_shared
from moorline.node.admin.sys_topics import is_sys_filter
from moorline.node.edge.auth import Principal
from moorline.node.edge.drain import refusal_connack
from moorline.node.edge.inbound import message_props
from moorline.node.edge.tls import certificate_login
from moorline.node.errors import NodeFailure, SessionOwnedByOther, SessionQuotaExceeded, ShardUnavailable
from moorline.node.sessions.delivery import LiveSession, ReadFilter

if TYPE_CHECKING:
    from moorline.node.edge.connection import Connection

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


def log_task_error(task: asyncio.Task[Any]) -> None:
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    if isinstance(exc, (ShardUnavailable, NodeFailure)):
        log.warning("closing a session: %s", exc)  # a shard reported unavailable: not a bug of ours
    else:
        log.error("closing a session failed", exc_info=exc)


class ConnectionControl:
    """CONNECT, SUBSCRIBE, UNSUBSCRIBE and DISCONNECT of one connection."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.node = conn.node
        self.server = conn.server
        self.cfg = conn.cfg
        self.state = conn.state

    async def on_connect(self, pk: p.Connect) -> None:
        self.conn.version = pk.protocol_level
        v5 = self.conn.version == MQTT_5
        drain = self.server.drain
        if drain is not None and drain.draining:  # told where to go (5.0), before any login work
            in_cluster = self.node.link is not None
            ref = self.server.client_address_of_live_peer(pk.client_id) if in_cluster else None
            self.conn.write(encode(refusal_connack(self.conn.version, ref, in_cluster), self.conn.version))
            self.conn.abort("connect refused: node draining")
            return
        props = pk.properties
        if v5 and props.authentication_method is not None:
            self.connack_refuse(RC.BAD_AUTH_METHOD)
            return
        client_id = pk.client_id
        assigned = None
        if not client_id:
            if not v5 and not pk.clean_start:
                self.connack_refuse(RC.CLIENT_IDENTIFIER_NOT_VALID)
                return
            client_id = assigned = f"auto-{uuid.uuid4().hex}"
        if len(client_id.encode()) > self.node.cfg.mqtt.max_client_id_bytes:
            # Kept per session, per registration key and per delivery batch, on every node.
            self.connack_refuse(RC.CLIENT_IDENTIFIER_NOT_VALID)  # 3.1.1: return code 2
            return
        cert_user = certificate_login(self.conn.transport, self.node.cfg.tls)
        refusal: int | None
        if cert_user is not None:  # tls.use_identity_as_username: the verified certificate is the login
            pk = dataclasses.replace(pk, username=cert_user, password=None)
            refusal = None if cert_user else RC.NOT_AUTHORIZED  # a certificate without a CN names nobody
            proven = True
        else:
            refusal, proven = await self.server.authorizer.connect_login(  # scrypt off the loop, rate-limited
                pk.username, pk.password, self.conn.peer.rpartition(":")[0], v5, lambda: not self.conn.closing)
        if self.conn.closing:
            return
        if refusal is not None:
            self.server.failed_logins.note(pk.username, client_id, self.conn.peer, refusal)
            self.connack_refuse(refusal)
            return
        self.conn.client_id = client_id
        self.conn.principal = Principal(pk.username, client_id, proven)  # unproven: a label (auth.py)
        owner = self.server.authorizer.owner_name(self.conn.principal)
        if v5:
            expiry = props.session_expiry_interval or 0
        else:
            expiry = 0 if pk.clean_start else self.node.cfg.session.max_expiry_s
        expiry = min(expiry, 0xFFFFFFFF)
        will = None
        if pk.will is not None:
            w = pk.will
            wp = w.properties
            mprops = message_props(wp)
            import msgspec

            will = c.WillSpec(
                w.topic, w.payload, w.qos, w.retain, wp.will_delay_interval or 0, wp.message_expiry_interval,
                msgspec.msgpack.encode(mprops) if mprops is not None else None,
            )
            if not self.server.authorizer.can_publish(self.conn.principal, w.topic):
                self.connack_refuse(RC.NOT_AUTHORIZED)
                return
        if self.node.session_owned_by_other(client_id, owner):
            log.warning("%s: CONNECT as %r refused: session %r belongs to another user", self.conn.peer,
                        pk.username, client_id)
            self.connack_refuse(RC.NOT_AUTHORIZED)  # 3.1.1: return code 5
            return
        if self.node.persistent_quota_exceeded(client_id, owner, expiry):
            log.warning("%s: CONNECT of %r refused: user %r holds session.max_persistent_per_user persistent "
                        "sessions", self.conn.peer, client_id, owner)
            self.connack_refuse(RC.QUOTA_EXCEEDED)  # 3.1.1: return code 3
            return
        old = self.node.connections.get(client_id)
        if old is not None and old is not self.conn:
            log.info("takeover: client %r user %r from %s takes its session over from the connection from %s",
                     client_id, pk.username, self.conn.peer, old.peer)
            old.disconnect(RC.SESSION_TAKEN_OVER, "session taken over")
            if old.live is not None:
                log.info("disconnect: client %r user %r from %s: session taken over", client_id, old.user, old.peer)
                live_old = old.live
                old.live = None
                await self.node.close_session(live_old, old.will_on_close, old.session_expiry_override)
        self.node.connections[client_id] = self.conn
        try:
            present, epoch, inc = await self.node.open_session(client_id, pk.clean_start, expiry, will,
                                                               owner)
        except SessionOwnedByOther:
            # Lost a race with the owner's own CONNECT: the session shard refused; nothing changed.
            if self.node.connections.get(client_id) is self.conn:
                del self.node.connections[client_id]
            self.connack_refuse(RC.NOT_AUTHORIZED)
            return
        except SessionQuotaExceeded:  # the session shard's own count (a race the early check missed)
            if self.node.connections.get(client_id) is self.conn:
                del self.node.connections[client_id]
            self.connack_refuse(RC.QUOTA_EXCEEDED)
            return
        except ShardUnavailable as exc:  # the session's shard has no quorum (or failed)
            if self.node.connections.get(client_id) is self.conn:
                del self.node.connections[client_id]
            log.warning("%s: CONNECT of %r refused: %s", self.conn.peer, client_id, exc)
            self.connack_refuse(RC.SERVER_UNAVAILABLE)  # 3.1.1: return code 3
            return
        if self.conn.closing:
            # The client went away while its CONNECT was being committed: this node owns a session
            # nobody is connected to. Hand it back (no will: the client never got a CONNACK).
            self.node.abandon_session(client_id, epoch)
            return
        if not self.node.epoch_is_current(client_id, epoch):
            # A later CONNECT of this client (on another node) was committed right after ours:
            # the session is its now. Refused; the client connects again.
            if self.node.connections.get(client_id) is self.conn:
                del self.node.connections[client_id]
            self.connack_refuse(RC.SERVER_UNAVAILABLE)
            return
        client_rm = props.receive_maximum if v5 and props.receive_maximum else self.cfg.max_inflight_out
        if not v5:
            client_rm = self.cfg.max_inflight_out
        self.conn.live = LiveSession(self.node, client_id, epoch, inc, client_rm, self.conn.send_publishes,
                                     self.conn.send_pubrel, self.read_filter())
        self.node.live[client_id] = self.conn.live
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
        self.conn.write(encode(p.Connack(present, 0, ack_props), self.conn.version))
        log.info("connect: client %r user %r from %s, MQTT %s, %s, keepalive %d s", client_id, pk.username,
                 self.conn.peer, "5.0" if v5 else "3.1.1",
                 ("clean" if expiry == 0 else f"persistent (expiry {expiry} s)")
                 + (", session present" if present else ""), keep if keep is not None else pk.keepalive)
        self.conn.user = pk.username
        self.conn.live.start()
        self.conn.arm_timer(self.conn.timer_interval())

    def read_filter(self) -> ReadFilter | None:
        """The read ACL for this principal's deliveries; None when no ACL is configured."""
        authorizer, who = self.server.authorizer, self.conn.principal
        if not authorizer.rules:
            return None
        return ReadFilter(lambda flt: authorizer.read_check_needed(who, flt),
                          lambda topic: authorizer.can_read(who, topic))

    def connack_refuse(self, reason: int) -> None:
        # The v5 reason code; the 3.1.1 encoder maps it to the return code.
        self.conn.write(encode(p.Connack(False, reason), self.conn.version))
        self.conn.abort(f"connect refused 0x{reason:02x}")

    async def on_subscribe(self, pk: p.Subscribe) -> None:
        live = self.conn.live
        if live is None:
            return  # the session left this connection (closed or taken over)
        v5 = self.conn.version == MQTT_5
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
                codes.append(self.subscribe_sys(flt, min(opts.qos, 2), check is not None, v5))
                if codes[-1] < 0x80:
                    sys_granted.append(flt)
                continue
            if not self.server.authorizer.can_subscribe(self.conn.principal, inner):
                codes.append(RC.NOT_AUTHORIZED if v5 else 0x80)
                continue
            qos = min(opts.qos, 2)
            if self.conn.closing or self.conn.live is not live:
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
        if self.conn.closing or self.conn.live is not live:
            return
        props = p.Properties(reason_string=failure) if v5 and failure else p.NO_PROPERTIES
        self.conn.send_packet(p.Suback(pk.packet_id, tuple(codes if v5 else [suback_v5_to_v3(x) for x in codes]), props))
        for flt in sys_granted:
            self.server.sys_topics.send_current(self.conn, flt)  # type: ignore[union-attr]

    def subscribe_sys(self, flt: str, qos: int, shared: bool, v5: bool) -> int:
        """A $SYS filter is node-local (moorline/node/admin/sys_topics.py), never registered in a shard.
        Needs a grant; no $share group. Granted at the QoS asked (as Mosquitto): its messages are
        QoS 0, and a message is delivered at the lower of the two."""
        sys_topics = self.server.sys_topics
        assert sys_topics is not None
        if shared:
            return RC.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED if v5 else 0x80
        if not sys_topics.may_subscribe(self.conn.principal, flt):
            return RC.NOT_AUTHORIZED if v5 else 0x80
        if not sys_topics.subscribe(self.conn, flt):
            return RC.QUOTA_EXCEEDED if v5 else 0x80
        return qos

    async def on_unsubscribe(self, pk: p.Unsubscribe) -> None:
        live = self.conn.live
        if live is None:
            return
        codes = []
        for flt in pk.filters:
            if self.conn.closing or self.conn.live is not live:
                return
            if is_sys_filter(flt) and self.server.sys_topics is not None:
                existed = self.server.sys_topics.unsubscribe(self.conn, flt)
            else:
                existed = await self.node.unsubscribe(live, flt)
            codes.append(0 if existed else RC.NO_SUBSCRIPTION_EXISTED)
        if self.conn.closing or self.conn.live is not live:
            return
        self.conn.send_packet(p.Unsuback(pk.packet_id, tuple(codes) if self.conn.version == MQTT_5 else ()))

    def on_disconnect(self, pk: p.Disconnect) -> None:
        self.conn.will_on_close = pk.reason_code == RC.DISCONNECT_WITH_WILL
        se = pk.properties.session_expiry_interval
        if se is not None and self.conn.version == MQTT_5:
            if self.state.connect is not None and not self.state.connect.properties.session_expiry_interval and se:
                self.conn.protocol_error(RC.PROTOCOL_ERROR, "session expiry set on DISCONNECT after 0 in CONNECT")
                return
            self.conn.session_expiry_override = se
        why = f"client sent DISCONNECT (0x{pk.reason_code:02x})"
        live = self.conn.live
        connect = self.state.connect
        if self.conn.will_on_close or live is None or connect is None or connect.will is None:
            self.conn.abort(why)
            return
        self.close_once_will_discarded(live, why)

    def close_once_will_discarded(self, live: LiveSession, why: str) -> None:
        """A clean DISCONNECT discards the will (MQTT-3.14.4-3), but only once the session shard
        commits the close: until then, a majority that lost touch with this node ends the session
        when its owner's lease lapses and publishes the will. So the connection is closed only when
        the close is committed. If it fails, or is not committed within mqtt.publish_timeout_s, an
        MQTT 5 client gets DISCONNECT 0x80 first (the will may still be published); a 3.1.1 client,
        which has no way to be told, is left to close the connection itself (it is bound to, after
        its DISCONNECT), or it is closed at that timeout."""
        self.conn.mark_closing(why)  # reads nothing more; the handler and the delivery pump stop
        self.conn.live = None
        if self.conn.transport is not None:
            self.conn.transport.pause_reading()
        log.info("disconnect: client %r user %r from %s: %s", self.conn.client_id, self.conn.user, self.conn.peer, why)
        if self.node.connections.get(self.conn.client_id) is self.conn:
            del self.node.connections[self.conn.client_id]
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.cfg.publish_timeout_s, self.will_discard_unknown,
                                "session close not committed within mqtt.publish_timeout_s")

        def outcome(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                failed = "cancelled" if fut.cancelled() else f"{fut.exception()}"
                if self.conn.version == MQTT_5:
                    timer.cancel()
                    self.will_discard_unknown(f"session close failed: {failed}")
                return  # 3.1.1: the client closes, or the timer does
            timer.cancel()
            self.conn.close_transport()

        try:
            task = self.node.close_session(live, False, self.conn.session_expiry_override, outcome)
        except ShardUnavailable as exc:
            log.warning("%r: session close not recorded: %s", self.conn.client_id, exc)
            if self.conn.version == MQTT_5:
                timer.cancel()
                self.will_discard_unknown(f"session close not recorded: {exc}")
            return
        task.add_done_callback(log_task_error)

    def will_discard_unknown(self, why: str) -> None:
        if self.conn.transport is None or self.conn.transport.is_closing():
            return
        log.warning("%r: after its DISCONNECT: %s; its will may still be published", self.conn.client_id, why)
        # The disconnect log line (and the simulator's judge) must not read this close as the
        # answer to the DISCONNECT: the will was not discarded for certain.
        self.conn.close_reason = f"will discard unknown after DISCONNECT: {why}"
        if self.conn.version == MQTT_5:
            self.conn.write(encode(p.Disconnect(RC.UNSPECIFIED_ERROR, p.Properties(
                reason_string="will discard not committed: the will may still be published")), MQTT_5))
        self.conn.close_transport()

