"""The retained-topic trie: the same matches, in the same order, as the scan it replaced, kept in
step with the retained messages through set, clear and snapshot restore."""

from __future__ import annotations

import random
from typing import Any, NoReturn

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.retained_index import RetainedIndex
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.mqtt.topics import matches

# Few distinct levels, so random topics and filters overlap; "" for empty levels, "$"-levels for
# MQTT-4.7.2-1.
LEVELS = ["a", "b", "", "$SYS", "$x", "a$", "ab"]
topic_levels = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=5)
topics = topic_levels.map("/".join)


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), min_size=0, max_size=5))
    if draw(st.booleans()) or not levels:
        levels.append("#")
    return "/".join(levels)


def scan(retained: set[str], topic_filter: str) -> list[str]:
    """What Register did before the index: every retained topic, sorted, tested one by one."""
    return [t for t in sorted(retained) if matches(topic_filter, t)]


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), topics), max_size=40), probes=st.lists(filters(), min_size=1, max_size=8))
def test_index_matches_what_the_scan_matched(ops: list[tuple[bool, str]], probes: list[str]) -> None:
    index = RetainedIndex()
    model: set[str] = set()
    for add, topic in ops:
        if add:
            index.add(topic)
            model.add(topic)
        else:
            assert index.discard(topic) is (topic in model)
            model.discard(topic)
        assert len(index) == len(model)
    assert sorted(index) == sorted(model)
    for f in [*probes, "#", "+", "+/#", "$SYS/#", "a/#", "/#"]:
        assert index.match(f) == scan(model, f), f


def test_dollar_topics_and_parent_level() -> None:
    index = RetainedIndex(["$SYS/load", "$SYS", "a", "a/b", "a/b/c", "/", "/x"])
    assert index.match("#") == ["/", "/x", "a", "a/b", "a/b/c"]  # no $-topic under a leading wildcard
    assert index.match("+") == ["a"]
    assert index.match("+/#") == ["/", "/x", "a", "a/b", "a/b/c"]
    assert index.match("$SYS/#") == ["$SYS", "$SYS/load"]
    assert index.match("+/load") == []
    assert index.match("a/#") == ["a", "a/b", "a/b/c"]  # "#" also matches the parent
    assert index.match("a/+") == ["a/b"]
    assert index.match("/+") == ["/", "/x"]


def test_discard_prunes_levels_so_memory_follows_the_retained_topics() -> None:
    index = RetainedIndex()
    for i in range(100):
        index.add(f"x/{i}/deep/er")
    for i in range(100):
        assert index.discard(f"x/{i}/deep/er")
    assert not index.discard("x/0/deep/er")
    assert len(index) == 0
    assert index._root.children == {}  # nothing left behind


def shard_with_retained(rng: random.Random, n: int) -> ShardState:
    s = ShardState(0, "inc0", TopicLimits(), 3600)
    fx = Effects()
    for i in range(n):
        topic = "/".join(rng.choice(LEVELS) for _ in range(rng.randint(1, 4)))
        payload = b"" if rng.random() < 0.2 else f"v{i}".encode()  # some publishes clear
        s.apply(c.Publish(StoredMessage(topic, payload, 1, True, rng.randbytes(16), 1000 + i, origin=f"o{i % 3}")),
                fx)
    return s


def register_retained(s: ShardState, flt: str, key: str, no_local: bool = False) -> list[StoredMessage]:
    res = s.apply(c.Register(0, key, "o1", 1, flt, 1, no_local=no_local), Effects())
    return list(res.retained)


def scan_retained(s: ShardState, flt: str, no_local: bool = False) -> list[StoredMessage]:
    return [m for t, m in sorted(s.topics.retained.items())
            if matches(flt, t) and not (no_local and m.origin == "o1")]


def test_register_returns_what_the_scan_returned_and_restore_rebuilds_the_index() -> None:
    rng = random.Random(19)
    s = shard_with_retained(rng, 400)
    assert sorted(s.topics.retained_index) == sorted(s.topics.retained)
    probes = ["#", "+", "+/+", "a/#", "$SYS/#", "+/b/#", "/#", "a", "$x/+", "ab/+/a"]
    for i, f in enumerate(probes):
        assert register_retained(s, f, f"o1\0{i}", no_local=i % 2 == 1) == scan_retained(s, f, no_local=i % 2 == 1)
    snap = s.snapshot()
    restored = ShardState.restore(snap, TopicLimits(), 3600)
    assert restored.snapshot() == snap  # the index is derived: the snapshot is what it was
    assert sorted(restored.topics.retained_index) == sorted(restored.topics.retained)
    for i, f in enumerate(probes):
        assert register_retained(restored, f, f"o1\0r{i}") == scan_retained(restored, f)


class _NoScan(dict[str, StoredMessage]):
    """The retained messages of a shard, refusing to be walked: a Register may look topics up only."""

    def _refuse(self, *_: Any) -> NoReturn:
        raise AssertionError("Register scanned every retained message")

    items = values = keys = __iter__ = _refuse  # type: ignore[assignment]


def test_register_looks_up_only_the_matching_retained_messages() -> None:
    """20,000 retained topics made one wildcard SUBSCRIBE scan them all (21 s of blocked loop in the
    issue's measurement); the index visits the matching ones only."""
    s = ShardState(0, "inc0", TopicLimits(), 3600)
    fx = Effects()
    for i in range(2000):
        s.apply(c.Publish(StoredMessage(f"dev/{i % 50}/t/{i}", b"v", 1, True, random.randbytes(16), 1000)), fx)
    s.topics.retained = _NoScan(s.topics.retained)
    got = register_retained(s, "dev/7/+/#", "o1\0f")
    assert [m.topic for m in got] == sorted(f"dev/7/t/{i}" for i in range(7, 2000, 50))
