"""Seeded random schedules against the core: message loss, duplication and reordering, crashes
that lose unsynced writes, async syncs (leader appends before its own sync), compaction and
membership changes. Checks Raft's safety properties after every step, then liveness after healing.

Small and bounded (a few seconds); the simulator in moorline/sim does the heavy version.
"""

from __future__ import annotations

import random

import pytest

from moorline.raft import (
    ConfChange,
    ConfChangeType,
    Config,
    ConfState,
    Entry,
    EntryType,
    HardState,
    MemberId,
    MemoryStorage,
    Message,
    ProposalDropped,
    RaftBugs,
    RaftNode,
    Ready,
    Snapshot,
    SnapshotMeta,
    StateRole,
)


def mid(i: int) -> MemberId:
    return (i, f"s{i}")


class Host:
    """One node's host: storage is the durable image; a taken Ready is synced later."""

    def __init__(self, i: int, storage: MemoryStorage, rng: random.Random, bugs: RaftBugs) -> None:
        self.i = i
        self.storage = storage
        self.bugs = bugs
        self.rng = rng
        self.pending: Ready | None = None
        self.applied: list[Entry] = []
        self.up = True
        self.node = self._start()

    def _start(self) -> RaftNode:
        cfg = Config(
            id=mid(self.i),
            election_tick=10,
            heartbeat_tick=1,
            max_entries_per_append=3,
            max_inflight_appends=3,
            rng=random.Random(self.rng.random()),
            bugs=self.bugs,
        )
        node = RaftNode(cfg, self.storage)
        self.applied_index = node.log.applied
        return node

    def crash_and_restart(self) -> None:
        self.pending = None  # unsynced writes are lost
        self.node = self._start()


class Cluster:
    def __init__(
        self, seed: int, n_voters: int, n_total: int, bugs: RaftBugs | None = None, crash_p: float = 0.003
    ) -> None:
        self.rng = random.Random(seed)
        self.crash_p = crash_p
        self.bugs = bugs or RaftBugs()
        cs = ConfState.of([mid(i) for i in range(1, n_voters + 1)])
        self.hosts: dict[int, Host] = {}
        for i in range(1, n_total + 1):
            st = MemoryStorage()
            if i <= n_voters:
                st.apply_snapshot(Snapshot(meta=SnapshotMeta(index=1, term=1, conf_state=cs)))
                st.set_hard_state(HardState(term=1, commit=1))
            self.hosts[i] = Host(i, st, self.rng, self.bugs)
        self.net: list[Message] = []
        self.committed: dict[int, tuple[int, bytes]] = {}  # index -> (term, data) applied anywhere
        self.leaders: dict[int, int] = {}  # term -> node id
        self.next_value = 0
        self.drop_p = 0.1

    # -- host actions -------------------------------------------------------------------
    def take_ready(self, h: Host) -> None:
        if not h.up or h.pending is not None or not h.node.has_ready():
            return
        rd = h.node.ready()
        self.net.extend(rd.early_messages)
        h.pending = rd

    def sync(self, h: Host) -> None:
        rd = h.pending
        if rd is None or not h.up:
            return
        h.pending = None
        st = h.storage
        if rd.snapshot is not None:
            st.apply_snapshot(rd.snapshot)
            h.applied = [e for e in h.applied if e.index <= rd.snapshot.meta.index]
        if rd.entries:
            st.append(rd.entries)
        if rd.hard_state is not None:
            st.set_hard_state(rd.hard_state)
        self.net.extend(rd.messages)
        for e in rd.committed_entries:
            self.check_apply(h, e)
        h.node.advance(rd)
        st.set_conf_state(h.node.conf_state)

    def check_apply(self, h: Host, e: Entry) -> None:
        seen = self.committed.get(e.index)
        if seen is None:
            self.committed[e.index] = (e.term, e.data)
        else:
            assert seen == (e.term, e.data), f"state machine safety: index {e.index} {seen} vs {e}"

    def deliver(self) -> None:
        if not self.net:
            return
        m = self.net.pop(self.rng.randrange(len(self.net)))
        if self.rng.random() < self.drop_p:
            return
        if self.rng.random() < 0.05:
            self.net.append(m)  # duplicate
        h = self.hosts.get(m.to[0])
        if h is not None and h.up:
            h.node.step(m)

    def note_leaders(self) -> None:
        for h in self.hosts.values():
            if h.up and h.node.role == StateRole.LEADER:
                prev = self.leaders.setdefault(h.node.term, h.i)
                assert prev == h.i, f"election safety: term {h.node.term} has leaders {prev} and {h.i}"

    def leader(self) -> Host | None:
        best = None
        for h in self.hosts.values():
            if h.up and h.node.role == StateRole.LEADER and (best is None or h.node.term > best.node.term):
                best = h
        return best

    def propose(self) -> None:
        h = self.leader()
        if h is None:
            return
        self.next_value += 1
        try:
            h.node.propose(f"v{self.next_value}".encode())
        except ProposalDropped:
            pass

    def conf_change(self) -> None:
        h = self.leader()
        if h is None:
            return
        cs = h.node.conf_state
        others = [i for i in self.hosts if mid(i) not in cs.voters and mid(i) not in cs.learners]
        choices: list[ConfChange] = []
        for i in others:
            choices.append(ConfChange(ConfChangeType.ADD_LEARNER, mid(i)))
        for m in cs.learners:
            choices.append(ConfChange(ConfChangeType.PROMOTE, m))
        if len(cs.voters) > 3:
            for m in cs.voters:
                if m != h.node.id:
                    choices.append(ConfChange(ConfChangeType.REMOVE, m))
        if not choices:
            return
        try:
            h.node.propose_conf_change(self.rng.choice(choices))
        except ProposalDropped:
            pass

    def compact(self, h: Host) -> None:
        applied = h.node.log.applied
        st = h.storage
        if applied > st.first_index() + 2 and h.pending is None:
            st.create_snapshot(applied, h.node.conf_state, b"")
            st.compact(applied - 1)

    def step(self) -> None:
        r = self.rng.random()
        hosts = list(self.hosts.values())
        h = self.rng.choice(hosts)
        if r < 0.45:
            self.deliver()
        elif r < 0.60:
            self.take_ready(h)
        elif r < 0.77:
            self.sync(h)
        elif r < 0.85:
            if h.up:
                h.node.tick()
        elif r < 0.93:
            self.propose()
        elif r < 0.95:
            self.conf_change()
        elif r < 0.97:
            self.compact(h)
        elif r < 0.9715:
            if h.up and sum(x.up for x in hosts) > len(hosts) // 2 + 1:
                h.up = False
                h.pending = None
        elif r < 0.99:
            if not h.up:
                h.up = True
                h.crash_and_restart()
        elif r < 0.99 + self.crash_p:
            if h.up:
                h.crash_and_restart()
        self.note_leaders()

    def heal_and_settle(self, rounds: int) -> None:
        self.drop_p = 0.0
        for h in self.hosts.values():
            if not h.up:
                h.up = True
                h.crash_and_restart()
        for _ in range(rounds):
            for h in self.hosts.values():
                h.node.tick()
            for _ in range(50):
                for h in self.hosts.values():
                    self.take_ready(h)
                    self.sync(h)
                while self.net:
                    self.deliver()
                if not any(h.node.has_ready() or h.pending for h in self.hosts.values()):
                    break
            self.note_leaders()


@pytest.mark.parametrize("seed", range(16))
def test_random_schedule_is_safe_and_live(seed: int) -> None:
    c = Cluster(seed, n_voters=3 if seed % 2 else 5, n_total=5)
    for _ in range(10_000):
        c.step()
    c.heal_and_settle(rounds=60)
    leader = c.leader()
    assert leader is not None, "no leader after healing"
    # Liveness: a fresh proposal commits everywhere in the leader's configuration.
    index = leader.node.propose(b"final")
    c.heal_and_settle(rounds=10)
    members = leader.node.conf_state.voters + leader.node.conf_state.learners
    for m in members:
        h = c.hosts[m[0]]
        assert h.node.log.applied >= index, f"node {m[0]} did not apply the final entry"
    assert c.committed[index][1] == b"final"


def test_random_schedules_reach_the_rare_paths() -> None:
    """Coverage marks: the schedules above really exercise membership changes, snapshots sent to
    lagging followers, and leader changes, so they cannot silently stop testing them."""
    conf_seen = snaps = elections = 0
    for seed in range(6):
        c = Cluster(seed, n_voters=3 if seed % 2 else 5, n_total=5)
        for _ in range(10_000):
            before = len(c.net)
            c.step()
            snaps += sum(1 for m in c.net[before:] if m.snapshot is not None)
        elections += len(c.leaders)
        if any(
            h.node.active_conf_state.learners or len(h.node.active_conf_state.voters) not in (3, 5)
            for h in c.hosts.values()
        ):
            conf_seen += 1
    assert conf_seen > 0 and snaps > 0 and elections > 6


def test_entry_type_roundtrip() -> None:
    e = Entry(
        term=1, index=2, type=EntryType.CONF_CHANGE, data=ConfChange(ConfChangeType.REMOVE, mid(2)).encode()
    )
    assert ConfChange.decode(e.data).member == mid(2)
