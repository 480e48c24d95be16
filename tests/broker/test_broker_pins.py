"""Issue 29 item 4 (state machine): readers' retention pins are replicated shard state (``Pin``,
``Unpin``), applied by every replica, so whoever leads a shard holds retention for them; their
time runs on entry times (the leader's), and they are in snapshots (version 6; version 5 decodes)."""

from __future__ import annotations

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import SNAPSHOT_VERSION, ShardState
from moorline.broker.topic_state import TopicLimits

LIMITS = TopicLimits(retention_min_age_ms=1000)


def shard_with(messages: int) -> ShardState:
    s = ShardState(0, "inc0", LIMITS, 3600)
    fx = Effects()
    for i in range(messages):
        s.apply(c.Publish(StoredMessage("t", b"x", 1, False, i.to_bytes(16, "big"), 0)), fx)
    return s


def pin(reader: str, offset: int, ts: int, ttl: int = 10_000, owner: str = "spark", max_pins: int = 10,
        max_per_owner: int = 10) -> c.Pin:
    return c.Pin(reader, owner, offset, ttl, max_pins, max_per_owner, ts)


def released(s: ShardState, now: int) -> list[int]:
    fx = Effects()
    s.apply(c.Housekeeping(now, -1), fx)
    return list(fx.releases)


def test_a_pin_holds_retention_from_its_offset_until_its_time_runs_out() -> None:
    s = shard_with(6)
    assert s.apply(pin("q1", 3, ts=1_000), Effects()) == "ok"
    assert released(s, 5_000) == [0, 1, 2]  # unowed and old, below the pin
    assert released(s, 10_000) == []  # pinned until 11,000
    assert released(s, 11_001) == [3, 4, 5]  # the pin ran out (no renewal): retention goes on
    assert "q1" not in s.pins


def test_renewal_owners_and_limits() -> None:
    s = shard_with(4)
    assert s.apply(pin("q1", 1, ts=1_000), Effects()) == "ok"
    assert s.apply(pin("q1", 2, ts=2_000, owner="mallory"), Effects()) == "held"
    assert s.apply(c.Unpin("q1", "mallory"), Effects()) == "held"
    assert s.apply(pin("q1", 2, ts=9_000), Effects()) == "ok"  # renewed and moved by its owner
    assert s.pins["q1"] == (2, 19_000, "spark")
    assert s.apply(pin("q2", 0, ts=9_000, max_per_owner=1), Effects()) == "too_many_for_owner"
    assert s.apply(pin("q2", 0, ts=9_000, owner="other", max_pins=1), Effects()) == "too_many"
    assert released(s, 15_000) == [0, 1]
    assert s.apply(c.Unpin("q1", "spark"), Effects()) == "ok"
    assert released(s, 15_000) == [2, 3]


def test_pins_are_in_snapshots_and_a_version_5_snapshot_decodes() -> None:
    s = shard_with(3)
    s.apply(pin("q1", 1, ts=1_000), Effects())
    data = s.snapshot()
    restored = ShardState.restore(data, LIMITS, 3600)
    assert restored.pins == s.pins == {"q1": (1, 11_000, "spark")}
    assert restored.snapshot() == data
    assert SNAPSHOT_VERSION == 6
    raw = msgspec.msgpack.decode(data)
    raw["version"] = 5
    del raw["pins"]
    old = ShardState.restore(msgspec.msgpack.encode(raw), LIMITS, 3600)
    assert old.pins == {} and old.topics.next_offset == 3


def test_a_forwarded_pin_is_restamped_with_the_leaders_time() -> None:
    data = c.encode_entry([pin("q1", 1, ts=123)])
    (cmd,) = c.decode_entry(c.restamp_entry(data, 50_000))
    assert isinstance(cmd, c.Pin) and cmd.ts_ms == 50_000
