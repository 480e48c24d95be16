"""``python -m bench`` (from the repository root): moorline next to Mosquitto and amqtt on loopback."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import typer
from rich.console import Console

from bench import cluster, machine, runner
from bench import report as report_mod

CLUSTER_SIZES = (3, 5)  # node addresses 127.0.0.11-15; three replicas of the topic in both


def bench(
    brokers: str | None = None,
    reps: int = 3,
    quick: bool = False,
    json_out: Path | None = None,
    cluster_nodes: int = typer.Option(0, "--cluster", help="N: W1 and W2 against N-node clusters (moorline, "
                                      "NATS JetStream R3, RabbitMQ quorum queue of 3) instead of single nodes"),
    scale: bool = typer.Option(False, "--scale", help="moorline's W1 on 1, 3 and 5 nodes (3 replicas): summed "
                               "CPU-s/10k, each node's share, and the 5-node / 3-node ratio (issue 32)"),
    learners: str = typer.Option("all", "--learners", help="shard.learners of moorline's clusters: all (every "
                                 "node keeps every shard) or none (a shard on its replicas only)"),
    workloads: str | None = typer.Option(None, "--workloads", help="with --cluster: a subset of w1,w2,saturation "
                                         "(default all; saturation, the lean load generator's pairs spread over "
                                         "the nodes, at 3 nodes only, moorline and NATS)"),
) -> None:
    """Side-by-side benchmark: W1 (QoS 1, 100 B x 20,000), W2 (64 KiB x 2,000), a saturation sweep with a lean
    load generator, a shallow pipeline (one pair, 16 in flight), and the cost of moorline's strict packet ids. Each broker is started fresh on loopback and
    stopped after. --quick: few messages, one repetition (smoke test). --cluster 3 (or 5): W1 and W2 against 3-node
    (5-node) clusters of moorline, NATS JetStream and RabbitMQ (default brokers moorline,nats,rabbitmq), and at 3 nodes
    a saturation sweep of moorline and NATS (--workloads picks a subset). --scale:
    moorline's W1 on 1, 3 and 5 nodes, the scale table."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # keep the tables readable in logs
    if learners not in ("all", "none"):
        raise typer.BadParameter(f"--learners must be all or none, not {learners!r}")
    cluster.MOORLINE_LEARNERS[0] = learners
    if cluster_nodes and cluster_nodes not in CLUSTER_SIZES:
        raise typer.BadParameter(f"--cluster must be one of {CLUSTER_SIZES}, not {cluster_nodes}")
    if workloads is not None and not cluster_nodes:
        raise typer.BadParameter("--workloads chooses among the --cluster workloads: give --cluster 3 or 5")
    try:
        cluster_workloads = cluster.parse_workloads(workloads, cluster_nodes) if cluster_nodes else ()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if scale and (cluster_nodes or brokers):
        raise typer.BadParameter("--scale measures moorline alone on 1, 3 and 5 nodes: no --cluster or --brokers")
    default_brokers = cluster.DEFAULT_CLUSTER_BROKERS if cluster_nodes else "moorline,mosquitto,amqtt"
    names = tuple(name.strip() for name in (brokers or default_brokers).split(",") if name.strip())
    if json_out is None:
        json_out = Path("bench-scale-results.json" if scale
                        else "bench-cluster-results.json" if cluster_nodes else "bench-results.json")
    started = time.time()
    load_at_start = os.getloadavg()
    speed = machine.probe()
    console.print(f"machine: 10M Python loop iterations {speed['python_loop_10m_s']:.3f} s, "
                  f"one system call from Python {speed['syscall_us']:.2f} µs, "
                  f"load average {load_at_start[0]:.2f} / {load_at_start[1]:.2f} / {load_at_start[2]:.2f}")
    if scale:
        scale_report = cluster.run_scale(cluster.scale_config(max(1, reps), quick), log=console.print)
        scale_report["meta"] = _meta(started, quick, load_at_start, speed)
        if quick:
            cluster.mark_quick(scale_report["comparison"])
        cluster.print_scale(console, scale_report)
        json_out.write_text(json.dumps(scale_report, indent=2) + "\n")
        console.print(f"wrote {json_out}")
        return
    if cluster_nodes:
        cluster_config = (cluster.quick_config(names, cluster_nodes, cluster_workloads) if quick
                          else cluster.full_config(names, cluster_nodes, max(1, reps), cluster_workloads))
        result = cluster.run(cluster_config, log=console.print)
        result["meta"] = _meta(started, quick, load_at_start, speed)
        if quick:
            cluster.mark_quick(result["comparison"])
        cluster.print_report(console, result)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_out}")
        return
    config = runner.quick_config(names) if quick else runner.full_config(names, max(1, reps))
    result = runner.run(config, log=console.print)
    result["meta"] = _meta(started, quick, load_at_start, speed)
    if quick:
        report_mod.mark_quick(result["comparison"])
    report_mod.print_report(console, result)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {json_out}")


def _meta(started: float, quick: bool, load_at_start: tuple[float, float, float], speed: dict[str, float]) -> dict[str, object]:
    return {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "quick": quick,
        "cpus": os.cpu_count(),
        # Other work on the machine moves msgs/s a lot (CPU-s/10k much less): keep it next to the figures.
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        # Interpreted code and system calls drift apart between VMs and days: read ratios against these.
        "machine_speed": speed,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
