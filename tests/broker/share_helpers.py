"""Shared helpers for the $share work-queue tests (tests/broker/test_broker_share_*.py)."""

from __future__ import annotations

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits, WorkQueue
from moorline.hashing import guid128

KEY = "$share\0g\0jobs/#"


def group(*members: str, single_active: bool = False, max_deliveries: int = 0, ack_timeout_ms: int = 0) -> ShardState:
    s = ShardState(0, "inc", TopicLimits(), 3600)
    fx = Effects()
    s.apply(c.Register(0, KEY, "", 1, "jobs/#", 1, share_group="g", want_retained=False,
                       single_active=single_active, max_deliveries=max_deliveries,
                       ack_timeout_ms=ack_timeout_ms), fx)
    for i, m in enumerate(members):
        s.apply(c.ShareMember(KEY, m, True, i + 1), fx)
    return s


def publish(s: ShardState, n: int, ts_ms: int = 1000) -> list[int]:
    out = []
    for i in range(n):
        m = StoredMessage(f"jobs/{i}", b"x", 1, False, guid128("t", s.topics.next_offset), ts_ms, None, None, "pub")
        out.append(int(s.apply(c.Publish(m), Effects()).offset))
    return out


def same_after_restore(s: ShardState) -> None:
    snap = s.snapshot()
    assert ShardState.restore(snap, TopicLimits(), 3600).snapshot() == snap


def as_version_4(snap: bytes) -> bytes:
    """The snapshot as version 4 wrote it: registrations without the work-queue fields."""
    raw = msgspec.msgpack.decode(snap)
    for reg in raw["regs"]:
        reg.pop("queue")
    raw["version"] = 4
    return msgspec.msgpack.encode(raw)


def queue_of(s: ShardState) -> WorkQueue:
    q = s.topics.regs[KEY].queue
    assert q is not None, "the group has a work-queue policy"
    return q
