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
    verdict_text = "[bold green]PASS[/]" if verdict.ok else f"[bold red]FAIL[/] ({t['runs_failed']} runs)"
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
) -> None:
    """Check histories for lost, duplicated, unexpected and out-of-order messages and packet-id misuse."""
    missing = [str(p) for p in histories if not p.exists()]
    if missing:
        raise typer.BadParameter(f"no such history: {', '.join(missing)}")
    from moorline.verify.job import make_spark, run_verify

    spark = make_spark(master, shuffle_partitions=shuffle_partitions, driver_memory=driver_memory)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        verdict = run_verify(spark, histories, report)
    finally:
        spark.stop()
    print_verdict(verdict, report)
    if not verdict.ok:
        raise typer.Exit(code=1)
