"""Scale benchmark for `moorline verify`: 10 million synthetic events across 1,000 runs (Parquet).

    python bench/verify_scale.py [--events 10000000] [--runs 1000] [--master 'local[*]'] [--out DIR]
                                 [--format parquet|jsonl]

Generates the histories with numpy + pyarrow (a realistic mix per message: publish invoke/ok, and a
delivery + ack to a QoS 1 subscriber, a QoS 2 subscriber and one member of a $share group), injects
one lost message in 1 % of the runs so the job has something to find, then runs
`python -m moorline verify` on them and reports the wall time and the peak resident memory of the
whole process tree (driver python + JVM + python workers), sampled from /proc every 0.2 s.
``--format jsonl`` writes the same histories as one JSON-lines file holding every run (the format
a harness appends to); ``parquet`` (default) writes one Parquet file per 25 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EVENTS_PER_MESSAGE = 8
SESSIONS = ["pub-0", "pub-1", "pub-2", "pub-3", "sub-q1", "sub-q2", "share-m1", "share-m2"]
TOPICS = ["bench/t0", "bench/t1", "bench/t2", "bench/t3"]


def generate(out: Path, events: int, runs: int, chunk_runs: int = 25) -> tuple[int, int]:
    """Write the histories; returns (rows written, runs with an injected loss)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moorline.verify.history import FIELDS, arrow_schema

    schema = arrow_schema()
    msgs = max(1, (events // runs - 24) // EVENTS_PER_MESSAGE)
    rng = np.random.default_rng(7)
    out.mkdir(parents=True, exist_ok=True)
    written, lossy = 0, 0
    for part, first_run in enumerate(range(0, runs, chunk_runs)):
        cols: dict[str, list[pa.Array]] = {name: [] for name, _ in FIELDS}
        for r in range(first_run, min(runs, first_run + chunk_runs)):
            run = f"run-{r:05d}"
            batch = _one_run(np, rng, run, r, msgs)
            if r % 100 == 7:  # 1 % of runs: drop sub-q1's delivery of one message (and its ack)
                victim = int(msgs // 2)
                keep = np.ones(len(batch["type"]), dtype=bool)
                keep[24 + victim * EVENTS_PER_MESSAGE + 2 : 24 + victim * EVENTS_PER_MESSAGE + 4] = False
                batch = {k: (v[keep] if v is not None else None) for k, v in batch.items()}
                lossy += 1
            n = len(batch["type"])
            for name, _kind in FIELDS:
                values = batch.get(name)
                typ = schema.field(name).type
                cols[name].append(pa.nulls(n, typ) if values is None else pa.array(values, type=typ))
            written += n
        table = pa.table({name: pa.concat_arrays(arrs) for name, arrs in cols.items()}, schema=schema)
        pq.write_table(table, out / f"part-{part:05d}.parquet", compression="snappy")
    return written, lossy


def to_jsonl(parquet_dir: Path, path: Path) -> int:
    """Every run of the Parquet histories in one JSON-lines file (nulls left out); returns the rows."""
    import pyarrow.parquet as pq

    rows = 0
    with open(path, "w", encoding="utf-8") as f:
        for part in sorted(parquet_dir.glob("*.parquet")):
            for batch in pq.ParquetFile(part).iter_batches(batch_size=50_000):
                for rec in batch.to_pylist():
                    f.write(json.dumps({k: v for k, v in rec.items() if v is not None}, separators=(",", ":")))
                    f.write("\n")
                    rows += 1
    return rows


def _one_run(np, rng, run: str, r: int, msgs: int) -> dict:  # type: ignore[no-untyped-def]
    """Columns (numpy / lists) of one run: 24 setup events, then 8 events per message."""
    t0 = 1_000_000_000
    # setup: connect invoke/ok for 8 sessions, subscribe invoke/ok for the 4 subscriber sessions
    s_type: list[str] = []
    s_op: list[str] = []
    s_sess: list[str] = []
    s_present: list[bool | None] = []
    s_filter: list[str | None] = []
    s_group: list[str | None] = []
    s_qos: list[int | None] = []
    for s in SESSIONS:
        s_type += ["invoke", "ok"]
        s_op += ["connect", "connect"]
        s_sess += [s, s]
        s_present += [None, False]
        s_filter += [None, None]
        s_group += [None, None]
        s_qos += [None, None]
    for s, q, g in (("sub-q1", 1, None), ("sub-q2", 2, None), ("share-m1", 1, "g"), ("share-m2", 1, "g")):
        s_type += ["invoke", "ok"]
        s_op += ["subscribe", "subscribe"]
        s_sess += [s, s]
        s_present += [None, None]
        s_filter += ["bench/#", "bench/#"]
        s_group += [g, g]
        s_qos += [q, q]
    i = np.arange(msgs)
    pub = i % 4
    pub_qos = np.where(pub < 2, 1, 2)
    topic_idx = (i // 4) % 4
    inv = t0 + 10_000_000 + i * 1_000_000
    ack_lat = rng.integers(200_000, 600_000, msgs)
    dl_lat = rng.integers(300_000, 700_000, (3, msgs))
    member = np.where(i % 2 == 0, 6, 7)
    E = EVENTS_PER_MESSAGE
    mono = np.empty(msgs * E, dtype=np.int64)
    sess = np.empty(msgs * E, dtype=np.int64)
    qos = np.empty(msgs * E, dtype=np.int32)
    typ = np.empty(msgs * E, dtype=object)
    op = np.empty(msgs * E, dtype=object)
    mono[0::E], mono[1::E] = inv, inv + ack_lat
    for k, sub in enumerate((4, 5)):
        mono[2 + 2 * k :: E] = inv + dl_lat[k]
        mono[3 + 2 * k :: E] = inv + dl_lat[k] + 10_000
        sess[2 + 2 * k :: E] = sess[3 + 2 * k :: E] = sub
    mono[6::E], mono[7::E] = inv + dl_lat[2], inv + dl_lat[2] + 10_000
    sess[0::E] = sess[1::E] = pub
    sess[6::E] = sess[7::E] = member
    qos[0::E] = qos[1::E] = pub_qos
    qos[2::E] = qos[3::E] = 1
    qos[4::E] = qos[5::E] = pub_qos
    qos[6::E] = qos[7::E] = 1
    typ[:] = "ok"
    typ[0::E] = "invoke"
    op[0::E] = op[1::E] = "publish"
    op[2::E] = op[4::E] = op[6::E] = "deliver"
    op[3::E] = op[5::E] = op[7::E] = "ack"
    guids = np.array([f"{r:08x}{k:024x}" for k in range(msgs)], dtype=object)
    pid = np.repeat((i % 65535) + 1, E).astype(np.int32)
    pid[0::E] = 0
    n_setup = len(s_type)
    names = np.array(SESSIONS, dtype=object)
    total = n_setup + msgs * E
    return {
        "run": np.full(total, run, dtype=object),
        "process": np.concatenate([np.array(s_sess, dtype=object), names[sess]]),
        "index": np.arange(total, dtype=np.int64),
        "type": np.concatenate([np.array(s_type, dtype=object), typ]),
        "op": np.concatenate([np.array(s_op, dtype=object), op]),
        "topic": np.concatenate(
            [np.full(n_setup, None, dtype=object), np.repeat(np.array(TOPICS, dtype=object)[topic_idx], E)]
        ),
        "qos": np.concatenate([np.array(s_qos, dtype=object), qos.astype(object)]),
        "guid": np.concatenate([np.full(n_setup, None, dtype=object), np.repeat(guids, E)]),
        "session": np.concatenate([np.array(s_sess, dtype=object), names[sess]]),
        "packet_id": np.concatenate([np.zeros(n_setup, dtype=np.int32), pid]),
        "dup": np.zeros(total, dtype=bool),
        "filter": np.concatenate([np.array(s_filter, dtype=object), np.full(msgs * E, None, dtype=object)]),
        "share_group": np.concatenate(
            [np.array(s_group, dtype=object), np.full(msgs * E, None, dtype=object)]
        ),
        "session_present": np.concatenate(
            [np.array(s_present, dtype=object), np.full(msgs * E, None, dtype=object)]
        ),
        "mono_ns": np.concatenate([t0 + np.arange(n_setup, dtype=np.int64) * 1000, mono]),
        "wall_ms": None,
    }


def _tree_rss_kib(root: int) -> dict[str, int]:
    """RSS (KiB) of root and its descendants, summed per kind (java / python)."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except (OSError, StopIteration):
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d))
        info[int(d)] = (comm, rss)
    totals = {"java": 0, "python": 0, "other": 0}
    stack = [root]
    while stack:
        p = stack.pop()
        comm, rss = info.get(p, ("", 0))
        kind = "java" if "java" in comm else "python" if "python" in comm else "other"
        totals[kind] += rss
        stack.extend(children.get(p, []))
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--out", type=Path, default=Path("/tmp/moorline-verify-scale"))
    ap.add_argument("--driver-memory", default="4g")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = ap.parse_args()
    hist_dir = args.out / "histories"
    t = time.monotonic()
    rows, lossy = generate(hist_dir, args.events, args.runs)
    gen_s = time.monotonic() - t
    print(
        f"generated {rows:,} events in {args.runs} runs ({lossy} runs with one loss) in {gen_s:.1f} s",
        flush=True,
    )
    if args.format == "jsonl":
        t = time.monotonic()
        jsonl = args.out / "history.jsonl"
        to_jsonl(hist_dir, jsonl)
        hist_dir = jsonl
        print(f"wrote them as one JSON-lines file {jsonl} ({jsonl.stat().st_size / 2**20:,.0f} MiB) in "
              f"{time.monotonic() - t:.1f} s", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "moorline",
        "verify",
        str(hist_dir),
        "--master",
        args.master,
        "--report",
        str(args.out / "report"),
        "--driver-memory",
        args.driver_memory,
    ]
    t = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = {"java": 0, "python": 0, "total": 0}
    while proc.poll() is None and time.monotonic() - t < args.timeout_s:
        rss = _tree_rss_kib(proc.pid)
        peak["java"] = max(peak["java"], rss["java"])
        peak["python"] = max(peak["python"], rss["python"])
        peak["total"] = max(peak["total"], rss["java"] + rss["python"] + rss["other"])
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate()[0]
    wall = time.monotonic() - t
    summary = json.loads((args.out / "report" / "summary.json").read_text())
    result = {
        "events": rows,
        "runs": args.runs,
        "master": args.master,
        "format": args.format,
        "verify_wall_s": round(wall, 1),
        "events_per_s": round(rows / wall),
        "peak_rss_mib": {k: round(v / 1024) for k, v in peak.items()},
        "exit_code": proc.returncode,
        "lost_found": summary["totals"]["lost"],
        "lost_injected": lossy,
    }
    print(out[-3000:])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
