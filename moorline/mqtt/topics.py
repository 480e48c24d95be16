"""Topic names, topic filters, shared subscriptions and subscription matching (section 4.7, 4.8).

Rules kept here:
- A topic name is non-empty, has no wildcards and is at most 65535 UTF-8 bytes (no U+0000).
- In a filter ``+`` fills a whole level; ``#`` fills a whole level and is the last one; ``#``
  also matches the parent level (``a/#`` matches ``a``).
- A topic starting with ``$`` is not matched by a filter starting with a wildcard (MQTT-4.7.2-1).
- ``$share/GROUP/FILTER``: GROUP non-empty without ``+``, ``#`` or ``/``; FILTER a valid filter.
- A broker also bounds what it accepts (``TopicBounds``: levels and UTF-8 bytes); ``topic_name_error``
  and ``topic_filter_error`` check a name or filter against them before anything is split or stored.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

MAX_TOPIC_BYTES = 65535
SHARE_PREFIX = "$share/"


@dataclass(frozen=True, slots=True)
class TopicBounds:
    """What a broker accepts beyond the protocol's own rules (``mqtt.max_topic_levels`` and
    ``mqtt.max_topic_length``). Every level of a stored filter costs a trie node (about 300 bytes)
    in every shard the filter is registered in, so depth is what must be bounded; a
    65,535-byte filter of ``+/+/...`` would be 32,768 levels in each of 16 shards."""

    max_levels: int = 32
    max_bytes: int = 1024  # UTF-8 bytes; never above the protocol's 65,535


DEFAULT_TOPIC_BOUNDS = TopicBounds()  # the broker's defaults (config.py says why these)
UNBOUNDED = TopicBounds(max_levels=MAX_TOPIC_BYTES + 1, max_bytes=MAX_TOPIC_BYTES)  # the protocol's own


def _bounds_error(s: str, what: str, bounds: TopicBounds) -> str | None:
    """Why ``s`` exceeds ``bounds``, or None. Counts without splitting or encoding more than once, so
    an oversized string costs no more than itself."""
    limit = bounds.max_bytes
    # len() counts code points: the UTF-8 length only differs (and needs encoding) for non-ASCII.
    if len(s) > limit or (len(s) * 4 > limit and not s.isascii() and len(s.encode("utf-8")) > limit):
        return f"{what} longer than {limit} bytes"
    levels = s.count("/") + 1
    if levels > bounds.max_levels:
        return f"{what} has {levels} levels, more than {bounds.max_levels}"
    return None


def topic_name_error(topic: str, bounds: TopicBounds = UNBOUNDED) -> str | None:
    """None if ``topic`` may be published (PUBLISH, will, HTTP) within ``bounds``; else why not, in
    words fit for a reason string or an HTTP error."""
    if not topic:
        return "empty topic name"
    if "+" in topic or "#" in topic:
        return "wildcard in topic name"
    if "\x00" in topic:
        return "U+0000 in topic name"
    return _bounds_error(topic, "topic name", bounds)


def topic_filter_error(topic_filter: str, bounds: TopicBounds = UNBOUNDED) -> str | None:
    """None if ``topic_filter`` (plain or ``$share/GROUP/FILTER``) may be subscribed within
    ``bounds``; else why not. The bounds apply to the filter that is matched and stored (without
    the ``$share/GROUP/`` prefix) and are checked before the filter is split."""
    inner = topic_filter
    if topic_filter.startswith(SHARE_PREFIX):  # "$share" alone is a plain filter, as parse_shared has it
        rest = topic_filter[len(SHARE_PREFIX):]
        slash = rest.find("/")
        if slash <= 0 or "+" in rest[:slash] or "#" in rest[:slash]:
            return "malformed shared subscription"
        inner = rest[slash + 1:]
    if not inner:
        return "empty topic filter"
    error = _bounds_error(inner, "topic filter", bounds)
    if error is not None:
        return error
    if not validate_topic_filter(inner) or (inner is not topic_filter and len(topic_filter.encode()) > MAX_TOPIC_BYTES):
        return "invalid topic filter"
    return None


def _length_ok(s: str) -> bool:
    # len(s) bounds the UTF-8 length from below and 4*len(s) from above: encode only when needed.
    if len(s) * 4 <= MAX_TOPIC_BYTES:
        return True
    return len(s.encode("utf-8")) <= MAX_TOPIC_BYTES


def validate_topic_name(s: str) -> bool:
    """True if ``s`` may be the topic of a PUBLISH (or a will)."""
    return bool(s) and "+" not in s and "#" not in s and "\x00" not in s and _length_ok(s)


def validate_topic_filter(s: str) -> bool:
    """True if ``s`` is a syntactically valid (non-shared) topic filter."""
    if not s or "\x00" in s or not _length_ok(s):
        return False
    if "+" not in s and "#" not in s:
        return True
    levels = s.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            return False
        if "+" in level and level != "+":
            return False
    return True


def is_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def parse_shared(topic_filter: str) -> tuple[str, str] | None:
    """``(group, filter)`` for a valid ``$share/GROUP/FILTER``, else None.

    None covers both "not a shared subscription" and "malformed shared subscription"; use
    ``is_shared`` to tell them apart (the latter deserves reason 0x8F).
    """
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    rest = topic_filter[len(SHARE_PREFIX):]
    slash = rest.find("/")
    if slash <= 0:
        return None
    group, inner = rest[:slash], rest[slash + 1:]
    if "+" in group or "#" in group or not validate_topic_filter(inner):
        return None
    return group, inner


def is_shared(topic_filter: str) -> bool:
    """True if the filter claims to be a shared subscription (valid or not)."""
    return topic_filter.startswith(SHARE_PREFIX) or topic_filter == "$share"


def matches(topic_filter: str, topic: str) -> bool:
    """Does a (non-shared, valid) filter match a (valid) topic name?"""
    if topic_filter == topic:
        return True
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    n = len(t_levels)
    for i, f in enumerate(f_levels):
        if f == "#":
            return True  # matches this level and everything below, including nothing (parent)
        if i >= n:
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == n


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Node(Generic[K, V]):
    __slots__ = ("children", "values")

    def __init__(self) -> None:
        self.children: dict[str, _Node[K, V]] = {}
        self.values: dict[K, V] = {}  # subscriptions whose filter ends at this node


class SubscriptionTrie(Generic[K, V]):
    """Filters -> {key: value}, matched against topic names.

    ``match`` walks one path per topic level plus the ``+`` and ``#`` branches, so its cost
    depends on the topic depth and the number of matches, not on how many filters exist.
    A key subscribed through several matching filters appears once per filter; callers that
    need one delivery per session merge them (highest QoS, all subscription identifiers).
    Filters are stored literally: strip ``$share/GROUP/`` before inserting.
    """

    __slots__ = ("_root", "_count")

    def __init__(self) -> None:
        self._root: _Node[K, V] = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def insert(self, topic_filter: str, key: K, value: V) -> None:
        """Add or replace the value for (filter, key)."""
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if key not in node.values:
            self._count += 1
        node.values[key] = value

    def remove(self, topic_filter: str, key: K) -> bool:
        """Remove (filter, key); False if it was not there. Prunes emptied branches."""
        path: list[tuple[_Node[K, V], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if key not in node.values:
            return False
        del node.values[key]
        self._count -= 1
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.values or child.children:
                break
            del parent.children[level]
        return True

    def get(self, topic_filter: str, key: K) -> V | None:
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return None
            node = child
        return node.values.get(key)

    def match(self, topic: str) -> list[tuple[K, V]]:
        """Every (key, value) whose filter matches ``topic``."""
        out: list[tuple[K, V]] = []
        levels = topic.split("/")
        n = len(levels)
        root = self._root
        # Depth 0 is special: a $-topic is not matched by a leading wildcard.
        frontier: list[_Node[K, V]]
        if topic.startswith("$"):
            child = root.children.get(levels[0])
            frontier = [child] if child is not None else []
        else:
            hash_node = root.children.get("#")
            if hash_node is not None:
                out.extend(hash_node.values.items())
            frontier = []
            child = root.children.get(levels[0])
            if child is not None:
                frontier.append(child)
            child = root.children.get("+")
            if child is not None:
                frontier.append(child)
        for i in range(1, n):
            if not frontier:
                return out
            level = levels[i]
            nxt: list[_Node[K, V]] = []
            for node in frontier:
                children = node.children
                if not children:
                    continue
                hash_node = children.get("#")
                if hash_node is not None:
                    out.extend(hash_node.values.items())
                child = children.get(level)
                if child is not None:
                    nxt.append(child)
                child = children.get("+")
                if child is not None:
                    nxt.append(child)
            frontier = nxt
        for node in frontier:
            if node.values:
                out.extend(node.values.items())
            hash_node = node.children.get("#")  # "a/#" also matches "a"
            if hash_node is not None:
                out.extend(hash_node.values.items())
        return out

    def items(self) -> Iterator[tuple[str, K, V]]:
        """Every (filter, key, value), depth first (for snapshots and debugging)."""
        stack: list[tuple[_Node[K, V], str | None]] = [(self._root, None)]
        while stack:
            node, prefix = stack.pop()
            for key, value in node.values.items():
                yield (prefix or ""), key, value
            for level, child in node.children.items():
                stack.append((child, level if prefix is None else f"{prefix}/{level}"))
