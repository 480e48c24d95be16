"""Issue 30 item 2, in the pure state machine: a $share member whose read ACL refuses a message
gives its claim back (ShareDecline) instead of releasing it for the whole group; the message is
dropped, counted as ``acl_no_reader``, only once every member of the group declined it."""

from __future__ import annotations

import random

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits

KEY = "$share\0g\0orders/#"


def group(*members: str) -> ShardState:
    s = ShardState(0, "inc", TopicLimits(), 3600)
    fx = Effects()
    s.apply(c.Register(0, KEY, "", 1, "orders/#", 1, share_group="g", want_retained=False), fx)
    for i, m in enumerate(members):
        s.apply(c.ShareMember(KEY, m, True, i + 1), fx)
    return s


def publish(s: ShardState, topic: str) -> int:
    m = StoredMessage(topic, b"x", 1, False, random.randbytes(16), 1000, None, None, "pub")
    r = s.apply(c.Publish(m), Effects())
    return int(r.offset)


def test_a_narrow_member_declining_does_not_lose_the_message_for_the_group() -> None:
    s = group("worker", "mallory")
    o = publish(s, "orders/secret/x")
    assert s.apply(c.ShareClaim(KEY, "mallory", (o,), 2), Effects()) == (o,)
    fx = Effects()
    assert s.apply(c.ShareDecline(KEY, "mallory", (o,), 2), fx) == ()  # worker may still read it
    reg = s.topics.regs[KEY]
    assert o in reg.owed and o not in reg.claims and reg.declined == {o: ["mallory"]}
    assert KEY in fx.owed_regs  # the dispatcher looks again
    assert s.apply(c.ShareClaim(KEY, "worker", (o,), 1), Effects()) == (o,)
    s.apply(c.AckReport(KEY, (o,)), Effects())
    assert not reg.owed and not reg.declined and not s.topics.drop_counts
    restored = ShardState.restore(s.snapshot(), TopicLimits(), 3600)
    assert restored.snapshot() == s.snapshot()


def test_a_message_no_member_may_read_is_a_counted_drop() -> None:
    s = group("mallory")
    o = publish(s, "orders/secret/x")
    s.apply(c.ShareClaim(KEY, "mallory", (o,), 1), Effects())
    s.apply(c.ShareDecline(KEY, "other", (o,), 1), Effects())  # not the holder: nothing
    assert o in s.topics.regs[KEY].claims
    assert s.apply(c.ShareDecline(KEY, "mallory", (o,), 1), Effects()) == (o,)
    reg = s.topics.regs[KEY]
    assert not reg.owed and not reg.declined and s.topics.owed_count == {}
    assert s.topics.drop_counts == {"acl_no_reader": 1}
    assert [d.reason for d in s.topics.drops] == ["acl_no_reader"]


def test_the_last_reader_leaving_drops_what_the_others_declined() -> None:
    s = group("worker", "mallory")
    o = publish(s, "orders/secret/x")
    s.apply(c.ShareClaim(KEY, "mallory", (o,), 2), Effects())
    s.apply(c.ShareDecline(KEY, "mallory", (o,), 2), Effects())
    s.apply(c.ShareMember(KEY, "worker", False, 1), Effects())
    assert s.topics.drop_counts == {"acl_no_reader": 1} and not s.topics.regs[KEY].owed
