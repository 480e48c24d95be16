"""What the membership driver (membership.py) sees: the member table, which members are live,
and the views the pure planner (reconcile.py) plans from (``NodeView``, ``GroupView``), built from
this node's replicas and its cluster link; and what it shows (GET /v1/cluster, metrics).

``MembershipViews`` is a base class of ``MembershipDriver``: its methods read the driver's state
(``node``, ``cfg``, the down-since times and the counters ``MembershipDriver.__init__`` sets).
"""

from __future__ import annotations

from typing import Any

from moorline.broker.membership import GONE, MembershipState, Move
from moorline.node.replication.reconcile import GroupView, NodeView
from moorline.raft.types import ConfState

# A group's configuration a node that is no member of it heard from its leader longer ago than
# this is not planned from (the leader tells it every reader feed's idle_s).
GROUP_INFO_STALE_S = 10.0


class MembershipViews:
    # Set by MembershipDriver.__init__ (declared here for the type checker only).
    node: Any
    cfg: Any
    reconcile_runs: int
    moves_started: int
    changes_proposed: int
    _down_since: dict[str, float]

    # --- views -------------------------------------------------------------------------------
    @property
    def table(self) -> MembershipState | None:
        host = self.node.meta_host
        return None if host is None else host.state.membership

    def live_names(self) -> set[str]:
        """This node and the members it hears from (a connected stream). Public: the driver's
        fencing and the operators' checks (membership.py, membership_ops.py) use it too."""
        link = self.node.link
        if link is None:
            return {self.node.node_name(self.node.member[0])}
        peers = link.stats().get("peers", {})
        live = {link.spec.me}
        for name, peer in peers.items():
            if peer.get("connected_streams"):
                live.add(name)
        return live

    def _node_views(self, table: MembershipState, now: float) -> list[NodeView]:
        live = self.live_names()
        out = []
        for m in table.members.values():
            up = m.name in live
            if up:
                self._down_since.pop(m.name, None)
            else:
                self._down_since.setdefault(m.name, now)
            out.append(NodeView(m.name, m.node_id, m.storage_id, m.state, m.zone, up,
                                0.0 if up else now - self._down_since[m.name]))
        return out

    def target_of(self, table: MembershipState, group: int) -> int | None:
        """Voters wanted in ``group``: a shard's target from the member table; the metadata
        group's, the initial members' count (the bootstrap record's); None while unknown."""
        if group < len(table.targets):
            return table.targets[group]
        initial = self._initial_members() if group == self.node.meta_group else None
        return len(initial) if initial is not None else None

    def _initial_members(self) -> tuple[tuple[int, str], ...] | None:
        """The bootstrap record's members as (node id, storage id); None while it is not known."""
        host = self.node.meta_host
        record = host.state.cluster if host is not None else None
        return None if record is None else tuple((node_id, sid) for _, node_id, sid in record.members)

    def _lag(self, host: Any) -> dict[tuple[int, str], int] | None:
        raft = host.raft
        if not raft.is_leader:
            return None
        last = raft.log.last_index()
        return {m: last - pr.match for m, pr in raft.progress.items()}

    def _group_views(self, table: MembershipState) -> list[GroupView]:
        last: dict[int, Move] = {}  # each shard's latest ended move
        me = tuple(self.node.member)
        mine: dict[int, Move] = {}  # each shard's latest done move of this node's own member
        # Each shard's voters a rebalance removed and no done move has added back since: a manual
        # move of the shard before the round that re-adds it as a learner (``readd``) left it out
        # for good (sim --cluster seed 102 with joins: n1 followed no replica of shard 1).
        unreadded: dict[int, dict[tuple[int, str], None]] = {}
        for mv in table.history:
            last[mv.shard] = mv
            if mv.outcome == "done" and (mv.node_id, mv.storage_id) == me:
                mine[mv.shard] = mv
            if mv.outcome == "done":
                removed = unreadded.setdefault(mv.shard, {})
                removed.pop((mv.node_id, mv.storage_id), None)
                if mv.kind == "remove" and mv.origin == "rebalance":
                    removed[(mv.node_id, mv.storage_id)] = None
        out = []
        for host in self.node.groups:
            raft = host.raft
            reader = host.reader
            if reader is not None and reader.active:
                # No member of the group (shard.learners = "none"): its configuration and lags as
                # its leader last told this node's reader; nothing is planned for the group while
                # unknown or old (its leader gone: the next one tells).
                known = reader.conf is not None and reader.clock() - reader.info_at <= GROUP_INFO_STALE_S
                rconf = reader.conf if reader.conf is not None else raft.active_conf_state
                out.append(GroupView(host.shard, rconf.voters, rconf.learners, self.target_of(table, host.shard),
                                     reader.lead or None, meta=False,
                                     busy=host.shard in table.moves or host.failed is not None or not known,
                                     lag=dict(reader.lag) if known else None,
                                     rebalanced=host.shard in last and last[host.shard].origin == "rebalance"
                                     and last[host.shard].kind == "promote" and last[host.shard].outcome == "done",
                                     readd=next(iter(unreadded.get(host.shard, {})), None)))
                continue
            conf = raft.active_conf_state
            is_meta = host.shard == self.node.meta_group
            target = self.target_of(table, host.shard)
            # A change in the log, not applied here yet. Not when it removed this node from the
            # group: the leader no longer sends it anything, so its replica never learns that the
            # change committed; the member table says whether the move ended (table.moves).
            pending = conf != raft.conf_state and (me in conf.voters or me in conf.learners)
            lead = raft.lead
            if me not in conf.members() or (host.shard in mine and mine[host.shard].kind == "remove"):
                # The member table says this node's removal from the group is done, yet its replica
                # still lists it: the removal committed while this node was down or cut off, so its
                # log never got it, and never will (the leader sends nothing to a non-member). Its
                # configuration is stale: the group's is this one without this node, its leader
                # unknown here (the planner then re-adds it as a learner, as for any other node).
                # Stale too when its replica applied its own removal (this node is in no group's
                # configuration but after one): no later change reaches it either (sim --cluster
                # seed 40084 with joins: n1, the metadata leader, removed from shard 0 by hand, saw
                # 2 voters there for good and planned promote n4, already a voter, every round,
                # never its own re-add). The history is bounded; the configuration says it alone.
                conf = ConfState.of([v for v in conf.voters if v != me], [x for x in conf.learners if x != me])
                pending, lead = False, None
                # Only this node's re-add is planned from it: a stale view grew the shard onto
                # another node, already a member, again and again (sim --cluster seed 147 with joins:
                # n1, the metadata leader, removed from shard 4 by hand, planned add_learner n4 there
                # every round, each done at once, and never itself).
                out.append(GroupView(host.shard, conf.voters, conf.learners, target, None, meta=is_meta,
                                     busy=host.shard in table.moves or host.failed is not None, readd=me, stale=True))
                continue
            out.append(GroupView(host.shard, conf.voters, conf.learners, target,
                                 lead[0] if lead is not None else None, meta=is_meta,
                                 busy=host.shard in table.moves or pending or host.failed is not None,
                                 lag=self._lag(host),
                                 rebalanced=host.shard in last and last[host.shard].origin == "rebalance"
                                 and last[host.shard].kind == "promote" and last[host.shard].outcome == "done",
                                 readd=next(iter(unreadded.get(host.shard, {})), None)))
        return out

    def _leaderships(self) -> dict[str, int]:
        led: dict[str, int] = {}
        for h in self.node.groups:
            if h.raft.lead is not None:
                name = self.node.node_name(h.raft.lead[0])
                led[name] = led.get(name, 0) + 1
        return led

    def below_target(self, table: MembershipState) -> list[int]:
        """Shards with fewer voters on members that are not gone than their target (this replica's view)."""
        keep = {m.member_id for m in table.members.values() if m.state not in GONE}
        out = []
        for host in self.node.hosts:
            voters = host.group_conf().voters
            if host.shard < len(table.targets) and sum(v in keep for v in voters) < table.targets[host.shard]:
                out.append(host.shard)
        return out


    # --- status and metrics -------------------------------------------------------------------
    def status(self) -> dict[str, Any] | None:
        """The member table and the shards' configurations (GET /v1/cluster); None on a single node."""
        table = self.table
        if table is None or self.node.link is None:
            return None
        live = self.live_names()
        by_id = {m.member_id: m.name for m in table.members.values()}

        def named(members: tuple[Any, ...]) -> list[str]:
            return [by_id.get(tuple(x), f"node {x[0]} (storage {x[1]})") for x in members]

        shards = []
        keep = {m.member_id for m in table.members.values() if m.state not in GONE}
        for host in self.node.hosts:
            conf = host.group_conf()
            target = table.targets[host.shard] if host.shard < len(table.targets) else None
            counted = sum(v in keep for v in conf.voters)
            shards.append({"shard": host.shard, "voters": named(conf.voters), "learners": named(conf.learners),
                           "target": target,
                           "health": ("below target" if target is not None and counted < target else
                                      "above target" if target is not None and counted > target else "at target")})
        return {
            "members": [{"name": m.name, "node_id": m.node_id, "storage_id": m.storage_id, "cluster": m.cluster,
                         "client": m.client, "zone": m.zone, "state": m.state, "since_ms": m.since_ms,
                         "live": m.name in live} for m in sorted(table.members.values(), key=lambda x: x.name)],
            "shards": shards,
            "moves": [move_summary(mv) for mv in sorted(table.moves.values(), key=lambda x: x.shard)],
            "recent_moves": [move_summary(mv) for mv in table.history],
            "reconciler": {"interval_s": self.cfg.reconcile_interval_s,
                           "max_concurrent_moves": self.cfg.max_concurrent_moves,
                           "runs_here": self.reconcile_runs},
        }

    def metrics(self) -> dict[str, Any]:
        table = self.table
        return {
            "members": table.counts() if table is not None else {},
            "shards_below_target": len(self.below_target(table)) if table is not None else 0,
            "moves_in_progress": len(table.moves) if table is not None else 0,
            "reconcile_runs": self.reconcile_runs,
            "moves_started": self.moves_started,
            "changes_proposed": self.changes_proposed,
        }



def move_summary(mv: Move) -> dict[str, Any]:
    out: dict[str, Any] = {"id": mv.id, "shard": mv.shard, "kind": mv.kind, "node": mv.node, "origin": mv.origin,
                           "started_ms": mv.started_ms}
    if mv.ended_ms:
        out["ended_ms"] = mv.ended_ms
        out["outcome"] = mv.outcome
    return out
