"""Driving the verification job: SparkSession, loading histories (JSON lines or Parquet), outputs.

Only aggregates reach the driver: the per-run summary (one row per run), a bounded sample of
anomalies per kind, and the timelines of a bounded number of runs for the plots. The full anomaly
list is written by Spark to ``REPORT/anomalies`` (Parquet).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moorline.verify.checks import ALL_KINDS, FAILING_KINDS, analyze
from moorline.verify.history import FIELD_NAMES, FIELDS, OPS, TYPES, spark_schema

SAMPLE_PER_KIND = 20  # anomalies listed in summary.json / report.html per kind
PLOTTED_RUNS_MAX = 12  # runs whose timelines are drawn (anomalous runs first)
MARKS_PER_RUN = 500  # anomalies marked on one run's timeline
RECORDS_PER_ANOMALY = 40  # history records listed under each sampled anomaly
BAD_RECORDS_SHOWN = 3  # records quoted when a history does not follow the format
REQUIRED_FIELDS = ("run", "type", "op", "mono_ns")  # without them no check can place an event
SHARD_IN_TEXT = re.compile(r"\bshard (\d+)")
SPARK_LOG_LEVELS = ("ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF")


class HistoryFormatError(ValueError):
    """The histories hold no event, or records that do not follow docs/history-format.md."""


def make_spark(
    master: str,
    *,
    shuffle_partitions: int = 8,
    app_name: str = "moorline-verify",
    driver_memory: str | None = None,
    log_level: str = "WARN",
) -> Any:
    from pyspark.sql import SparkSession

    from moorline.spark.interpreter import use_running_python

    use_running_python()  # workers run this interpreter (a virtualenv's), unless PYSPARK_PYTHON is set
    builder = SparkSession.builder
    if driver_memory:  # only effective when this call starts the JVM (local mode)
        builder = builder.config("spark.driver.memory", driver_memory)
    session = (
        builder.master(master)
        .appName(app_name)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # moorline.verify.progress shows progress instead
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.log.level", log_level)  # from the JVM's start on, not only after it
        .getOrCreate()
    )
    session.sparkContext.setLogLevel(log_level)  # a session that already ran keeps its old level otherwise
    return session


def _is_parquet(path: Path) -> bool:
    if path.is_dir():
        return any(p.suffix == ".parquet" for p in path.rglob("*.parquet"))
    return path.suffix == ".parquet"


def _problem(r: Any, parsed_ok: Any, keys: Any) -> Any:
    """Why a record does not follow the history format (null when it does)."""
    from pyspark.sql import functions as F

    unknown = F.array_except(keys, F.array(*[F.lit(n) for n in sorted(FIELD_NAMES)]))
    cond = F.when(~parsed_ok, F.lit("not a JSON object with the documented column types"))
    cond = cond.when(F.size(unknown) > 0, F.concat(F.lit("unknown field(s): "), F.array_join(unknown, ", ")))
    for name in REQUIRED_FIELDS:
        cond = cond.when(r[name].isNull(), F.lit(f'no "{name}"'))
    cond = cond.when(~r["type"].isin(*sorted(TYPES)), F.concat(F.lit("unknown type: "), r["type"]))
    return cond.when(~r["op"].isin(*sorted(OPS)), F.concat(F.lit("unknown op: "), r["op"]))


def load_histories(spark: Any, paths: list[Path]) -> Any:
    """One DataFrame over every history file/directory given (JSON lines or Parquet, mixed).

    Besides the history columns it has ``_problem`` (why a record does not follow
    docs/history-format.md, else null) and ``_bad`` (the record, for the error message; null when
    good): ``checked_events`` turns them into an error."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not paths:
        raise ValueError("no history given")
    schema = spark_schema()
    parquet = [str(p) for p in paths if _is_parquet(p)]
    jsonl = [str(p) for p in paths if not _is_parquet(p)]
    frames = []
    if jsonl:
        # Read as text and parse here (not spark.read.json): fields the schema does not know and
        # values of the wrong type must be errors, not nulls.
        lines = spark.read.text(jsonl).select("value", F.col("_metadata.file_path").alias("file"))
        lines = lines.where(F.trim("value") != "")
        with_corrupt = T.StructType([*schema.fields, T.StructField("_corrupt", T.StringType(), True)])
        r = F.from_json(
            "value", with_corrupt, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt"}
        )
        keys = F.json_object_keys("value")
        parsed = lines.select("value", "file", r.alias("r"), keys.alias("keys"))
        ok = F.col("r._corrupt").isNull() & F.col("keys").isNotNull()
        problem = _problem(F.col("r"), ok, F.coalesce(F.col("keys"), F.array().cast("array<string>")))
        frames.append(
            parsed.select(
                *[F.col("r")[name].alias(name) for name, _ in FIELDS],
                problem.alias("_problem"),
                F.when(problem.isNotNull(), F.concat_ws(": ", "file", "value")).alias("_bad"),
            )
        )
    if parquet:
        raw = spark.read.parquet(*parquet)
        unknown = sorted(set(raw.columns) - FIELD_NAMES)
        if unknown:
            raise HistoryFormatError(
                f"Parquet history {', '.join(parquet)} has unknown column(s) {unknown}; "
                "the columns are listed in docs/history-format.md"
            )
        numeric = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
        for f in raw.schema.fields:
            want = schema[f.name].dataType
            same_kind = isinstance(f.dataType, type(want)) or (
                isinstance(want, numeric) and isinstance(f.dataType, numeric)
            )
            if not same_kind:
                raise HistoryFormatError(
                    f"Parquet history {', '.join(parquet)}: column {f.name!r} is {f.dataType.simpleString()}, "
                    f"the format says {want.simpleString()} (docs/history-format.md)"
                )
        present = set(raw.columns)
        cols = raw.select(
            *[
                (F.col(name) if name in present else F.lit(None)).cast(schema[name].dataType).alias(name)
                for name, _ in FIELDS
            ]
        )
        r = F.struct(*[F.col(name) for name, _ in FIELDS])
        problem = _problem(r, F.lit(True), F.array().cast("array<string>"))
        frames.append(
            cols.select(
                *[name for name, _ in FIELDS],
                problem.alias("_problem"),
                F.when(problem.isNotNull(), F.to_json(r)).alias("_bad"),
            )
        )
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


def checked_events(loaded: Any, paths: list[Path]) -> Any:
    """The history events, once every record follows the format and there is at least one."""
    from pyspark.sql import functions as F

    counts = loaded.agg(F.count("*").alias("n"), F.count("_problem").alias("bad")).collect()[0]
    where = ", ".join(str(p) for p in paths)
    if counts["n"] == 0:
        raise HistoryFormatError(
            f"no events in {where}: a history has one JSON object per line (or Parquet rows) as "
            "docs/history-format.md describes"
        )
    if counts["bad"]:
        shown = loaded.where(F.col("_problem").isNotNull()).select("_problem", "_bad").limit(BAD_RECORDS_SHOWN)
        examples = "\n".join(f"  {r['_problem']}: {str(r['_bad'])[:300]}" for r in shown.collect())
        raise HistoryFormatError(
            f"{counts['bad']} of {counts['n']} records in {where} do not follow the history format "
            f"(docs/history-format.md), e.g.:\n{examples}"
        )
    return loaded.drop("_problem", "_bad")


@dataclass
class Verdict:
    ok: bool
    totals: dict[str, int]
    runs: list[dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]
    latency: dict[str, Any]
    timelines: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    faults: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Messages lost in runs where the node detected and reported corruption (each counted once,
    # however many subscribers were owed it), and the shards the reports name.
    unavailable: int = 0
    unavailable_shards: list[int] = field(default_factory=list)
    # Per plotted run: its anomalies (t_s, kind, guid, subscriber, detail), marked on its timeline.
    marks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Per sampled anomaly (key: anomaly_key): the history records of its message, in time order.
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def headline(self) -> str:
        """The verdict in one line: PASS or FAIL, and what a PASS does not mean (nothing lost)."""
        notes = [] if self.ok else [f"{self.totals.get('runs_failed', 0)} runs"]
        if self.unavailable:
            where = ""
            if self.unavailable_shards:
                label = "shard" if len(self.unavailable_shards) == 1 else "shards"
                where = f", {label} {', '.join(str(s) for s in self.unavailable_shards)}"
            noun = "message" if self.unavailable == 1 else "messages"
            notes.append(f"{self.unavailable} {noun} unavailable: corruption detected and reported{where}")
        return ("PASS" if self.ok else "FAIL") + (f" ({'; '.join(notes)})" if notes else "")


VERIFY_STEPS = (
    "reading and checking the histories",
    "checking messages and deliveries",
    "writing the anomaly list",
    "summing up per run",
    "sampling anomalies",
    "drawing timelines",
    "writing the report",
)


def anomaly_key(a: dict[str, Any]) -> str:
    """Identifies one anomaly in the report (its marks link to its sample row and records)."""
    return "|".join(str(a.get(k)) for k in ("run", "kind", "guid", "subscriber", "mono_ns"))


def _records_of(events: Any, sample_rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The history records of each sampled anomaly's message (for a delivery without a guid: the
    records at its instant), at most RECORDS_PER_ANOMALY each."""
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    if not sample_rows:
        return {}
    spark = events.sparkSession
    keys = spark.createDataFrame(
        [(a["run"], a["guid"], a["mono_ns"], anomaly_key(a)) for a in sample_rows],
        "run string, guid string, a_ns long, akey string",
    )
    on_guid = events.join(F.broadcast(keys.where(F.col("guid").isNotNull())), ["run", "guid"])
    on_time = events.drop("guid").join(
        F.broadcast(keys.where(F.col("guid").isNull())), (["run"]), "inner"
    ).where(F.col("mono_ns") == F.col("a_ns"))
    found = on_guid.unionByName(on_time, allowMissingColumns=True)
    w = W.partitionBy("akey").orderBy("mono_ns", "index")
    rows = (
        found.withColumn("n", F.row_number().over(w))
        .where(F.col("n") <= RECORDS_PER_ANOMALY)
        .orderBy("akey", "n")
        .collect()
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        rec = {k: v for k, v in r.asDict().items() if v is not None and k not in ("akey", "a_ns", "n")}
        out.setdefault(r["akey"], []).append(rec)
    return out


def _row(r: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, list | tuple) else v) for k, v in r.asDict(recursive=True).items()}


def run_verify(
    spark: Any, paths: list[Path], report_dir: Path, progress: Callable[[str], None] | None = None
) -> Verdict:
    """Run the checks, write REPORT/summary.json, REPORT/report.html and REPORT/anomalies/.

    Raises HistoryFormatError when the histories hold no event or records off the format.
    ``progress`` is told each of VERIFY_STEPS as it starts."""
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    from moorline.verify.report import tested_line, write_html

    step = progress or (lambda _name: None)
    step(VERIFY_STEPS[0])
    loaded = load_histories(spark, paths).persist()
    try:
        events = checked_events(loaded, paths)
    except HistoryFormatError:
        loaded.unpersist()
        raise
    step(VERIFY_STEPS[1])
    analysis = analyze(events)
    report_dir.mkdir(parents=True, exist_ok=True)
    anomalies = analysis.anomalies.persist()
    step(VERIFY_STEPS[2])
    anomalies.write.mode("overwrite").parquet(str(report_dir / "anomalies"))

    step(VERIFY_STEPS[3])
    per_run = [_row(r) for r in analysis.per_run.orderBy("run").collect()]
    step(VERIFY_STEPS[4])
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
            "subscribers",
            "faults",
        )
    }
    totals["runs"] = len(per_run)
    totals["runs_failed"] = sum(1 for r in per_run if any(int(r.get(k) or 0) for k in FAILING_KINDS))

    unavailable, unavailable_shards = 0, []
    if totals["lost_detected_corruption"]:
        detected = anomalies.where(F.col("kind") == "lost_detected_corruption")
        unavailable = detected.select("run", "guid").distinct().count()
        reports = analysis.faults.where(F.col("reason") == "corruption_detected").select("detail").distinct()
        found = {int(m) for r in reports.limit(1000).collect() for m in SHARD_IN_TEXT.findall(r["detail"] or "")}
        unavailable_shards = sorted(found)
    totals["unavailable_messages"] = unavailable

    latency = _overall_latency(analysis)
    step(VERIFY_STEPS[5])
    plotted = sorted(per_run, key=lambda r: (-sum(int(r.get(k) or 0) for k in ALL_KINDS), r["run"]))
    plotted_ids = [r["run"] for r in plotted[:PLOTTED_RUNS_MAX]]
    timelines: dict[str, list[dict[str, Any]]] = {run: [] for run in plotted_ids}
    for r in analysis.timeline.where(F.col("run").isin(plotted_ids)).orderBy("run", "second").collect():
        timelines[r["run"]].append(_row(r))
    faults: dict[str, list[dict[str, Any]]] = {run: [] for run in plotted_ids}
    for r in analysis.faults.where(F.col("run").isin(plotted_ids)).orderBy("run", "t_s").collect():
        faults[r["run"]].append(_row(r))
    marks: dict[str, list[dict[str, Any]]] = {run: [] for run in plotted_ids}
    run_start = events.where(F.col("run").isin(plotted_ids)).groupBy("run").agg(F.min("mono_ns").alias("start_ns"))
    w_mark = W.partitionBy("run").orderBy("mono_ns", "kind", "guid")
    marked = (
        anomalies.where(F.col("run").isin(plotted_ids))
        .withColumn("n", F.row_number().over(w_mark))
        .where(F.col("n") <= MARKS_PER_RUN)
        .join(run_start, "run")
        .withColumn("t_s", (F.col("mono_ns") - F.col("start_ns")) / 1e9)
        .drop("n", "start_ns")
        .orderBy("run", "mono_ns")
    )
    for r in marked.collect():
        marks[r["run"]].append(_row(r))
    records = _records_of(events, [a for rows in samples.values() for a in rows])

    ok = not any(totals[k] for k in FAILING_KINDS)
    verdict = Verdict(
        ok=ok,
        totals=totals,
        runs=per_run,
        samples=samples,
        latency=latency,
        timelines=timelines,
        faults=faults,
        unavailable=unavailable,
        unavailable_shards=unavailable_shards,
        marks=marks,
        records=records,
    )
    step(VERIFY_STEPS[6])
    summary = {
        "ok": ok,
        "verdict": verdict.headline(),
        "tested": tested_line(totals),
        "unavailable_shards": unavailable_shards,
        "failing_kinds": list(FAILING_KINDS),
        "totals": totals,
        "latency_ms": latency,
        "runs": per_run,
        "anomaly_samples": samples,
    }
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    write_html(report_dir / "report.html", verdict)
    anomalies.unpersist()
    loaded.unpersist()
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
