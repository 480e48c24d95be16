"""One SparkSession for the whole tests/spark run, and a moorline to talk to.

The ``broker`` fixture prefers a real node (``python -m moorline run`` on port 0, ready line
parsed); when the node cannot start it falls back to the in-process fake of the HTTP API, and
the terminal summary lists which tests ran against which. ``MOORLINE_SPARK_BROKER=node`` makes
the fallback an error, ``=fake`` skips the node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_broker import FakeBroker  # noqa: E402
from spark_helpers import Broker, node_status, node_works, start_node  # noqa: E402

from moorline.spark.interpreter import use_running_python  # noqa: E402

pytest.importorskip("pyspark")

# Both must be in the environment before any JVM starts (conftests are imported at collection).
# Spark's workers run this interpreter, so a virtualenv works without PYSPARK_PYTHON.
use_running_python()
# PySpark finds format("moorline") without a register call by listing the pyspark_* modules on
# its workers' path. A checkout installed with `pip install -e` serves pyspark_moorline.py through
# an import hook such a listing cannot see (an installed wheel puts it in site-packages), so the
# workers get the repository root on their path.
REPO = str(Path(__file__).resolve().parents[2])
if REPO not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

_used: dict[str, str] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _used:
        terminalreporter.section("moorline spark: broker per test")
        for nodeid, kind in sorted(_used.items()):
            terminalreporter.write_line(f"{kind:<60} {nodeid}")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    from moorline.spark import MoorlineDataSource

    other = SparkSession.getActiveSession()
    if other is not None and other.sparkContext.master != "local[2,3]":
        other.stop()  # another suite's session (e.g. local[*]) would not retry failed tasks
    session = (
        SparkSession.builder.master("local[2,3]")  # 3 attempts per task: retries are part of the tests
        .appName("moorline-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stopTimeout", "30s")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    assert session.sparkContext.master == "local[2,3]"
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(MoorlineDataSource)
    yield session
    session.stop()


@pytest.fixture()
def short_retention_node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Broker]:
    """A real node whose unowed messages leave after 1 s unless pinned; skipped without a node."""
    if os.environ.get("MOORLINE_SPARK_BROKER") == "fake":
        pytest.skip("MOORLINE_SPARK_BROKER=fake")
    toml = "[retention]\nmin_age_s = 1.0\n\n[shard]\ncount = 4\nhousekeeping_interval_s = 0.2\n"
    started = start_node(tmp_path, toml)
    _used[request.node.nodeid] = "real node (retention.min_age_s = 1)"
    if started is None:
        pytest.skip(f"no usable node with a short retention: {node_status.get('why')}")
    proc, mqtt, http = started
    b = Broker(http, mqtt, None, "node")
    try:
        if not node_works(b):
            pytest.skip(f"node HTTP API unusable: {node_status.get('why')}")
        yield b
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture()
def fake_broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    fb = FakeBroker(shard_count=4).start()
    _used[request.node.nodeid] = "fake broker (test needs its hooks)"
    yield Broker(fb.address, None, fb, "fake")
    fb.stop()


@pytest.fixture()
def broker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Broker]:
    pref = os.environ.get("MOORLINE_SPARK_BROKER", "auto")
    if pref != "fake":
        started = start_node(tmp_path)
        if started is not None:
            proc, mqtt, http = started
            b = Broker(http, mqtt, None, "node")
            if node_works(b):
                _used[request.node.nodeid] = "real node"
                yield b
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return
            proc.kill()
            proc.wait()
        if pref == "node":
            pytest.fail(f"MOORLINE_SPARK_BROKER=node but the node is unusable: {node_status.get('why')}")
    fb = FakeBroker(shard_count=4).start()
    _used[request.node.nodeid] = f"fake broker ({node_status.get('why', 'forced')})"
    yield Broker(fb.address, None, fb, "fake")
    fb.stop()
