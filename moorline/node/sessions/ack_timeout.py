"""Acknowledgement timeouts of ``$share`` work queues (docs/queues.md, ``queue.ack_timeout_s``).

MQTT cannot take a delivered message back from a connected client that may still acknowledge it.
So, as RabbitMQ's consumer timeout closes the channel, a member holding a message of a group with
an ack timeout unacknowledged for longer than that while connected has its connection closed (MQTT
5: DISCONNECT 0x83 with the reason string ``ack timeout``; 3.1.1: closed). Its unacknowledged QoS 1
messages go back to the group by a replicated ``ShareTimeout`` (each a delivery attempt), as a
session end returns them; a QoS 2 message stays the member's (MQTT-4.8.2-4/5: delivered to it
again when it reconnects, never to another member).

The check runs on the node the member is connected to, each housekeeping round: that node alone
knows what the client has acknowledged (an expiry-0 session's deliveries are never replicated).
A message counts as held from its claim (the group shard's replicated entry time) or from the
start of the member's connection, whichever is later (a reconnected member's resends need time
too).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.queries import claim_of, registration
from moorline.broker.session_state import SENT

if TYPE_CHECKING:
    from moorline.node.sessions.delivery import LiveSession

log = logging.getLogger("moorline.queues")

ACK_TIMEOUT_REASON_CODE = 0x83  # implementation specific error
ACK_TIMEOUT_REASON = "ack timeout"


@dataclass(slots=True)
class Overdue:
    """What a connected member holds past its groups' ack timeouts."""

    held: int = 0  # messages held unacknowledged past the timeout (any QoS)
    # (topic shard, group registration) -> QoS 1 offsets that go back to the group
    returns: dict[tuple[int, str], list[int]] = field(default_factory=dict)


def _unacked(live: LiveSession) -> Iterable[c.DeliveryItem]:
    """Deliveries the client has neither acknowledged (PUBACK) nor received (PUBREC)."""
    waiting = set(live.pid_to_seq.values())  # sent and not yet PUBACK'd / PUBCOMP'd by the client
    if live.ephemeral:
        releasing = live.local_releasing
        for seq, it in live.local_inflight.items():
            if seq in waiting and seq not in releasing:
                yield it
        return
    sess = live.session()
    if sess is None:
        return
    for seq, d in sess.inflight.items():
        if d.state == SENT and seq in waiting:
            yield d.item


def overdue(node: Any, live: LiveSession, now_ms: int, connected_ms: int) -> Overdue | None:
    """What ``live`` holds past its groups' ack timeouts at ``now_ms`` (None: nothing)."""
    out = Overdue()
    hosts = node.hosts
    for it in _unacked(live):
        if it.offset < 0 or not 0 <= it.shard < len(hosts):
            continue
        topics = hosts[it.shard].state.topics
        for rk in it.reg_keys:
            if not rk.startswith(c.SHARE_PREFIX):
                continue
            reg = registration(topics, rk)
            q = reg.queue if reg is not None else None
            if reg is None or q is None or q.ack_timeout_ms <= 0:
                continue
            holder = claim_of(reg, it.offset)
            at = q.claim_ts.get(it.offset)
            if holder is None or holder[0] != live.client_id or at is None:
                continue
            if now_ms - max(at, connected_ms) < q.ack_timeout_ms:
                continue
            out.held += 1
            if it.qos == 1:
                out.returns.setdefault((it.shard, rk), []).append(it.offset)
            break
    return out if out.held else None


class AckTimeouts:
    """The node's check of its connected members (``run`` each housekeeping round)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.closed = 0  # connections closed for an ack timeout (moorline_queue_ack_timeouts_total)
        self.returned = 0  # QoS 1 messages those closes sent back to their groups

    def run(self, now_ms: int) -> int:
        """Closes the connections of members holding messages past their ack timeout; returns how many."""
        node = self.node
        if not any(q.ack_timeout_ms > 0 for q in _queues(node)):
            return 0  # no group with an ack timeout here: nothing to look at
        mono = node.clock.monotonic()
        n = 0
        for cid, live in list(node.live.items()):
            conn = node.connections.get(cid)
            if live.closed or conn is None or not _drives(conn, live):
                continue
            connected_ms = now_ms - int((mono - conn.connected_at) * 1000)
            found = overdue(node, live, now_ms, connected_ms)
            if found is None:
                continue
            n += 1
            self.closed += 1
            log.info("client %s held %d $share message(s) unacknowledged past queue.ack_timeout_s: connection "
                     "closed (%d QoS 1 message(s) back to their group)", cid,
                     found.held, sum(len(v) for v in found.returns.values()))
            for (shard, rk), offsets in sorted(found.returns.items()):
                self.returned += len(offsets)
                try:
                    fut = node.propose_cross(shard, c.ShareTimeout(now_ms, rk, cid, live.incarnation, tuple(offsets)))
                except Exception as exc:  # the shard has no leader now: the session's end returns them
                    log.warning("client %s: ack timeout return to shard %d not proposed: %s", cid, shard, exc)
                    continue
                fut.add_done_callback(_consume)
            conn.disconnect(ACK_TIMEOUT_REASON_CODE, ACK_TIMEOUT_REASON)
        return n


def _drives(conn: Any, live: LiveSession) -> bool:
    """Whether ``conn`` is the connection ``live`` delivers on (not one taken over or closing)."""
    return getattr(conn, "live", None) is live


def _queues(node: Any) -> Iterable[Any]:
    for h in node.hosts:
        topics = h.state.topics
        for rk in topics.share_keys:
            reg = registration(topics, rk)
            if reg is not None and reg.queue is not None:
                yield reg.queue


def _consume(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()  # nobody awaits it: an error (outcome unknown) means the session's end returns them
