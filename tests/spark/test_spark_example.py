"""examples/spark_alerts.py publishes alerts on its first run over fresh readings, with its defaults."""

from __future__ import annotations

import importlib.util
import json
from base64 import b64decode
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from spark_helpers import Broker

pytestmark = pytest.mark.spark

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark_alerts.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spark_alerts_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_once(spark: Any, broker: Broker, ckpt: Path, *extra: str) -> None:
    example = load_example()
    args = example.parse_args(["--servers", broker.http, "--checkpoint", str(ckpt), "--once", *extra])
    query = example.start(spark, args)
    example.follow(query)  # returns when the availableNow run ended; raises its error if it failed
    assert query.exception() is None


def test_first_run_on_fresh_readings_publishes_alerts(spark: Any, broker: Broker, tmp_path: Path) -> None:
    broker.publish(
        [
            ("sensors/boiler", b"70.5"),
            ("sensors/boiler", b"95"),
            ("sensors/pump", b"81.25"),
            ("sensors/pump", b"12"),
            ("sensors/fan", b"not a number"),
        ]
    )
    run_once(spark, broker, tmp_path / "ckpt")
    got = sorted(
        (m["topic"], json.loads(b64decode(m["payload"]))["value"]) for m in broker.read_all("alerts/")
    )
    assert got == [("alerts/sensors/boiler", 95.0), ("alerts/sensors/pump", 81.25)]
    # A second run over the same checkpoint publishes nothing again.
    run_once(spark, broker, tmp_path / "ckpt")
    assert len(broker.read_all("alerts/")) == 2


def test_window_mode_publishes_a_window_only_after_the_watermark_passed_it(
    spark: Any, broker: Broker, tmp_path: Path
) -> None:
    """What the docstring says of --window: a first run over a burst of fresh readings emits nothing."""
    broker.publish([("sensors/boiler", b"95"), ("sensors/boiler", b"99")])
    run_once(spark, broker, tmp_path / "ckpt", "--window", "1 minute")
    assert broker.read_all("alerts/") == []
