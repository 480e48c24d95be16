"""The history writer and the topic-filter regexes (pure, no Spark)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from moorline.verify.history import FIELDS, HistoryWriter, arrow_schema
from moorline.verify.topics import filter_to_regex, matches


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+", "a", False),
        ("a/+", "a/", True),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("a/#", "ab", False),
        ("#", "x/y", True),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("+/+", "a/b", True),
        ("a.b/+", "aXb/c", False),
    ],
)
def test_verify_filter_regex_follows_mqtt_matching(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic_filter, topic) is expected


@pytest.mark.parametrize("bad", ["", "a/#/b", "a#", "a+/b"])
def test_verify_invalid_filters_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        filter_to_regex(bad)


def test_verify_filter_regex_is_java_compatible_shape() -> None:
    # Spark evaluates these with java.util.regex: only constructs both engines share.
    rx = filter_to_regex("a.b/+/#")
    assert re.fullmatch(r"[\^\w\\./()?!*\[\]$|+-]*", rx), rx


def test_verify_history_writer_orders_index_and_time_across_threads(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path, run="r", flush_every=7) as h:

        def work(n: int) -> None:
            for i in range(200):
                h.record("invoke", "publish", process=f"p{n}", guid=f"{n:016x}{i:016x}", topic="t", qos=1)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(800))
    assert all(a["mono_ns"] <= b["mono_ns"] for a, b in zip(rows, rows[1:], strict=False))
    assert {r["run"] for r in rows} == {"r"} and len({r["guid"] for r in rows}) == 800


def test_verify_history_writer_rejects_unknown_fields_and_kinds(tmp_path: Path) -> None:
    with HistoryWriter(tmp_path / "h.jsonl", run="r") as h:
        with pytest.raises(ValueError):
            h.record("ok", "publish", colour="red")
        with pytest.raises(ValueError):
            h.record("maybe", "publish")
        with pytest.raises(ValueError):
            h.record("ok", "teleport")


def test_verify_arrow_schema_matches_fields() -> None:
    assert [f.name for f in arrow_schema()] == [name for name, _ in FIELDS]
