"""``moorline chaos`` refuses what it cannot run with a usage error, before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moorline.cli import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2"], "must be 1, 3 or 5, not 2"),
        (["--nodes", "4"], "must be 1, 3 or 5, not 4"),
        (["--nodes", "0"], "must be 1, 3 or 5, not 0"),
        (["--nodes", "3", "--faults", "bitflip"], "not made on a cluster of 3"),
        (["--nodes", "1", "--faults", "pause"], "not made on one node"),
        (["--nodes", "3", "--broker", "mosquitto"], "moorline nodes only"),
        (["--nodes", "3", "--partition-with", "nftables"], "auto, iptables, proxy"),
        (["--nodes", "3", "--pause-s", "0"], "durations must be > 0"),
        (["--nodes", "5", "--fault", "bogus"], "not 'bogus'"),
    ],
)
def test_chaos_cli_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["chaos", *args, "--out", str(tmp_path / "out"), "--no-verify"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.replace("│", " ").split())  # rich wraps the message in a box
    assert message in text, result.output
    assert not (tmp_path / "out").exists()  # nothing started
