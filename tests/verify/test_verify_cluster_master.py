"""The same verify job, unchanged, on a Spark cluster: ``--master local-cluster[2,1,1024]`` starts a
standalone master and two executor JVMs (one core, 1 GiB each) from pyspark's own scripts, so the
job's tasks run in other processes than the driver, as on a real cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

G1, G2 = "1" * 32, "2" * 32


def _spark_class() -> Path | None:
    try:
        import pyspark
    except ImportError:  # pragma: no cover - the [spark] extra is installed in CI
        return None
    path = Path(pyspark.__file__).parent / "bin" / "spark-class"
    return path if path.exists() else None


@pytest.mark.skipif(shutil.which("java") is None or _spark_class() is None,
                    reason="local-cluster needs Java and pyspark's bin/spark-class")
def test_verify_runs_unchanged_on_a_local_cluster(hist: Any, tmp_path: Path) -> None:
    h = hist("cluster")
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.publish("p1", G1).publish("p1", G2, pid=2).fault("kill", "n1")
    h.deliver("s1", G1).disconnect("s1")  # G2 lost
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in h.rows))
    report = tmp_path / "report"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, "-m", "moorline", "verify", str(path), "--master", "local-cluster[2,1,1024]",
         "--report", str(report), "--driver-memory", "1g"],
        capture_output=True, text=True, timeout=540, env=env,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["totals"]["lost"] == 1 and summary["totals"]["acknowledged"] == 2
    assert summary["anomaly_samples"]["lost"][0]["guid"] == G2
