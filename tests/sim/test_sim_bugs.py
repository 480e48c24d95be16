"""Proof the checkers can fail: every known-broken variant is caught within a bounded number
of seeds (stopping at the first violation)."""

from __future__ import annotations

import pytest

from moorline.sim.simulation import ALL_BUGS, SimConfig, Simulation

MAX_SEEDS = 200


@pytest.mark.parametrize("bug", ALL_BUGS)
def test_bug_is_caught(bug: str) -> None:
    for seed in range(MAX_SEEDS):
        r = Simulation(SimConfig(seed=seed, bug=bug)).run()
        if not r.ok:
            assert r.violations[0]
            return
    pytest.fail(f"bug {bug} not caught in {MAX_SEEDS} seeds")
