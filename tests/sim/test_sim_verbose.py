"""``moorline sim --replay S --verbose`` prints every Raft message (with its fate) and every vote
of seed S as they happen, bounded by --verbose-max-lines, and replays the same run as without
--verbose (the same trace digest)."""

from __future__ import annotations

import re

import typer
from typer.testing import CliRunner

from moorline.sim.cli import sim

MESSAGE = re.compile(r"^ +\d+ms   n\d/s\d+ -> n\d/s\d+ [A-Z_]+ term=\d+")
VOTE = re.compile(r"^ +\d+ms vote: n\d/s\d+ votes for n\d/s\d+ in term \d+$")


def _run(*args: str) -> str:
    app = typer.Typer()
    app.command()(sim)
    result = CliRunner().invoke(app, [*args, "--progress-every", "0"])
    assert result.exit_code == 0, result.output[-3000:]
    return result.output


def _digest(out: str) -> str:
    return re.search(r"digest ([0-9a-f]{8})", out).group(1)  # type: ignore[union-attr]


def test_verbose_replay_prints_every_message_and_vote() -> None:
    out = _run("--replay", "3", "--ops", "300", "--verbose")
    lines = out.splitlines()
    messages = [x for x in lines if MESSAGE.match(x)]
    votes = [x for x in lines if VOTE.match(x)]
    assert len(messages) > 500
    assert votes and any(" APP term=" in x and "entries=" in x for x in messages)
    assert any(x.split()[-1] == "GRANTED" and "VOTE_RESP" in x for x in messages)
    # each vote line comes with the grant that carries it
    for v in votes:
        voter, cand = re.findall(r"n\d/s\d+", v)
        assert any(f"{voter} -> {cand} VOTE_RESP" in x and "GRANTED" in x for x in messages)
    # the verbose run is the same run
    assert _digest(out) == _digest(_run("--replay", "3", "--ops", "300"))


def test_verbose_output_is_bounded() -> None:
    out = _run("--replay", "3", "--ops", "300", "--verbose", "--verbose-max-lines", "25")
    lines = out.splitlines()
    stop = next(i for i, x in enumerate(lines) if x.startswith("... verbose output stops after 25 lines"))
    assert stop == 25
    assert lines[stop + 1].startswith("seed 3: ok")


def test_verbose_needs_a_replay_seed() -> None:
    app = typer.Typer()
    app.command()(sim)
    result = CliRunner().invoke(app, ["--seeds", "2", "--verbose"])
    assert result.exit_code == 2
    assert "--verbose needs --replay" in result.output
