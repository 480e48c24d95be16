"""``moorline sim`` refuses a cluster size it cannot simulate as a usage error, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_an_even_cluster_size_is_a_usage_error() -> None:
    env = dict(os.environ, COLUMNS="200", TERM="dumb")  # a wide error box: the message on one line
    proc = subprocess.run(
        [sys.executable, "-m", "moorline", "sim", "--nodes", "4", "--seeds", "1", "--ops", "10"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]  # click's usage-error code
    assert "--nodes must be 1, 3 or 5, not 4" in proc.stderr
    assert "Traceback" not in proc.stderr and "ValueError" not in proc.stderr
    assert "seeds run" not in proc.stdout  # refused before any seed ran
