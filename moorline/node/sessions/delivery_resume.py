"""The state of one connected session's delivery and its resume on (re)connect: the unacknowledged
deliveries resent in seqno order with their packet ids, a read barrier on every shard the session
reads before its owed messages flow, and the pending notices (re)loaded from the shards' state.
Extended by delivery_acks.py (acknowledgements) and delivery.py (``LiveSession``: the pump)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.queries import claim_of, claims_of, owed_after, registration, session_of
from moorline.broker.session_state import RELEASING, Session, packet_id_of
from moorline.broker.topic_state import same_incarnation
from moorline.node.sessions.outbound import OutboundPublish, ReadFilter
from moorline.raft import ProposalDropped

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.delivery")

# Packet ids are seqno mod 65535 + 1 (session_state.packet_id_of): a seqno this far past a delivery
# still unacknowledged would reuse its packet id.
PACKET_ID_SPACE = 65535
# Finished $share claims kept (see ResumingSession.share_finished) are looked over once there are
# this many, then again at twice as many as survived a look.
SHARE_FINISHED_PRUNE_MIN = 256
READ_BARRIER_WAIT_S = 2.0  # a session's read barrier on a shard not answered in this long is asked again
READ_BARRIER_RETRY_S = 0.5  # ...and after this long when the shard has no known leader


class ResumingSession:
    """A connected session's delivery state and its resume; owns no replicated state of its own."""

    def __init__(
        self,
        node: Node,
        client_id: str,
        epoch: int,
        incarnation: int,
        receive_max: int,
        send_publishes: Callable[[list[OutboundPublish]], None],
        send_pubrel: Callable[[int], None],
        read_filter: ReadFilter | None = None,  # None: no read ACL applies to this session
    ) -> None:
        self.node = node
        self.read_filter = read_filter
        self.client_id = client_id
        self.shard = node.session_shard(client_id)
        self.epoch = epoch
        self.incarnation = incarnation
        self.receive_max = receive_max
        self.send_publishes = send_publishes  # a batch, in order
        self.send_pubrel = send_pubrel
        self.closed = False
        self.writable = True  # false while the socket's write buffer is above its high-water mark
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        sess = self.session()
        # Expiry 0 never becomes non-zero later (MQTT 5 3.14.2.2.2: a protocol error on DISCONNECT).
        self.ephemeral = sess is not None and sess.expiry_s == 0
        # Ephemeral sessions only: seqno -> delivery not yet finished (the item itself: no wrapper
        # object per message), and the seqnos of those whose PUBREC came (PUBREL sent).
        self.local_inflight: dict[int, c.DeliveryItem] = {}
        self.local_releasing: set[int] = set()
        self.next_seq = sess.next_seq if sess else 0
        self.cursor: dict[int, int] = dict(sess.last_delivered) if sess else {}
        self.pid_to_seq: dict[int, int] = {}
        # A lower bound of the oldest seqno in pid_to_seq (which only rises): 0 until first computed.
        self._oldest_unacked_seq_floor = 0
        self.inflight_out = 0  # QoS>0 PUBLISHes not yet acknowledged by the client
        self.share_delivered: set[tuple[int, int]] = set()  # (shard, offset) of share claims in flight
        # $share claims this session finished (acknowledged): (shard, offset) -> registration. The
        # claim still names this session until the topic shard applies the ack report (later, or
        # never when the report is lost), and what is reloaded from that state meanwhile (a
        # snapshot install, an overflow) must not take it for a claim still to deliver. Forgotten
        # once the claim no longer names us (_prune_share_finished) or the offset is claimed anew.
        self.share_finished: dict[tuple[int, int], str] = {}
        self._share_finished_prune_at = SHARE_FINISHED_PRUNE_MIN
        self.pending: dict[int, deque[tuple[int, str]]] = {}  # shard -> (offset, registration), arrival order
        # Shards whose notices went past session.max_pending_notices while the client did not take
        # them: dropped (the shard's state still owes every one of them) and read again from that
        # state, at most that many at a time, once the pump has taken what it had.
        self.overflowed: set[int] = set()
        self.max_pending = node.cfg.session.max_pending_notices
        # shard -> (the shard's next offset when the Register applied, one of its retained
        # messages: an embedded delivery): served after that shard's pending offsets below that
        # offset (applied before the Register, e.g. earlier in the same batch of effects) and
        # before the rest, so a retained copy neither overtakes nor follows a live one of its topic.
        self.retained_first: dict[int, deque[tuple[int, c.DeliveryItem]]] = {}
        # Shards whose replica here is not yet known to hold everything the group had committed
        # when the session started here (a read barrier each): what they owe is not delivered
        # before, since a replica that was down or cut off may not have applied the acks,
        # returns and takeovers that came before this session's start.
        self.unconfirmed: set[int] = set()
        self._confirm_task: asyncio.Task[None] | None = None
        self._acks: list[tuple[int, int]] = []
        self._ack_flush: asyncio.Handle | None = None

    def session(self) -> Session | None:
        return session_of(self.node.hosts[self.shard].state.sessions, self.client_id)

    def _begin(self) -> None:
        self._resend()
        sess = self.session()
        if sess is not None:
            self.load_pending(sess)
            if self.node.link is not None:  # one node: its replicas are the groups themselves
                shards = [shard for shard, _ in self.node.session_regs(self.client_id, sess)]
                if shards:
                    self.unconfirmed = set(shards)
                    self._confirm_task = asyncio.get_running_loop().create_task(
                        self._confirm_replicas(shards), name=f"read-barrier:{self.client_id}")
        self.wake()

    async def _confirm_replicas(self, shards: list[int]) -> None:
        """A read barrier on every shard the session reads; each shard's owed messages flow once
        its barrier passed. Asked again until answered."""
        todo = set(shards)
        while todo and not self.closed:
            asked: dict[int, asyncio.Future[None]] = {}
            for shard in sorted(todo):
                try:
                    asked[shard] = self.node.read_barrier(shard)
                except ProposalDropped:
                    pass  # no leader known yet (or too many reads): asked again below
            if not asked:
                await asyncio.sleep(READ_BARRIER_RETRY_S)
                continue
            try:
                await asyncio.wait(list(asked.values()), timeout=READ_BARRIER_WAIT_S)
            except asyncio.CancelledError:  # the session closed: nobody looks at these any more
                for fut in asked.values():
                    fut.cancel()
                raise
            for shard, fut in asked.items():
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    todo.discard(shard)
                    self._shard_confirmed(shard)
                elif not fut.done():
                    fut.cancel()
            if todo and len(asked) < len(todo):
                await asyncio.sleep(READ_BARRIER_RETRY_S)

    def _shard_confirmed(self, shard: int) -> None:
        """The pending entries stay as they are: the pump checks each against the replica's state
        when it delivers it (claimed for us, still owed, past the cursor), and that state is now
        current; what the catch-up applied was notified as it applied. (Reloading them here would
        bring back a claim whose PUBCOMP just came, its ack report not applied yet.)"""
        if self.closed or shard not in self.unconfirmed:
            return
        self.unconfirmed.discard(shard)
        self.wake()

    def _replicas_behind(self) -> dict[int, int]:
        """Topic shards whose replica here has not yet applied a message the session has in flight
        (shard -> that offset). The session shard committed the delivery after the message, but
        this node's replica of the message's shard may lag: resending without it would skip it
        and let later deliveries overtake it."""
        sess = self.session()
        behind: dict[int, int] = {}
        if sess is None:
            return behind
        hosts = self.node.hosts
        for d in sess.inflight.values():
            shard, offset = d.item.shard, d.item.offset
            if offset < 0 or not 0 <= shard < len(hosts) or hosts[shard].failed is not None:
                continue
            if hosts[shard].state.topics.next_offset <= offset:
                behind[shard] = max(behind.get(shard, -1), offset)
        return behind

    def wake(self) -> None:
        self._wake.set()

    def _resend(self) -> None:
        sess = self.session()
        if sess is None:
            return
        outs: list[OutboundPublish] = []
        unavailable: set[int] = set()
        renumber = self.node.faults.renumber_packet_ids_on_takeover
        for i, (seq, d) in enumerate(sess.inflight.items()):
            # The broken build: fresh packet ids, half the id space past the session's next one.
            pid = packet_id_of(self.next_seq + PACKET_ID_SPACE // 2 + i if renumber else seq)
            self.pid_to_seq[pid] = seq
            self.inflight_out += 1
            if d.item.offset < 0:
                self.share_delivered.discard((d.item.shard, d.item.offset))
            else:
                self.share_delivered.add((d.item.shard, d.item.offset))
            if d.state == RELEASING:
                if outs:  # the resends keep their original order, PUBRELs included
                    self.send_publishes(outs)
                    outs = []
                self.send_pubrel(pid)
                continue
            msg = self._message(d.item)
            if msg is None:
                if d.item.shard >= 0 and self.node.hosts[d.item.shard].failed is not None:
                    unavailable.add(d.item.shard)  # reported once per shard, below
                else:
                    log.error("session %s: message %d/%d of an unacknowledged delivery is gone",
                              self.client_id, d.item.shard, d.item.offset)
                continue
            outs.append(OutboundPublish(msg, d.item.qos, d.item.retain, True, pid, d.item.sub_ids))
        if outs:
            self.send_publishes(outs)
        for shard in sorted(unavailable):
            log.warning("session %s: unacknowledged deliveries from shard %d not resent: the shard is "
                        "unavailable (%s)", self.client_id, shard, self.node.hosts[shard].failed)

    def _message(self, item: c.DeliveryItem) -> StoredMessage | None:
        if item.embedded is not None:
            return item.embedded
        return self.node.hosts[item.shard].message(item.offset)

    def _cannot_continue(self, why: str) -> None:
        """The delivery log here no longer continues the committed one: stop, and end the client's
        connection so it reconnects and the session resumes from what was committed (MQTT 5:
        DISCONNECT 0x80 with the reason)."""
        self.closed = True
        conn = self.node.connections.get(self.client_id)
        if conn is not None and getattr(conn, "live", None) is self:
            log.info("session %s: %s; closing its connection", self.client_id, why)
            conn.disconnect(0x80, f"delivery must resume from the committed state: {why}")

    def load_pending(self, sess: Session) -> None:
        """On (re)connect: everything owed past the delivered cursor, and our undelivered claims."""
        node = self.node
        self.pending = {}
        self.overflowed = set()
        self.share_delivered.update((shard, offset) for shard, _rk, offset in sess.share_done)
        if self.share_finished:
            self._prune_share_finished()
        for shard, regs in node.session_regs(self.client_id, sess):
            entries = self._pending_entries(shard, regs)
            if len(entries) > self.max_pending:
                del entries[self.max_pending:]
                self.overflowed.add(shard)  # the rest is read again once these are taken
            if entries:
                self.pending[shard] = deque(entries)

    def _reload_overflowed(self, sess: Session) -> None:
        """Shards whose notices were dropped: what they owe past the cursor, from their state, as
        far as the bound allows (the rest on a later pass)."""
        for shard, regs in self.node.session_regs(self.client_id, sess):
            if shard not in self.overflowed or self.pending.get(shard):
                continue
            entries = self._pending_entries(shard, regs)
            if len(entries) <= self.max_pending:
                self.overflowed.discard(shard)
            else:
                del entries[self.max_pending:]
            self.pending[shard] = deque(entries)

    def _pending_entries(self, shard: int, regs: list[tuple[str, Any]]) -> list[tuple[int, str]]:
        """(offset, registration) owed to (or claimed for) this session in ``shard`` past the
        delivered cursor, as this replica's state has it, in offset order."""
        topics = self.node.hosts[shard].state.topics
        cursor = self.cursor.get(shard, -1)
        entries: list[tuple[int, str]] = []
        for reg_key, _sub in regs:
            reg = registration(topics, reg_key)
            if reg is None:
                continue
            if reg.share_group is not None:
                done, finished = self.share_delivered, self.share_finished
                entries.extend((o, reg_key) for o, holder in claims_of(reg).items()
                               if self._holds(holder) and (shard, o) not in done and (shard, o) not in finished)
            elif reg.session_inc == self.incarnation:
                entries.extend((o, reg_key) for o in owed_after(reg, cursor))
        entries.sort()
        return entries

    def _prune_share_finished(self) -> None:
        """Finished $share claims whose claim no longer names this session (its ack report applied,
        or the claim went back to the group) are forgotten; those of a shard that failed or is
        installing a snapshot here are kept."""
        hosts = self.node.hosts
        keep: dict[tuple[int, int], str] = {}
        for (shard, offset), reg_key in self.share_finished.items():
            host = hosts[shard] if 0 <= shard < len(hosts) else None
            if host is not None and host.failed is None and not host.installing:
                reg = registration(host.state.topics, reg_key)
                holder = claim_of(reg, offset) if reg is not None else None
                if holder is None or not self._holds(holder):
                    continue
            keep[(shard, offset)] = reg_key
        self.share_finished = keep
        self._share_finished_prune_at = max(SHARE_FINISHED_PRUNE_MIN, 2 * len(keep))

    def _holds(self, holder: tuple[str, int]) -> bool:
        """Whether a $share claim (member, incarnation) is this session's: a claim made for an
        earlier session of this client id is that session's, returned when it ends."""
        return holder[0] == self.client_id and same_incarnation(holder[1], self.incarnation)
