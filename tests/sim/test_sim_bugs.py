"""Proof the checkers can fail: every test-only switch (a realistic bug in the Raft core or in the
sim host) is caught within 200 seeds of the DEFAULT fault mix: the mix clean runs draw, the
same for every switch, no mix tuned per bug. The checks that restate a core rule (the host's
commit-rule check) are off: the effect checks must see every bug on their own.

Each test stops at the first violating seed, then runs that seed without the switch, which
must pass (the switch broke it, not the seed). The comment on each case is the seed that
caught it when it was written (seeds needed = that + 1); docs/simulator.md has the table with
both cluster sizes. A switch that stops being caught within 200 seeds fails here.
"""

from __future__ import annotations

import pytest

from moorline.sim.simulation import ALL_BUGS, SeedResult, SimConfig, Simulation

MAX_SEEDS = 200

# (switch, cluster size it is tested at): the first seed that catches it at 3 / at 5 nodes,
# from seed 0 (seeds needed = that + 1), when this was written (docs/raft-simulator.md)
CASES: list[tuple[str, int]] = [
    ("vote_without_persist", 3),  # 1 / 0
    ("commit_prev_term_by_count", 3),  # 38 / 144
    ("no_election_reset_on_append", 3),  # 1 / 0 (the stability phase)
    ("self_ack_before_sync", 3),  # 1 / 0
    ("hard_state_sync_skipped", 3),  # 1 / 0
    ("accept_stale_term_append", 3),  # 40 / 35
    ("conf_change_while_pending", 5),  # not within 200 at 3 (one node in flux at a time) / 17
    ("forget_vote_on_restart", 3),  # 1 / 0
    ("heartbeat_commit_unclamped", 3),  # 5 / 0
    ("snapshot_keeps_log_tail", 3),  # 42 / 82
    ("ack_before_sync", 3),  # 3 / 29
    ("wiped_rejoins_as_voter", 3),  # 9 / 20
    ("truncate_synced_corruption", 3),  # 23 / 0
    ("dedup_at_propose", 3),  # 0 / 7
]


def _run(seed: int, nodes: int, bug: str | None) -> SeedResult:
    return Simulation(
        SimConfig(seed=seed, nodes=nodes, ops=1000 if nodes == 3 else 600, bug=bug, rule_checks=False)
    ).run()


def test_every_switch_has_a_case() -> None:
    assert sorted(b for b, _ in CASES) == sorted(ALL_BUGS)


@pytest.mark.parametrize(("bug", "nodes"), CASES, ids=[b for b, _ in CASES])
def test_switch_is_caught_by_the_default_mix(bug: str, nodes: int) -> None:
    for seed in range(MAX_SEEDS):
        r = _run(seed, nodes, bug)
        if not r.ok:
            assert r.violations[0]
            clean = _run(seed, nodes, None)
            assert clean.ok, f"seed {seed} fails without the switch too: {clean.violations}"
            return
    pytest.fail(f"switch {bug} not caught in {MAX_SEEDS} seeds of the default mix at {nodes} nodes")
