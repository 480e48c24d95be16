"""The replica reconciler's planner: which configuration changes bring every shard to its target.

Pure, synchronous and deterministic: the metadata group's leader calls ``plan`` with the member
table, every group's configuration as its own replica sees it, which nodes it hears from, and what
is in progress; it gets back at most one change per shard and at most ``max_moves`` in all.

The order is RabbitMQ #7209's lesson: **shrink before grow**. First, voters on forgotten or left
nodes (and on nodes down longer than ``auto_remove_after_s``, when an operator opted into that) are
removed — a shard of three with one dead voter becomes a shard of two with
two live, never a shard of four with three live, whose majority (three) a second failure would
take away. A removal that would leave the shard's voters without a live majority is not planned
(it could not commit anyway; ``forget`` refuses it up front). Only then, a shard below its target
gets one voter more, on a live active node chosen by:

1. zone: a node in a zone none of the shard's voters is in, while there is one;
2. fewest voters across the cluster (counting the changes planned in this round);
3. fewest leaderships;
4. a hash of (cluster key, shard, node name): deterministic, and spread.

Last, learners on gone nodes are removed (they count for no quorum: nothing waits for them).

The **metadata group** is grown the same way (its target: the initial members' count, 1, 3 or 5):
after a dead node's replacement its forgotten voter is removed, and a caught-up learner on a live
active node takes its place, so that a second failure leaves the member table a majority. It is
never rebalanced, and a leaving node's voter in it is not removed before the node has left.

A **leaving** node (a live one going away, ``moorline cluster leave``) is the other way round —
grow before shrink, as the node is still serving: a shard it votes in first gets a voter elsewhere
(as if below target), and only then loses the leaving node's voter; then its learners go. Its
voter in the metadata group stays until the member table says it has left (the node reads that
from its own replica, and stops), and goes then like any left node's.

Every node already follows every shard as a learner, so growing is usually ``promote``; a learner
is promoted only within ``promote_lag_entries`` of the leader's log (a lag not known to the planner
is checked by the shard's leader before it proposes). A node that is not a member of the shard at
all first becomes a learner (``add_learner``), and is promoted in a later round once caught up.

A node that is down but not forgotten keeps its memberships: its voter still counts towards the
target, so no replacement is placed while it restarts (scenario Three of #7209).

A node that **joined** (``moorline cluster join`` then ``--join``; not one of the initial members
of the bootstrap record) is in no group at first: every group (the metadata
group too, and that one first) gets it as a learner (``add_learner``), one group per change, so that
it follows every shard like the others. A shard led by a node that does not follow the metadata group
gets no change until it does: its leader, which proposes the change, reads no member table. Then
**rebalancing** gives it its share of voters: while a joined node has fewer than ``voters // nodes``
voters and another node has more, a shard where
the most loaded node votes and the joined node is a caught-up learner gets it as a voter (a
``promote`` whose origin is ``rebalance``), which leaves that shard one above target; the next round
removes the voter of the most loaded node there that does not lead it (a shard above target only
because of a rebalance: one an operator grew by hand is left as it is), and the round after adds it
back as a learner (the Raft core has no demotion: a voter is removed, then added as a learner).
A rebalance never leaves two of a shard's voters in one zone: a joined node whose zone has a voter
there takes that voter's place (the trim removes the zone's second voter first), or none.

**Zone repair** (the bootstrap placement knows no zones; a node's zone reaches the member table when
it announces it): a shard at target two of whose voters share a zone, all of them live, gets a
caught-up learner of a zone it has no voter in (a promotion with origin ``rebalance``), and the trim
then removes one of the two. Each repair takes one duplicate away, so it ends; with too few zones
nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moorline.hashing import guid128

MemberId = tuple[int, str]

GONE_STATES = ("left", "forgotten")


@dataclass(frozen=True)
class NodeView:
    name: str
    node_id: int
    storage_id: str
    state: str = "active"  # the member table's: active, draining, leaving, left, forgotten
    zone: str = ""
    live: bool = True  # the planner's node hears from it
    down_for_s: float = 0.0  # how long it has not been heard from (0 when live)

    @property
    def member_id(self) -> MemberId:
        return (self.node_id, self.storage_id)


@dataclass(frozen=True)
class GroupView:
    shard: int
    voters: tuple[MemberId, ...]
    learners: tuple[MemberId, ...] = ()
    target: int | None = 3  # voters wanted; None: unknown (never grown)
    leader: int | None = None  # node id of its leader, when known
    busy: bool = False  # a change is in progress (the member table's move, or one pending in the log)
    lag: dict[MemberId, int] | None = None  # entries each member is behind the leader; None: unknown
    rebalanced: bool = False  # its last change was a rebalance's promotion: a surplus voter is removed
    readd: MemberId | None = None  # the voter its last change (a rebalance's) removed: it follows again
    # The planner's own replica of the group is frozen (its node was removed from it and never hears
    # of it again): nothing is known of the group but that; only the node's re-add (readd) is planned.
    stale: bool = False
    meta: bool = False  # the metadata group (its target: the initial members' count)


@dataclass(frozen=True)
class PlannedMove:
    shard: int
    kind: str  # "remove" | "promote" | "add_learner"
    node: str
    member: MemberId
    reason: str
    origin: str = "reconcile"  # or "rebalance" (the member table's move records it)


@dataclass
class PlanSettings:
    cluster_key: str
    max_moves: int = 2
    promote_lag_entries: int = 1000
    auto_remove_after_s: float = 0.0  # 0: never remove a down node's memberships by itself
    in_progress: int = 0  # moves already under way (count against max_moves)
    leaderships: dict[str, int] = field(default_factory=dict)  # node name -> groups it leads
    # The cluster's initial members (the bootstrap record's (node id, storage id)): the others joined
    # and get their share of voters by rebalancing. None: the metadata group's voters stand for them
    # (they are the same while the metadata group has never been grown).
    initial_members: tuple[MemberId, ...] | None = None
    # shard.learners: "all", every live active node follows every shard as a learner; "none", a
    # shard lives on its voters, with a learner only while it catches up to be promoted (growth,
    # rebalance, zone repair), and learners no promotion needs are removed. The metadata group is
    # followed by every node either way (a shard's leader carries out the moves it reads there).
    learners: str = "all"
    # The member running the planner (the metadata group's leader), when known: with "none" its own
    # surplus learner in a group goes last, as its view of a group it is no member of stands still.
    planner: MemberId | None = None
    # Bug switches (testing/faults.py; the simulator's harness sets them, never production).
    grow_before_shrink: bool = False  # grow_before_shrink_on_forget: a gone voter goes after the growth
    promote_unchecked: bool = False  # promote_before_caught_up: a learner's lag is not looked at


def _removable(node: NodeView | None, auto_remove_after_s: float) -> str | None:
    """Why a member on this node goes (None: it stays)."""
    if node is None:
        return "its storage is no longer a member of the cluster"
    if node.state in GONE_STATES:
        return f"its node {node.name} is {node.state}"
    if auto_remove_after_s > 0 and not node.live and node.down_for_s >= auto_remove_after_s:
        return f"its node {node.name} has been down {node.down_for_s:.0f} s (cluster.auto_remove_after_s)"
    return None


def live_majority_after_removal(voters: tuple[MemberId, ...], removed: MemberId, live: set[MemberId]) -> bool:
    """Whether the change can commit and the shard stays available: the removal is committed by a
    majority of the voters it starts from (``removed`` counts if it is live), and the voters without
    ``removed`` keep a live majority. The first matters where few voters are left: of two voters,
    one dead, removing the dead one needs both (found by moorline sim --cluster, seed 30106: a
    forget accepted there left its shard unable to commit anything, for good)."""
    rest = [v for v in voters if v != removed]
    if not rest:
        return False
    if sum(1 for v in voters if v in live) * 2 <= len(voters):
        return False
    return sum(1 for v in rest if v in live) * 2 > len(rest)


def _caught_up(g: GroupView, member: MemberId, settings: PlanSettings) -> bool:
    """Whether a learner may be promoted in ``g`` now: within ``promote_lag_entries`` of the leader's
    log, or its lag unknown to the planner (the shard's leader checks it before proposing)."""
    if g.lag is None or settings.promote_unchecked:
        return True
    lag = g.lag.get(member)
    return lag is not None and lag <= settings.promote_lag_entries


def _voters_only(g: GroupView, settings: PlanSettings) -> bool:
    """Whether ``g`` keeps learners only to promote them (``shard.learners = "none"``; never the
    metadata group, which every node follows)."""
    return settings.learners == "none" and not g.meta


def _other_storage(g: GroupView, n: NodeView) -> bool:
    """Whether another storage of ``n``'s node is still a member of ``g`` (removed first)."""
    return any(m[0] == n.node_id and m != n.member_id for m in (*g.voters, *g.learners))


Candidates = list[tuple[tuple[object, ...], NodeView]]


def _pick(g: GroupView, candidates: Candidates, settings: PlanSettings) -> tuple[NodeView, str] | None:
    """The node (and the change: promote or add_learner) a growth, rebalance or zone repair of
    ``g`` takes from ``candidates`` (sort key, node), or None for not now. A learner is promoted
    only when caught up. With ``shard.learners = "all"`` a learner not caught up is passed over and
    a node that follows nothing becomes a learner; with ``"none"`` a learner already there (added
    for this in an earlier round) is waited for, and only when there is none is one added."""
    learners = set(g.learners)
    if _voters_only(g, settings):
        catching_up = [kn for kn in candidates if kn[1].member_id in learners]
        if catching_up:
            candidates = [kn for kn in catching_up if _caught_up(g, kn[1].member_id, settings)]
    else:
        candidates = [kn for kn in candidates if kn[1].member_id not in learners
                      or _caught_up(g, kn[1].member_id, settings)]
    if not candidates:
        return None
    _, best = min(candidates, key=lambda kv: kv[0])
    return best, "promote" if best.member_id in learners else "add_learner"


def _grow_candidates(g: GroupView, counted: list[MemberId], by_member: dict[MemberId, NodeView],
                     eligible: list[NodeView], voters_of: dict[str, int], settings: PlanSettings) -> Candidates:
    """Every node that could be ``g``'s next voter, caught up or not, with its sort key."""
    voter_nodes = {v[0] for v in g.voters}
    zones_used = {by_member[v].zone for v in counted if v in by_member}
    candidates: Candidates = []
    for n in eligible:
        if n.node_id in voter_nodes:
            continue
        if _other_storage(g, n):
            continue  # its old storage is still a member: that one is removed first
        key = (1 if n.zone in zones_used else 0, voters_of.get(n.name, 0), settings.leaderships.get(n.name, 0),
               guid128("reconcile", settings.cluster_key, g.shard, n.name), n.name)
        candidates.append((key, n))
    return candidates


def _grow(g: GroupView, counted: list[MemberId], by_member: dict[MemberId, NodeView], eligible: list[NodeView],
          voters_of: dict[str, int], settings: PlanSettings) -> PlannedMove | None:
    """One voter more for ``g`` (whose ``counted`` voters stay), or None when no node fits now."""
    picked = _pick(g, _grow_candidates(g, counted, by_member, eligible, voters_of, settings), settings)
    if picked is None:
        return None
    best, kind = picked
    return PlannedMove(g.shard, kind, best.name, best.member_id,
                       f"shard {g.shard} has {len(counted)} of {g.target} voters")


def _shares_zone(node: NodeView, voters: tuple[MemberId, ...], by_member: dict[MemberId, NodeView]) -> bool:
    """Whether another of ``voters`` is in ``node``'s zone (never for a node without a zone)."""
    return bool(node.zone) and any(v != node.member_id and v in by_member and by_member[v].zone == node.zone
                                   for v in voters)


def _zone_repair_candidates(g: GroupView, by_member: dict[MemberId, NodeView], eligible: list[NodeView],
                            voters_of: dict[str, int], settings: PlanSettings) -> tuple[str, Candidates]:
    """When two of ``g``'s voters share a zone (2d): that zone, and every node of a zone none of
    them is in that could take a voter (caught up or not; with ``shard.learners = "all"`` only its
    learners, as every node follows every shard). ("", []) when ``g`` needs no repair now."""
    if g.target is None or g.meta or g.stale or len(g.voters) != g.target:
        return "", []
    if any(v not in by_member or by_member[v].state != "active" or not by_member[v].live for v in g.voters):
        return "", []  # (as a rebalance: never a voter more while one of them is down or going)
    voters = [by_member[v] for v in g.voters]
    dup = sorted({n.zone for n in voters if _shares_zone(n, g.voters, by_member)})
    if not dup:
        return "", []
    zones_used = {n.zone for n in voters}
    candidates: Candidates = []
    for n in eligible:
        if not n.zone or n.zone in zones_used:
            continue
        if n.member_id not in g.learners and (not _voters_only(g, settings) or _other_storage(g, n)):
            continue
        key = (voters_of.get(n.name, 0), settings.leaderships.get(n.name, 0),
               guid128("zone", settings.cluster_key, g.shard, n.name), n.name)
        candidates.append((key, n))
    return dup[0], candidates


def _zone_repair(g: GroupView, by_member: dict[MemberId, NodeView], eligible: list[NodeView],
                 voters_of: dict[str, int], touched: set[int], settings: PlanSettings) -> PlannedMove | None:
    """A voter in an unused zone for ``g`` when two of its voters share one (2d), or None."""
    if g.busy or g.shard in touched:
        return None
    zone, candidates = _zone_repair_candidates(g, by_member, eligible, voters_of, settings)
    picked = _pick(g, candidates, settings)
    if picked is None:
        return None
    best, kind = picked
    return PlannedMove(g.shard, kind, best.name, best.member_id,
                       f"two voters of shard {g.shard} are in zone {zone}; {best.name} is in zone {best.zone}, "
                       "which has none", "rebalance")


def _rebalance_giver(g: GroupView, u: NodeView, by_member: dict[MemberId, NodeView], voters_of: dict[str, int],
                     share: int, settings: PlanSettings) -> NodeView | None:
    """The voter of ``g`` that would give its place to the joined node ``u`` (2c), or None when
    ``g`` is no shard for that. Whether ``u`` is caught up is not looked at; with ``shard.learners =
    "all"`` ``u`` must be a learner of ``g`` already (every node follows every shard), with
    ``"none"`` a learner or no member (it is added as a learner first)."""
    if g.target is None or g.meta or g.stale or len(g.voters) != g.target or u.member_id in g.voters:
        return None
    if u.member_id not in g.learners and (not _voters_only(g, settings) or _other_storage(g, u)):
        return None
    # (every voter live too: a shard whose voter's node just went down would run with four voters,
    # one down, until the trim: one failure more from no majority)
    if any(_removable(by_member.get(v), settings.auto_remove_after_s) is not None
           or by_member[v].state != "active" or not by_member[v].live for v in g.voters):
        return None
    # the node that would give the voter up: the most loaded that does not lead the shard (the trim
    # after the promotion removes no leader), or the one voter in u's zone (the trim removes the one
    # of a zone's two that votes in more shards: that one)
    same_zone = [by_member[v] for v in g.voters if u.zone and by_member[v].zone == u.zone]
    if len(same_zone) > 1 or (same_zone and same_zone[0].node_id == g.leader):
        return None  # it would leave two of the shard's voters in one zone
    heavy = same_zone[0] if same_zone else max(
        (by_member[v] for v in g.voters if v[0] != g.leader),
        key=lambda n: (voters_of.get(n.name, 0), n.name), default=None)
    if heavy is None or voters_of.get(heavy.name, 0) <= share:
        return None
    return heavy


def _staying(g: GroupView, by_member: dict[MemberId, NodeView], settings: PlanSettings) -> list[MemberId]:
    """``g``'s voters that count towards its target: not on a gone (or long down, when opted in)
    node, nor on a leaving one."""
    return [v for v in g.voters if _removable(by_member.get(v), settings.auto_remove_after_s) is None
            and by_member[v].state != "leaving"]


def _growth_pending(g: GroupView, by_member: dict[MemberId, NodeView], eligible: list[NodeView],
                    voters_of: dict[str, int], settings: PlanSettings) -> bool:
    """Whether ``g`` is below target with a node to grow onto and no gone voter to remove first (one
    that cannot be removed would keep it below target for good)."""
    if g.target is None or g.meta:
        return False
    counted = _staying(g, by_member, settings)
    if len(counted) >= g.target:
        return False
    if any(_removable(by_member.get(v), settings.auto_remove_after_s) is not None for v in g.voters):
        return False
    return bool(_grow_candidates(g, counted, by_member, eligible, voters_of, settings))


def _needed_learners(g: GroupView, by_member: dict[MemberId, NodeView], eligible: list[NodeView],
                     joined: list[NodeView], voters_of: dict[str, int], share: int,
                     settings: PlanSettings) -> set[MemberId]:
    """The learners of ``g`` that a promotion the planner would make needs (``shard.learners =
    "none"``): each is a candidate of a growth (``g`` below target), a zone repair or a rebalance
    towards a joined node below its share, by the same rules that would promote it once caught
    up. The planner is stateless: a learner added in an earlier round to be promoted is still
    catching up, and is kept because these rules still pick it."""
    learners = set(g.learners)
    needed: set[MemberId] = set()
    counted = _staying(g, by_member, settings)
    if g.target is not None and len(counted) < g.target:
        needed |= {n.member_id for _, n in _grow_candidates(g, counted, by_member, eligible, voters_of, settings)}
    needed |= {n.member_id for _, n in _zone_repair_candidates(g, by_member, eligible, voters_of, settings)[1]}
    for u in joined:
        if voters_of.get(u.name, 0) < share and _rebalance_giver(g, u, by_member, voters_of, share, settings):
            needed.add(u.member_id)
    return needed & learners


def plan(nodes: list[NodeView], groups: list[GroupView], settings: PlanSettings) -> list[PlannedMove]:
    by_member = {n.member_id: n for n in nodes}
    live = {n.member_id for n in nodes if n.live and n.state not in GONE_STATES}
    budget = max(0, settings.max_moves - settings.in_progress)
    out: list[PlannedMove] = []
    every = sorted(groups, key=lambda g: g.shard)
    # A group led by a node that does not follow the metadata group gets no change for now: its
    # leader, which alone proposes the change, never reads the move from the member table, so the
    # move only times out, is planned again, and takes the budget round after round (sim --cluster
    # seed 40418 with joins: n1, joined again, led shards 2 and 5 before it followed the metadata
    # group; add_learner n4 there, planned every round, kept n4 and n1 out of the metadata group).
    followers = {m[0] for g in groups if g.meta for m in (*g.voters, *g.learners)}
    touched: set[int] = {g.shard for g in groups if followers and g.leader is not None
                         and g.leader not in followers}
    ordered = [g for g in every if not g.stale]  # a stale view is only followed (2b)

    # 1. Shrink: voters on gone nodes (their learners go last, in 3: nothing waits for them).
    for g in ordered:
        if budget <= 0:
            return out
        if g.busy or g.shard in touched:
            continue
        if settings.grow_before_shrink and g.target is not None and not g.meta and sum(
                _removable(by_member.get(v), settings.auto_remove_after_s) is None for v in g.voters) < g.target:
            continue  # the broken order: this shard grows first (2.), its gone voter goes afterwards
        for m in g.voters:
            node = by_member.get(m)
            why = _removable(node, settings.auto_remove_after_s)
            if why is None:
                continue
            if g.leader is not None and m[0] == g.leader:
                continue  # a leader cannot remove itself; it is not gone if it leads
            if m in g.voters and not live_majority_after_removal(g.voters, m, live):
                continue
            name = node.name if node is not None else f"node {m[0]} (storage {m[1]})"
            out.append(PlannedMove(g.shard, "remove", name, m, why))
            touched.add(g.shard)
            budget -= 1
            break

    voters_of: dict[str, int] = {n.name: 0 for n in nodes}
    for g in groups:
        for v in g.voters:
            node = by_member.get(v)
            if node is not None:
                voters_of[node.name] += 1

    # 1b. A shard above target after a rebalance's promotion: the most loaded voter that does not
    #     lead it goes.
    for g in ordered:
        if budget <= 0:
            return out
        if (g.busy or g.shard in touched or not g.rebalanced or g.target is None or g.meta
                or len(g.voters) <= g.target):
            continue
        surplus = [by_member[v] for v in g.voters if v in by_member and v[0] != g.leader
                   and live_majority_after_removal(g.voters, v, live)]
        if not surplus:
            continue
        # (a voter sharing its zone with another goes first: a zone repair's surplus is its duplicate)
        drop = min(surplus, key=lambda n: (not _shares_zone(n, g.voters, by_member), -voters_of.get(n.name, 0), n.name))
        out.append(PlannedMove(g.shard, "remove", drop.name, drop.member_id,
                               f"shard {g.shard} is above target after a rebalance; {drop.name} votes in "
                               f"{voters_of.get(drop.name, 0)} shards", "rebalance"))
        voters_of[drop.name] = voters_of.get(drop.name, 0) - 1
        touched.add(g.shard)
        budget -= 1

    # 2. Grow: a shard below its target gets one voter more; a shard at target with a voter on a
    #    leaving node loses that voter (grow before shrink while the node is alive).
    eligible = [n for n in nodes if n.state == "active" and n.live and n.storage_id]
    for g in ordered:
        if budget <= 0:
            break
        if g.busy or g.shard in touched:
            continue
        gone = [v for v in g.voters if _removable(by_member.get(v), settings.auto_remove_after_s) is not None]
        if gone and not settings.grow_before_shrink:
            continue  # a gone voter must go first (shrink before grow); 1. could not remove it now
        leaving = [v for v in g.voters if v in by_member and by_member[v].state == "leaving"]
        counted = [v for v in g.voters if v not in leaving and v not in gone]
        if g.target is not None and len(counted) < g.target:
            move = _grow(g, counted, by_member, eligible, voters_of, settings)
            if move is not None:
                out.append(move)
                if move.kind == "promote":
                    voters_of[move.node] = voters_of.get(move.node, 0) + 1
                touched.add(g.shard)
                budget -= 1
            continue  # a leaving voter goes only once its replacement votes (grow before shrink)
        # (the metadata group keeps a leaving node's voter until the node is left: the node learns
        # from its own replica that it is, and stops; then it is removed as any left node is)
        if leaving and g.target is not None and not g.meta and live_majority_after_removal(g.voters, leaving[0], live):
            node = by_member[leaving[0]]
            out.append(PlannedMove(g.shard, "remove", node.name, leaving[0],
                                   f"its node {node.name} is leaving (the shard has {len(counted)} other voters)"))
            touched.add(g.shard)
            budget -= 1

    # 2b. Follow: every live active node follows every group. A node that joined (not an initial
    #     member: settings.initial_members) becomes a learner of
    #     every group it is not in, and so does any other node a change left out of a group that is
    #     at target (an operator's remove-replica on more nodes than replicas, a rebalance's
    #     removal): a node that follows no replica of a shard serves its sessions from a replica
    #     that never moves again (sim --cluster seed 125 with joins: n3 removed from shard 1 by
    #     hand, clients stuck on n3). With shard.learners = "none" only the metadata group: a
    #     shard is followed by its voters alone (and a learner only to be promoted: 2., 2c, 2d).
    # (not "no voter of the metadata group": that group is grown back after a replace, maybe onto
    # the replacement itself, which must still get its share of voters: test_cluster_join)
    initial = (set(settings.initial_members) if settings.initial_members is not None
               else {v for g in groups if g.meta for v in g.voters})
    joined = [n for n in eligible if initial and n.member_id not in initial]
    others = [n for n in eligible if n not in joined]
    live_ids = {n.member_id for n in nodes if n.live}
    # (the metadata group first: a node that does not follow it cannot carry out the member
    # table's moves of the shards it leads)
    for g in sorted(every, key=lambda g: (not g.meta, g.shard)):
        if budget <= 0:
            break
        if g.busy or g.shard in touched or _voters_only(g, settings):
            continue
        members = (*g.voters, *g.learners)
        readd = [n for n in others if n.member_id == g.readd]
        # (the others only where the voters have a live majority: nothing else could commit it)
        rest = [n for n in others if n not in readd] if 2 * sum(v in live_ids for v in g.voters) > len(g.voters) else []
        for n in [n for n in eligible if n.member_id == g.readd] if g.stale else [*joined, *readd, *rest]:
            if n.member_id in members or any(m[0] == n.node_id for m in members):
                continue  # a member already (or its old storage still is: that one is removed first)
            out.append(PlannedMove(g.shard, "add_learner", n.name, n.member_id,
                                   f"{n.name} follows no replica of group {g.shard}"))
            touched.add(g.shard)
            budget -= 1
            break

    # 2c. Rebalance: a node with fewer than its share of voters takes one from the most loaded.
    active = [n for n in nodes if n.state == "active" and n.storage_id]
    share = sum(voters_of.get(n.name, 0) for n in active) // len(active) if active else 0
    growing = settings.learners == "none" and any(_growth_pending(g, by_member, eligible, voters_of, settings)
                                                  for g in ordered)
    if active and budget > 0:
        for u in sorted(joined, key=lambda n: (voters_of.get(n.name, 0), n.name)):
            while budget > 0 and voters_of.get(u.name, 0) < share:
                options: list[tuple[tuple[int, bytes], GroupView, NodeView]] = []
                for g in ordered:
                    if g.busy or g.shard in touched:
                        continue
                    heavy = _rebalance_giver(g, u, by_member, voters_of, share, settings)
                    if heavy is not None:
                        options.append(((-voters_of.get(heavy.name, 0),
                                         guid128("rebalance", settings.cluster_key, g.shard, u.name)), g, heavy))
                if settings.learners == "none":
                    # (a learner added for this in an earlier round is waited for, not another added;
                    # and none is added while a shard grows: that raises the share, which can leave
                    # the learner with no voter to take, a copy made for nothing)
                    catching_up = [o for o in options if u.member_id in o[1].learners]
                    if catching_up:
                        options = [o for o in catching_up if _caught_up(o[1], u.member_id, settings)]
                    elif growing:
                        options = []
                else:
                    options = [o for o in options if u.member_id in o[1].learners
                               and _caught_up(o[1], u.member_id, settings)]
                if not options:
                    break
                _, g, heavy = min(options, key=lambda o: o[0])
                if u.member_id not in g.learners:  # (shard.learners = "none": it follows first)
                    out.append(PlannedMove(g.shard, "add_learner", u.name, u.member_id,
                                           f"{u.name} votes in {voters_of.get(u.name, 0)} shards, {heavy.name} in "
                                           f"{voters_of.get(heavy.name, 0)} (a share is {share}): it follows shard "
                                           f"{g.shard} to be promoted once caught up", "rebalance"))
                    touched.add(g.shard)
                    budget -= 1
                    break  # (one learner catching up per node: it is promoted before another is added)
                out.append(PlannedMove(g.shard, "promote", u.name, u.member_id,
                                       f"{u.name} votes in {voters_of.get(u.name, 0)} shards, {heavy.name} in "
                                       f"{voters_of.get(heavy.name, 0)} (a share is {share})", "rebalance"))
                voters_of[u.name] = voters_of.get(u.name, 0) + 1
                voters_of[heavy.name] -= 1
                touched.add(g.shard)
                budget -= 1

    # 2d. Zone repair: a shard two of whose voters share a zone, while a caught-up learner on a live
    #     node of a zone none of its voters is in exists, gets that learner as a voter (a promotion
    #     with origin "rebalance"); the trim (1b) then removes one of the two. Initial placement
    #     knows no zones, and a node's zone reaches the member table only once it announces it.
    for g in ordered:
        if budget <= 0:
            break
        move = _zone_repair(g, by_member, eligible, voters_of, touched, settings)
        if move is not None:
            out.append(move)
            voters_of[move.node] = voters_of.get(move.node, 0) + 1
            touched.add(g.shard)
            budget -= 1

    # 3. Clean up: learners on gone or leaving nodes; with shard.learners = "none" also learners on
    #    live nodes that no promotion the planner would make needs (a cluster switched from "all",
    #    a growth done elsewhere): never one catching up for a promotion decided in an earlier round,
    #    as the rules that decided it still pick it. Learners on down nodes stay, like their voters.
    for g in ordered:
        if budget <= 0:
            break
        if g.busy or g.shard in touched:
            continue
        needed = (_needed_learners(g, by_member, eligible, joined, voters_of, share, settings)
                  if _voters_only(g, settings) else set())
        # (the planner's own learner last: once removed, its replica of the group hears nothing more,
        # and the other surplus learners would stay)
        for m in sorted(g.learners, key=lambda m: m == settings.planner) if _voters_only(g, settings) else g.learners:
            node = by_member.get(m)
            why = _removable(node, settings.auto_remove_after_s)
            if why is None and node is not None and node.state == "leaving":
                why = f"its node {node.name} is leaving"
            if (why is None and node is not None and node.live and _voters_only(g, settings)
                    and m not in needed):
                why = f"shard.learners is none: no promotion needs {node.name} as a learner of shard {g.shard}"
            if why is not None:
                name = node.name if node is not None else f"node {m[0]} (storage {m[1]})"
                out.append(PlannedMove(g.shard, "remove", name, m, why))
                budget -= 1
                break
    return out


def forget_check(voters_by_group: dict[int, tuple[MemberId, ...]], forgotten: MemberId,
                 live: set[MemberId]) -> list[str]:
    """What ``forget`` would break: per group where ``forgotten`` votes, why removing it leaves the
    group without a live majority of its voters (empty: safe to forget)."""
    problems = []
    for shard, voters in sorted(voters_by_group.items()):
        if forgotten not in voters:
            continue
        if not live_majority_after_removal(voters, forgotten, live):
            rest = [v for v in voters if v != forgotten]
            alive = sum(1 for v in rest if v in live)
            if alive * 2 > len(rest):  # the rest would do; the removal itself cannot commit
                problems.append(f"shard {shard}: removing it is committed by a majority of its {len(voters)} "
                                f"voters ({len(voters) // 2 + 1}), and {sum(1 for v in voters if v in live)} "
                                "are live")
            else:
                problems.append(f"shard {shard}: {alive} of its {len(rest)} other voters are live; a majority "
                                f"is {len(rest) // 2 + 1}")
    return problems
