"""``moorline sim`` shows its progress (seeds done, violations so far, seeds per second) on stderr;
when stderr is not a terminal, as plain lines, and stdout keeps only the results."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^sim: (\d+)/3 seeds, (\d+) violations, [\d.]+ seeds/s, \d+ s$")


def test_sim_prints_plain_progress_lines_to_a_pipe() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moorline", "sim", "--seeds", "3", "--ops", "50", "--progress-every", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [m for m in (LINE.match(x) for x in proc.stderr.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [1, 2, 3], proc.stderr
    assert all(m.group(2) == "0" for m in lines)
    assert "sim:" not in proc.stdout and "violations: 0" in proc.stdout


def test_progress_lines_come_every_interval_and_once_at_the_end() -> None:
    from moorline.sim.cli import SeedProgress

    now = [0.0]
    out = io.StringIO()
    p = SeedProgress(total=5, every_s=10.0, stream=out, clock=lambda: now[0])
    for t, violations in ((3.0, 0), (11.0, 0), (12.0, 2), (30.0, 0), (40.0, 0)):
        now[0] = t
        p.seed_done(violations)
    p.close()
    assert out.getvalue().splitlines() == [
        "sim: 2/5 seeds, 0 violations, 0.18 seeds/s, 11 s",
        "sim: 4/5 seeds, 2 violations, 0.13 seeds/s, 30 s",
        "sim: 5/5 seeds, 2 violations, 0.12 seeds/s, 40 s",  # the last seed: printed by close()
    ]
