"""Issue 33 item 2, in the pure state machine: every unacknowledged hand-out of a $share message
that comes back (session end, ack timeout) counts; at max_deliveries the message waits for the
dead-letter topic (never claimed again) and ShareDeadLettered ends it as a drop ``delivery_limit``,
once, however often it is applied."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from tests.broker.share_helpers import KEY, as_version_4, group, publish, queue_of, same_after_restore


def hand_out_and_lose(s: ShardState, member: str, inc: int, offset: int) -> None:
    assert s.apply(c.ShareClaim(KEY, member, (offset,), inc), Effects()) == (offset,)
    s.apply(c.ShareReturn(KEY, member, (), inc), Effects())


def test_a_poison_message_is_dead_lettered_after_max_deliveries() -> None:
    s = group("a", "b", max_deliveries=3)
    o, o2 = publish(s, 2)
    reg = s.topics.regs[KEY]
    hand_out_and_lose(s, "a", 1, o)
    hand_out_and_lose(s, "b", 2, o)
    assert queue_of(s).attempts == {o: 2} and not queue_of(s).dead
    same_after_restore(s)  # the count is replicated state
    hand_out_and_lose(s, "a", 1, o)
    assert queue_of(s).dead == {o: (3, "a")} and o not in queue_of(s).attempts and o in reg.owed
    assert s.apply(c.ShareClaim(KEY, "b", (o, o2), 2), Effects()) == (o2,)  # never handed out again
    same_after_restore(s)
    fx = Effects()
    assert s.apply(c.ShareDeadLettered(KEY, (o,)), fx) == (o,)
    assert o not in reg.owed and not queue_of(s).dead and s.topics.drop_counts == {"delivery_limit": 1}
    assert [(d.reason, d.offset) for d in s.topics.drops] == [("delivery_limit", o)]
    assert s.apply(c.ShareDeadLettered(KEY, (o,)), Effects()) == ()  # again (a new leader): nothing
    assert s.topics.drop_counts == {"delivery_limit": 1}
    assert o not in s.topics.owed_count
    same_after_restore(s)


def test_an_acknowledged_message_forgets_its_attempts() -> None:
    s = group("a", max_deliveries=2)
    (o,) = publish(s, 1)
    hand_out_and_lose(s, "a", 1, o)
    s.apply(c.ShareClaim(KEY, "a", (o,), 1), Effects())
    s.apply(c.AckReport(KEY, (o,)), Effects())
    assert not queue_of(s).attempts and not queue_of(s).dead and not s.topics.drop_counts


def test_without_a_limit_nothing_is_dead_lettered() -> None:
    s = group("a")
    (o,) = publish(s, 1)
    for _ in range(5):
        hand_out_and_lose(s, "a", 1, o)
    reg = s.topics.regs[KEY]
    assert reg.queue is None  # a plain group counts nothing
    assert s.apply(c.ShareDeadLettered(KEY, (o,)), Effects()) == ()  # not waiting for the DLQ: refused
    assert o in reg.owed


def test_a_qos2_message_dropped_on_return_is_not_an_attempt() -> None:
    s = group("a", max_deliveries=1)
    (o,) = publish(s, 1)
    s.apply(c.ShareClaim(KEY, "a", (o,), 1), Effects())
    s.apply(c.ShareReturn(KEY, "a", (o,), 1), Effects())
    assert not queue_of(s).dead and s.topics.drop_counts == {"share_qos2_member_gone": 1}


def test_version_4_snapshot_of_a_group_restores_without_counts() -> None:
    s = group("a", max_deliveries=0)
    publish(s, 1)
    old = ShardState.restore(as_version_4(s.snapshot()), TopicLimits(), 3600)
    assert old.topics.regs[KEY].queue is None and old.snapshot() == s.snapshot()


def test_plain_registrations_carry_no_work_queue_state_in_snapshots() -> None:
    import msgspec

    s = group("a")
    s.apply(c.Register(0, "cl\0jobs/#", "cl", 1, "jobs/#", 1), Effects())
    raw = msgspec.msgpack.decode(s.snapshot())
    assert [r["queue"] for r in raw["regs"]] == [None, None]
