"""GET /v1/shards and /v1/cluster carry the Raft view, on a single node too (a cluster of one), and
`moorline cluster status` prints them as tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from e2e_broker import REPO_ROOT, BrokerProc

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]


def _get(b: BrokerProc, path: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(b.http_url + path, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_a_single_node_is_a_cluster_of_one(broker: BrokerProc) -> None:
    shards = _get(broker, "/v1/shards")["shards"]
    assert len(shards) == 16
    for s in shards:
        assert s["leader"] == "n1" and s["voters"] == ["n1"] and s["learners"] == []
        assert s["term"] >= 1 and s["commit"] >= 1 and s["replicas"]["n1"]["applied"] == s["applied_index"]
    cluster = _get(broker, "/v1/cluster")
    for _ in range(50):  # the metadata group's first leader writes its record just after start
        if cluster["metadata"]["record"] is not None:
            break
        time.sleep(0.1)
        cluster = _get(broker, "/v1/cluster")
    nodes = cluster["nodes"]
    # 16 shards and the metadata group, a group of one voter on a single node too
    assert [(n["id"], n["self"], n["reachable"], n["groups_led"]) for n in nodes] == [("n1", True, True, 17)]
    assert len(nodes[0]["storage_id"]) == 32
    meta = cluster["metadata"]
    assert meta["leader"] == "n1" and meta["voters"] == ["n1"]
    assert meta["record"]["members"] == [{"id": "n1", "node_id": 1, "storage_id": nodes[0]["storage_id"]}]


def test_cluster_status_prints_tables(broker: BrokerProc) -> None:
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "cluster", "status", "--http",
                        f"127.0.0.1:{broker.http_port}"], capture_output=True, text=True, timeout=60,
                       cwd=str(REPO_ROOT), env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "160"})
    assert r.returncode == 0, r.stderr
    assert "n1 (this)" in r.stdout and "shards (16)" in r.stdout and "metadata group: leader n1" in r.stdout
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "cluster", "status", "--http", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, cwd=str(REPO_ROOT),
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode != 0 and "unreachable" in (r.stdout + r.stderr) and "Traceback" not in r.stderr
