"""run_verify over JSON lines and Parquet together, the files it writes, and the CLI's exit code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer

pytestmark = pytest.mark.spark

G1, G2 = "1" * 32, "2" * 32


def _history(hist: Any, run: str, deliver_second: bool) -> Any:
    h = hist(run)
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.publish("p1", G1).publish("p1", G2, pid=2).fault("kill", "test").fault("restart")
    h.deliver("s1", G1)
    if deliver_second:
        h.deliver("s1", G2, pid=2)
    return h.disconnect("s1")


def test_verify_reads_jsonl_and_parquet_and_writes_report(spark: Any, hist: Any, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moorline.verify.history import FIELDS, arrow_schema
    from moorline.verify.job import run_verify

    good, bad = _history(hist, "good", True), _history(hist, "bad", False)
    jsonl = tmp_path / "good.jsonl"
    jsonl.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in good.rows)
    )
    pq_dir = tmp_path / "bad"
    pq_dir.mkdir()
    cols = {name: [r.get(name) for r in bad.rows] for name, _ in FIELDS}
    pq.write_table(pa.table(cols, schema=arrow_schema()), pq_dir / "part-0.parquet")

    verdict = run_verify(spark, [jsonl, pq_dir], tmp_path / "report")
    runs = {r["run"]: r for r in verdict.runs}
    assert not verdict.ok and verdict.totals["runs"] == 2 and verdict.totals["lost"] == 1
    assert runs["good"]["lost"] == 0 and runs["bad"]["lost"] == 1 and runs["bad"]["fault_kill"] == 1
    assert verdict.samples["lost"][0]["guid"] == G2
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["ok"] is False and summary["totals"]["lost"] == 1
    html = (tmp_path / "report" / "report.html").read_text()
    assert "FAIL" in html and "<svg" in html and "<polyline" in html and "stroke-dasharray" in html
    assert spark.read.parquet(str(tmp_path / "report" / "anomalies")).count() == 1


def test_verify_cli_exit_code_follows_the_verdict(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moorline.verify import cli, job
    from moorline.verify.checks import ALL_KINDS

    class NoStages:
        def getActiveStageIds(self) -> list[int]:  # noqa: N802 (pyspark's name)
            return []

    class FakeSpark:
        sparkContext = type(
            "SC", (), {"setLogLevel": staticmethod(lambda level: None), "statusTracker": staticmethod(NoStages)}
        )()

        def stop(self) -> None:
            pass

    def fake_verdict(lost: int) -> Any:
        totals = {k: 0 for k in ALL_KINDS} | {"runs": 1, "runs_failed": int(bool(lost)), "lost": lost, "acknowledged": 10}
        return job.Verdict(ok=not lost, totals=totals, runs=[], samples={}, latency={})

    history = tmp_path / "h.jsonl"
    history.write_text("")
    monkeypatch.setattr(job, "make_spark", lambda *a, **k: FakeSpark())
    for lost, code in ((0, None), (3, 1)):
        monkeypatch.setattr(job, "run_verify", lambda *a, lost=lost, **k: fake_verdict(lost))
        if code is None:
            cli.verify([history], report=tmp_path / "r")
        else:
            with pytest.raises(typer.Exit) as exc:
                cli.verify([history], report=tmp_path / "r")
            assert exc.value.exit_code == code


def test_report_says_what_was_tested_and_marks_each_anomaly_with_its_records(
    spark: Any, hist: Any, tmp_path: Path
) -> None:
    import re

    from moorline.verify.job import anomaly_key, run_verify
    from moorline.verify.report import anchor

    h = _history(hist, "marked", False)  # G2 lost
    h.deliver("s1", G1, dup=True, pid=1)  # G1 delivered twice on one connection: duplicate
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in h.rows))
    verdict = run_verify(spark, [path], tmp_path / "report")
    page = (tmp_path / "report" / "report.html").read_text()
    first = re.search(r"<body>(.*?)</p>", page)
    assert first is not None
    assert first.group(1) == "<p id='tested'>Tested 1 run: 2 acknowledged publishes, 1 subscriber, 2 faults"
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["tested"].startswith("Tested 1 run")
    lost, dup = verdict.samples["lost"][0], verdict.samples["duplicate"][0]
    for a in (lost, dup):
        ident = anchor(anomaly_key(a))
        assert f"<tr id='{ident}'>" in page  # the sample row
        assert f'<a href="#{ident}" class="mark">' in page  # its mark on the run's timeline
    assert [r["op"] for r in verdict.records[anomaly_key(lost)]] == ["publish", "publish"]  # invoke, ok
    assert [r["op"] for r in verdict.records[anomaly_key(dup)]] == ["publish", "publish", "deliver", "ack",
                                                                     "deliver", "ack"]
    assert {m["kind"] for m in verdict.marks["marked"]} == {"lost", "duplicate"}
    assert verdict.marks["marked"][0]["t_s"] > 0


def test_report_first_line_names_what_was_not_tested() -> None:
    from moorline.verify.report import tested_line

    assert tested_line({"runs": 2, "acknowledged": 0, "subscribers": 1, "faults": 0}) == (
        "Tested 2 runs: 0 acknowledged publishes, 1 subscriber, 0 faults (nothing acknowledged, no fault injected)"
    )
