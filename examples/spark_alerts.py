"""Per-minute sensor aggregates from moorline, alerts published back to moorline, exactly once.

    spark-submit --master 'local[*]' examples/spark_alerts.py --servers 127.0.0.1:8080 \
        --checkpoint /tmp/alerts-ckpt [--threshold 80]

Reads ``sensors/#`` (payload: a decimal reading, e.g. ``b"73.5"``), computes per topic and
minute the average and maximum, and publishes one alert per (sensor, minute) whose maximum is
above the threshold to ``alerts/<sensor topic>`` as JSON. Restart it with the same checkpoint
after any crash: no reading is lost or counted twice, and no alert is published twice.
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from moorline.spark import MoorlineDataSource


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", required=True, help="the node's --http address(es), comma-separated")
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (shared storage on a cluster)")
    ap.add_argument("--threshold", type=float, default=80.0)
    ap.add_argument("--window", default="1 minute", help="aggregation window")
    ap.add_argument("--watermark", default="2 minutes", help="how late a reading may arrive")
    ap.add_argument("--once", action="store_true", help="process what is there now, then stop (availableNow)")
    args = ap.parse_args()

    spark = SparkSession.builder.appName("moorline-alerts").getOrCreate()
    spark.dataSource.register(MoorlineDataSource)

    readings = (
        spark.readStream.format("moorline")
        .option("servers", args.servers)
        .option("topics", "sensors/#")
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "100000")
        .load()
        .select("topic", "timestamp", F.col("payload").cast("string").cast("double").alias("value"))
        .where(F.col("value").isNotNull())
    )
    per_minute = (
        readings.withWatermark(
            "timestamp", args.watermark
        )  # append mode: a window is final after the watermark
        .groupBy(F.window("timestamp", args.window), "topic")
        .agg(F.avg("value").alias("avg"), F.max("value").alias("max"), F.count("*").alias("n"))
    )
    alerts = per_minute.where(F.col("max") > args.threshold).select(
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
    writer = (
        alerts.writeStream.format("moorline")
        .option("servers", args.servers)
        .option("checkpointLocation", args.checkpoint)
        .outputMode("append")
    )
    query = (
        writer.trigger(availableNow=True).start()
        if args.once
        else writer.trigger(processingTime="10 seconds").start()
    )
    query.awaitTermination()


if __name__ == "__main__":
    main()
