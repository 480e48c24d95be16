"""Whole simulations: clean seeds must pass and reach the rare paths; replays are exact.

``MOORLINE_SIM_SEEDS`` sets how many clean 3-node seeds run (default 200, the CI-sized run,
about a minute of CPU); the coverage assertions need the default (the rare paths are rare).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from moorline.sim.cli import sim
from moorline.sim.marks import RARE_PATHS, CoverageReport, Marks
from moorline.sim.simulation import SeedResult, SimConfig, Simulation

CLEAN_SEEDS = int(os.environ.get("MOORLINE_SIM_SEEDS", "200"))
FIVE_NODE_SEEDS = max(1, CLEAN_SEEDS // 10)

# rare paths a clean run must keep reaching (TigerBeetle-style coverage marks)
REQUIRED_MARKS = (
    "leader_elected",
    "leader_stepped_down_check_quorum",
    "leadership_transferred",
    "snapshot_sent",
    "snapshot_installed",
    "log_compacted",
    "torn_tail_truncated",
    "unsynced_writes_lost",
    "corruption_detected",
    "corrupted_replica_removed",
    "wiped_node_restarted",
    "wiped_node_readded",
    "learner_promoted",
    "read_index_served",
    "queue_dedup_at_apply",
    "queue_redelivery_after_expiry",
    "client_retry",
    *RARE_PATHS,
)


def _describe(r: SeedResult) -> str:
    return "\n".join([f"seed {r.seed}: {r.violations}", r.params, *r.trace])


@pytest.fixture(scope="module")
def clean_run() -> tuple[Marks, Counter[str], list[SeedResult]]:
    coverage = CoverageReport()
    faults: Counter[str] = Counter()
    failures: list[SeedResult] = []
    for seed in range(CLEAN_SEEDS):
        r = Simulation(SimConfig(seed=seed)).run()
        coverage.add_seed(r.marks)
        faults.update(r.faults)
        if not r.ok:
            failures.append(r)
            break
    return coverage.marks, faults, failures


def test_clean_seeds_have_no_violation(clean_run: tuple[Marks, Counter[str], list[SeedResult]]) -> None:
    _marks, faults, failures = clean_run
    assert not failures, _describe(failures[0])
    assert sum(faults.values()) > 0


def test_clean_seeds_reach_the_rare_paths(clean_run: tuple[Marks, Counter[str], list[SeedResult]]) -> None:
    """The standard run (the CI-sized one) reaches every rare path the bug switches need: a
    check can only see a bug on a path the run takes."""
    if CLEAN_SEEDS < 200:
        pytest.skip("the rare paths are asserted for the CI-sized run (200 seeds)")
    marks, faults, _failures = clean_run
    missing = [m for m in REQUIRED_MARKS if marks.get(m) == 0]
    assert not missing, f"coverage marks never hit: {missing}"
    for kind in ("crash", "pause", "wipe", "bit_flip", "transfer", "replace", "stall", "new_leader_fault"):
        assert faults[kind] > 0, kind
    assert sum(v for k, v in faults.items() if k.startswith("partition_")) > 0


def test_the_coverage_report_counts_rare_paths_per_run_and_per_seed() -> None:
    report = CoverageReport()
    a, b = Marks(), Marks()
    a.hit("stale_term_suffix_truncated", 3)
    b.hit("stale_term_suffix_truncated")
    b.hit("conf_change_refused_pending", 2)
    report.add_seed(a)
    report.add_seed(b)
    rows = {line.split()[0]: line.split()[1:3] for line in report.table_lines()[1:]}
    assert rows["stale_term_suffix_truncated"] == ["4", "2"]  # 4 times, in 2 seeds
    assert rows["conf_change_refused_pending"] == ["2", "1"]
    assert rows["snapshot_over_longer_divergent_log"] == ["0", "0"]
    assert "NOT REACHED" in next(x for x in report.table_lines() if "snapshot_over_longer" in x)
    assert "snapshot_over_longer_divergent_log" in report.missing()
    assert "stale_term_suffix_truncated" not in report.missing()


def test_the_cli_prints_the_coverage_report() -> None:
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(sim)
    result = CliRunner().invoke(app, ["--seeds", "2", "--ops", "200", "--progress-every", "0"])
    assert result.exit_code == 0, result.output[-3000:]
    lines = result.output.splitlines()
    at = lines.index("coverage of rare paths (2 seeds):")
    table = lines[at + 2 : at + 2 + len(RARE_PATHS)]
    assert [line.split()[0] for line in table] == list(RARE_PATHS)


def test_five_node_seeds_have_no_violation() -> None:
    for seed in range(FIVE_NODE_SEEDS):
        r = Simulation(SimConfig(seed=seed, nodes=5, ops=600)).run()
        assert r.ok, _describe(r)


def test_same_seed_same_run() -> None:
    a = Simulation(SimConfig(seed=7, ops=300)).run()
    b = Simulation(SimConfig(seed=7, ops=300)).run()
    assert a.trace_digest == b.trace_digest and a.events == b.events and a.trace == b.trace
    c = Simulation(SimConfig(seed=8, ops=300)).run()
    assert c.trace_digest != a.trace_digest


def _cli(args: list[str], hashseed: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    code = "import typer; from moorline.sim.cli import sim; typer.run(sim)"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def _trace_block(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "trace (last" in line)
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    return [lines[start].strip().split("digest")[1], *block]


def test_violation_replays_exactly_across_processes() -> None:
    """A failing run prints its seed and trace; --replay in another process (another hash
    seed) prints the same trace and fails again."""
    run = _cli(["--seeds", "50", "--bug", "vote_without_persist", "--ops", "1000"], "1")
    assert run.returncode == 1, run.stdout[-3000:]
    assert "VIOLATION seed=" in run.stdout
    seed = int(run.stdout.split("VIOLATION seed=")[1].split()[0])
    replay = _cli(["--replay", str(seed), "--bug", "vote_without_persist", "--ops", "1000"], "2")
    assert replay.returncode == 1, replay.stdout[-3000:]
    assert _trace_block(run.stdout) == _trace_block(replay.stdout)


def test_clean_cli_run_exits_zero() -> None:
    run = _cli(["--seeds", "3", "--ops", "200"], "3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "seeds run: 3" in run.stdout and "violations: 0" in run.stdout
