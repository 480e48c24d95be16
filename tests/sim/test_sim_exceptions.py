"""An exception from the code under test (an invariant violation in the core, an error from
``tick``) is a violation of that seed, reported with the seed and the replay command; it never
ends the run with a traceback. The broken build is injected by the test (a patched ``tick``)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from moorline.invariant import InvariantViolation
from moorline.raft import RaftNode
from moorline.sim.cli import sim
from moorline.sim.simulation import SimConfig, Simulation


def _break_tick(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """The core's tick raises an invariant violation on its ``after``-th call in the process."""
    calls = [0]
    real_tick = RaftNode.tick

    def tick(self: RaftNode) -> None:
        calls[0] += 1
        if calls[0] == after:
            raise InvariantViolation("injected: tick found a broken invariant")
        real_tick(self)

    monkeypatch.setattr(RaftNode, "tick", tick)


def test_an_exception_from_the_core_is_a_violation_of_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    _break_tick(monkeypatch, after=200)
    r = Simulation(SimConfig(seed=4, ops=200)).run()
    assert not r.ok
    v = r.violations[0]
    assert v.startswith("exception from the code under test: InvariantViolation: injected: tick found"), v
    assert "test_sim_exceptions.py:" in v and "in tick)" in v, v  # where it was raised
    assert any("exception InvariantViolation" in line for line in r.trace)  # the trace ends with it


def test_the_cli_reports_the_seed_and_the_replay_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _break_tick(monkeypatch, after=300)
    app = typer.Typer()
    app.command()(sim)
    result = CliRunner().invoke(app, ["--seeds", "3", "--start", "7", "--ops", "200", "--progress-every", "0"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output[-3000:]
    out = result.output
    assert "VIOLATION seed=7" in out, out[-3000:]
    assert "exception from the code under test: InvariantViolation" in out
    assert "replay: moorline sim --replay 7 --nodes 3 --ops 200 --verbose" in out
    assert "Traceback" not in out
