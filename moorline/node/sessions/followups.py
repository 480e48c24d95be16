"""Follow-ups derived from replicated state (issue 29 item 3): each housekeeping round, the leader
of a topic shard looks at the shard's registrations next to its own replica of their sessions'
shards and proposes what a crash (or a lost proposal) left undone:

- ack reports: offsets a registration still owes although its session committed their
  acknowledgement (delivered at or below the session's cursor for the shard and no longer in
  flight, or a ``$share`` member's ``share_done``), because the ``AckReport`` that should have
  followed the ``SessionAcks`` was lost (its proposer crashed, or the proposal failed). They are
  reported again: ``AckReport`` is idempotent at apply (an offset no longer owed is skipped; a
  registration replaced since starts past every offset the old one owed).
- ghost registrations: a plain registration no subscription of its session stands behind (a
  SUBSCRIBE undone, an UNSUBSCRIBE or a session's end whose ``Unregister`` never reached the
  shard) is unregistered, so it stops collecting messages.
- wills owed: a will the session shard handed out as due (``SessionHousekeeping``, or a takeover's
  ``OpenResult.replaced_will``) stays in its state (``SessionState.wills_owed``) until a
  ``WillPublished`` says its topic's shard applied it. The leader of the session shard publishes
  an owed will again (its proposer crashed, its publish was refused for room or its outcome lost);
  the will's GUID makes any publication after the first a duplicate the topic shard recognises.

Nothing here is remembered by the node that started the work: any node that becomes a shard's
leader finds the same candidates in its replicas. What the leader keeps in memory is only a
de-bouncing filter (a candidate is acted on when seen in two consecutive rounds, so acks and
unsubscribes on their way are not reported or undone twice); a new leader needs two rounds.

A replica of the session's shard that lags is safe for both: a lagging cursor reports fewer
acks, never an unacknowledged offset (acknowledgements are never undone within an incarnation),
and a ghost is declared only when the replica has applied the registration's creation: the shard's
incarnation counter has reached the registration's incarnation and, for the same incarnation, the
session's subscription version has reached the registration's. An ``Unregister`` carries the
registration's incarnation and version, so one that a re-SUBSCRIBE overtook is ignored at apply.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.session_state import LEASE_LAPSE_GRACE_MS, OwedWill, Session
from moorline.broker.topic_state import Registration, same_incarnation
from moorline.node.errors import ShardUnavailable
from moorline.node.replication.shard_host import ShardHost
from moorline.raft import ProposalDropped

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")
LOG_NAMES = 5  # registrations a follow-up's log line names (one line per shard and round)


class FollowUps:
    """The follow-ups of the shards this node leads (``Housekeeping.run`` calls ``run``)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        # /metrics: moorline_followup_acks_resent_total, moorline_followup_ghosts_unregistered_total
        self.acks_resent = 0  # offsets reported again
        self.ghosts_unregistered = 0  # Unregister proposals for ghost registrations
        self.wills_republished = 0  # owed wills published again
        # Per shard, the candidates found in the previous round (de-bouncing only; see above).
        self._acks_seen: dict[int, dict[tuple[str, int], None]] = {}
        self._ghosts_seen: dict[int, dict[tuple[str, int, int], None]] = {}
        self._wills_seen: dict[int, dict[tuple[str, int, int], None]] = {}
        # Owed wills this node is publishing again right now (one publication at a time each).
        self._wills_publishing: dict[tuple[str, int, int], None] = {}

    def run(self, host: ShardHost) -> None:
        """One round for a shard this node leads."""
        limit = self.node.cfg.shard.followups_max_per_round
        if limit <= 0:
            return
        self._resend_acks(host, limit)
        self._unregister_ghosts(host, limit)
        self._publish_owed_wills(host, limit)

    def forget(self, shard: int) -> None:
        """Not the shard's leader (any more): its candidates start over."""
        self._acks_seen.pop(shard, None)
        self._ghosts_seen.pop(shard, None)
        self._wills_seen.pop(shard, None)

    # --- helpers ---------------------------------------------------------------------------------
    def _session(self, client_id: str) -> tuple[ShardHost, Session | None] | None:
        """The session's shard replica and the session in it; None when that shard failed."""
        shost = self.node.hosts[self.node.session_shard(client_id)]
        if shost.failed is not None or not shost.knows_session(client_id):
            # Failed, or a partial state fed by another node's replica (reader.py) that does not
            # follow this client (yet): it cannot tell a ghost from another node's session.
            return None
        return shost, shost.state.sessions.sessions.get(client_id)

    # --- ack reports -----------------------------------------------------------------------------
    def _ack_candidates(self, host: ShardHost, limit: int) -> dict[str, list[int]]:
        """Registration -> offsets it owes that its session(s) committed as acknowledged."""
        shard = host.shard
        found: dict[str, list[int]] = {}
        n = 0
        inflight_of: dict[str, set[int]] = {}  # client id -> offsets of this shard in flight to it
        share_done_of: dict[str, dict[str, list[int]]] = {}  # client id -> $share registration -> offsets
        for rk, reg in host.state.topics.regs.items():
            if n >= limit:
                break
            if not reg.owed:
                continue
            offsets: list[int] = []
            if reg.share_group is None:
                offsets = self._plain_done(shard, rk, reg, inflight_of)
            else:
                for member, inc in reg.members.items():
                    got = self._session(member)
                    sess = got[1] if got is not None else None
                    if sess is None or not same_incarnation(inc, sess.incarnation):
                        continue
                    done = share_done_of.get(member)
                    if done is None:
                        done = share_done_of[member] = {}
                        for s, key, off in sess.share_done:
                            if s == shard:
                                done.setdefault(key, []).append(off)
                    offsets.extend(o for o in done.get(rk, ()) if o in reg.owed)
            if offsets:
                offsets = offsets[: limit - n]
                found[rk] = offsets
                n += len(offsets)
        return found

    def _plain_done(self, shard: int, rk: str, reg: Registration, inflight_of: dict[str, set[int]]) -> list[int]:
        """Offsets a plain registration (draining too) owes at or below its session's cursor for
        this shard and not in flight: delivered and acknowledged (or QoS 0), in the session's shard."""
        got = self._session(reg.client_id)
        sess = got[1] if got is not None else None
        if sess is None or sess.incarnation != reg.session_inc:
            return []
        cursor = sess.last_delivered.get(shard, -1)
        if cursor < 0 or next(iter(reg.owed)) > cursor:
            return []
        inflight = inflight_of.get(reg.client_id)
        if inflight is None:
            inflight = inflight_of[reg.client_id] = {d.item.offset for d in sess.inflight.values() if d.item.shard == shard}
        done: list[int] = []
        for o in reg.owed:  # ascending
            if o > cursor:
                break
            if o not in inflight:
                done.append(o)
        return done

    def _resend_acks(self, host: ShardHost, limit: int) -> None:
        shard = host.shard
        found = self._ack_candidates(host, limit)
        seen = self._acks_seen.get(shard, {})
        now_seen: dict[tuple[str, int], None] = {}
        acted: list[str] = []
        before = self.acks_resent
        for rk, offsets in found.items():
            again: list[int] = []
            for o in offsets:
                now_seen[(rk, o)] = None
                if (rk, o) in seen:
                    again.append(o)
            if not again:
                continue
            try:
                self.node.propose_lazy(shard, c.AckReport(rk, tuple(again)))
            except (ShardUnavailable, ProposalDropped) as exc:
                log.warning("shard %d: ack report follow-up deferred: %s", shard, exc)
                break
            self.acks_resent += len(again)
            coverage.hit("followup_ack_resent")
            acted.append(rk)
        self._acks_seen[shard] = now_seen
        if acted:
            log.info("shard %d: reported %d acknowledged offset(s) of %d registration(s) again, their ack "
                     "reports lost (%s)", shard, self.acks_resent - before, len(acted), _names(acted))

    # --- ghost registrations ---------------------------------------------------------------------
    def _ghost_reason(self, rk: str, reg: Registration) -> str | None:
        """Why a plain registration is a ghost ("session_expired": its incarnation is gone;
        "subscribe_failed": the incarnation has no such subscription), or None when it is not one
        or this node's replica of the session's shard cannot tell yet."""
        got = self._session(reg.client_id)
        if got is None:
            return None  # the session's shard failed here: its subscriptions are unknown
        shost, sess = got
        if shost.state.sessions.incarnations < reg.session_inc:
            return None  # the replica has not applied the open of the registration's incarnation
        if sess is None:
            return "session_expired"
        if sess.incarnation > reg.session_inc:
            # A clean start replaced it: the node that opened the new incarnation ends the old one
            # (its registrations) once the previous owner released it or its lease ran out.
            prev = sess.prev_lease
            if prev is not None and self.node.now_ms() <= prev[2] + LEASE_LAPSE_GRACE_MS:
                return None
            return "session_expired"
        if sess.incarnation < reg.session_inc:
            return None
        if reg.sub_version < 0 or sess.sub_version < reg.sub_version:
            return None  # the replica has not applied the SUBSCRIBE behind this Register (or unversioned)
        if rk.partition("\0")[2] in sess.subs:
            return None
        return "subscribe_failed"

    def _unregister_ghosts(self, host: ShardHost, limit: int) -> None:
        shard = host.shard
        seen = self._ghosts_seen.get(shard, {})
        now_seen: dict[tuple[str, int, int], None] = {}
        acted: list[str] = []
        for rk, reg in list(host.state.topics.regs.items()):
            if len(now_seen) >= limit:
                break
            if reg.share_group is not None or reg.draining:
                continue  # draining: unsubscribed, finishing what is in flight
            reason = self._ghost_reason(rk, reg)
            if reason is None:
                continue
            key = (rk, reg.session_inc, reg.sub_version)
            now_seen[key] = None
            if key not in seen:
                continue
            try:
                self.node.propose_lazy(shard, c.Unregister(rk, reg.session_inc, reason, reg.sub_version))
            except (ShardUnavailable, ProposalDropped) as exc:
                log.warning("shard %d: ghost registration follow-up deferred: %s", shard, exc)
                break
            coverage.hit("followup_ghost_unregistered")
            acted.append(f"{_names([rk])} ({reason}, incarnation {reg.session_inc})")
        self.ghosts_unregistered += len(acted)
        self._ghosts_seen[shard] = now_seen
        if acted:
            log.info("shard %d: unregistered %d registration(s) no subscription stands behind: %s%s", shard,
                     len(acted), ", ".join(acted[:LOG_NAMES]), ", ..." if len(acted) > LOG_NAMES else "")


    # --- wills owed ----------------------------------------------------------------------------
    def _publish_owed_wills(self, host: ShardHost, limit: int) -> None:
        """Owed wills seen in the previous round too (a publication under way has had a round to
        reach its ``WillPublished``) are published again, at most ``limit`` per round."""
        shard = host.shard
        seen = self._wills_seen.get(shard, {})
        now_seen: dict[tuple[str, int, int], None] = {}
        started: list[str] = []
        for key, owed in host.state.sessions.wills_owed.items():
            if len(now_seen) >= limit:
                break
            now_seen[key] = None
            if key not in seen or key in self._wills_publishing:
                continue
            self._wills_publishing[key] = None
            task = asyncio.get_running_loop().create_task(self._publish_again(key, owed))
            self.node.run_in_background(task)
            self.wills_republished += 1
            coverage.hit("followup_will_republished")
            started.append(owed.client_id)
        self._wills_seen[shard] = now_seen
        if started:
            log.info("shard %d: publishing %d owed will(s) again: %s", shard, len(started),
                     ", ".join(repr(n) for n in started[:LOG_NAMES]) + (", ..." if len(started) > LOG_NAMES else ""))

    async def _publish_again(self, key: tuple[str, int, int], owed: OwedWill) -> None:
        try:
            await self.node.lifecycle.publish_owed_will(owed)
        finally:
            self._wills_publishing.pop(key, None)


def _names(keys: list[str]) -> str:
    """Registration keys for a log line (client id and filter), the first few."""
    shown = ", ".join(repr(k.replace("\0", " ")) for k in keys[:LOG_NAMES])
    return shown + (", ..." if len(keys) > LOG_NAMES else "")
