"""Smoke test of the benchmark harness: `python -m bench --quick` against Mosquitto only, then a look at the JSON.

No speed is asserted (speed belongs to the bench itself); this checks the harness measures something coherent:
every message arrived, the latency percentiles are ordered, CPU and memory were read from /proc.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _mosquitto_installed() -> bool:
    return shutil.which("mosquitto") is not None or os.path.exists("/usr/sbin/mosquitto")


@pytest.mark.skipif(not _mosquitto_installed(), reason="mosquitto is not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bench reads /proc")
def test_bench_quick_mode_against_mosquitto_writes_sane_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--brokers", "mosquitto", "--quick", "--json-out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())

    assert report["brokers"]["mosquitto"]["status"] == "ok"
    assert report["meta"]["quick"] is True
    speed = report["meta"]["machine_speed"]
    assert 0 < speed["python_loop_10m_s"] < 60 and 0 < speed["syscall_us"] < 1000
    mosquitto = report["results"]["mosquitto"]
    for workload in ("w1", "w2"):
        assert "error" not in mosquitto[workload], mosquitto[workload]
        config = report["config"][workload]
        [rep] = mosquitto[workload]["reps"]  # quick mode: exactly one repetition
        assert rep["complete"] is True
        assert rep["received"] == config["messages"]
        assert rep["msgs_per_s"] > 0
        assert 0 < rep["latency_p50_ms"] <= rep["latency_p99_ms"] <= rep["latency_max_ms"] < 60_000
        assert rep["cpu_s_per_10k"] is not None and 0 <= rep["cpu_s_per_10k"] < 100
        assert 1 < rep["peak_rss_mb"] < 4096
        assert mosquitto[workload]["median"]["msgs_per_s"] == rep["msgs_per_s"]
    saturation = mosquitto["saturation"]
    assert "error" not in saturation, saturation
    assert saturation["max"]["delivered"] > 0
    assert saturation["max"]["msgs_per_s"] == pytest.approx(
        saturation["max"]["delivered"] / saturation["max"]["measure_s"]
    )
    assert saturation["max"]["cpu_s"] > 0  # a saturated broker burns CPU; 0 would mean /proc was not read
    shallow = mosquitto["shallow"]["run"]  # one pair, a few messages in flight
    assert shallow["pairs"] == 1 and report["config"]["shallow"]["window"] == 16
    assert shallow["delivered"] > 0 and shallow["cpu_s"] > 0
    assert "Shallow pipeline" in proc.stdout
    # W1 again over TLS (bench/tls_bench.py), the clients verifying the dev CA; its ratio to plain W1
    [tls_rep] = mosquitto["w1_tls"]["reps"]
    assert tls_rep["complete"] is True and tls_rep["received"] == report["config"]["w1"]["messages"]
    tls = report["comparison"]["tls"]["mosquitto"]
    assert tls["w1_msgs_per_s_tls"] == tls_rep["msgs_per_s"] and tls["w1_cpu_s_per_10k_tls"] == tls_rep["cpu_s_per_10k"]
    assert "W1 over TLS, mosquitto" in proc.stdout
    # moorline was not requested: no targets, ratios or packet-id line.
    assert {k: v for k, v in report["comparison"].items() if k != "tls"} == {
        "targets": [], "ratios": {}, "strict_packet_ids": None}
    assert "W1:" in proc.stdout and "mosquitto" in proc.stdout
