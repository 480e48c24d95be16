"""The pure parts of ``python -m bench --cluster 5`` and ``--scale``: where the topic and the clients go, each
node's role and CPU share, the peers' configurations, the scale ratio against its target, the tables.

The runs themselves are covered by test_bench_cluster_smoke.py (three nodes); a five-node smoke run costs more
than a minute on a shared 2-core machine, so the five-node parts are checked here without processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from bench import cluster
from moorline.config import load_config

REPO = Path(__file__).resolve().parents[2]
NAMES5 = ["n1", "n2", "n3", "n4", "n5"]


def _shard_of(topic: str, count: int) -> int:
    return int(topic.rsplit("/", 1)[1]) % count


def _view(leader: str, voters: list[str], preferred: str | None = None) -> dict[str, Any]:
    return {"leader": leader, "voters": voters, "preferred_leader": preferred or leader,
            "learners": [n for n in NAMES5 if n not in voters]}


def test_three_nodes_keep_the_first_layout() -> None:
    views = {0: _view("n1", ["n1", "n2", "n3"]), 1: _view("n2", ["n1", "n2", "n3"]),
             2: _view("n3", ["n1", "n2", "n3"])}
    placement = cluster.pick_moorline_topic("bench/w1", ["n1", "n2", "n3"], 3, views, "n3", _shard_of)
    assert (placement.topic, placement.shard, placement.leader) == ("bench/w1/2", 2, "n3")
    assert (placement.publish_node, placement.subscribe_node) == ("n1", "n2")
    assert placement.roles(["n1", "n2", "n3"]) == {"n1": "pub+follower", "n2": "sub+follower", "n3": "leader"}


def test_five_nodes_put_both_clients_outside_the_shards_voters() -> None:
    views = {
        0: _view("n2", ["n2", "n4", "n5"], preferred="n4"),  # led off its preferred leader: it would move
        1: _view("n3", ["n1", "n3", "n4"]),
        2: _view("n1", ["n1", "n2", "n5"]),
    }
    placement = cluster.pick_moorline_topic("bench/w1", NAMES5, 3, views, "n5", _shard_of)
    assert (placement.topic, placement.shard, placement.leader) == ("bench/w1/1", 1, "n3")
    assert (placement.publish_node, placement.subscribe_node) == ("n2", "n5")
    assert placement.publish_node not in placement.voters and placement.subscribe_node not in placement.voters
    assert placement.roles(NAMES5) == {"n1": "follower", "n2": "pub+non-voter", "n3": "leader",
                                       "n4": "follower", "n5": "sub+non-voter"}


def test_no_suitable_shard_is_a_clear_error() -> None:
    views = {0: _view("n1", ["n1", "n2", "n3"]), 1: {"leader": None, "voters": []}}
    with pytest.raises(RuntimeError, match="no shard led by n3"):
        cluster.pick_moorline_topic("bench/w1", ["n1", "n2", "n3"], 2, views, "n3", _shard_of)


def test_clients_stay_on_node_1_and_2_when_every_node_is_a_replica() -> None:
    assert cluster.spread_clients(["n1", "n2", "n3"], ("n3", "n1", "n2"), "n1", "n2") == ("n1", "n2")
    assert cluster.spread_clients(NAMES5, ("n5", "n1", "n3"), "n1", "n2") == ("n2", "n4")


def test_nats_stream_peers_include_the_node_that_reports_them() -> None:
    # A node lists the streams it hosts, with the leader and the *other* peers (n4's view of n1, n4, n5).
    report = {"account_details": [{"stream_detail": [
        {"name": "$MQTT_sess", "cluster": {"leader": "n2", "replicas": [{"name": "n1"}, {"name": "n3"}]}},
        {"name": "$MQTT_msgs", "cluster": {"leader": "n5", "replicas": [{"name": "n1"}, {"name": "n5"}]}},
    ]}]}
    assert cluster.stream_placement("n4", report) == ("n5", ["n1", "n4", "n5"])
    assert cluster.stream_placement("n2", {"account_details": []}) is None


def test_cpu_by_role_and_its_median() -> None:
    roles = {"n1": "leader", "n2": "pub+non-voter", "n3": "follower", "n4": "follower", "n5": "sub+non-voter"}
    rep1 = {"cpu_by_role": cluster.cpu_by_role({"n1": 4.0, "n2": 2.0, "n3": 1.0, "n4": 3.0, "n5": 0.0}, roles,
                                               20_000)}
    assert rep1["cpu_by_role"]["follower"] == {"nodes": 2, "cpu_s": 4.0, "cpu_s_per_10k_per_node": 1.0,
                                               "share": 0.4}
    assert rep1["cpu_by_role"]["leader"]["cpu_s_per_10k_per_node"] == 2.0
    rep2 = {"cpu_by_role": cluster.cpu_by_role({"n1": 6.0, "n2": 2.0, "n3": 1.0, "n4": 1.0, "n5": 0.0}, roles,
                                               20_000)}
    median = cluster.median_by_role([rep1, rep2])
    assert median["leader"] == {"nodes": 1, "reps": 2, "cpu_s_per_10k_per_node": 2.5, "share": 0.5}
    text = cluster.format_roles(median)
    assert text.index("pub+non-voter") < text.index("sub+non-voter") < text.index("leader") < text.index("follower")
    assert "follower x2 0.750" in text and "leader 2.500 (50%)" in text


def test_a_single_node_run_does_everything() -> None:
    result: dict[str, Any] = {"cpu_s": 0.6, "received": 20_000}
    cluster.add_roles(result)
    assert result["cpu_by_role"] == {"pub+sub+leader": {"nodes": 1, "cpu_s": 0.6, "cpu_s_per_10k_per_node": 0.3,
                                                        "share": 1.0}}


def test_five_node_configurations_hold_three_replicas(tmp_path: Path) -> None:
    moorline = cluster.MoorlineCluster(5)
    (tmp_path / "m.toml").write_text(moorline.config_text())
    assert load_config(tmp_path / "m.toml").shard.replicas == 3
    nats = cluster.NatsCluster(5)
    text = nats.config_text("n4", tmp_path, "nats://127.0.0.14:4248", ["nats://127.0.0.11:4248"], 1, 2, 3)
    assert "stream_replicas: 3\n" in text and "server_name: n4\n" in text
    assert cluster.NatsCluster(3).replicas == 3
    assert cluster.quorum_queue_arguments(3)["x-quorum-initial-group-size"] == 3


def _scale_rows(cpu: dict[int, float]) -> dict[str, Any]:
    roles = {"leader": {"nodes": 1, "reps": 3, "cpu_s_per_10k_per_node": 0.4, "share": 0.35}}
    return {str(n): {"median": {"cpu_s_per_10k": v, "msgs_per_s": 3000.0, "latency_p50_ms": 60.0,
                                "latency_p99_ms": 120.0}, "median_by_role": roles} for n, v in cpu.items()}


def test_scale_ratio_against_the_issue_target() -> None:
    config = cluster.scale_config(3, quick=False)
    comparison = cluster.compare_scale(_scale_rows({1: 0.3, 3: 1.0, 5: 2.31}), config)
    [target] = comparison["targets"]
    assert target["bound"] == 1.1 and target["moorline"] == pytest.approx(2.31) and target["met"] is False
    assert comparison["ratios"]["3"]["over_1_node"] == pytest.approx(1.0 / 0.3)
    assert cluster.compare_scale(_scale_rows({3: 1.0, 5: 1.1}), config)["targets"][0]["met"] is True
    missing = cluster.compare_scale(_scale_rows({1: 0.3, 3: 1.0}), config)
    assert missing["targets"][0]["met"] is None and missing["ratios"]["5"]["over_3_nodes"] is None


def test_scale_table_prints_the_ratio_next_to_its_target() -> None:
    config = cluster.scale_config(1, quick=True)
    rows = _scale_rows({1: 0.3, 3: 1.0})
    rows["5"] = {"error": "RuntimeError: five nodes did not start", "reps": []}
    report = {"config": cluster.asdict(config), "rows": rows, "comparison": cluster.compare_scale(rows, config),
              "meta": {"quick": True}}
    cluster.mark_quick(report["comparison"])
    console = Console(width=250, record=True)
    cluster.print_scale(console, report)
    text = console.export_text()
    assert "W1 summed CPU-s/10k, 5 nodes / 3 nodes" in text and "<= 1.10x" in text
    assert "not comparable" in text and "five nodes did not start" in text
    assert "leader 0.400 (35%)" in text and "3.33" in text  # 3 nodes over 1 node


def test_cluster_report_prints_cpu_per_node_by_role() -> None:
    config = cluster.quick_config(("moorline",), 5)
    block = {"median": {"msgs_per_s": 2000.0, "latency_p50_ms": 50.0, "latency_p99_ms": 80.0, "cpu_s_per_10k": 1.5,
                        "peak_rss_mb": 300.0, "complete": True},
             "median_by_role": {"sub+non-voter": {"nodes": 1, "cpu_s_per_10k_per_node": 0.2, "share": 0.13}},
             "reps": []}
    report = {"config": cluster.asdict(config), "results": {"moorline": {"w1": block, "w2": block}},
              "brokers": {"moorline": {"status": "ok"}}, "comparison": {"targets": [], "ratios": {}}}
    console = Console(width=300, record=True)
    cluster.print_report(console, report)
    text = console.export_text()
    assert "W1 on 5-node clusters" in text and "outside the topic's 3 replicas" in text
    assert "sub+non-voter 0.200 (13%)" in text


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "4"], "--cluster must be one of (3, 5)"),
    (["--scale", "--cluster", "5"], "--scale measures moorline alone"),
])
def test_cli_refuses_what_it_cannot_run(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert message in " ".join((proc.stdout + proc.stderr).split()), proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr
