"""The replica reconciler's planner (moorline/node/replication/reconcile.py): shrink before grow,
one change per shard, a cluster-wide budget, zone-aware and deterministic placement, promotion only
when caught up, a down node keeping its memberships; and, applied round after round, convergence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.node.replication.placement import place_shards
from moorline.node.replication.reconcile import (
    GroupView,
    NodeView,
    PlannedMove,
    PlanSettings,
    forget_check,
    plan,
)

NAMES = ["n1", "n2", "n3", "n4", "n5"]


def nodes(**over: dict[str, object]) -> list[NodeView]:
    out = []
    for i, name in enumerate(NAMES, 1):
        kw: dict[str, object] = {"name": name, "node_id": i, "storage_id": f"s{i}"}
        kw.update(over.get(name, {}))
        out.append(NodeView(**kw))  # type: ignore[arg-type]
    return out


def mid(name: str) -> tuple[int, str]:
    i = int(name[1:])
    return (i, f"s{i}")


def groups(shards: int = 8, replicas: int = 3, dead: str = "") -> list[GroupView]:
    """The bootstrap placement; each shard led by its first voter that is not ``dead``."""
    table = place_shards("k", NAMES, shards, replicas)
    return [GroupView(s, tuple(mid(v) for v in p.voters), tuple(mid(v) for v in p.learners), replicas,
                      leader=mid(next(v for v in p.voters if v != dead))[0]) for s, p in enumerate(table)]


def apply(gs: list[GroupView], moves: list[PlannedMove]) -> list[GroupView]:
    by = {g.shard: g for g in gs}
    for mv in moves:
        g = by[mv.shard]
        voters, learners = set(g.voters), set(g.learners)
        if mv.kind == "remove":
            voters.discard(mv.member)
            learners.discard(mv.member)
        elif mv.kind == "promote":
            learners.discard(mv.member)
            voters.add(mv.member)
        else:
            learners.add(mv.member)
        leader = g.leader if g.leader in {v[0] for v in voters} else min(voters)[0]
        by[mv.shard] = GroupView(g.shard, tuple(sorted(voters)), tuple(sorted(learners)), g.target, leader)
    return [by[s] for s in sorted(by)]


def test_forgotten_voter_is_removed_before_anything_grows() -> None:
    ns = nodes(n3={"state": "forgotten", "live": False})
    gs = groups(dead="n3")
    moves = plan(ns, gs, PlanSettings("k", max_moves=100))
    with_n3 = {g.shard for g in gs if mid("n3") in g.voters or mid("n3") in g.learners}
    assert {m.shard for m in moves} == with_n3
    assert all(m.kind == "remove" and m.node == "n3" for m in moves)
    # next round: the shards that lost a voter grow, on a live node, never n3
    gs2 = apply(gs, moves)
    grow = plan(ns, gs2, PlanSettings("k", max_moves=100))
    assert {m.shard for m in grow} == {g.shard for g in gs if mid("n3") in g.voters}
    assert all(m.kind == "promote" and m.node != "n3" for m in grow)


def test_down_but_not_forgotten_node_keeps_its_memberships() -> None:
    ns = nodes(n2={"live": False, "down_for_s": 3600})
    assert plan(ns, groups(), PlanSettings("k", max_moves=100)) == []
    # opted into auto-removal: after that long, its memberships go (its voters first)
    moves = plan(ns, groups(), PlanSettings("k", max_moves=100, auto_remove_after_s=600))
    assert moves and all(m.kind == "remove" and m.node == "n2" for m in moves)


def test_budget_and_busy_shards() -> None:
    ns = nodes(n3={"state": "forgotten", "live": False})
    gs = groups(dead="n3")
    assert len(plan(ns, gs, PlanSettings("k", max_moves=2))) == 2
    assert plan(ns, gs, PlanSettings("k", max_moves=2, in_progress=2)) == []
    busy = [GroupView(g.shard, g.voters, g.learners, g.target, g.leader, busy=True) for g in gs]
    assert plan(ns, busy, PlanSettings("k", max_moves=100)) == []


def test_removal_that_loses_the_live_majority_is_not_planned() -> None:
    ns = nodes(n1={"state": "forgotten", "live": False}, n2={"live": False})
    g = GroupView(0, (mid("n1"), mid("n2"), mid("n3")), (), 3, leader=3)
    assert plan(ns, [g], PlanSettings("k")) == []
    assert forget_check({0: g.voters}, mid("n1"), {mid("n3")}) == [
        "shard 0: 1 of its 2 other voters are live; a majority is 2"]
    assert forget_check({0: g.voters}, mid("n1"), {mid("n2"), mid("n3")}) == []


def test_a_dead_voter_of_two_cannot_be_removed() -> None:
    """Two voters, one dead: removing the dead one is committed by both, so it never commits (sim
    --cluster seed 30106: a remove-replica racing a crash left such a shard, and a forget accepted
    there left it unable to commit anything, for good)."""
    ns = nodes(n1={"state": "forgotten", "live": False})
    g = GroupView(0, (mid("n1"), mid("n2")), (), 3, leader=2)
    assert plan(ns, [g], PlanSettings("k")) == []
    assert forget_check({0: g.voters}, mid("n1"), {mid("n2"), mid("n3")}) == [
        "shard 0: removing it is committed by a majority of its 2 voters (2), and 1 are live"]


def test_promotion_waits_for_the_learner_to_catch_up() -> None:
    ns = nodes()
    g = GroupView(0, (mid("n1"), mid("n2")), (mid("n3"), mid("n4"), mid("n5")), 3, leader=1,
                  lag={mid("n3"): 5000, mid("n4"): 5000, mid("n5"): 10})
    moves = plan(ns, [g], PlanSettings("k", promote_lag_entries=100))
    assert [(m.kind, m.node) for m in moves] == [("promote", "n5")]
    g2 = GroupView(0, g.voters, g.learners, 3, 1, lag={mid("n3"): 5000})
    assert plan(ns, [g2], PlanSettings("k", promote_lag_entries=100)) == []


def test_a_node_that_follows_nothing_becomes_a_learner_first() -> None:
    ns = nodes()
    g = GroupView(0, (mid("n1"), mid("n2")), (), 3, leader=1)
    (move,) = plan(ns[:3], [g], PlanSettings("k"))
    assert (move.kind, move.node) == ("add_learner", "n3")


def test_zone_aware() -> None:
    zones = {"n1": "a", "n2": "a", "n3": "b", "n4": "b", "n5": "c"}
    ns = nodes(**{n: {"zone": z} for n, z in zones.items()})
    g = GroupView(0, (mid("n1"), mid("n3")), (mid("n2"), mid("n4"), mid("n5")), 3, leader=1)
    (move,) = plan(ns, [g], PlanSettings("k"))
    assert move.node == "n5"  # the only zone without a voter
    # n5 down: no zone left unused, another zone's node it is
    over: dict[str, dict[str, object]] = {n: {"zone": z} for n, z in zones.items()}
    over["n5"] = {"zone": "c", "live": False}
    (move,) = plan(nodes(**over), [g], PlanSettings("k"))
    assert move.node in ("n2", "n4")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[NodeView], list[GroupView], PlanSettings]:
    shards = draw(st.integers(1, 12))
    replicas = draw(st.sampled_from([1, 3, 5]))
    over: dict[str, dict[str, object]] = {}
    for name in NAMES:
        over[name] = {"state": draw(st.sampled_from(["active", "active", "active", "draining", "leaving", "forgotten", "left"])),
                      "live": draw(st.booleans()) or draw(st.booleans()),
                      "zone": draw(st.sampled_from(["", "a", "b", "c"]))}
    ns = nodes(**over)
    gs = []
    for g in groups(shards, replicas):
        voters = tuple(v for v in g.voters if draw(st.integers(0, 5)) > 0) or g.voters[:1]
        gs.append(GroupView(g.shard, voters, tuple(m for m in g.learners + g.voters if m not in voters), replicas,
                            leader=draw(st.sampled_from([None, *[v[0] for v in voters]])), busy=draw(st.booleans())
                            and draw(st.booleans())))
    cfg = PlanSettings("k", max_moves=draw(st.integers(0, 10)), in_progress=draw(st.integers(0, 3)),
                       auto_remove_after_s=draw(st.sampled_from([0.0, 1.0])))
    return ns, gs, cfg


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_plan_properties(scenario: tuple[list[NodeView], list[GroupView], PlanSettings], rnd: object) -> None:
    ns, gs, cfg = scenario
    moves = plan(ns, gs, cfg)
    shuffled = list(ns)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert plan(shuffled, list(reversed(gs)), cfg) == moves  # deterministic, whatever the input order
    assert len(moves) <= max(0, cfg.max_moves - cfg.in_progress)
    assert len({m.shard for m in moves}) == len(moves)  # one change per shard
    by_shard = {g.shard: g for g in gs}
    by_name = {n.name: n for n in ns}
    by_name_id = {n.member_id: n for n in ns}
    live = {n.member_id for n in ns if n.live and n.state not in ("left", "forgotten")}
    # voters on gone nodes go first, then shards grow, then learners on gone nodes go
    def phase(m: PlannedMove) -> int:
        if m.kind != "remove":
            return 1
        if m.member not in by_shard[m.shard].voters:
            return 2
        return 1 if by_name[m.node].state == "leaving" else 0

    phases = [phase(m) for m in moves]
    assert phases == sorted(phases), [(m.kind, m.shard) for m in moves]
    for m in moves:
        g = by_shard[m.shard]
        assert not g.busy
        if m.kind == "remove":
            assert m.member in g.voters or m.member in g.learners
            leaving = m.node in by_name and by_name[m.node].state == "leaving"
            assert g.leader != m.member[0] or leaving  # (the driver hands a leaving leader's shard over first)
            if leaving and m.member in g.voters and g.target is not None:
                assert sum(by_name_id[v].state == "active" for v in g.voters if v in by_name_id) >= g.target
            if m.member in g.voters:
                rest = [v for v in g.voters if v != m.member]
                assert sum(v in live for v in rest) * 2 > len(rest)
        else:
            node = by_name[m.node]
            assert node.state == "active" and node.live and m.member not in g.voters
            staying = [v for v in g.voters if not (v in by_name_id and by_name_id[v].state == "leaving")]
            if m.origin == "rebalance":  # a zone repair (no node joined here): at target, a zone twice
                zones = [by_name_id[v].zone for v in g.voters]
                assert m.kind == "promote" and g.target == len(g.voters)
                assert node.zone and node.zone not in zones
                assert any(z and zones.count(z) > 1 for z in zones)
                assert all(by_name_id[v].live and by_name_id[v].state == "active" for v in g.voters)
            else:
                assert g.target is not None and len(staying) < g.target
            gone = [v for v in g.voters if v not in {n.member_id for n in ns if n.state not in ("left", "forgotten")}]
            assert not gone  # never grow a shard that still has a gone voter


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10), st.sampled_from(NAMES), st.integers(1, 4), st.sampled_from(["all", "none"]))
def test_forget_converges_to_target_on_live_nodes(shards: int, dead: str, max_moves: int, learners: str) -> None:
    """Round after round (each move applied): every shard ends with 3 voters, none on the
    forgotten node, which is in no shard at all; no round grows a shard that has a gone voter.
    With shard.learners = "none" (from the placement of a cluster created with "all", every other
    node a learner) no shard keeps a learner either."""
    ns = nodes(**{dead: {"state": "forgotten", "live": False}})
    gs = groups(shards, dead=dead)
    for _ in range(4 * shards + 4 if learners == "all" else 8 * shards + 8):
        moves = plan(ns, gs, PlanSettings("k", max_moves=max_moves, learners=learners))
        if not moves:
            break
        gs = apply(gs, moves)
    for g in gs:
        assert len(g.voters) == 3
        assert mid(dead) not in g.voters and mid(dead) not in g.learners
        assert learners == "all" or g.learners == ()


def test_spread_after_forget() -> None:
    """The replacements spread over the live nodes (fewest voters first)."""
    ns = nodes(n5={"state": "forgotten", "live": False})
    gs = groups(20, dead="n5")
    for _ in range(100):
        moves = plan(ns, gs, PlanSettings("k", max_moves=5))
        if not moves:
            break
        gs = apply(gs, moves)
    count = {n: sum(mid(n) in g.voters for g in gs) for n in NAMES[:4]}
    assert max(count.values()) - min(count.values()) <= 1, count


def test_leave_grows_before_it_shrinks() -> None:
    """A live node leaving: each shard it votes in first gets a voter elsewhere, and only then loses
    the leaving node's; round after round it ends in no group, every shard at 3 voters."""
    ns = nodes(n2={"state": "leaving"})
    gs = groups(8, dead="n2")
    first = plan(ns, gs, PlanSettings("k", max_moves=100))
    with_n2 = {g.shard for g in gs if mid("n2") in g.voters}
    assert {m.shard for m in first if m.kind == "promote"} == with_n2
    assert not any(m.kind == "remove" and m.member in next(g for g in gs if g.shard == m.shard).voters
                   for m in first)
    for _ in range(20):
        moves = plan(ns, gs, PlanSettings("k", max_moves=3))
        if not moves:
            break
        for mv in moves:
            g = next(g for g in gs if g.shard == mv.shard)
            if mv.kind == "remove" and mv.member in g.voters:
                assert len([v for v in g.voters if v != mid("n2")]) >= 3  # never below target
        gs = apply(gs, moves)
    assert all(len(g.voters) == 3 and mid("n2") not in g.voters + g.learners for g in gs)


def test_leave_waits_when_no_node_can_take_its_place() -> None:
    ns = nodes(n2={"state": "leaving"}, n4={"live": False}, n5={"live": False})
    g = GroupView(0, (mid("n1"), mid("n2"), mid("n3")), (mid("n4"), mid("n5")), 3, leader=1)
    assert plan(ns, [g], PlanSettings("k")) == []


def test_metadata_group_regrows_after_a_replace() -> None:
    """n3 replaced: its old storage forgotten, n3 back with storage s3b, a caught-up learner of the
    metadata group. The forgotten voter goes first, then the new n3 is promoted, back to the
    initial members' three voters: a second failure must leave the member table a majority."""
    ns = [n for n in nodes() if n.name in ("n1", "n2")]
    ns += [NodeView("n3", 3, "s3", state="forgotten", live=False), NodeView("n3", 3, "s3b")]
    new = (3, "s3b")
    meta = GroupView(8, (mid("n1"), mid("n2"), mid("n3")), (new,), 3, leader=1, meta=True, lag={new: 0})
    first = plan(ns, [meta], PlanSettings("k"))
    assert [(m.kind, m.member) for m in first] == [("remove", mid("n3"))]
    meta = GroupView(8, (mid("n1"), mid("n2")), (new,), 3, leader=1, meta=True, lag={new: 0})
    assert [(m.kind, m.member) for m in plan(ns, [meta], PlanSettings("k"))] == [("promote", new)]
    lagging = GroupView(8, meta.voters, meta.learners, 3, leader=1, meta=True, lag={new: 5000})
    assert plan(ns, [lagging], PlanSettings("k", promote_lag_entries=1000)) == []
    done = GroupView(8, (mid("n1"), mid("n2"), new), (), 3, leader=1, meta=True, lag={new: 0})
    assert plan(ns, [done], PlanSettings("k")) == []


def test_metadata_group_keeps_a_leaving_voter_until_it_has_left() -> None:
    """A leaving initial member: the metadata group grows onto another node first, and its voter
    stays (the node learns from its own replica that it has left, and stops)."""
    ns = nodes(n2={"state": "leaving"})
    meta = GroupView(8, (mid("n1"), mid("n2"), mid("n3")), (mid("n4"), mid("n5")), 3, leader=1, meta=True,
                     lag={mid("n4"): 0, mid("n5"): 0})
    moves = plan(ns, [meta], PlanSettings("k", max_moves=10))
    assert [m.kind for m in moves] == ["promote"] and moves[0].member in (mid("n4"), mid("n5"))
    grown = GroupView(8, (*meta.voters, moves[0].member), tuple(m for m in meta.learners if m != moves[0].member),
                      3, leader=1, meta=True, lag={mid("n4"): 0, mid("n5"): 0})
    assert not [m for m in plan(ns, [grown], PlanSettings("k", max_moves=10)) if m.kind == "remove"
                and m.member == mid("n2")]
