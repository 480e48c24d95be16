"""The replica reconciler's planner with ``shard.learners = "none"`` (moorline/node/replication/reconcile.py):
a shard lives on its voters; a learner is added only as the first step of a promotion (growth,
rebalance, zone repair), kept while it catches up, promoted once caught up; learners no promotion
needs (a cluster switched from "all") are removed, one per group per round; the metadata group is
followed by every node as before. Round after round, every shard ends at target with no learner."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.node.replication.placement import place_shards
from moorline.node.replication.reconcile import GroupView, NodeView, PlannedMove, PlanSettings, plan
from tests.node.test_reconcile_zones import apply

NAMES = ["n1", "n2", "n3", "n4", "n5"]
LAGGING = 5000  # a learner's lag right after it was added (promote_lag_entries is 1000)


def mid(name: str) -> tuple[int, str]:
    i = int(name[1:])
    return (i, f"s{i}")


def node_views(zones: dict[str, str] | None = None, **over: dict[str, object]) -> list[NodeView]:
    out = []
    for i, name in enumerate(NAMES, 1):
        kw: dict[str, object] = {"name": name, "node_id": i, "storage_id": f"s{i}", "zone": (zones or {}).get(name, "")}
        kw.update(over.get(name, {}))
        out.append(NodeView(**kw))  # type: ignore[arg-type]
    return out


def placed(shards: int, learners: str, names: list[str] = NAMES, dead: str = "") -> list[GroupView]:
    """The bootstrap placement; each shard led by its first voter that is not ``dead``."""
    return [GroupView(s, tuple(mid(v) for v in p.voters), tuple(mid(v) for v in p.learners), 3,
                      leader=mid(next(v for v in p.voters if v != dead))[0])
            for s, p in enumerate(place_shards("k", names, shards, 3, learners))]


def none(**kw: object) -> PlanSettings:
    return PlanSettings("k", learners="none", **kw)  # type: ignore[arg-type]


@dataclass
class World:
    """Groups with each planned move carried out as the membership driver records it: a
    rebalance's promotion marks its shard ``rebalanced``, a voter a rebalance removed is ``readd``;
    a learner lags ``LAGGING`` entries for ``catch_up_rounds`` rounds after it was added."""

    groups: list[GroupView]
    catch_up_rounds: int = 1
    round: int = 0
    added: dict[tuple[int, tuple[int, str]], int] = field(default_factory=dict)  # (shard, member) -> round
    # learners the planner added, then removed without ever promoting them
    wasted: list[tuple[int, tuple[int, str]]] = field(default_factory=list)

    def views(self) -> list[GroupView]:
        out = []
        for g in self.groups:
            lag = {m: LAGGING if self.round - self.added.get((g.shard, m), -99) <= self.catch_up_rounds else 0
                   for m in (*g.voters, *g.learners)}
            out.append(GroupView(g.shard, g.voters, g.learners, g.target, g.leader, lag=lag, rebalanced=g.rebalanced,
                                 readd=g.readd, meta=g.meta))
        return out

    def carry_out(self, moves: list[PlannedMove]) -> None:
        """The moves done (``test_reconcile_zones.apply``), and which learners it added or wasted
        (one move per group per round: each move sees its group as the round began)."""
        by = {g.shard: g for g in self.groups}
        for mv in moves:
            key = (mv.shard, mv.member)
            if mv.kind == "remove":
                if mv.member in by[mv.shard].learners and key in self.added:
                    self.wasted.append(key)
            elif mv.kind == "promote":
                self.added.pop(key, None)
            else:
                self.added[key] = self.round
        self.groups = apply(self.groups, moves)

    def converge(self, ns: list[NodeView], cfg: PlanSettings, rounds: int = 300) -> list[list[PlannedMove]]:
        history: list[list[PlannedMove]] = []
        for _ in range(rounds):
            self.round += 1
            moves = plan(ns, self.views(), cfg)
            if not moves and not any(self.round - r <= self.catch_up_rounds for r in self.added.values()):
                return history
            assert len({m.shard for m in moves}) == len(moves)  # one change per group per round
            history.append(moves)
            self.carry_out(moves)
        raise AssertionError(f"no fixed point after {rounds} rounds: {self.groups}")


def test_a_surplus_learner_is_removed_one_per_group_per_round() -> None:
    g = GroupView(0, (mid("n1"), mid("n2"), mid("n3")), (mid("n4"), mid("n5")), 3, leader=1)
    first = plan(node_views(), [g], none(max_moves=10))
    assert [(m.kind, m.node) for m in first] == [("remove", "n4")]
    assert "shard.learners is none" in first[0].reason
    second = plan(node_views(), [GroupView(0, g.voters, (mid("n5"),), 3, leader=1)], none(max_moves=10))
    assert [(m.kind, m.node) for m in second] == [("remove", "n5")]
    assert plan(node_views(), [GroupView(0, g.voters, (), 3, leader=1)], none(max_moves=10)) == []
    # with "all" they are where they belong
    assert plan(node_views(), [g], PlanSettings("k", max_moves=10)) == []
    # a learner on a down node stays, like its voters (nothing waits for it)
    assert [m.node for m in plan(node_views(n4={"live": False, "down_for_s": 60.0}), [g], none())] == ["n5"]


def test_the_planners_own_surplus_learner_goes_last() -> None:
    """Once the metadata leader's own learner is removed from a shard, its replica of that shard
    hears nothing more: the planner would never see the shard's other surplus learners again."""
    g = GroupView(0, (mid("n2"), mid("n3"), mid("n4")), (mid("n1"), mid("n5")), 3, leader=2)
    assert [m.node for m in plan(node_views(), [g], none())] == ["n1"]  # (no planner named: in order)
    assert [m.node for m in plan(node_views(), [g], none(planner=mid("n1")))] == ["n5"]
    alone = GroupView(0, g.voters, (mid("n1"),), 3, leader=2)
    assert [m.node for m in plan(node_views(), [alone], none(planner=mid("n1")))] == ["n1"]


def test_growth_adds_a_learner_keeps_it_while_it_catches_up_then_promotes_it() -> None:
    ns = node_views(n3={"state": "forgotten", "live": False})
    g = GroupView(0, (mid("n1"), mid("n2")), (), 3, leader=1)
    (add,) = plan(ns, [g], none())
    assert add.kind == "add_learner" and add.node in ("n4", "n5") and "2 of 3 voters" in add.reason
    other = "n5" if add.node == "n4" else "n4"
    catching_up = GroupView(0, g.voters, (add.member,), 3, leader=1, lag={add.member: LAGGING})
    # not caught up: no promotion, not trimmed as surplus, and no second learner added elsewhere
    assert plan(ns, [catching_up], none(max_moves=10)) == []
    # lag unknown to the planner (the leader checks it before proposing): promoted
    caught_up = GroupView(0, g.voters, (add.member,), 3, leader=1, lag={add.member: 10})
    (promote,) = plan(ns, [caught_up], none())
    assert (promote.kind, promote.node) == ("promote", add.node)
    # a learner on the other node too (as after a switch from "all"): the caught-up one is promoted
    both = GroupView(0, g.voters, (mid("n4"), mid("n5")), 3, leader=1, lag={add.member: LAGGING, mid(other): 0})
    assert [(m.kind, m.node) for m in plan(ns, [both], none())] == [("promote", other)]
    done = GroupView(0, (*g.voters, add.member), (), 3, leader=1)
    assert plan(ns, [done], none()) == []


def test_growth_round_after_round_never_trims_the_learner_it_waits_for() -> None:
    ns = node_views(n3={"state": "forgotten", "live": False})
    w = World(placed(8, "none", dead="n3"), catch_up_rounds=3)
    history = w.converge(ns, none(max_moves=3))
    assert w.wasted == []
    kinds = [m.kind for moves in history for m in moves]
    with_n3 = sum(mid("n3") in g.voters for g in placed(8, "none"))
    assert kinds.count("remove") == with_n3 and kinds.count("add_learner") == kinds.count("promote") == with_n3
    for g in w.groups:
        assert len(g.voters) == 3 and mid("n3") not in g.voters and g.learners == ()


def test_a_cluster_switched_from_all_converges_to_voters_only() -> None:
    """The data directories of a cluster created with "all": every non-voter follows every shard.
    With "none" the reconciler removes those learners through the member table, one per group per
    round within the move budget, and never a voter."""
    start = placed(6, "all")
    w = World(list(start))
    history = w.converge(node_views(), none(max_moves=4))
    assert all(m.kind == "remove" and m.member not in next(g for g in start if g.shard == m.shard).voters
               for moves in history for m in moves)
    assert all(len(moves) <= 4 for moves in history)
    assert [set(g.voters) for g in w.groups] == [set(g.voters) for g in start]
    assert all(g.learners == () for g in w.groups)
    assert sum(len(moves) for moves in history) == sum(len(g.learners) for g in start)


def test_a_joined_node_takes_its_share_one_learner_at_a_time() -> None:
    """n5 joined a cluster of four started with "none": it follows the metadata group (as with
    "all"), and no shard but one it is caught up in to take a voter there; the surplus voter goes
    and follows nothing afterwards (no re-add)."""
    initial = tuple(mid(n) for n in NAMES[:4])
    shards = placed(8, "none", NAMES[:4])
    meta = GroupView(8, initial[:3], (), 3, leader=1, meta=True)
    w = World([*shards, meta], catch_up_rounds=2)
    ns = node_views()
    cfg = none(max_moves=2, initial_members=initial)
    first = plan(ns, w.views(), cfg)
    assert first[0].shard == 8 and (first[0].kind, first[0].node) == ("add_learner", "n5")
    history = w.converge(ns, cfg)
    assert w.wasted == []
    share = (8 * 3 + 3) // 5  # (the planner counts the metadata group's voters too)
    assert sum(mid("n5") in g.voters for g in w.groups) == share
    assert mid("n5") in w.groups[8].learners  # the metadata group is followed by every node
    for g in w.groups[:8]:
        assert len(g.voters) == 3 and g.learners == ()
    # never two learners of n5 catching up at once in the shards
    followed: set[int] = set()
    for moves in history:
        for m in moves:
            if m.node == "n5" and m.shard < 8:
                if m.kind == "add_learner":
                    assert not followed, (m, followed)
                    followed.add(m.shard)
                elif m.kind == "promote":
                    followed.discard(m.shard)


def test_no_rebalance_learner_while_a_shard_grows() -> None:
    """A growth raises the share a joined node is rebalanced to: a learner added before it could
    find no voter to take any more, a copy made for nothing. A shard that cannot grow (its gone
    voter cannot be removed) does not hold the rebalance up."""
    initial = tuple(mid(n) for n in NAMES[:4])
    full = [GroupView(s, (mid("n1"), mid("n2"), mid("n3")), (), 3, leader=1) for s in range(4)]
    cfg = none(max_moves=10, initial_members=initial)
    (add,) = plan(node_views(), full, cfg)
    assert (add.kind, add.node, add.origin) == ("add_learner", "n5", "rebalance")
    short = GroupView(4, (mid("n1"), mid("n4")), (), 3, leader=1)
    assert [(m.shard, m.kind, m.node) for m in plan(node_views(), [*full, short], cfg)] == [
        (4, "add_learner", "n5")]  # the growth only (n5: fewest voters)
    # n4 forgotten, a voter of shard 4 beside n3 only: of two voters, one dead, neither can go, and
    # shard 4 stays below target until an operator steps in; n5 takes its share meanwhile
    ns = node_views(n4={"state": "forgotten", "live": False, "down_for_s": 60.0})
    stuck = GroupView(4, (mid("n3"), mid("n4")), (), 3, leader=3)
    assert [(m.kind, m.node, m.origin) for m in plan(ns, [*full, stuck], cfg)] == [("add_learner", "n5", "rebalance")]


def test_zone_repair_adds_the_learner_it_promotes() -> None:
    zones = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "c"}
    g = GroupView(0, (mid("n1"), mid("n2"), mid("n3")), (), 3, leader=1)
    w = World([g], catch_up_rounds=2)
    history = w.converge(node_views(zones), none())
    assert [(m.kind, m.node) for moves in history for m in moves] == [
        ("add_learner", "n5"), ("promote", "n5"), ("remove", "n2")]
    assert history[0][0].origin == "rebalance" and "zone a" in history[0][0].reason
    (final,) = w.groups
    assert final.voters == (mid("n1"), mid("n3"), mid("n5")) and final.learners == () and w.wasted == []


def test_no_re_add_of_a_stale_group_with_none() -> None:
    """The planner's own node removed from a shard: with "all" it follows again (readd); with
    "none" that shard is simply not one of its own."""
    stale = GroupView(0, (mid("n2"), mid("n3"), mid("n4")), (), 3, readd=mid("n1"), stale=True)
    assert [(m.kind, m.node) for m in plan(node_views(), [stale], PlanSettings("k"))] == [("add_learner", "n1")]
    assert plan(node_views(), [stale], none()) == []


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeView], World, PlanSettings]:
    """Five nodes (one maybe forgotten, leaving or down, any zones; the fifth maybe joined), the
    bootstrap placement with "all" or "none", shards with a voter dropped here and there."""
    shards = draw(st.integers(1, 10))
    zones = dict(zip(NAMES, draw(st.lists(st.sampled_from(["", "a", "b", "c"]), min_size=5, max_size=5)),
                     strict=True))
    over: dict[str, dict[str, object]] = {}
    event = draw(st.sampled_from(["none", "forgotten", "leaving", "down"]))
    victim = draw(st.sampled_from(NAMES[:4]))
    if event == "forgotten":
        over[victim] = {"state": "forgotten", "live": False, "down_for_s": 60.0}
    elif event == "leaving":
        over[victim] = {"state": "leaving"}
    elif event == "down":
        over[victim] = {"live": False, "down_for_s": 60.0}
    joined = draw(st.booleans())
    names = NAMES[:4] if joined else NAMES
    gs = []
    for g in placed(shards, draw(st.sampled_from(["all", "none"])), names):
        voters = g.voters
        # (a voter of three dropped, as by an operator's remove-replica; not beside a forgotten
        # voter: of two, one dead, neither can be removed, by design)
        if event != "forgotten" or mid(victim) not in voters:
            drop = draw(st.sampled_from([None, *voters]))
            voters = tuple(v for v in voters if v != drop)
        learners = tuple(x for x in (*g.learners, *g.voters) if x not in voters and draw(st.booleans()))
        # led by a voter that is up (a node down or forgotten leads nothing)
        leader = next((v[0] for v in voters if event == "none" or v != mid(victim)), voters[0][0])
        gs.append(GroupView(g.shard, voters, learners, 3, leader=leader))
    initial = tuple(mid(n) for n in names)
    gs.append(GroupView(shards, initial[:3], initial[3:], 3, leader=1, meta=True))
    cfg = none(max_moves=draw(st.integers(1, 4)), initial_members=initial)
    return node_views(zones, **over), World(gs, catch_up_rounds=draw(st.integers(0, 3))), cfg


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_voters_only_converges_to_target_without_learners(cluster: tuple[list[NodeView], World, PlanSettings]) -> None:
    """Round after round: every shard ends with its target of voters, none on a forgotten or
    leaving node, and no learner (but on a down node, which keeps its memberships); the metadata
    group is followed by every live node; no voter is ever removed but a gone or leaving node's or
    a rebalance's surplus, and no shard is ever without a live majority of its voters."""
    ns, w, cfg = cluster
    by_member = {n.member_id: n for n in ns}
    live = {n.member_id for n in ns if n.live and n.state not in ("left", "forgotten")}
    for moves in w.converge(ns, cfg):
        for m in moves:
            g = next(g for g in w.groups if g.shard == m.shard)  # (after: the moves are carried out)
            assert sum(v in live for v in g.voters) * 2 > len(g.voters) or m.kind != "remove"
    down = {n.member_id for n in ns if not n.live}
    staying = {n.member_id for n in ns if n.state == "active" and n.live}
    for g in w.groups:
        if g.meta:
            assert staying <= set(g.voters) | set(g.learners)
            continue
        assert len(g.voters) == 3, g
        assert all(by_member[v].state not in ("forgotten", "leaving") for v in g.voters), g
        assert set(g.learners) <= down, g
