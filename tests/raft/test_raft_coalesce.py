"""Coalesced heartbeats keep each group's term, commit and context, and check-quorum per group."""

from __future__ import annotations

import msgspec
from raft_helpers import Group, mid

from moorline.raft import Message, MessageType, StateRole
from moorline.raft.coalesce import GroupId, HeartbeatBatch, coalesce, expand


def test_roundtrip_keeps_per_group_fields() -> None:
    out: list[tuple[GroupId, Message]] = [
        ("g1", Message(type=MessageType.HEARTBEAT, from_=mid(1), to=mid(2), term=3, commit=7, context=b"r")),
        (5, Message(type=MessageType.HEARTBEAT, from_=mid(1), to=mid(2), term=9, commit=1)),
        (5, Message(type=MessageType.APP, from_=mid(1), to=mid(2), term=9, index=4)),
        (6, Message(type=MessageType.HEARTBEAT_RESP, from_=mid(1), to=mid(3), term=2)),
    ]
    batches, rest = coalesce(1, out)
    assert [b.dst for b in batches] == [2, 3]
    assert [m.type for _, m in rest] == [MessageType.APP]
    wire = msgspec.msgpack.encode(batches[0])
    back = msgspec.msgpack.decode(wire, type=HeartbeatBatch)
    assert expand(back) == [out[0], out[1]]
    assert expand(batches[1]) == [out[3]]


def test_batches_are_bounded() -> None:
    out = [(g, Message(type=MessageType.HEARTBEAT, from_=mid(1), to=mid(2), term=1)) for g in range(10)]
    batches, _ = coalesce(1, out, max_items=4)
    assert [len(b.items) for b in batches] == [4, 4, 2]


def test_check_quorum_is_fed_per_group() -> None:
    """Two groups led by node 1; only group A's followers answer the coalesced heartbeats:
    group A's leader keeps leading, group B's steps down."""
    a, b = Group(3), Group(3)
    a.elect(1)
    b.elect(1)
    la, lb = a.nodes[mid(1)], b.nodes[mid(1)]
    for _ in range(2 * la.cfg.election_tick):
        la.tick()
        lb.tick()
        rda, rdb = la.ready(), lb.ready()
        outgoing = [("A", m) for m in rda.early_messages] + [("B", m) for m in rdb.early_messages]
        la.advance(rda)
        lb.advance(rdb)
        batches, _ = coalesce(1, outgoing)
        for batch in batches:
            for group, m in expand(batch):
                if group != "A":
                    continue  # group B's followers are unreachable
                follower = a.nodes[m.to]
                follower.step(m)
                rd = follower.ready()
                follower.advance(rd)
                for resp in rd.messages:
                    la.step(resp)
    assert la.role == StateRole.LEADER
    assert lb.role == StateRole.FOLLOWER
