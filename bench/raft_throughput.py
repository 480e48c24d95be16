"""Committed entries per second of a 3-node in-process Raft group (no IO, 100-byte payloads).

A minimal host drives three ``RaftNode`` replicas over ``MemoryStorage``: each round the leader
takes up to ``--batch`` proposals, then every node handles its Ready (persist to memory, send,
apply, advance) and messages are delivered, until the batch is committed on the leader.
Pipelining keeps several rounds in flight (``--window`` proposals outstanding).

    python bench/raft_throughput.py [--entries 200000] [--batch 1024] [--window 4096]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from moorline.raft import (  # noqa: E402
    Config,
    ConfState,
    HardState,
    MemoryStorage,
    RaftNode,
    Snapshot,
    SnapshotMeta,
)


def make_group(n: int, max_entries: int) -> tuple[list[RaftNode], list[MemoryStorage]]:
    ids = [(i, f"s{i}") for i in range(1, n + 1)]
    nodes, storages = [], []
    for mid in ids:
        st = MemoryStorage()
        st.apply_snapshot(Snapshot(meta=SnapshotMeta(index=1, term=1, conf_state=ConfState.of(ids))))
        st.set_hard_state(HardState(term=1, commit=1))
        cfg = Config(id=mid, rng=random.Random(mid[0]), max_entries_per_append=max_entries)
        nodes.append(RaftNode(cfg, st))
        storages.append(st)
    return nodes, storages


def pump(nodes: list[RaftNode], storages: list[MemoryStorage], by_id: dict[tuple[int, str], RaftNode]) -> int:
    """Handle every Ready once and deliver the resulting messages; returns entries applied."""
    applied = 0
    outbox = []
    for node, st in zip(nodes, storages, strict=True):
        if not node.has_ready():
            continue
        rd = node.ready()
        if rd.snapshot is not None:
            st.apply_snapshot(rd.snapshot)
        if rd.entries:
            st.append(rd.entries)
        if rd.hard_state is not None:
            st.set_hard_state(rd.hard_state)
        outbox.extend(rd.early_messages)
        outbox.extend(rd.messages)
        applied += len(rd.committed_entries) if node.is_leader else 0
        node.advance(rd)
    for m in outbox:
        by_id[m.to].step(m)
    return applied


def run(total: int, batch: int, window: int, max_entries: int) -> tuple[float, int]:
    nodes, storages = make_group(3, max_entries)
    by_id = {n.id: n for n in nodes}
    nodes[0].campaign()
    for _ in range(100):
        pump(nodes, storages, by_id)
    leader = nodes[0]
    assert leader.is_leader
    payload = bytes(100)
    proposed = committed = 0
    start_commit = leader.log.committed
    t0 = time.perf_counter()
    while committed < total:
        outstanding = leader.log.last_index() - leader.log.committed
        k = min(batch, total - proposed, max(0, window - outstanding))
        for _ in range(k):
            leader.propose(payload)
        proposed += k
        pump(nodes, storages, by_id)
        committed = leader.log.committed - start_commit
    dt = time.perf_counter() - t0
    # Sanity: every follower's log agrees with the leader's up to what it has stored.
    for st in storages[1:]:
        upto = min(st.last_index(), leader.log.committed)
        assert st.term(upto) == leader.log.term(upto), "follower log diverged"
    return dt, committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--max-entries", type=int, default=4096)
    args = ap.parse_args()
    dt, committed = run(args.entries, args.batch, args.window, args.max_entries)
    print(
        f"3-node group, 100-byte payloads, batch={args.batch}: {committed} entries committed in {dt:.3f} s "
        f"= {committed / dt:,.0f} entries/s"
    )


if __name__ == "__main__":
    main()
