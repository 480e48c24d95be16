"""Issue 36, items 1 and 2: a verdict that cannot pass on nothing, and tools that say which extra
they need instead of ending in an ImportError traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moorline.cli import app


def _text(output: str) -> str:
    return " ".join(output.replace("│", " ").split())  # rich may wrap a message in a box


def test_min_acked_floor() -> None:
    from moorline.verify.cli import not_verified_reason

    assert not_verified_reason({"acknowledged": 0}, 1) == (
        "the histories hold no acknowledged publish: nothing was checked")
    assert not_verified_reason({}, 1) is not None
    assert not_verified_reason({"acknowledged": 4}, 5) == "4 acknowledged publishes, fewer than --min-acked 5"
    assert not_verified_reason({"acknowledged": 1}, 2) == "1 acknowledged publish, fewer than --min-acked 2"
    assert not_verified_reason({"acknowledged": 5}, 5) is None
    assert not_verified_reason({"acknowledged": 0}, 0) is None  # the caller asked for nothing


class _Verdict:
    """What run_verify returns, for a history without anomalies and with ``acked`` acknowledged publishes."""

    def __init__(self, acked: int) -> None:
        self.totals: dict[str, Any] = {"runs": 1, "events": 5, "published": acked, "acknowledged": acked}
        self.latency: dict[str, Any] = {}
        self.ok = True
        self.unavailable = 0

    def headline(self) -> str:
        return "PASS"


@pytest.mark.parametrize(("acked", "args", "reason"), [
    (0, [], "the histories hold no acknowledged publish: nothing was checked"),
    (4, ["--min-acked", "5"], "4 acknowledged publishes, fewer than --min-acked 5"),
])
def test_verify_with_too_few_acknowledged_publishes_is_not_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, acked: int, args: list[str], reason: str) -> None:
    """The command's verdict on what the checks counted (Spark replaced by their result): exit 3
    and why, never PASS."""
    pytest.importorskip("pyspark")
    import contextlib

    from moorline.verify import job, progress

    class Spark:
        sparkContext = None

        def stop(self) -> None:
            pass

    monkeypatch.setattr(job, "make_spark", lambda *a, **k: Spark())
    monkeypatch.setattr(job, "run_verify", lambda spark, paths, report, progress=None: _Verdict(acked))
    monkeypatch.setattr(progress, "SparkProgress",
                        lambda *a, **k: contextlib.nullcontext(type("Shown", (), {"step": None})()))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    history = tmp_path / "h.jsonl"
    history.write_text("{}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["verify", str(history), "--report", str(tmp_path / "r"), *args])
    text = _text(result.output)
    assert result.exit_code == 3, (result.output, result.exception)
    assert f"NOT VERIFIED ({reason}" in text and f"moorline verify: NOT VERIFIED: {reason}" in text, text
    assert "PASS" not in text


def test_verify_without_pyspark_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    history = tmp_path / "h.jsonl"
    history.write_text("{}\n", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark: ModuleNotFoundError
    result = CliRunner().invoke(app, ["verify", str(history), "--report", str(tmp_path / "r")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert not isinstance(result.exception, ImportError)
    assert "pip install 'moorline[spark]'" in _text(result.output)
    assert "Traceback" not in result.output


def test_chaos_without_paho_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("paho", "paho.mqtt", "paho.mqtt.client"):
        monkeypatch.setitem(sys.modules, name, None)
    result = CliRunner().invoke(app, ["chaos", "--out", str(tmp_path / "out"), "--no-verify", "--duration", "2"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "pip install 'moorline[chaos]'" in _text(result.output)
    assert not (tmp_path / "out").exists()  # nothing started


def _chaos(tmp_path: Path) -> Any:
    return CliRunner().invoke(app, ["chaos", "--out", str(tmp_path / "out"), "--no-verify", "--duration", "2",
                                    "--kills", "0", "--seed", "3"])


def test_chaos_fails_when_a_client_thread_dies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's run: publishers die on a missing module; the run must fail, not report 0/0 and pass."""
    from moorline.chaos import harness

    def die(self: Any, stop: Any) -> None:
        raise ModuleNotFoundError("No module named 'paho'", name="paho")

    monkeypatch.setattr(harness.Publisher, "run", die)
    result = _chaos(tmp_path)
    assert result.exit_code == 1, (result.output, result.exception)
    text = _text(result.output)
    assert "a client thread died" in text and "No module named 'paho'" in text, result.output


def test_chaos_run_that_acknowledged_nothing_is_not_verified(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from moorline.chaos import harness

    monkeypatch.setattr(harness.Publisher, "run", lambda self, stop: None)  # publishes nothing, dies of nothing
    result = _chaos(tmp_path)
    assert result.exit_code == 3, (result.output, result.exception)
    assert "NOT VERIFIED" in result.output and "acknowledged fewer than --min-acked 1" in _text(result.output)
