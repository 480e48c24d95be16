"""Reads across retention (fail or skip), batch reads/writes, and option errors seen through Spark."""

from __future__ import annotations

import json
import time
from base64 import b64decode
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from spark_helpers import Broker, wait_for

pytestmark = pytest.mark.spark


def read_once(spark: Any, broker: Broker, out: Path, ckpt: Path, **opts: str) -> Any:
    r = spark.readStream.format("moorline").option("servers", broker.http).option("topics", "ret/#")
    r = r.option("startingOffsets", "earliest")
    for k, v in opts.items():
        r = r.option(k, v)
    q = (
        r.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(ckpt))
    )
    return q.trigger(availableNow=True).start()


def test_checkpoint_below_the_complete_range(spark: Any, fake_broker: Broker, tmp_path: Path) -> None:
    """Retention removed rows the checkpoint still needs (the pin lapsed): the query fails naming
    the earliest complete offset; with failOnDataLoss=false it skips to it and reads the rest once."""
    b, fake = fake_broker, fake_broker.fake
    assert fake is not None
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = [(f"ret/{i % 3}", f"a-{i:04d}".encode()) for i in range(300)]
    b.publish(first)
    q = read_once(spark, b, out, ckpt)
    assert q.awaitTermination(120) and q.exception() is None
    assert fake.pins, "the reader pins what it plans"
    second = [(f"ret/{i % 3}", f"b-{i:04d}".encode()) for i in range(300)]
    b.publish(second)
    shards = b.request("GET", "/v1/shards")["shards"]
    for s in shards:
        if s["next_offset"] > 0:
            fake.raise_low_water(s["shard"], s["next_offset"] - 40)
    lows = {s["shard"]: s["low_water"] for s in b.request("GET", "/v1/shards")["shards"] if s["low_water"]}
    q = read_once(spark, b, out, ckpt)
    with pytest.raises(Exception, match="earliest complete offset is") as err:
        q.awaitTermination(120)
    assert any(f"earliest complete offset is {low}" in str(err.value) for low in lows.values())
    q = read_once(spark, b, out, ckpt, failOnDataLoss="false")
    assert q.awaitTermination(120) and q.exception() is None
    rows = spark.read.parquet(str(out)).select("payload", "shard", "offset").collect()
    got = Counter(bytes(r["payload"]) for r in rows)
    assert max(got.values()) == 1
    survivors = {b64decode(m["payload"]) for m in b.read_all("ret/")}
    assert set(got) == {p for _, p in first} | survivors
    assert all(r["offset"] >= lows.get(r["shard"], 0) or bytes(r["payload"]).startswith(b"a-") for r in rows)
    assert len(survivors) == 40 * len(lows)


def test_real_node_pins_hold_retention_and_loss_is_reported(
    spark: Any, short_retention_node: Broker, tmp_path: Path
) -> None:
    """Real node, retention.min_age = 1 s: the query's pin keeps unread rows; once the pin is gone
    retention removes them and the restarted query fails naming the earliest complete offset."""
    b = short_retention_node
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    expected: set[bytes] = set()
    for run in range(3):  # the first run reads nothing but plants the query's pin
        q = read_once(spark, b, out, ckpt, readerId="ret-test")
        assert q.awaitTermination(120) and q.exception() is None
        got = Counter(bytes(r["payload"]) for r in spark.read.parquet(str(out)).select("payload").collect())
        assert set(got) == expected and max(got.values(), default=1) == 1, (
            f"run {run}: a pinned row was lost or read twice"
        )
        batch = [(f"ret/{i % 3}", f"{run}-{i:04d}".encode()) for i in range(200)]
        b.publish(batch)
        expected |= {p for _, p in batch}
        time.sleep(1.8)  # past min_age (1 s) plus housekeeping: only the pin keeps these rows
    b.request("DELETE", "/v1/pins/ret-test")  # as if the query stayed down past pinTtlMs
    wait_for(
        lambda: any(s["low_water"] > 400 // 3 for s in b.request("GET", "/v1/shards")["shards"]),
        30,
        "retention",
    )
    q = read_once(spark, b, out, ckpt, readerId="ret-test")
    with pytest.raises(Exception, match="earliest complete offset is"):
        q.awaitTermination(120)


def test_batch_read_of_a_bounded_range(spark: Any, broker: Broker) -> None:
    broker.publish([(f"br/{i % 4}", f"r-{i}".encode()) for i in range(200)])
    shards = broker.request("GET", "/v1/shards")["shards"]
    start = {str(s["shard"]): {"offset": s["next_offset"]} for s in shards}
    res = broker.publish([(f"br/{i % 4}", f"s-{i}".encode()) for i in range(100)])
    end = {str(r["shard"]): {"offset": 0} for r in res}
    for r in res:
        end[str(r["shard"])]["offset"] = max(end[str(r["shard"])]["offset"], r["offset"] + 1)
    df = (
        spark.read.format("moorline")
        .option("servers", broker.http)
        .option("topics", "br/#")
        .option("startingOffsets", json.dumps(start))
        .option("endingOffsets", json.dumps({k: v for k, v in end.items()}))
        .load()
    )
    payloads = sorted(bytes(r["payload"]) for r in df.select("payload").collect())
    assert payloads == sorted(f"s-{i}".encode() for i in range(100))


def test_batch_write_key_column_is_exactly_once_and_plain_is_not(spark: Any, broker: Broker) -> None:
    rows = [(f"bw/{i % 3}", f"k-{i}", f"v-{i}") for i in range(120)]
    df = spark.createDataFrame(rows, "topic string, key string, value string").repartition(3)
    for _ in range(2):
        df.write.format("moorline").mode("append").option("servers", broker.http).option(
            "keyColumn", "key"
        ).save()
    keyed = Counter(b64decode(m["payload"]) for m in broker.read_all("bw/"))
    assert len(keyed) == 120 and max(keyed.values()) == 1
    plain = spark.createDataFrame([("v",)], "value string")
    for _ in range(2):
        plain.write.format("moorline").mode("append").option("servers", broker.http).option(
            "topic", "bw2/x"
        ).save()
    assert len(broker.read_all("bw2/")) == 2, (
        "a re-run batch job without a key column publishes again (documented)"
    )


def test_option_errors_are_clear(spark: Any, broker: Broker) -> None:
    base = spark.read.format("moorline").option("servers", broker.http).option("topics", "x/#")
    with pytest.raises(Exception, match="unknown option.*tpoics"):
        spark.read.format("moorline").option("servers", broker.http).option("tpoics", "x").load()
    with pytest.raises(Exception, match="startingOffsets.*JSON"):
        base.option("startingOffsets", "{not json").load().count()
    with pytest.raises(Exception, match="no moorline server answered"):
        spark.read.format("moorline").option("servers", "127.0.0.1:1").option("topics", "x").load().count()
    with pytest.raises(Exception, match='"payload" or "value" column'):
        spark.createDataFrame([("a",)], "topic string").write.format("moorline").mode("append").option(
            "servers", broker.http
        ).save()
    with pytest.raises(Exception, match="maxOffsetsPerTrigger.*streaming"):
        base.option("maxOffsetsPerTrigger", "10").load().count()
