"""Driving the verification job: SparkSession, loading histories (JSON lines or Parquet), outputs.

Only aggregates reach the driver: the per-run summary (one row per run), a bounded sample of
anomalies per kind, and the timelines of a bounded number of runs for the plots. The full anomaly
list is written by Spark to ``REPORT/anomalies`` (Parquet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moorline.verify.checks import ALL_KINDS, FAILING_KINDS, analyze
from moorline.verify.history import FIELDS, spark_schema

SAMPLE_PER_KIND = 20  # anomalies listed in summary.json / report.html per kind
PLOTTED_RUNS_MAX = 12  # runs whose timelines are drawn (anomalous runs first)


def make_spark(
    master: str,
    *,
    shuffle_partitions: int = 8,
    app_name: str = "moorline-verify",
    driver_memory: str | None = None,
) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if driver_memory:  # only effective when this call starts the JVM (local mode)
        builder = builder.config("spark.driver.memory", driver_memory)
    return (
        builder.master(master)
        .appName(app_name)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )


def _is_parquet(path: Path) -> bool:
    if path.is_dir():
        return any(p.suffix == ".parquet" for p in path.rglob("*.parquet"))
    return path.suffix == ".parquet"


def load_histories(spark: Any, paths: list[Path]) -> Any:
    """One DataFrame over every history file/directory given (JSON lines or Parquet, mixed)."""
    from pyspark.sql import functions as F

    if not paths:
        raise ValueError("no history given")
    schema = spark_schema()
    parquet = [str(p) for p in paths if _is_parquet(p)]
    jsonl = [str(p) for p in paths if not _is_parquet(p)]
    frames = []
    if jsonl:
        frames.append(spark.read.schema(schema).option("mode", "FAILFAST").json(jsonl))
    if parquet:
        raw = spark.read.parquet(*parquet)
        present = set(raw.columns)
        frames.append(
            raw.select(
                *[
                    (F.col(name) if name in present else F.lit(None)).cast(schema[name].dataType).alias(name)
                    for name, _ in FIELDS
                ]
            )
        )
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


@dataclass
class Verdict:
    ok: bool
    totals: dict[str, int]
    runs: list[dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]
    latency: dict[str, Any]
    timelines: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    faults: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _row(r: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, list | tuple) else v) for k, v in r.asDict(recursive=True).items()}


def run_verify(spark: Any, paths: list[Path], report_dir: Path) -> Verdict:
    """Run the checks, write REPORT/summary.json, REPORT/report.html and REPORT/anomalies/."""
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    from moorline.verify.report import write_html

    events = load_histories(spark, paths).persist()
    analysis = analyze(events)
    report_dir.mkdir(parents=True, exist_ok=True)
    anomalies = analysis.anomalies.persist()
    anomalies.write.mode("overwrite").parquet(str(report_dir / "anomalies"))

    per_run = [_row(r) for r in analysis.per_run.orderBy("run").collect()]
    w = W.partitionBy("kind").orderBy("run", "subscriber", "guid")
    sample_rows = (
        anomalies.withColumn("n", F.row_number().over(w))
        .where(F.col("n") <= SAMPLE_PER_KIND)
        .drop("n")
        .collect()
    )
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in ALL_KINDS}
    for r in sample_rows:
        samples[r["kind"]].append(_row(r))

    totals = {
        k: int(sum(int(r.get(k) or 0) for r in per_run))
        for k in (
            *ALL_KINDS,
            "published",
            "acknowledged",
            "refused",
            "indeterminate",
            "indeterminate_delivered",
            "deliveries_received",
            "first_deliveries",
            "excused",
            "duplicate_legit",
            "events",
            "fault_kill",
            "fault_restart",
            "fault_truncate",
            "fault_bitflip",
            "fault_corruption_detected",
        )
    }
    totals["runs"] = len(per_run)
    totals["runs_failed"] = sum(1 for r in per_run if any(int(r.get(k) or 0) for k in FAILING_KINDS))

    latency = _overall_latency(analysis)
    plotted = sorted(per_run, key=lambda r: (-sum(int(r.get(k) or 0) for k in ALL_KINDS), r["run"]))
    plotted_ids = [r["run"] for r in plotted[:PLOTTED_RUNS_MAX]]
    timelines: dict[str, list[dict[str, Any]]] = {run: [] for run in plotted_ids}
    for r in analysis.timeline.where(F.col("run").isin(plotted_ids)).orderBy("run", "second").collect():
        timelines[r["run"]].append(_row(r))
    faults: dict[str, list[dict[str, Any]]] = {run: [] for run in plotted_ids}
    for r in analysis.faults.where(F.col("run").isin(plotted_ids)).orderBy("run", "t_s").collect():
        faults[r["run"]].append(_row(r))

    ok = not any(totals[k] for k in FAILING_KINDS)
    verdict = Verdict(
        ok=ok,
        totals=totals,
        runs=per_run,
        samples=samples,
        latency=latency,
        timelines=timelines,
        faults=faults,
    )
    summary = {
        "ok": ok,
        "failing_kinds": list(FAILING_KINDS),
        "totals": totals,
        "latency_ms": latency,
        "runs": per_run,
        "anomaly_samples": samples,
    }
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    write_html(report_dir / "report.html", verdict)
    anomalies.unpersist()
    events.unpersist()
    return verdict


def _overall_latency(analysis: Any) -> dict[str, Any]:
    row = analysis.latency.collect()[0]
    out: dict[str, Any] = {}
    for prefix in ("ack", "deliver"):
        pcts = row[f"{prefix}_pcts"] or [None] * 4
        for name, v in zip(("p50", "p90", "p99", "p999"), pcts, strict=True):
            out[f"{prefix}_{name}"] = None if v is None else float(v)
        mx = row[f"{prefix}_max"]
        out[f"{prefix}_max"] = None if mx is None else float(mx)
    return out
