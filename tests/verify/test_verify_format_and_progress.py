"""verify refuses histories that are empty or off the documented format, says when detected
corruption made messages unavailable, and shows its progress (not Spark's INFO logs)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]
G1, G2 = "1" * 32, "2" * 32


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows))
    return path


def good_history(hist: Any, run: str = "r1") -> Any:
    h = hist(run)
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.publish("p1", G1).deliver("s1", G1)
    return h.disconnect("s1")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "no events in"),
        ("\n  \n", "no events in"),
        ('{"foo": 1}\n', "unknown field(s): foo"),
        ("not json\n", "not a JSON object with the documented column types"),
        ('{"run": "r", "type": "ok", "op": "deliver", "mono_ns": 5, "qos": "high"}\n', "documented column types"),
        ('{"run": "r", "type": "ok", "op": "deliver"}\n', 'no "mono_ns"'),
        ('{"run": "r", "type": "ok", "op": "teleport", "mono_ns": 5}\n', "unknown op: teleport"),
    ],
    ids=["empty", "blank-lines", "unknown-field", "not-json", "wrong-type", "no-mono-ns", "unknown-op"],
)
def test_verify_refuses_histories_off_the_format(spark: Any, tmp_path: Path, content: str, expected: str) -> None:
    from moorline.verify.job import HistoryFormatError, run_verify

    path = tmp_path / "h.jsonl"
    path.write_text(content)
    with pytest.raises(HistoryFormatError) as err:
        run_verify(spark, [path], tmp_path / "report")
    assert expected in str(err.value)
    assert "docs/history-format.md" in str(err.value)


def test_one_bad_record_among_good_ones_fails_and_is_quoted(spark: Any, hist: Any, tmp_path: Path) -> None:
    from moorline.verify.job import HistoryFormatError, run_verify

    path = write_jsonl(tmp_path / "h.jsonl", good_history(hist).rows)
    with path.open("a") as f:
        f.write('{"run": "r1", "type": "ok", "op": "deliver", "mono_ns": 9, "colour": "red"}\n')
    with pytest.raises(HistoryFormatError, match=r"1 of \d+ records") as err:
        run_verify(spark, [path], tmp_path / "report")
    assert "unknown field(s): colour" in str(err.value) and "h.jsonl" in str(err.value)


def test_parquet_history_with_an_unknown_column_is_refused(spark: Any, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moorline.verify.job import HistoryFormatError, run_verify

    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.table({"run": ["r"], "type": ["ok"], "op": ["ack"], "mono_ns": [1], "foo": [1]}), d / "a.parquet")
    with pytest.raises(HistoryFormatError, match=r"unknown column\(s\) \['foo'\]"):
        run_verify(spark, [d], tmp_path / "report")


def test_detected_corruption_that_made_messages_unavailable_is_in_the_verdict(
    spark: Any, hist: Any, tmp_path: Path
) -> None:
    """Two subscribers are owed G2; the node reported a checksum failure in shard 1 and G2 never
    came: PASS, but the verdict line and the report say one message is unavailable."""
    from moorline.verify.job import run_verify

    h = hist("corrupt")
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("s2", present=False).subscribe("s2", "t/#")
    h.connect("p1", present=False).publish("p1", G1).publish("p1", G2, pid=2)
    h.fault("bitflip", "wal/00000001.log offset 4096").fault(
        "corruption_detected", "2026-11-25 ERROR moorline.node: shard 1 refuses service: checksum failure in synced data"
    )
    h.deliver("s1", G1).deliver("s2", G1).disconnect("s1").disconnect("s2")
    report = tmp_path / "report"
    verdict = run_verify(spark, [write_jsonl(tmp_path / "h.jsonl", h.rows)], report)
    assert verdict.ok and verdict.totals["lost_detected_corruption"] == 2
    assert (verdict.unavailable, verdict.unavailable_shards) == (1, [1])
    line = "PASS (1 message unavailable: corruption detected and reported, shard 1)"
    assert verdict.headline() == line
    assert json.loads((report / "summary.json").read_text())["verdict"] == line
    html = (report / "report.html").read_text()
    assert line in html and "1 messages unavailable" in html


def test_clean_history_verdict_line_is_a_plain_pass(spark: Any, hist: Any, tmp_path: Path) -> None:
    from moorline.verify.job import run_verify

    verdict = run_verify(spark, [write_jsonl(tmp_path / "h.jsonl", good_history(hist).rows)], tmp_path / "r")
    assert verdict.headline() == "PASS" and verdict.unavailable == 0


def test_verify_cli_exits_2_with_the_reason_on_a_history_off_the_format(
    spark: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moorline.verify import cli, job

    class KeepOpen:
        """The suite's session, which the command must not stop."""

        def __getattr__(self, name: str) -> Any:
            return getattr(spark, name)

        def stop(self) -> None:
            pass

    monkeypatch.setattr(job, "make_spark", lambda *a, **k: KeepOpen())
    path = tmp_path / "h.jsonl"
    path.write_text('{"foo": 1}\n')
    with pytest.raises(typer.Exit) as exc:
        cli.verify([path], report=tmp_path / "r")
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err
    assert "do not follow the history format" in err and "unknown field(s): foo" in err


class FakeTracker:
    def __init__(self) -> None:
        self.stages: dict[int, SimpleNamespace] = {}

    def getActiveStageIds(self) -> list[int]:  # noqa: N802 (pyspark's name)
        return list(self.stages)

    def getStageInfo(self, stage_id: int) -> SimpleNamespace | None:  # noqa: N802
        return self.stages.get(stage_id)


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal() -> None:
    from moorline.verify.progress import SparkProgress

    tracker = FakeTracker()
    sc = SimpleNamespace(statusTracker=lambda: tracker)
    now = [0.0]
    out = io.StringIO()
    p = SparkProgress(sc, "verify", ["load", "check"], stream=out, plain_every_s=10.0, clock=lambda: now[0])
    assert not p.interactive
    p.step("load")
    tracker.stages[3] = SimpleNamespace(numCompletedTasks=1, numTasks=4)
    now[0] = 5.0
    p.refresh()  # within 10 s of the last line: nothing new
    now[0] = 12.0
    p.refresh()
    p.step("check")
    lines = out.getvalue().splitlines()
    assert lines == [
        "verify: [1/2] load — no stage running, 0 s",
        "verify: [1/2] load — stage 3: 1/4 tasks, 12 s",
        "verify: [2/2] check — stage 3: 1/4 tasks, 12 s",
    ]


def test_verify_command_shows_progress_and_keeps_spark_info_logs_out(hist: Any, tmp_path: Path) -> None:
    """The real command in a subprocess whose stderr is a pipe: progress lines, no INFO lines."""
    history = write_jsonl(tmp_path / "h.jsonl", good_history(hist).rows)
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "moorline", "verify", str(history), "--master", "local[1]",
            "--report", str(tmp_path / "report"), "--shuffle-partitions", "1", "--progress-every", "1",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "verify: [1/7] reading and checking the histories" in proc.stderr
    assert "verify: [7/7] writing the report" in proc.stderr
    assert "verify: done in" in proc.stderr
    info = [line for line in (proc.stdout + proc.stderr).splitlines() if " INFO " in line]
    assert not info, info[:5]
    assert "PASS" in proc.stdout
