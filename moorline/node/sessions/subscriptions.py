"""SUBSCRIBE and UNSUBSCRIBE: the subscription committed in the session's shard, then its
registration in every shard the filter can match (undone everywhere when that fails part-way)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.broker.queries import owed_after, registration
from moorline.broker.session_state import Session, SubscriptionState
from moorline.broker.share_policy import GroupPolicy, group_policy
from moorline.mqtt.topics import parse_shared
from moorline.node.errors import NodeFailure, ShardUnavailable
from moorline.node.sessions.delivery import LiveSession

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")
SHARE_PREFIX = c.SHARE_PREFIX


def reg_key_for(client_id: str, topic_filter: str) -> tuple[str, str, str | None]:
    """(registration key, inner filter, share group) of a session's subscription."""
    shared = parse_shared(topic_filter)
    if shared is not None:
        group, inner = shared
        return f"{SHARE_PREFIX}{group}\x00{inner}", inner, group
    return f"{client_id}\x00{topic_filter}", topic_filter, None


class Subscriptions:
    """Subscribe and unsubscribe across shards."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def share_policy(self, group: str, asked_single_active: bool = False) -> GroupPolicy:
        """A $share group's work-queue policy from ``[queue]`` (docs/queues.md)."""
        qc = self.node.cfg.queue
        return group_policy(qc.single_active, qc.limited_groups, qc.max_deliveries, qc.ack_timeout_s,
                            group, asked_single_active)

    def register_everywhere(
        self, sess: Session, flt: str, sub: SubscriptionState, want_retained: bool, futs: list[Any],
        single_active: bool = False,
    ) -> list[int]:
        """Proposes the registration in every shard the filter can match; returns the shards that
        refused it at once (unavailable). The futures of the others go to ``futs``."""
        reg_key, inner, group = reg_key_for(sess.client_id, flt)
        pol = self.node.share_policy(group, single_active) if group is not None else GroupPolicy(False, 0, 0)
        refused: list[int] = []
        for shard in self.node.shards_for_filter(inner):
            try:
                futs.append(self.node.propose_cross(shard, c.Register(
                    self.node.now_ms(), reg_key, sess.client_id if group is None else "", sess.incarnation, inner,
                    sub.qos, sub.no_local, want_retained and group is None, group, sub.version,
                    pol.single_active, pol.max_deliveries, pol.ack_timeout_ms,
                )))
                if group is not None:
                    futs.append(self.node.propose_cross(shard, c.ShareMember(reg_key, sess.client_id, True,
                                                                        sess.incarnation)))
            except ShardUnavailable:
                refused.append(shard)
        return refused

    async def subscribe(
        self, live: LiveSession, flt: str, qos: int, no_local: bool, rap: bool, rh: int, sub_id: int | None,
        single_active: bool = False,
    ) -> None:
        """Commits the subscription in the session's shard, then registers it in every shard the
        filter can match; SUBACK may follow. Each shard's Register hands its retained messages to
        the session as it applies (``_on_effects``): they may precede the SUBACK (MQTT-3.8.4)."""
        fut = self.node.propose(live.shard, c.SessionSubscribe(live.client_id, live.epoch, flt, qos, no_local, rap, rh, sub_id))
        assert fut is not None
        res = await self.node.bounded(fut, live.shard)
        sess = live.session()
        if res is None or sess is None or sess.epoch != live.epoch or flt not in sess.subs:
            raise NodeFailure("session taken over")
        existed, _inc = res
        sub = sess.subs[flt]
        want = rh == 0 or (rh == 1 and not existed)
        futs: list[Any] = []
        refused = self.register_everywhere(sess, flt, sub, want, futs, single_active)
        if self.node.faults.suback_before_all_shards and len(futs) > 1:  # broken build: the first shard's answer only
            asyncio.gather(*futs[1:], return_exceptions=True)  # the other shards answer whenever, unheard
            futs = futs[:1]
        results = await asyncio.gather(*(self.node.bounded(f, -1) for f in futs), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if refused or errors:
            # Failed part-way: undone everywhere it reached, so nothing registered goes on collecting
            # or delivering messages for a subscription the client was told failed (SUBACK 0x80).
            await self._undo_subscribe(live, flt, sub.version)
            which = ", ".join(f"shard {s}" for s in refused)
            raise ShardUnavailable(f"{which or 'a shard'} unavailable" + (f": {errors[0]}" if errors else ""))
        live.wake()

    async def _undo_subscribe(self, live: LiveSession, flt: str, version: int) -> None:
        """Removes a subscription whose registration failed part-way, from the session and from
        every shard that can still be reached (best effort: a shard that is down now has the
        registration removed when the session's subscriptions are reconciled)."""
        fut = self.node.propose(live.shard, c.SessionUnsubscribe(live.client_id, live.epoch, flt))
        assert fut is not None
        try:
            undone = await self.node.bounded(fut, live.shard)
        except ShardUnavailable:
            undone = None
        reg_key, inner, group = reg_key_for(live.client_id, flt)
        futs = []
        for shard in self.node.shards_for_filter(inner):
            try:
                if group is not None:
                    futs.append(self.node.propose_cross(shard, c.ShareMember(reg_key, live.client_id, False,
                                                                        live.incarnation)))
                else:
                    futs.append(self.node.propose_cross(shard, c.Unregister(
                        reg_key, live.incarnation, "subscribe_failed", undone if undone else version)))
            except ShardUnavailable:
                continue
        await asyncio.gather(*(self.node.bounded(f, -1) for f in futs), return_exceptions=True)

    async def unsubscribe(self, live: LiveSession, flt: str) -> bool:
        fut = self.node.propose(live.shard, c.SessionUnsubscribe(live.client_id, live.epoch, flt))
        assert fut is not None
        version = await self.node.bounded(fut, live.shard)
        if version is None:
            raise NodeFailure("session taken over")
        if not version:
            return False
        reg_key, inner, group = reg_key_for(live.client_id, flt)
        futs = []
        for shard in self.node.shards_for_filter(inner):
            if group is not None:
                futs.append(self.node.propose_cross(shard, c.ShareMember(reg_key, live.client_id, False, live.incarnation)))
                continue
            reg = registration(self.node.hosts[shard].state.topics, reg_key)
            cursor = live.cursor.get(shard, -1)
            if reg is not None:
                # Not yet delivered: no longer wanted. In flight: finished first (acked as usual).
                unwanted = tuple(owed_after(reg, cursor))
                if unwanted:
                    futs.append(self.node.propose_cross(shard, c.AckReport(reg_key, unwanted)))
            futs.append(self.node.propose_cross(shard, c.Unregister(reg_key, live.incarnation, "unsubscribe", version)))
        await asyncio.gather(*futs)
        return True
