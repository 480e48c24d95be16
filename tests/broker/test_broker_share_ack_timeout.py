"""Issue 33 item 3, in the pure state machine: a claim held unacknowledged past the group's ack
timeout, by the ShareTimeout entry's time (the leader's), goes back to the group, counted as a
delivery attempt; an early or stale ShareTimeout changes nothing; a late acknowledgement is harmless."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from tests.broker.share_helpers import KEY, group, publish, queue_of, same_after_restore


def test_a_claim_past_the_timeout_goes_back_and_counts() -> None:
    s = group("a", "b", ack_timeout_ms=5000, max_deliveries=5)
    (o,) = publish(s, 1)
    s.apply(c.ShareClaim(KEY, "a", (o,), 1, ts_ms=10_000), Effects())
    assert queue_of(s).claim_ts == {o: 10_000}
    assert s.apply(c.ShareTimeout(14_999, KEY, "a", 1, (o,)), Effects()) == ()  # too early
    assert s.apply(c.ShareTimeout(15_000, KEY, "b", 2, (o,)), Effects()) == ()  # not the holder
    assert s.apply(c.ShareTimeout(15_000, KEY, "a", 9, (o,)), Effects()) == ()  # another incarnation
    fx = Effects()
    assert s.apply(c.ShareTimeout(15_000, KEY, "a", 1, (o,)), fx) == (o,)
    q, reg = queue_of(s), s.topics.regs[KEY]
    assert o not in reg.claims and not q.claim_ts and q.attempts == {o: 1} and q.timed_out == {o: "a"}
    assert KEY in fx.owed_regs
    same_after_restore(s)
    assert s.apply(c.ShareClaim(KEY, "b", (o,), 2, ts_ms=15_100), Effects()) == (o,)
    s.apply(c.AckReport(KEY, (o,)), Effects())  # a's late PUBACK, or b's: once
    s.apply(c.AckReport(KEY, (o,)), Effects())
    assert not reg.owed and not q.attempts and not q.timed_out and not reg.claims and not q.claim_ts
    assert s.topics.owed_count == {}


def test_timeouts_reach_the_delivery_limit() -> None:
    s = group("a", ack_timeout_ms=1000, max_deliveries=2)
    (o,) = publish(s, 1)
    for t in (0, 2000):
        s.apply(c.ShareClaim(KEY, "a", (o,), 1, ts_ms=10_000 + t), Effects())
        assert s.apply(c.ShareTimeout(11_000 + t, KEY, "a", 1, (o,)), Effects()) == (o,)
    assert queue_of(s).dead == {o: (2, "a")} and not queue_of(s).timed_out


def test_a_group_without_a_timeout_records_no_claim_times() -> None:
    s = group("a")
    (o,) = publish(s, 1)
    s.apply(c.ShareClaim(KEY, "a", (o,), 1, ts_ms=10_000), Effects())
    reg = s.topics.regs[KEY]
    assert reg.queue is None
    assert s.apply(c.ShareTimeout(99_000, KEY, "a", 1, (o,)), Effects()) == ()
    assert o in reg.claims


def test_the_groups_index_follows_registrations_and_restores() -> None:
    from moorline.broker.shard import ShardState
    from moorline.broker.topic_state import TopicLimits

    s = group("a", ack_timeout_ms=1000)
    s.apply(c.Register(0, "cl\0jobs/#", "cl", 1, "jobs/#", 1), Effects())
    assert list(s.topics.share_keys) == [KEY]
    restored = ShardState.restore(s.snapshot(), TopicLimits(), 3600)
    assert list(restored.topics.share_keys) == [KEY]
