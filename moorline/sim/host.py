"""The sim host: runs one RaftNode replica on a sim node, obeying the host's obligations.

Persistence rule: a Ready's snapshot, entries and hard state are written and synced before its
``messages`` are sent (only ``early_messages`` go out at once); then committed entries are
applied, read states served, and ``advance`` reports the sync to the core. A crash while the
sync is in flight loses the pending writes (or part of them).

Recovery rebuilds ``MemoryStorage`` from the disk records; a checksum failure in synced data
quarantines the replica (it neither votes nor campaigns nor acks) until the operator removes it
and adds a fresh replica (new storage id) as a learner.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moorline.raft import (
    ConfChange,
    ConfChangeType,
    Config,
    ConfState,
    EntryType,
    HardState,
    MemberId,
    MemoryStorage,
    Message,
    MessageType,
    ProposalDropped,
    RaftBugs,
    RaftError,
    Ready,
    Snapshot,
    SnapshotMeta,
    StateRole,
)
from moorline.sim.disk import Record, RecordKind, SimDisk, batch_record, snapshot_record
from moorline.sim.loop import EventLoop, Timer
from moorline.sim.marks import Marks
from moorline.sim.network import SimNetwork
from moorline.sim.statemachine import SimStateMachine, encode_command

if TYPE_CHECKING:
    from moorline.sim.checkers.raft_safety import RaftObserver

_RAFT_NODE: Any = None


def raft_node_class() -> Any:
    """The core's RaftNode (imported lazily: the core is developed in parallel)."""
    global _RAFT_NODE
    if _RAFT_NODE is None:
        import moorline.raft as raft

        _RAFT_NODE = raft.RaftNode  # type: ignore[attr-defined]
    return _RAFT_NODE


@dataclass(slots=True)
class HostBugs:
    """Sim/host-level broken variants (test-only), passed in through ``SimShared``."""

    ack_before_sync: bool = False  # a Ready's messages leave before its writes are synced
    wiped_rejoins_as_voter: bool = False  # a wiped node re-bootstraps under its old identity
    truncate_synced_corruption: bool = False  # a checksum failure in synced data read as a torn tail
    dedup_at_propose: bool = False  # enqueue de-duplication on the leader at propose time only


HOST_BUG_NAMES: tuple[str, ...] = tuple(HostBugs.__dataclass_fields__)


def fmt_member(m: MemberId | None) -> str:
    return "-" if m is None else f"n{m[0]}/{m[1]}"


@dataclass(slots=True)
class LogView:
    """A member's log as an election would see it: a running replica's, or the durable log a
    crashed node will restart with."""

    member: MemberId
    log: Any  # moorline.raft.log.RaftLog
    voters: tuple[MemberId, ...]  # of the configuration in force in that log
    can_vote: bool  # a corrupted replica neither votes nor campaigns


@dataclass(slots=True)
class HostParams:
    tick_ms: int = 50  # heartbeat every 2 ticks (100 ms); election timeout 0.5-1 s
    election_tick: int = 10
    heartbeat_tick: int = 2
    snapshot_every: int = 200  # applied entries between snapshots (0: never)
    keep_entries: int = 20  # entries kept behind a snapshot for slow followers
    clock_skew_ms: int = 0  # this node's clock offset, used in the leader's stamps
    max_pending_requests: int = 10_000
    batch_ms: int = 2  # inputs arriving within this window share one Ready (group commit)
    max_entries_per_append: int = 4096
    corrupt_mode: str = "quarantine"  # or "core_mark": run on the readable records + mark_corrupted()
    report_snapshot: bool = True  # tell the core when a snapshot transfer ended (swarm: on/off)


@dataclass(slots=True)
class SimShared:
    """What all hosts of one simulation share."""

    loop: EventLoop
    net: SimNetwork
    rng: random.Random
    marks: Marks
    observer: RaftObserver
    raft_bugs: RaftBugs
    host_bugs: HostBugs
    sm_factory: Callable[[], SimStateMachine]
    trace: Callable[[str], None]
    # checks that restate a core rule rather than observe an effect (the commit rule); a bug
    # run turns them off to prove the effect checks catch the bug on their own
    rule_checks: bool = True
    # members the cluster's configuration no longer holds whose replicas still run (coverage)
    removed_members: set[MemberId] = field(default_factory=set)
    on_leader_elected: Callable[[SimNode], None] | None = None


def bootstrap_storage(voters: list[MemberId], sm_state: bytes) -> MemoryStorage:
    """Initial members start from a snapshot at index 1 holding the first configuration, so a
    member with an empty log can only be caught up by a snapshot, which carries the config."""
    cs = ConfState.of(voters)
    st = MemoryStorage(cs)
    st.apply_snapshot(Snapshot(meta=SnapshotMeta(index=1, term=1, conf_state=cs), data=sm_state))
    st.set_hard_state(HardState(term=1, commit=1))
    return st


@dataclass(slots=True)
class ReadWait:
    client: int
    req: int
    key: str
    index: int = -1  # set when the read state arrives


@dataclass(slots=True)
class Replica:
    """One running replica (member) on a sim node."""

    member: MemberId
    raft: Any
    storage: MemoryStorage
    sm: SimStateMachine
    conf: ConfState
    applied: int
    pending: dict[tuple[int, int], int] = field(default_factory=dict)  # (client, req) -> client endpoint
    reads: dict[bytes, ReadWait] = field(default_factory=dict)
    ready_reads: list[ReadWait] = field(default_factory=list)
    proposed_ids: set[str] = field(default_factory=set)  # only for the dedup_at_propose bug
    syncing: bool = False
    process_scheduled: bool = False
    last_stamp_ms: int = 0
    was_leader_term: int = 0
    last_commit: int = 0
    since_snapshot: int = 0


class SimNode:
    """A machine: one disk, one network endpoint, at most one replica at a time."""

    def __init__(self, node_id: int, shared: SimShared, disk: SimDisk, params: HostParams) -> None:
        self.node_id = node_id
        self.sh = shared
        self.disk = disk
        self.params = params
        self.replica: Replica | None = None
        self.storage_gen = 0
        self.alive = False
        self.quarantined: MemberId | None = None  # corrupted member awaiting removal
        self.paused_until_ms = 0
        self.epoch = 0  # bumps on crash: callbacks of an old life are ignored
        self._tick_timer: Timer | None = None
        self._held: list[tuple[int, Any]] = []  # messages received while paused
        self._down_view: LogView | None = None  # cache of view() while crashed

    # -- identity --------------------------------------------------------------------------
    def member_id(self) -> MemberId:
        return (self.node_id, f"s{self.storage_gen}")

    def view(self) -> LogView | None:
        """This node's log for the checks: the running replica's, or (crashed) the durable one it
        will restart with; None when it has none (quarantined, empty, corrupt on disk)."""
        r = self.replica
        if self.alive:
            if r is None:
                return None
            raft = r.raft
            return LogView(r.member, raft.log, raft.active_conf_state.voters, not raft.corrupted)
        if self.disk.corrupt_marker:
            return None  # it will restart quarantined: no votes, no campaigns
        if self._down_view is None:
            records = self.disk.peek()
            if not records:
                return None
            st = _rebuild(records)
            member = self.member_id()
            raft = raft_node_class()(Config(id=member, rng=random.Random(0)), st)
            self._down_view = LogView(member, raft.log, raft.active_conf_state.voters, True)
        return self._down_view

    # -- life cycle ------------------------------------------------------------------------
    def start_bootstrap(self, voters: list[MemberId]) -> None:
        sm = self.sh.sm_factory()
        st = bootstrap_storage(voters, sm.snapshot())
        self.disk.write(snapshot_record(st.snapshot()))
        self.disk.write(batch_record([], st.hard_state()))
        self.disk.sync()
        self._boot(st, sm, 1)

    def start_empty(self) -> None:
        """A new storage (new storage id): joins only when the operator adds it as a learner."""
        self._boot(MemoryStorage(), self.sh.sm_factory(), 0)

    def _boot(self, st: MemoryStorage, sm: SimStateMachine, applied: int) -> None:
        member = self.member_id()
        p = self.params
        snap = st.snapshot()
        if not snap.is_empty():
            sm.restore(snap.data)
            applied = snap.meta.index
            self.sh.observer.on_snapshot_state(member, applied, snap.data)
        cfg = Config(
            id=member,
            election_tick=p.election_tick,
            heartbeat_tick=p.heartbeat_tick,
            max_entries_per_append=p.max_entries_per_append,
            applied=applied,
            rng=random.Random(self.sh.rng.random()),
            bugs=self.sh.raft_bugs,
        )
        raft = raft_node_class()(cfg, st)
        self.sh.observer.on_boot(member, raft.term, raft.vote, raft.log.last_index())
        _hs, cs = st.initial_state()
        self.replica = Replica(member=member, raft=raft, storage=st, sm=sm, conf=cs, applied=applied)
        self.replica.last_commit = st.hard_state().commit
        self.alive = True
        self.sh.net.attach(self.node_id, self._on_net)
        self._schedule_tick()
        self._kick()

    def crash(self) -> None:
        """Power loss: drop the process; unsynced writes are (partly) lost."""
        if not self.alive:
            return
        self.alive = False
        self.epoch += 1
        self.replica = None
        self._down_view = None
        self._held.clear()
        if self._tick_timer is not None:
            self._tick_timer.cancel()
        self.sh.net.detach(self.node_id)
        lost, torn = self.disk.crash(self.sh.rng)
        if lost:
            self.sh.marks.hit("unsynced_writes_lost")
        self.sh.trace(f"crash n{self.node_id} lost_writes={lost} torn={torn}")

    def restart(self) -> None:
        """Start from the disk: recover, quarantine on corruption."""
        invariant_dead = not self.alive
        assert invariant_dead
        rec = self.disk.recover(self.sh.host_bugs.truncate_synced_corruption)
        if rec.torn_tail_truncated:
            self.sh.marks.hit("torn_tail_truncated")
        if rec.synced_corruption_truncated:
            self.sh.marks.hit("bug_synced_corruption_truncated")
        if rec.corrupt_at is not None or self.disk.corrupt_marker:
            if not self.disk.corrupt_marker:
                self.sh.marks.hit("corruption_detected")
            self.disk.corrupt_marker = True
            self.quarantined = self.member_id()
            if self.params.corrupt_mode == "core_mark":
                # run the replica on what is readable and let the core refuse to vote/campaign
                # (the consistent prefix before the bad record: skipping it would resurrect
                # entries it had overwritten, and a later hard state would vouch for them)
                st = _rebuild(rec.records)
                self.disk.sync()
                self.sh.trace(
                    f"restart n{self.node_id}: corruption at record {rec.corrupt_at}, marked corrupted, "
                    f"last={st.last_index()} hs={st.hard_state()}"
                )
                self._boot(st, self.sh.sm_factory(), 0)
                assert self.replica is not None
                self.replica.raft.mark_corrupted()
                return
            self.sh.trace(f"restart n{self.node_id}: corruption at record {rec.corrupt_at}, quarantined")
            self.alive = True  # up, but the group is stopped: no replica runs
            self.sh.net.attach(self.node_id, self._on_net)
            return
        if not rec.records:  # wiped (or never written): a new storage
            self.sh.trace(f"restart n{self.node_id}: empty disk")
            self.start_empty()
            return
        st = _rebuild(rec.records)
        self.disk.sync()  # what recovery read becomes known-durable before we act on it
        self.sh.trace(f"restart n{self.node_id} last={st.last_index()} hs={st.hard_state()}")
        self._boot(st, self.sh.sm_factory(), 0)

    def wipe_and_restart(self) -> None:
        """The disk is replaced: same node id, new storage id (unless the bug says otherwise)."""
        if self.alive:
            self.crash()
        self.disk.wipe()
        self.quarantined = None
        self.sh.marks.hit("wiped_node_restarted")
        if self.sh.host_bugs.wiped_rejoins_as_voter:
            # BUG (test-only): re-run the bootstrap with the old identity: votes it forgot.
            self.start_bootstrap(self.sh_initial_voters)
            return
        self.storage_gen += 1
        self.start_empty()

    sh_initial_voters: list[MemberId] = []

    def replace_storage(self) -> None:
        """The operator removed this node's member: delete its data, come back as a new storage."""
        if self.alive:
            self.crash()
        self.disk.wipe()
        self.quarantined = None
        self.storage_gen += 1
        self.start_empty()

    def pause(self, until_ms: int) -> None:
        self.paused_until_ms = max(self.paused_until_ms, until_ms)
        self.sh.loop.call_at(self.paused_until_ms, self._resume, self.epoch)

    def _resume(self, epoch: int) -> None:
        if epoch != self.epoch or self.sh.loop.now_ms < self.paused_until_ms:
            return
        held, self._held = self._held, []
        for src, payload in held:
            self._on_net(src, payload)
        self._kick()

    def paused(self) -> bool:
        return self.sh.loop.now_ms < self.paused_until_ms

    # -- ticking -----------------------------------------------------------------------------
    def _schedule_tick(self) -> None:
        self._tick_timer = self.sh.loop.call_later(self.params.tick_ms, self._on_tick, self.epoch)

    def _on_tick(self, epoch: int) -> None:
        if epoch != self.epoch or not self.alive:
            return
        self._schedule_tick()
        r = self.replica
        if r is None or self.paused():
            return
        r.raft.tick()
        self._after_input(r)

    # -- network input -------------------------------------------------------------------------
    def _on_net(self, src: int, payload: Any) -> None:
        if not self.alive:
            return
        if self.paused():
            if len(self._held) < 100_000:
                self._held.append((src, payload))
            return
        r = self.replica
        if isinstance(payload, Message):
            if r is None or payload.to != r.member:
                return  # for a member that no longer lives here (or quarantined)
            if payload.type == MessageType.APP and payload.term < r.raft.term:
                self.sh.marks.hit("stale_term_append_received")  # from a deposed leader
            try:
                r.raft.step(payload)
            except RaftError:
                pass
            self._after_input(r)
            return
        self._on_client(src, payload)

    # -- client requests -------------------------------------------------------------------------
    def _reply(self, client: int, req: int, result: tuple[Any, ...]) -> None:
        self.sh.net.send(self.node_id, client, ("reply", req, result), reliable=True)

    def _on_client(self, client: int, payload: Any) -> None:
        kind, req = payload[0], payload[1]
        r = self.replica
        # reads via read-index are served by any replica that knows a leader; writes by the leader
        can_serve = r is not None and (self._is_leader(r) or (kind == "read" and r.raft.lead is not None))
        if r is None or not can_serve:
            hint = self._leader_hint(r)
            self._reply(client, req, ("not_leader", hint))
            return
        if kind == "read":
            ctx = f"{client}:{req}".encode()
            if len(r.reads) >= self.params.max_pending_requests:
                self._reply(client, req, ("dropped",))
                return
            r.reads[ctx] = ReadWait(client, req, payload[2])
            try:
                r.raft.read_index(ctx)
            except RaftError:
                del r.reads[ctx]
                self._reply(client, req, ("dropped",))
                return
            self._after_input(r)
            return
        op, args = payload[2], payload[3:]
        if op == "enq" and self.sh.host_bugs.dedup_at_propose:
            if args[1] in r.proposed_ids:  # BUG (test-only): de-dup only at propose, per leader
                self._reply(client, req, ("dup",))
                return
            r.proposed_ids.add(args[1])
        now = self.sh.loop.now_ms + self.params.clock_skew_ms
        r.last_stamp_ms = max(r.last_stamp_ms, now)
        data = encode_command([op, client, req, r.last_stamp_ms, *args])
        if len(r.pending) >= self.params.max_pending_requests:
            self._reply(client, req, ("dropped",))
            return
        try:
            r.raft.propose(data)
        except ProposalDropped:
            self.sh.marks.hit("proposal_dropped")
            self._reply(client, req, ("dropped",))
            return
        r.pending[(client, req)] = client
        self._after_input(r)

    def _is_leader(self, r: Replica) -> bool:
        return bool(r.raft.role == StateRole.LEADER)

    def _leader_hint(self, r: Replica | None) -> int:
        if r is None:
            return 0
        lead = r.raft.lead
        return int(lead[0]) if lead else 0

    # -- the Ready cycle -----------------------------------------------------------------------
    def _after_input(self, r: Replica) -> None:
        self._observe_role(r)
        self._kick()

    def _kick(self) -> None:
        r = self.replica
        if r is None or r.process_scheduled or r.syncing or not r.raft.has_ready():
            return
        r.process_scheduled = True
        self.sh.loop.call_later(self.params.batch_ms, self._process, self.epoch)

    def _observe_role(self, r: Replica) -> None:
        raft = r.raft
        if raft.role == StateRole.LEADER:
            term = raft.term
            if r.was_leader_term != term:
                r.was_leader_term = term
                self.sh.marks.hit("leader_elected")
                self.sh.trace(f"n{self.node_id}/{r.member[1]} leader term {term}")
                self.sh.observer.on_leader(term, r.member, _term_at(r.storage), r.storage.first_index() - 1)
                if self.sh.on_leader_elected is not None:
                    self.sh.on_leader_elected(self)
        elif r.was_leader_term:
            if raft.term == r.was_leader_term:
                # no higher term seen: check-quorum (lost contact with a majority) or own removal
                self.sh.marks.hit("leader_stepped_down_check_quorum")
            r.was_leader_term = 0
            self.sh.marks.hit("leader_stepped_down")
            # requests proposed here may never commit: their clients time out and retry

    def _process(self, epoch: int) -> None:
        r = self.replica
        if epoch != self.epoch or r is None:
            return
        r.process_scheduled = False
        if r.syncing or self.paused() or not r.raft.has_ready():
            return
        rd: Ready = r.raft.ready()
        self._observe_role(r)
        net = self.sh.net
        me = self.node_id
        for m in rd.early_messages:
            self._send(me, m)
        if rd.snapshot is not None and not rd.snapshot.is_empty():
            self._note_snapshot_install(r, rd.snapshot)
            self.disk.write(snapshot_record(rd.snapshot))
            r.storage.apply_snapshot(rd.snapshot)
        if rd.entries or rd.hard_state is not None:
            self.disk.write(batch_record(rd.entries, rd.hard_state))
            if rd.entries:
                first = rd.entries[0].index
                term_at = _term_at(r.storage)
                prev = term_at(first - 1)
                if first <= r.storage.last_index():
                    self._note_overwrite(r, rd.entries, term_at)
                r.storage.append(rd.entries)
                self.sh.observer.on_persist(r.member, [(e.index, e.term, e.data) for e in rd.entries], prev)
            if rd.hard_state is not None:
                r.storage.set_hard_state(rd.hard_state)
                self._check_commit_rule(r, rd.hard_state)
        if self.sh.host_bugs.ack_before_sync:
            for m in rd.messages:  # BUG (test-only): messages leave before the data is durable
                self._send(me, m)
        if rd.must_sync:  # otherwise the writes stay pending (lost on a crash), as the contract allows
            r.syncing = True
            delay = self.disk.sync_latency_ms(self.sh.rng)
            self.sh.loop.call_later(delay, self._synced, self.epoch, rd)
        else:
            self._finish(r, rd)
        del net

    def _note_snapshot_install(self, r: Replica, snap: Snapshot) -> None:
        s = snap.meta.index
        if r.storage.last_index() > s and _term_at(r.storage)(s) != snap.meta.term:
            # the rare path where a snapshot must replace a longer log of another branch
            self.sh.marks.hit("snapshot_over_longer_divergent_log")

    def _note_overwrite(self, r: Replica, entries: list[Any], term_at: Callable[[int], int | None]) -> None:
        """Entries are about to replace stored ones from ``entries[0].index`` on: report the
        stored entries that differ (a suffix of older terms a new leader truncates)."""
        first = entries[0].index
        replaced: list[tuple[int, int]] = []
        for index in range(first, r.storage.last_index() + 1):
            old = term_at(index)
            k = index - first
            if old is not None and (k >= len(entries) or entries[k].term != old):
                replaced.append((index, old))
        if replaced:
            self.sh.marks.hit("stale_term_suffix_truncated")
            self.sh.observer.on_truncate(r.member, r.raft.term, replaced)

    def _check_commit_rule(self, r: Replica, hs: HardState) -> None:
        """Raft's commit rule (paper section 5.4.2, Figure 8): a leader advances its commit
        index only to an entry of its own term; older entries commit only beneath one. A rule
        check (it restates the core's rule): skipped when ``rule_checks`` is off."""
        if not self.sh.rule_checks:
            r.last_commit = max(r.last_commit, hs.commit)
            return
        if hs.commit > r.last_commit and r.raft.role == StateRole.LEADER and hs.term == r.raft.term:
            t = _term_at(r.storage)(hs.commit)
            if t is not None and t != hs.term:
                self.sh.observer._fail(
                    f"commit rule: leader {r.member} of term {hs.term} advanced commit to "
                    f"{hs.commit}, an entry of term {t}"
                )
        r.last_commit = max(r.last_commit, hs.commit)

    def _synced(self, epoch: int, rd: Ready) -> None:
        r = self.replica
        if epoch != self.epoch or r is None:
            return  # crashed during the sync: the pending writes met their fate in crash()
        if self.paused():  # a paused process finishes its fsync only when it runs again
            self.sh.loop.call_at(self.paused_until_ms, self._synced, epoch, rd)
            return
        self.disk.sync()
        r.syncing = False
        self._finish(r, rd)

    def _finish(self, r: Replica, rd: Ready) -> None:
        me = self.node_id
        if not self.sh.host_bugs.ack_before_sync:
            for m in rd.messages:
                self._send(me, m)
        if rd.snapshot is not None and not rd.snapshot.is_empty():
            r.sm.restore(rd.snapshot.data)
            r.applied = rd.snapshot.meta.index
            r.conf = rd.snapshot.meta.conf_state
            r.since_snapshot = 0
            self.sh.marks.hit("snapshot_installed")
            self.sh.observer.on_snapshot_state(r.member, r.applied, rd.snapshot.data)
        for e in rd.committed_entries:
            self._apply(r, e)
        for rs in rd.read_states:
            w = r.reads.pop(rs.ctx, None)
            if w is not None:
                w.index = rs.index
                r.ready_reads.append(w)
        self._serve_reads(r)
        r.raft.advance(rd)
        r.conf = r.raft.conf_state
        self._observe_role(r)
        self._maybe_snapshot(r)
        self._kick()

    def _send(self, me: int, m: Message) -> None:
        t = m.type
        if self.sh.observer.on_send(m):
            if t == MessageType.VOTE:
                self.sh.trace(f"{fmt_member(m.from_)} campaigns in term {m.term} (votes for itself)")
            else:
                self.sh.trace(f"vote: {fmt_member(m.from_)} votes for {fmt_member(m.to)} in term {m.term}")
        if (t == MessageType.PRE_VOTE or t == MessageType.VOTE) and m.from_ in self.sh.removed_members:
            self.sh.marks.hit("removed_member_campaigned")
        if t == MessageType.SNAP:
            self.sh.marks.hit("snapshot_sent")
            if self.params.report_snapshot:
                self.sh.net.send(me, m.to[0], m, on_done=self._snapshot_done(m.to))
                return
        self.sh.net.send(me, m.to[0], m)

    def _snapshot_done(self, to: MemberId) -> Callable[[bool], None]:
        epoch = self.epoch

        def done(ok: bool) -> None:
            r = self.replica
            if epoch == self.epoch and r is not None:
                r.raft.report_snapshot(to, ok)
                self._kick()

        return done

    def _apply(self, r: Replica, e: Any) -> None:
        invariant_next = e.index == r.applied + 1
        if not invariant_next:
            self.sh.observer._fail(f"host: {r.member} applied {e.index} after {r.applied} (gap)")
        self.sh.observer.on_apply(r.member, e.index, e.term, e.data)
        r.applied = e.index
        r.since_snapshot += 1
        if e.type == EntryType.CONF_CHANGE:
            cc = ConfChange.decode(e.data)  # the core applies it in advance()
            self.sh.marks.hit("conf_change_applied")
            if cc.type == ConfChangeType.PROMOTE:
                self.sh.marks.hit("learner_promoted")
            return
        if not e.data:
            return
        client, req, result = r.sm.apply(e.data)
        if result == ("dup",):
            self.sh.marks.hit("queue_dedup_at_apply")
        elif result[0] == "msg" and result[3] > 1:
            self.sh.marks.hit("queue_redelivery_after_expiry")
        if r.pending.pop((client, req), None) is not None:
            self._reply(client, req, result)

    def _serve_reads(self, r: Replica) -> None:
        if not r.ready_reads:
            return
        keep: list[ReadWait] = []
        for w in r.ready_reads:
            if w.index <= r.applied:
                self.sh.marks.hit("read_index_served")
                self._reply(w.client, w.req, ("value", r.sm.read(w.key)))
            else:
                keep.append(w)
        r.ready_reads = keep

    def _maybe_snapshot(self, r: Replica) -> None:
        every = self.params.snapshot_every
        if not every or r.since_snapshot < every or r.syncing or self.disk.pending:
            return
        data = r.sm.snapshot()
        st = r.storage
        if r.applied > st.last_index() or r.applied < st.first_index():
            return
        snap = st.create_snapshot(r.applied, r.conf, data)
        self.sh.observer.on_snapshot_state(r.member, r.applied, data)
        compact_to = r.applied - self.params.keep_entries
        if compact_to >= st.first_index():
            st.compact(compact_to)
            self.sh.marks.hit("log_compacted")
        # rewrite the image: the snapshot, then what the log still holds, then the hard state
        tail = (
            st.entries(st.first_index(), st.last_index() + 1, 1 << 62)
            if st.last_index() >= st.first_index()
            else []
        )
        self.disk.rewrite([snapshot_record(snap), batch_record(tail, st.hard_state())])
        r.since_snapshot = 0


def _rebuild(records: list[Record]) -> MemoryStorage:
    """Replay WAL records into a MemoryStorage. Entries that would leave a gap (after a skipped
    corrupt record) are dropped, and the commit index is clamped to what the log holds."""
    st = MemoryStorage()
    for r in records:
        if r.kind == RecordKind.SNAPSHOT:
            assert r.snapshot is not None
            if r.snapshot.meta.index >= st.snapshot_index():
                st.apply_snapshot(r.snapshot)
            continue
        if r.entries and r.entries[0].index <= st.last_index() + 1:
            st.append(r.entries)
        if r.hard_state is not None:
            st.set_hard_state(r.hard_state)
    hs = st.hard_state()
    if hs.commit > st.last_index() or hs.commit < st.first_index() - 1:
        st.set_hard_state(
            HardState(
                term=hs.term, vote=hs.vote, commit=min(max(hs.commit, st.first_index() - 1), st.last_index())
            )
        )
    return st


def _term_at(st: MemoryStorage) -> Callable[[int], int | None]:
    def term_at(index: int) -> int | None:
        try:
            return st.term(index)
        except RaftError:
            return None

    return term_at
