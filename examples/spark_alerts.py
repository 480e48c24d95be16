"""Sensor alerts from moorline, published back to moorline, exactly once.

    spark-submit --master 'local[*]' examples/spark_alerts.py --servers 127.0.0.1:8888 \\
        --checkpoint /tmp/alerts-ckpt [--threshold 80] [--once]

Reads ``sensors/#`` (payload: a decimal reading, e.g. ``b"73.5"``) and publishes, for every
reading above ``--threshold``, an alert to ``alerts/<sensor topic>`` as JSON (sensor, value,
publish time, shard, offset). Alerts follow their readings at once, so the first run over fresh
readings already publishes them: with the defaults, publish ``95`` to ``sensors/boiler`` and
``alerts/sensors/boiler`` gets an alert.

``--window "1 minute"`` alerts per time window instead: per sensor and window the average,
maximum and count, and one alert per (sensor, window) whose maximum is above the threshold.
Spark's append mode emits a window only once the watermark (``--watermark``, default 2 minutes)
has passed the window's end, i.e. after a reading newer than the window's end plus the watermark
has arrived: over a burst of fresh readings such a run publishes nothing until later readings come.

Restart it with the same checkpoint after any crash: no reading is lost or counted twice, and no
alert is published twice. While it runs it prints one line per micro-batch on stderr; Spark's own
logs stay at ``--spark-log-level`` (WARN).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

# Imported before the SparkSession starts: Spark's Python workers then run this interpreter
# (a virtualenv's, with pyarrow and moorline) unless PYSPARK_PYTHON is set.
from moorline.spark import MoorlineDataSource

SPARK_LOG_LEVELS = ("ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", required=True, help="the node's --http address(es), comma-separated")
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (shared storage on a cluster)")
    ap.add_argument("--threshold", type=float, default=80.0, help="alert above this reading (default 80)")
    ap.add_argument(
        "--window", default=None, help='alert per time window (e.g. "1 minute") instead of per reading'
    )
    ap.add_argument(
        "--watermark", default="2 minutes", help="with --window: how late a reading may arrive"
    )
    ap.add_argument("--once", action="store_true", help="process what is there now, then stop (availableNow)")
    ap.add_argument(
        "--spark-log-level", default="WARN", type=str.upper, choices=SPARK_LOG_LEVELS, help="Spark's own logs"
    )
    return ap.parse_args(argv)


def alerts(spark: SparkSession, args: argparse.Namespace) -> DataFrame:
    """The alerts to publish (topic, payload, qos), from the readings in moorline."""
    readings = (
        spark.readStream.format("moorline")
        .option("servers", args.servers)
        .option("topics", "sensors/#")
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "100000")
        .load()
        .select(
            "topic",
            "timestamp",
            "shard",
            "offset",
            # try_cast: a payload that is not a number is skipped (Spark 4's ANSI cast would fail the query)
            F.col("payload").cast("string").try_cast("double").alias("value"),
        )
        .where(F.col("value").isNotNull())
    )
    if args.window is None:
        # One alert per reading: a pure function of the input rows, so a replayed batch publishes
        # the same alerts with the same identities and the sink de-duplicates them.
        return readings.where(F.col("value") > args.threshold).select(
            F.concat(F.lit("alerts/"), F.col("topic")).alias("topic"),
            F.to_json(
                F.struct(
                    F.col("topic").alias("sensor"),
                    "value",
                    F.col("timestamp").alias("published"),
                    "shard",
                    "offset",
                )
            ).alias("payload"),
            F.lit(1).alias("qos"),
        )
    per_window = (
        readings.withWatermark("timestamp", args.watermark)  # append mode: a window is final after the watermark
        .groupBy(F.window("timestamp", args.window), "topic")
        .agg(F.avg("value").alias("avg"), F.max("value").alias("max"), F.count("*").alias("n"))
    )
    return per_window.where(F.col("max") > args.threshold).select(
        F.concat(F.lit("alerts/"), F.col("topic")).alias("topic"),
        F.to_json(
            F.struct(
                F.col("topic").alias("sensor"),
                F.col("window.start").alias("window_start"),
                "avg",
                "max",
                "n",
            )
        ).alias("payload"),
        F.lit(1).alias("qos"),
    )


def start(spark: SparkSession, args: argparse.Namespace) -> Any:
    writer = (
        alerts(spark, args)
        .writeStream.format("moorline")
        .option("servers", args.servers)
        .option("checkpointLocation", args.checkpoint)
        .outputMode("append")
    )
    if args.once:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime="10 seconds").start()


def follow(query: Any) -> None:
    """One progress line per micro-batch on stderr until the query ends; its error, if any, raised."""
    seen = -1
    while True:
        ended = query.awaitTermination(1.0)
        progress = query.lastProgress
        if progress is not None and progress["batchId"] != seen:
            seen = progress["batchId"]
            rate = progress.get("processedRowsPerSecond") or 0.0
            print(
                f"alerts: batch {seen}: {progress['numInputRows']} readings in, {rate:.1f} readings/s",
                file=sys.stderr,
                flush=True,
            )
        if ended or not query.isActive:
            break
    if query.exception() is not None:
        raise query.exception()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spark = (
        SparkSession.builder.appName("moorline-alerts")
        .config("spark.log.level", args.spark_log_level)  # from the JVM's start on, not after it
        .config("spark.ui.showConsoleProgress", "false")  # follow() prints progress instead
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel(args.spark_log_level)
    # With moorline installed, format("moorline") is found without this (pyspark_moorline); it is
    # kept so the example also runs from a checkout installed with `pip install -e`.
    spark.dataSource.register(MoorlineDataSource)
    follow(start(spark, args))


if __name__ == "__main__":
    main()
