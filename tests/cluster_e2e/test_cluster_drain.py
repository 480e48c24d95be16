"""Drain and rolling restarts (issue 31 item 6), with real processes.

* A node drained through another node (``moorline cluster drain n2 --http <n1>``: ``POST /v1/drain
  {"node": "n2"}`` to n1, forwarded over the cluster link): its MQTT 5 producer gets DISCONNECT 0x9C with a Server Reference naming a live
  node's MQTT address; its 3.1.1 producer is closed only once every PUBLISH the node read was
  answered (what the survivors' stores hold of each producer is exactly what it was acknowledged);
  the node exits 0 within cluster.drain_timeout_s; ``GET /v1/health?ready=cluster`` says 503 while it
  is gone and 200 once it is back and caught up.
* A rolling restart of all three nodes (SIGTERM, restart, wait for ``?ready=cluster`` before the
  next) under a continuous QoS 1 load whose producers follow the Server Reference (or go to the next
  node): nothing acknowledged is lost, no publish is refused, every producer DISCONNECT is 0x9C
  naming a live node, every message sent is acknowledged in the end; the longest wait of any
  publish is printed.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from cluster_harness import REPO_ROOT, Cluster, ClusterFactory, wait_for
from drain_clients import Producer

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(240)]

DRAIN_TIMEOUT_S = 10.0
MAX_PUBLISH_WAIT_S = 5.0  # typically 0.1-0.2 s; a lease wait would be 10 s
CONFIG = f"""
[cluster]
drain_timeout_s = {DRAIN_TIMEOUT_S}
"""


def health(cluster: Cluster, name: str, ready: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{cluster[name].http_url}/v1/health?ready={ready}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_cluster_ready(cluster: Cluster, name: str, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    wait_for(f"{name}: GET /v1/health?ready=cluster 200", lambda: health(cluster, name, "cluster")[0] == 200,
             timeout, 0.2)
    return time.monotonic() - t0


def stored_payloads(cluster: Cluster, names: list[str], topics: list[str]) -> list[str]:
    """Every message of ``topics`` in the first replica's store, once the replicas agree."""
    shards = sorted({cluster.shard_of(t) for t in topics})
    for shard in shards:
        cluster.wait_applied_equal(shard, names, timeout=30)
    return [base64.b64decode(m["payload"]).decode() for shard in shards
            for m in cluster[names[0]].messages(shard) if m["topic"] in topics]


def mqtt_address(cluster: Cluster, name: str) -> str:
    return f"127.0.0.1:{cluster[name].mqtt_port}"


def test_drain_redirects_v5_answers_311_and_exits_0(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=CONFIG)
    nodes = cluster.nodes
    topics = [f"drain/{k}" for k in range(6)]
    # Unpaced (the window bounds them): many publishes are in flight whenever the drain comes.
    v5 = Producer(nodes, "n2", "drain-v5", topics, version=5, window=64, rate_per_s=1e6, reconnect=False).start()
    v3 = Producer(nodes, "n2", "drain-v3", topics, version=4, window=64, rate_per_s=1e6, reconnect=False).start()
    wait_for("both producers acknowledged", lambda: len(v5.waits) > 500 and len(v3.waits) > 500, 30)

    # `moorline cluster drain n2` asks n1 (POST /v1/drain), which passes it on over the cluster link.
    t0 = time.monotonic()
    cli = subprocess.run([sys.executable, "-m", "moorline.cli", "cluster", "drain", "n2", "--http",
                          f"127.0.0.1:{cluster['n1'].http_port}", "--wait", str(DRAIN_TIMEOUT_S + 5)],
                         capture_output=True, text=True, timeout=60, cwd=str(REPO_ROOT))
    assert cli.returncode == 0 and "n2 is draining (asked through n1)" in cli.stdout, (cli.stdout, cli.stderr)
    assert "n2 has stopped" in cli.stdout, cli.stdout  # --wait: n1 no longer reaches n2
    rc = cluster["n2"].wait_exit(DRAIN_TIMEOUT_S + 5)
    drain_s = time.monotonic() - t0
    v5.finish(10)
    v3.finish(10)
    assert v5.error is None and v3.error is None, (v5.error, v3.error)
    print(f"drain of n2: exit {rc} after {drain_s:.2f} s; v5 acked {len(v5.waits)}, 3.1.1 acked {len(v3.waits)}; "
          f"v5 ends {v5.ends}, 3.1.1 ends {v3.ends}")
    assert rc == 0, cluster["n2"].log_tail()
    assert drain_s < DRAIN_TIMEOUT_S, f"drain took {drain_s:.1f} s, over cluster.drain_timeout_s"
    assert "drained in" in cluster["n2"].log(since_start=True)

    # MQTT 5: DISCONNECT 0x9C naming a live node; 3.1.1: closed (it has no DISCONNECT from the server).
    assert [(e.how, e.reason) for e in v5.ends] == [("disconnect", 0x9C)], v5.ends
    assert v5.ends[0].reference in {mqtt_address(cluster, "n1"), mqtt_address(cluster, "n3")}, v5.ends
    assert [e.how for e in v3.ends] == ["closed"], v3.ends
    assert not v5.refused and not v3.refused

    # What each producer was acknowledged is exactly what the survivors hold of it: nothing
    # acknowledged lost, and nothing committed was left unanswered when its connection closed.
    stored = stored_payloads(cluster, ["n1", "n3"], topics)
    assert len(stored) == len(set(stored)), "a message stored twice"
    for prod in (v5, v3):
        mine = {int(p.rpartition(":")[2]) for p in stored if p.startswith(prod.cid + ":")}
        lost = prod.acked - mine
        unanswered = mine - prod.acked
        assert not lost, f"{prod.cid}: {len(lost)} acknowledged messages not stored: {sorted(lost)[:10]}"
        assert not unanswered, f"{prod.cid}: {len(unanswered)} messages committed but never acknowledged " \
                               f"before the drain closed the connection: {sorted(unanswered)[:10]}"

    # Readiness: not while n2 is gone; yes once it is back and caught up.
    status, body = health(cluster, "n1", "cluster")
    assert status == 503 and any("n2" in r for r in body["not_ready"]), body
    cluster.start_node("n2")
    waited = wait_cluster_ready(cluster, "n1")
    print(f"n2 restarted: cluster ready after {waited:.1f} s")
    cluster.assert_no_errors()


def test_rolling_restart_under_qos1_load_loses_and_fails_nothing(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, config_text=CONFIG)
    nodes = cluster.nodes
    topics = [f"roll/{k}" for k in range(8)]
    producers = [Producer(nodes, name, f"roll-{name}", topics, version=5, rate_per_s=150) for name in nodes]
    producers.append(Producer(nodes, "n2", "roll-v3", topics, version=4, rate_per_s=150))
    for prod in producers:
        prod.start()
    wait_for("every producer acknowledged", lambda: all(len(p.waits) > 50 for p in producers), 30)
    drains: dict[str, float] = {}
    readies: dict[str, float] = {}
    roll_t0 = time.monotonic()
    for name in cluster.names:
        wait_cluster_ready(cluster, name)
        t0 = time.monotonic()
        rc = cluster.stop(name, timeout=DRAIN_TIMEOUT_S + 10)
        drains[name] = time.monotonic() - t0
        assert rc == 0, f"{name} exited {rc}:\n{cluster[name].log_tail()}"
        assert drains[name] < DRAIN_TIMEOUT_S, f"{name}: drain took {drains[name]:.1f} s"
        cluster.start_node(name)
        readies[name] = wait_cluster_ready(cluster, name)
    roll_s = time.monotonic() - roll_t0
    time.sleep(1.0)  # some load after the last node is back
    for prod in producers:
        prod.finish(30)
    errors = [(p.cid, p.error) for p in producers if p.error is not None]
    assert not errors, errors

    waits = sorted(w for p in producers for w in p.waits.values())
    longest = waits[-1]
    p99 = waits[int(len(waits) * 0.99)]
    ends = [(p.cid, e.node, e.how, e.reason, e.reference) for p in producers for e in p.ends]
    print(f"rolling restart of 3 nodes in {roll_s:.1f} s: {len(waits)} publishes acknowledged; longest publish wait "
          f"{longest * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; drain (SIGTERM to exit 0) "
          + ", ".join(f"{n} {s:.2f} s" for n, s in drains.items()) + "; ready again after "
          + ", ".join(f"{n} {s:.1f} s" for n, s in readies.items()) + f"; connection ends: {ends}")

    # No publish failed: none refused, none left unanswered, no DISCONNECT but 0x9C naming a live node.
    refused = {p.cid: p.refused for p in producers if p.refused}
    assert not refused, f"publishes refused: {refused}"
    unanswered = {p.cid: p.unanswered()[:10] for p in producers if p.unanswered()}
    assert not unanswered, f"publishes never answered: {unanswered}"
    addresses = {mqtt_address(cluster, n) for n in cluster.names}
    for p in producers:
        for e in p.ends:
            if e.how in ("disconnect", "connack"):
                assert e.reason == 0x9C and e.reference in addresses - {mqtt_address(cluster, e.node)}, \
                    f"{p.cid}: {e}"
    # A client sent elsewhere reconnects at once: it never waits out the drained node's session
    # lease (session.owner_lease_s, 10 s), which it would if the session were released after it left.
    assert longest < MAX_PUBLISH_WAIT_S, f"a publish waited {longest:.1f} s"
    v5_disconnects = [e for p in producers if p.version == 5 for e in p.ends if e.how == "disconnect"]
    assert len(v5_disconnects) >= 3, f"each drained node's MQTT 5 producer is told 0x9C: {ends}"

    # Nothing acknowledged lost: every acknowledged message is in the replicas' stores.
    stored = set(stored_payloads(cluster, cluster.names, topics))
    for p in producers:
        lost = [s for s in sorted(p.acked) if p.payload_of(s).decode() not in stored]
        assert not lost, f"{p.cid}: {len(lost)} acknowledged messages lost: {lost[:10]}"
    cluster.assert_no_errors()
