"""A stream's first start races retention: rows removed between reading the shards and pinning the
start were never promised to the query, so "earliest" is planned again under the pin and the first
batch does not fail as data loss (no Spark needed: the stream reader is driven directly)."""

from __future__ import annotations

import json
from base64 import b64encode
from typing import Any

from fake_broker import FakeBroker

from moorline.spark.options import parse_read_options
from moorline.spark.planning import get_pos
from moorline.spark.reader import MoorlineStreamReader


def test_retention_between_plan_and_pin_is_not_data_loss() -> None:
    fb = FakeBroker(shard_count=4).start()
    try:
        fb.publish({"messages": [{"topic": f"race/{i % 4}", "payload": b64encode(f"p{i}".encode()).decode()} for i in range(40)]})
        shards = {s["shard"]: s for s in fb.shards_doc()["shards"]}
        busy = [s for s, doc in shards.items() if doc["next_offset"] >= 3]
        assert busy, shards
        fired: list[dict[str, Any]] = []

        def retention_runs_first(doc: dict[str, Any]) -> None:
            if not fired:  # the housekeeping pass lands just before the first pin
                fired.append(doc)
                for s in busy:
                    fb.raise_low_water(s, 2)

        fb.on_pin = retention_runs_first
        opts = parse_read_options({"servers": fb.address, "topics": "race/#", "startingOffsets": "earliest"}, True)
        reader = MoorlineStreamReader(opts)
        start = reader.initialOffset()
        assert fired, "the hook ran"
        for s in busy:
            pos = get_pos(start, s)
            assert pos is not None and pos[1] == 2, (s, start)
            assert fb.pins[reader.reader_id][str(s)] == 2
        end = reader.latestOffset(start, None)  # raised MoorlineDataLossError before the re-plan
        assert end != start
    finally:
        fb.stop()


def test_explicit_start_removed_by_retention_still_fails() -> None:
    """The re-plan is for "earliest" moving under us; an explicit start that is gone stays an error."""
    fb = FakeBroker(shard_count=4).start()
    try:
        fb.publish({"messages": [{"topic": f"race/{i % 4}", "payload": b64encode(f"p{i}".encode()).decode()} for i in range(40)]})
        shard = next(s["shard"] for s in fb.shards_doc()["shards"] if s["next_offset"] >= 3)
        inc = next(s["incarnation"] for s in fb.shards_doc()["shards"] if s["shard"] == shard)
        fb.on_pin = lambda doc: fb.raise_low_water(shard, 2)
        spec = json.dumps({str(shard): {"incarnation": inc, "offset": 0}})
        opts = parse_read_options({"servers": fb.address, "topics": "race/#", "startingOffsets": spec}, True)
        reader = MoorlineStreamReader(opts)
        try:
            reader.latestOffset(reader.initialOffset(), None)
        except Exception as e:  # noqa: BLE001 - the message is what the user sees
            assert "earliest complete offset is 2" in str(e)
        else:
            raise AssertionError("an explicit start below the complete range was accepted")
    finally:
        fb.stop()
