"""``moorline chaos``: crash-test a node with a recorded workload, then verify the histories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def chaos(
    nodes: Annotated[int, typer.Option(help="Nodes to run (only 1 is supported so far).")] = 1,
    runs: Annotated[int, typer.Option(help="Independent runs, each on a fresh data directory.")] = 1,
    duration: Annotated[
        float, typer.Option(help="Seconds of workload per run (faults happen inside).")
    ] = 20.0,
    faults: Annotated[str, typer.Option(help="Comma list of kill,truncate,bitflip ('' for none).")] = "kill",
    kills: Annotated[int, typer.Option(help="SIGKILL + restart cycles per run.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed for fault moments, damage and workload.")] = 1,
    out: Annotated[Path, typer.Option(help="Directory for histories and the verify report.")] = Path(
        "chaos-out"
    ),
    master: Annotated[str, typer.Option(help="Spark master for verify.")] = "local[*]",
    broker: Annotated[str, typer.Option(help="moorline, or mosquitto to develop the harness.")] = "moorline",
    fault: Annotated[
        list[str] | None,
        typer.Option(help="A deliberately broken build to prove the checks can fail: drop_on_restart, "
                          "unsafe_ack_before_sync (repeatable)."),
    ] = None,
    verify: Annotated[bool, typer.Option(help="Run verify on the histories at the end.")] = True,
) -> None:
    """Start a node, drive publishers and subscribers, SIGKILL/damage/restart it at seeded moments, then verify."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from moorline.chaos.harness import ChaosConfig, run_once

    if nodes != 1:
        raise typer.BadParameter("only --nodes 1 is supported by this harness so far")
    broken: dict[str, Any] = {}
    for name in fault or []:
        if name not in ("drop_on_restart", "unsafe_ack_before_sync"):
            raise typer.BadParameter(f"--fault must be drop_on_restart or unsafe_ack_before_sync, not {name!r}")
        broken[name] = True
    fault_set = frozenset(f.strip() for f in faults.split(",") if f.strip())
    if fault_set & {"truncate", "bitflip"}:
        fault_set |= {"kill"}  # damage happens while the node is down
    try:
        cfg = ChaosConfig(
            duration_s=duration, faults=fault_set, seed=seed, kills_per_run=kills, broker=broker, node_faults=broken
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console()
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as bar:
        for i in range(runs):
            run_id = f"s{seed}-r{i}"
            task = bar.add_task(f"run {run_id}", total=1.0)

            def report(fraction: float, task_id: TaskID = task) -> None:
                bar.update(task_id, completed=fraction)

            res = run_once(cfg, run_id, out, progress=report)
            results.append(res)
            bar.update(
                task,
                completed=1.0,
                description=(
                    f"run {run_id}: {res.acked}/{res.published} acked, {res.kills} kills"
                    + (", corruption detected" if res.corruption_detected else "")
                ),
            )
    for res in results:
        for note in res.notes:
            console.print(f"[yellow]{res.run}[/]: {note}")
    failed_restarts = [r.run for r in results if r.restart_failed]
    if verify:
        from moorline.verify.cli import verify as verify_cmd

        try:
            verify_cmd([r.history for r in results], master=master, report=out / "report")
        except typer.Exit:
            if failed_restarts:
                console.print(f"[bold red]node failed to restart in runs {failed_restarts}[/]")
            raise
    if failed_restarts:
        console.print(f"[bold red]node failed to restart in runs {failed_restarts}[/]")
        raise typer.Exit(code=1)
