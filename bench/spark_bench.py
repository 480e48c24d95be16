"""Rows/s read and written by ``format("moorline")`` in local[2], 100-byte messages.

    python bench/spark_bench.py [--rows 50000] [--servers HOST:PORT] [--fake]

Without ``--servers`` it starts a real node (``python -m moorline run`` on port 0) in a temporary
directory, or the in-process fake HTTP broker of the tests with ``--fake``. It measures:

* batch read: ``spark.read.format("moorline")`` of every row, ``count()`` forced through a
  ``payload`` length sum (so rows are really materialised);
* stream read: one ``availableNow`` micro-batch run into a no-op sink;
* batch write: ``df.write.format("moorline")`` of the same number of rows (canonical sort +
  sequenced publish, every row acknowledged);
* stream write: one ``availableNow`` run from moorline to moorline.

Each figure is rows / wall seconds of the Spark action (JVM start excluded).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _req(http: str, method: str, path: str, doc: Any = None) -> Any:
    data = None if doc is None else json.dumps(doc).encode()
    r = urllib.request.Request(f"http://{http}{path}", data=data, method=method)
    r.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(r, timeout=120) as resp:
        return json.loads(resp.read())


def preload(http: str, topic_prefix: str, rows: int, chunk: int = 2000) -> float:
    payload = base64.b64encode(b"x" * 100).decode()
    t = time.perf_counter()
    for i in range(0, rows, chunk):
        msgs = [
            {"topic": f"{topic_prefix}/{(i + j) % 16}", "payload": payload}
            for j in range(min(chunk, rows - i))
        ]
        res = _req(http, "POST", "/v1/publish", {"messages": msgs})["results"]
        assert all(r["status"] == "ok" for r in res)
    return rows / (time.perf_counter() - t)


def start_node(tmp: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moorline",
            "run",
            "--data-dir",
            f"{tmp}/node",
            "--mqtt",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"http=(\S+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("the node did not print its ready line")


def timed(what: str, rows: int, fn: Any) -> float:
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    print(f"{what:<14} {rows:>8} rows  {dt:7.2f} s  {rows / dt:10,.0f} rows/s", flush=True)
    return rows / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--servers")
    ap.add_argument("--fake", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    proc = None
    fake = None
    tmp = tempfile.mkdtemp(prefix="moorline-spark-bench-")
    if args.servers:
        http = args.servers
        kind = "given server"
    elif args.fake:
        sys.path.insert(0, str(ROOT / "tests" / "spark"))
        from fake_broker import FakeBroker

        fake = FakeBroker(shard_count=16).start()
        http, kind = fake.address, "fake broker (in-process)"
    else:
        proc, http = start_node(tmp)
        kind = "real node (1 voter)"
    try:
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        from moorline.spark import MoorlineDataSource

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(MoorlineDataSource)
        n = args.rows
        # Warm-up: start the Python workers and the data source once, outside the timings.
        preload(http, "bench/warm", 100)
        spark.read.format("moorline").option("servers", http).option("topics", "bench/warm/#").load().count()
        print(f"moorline spark bench: {kind} at {http}, local[2], {n} rows of 100 bytes")
        pub_rate = preload(http, "bench/in", n)
        print(f"{'preload(HTTP)':<14} {n:>8} rows  {'':>7}    {pub_rate:10,.0f} rows/s")

        def src() -> Any:
            return spark.read.format("moorline").option("servers", http).option("topics", "bench/in/#").load()

        timed("batch read", n, lambda: src().select(F.sum(F.length("payload"))).collect())

        def stream_read() -> None:
            q = (
                spark.readStream.format("moorline")
                .option("servers", http)
                .option("topics", "bench/in/#")
                .option("startingOffsets", "earliest")
                .load()
                .writeStream.format("noop")
                .option("checkpointLocation", f"{tmp}/ck-read")
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()

        timed("stream read", n, stream_read)
        timed(
            "batch write",
            n,
            lambda: (
                src()
                .select(F.concat(F.lit("bench/out/"), F.col("shard")).alias("topic"), "payload")
                .write.format("moorline")
                .mode("append")
                .option("servers", http)
                .save()
            ),
        )

        def stream_write() -> None:
            q = (
                spark.readStream.format("moorline")
                .option("servers", http)
                .option("topics", "bench/in/#")
                .option("startingOffsets", "earliest")
                .load()
                .select(F.concat(F.lit("bench/out2/"), F.col("shard")).alias("topic"), "payload")
                .writeStream.format("moorline")
                .option("servers", http)
                .option("checkpointLocation", f"{tmp}/ck-write")
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()

        timed("stream write", n, stream_write)
        spark.stop()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        if fake is not None:
            fake.stop()


if __name__ == "__main__":
    main()
