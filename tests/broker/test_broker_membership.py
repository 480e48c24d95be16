"""The metadata group's member table: bootstrap from the record, announce, state changes, one move
per shard, and snapshots (new encoding round-trips; an older metadata snapshot rebuilds the table)."""

from __future__ import annotations

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.membership import MembershipState
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits

RECORD = c.ClusterRecord(
    cluster_id="t", members=(("n1", 1, "s1"), ("n2", 2, "s2"), ("n3", 3, "s3")), shard_count=2, replicas=3,
    placement=((("n1", "n2", "n3"), ()), (("n2", "n3", "n1"), ())),
)


def meta() -> ShardState:
    st = ShardState(2, "meta", TopicLimits(), 3600)
    st.apply(c.ClusterBootstrap(RECORD), Effects())
    return st


def run(st: ShardState, cmd: c.Command) -> object:
    return st.apply(cmd, Effects())


def test_bootstrap_record_gives_the_member_table() -> None:
    st = meta()
    ms = st.membership
    assert ms is not None
    assert sorted(ms.members) == ["n1", "n2", "n3"]
    assert all(m.state == "active" for m in ms.members.values())
    assert ms.targets == [3, 3]


def test_commands_before_the_record_are_refused() -> None:
    st = ShardState(2, "meta", TopicLimits(), 3600)
    assert "no cluster record" in str(run(st, c.MemberSetState("n1", "forgotten")))


def test_announce_sets_addresses_and_refuses_a_wiped_node() -> None:
    st = meta()
    assert run(st, c.MemberAnnounce(c.MemberInfo("n1", 1, "s1", "127.0.0.11:7000", "127.0.0.11:1883", "a"))) is None
    assert st.membership is not None
    m = st.membership.members["n1"]
    assert (m.cluster, m.client, m.zone) == ("127.0.0.11:7000", "127.0.0.11:1883", "a")
    refused = run(st, c.MemberAnnounce(c.MemberInfo("n1", 1, "other")))
    assert isinstance(refused, str) and "forget the old one" in refused
    assert "node id 2" in str(run(st, c.MemberAnnounce(c.MemberInfo("n9", 2, "x"))))
    assert run(st, c.MemberAnnounce(c.MemberInfo("n4", 4, "s4"), ts_ms=5)) is None
    assert st.membership.members["n4"].state == "active"


def test_state_transitions() -> None:
    st = meta()
    assert run(st, c.MemberSetState("n3", "forgotten", 10)) is None
    assert st.membership is not None and st.membership.members["n3"].state == "forgotten"
    assert "cannot become active" in str(run(st, c.MemberSetState("n3", "active")))
    assert "unknown member state" in str(run(st, c.MemberSetState("n2", "sleeping")))
    assert "no member" in str(run(st, c.MemberSetState("n7", "forgotten")))
    assert "was forgotten" in str(run(st, c.MemberAnnounce(c.MemberInfo("n3", 3, "s3"))))
    assert st.membership.counts()["forgotten"] == 1


def test_one_move_per_shard_and_moves_end() -> None:
    st = meta()
    first = run(st, c.MoveStart(0, "remove", "n3", 3, "s3", "reconcile", 1))
    assert not isinstance(first, str)
    second = run(st, c.MoveStart(0, "promote", "n1", 1, "s1", "manual", 2))
    assert isinstance(second, str) and "change in progress" in second
    other_shard = run(st, c.MoveStart(1, "promote", "n1", 1, "s1", "manual", 2))
    assert not isinstance(other_shard, str)
    assert "not a member" in str(run(st, c.MoveStart(2, "promote", "n1", 1, "wrong", "manual")))
    assert "no shard 5" in str(run(st, c.MoveStart(5, "remove", "n1", 1, "s1", "manual")))
    assert run(st, c.MoveEnd(0, 999, "done")) is False  # not the move in progress
    assert run(st, c.MoveEnd(0, first.id, "done", 7)) is True  # type: ignore[union-attr]
    assert run(st, c.MoveEnd(0, first.id, "done", 7)) is False  # reported twice: once
    assert st.membership is not None and 0 not in st.membership.moves
    assert st.membership.history[-1].outcome == "done"
    run(st, c.MemberSetState("n2", "draining"))
    assert "draining" in str(run(st, c.MoveStart(0, "promote", "n2", 2, "s2", "manual")))


def test_snapshot_round_trip_and_replicas_agree() -> None:
    a, b = meta(), meta()
    cmds: list[c.Command] = [c.MemberAnnounce(c.MemberInfo("n2", 2, "s2", "h:1", "h:2", "z")),
                             c.MoveStart(1, "remove", "n1", 1, "s1", "manual", 3), c.MemberSetState("n1", "leaving", 4)]
    for cmd in cmds:
        run(a, cmd)
        run(b, cmd)
    assert a.snapshot() == b.snapshot()
    back = ShardState.restore(a.snapshot(), TopicLimits(), 3600)
    assert back.snapshot() == a.snapshot()
    assert back.membership is not None and back.membership.moves[1].node == "n1"
    assert back.membership.members["n1"].state == "leaving"


def test_older_metadata_snapshot_rebuilds_the_table_from_the_record() -> None:
    st = meta()
    raw = msgspec.msgpack.decode(st.snapshot())
    assert isinstance(raw, list) or isinstance(raw, dict)
    if isinstance(raw, dict):
        raw.pop("membership")
    old = ShardState.restore(msgspec.msgpack.encode(raw), TopicLimits(), 3600)
    assert old.membership is not None and sorted(old.membership.members) == ["n1", "n2", "n3"]
    plain = ShardState(0, "inc", TopicLimits(), 3600)
    assert ShardState.restore(plain.snapshot(), TopicLimits(), 3600).membership is None


def test_membership_state_rejects_unknown_version() -> None:
    snap = MembershipState.from_record(RECORD).to_snapshot()
    snap.version = 99
    try:
        MembershipState.from_snapshot(snap)
    except ValueError as exc:
        assert "version 99" in str(exc)
    else:
        raise AssertionError("version 99 decoded")
