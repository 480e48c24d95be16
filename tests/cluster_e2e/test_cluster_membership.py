"""Issue 31: shard membership the metadata group owns and keeps at target (RabbitMQ #7209's
scenarios, real processes, 5 nodes, shard.replicas = 3, the reconciler scaled down to seconds).

- Scenario Three: a voter's node SIGKILLed and restarted after the reconciler has run while it was
  down: no replacement is placed (no move at all), and it catches up from the log.
- Scenario One: a node SIGKILLed and forgotten (``moorline cluster forget``, the CLI) under a QoS 1
  stream: every shard that had a voter on it has 3 live voters again, none on it, within the bound;
  the forgotten node is in no group any more; nothing acknowledged is lost. Forgetting a live node
  is refused first (409, saying why).
- Scenario Two: at the moment of the forget, a manual ``add-replica`` of one of those shards races
  the reconciler: it is accepted or refused (409: a change in progress), never two moves on one
  shard at once (watched all along), and the shard ends with >= 3 live voters.
- Leave: a live node (``POST .../leave``) under the same stream: no shard ever below 3 voters (grow
  before shrink), the node ends in no group, exits 0 by itself, and is refused a restart (exit 2).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from cluster_clients import StreamPublisher, connect, wait_acks
from cluster_harness import REPO_ROOT, SHARD_COUNT, Cluster, ClusterFactory, wait_for

pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(170)]

INTERVAL_S = 5.0  # cluster.reconcile_interval_s, scaled down from 30 s
# After a forget the reconciler runs within reconcile_after_event_s and again as each move ends: every
# affected shard's dead voter removed (shrink), then a learner promoted elsewhere (grow), up to 8
# moves at once. The issue asks for this within the reconcile interval; the bound is twice that for
# a loaded 2-core CI machine (measured: about 3 s for 10 shards).
RESTORE_BOUND_S = 2 * INTERVAL_S
CONFIG = f"""
[cluster]
reconcile_interval_s = {INTERVAL_S}
reconcile_after_event_s = 0.3
max_concurrent_moves = 8
move_timeout_s = 20
"""


def membership(cluster: Cluster, via: str) -> dict[str, Any]:
    ms = cluster[via].get("/v1/cluster")["membership"]
    assert ms is not None
    return ms


def post(cluster: Cluster, via: str, method: str, path: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(cluster[via].http_url + path, method=method, data=b"{}",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class MoveWatcher:
    """Polls GET /v1/cluster on a node: every move seen, and whether two were ever in progress on
    one shard at once (the member table keys them by shard; this checks the answer says so too)."""

    def __init__(self, cluster: Cluster, via: str) -> None:
        self.cluster, self.via = cluster, via
        self.seen: dict[int, dict[str, Any]] = {}
        self.double: list[Any] = []
        self.fewest_voters: dict[int, int] | None = None  # per shard, while track_voters() is on
        self.most_voters: dict[int, int] | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ms = membership(self.cluster, self.via)
            except (OSError, ValueError, AssertionError):
                time.sleep(0.1)
                continue
            shards = [m["shard"] for m in ms["moves"]]
            if len(shards) != len(set(shards)):
                self.double.append(ms["moves"])
            for m in ms["moves"] + ms["recent_moves"]:
                self.seen[m["id"]] = m
            if self.fewest_voters is not None and self.most_voters is not None:
                for sh in ms["shards"]:
                    self.fewest_voters[sh["shard"]] = min(self.fewest_voters.get(sh["shard"], 99), len(sh["voters"]))
                    self.most_voters[sh["shard"]] = max(self.most_voters.get(sh["shard"], 0), len(sh["voters"]))
            time.sleep(0.1)

    def track_voters(self) -> None:
        self.fewest_voters, self.most_voters = {}, {}

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)


def voters_by_shard(cluster: Cluster, via: str) -> dict[int, list[str]]:
    return {s["shard"]: s["voters"] for s in membership(cluster, via)["shards"]}


def test_forget_restart_manual_race_and_leave(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(5, CONFIG)
    # The member table: from the bootstrap record, every node announces its addresses.
    def settled() -> dict[str, Any] | None:
        if cluster["n1"].get("/v1/cluster")["membership"] is None:
            return None  # the metadata group has no member table yet (a loaded machine: CI)
        m = membership(cluster, "n1")
        ok = (all(x["cluster"] and x["live"] and x["state"] == "active" for x in m["members"])
              and all(s["health"] == "at target" and len(s["voters"]) == 3 for s in m["shards"]))
        return m if ok else None

    ms = wait_for("every member announced, live and active, every shard at target", settled, 30)
    assert [m["name"] for m in ms["members"]] == ["n1", "n2", "n3", "n4", "n5"]
    status_cli = subprocess.run([sys.executable, "-m", "moorline.cli", "cluster", "status", "--wide", "--http",
                                 f"127.0.0.1:{cluster['n1'].http_port}"], capture_output=True, text=True, timeout=30,
                                cwd=str(REPO_ROOT), env={**os.environ, "COLUMNS": "200"})
    assert status_cli.returncode == 0 and "members (the metadata group's table)" in status_cli.stdout, status_cli
    assert f"{SHARD_COUNT} at target, 0 below" in status_cli.stdout, status_cli.stdout
    watcher = MoveWatcher(cluster, "n1")

    # --- scenario Three: n5 restarted after the reconciler has run while it was down --------------
    meta_leader = cluster["n1"].get("/v1/cluster")["metadata"]["leader"]
    victim3 = "n5" if meta_leader != "n5" else "n3"
    others = [n for n in cluster.names if n != victim3]

    def runs() -> int:  # reconcile runs on any node (the metadata leadership may move meanwhile)
        return sum(membership(cluster, n)["reconciler"]["runs_here"] for n in others)

    runs_before = runs()
    cluster.kill9(victim3)
    wait_for("the reconciler ran twice while a voter's node was down", lambda: runs() >= runs_before + 2,
             3 * INTERVAL_S + 5)
    assert membership(cluster, "n1")["moves"] == [] and watcher.seen == {}, watcher.seen
    cluster.start_node(victim3)
    for shard in range(SHARD_COUNT):
        cluster.wait_applied_equal(shard, cluster.names, timeout=30)
    assert watcher.seen == {}, f"a replacement was placed for a node that came back: {watcher.seen}"
    assert voters_by_shard(cluster, "n1") == {s["shard"]: s["voters"] for s in ms["shards"]}

    # --- scenario One (and Two): n4 killed and forgotten under a QoS 1 stream ---------------------
    dead = "n4"
    topics = [f"membership/t{i}" for i in range(64)]
    pub = StreamPublisher(connect(cluster["n1"], "membership-pub", clean=True, expiry=0), topics, total=1_000_000,
                          window=16).start()
    wait_acks(pub, 200, 30)
    status, body = post(cluster, "n2", "POST", f"/v1/cluster/members/{dead}/forget")
    assert status == 409 and any("live" in r for r in body["reasons"]), body  # refused: it is live

    before = voters_by_shard(cluster, "n1")
    affected = sorted(s for s, v in before.items() if dead in v)
    assert affected, before
    cluster.kill9(dead)
    wait_for(f"{dead} seen down", lambda: not next(m for m in membership(cluster, "n2")["members"]
                                                   if m["name"] == dead)["live"], 15)
    t0 = time.monotonic()
    watcher.track_voters()
    cli = subprocess.run([sys.executable, "-m", "moorline.cli", "cluster", "forget", dead, "--http",
                          f"127.0.0.1:{cluster['n2'].http_port}"], capture_output=True, text=True, timeout=30,
                         cwd=str(REPO_ROOT))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # scenario Two: a manual add-replica of an affected shard, at once, racing the reconciler
    raced = affected[0]
    target = next(n for n in ("n1", "n2", "n3", "n5") if n not in before[raced])
    manual, manual_body = post(cluster, "n3", "POST", f"/v1/cluster/shards/{raced}/replicas/{target}")
    assert manual in (202, 409), manual_body
    if manual == 409:
        assert "change in progress" in manual_body["error"], manual_body

    live = {"n1", "n2", "n3", "n5"}

    def restored() -> dict[int, list[str]] | None:
        now = voters_by_shard(cluster, "n1")
        ok = all(len(now[s]) >= 3 and set(now[s]) <= live for s in affected)
        return now if ok and all(set(v) <= live for v in now.values()) else None

    after = wait_for("every affected shard back to 3 live voters", restored, RESTORE_BOUND_S, interval=0.1)
    restore_s = time.monotonic() - t0
    print(f"voters restored on {len(affected)} shards {restore_s:.1f} s after the forget "
          f"(manual add-replica: {manual})")
    for s in affected:
        assert dead not in after[s]
        expected = 4 if (s == raced and manual == 202) else 3
        assert len(after[s]) in (3, expected), (s, after[s])
    # shrink before grow: the dead voter went before a new one came (never 4 voters, 3 of them live),
    # except where the manual add-replica won the race
    assert watcher.most_voters is not None
    grown = {s: n for s, n in watcher.most_voters.items() if n > 3 and s != raced}
    assert not grown, f"shards grown before their forgotten voter was removed: {grown}"
    unaffected = [s for s in before if s not in affected]
    assert all(after[s] == before[s] for s in unaffected if s != raced)

    def forgotten_everywhere() -> bool:
        shards = cluster["n1"].shards()
        meta = cluster["n1"].get("/v1/cluster")["metadata"]
        return all(dead not in s["voters"] + s["learners"] for s in shards) and dead not in meta["voters"]

    wait_for(f"{dead} removed from every group (learners and the metadata group too)", forgotten_everywhere, 30)
    ms = membership(cluster, "n2")
    assert next(m for m in ms["members"] if m["name"] == dead)["state"] == "forgotten"
    wait_for("no move in progress", lambda: membership(cluster, "n1")["moves"] == [], 20)
    # The forgotten node started again on its old data directory is no peer any more: every node
    # refuses its handshakes, so it reaches nobody and leads nothing.
    cluster.start_node(dead)
    wait_for(f"{dead}'s handshakes refused", lambda: f"'{dead}' is not a peer of" in cluster[dead].log(since_start=True),
             15)
    time.sleep(2.0)
    seen = {n["id"]: n for n in cluster["n1"].get("/v1/cluster")["nodes"]}
    assert not seen[dead]["reachable"], seen[dead]
    assert all(s["leader"] != dead for s in cluster["n1"].shards())
    cluster.kill9(dead)

    # --- leave: n5, live, goes away under the same stream: grow before shrink, then it stops --------
    leaver = "n5"
    stay = {"n1", "n2", "n3"}
    watcher.track_voters()
    status, body = post(cluster, "n1", "POST", f"/v1/cluster/members/{leaver}/leave")
    assert status == 202, body
    t1 = time.monotonic()
    rc = cluster[leaver].wait_exit(60)
    leave_s = time.monotonic() - t1
    assert rc == 0, cluster[leaver].log_tail()

    def left_everywhere() -> dict[int, list[str]] | None:
        now = voters_by_shard(cluster, "n1")
        shards = cluster["n1"].shards()
        meta = cluster["n1"].get("/v1/cluster")["metadata"]
        gone = all(leaver not in s["voters"] + s["learners"] for s in shards) and leaver not in meta["voters"]
        return now if gone and all(len(v) == 3 and set(v) == stay for v in now.values()) else None

    wait_for(f"{leaver} in no group, every shard on {sorted(stay)}", left_everywhere, 30)
    print(f"{leaver} left (every shard re-placed, then it stopped with exit 0) {leave_s:.1f} s after the leave")
    assert next(m for m in membership(cluster, "n1")["members"] if m["name"] == leaver)["state"] == "left"
    watcher.close()
    assert watcher.double == [], f"two moves in progress on one shard: {watcher.double}"
    assert watcher.fewest_voters and min(watcher.fewest_voters.values()) >= 3, watcher.fewest_voters
    outcomes = [m.get("outcome") for m in watcher.seen.values() if "outcome" in m]
    assert all(o == "done" or o.startswith("not needed") for o in outcomes), outcomes
    # starting it again on its data directory is refused, saying why
    cluster[leaver].spawn(cluster.initial_cluster, cluster.config_text, cluster.extra_args)
    assert cluster[leaver].wait_exit(30) == 2
    assert "left cluster" in cluster[leaver].log(since_start=True)

    # nothing acknowledged lost: every PUBACKed sequence number is in its shard's store
    pub.stop.set()
    pub.join(30)
    assert pub.refused == {} and pub.error is None, (pub.refused, pub.error)
    assert len(pub.acked) > 1000, len(pub.acked)
    for shard in range(SHARD_COUNT):  # (a PUBACK says a majority of the voters has it; wait for all)
        cluster.wait_applied_equal(shard, sorted(stay), timeout=30)
    for name in sorted(stay):
        stored: set[int] = set()
        for shard in range(SHARD_COUNT):
            for m in cluster[name].messages(shard):
                if m["topic"].startswith("membership/"):
                    stored.add(int(base64.b64decode(m["payload"]).decode()))
        lost = sorted(pub.acked - stored)
        assert not lost, f"{name}: {len(lost)} acknowledged messages missing, first {lost[:10]}"
