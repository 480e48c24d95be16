"""Issue 30 item 3, in the pure state machine: one user cannot open persistent sessions without
bound (session.max_persistent_per_user, carried by SessionOpen and decided at apply)."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits


def open_(s: ShardState, cid: str, user: str, expiry: int = 60, cap: int = 2, clean: bool = False,
          ts: int = 1000) -> object:
    return s.apply(c.SessionOpen(ts, cid, clean, expiry, None, user, True, 1, 0, cap), Effects())


def test_one_user_cannot_open_more_persistent_sessions_than_the_bound() -> None:
    s = ShardState(0, "inc", TopicLimits(), 3600)
    assert not open_(s, "a1", "alice").refused  # type: ignore[attr-defined]
    assert not open_(s, "a2", "alice").refused  # type: ignore[attr-defined]
    before = s.snapshot()
    r = open_(s, "a3", "alice")
    assert r.refused and r.over_quota  # type: ignore[attr-defined]
    assert s.snapshot() == before  # nothing changed
    assert not open_(s, "a1", "alice").refused  # type: ignore[attr-defined]  # a resume is no session more
    assert not open_(s, "a2", "alice", clean=True).refused  # type: ignore[attr-defined]  # nor a clean start
    assert not open_(s, "a3", "alice", expiry=0).refused  # type: ignore[attr-defined]  # nor a clean session
    assert not open_(s, "b1", "bob").refused  # type: ignore[attr-defined]  # other users have their own
    assert not open_(s, "a4", "alice", cap=0).refused  # type: ignore[attr-defined]  # entries before the bound
    # A session that ends frees its place; the derived count survives a snapshot.
    sess = s.sessions.sessions["a1"]
    s.apply(c.SessionClose(2000, "a1", sess.epoch, False, 0), Effects())
    assert s.sessions.persistent_of("alice") == 2
    restored = ShardState.restore(s.snapshot(), TopicLimits(), 3600)
    assert restored.sessions.persistent == s.sessions.persistent
    # Expiry through housekeeping.
    a2 = s.sessions.sessions["a2"]
    s.apply(c.SessionClose(3000, "a2", a2.epoch, False), Effects())
    s.apply(c.SessionHousekeeping(3000 + 61_000), Effects())
    assert s.sessions.persistent_of("alice") == 1
    assert not open_(s, "a5", "alice", ts=70_000).refused  # type: ignore[attr-defined]
