"""Retained topics as a trie of their levels, so a SUBSCRIBE finds its retained messages (pure).

``TopicState.retained`` (topic -> message) stays the state and what a snapshot encodes; this index
is derived from its keys, kept in step when a retained message is set or cleared, and rebuilt on
restore. A filter is matched by walking the trie level by level (one child for a literal level,
every child for ``+``, the whole subtree for ``#``), so its cost follows the matching topics and
the filter's depth, never the number of retained topics, and no topic is split again.

Matching follows ``moorline.mqtt.topics.matches``: ``#`` also matches the parent level, and a topic
whose first level starts with ``$`` is not matched by a filter starting with a wildcard
(MQTT-4.7.2-1). Results are sorted by topic, the order the scan it replaces gave.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class _Level:
    __slots__ = ("children", "topic")

    def __init__(self) -> None:
        self.children: dict[str, _Level] | None = None  # most nodes are leaves: no dict until needed
        self.topic: str | None = None  # the retained topic ending at this level


class RetainedIndex:
    """The set of retained topics, matched against topic filters."""

    __slots__ = ("_root", "_count")

    def __init__(self, topics: Iterable[str] = ()) -> None:
        self._root = _Level()
        self._count = 0
        for topic in topics:
            self.add(topic)

    def __len__(self) -> int:
        return self._count

    def add(self, topic: str) -> None:
        """``topic`` has a retained message (adding it twice is harmless)."""
        node = self._root
        for level in topic.split("/"):
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(level)
            if child is None:
                child = children[level] = _Level()
            node = child
        if node.topic is None:
            node.topic = topic
            self._count += 1

    def discard(self, topic: str) -> bool:
        """``topic`` has no retained message any more; False if it had none. Prunes emptied levels."""
        path: list[tuple[_Level, str]] = []
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level) if node.children is not None else None
            if child is None:
                return False
            path.append((node, level))
            node = child
        if node.topic is None:
            return False
        node.topic = None
        self._count -= 1
        for parent, level in reversed(path):
            child = parent.children[level]  # type: ignore[index]
            if child.topic is not None or child.children:
                break
            del parent.children[level]  # type: ignore[union-attr]
        return True

    def __iter__(self) -> Iterator[str]:
        """Every topic, in no particular order."""
        out: list[str] = []
        self._collect(self._root, out, skip_dollar=False)
        return iter(out)

    def match(self, topic_filter: str) -> list[str]:
        """The topics ``topic_filter`` (valid, not ``$share``) matches, sorted."""
        out: list[str] = []
        levels = topic_filter.split("/")
        last = len(levels)
        stack: list[tuple[_Level, int]] = [(self._root, 0)]
        while stack:
            node, i = stack.pop()
            if i == last:
                if node.topic is not None:
                    out.append(node.topic)
                continue
            level = levels[i]
            if level == "#":
                if node.topic is not None:
                    out.append(node.topic)  # "a/#" matches "a"
                self._collect_below(node, out, skip_dollar=i == 0)
                continue
            children = node.children
            if not children:
                continue
            if level == "+":
                for key, child in children.items():
                    if i == 0 and key[:1] == "$":
                        continue  # MQTT-4.7.2-1
                    stack.append((child, i + 1))
            else:
                exact = children.get(level)
                if exact is not None:
                    stack.append((exact, i + 1))
        out.sort()
        return out

    @staticmethod
    def _collect_below(node: _Level, out: list[str], skip_dollar: bool) -> None:
        """Every topic strictly below ``node``; at the root, none under a ``$`` first level."""
        children = node.children
        if not children:
            return
        if skip_dollar:
            level = [child for key, child in children.items() if key[:1] != "$"]
        else:
            level = list(children.values())
        append = out.append
        while level:  # level by level: a third faster here than a stack of single nodes
            below: list[_Level] = []
            extend = below.extend
            for n in level:
                if n.topic is not None:
                    append(n.topic)
                if n.children:
                    extend(n.children.values())
            level = below

    @classmethod
    def _collect(cls, node: _Level, out: list[str], skip_dollar: bool) -> None:
        if node.topic is not None:
            out.append(node.topic)
        cls._collect_below(node, out, skip_dollar)
