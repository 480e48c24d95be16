"""Issue 31, join and replace (real processes, 3 nodes, shard.replicas = 3, reconciler scaled down):

- ``moorline cluster join n4 --cluster ADDR`` admits n4 (its entry and node id in the member table),
  then ``moorline run --node-id n4 --cluster ADDR --join <a member's cluster address>`` (no
  --initial-cluster) starts it: a member binds its storage and tells it the cluster; every group
  gets it as a learner (snapshot transfer, then the log); the reconciler gives it its share of voters
  (``replicas * shards / nodes``, promoting only caught-up learners, removing the surplus voter) and
  the leader rebalancer some leaderships. All under a QoS 1 stream: 0 acknowledged lost, 0 refused.
- Then n5 the same way (five nodes: 9 or 10 voters each).
- A joined node restarts from its data directory's cluster.json (no --join).
- Replace a wiped node under the same stream: n3 killed, forgotten, its data directory wiped, admitted
  again under its name and started with --join: a new member (new node id, new storage id), voter of
  its share again.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cluster_clients import StreamPublisher, connect, wait_acks
from cluster_harness import REPO_ROOT, SHARD_COUNT, Cluster, ClusterFactory, ClusterNode, _free_port, wait_for

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(170)]

CONFIG = """
[cluster]
reconcile_interval_s = 5.0
reconcile_after_event_s = 0.2
max_concurrent_moves = 8
move_timeout_s = 30
"""
REPLICAS = 3


def membership(cluster: Cluster, via: str) -> dict[str, Any]:
    ms = cluster[via].get("/v1/cluster")["membership"]
    if ms is None:  # the metadata group has not applied its member table yet (just after start)
        raise ValueError(f"{via} has no member table yet")  # wait_for retries on ValueError
    return ms


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moorline.cli", "cluster", *args], capture_output=True, text=True,
                          timeout=30, cwd=str(REPO_ROOT))


def spawn_joining(nd: ClusterNode, join: str | None, config_text: str) -> None:
    """``moorline run`` with --join (or, restarting a joined node, with neither --join nor
    --initial-cluster): the harness's spawn always passes --initial-cluster."""
    assert nd.proc is None
    nd.starts += 1
    nd.data_dir.mkdir(parents=True, exist_ok=True)
    nd.config_path.write_text(config_text)
    cmd = [sys.executable, "-m", "moorline.cli", "run", "--node-id", nd.name,
           "--cluster", f"{nd.cluster_host}:{nd.cluster_port}", "--data-dir", str(nd.data_dir),
           "--mqtt", f"127.0.0.1:{nd.mqtt_port}", "--http", f"127.0.0.1:{nd.http_port}",
           "--config", str(nd.config_path), *(["--join", join] if join else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    with open(nd.log_path, "ab") as log:
        log.write(f"\n===== start #{nd.starts}: {' '.join(cmd)}\n".encode())
        log.flush()
        nd._log_offset = log.tell()
        nd.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=env,
                                   stdin=subprocess.DEVNULL)


def admit(cluster: Cluster, nd: ClusterNode, via: str) -> str:
    """``moorline cluster join``: the --join value it prints."""
    out = cli("join", nd.name, "--cluster", f"{nd.cluster_host}:{nd.cluster_port}", "--http",
              f"127.0.0.1:{cluster[via].http_port}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--join" in out.stdout, out.stdout
    return out.stdout.split("--join", 1)[1].split('"', 1)[0].strip()


def health(cluster: Cluster, name: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{cluster[name].http_url}/v1/health?ready=cluster", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def spread(cluster: Cluster, via: str) -> tuple[dict[str, int], dict[str, int], dict[int, list[str]]]:
    """(voters per node, leaderships per node, voters per shard) as ``via`` sees them."""
    ms = membership(cluster, via)
    voters: dict[str, int] = {}
    by_shard: dict[int, list[str]] = {}
    for s in ms["shards"]:
        by_shard[s["shard"]] = s["voters"]
        for v in s["voters"]:
            voters[v] = voters.get(v, 0) + 1
    leaders: dict[str, int] = {}
    for s in cluster[via].shards():
        if s.get("leader"):
            leaders[s["leader"]] = leaders.get(s["leader"], 0) + 1
    return voters, leaders, by_shard


def wait_joined(cluster: Cluster, name: str, nodes: int, started: float) -> dict[str, float]:
    """Learner of every group, then its share of voters on shards at target, then a leadership."""
    times: dict[str, float] = {}

    def follows_all() -> bool:
        ms = membership(cluster, "n1")
        meta = cluster["n1"].get("/v1/cluster")["metadata"]
        return (all(name in s["voters"] + s["learners"] for s in ms["shards"])
                and name in meta.get("learners", []) + meta["voters"])

    wait_for(f"{name} a member of every group", follows_all, 60, interval=0.2)
    times["learner_everywhere_s"] = time.monotonic() - started
    share = REPLICAS * SHARD_COUNT // nodes

    def balanced() -> bool:
        voters, _, by_shard = spread(cluster, "n1")
        return (voters.get(name, 0) >= share and all(len(v) == REPLICAS for v in by_shard.values())
                and membership(cluster, "n1")["moves"] == [])

    wait_for(f"{name} a voter of {share} shards, every shard at {REPLICAS} voters", balanced, 60, interval=0.2)
    times["voters_s"] = time.monotonic() - started

    def leads() -> bool:  # its share is shards / nodes; the rebalancer moves a few per round, under load
        return spread(cluster, "n1")[1].get(name, 0) >= 1

    wait_for(f"{name} leads a shard", leads, 45, interval=0.2)
    times["leader_s"] = time.monotonic() - started
    return times


def check_nothing_lost(cluster: Cluster, pub: StreamPublisher, names: list[str]) -> None:
    pub.stop.set()
    pub.join(30)
    assert pub.refused == {} and pub.error is None, (pub.refused, pub.error)
    assert pub.ended_by == "stopped", pub.ended_by
    for shard in range(SHARD_COUNT):
        cluster.wait_applied_equal(shard, names, timeout=30)
    for name in names:
        stored: set[int] = set()
        for shard in range(SHARD_COUNT):
            for m in cluster[name].messages(shard):
                if m["topic"].startswith("join/"):
                    stored.add(int(base64.b64decode(m["payload"]).decode()))
        lost = sorted(pub.acked - stored)
        assert not lost, f"{name}: {len(lost)} acknowledged messages missing, first {lost[:10]}"


def test_join_then_replace_a_wiped_node_under_load(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(3, CONFIG)
    wait_for("every member announced", lambda: all(m["cluster"] and m["live"] for m in
                                                   membership(cluster, "n1")["members"]), 30)
    n4 = ClusterNode("n4", 4, cluster.base, "127.0.0.14", _free_port("127.0.0.14"))
    cluster.nodes["n4"] = n4
    pub = StreamPublisher(connect(cluster["n1"], "join-pub", clean=True, expiry=0),
                          [f"join/t{i}" for i in range(64)], total=1_000_000, window=16).start()
    wait_acks(pub, 200, 30)

    # A node nobody admitted is refused, saying how to be admitted.
    stray = ClusterNode("n9", 9, cluster.base, "127.0.0.19", _free_port("127.0.0.19"))
    spawn_joining(stray, f"{cluster['n1'].cluster_host}:{cluster['n1'].cluster_port}",
                  CONFIG + "\n" + "bootstrap_timeout_s = 3\n")
    assert stray.wait_exit(30) == 2
    assert "moorline cluster join n9" in stray.log(since_start=True), stray.log_tail()

    # --- join n4 ---------------------------------------------------------------------------------
    t0 = time.monotonic()
    seeds = admit(cluster, n4, "n2")
    assert any(m["name"] == "n4" and m["state"] == "active" and not m["storage_id"]
               for m in membership(cluster, "n1")["members"])
    spawn_joining(n4, seeds, CONFIG)
    n4.wait_ready()
    admitted_s = time.monotonic() - t0
    entry = next(m for m in membership(cluster, "n1")["members"] if m["name"] == "n4")
    assert entry["node_id"] == 4 and entry["storage_id"], entry
    times = wait_joined(cluster, "n4", 4, t0)
    voters, leaders, _ = spread(cluster, "n1")
    print(f"n4 joined: ready {admitted_s:.1f} s after the admission; learner of every group at "
          f"{times['learner_everywhere_s']:.1f} s, {voters.get('n4')} voters at {times['voters_s']:.1f} s, "
          f"leading at {times['leader_s']:.1f} s; voters {voters}, leaders {leaders}")
    wait_acks(pub, len(pub.acked) + 100, 30)

    # --- join n5 (admitted through another node) ----------------------------------------------------
    n5 = ClusterNode("n5", 5, cluster.base, "127.0.0.15", _free_port("127.0.0.15"))
    cluster.nodes["n5"] = n5
    t5 = time.monotonic()
    spawn_joining(n5, admit(cluster, n5, "n3"), CONFIG)
    n5.wait_ready()
    times5 = wait_joined(cluster, "n5", 5, t5)
    voters, leaders, _ = spread(cluster, "n1")
    print(f"n5 joined: {voters.get('n5')} voters at {times5['voters_s']:.1f} s, leading at {times5['leader_s']:.1f} s; "
          f"voters {voters}, leaders {leaders}")
    assert min(voters["n4"], voters["n5"]) >= REPLICAS * SHARD_COUNT // 5, voters
    assert max(voters.values()) - min(voters.values()) <= 3, voters  # the others give up about evenly

    # Readiness counts the joined node: whole with it, not while it is down.
    wait_for("n1 ready=cluster with n4", lambda: health(cluster, "n1")[0] == 200, 30, interval=0.2)
    # A joined node restarts from its cluster.json (no --join, no --initial-cluster).
    assert n4.signal_and_wait(15, 30) == 0
    wait_for("n1 not ready while n4 is down", lambda: any(
        "n4" in r for r in health(cluster, "n1")[1].get("not_ready", [])), 15, interval=0.2)
    spawn_joining(n4, None, CONFIG)
    n4.wait_ready()
    # Live again as every node sees it: n2, asked to forget n3 below, refuses while a shard whose
    # voters are n3, n4 and one more would be left with one live voter of two in its view.
    wait_for("n4 live again", lambda: all(next(m for m in membership(cluster, seen_by)["members"]
                                               if m["name"] == "n4")["live"] for seen_by in ("n1", "n2", "n5")), 20)

    # --- replace n3: killed, forgotten, wiped, admitted again, joined ------------------------------
    t1 = time.monotonic()
    cluster.kill9("n3")
    wait_for("n3 seen down", lambda: not next(m for m in membership(cluster, "n2")["members"]
                                              if m["name"] == "n3")["live"], 15)
    out = cli("forget", "n3", "--http", f"127.0.0.1:{cluster['n2'].http_port}")
    assert out.returncode == 0, out.stdout + out.stderr
    shutil.rmtree(cluster["n3"].data_dir)
    cluster["n3"].data_dir.mkdir()
    seeds = admit(cluster, cluster["n3"], "n1")
    spawn_joining(cluster["n3"], seeds, CONFIG)
    cluster["n3"].wait_ready()
    members = {m["name"]: m for m in membership(cluster, "n1")["members"]}
    assert members["n3"]["state"] == "active" and members["n3"]["node_id"] == 6, members
    assert members["n3@3"]["state"] == "forgotten", members
    times3 = wait_joined(cluster, "n3", 5, t1)
    voters, leaders, by_shard = spread(cluster, "n1")
    print(f"n3 replaced: voters at {times3['voters_s']:.1f} s after the kill; voters {voters}, leaders {leaders}")
    assert "n3@3" not in voters
    # The metadata group is grown back to the initial members' three voters (the forgotten n3's
    # voter removed, a caught-up learner promoted): a second failure leaves the member table a majority.
    meta_voters = wait_for("the metadata group back at 3 voters", lambda: (
        v if len(v := cluster["n1"].get("/v1/cluster")["metadata"]["voters"]) == 3 else None), 60, interval=0.5)
    assert "n3@3" not in meta_voters, meta_voters
    print(f"metadata group voters after the replace: {meta_voters}")

    # The joined nodes serve clients (their clocks are compared with every member's: a node no member
    # answered would refuse clients and leadership once its start-up grace is over).
    for name in ("n4", "n5"):
        small = StreamPublisher(connect(cluster[name], f"join-{name}", clean=True, expiry=0), ["join/direct"],
                                total=50, window=8).start()
        small.join(30)
        assert len(small.acked) == 50 and not small.refused, (name, small.ended_by, small.refused)
        assert "refusing to serve clients" not in cluster[name].log(), cluster[name].log_tail()
    check_nothing_lost(cluster, pub, ["n1", "n2", "n3", "n4", "n5"])
    print(f"{len(pub.acked)} acknowledged, 0 lost, 0 refused")
    Path(cluster.base / "joined.txt").write_text(repr((times, times5, times3)))
