"""``moorline chaos``: crash-test a node or a cluster with a recorded workload, then verify the histories."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from moorline.chaos.harness import RunResult

SINGLE_DEFAULT_FAULTS = "kill"
CLUSTER_DEFAULT_FAULTS = "kill,truncate,pause,partition"


def chaos(
    nodes: Annotated[int, typer.Option(help="Nodes: 1 (one process), or a cluster of 3 or 5.")] = 1,
    runs: Annotated[int, typer.Option(help="Independent runs, each on a fresh data directory.")] = 1,
    duration: Annotated[
        float, typer.Option(help="Seconds of workload per run (faults happen inside).")
    ] = 20.0,
    faults: Annotated[
        str | None,
        typer.Option(help="Comma list ('' for none). One node: kill,truncate,bitflip (default: kill). "
                          "Cluster: kill,truncate,pause,partition (default: all four)."),
    ] = None,
    kills: Annotated[int, typer.Option(help="SIGKILL + restart cycles per run.")] = 2,
    pauses: Annotated[int, typer.Option(help="Cluster: SIGSTOP ... SIGCONT episodes per run.")] = 2,
    partitions: Annotated[int, typer.Option(help="Cluster: partitions (a minority cut off) per run.")] = 2,
    pause_s: Annotated[
        float, typer.Option("--pause-s", help="Cluster: seconds a node stays paused (> election timeout).")
    ] = 3.0,
    partition_s: Annotated[
        float, typer.Option("--partition-s", help="Cluster: seconds a partition lasts.")
    ] = 5.0,
    base_address: Annotated[
        str, typer.Option(help="Cluster: node i listens on this loopback address + i - 1.")
    ] = "127.0.0.31",
    partition_with: Annotated[
        str, typer.Option(help="Cluster: auto (iptables when root and available, else proxy), iptables, proxy.")
    ] = "auto",
    node_config: Annotated[
        Path | None, typer.Option(help="TOML configuration file given to every node (--config).")
    ] = None,
    keep_data: Annotated[
        bool, typer.Option(help="Cluster: keep the nodes' data directories in the run directory.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed for fault moments, damage and workload.")] = 1,
    out: Annotated[Path, typer.Option(help="Directory for histories, run directories and the verify report.")] = Path(
        "chaos-out"
    ),
    master: Annotated[str, typer.Option(help="Spark master for verify.")] = "local[*]",
    broker: Annotated[str, typer.Option(help="moorline, or mosquitto to develop the harness.")] = "moorline",
    fault: Annotated[
        list[str] | None,
        typer.Option(help="A deliberately broken build to prove the checks can fail, e.g. drop_on_restart "
                          "(repeatable; any broken switch of moorline.testing.Faults)."),
    ] = None,
    verify: Annotated[bool, typer.Option(help="Run verify on the histories at the end.")] = True,
    min_acked: Annotated[
        int, typer.Option(help="Acknowledged publishes each run must have; fewer: the run exercised "
                               "nothing, exit 3 (verify gets runs x this as its --min-acked).")
    ] = 1,
) -> None:
    """Start a node (or a cluster), drive publishers and subscribers, kill/damage/pause/partition at
    seeded moments, heal, drain, then verify. Exit 0 PASS, 1 FAIL (anomalies, a node that would not
    restart, a client thread that died), 2 bad input or a missing extra, 3 NOT VERIFIED (a run with
    fewer than --min-acked acknowledged publishes)."""
    require_extras(verify)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from moorline.chaos.cluster import ClusterSetupError
    from moorline.chaos.harness import ChaosConfig, run_once
    from moorline.chaos.node import NodeStartError
    from moorline.chaos.partition import PartitionError
    from moorline.testing.faults import BROKEN_SWITCHES

    if nodes not in (1, 3, 5):
        raise typer.BadParameter(f"must be 1, 3 or 5, not {nodes}", param_hint="--nodes")
    broken: dict[str, Any] = {}
    for name in fault or []:
        if name not in BROKEN_SWITCHES:
            raise typer.BadParameter(f"must be one of {', '.join(BROKEN_SWITCHES)}, not {name!r}",
                                     param_hint="--fault")
        broken[name] = True
    if faults is None:
        faults = SINGLE_DEFAULT_FAULTS if nodes == 1 else CLUSTER_DEFAULT_FAULTS
    fault_set = frozenset(f.strip() for f in faults.split(",") if f.strip())
    if fault_set & {"truncate", "bitflip"}:
        fault_set |= {"kill"}  # damage happens while the node is down
    config_text = None
    if node_config is not None:
        try:
            config_text = node_config.read_text(encoding="utf-8")
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {node_config}: {exc.strerror or exc}",
                                     param_hint="--node-config") from None
    try:
        cfg = ChaosConfig(
            duration_s=duration, faults=fault_set, seed=seed, kills_per_run=kills, broker=broker,
            node_faults=broken, nodes=nodes, pauses_per_run=pauses, partitions_per_run=partitions,
            pause_s=pause_s, partition_s=partition_s, base_address=base_address, partition_with=partition_with,
            node_config_text=config_text, keep_data=keep_data,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if runs < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--runs")
    if min_acked < 0:
        raise typer.BadParameter("must be 0 or more", param_hint="--min-acked")
    console = Console()
    results: list[RunResult] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as bar:
        for i in range(runs):
            run_id = f"s{seed}-r{i}"
            task = bar.add_task(f"run {run_id}", total=1.0)

            def report(fraction: float, task_id: TaskID = task) -> None:
                bar.update(task_id, completed=fraction)

            try:
                res = run_once(cfg, run_id, out, progress=report)
            except (ClusterSetupError, PartitionError, NodeStartError) as exc:
                bar.stop()
                console.print(f"[bold red]chaos run {run_id} failed:[/] {exc}")
                if isinstance(exc, NodeStartError):
                    console.print(exc.log_tail)
                raise typer.Exit(code=1) from None
            results.append(res)
            bar.update(task, completed=1.0, description=f"run {run_id}: {_summary(res)}")
    for res in results:
        if res.run_dir is not None:
            console.print(f"{res.run}: node logs and faults.txt in {res.run_dir}")
        for note in res.notes:
            console.print(f"[yellow]{res.run}[/]: {note}")
    failed_restarts = [r.run for r in results if r.restart_failed]
    died = [(r.run, e) for r in results for e in r.client_errors]
    idle = [r.run for r in results if r.acked < min_acked]
    if died:
        for run, error in died:
            console.print(f"[bold red]{run}: a client thread died: {error}[/]")
        console.print("[bold red]FAIL: the workload did not run as planned; the histories prove nothing[/]")
        raise typer.Exit(code=1)
    if verify:
        from moorline.verify.cli import verify as verify_cmd

        try:
            verify_cmd([r.history for r in results], master=master, report=out / "report",
                       min_acked=min_acked * len(results))
        except typer.Exit:
            if failed_restarts:
                console.print(f"[bold red]node failed to restart in runs {failed_restarts}[/]")
            raise
    if failed_restarts:
        console.print(f"[bold red]node failed to restart in runs {failed_restarts}[/]")
        raise typer.Exit(code=1)
    if idle:
        console.print(f"[bold red]NOT VERIFIED: runs {', '.join(idle)} acknowledged fewer than "
                      f"--min-acked {min_acked} publishes[/]")
        raise typer.Exit(code=3)


CHAOS_HINT = "pip install 'moorline[chaos]'"


def require_extras(with_verify: bool) -> None:
    """One line naming the extra to install, not an ImportError in a client thread (chaos's
    publishers use paho-mqtt) or a traceback from verify (PySpark)."""
    needed = [("paho.mqtt.client", "paho-mqtt")]
    if with_verify:
        needed.append(("pyspark", "PySpark"))
    for module, what in needed:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            top = module.partition(".")[0]
            if exc.name is None or not (exc.name == top or exc.name.startswith(top + ".")):
                raise
            typer.echo(f"moorline chaos needs {what} ({exc.name} is not installed): {CHAOS_HINT}", err=True)
            raise typer.Exit(code=2) from None


def _summary(res: RunResult) -> str:
    text = f"{res.acked}/{res.published} acked, {res.kills} kills"
    if res.run_dir is not None:  # a cluster
        text += (f" ({res.truncations} truncated), {res.pauses} pauses, {res.partitions} partitions, "
                 f"{res.leader_changes} leader changes")
    if res.corruption_detected:
        text += ", corruption detected"
    return text
