"""Outbound delivery for one connected session.

Order of operations for every batch (docs/design.md, "Delivery"): pick owed messages in offset order
per shard, commit a ``Deliver`` batch in the session's shard (seqno -> packet id), and only then
write the PUBLISH packets. Acknowledgements are committed in batches; after they commit, the
topic shards get ``AckReport`` commands and may release the messages. On reconnect the session
first resends every unacknowledged delivery in seqno order with its original packet id.

A session with expiry 0 (clean session) ends with its connection: no later connection, on this
node or another, can resume it, so nothing could ever resend its deliveries. Its delivery log
therefore lives only here (``local_inflight``) and is never replicated: no ``Deliver`` batch and
no ``SessionAcks`` are committed for it. Its acknowledgements still reach the topic shards as
``AckReport`` commands, which is what releases the messages (they stay owed until then).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage, decode_message
from moorline.broker.queries import claim_of, is_owed, registration
from moorline.broker.session_state import SubscriptionState, packet_id_of
from moorline.broker.topic_state import ACL_NO_READER, Registration, TopicState
from moorline.node.sessions.delivery_acks import AckingSession
from moorline.node.sessions.delivery_resume import PACKET_ID_SPACE
from moorline.node.sessions.outbound import OutboundPublish, ReadFilter
from moorline.node.sessions.recent import SHARD_SHIFT
from moorline.storage.msgstore import MessageStore, RecordRead

__all__ = ["LiveSession", "OutboundPublish", "ReadFilter"]  # the last two: outbound.py's, used with it

log = logging.getLogger("moorline.delivery")

_UNSEEN: Any = object()
REPLICA_CATCH_UP_POLL_S = 0.01  # a resuming session waiting for a lagging replica looks again this often


class LiveSession(AckingSession):
    """The node-side driver of one connected session. Owns no replicated state of its own."""

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        behind = self._replicas_behind()
        loop = asyncio.get_running_loop()
        if behind:
            self._task = loop.create_task(self._start_when_caught_up(behind), name=f"deliver:{self.client_id}")
            return
        self._begin()
        self._task = loop.create_task(self._pump(), name=f"deliver:{self.client_id}")

    async def _start_when_caught_up(self, behind: dict[int, int]) -> None:
        """Resend (and then deliver) once every replica here holds what is in flight; bounded by
        ``mqtt.publish_timeout_s``, after which the client is told to reconnect (elsewhere)."""
        clock = self.node.clock
        deadline = clock.monotonic() + self.node.cfg.mqtt.publish_timeout_s
        while not self.closed and behind:
            hosts = self.node.hosts
            behind = {s: o for s, o in behind.items()
                      if hosts[s].failed is None and hosts[s].state.topics.next_offset <= o}
            if not behind:
                break
            if clock.monotonic() >= deadline:
                self._cannot_continue(f"this node's replica of shard {min(behind)} is behind the session's deliveries")
                return
            await asyncio.sleep(REPLICA_CATCH_UP_POLL_S)
        if self.closed:
            return
        self._begin()
        await self._pump()

    def stop(self) -> None:
        """No more deliveries; acknowledgements received so far are proposed now."""
        self.closed = True
        if self._ack_flush is not None:
            self._ack_flush.cancel()
        self._flush_acks()
        self._wake.set()

    async def close(self) -> None:
        self.stop()
        if self._confirm_task is not None:
            self._confirm_task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    # --- the pump ------------------------------------------------------------------------------
    async def _pump(self) -> None:
        while not self.closed:
            await self._wake.wait()
            self._wake.clear()
            try:
                while not self.closed and self.writable and await self._deliver_once():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("session %s: delivery failed", self.client_id)
                await asyncio.sleep(0.1)
                self._wake.set()

    def room(self) -> int:
        return self.receive_max - self.inflight_out

    def _packet_id_room(self) -> int:
        """How many more seqnos may be given out before one would reuse the packet id of a delivery
        the client has not acknowledged (MQTT-2.2.1-3): at 0 the session stops sending until it is."""
        room = self._oldest_unacked_seq_floor + PACKET_ID_SPACE - self.next_seq
        if room > self.node.cfg.session.delivery_batch_max:
            return room  # the common case, without a look at what is in flight
        seqs = self.pid_to_seq.values()
        self._oldest_unacked_seq_floor = min(seqs) if seqs else self.next_seq
        return self._oldest_unacked_seq_floor + PACKET_ID_SPACE - self.next_seq

    def notify(self, shard: int, reg_key: str, offset: int) -> None:
        """A committed apply made ``offset`` owed to (or claimed for) this session. Wakes only:
        the message itself is read from the shard's store when it is delivered."""
        if self.share_finished and reg_key.startswith(c.SHARE_PREFIX) and shard not in self.unconfirmed:
            # A claim applied just now: the offset was unclaimed, so a claim of it this session
            # finished before has ended (the offset is owed to the group again). Not while the
            # shard's read barrier is pending: this replica may still be applying claims committed
            # before the session started, among them the very claim a resend (from the session
            # shard's delivery log, which waits for the message here, not for its claim) just
            # finished (sim --cluster seed 60344).
            self.share_finished.pop((shard, offset), None)
        self.notify_run(shard, ((offset, reg_key),))

    def notify_run(self, shard: int, run: Iterable[tuple[int, str]]) -> None:
        """``notify`` for (offset, registration) pairs in apply order, appended as they are."""
        if shard in self.overflowed:
            return  # read from the shard's state when the pump gets there
        dq = self.pending.get(shard)
        if dq is None:
            dq = self.pending[shard] = deque()
        dq.extend(run)
        if len(dq) > self.max_pending:
            dq.clear()
            self.overflowed.add(shard)

    async def _read_ahead(self) -> dict[int, StoredMessage]:
        """The messages the next batch may take that neither the recent cache nor the store's
        write buffer holds, read from the stores' files off the event loop (the node's file-work
        executor; on the loop without one: the simulator's inline seam), so a cache miss never
        stalls the loop (heartbeats included) for a disk read. Keyed as the recent cache is. Each
        store is held (no segment reclaimed) while its records are read; what the read could not
        confirm, or what a store replaced or failed meanwhile, is left out (``host.message``
        reads it then)."""
        limit = self.node.cfg.session.delivery_batch_max
        recent = self.node.recent.by_key
        hosts = self.node.hosts
        jobs: list[tuple[int, Any, list[RecordRead]]] = []
        for shard, dq in self.pending.items():
            if not dq or shard in self.unconfirmed:
                continue
            host = hosts[shard]
            if host.failed is not None or host.installing:
                continue  # (an install moves the stores: host.message gives nothing meanwhile)
            store = host.store
            key_base = shard << SHARD_SHIFT
            reads: list[RecordRead] = []
            seen: set[int] = set()
            for k, (offset, _rk) in enumerate(dq):
                if k >= limit:
                    break
                if (key_base | offset) in recent or offset in seen:
                    continue
                seen.add(offset)
                plan = store.plan_get(offset)
                if plan is not None:
                    reads.append(plan)
            if reads:
                jobs.append((shard, store, reads))
        if not jobs:
            return {}
        executor = hosts[jobs[0][0]].snapshot_settings.executor
        for _shard, store, _reads in jobs:
            store.hold_reclaim()
        try:
            if executor is None:
                results = _read_all([reads for _s, _st, reads in jobs])
            else:
                results = await asyncio.get_running_loop().run_in_executor(
                    executor, _read_all, [reads for _s, _st, reads in jobs])
        finally:
            for _shard, store, _reads in jobs:
                store.release_reclaim()
        fetched: dict[int, StoredMessage] = {}
        for (shard, store, reads), records in zip(jobs, results, strict=True):
            host = hosts[shard]
            if host.store is not store or host.failed is not None or host.installing:
                continue  # replaced by an installed snapshot, or failed, while reading
            key_base = shard << SHARD_SHIFT
            for plan, record in zip(reads, records, strict=True):
                if record is not None:
                    fetched[key_base | plan.offset] = decode_message(record)
        return fetched

    async def _deliver_once(self) -> bool:
        fetched = await self._read_ahead() if self.pending else {}
        sess = self.session()
        if sess is None or sess.epoch != self.epoch:
            return False
        subs = self.node.reg_subs(self.client_id, sess)
        if self.overflowed:
            self._reload_overflowed(sess)
        room = self.room()
        batch_max = min(self.node.cfg.session.delivery_batch_max, self._packet_id_room())
        if batch_max <= 0:
            return False  # woken again by acknowledgements
        # One batch never writes much more than the socket's high-water mark, so pause_writing
        # stops the pump before the write buffer nears mqtt.max_write_buffer_bytes.
        byte_budget = self.node.cfg.mqtt.write_buffer_high_bytes
        batch_bytes = 0
        items: list[c.DeliveryItem] = []
        taken_share: set[tuple[int, int]] = set()  # $share (shard, offset) put in this batch
        msgs: list[StoredMessage] = []
        more = False
        held: dict[int, int] = {}  # shard -> the offset its live deliveries stop at (retained ones wait)
        if self.retained_first:
            room, batch_bytes, held = self._take_retained(items, msgs, room, batch_max, byte_budget)
            more = len(items) >= batch_max or batch_bytes >= byte_budget
        behind_live = [s for s in held if not self._retained_ready(s)]
        now_ms = self.node.clock.wall_ms()
        read_filter = self.read_filter
        recent = self.node.recent
        recent_get = recent.by_key.get
        hits = 0
        unconfirmed = self.unconfirmed
        for shard, dq in self.pending.items():
            if more:
                break
            if not dq or shard in unconfirmed:
                continue
            stop_at = held.get(shard)
            if stop_at is not None and dq[0][0] >= stop_at:
                continue
            host = self.node.hosts[shard]
            topics = host.state.topics
            key_base = shard << SHARD_SHIFT
            cursor = self.cursor.get(shard, -1)
            expired: dict[str, list[int]] = {}
            denied: dict[str, list[int]] = {}
            # Per registration, what a plain (non-$share) one of this incarnation gives every offset
            # it owes: almost every offset is owed to one such registration, so its lookups are
            # done once per batch, not once per message.
            plain: dict[str, tuple[Registration, int, tuple[int, ...], bool, tuple[str, ...]] | None] = {}
            while dq:
                offset, reg_key = dq[0]
                if stop_at is not None and offset >= stop_at:
                    break  # a retained message the shard applied before this offset goes first
                n = 1
                if len(dq) > 1 and dq[1][0] == offset:
                    while n < len(dq) and dq[n][0] == offset:
                        n += 1
                    qos, sub_ids, reg_keys, rap, share = self._resolve(topics, subs, shard, offset, dq, n, cursor)
                else:
                    known = plain.get(reg_key, _UNSEEN)
                    if known is _UNSEEN:
                        known = plain[reg_key] = self._plain_registration(topics, subs, reg_key)
                    if known is not None:
                        owner, qos, sub_ids, rap, reg_keys = known
                        share = False
                        if offset <= cursor or not is_owed(owner, offset):
                            qos = -1
                    else:
                        qos, sub_ids, reg_keys, rap, share = self._resolve(topics, subs, shard, offset, dq, 1, cursor)
                if share and (shard, offset) in taken_share:
                    qos = -1  # claimed twice for us in one burst of applies: sent once
                if qos < 0:
                    for _ in range(n):
                        dq.popleft()
                    continue
                msg = recent_get(key_base | offset)  # host.message(offset), inlined for a recent one
                if msg is None:
                    # Not once the shard failed (a damaged record found meanwhile): nothing past
                    # the damage is delivered, as host.message says.
                    msg = fetched.get(key_base | offset) if fetched and host.failed is None else None
                    if msg is None:
                        msg = host.message(offset)
                    if msg is None:
                        for _ in range(n):
                            dq.popleft()
                        continue
                else:
                    hits += 1
                if msg.qos < qos:
                    qos = msg.qos
                if qos > 0 and room <= 0:
                    more = False  # woken again by acknowledgements
                    break
                if n == 1:
                    dq.popleft()
                else:
                    for _ in range(n):
                        dq.popleft()
                if msg.expiry_s is not None and msg.expires_at_ms() <= now_ms:  # type: ignore[operator]
                    for rk in reg_keys:
                        expired.setdefault(rk, []).append(offset)
                    if not share:
                        self.cursor[shard] = max(cursor, offset)
                    continue
                if read_filter is not None and not read_filter.allowed(reg_keys, msg.topic):
                    for rk in reg_keys:  # never sent: dropped (plain) or declined ($share), below
                        denied.setdefault(rk, []).append(offset)
                    if not share:
                        self.cursor[shard] = max(cursor, offset)
                    continue
                if share:
                    taken_share.add((shard, offset))
                items.append(c.DeliveryItem(shard, offset, qos, msg.retain and rap, sub_ids, reg_keys))
                msgs.append(msg)
                if qos > 0:
                    room -= 1
                batch_bytes += len(msg.payload) + len(msg.topic)
                if len(items) >= batch_max or batch_bytes >= byte_budget:
                    more = True
                    break
            for rk, offs in expired.items():
                self.node.propose(shard, c.DropOwed(rk, tuple(offs), "message_expiry"), want=False)
            for rk, offs in denied.items():
                if rk.startswith(c.SHARE_PREFIX):
                    self.node.propose(shard, c.ShareDecline(rk, self.client_id, tuple(offs), self.incarnation),
                                      want=False)
                else:
                    self.node.propose(shard, c.DropOwed(rk, tuple(offs), ACL_NO_READER), want=False)
            if more:
                break
        recent.count_hits(hits)
        if not items:
            # Live offsets a retained message waited behind may all have been skipped (not owed,
            # expired, denied): the retained ones can go now.
            return any(self._retained_ready(s) for s in behind_live)
        await self._commit_and_send(items, msgs)
        # A shard whose notices were dropped and whose reloaded part is now taken has more to read
        # from its state: nobody would wake the pump for it (its notices are not kept).
        return more or bool(held) or any(not self.pending.get(s) for s in self.overflowed)

    def _plain_registration(
        self, topics: TopicState, subs: dict[str, SubscriptionState], reg_key: str
    ) -> tuple[Registration, int, tuple[int, ...], bool, tuple[str, ...]] | None:
        """(registration, qos, subscription ids, retain as published, (reg_key,)) for a plain
        registration of this session's incarnation that a subscription of the session stands
        behind; None for anything else ($share, stale, gone, or unsubscribed).

        Unsubscribed (the session's subscription is gone, the registration draining): what it owes
        and is not delivered yet is not sent. ``Subscriptions.unsubscribe`` reports those offsets
        acknowledged (owed past this session's cursor once the unsubscribe applied here), so a
        message sent after that point would be released with its delivery still unacknowledged,
        and never resent (sim --cluster seed 30574). What is in flight is finished as usual."""
        reg = registration(topics, reg_key)
        if reg is None or reg.share_group is not None or reg.session_inc != self.incarnation:
            return None
        sub = subs.get(reg_key)
        if sub is None:
            return None
        return reg, sub.qos, (sub.sub_id,) if sub.sub_id else (), sub.retain_as_published, (reg_key,)

    def _resolve(
        self, topics: TopicState, subs: dict[str, SubscriptionState], shard: int, offset: int,
        dq: deque[tuple[int, str]], n: int, cursor: int,
    ) -> tuple[int, tuple[int, ...], tuple[str, ...], bool, bool]:
        """(qos, subscription ids, registrations, retain as published, $share) for ``offset``, owed
        to the registrations of ``dq[:n]``; qos -1 when none of them still wants it from us."""
        qos = -1
        sub_ids: tuple[int, ...] = ()  # tuples: almost always one registration owes an offset
        reg_keys: tuple[str, ...] = ()
        rap = False
        share = False
        for i in range(n):
            reg_key = dq[i][1]
            reg = registration(topics, reg_key)
            sub = subs.get(reg_key)
            if reg is None:
                continue
            if reg.share_group is not None:
                holder = claim_of(reg, offset)
                if (holder is None or not self._holds(holder) or (shard, offset) in self.share_delivered
                        or (shard, offset) in self.share_finished):
                    continue
                share = True
            elif (reg.session_inc != self.incarnation or not is_owed(reg, offset) or offset <= cursor
                  or sub is None):  # unsubscribed: see _plain_registration
                continue
            sq = sub.qos if sub is not None else reg.qos
            if sq > qos:
                qos = sq
            if sub is not None:
                if sub.sub_id:
                    sub_ids += (sub.sub_id,)
                rap = rap or sub.retain_as_published
            reg_keys += (reg_key,)
        return qos, sub_ids, reg_keys, rap, share

    def add_retained(self, shard: int, reg_key: str, retained: tuple[StoredMessage, ...], live_before: int) -> bool:
        """A Register of this session applied in ``shard`` with these retained messages, when the
        shard's next offset was ``live_before``; False when it is not this session's (an older
        incarnation's, or the session is closing)."""
        reg = registration(self.node.hosts[shard].state.topics, reg_key)
        sess = self.session()
        if self.closed or reg is None or reg.session_inc != self.incarnation or sess is None:
            return False
        sub = self.node.reg_subs(self.client_id, sess).get(reg_key)
        qos = sub.qos if sub is not None else reg.qos
        sub_ids = (sub.sub_id,) if sub is not None and sub.sub_id else ()
        can_read = self.read_filter.can_read if self.read_filter is not None else None
        dq = self.retained_first.setdefault(shard, deque())
        dq.extend((live_before, c.DeliveryItem(-1, -1, min(qos, m.qos), True, sub_ids, (), m))
                  for m in retained if can_read is None or can_read(m.topic))
        if not dq:
            del self.retained_first[shard]
            return False
        return True

    def _take_retained(
        self, items: list[c.DeliveryItem], msgs: list[StoredMessage], room: int, batch_max: int, byte_budget: int,
    ) -> tuple[int, int, dict[int, int]]:
        """Retained messages first, within the same bounds as any delivery (packet ids, the
        client's window, the batch's bytes), except behind the live offsets their shard applied
        before their Register; returns (room left, bytes, shard -> the offset its live deliveries
        stop at, for shards still holding retained ones)."""
        batch_bytes = 0
        held: dict[int, int] = {}
        for shard in list(self.retained_first):
            dq = self.retained_first[shard]
            while (dq and self._retained_ready(shard) and len(items) < batch_max and batch_bytes < byte_budget
                   and (dq[0][1].qos == 0 or room > 0)):
                it = dq.popleft()[1]
                msg = it.embedded
                assert msg is not None
                items.append(it)
                msgs.append(msg)
                room -= it.qos > 0
                batch_bytes += len(msg.payload) + len(msg.topic)
            if dq:
                held[shard] = dq[0][0]
            else:
                del self.retained_first[shard]
        return room, batch_bytes, held

    def _retained_ready(self, shard: int) -> bool:
        """The shard's next retained message goes before any live offset it still owes: none of
        its pending offsets is one the shard applied before that message's Register."""
        dq = self.retained_first.get(shard)
        if not dq:
            return False
        pend = self.pending.get(shard)
        return not pend or pend[0][0] >= dq[0][0]

    async def _commit_and_send(self, items: list[c.DeliveryItem], msgs: list[StoredMessage]) -> None:
        first = self.next_seq
        self.next_seq += len(items)
        cursor = self.cursor
        local = self.local_inflight if self.ephemeral else None
        in_flight = 0
        seq = first
        for it in items:
            offset = it.offset
            if offset >= 0:
                if it.reg_keys and it.reg_keys[0].startswith(c.SHARE_PREFIX):
                    self.share_delivered.add((it.shard, offset))
                elif offset > cursor.get(it.shard, -1):
                    cursor[it.shard] = offset
            if it.qos > 0:
                in_flight += 1
                if local is not None:
                    local[seq] = it
            seq += 1
        self.inflight_out += in_flight
        if local is None:
            fut = self.node.propose(self.shard, c.Deliver(self.client_id, self.epoch, first, tuple(items)))
            self.node.stats["delivery_batches_committed"] += 1
            if not self.node.faults.loose_packet_ids:
                assert fut is not None
                try:
                    ok = await fut  # the batch is durable before any PUBLISH of it leaves
                except Exception as exc:  # noqa: BLE001 - dropped, unavailable, outcome unknown
                    self._cannot_continue(f"a delivery batch did not commit: {exc}")
                    return
                if not ok:
                    self._cannot_continue("a delivery batch was refused (stale owner or a batch before it lost)")
                    return
        if self.closed:
            return
        qos0_acks: dict[int, dict[str, list[int]]] = {}
        outs: list[OutboundPublish] = []
        pid_to_seq = self.pid_to_seq
        seq = first
        for it, msg in zip(items, msgs, strict=True):
            if it.qos > 0:
                pid = packet_id_of(seq)
                pid_to_seq[pid] = seq
                outs.append(OutboundPublish(msg, it.qos, it.retain, False, pid, it.sub_ids))
            else:
                if it.offset >= 0:
                    for rk in it.reg_keys:
                        qos0_acks.setdefault(it.shard, {}).setdefault(rk, []).append(it.offset)
                outs.append(OutboundPublish(msg, 0, it.retain, False, None, it.sub_ids))
            seq += 1
        self.send_publishes(outs)
        for shard, by_reg in qos0_acks.items():
            for rk, offs in by_reg.items():
                self.node.propose_lazy(shard, c.AckReport(rk, tuple(offs)))

def _read_all(jobs: list[list[RecordRead]]) -> list[list[bytes | None]]:
    """``MessageStore.read_records`` for each store's reads (one executor call for all of them)."""
    return [MessageStore.read_records(reads) for reads in jobs]
