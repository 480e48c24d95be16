"""Streaming writes into moorline: exactly-once across task retries and a stop between the sink
commit and the checkpoint commit."""

from __future__ import annotations

from base64 import b64decode
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from spark_helpers import FAILPOINT_DIR, Broker, MqttCollector, arm_failpoint, wait_for

from moorline.spark.failpoints import marked

pytestmark = pytest.mark.spark


def source(spark: Any, broker: Broker, topics: str) -> Any:
    return (
        spark.readStream.format("moorline")
        .option("servers", broker.http)
        .option("topics", topics)
        .option("startingOffsets", "earliest")
        .load()
    )


def exactly_once(expected: list[bytes], got: list[bytes], what: str) -> None:
    counts = Counter(got)
    dupes = [p for p, c in counts.items() if c > 1]
    missing = set(expected) - set(counts)
    unexpected = set(counts) - set(expected)
    assert not dupes, f"{what}: {len(dupes)} duplicated, e.g. {dupes[:3]}"
    assert not missing, f"{what}: {len(missing)} missing, e.g. {sorted(missing)[:3]}"
    assert not unexpected, f"{what}: {len(unexpected)} unexpected"


def test_stream_write_after_shuffle_with_task_retry(spark: Any, broker: Broker, tmp_path: Path) -> None:
    """A keyed shuffle (row order per task varies between attempts) -> moorline sink; one
    task fails after publishing its first chunk and is retried (local[2,3]). Every row is in
    moorline once: checked through the fetch API and, with a real node, an MQTT subscriber."""
    from pyspark.sql import functions as F

    expected = [f"w-{i:05d}".encode() for i in range(1500)]
    broker.publish([(f"in/{i % 7}", p) for i, p in enumerate(expected)])
    sub = MqttCollector(broker.mqtt, "out/#") if broker.mqtt else None
    failpoint = arm_failpoint("write_after_first_chunk")
    q = (
        source(spark, broker, "in/#")
        .dropDuplicates(
            ["guid"]
        )  # a keyed shuffle (a groupBy on guid); Spark's Python sinks take append mode only
        .select(F.concat(F.lit("out/"), F.col("topic")).alias("topic"), "payload")
        .writeStream.format("moorline")
        .option("servers", broker.http)
        .option("publishBatchSize", "50")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(240), "the query did not finish"
        assert q.exception() is None, q.exception()
        assert not failpoint.exists(), "the injected task failure did not fire"
        stored = broker.read_all("out/")
        exactly_once(expected, [b64decode(m["payload"]) for m in stored], "stored")
        assert all(m["topic"].startswith("out/in/") for m in stored)
        if sub is not None:
            wait_for(lambda: len(sub.got) >= len(expected), 60, "MQTT deliveries")
            exactly_once(expected, [p for _, p, _ in sub.got], "delivered over MQTT")
            guids = [g for _, _, g in sub.got]
            assert None not in guids and len(set(guids)) == len(guids)
    finally:
        if sub is not None:
            sub.close()


def test_stream_write_stopped_between_sink_commit_and_checkpoint(
    spark: Any, broker: Broker, tmp_path: Path
) -> None:
    """The writer's commit() sets the sink marker, then the query dies before Spark's commit log
    is written. The restarted query re-runs the batch; the marker makes it publish nothing."""
    from pyspark.sql import functions as F

    expected = [f"c-{i:05d}".encode() for i in range(600)]
    broker.publish([(f"in2/{i % 5}", p) for i, p in enumerate(expected)])
    ckpt = tmp_path / "ckpt"

    def run() -> Any:
        return (
            source(spark, broker, "in2/#")
            .select(F.concat(F.lit("out2/"), F.col("topic")).alias("topic"), "payload", "user_properties")
            .writeStream.format("moorline")
            .option("servers", broker.http)
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start()
        )

    (Path(FAILPOINT_DIR) / "mark-skipped_committed_batch").unlink(missing_ok=True)
    arm_failpoint("commit_after_marker")
    q = run()
    with pytest.raises(Exception, match="commit_after_marker"):
        q.awaitTermination(240)
    assert not (ckpt / "commits" / "0").exists(), "batch 0 must be uncommitted in the checkpoint"
    assert broker.request("GET", f"/v1/sink-markers/{q.id}")["batch_id"] == 0
    exactly_once(expected, [b64decode(m["payload"]) for m in broker.read_all("out2/")], "first run")
    requests_before = broker.fake.publish_requests if broker.fake else None
    assert not marked("skipped_committed_batch")
    q = run()
    assert q.awaitTermination(240)
    assert q.exception() is None, q.exception()
    assert (ckpt / "commits" / "0").exists()
    assert marked("skipped_committed_batch"), "the replayed batch was not skipped by the sink marker"
    if broker.fake is not None:
        assert broker.fake.publish_requests == requests_before, "a committed batch was published again"
    exactly_once(expected, [b64decode(m["payload"]) for m in broker.read_all("out2/")], "after restart")
    assert not [p for p in Path(FAILPOINT_DIR).iterdir() if not p.name.startswith("mark-")]
