"""Issue 36, items 1 and 2: a verdict that cannot pass on nothing, and tools that say which extra
they need instead of ending in an ImportError traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moorline.cli import app

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.spark
def test_verify_of_a_history_without_publishes_is_not_verified(tmp_path: Path) -> None:
    """A well-formed history (connects, a subscription) with no publish: exit 3 and why, no PASS."""
    if shutil.which("java") is None:  # pragma: no cover - CI has Java
        pytest.skip("pyspark needs a Java runtime")
    rows: list[dict[str, Any]] = []
    t = 1_000_000_000

    def ev(type: str, op: str, **kw: Any) -> None:
        nonlocal t
        t += 1_000_000
        rows.append({"run": "r1", "index": len(rows), "type": type, "op": op, "mono_ns": t,
                     "wall_ms": t // 1_000_000, "process": kw.get("session"), **kw})

    ev("invoke", "connect", session="s1", clean_start=False, session_expiry=3600)
    ev("ok", "connect", session="s1", session_present=False)
    ev("invoke", "subscribe", session="s1", filter="t/#", qos=1, share_group=None, sticky=False, no_local=False)
    ev("ok", "subscribe", session="s1", filter="t/#", qos=1, share_group=None, sticky=False, no_local=False)
    ev("ok", "disconnect", session="s1")
    history = tmp_path / "h.jsonl"
    history.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    proc = subprocess.run(
        [sys.executable, "-m", "moorline", "verify", str(history), "--master", "local[1]",
         "--report", str(tmp_path / "report"), "--shuffle-partitions", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "NOT VERIFIED" in out and "no acknowledged publish" in out, out[-3000:]
    assert "PASS" not in out


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
