"""Pure parts of the data source: options, offset planning, canonical sequencing (no Spark, no IO)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moorline.hashing import shard_of
from moorline.spark.node_client import ShardInfo
from moorline.spark.options import MoorlineOptionError, parse_read_options, parse_write_options
from moorline.spark.planning import (
    MoorlineDataLossError,
    clamp_to_complete,
    latest_end,
    plan_ranges,
    relevant_shards,
    resolve_spec,
    topic_matches,
)
from moorline.spark.sequencing import make_row, sequenced_messages

SHARDS = {i: ShardInfo(i, f"inc{i}", 10 * i, 100 + 10 * i) for i in range(4)}


def pos(inc: str, off: int) -> dict[str, object]:
    return {"incarnation": inc, "offset": off}


def test_topic_matching_follows_mqtt() -> None:
    assert topic_matches("sensors/#", "sensors/a/b")
    assert topic_matches("sensors/#", "sensors")
    assert topic_matches("sensors/+/t", "sensors/a/t")
    assert not topic_matches("sensors/+/t", "sensors/a/b/t")
    assert not topic_matches("#", "$SYS/x")
    assert not topic_matches("sensors/a", "sensors/a/b")


def test_only_the_topics_own_shards_are_read_without_wildcards() -> None:
    assert relevant_shards(("a/b", "c"), 16) == sorted({shard_of("a/b", 16), shard_of("c", 16)})
    assert relevant_shards(("a/#",), 16) == list(range(16))


def test_options_reject_unknown_and_malformed() -> None:
    base = {"servers": "127.0.0.1:1", "topics": "a/#"}
    with pytest.raises(MoorlineOptionError, match="unknown option.*bogus"):
        parse_read_options({**base, "bogus": "1"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match="startingOffsets.*JSON"):
        parse_read_options({**base, "startingOffsets": "{nope"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match="HOST:PORT"):
        parse_read_options({**base, "servers": "localhost"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match="not a valid MQTT topic filter"):
        parse_read_options({**base, "topics": "a/#/b"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match="batch reads"):
        parse_read_options({**base, "endingOffsets": "latest"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match="qos"):
        parse_write_options({"servers": "127.0.0.1:1", "qos": "3"})
    o = parse_read_options(
        {**base, "STARTINGOFFSETS": '{"1": {"offset": 12}}', "maxOffsetsPerTrigger": "5"}, True
    )
    assert o.starting.per_shard == {1: (None, 12)} and o.max_offsets_per_trigger == 5


def test_resolve_and_clamp() -> None:
    o = parse_read_options(
        {"servers": "h:1", "topics": "#", "startingOffsets": '{"1": 3, "2": {"offset": 25}}'}, True
    )
    start = resolve_spec(o.starting, SHARDS, [0, 1, 2, 3], True, "startingOffsets")
    assert start["0"] == pos("inc0", 0) and start["2"] == pos("inc2", 25) and start["3"] == pos("inc3", 30)
    with pytest.raises(MoorlineDataLossError, match="earliest complete offset is 10"):
        clamp_to_complete(start, SHARDS, fail_on_data_loss=True)
    skipped = clamp_to_complete(start, SHARDS, fail_on_data_loss=False)
    assert skipped["1"] == pos("inc1", 10)
    rebuilt = clamp_to_complete({"2": pos("old", 50)}, SHARDS, fail_on_data_loss=False)
    assert rebuilt["2"] == pos("inc2", 20)
    with pytest.raises(MoorlineDataLossError, match="rebuilt"):
        clamp_to_complete({"2": pos("old", 50)}, SHARDS, fail_on_data_loss=True)


@given(st.lists(st.integers(0, 500), min_size=1, max_size=6), st.integers(1, 1000))
def test_trigger_budget_is_exact_and_within_backlog(backlogs: list[int], budget: int) -> None:
    shards = {i: ShardInfo(i, "x", 0, b) for i, b in enumerate(backlogs)}
    start = {str(i): pos("x", 0) for i in shards}
    end = latest_end(start, shards, budget)
    taken = [int(end[str(i)]["offset"]) for i in shards]  # type: ignore[call-overload]
    assert all(0 <= t <= b for t, b in zip(taken, backlogs, strict=True))
    assert sum(taken) == min(budget, sum(backlogs))


def test_plan_ranges_cut_or_fail_below_low_water() -> None:
    start = {"1": pos("inc1", 5), "2": pos("inc2", 40)}
    end = {"1": pos("inc1", 50), "2": pos("inc2", 60)}
    with pytest.raises(MoorlineDataLossError, match="earliest complete offset is 10"):
        plan_ranges(start, end, SHARDS, fail_on_data_loss=True)
    ranges = plan_ranges(start, end, SHARDS, fail_on_data_loss=False)
    assert [(r.shard, r.start, r.end) for r in ranges] == [(1, 10, 50), (2, 40, 60)]


def test_canonical_sequencing_ignores_row_order_and_numbers_per_shard() -> None:
    rows = [
        make_row(f"t/{i % 9}", f"p{i % 13}".encode(), None, None, {"k": str(i % 3)}, None, 1)
        for i in range(300)
    ]
    shuffled = rows[:]
    random.Random(7).shuffle(shuffled)
    a = sequenced_messages(rows, 16, "query-1", 3, 5)
    b = sequenced_messages(shuffled, 16, "query-1", 3, 5)
    assert a == b
    per_shard: dict[int, list[int]] = {}
    for m in a:
        per_shard.setdefault(shard_of(m["topic"], 16), []).append(m["seq"])
    for seqs in per_shard.values():
        assert seqs == [(5 << 32) | n for n in range(len(seqs))]
    # the next batch starts above every sequence of this one
    c = sequenced_messages(rows, 16, "query-1", 3, 6)
    assert min(m["seq"] for m in c) > max(m["seq"] for m in a)
    # GUIDs (producer ‖ seq) are unique across shards
    assert len({(m["producer"], m["seq"]) for m in a}) == len(a)
    assert len({m["producer"] for m in a}) == len(per_shard)


def test_reserved_user_properties_are_refused() -> None:
    from moorline.spark.sequencing import MoorlineRowError

    with pytest.raises(MoorlineRowError, match="reserved"):
        make_row("t", b"x", None, None, {"guid": "1"}, None, 1)
    with pytest.raises(MoorlineRowError, match="wildcard"):
        make_row("t/#", b"x", None, None, None, None, 1)


class StubClient:
    """Answers publish requests from a script of per-message statuses."""

    def __init__(self, script: list[list[str]]) -> None:
        self.script = script
        self.requests: list[list[dict[str, object]]] = []

    def publish(self, messages: list[dict[str, object]]) -> list[dict[str, object]]:
        self.requests.append(messages)
        statuses = self.script.pop(0)
        return [{"status": st, "shard": 0, "offset": i, "reason": "full"} for i, st in enumerate(statuses)]


def test_refused_rows_are_resent_in_order_and_a_sequence_hole_fails() -> None:
    from typing import cast

    from moorline.spark.node_client import NodeClient
    from moorline.spark.options import parse_write_options
    from moorline.spark.writer import MoorlinePublishError, publish_all

    opts = parse_write_options({"servers": "h:1", "publishRetries": "3"})
    msgs: list[dict[str, object]] = [{"topic": "t", "seq": i} for i in range(4)]
    stub = StubClient(
        [
            ["ok", "refused", "refused", "refused"],
            ["refused", "refused", "refused"],
            ["ok", "duplicate", "ok"],
        ]
    )
    assert publish_all(cast(NodeClient, stub), msgs, opts, sequenced=True) == (3, 1)
    assert [[m["seq"] for m in r] for r in stub.requests] == [[0, 1, 2, 3], [1, 2, 3], [1, 2, 3]]
    hole = StubClient([["ok", "refused", "ok", "ok"]])
    with pytest.raises(MoorlinePublishError, match="after refusing an earlier one"):
        publish_all(cast(NodeClient, hole), msgs, opts, sequenced=True)
    never = StubClient([["refused"] * 4] * 4)
    with pytest.raises(MoorlinePublishError, match="refused after 4 attempts"):
        publish_all(cast(NodeClient, never), msgs, opts, sequenced=True)


def test_an_unknown_option_suggests_the_closest_known_one() -> None:
    base = {"servers": "127.0.0.1:1", "topics": "a/#"}
    with pytest.raises(MoorlineOptionError, match=r'"startingOffset" \(did you mean "startingOffsets"\?\)'):
        parse_read_options({**base, "startingOffset": "earliest"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match=r'"maxoffsetpertrigger" \(did you mean "maxOffsetsPerTrigger"\?\)'):
        parse_read_options({**base, "maxoffsetpertrigger": "5"}, streaming=True)
    with pytest.raises(MoorlineOptionError, match=r'"topics" \(did you mean "topic"\?\)'):
        parse_write_options({"servers": "127.0.0.1:1", "topics": "out/a"})
    with pytest.raises(MoorlineOptionError) as err:
        parse_read_options({**base, "zzz": "1"}, streaming=True)
    assert "did you mean" not in str(err.value) and '"zzz"' in str(err.value)


def test_ending_offsets_past_the_end_read_to_the_end_and_are_not_data_loss() -> None:
    o = parse_read_options({"servers": "h:1", "topics": "#", "endingOffsets": '{"1": 5000}'}, streaming=False)
    end = resolve_spec(o.ending, SHARDS, [0, 1], True, "endingOffsets")
    assert end["1"] == pos("inc1", SHARDS[1].next_offset)
    s = parse_read_options({"servers": "h:1", "topics": "#", "startingOffsets": '{"1": 5000}'}, streaming=True)
    with pytest.raises(MoorlineOptionError, match="past the shard's end") as err:
        resolve_spec(s.starting, SHARDS, [0, 1], True, "startingOffsets")
    assert not isinstance(err.value, MoorlineDataLossError)


def test_starting_timestamp_options_follow_kafkas_precedence() -> None:
    base = {"servers": "h:1", "topics": "#", "startingOffsets": "latest"}
    by_shard = parse_read_options({**base, "startingOffsetsByTimestamp": '{"0": 1000, "3": 2000}'}, True)
    assert by_shard.starting.kind == "timestamp" and by_shard.starting.timestamps == {0: 1000, 3: 2000}
    both = parse_read_options(
        {**base, "startingOffsetsByTimestamp": '{"0": 1000}', "startingTimestamp": "5000"}, True
    )
    assert both.starting.default_timestamp == 5000 and both.starting.timestamps == {}
    with pytest.raises(MoorlineOptionError, match="startingOffsetsByTimestamp.*JSON"):
        parse_read_options({**base, "startingOffsetsByTimestamp": "yesterday"}, True)
    with pytest.raises(MoorlineOptionError, match="not a time in ms"):
        parse_read_options({**base, "startingOffsetsByTimestamp": '{"0": "noon"}'}, True)
    with pytest.raises(MoorlineOptionError, match="startingTimestamp.*not an integer"):
        parse_read_options({**base, "startingTimestamp": "noon"}, True)


@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=300),
    st.integers(-5, 700),
)
def test_first_offset_by_publish_time_is_a_bounded_binary_search(
    layout: list[tuple[bool, int]], t_ms: int
) -> None:
    """Offsets 10..10+n, some released (absent); publish times grow with offsets."""
    from moorline.spark.planning import first_offset_at_or_after

    low, times, now = 10, {}, 0
    for i, (present, step) in enumerate(layout):
        now += step
        if present:
            times[low + i] = now
    high = low + len(layout)

    def first_at(o: int) -> tuple[int, int] | None:
        later = [x for x in sorted(times) if x >= o]
        return (later[0], times[later[0]]) if later else None

    def brute() -> int:
        for o in range(low, high + 1):
            found = first_at(o)
            if found is None or found[1] >= t_ms:
                return o
        raise AssertionError("high always qualifies")

    offset, probes = first_offset_at_or_after(t_ms, low, high, first_at)
    assert offset == brute()
    assert probes <= max(1, len(layout)).bit_length() + 1


def test_spark_workers_get_this_interpreter_unless_the_user_chose_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from moorline.spark.interpreter import use_running_python

    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", "/opt/mine/python")
    assert use_running_python() == {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": "/opt/mine/python"}


def test_pyspark_moorline_is_shipped_and_names_the_source() -> None:
    """PySpark's lookup imports top-level pyspark_* modules and registers their DefaultSource."""
    import tomllib
    from pathlib import Path

    from pyspark.sql.datasource import DataSource

    import pyspark_moorline

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "pyspark_moorline" in pyproject["tool"]["setuptools"]["py-modules"]
    assert issubclass(pyspark_moorline.DefaultSource, DataSource)
    assert pyspark_moorline.DefaultSource.name() == "moorline"
