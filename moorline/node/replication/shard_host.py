"""Hosts one shard on this node: its state machine, its Raft replica and message store, and the
Ready/apply cycle that joins them. Its parts: the proposer (``proposer.py``: batching,
forwarding, resend, held proposals, who waits for what), the read barriers (``read_barrier.py``)
and the snapshots (``snapshots.py``: taken off the loop, recorded, a leader's installed).

Proposals are batched: every command proposed during one pass of the event loop goes into one
log entry (``seal`` proposes it to the Raft core). The node's ``GroupCommit`` writes each host's
``Ready`` (entries, hard state) to the node-wide WAL, syncs every group with one fdatasync, then
calls ``after_sync`` here, which records what is durable, applies what the core says is
committed and resolves the proposers' futures. A single node is a one-voter group on this same
path: its own sync is the quorum.

A replica that fell too far behind its leader's log installs the leader's snapshot
(``snapshot_install.py`` for the files, ``snapshot_transfer.py`` for the transfer): the staged
state and store replace this host's when the core's Ready carries the snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage, decode_message
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.invariant import invariant
from moorline.node.errors import ShardUnavailable as ShardUnavailable
from moorline.node.replication import snapshot_install
from moorline.node.replication.proposer import (
    IN_GROUP,
    GroupEnd,
    Proposer,
    Waiter,
    resolve_waiter,
)
from moorline.node.replication.proposer import Callback as Callback
from moorline.node.replication.proposer import consume_outcome as consume_outcome
from moorline.node.replication.proposer import outcome_within as outcome_within
from moorline.node.replication.read_barrier import ReadBarriers
from moorline.node.replication.reader import ShardReader
from moorline.node.replication.reader_feed import ReaderFeeds
from moorline.node.replication.snapshots import SavedSnapshotInfo as SavedSnapshotInfo
from moorline.node.replication.snapshots import ShardSnapshots
from moorline.node.replication.snapshots import SnapshotSettings as SnapshotSettings
from moorline.node.replication.snapshots import decode_conf as decode_conf
from moorline.node.replication.snapshots import encode_conf as encode_conf
from moorline.node.replication.snapshots import recorded_members as recorded_members
from moorline.node.replication.snapshots import records_from as records_from
from moorline.node.sessions.recent import RecentMessages
from moorline.raft import Entry, EntryType, HardState, MemoryStorage, Message, RaftNode, Ready
from moorline.raft.types import ConfState
from moorline.storage.msgstore import MessageStore, StoreCorruption
from moorline.storage.snapshots import SnapshotStore
from moorline.testing.faults import NO_FAULTS, Faults

log = logging.getLogger("moorline.shard")


@dataclass(slots=True)
class ApplyHooks:
    """Callbacks into the node for effects (wake-ups, cross-shard commands)."""

    on_effects: Callable[[ShardHost, Effects], None]
    on_results: Callable[[ShardHost, list[c.Command], list[Any]], None] = field(
        default=lambda host, cmds, results: None
    )
    # Raft messages to other members (none while the group has one voter). Those of a Ready that
    # needed a sync are handed over only after it.
    send: Callable[[ShardHost, list[Message]], None] = field(default=lambda host, msgs: None)
    # Proposals (encoded entries) for the leader, on node ``int``, when this replica does not lead.
    forward: Callable[[ShardHost, int, list[bytes]], None] = field(default=lambda host, node, entries: None)
    # The node's wall clock (ms): a leader stamps the entries other members forward with it.
    now_ms: Callable[[], int] = field(default=lambda: 0)


class ShardHost:
    """One shard replica on this node: its state machine, Raft core, message store; the
    Ready/apply cycle; its proposer, read barriers and snapshots are parts (``proposer``,
    ``reads``, ``snaps``)."""

    def __init__(
        self,
        shard: int,
        state: ShardState,
        raft: RaftNode,
        raft_log: MemoryStorage,
        store: MessageStore,
        snapshots: SnapshotStore,
        hooks: ApplyHooks,
        snapshot_every_entries: int,
        max_entry_bytes: int = 4 << 20,
        recent: RecentMessages | None = None,
    ) -> None:
        self.recent = recent
        self.proposer = Proposer(self)
        self.reads = ReadBarriers(self)
        self.snaps = ShardSnapshots(self)
        self.max_entry_bytes = max_entry_bytes
        self.shard = shard
        self.state = state
        self.raft = raft
        # What the WAL holds of this group since its snapshot (read by the core); bounded by
        # compaction once nothing needs the older entries.
        self.raft_log = raft_log
        self._rd: Ready | None = None  # handed to the WAL; its persistence completes in after_sync
        self.store = store
        store.on_corruption = self.store_damaged  # a bad record stops this shard, not the reader
        self.snapshots = snapshots
        self.hooks = hooks
        self.snapshot_every_entries = snapshot_every_entries
        self.failed: str | None = None  # reason the shard refuses service
        self._fx = Effects()
        self.entries_since_snapshot = 0
        self.snapshot_settings = SnapshotSettings()  # the node sets its own
        self.last_snapshot: SavedSnapshotInfo | None = None
        self.last_snapshot_bytes = 0  # size of the last state snapshot: decides inline or forked
        self.generation = 0  # +1 for every install of a leader's snapshot (older snapshot jobs are void)
        # A received snapshot waiting for the core (snapshot_transfer), then one installed whose
        # WAL records are not synced yet (its staging directory goes after that sync).
        self.staged_install: snapshot_install.StagedInstall | None = None
        self.installed: snapshot_install.StagedInstall | None = None
        self.installs = 0  # leader snapshots installed since start
        self.faults: Faults = NO_FAULTS  # the node's: deliberately broken builds, for tests only
        # Reader feeds (issue 32): as leader, the feeds of nodes that hold no replica of this shard
        # (reader_feed.py); as no member of the group, this node's partial state fed by its leader
        # (reader.py). None on a single node (and ``reader`` with shard.learners = "all").
        self.feeds: ReaderFeeds | None = None
        self.reader: ShardReader | None = None
        self.leader_heard_at = 0.0  # (monotonic) the last append, heartbeat or snapshot from a leader
        # This node dropped its copy of the group (boot.leave_group): its store still holds the old
        # copy's messages, cut away before the new copy's first append (an install replaces it).
        self.store_stale = False
        self._members_of: tuple[Any, frozenset[int]] = (None, frozenset())  # (conf, its node ids), cached

    @property
    def reads_remotely(self) -> bool:
        """This node is no member of the group: ``state`` is a partial one its leader feeds
        (the sessions and registrations of this node's clients only), or nothing yet."""
        return self.reader is not None and self.reader.active

    def knows_session(self, client_id: str) -> bool:
        """Whether this replica can tell ``client_id``'s session record (None included) as the
        shard has it: a member's replica always; a partial state only for the clients it follows."""
        reader = self.reader
        return reader is None or not reader.active or reader.knows(client_id)

    def _origin_is_member(self, node_id: int) -> bool:
        conf = self.raft.active_conf_state
        if conf is not self._members_of[0]:
            self._members_of = (conf, frozenset(m[0] for m in conf.members()))
        return node_id in self._members_of[1]

    def can_drop_copy(self) -> bool:
        """Nothing of this replica is on its way to or from the WAL (no Ready handed to group
        commit, no snapshot written or installed): its copy can be dropped (boot.leave_group)."""
        return (self._rd is None and self.snaps.job is None and self.snaps.installing is None
                and self.staged_install is None and self.installed is None)

    def node_member(self) -> bool:
        """Whether this node is in the group's configuration, as its own core knows it."""
        me = self.proposer.node_id
        return any(m[0] == me for m in self.raft.active_conf_state.members())

    def group_conf(self) -> ConfState:
        """The group's configuration as this node knows it: its own core's, or (no member of the
        group) what the leader feeding it last told (reader.py); its core's until then."""
        reader = self.reader
        if reader is not None and reader.active and reader.conf is not None:
            return reader.conf
        return self.raft.active_conf_state

    @property
    def proposal_lead(self) -> Any:
        """Where this node's proposals go: the Raft leader, or (reading remotely) the node feeding it."""
        reader = self.reader
        if reader is not None and reader.active:
            return (reader.lead, "") if reader.lead else None
        return self.raft.lead

    def proposer_lead_changed(self) -> None:
        self.proposer.check_leader(force=True)

    @property
    def node_id(self) -> int:
        """The proposer's: this node's Raft node id (proposal ids: node, boot, seq)."""
        return self.proposer.node_id

    @node_id.setter
    def node_id(self, value: int) -> None:
        self.proposer.node_id = value

    @property
    def boot(self) -> int:
        """The proposer's: this node's boot number, as the shard admits its proposals."""
        return self.proposer.boot

    @boot.setter
    def boot(self, value: int) -> None:
        self.proposer.boot = value

    @property
    def max_pending_proposals(self) -> int:
        """The proposer's: raft.max_pending_proposals."""
        return self.proposer.max_pending_proposals

    @max_pending_proposals.setter
    def max_pending_proposals(self, value: int) -> None:
        self.proposer.max_pending_proposals = value

    @property
    def batch_bytes(self) -> int:
        """The proposer's: estimated bytes of the commands not yet sealed."""
        return self.proposer.batch_bytes

    @batch_bytes.setter
    def batch_bytes(self, value: int) -> None:
        self.proposer.batch_bytes = value

    def seal(self) -> Ready | None:
        """Turn the commands proposed so far into log entries (proposed to the core); returns the
        Ready whose entries and hard state must be written to the WAL before ``after_sync``."""
        self.proposer.seal_batch()
        return self.take_ready()

    def tick(self) -> None:
        """The logical clock (cluster mode): the core's timers, then our proposals' hand-over."""
        self.proposer.ticks += 1
        self.raft.tick()
        self.check_leader()
        self.proposer.propose_held()
        if self.feeds is not None:
            self.feeds.tick()
        if self.reader is not None:
            self.reader.tick()

    def has_work(self) -> bool:
        """Commands to seal, or a Ready for the WAL (none while a leader's snapshot is installed)."""
        if self.snaps.installing is not None:
            return False
        return self.proposer.has_batch() or self._rd is not None or self.raft.has_ready()

    @property
    def installing(self) -> bool:
        """A leader's snapshot is being installed (its files off the loop): nothing is taken from
        the core, applied, or read from the store until it is done."""
        return self.snaps.installing is not None

    def take_ready(self) -> Ready | None:
        """The Ready to write to the WAL now: one ``after_sync`` left waiting, or the core's next
        (None while a snapshot's install runs: its Ready comes when the files are in place)."""
        if self._rd is None and self.snaps.installing is None and self.raft.has_ready():
            self._rd = self._next_ready()
        return self._rd

    def ready_after_install(self, rd: Ready) -> None:
        """The install of ``rd``'s snapshot is done (``ShardSnapshots``): ``rd`` is the Ready the
        group commit writes next (the node kicks it)."""
        self._rd = rd
        if rd.early_messages:
            self.hooks.send(self, rd.early_messages)
            rd.early_messages = []

    def _next_ready(self) -> Ready | None:
        """The core's next Ready. One carrying a leader's snapshot starts its install (files off
        the loop, then state and store: ``ShardSnapshots.install``) and is held until that is done
        (None here), so the WAL records staged after it (truncation, snapshot mark, hard state:
        group_commit.stage_ready) follow a durable install."""
        rd = self.raft.ready()
        if rd.snapshot is not None:
            self.snaps.install(rd)
            if self.snaps.installing is not None:
                return None  # handed back by ready_after_install
        if rd.early_messages and self.failed is None:
            # A leader's appends and heartbeats go out now, while its own fsync of these entries
            # runs: the followers write theirs in parallel, so an acknowledgement waits for one
            # fsync round, not the leader's and then a follower's in series. Safe because the
            # core counts the leader's own copy only at advance(), after that sync.
            self.hooks.send(self, rd.early_messages)
            rd.early_messages = []
        return rd

    def after_sync(self, stage_hard_state: Callable[[int, HardState], None]) -> bool:
        """The WAL synced this host's Ready: record it, send what waited for it, apply what is
        committed, advance. Readies that follow and need no sync (a new commit index) are handled
        here too, their hard state staged unsynced; returns True when a Ready that needs a sync
        is waiting (the caller syncs again)."""
        rd, self._rd = self._rd, None
        if rd is None:
            return False
        self._persisted(rd)
        while self.failed is None and self.snaps.installing is None and self.raft.has_ready():
            next_rd = self._next_ready()
            if next_rd is None:
                return False  # an install started: its Ready comes when its files are in place
            rd = next_rd
            if rd.entries or rd.snapshot is not None or rd.must_sync:
                self._rd = rd
                return True
            if rd.hard_state is not None:
                stage_hard_state(self.shard, rd.hard_state)
            self._persisted(rd)
        return False

    def _persisted(self, rd: Ready) -> None:
        if rd.snapshot is not None and self.failed is not None:
            return  # its install failed: nothing of this Ready is recorded or sent
        if rd.snapshot is not None and self.installed is not None:
            # The WAL holds the install now: its staging directory (and the old store) can go.
            done, self.installed = self.installed, None
            self.snaps.run_io(snapshot_install.finish_install, done.directory)
        log_ = self.raft_log
        if rd.entries:
            log_.append(rd.entries)
            if self.faults.ack_before_quorum:
                self.proposer.ack_appended(rd.entries)
        if rd.hard_state is not None:
            log_.set_hard_state(rd.hard_state)
        if rd.messages:  # votes and append acknowledgements: only once this Ready is durable
            self.hooks.send(self, rd.messages)
        for e in rd.committed_entries:
            self._apply_entry(e)
        self.raft.advance(rd)
        if self.proposer.held_from is not None:
            self.proposer.propose_held()  # commits made room in the log; no tick on a single node
        if rd.read_states or self.reads.confirmed:
            self._serve_reads(rd)
        st = self.raft.active_conf_state
        if len(st.voters) == 1 and not st.learners:
            # One voter: no follower will ever ask for an applied entry again.
            log_.compact(min(self.state.applied_index, log_.last_index()))
        elif log_.first_index() - 1 > log_.snapshot_index():
            # The group grew after one voter had compacted past its last snapshot: a new member
            # can only start from a snapshot that joins up with the log (the core waits for it).
            self.snaps.start_snapshot()

    def _apply_entry(self, e: Entry) -> None:
        if e.type != EntryType.NORMAL or not e.data:  # a configuration change, a leader's no-op
            self.state.applied_index = e.index
            return
        head = c.decode_head(e.data)
        forwarded = self.proposer.take_forwarded(head, e.data)  # decoded when this leader logged it
        if not self.state.admit(head.origin, head.boot, head.seq):
            self.state.applied_index = e.index  # a proposal resent to a new leader, applied before
            if head.origin == self.node_id:
                self.check_admission()  # (ours refused for a too-large boot jump?)
            return
        if head.origin == self.node_id and head.boot != self.boot:
            self.check_admission()  # (admission moved past our boot?)
        own = self.proposer.take_own(head)
        if own is not None:
            # Our commands as proposed, unless a leader restamped them (forwarded): then what the
            # log holds, as every other replica applies it.
            cmds = (own.commands if e.data is own.data or e.data == own.data
                    else forwarded if forwarded is not None else c.decode_entry(e.data))
            self._apply_commands(e.index, cmds, own.futures, head)
            return
        cmds = forwarded if forwarded is not None else c.decode_entry(e.data)  # recovery, or another member's
        none: list[Waiter] = [None] * len(cmds)
        self._apply_commands(e.index, cmds, none, head)

    def _apply_commands(self, index: int, cmds: list[c.Command], futs: list[Waiter],
                        head: c.EntryHead | None = None) -> None:
        fx = self._fx
        fx.clear()
        results: list[Any] = []
        state = self.state
        apply = state.apply
        publish = c.Publish
        n = len(cmds)
        invariant(len(futs) == n, f"shard {self.shard}: {n} commands with {len(futs)} waiters")
        i = 0
        while i < n:
            cmd = cmds[i]
            try:
                if type(cmd) is publish:  # a run of PUBLISHes (a client's read's worth): one call
                    j = i + 1
                    while j < n and type(cmds[j]) is publish:
                        j += 1
                    results += state.apply_publishes(cmds[i:j], fx)  # type: ignore[arg-type]
                else:
                    j = i + 1
                    results.append(apply(cmd, fx))
            except Exception as exc:  # an apply bug stops this shard (the caller fails it), never the node
                reason = f"apply of {type(cmd).__name__} failed at index {index}: {exc!r}"
                self.failed = reason  # nothing more of this shard is applied, whatever the caller does
                failure = ShardUnavailable(reason)
                for fut in futs[i:]:  # nothing from here on was answered: every waiter hears it
                    resolve_waiter(fut, None, failure)
                raise
            for k in range(i, j):
                fut = futs[k]
                if fut is not None and fut is not IN_GROUP:
                    if type(fut) is GroupEnd:
                        resolve_waiter(fut, results[k + 1 - fut.size:k + 1], None)
                    else:
                        resolve_waiter(fut, results[k], None)
            i = j
        self.state.applied_index = index
        store = self.store
        recent = self.recent
        if fx.appends:
            if self.store_stale:
                self.store_stale = False
                store.truncate_from(fx.appends[0][0])  # the copy dropped before: its messages go
            store.append_many(fx.appends)
            if recent is not None:
                recent.put_many(self.shard, fx.appends)
        if fx.releases:
            kinds = {type(cmd) for cmd in cmds}
            if c.AckReport in kinds:
                coverage.hit("release_on_ack")
            if c.Housekeeping in kinds:
                coverage.hit("retention_release")
            store.release(fx.releases)
            if recent is not None:
                recent.drop(self.shard, fx.releases)
        feeds = self.feeds
        if feeds is not None:
            if head is not None and head.origin != self.proposer.node_id and not self._origin_is_member(head.origin):
                feeds.keep_results(head, results)  # a reader's proposal: its results outlive a leader change
            if feeds.feeds:
                feeds.on_applied(index, head, cmds, results, fx)
        self.hooks.on_results(self, cmds, results)
        self.hooks.on_effects(self, fx)
        self.entries_since_snapshot += 1

    def message(self, offset: int) -> StoredMessage | None:
        """The message at ``offset`` (kept decoded while recent; else read from the store). None
        once the shard failed: its readers get nothing from it (not a later message past a
        damaged one), and what it owes them stays owed in its state; None while a leader's
        snapshot is installed (the stores move; the install reloads what sessions here deliver)."""
        if self.failed is not None or self.snaps.installing is not None:
            return None
        reader = self.reader
        if reader is not None and reader.active:
            return reader.messages.get(offset)
        if self.recent is not None:
            msg = self.recent.get(self.shard, offset)
            if msg is not None:
                return msg
        rec = self.store.get(offset)
        return None if rec is None else decode_message(rec)

    def wants_snapshot(self) -> bool:
        return self.entries_since_snapshot >= self.snapshot_every_entries and self.snaps.job is None

    @property
    def snapshot_in_flight(self) -> bool:
        return self.snaps.job is not None

    def fail_on_bug(self, where: str, exc: BaseException) -> None:
        """A bug surfaced in this group (an apply that raised, an invariant of the Raft core): the
        group stops serving, as for corruption in synced data, and says so once with the
        traceback; every other group goes on (one bad shard stops one shard)."""
        reason = self.failed or f"{where} failed: {exc!r}"
        log.error("shard %d stops serving: %s", self.shard, reason, exc_info=exc)
        self.fail(reason)

    def fail(self, reason: str) -> None:
        self.failed = reason
        self.proposer.fail_all(reason)
        if self.recent is not None:  # nothing of a failed shard is delivered, cached or not
            self.recent.drop(self.shard, list(self.state.topics.meta))

    def store_damaged(self, exc: StoreCorruption) -> None:
        """A read found a record of this shard's store damaged: synced data is lost, so the shard
        stops (an operator's matter: logged once, with the file and offset)."""
        if self.failed is None:
            self.fail(f"checksum failure in synced data: {exc}")
            log.error("shard %d refuses service: %s", self.shard, self.failed)

    # --- the parts' API, as the node, group commit, transfers and tests call it -------------------
    def propose(self, cmd: c.Command, want_result: bool = True) -> asyncio.Future[Any] | None:
        return self.proposer.propose(cmd, want_result)

    def propose_cb(self, cmd: c.Command, callback: Callback) -> None:
        """Like ``propose``, but ``callback(result, error)`` runs right at apply (or failure)."""
        self.proposer.propose_cb(cmd, callback)

    def propose_group(self, cmds: list[c.Command], callback: Callback) -> None:
        """Propose ``cmds`` as one group: ``callback(results, error)`` runs once, when the last is applied."""
        self.proposer.propose_group(cmds, callback)

    def has_batch(self) -> bool:
        return self.proposer.has_batch()

    def batch_len(self) -> int:
        """Commands proposed and not sealed yet (GroupCommit tells lazy ones from urgent ones by it)."""
        return self.proposer.batch_len()

    def propose_forwarded(self, entries: list[bytes]) -> int:
        """Another member's proposals (or ours, handed over again): ``Proposer.propose_forwarded``."""
        return self.proposer.propose_forwarded(entries)

    def check_admission(self) -> None:
        self.proposer.check_admission()

    def check_leader(self, force: bool = False) -> None:
        self.proposer.check_leader(force)

    def read_barrier(self) -> asyncio.Future[None]:
        """``ReadBarriers.ask``: this replica as of the group's commit when asked (reading remotely:
        the feed's, ``ShardReader.barrier``)."""
        reader = self.reader
        if reader is not None and reader.active:
            return reader.barrier()
        return self.reads.ask()

    def _serve_reads(self, rd: Ready) -> None:
        self.reads.serve(rd)  # (the cluster simulator instruments this method)

    def take_snapshot(self) -> tuple[int, int]:
        return self.snaps.take_snapshot()

    def start_snapshot(self) -> bool:
        return self.snaps.start_snapshot()

    async def fresh_snapshot(self) -> SavedSnapshotInfo:
        return await self.snaps.fresh_snapshot()

    async def snapshot_idle(self) -> None:
        await self.snaps.snapshot_idle()


def default_limits(cfg: Any, dedup_at_propose_only: bool = False) -> TopicLimits:
    return TopicLimits(
        retention_min_age_ms=int(cfg.retention.min_age_s * 1000),
        shard_max_bytes=cfg.shard.max_bytes,
        reserved_headroom_bytes=cfg.shard.reserved_headroom_bytes,
        dedup_window_ms=int(cfg.dedup.history_window_s * 1000),
        dedup_max_history=cfg.dedup.max_history,
        producer_ttl_ms=int(cfg.dedup.producer_ttl_s * 1000),
        max_seq_gap=cfg.producer.max_seq_gap,
        dedup_at_propose_only=dedup_at_propose_only,  # a deliberately broken build (tests only)
    )
