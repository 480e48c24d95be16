"""Topic names, filters, shared subscriptions, matching, and the trie against a naive matcher."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.mqtt.topics import (
    UNBOUNDED,
    SubscriptionTrie,
    TopicBounds,
    is_shared,
    is_wildcard,
    matches,
    parse_shared,
    topic_filter_error,
    topic_name_error,
    validate_topic_filter,
    validate_topic_name,
)


@pytest.mark.parametrize("name,ok", [
    ("a", True), ("a/b/c", True), ("/", True), ("//", True), ("/a", True), ("a/", True), ("$SYS/x", True),
    ("sport/tennis player1", True), ("ü/€", True),
    ("", False), ("a/+", False), ("a/#", False), ("#", False), ("+", False), ("a+b", False), ("a\x00b", False),
    ("x" * 65535, True), ("x" * 65536, False), ("€" * 21845, True), ("€" * 21846, False),
])
def test_validate_topic_name(name: str, ok: bool) -> None:
    assert validate_topic_name(name) is ok


@pytest.mark.parametrize("f,ok", [
    ("#", True), ("+", True), ("a/#", True), ("a/+/b", True), ("+/+", True), ("/+", True), ("+/#", True),
    ("a//b", True), ("$SYS/#", True), ("a/b", True),
    ("", False), ("a/#/b", False), ("a#", False), ("a/b#", False), ("#/", False), ("a+", False), ("a/+b", False),
    ("++", False), ("##", False), ("a\x00", False),
])
def test_validate_topic_filter(f: str, ok: bool) -> None:
    assert validate_topic_filter(f) is ok


@pytest.mark.parametrize("f,result", [
    ("$share/g/a/b", ("g", "a/b")), ("$share/g/#", ("g", "#")), ("$share/grp/+/x", ("grp", "+/x")),
    ("$share/g//", ("g", "/")),
    ("$share//a", None), ("$share/g", None), ("$share/g/", None), ("$share/g+/a", None), ("$share/g#/a", None),
    ("$share/g/a/#/b", None), ("a/b", None), ("$SHARE/g/a", None), ("$sharex/g/a", None),
])
def test_parse_shared(f: str, result: tuple[str, str] | None) -> None:
    assert parse_shared(f) == result


def test_is_shared_and_is_wildcard() -> None:
    assert is_shared("$share/g/a") and is_shared("$share//a") and not is_shared("$sharex/a")
    assert is_wildcard("a/+") and is_wildcard("#") and not is_wildcard("a/b")


MATCH_TABLE = [
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("#", "a/b/c", True),
    ("#", "/", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+/#", "a", True),
    ("a/b", "a/b", True),
    ("a/b", "a/b/c", False),
    ("a/b/c", "a/b", False),
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
    # $-topics are not matched by a leading wildcard (MQTT-4.7.2-1)
    ("#", "$SYS/monitor/Clients", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS", True),
    ("a/#", "a/$SYS", True),
    ("+/$x", "b/$x", True),
]


@pytest.mark.parametrize("f,topic,expected", MATCH_TABLE)
def test_matches_table(f: str, topic: str, expected: bool) -> None:
    assert matches(f, topic) is expected
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    trie.insert(f, "k", 1)
    assert (trie.match(topic) == [("k", 1)]) is expected


def test_trie_insert_replace_remove_prunes() -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    trie.insert("a/+/c", "s1", 1)
    trie.insert("a/+/c", "s1", 2)  # replace
    trie.insert("a/#", "s2", 3)
    trie.insert("#", "s3", 4)
    assert len(trie) == 3
    assert sorted(trie.match("a/b/c")) == [("s1", 2), ("s2", 3), ("s3", 4)]
    assert trie.get("a/+/c", "s1") == 2 and trie.get("a/+/c", "zz") is None
    assert trie.remove("a/+/c", "s1") is True
    assert trie.remove("a/+/c", "s1") is False
    assert trie.remove("nope/x", "s1") is False
    assert sorted(trie.match("a/b/c")) == [("s2", 3), ("s3", 4)]
    assert trie.remove("a/#", "s2") and trie.remove("#", "s3")
    assert len(trie) == 0 and trie.match("a/b/c") == []
    assert trie._root.children == {}  # every emptied branch was pruned


def test_trie_same_key_through_two_filters_appears_twice() -> None:
    trie: SubscriptionTrie[str, str] = SubscriptionTrie()
    trie.insert("a/+", "s", "plus")
    trie.insert("a/b", "s", "exact")
    assert sorted(trie.match("a/b")) == [("s", "exact"), ("s", "plus")]


def test_trie_items_lists_filters() -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    subs = {("a/b", "x", 1), ("a/#", "y", 2), ("/", "z", 3), ("+", "w", 4), ("a//b", "v", 5)}
    for f, k, v in subs:
        trie.insert(f, k, v)
    assert set(trie.items()) == subs


# Levels from a small alphabet so filters and topics collide often; '' and '$' levels included.
LEVELS = st.sampled_from(["a", "b", "", "$x", "c"])
topics = st.lists(LEVELS, min_size=1, max_size=4).map("/".join).filter(validate_topic_name)
filter_levels = st.sampled_from(["a", "b", "", "$x", "+", "c"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(filter_levels, min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    f = "/".join(levels) or "a"  # a single empty level is the empty (invalid) filter
    assert validate_topic_filter(f)
    return f


@given(subs=st.lists(st.tuples(filters(), st.integers(0, 5)), max_size=30),
       removals=st.lists(st.integers(0, 29), max_size=10), probe=st.lists(topics, min_size=1, max_size=10))
@settings(max_examples=200)
def test_trie_equals_naive_matching(subs: list[tuple[str, int]], removals: list[int], probe: list[str]) -> None:
    trie: SubscriptionTrie[int, str] = SubscriptionTrie()
    model: dict[tuple[str, int], str] = {}
    for f, key in subs:
        trie.insert(f, key, f)
        model[(f, key)] = f
    for r in removals:
        if r < len(subs):
            f, key = subs[r]
            assert trie.remove(f, key) == ((f, key) in model)
            model.pop((f, key), None)
    assert len(trie) == len(model)
    for topic in probe:
        expected = sorted((key, f) for (f, key) in model if matches(f, topic))
        assert sorted(trie.match(topic)) == expected


@given(f=filters(), topic=topics)
@settings(max_examples=300)
def test_matches_agrees_with_regex_reference(f: str, topic: str) -> None:
    import re

    # An independent reference: translate the filter to a regex.
    parts = f.split("/")
    pattern = ""
    for i, part in enumerate(parts):
        sep = "/" if i else ""
        if part == "#":
            pattern = pattern + ("(/.*)?" if i else ".*")
            break
        pattern += sep + ("[^/]*" if part == "+" else re.escape(part))
    expected = re.fullmatch(pattern, topic) is not None
    if topic.startswith("$") and f[0] in "+#":
        expected = False
    assert matches(f, topic) is expected


# --- the broker's bounds (mqtt.max_topic_levels, mqtt.max_topic_length) -------------------------------

BOUNDS = TopicBounds(max_levels=4, max_bytes=12)


@pytest.mark.parametrize("name,error", [
    ("a/b/c/d", None), ("x" * 12, None), ("€€€€", None), ("$SYS/a/b/c", None),
    ("a/b/c/d/e", "topic name has 5 levels, more than 4"), ("////", "topic name has 5 levels, more than 4"),
    ("x" * 13, "topic name longer than 12 bytes"), ("€€€€a", "topic name longer than 12 bytes"),
    ("", "empty topic name"), ("a/+", "wildcard in topic name"), ("#", "wildcard in topic name"),
    ("a\x00", "U+0000 in topic name"),
])
def test_topic_name_error_names_the_bound(name: str, error: str | None) -> None:
    assert topic_name_error(name, BOUNDS) == error
    assert (topic_name_error(name, UNBOUNDED) is None) is validate_topic_name(name)  # the protocol's rules alone


@pytest.mark.parametrize("f,error", [
    ("a/+/c/#", None), ("+/+/+/+", None), ("$share/g/a/b/c/d", None), ("$share/a-long-group/x", None),
    ("$share", None),  # not a shared subscription: a plain filter, as parse_shared has it
    ("a/+/c/d/#", "topic filter has 5 levels, more than 4"), ("$share/g/a/b/c/d/e", "topic filter has 5 levels, more than 4"),
    ("+" * 13, "topic filter longer than 12 bytes"),
    ("a/#/b", "invalid topic filter"), ("a+", "invalid topic filter"), ("", "empty topic filter"),
    ("$share/g/", "empty topic filter"), ("$share//a", "malformed shared subscription"),
    ("$share/g+/a", "malformed shared subscription"), ("$share/g/a/#/b", "invalid topic filter"),
])
def test_topic_filter_error_names_the_bound(f: str, error: str | None) -> None:
    assert topic_filter_error(f, BOUNDS) == error


@given(f=st.text(alphabet="ab/+#$€\x00", max_size=12))
@settings(max_examples=300)
def test_unbounded_filter_check_agrees_with_the_protocol_rules(f: str) -> None:
    plain_ok = validate_topic_filter(f) and not (f.startswith("$share/") and parse_shared(f) is None)
    assert (topic_filter_error(f, UNBOUNDED) is None) is plain_ok


def test_a_deep_filter_is_refused_without_being_split() -> None:
    """A 65,535-byte filter of 32,768 "+" levels: the old check split it into a 32,768-string list
    (and the trie then held a node per level in every shard); the bound needs no split."""
    deep = "/".join(["+"] * 32768)
    assert len(deep) == 65535 and validate_topic_filter(deep)
    long_but_shallow = TopicBounds(max_levels=32, max_bytes=65535)
    tracemalloc.start()
    try:
        errors = [topic_filter_error(deep, TopicBounds()), topic_filter_error(deep, long_but_shallow)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert errors == ["topic filter longer than 1024 bytes", "topic filter has 32768 levels, more than 32"]
    assert peak < 16 * 1024, f"checking the filter allocated {peak} bytes"
