"""Join's pure parts (issue 31): the member table admits a node before it starts and binds its
storage at its join, admits a forgotten name again as a new member; the planner makes a joined
node a learner everywhere, gives it its share of voters (caught-up learners only) and takes the
surplus out, and leaves a cluster without joined nodes exactly as before. Milliseconds."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.membership import MembershipState
from moorline.node.replication.placement import place_shards
from moorline.node.replication.reconcile import GroupView, NodeView, PlanSettings, plan


def table() -> MembershipState:
    record = c.ClusterRecord("k", (("n1", 1, "s1"), ("n2", 2, "s2"), ("n3", 3, "s3")), 2, 3,
                             ((("n1", "n2", "n3"), ()), (("n2", "n3", "n1"), ())))
    return MembershipState.from_record(record)


def announce(st: MembershipState, name: str, node_id: int, sid: str, cluster: str = "127.0.0.14:1") -> object:
    return st.apply(c.MemberAnnounce(c.MemberInfo(name, node_id, sid, cluster), 5))


def test_admit_then_bind_then_refuse_another_storage() -> None:
    st = table()
    assert st.next_node_id() == 4
    assert announce(st, "n4", 4, "") is None  # admitted, no storage yet
    assert st.members["n4"].storage_id == "" and st.members["n4"].state == "active"
    assert announce(st, "n4", 4, "s4") is None  # its join binds it
    assert st.members["n4"].storage_id == "s4"
    assert "storage id s4" in str(announce(st, "n4", 4, "other"))  # a wiped n4 is not n4
    assert "node id 4 is n4's" in str(announce(st, "n5", 4, ""))
    assert "no '@'" in str(announce(st, "n5@1", 5, ""))


def test_a_forgotten_name_comes_back_as_a_new_member() -> None:
    st = table()
    assert st.apply(c.MemberSetState("n3", "forgotten", 7)) is None
    assert announce(st, "n3", 3, "s3-new") == "n3 was forgotten"  # not under its old node id
    assert announce(st, "n3", st.next_node_id(), "") is None
    assert st.members["n3"].node_id == 4 and st.members["n3"].state == "active"
    old = st.members["n3@3"]
    assert (old.node_id, old.storage_id, old.state) == (3, "s3", "forgotten")
    assert st.next_node_id() == 5  # the old id is never given again
    snap = MembershipState.from_snapshot(st.to_snapshot())
    assert sorted(snap.members) == ["n1", "n2", "n3", "n3@3"]


NAMES = ["n1", "n2", "n3"]
SHARDS = 16


def mid(name: str) -> tuple[int, str]:
    return (int(name[1:]), f"s{name[1:]}")


def cluster(joined_learner_of: set[int], meta_learner: bool) -> tuple[list[NodeView], list[GroupView]]:
    nodes = [NodeView(n, *mid(n)) for n in [*NAMES, "n4"]]
    groups = []
    for s, p in enumerate(place_shards("k", NAMES, SHARDS, 3)):
        learners = tuple(mid(x) for x in p.learners) + ((mid("n4"),) if s in joined_learner_of else ())
        groups.append(GroupView(s, tuple(mid(v) for v in p.voters), learners, 3, leader=mid(p.voters[0])[0]))
    meta = GroupView(SHARDS, tuple(mid(n) for n in NAMES), (mid("n4"),) if meta_learner else (), 3, leader=1,
                     meta=True)
    return nodes, [*groups, meta]


def test_a_joined_node_becomes_a_learner_of_every_group_first() -> None:
    nodes, groups = cluster(set(), False)
    moves = plan(nodes, groups, PlanSettings("k", max_moves=100))
    assert {(m.shard, m.kind, m.node) for m in moves} == {(s, "add_learner", "n4") for s in range(SHARDS + 1)}


def test_rebalance_promotes_caught_up_learners_up_to_a_share_then_trims() -> None:
    nodes, groups = cluster(set(range(SHARDS)), True)
    lagging = {0: {mid("n4"): 5000}}  # shard 0's leader knows n4 is far behind: not promoted there
    groups = [GroupView(g.shard, g.voters, g.learners, g.target, g.leader, lag=lagging.get(g.shard), meta=g.meta)
              for g in groups]
    moves = plan(nodes, groups, PlanSettings("k", max_moves=100, promote_lag_entries=100))
    assert all(m.kind == "promote" and m.node == "n4" and m.origin == "rebalance" for m in moves), moves
    assert len(moves) == 3 * SHARDS // 4 and 0 not in {m.shard for m in moves}
    # a shard the rebalance grew loses the most loaded voter that does not lead it
    g = groups[moves[0].shard]
    grown = GroupView(g.shard, (*g.voters, mid("n4")), tuple(x for x in g.learners if x != mid("n4")), 3, g.leader,
                      rebalanced=True)
    others = [x for x in groups if x.shard != g.shard]
    trim = [m for m in plan(nodes, [*others, grown], PlanSettings("k", max_moves=1)) if m.shard == g.shard]
    assert len(trim) == 1 and trim[0].kind == "remove" and trim[0].node != "n4" and trim[0].member[0] != g.leader
    # one an operator grew by hand (not a rebalance) is left above target
    manual = GroupView(g.shard, grown.voters, grown.learners, 3, g.leader)
    assert not [m for m in plan(nodes, [*others, manual], PlanSettings("k", max_moves=100))
                if m.shard == g.shard and m.kind == "remove"]
    # the removed voter follows the shard again as a learner
    removed = trim[0].member
    after = GroupView(g.shard, tuple(v for v in grown.voters if v != removed), grown.learners, 3, g.leader,
                      readd=removed)
    again = [m for m in plan(nodes, [*others, after], PlanSettings("k", max_moves=100)) if m.shard == g.shard]
    assert [(m.kind, m.member) for m in again] == [("add_learner", removed)]


def test_no_joined_node_no_change() -> None:
    nodes = [NodeView(n, *mid(n)) for n in NAMES]
    _, groups = cluster(set(), False)
    assert plan(nodes, groups, PlanSettings("k", max_moves=100)) == []


def test_rebalance_skips_a_shard_whose_voter_is_down() -> None:
    """n2 went down a moment ago (not forgotten): a rebalance promotion on a shard where it votes
    would leave four voters with one down until the trim; only shards with every voter live move."""
    nodes, groups = cluster(set(range(SHARDS)), True)
    nodes = [NodeView(n.name, n.node_id, n.storage_id, live=n.name != "n2", down_for_s=0.0 if n.name != "n2" else 2.0)
             for n in nodes]
    assert [m for m in plan(cluster(set(range(SHARDS)), True)[0], groups, PlanSettings("k", max_moves=100))
            if m.origin == "rebalance"]  # with n2 live: the rebalance runs
    moves = plan(nodes, groups, PlanSettings("k", max_moves=100))
    assert {g.shard for g in groups if mid("n2") in g.voters} >= set(range(SHARDS))  # (n2 votes in every shard)
    assert not [m for m in moves if m.origin == "rebalance"], moves


def test_a_replacement_in_the_metadata_group_still_gets_its_share_of_voters() -> None:
    """n3 replaced (new storage s3b) and already promoted into the metadata group (grown back to
    three voters after the forget): it is still a node that joined, not an initial member, so the
    rebalance gives it voters (test_cluster_join: n3 stayed at 2 voters of 16 shards when "joined"
    meant "no voter of the metadata group")."""
    new = (3, "s3b")
    nodes = [NodeView("n1", *mid("n1")), NodeView("n2", *mid("n2")), NodeView("n3", *new),
             NodeView("n3@3", 3, "s3", state="forgotten", live=False)]
    # (each shard at a target of two, so that only the rebalance moves anything)
    groups = [GroupView(s, (mid("n1"), mid("n2")), (new,), 2, leader=1) for s in range(SHARDS)]
    meta = GroupView(SHARDS, (mid("n1"), mid("n2"), new), (), 3, leader=1, meta=True)
    initial = (mid("n1"), mid("n2"), mid("n3"))
    # Without the initial members (the metadata group's voters stand for them): n3 counts as initial.
    assert [m for m in plan(nodes, [*groups, meta], PlanSettings("k", max_moves=100)) if m.origin == "rebalance"] == []
    moves = plan(nodes, [*groups, meta], PlanSettings("k", max_moves=100, initial_members=initial))
    assert moves and all(m.kind == "promote" and m.member == new and m.origin == "rebalance" for m in moves), moves
