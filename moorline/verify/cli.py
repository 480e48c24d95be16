"""``moorline verify HISTORY...``: check histories with PySpark, write a report.

Exit codes: 0 PASS; 1 FAIL (anomalies); 2 bad input, or PySpark / Java missing; 3 NOT VERIFIED:
the histories hold fewer acknowledged publishes than ``--min-acked`` (a run that exercised nothing
proves nothing, however clean it looks).

pyspark is imported inside the command only, so ``moorline --help`` stays fast.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from moorline.verify.checks import ALL_KINDS, FAILING_KINDS

EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_NOT_VERIFIED = 3
SPARK_MODULES = ("pyspark", "py4j", "pyarrow", "pandas")
SPARK_HINT = "pip install 'moorline[spark]'"


def missing_extra(exc: ModuleNotFoundError, modules: tuple[str, ...]) -> bool:
    """Whether ``exc`` is one of ``modules`` (or a submodule) not being installed."""
    name = exc.name or ""
    return any(name == m or name.startswith(m + ".") for m in modules)


def not_verified_reason(totals: dict[str, Any], min_acked: int) -> str | None:
    """Why a verdict without anomalies is still no PASS: too few acknowledged publishes to check."""
    acked = int(totals.get("acknowledged", 0) or 0)
    if acked >= min_acked:
        return None
    if acked == 0:
        return "the histories hold no acknowledged publish: nothing was checked"
    noun = "publish" if acked == 1 else "publishes"
    return f"{acked} acknowledged {noun}, fewer than --min-acked {min_acked}"


def print_verdict(verdict: Any, report: Path, not_verified: str | None = None) -> None:
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
    if verdict.ok and not_verified is not None:
        verdict_text = f"[bold red]NOT VERIFIED ({not_verified})[/]"
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
    min_acked: Annotated[
        int, typer.Option(help="Fewer acknowledged publishes than this in all histories: NOT VERIFIED, exit 3.")
    ] = 1,
) -> None:
    """Check histories for lost, duplicated, unexpected and out-of-order messages and packet-id misuse.
    Exit 0 PASS, 1 FAIL, 2 bad input or PySpark missing, 3 NOT VERIFIED (fewer than --min-acked
    acknowledged publishes)."""
    from moorline.verify.job import SPARK_LOG_LEVELS

    missing = [str(p) for p in histories if not p.exists()]
    if missing:
        raise typer.BadParameter(f"no such history: {', '.join(missing)}")
    if min_acked < 0:
        raise typer.BadParameter("--min-acked must be 0 or more")
    level = spark_log_level.upper()
    if level not in SPARK_LOG_LEVELS:
        raise typer.BadParameter(
            f"--spark-log-level must be one of {', '.join(SPARK_LOG_LEVELS)}, not {spark_log_level!r}"
        )
    if progress_every <= 0:
        raise typer.BadParameter("--progress-every must be above 0 seconds")
    from moorline.verify.job import VERIFY_STEPS, HistoryFormatError, make_spark, run_verify
    from moorline.verify.progress import SparkProgress

    try:
        import pyspark  # noqa: F401  (only to say which extra is missing, before anything starts)
    except ModuleNotFoundError as exc:
        if not missing_extra(exc, SPARK_MODULES):
            raise
        typer.echo(f"moorline verify needs PySpark ({exc.name} is not installed): {SPARK_HINT}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    if master.startswith("local") and shutil.which("java") is None:
        typer.echo("moorline verify needs a Java runtime (17 or later) for PySpark: none found on PATH "
                   "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless)", err=True)
        raise typer.Exit(code=EXIT_USAGE)
    try:
        spark = make_spark(
            master, shuffle_partitions=shuffle_partitions, driver_memory=driver_memory, log_level=level
        )
    except ModuleNotFoundError as exc:
        if not missing_extra(exc, SPARK_MODULES):
            raise
        typer.echo(f"moorline verify needs PySpark ({exc.name} is not installed): {SPARK_HINT}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    try:
        with SparkProgress(spark.sparkContext, "verify", VERIFY_STEPS, plain_every_s=progress_every) as shown:
            verdict = run_verify(spark, histories, report, progress=shown.step)
    except HistoryFormatError as exc:
        typer.echo(f"moorline verify: {exc}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    finally:
        spark.stop()
    reason = not_verified_reason(verdict.totals, min_acked)
    print_verdict(verdict, report, reason)
    if not verdict.ok:
        raise typer.Exit(code=EXIT_FAIL)
    if reason is not None:
        typer.echo(f"moorline verify: NOT VERIFIED: {reason}", err=True)
        raise typer.Exit(code=EXIT_NOT_VERIFIED)
