"""A separate Spark driver the read test kills with SIGKILL mid-stream (an abrupt stop).

    python spark_read_driver.py SERVERS OUT_DIR CHECKPOINT_DIR

Streams ``sensors/#`` into parquet and prints ``progress <batchId> <numInputRows>`` per batch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    servers, out, ckpt = sys.argv[1:4]
    from pyspark.sql import SparkSession

    from moorline.spark import MoorlineDataSource

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(MoorlineDataSource)
    q = (
        spark.readStream.format("moorline")
        .option("servers", servers)
        .option("topics", "sensors/#")
        .option("maxOffsetsPerTrigger", "700")
        .load()
        .writeStream.format("parquet")
        .option("path", out)
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="1 second")
        .start()
    )
    seen = -1
    deadline = time.monotonic() + 240  # bounded: the test kills it long before
    while q.isActive and time.monotonic() < deadline:
        p = q.lastProgress
        if p is not None and p["batchId"] != seen:
            seen = p["batchId"]
            print(f"progress {p['batchId']} {p['numInputRows']}", flush=True)
        time.sleep(0.2)
    print(f"ended {q.exception()}", flush=True)


if __name__ == "__main__":
    main()
