"""The pure parts of the cluster saturation sweep (``python -m bench --cluster 3``, workload ``saturation``): where
each pair's publisher, subscriber and topic go, the sweep's stop rule, the target against NATS R3 and its table.

A run against real clusters is the bench's job (bench/README.md); these tests start no process.
"""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from bench import cluster

NAMES3 = ["n1", "n2", "n3"]


def _shard_of(topic: str, count: int) -> int:
    return int(topic.rsplit("/", 1)[1]) % count


def _views(leaders: list[str]) -> dict[int, dict[str, Any]]:
    return {shard: {"leader": leader, "voters": NAMES3} for shard, leader in enumerate(leaders)}


def test_pairs_spread_over_the_nodes() -> None:
    assert [cluster.pair_nodes(i, NAMES3) for i in range(4)] == [("n1", "n2"), ("n2", "n3"), ("n3", "n1"),
                                                                  ("n1", "n2")]
    placed = cluster.spread_pairs(3, NAMES3, leader="n2")
    assert [(p.topic, p.publish_node, p.subscribe_node, p.leader) for p in placed] == [
        ("bench/sat/0", "n1", "n2", "n2"), ("bench/sat/1", "n2", "n3", "n2"), ("bench/sat/2", "n3", "n1", "n2")]


def test_moorline_pairs_take_shards_led_by_each_node_in_turn() -> None:
    # Six shards, two led by each node.
    views = _views(["n1", "n2", "n3", "n1", "n2", "n3"])
    placed = cluster.pick_moorline_pairs(6, NAMES3, 6, views, _shard_of)
    # Pair i: publisher on node i % 3, subscriber on (i + 1) % 3, its shard led by the third node.
    for pair in placed:
        assert (pair.publish_node, pair.subscribe_node) == cluster.pair_nodes(pair.index, NAMES3)
        assert pair.leader == NAMES3[(pair.index + 2) % 3] == views[pair.shard or 0]["leader"]
        assert _shard_of(pair.topic, 6) == pair.shard and pair.topic.startswith(f"bench/sat/{pair.index}/")
    assert sorted(pair.shard or 0 for pair in placed) == [0, 1, 2, 3, 4, 5]  # no two pairs on one shard
    assert sorted({pair.leader or "" for pair in placed}) == NAMES3


def test_moorline_pairs_share_a_shard_only_when_its_leader_has_no_other() -> None:
    views = _views(["n1", "n2", "n3"])
    placed = cluster.pick_moorline_pairs(4, NAMES3, 3, views, _shard_of)
    assert [pair.shard for pair in placed] == [2, 0, 1, 2]  # pair 3 wants n3 again: its only shard
    with pytest.raises(RuntimeError, match="no shard led by n3"):
        cluster.pick_moorline_pairs(1, NAMES3, 2, _views(["n1", "n2"]), _shard_of)


@pytest.mark.parametrize("rates, expected", [
    ([], 1),
    ([100.0], 2),
    ([100.0, 106.0], 3),  # the second pair added 6 %: one more
    ([100.0, 105.0], None),  # 5 % is not more than 5 %
    ([100.0, 90.0], None),
    ([100.0, 150.0, 200.0, 260.0, 330.0], 6),
    ([100.0, 150.0, 200.0, 260.0, 330.0, 420.0], None),  # at most 6 pairs
])
def test_the_sweep_adds_a_pair_while_the_last_one_added_more_than_5_percent(rates: list[float],
                                                                             expected: int | None) -> None:
    steps = [(pairs, rate) for pairs, rate in enumerate(rates, start=1)]
    assert cluster.next_pair_count(steps, (1, 2), 6) == expected


def test_quick_sweep_is_one_step() -> None:
    assert cluster.next_pair_count([], (1,), 6) == 1
    assert cluster.next_pair_count([(1, 5000.0)], (1,), 6) is None


def _sat(rate: float, pairs: int = 2) -> dict[str, Any]:
    step = {"pairs": pairs, "msgs_per_s": rate, "publish_acks_per_s": rate, "cpu_s_per_10k": 1.0}
    return {"max": step, "steps": [step], "still_rising": False}


def test_target_and_ratio_against_nats() -> None:
    config = cluster.full_config(("moorline", "nats"), 3, 1, ("saturation",))
    results = {"moorline": {"saturation": _sat(9_000.0)}, "nats": {"saturation": _sat(10_000.0)}}
    comparison = cluster.compare(results, config)
    [target] = comparison["targets"]  # no W1 target without a W1 run
    assert target["target"] == "saturation msgs/s vs NATS R3" and target["bound"] == 10_000.0
    assert target["met"] is False
    assert comparison["ratios"]["nats"]["saturation_msgs_per_s"] == pytest.approx(0.9)
    results["moorline"]["saturation"] = _sat(10_000.2)
    assert cluster.compare(results, config)["targets"][0]["met"] is True


def test_workloads_option() -> None:
    assert cluster.parse_workloads(None, 3) == ("w1", "w2", "saturation")
    assert cluster.parse_workloads(None, 5) == ("w1", "w2")
    assert cluster.parse_workloads("saturation, w1", 3) == ("saturation", "w1")
    with pytest.raises(ValueError, match="3 nodes only"):
        cluster.parse_workloads("saturation", 5)
    with pytest.raises(ValueError, match="choose from w1, w2, saturation"):
        cluster.parse_workloads("w3", 3)
    assert cluster.full_config(("moorline",), 3, 3, ("w1",)).saturation is None
    sweep = cluster.full_config(("moorline",), 3, 3, ("saturation",)).saturation
    assert sweep is not None and sweep.pair_counts == (1, 2) and sweep.max_pairs == 6


def test_saturation_table() -> None:
    config = cluster.quick_config(("moorline", "nats", "rabbitmq"), 3, ("saturation",))
    results = {"moorline": {"saturation": _sat(12_345.0)}, "nats": {"saturation": _sat(6_000.0)},
               "rabbitmq": {"saturation": {"skipped": "not measured: the MQTT load generator does not speak AMQP"}}}
    report = {"config": cluster.asdict(config), "results": results, "meta": {"quick": True},
              "brokers": {name: {"status": "ok"} for name in results}, "comparison": cluster.compare(results, config)}
    cluster.mark_quick(report["comparison"])
    console = Console(width=300, record=True)
    cluster.print_report(console, report)
    text = console.export_text()
    assert "saturation on 3-node clusters" in text and "12,345" in text and "2: 6,000" in text
    assert "does not speak AMQP" in text and "saturation msgs/s vs NATS R3" in text
    assert "2.06x" in text  # moorline / NATS
    assert "W1 on" not in text  # not run, not printed


def test_saturation_target_is_compared_and_printed_as_msgs_per_s() -> None:
    config = cluster.full_config(("moorline", "nats"), 3, 1, ("w1", "saturation"))
    step = {"msgs_per_s": 1000.0, "latency_p99_ms": 40.0, "cpu_s_per_10k": 0.4}
    results = {"moorline": {"w1": {"median": step}, "saturation": _sat(5_000.4)},
               "nats": {"saturation": _sat(5_000.0)}}
    rows = {row["target"]: row for row in cluster.compare(results, config)["targets"]}
    assert rows["saturation msgs/s vs NATS R3"]["met"] is True  # 5,000 >= 5,000 as printed
    assert rows["W1 p99 ms"]["met"] is True
    report = {"config": cluster.asdict(config), "results": results, "brokers": {},
              "comparison": cluster.compare(results, config)}
    console = Console(width=300, record=True)
    cluster.print_report(console, report)
    assert ">= 5,000" in console.export_text()
