"""A connected session's acknowledgements from its client (PUBACK, PUBREC, PUBCOMP): committed in
batches in the session shard (``SessionAcks``), then reported to the topic shards (``AckReport``),
which may release the messages. Extended by delivery.py (``LiveSession``)."""

from __future__ import annotations

import asyncio
from typing import Any

from moorline.broker import commands as c
from moorline.node.errors import ShardUnavailable
from moorline.node.sessions.delivery_resume import ResumingSession

ACK_RETRY_S = 0.2  # acknowledgements the session shard refused (pending-proposal bound) are proposed again


class AckingSession(ResumingSession):
    """A connected session's acknowledgement path."""

    def on_puback(self, pid: int) -> bool:
        return self.on_pubacks([pid])

    def on_pubacks(self, pids: list[int]) -> bool:
        """PUBACKs (or PUBCOMPs) read together: ``on_puback`` for each, with one wake-up. True
        when any of them finished a delivery of ours."""
        pid_to_seq = self.pid_to_seq
        acks = self._acks
        done = 0
        for pid in pids:
            seq = pid_to_seq.pop(pid, None)
            if seq is not None:
                acks.append((seq, 1))
                done += 1
        if not done:
            return False
        self.inflight_out -= done
        if self._ack_flush is None:
            delay = self.node.cfg.session.ack_commit_interval_ms / 1000
            loop = asyncio.get_running_loop()
            # 0: after the rest of this loop pass (every ack read in it), with no timer to wake the loop.
            self._ack_flush = (loop.call_soon(self._flush_acks) if delay <= 0
                               else loop.call_later(delay, self._flush_acks))
        self.wake()
        return True

    async def on_pubrec(self, pid: int) -> bool:
        seq = self.pid_to_seq.get(pid)
        if seq is None:
            return False
        if self.ephemeral:
            if seq in self.local_inflight:
                self.local_releasing.add(seq)
            return True
        fut = self.node.propose(self.shard, c.SessionAcks(self.client_id, self.epoch, ((seq, 2),)))
        assert fut is not None
        await fut  # PUBREC committed before PUBREL is sent
        return True

    def on_pubcomp(self, pid: int) -> bool:
        return self.on_puback(pid)

    def _flush_acks(self) -> None:
        self._ack_flush = None
        if not self._acks:
            return
        acks, self._acks = tuple(self._acks), []
        if self.ephemeral:
            done: list[c.DeliveryItem] = []
            local, releasing = self.local_inflight, self.local_releasing
            for seq, _kind in acks:  # kind 1 only: PUBREC (kind 2) never queues here
                it = local.pop(seq, None)
                if it is not None:
                    done.append(it)
                    if releasing:
                        releasing.discard(seq)
            self._report_done(done)
            return
        # QoS 1 acks may be committed late (one lost with its owner is redelivered): no sync of their own.
        try:
            fut = self.node.propose_lazy(self.shard, c.SessionAcks(self.client_id, self.epoch, acks), want=True)
        except ShardUnavailable:
            # The session shard takes no more proposals from this node now (raft.max_pending_proposals
            # during a partition, or failed): keep the acks (at most the in-flight window) and try
            # again; a session that ends meanwhile has those messages resent, as MQTT allows.
            if not self.closed:
                self._acks[:0] = acks
                self._ack_flush = asyncio.get_running_loop().call_later(ACK_RETRY_S, self._flush_acks)
            return
        assert fut is not None
        fut.add_done_callback(self._acks_committed)

    def _acks_committed(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        self._report_done(fut.result())

    def _report_done(self, done: list[c.DeliveryItem]) -> None:
        """Finished deliveries: their topic shards may release the messages."""
        share_delivered, finished = self.share_delivered, self.share_finished
        by_regs: dict[tuple[int, tuple[str, ...]], list[int]] = {}  # (shard, registrations) -> offsets
        for it in done:
            offset = it.offset
            if offset < 0:
                continue
            if share_delivered:
                claim = (it.shard, offset)
                if claim in share_delivered:
                    share_delivered.discard(claim)
                    if it.reg_keys and it.reg_keys[0].startswith(c.SHARE_PREFIX):
                        # Finished, yet claimed for us until the ack report below applies.
                        finished[claim] = it.reg_keys[0]
            key = (it.shard, it.reg_keys)
            offsets = by_regs.get(key)
            if offsets is None:
                by_regs[key] = [offset]
            else:
                offsets.append(offset)
        if len(finished) > self._share_finished_prune_at:
            self._prune_share_finished()
        if self.node.faults.drop_ack_reports:  # test instrument: reports lost (sessions/followups.py)
            return
        by_shard: dict[int, dict[str, list[int]]] = {}
        for (shard, reg_keys), offsets in by_regs.items():
            for rk in reg_keys:
                by_shard.setdefault(shard, {}).setdefault(rk, []).extend(offsets)
        for shard, by_reg in by_shard.items():
            for rk, offs in by_reg.items():
                self.node.propose_lazy(shard, c.AckReport(rk, tuple(offs)))
