"""Session lifecycle: open (with the takeover wait), close, end; owner leases renewed and
enforced; after a restart, sessions and registrations reconciled; wills and expiry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.messages import MessageProps, StoredMessage
from moorline.broker.session_state import SENT, OwedWill, Session
from moorline.hashing import guid128
from moorline.node.errors import NodeFailure, SessionOwnedByOther, SessionQuotaExceeded, ShardUnavailable
from moorline.node.replication.shard_host import ShardHost
from moorline.node.sessions.delivery import LiveSession
from moorline.node.sessions.subscriptions import reg_key_for
from moorline.raft import ProposalDropped

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")
LEASE_POLL_S = 0.05  # a takeover looks for the previous owner's release this often
LEASE_CHECK_MARGIN_S = 1.0  # a client is closed this long before its lease would end unrenewed


class SessionLifecycle:
    """Open / close / end of sessions, owner leases, reconciliation after a restart."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._lease_deadline = node.registry.lease_deadline  # the registry's: (client id, epoch) -> deadline
        # Opens committed but not served yet (client id, epoch): waiting for the previous owner's
        # release or lease, or ending the incarnation they replaced. Their leases are renewed like
        # those of live sessions (a wait can take most of a lease).
        self._opening: dict[tuple[str, int], None] = {}
        # Session closes not finished yet (committed SessionClose, then the will or the session's
        # end): a stop waits for them (bounded), not for every task (edge/server.py).
        self._closing: dict[asyncio.Task[None], None] = {}

    def on_results(self, host: ShardHost, cmds: list[c.Command], results: list[Any]) -> None:
        """A session opened elsewhere (another node, a newer epoch) ends this node's connection of
        it: 0x8E on 5.0 (the new owner already serves; this one's commands are stale)."""
        if self.node.link is None:
            return
        for cmd, res in zip(cmds, results, strict=False):
            if type(cmd) is c.SessionOpen and res is not None and not res.refused:
                self._taken_over(host, cmd.client_id, res.epoch, newer_only=False)

    def session_record_set(self, host: ShardHost, client_id: str, sess: Any) -> None:
        """A shard this node reads remotely (reader.py) set a client's session record, as its leader
        applied a SessionOpen: a newer epoch than the one this node serves is a takeover elsewhere,
        handled as ``on_results`` handles the open itself on a replica."""
        if sess is not None:
            self._taken_over(host, client_id, sess.epoch, newer_only=True)

    def _taken_over(self, host: ShardHost, client_id: str, epoch: int, newer_only: bool) -> None:
        """The session of ``client_id`` is at ``epoch`` now: this node's connection of it, at another
        epoch (an older one with ``newer_only``), ends (0x8E) and its lease goes."""
        conn = self.node.connections.get(client_id)
        live = getattr(conn, "live", None)
        if conn is None or live is None or live.epoch == epoch or (newer_only and live.epoch > epoch):
            return
        conn.disconnect(0x8E, "session taken over on another node")
        # Stopped serving it: the new owner need not wait for our lease to run out.
        self._lease_deadline.pop((client_id, live.epoch), None)
        self.node.propose(host.shard, c.LeaseRelease(client_id, live.epoch, self.node.member[0]), want=False)

    async def reconcile_after_restart(self) -> None:
        """Sessions that were connected when the node stopped are now disconnected (wills may
        fire); every subscription is registered again (idempotent) in case a crash cut that short.

        Single node only: in a cluster a session marked connected may be served by another node
        right now, and this node's replicas may lag; there the owner lease ends the sessions of a
        node that died (housekeeping), and lost ack reports and ghost registrations are followed up
        by each topic shard's leader from replicated state (sessions/followups.py, which also does
        so on a single node, every housekeeping round; this pass does it at once, at start, where
        no replica can lag and nothing is in flight)."""
        if self.node.link is not None:
            return
        now = self.node.now_ms()
        futs: list[Any] = []
        wanted: set[str] = set()  # plain registration keys some session's subscription stands behind
        for host in self.node.hosts:
            for sess in list(host.state.sessions.sessions.values()):
                wanted.update(reg_key_for(sess.client_id, flt)[0] for flt in sess.subs)
                if host.failed is not None:
                    continue
                for flt, sub in sess.subs.items():
                    self.node.subscriptions.register_everywhere(sess, flt, sub, want_retained=False, futs=futs)
                self._resend_ack_reports(sess)
                if sess.connected:
                    futs.append(self.node.propose(host.shard, c.SessionClose(now, sess.client_id, sess.epoch, True)))
        self._unregister_ghosts(wanted, futs)
        for f in futs:
            if f is not None:
                try:
                    result = await f
                except ShardUnavailable:
                    continue
                if isinstance(result, Session):
                    await self.end_session(result, "session_expired")

    def _unregister_ghosts(self, wanted: set[str], futs: list[Any]) -> None:
        """Plain registrations no subscription stands behind (a SUBSCRIBE undone, or a session
        ended, while the shard was unavailable) stop collecting messages. Those of sessions whose
        own shard is unavailable are kept: that session's subscriptions are unknown."""
        for host in self.node.hosts:
            if host.failed is not None:
                continue
            for rk, reg in list(host.state.topics.regs.items()):
                if reg.share_group is not None or reg.draining or rk in wanted:
                    continue  # draining: unsubscribed, finishing what is in flight
                if self.node.hosts[self.node.session_shard(reg.client_id)].failed is not None:
                    continue
                futs.append(self.node.propose(host.shard, c.Unregister(rk, reg.session_inc, "subscribe_failed")))

    def _resend_ack_reports(self, sess: Session) -> None:
        """Acks committed in the session's shard whose reports to topic shards a crash may have cut
        short are reported again (idempotent): delivered (at or below the cursor), not in flight."""
        by_reg: dict[tuple[int, str], list[int]] = {}
        for shard, rk, offset in sess.share_done:
            by_reg.setdefault((shard, rk), []).append(offset)
        inflight = {(d.item.shard, d.item.offset) for d in sess.inflight.values()}
        for shard, regs in self.node.session_regs(sess.client_id, sess):
            cursor = sess.last_delivered.get(shard, -1)
            topics = self.node.hosts[shard].state.topics
            for rk, _sub in regs:
                reg = topics.regs.get(rk)
                if reg is None or reg.share_group is not None or reg.session_inc != sess.incarnation:
                    continue
                done = [o for o in reg.owed if o <= cursor and (shard, o) not in inflight]
                if done:
                    by_reg.setdefault((shard, rk), []).extend(done)
        for (shard, rk), offsets in by_reg.items():
            self.node.propose_lazy(shard, c.AckReport(rk, tuple(offsets)))

    async def end_session(self, sess: Session, reason: str, live: LiveSession | None = None) -> None:
        """A session ended (clean start, expiry 0 disconnect, expiry): its registrations go, and
        its $share claims return to the group except unreceived QoS 2, which are dropped. An
        expiry-0 session's deliveries were logged only by its ``live`` driver, if any."""
        qos2_unreceived: dict[tuple[str, int], list[int]] = {}
        # $share deliveries the member finished (acknowledged: share_done) or received at QoS 2
        # (PUBREC'd) are done: reported as acknowledged before the claims go back, so none is
        # sent to another member (MQTT-4.8.2-5). The report from the member's own node may not
        # have reached the topic shard yet (another node may end the session).
        received: dict[tuple[str, int], list[int]] = {}
        for shard, rk, offset in sess.share_done:
            received.setdefault((rk, shard), []).append(offset)
        if live is not None and live.ephemeral:
            releasing = live.local_releasing
            unreceived = [it for seq, it in live.local_inflight.items() if seq not in releasing]
            pubrecd = [it for seq, it in live.local_inflight.items() if seq in releasing]
        else:
            unreceived = [d.item for d in sess.inflight.values() if d.state == SENT]
            pubrecd = [d.item for d in sess.inflight.values() if d.state != SENT]
        for it in unreceived:
            if it.offset >= 0 and it.qos == 2:
                for rk in it.reg_keys:
                    if self.node.is_share_key(rk):
                        qos2_unreceived.setdefault((rk, it.shard), []).append(it.offset)
        for it in pubrecd:
            if it.offset >= 0 and it.qos == 2:
                for rk in it.reg_keys:
                    if self.node.is_share_key(rk):
                        received.setdefault((rk, it.shard), []).append(it.offset)
        futs: list[asyncio.Future[Any]] = []
        try:
            for flt in sess.subs:
                reg_key, inner, group = reg_key_for(sess.client_id, flt)
                for shard in self.node.shards_for_filter(inner):
                    if self.node.hosts[shard].failed is not None:
                        continue  # unregistered when the shard is back (_unregister_ghosts)
                    if group is not None:
                        done = received.get((reg_key, shard))
                        if done:  # proposed first from this node: applied before the return
                            self.node.propose(shard, c.AckReport(reg_key, tuple(done)), want=False)
                        dropped = tuple(qos2_unreceived.get((reg_key, shard), ()))
                        inc = sess.incarnation
                        futs.append(self.node.propose_cross(shard, c.ShareReturn(reg_key, sess.client_id, dropped, inc)))
                        futs.append(self.node.propose_cross(shard, c.ShareMember(reg_key, sess.client_id, False, inc)))
                    else:
                        futs.append(self.node.propose_cross(shard, c.Unregister(reg_key, sess.incarnation, reason)))
        except BaseException:
            # A later proposal refused (raft.max_pending_proposals): the outcomes of those already
            # proposed are nobody's now; retrieved, so none is reported as never retrieved.
            for f in futs:
                f.add_done_callback(_retrieve)
            raise
        self.node.registry.views.pop(sess.client_id, None)
        # Every outcome retrieved (gather's first failure would leave the others' unretrieved),
        # then the first failure raised, as before.
        outcomes = await asyncio.gather(*futs, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def takeover_across_users(self) -> bool:
        auth = self.node.cfg.auth
        allowed = auth.session_takeover_across_users
        if allowed is not None:
            return allowed
        from moorline.node.edge.auth import identities_proven  # unset: on only where no identity is proven

        return not identities_proven(auth, self.node.cfg.tls.use_identity_as_username)

    def session_owned_by_other(self, client_id: str, principal: str) -> bool:
        """A cheap early answer, before a CONNECT disturbs anything; the session shard's apply of
        ``SessionOpen(owner_only=True)`` is the authority."""
        if self.takeover_across_users():
            return False
        owner = self.node.hosts[self.node.session_shard(client_id)].state.sessions.owner_of(client_id, self.node.now_ms())
        return owner is not None and owner != principal

    def persistent_quota_exceeded(self, client_id: str, principal: str, expiry_s: int) -> bool:
        """Whether a CONNECT of ``principal`` with this expiry would open one persistent session
        more than session.max_persistent_per_user, counted over this node's replica of every
        session shard (the whole cluster's, up to what has not reached this replica yet; each
        session shard enforces the bound exactly for itself at apply)."""
        cap = self.node.cfg.session.max_persistent_per_user
        if cap <= 0 or expiry_s <= 0 or not principal:
            return False
        now = self.node.now_ms()
        sessions = self.node.hosts[self.node.session_shard(client_id)].state.sessions
        sess = sessions.sessions.get(client_id)
        if sess is not None and sess.principal == principal and sess.expiry_s > 0 and sessions.owner_of(client_id, now):
            return False  # resumed (or replaced by a clean start): no session more
        return sum(h.state.sessions.persistent_of(principal) for h in self.node.hosts) >= cap

    async def open_session(
        self, client_id: str, clean_start: bool, expiry_s: int, will: c.WillSpec | None, principal: str
    ) -> tuple[bool, int, int]:
        """Raises SessionOwnedByOther when the session belongs to another principal, and
        SessionQuotaExceeded when it would be one persistent session too many for the principal,
        and ShardUnavailable when this node's clock is not within the bound (docs/design.md,
        "Leases and clocks"): its leases would not be safe."""
        link = self.node.link
        if link is not None and not self.node.faults.no_clock_bound and (off := link.clocks.out_of_bound()):
            raise ShardUnavailable(off)  # CONNACK server unavailable: the client tries another node
        await self.node.follow_client(client_id)  # the shards this node reads remotely serve it first
        shard = self.node.session_shard(client_id)
        lease_s = self.node.cfg.session.owner_lease_s
        proposed_at = self.node.clock.monotonic()
        cap = self.node.cfg.session.max_persistent_per_user if principal else 0
        fut = self.node.propose(shard, c.SessionOpen(self.node.now_ms(), client_id, clean_start, expiry_s, will, principal,
                                                not self.takeover_across_users(), self.node.member[0],
                                                int(lease_s * 1000), cap))
        assert fut is not None
        reason = "session_expired" if not clean_start else "clean_start"
        try:
            res = await self.node.bounded(fut, shard)
        except ShardUnavailable:
            # Outcome unknown: the open may still commit. If it does, nobody is served by it, but
            # the incarnation it replaced (clean start) must still end (its registrations and
            # $share memberships go), and the session it opened is handed back.
            fut.add_done_callback(lambda f: self._open_applied_unserved(client_id, f, reason))
            raise
        if res.refused:
            raise SessionQuotaExceeded(client_id) if res.over_quota else SessionOwnedByOther(client_id)
        # Our lease counts from when we proposed it, shortened by the clock-drift bound.
        self._lease_deadline[(client_id, res.epoch)] = proposed_at + lease_s * (1 - self.node.cfg.session.owner_lease_drift)
        key = (client_id, res.epoch)
        # Until it is served, the open's lease is renewed like a live session's (the wait for the
        # previous owner, the end of the incarnation it replaced, can take a while).
        self._opening[key] = None
        try:
            try:
                if res.wait_until_ms and not self.node.faults.no_owner_lease:  # the broken build serves at once
                    coverage.hit("takeover_waited")
                    await self._wait_for_previous_owner(client_id, res)
            finally:
                # Also when the wait failed (taken over again meanwhile): the incarnation this open
                # replaced is gone from the session shard whatever happens to this connection, and
                # nothing else would end it (a $share member whose claims never come back).
                self._publish_replaced_will(client_id, res)
                if res.ended is not None:
                    coverage.hit("session_replaced")
                    await self.end_session(res.ended, reason)
        finally:
            self._opening.pop(key, None)
        deadline = self._lease_deadline.get(key)
        if (deadline is None or self.node.clock.monotonic() >= deadline - LEASE_CHECK_MARGIN_S) and \
                not self.node.faults.no_owner_lease:
            # This node's own lease ran out (or nearly) before the session could be served, not
            # renewed meanwhile (the session shard unreachable, a long wait, this node paused):
            # the session shard may already have ended the session as a connection lost at the
            # lease's end, so a CONNACK now would serve a session that is gone (and could outlive
            # the lease, promise 5). Handed back; the client connects again.
            self.node.abandon_session(client_id, res.epoch)
            raise ShardUnavailable(f"session {client_id!r}: this node's lease on it ran out before it "
                                   "could be served")
        return res.session_present, res.epoch, res.incarnation

    def _publish_replaced_will(self, client_id: str, res: Any) -> None:
        """The will of the connection an open replaced, when due (session_state._replaced_will):
        the session shard handed it to this open alone. Published once the previous owner is done
        with that connection (after the takeover wait), without holding up the CONNACK."""
        if res.replaced_will is None:
            return
        inc, epoch, will = res.replaced_will
        task = asyncio.get_running_loop().create_task(self._publish_will_of(client_id, inc, epoch, will))
        self.node.run_in_background(task)

    def _open_applied_unserved(self, client_id: str, fut: asyncio.Future[Any], reason: str) -> None:
        """A SessionOpen whose caller gave up (outcome unknown) applied after all."""
        if fut.cancelled() or fut.exception() is not None:
            return
        res = fut.result()
        if res is None or res.refused or self.node.stopping.is_set():
            return
        self.node.abandon_session(client_id, res.epoch)
        self._publish_replaced_will(client_id, res)
        if res.ended is not None:
            task = asyncio.get_running_loop().create_task(self.end_session(res.ended, reason))
            self.node.run_in_background(task)

    async def _wait_for_previous_owner(self, client_id: str, res: Any) -> None:
        """A takeover from another node serves only once that node released the session (it ended
        its client's connection when it applied our open) or its lease has run out (a node cut off
        from the majority closes its clients before then): never two owners at once."""
        remaining_s = (res.wait_until_ms - res.ts_ms) / 1000 * (1 + self.node.cfg.session.owner_lease_drift)
        deadline = self.node.clock.monotonic() + remaining_s
        host = self.node.hosts[self.node.session_shard(client_id)]
        while self.node.clock.monotonic() < deadline:
            sess = host.state.sessions.sessions.get(client_id)
            if sess is None or sess.epoch != res.epoch:
                raise NodeFailure("session taken over again while waiting for the previous owner")
            if sess.prev_lease is None:
                return  # released
            await asyncio.sleep(LEASE_POLL_S)

    async def lease_loop(self) -> None:
        """Renews the leases of the sessions this node serves (every third of a lease, one
        committed SessionRenew per session shard) and closes any client whose lease this node
        could not renew in time: cut off from the session shard's majority, it must stop serving
        before another node may start."""
        lease_s = self.node.cfg.session.owner_lease_s
        margin = lease_s * (1 - self.node.cfg.session.owner_lease_drift)
        next_renew = 0.0
        while not self.node.stopping.is_set():
            await asyncio.sleep(LEASE_POLL_S * 10)
            now = self.node.clock.monotonic()
            if now >= next_renew:
                next_renew = now + lease_s / 3
                by_shard: dict[int, list[tuple[str, int]]] = {}
                for cid, live in self.node.live.items():
                    by_shard.setdefault(live.shard, []).append((cid, live.epoch))
                for cid, epoch in self._opening:  # waiting for the previous owner: their lease runs
                    by_shard.setdefault(self.node.session_shard(cid), []).append((cid, epoch))
                for shard, held in by_shard.items():
                    if self.node.hosts[shard].failed is not None:
                        continue
                    cmd = c.SessionRenew(self.node.now_ms(), self.node.member[0], int(lease_s * 1000), tuple(held))
                    try:
                        self.node.propose_cb(shard, cmd, self._renewed(tuple(held), now + margin))
                    except ShardUnavailable as exc:
                        # Not renewed this round (a long minority partition fills
                        # raft.max_pending_proposals): the deadlines below close the clients in
                        # time; the loop itself must go on, or nothing is ever closed again.
                        log.warning("shard %d: session leases not renewed: %s", shard, exc)
            for key, until in list(self._lease_deadline.items()):
                live_now = self.node.live.get(key[0])
                if (live_now is None or live_now.epoch != key[1]) and now > until and key not in self._opening:
                    del self._lease_deadline[key]  # a CONNECT that never became a live session
            for cid, live in list(self.node.live.items()):
                deadline = self._lease_deadline.get((cid, live.epoch))
                if deadline is not None and now >= deadline - LEASE_CHECK_MARGIN_S and not self.node.faults.no_owner_lease:
                    conn = self.node.connections.get(cid)
                    if conn is not None and getattr(conn, "live", None) is live:
                        log.warning("%s: session lease not renewed in time (session shard unreachable?): "
                                    "closing the connection", cid)
                        conn.disconnect(0x80, "session ownership lease lost")

    def _renewed(self, held: tuple[tuple[str, int], ...], deadline: float) -> Any:
        def done(result: Any, exc: BaseException | None) -> None:
            if exc is not None:
                return
            # Only the leases the session shard extended (SessionState.apply_renew): one it ended
            # or gave to another owner meanwhile keeps its old deadline, and the check in
            # lease_loop closes its client by then (it served on a lease nobody renewed).
            renewed = set(result) if isinstance(result, tuple) else set(held)
            for key in held:
                if key in renewed and key in self._lease_deadline:
                    self._lease_deadline[key] = max(self._lease_deadline[key], deadline)
        return done

    def abandon_session(self, client_id: str, epoch: int) -> None:
        """A session opened for a connection that closed before it was served: closed (no will),
        its lease released, so a CONNECT elsewhere need not wait for it."""
        self._lease_deadline.pop((client_id, epoch), None)
        self.node.propose(self.node.session_shard(client_id), c.SessionClose(self.node.now_ms(), client_id, epoch, False),
                     want=False)

    def close_session(self, live: LiveSession, send_will: bool, expiry_s: int | None,
                      on_outcome: Callable[[asyncio.Future[Any]], None] | None = None) -> asyncio.Task[None]:
        """Proposes the close at once (before any later CONNECT of the same client can be proposed,
        so the session shard sees them in the order they happened), then finishes asynchronously.
        ``on_outcome`` gets the proposal's future once the close is applied or has failed (a clean
        DISCONNECT waits for it: only a committed close discards the will)."""
        self._lease_deadline.pop((live.client_id, live.epoch), None)
        live.stop()  # pending acks are proposed first, in the same entry
        if self.node.live.get(live.client_id) is live:
            del self.node.live[live.client_id]
            self.node.registry.views.pop(live.client_id, None)
        fut = self.node.propose(live.shard, c.SessionClose(self.node.now_ms(), live.client_id, live.epoch, send_will, expiry_s))
        assert fut is not None
        if on_outcome is not None:
            fut.add_done_callback(on_outcome)
        task = asyncio.get_running_loop().create_task(self._finish_close(live, fut, send_will))
        self._closing[task] = None
        task.add_done_callback(self._close_done)
        return task

    def _close_done(self, task: asyncio.Task[None]) -> None:
        self._closing.pop(task, None)

    def unfinished_closes(self) -> list[asyncio.Task[None]]:
        """The session closes still under way, oldest first (a stop waits for them)."""
        return list(self._closing)

    async def _finish_close(self, live: LiveSession, fut: asyncio.Future[Any], send_will: bool) -> None:
        try:
            await live.close()
            ended = await fut
            if isinstance(ended, Session):
                await self.end_session(ended, "session_expired", live)
            elif send_will:
                await self.session_housekeeping(live.shard)
        finally:
            cid = live.client_id
            # Served here no more (no connection of it here, not even one being set up: a CONNECT
            # registers its connection before it opens the session): remote shards stop feeding it.
            if cid not in self.node.live and cid not in self.node.connections:
                self.node.unfollow_client(cid)

    async def session_housekeeping(self, shard: int) -> None:
        fut = self.node.propose(shard, c.SessionHousekeeping(self.node.now_ms()))
        assert fut is not None
        wills, ended = await fut
        for owed, _will in wills:  # named as of the entry that fired it (the session may have moved on)
            await self.publish_owed_will(owed)
        for sess in ended:
            await self.end_session(sess, "session_expired")

    async def publish_owed_will(self, owed: OwedWill) -> None:
        """An owed will published again (sessions/followups.py)."""
        await self._publish_will_of(owed.client_id, owed.incarnation, owed.epoch, owed.will)

    async def _publish_will_of(self, client_id: str, incarnation: int, epoch: int, will: c.WillSpec) -> None:
        """The will of ``client_id``'s connection of that incarnation and epoch (its GUID). The
        session shard owes it until a ``WillPublished`` applies (session_state.OwedWill): a publish
        that fails here (the topic shard unavailable, its proposals refused, the outcome unknown)
        is tried again by the session shard's leader (sessions/followups.py), a duplicate then."""
        coverage.hit("will_published")
        props = msgspec.msgpack.decode(will.props, type=MessageProps) if will.props else None
        msg = StoredMessage(
            will.topic, will.payload, will.qos, will.retain, guid128(client_id, incarnation, epoch, "will"),
            self.node.now_ms(), will.expiry_s, props, client_id,
        )
        try:
            await self.node.publish(msg, principal="")
            # Applied in the topic's shard (stored, a duplicate, or refused there for good).
            self.node.propose(self.node.session_shard(client_id), c.WillPublished(client_id, incarnation, epoch),
                              want=False)
        except (ShardUnavailable, ProposalDropped, NodeFailure) as exc:
            log.warning("%s: will not published yet (the session shard's leader tries again): %s", client_id, exc)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Marks a proposal's outcome retrieved (nobody waits for it any longer)."""
    if not fut.cancelled():
        fut.exception()
