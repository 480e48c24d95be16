"""Smoke test of the cluster benchmark: `python -m bench --cluster 3 --quick --brokers moorline`, then the JSON
(W1, W2 and the one-pair saturation row).

No speed is asserted (the bench reports it); this checks that three nodes were measured as one broker (CPU of
each node read and summed), that the topic's shard was led by node 3 while the clients used nodes 1 and 2,
that every message arrived, each node's role and share of the CPU, and that every node process the bench started
is gone afterwards, also when a run fails. The five-node run's parts are in test_bench_cluster_placement.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cluster, runner
from bench.brokers import RunningBroker

REPO = Path(__file__).resolve().parents[2]


def _loopback_hosts_bindable(hosts: tuple[str, ...] = ("127.0.0.11", "127.0.0.12", "127.0.0.13")) -> bool:
    for host in hosts:
        try:
            with socket.socket() as sock:
                sock.bind((host, 0))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited (only its parent's bookkeeping is left)


pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bench reads /proc"),
    pytest.mark.skipif(not _loopback_hosts_bindable(), reason="127.0.0.11-13 cannot be bound here"),
]


def test_cluster_quick_mode_against_moorline_writes_sane_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--cluster", "3", "--quick", "--brokers", "moorline", "--json-out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["brokers"]["moorline"]["status"] == "ok"
    assert report["meta"]["quick"] is True and report["config"]["nodes"] == 3
    moorline = report["results"]["moorline"]
    for workload in ("w1", "w2"):
        assert "error" not in moorline[workload], moorline[workload]
        [rep] = moorline[workload]["reps"]
        assert rep["complete"] is True
        assert rep["received"] == report["config"][workload]["messages"]
        assert 0 < rep["latency_p50_ms"] <= rep["latency_p99_ms"] <= rep["latency_max_ms"] < 60_000
        # Three nodes measured as one broker: each node's CPU read, the figure is their sum.
        assert set(rep["cpu_s_by_member"]) == {"n1", "n2", "n3"}
        assert rep["cpu_s"] == pytest.approx(sum(rep["cpu_s_by_member"].values()))
        assert rep["cpu_s"] > 0 and rep["cpu_s_per_10k"] == pytest.approx(rep["cpu_s"] / rep["received"] * 10_000)
        assert 3 < rep["peak_rss_mb"] < 3 * 4096
        # Publisher on node 1, subscriber on node 2, the topic's shard led by node 3.
        assert rep["topic_leader_at_start"] == "n3" and rep["topic"].startswith(f"bench/{workload}/")
        assert rep["node_roles"] == {"n1": "pub+follower", "n2": "sub+follower", "n3": "leader"}
        assert sorted(rep["topic_voters"]) == ["n1", "n2", "n3"]
        assert set(rep["cpu_by_role"]) == {"pub+follower", "sub+follower", "leader"}
        assert sum(role["share"] for role in rep["cpu_by_role"].values()) == pytest.approx(1.0)
        assert rep["log_errors"] == 0, rep.get("log_samples")
        assert not [pid for pid in rep["member_pids"].values() if _alive(pid)]  # all stopped
    [target_w1_cpu, target_w1_p99] = report["comparison"]["targets"]
    assert target_w1_cpu["bound"] == 0.5 and target_w1_p99["bound"] == 50.0
    assert target_w1_cpu["met"] is None and target_w1_cpu["comparable"] is False  # --quick
    assert "W1 on 3-node clusters" in proc.stdout and "not comparable" in proc.stdout
    assert "pub+follower" in proc.stdout  # CPU per node by role
    # The saturation row: one pair (--quick), publisher on node 1, subscriber on node 2, its shard led by node 3.
    saturation = moorline["saturation"]
    assert "error" not in saturation, saturation
    [step] = saturation["steps"]
    assert step["pairs"] == 1 and step["delivered"] > 0 and saturation["max"]["delivered"] == step["delivered"]
    assert set(step["cpu_s_by_member"]) == {"n1", "n2", "n3"} and step["cpu_s"] > 0
    [pair] = step["saturation_pairs"]
    assert (pair["publish_node"], pair["subscribe_node"], pair["leader"]) == ("n1", "n2", "n3")
    assert step["saturation_leaders_moved"] == [] and step["log_errors"] == 0, step.get("log_samples")
    assert not [pid for pid in step["member_pids"].values() if _alive(pid)]
    assert "saturation on 3-node clusters" in proc.stdout


@pytest.mark.skipif(not _loopback_hosts_bindable(("127.0.0.14", "127.0.0.15")), reason="127.0.0.14-15 not bindable")
def test_five_node_quick_run_puts_the_clients_outside_the_topics_voters(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--cluster", "5", "--quick", "--brokers", "moorline", "--json-out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["nodes"] == 5 and "shard.replicas = 3" in report["brokers"]["moorline"]["version"]
    [rep] = report["results"]["moorline"]["w1"]["reps"]
    assert rep["complete"] is True and rep["received"] == report["config"]["w1"]["messages"]
    assert set(rep["cpu_s_by_member"]) == {"n1", "n2", "n3", "n4", "n5"}
    # Three voters of the topic's shard (read from GET /v1/shards), the clients on the two other nodes.
    voters = rep["topic_voters"]
    assert len(voters) == 3 and rep["topic_leader_at_start"] in voters
    assert rep["publish_node"] not in voters and rep["subscribe_node"] not in voters
    assert rep["publish_node"] != rep["subscribe_node"]
    assert sorted(rep["node_roles"].values()) == ["follower", "follower", "leader", "pub+non-voter", "sub+non-voter"]
    assert rep["cpu_by_role"]["follower"]["nodes"] == 2
    assert rep["log_errors"] == 0, rep.get("log_samples")
    assert not [pid for pid in rep["member_pids"].values() if _alive(pid)]
    assert "outside the topic's 3 replicas" in proc.stdout


def test_a_failing_cluster_run_stops_every_node(tmp_path: Path) -> None:
    started: dict[str, Any] = {}

    def body(broker: RunningBroker) -> dict[str, Any]:
        assert isinstance(broker, cluster.RunningCluster)
        started.update({member.name: member.pid for member in broker.members})
        raise RuntimeError("a run that fails half-way")

    with pytest.raises(RuntimeError, match="a run that fails half-way"):
        runner._with_broker(cluster.MoorlineCluster(3), None, body)
    assert set(started) == {"n1", "n2", "n3"}
    assert not [pid for pid in started.values() if _alive(pid)]
