"""MQTT topic filters as regular expressions (pure), so Spark can match topics with ``rlike``.

Rules (MQTT 5 section 4.7): ``+`` matches one whole level, ``#`` (last level only) matches the
parent level and everything below it, and a filter starting with a wildcard never matches a topic
starting with ``$``.
"""

from __future__ import annotations

import re


def filter_to_regex(topic_filter: str) -> str:
    """A Java/Python-compatible regex (anchored) that matches exactly the topics the filter matches."""
    if topic_filter == "":
        raise ValueError("empty topic filter")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"'#' must be a whole last level: {topic_filter!r}")
        if "+" in level and level != "+":
            raise ValueError(f"'+' must be a whole level: {topic_filter!r}")
    parts: list[str] = []
    for i, level in enumerate(levels):
        if level == "#":
            # "a/#" matches "a" too: the separator before '#' is optional together with the rest.
            if i == 0:
                return "^(?!\\$).*$"
            prefix = "".join(parts)
            return f"^{prefix}(/.*)?$"
        sep = "/" if i > 0 else ""
        if level == "+":
            parts.append(sep + ("(?!\\$)[^/]*" if i == 0 else "[^/]*"))
        else:
            parts.append(re.escape(sep + level))
    return "^" + "".join(parts) + "$"


def matches(topic_filter: str, topic: str) -> bool:
    """Reference matcher used by tests (and by the harness to decide which subscriber expects what)."""
    return re.match(filter_to_regex(topic_filter), topic) is not None
