"""Small helpers shared by the raft unit tests (not a test module)."""

from __future__ import annotations

import random

from moorline.raft import (
    Config,
    ConfState,
    Entry,
    HardState,
    MemberId,
    MemoryStorage,
    Message,
    MessageType,
    RaftBugs,
    RaftNode,
    Ready,
    Snapshot,
    SnapshotMeta,
)


def mid(i: int) -> MemberId:
    return (i, f"s{i}")


def bootstrap(n: int, i: int, bugs: RaftBugs | None = None, **cfg: object) -> tuple[RaftNode, MemoryStorage]:
    """Node ``i`` of an ``n``-voter group that starts from a snapshot at index 1, term 1."""
    st = MemoryStorage()
    cs = ConfState.of([mid(k) for k in range(1, n + 1)])
    st.apply_snapshot(Snapshot(meta=SnapshotMeta(index=1, term=1, conf_state=cs)))
    st.set_hard_state(HardState(term=1, commit=1))
    config = Config(id=mid(i), rng=random.Random(i), bugs=bugs or RaftBugs(), **cfg)  # type: ignore[arg-type]
    return RaftNode(config, st), st


def handle(node: RaftNode, st: MemoryStorage) -> tuple[Ready, list[Message]]:
    """Do everything a correct host does with one Ready; returns it and the messages sent."""
    rd = node.ready()
    if rd.snapshot is not None:
        st.apply_snapshot(rd.snapshot)
    if rd.entries:
        st.append(rd.entries)
    if rd.hard_state is not None:
        st.set_hard_state(rd.hard_state)
    node.advance(rd)
    return rd, rd.early_messages + rd.messages


class Group:
    """Nodes 1..n connected by a perfect network (for setting up a state before a unit check)."""

    def __init__(self, n: int, bugs: dict[int, RaftBugs] | None = None, **cfg: object) -> None:
        self.nodes: dict[MemberId, RaftNode] = {}
        self.storages: dict[MemberId, MemoryStorage] = {}
        for i in range(1, n + 1):
            node, st = bootstrap(n, i, (bugs or {}).get(i), **cfg)
            self.nodes[mid(i)] = node
            self.storages[mid(i)] = st

    def stabilize(self, down: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        for _ in range(1000):
            moved = False
            for m_id, node in self.nodes.items():
                if m_id[0] in down or not node.has_ready():
                    continue
                _, msgs = handle(node, self.storages[m_id])
                moved = True
                for m in msgs:
                    if m.to[0] not in down and m.to in self.nodes:
                        self.nodes[m.to].step(m)
            if not moved:
                return
        raise AssertionError("group did not stabilize")

    def elect(self, i: int) -> RaftNode:
        self.nodes[mid(i)].campaign()
        self.stabilize()
        assert self.nodes[mid(i)].is_leader
        return self.nodes[mid(i)]


def snapshot_over_log(
    entries: list[Entry], term: int, snap_index: int, snap_term: int, bugs: RaftBugs | None = None
) -> tuple[RaftNode, MemoryStorage, list[int]]:
    """Follower 2 of 3 holding ``entries`` (after the bootstrap snapshot at 1) at ``term`` with
    commit 1, restarted, is sent a snapshot at (``snap_index``, ``snap_term``) by 1: the node, its
    storage and the indexes it acknowledged."""
    node, st = bootstrap(3, 2, bugs)
    st.append(entries)
    st.set_hard_state(HardState(term=term, commit=1))
    node = type(node)(node.cfg, st)
    cs = ConfState.of([mid(1), mid(2), mid(3)])
    snap = Snapshot(meta=SnapshotMeta(index=snap_index, term=snap_term, conf_state=cs), data=b"state")
    node.step(Message(type=MessageType.SNAP, from_=mid(1), to=mid(2), term=term, snapshot=snap))
    _, msgs = handle(node, st)
    return node, st, [m.index for m in msgs if m.type == MessageType.APP_RESP and not m.reject]
