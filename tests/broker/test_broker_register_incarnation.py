"""A plain Register of an ended session incarnation, applied after the new incarnation's (seed
60351 of the default simulator mix): it must leave the newer registration alone."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits

KEY = "csub1\0w/#"


def _msg(topic: str, guid: bytes, retain: bool = False) -> StoredMessage:
    return StoredMessage(topic, b"will", 1, retain, guid, 1000, None, None, "will2")


def _register(inc: int, version: int) -> c.Register:
    return c.Register(0, KEY, "csub1", inc, "w/#", 1, sub_version=version)


def test_late_register_of_an_ended_incarnation_keeps_the_new_one() -> None:
    """Incarnation 69's SUBSCRIBE w/# was proposed, its connection ended, and incarnation 75 (a clean
    start) subscribed w/# too; the old Register committed only after the new one. It replaced the
    new registration, and the old incarnation's cleanup (Unregister, session_expired) then removed
    it: the new session, told SUBACK 0x01, was owed no message of w/# any more (its wills lost)."""
    s, fx = ShardState(0, "inc0", TopicLimits(), 3600), Effects()
    s.apply(c.Publish(_msg("w/old", bytes([1]) * 16, retain=True)), fx)
    s.apply(_register(75, 2), fx)
    fx = Effects()
    s.apply(_register(69, 2), fx)  # the ended incarnation's, applied late
    assert s.topics.regs[KEY].session_inc == 75
    assert fx.retained_new == []  # nothing handed out for the ended incarnation
    assert s.apply(c.Unregister(KEY, 69, "session_expired", 2), fx) is False
    assert s.apply(c.Unregister(KEY, 69, "session_expired"), fx) is False
    assert s.topics.regs[KEY].session_inc == 75
    s.apply(c.Publish(_msg("w/will2", bytes([2]) * 16)), fx)
    assert list(s.topics.regs[KEY].owed) == [1]


def test_register_of_a_newer_incarnation_replaces_the_old_one() -> None:
    """The other order (the ordinary clean start): the newer incarnation's Register takes over."""
    s, fx = ShardState(0, "inc0", TopicLimits(), 3600), Effects()
    s.apply(_register(69, 2), fx)
    s.apply(c.Publish(_msg("w/will2", bytes([3]) * 16)), fx)
    s.apply(_register(75, 2), fx)
    reg = s.topics.regs[KEY]
    assert reg.session_inc == 75 and not reg.owed  # the old one's owed message dropped with it
    assert s.topics.drop_counts == {"session_replaced": 1}
