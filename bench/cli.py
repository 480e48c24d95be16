"""``python -m bench`` (from the repository root): moorline next to Mosquitto and amqtt on loopback."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from rich.console import Console

from bench import machine, runner
from bench import report as report_mod


def bench(
    brokers: str = "moorline,mosquitto,amqtt",
    reps: int = 3,
    quick: bool = False,
    json_out: Path = Path("bench-results.json"),
) -> None:
    """Side-by-side benchmark: W1 (QoS 1, 100 B x 20,000), W2 (64 KiB x 2,000), a saturation sweep with a lean
    load generator, a shallow pipeline (one pair, 16 in flight), and the cost of moorline's strict packet ids. Each broker is started fresh on loopback and
    stopped after. --quick: few messages, one repetition (smoke test)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # keep the tables readable in logs
    names = tuple(name.strip() for name in brokers.split(",") if name.strip())
    config = runner.quick_config(names) if quick else runner.full_config(names, max(1, reps))
    started = time.time()
    load_at_start = os.getloadavg()
    speed = machine.probe()
    console.print(f"machine: 10M Python loop iterations {speed['python_loop_10m_s']:.3f} s, "
                  f"one system call from Python {speed['syscall_us']:.2f} µs")
    result = runner.run(config, log=console.print)
    result["meta"] = {
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
    if quick:
        report_mod.mark_quick(result["comparison"])
    report_mod.print_report(console, result)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {json_out}")
