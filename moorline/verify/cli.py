"""``moorline verify HISTORY...``: check histories with PySpark, write a report, exit 1 on anomalies.

pyspark is imported inside the command only, so ``moorline --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moorline.verify.checks import ALL_KINDS, FAILING_KINDS


def print_verdict(verdict: Any, report: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="moorline verify")
    table.add_column("metric")
    table.add_column("value", justify="right")
    t = verdict.totals
    for key in (
        "runs",
        "events",
        "published",
        "acknowledged",
        "refused",
        "indeterminate",
        "indeterminate_delivered",
        "first_deliveries",
        "excused",
        "duplicate_legit",
        "fault_kill",
        "fault_truncate",
        "fault_bitflip",
        "fault_corruption_detected",
    ):
        table.add_row(key, str(t.get(key, 0)))
    for kind in ALL_KINDS:
        value = str(t.get(kind, 0))
        style = "bold red" if kind in FAILING_KINDS and t.get(kind) else ""
        table.add_row(kind, f"[{style}]{value}[/]" if style else value)
    for key, value in verdict.latency.items():
        table.add_row(f"{key} ms", "-" if value is None else f"{value:.2f}")
    console.print(table)
    headline = verdict.headline()
    verdict_text = f"[bold green]{headline}[/]" if verdict.ok else f"[bold red]{headline}[/]"
    if verdict.ok and verdict.unavailable:
        verdict_text = f"[bold yellow]{headline}[/]"  # nothing silent, but not "nothing lost"
    console.print(f"{verdict_text}  report: {report / 'report.html'}  summary: {report / 'summary.json'}")


def verify(
    histories: Annotated[
        list[Path], typer.Argument(help="History files or directories (JSON lines or Parquet).")
    ],
    master: Annotated[str, typer.Option(help="Spark master URL.")] = "local[*]",
    report: Annotated[Path, typer.Option(help="Directory for summary.json, report.html, anomalies/.")] = Path(
        "verify-report"
    ),
    shuffle_partitions: Annotated[int, typer.Option(help="spark.sql.shuffle.partitions.")] = 16,
    driver_memory: Annotated[str, typer.Option(help="spark.driver.memory (local mode).")] = "2g",
    spark_log_level: Annotated[
        str, typer.Option(help="Spark's log level on the terminal: ERROR, WARN, INFO, DEBUG...")
    ] = "WARN",
    progress_every: Annotated[
        float, typer.Option(help="Seconds between progress lines when stderr is not a terminal.")
    ] = 10.0,
) -> None:
    """Check histories for lost, duplicated, unexpected and out-of-order messages and packet-id misuse."""
    from moorline.verify.job import SPARK_LOG_LEVELS

    missing = [str(p) for p in histories if not p.exists()]
    if missing:
        raise typer.BadParameter(f"no such history: {', '.join(missing)}")
    level = spark_log_level.upper()
    if level not in SPARK_LOG_LEVELS:
        raise typer.BadParameter(
            f"--spark-log-level must be one of {', '.join(SPARK_LOG_LEVELS)}, not {spark_log_level!r}"
        )
    if progress_every <= 0:
        raise typer.BadParameter("--progress-every must be above 0 seconds")
    from moorline.verify.job import VERIFY_STEPS, HistoryFormatError, make_spark, run_verify
    from moorline.verify.progress import SparkProgress

    spark = make_spark(
        master, shuffle_partitions=shuffle_partitions, driver_memory=driver_memory, log_level=level
    )
    try:
        with SparkProgress(spark.sparkContext, "verify", VERIFY_STEPS, plain_every_s=progress_every) as shown:
            verdict = run_verify(spark, histories, report, progress=shown.step)
    except HistoryFormatError as exc:
        typer.echo(f"moorline verify: {exc}", err=True)
        raise typer.Exit(code=2) from None
    finally:
        spark.stop()
    print_verdict(verdict, report)
    if not verdict.ok:
        raise typer.Exit(code=1)
