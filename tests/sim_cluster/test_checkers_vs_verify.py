"""Cross-check: ``moorline verify``'s Spark job and the simulator's checkers find the same anomalies
(kind, message, subscriber) in a simulated history, clean and doctored.

The workload here leaves out what verify misjudges (docs/cluster-sim-workload.md, "Where the
checkers differ from verify"): QoS 0, publishes without a guid, retained messages, unsubscribes,
$share groups, and acknowledgements arriving together."""

from __future__ import annotations

import copy
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moorline.sim.cluster.checkers import VERIFY_KINDS, analyze_history
from moorline.sim.cluster.workload import WorkloadConfig, run_workload

pytestmark = pytest.mark.spark

Rec = dict[str, Any]
COMPARABLE = WorkloadConfig(publisher_qos=(1, 2), guidless_publishers=False, subscription_qos=(1, 2),
                            retained_messages=0, racers=0, share_members=0, publish_window=1,
                            withhold_probability=0.0)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    if shutil.which("java") is None:  # pragma: no cover - CI has Java 17
        pytest.skip("pyspark needs a Java runtime")
    from moorline.verify.job import make_spark

    session = make_spark("local[2]", shuffle_partitions=1, app_name="moorline-sim-crosscheck")
    yield session
    session.stop()


def of(records: list[Rec], **want: Any) -> list[Rec]:
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


def renumber(records: list[Rec]) -> list[Rec]:
    out = sorted(records, key=lambda r: (r["mono_ns"], r["index"]))
    for i, r in enumerate(out):
        r["index"] = i
    return out


def doctor(clean: list[Rec]) -> list[Rec]:
    """One message lost, one delivered twice, two swapped, one redelivered under a new packet id."""
    recs = copy.deepcopy(clean)
    for r in recs:
        r["run"] = "doctored"
    acked = {r["guid"] for r in of(recs, op="publish", type="ok")}
    pub_of = {r["guid"]: r["session"] for r in of(recs, op="publish", type="invoke")}

    def once_delivered(session: str) -> list[Rec]:
        dl = of(recs, op="deliver", type="ok", session=session, qos=1)
        count = Counter(r["guid"] for r in dl)
        return [r for r in dl if count[r["guid"]] == 1 and r["guid"] in acked]

    once = once_delivered("psub1")
    assert len(once) > 20
    lost, dup = once[len(once) // 2], once[3]
    a, b = next((a, b) for a, b in zip(once, once[1:], strict=False)
                if a["topic"] == b["topic"] and pub_of[a["guid"]] == pub_of[b["guid"]]
                and not {lost["guid"], dup["guid"]} & {a["guid"], b["guid"]})
    # a QoS 1 message a session had before one of its reconnects
    moved, later = next((m, c) for s in ("q2b1", "q2a2", "psub2", "psub3") for m in once_delivered(s)
                        for c in of(recs, op="connect", type="ok", session=s) if c["mono_ns"] > m["mono_ns"])
    recs = [r for r in recs if not (r.get("session") == "psub1" and r.get("guid") == lost["guid"])]
    recs.append({**dup, "dup": True, "mono_ns": dup["mono_ns"] + 1000, "index": dup["index"] + 0.5})
    ga, gb = a["guid"], b["guid"]
    for r in recs:
        if r.get("session") == "psub1" and r.get("guid") in (ga, gb):
            r["guid"] = gb if r["guid"] == ga else ga
    recs.append({**moved, "dup": True, "packet_id": moved["packet_id"] + 900, "mono_ns": later["mono_ns"],
                 "index": later["index"] + 0.5, "node": later["node"]})
    return renumber(recs)


def test_verify_and_the_checkers_agree_on_a_clean_and_a_doctored_history(spark: Any, tmp_path: Path) -> None:
    from moorline.verify.job import run_verify

    clean = run_workload(7, cfg=COMPARABLE).records
    doctored = doctor(clean)
    paths = []
    for name, recs in (("clean", clean), ("doctored", doctored)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        paths.append(path)
    verdict = run_verify(spark, paths, tmp_path / "report")
    assert not verdict.ok
    theirs = {(a["run"], a["kind"], a["guid"], a["subscriber"])
              for a in spark.read.parquet(str(tmp_path / "report" / "anomalies")).collect()}
    ours = {(v.run, v.kind, v.guid, v.subscriber) for v in analyze_history(clean + doctored).violations
            if v.kind in VERIFY_KINDS}
    assert ours == theirs
    assert not [x for x in ours if x[0] == clean[0]["run"]]  # the clean history is clean for both
    assert Counter(x[1] for x in ours) == Counter(
        {"lost": 1, "duplicate": 1, "out_of_order": 1, "packet_id_misuse": 1})
