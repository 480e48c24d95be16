"""Where a three-node W1's CPU goes: ``perf`` on each moorline node while W1 runs, by Python function.

Run: ``python -m bench.cluster_profile [--workload w1|w2] [--out DIR] [--python PATH]``, as root (perf
attaches to the nodes), on a machine with ``perf``. The nodes run under ``--python`` (default: this
interpreter) with ``PYTHONPERFSUPPORT=1``; that needs Python 3.12 or later (3.11 has no perf
trampolines, and then every sample is only "the interpreter"), with moorline's dependencies and
paho-mqtt installed, e.g. ``python3.12 -m venv V && V/bin/pip install -e . paho-mqtt``.

Each sample is charged to the innermost Python function on its stack, C callees included (perf's
unwinder stops at the first trampoline, so inclusive times are not available), and the functions
are grouped into the categories of ``CATEGORIES``. py-spy is not used: on a busy machine it charges
a process preempted inside ``write`` (by the peer it just woke) as if it were running there.

Also printed per node: CPU seconds, WAL syncs and frames sent during the measured pass (from
``/metrics`` and ``/v1/cluster``), so a change can be read as "fewer rounds" or "cheaper rounds".
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import paho_clients, runner  # noqa: E402
from bench.cluster import MoorlineCluster, RunningMoorlineCluster  # noqa: E402

# First match wins: (category, substrings of "function file").
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("WAL sync (fdatasync, sync thread)", ("WriteAheadLog.sync ", "SyncThread.", "pwrite_all", "_hand_over",
                                           "SegmentPreparer", "prealloc")),
    ("WAL append", ("storage/wal.py",)),
    ("cluster transport (frames, streams)", ("moorline/cluster/", "asyncio/streams.py", "asyncio/timeouts.py",
                                             "asyncio/locks.py", "cluster_link.py", "raft/coalesce.py",
                                             "asyncio/tasks.py", "asyncio/futures.py", "asyncio/mixins.py")),
    ("Raft core", ("moorline/raft/",)),
    ("state machine apply (broker)", ("moorline/broker/",)),
    ("message store, recent cache", ("storage/msgstore.py", "node/sessions/recent.py", "moorline/storage/")),
    ("MQTT codec, connections, delivery", ("moorline/mqtt/", "node/edge/connection.py", "node/sessions/delivery.py",
                                           "node/edge/server.py")),
    ("group commit, shard host, node", ("moorline/node/",)),
    ("event loop (C: epoll, callbacks, socket reads)", ("asyncio/runners.py", "asyncio/base_events.py",
                                                        "[no Python frame]")),
]
_PY_FRAME = re.compile(r"py::([^:]+):(\S+?)\+0x")


def categorize(key: str) -> str:
    for name, patterns in CATEGORIES:
        if any(p in key for p in patterns):
            return name
    return "other"


def samples_by_function(perf_data: Path) -> collections.Counter[str]:
    """``perf script`` samples keyed by their innermost Python function ("function file")."""
    out = subprocess.run(["perf", "script", "-i", str(perf_data)], capture_output=True, text=True,
                         timeout=600).stdout
    counts: collections.Counter[str] = collections.Counter()
    for sample in out.split("\n\n"):
        lines = sample.strip().splitlines()
        if len(lines) < 2:
            continue
        frame = next((line for line in lines[1:] if " py::" in line), None)
        match = _PY_FRAME.search(frame) if frame else None
        counts[f"{match.group(1)} {match.group(2)}" if match else "[no Python frame]"] += 1
    return counts


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback only
        return str(response.read().decode())


def node_counters(cluster: RunningMoorlineCluster) -> dict[str, dict[str, float]]:
    """Per node: WAL syncs (/metrics) and frames sent to each peer (/v1/cluster)."""
    out: dict[str, dict[str, float]] = {}
    for member, port in zip(cluster.members, cluster.http_ports, strict=True):
        row: dict[str, float] = {}
        for line in _get(f"http://127.0.0.1:{port}/metrics").splitlines():
            if line.startswith("moorline_wal_syncs_total "):
                row["wal_syncs"] = float(line.split()[1])
        status = json.loads(_get(f"http://127.0.0.1:{port}/v1/cluster"))
        row["frames_sent"] = float(sum(stream.get("frames_sent", 0)
                                       for node in status.get("nodes", [])
                                       for stream in (node.get("transport") or {}).get("streams", {}).values()))
        out[member.name] = row
    return out


def profile(workload: runner.PahoWorkload, out: Path, python: str, log: Any = print) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    kind = MoorlineCluster(3)
    kind.single._argv = lambda: [python, "-m", "moorline", "run"]  # type: ignore[method-assign]
    log(kind.prepare(log))
    with tempfile.TemporaryDirectory(prefix="moorline-cluster-profile-") as tmp:
        cluster = kind.start(Path(tmp), {"PYTHONPERFSUPPORT": "1"})
        assert isinstance(cluster, RunningMoorlineCluster)
        perfs: list[subprocess.Popen[bytes]] = []
        sub = pub = None
        try:
            topic = cluster.topic_for(f"bench/{workload.name}")
            sub_conn, sub_child = ctx.Pipe()
            pub_conn, pub_child = ctx.Pipe()
            common = (cluster.protocol, topic, workload.warmup, workload.messages)
            sub = ctx.Process(target=paho_clients.subscriber_main, daemon=True,
                              args=(sub_child, cluster.subscribe_port, *common, workload.window, 180.0, False))
            pub = ctx.Process(target=paho_clients.publisher_main, daemon=True,
                              args=(pub_child, cluster.publish_port, *common, workload.payload_bytes,
                                    workload.window, 180.0))
            sub.start()
            runner._expect(sub_conn, "ready", 60, sub)
            pub.start()
            runner._expect(pub_conn, "ready", 60, pub)
            pub_conn.send("warmup")
            runner._expect(pub_conn, "warm_acked", 180, pub)
            runner._expect(sub_conn, "warm_done", 180, sub)
            for member in cluster.members:
                perfs.append(subprocess.Popen(
                    ["perf", "record", "-F", "997", "--call-graph", "dwarf,32768", "-o", str(out / f"{member.name}.data"),
                     "-p", str(member.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)
            cpu_before, counters_before = cluster.cpu_seconds_by_member(), node_counters(cluster)
            pub_conn.send("go")
            _, pub_result = runner._expect(pub_conn, "done", 190, pub)
            _, sub_result = runner._expect(sub_conn, "result", 190, sub)
            cpu_after, counters_after = cluster.cpu_seconds_by_member(), node_counters(cluster)
        finally:
            for proc in perfs:
                proc.send_signal(signal.SIGINT)
            for proc in perfs:
                proc.wait(60)
            runner._stop_clients([p for p in (pub, sub) if p is not None])
            cluster.stop()
    elapsed_s = (sub_result["last_receive_ns"] - pub_result["first_publish_ns"]) / 1e9
    received = sub_result["received"]
    result: dict[str, Any] = {
        "msgs_per_s": received / elapsed_s, "latency_p50_ms": sub_result["latency_p50_ns"] / 1e6,
        "latency_p99_ms": sub_result["latency_p99_ns"] / 1e6, "received": received, "nodes": {},
    }
    for name in cpu_before:
        counts = samples_by_function(out / f"{name}.data")
        total = sum(counts.values()) or 1
        by_category: collections.Counter[str] = collections.Counter()
        for key, n in counts.items():
            by_category[categorize(key)] += n
        result["nodes"][name] = {
            "cpu_s_per_10k": (cpu_after[name] - cpu_before[name]) / received * 10_000,
            "per_10k": {k: (counters_after[name][k] - counters_before[name][k]) / received * 10_000
                        for k in counters_after[name]},
            "samples": total,
            "categories": {k: n / total for k, n in by_category.most_common()},
            "top_functions": {k: n / total for k, n in counts.most_common(25)},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("w1", "w2"), default="w1")
    parser.add_argument("--out", type=Path, default=Path("cluster-profile"))
    parser.add_argument("--python", default=sys.executable, help="the interpreter the nodes run under (3.12+)")
    args = parser.parse_args()
    config = runner.full_config(("moorline",), 1)
    workload = config.w1 if args.workload == "w1" else config.w2
    result = profile(workload, args.out, args.python)
    print(f"{args.workload}: {result['msgs_per_s']:,.0f} msgs/s, p50/p99 {result['latency_p50_ms']:.0f}/"
          f"{result['latency_p99_ms']:.0f} ms")
    for node, row in result["nodes"].items():
        extra = ", ".join(f"{k} {v:.0f}" for k, v in row["per_10k"].items())
        print(f"{node}: {row['cpu_s_per_10k']:.3f} CPU-s/10k; per 10k messages: {extra}; {row['samples']} samples")
        for name, share in row["categories"].items():
            print(f"   {100 * share:5.1f} %  {name}")
    (args.out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'profile.json'}")


if __name__ == "__main__":
    main()
