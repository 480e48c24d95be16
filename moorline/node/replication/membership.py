"""The membership driver: the metadata group's member table put to work on a running node.

One supervised task per node (``MembershipDriver.run``), every ``DRIVE_INTERVAL_S``:

- it announces this node's addresses and zone to the member table when they differ from it;
- on the metadata group's leader, every ``cluster.reconcile_interval_s`` (±20 % jitter) and
  ``cluster.reconcile_after_event_s`` after a membership event, it runs the planner
  (``reconcile.plan``: shrink before grow, zone-aware placement) and records each planned change
  as a move (``MoveStart``): the member table holds at most one per shard, so an operator's manual
  change and the reconciler's never both run on one shard (the second is refused there);
- on every node, for each move of a shard this node leads, it proposes the configuration change
  to that shard's Raft group (one pending change per group: the core refuses a second), promoting
  a learner only within ``cluster.promote_lag_entries`` of the leader's log, and ends the move
  (``MoveEnd``) once the shard's applied configuration shows it; a move not done within
  ``cluster.move_timeout_s`` is given up by the metadata leader and planned again.

The operators' commands (forget, leave, add-replica, remove-replica, join admission) are methods
of the driver too, from its base class ``MembershipOps`` (membership_ops.py), called by the HTTP
routes (admin/cluster_admin_api.py); they go through the metadata group like the reconciler. The
views the planner plans from, and the status it shows, come from ``MembershipViews``
(membership_views.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from moorline.broker import commands as c
from moorline.broker.membership import GONE, MembershipState, Move
from moorline.config import ConfigError
from moorline.node.replication.cluster_spec import parse_hostport
from moorline.node.replication.membership_ops import MembershipOps
from moorline.node.replication.reconcile import (
    PlannedMove,
    PlanSettings,
    live_majority_after_removal,
    plan,
)
from moorline.node.replication.shard_host import ShardUnavailable
from moorline.raft.confchange import ConfChangeInvalid, apply_conf_change
from moorline.raft.types import ConfChange, ConfChangeType, ProposalDropped

log = logging.getLogger("moorline.membership")

DRIVE_INTERVAL_S = 0.2  # how often a node looks at the member table's moves and its own entry
JITTER = 0.2  # reconcile_interval_s varies by this fraction either way
ANNOUNCE_RETRY_S = 5.0
END_RETRY_S = 2.0
LEFT_MARKER = "left.json"  # in a data directory whose node left the cluster: it is never started again
KINDS = {"add_learner": ConfChangeType.ADD_LEARNER, "promote": ConfChangeType.PROMOTE,
         "remove": ConfChangeType.REMOVE}


def refuse_if_left(data_dir: Path) -> None:
    """A node that left its cluster is not started again on the same data directory."""
    marker = data_dir / LEFT_MARKER
    if marker.exists():
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            info = {}
        raise ConfigError(f"this data directory ({data_dir}) belongs to node {info.get('node', '?')}, which left "
                          f"cluster {info.get('cluster_id', '?')!r}: its replicas were handed to other nodes. To "
                          f"run a node again, start it on a new, empty data directory")


def in_conf(move: Move, voters: tuple[Any, ...], learners: tuple[Any, ...]) -> bool:
    """Whether a configuration already shows ``move`` done."""
    m = (move.node_id, move.storage_id)
    if move.kind == "promote":
        return m in voters
    if move.kind == "add_learner":
        return m in voters or m in learners
    return m not in voters and m not in learners


# A group this node's member was removed from (per the member table) and whose leader has sent it
# nothing for this long is left: its copy goes (shard.learners = "none").
LEFT_SILENCE_S = 5.0


class MembershipDriver(MembershipOps):
    """The views (``MembershipViews``) and the operators' commands (``MembershipOps``) are its base
    classes, in their own modules; this one drives: the task, moves, planning."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.cfg = node.cfg.cluster
        self.clock = node.clock
        self.rng = node.seams.rng()
        self.reconcile_runs = 0  # planner runs by this node as the metadata leader
        self.moves_started = 0  # moves its reconciler recorded
        self.changes_proposed = 0  # configuration changes this node proposed as a shard's leader
        self._next_run: float | None = None
        self._signature: tuple[Any, ...] | None = None
        self._down_since: dict[str, float] = {}
        self._announced_at = -1e9
        self._ended_at: dict[tuple[int, int], float] = {}
        self._proposed: dict[tuple[int, int], int] = {}  # (shard, move id) -> log index of our proposal
        self.left = False  # this node saw itself left in the member table (and asked itself to stop)
        self._fenced: set[str] = set()  # members this node's cluster link no longer talks to
        self._learn_refused: dict[tuple[str, int, str], None] = {}  # members the link refused to add
        self._bootstrap_preferred: list[Any] | None = None  # each shard's preferred leader at boot

    # --- the task ----------------------------------------------------------------------------
    async def run(self) -> None:
        while not self.node.stopping.is_set():
            await asyncio.sleep(DRIVE_INTERVAL_S)
            await self.step()

    def kick(self) -> None:
        """A membership event: reconcile soon (on the metadata leader)."""
        soon = self.clock.monotonic() + self.cfg.reconcile_after_event_s
        if self._next_run is None or soon < self._next_run:
            self._next_run = soon

    def _interval(self) -> float:
        return self.cfg.reconcile_interval_s * (1 + self.rng.uniform(-JITTER, JITTER))

    async def step(self) -> None:
        table = self.table
        if table is None or self.node.link is None:
            return
        now = self.clock.monotonic()
        signature = (tuple(sorted((m.name, m.state) for m in table.members.values())), table.next_move_id,
                     len(table.moves))
        if self._signature is not None and signature[0] != self._signature[0]:
            self.kick()  # a member's state changed (or a member came)
        elif self._signature is not None and len(table.moves) < self._signature[2]:
            self.kick()  # a move ended: the next change of that shard need not wait a whole interval
        self._signature = signature
        if self.node.link.on_join_request is None:
            self.node.link.on_join_request = self.on_join_request
        self._check_left(table)
        self._fence(table)
        self._learn_peers(table)
        self._prefer_leaders()
        await self._announce(table, now)
        self._drive_moves(table, now)
        self._leave_removed_groups(table)
        meta = self.node.meta_host
        if meta is None or not meta.raft.is_leader or meta.failed is not None:
            self._next_run = None
            return
        if self._next_run is None:
            self._next_run = now + min(self._interval(), self.cfg.reconcile_after_event_s + DRIVE_INTERVAL_S)
        if now >= self._next_run:
            self._next_run = now + self._interval()
            await self.reconcile(table, now)

    def _check_left(self, table: MembershipState) -> None:
        """Once the member table says this node (this storage) has left: mark the data directory so
        it is never started again, and stop as SIGTERM stops a node (drain, exit 0)."""
        link = self.node.link
        entry = table.members.get(link.spec.me)
        if self.left or entry is None or entry.state != "left" or entry.member_id != tuple(self.node.member):
            return
        self.left = True
        marker = {"node": link.spec.me, "cluster_id": self.node.cfg.cluster.cluster_id, "left_ms": entry.since_ms}
        (Path(self.node.cfg.data_dir) / LEFT_MARKER).write_text(json.dumps(marker))
        log.warning("this node has left the cluster (its replicas are on other nodes): stopping; its data directory "
                    "is marked and will not start again")
        if self.node.seams.cluster_network is None:  # a real process (a simulator's node is stopped by its world)
            os.kill(os.getpid(), signal.SIGTERM)

    def _fence(self, table: MembershipState) -> None:
        """A forgotten member (and a left one once it has stopped) is no peer any more: the link
        drops its connections and refuses its handshakes, so a forgotten node started again on its
        old data directory cannot disturb the groups it was removed from."""
        link = self.node.link
        pending = [m for m in table.members.values()
                   if m.state in GONE and m.name != link.spec.me and m.name not in self._fenced]
        if not pending:
            return
        live = self.live_names() if any(m.state == "left" for m in pending) else set()
        for m in pending:
            if m.state == "left" and m.name in live:
                continue  # it stops by itself once it has read that it left
            link.transport.remove_peer(m.name)
            self._fenced.add(m.name)
            log.info("cluster: %s is %s: no longer a peer of this node", m.name, m.state)

    def _learn_peers(self, table: MembershipState) -> None:
        """Every member the table knows with a cluster address becomes a peer of this node's link
        (a member admitted after this node started: its node id and address come from the table).
        Gone members are not (``_fence`` removed them)."""
        link = self.node.link
        for m in table.members.values():
            if m.state in GONE or not m.cluster or m.name == link.spec.me:
                continue
            known = link.spec.ids.get(m.name)
            if known is not None and known != m.node_id:
                link.forget_member(m.name)  # a forgotten node's name admitted again: a new member
                self._fenced.discard(m.name)
            elif known is not None or m.name in self._fenced:
                continue
            attempt = (m.name, m.node_id, m.cluster)
            if attempt in self._learn_refused:
                continue  # refused once with these details (logged then): not every step
            try:
                address = parse_hostport(m.cluster, f"member {m.name}'s cluster address")
            except ConfigError as exc:
                log.error("cluster: %s", exc)
                self._learn_refused[attempt] = None
                continue
            if link.learn_member(m.name, m.node_id, address):
                self.kick()
            else:
                self._learn_refused[attempt] = None

    def _leave_removed_groups(self, table: MembershipState) -> None:
        """shard.learners = "none": a group this node was removed from (the member table's last
        done move of its member there is a removal, and no move adds it back now) is read through
        a reader feed from then on, and this node's copy of it goes (boot.Startup.leave_group)."""
        if self.node.cfg.shard.learners != "none":
            return
        me = tuple(self.node.member)
        removed: dict[int, bool] = {}
        for mv in table.history:
            if mv.outcome == "done" and (mv.node_id, mv.storage_id) == me:
                removed[mv.shard] = mv.kind == "remove"
        now = self.clock.monotonic()
        for shard, gone in removed.items():
            if not gone or not 0 <= shard < len(self.node.hosts) or shard in table.moves:
                continue
            host = self.node.hosts[shard]
            if (host.reader is None or host.reader.active or host.failed is not None or host.raft.is_leader
                    or not host.can_drop_copy()):
                continue
            # Never a copy the group still counts on: the table may lag a re-add that already
            # happened, and a core just added may not hold its own addition yet (sim --cluster seed
            # 86). Dropped once no leader has sent it anything for a while: a removed node hears
            # nothing, a member hears every tick.
            if now - host.leader_heard_at < LEFT_SILENCE_S:
                continue
            self.node.startup.leave_group(host)

    def _prefer_leaders(self) -> None:
        """Once a node that joined votes somewhere, each shard's preferred leader (which the leader
        rebalancer moves leadership to, replication/leadership.py) is chosen again from its current
        voters, shard by shard: the voter preferred for fewest shards so far (ties: the bootstrap
        placement's choice, then by name), which spreads leaderships about evenly. It depends on the
        configurations only, so every node that sees the same ones prefers the same leaders (a
        leader never hands a shard to a node that would hand it on); before any join the bootstrap
        placement's choice stays untouched."""
        members = self._initial_members()
        if members is None:
            return
        initial = set(members)
        confs = [h.group_conf().voters for h in self.node.hosts]
        nodes = {v for voters in confs for v in voters}
        if not confs or any(not v for v in confs) or all(v in initial for v in nodes):
            return
        if self._bootstrap_preferred is None:
            self._bootstrap_preferred = list(self.node.preferred_leader)
        count: dict[Any, int] = {}
        for shard, voters in enumerate(confs):
            first = self._bootstrap_preferred[shard]
            pref = min(voters, key=lambda v: (count.get(v, 0), v != first, self.node.node_name(v[0])))
            count[pref] = count.get(pref, 0) + 1
            self.node.preferred_leader[shard] = pref

    async def _announce(self, table: MembershipState, now: float) -> None:
        link = self.node.link
        me = link.spec.me
        entry = table.members.get(me)
        if entry is None or entry.member_id != tuple(self.node.member) or entry.state in GONE:
            return  # not (or no longer) this storage's entry: nothing to announce
        cluster = "{}:{}".format(*link.spec.addresses[me])
        # (the bound address once the assembly has it: a configured port 0 is not where clients go)
        client = self.node.client_address or self.node.cfg.listeners.advertise or self.node.cfg.listeners.mqtt
        if (entry.cluster, entry.client, entry.zone) == (cluster, client, self.cfg.zone):
            return
        if now - self._announced_at < ANNOUNCE_RETRY_S:
            return
        self._announced_at = now
        info = c.MemberInfo(me, self.node.member[0], self.node.member[1], cluster, client, self.cfg.zone)
        try:
            why = await self.propose_meta(c.MemberAnnounce(info, self.node.now_ms()))
        except (TimeoutError, ShardUnavailable):
            return
        if why is not None:
            log.warning("the member table refused this node's announcement: %s", why)

    # --- shard leaders: proposing the changes ------------------------------------------------
    def _end(self, move: Move, outcome: str, now: float) -> None:
        key = (move.shard, move.id)
        if now - self._ended_at.get(key, -1e9) < END_RETRY_S:
            return
        self._ended_at[key] = now
        if len(self._ended_at) > 256:
            self._ended_at = {k: t for k, t in self._ended_at.items() if now - t < END_RETRY_S}
        try:
            self.node.propose(self.node.meta_group, c.MoveEnd(move.shard, move.id, outcome, self.node.now_ms()),
                              want=False)
        except ShardUnavailable:
            pass
        if outcome != "done":
            log.warning("shard %d: %s %s (move %d, %s) given up: %s", move.shard, move.kind, move.node, move.id,
                        move.origin, outcome)
        else:
            log.info("shard %d: %s %s done (move %d, %s)", move.shard, move.kind, move.node, move.id, move.origin)

    def _drive_moves(self, table: MembershipState, now: float) -> None:
        for shard, move in list(table.moves.items()):
            if not 0 <= shard < len(self.node.groups):
                continue
            host = self.node.groups[shard]
            raft = host.raft
            if host.failed is not None or not raft.is_leader:
                continue
            applied = raft.conf_state
            if in_conf(move, applied.voters, applied.learners):
                self._end(move, "done", now)
                continue
            if raft.active_conf_state != applied:
                continue  # a change in the log not applied yet (ours, or before ours): one at a time
            member = (move.node_id, move.storage_id)
            if move.kind == "remove" and member == tuple(self.node.member):
                self._hand_over(host)  # a leader cannot remove itself
                continue
            target = self.target_of(table, shard)
            if move.kind != "remove" and move.origin == "reconcile" and target is not None:
                # (the planner's count: voters that stay, i.e. not on gone or leaving nodes)
                keep = {m.member_id for m in table.members.values() if m.state not in GONE and m.state != "leaving"}
                if move.kind == "promote" and sum(v in keep for v in applied.voters) >= target:
                    self._end(move, "not needed: the shard is at its target", now)
                    continue
            if move.kind == "promote" and move.origin != "manual" and not self.node.faults.grow_before_shrink_on_forget:
                # Shrink before grow also for a growth planned before a voter's node was forgotten
                # (or left) and carried out after: ended, so the next round removes that voter first
                # (sim --cluster seed 50054 with joins: a rebalance's promote n4 of shard 1, planned
                # while n2 was still active, made n4 a fourth voter beside the forgotten n2).
                gone = {m.member_id for m in table.members.values() if m.state in GONE}
                if any(v in gone for v in applied.voters):
                    self._end(move, "not now: a voter on a gone node is removed first (shrink before grow)", now)
                    continue
            if move.kind == "promote":
                pr = raft.progress.get(member)
                if (pr is None or raft.log.last_index() - pr.match > self.cfg.promote_lag_entries) \
                        and not self.node.faults.promote_before_caught_up:
                    continue  # not caught up yet: promoted once it is (or given up after move_timeout_s)
            if move.kind == "remove" and member in applied.voters:
                live = {m for m in applied.voters if raft.is_active(m) or m == tuple(self.node.member)}
                if not live_majority_after_removal(applied.voters, member, live) and move.origin != "manual":
                    continue  # would leave no live majority: wait (forget refuses this up front)
            cc = ConfChange(KINDS[move.kind], member)
            try:
                apply_conf_change(raft.active_conf_state, cc)
            except ConfChangeInvalid as exc:
                self._end(move, f"refused by the shard: {exc}", now)
                continue
            try:
                index = raft.propose_conf_change(cc)
            except ProposalDropped as exc:
                log.debug("shard %d: %s %s not proposed yet: %s", shard, move.kind, move.node, exc)
                continue
            self._proposed[(shard, move.id)] = index
            self.changes_proposed += 1
            self.node.commit.kick(shard)
            log.info("shard %d: proposed %s %s (move %d, %s) at index %d", shard, move.kind, move.node, move.id,
                     move.origin, index)

    def _hand_over(self, host: Any) -> None:
        raft = host.raft
        others = [m for m in raft.active_conf_state.voters if m != tuple(self.node.member) and m in raft.progress]
        if not others or raft.lead_transferee is not None:
            return
        best = max(others, key=lambda m: (raft.is_active(m), raft.progress[m].match))
        try:
            raft.transfer_leader(best)
        except ProposalDropped:
            return
        self.node.commit.kick(host.shard)

    # --- the metadata leader: planning ------------------------------------------------------
    async def reconcile(self, table: MembershipState, now: float) -> list[PlannedMove]:
        self.reconcile_runs += 1
        wall = self.node.now_ms()
        for move in list(table.moves.values()):
            if move.started_ms and wall - move.started_ms > self.cfg.move_timeout_s * 1000:
                self._end(move, f"not done within cluster.move_timeout_s ({self.cfg.move_timeout_s:.0f} s)", now)
        nodes = self._node_views(table, now)
        moves = plan(nodes, self._group_views(table), PlanSettings(
            cluster_key=self.node.cfg.cluster.cluster_id + "/" + ",".join(sorted(table.members)),
            max_moves=self.cfg.max_concurrent_moves, promote_lag_entries=self.cfg.promote_lag_entries,
            auto_remove_after_s=self.cfg.auto_remove_after_s, in_progress=len(table.moves),
            leaderships=self._leaderships(), initial_members=self._initial_members(),
            learners=self.node.cfg.shard.learners, planner=tuple(self.node.member),
            grow_before_shrink=self.node.faults.grow_before_shrink_on_forget,
            promote_unchecked=self.node.faults.promote_before_caught_up))
        for mv in moves:
            try:
                result = await self.propose_meta(c.MoveStart(mv.shard, mv.kind, mv.node, mv.member[0], mv.member[1],
                                                              mv.origin, self.node.now_ms()))
            except (TimeoutError, ShardUnavailable) as exc:
                log.info("reconcile: shard %d: %s %s not recorded: %s", mv.shard, mv.kind, mv.node, exc)
                continue
            if isinstance(result, str):
                log.info("reconcile: shard %d: %s %s refused: %s", mv.shard, mv.kind, mv.node, result)
                continue
            self.moves_started += 1
            log.info("reconcile: shard %d: %s %s (%s)", mv.shard, mv.kind, mv.node, mv.reason)
        await self._mark_left(table)
        return moves

    async def _mark_left(self, table: MembershipState) -> None:
        """A leaving member that is in no shard's configuration any more has left."""
        for m in list(table.members.values()):
            if m.state != "leaving":
                continue
            if any(m.member_id in h.group_conf().members() for h in self.node.hosts):
                continue
            try:
                why = await self.propose_meta(c.MemberSetState(m.name, "left", self.node.now_ms()))
            except (TimeoutError, ShardUnavailable):
                continue
            if why is None:
                log.info("%s has left the cluster: it votes and follows in no shard", m.name)

