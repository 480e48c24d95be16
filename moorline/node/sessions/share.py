"""$share groups on the shard's leader: dispatch (claims committed before they are pushed),
dead letters, single-active hand-over (docs/queues.md), and the claims of members' ended sessions
returned (``return_ended``). Ack timeouts are judged on the node the member is connected to:
sessions/ack_timeout.py."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.queries import (
    claims_of,
    owed_count,
    owed_offsets,
    registration,
    registration_keys,
    session_of,
)
from moorline.broker.session_state import LEASE_LAPSE_GRACE_MS
from moorline.broker.share_policy import dead_letter_message
from moorline.broker.topic_state import Registration, same_incarnation
from moorline.hashing import shard_of
from moorline.node.errors import ShardUnavailable
from moorline.node.replication.proposer import consume_outcome
from moorline.node.replication.shard_host import ShardHost
from moorline.raft import ProposalDropped
from moorline.testing.volatile_dlq import VolatileDeliveryCounts

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")


class ShareDispatch:
    """The $share dispatcher and its timers."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._pending: set[tuple[int, str]] = set()
        self._rr: dict[str, int] = {}  # $share registration -> next member (pruned: prune_rr)
        self._activating: set[tuple[str, str]] = set()  # (group, active member) a ShareActivate is pending for
        self._dlq_pending: set[tuple[int, str, int]] = set()  # (shard, group, offset) being dead-lettered
        self.dead_lettered = 0  # messages this node moved to a dead-letter topic
        # The broken build Faults.dlq_count_not_replicated (tests only): leader-memory hand-out counts.
        self._volatile = VolatileDeliveryCounts() if node.faults.dlq_count_not_replicated else None
        self._rounds = 0
        # return_ended: per shard, the (group, member, incarnation) found ended in the previous
        # round (de-bouncing only, as in sessions/followups.py); claims and leaves proposed so far.
        self._ended_seen: dict[int, dict[tuple[str, str, int], None]] = {}
        self.ended_returned = 0

    def schedule_dispatch(self, shard: int, reg_key: str) -> None:
        key = (shard, reg_key)
        if key in self._pending:
            return
        self._pending.add(key)
        asyncio.get_running_loop().call_soon(self.dispatch, shard, reg_key)

    def dispatch(self, shard: int, reg_key: str) -> None:
        """The $share dispatcher for (shard, group): claims are committed before they are pushed."""
        self._pending.discard((shard, reg_key))
        host = self.node.hosts[shard]
        if not host.raft.is_leader:
            return  # a group's dispatcher runs on the shard's leader
        reg = registration(host.state.topics, reg_key)
        if reg is None:
            return
        q = reg.queue  # the group's work-queue policy and state (docs/queues.md), if any
        dead = q.dead if q is not None else {}
        if dead:
            self._dead_letter(host, reg_key)
        if not reg.members:
            return
        claims = claims_of(reg)
        unclaimed = [o for o in owed_offsets(reg) if o not in claims and o not in dead]
        if self._volatile is not None and unclaimed:  # the broken build (tests only)
            unclaimed = self._volatile.to_claim(self.node, host, reg_key, reg, unclaimed)
        if not unclaimed:
            return
        # Members connected anywhere in the cluster, as their session shards record it: the leader
        # of this shard is often not the node a member is connected to. A member connected here
        # has the room its window has; one elsewhere gets the claims its receive window could
        # hold, less those it has not acknowledged yet (its node delivers what is claimed). Only
        # the incarnation that joined is a member: a client id reconnected as a new session that
        # has not joined (or whose old session's leave is still to apply) is given nothing.
        members = reg.members
        online = [m for m, inc in members.items() if self.node.registry.member_connected(m, inc)]
        if not online:
            return
        if q is not None and q.single_active:
            # One member receives: the active one (replicated). Offline, and nothing held by anyone
            # (what it holds comes back when its session ends, an ended incarnation's through the
            # follow-ups), it hands over to the first member online in join order; the apply
            # re-checks both and re-runs this dispatcher.
            active = q.active
            if active not in online:
                if online[0] != active and (reg_key, active) not in self._activating and not claims_of(reg):
                    self._activating.add((reg_key, active))
                    coverage.hit("share_single_active_handover")
                    try:
                        fut = self.node.propose(shard, c.ShareActivate(reg_key, online[0], active))
                    except ShardUnavailable:  # refused (e.g. raft.max_pending_proposals): the next dispatch asks again
                        fut = None
                    if fut is not None:
                        def activated(f: asyncio.Future[Any], key: tuple[str, str] = (reg_key, active)) -> None:
                            consume_outcome(f)  # nobody awaits it: an error (outcome unknown) is retried
                            self._activating.discard(key)

                        fut.add_done_callback(activated)
                    else:
                        self._activating.discard((reg_key, active))
                return
            online = [active]
        outstanding: dict[str, int] = {}
        for member, inc in claims_of(reg).values():
            if members.get(member) == inc:
                outstanding[member] = outstanding.get(member, 0) + 1
        window = self.node.cfg.mqtt.receive_maximum
        room = {}
        for m in online:
            live = self.node.live.get(m)
            if live is not None and same_incarnation(live.incarnation, members[m]):
                room[m] = max(0, live.room())
            else:
                room[m] = max(0, window - outstanding.get(m, 0))
        # A single-active group has one member to give to: its commit order is every topic's order.
        sticky = self.node.cfg.share.dispatch == "sticky_topic" and not (q is not None and q.single_active)
        order = list(members)
        assigned: dict[str, list[int]] = {}
        rr = self._rr.get(reg_key, 0)
        declined = reg.declined  # offset -> members whose read ACL refused it: offered to the others
        timed_out = q.timed_out if q is not None else None  # offset -> the member it was taken back from
        for offset in unclaimed:
            refused = declined.get(offset) if declined else None
            avoid = timed_out.get(offset) if timed_out else None
            if sticky:
                meta = host.state.topics.meta.get(offset)
                topic = meta.topic if meta is not None else ""
                able = [m for m in order if m not in refused] if refused else order
                if not able:
                    continue
                member = able[shard_of(topic, len(able))]
                if member not in room or room[member] <= 0:
                    continue
            else:
                member = ""
                for _ in range(len(online)):
                    cand = online[rr % len(online)]
                    rr += 1
                    if room[cand] > 0 and not (refused and cand in refused) and cand != avoid:
                        member = cand
                        break
                if not member and avoid and room.get(avoid, 0) > 0 and not (refused and avoid in refused):
                    member = avoid  # the only member with room: back to the one it timed out with
                if not member:
                    if refused:
                        continue  # no online member with room that has not declined it: the next offset
                    break  # no room anywhere
            room[member] -= 1
            assigned.setdefault(member, []).append(offset)
        self._rr[reg_key] = rr
        if self._volatile is not None:  # the broken build (tests only)
            self._volatile.claimed(shard, reg_key, assigned)
        now = self.node.now_ms() if q is not None and q.ack_timeout_ms > 0 else 0
        for member, offsets in assigned.items():
            self.node.propose(shard, c.ShareClaim(reg_key, member, tuple(offsets), members[member], now), want=False)

    def _dead_letter(self, host: ShardHost, reg_key: str) -> None:
        """Messages of a $share group past its delivery limit (``reg.queue.dead``, replicated): each is
        published to the dead-letter topic under a GUID derived from (group, shard, offset), then
        ShareDeadLettered releases it from the group. A leader change in between publishes it
        again, a duplicate the GUID history refuses: it appears once."""
        reg = registration(host.state.topics, reg_key)
        if reg is None or reg.share_group is None or reg.queue is None or not host.raft.is_leader:
            return
        shard = host.shard
        todo = [(o, n, last) for o, (n, last) in reg.queue.dead.items() if (shard, reg_key, o) not in self._dlq_pending]
        if not todo:
            return
        now = self.node.now_ms()
        msgs: list[tuple[int, StoredMessage]] = []
        for offset, n, last in todo:
            msg = host.message(offset)
            if msg is None:
                continue  # the shard failed, or not readable here now: tried again next round
            msgs.append((offset, dead_letter_message(self.node.cfg.queue.dead_letter_topic, reg.share_group, reg.filter,
                                                     shard, offset, msg, n, last, now)))
            self._dlq_pending.add((shard, reg_key, offset))
        if msgs:
            task = asyncio.get_running_loop().create_task(self.publish_dead_letters(shard, reg_key, msgs))
            self.node.run_in_background(task)

    async def publish_dead_letters(self, shard: int, reg_key: str, msgs: list[tuple[int, StoredMessage]]) -> None:
        """Publishes each (offset, dead-letter copy), then releases those published from the group."""
        try:
            done: list[int] = []
            for offset, msg in msgs:
                fut = self.node.propose(self.node.topic_shard(msg.topic), c.Publish(msg))
                assert fut is not None
                res = await self.node.bounded(fut, -1)
                if res.status in ("ok", "duplicate"):
                    done.append(offset)
                else:
                    log.warning("$share dead letter of shard %d offset %d refused: %s", shard, offset, res.reason)
            if done:
                fut = self.node.propose(shard, c.ShareDeadLettered(reg_key, tuple(done)))
                assert fut is not None
                moved = await self.node.bounded(fut, shard)
                self.dead_lettered += len(moved)
        finally:
            for offset, _ in msgs:
                self._dlq_pending.discard((shard, reg_key, offset))

    def timers(self, host: ShardHost, now: int) -> None:
        """On the shard's leader, each housekeeping round: dead letters not yet published are tried
        again, and groups with unclaimed messages and a member online are dispatched. (Ack
        timeouts are judged where the member is connected: sessions/ack_timeout.py.)"""
        topics = host.state.topics
        self.return_ended(host)
        for reg_key in list(topics.share_keys):
            reg = registration(topics, reg_key)
            if reg is None or reg.share_group is None:
                continue
            q = reg.queue
            if q is not None and q.dead:
                self._dead_letter(host, reg_key)
            if (owed_count(reg) > len(claims_of(reg)) + (len(q.dead) if q is not None else 0)
                    and any(self.node.registry.member_connected(m, inc) for m, inc in reg.members.items())):
                # A safety net: a member's connection applied in its session shard's replica here
                # after the group's last change (nothing else would dispatch to it until the next).
                self.schedule_dispatch(host.shard, reg_key)

    def return_ended(self, host: ShardHost) -> None:
        """On the shard's leader, each housekeeping round: claims held for a member's session
        incarnation that has ended, and its membership, go back to the group (``ShareReturn``, then
        ``ShareMember`` leave), as ``SessionLifecycle.end_session`` does when the session ends.
        That end can be cut short (its proposals refused for room, raft.max_pending_proposals, or
        its node crashed right after the open that replaced the session committed), and nothing
        else returns the claims: the messages stay claimed for nobody forever, and a single-active
        group then has two holders once its next member claims (sim --cluster seed 30722).

        Derived from this node's replicas only, like sessions/followups.py: an incarnation is
        ended when its session shard's replica here has applied its open (the shard's incarnation
        counter reached it) and the client id's session is gone or a later incarnation, and not
        while a takeover may still wait for the old owner's lease. Acted on when seen in two
        consecutive rounds (a normal end's proposals on their way land first). Which claims were
        sent at QoS 2 is gone with the session's delivery log, and so is the member's subscription
        QoS, so every claim of a QoS 2 message is dropped (counted, as an unreceived one is): never
        sent to another member (MQTT-4.8.2-5). Both commands are idempotent at apply."""
        limit = self.node.cfg.shard.followups_max_per_round
        if limit <= 0:
            return
        shard = host.shard
        topics = host.state.topics
        seen = self._ended_seen.get(shard, {})
        now_seen: dict[tuple[str, str, int], None] = {}
        ended: dict[tuple[str, int], bool] = {}  # (member, incarnation) -> ended, per round
        for reg_key in list(topics.share_keys):
            if len(now_seen) >= limit:
                break
            reg = registration(topics, reg_key)
            if reg is None or reg.share_group is None:
                continue
            held: dict[tuple[str, int], list[int]] = {}
            for offset, holder in claims_of(reg).items():
                held.setdefault(holder, []).append(offset)
            candidates = list(held) + [(m, inc) for m, inc in reg.members.items() if (m, inc) not in held]
            for member, inc in candidates:
                gone = ended.get((member, inc))
                if gone is None:
                    gone = ended[(member, inc)] = self._incarnation_ended(member, inc)
                if not gone:
                    continue
                key = (reg_key, member, inc)
                now_seen[key] = None
                if key not in seen:
                    continue
                try:
                    self._return(host, reg_key, reg, member, inc, held.get((member, inc), []))
                except (ShardUnavailable, ProposalDropped) as exc:
                    log.warning("shard %d: claims of %r's ended session not returned yet: %s", shard, member, exc)
                    self._ended_seen[shard] = now_seen
                    return
        self._ended_seen[shard] = now_seen

    def _return(self, host: ShardHost, reg_key: str, reg: Registration, member: str, inc: int,
                offsets: list[int]) -> None:
        shard = host.shard
        if offsets:
            # A QoS 2 message may have gone at QoS 2 whatever ``reg.qos`` says: that is the QoS of
            # the group's last Register (any member's), and each member receives at its own
            # subscription's QoS (sim --cluster seed 50085).
            meta = host.state.topics.meta
            dropped = tuple(o for o in offsets if (m := meta.get(o)) is not None and m.qos >= 2)
            self.node.propose(shard, c.ShareReturn(reg_key, member, dropped, inc), want=False)
        if reg.members.get(member) == inc:
            self.node.propose(shard, c.ShareMember(reg_key, member, False, inc), want=False)
        self.ended_returned += 1
        coverage.hit("share_ended_claims_returned")
        log.info("shard %d: %d claim(s) of %r's ended session (incarnation %d) returned to $share group %r",
                 shard, len(offsets), member, inc, reg.share_group)

    def _incarnation_ended(self, client_id: str, inc: int) -> bool:
        """Whether the session incarnation ``inc`` of ``client_id`` has ended, as this node's
        replica of its session shard knows (False when it cannot tell)."""
        if inc < 0:
            return False  # LEGACY_INC: any incarnation
        shost = self.node.hosts[self.node.session_shard(client_id)]
        if shost.failed is not None or not shost.knows_session(client_id):
            return False  # (a partial state that does not follow the client cannot tell)
        sessions = shost.state.sessions
        if sessions.incarnations < inc:
            return False  # the replica has not applied that incarnation's open yet
        sess = session_of(sessions, client_id)
        if sess is None:
            return True
        if sess.incarnation <= inc:
            return False
        prev = sess.prev_lease  # a takeover: the old owner may serve the old incarnation until then
        return prev is None or self.node.now_ms() > prev[2] + LEASE_LAPSE_GRACE_MS

    def on_ack_room(self, client_id: str) -> None:
        """A member freed window room: its share groups may dispatch again."""
        live = self.node.live.get(client_id)
        if live is None:
            return
        sess = live.session()
        if sess is None:
            return
        for shard, reg_key in self.node.registry.session_views(sess).shares:
            self.schedule_dispatch(shard, reg_key)

    def prune_rr(self) -> None:
        """Round-robin positions of $share groups that no longer exist here go (one entry per group
        ever seen otherwise: a client creating groups would grow it without bound)."""
        self._rounds += 1
        if not self._rr or self._rounds % 60:
            return  # every 60th round: a scan of every registration is not for every second
        live_keys = {k for h in self.node.hosts for k in registration_keys(h.state.topics) if self.node.is_share_key(k)}
        for key in [k for k in self._rr if k not in live_keys]:
            del self._rr[key]
