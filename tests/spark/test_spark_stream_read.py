"""Streaming reads into a parquet sink survive crashes and restarts with every message exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from spark_helpers import Broker, arm_failpoint, wait_for, wait_query

pytestmark = pytest.mark.spark


def start_query(
    spark: Any, broker: Broker, out: Path, ckpt: Path, available_now: bool = False, **opts: str
) -> Any:
    reader = spark.readStream.format("moorline").option("servers", broker.http).option("topics", "sensors/#")
    for k, v in opts.items():
        reader = reader.option(k, v)
    return (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(ckpt))
        .trigger(**({"availableNow": True} if available_now else {"processingTime": "1 second"}))
        .start()
    )


def test_stream_read_crash_and_restart_exactly_once(spark: Any, broker: Broker, tmp_path: Path) -> None:
    """Publishers run while the query fails mid-batch (after its offsets were logged), and while a
    restarted driver is killed with SIGKILL mid-stream; each restart resumes from the checkpoint.
    The parquet sink ends with every published message exactly once."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    published: list[bytes] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def publisher() -> None:
        try:
            n = 0
            while not stop.is_set() and n < 8000:  # bounded; normally stopped by the test first
                batch = [(f"sensors/{i % 11}/t", f"m-{n + i:06d}".encode()) for i in range(50)]
                broker.publish(batch)
                published.extend(p for _, p in batch)
                n += len(batch)
                time.sleep(0.25)
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
    # Run 2: restart in a separate driver and kill it (SIGKILL, driver and JVM) mid-stream.
    driver = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "spark_read_driver.py"),
            broker.http,
            str(out),
            str(ckpt),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: the kill reaches its JVM too, nothing else
    )
    try:
        assert driver.stdout is not None
        deadline = time.monotonic() + 180
        batches_with_rows = 0
        while batches_with_rows < 2 and time.monotonic() < deadline:
            line = driver.stdout.readline()
            assert line, "the restarted driver exited early"
            if line.startswith("progress") and int(line.split()[2]) > 0:
                batches_with_rows += 1
        assert batches_with_rows == 2, "the restarted driver made no progress"
        time.sleep(0.5)  # most likely inside the next batch
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    time.sleep(1)  # publishers keep going while no query runs
    stop.set()
    pub.join(timeout=60)
    assert not errors, errors
    # Run 3: drain everything still pending, then compare.
    q = start_query(spark, broker, out, ckpt, available_now=True)
    assert q.awaitTermination(180), "the availableNow run did not finish"
    assert q.exception() is None, q.exception()
    rows = spark.read.parquet(str(out)).select("payload", "topic", "offset", "shard", "guid").collect()
    counts = Counter(bytes(r["payload"]) for r in rows)
    dupes = [p for p, c in counts.items() if c > 1]
    assert not dupes, f"{len(dupes)} duplicated, e.g. {dupes[:3]}"
    missing = sorted(set(published) - set(counts))
    assert not missing, f"{len(missing)} missing, e.g. {missing[:3]}"
    assert len(rows) == len(published) >= 1000
    assert all(r["topic"].startswith("sensors/") for r in rows)
    assert len({(r["shard"], r["offset"]) for r in rows}) == len(rows)
