"""What a shard's apply hands this node (its Effects): retained and owed messages to the live
sessions, $share groups to dispatch, and the per-subscription queue caps, enforced on the leader."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.queries import owed_count, owed_offsets, registration
from moorline.node.replication.shard_host import ShardHost
from moorline.node.sessions.delivery import LiveSession

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")
SHARE_PREFIX = c.SHARE_PREFIX


class Fanout:
    """Apply effects to sessions; queue caps."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def on_effects(self, host: ShardHost, fx: Effects) -> None:
        shard = host.shard
        # A dict, not a set: sessions wake in a deterministic order (a set of objects iterates in
        # address order, which differs run to run and breaks a simulator seed's replay).
        woken: dict[LiveSession, None] = {}
        # Retained messages of a new registration go after what the shard applied before the
        # Register and before anything it owes the session from then on (the pump keeps to that).
        for reg_key, retained, live_before in fx.retained_new:
            live = self.node.live.get(reg_key.partition("\x00")[0])
            if live is not None and live.add_retained(shard, reg_key, retained, live_before):
                woken[live] = None
        # Runs of one registration (one subscriber's messages, in apply order) go to its session at once.
        for reg_key, run in groupby(fx.owed_new, key=itemgetter(1)):
            if reg_key.startswith(SHARE_PREFIX):
                continue
            live = self.node.live.get(reg_key.partition("\x00")[0])
            if live is not None:
                live.notify_run(shard, run)
                woken[live] = None
        for reg_key in fx.owed_regs:
            if self.node.is_share_key(reg_key):
                self.node.share.schedule_dispatch(shard, reg_key)
            else:
                self._enforce_queue_cap(host, reg_key)
        for reg_key, member, offsets in fx.claims:
            live = self.node.live.get(member)
            if live is not None:
                for offset in offsets:
                    live.notify(shard, reg_key, offset)
                woken[live] = None
        for live in woken:
            live.wake()

    def _enforce_queue_cap(self, host: ShardHost, reg_key: str) -> None:
        """session.max_queued_messages / _bytes hold per subscription across every shard its filter
        reads: past either, its oldest undelivered messages (by entry time, then shard and offset)
        are dropped by committed, counted DropOwed commands. Messages already sent and not yet
        acknowledged are never dropped: the client may be acknowledging them right now."""
        reg = registration(host.state.topics, reg_key)
        if reg is None or len(self.node.hosts) < self.node.shard_count or not host.raft.is_leader:
            return  # recovering (caps hold again from the next apply), or the leader's to enforce
        cap_n, cap_b = self.node.cfg.session.max_queued_messages, self.node.cfg.session.max_queued_bytes
        shards = self.node.shards_for_filter(reg.filter)
        total_n = total_b = 0
        for shard in shards:
            t = self.node.hosts[shard].state.topics
            r = registration(t, reg_key)
            if r is not None:
                total_n += owed_count(r)
                total_b += t.owed_bytes.get(reg_key, 0)
        if total_n <= cap_n and total_b <= cap_b:
            return
        cursors = self.node.registry.delivered_cursors(reg.client_id)
        candidates = []
        for shard in shards:
            h = self.node.hosts[shard]
            r = registration(h.state.topics, reg_key)
            if r is not None and owed_count(r) and h.failed is None:
                candidates.append(self._undelivered_by_age(h, r, cursors.get(shard, -1)))
        victims: dict[int, list[int]] = {}
        for _ts, shard, offset, size in heapq.merge(*candidates):
            if total_n <= cap_n and total_b <= cap_b:
                break
            victims.setdefault(shard, []).append(offset)
            total_n -= 1
            total_b -= size
        for shard, offsets in victims.items():
            coverage.hit("queue_cap_drop")
            self.node.propose(shard, c.DropOwed(reg_key, tuple(offsets), "queue_cap"), want=False)

    @staticmethod
    def _undelivered_by_age(host: ShardHost, reg: Any, cursor: int) -> Iterable[tuple[int, int, int, int]]:
        """(entry time, shard, offset, size) of what ``reg`` is owed above ``cursor``, oldest first
        (a shard's offsets are in entry-time order)."""
        meta = host.state.topics.meta
        for offset in owed_offsets(reg):
            if offset > cursor:
                m = meta.get(offset)
                if m is not None:
                    yield m.ts_ms, host.shard, offset, m.size
