"""Zones in the replica reconciler's planner (moorline/node/replication/reconcile.py): a shard two of
whose voters share a zone gets a voter in a zone it has none in, then loses one of the two (the zone
repair: initial placement knows no zones); a rebalance never puts two voters of a shard in one zone;
and, round after round, every shard ends with its voters in distinct zones wherever there are enough."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.node.replication.placement import place_shards
from moorline.node.replication.reconcile import GroupView, NodeView, PlannedMove, PlanSettings, plan

NAMES = ["n1", "n2", "n3", "n4", "n5"]


def mid(name: str) -> tuple[int, str]:
    i = int(name[1:])
    return (i, f"s{i}")


def nodes(zones: dict[str, str], down: tuple[str, ...] = ()) -> list[NodeView]:
    return [NodeView(n, i, f"s{i}", zone=zones.get(n, ""), live=n not in down) for i, n in enumerate(NAMES, 1)]


def bootstrap(shards: int) -> list[GroupView]:
    """The bootstrap placement: every node follows every shard, each led by its first voter."""
    return [GroupView(s, tuple(mid(v) for v in p.voters), tuple(mid(v) for v in p.learners), 3, leader=mid(p.voters[0])[0])
            for s, p in enumerate(place_shards("k", NAMES, shards, 3))]


def apply(gs: list[GroupView], moves: list[PlannedMove]) -> list[GroupView]:
    """Each move done, as the membership driver records it: a rebalance's promotion marks the shard
    ``rebalanced`` (its surplus voter is removed next), and a voter a rebalance removed follows
    again (``readd``)."""
    by = {g.shard: g for g in gs}
    for mv in moves:
        g = by[mv.shard]
        voters, learners = set(g.voters), set(g.learners)
        readd = None
        if mv.kind == "remove":
            voters.discard(mv.member)
            learners.discard(mv.member)
            readd = mv.member if mv.origin == "rebalance" else None
        elif mv.kind == "promote":
            learners.discard(mv.member)
            voters.add(mv.member)
        else:
            learners.add(mv.member)
        leader = g.leader if g.leader in {v[0] for v in voters} else min(voters)[0]
        by[mv.shard] = GroupView(g.shard, tuple(sorted(voters)), tuple(sorted(learners)), g.target, leader,
                                 rebalanced=mv.kind == "promote" and mv.origin == "rebalance", readd=readd,
                                 meta=g.meta)
    return [by[s] for s in sorted(by)]


def zones_of(g: GroupView, zones: dict[str, str]) -> list[str]:
    return sorted(zones.get(f"n{v[0]}", "") for v in g.voters)


def converge(ns: list[NodeView], gs: list[GroupView], max_moves: int = 2, rounds: int = 200,
             learners: str = "all") -> list[GroupView]:
    for _ in range(rounds):
        moves = plan(ns, gs, PlanSettings("k", max_moves=max_moves, learners=learners))
        if not moves:
            return gs
        gs = apply(gs, moves)
    raise AssertionError(f"no fixed point after {rounds} rounds: {gs}")


def test_two_voters_in_one_zone_get_a_voter_in_an_unused_zone_then_lose_one() -> None:
    zones = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "c"}
    g = GroupView(0, (mid("n1"), mid("n2"), mid("n3")), (mid("n4"), mid("n5")), 3, leader=1)
    (move,) = plan(nodes(zones), [g], PlanSettings("k"))
    assert (move.kind, move.node, move.origin) == ("promote", "n5", "rebalance")  # zone c: the only unused one
    assert "zone a" in move.reason
    (g2,) = apply([g], [move])
    (trim,) = plan(nodes(zones), [g2], PlanSettings("k"))
    # of the two in zone a the one that does not lead goes, though n3 votes in as many shards
    assert (trim.kind, trim.node) == ("remove", "n2")
    (g3,) = apply([g2], [trim])
    assert zones_of(g3, zones) == ["a", "b", "c"]
    # the removed voter follows again, and nothing more moves
    (readd,) = plan(nodes(zones), [g3], PlanSettings("k"))
    assert (readd.kind, readd.node) == ("add_learner", "n2")
    assert plan(nodes(zones), apply([g3], [readd]), PlanSettings("k")) == []


def test_no_repair_without_an_unused_zone_or_while_a_voter_is_down() -> None:
    g = GroupView(0, (mid("n1"), mid("n2"), mid("n3")), (mid("n4"), mid("n5")), 3, leader=1)
    two_zones = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "b"}
    assert plan(nodes(two_zones), [g], PlanSettings("k")) == []  # a third zone has no node: a, a, b stays
    zones = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "c"}
    assert plan(nodes(zones, down=("n5",)), [g], PlanSettings("k")) == []  # its node is down
    assert plan(nodes(zones, down=("n3",)), [g], PlanSettings("k")) == []  # a voter is down: not now
    lagging = GroupView(0, g.voters, g.learners, 3, leader=1, lag={mid("n4"): 0, mid("n5"): 5000})
    assert plan(nodes(zones), [lagging], PlanSettings("k")) == []  # n5 not caught up
    # nodes without a zone are never "in one zone"
    assert plan(nodes({"n5": "c"}), [g], PlanSettings("k")) == []


def test_a_rebalance_never_puts_two_voters_of_a_shard_in_one_zone() -> None:
    """n5 joined (not an initial member) in zone a, where n1 already votes in every shard: it takes
    n1's place, not that of n3 (as loaded as n1, and picked without zones), which would leave two
    voters in zone a."""
    zones = {"n1": "a", "n2": "b", "n3": "c", "n4": "a", "n5": "a"}
    initial = tuple(mid(n) for n in NAMES[:4])
    gs = [GroupView(s, (mid("n1"), mid("n2"), mid("n3")), (mid("n4"), mid("n5")), 3, leader=2) for s in range(4)]
    moves = plan(nodes(zones), gs, PlanSettings("k", max_moves=10, initial_members=initial))
    assert len(moves) == 2  # n5's share: 12 voters over 5 nodes
    for m in moves:
        assert (m.kind, m.node, m.origin) == ("promote", "n5", "rebalance")
        g2 = apply([g for g in gs if g.shard == m.shard], [m])
        (trim,) = plan(nodes(zones), g2, PlanSettings("k", initial_members=initial))
        assert trim.node == "n1"  # the zone's other voter goes, not n3, zone c's only one
        assert zones_of(apply(g2, [trim])[0], zones) == ["a", "b", "c"]
    # where n1 leads, n5 takes no voter: the trim removes no leader, so zone a would keep two
    led_by_n1 = [GroupView(g.shard, g.voters, g.learners, 3, leader=1) for g in gs]
    assert plan(nodes(zones), led_by_n1, PlanSettings("k", max_moves=10, initial_members=initial)) == []


def test_bootstrap_placement_converges_to_distinct_zones() -> None:
    """Five nodes on three machines (zones a, a, b, b, c), placed with no zones at bootstrap: every
    shard ends with three voters in three zones, each node's voter count within the zones' bounds."""
    zones = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "c"}
    gs = bootstrap(12)
    assert any(len(set(zones_of(g, zones))) < 3 for g in gs)  # the bootstrap does break the rule
    gs = converge(nodes(zones), gs)
    for g in gs:
        assert len(g.voters) == 3 and zones_of(g, zones) == ["a", "b", "c"], g
        assert len(g.voters) + len(g.learners) == 5  # every node still follows every shard


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["", "a", "b", "c", "d"]), min_size=5, max_size=5), st.integers(1, 10),
       st.integers(1, 4), st.sampled_from(["all", "none"]), st.booleans())
def test_zones_converge_whatever_they_are(zone_list: list[str], shards: int, max_moves: int, learners: str,
                                          voters_only_start: bool) -> None:
    """Any zones: round after round the planner reaches a fixed point where every shard has three
    voters and no shard with two voters in one zone could have a voter in a zone it lacks. With
    shard.learners = "none" (started from either placement) no shard keeps a learner either: a
    zone repair adds the one it promotes."""
    zones = dict(zip(NAMES, zone_list, strict=True))
    start = bootstrap(shards)
    if learners == "none" and voters_only_start:
        start = [GroupView(g.shard, g.voters, (), g.target, g.leader) for g in start]
    gs = converge(nodes(zones), start, max_moves, learners=learners)
    present = {z for z in zone_list if z}
    for g in gs:
        assert len(g.voters) == 3
        assert learners == "all" or g.learners == ()
        used = zones_of(g, zones)
        named = [z for z in used if z]
        if len(set(named)) < len(named):
            assert not (present - set(used)), (g, zones)
