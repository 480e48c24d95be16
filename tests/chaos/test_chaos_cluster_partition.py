"""A chaos cluster's partitions cut real nodes apart, with iptables and with the relay fallback: a
node cut off from both others leads nothing on the majority side, which elects leaders without it;
after healing, all three agree on the leaders again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moorline.chaos.cluster import ClusterNodes
from moorline.chaos.partition import iptables_usable

pytestmark = [pytest.mark.cluster_e2e]


def _leaders_without(cluster: ClusterNodes, banned: str, timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        leaders = cluster.wait_leaders(max(0.1, deadline - time.monotonic()))
        if leaders is not None and banned not in leaders.values():
            return leaders
        if time.monotonic() >= deadline:
            raise AssertionError(f"the majority still names {banned} as a leader: {leaders}")
        time.sleep(0.2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["proxy", "iptables"])
def test_chaos_partition_isolates_a_node_and_heals(mode: str, cluster_addresses: str, tmp_path: Path) -> None:
    if mode == "iptables" and (reason := iptables_usable()) is not None:
        pytest.skip(f"iptables partitions: {reason}")
    cluster = ClusterNodes(3, tmp_path / "run", base_address=cluster_addresses, partition_with=mode,
                           partitions_wanted=True)
    assert cluster.partitioner.kind == mode
    try:
        cluster.start(leaders_timeout_s=30)
        before = cluster.wait_leaders(10)
        assert before is not None and "n1" in before.values(), before  # leaders are spread: n1 leads some
        cluster.set_faulty(["n1"], True)  # asks n2 and n3 only
        for peer in ("n2", "n3"):
            cluster.partitioner.cut("n1", peer)
        after = _leaders_without(cluster, "n1", timeout_s=30)
        moved = sorted(s for s, ld in before.items() if ld == "n1")
        assert all(after[s] in ("n2", "n3") for s in moved), after
        cluster.partitioner.heal_all()
        cluster.set_faulty(["n1"], False)
        healed = cluster.wait_leaders(30)  # n1 agrees with the others again
        assert healed is not None, "n1 did not rejoin within 30 s of healing"
        exits = cluster.stop()
        assert exits == {"n1": 0, "n2": 0, "n3": 0}, exits
    finally:
        cluster.kill_all()
        cluster.close()
    assert "moorline ready" in (tmp_path / "run" / "n1.log").read_text()
