"""End to end: the harness against real nodes, then verify. A broken node must be caught; the
correct node must pass. All histories are checked by one Spark job (one run each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moorline.verify.checks import FAILING_KINDS

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def verdict(node_available: None, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from moorline.chaos.harness import ChaosConfig, run_once
    from moorline.verify.job import make_spark, run_verify

    out = tmp_path_factory.mktemp("chaos")
    runs = {
        "clean": ChaosConfig(duration_s=8, faults=frozenset({"kill", "truncate"}), kills_per_run=2, seed=11),
        "drop-on-restart": ChaosConfig(
            duration_s=6,
            faults=frozenset({"kill"}),
            kills_per_run=2,
            seed=12,
            node_faults={"drop_on_restart": True},
        ),
        "unsafe-ack": ChaosConfig(
            duration_s=6,
            faults=frozenset({"kill", "truncate"}),
            kills_per_run=3,
            seed=13,
            node_faults={"unsafe_ack_before_sync": True},
        ),
        "bitflip": ChaosConfig(duration_s=5, faults=frozenset({"kill", "bitflip"}), kills_per_run=1, seed=14),
    }
    results = {name: run_once(cfg, name, out) for name, cfg in runs.items()}
    from pyspark.sql import SparkSession

    shared = SparkSession.getActiveSession()  # the verify suite's session, when both suites run together
    spark = make_spark("local[2]", shuffle_partitions=1, app_name="moorline-chaos-tests")
    try:
        v = run_verify(spark, [r.history for r in results.values()], out / "report")
    finally:
        if shared is None:
            spark.stop()
    return {r["run"]: r for r in v.runs}, results, out / "report"


def test_chaos_clean_run_against_correct_node_passes(verdict: Any) -> None:
    runs, results, _ = verdict
    row = runs["clean"]
    assert results["clean"].kills == 2 and row["fault_kill"] == 2 and row["fault_truncate"] == 2
    assert row["acknowledged"] > 100 and row["first_deliveries"] > 0
    assert {k: row[k] for k in FAILING_KINDS if row[k]} == {}


def test_chaos_drop_on_restart_node_is_caught_losing_messages(verdict: Any) -> None:
    runs, _, _ = verdict
    assert runs["drop-on-restart"]["lost"] > 0


def test_chaos_unsafe_ack_before_sync_with_truncate_is_caught(verdict: Any) -> None:
    runs, _, _ = verdict
    assert runs["unsafe-ack"]["fault_truncate"] == 3
    assert runs["unsafe-ack"]["lost"] > 0


def test_chaos_bitflip_is_detected_or_harmless_never_silent_loss(verdict: Any) -> None:
    runs, results, _ = verdict
    row = runs["bitflip"]
    assert row["fault_bitflip"] == 1
    assert row["lost"] == 0  # any loss must come with a corruption report (lost_detected_corruption)
    if row["lost_detected_corruption"]:
        assert results["bitflip"].corruption_detected


def test_chaos_report_files_are_written(verdict: Any) -> None:
    _, _, report = verdict
    html = (Path(report) / "report.html").read_text()
    assert "<svg" in html and "drop-on-restart" in html
    assert (Path(report) / "summary.json").exists()
