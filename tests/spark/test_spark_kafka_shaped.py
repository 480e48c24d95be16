"""What a Kafka-source user expects: format("moorline") without a register call, starting by
publish time, ending offsets past the end, errors that say what to do, workers on this interpreter."""

from __future__ import annotations

import json
import sys
import time
from base64 import b64decode
from pathlib import Path
from typing import Any

import pytest
from spark_helpers import Broker, wait_for

pytestmark = pytest.mark.spark


def payloads(rows: list[Any]) -> list[bytes]:
    return sorted(bytes(r["payload"]) for r in rows)


def test_format_moorline_works_in_a_session_that_registered_nothing(spark: Any, broker: Broker) -> None:
    """PySpark's lookup of pyspark_* modules registers DefaultSource: a new session (whose data
    source registry is its own) reads through format("moorline") on the driver and executors."""
    expected = [f"lk-{i}".encode() for i in range(40)]
    broker.publish([(f"lookup/{i % 5}", p) for i, p in enumerate(expected)])
    fresh = spark.newSession()
    rows = fresh.read.format("moorline").option("servers", broker.http).option("topics", "lookup/#").load().collect()
    assert payloads(rows) == sorted(expected)
    # The registered class keeps working next to the looked-up one.
    rows = spark.read.format("moorline").option("servers", broker.http).option("topics", "lookup/#").load().collect()
    assert payloads(rows) == sorted(expected)


def test_spark_workers_run_the_driver_interpreter(spark: Any) -> None:
    seen = spark.sparkContext.parallelize(range(2), 2).map(lambda _: sys.executable).distinct().collect()
    assert seen == [sys.executable]


def test_starting_offsets_by_publish_time(spark: Any, broker: Broker, tmp_path: Path) -> None:
    """startingTimestamp (batch) and startingOffsetsByTimestamp (stream): only messages published
    at or after the time are read; a shard not listed starts at earliest."""
    before = [(f"ts/{i % 7}", f"old-{i}".encode()) for i in range(60)]
    broker.publish(before)
    time.sleep(0.05)
    t_ms = int(time.time() * 1000)
    time.sleep(0.05)
    after = [(f"ts/{i % 7}", f"new-{i}".encode()) for i in range(60)]
    broker.publish(after)

    def read(**opts: str) -> list[bytes]:
        r = spark.read.format("moorline").option("servers", broker.http).option("topics", "ts/#")
        for k, v in opts.items():
            r = r.option(k, v)
        return payloads(r.load().collect())

    assert read(startingTimestamp=str(t_ms)) == sorted(p for _, p in after)
    assert read(startingTimestamp=str(t_ms + 3_600_000)) == []  # nothing that late: start at the end

    shards = broker.request("GET", "/v1/shards")["shards"]
    listed, *unlisted = sorted({_shard_of(shards, t) for t, _ in before})
    q = (
        spark.readStream.format("moorline")
        .option("servers", broker.http)
        .option("topics", "ts/#")
        .option("startingOffsetsByTimestamp", json.dumps({str(listed): t_ms}))
        .load()
        .writeStream.format("memory")
        .queryName("by_timestamp")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(120) and q.exception() is None
    got = spark.sql("select shard, payload from by_timestamp").collect()
    from_listed = sorted(bytes(r["payload"]) for r in got if r["shard"] == listed)
    assert from_listed and all(p.startswith(b"new-") for p in from_listed)
    assert {r["shard"] for r in got if bytes(r["payload"]).startswith(b"old-")} <= set(unlisted)
    assert len(got) == len(after) + sum(1 for t, _ in before if _shard_of(shards, t) != listed)


def _shard_of(shards: list[dict[str, Any]], topic: str) -> int:
    from moorline.hashing import shard_of

    return shard_of(topic, len(shards))


def test_ending_offsets_past_the_end_and_an_empty_range(spark: Any, broker: Broker) -> None:
    items = [(f"end/{i % 3}", f"e-{i}".encode()) for i in range(30)]
    broker.publish(items)
    shards = broker.request("GET", "/v1/shards")["shards"]
    past = {str(s["shard"]): s["next_offset"] + 1000 for s in shards}
    base = spark.read.format("moorline").option("servers", broker.http).option("topics", "end/#")
    rows = base.option("endingOffsets", json.dumps(past)).load().collect()
    assert payloads(rows) == sorted(p for _, p in items)
    # Nothing to read (start at the end): an empty result, not a failure.
    assert base.option("startingOffsets", "latest").load().count() == 0


def test_sink_errors_say_what_to_do_and_come_before_any_task(
    spark: Any, fake_broker: Broker, tmp_path: Path
) -> None:
    from pyspark.sql import functions as F

    fake = fake_broker.fake
    assert fake is not None
    rate = spark.readStream.format("rate").option("rowsPerSecond", 5).load()

    # A wildcard in the sink's topic option: the query fails while starting, before any task.
    q = (
        rate.select(F.col("value").cast("string").alias("payload"))
        .writeStream.format("moorline")
        .option("servers", fake_broker.http)
        .option("topic", "out/#")
        .option("checkpointLocation", str(tmp_path / "wild"))
        .start()
    )
    wait_for(lambda: not q.isActive, 60, "the query to fail")
    assert 'option "topic": \'out/#\' is not a valid topic name (no wildcards)' in str(q.exception())
    assert q.lastProgress is None and fake.publish_requests == 0

    # outputMode("complete") and ("update"): one wording, "moorline does not support <mode> mode".
    counts = rate.groupBy((F.col("value") % 2).alias("k")).count()
    out = counts.select(F.lit("out/c").alias("topic"), F.col("count").cast("string").alias("payload"))
    texts = []
    for mode in ("complete", "update"):
        q = (
            out.writeStream.format("moorline")
            .option("servers", fake_broker.http)
            .option("checkpointLocation", str(tmp_path / mode))
            .outputMode(mode)
            .start()
        )
        wait_for(lambda q=q: not q.isActive, 60, f"the {mode} query to fail")
        texts.append(str(q.exception()))
    assert "moorline does not support Complete mode" in texts[0] and 'outputMode("append")' in texts[0]
    assert "moorline does not support Update mode" in texts[1]

    # df.write: without a mode Spark refuses (ErrorIfExists) naming Append; overwrite says use append.
    df = spark.createDataFrame([("out/w", "x")], "topic string, payload string")
    with pytest.raises(Exception, match="Append"):
        df.write.format("moorline").option("servers", fake_broker.http).save()
    with pytest.raises(Exception, match=r'use mode\("append"\)'):
        df.write.format("moorline").option("servers", fake_broker.http).mode("overwrite").save()
    df.write.format("moorline").option("servers", fake_broker.http).mode("append").save()
    assert [b64decode(m["payload"]) for m in fake.all_messages()] == [b"x"]
    assert fake.publish_requests == 1
