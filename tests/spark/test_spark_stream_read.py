"""Streaming reads into a parquet sink survive crashes and restarts with every message exactly once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import Broker, arm_failpoint, wait_for, wait_query

pytestmark = pytest.mark.spark


def start_query(spark: Any, broker: Broker, out: Path, ckpt: Path, **opts: str) -> Any:
    reader = spark.readStream.format("moorline").option("servers", broker.http).option("topics", "sensors/#")
    for k, v in opts.items():
        reader = reader.option(k, v)
    return (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(ckpt))
        .trigger(processingTime="1 second")
        .start()
    )


def test_stream_read_crash_and_restart_exactly_once(spark: Any, broker: Broker, tmp_path: Path) -> None:
    """Publishers run while the query is failed mid-batch (after its offsets were logged) and
    later stopped mid-flight; each restart resumes from the checkpoint. The parquet sink ends with
    every published message exactly once."""
    from moorline.spark.failpoints import fires  # noqa: F401 (documents where the failpoint lives)

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    published: list[bytes] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def publisher() -> None:
        try:
            n = 0
            while not stop.is_set() and n < 6000:
                batch = [(f"sensors/{i % 11}/t", f"m-{n + i:06d}".encode()) for i in range(150)]
                broker.publish(batch)
                published.extend(p for _, p in batch)
                n += len(batch)
                time.sleep(0.05)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    broker.publish([("other/x", b"not read")])
    pub = threading.Thread(target=publisher, daemon=True)
    pub.start()
    # Run 1: the query dies in partitions(), after batch offsets were written to the checkpoint.
    q = start_query(spark, broker, out, ckpt, startingOffsets="earliest", maxOffsetsPerTrigger="700")
    wait_query(q, lambda: q.lastProgress is not None and q.lastProgress["batchId"] >= 1, 120, "two batches")
    arm_failpoint("stream_partitions")
    wait_for(lambda: not q.isActive, 60, "the injected planning failure")
    assert q.exception() is not None and "stream_partitions" in str(q.exception())
    # Run 2: restart; stop it while publishers keep going.
    q = start_query(spark, broker, out, ckpt, startingOffsets="latest", maxOffsetsPerTrigger="700")
    wait_query(q, lambda: q.lastProgress is not None and q.lastProgress["numInputRows"] > 0, 120, "a batch after restart")
    q.stop()
    stop.set()
    pub.join(timeout=60)
    assert not errors, errors
    # Run 3: drain everything still pending, then compare.
    q = start_query(spark, broker, out, ckpt)
    total = len(published)

    def drained() -> bool:
        return spark.read.parquet(str(out)).count() >= total

    wait_query(q, drained, 180, f"{total} rows in the sink")
    q.stop()
    rows = spark.read.parquet(str(out)).select("payload", "topic", "offset", "shard", "guid").collect()
    counts = Counter(bytes(r["payload"]) for r in rows)
    dupes = [p for p, c in counts.items() if c > 1]
    assert not dupes, f"{len(dupes)} duplicated, e.g. {dupes[:3]}"
    assert set(counts) == set(published), f"missing {len(set(published) - set(counts))}"
    assert len(rows) == len(published) >= 1000
    assert all(r["topic"].startswith("sensors/") for r in rows)
    assert len({(r["shard"], r["offset"]) for r in rows}) == len(rows)
