"""The inbound publish path of a connection: a PUBLISH proposed to its topic's shard, and its
acknowledgement queued in arrival order, to leave once the entry holding the message is synced
(MQTT-4.6.0-2). The common QoS 1 case, a run of PUBLISHes without properties to one shard, is
proposed as one command group with one queue slot; QoS 2 first records its packet id -> GUID in the
session shard; PUBREL completes through the same queue (PUBCOMP)."""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.messages import MessageProps, StoredMessage
from moorline.broker.topic_state import PublishResult
from moorline.mqtt import packets as p
from moorline.mqtt.codec import MQTT_5, encode_puback
from moorline.mqtt.errors import ProtocolError
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.node.errors import ShardUnavailable

if TYPE_CHECKING:
    from moorline.node.edge.connection import Connection

log = logging.getLogger("moorline.conn")

# Completes an acknowledgement slot: (result, error), the shape of a proposal's waiter.
AckCallback = Callable[[Any, BaseException | None], None]


class AckKind(enum.Enum):
    """What an acknowledgement slot sends once it completes."""

    PUBACK = "puback"  # QoS 1
    PUBREC = "pubrec"  # QoS 2
    PUBCOMP = "pubcomp"  # a PUBREL's answer, once the release is committed
    PUBACK_GROUP = "puback_group"  # the PUBACKs of a command group, written together


@dataclasses.dataclass(eq=False, slots=True)
class AckSlot:
    """One place in a connection's acknowledgement queue: one PUBLISH (or PUBREL), or a group of
    ``count`` QoS 1 PUBLISHes (``group``: their packet ids, in order)."""

    kind: AckKind
    packet_id: int  # 0 for a group
    reason: int  # the reason code decided before any proposal (ACL refusal, shard unavailable), else 0
    reason_string: str | None  # MQTT 5: sent with that reason code
    since: float  # when the PUBLISH was read (monotonic): publish_timeout counts from there
    count: int = 1
    group: list[int] = dataclasses.field(default_factory=list)
    done: bool = False  # completed: the entry is synced (or the answer was known at once)
    result: Any = None  # the proposal's result (PublishResult, a group's list of them, a release's bool)
    error: BaseException | None = None  # the proposal failed: outcome unknown
    refused_shard: int | None = None  # a refusal of that shard, decided before any proposal (untold)

    def reason_props(self) -> p.Properties:
        """The acknowledgement's reason string, when the slot carries one."""
        return p.Properties(reason_string=self.reason_string) if self.reason_string is not None \
            else p.NO_PROPERTIES


def message_props(pp: p.Properties) -> MessageProps | None:
    """The MQTT 5 properties a stored message (or a will) keeps; None when it has none."""
    if (pp.payload_format_indicator is None and pp.content_type is None and pp.response_topic is None
            and pp.correlation_data is None and not pp.user_properties):
        return None
    return MessageProps(pp.payload_format_indicator, pp.content_type, pp.response_topic, pp.correlation_data,
                        pp.user_properties)

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



class InboundPublishes:
    """The publish path of one connection and its ordered acknowledgement queue."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.node = conn.node
        self.server = conn.server
        self.cfg = conn.cfg
        self.state = conn.state
        self.acks: deque[AckSlot] = deque()
        self.waiting = 0  # PUBLISHes whose acknowledgement is queued (a group slot counts each)
        self.q2_inprogress: set[int] = set()
        self.paused = False  # reading paused because too many acknowledgements are pending
        # shard -> refusals of PUBLISHes to it queued here and not written yet: later PUBLISHes to
        # that shard are refused too until the client has been told (see propose_publish).
        self.untold: dict[int, int] = {}

    def oldest_since(self, none_queued: float) -> float:
        """When the PUBLISH of the oldest queued acknowledgement was read; ``none_queued`` if none."""
        return self.acks[0].since if self.acks else none_queued

    def denied(self, pk: p.Publish) -> bool:
        if self.server.authorizer.can_publish(self.conn.principal, pk.topic):
            return False
        v5 = self.conn.version == MQTT_5
        log.warning("%s: publish to %r denied by ACL", self.conn.client_id, pk.topic)
        self.node.publish_denied["mqtt"] += 1
        if pk.qos == 1:
            self.queue_ack(AckKind.PUBACK, pk.packet_id, RC.NOT_AUTHORIZED if v5 else 0)(None, None)  # type: ignore[arg-type]
        elif pk.qos == 2:
            self.queue_ack(AckKind.PUBREC, pk.packet_id, RC.NOT_AUTHORIZED if v5 else 0)(None, None)  # type: ignore[arg-type]
        return True

    def publish_sync(self, pk: p.Publish) -> None:
        if not self.denied(pk):
            guid, producer, seq = _guid_from(pk.properties)
            self.propose_publish(pk, guid, producer, seq)

    async def on_publish(self, pk: p.Publish) -> None:
        if self.conn.live is None:
            raise ProtocolError(RC.PROTOCOL_ERROR, "PUBLISH before CONNECT completed")
        if pk.qos < 2:
            self.publish_sync(pk)
            return
        if pk.packet_id in self.q2_inprogress:
            return  # a resend while the first copy is still being committed: its PUBREC will come
        if self.denied(pk):
            return
        guid, producer, seq = _guid_from(pk.properties)
        if pk.qos == 2:
            sess = self.conn.live.session()
            known = sess.inbound_qos2.get(pk.packet_id) if sess is not None else None  # type: ignore[arg-type]
            if known is not None:
                guid = known
            else:
                guid = guid or self.node.new_guid()
                live = self.conn.live
                fut = self.node.propose(live.shard, c.InboundQos2(self.conn.client_id, live.epoch, pk.packet_id, guid))  # type: ignore[arg-type]
                assert fut is not None
                self.q2_inprogress.add(pk.packet_id)  # type: ignore[arg-type]
                try:
                    recorded = await fut  # pid -> GUID is durable before the message is proposed
                finally:
                    self.q2_inprogress.discard(pk.packet_id)  # type: ignore[arg-type]
                if recorded is None:
                    self.conn.disconnect(RC.SESSION_TAKEN_OVER, "session taken over")
                    return
                if self.conn.closing or self.conn.live is None:
                    return  # closed meanwhile: the pid -> GUID binding stays, so a resend is de-duplicated
                guid = recorded
        self.propose_publish(pk, guid, producer, seq)

    def propose_publish(self, pk: p.Publish, guid: bytes | None, producer: bytes | None, seq: int | None) -> None:
        assert self.conn.live is not None
        v5 = self.conn.version == MQTT_5
        msg = StoredMessage(
            pk.topic, pk.payload, pk.qos, pk.retain, guid or self.node.new_guid(), self.node.now_ms(),
            pk.properties.message_expiry_interval if v5 else None, message_props(pk.properties) if v5 else None,
            self.conn.client_id,
        )
        shard = self.node.topic_shard(pk.topic)
        cmd = c.Publish(msg, self.server.authorizer.owner_name(self.conn.principal), producer, seq)
        self.node.published["mqtt"] += 1
        kind = AckKind.PUBACK if pk.qos == 1 else AckKind.PUBREC
        if pk.qos == 0:
            try:
                self.node.propose(shard, cmd, want=False)
            except ShardUnavailable as exc:
                self.refuse_unavailable([], kind, exc)
            return
        if shard in self.untold:
            # An earlier PUBLISH to this shard was refused and the client has not been told yet
            # (its 0x80 waits in the queue behind older acknowledgements). Should the connection
            # end before it is written, the client resends that one; had this one committed, the
            # resend would commit behind it (moorline sim --cluster seed 71213: out_of_order). So
            # this one is refused too, and the client resends them in their order.
            self.refuse_unavailable([pk.packet_id], kind, self._refused_before(shard), resent=pk.dup,  # type: ignore[list-item]
                                    shard=shard)
            return
        done = self.queue_ack(kind, pk.packet_id)  # type: ignore[arg-type]
        try:
            self.node.propose_cb(shard, cmd, done)
        except ShardUnavailable as exc:
            # Its slot, queued just above, would never complete: every later acknowledgement (the
            # refusal too) would wait behind it until publish_timeout closed the connection, while
            # later PUBLISHes of the same topic committed; the client then resent the refused one
            # behind them (moorline sim --cluster seed 140, drawn configuration: out_of_order).
            self.acks.pop()
            self.waiting -= 1
            self.refuse_unavailable([pk.packet_id], kind, exc, resent=pk.dup, shard=shard)  # type: ignore[list-item]

    @staticmethod
    def _refused_before(shard: int) -> ShardUnavailable:
        return ShardUnavailable(f"shard {shard}: refused, as an earlier PUBLISH of this connection to it was "
                                f"(its refusal is not sent yet)")

    def refuse_unavailable(self, pids: list[int], kind: AckKind, exc: ShardUnavailable, resent: bool = False,
                           shard: int | None = None) -> None:
        """The shard refused before anything entered its log, so a refusal is true (promise 6):
        5.0 gets 0x80 per message and keeps the connection for the other shards; 3.1.1, which
        cannot refuse, is closed (the client resends later). QoS 0 is dropped, counted.

        Not so for a resend (DUP=1): its earlier copy may be in a log already (its connection was
        lost with the outcome unknown), so a refusal could be a lie (moorline sim --cluster seed
        123, drawn configuration: refused, then delivered). The outcome stays unknown: the
        connection is closed (0x89) and the client resends again.

        ``shard``: the refusing shard, which refuses this connection's later PUBLISHes too until
        these refusals are written (``untold``)."""
        self.node.stats["refused"] += max(1, len(pids))
        if not pids:
            return
        if resent:
            self.conn.disconnect(RC.SERVER_BUSY, f"resent publish not taken now ({exc}); its earlier copy may be stored")
            return
        if self.conn.version != MQTT_5:
            self.conn.abort(f"publish refused: {exc}")
            return
        self.server.log_client(log, logging.INFO, self.conn.peer_host(), "%r: publish refused: %s",
                               self.conn.client_id, exc)
        for pid in pids:
            slot = AckSlot(kind, pid, RC.UNSPECIFIED_ERROR, str(exc)[:200], self.conn.read_at(), refused_shard=shard)
            if shard is not None:
                self.untold[shard] = self.untold.get(shard, 0) + 1
            self._queue(slot)(None, None)

    def queue_ack(self, kind: AckKind, packet_id: int, reason: int = 0,
                  reason_string: str | None = None) -> AckCallback:
        """Queue the acknowledgement of one PUBLISH (or PUBREL); ``reason`` forces its reason code
        (a refusal decided before any proposal). Returns the callback that completes it."""
        return self._queue(AckSlot(kind, packet_id, reason, reason_string, self.conn.read_at()))

    def queue_group_ack(self, pids: list[int]) -> AckCallback:
        """Queue the PUBACKs of a group (one slot for ``len(pids)`` PUBLISHes); returns the callback
        that completes it."""
        return self._queue(AckSlot(AckKind.PUBACK_GROUP, 0, 0, None, self.conn.read_at(), len(pids), pids))

    def _queue(self, slot: AckSlot) -> AckCallback:
        """Acks leave in queue order, so a later one waits for an earlier one."""
        self.acks.append(slot)
        self.waiting += slot.count
        if (self.waiting >= self.cfg.receive_maximum and self.conn.version != MQTT_5 and not self.paused
                and self.conn.transport is not None):
            # 3.1.1 has no Receive Maximum (v5 clients get 0x93 before this): stop reading instead.
            self.paused = True
            self.conn.transport.pause_reading()

        def complete(result: Any, exc: BaseException | None) -> None:
            slot.done, slot.result, slot.error = True, result, exc
            if self.acks and self.acks[0] is slot:
                self.drain_acks()

        return complete

    def drain_acks(self) -> None:
        """Acks leave in arrival order of their PUBLISHes (MQTT-4.6.0-2), each after its sync."""
        acks = self.acks
        latency = self.node.ack_latency
        now = self.node.clock.monotonic()
        while acks and acks[0].done:
            slot = acks.popleft()
            kind, pid, result, exc, since = slot.kind, slot.packet_id, slot.result, slot.error, slot.since
            self.waiting -= slot.count
            if slot.refused_shard is not None:
                self._told(slot.refused_shard)
            if self.conn.closing:
                continue
            reason = slot.reason
            if exc is not None:
                # Outcome unknown: never acknowledge; close so the client resends (DUP).
                self.conn.disconnect(RC.SERVER_BUSY, f"publish outcome unknown: {exc}")  # 0x89
                return
            if kind is AckKind.PUBACK_GROUP:
                latency.observe(now - since, slot.count)
                if not self.send_group_pubacks(slot.group, result):
                    return
                continue
            if kind is AckKind.PUBCOMP:
                reason = 0 if result else RC.PACKET_ID_NOT_FOUND
                self.conn.send_packet(p.Pubcomp(pid, reason if self.conn.version == MQTT_5 else 0))
                continue
            if result is not None and result.status == "refused":
                if self.conn.version != MQTT_5:
                    self.conn.abort(f"publish refused: {result.reason}")  # 3.1.1 cannot say no: close
                    return
                reason = result.reason_code
            if kind is AckKind.PUBACK:
                if reason == 0:
                    latency.observe(now - since)
                    self.state.note_inbound_acked(pid)
                    self.conn.write(encode_puback(pid))
                else:
                    self.conn.send_packet(p.Puback(pid, reason, slot.reason_props()))
            else:
                if reason == 0:
                    latency.observe(now - since)
                self.conn.send_packet(p.Pubrec(pid, reason, slot.reason_props()))
                if reason >= 0x80:
                    self.state.note_inbound_acked(pid)
        if self.paused and self.waiting < self.cfg.receive_maximum // 2 and not self.conn.closing:
            self.paused = False
            self.conn.ack_room_again()

    def _told(self, shard: int) -> None:
        left = self.untold[shard] - 1
        if left:
            self.untold[shard] = left
        else:
            del self.untold[shard]

    def send_group_pubacks(self, pids: list[int], results: list[PublishResult]) -> bool:
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
                self.conn.write(b"".join(out))
                out = []
            if self.conn.version != MQTT_5:
                self.conn.abort(f"publish refused: {result.reason}")
                return False
            self.conn.send_packet(p.Puback(pid, result.reason_code))
        if out:
            self.conn.write(b"".join(out))
        return True

    def on_pubrel(self, pk: p.Pubrel) -> None:
        if self.conn.live is None:
            return  # the session left this connection (closed or taken over)
        live = self.conn.live
        self.node.propose_cb(live.shard, c.InboundRelease(self.conn.client_id, live.epoch, pk.packet_id),
                             self.queue_ack(AckKind.PUBCOMP, pk.packet_id))

    def publish_group(self, packets: list[p.Packet], i: int) -> int:
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
        who = self.conn.principal
        can_publish = self.server.authorizer.can_publish
        principal = self.server.authorizer.owner_name(who)
        client_id = self.conn.client_id
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
            self.publish_sync(first)  # refused by the ACL: answered on the general path
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
        if shard in self.untold:  # refused, as an earlier PUBLISH to this shard was (propose_publish)
            self.refuse_unavailable(pids, AckKind.PUBACK, self._refused_before(shard), resent=resent, shard=shard)
            return i
        try:
            node.propose_group(shard, cmds, self.queue_group_ack(pids))
        except ShardUnavailable as exc:
            self.acks.pop()  # the group's slot, queued just above: its PUBLISHes are refused one by one
            self.waiting -= len(pids)
            self.refuse_unavailable(pids, AckKind.PUBACK, exc, resent=resent, shard=shard)
        return i

