"""``python -m bench.rolling_restart``: a rolling restart of a three-node moorline cluster under a QoS 1 load.

Three nodes on this machine (cluster addresses 127.0.0.11-13, clients on 127.0.0.1, the harness of
tests/cluster_e2e), one paced QoS 1 producer per node (MQTT 5) and one MQTT 3.1.1 producer. Each
producer, when its node drains, follows the Server Reference (or goes to the next node) and resends
what was not acknowledged. The nodes are restarted one by one: wait for ``GET /v1/health?ready=cluster``,
SIGTERM (a drain: exit 0), start again, wait for ready. Prints the longest wait of any publish (first
send to PUBACK) during the roll, its p99, each node's drain (SIGTERM to exit) and its time back to
ready, and checks that nothing acknowledged was lost and no publish failed.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "cluster_e2e"), str(REPO / "tests" / "e2e")]

from cluster_harness import Cluster, wait_for  # noqa: E402
from drain_clients import Producer  # noqa: E402


def _ready(cluster: Cluster, name: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{cluster[name].http_url}/v1/health?ready=cluster", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rolling_restart", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=300.0, help="messages a second per producer (default 300)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of load before and after the roll")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moorline-roll-") as tmp:
        cluster = Cluster(Path(tmp), 3, "[cluster]\ndrain_timeout_s = 20\n")
        try:
            cluster.start()
            topics = [f"roll/{k}" for k in range(16)]
            producers = [Producer(cluster.nodes, n, f"roll-{n}", topics, rate_per_s=args.rate) for n in cluster.names]
            producers.append(Producer(cluster.nodes, "n2", "roll-v3", topics, version=4, rate_per_s=args.rate))
            for p in producers:
                p.start()
            time.sleep(args.settle)
            drains, readies = {}, {}
            t_roll = time.monotonic()
            for name in cluster.names:
                wait_for(f"{name} ready", lambda n=name: _ready(cluster, n), 120, 0.2)  # type: ignore[misc]
                t0 = time.monotonic()
                rc = cluster.stop(name, timeout=40)
                drains[name] = time.monotonic() - t0
                if rc != 0:
                    print(f"{name} exited {rc}", file=sys.stderr)
                    return 1
                cluster.start_node(name)
                t0 = time.monotonic()
                wait_for(f"{name} ready", lambda n=name: _ready(cluster, n), 120, 0.2)  # type: ignore[misc]
                readies[name] = time.monotonic() - t0
            roll_s = time.monotonic() - t_roll
            time.sleep(args.settle)
            for p in producers:
                p.finish(60)
            shards = sorted({cluster.shard_of(t) for t in topics})
            for shard in shards:
                cluster.wait_applied_equal(shard, cluster.names, timeout=60)
            stored = {base64.b64decode(m["payload"]).decode() for s in shards for m in cluster["n1"].messages(s)}
        finally:
            cluster.close()
    waits = sorted(w for p in producers for w in p.waits.values())
    lost = sum(1 for p in producers for s in p.acked if p.payload_of(s).decode() not in stored)
    refused = sum(len(p.refused) for p in producers)
    unanswered = sum(len(p.unanswered()) for p in producers)
    bad_ends = [(p.cid, e.how, e.reason) for p in producers for e in p.ends
                if e.how in ("disconnect", "connack") and e.reason != 0x9C]
    figures = {
        "producers": len(producers), "rate_per_producer": args.rate, "roll_s": round(roll_s, 2),
        "acknowledged": len(waits), "lost": lost, "refused": refused, "unanswered": unanswered,
        "other_disconnects": bad_ends,
        "longest_publish_wait_ms": round(waits[-1] * 1000, 1), "p99_publish_wait_ms": round(
            waits[int(len(waits) * 0.99)] * 1000, 1),
        "drain_s": {n: round(s, 2) for n, s in drains.items()}, "ready_again_s": {n: round(s, 2) for n, s in readies.items()},
    }
    print(f"rolling restart of 3 nodes under {len(producers)} x {args.rate:g} QoS 1 msg/s: {roll_s:.1f} s")
    print(f"  acknowledged {len(waits)}, lost {lost}, refused {refused}, unanswered {unanswered}, "
          f"disconnects other than 0x9C {len(bad_ends)}")
    print(f"  longest publish wait {figures['longest_publish_wait_ms']} ms, p99 {figures['p99_publish_wait_ms']} ms")
    print("  drain (SIGTERM to exit 0): " + ", ".join(f"{n} {s:.2f} s" for n, s in drains.items()))
    print("  back to ready=cluster:     " + ", ".join(f"{n} {s:.2f} s" for n, s in readies.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if not (lost or refused or unanswered or bad_ends) else 1


if __name__ == "__main__":
    sys.exit(main())
