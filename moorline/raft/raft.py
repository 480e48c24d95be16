"""``RaftNode``: the sans-IO Raft state machine (etcd-raft ``RawNode`` shaped).

Inputs: ``step(msg)`` for peer messages, ``tick()`` for the logical clock, ``propose*`` /
``read_index`` / ``transfer_leader`` for local requests. Output: one ``Ready`` batch at a time.

Host obligations (the whole contract; the simulator and the node both follow it):

1. Call ``tick()`` at a fixed interval (the heartbeat interval; election timeouts are counted
   in ticks and randomized from the seeded ``Config.rng``).
2. When ``has_ready()``: ``rd = ready()``; then
   a. persist ``rd.snapshot`` (if any), ``rd.entries`` (replacing any existing suffix from the
      first entry's index) and ``rd.hard_state`` (if any); fsync when ``rd.must_sync``;
   b. send ``rd.early_messages`` at any time (they are leader appends/heartbeats/snapshots and
      never depend on this Ready's persistence) and ``rd.messages`` ONLY once (a) is durable.
      Votes and append acknowledgements are in ``rd.messages``: sending them early breaks
      "ack means durable" and "one vote per term";
   c. apply ``rd.committed_entries`` in order (they may include entries of this same Ready;
      apply them only after (a)); serve ``rd.read_states`` once applied >= their index;
   d. ``advance(rd)``. Only here does a leader count its own copy of ``rd.entries`` toward
      the commit quorum (it may replicate in parallel with its own fsync, but never counts
      itself before that fsync). Configuration changes take effect when appended to the log
      (``active_conf_state``); ``conf_state`` is the configuration as of the applied index,
      updated here: record it with any snapshot taken at that index. No host call applies
      configuration changes.
   ``step``/``tick``/``propose`` may be called between ``ready()`` and ``advance()``, but not
   ``ready()`` itself.
3. Drop nothing silently on the way in: ``step`` ignores messages not addressed to this
   member's ``(node id, storage id)`` — a wiped node has a new storage id and is a new member.
4. After a checksum failure in synced data of this group, call ``mark_corrupted()`` (again on
   every restart while the damage remains): the replica then refuses to vote or campaign until
   it has applied its own removal; it must be re-added (as a learner) to count again.
5. Report transport trouble with ``report_unreachable`` / ``report_snapshot`` (optional; they
   only speed up recovery).
6. Time out what the core may drop without an answer: a proposal is lost if the entry at its
   returned index commits with another term (leader change), and read-index requests vanish
   when leadership changes. Both are refused up front (ProposalDropped) when the core knows.
7. ``Storage`` (read-only for the core): ``initial_state()`` returns the durable hard state and
   the configuration of the storage's snapshot; the core replays later configuration entries
   from the log itself. ``Config.applied`` (default 0 = the snapshot index) says how far the
   host's state machine already is; committed entries after it are handed out again.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from moorline.hashing import crc32c
from moorline.invariant import invariant
from moorline.raft.confchange import ConfChangeInvalid, apply_conf_change
from moorline.raft.log import RaftLog
from moorline.raft.progress import Progress, ProgressState
from moorline.raft.quorum import VoteResult, committed_index, has_active_quorum, vote_result
from moorline.raft.storage import Storage
from moorline.raft.types import (
    CAMPAIGN_TRANSFER,
    CompactedError,
    ConfChange,
    ConfChangeType,
    Config,
    ConfState,
    Entry,
    EntryType,
    HardState,
    MemberId,
    Message,
    MessageType,
    ProposalDropped,
    ReadState,
    Ready,
    SnapshotTemporarilyUnavailable,
    StateRole,
    UnavailableError,
)

MT = MessageType
_DATA = attrgetter("data")
_TYPE = attrgetter("type")
_EARLY_TYPES = frozenset({MT.APP, MT.SNAP, MT.HEARTBEAT})


@dataclass(slots=True)
class Status:
    id: MemberId
    role: StateRole
    term: int
    vote: MemberId | None
    leader: MemberId | None
    commit: int
    applied: int
    last_index: int
    conf_state: ConfState  # in force (latest in the log)
    applied_conf_state: ConfState  # as of the applied index
    progress: dict[MemberId, str] = field(default_factory=dict)
    lead_transferee: MemberId | None = None
    corrupted: bool = False


class _ReadRequest:
    __slots__ = ("ctx", "index", "requester", "acks")

    def __init__(self, ctx: bytes, index: int, requester: MemberId) -> None:
        self.ctx = ctx
        self.index = index
        self.requester = requester
        self.acks: set[MemberId] = set()


class RaftNode:
    """One replica of one Raft group. See the module docstring for the host's obligations."""

    def __init__(self, config: Config, storage: Storage) -> None:
        config.validate()
        self.id: MemberId = config.id
        self.cfg = config
        self.bugs = config.bugs
        self._bug_self_ack = config.bugs.self_ack_before_sync
        self._max_uncommitted = config.max_uncommitted_bytes or (1 << 62)
        self.rng = config.rng if config.rng is not None else random.Random(crc32c(repr(config.id).encode()))
        self.log = RaftLog(storage)
        hs, cs = storage.initial_state()
        if config.bugs.forget_vote_on_restart:
            hs = HardState(term=hs.term, vote=None, commit=hs.commit)  # RaftBugs: the vote is not reloaded
        self.term = hs.term
        self.vote: MemberId | None = hs.vote
        if hs.commit:
            invariant(hs.commit <= self.log.last_index(), "hard state commit beyond the stored log")
            self.log.commit_to(hs.commit)
        if config.applied:
            invariant(config.applied >= self.log.applied, "config.applied below the snapshot")
            self.log.applied_to(config.applied)
        # Configuration in force = the latest one in the log, committed or not (append-time, as in
        # the Raft dissertation; see README.md). ``_conf_history`` holds (index, config after it)
        # for the base (snapshot) and every conf entry above it, to revert on log truncation.
        self._conf_history: list[tuple[int, ConfState]] = [(self.log.first_index() - 1, cs)]
        lo, hi = self.log.first_index(), self.log.last_index()
        if hi >= lo:
            for e in self.log.slice(lo, hi + 1, 1 << 62):
                if e.type == EntryType.CONF_CHANGE:
                    self._push_conf(e)
        self.conf: ConfState = self._conf_history[-1][1]
        self.applied_conf: ConfState = self._conf_at(self.log.applied)
        self.progress: dict[MemberId, Progress] = {}
        self.role = StateRole.FOLLOWER
        self.lead: MemberId | None = None
        self.msgs: list[Message] = []
        self.read_states: list[ReadState] = []
        self.votes: dict[MemberId, bool] = {}
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = config.election_tick
        self.lead_transferee: MemberId | None = None
        self.pending_conf_index = 0
        self.uncommitted_bytes = 0
        self.corrupted = False
        self._read_queue: deque[_ReadRequest] = deque()
        self._read_by_ctx: dict[bytes, _ReadRequest] = {}
        self._reads_waiting_commit: list[tuple[MemberId, bytes]] = []
        self._bcast_pending = False
        self._vote_hidden = False  # RaftBugs.vote_without_persist
        self._prev_hs = hs  # the last hard state handed out (durable once advanced)
        self._ready_out: Ready | None = None
        self._committed_term = self.log.term_or_zero(self.log.committed)
        self._tracking_removed = False
        self._step: Callable[[Message], None] = self._step_follower
        self._tick: Callable[[], None] = self._tick_election
        self._rebuild_progress()
        self._become_follower(self.term, None)

    # ==========================================================================================
    # Public API
    # ==========================================================================================
    @property
    def conf_state(self) -> ConfState:
        """The configuration as of the applied index (what a snapshot at that index records)."""
        return self.applied_conf

    @property
    def active_conf_state(self) -> ConfState:
        """The configuration in force: the latest one in the log, committed or not."""
        return self.conf

    @property
    def is_leader(self) -> bool:
        return self.role == StateRole.LEADER

    def tick(self) -> None:
        self._tick()

    def campaign(self) -> None:
        """Start an election now (as if the election timeout had fired)."""
        self._hup(transfer=False)

    def propose(self, data: bytes) -> int:
        """Append a normal entry; returns its index. Raises ProposalDropped when refused."""
        size = len(data)
        used = self.uncommitted_bytes
        if (
            self.role != StateRole.LEADER
            or self.lead_transferee is not None
            or (used and used + size > self._max_uncommitted)
            or self._bug_self_ack
        ):
            self._check_can_propose(size)
            return self._append_one(EntryType.NORMAL, data)
        # Hot path (one call per client command): no extra calls or lookups.
        log = self.log
        unstable = log.unstable
        if not unstable:
            return self._append_one(EntryType.NORMAL, data)
        index = log.unstable_offset + len(unstable)
        unstable.append(Entry(self.term, index, EntryType.NORMAL, data))
        self.uncommitted_bytes = used + size
        self._bcast_pending = True
        return index

    def propose_conf_change(self, change: ConfChange) -> int:
        """Append a configuration change; returns its index. Raises ProposalDropped when refused.

        Refused unless every earlier change (and the leader's own first entry of its term) has
        been applied, and unless the change is valid against the current configuration."""
        data = change.encode()
        self._check_can_propose(len(data))
        if self.pending_conf_index > self.log.applied and not self.bugs.conf_change_while_pending:
            raise ProposalDropped(
                f"conf change pending: index {self.pending_conf_index} not applied ({self.log.applied})"
            )
        if change.member == self.id and change.type == ConfChangeType.REMOVE:
            raise ProposalDropped("a leader cannot remove itself: transfer leadership first")
        try:
            apply_conf_change(self.conf, change)
        except ConfChangeInvalid as exc:
            raise ProposalDropped(str(exc)) from exc
        index = self._append_one(EntryType.CONF_CHANGE, data)
        self.pending_conf_index = index
        return index

    def read_index(self, ctx: bytes) -> None:
        """Request a linearizable read point; a ``ReadState(index, ctx)`` arrives in a Ready.

        ``ctx`` must be unique among outstanding requests (the host uses a counter)."""
        if self.role == StateRole.LEADER:
            self._leader_read_index(self.id, ctx)
        elif self.lead is not None and self.lead != self.id:
            self._send(MT.READ_INDEX, self.lead, context=ctx)
        else:
            raise ProposalDropped("no leader known for read index")

    def transfer_leader(self, to: MemberId) -> None:
        """Hand leadership to voter ``to``: catch it up, then tell it to campaign (TIMEOUT_NOW)."""
        if self.role != StateRole.LEADER:
            raise ProposalDropped("not leader")
        if to == self.id or to not in self.conf.voters:
            raise ProposalDropped(f"cannot transfer leadership to {to}")
        if self.lead_transferee == to:
            return
        self.lead_transferee = to
        # Transfer must finish within one election timeout, else it is aborted in tick.
        self.election_elapsed = 0
        pr = self.progress[to]
        if pr.match == self.log.last_index():
            self._send(MT.TIMEOUT_NOW, to)
        else:
            self._send_append(to, force=True)  # a probe even if nothing new: find its match now

    def is_active(self, member: MemberId) -> bool:
        """Leader: whether ``member`` answered within about one election timeout (this check-quorum
        period or the whole previous one); a liveness hint for leadership transfers."""
        pr = self.progress.get(member)
        return pr is not None and (pr.recent_active or pr.active_last_period)

    def mark_corrupted(self) -> None:
        """Synced data of this group failed its checksum: never vote or campaign again here."""
        self.corrupted = True
        if self.role != StateRole.FOLLOWER:
            self._become_follower(self.term, None)

    def report_unreachable(self, to: MemberId) -> None:
        pr = self.progress.get(to)
        if self.role == StateRole.LEADER and pr is not None and pr.state == ProgressState.REPLICATE:
            pr.become_probe()

    def report_snapshot(self, to: MemberId, ok: bool) -> None:
        pr = self.progress.get(to)
        if self.role != StateRole.LEADER or pr is None or pr.state != ProgressState.SNAPSHOT:
            return
        if not ok:
            pr.pending_snapshot = 0
        pr.become_probe()
        pr.probe_sent = True  # wait for the next heartbeat response before probing

    def step(self, m: Message) -> None:
        """Handle one message from a peer."""
        if m.to != self.id:
            return  # meant for another incarnation of this node (different storage id)
        if m.term > self.term:
            if m.type == MT.VOTE or m.type == MT.PRE_VOTE:
                force = m.context == CAMPAIGN_TRANSFER
                in_lease = (
                    self.cfg.check_quorum
                    and self.lead is not None
                    and self.election_elapsed < self.cfg.election_tick
                )
                if not force and in_lease:
                    # Leader stickiness: we heard from a live leader within the election
                    # timeout, so a disruptive (partitioned, rejoining) candidate is ignored.
                    return
            if m.type == MT.PRE_VOTE or (m.type == MT.PRE_VOTE_RESP and not m.reject):
                pass  # pre-votes never change our term; a granted pre-vote is for term+1
            elif m.type in (MT.APP, MT.HEARTBEAT, MT.SNAP):
                self._become_follower(m.term, m.from_)
            else:
                self._become_follower(m.term, None)
        elif m.term < self.term:
            if self.bugs.accept_stale_term_append and m.type == MT.APP and self.role == StateRole.FOLLOWER:
                self._step_follower(m)  # RaftBugs: a stale leader's append is taken as current
                return
            if (self.cfg.check_quorum or self.cfg.pre_vote) and m.type in (MT.APP, MT.HEARTBEAT):
                # A stale leader (e.g. after a partition healed) learns our term and steps down;
                # without this it could stay leader forever while we ignore it.
                self._send(MT.APP_RESP, m.from_)
            elif m.type == MT.PRE_VOTE:
                self._send(MT.PRE_VOTE_RESP, m.from_, reject=True)
            return

        if m.type == MT.VOTE or m.type == MT.PRE_VOTE:
            self._handle_vote_request(m)
            return
        self._step(m)

    def has_ready(self) -> bool:
        if self._bcast_pending:
            self._flush_bcast()  # batches every proposal since the last Ready into few appends
        if self.msgs or self.read_states or self.log.unstable or self.log.unstable_snapshot is not None:
            return True
        if self.log.has_next_committed():
            return True
        return self._hard_state() != self._prev_hs

    def ready(self) -> Ready:
        """The next batch of work; see the module docstring for what the host must do with it."""
        invariant(self._ready_out is None, "ready() called again before advance()")
        if self._bcast_pending:
            self._flush_bcast()
        log = self.log
        rd = Ready()
        hs = self._hard_state()
        prev = self._prev_hs
        self._check_hard_state(prev, hs)
        term_or_vote_changed = hs.term != prev.term or hs.vote != prev.vote
        if hs != prev:
            rd.hard_state = hs
        if log.unstable:
            rd.entries = list(log.unstable)
            invariant(
                rd.entries[-1].index - rd.entries[0].index == len(rd.entries) - 1,
                "Ready entries not contiguous",
            )
        rd.snapshot = log.unstable_snapshot
        committed = log.next_committed(self.cfg.max_committed_bytes_per_ready)
        if committed:
            invariant(committed[0].index == log.applied + 1, "committed entries must follow applied")
            if self.role == StateRole.LEADER and self.uncommitted_bytes:
                freed = sum(map(len, map(_DATA, committed)))
                self.uncommitted_bytes = max(0, self.uncommitted_bytes - freed)
        rd.committed_entries = committed
        msgs = self.msgs
        self.msgs = []
        if self.role == StateRole.LEADER and not term_or_vote_changed:
            rd.early_messages = [m for m in msgs if m.type in _EARLY_TYPES]
            if rd.early_messages:
                msgs = [m for m in msgs if m.type not in _EARLY_TYPES]
        rd.messages = msgs
        if self.read_states:
            rd.read_states = self.read_states
            self.read_states = []
        rd.must_sync = (
            bool(rd.entries)
            or rd.snapshot is not None
            or (term_or_vote_changed and not self.bugs.hard_state_sync_skipped)
        )
        if self._bug_self_ack and self.role == StateRole.LEADER and not term_or_vote_changed:
            # RaftBugs.self_ack_before_sync: the leader's own entries are counted without being
            # durable (it already counted them at propose); a host that honours must_sync skips
            # the fsync, so a crash loses entries the quorum counted.
            rd.must_sync = rd.snapshot is not None
        self._prev_hs = hs
        self._ready_out = rd
        return rd

    def advance(self, rd: Ready) -> None:
        """The host persisted, sent and applied everything in ``rd``."""
        invariant(self._ready_out is rd, "advance() with a Ready that was not the last one handed out")
        self._ready_out = None
        log = self.log
        if rd.snapshot is not None:
            log.stable_snap_to(rd.snapshot.meta.index)
            log.applied_to(rd.snapshot.meta.index)
            self.applied_conf = rd.snapshot.meta.conf_state
        if rd.entries:
            last = rd.entries[-1]
            log.stable_to(last.index, last.term)
            if self.role == StateRole.LEADER and not self.bugs.self_ack_before_sync:
                # Our own copy is durable now: only from here on does it count toward commit.
                me = self.progress.get(self.id)
                if me is not None and me.maybe_update(log.persisted_last_index()):
                    self._maybe_commit()
        if rd.committed_entries:
            log.applied_to(rd.committed_entries[-1].index)
            for e in rd.committed_entries:
                if e.type == EntryType.CONF_CHANGE:
                    self._apply_conf_change(ConfChange.decode(e.data))
            self._prune_conf_history()
            if self._tracking_removed:
                self._rebuild_progress()  # the removal is applied (and its commit was sent)

    def status(self) -> Status:
        st = Status(
            id=self.id,
            role=self.role,
            term=self.term,
            vote=self.vote,
            leader=self.lead,
            commit=self.log.committed,
            applied=self.log.applied,
            last_index=self.log.last_index(),
            conf_state=self.conf,
            applied_conf_state=self.applied_conf,
            lead_transferee=self.lead_transferee,
            corrupted=self.corrupted,
        )
        if self.role == StateRole.LEADER:
            me = self.progress.get(self.id)
            if me is not None:
                me.next = self.log.last_index() + 1  # our own next is not maintained per append
            st.progress = {mid: pr.describe() for mid, pr in sorted(self.progress.items())}
        return st

    # ==========================================================================================
    # Role transitions
    # ==========================================================================================
    def _become_follower(self, term: int, lead: MemberId | None) -> None:
        self._reset(term)
        self.role = StateRole.FOLLOWER
        self.lead = lead
        self._step = self._step_follower
        self._tick = self._tick_election

    def _become_pre_candidate(self) -> None:
        invariant(self.role != StateRole.LEADER, "leader cannot become pre-candidate")
        # Pre-candidacy changes neither term nor vote: a partitioned node that keeps failing
        # pre-votes never inflates its term and never disrupts a healthy leader on return.
        self.role = StateRole.PRE_CANDIDATE
        self.votes = {}
        self.lead = None
        self._step = self._step_candidate
        self._tick = self._tick_election

    def _become_candidate(self) -> None:
        invariant(self.role != StateRole.LEADER, "leader cannot become candidate")
        self._reset(self.term + 1)
        self.vote = self.id
        self.role = StateRole.CANDIDATE
        self._step = self._step_candidate
        self._tick = self._tick_election

    def _become_leader(self) -> None:
        invariant(self.role == StateRole.CANDIDATE, "only a candidate can become leader")
        self._reset(self.term)
        self.role = StateRole.LEADER
        self.lead = self.id
        self._step = self._step_leader
        self._tick = self._tick_heartbeat
        me = self.progress.get(self.id)
        invariant(me is not None, "leader must be a member")
        assert me is not None
        me.become_replicate()
        me.match = self.log.persisted_last_index()
        me.next = self.log.last_index() + 1
        me.recent_active = True
        # Our no-op commits every earlier entry (a leader never commits an older term's entry
        # by counting replicas) and no conf change may start before it is applied.
        index = self._append_one(EntryType.NORMAL, b"")
        self.pending_conf_index = index
        self.uncommitted_bytes = 0

    def _reset(self, term: int) -> None:
        if term != self.term:
            if not (term > self.term):
                invariant(False, f"term went back: {self.term} -> {term}")
            self.term = term
            self.vote = None
            self._vote_hidden = False
        self.lead = None
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = self.cfg.election_tick + self.rng.randrange(self.cfg.election_tick)
        self.lead_transferee = None
        self.votes = {}
        self._bcast_pending = False
        last = self.log.last_index()
        for mid, pr in self.progress.items():
            learner = pr.is_learner
            fresh = Progress(last + 1, self.cfg.max_inflight_appends, learner)
            if mid == self.id:
                fresh.match = min(self.log.persisted_last_index(), last)
            self.progress[mid] = fresh
        self.pending_conf_index = 0
        self.uncommitted_bytes = 0
        self._read_queue.clear()
        self._read_by_ctx.clear()
        self._reads_waiting_commit.clear()

    # ==========================================================================================
    # Ticks and elections
    # ==========================================================================================
    def _promotable(self) -> bool:
        return self.id in self.conf.voters and not self.corrupted and self.log.unstable_snapshot is None

    def _tick_election(self) -> None:
        self.election_elapsed += 1
        if self.election_elapsed >= self.randomized_election_timeout and self._promotable():
            self.election_elapsed = 0
            self._hup(transfer=False)

    def _tick_heartbeat(self) -> None:
        self.heartbeat_elapsed += 1
        self.election_elapsed += 1
        if self.election_elapsed >= self.cfg.election_tick:
            self.election_elapsed = 0
            if self.cfg.check_quorum and not self._check_quorum_active():
                self._become_follower(self.term, None)  # lost contact with a majority
                return
            self.lead_transferee = None  # a transfer that took an election timeout is aborted
        if self.role != StateRole.LEADER:
            return
        self._expire_snapshots()
        if self.heartbeat_elapsed >= self.cfg.heartbeat_tick:
            self.heartbeat_elapsed = 0
            self._bcast_heartbeat(b"")

    def _expire_snapshots(self) -> None:
        """A snapshot neither acknowledged nor reported within two election timeouts is taken as
        lost (the host may never call report_snapshot): probe again, which resends it."""
        limit = 2 * self.cfg.election_tick
        for pr in self.progress.values():
            if pr.state == ProgressState.SNAPSHOT:
                pr.snapshot_ticks += 1
                if pr.snapshot_ticks > limit:
                    pr.pending_snapshot = 0
                    pr.become_probe()

    def _check_quorum_active(self) -> bool:
        active: dict[MemberId, bool] = {}
        for mid, pr in self.progress.items():
            active[mid] = mid == self.id or pr.recent_active
            if mid != self.id:
                pr.active_last_period = pr.recent_active
                pr.recent_active = False
        return has_active_quorum(self.conf.voters, active)

    def _hup(self, transfer: bool) -> None:
        if self.role == StateRole.LEADER or not self._promotable():
            return
        if self.cfg.pre_vote and not transfer:
            self._campaign(pre=True, transfer=False)
        else:
            self._campaign(pre=False, transfer=transfer)

    def _campaign(self, pre: bool, transfer: bool) -> None:
        if pre:
            self._become_pre_candidate()
            vote_type, term = MT.PRE_VOTE, self.term + 1
        else:
            self._become_candidate()
            vote_type, term = MT.VOTE, self.term
        self.votes[self.id] = True
        if self._poll() == VoteResult.WON:
            return  # single voter: already moved on
        last = self.log.last_index()
        last_term = self.log.last_term()
        ctx = CAMPAIGN_TRANSFER if transfer else b""
        for v in self.conf.voters:
            if v != self.id:
                self.msgs.append(
                    Message(
                        type=vote_type,
                        from_=self.id,
                        to=v,
                        term=term,
                        index=last,
                        log_term=last_term,
                        context=ctx,
                    )
                )

    def _poll(self) -> VoteResult:
        res = vote_result(self.conf.voters, self.votes)
        if res == VoteResult.WON:
            if self.role == StateRole.PRE_CANDIDATE:
                self._campaign(pre=False, transfer=False)
            else:
                self._become_leader()
                self._bcast_pending = True
        elif res == VoteResult.LOST:
            self._become_follower(self.term, None)
        return res

    def _handle_vote_request(self, m: Message) -> None:
        pre = m.type == MT.PRE_VOTE
        can_vote = (
            self.vote == m.from_ or (self.vote is None and self.lead is None) or (pre and m.term > self.term)
        ) and not self.corrupted
        resp_type = MT.PRE_VOTE_RESP if pre else MT.VOTE_RESP
        if can_vote and self.log.is_up_to_date(m.index, m.log_term):
            # A granted pre-vote answers with the candidate's future term so it can count it.
            self.msgs.append(Message(type=resp_type, from_=self.id, to=m.from_, term=m.term))
            if not pre:
                self.election_elapsed = 0
                self.vote = m.from_
                if self.bugs.vote_without_persist:
                    self._vote_hidden = True
        else:
            self._send(resp_type, m.from_, reject=True)

    # ==========================================================================================
    # Per-role message handling
    # ==========================================================================================
    def _step_follower(self, m: Message) -> None:
        t = m.type
        if t == MT.APP:
            if not self.bugs.no_election_reset_on_append:
                self.election_elapsed = 0
            self.lead = m.from_
            self._handle_append(m)
        elif t == MT.HEARTBEAT:
            self.election_elapsed = 0
            self.lead = m.from_
            self._handle_heartbeat(m)
        elif t == MT.SNAP:
            self.election_elapsed = 0
            self.lead = m.from_
            self._handle_snapshot(m)
        elif t == MT.TIMEOUT_NOW:
            self._hup(transfer=True)
        elif t == MT.READ_INDEX_RESP:
            self.read_states.append(ReadState(index=m.index, ctx=m.context))

    def _step_candidate(self, m: Message) -> None:
        t = m.type
        if t in (MT.APP, MT.HEARTBEAT, MT.SNAP):
            # Someone won this term: follow it.
            self._become_follower(m.term, m.from_)
            self._step_follower(m)
            return
        my_resp = MT.PRE_VOTE_RESP if self.role == StateRole.PRE_CANDIDATE else MT.VOTE_RESP
        if t == my_resp:
            self.votes.setdefault(m.from_, not m.reject)
            self._poll()

    def _step_leader(self, m: Message) -> None:
        t = m.type
        if t == MT.READ_INDEX:
            self._leader_read_index(m.from_, m.context)
            return
        pr = self.progress.get(m.from_)
        if pr is None:
            return
        if t == MT.APP_RESP:
            pr.recent_active = True
            self._handle_append_resp(m, pr)
        elif t == MT.HEARTBEAT_RESP:
            pr.recent_active = True
            pr.probe_sent = False
            if pr.match < self.log.last_index() or pr.pending_commit < self.log.committed:
                self._send_append(m.from_, force=True)
            if m.context:
                self._read_ack(m.from_, m.context)

    # ==========================================================================================
    # Replication: follower side
    # ==========================================================================================
    def _handle_append(self, m: Message) -> None:
        log = self.log
        if m.index < log.committed:
            self._send(MT.APP_RESP, m.from_, index=log.committed)
            return
        if log.match_term(m.index, m.log_term):
            ents = m.entries
            last_new = m.index + len(ents)
            if ents:
                ci = log.find_conflict(ents)
                if ci:
                    if not (ci > log.committed):
                        invariant(False, f"conflict at {ci} would rewrite committed {log.committed}")
                    new = ents[ci - ents[0].index :]
                    log.append(new)
                    if self._conf_history[-1][0] >= ci or EntryType.CONF_CHANGE in map(_TYPE, new):
                        self._on_log_appended(new)
            if log.commit_to(min(m.commit, last_new)):
                self._note_commit()
            self._send(MT.APP_RESP, m.from_, index=last_new)
            return
        # Reject with a hint so the leader skips a whole term's worth of entries at once.
        hint = log.find_conflict_by_term(min(m.index, log.last_index()), m.log_term)
        self._send(
            MT.APP_RESP,
            m.from_,
            index=m.index,
            reject=True,
            reject_hint=hint,
            log_term=log.term_or_zero(hint),
        )

    def _handle_heartbeat(self, m: Message) -> None:
        if self.log.commit_to(min(m.commit, self.log.last_index())):
            self._note_commit()
        self._send(MT.HEARTBEAT_RESP, m.from_, context=m.context)

    def _handle_snapshot(self, m: Message) -> None:
        snap = m.snapshot
        if snap is None:
            return
        meta = snap.meta
        log = self.log
        if meta.index <= log.committed:
            self._send(MT.APP_RESP, m.from_, index=log.committed)
            return
        # The snapshot's configuration may predate our own addition (a new learner is caught up
        # from an old snapshot, then learns of itself from the entries after it): install anyway.
        if log.match_term(meta.index, meta.term):
            # We already hold the snapshot's last entry: only fast-forward the commit index. The
            # acknowledgement claims the commit index, not our last index: entries past the
            # snapshot may be another leader's branch, and claiming them would let this leader
            # count us for entries we do not hold (the leader learns the rest by probing).
            log.commit_to(meta.index)
            self._note_commit()
            self._send(MT.APP_RESP, m.from_, index=log.committed)
            return
        # Our entry at the snapshot's index differs (or is missing): everything after it is on
        # another branch and goes with the rest of the log.
        kept: list[Entry] = []
        if self.bugs.snapshot_keeps_log_tail and log.last_index() > meta.index:
            kept = log.slice(meta.index + 1, log.last_index() + 1, 1 << 62)  # RaftBugs
        log.restore(snap)
        self._note_commit()
        self._conf_history = [(meta.index, meta.conf_state)]
        self._set_conf(meta.conf_state)
        if kept:
            log.append(kept)
            self._on_log_appended(kept)
        self._send(MT.APP_RESP, m.from_, index=log.last_index())

    # ==========================================================================================
    # Replication: leader side
    # ==========================================================================================
    def _check_can_propose(self, size: int) -> None:
        if self.role != StateRole.LEADER:
            raise ProposalDropped("not leader")
        if self.lead_transferee is not None:
            raise ProposalDropped("leadership transfer in progress")
        limit = self.cfg.max_uncommitted_bytes
        if limit and self.uncommitted_bytes > 0 and self.uncommitted_bytes + size > limit:
            raise ProposalDropped("too many uncommitted bytes")

    def _append_one(self, kind: EntryType, data: bytes) -> int:
        log = self.log
        index = log.last_index() + 1
        e = Entry(self.term, index, kind, data)
        if log.unstable and log.unstable_offset + len(log.unstable) == index:
            log.unstable.append(e)
        else:
            log.append([e])
        self.uncommitted_bytes += len(data)
        self._bcast_pending = True
        if kind == EntryType.CONF_CHANGE:
            self._on_log_appended([e])
        me = self.progress.get(self.id)
        if self._bug_self_ack and me is not None:
            me.maybe_update(index)
            self._maybe_commit()
        return index

    def _flush_bcast(self) -> None:
        self._bcast_pending = False
        if self.role != StateRole.LEADER:
            return
        for mid in self.progress:
            if mid != self.id:
                self._send_append(mid)

    def _send_append(self, to: MemberId, force: bool = False, bump_commit: bool = True) -> None:
        """Send as many appends to ``to`` as flow control allows (at least one probe if forced).

        With ``bump_commit`` false an append goes out only if it carries entries: commit-only
        updates are left to the next Ready's broadcast, which coalesces them."""
        pr = self.progress[to]
        log = self.log
        cfg = self.cfg
        while True:
            last = log.last_index()
            if pr.state == ProgressState.SNAPSHOT:
                return
            has_entries = pr.next <= last
            can_bump = bump_commit and pr.pending_commit < min(log.committed, pr.next - 1)
            if pr.is_paused():
                if not force:
                    return
            elif not has_entries and not can_bump and not force:
                return
            send_entries = has_entries and not pr.is_paused()
            prev = pr.next - 1
            try:
                prev_term = log.term(prev)
                ents: list[Entry] = []
                if send_entries:
                    hi = min(last + 1, pr.next + cfg.max_entries_per_append)
                    ents = log.slice(pr.next, hi, cfg.max_bytes_per_append)
            except (CompactedError, UnavailableError):
                self._send_snapshot(to, pr)
                return
            commit = log.committed
            self.msgs.append(
                Message(
                    type=MT.APP,
                    from_=self.id,
                    to=to,
                    term=self.term,
                    index=prev,
                    log_term=prev_term,
                    entries=ents,
                    commit=commit,
                )
            )
            if ents:
                pr.sent_entries(ents[-1].index)
            elif pr.state == ProgressState.PROBE:
                pr.probe_sent = True
            pr.pending_commit = min(max(pr.pending_commit, commit), pr.next - 1)
            force = False
            if pr.state != ProgressState.REPLICATE or not ents:
                return

    def _send_snapshot(self, to: MemberId, pr: Progress) -> None:
        if not pr.recent_active:
            return  # do not ship a snapshot to a member we have not heard from
        try:
            snap = self.log.storage.snapshot()
        except SnapshotTemporarilyUnavailable:
            return
        invariant(not snap.is_empty(), "need a snapshot but storage has none")
        self.msgs.append(Message(type=MT.SNAP, from_=self.id, to=to, term=self.term, snapshot=snap))
        pr.become_snapshot(snap.meta.index)

    def _handle_append_resp(self, m: Message, pr: Progress) -> None:
        if m.reject:
            hint = m.reject_hint
            if m.log_term > 0:
                hint = self.log.find_conflict_by_term(hint, m.log_term)
            if pr.maybe_decr_to(m.index, hint):
                if pr.state == ProgressState.REPLICATE:
                    pr.become_probe()
                self._send_append(m.from_)
            return
        updated = pr.maybe_update(m.index)
        if not updated and not (pr.state == ProgressState.PROBE and m.index == pr.match):
            return  # stale acknowledgement
        if pr.state == ProgressState.PROBE:
            pr.become_replicate()
        elif pr.state == ProgressState.SNAPSHOT:
            # The snapshot (or something newer) arrived. If we compacted again meanwhile, the
            # probe below finds the gap and sends the current snapshot.
            reconnected = pr.match + 1 >= self.log.first_index()
            if reconnected or pr.match >= pr.pending_snapshot:
                pr.become_probe()
                if reconnected:
                    pr.become_replicate()
        else:
            pr.free_le(m.index)
        if self._maybe_commit():
            self._bcast_pending = True
        self._send_append(m.from_, bump_commit=False)
        if m.from_ == self.lead_transferee and pr.match == self.log.last_index():
            self._send(MT.TIMEOUT_NOW, m.from_)

    def _maybe_commit(self) -> bool:
        log = self.log
        match = {mid: pr.match for mid, pr in self.progress.items()}
        mci = committed_index(self.conf.voters, match)
        if mci <= log.committed:
            return False
        if log.term_or_zero(mci) != self.term and not self.bugs.commit_prev_term_by_count:
            # Figure 8 of the Raft paper: an older term's entry on a majority can still be
            # overwritten; it commits only under an entry of our own term.
            return False
        log.commit_to(mci)
        self._note_commit()
        self._release_reads_waiting_commit()
        self._bcast_pending = True  # followers learn the new commit index in the next Ready
        return True

    def _note_commit(self) -> None:
        """Pair check: what was committed never changes term (unless compacted away)."""
        log = self.log
        self._committed_term = log.term_or_zero(log.committed)

    def _bcast_heartbeat(self, ctx: bytes) -> None:
        committed = self.log.committed
        unclamped = self.bugs.heartbeat_commit_unclamped
        for mid, pr in self.progress.items():
            if mid == self.id:
                continue
            self.msgs.append(
                Message(
                    type=MT.HEARTBEAT,
                    from_=self.id,
                    to=mid,
                    term=self.term,
                    # never beyond what the follower matches: past it, its log may still differ
                    commit=committed if unclamped else min(pr.match, committed),
                    context=ctx,
                )
            )

    # ==========================================================================================
    # Read index (no leases): confirm leadership with a heartbeat round, then read at commit
    # ==========================================================================================
    def _leader_read_index(self, requester: MemberId, ctx: bytes) -> None:
        if len(self._read_queue) + len(self._reads_waiting_commit) >= self.cfg.max_read_index_pending:
            raise ProposalDropped("too many pending read-index requests")
        if self.log.term_or_zero(self.log.committed) != self.term:
            # Until our no-op commits we do not know the true commit index.
            self._reads_waiting_commit.append((requester, ctx))
            return
        self._start_read(requester, ctx)

    def _start_read(self, requester: MemberId, ctx: bytes) -> None:
        index = self.log.committed
        if len(self.conf.voters) == 1 and self.conf.voters[0] == self.id:
            self._answer_read(requester, index, ctx)
            return
        if ctx in self._read_by_ctx:
            return
        req = _ReadRequest(ctx, index, requester)
        req.acks.add(self.id)
        self._read_queue.append(req)
        self._read_by_ctx[ctx] = req
        self._bcast_heartbeat(ctx)

    def _read_ack(self, frm: MemberId, ctx: bytes) -> None:
        req = self._read_by_ctx.get(ctx)
        if req is None:
            return
        req.acks.add(frm)
        votes = {v: True for v in req.acks}
        if vote_result(self.conf.voters, votes) != VoteResult.WON:
            return
        # Requests are confirmed in order: this one and every earlier one are now safe.
        while self._read_queue:
            r = self._read_queue.popleft()
            del self._read_by_ctx[r.ctx]
            self._answer_read(r.requester, r.index, r.ctx)
            if r is req:
                break

    def _answer_read(self, requester: MemberId, index: int, ctx: bytes) -> None:
        if requester == self.id:
            self.read_states.append(ReadState(index=index, ctx=ctx))
        else:
            self._send(MT.READ_INDEX_RESP, requester, index=index, context=ctx)

    def _release_reads_waiting_commit(self) -> None:
        if not self._reads_waiting_commit or self.log.term_or_zero(self.log.committed) != self.term:
            return
        waiting = self._reads_waiting_commit
        self._reads_waiting_commit = []
        for requester, ctx in waiting:
            self._start_read(requester, ctx)

    # ==========================================================================================
    # Configuration
    # ==========================================================================================
    def _apply_conf_change(self, cc: ConfChange) -> None:
        """A committed change was applied: track the applied configuration (for snapshots)."""
        try:
            self.applied_conf = apply_conf_change(self.applied_conf, cc)
        except ConfChangeInvalid:
            return  # the same deterministic no-op as in _push_conf
        ac = self.applied_conf
        if cc.member == self.id and self.id not in ac.voters and self.id not in ac.learners:
            # Our removal is committed: our old acknowledgements count for nothing any more, so a
            # re-add (as a learner, caught up from the leader) may vote again.
            self.corrupted = False

    def _push_conf(self, e: Entry) -> None:
        cc = ConfChange.decode(e.data)
        cur = self._conf_history[-1][1]
        try:
            new = apply_conf_change(cur, cc)
        except ConfChangeInvalid:
            new = cur  # invalid against the log's configuration: a no-op on every replica
        self._conf_history.append((e.index, new))

    def _conf_at(self, index: int) -> ConfState:
        conf = self._conf_history[0][1]
        for i, cs in self._conf_history:
            if i > index:
                break
            conf = cs
        return conf

    def _on_log_appended(self, entries: list[Entry]) -> None:
        """Entries were appended from ``entries[0].index`` on (anything after was truncated)."""
        hist = self._conf_history
        first = entries[0].index
        invariant(hist[0][0] < first, "append below the configuration base")
        changed = False
        while hist[-1][0] >= first:
            hist.pop()  # a conf entry was truncated away: revert to the configuration before it
            changed = True
        for e in entries:
            if e.type == EntryType.CONF_CHANGE:
                self._push_conf(e)
                changed = True
        if changed:
            self._set_conf(hist[-1][1])

    def _prune_conf_history(self) -> None:
        """Entries at or below the applied index can no longer be truncated: keep one as base."""
        hist = self._conf_history
        applied = self.log.applied
        k = 0
        while k + 1 < len(hist) and hist[k + 1][0] <= applied:
            k += 1
        if k:
            del hist[:k]

    def _set_conf(self, cs: ConfState) -> None:
        if cs == self.conf:
            return
        self.conf = cs
        self._rebuild_progress()
        if self.role != StateRole.LEADER:
            return
        if self.id not in cs.voters:
            # Cannot happen through propose_conf_change (a leader never removes itself), but a
            # leader outside its own configuration must not go on counting itself.
            self._become_follower(self.term, None)
            return
        if self.lead_transferee is not None and self.lead_transferee not in cs.voters:
            self.lead_transferee = None
        self._maybe_commit()  # the quorum may have shrunk
        self._bcast_pending = True

    def _tracked_members(self) -> set[MemberId]:
        """Members the leader replicates to: the configuration in force, plus members that the
        latest (not yet applied) change removes, so they still learn of their removal."""
        members = set(self.conf.voters) | set(self.conf.learners)
        hist = self._conf_history
        self._tracking_removed = False
        if len(hist) >= 2 and hist[-1][0] > self.log.applied:
            prev = hist[-2][1]
            extra = (set(prev.voters) | set(prev.learners)) - members
            if extra:
                members |= extra
                self._tracking_removed = True
        return members

    def _rebuild_progress(self) -> None:
        last = self.log.last_index()
        voters = set(self.conf.voters)
        fresh: dict[MemberId, Progress] = {}
        for mid in sorted(self._tracked_members()):
            pr = self.progress.get(mid)
            if pr is None:
                pr = Progress(last + 1, self.cfg.max_inflight_appends, mid not in voters)
                # New members count as active so check-quorum does not fire before they speak.
                pr.recent_active = True
                if mid == self.id:
                    pr.match = self.log.persisted_last_index()
            pr.is_learner = mid not in voters
            fresh[mid] = pr
        self.progress = fresh

    # ==========================================================================================
    # Helpers and invariants
    # ==========================================================================================
    def _send(self, t: MessageType, to: MemberId, **kw: object) -> None:
        self.msgs.append(Message(type=t, from_=self.id, to=to, term=self.term, **kw))  # type: ignore[arg-type]

    def _hard_state(self) -> HardState:
        vote = self.vote
        if self._vote_hidden:
            vote = self._prev_hs.vote if self._prev_hs.term == self.term else None
        p = self._prev_hs
        if p.term == self.term and p.vote == vote and p.commit == self.log.committed:
            return p
        return HardState(term=self.term, vote=vote, commit=self.log.committed)

    def _check_hard_state(self, prev: HardState, hs: HardState) -> None:
        if hs is prev:
            return  # nothing changed since the last Ready
        if not (hs.term >= prev.term):
            invariant(False, f"term decreased {prev.term} -> {hs.term}")
        if not (hs.commit >= prev.commit):
            invariant(False, f"commit decreased {prev.commit} -> {hs.commit}")
        invariant(hs.commit <= self.log.last_index(), "commit beyond last index")
        if hs.term == prev.term and prev.vote is not None:
            if not (hs.vote == prev.vote):
                invariant(False, f"second vote in term {hs.term}: {prev.vote} then {hs.vote}")
        invariant(
            self._committed_term == 0
            or self.log.term_or_zero(self.log.committed) in (0, self._committed_term),
            "a committed entry changed term",
        )
        if self.role == StateRole.LEADER:
            invariant(self.lead == self.id, "leader must know itself as leader")
            me = self.progress[self.id]
            invariant(me.match <= self.log.last_index(), "leader self-match beyond its log")
