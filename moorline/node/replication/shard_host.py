"""Hosts one shard on this node: its state machine, its Raft replica, message store and snapshots.

Proposals are batched: every command proposed during one pass of the event loop goes into one
log entry (``seal`` proposes it to the Raft core). The node's ``GroupCommit`` writes each host's
``Ready`` (entries, hard state) to the node-wide WAL, syncs every group with one fdatasync, then
calls ``after_sync`` here, which records what is durable, applies what the core says is
committed and resolves the proposers' futures. A single node is a one-voter group on this same
path: its own sync is the quorum.

Snapshots (``start_snapshot``) never encode or sync on the event loop once a shard's state is
large: the loop forks a child, which encodes the state as it was at the fork (the child's
copy-on-write view: apply goes on in the parent and cannot change what the child encodes) and
writes the snapshot file; a thread then syncs the message store's records up to that state and
moves the file into place, and only then is the WAL told (``on_saved``). A thread alone would not
do: encoding is one long call that holds the GIL (measured: the loop stood still for as long as
the encoding took, 480 ms for 58 MB, whether on a thread or not). At most one snapshot per shard is
in flight, and ``SnapshotSettings.max_parallel`` per node.

A replica that fell too far behind its leader's log installs the leader's snapshot
(``snapshot_install.py`` for the files, ``snapshot_transfer.py`` for the transfer): the staged
state and store replace this host's when the core's Ready carries the snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage, decode_message
from moorline.broker.shard import MAX_BOOT_JUMP, ShardState
from moorline.broker.topic_state import PublishResult, TopicLimits
from moorline.invariant import invariant
from moorline.node.replication import snapshot_install
from moorline.node.sessions.recent import SHARD_SHIFT, RecentMessages
from moorline.raft import (
    ConfState,
    Entry,
    EntryType,
    HardState,
    MemberId,
    MemoryStorage,
    Message,
    ProposalDropped,
    RaftNode,
    Ready,
)
from moorline.raft.types import Snapshot
from moorline.storage.msgstore import MessageStore, StoreCorruption, StoreSyncJob
from moorline.storage.snapshots import SnapshotStore, write_snapshot_file
from moorline.testing.faults import NO_FAULTS, Faults

log = logging.getLogger("moorline.shard")

# Default of raft.follower_log_margin_entries: entries a multi-voter group keeps in memory below
# its snapshot, so a follower that lags by less catches up from entries, not a snapshot.
MULTI_VOTER_LOG_MARGIN = 50_000
READS_ASKED_MAX = 1024  # read barriers asked and not yet answered, per group (the oldest past it fail)

_conf_encoder = msgspec.msgpack.Encoder()
_conf_decoder = msgspec.msgpack.Decoder(ConfState)


def encode_conf(conf: ConfState) -> bytes:
    """A snapshot file's meta: the membership configuration as of its index."""
    return _conf_encoder.encode(conf)


def decode_conf(meta: bytes) -> ConfState | None:
    """The configuration a snapshot file records; None for a file from before it was recorded."""
    return _conf_decoder.decode(meta) if meta else None


@dataclass(slots=True)
class SnapshotSettings:
    """How a node takes and installs its shards' snapshots; one object shared by every host. The
    defaults (no executor) do everything inline: unit tests, and a simulator, where a seed must
    decide every step."""

    follower_log_margin_entries: int = MULTI_VOTER_LOG_MARGIN
    # Shards whose last snapshot was at most this big are encoded on the event loop (a fork costs
    # more than that); larger ones in a forked child. Writing and syncing go to ``executor``.
    inline_max_bytes: int = 512 << 10
    max_parallel: int = 2  # snapshots being written at once, node-wide (forked children included)
    executor: concurrent.futures.Executor | None = None
    install_root: Path | None = None  # where received snapshots are staged (<data>/install); None: refused
    # Told once a snapshot is durable (file and store records): the node marks it in the WAL.
    on_saved: Callable[[ShardHost, int, int], None] | None = None
    # Told after a replica installed a leader's snapshot: delivery state of the shard is stale.
    on_installed: Callable[[ShardHost], None] | None = None
    running: int = 0  # snapshots being written now
    forked: int = 0  # snapshots encoded by a forked child since start

    @classmethod
    def for_node(cls, cfg: Any, data_dir: Path, on_saved: Callable[[ShardHost, int, int], None],
                 on_installed: Callable[[ShardHost], None], inline: bool = False) -> SnapshotSettings:
        """A node's: snapshots off the event loop (a thread pool of ``storage.max_parallel_snapshots``
        threads, forked encoders), received snapshots staged under ``<data>/install``. ``inline``
        (the simulator's seam: no threads, no forks) does all of it on the event loop."""
        workers = cfg.storage.max_parallel_snapshots
        return cls(
            follower_log_margin_entries=cfg.raft.follower_log_margin_entries,
            inline_max_bytes=cfg.storage.snapshot_inline_max_bytes,
            max_parallel=workers,
            # One more thread than snapshots: staging received chunks and cleaning up go there too.
            executor=None if inline else concurrent.futures.ThreadPoolExecutor(workers + 1,
                                                                               thread_name_prefix="snapshot"),
            on_saved=on_saved,
            on_installed=on_installed,
            install_root=snapshot_install.install_root(data_dir),
        )


def records_from(state: ShardState) -> int:
    """The lowest offset whose record a snapshot of ``state`` must carry: its first kept message
    (the next offset when it keeps none). Not the store's low-water mark: that is only where every
    later offset is present, and a message kept longer (still owed) than later released ones
    survives below it; a transfer starting there installed a replica without it (moorline sim
    --cluster, seed 203)."""
    return next(iter(state.topics.meta), state.topics.next_offset)


def recorded_members(meta: bytes, voters: list[MemberId], learners: list[MemberId]
                     ) -> tuple[list[MemberId], list[MemberId]]:
    """The voters and learners a replica starts with: the configuration its snapshot recorded
    (the committed history decides membership), else the ones given (no snapshot yet, or one
    from before configurations were recorded)."""
    conf = decode_conf(meta)
    if conf is None:
        return voters, learners
    return list(conf.voters), list(conf.learners)


@dataclass(eq=False)
class SavedSnapshotInfo:
    """A snapshot this host saved: what a transfer to a follower sends."""

    index: int
    term: int
    meta: bytes
    path: Path
    size: int
    # Where a transfer's records start: the state's lowest kept offset when it was frozen
    # (``records_from``), which can be below the store's low-water mark (sparse survivors).
    low_water: int
    next_offset: int  # the state's (and the store's) next message offset at ``index``


@dataclass(eq=False)
class _SnapshotJob:
    index: int
    term: int
    conf: ConfState
    store: MessageStore
    store_job: StoreSyncJob
    low_water: int
    next_offset: int
    generation: int
    pending: Path
    data: bytes | None = None  # encoded on the loop (small states)
    child: tuple[int, int] | None = None  # (pid, read end of its report pipe) of a forked encoder
    future: concurrent.futures.Future[int] | None = None
    waiters: list[asyncio.Future[SavedSnapshotInfo]] = field(default_factory=list)


class ShardUnavailable(Exception):
    """The shard refuses service (e.g. corruption detected in synced data)."""


# Who waits for a command's result: a future, a plain callback (no future, no extra loop hop),
# one callback for a whole group of commands (the publish hot path: a read's worth of PUBLISHes),
# or nobody.
Callback = Callable[[Any, BaseException | None], None]


class GroupEnd:
    """The waiter of the last command of a group proposed together: its callback gets the list of
    the group's results once, when the last of them is applied. The other members wait on
    ``IN_GROUP``. A group is never split over two log entries, so its results are contiguous."""

    __slots__ = ("callback", "size")

    def __init__(self, callback: Callback, size: int) -> None:
        self.callback = callback
        self.size = size


class _InGroup:
    __slots__ = ()


IN_GROUP = _InGroup()

Waiter = asyncio.Future[Any] | Callback | GroupEnd | _InGroup | None


def _resolve(waiter: Waiter, result: Any, exc: BaseException | None) -> None:
    if waiter is None or waiter is IN_GROUP:
        return
    if isinstance(waiter, GroupEnd):
        waiter = waiter.callback
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(result)
        return
    try:
        waiter(result, exc)  # type: ignore[operator]
    except Exception:
        log.exception("a command callback failed")


def consume_outcome(fut: asyncio.Future[Any]) -> None:
    """Done callback for a proposal's future its waiter gave up on (timed out, cancelled, or
    never wanted it): the outcome settled later (a result, or an exception: outcome unknown after
    an install, the shard failed) is taken, so asyncio does not report it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


async def outcome_within(fut: asyncio.Future[Any], timeout: float) -> Any:
    """``fut``'s result within ``timeout`` seconds, else TimeoutError; ``fut`` itself is never
    cancelled (the command may still apply). ``asyncio.shield`` stops looking at ``fut`` once its
    waiter timed out or was cancelled: a later exception there would be reported as never
    retrieved (moorline sim --cluster seed 142: a SUBSCRIBE whose SessionSubscribe timed out was
    settled "outcome unknown" when the replica installed a snapshot), so ``fut`` is consumed then."""
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    finally:
        if not fut.done():
            fut.add_done_callback(consume_outcome)


@dataclass(slots=True)
class _Own:
    """A proposal of this node, kept (and resent to whoever leads) until this replica applies it."""

    seq: int
    data: bytes
    commands: list[c.Command]
    futures: list[Waiter]
    sent_tick: int = 0


class _EntryHead(msgspec.Struct, array_like=True, frozen=True):
    """An entry's proposal id, decoded without its commands (msgspec.Raw is not parsed)."""

    version: int
    commands: msgspec.Raw
    origin: int = 0
    boot: int = 0
    seq: int = 0


_head_decoder = msgspec.msgpack.Decoder(_EntryHead)


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
        self.max_entry_bytes = max_entry_bytes
        self.shard = shard
        self.state = state
        self.raft = raft
        # What the WAL holds of this group since its snapshot (read by the core); bounded by
        # compaction once nothing needs the older entries.
        self.raft_log = raft_log
        self._rd: Ready | None = None  # handed to the WAL; its persistence completes in after_sync
        self.store = store
        store.on_corruption = self._store_damaged  # a bad record stops this shard, not the reader
        self.snapshots = snapshots
        self.hooks = hooks
        self.snapshot_every_entries = snapshot_every_entries
        self.failed: str | None = None  # reason the shard refuses service
        self._batch_cmds: list[c.Command] = []
        self._batch_futs: list[Waiter] = []
        self.batch_bytes = 0  # estimated bytes of the commands not yet sealed
        # Proposal ids (node, boot, seq): the boot number changes with every start of the node.
        self.node_id = 1
        self.boot = 0
        self._seq = 0
        self._own: dict[int, _Own] = {}  # seq -> proposal not applied here yet, in seq order
        self.max_pending_proposals = 256  # raft.max_pending_proposals: entries in _own (and sealing)
        self._lead_seen: Any = None  # the leader our proposals were last handed to
        self._ticks = 0
        self.resend_after_ticks = 20  # a proposal not applied after this many ticks is handed over again
        # The seq of our oldest proposal that our own log (we lead) refused to take (a leadership
        # transfer in progress, too many uncommitted bytes): it and every later one wait in _own,
        # in order, until the log takes them (_propose_held) or another leader is handed them all.
        self._held_from: int | None = None
        self._fx = Effects()
        self._entries_since_snapshot = 0
        self.snapshot_settings = SnapshotSettings()  # the node sets its own
        self._snap_job: _SnapshotJob | None = None
        self.last_snapshot: SavedSnapshotInfo | None = None
        self.last_snapshot_bytes = 0  # size of the last state snapshot: decides inline or forked
        self.generation = 0  # +1 for every install of a leader's snapshot (older snapshot jobs are void)
        # A received snapshot waiting for the core (snapshot_transfer), then one installed whose
        # WAL records are not synced yet (its staging directory goes after that sync).
        self.staged_install: snapshot_install.StagedInstall | None = None
        self._installed: snapshot_install.StagedInstall | None = None
        self.installs = 0  # leader snapshots installed since start
        self._stamp_ms = 0  # the latest time this replica stamped forwarded entries with, as leader
        self.faults: Faults = NO_FAULTS  # the node's: deliberately broken builds, for tests only
        self._forgotten: dict[int, _Own] = {}  # Faults.forwarder_drops_on_leader_change: never resent
        # Read barriers (Raft read index): asked, by context; then confirmed, waiting for the apply.
        self._reads_asked: dict[bytes, asyncio.Future[None]] = {}
        self._reads_confirmed: list[tuple[int, asyncio.Future[None]]] = []
        self._read_seq = 0

    # --- proposing ---------------------------------------------------------------------------
    def propose(self, cmd: c.Command, want_result: bool = True) -> asyncio.Future[Any] | None:
        if self.failed is not None:
            if not want_result:
                # Nobody waits for it (ack reports, expiry drops, claims, QoS 0): a failed shard
                # applies nothing, and raising would only break whoever sent it, often on behalf
                # of another shard. Ack reports are sent again at restart; QoS 0 may be lost.
                return None
            raise ShardUnavailable(f"shard {self.shard} unavailable: {self.failed}")
        if len(self._own) >= self.max_pending_proposals:
            if not want_result:
                return None  # as for a failed shard: nobody waits for it, its sender repeats what matters
            raise ShardUnavailable(f"shard {self.shard}: {len(self._own)} proposals of this node wait for a leader "
                                   f"to commit them (raft.max_pending_proposals): refused, it entered no log")
        fut: asyncio.Future[Any] | None = asyncio.get_running_loop().create_future() if want_result else None
        if self.faults.dedup_at_propose_only and self._answered_here(cmd, fut):
            return fut
        self._batch_cmds.append(cmd)
        self._batch_futs.append(fut)
        if isinstance(cmd, c.Publish):
            self.batch_bytes += len(cmd.msg.payload) + 128
        return fut

    def propose_cb(self, cmd: c.Command, callback: Callback) -> None:
        """Like ``propose``, but ``callback(result, error)`` runs right at apply (or failure)."""
        if self.failed is not None:
            raise ShardUnavailable(f"shard {self.shard} unavailable: {self.failed}")
        if len(self._own) >= self.max_pending_proposals:
            raise ShardUnavailable(f"shard {self.shard}: {len(self._own)} proposals of this node wait for a leader "
                                   f"to commit them (raft.max_pending_proposals): refused, it entered no log")
        if self.faults.dedup_at_propose_only and self._answered_here(cmd, callback):
            return
        self._batch_cmds.append(cmd)
        self._batch_futs.append(callback)
        if isinstance(cmd, c.Publish):
            self.batch_bytes += len(cmd.msg.payload) + 128

    def propose_group(self, cmds: list[c.Command], callback: Callback) -> None:
        """Propose ``cmds`` as one group: ``callback(results, error)`` runs once, when the last is applied."""
        if self.failed is not None:
            raise ShardUnavailable(f"shard {self.shard} unavailable: {self.failed}")
        if len(self._own) >= self.max_pending_proposals:
            raise ShardUnavailable(f"shard {self.shard}: {len(self._own)} proposals of this node wait for a leader "
                                   f"to commit them (raft.max_pending_proposals): refused, it entered no log")
        n = len(cmds)
        invariant(n > 0, "a command group is not empty")
        self._batch_cmds.extend(cmds)
        futs = self._batch_futs
        futs.extend([IN_GROUP] * (n - 1))
        futs.append(GroupEnd(callback, n))
        size = 0
        for cmd in cmds:
            if type(cmd) is c.Publish:
                size += len(cmd.msg.payload) + 128
        self.batch_bytes += size

    def has_batch(self) -> bool:
        return bool(self._batch_cmds)

    def batch_len(self) -> int:
        """Commands proposed and not sealed yet (GroupCommit tells lazy ones from urgent ones by it)."""
        return len(self._batch_cmds)

    def seal(self) -> Ready | None:
        """Turn the commands proposed so far into log entries (proposed to the core); returns the
        Ready whose entries and hard state must be written to the WAL before ``after_sync``."""
        if self._batch_cmds:
            cmds, futs = self._batch_cmds, self._batch_futs
            self._batch_cmds, self._batch_futs = [], []
            self.batch_bytes = 0
            start = 0
            size = 0
            for i, cmd in enumerate(cmds):  # one entry per batch, split to respect max_entry_bytes
                est = len(cmd.msg.payload) + 256 if isinstance(cmd, c.Publish) else 256
                # A group stays in one entry, so its results arrive together.
                if size + est > self.max_entry_bytes and i > start and futs[i - 1] is not IN_GROUP:
                    self._propose_entry(cmds[start:i], futs[start:i])
                    start, size = i, 0
                size += est
            self._propose_entry(cmds[start:], futs[start:])
        return self.take_ready()

    def _propose_entry(self, cmds: list[c.Command], futs: list[Waiter]) -> None:
        self._seq += 1
        own = _Own(self._seq, c.encode_entry(cmds, self.node_id, self.boot, self._seq), cmds, futs, self._ticks)
        self._own[own.seq] = own
        if self.raft.lead != self._lead_seen:
            # A new leader: everything not applied yet goes to it first, in order, then this one
            # (the shard applies a node's proposals only in their order).
            self.check_leader(force=True)
            return
        if self._held_from is not None:
            return  # behind a proposal our log refused: proposed after it (_propose_held)
        if self.raft.is_leader:
            try:
                self.raft.propose(own.data)
            except ProposalDropped:
                # It entered no log, yet it is not refused: a refusal here, after later PUBLISHes
                # of the same client were read and proposed, would let them commit before its
                # resend (moorline sim --cluster seed 10993: a message refused during a leadership
                # transfer, the next two of its topic committed first). It waits, and so does
                # everything after it, until the log takes them or another leader is given them.
                self._held_from = own.seq
                coverage.hit("proposal_held")
            return
        lead = self.raft.lead
        if lead is not None:
            self.hooks.forward(self, lead[0], [own.data])
        # No leader known: kept, handed over when one is (check_leader).

    def propose_forwarded(self, entries: list[bytes]) -> int:
        """Another member's proposals (or ours, handed over again): into the log if we lead, else
        dropped (its origin hands them to the leader it learns of; an entry applies once whoever
        proposes it). Returns how many, from the first, the log took."""
        if not self.raft.is_leader or self.failed is not None:
            return 0
        # The leader's time, never decreasing, replaces the proposer's in every command.
        self._stamp_ms = stamp = max(self._stamp_ms, self.hooks.now_ms())
        for i, data in enumerate(entries):
            try:
                self.raft.propose(c.restamp_entry(data, stamp))
            except ProposalDropped:
                return i  # the origin resends after resend_after_ticks
        return len(entries)

    def _propose_held(self) -> None:
        """Our proposals from the one our log refused: into it, in order, as far as it takes them."""
        held = self._held_from
        if held is None or not self.raft.is_leader or self.raft.lead != self._lead_seen or self.failed is not None:
            return
        for seq, own in self._own.items():  # ascending
            if seq < held:
                continue
            try:
                self.raft.propose(own.data)
            except ProposalDropped:
                self._held_from = seq
                return
            own.sent_tick = self._ticks
        self._held_from = None

    def tick(self) -> None:
        """The logical clock (cluster mode): the core's timers, then our proposals' hand-over."""
        self._ticks += 1
        self.raft.tick()
        self.check_leader()
        self._propose_held()

    def check_admission(self) -> None:
        """The shard applies this node's proposals only under a boot after the last one it admitted
        from it, at most MAX_BOOT_JUMP after (ShardState.admit). When the admitted boot is at or
        beyond ours (an entry forged for this node, or a data directory restored from an old copy)
        or more than MAX_BOOT_JUMP behind (a crash loop), every proposal of ours would be skipped
        forever: we propose under the boot after the admitted one from then on, renumbering what
        waits (nothing of it was applied: its boot is refused), and hand it all over again."""
        last = self.state.proposals.get(self.node_id)
        floor = last[0] if last is not None else 0
        if floor < self.boot <= floor + MAX_BOOT_JUMP or (last is not None and last[0] == self.boot):
            return
        boot = floor + 1
        log.error("shard %d: this node's proposals are admitted only under a boot after %d, but it runs as boot "
                  "%d (an entry forged for this node, or restored data?): it proposes as boot %d from now on",
                  self.shard, floor, self.boot, boot)
        self.boot = boot
        owns = list(self._own.values())
        self._own = {}
        self._seq = 0
        for own in owns:
            self._seq += 1
            own.seq = self._seq
            own.data = c.encode_entry(own.commands, self.node_id, boot, own.seq)
            self._own[own.seq] = own
        self._held_from = None
        if owns:
            self.check_leader(force=True)

    def check_leader(self, force: bool = False) -> None:
        """Hands every proposal not applied yet, in original order, to a new leader; or again to
        the same one when the oldest waited ``resend_after_ticks`` (it, or a frame carrying it, may
        have been dropped, and then nothing after it applies either)."""
        if not self._own:
            self._lead_seen = self.raft.lead
            return
        lead = self.raft.lead
        oldest = next(iter(self._own.values()))
        if not force and lead == self._lead_seen and self._ticks - oldest.sent_tick < self.resend_after_ticks:
            return
        if self.faults.forwarder_drops_on_leader_change and lead != self._lead_seen:
            self._forget_unapplied(keep_newest=force)
        if lead != self._lead_seen and lead is not None and self._own:
            coverage.hit("proposals_handed_to_new_leader")
        self._lead_seen = lead
        if lead is None or not self._own:
            return
        owns = list(self._own.values())
        for own in owns:
            own.sent_tick = self._ticks
        self._held_from = None  # every one of them is handed over now, in order
        if self.raft.is_leader:
            taken = self.propose_forwarded([o.data for o in owns])
            if taken < len(owns):
                self._held_from = owns[taken].seq  # the rest wait for room, in order
                coverage.hit("proposal_held")
        else:
            self.hooks.forward(self, lead[0], [o.data for o in owns])

    def read_barrier(self) -> asyncio.Future[None]:
        """Resolves once this replica has applied everything the group had committed when it was
        asked (Raft read index, confirmed by the leader's quorum). A replica that was down, cut off
        or is replaying its log reads as of then, not as of its own past. Raises ProposalDropped
        when no leader is known (or too many reads wait); the caller bounds the wait."""
        self._read_seq += 1
        ctx = b"rb" + self.node_id.to_bytes(4, "big") + self.boot.to_bytes(8, "big") + self._read_seq.to_bytes(8, "big")
        self.raft.read_index(ctx)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reads_asked[ctx] = fut
        return fut

    def _serve_reads(self, rd: Ready) -> None:
        for rs in rd.read_states:
            fut = self._reads_asked.pop(rs.ctx, None)
            if fut is not None and not fut.done():
                self._reads_confirmed.append((rs.index, fut))
        if self._reads_confirmed:
            applied = self.state.applied_index
            waiting = []
            for index, fut in self._reads_confirmed:
                if fut.done():
                    continue
                if index <= applied:
                    fut.set_result(None)
                else:
                    coverage.hit("read_barrier_waited")
                    waiting.append((index, fut))
            self._reads_confirmed = waiting
        if len(self._reads_asked) > READS_ASKED_MAX:  # answers lost with a leader change: forget the oldest
            for ctx in list(self._reads_asked)[: len(self._reads_asked) - READS_ASKED_MAX]:
                fut = self._reads_asked.pop(ctx)
                if not fut.done():
                    fut.set_exception(ProposalDropped("read index not answered"))

    def has_work(self) -> bool:
        """Commands to seal, or a Ready for the WAL."""
        return bool(self._batch_cmds) or self._rd is not None or self.raft.has_ready()

    def take_ready(self) -> Ready | None:
        """The Ready to write to the WAL now: one ``after_sync`` left waiting, or the core's next."""
        if self._rd is None and self.raft.has_ready():
            self._rd = self._next_ready()
        return self._rd

    def _next_ready(self) -> Ready:
        """The core's next Ready; one carrying a leader's snapshot installs it first (files,
        state, store), so the WAL records staged after it (truncation, snapshot mark, hard state:
        group_commit.stage_ready) follow a durable install."""
        rd = self.raft.ready()
        if rd.snapshot is not None:
            self._install(rd.snapshot)
        return rd

    # --- committing and applying -----------------------------------------------------------------
    def after_sync(self, stage_hard_state: Callable[[int, HardState], None]) -> bool:
        """The WAL synced this host's Ready: record it, send what waited for it, apply what is
        committed, advance. Readies that follow and need no sync (a new commit index) are handled
        here too, their hard state staged unsynced; returns True when a Ready that needs a sync
        is waiting (the caller syncs again)."""
        rd, self._rd = self._rd, None
        if rd is None:
            return False
        self._persisted(rd)
        while self.failed is None and self.raft.has_ready():
            rd = self._next_ready()
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
        if rd.snapshot is not None and self._installed is not None:
            # The WAL holds the install now: its staging directory (and the old store) can go.
            done, self._installed = self._installed, None
            self._run_io(snapshot_install.finish_install, done.directory)
        log_ = self.raft_log
        if rd.entries:
            log_.append(rd.entries)
            if self.faults.ack_before_quorum:
                self._ack_appended(rd.entries)
        if rd.hard_state is not None:
            log_.set_hard_state(rd.hard_state)
        if rd.early_messages or rd.messages:
            self.hooks.send(self, rd.early_messages + rd.messages)
        for e in rd.committed_entries:
            self._apply_entry(e)
        self.raft.advance(rd)
        if self._held_from is not None:
            self._propose_held()  # commits made room in the log; no tick on a single node
        if rd.read_states or self._reads_confirmed:
            self._serve_reads(rd)
        st = self.raft.active_conf_state
        if len(st.voters) == 1 and not st.learners:
            # One voter: no follower will ever ask for an applied entry again.
            log_.compact(min(self.state.applied_index, log_.last_index()))

    def _apply_entry(self, e: Entry) -> None:
        if e.type != EntryType.NORMAL or not e.data:  # a configuration change, a leader's no-op
            self.state.applied_index = e.index
            return
        head = _head_decoder.decode(e.data)
        if not self.state.admit(head.origin, head.boot, head.seq):
            self.state.applied_index = e.index  # a proposal resent to a new leader, applied before
            if head.origin == self.node_id:
                self.check_admission()  # (ours refused for a too-large boot jump?)
            return
        if head.origin == self.node_id and head.boot != self.boot:
            self.check_admission()  # (admission moved past our boot?)
        own = (self._own.pop(head.seq, None) or self._forgotten.pop(head.seq, None)
               if head.origin == self.node_id and head.boot == self.boot else None)
        if own is not None:
            # Our commands as proposed, unless a leader restamped them (forwarded): then what the
            # log holds, as every other replica applies it.
            cmds = own.commands if e.data is own.data or e.data == own.data else c.decode_entry(e.data)
            self._apply_commands(e.index, cmds, own.futures)
            return
        cmds = c.decode_entry(e.data)  # recovery, or an entry another member proposed
        none: list[Waiter] = [None] * len(cmds)
        self._apply_commands(e.index, cmds, none)

    def _apply_commands(self, index: int, cmds: list[c.Command], futs: list[Waiter]) -> None:
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
                    _resolve(fut, None, failure)
                raise
            for k in range(i, j):
                fut = futs[k]
                if fut is not None and fut is not IN_GROUP:
                    if type(fut) is GroupEnd:
                        _resolve(fut, results[k + 1 - fut.size:k + 1], None)
                    else:
                        _resolve(fut, results[k], None)
            i = j
        self.state.applied_index = index
        store = self.store
        recent = self.recent
        if fx.appends:
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
        self.hooks.on_results(self, cmds, results)
        self.hooks.on_effects(self, fx)
        self._entries_since_snapshot += 1

    def message(self, offset: int) -> StoredMessage | None:
        """The message at ``offset`` (kept decoded while recent; else read from the store). None
        once the shard failed: its readers get nothing from it (not a later message past a
        damaged one), and what it owes them stays owed in its state."""
        if self.failed is not None:
            return None
        if self.recent is not None:
            msg = self.recent.get(self.shard, offset)
            if msg is not None:
                return msg
        rec = self.store.get(offset)
        return None if rec is None else decode_message(rec)

    def wants_snapshot(self) -> bool:
        return self._entries_since_snapshot >= self.snapshot_every_entries and self._snap_job is None

    @property
    def snapshot_in_flight(self) -> bool:
        return self._snap_job is not None

    def take_snapshot(self) -> tuple[int, int]:
        """Persist the state at the applied index now, on this thread (shutdown, tests); waits for
        a snapshot in flight first. The caller marks it in the WAL."""
        self._wait_snapshot_job()
        coverage.hit("snapshot_taken")
        self._entries_since_snapshot = 0
        index = self.state.applied_index
        term = self.raft_log.term(index)
        conf = self.raft.conf_state
        self.store.sync()
        data = self.state.snapshot()
        meta = encode_conf(conf)
        path = self.snapshots.save(self.shard, index, term, data, meta)
        self.last_snapshot_bytes = len(data)
        self._snapshot_recorded(index, term, conf, SavedSnapshotInfo(
            index, term, meta, path, path.stat().st_size, records_from(self.state), self.state.topics.next_offset))
        return index, term

    def start_snapshot(self) -> bool:
        """Start a snapshot of the state at the applied index, off the event loop when a node's
        executor is set (module doc); ``SnapshotSettings.on_saved`` hears when it is durable. False
        when one is in flight, the node's limit is reached, or the shard cannot take one now."""
        settings = self.snapshot_settings
        if (self._snap_job is not None or self.failed is not None or self.staged_install is not None
                or settings.running >= settings.max_parallel):
            return False
        self._entries_since_snapshot = 0
        coverage.hit("snapshot_taken")
        index = self.state.applied_index
        store = self.store
        job = _SnapshotJob(index, self.raft_log.term(index), self.raft.conf_state, store, store.begin_sync(),
                           records_from(self.state), self.state.topics.next_offset, self.generation,
                           self.snapshots.temp_path(self.shard, f"{index}-{self.generation}-{os.getpid()}"))
        executor = settings.executor
        if not self.last_snapshot_bytes:  # first one since start: the size of the one loaded
            latest = self.snapshots.latest(self.shard)
            self.last_snapshot_bytes = _file_size(latest[2]) if latest is not None else 0
        try:
            if executor is None or self.last_snapshot_bytes <= settings.inline_max_bytes:
                job.data = self.state.snapshot()  # small: cheaper than a fork
            else:
                job.child = _fork_encoder(self.state, job.pending, self.shard, index, job.term, encode_conf(job.conf))
                settings.forked += 1
        except OSError as exc:  # fork refused (memory): try again at the next occasion
            store.abort_sync(job.store_job)
            self._entries_since_snapshot = self.snapshot_every_entries
            log.error("shard %d: snapshot not started: %s", self.shard, exc)
            return False
        self._snap_job = job
        settings.running += 1
        if executor is None:
            fut: concurrent.futures.Future[int] = concurrent.futures.Future()
            try:
                fut.set_result(self._write_snapshot(job))
            except BaseException as exc:  # noqa: BLE001 - reported by _snapshot_written
                fut.set_exception(exc)
            job.future = fut
            self._snapshot_written(job)
            return True
        loop = asyncio.get_running_loop()
        job.future = executor.submit(self._write_snapshot, job)
        job.future.add_done_callback(lambda _f: _call_soon(loop, self._snapshot_written, job))
        return True

    async def fresh_snapshot(self) -> SavedSnapshotInfo:
        """A snapshot taken from now on (a transfer to a follower holds the store's reclaim first,
        so every record the state keeps is still in the store when it is read). Raises
        ShardUnavailable when none can be taken (the shard failed or installs one)."""
        while True:
            if self.failed is not None or self.staged_install is not None:
                raise ShardUnavailable(f"shard {self.shard}: no snapshot can be taken now")
            job = self._snap_job
            if job is None:
                if not self.start_snapshot():
                    await asyncio.sleep(0.05)  # the node's limit of parallel snapshots
                    continue
                if self._snap_job is None:  # done inline already
                    if self.last_snapshot is None or self.last_snapshot.index != self.state.applied_index:
                        raise ShardUnavailable(f"shard {self.shard}: snapshot failed")
                    return self.last_snapshot
                job = self._snap_job
                waiter: asyncio.Future[SavedSnapshotInfo] = asyncio.get_running_loop().create_future()
                job.waiters.append(waiter)
                return await waiter
            await self._job_done(job)  # one started before: wait for it, then start ours

    async def snapshot_idle(self) -> None:
        """Until no snapshot of this host is in flight."""
        while self._snap_job is not None:
            await self._job_done(self._snap_job)

    @staticmethod
    async def _job_done(job: _SnapshotJob) -> None:
        waiter: asyncio.Future[SavedSnapshotInfo] = asyncio.get_running_loop().create_future()
        job.waiters.append(waiter)
        try:
            await waiter
        except Exception:  # noqa: BLE001 - it failed; the caller decides what next
            pass

    def _write_snapshot(self, job: _SnapshotJob) -> int:
        """The blocking part (executor thread): the encoded file (by the child, or from ``data``),
        the store's records up to the snapshot's next offset, then the file into place. Returns
        the state's encoded size. In this order: a snapshot file must never name records the
        store could lose."""
        meta = encode_conf(job.conf)
        if job.child is not None:
            size, data_bytes = _wait_encoder(*job.child)
        else:
            assert job.data is not None
            size = write_snapshot_file(job.pending, self.shard, job.index, job.term, job.data, meta)
            data_bytes = len(job.data)
        job.store.run_sync_job(job.store_job)
        path = self.snapshots.adopt(self.shard, job.index, job.term, job.pending, size)
        job.pending = path
        return data_bytes

    def _snapshot_written(self, job: _SnapshotJob) -> None:
        """Back on the loop: record what became durable, then tell the node (WAL mark)."""
        if job.future is None or (self._snap_job is not job):
            return  # completed already (take_snapshot waited for it)
        self._snap_job = None
        self.snapshot_settings.running -= 1
        exc = job.future.exception()
        if exc is not None:
            if job.store is self.store:
                job.store.abort_sync(job.store_job)
            self._entries_since_snapshot = self.snapshot_every_entries  # try again soon
            log.error("shard %d: snapshot at index %d failed: %s", self.shard, job.index, exc)
            for w in job.waiters:
                if not w.done():
                    w.set_exception(ShardUnavailable(f"shard {self.shard}: snapshot failed: {exc}"))
            try:
                job.pending.unlink()
            except OSError:
                pass
            return
        if job.generation != self.generation or job.store is not self.store:
            # A leader's snapshot was installed meanwhile: this one describes the replaced state.
            for w in job.waiters:
                if not w.done():
                    w.set_exception(ShardUnavailable(f"shard {self.shard}: replaced by an installed snapshot"))
            return
        job.store.finish_sync(job.store_job)
        self.last_snapshot_bytes = job.future.result()
        info = SavedSnapshotInfo(job.index, job.term, encode_conf(job.conf), job.pending,
                                 _file_size(job.pending), job.low_water, job.next_offset)
        self._snapshot_recorded(job.index, job.term, job.conf, info)
        on_saved = self.snapshot_settings.on_saved
        if on_saved is not None:
            on_saved(self, job.index, job.term)
        for w in job.waiters:
            if not w.done():
                w.set_result(info)

    def _snapshot_recorded(self, index: int, term: int, conf: ConfState, info: SavedSnapshotInfo) -> None:
        """The snapshot at ``index`` is durable: the core's storage records it and drops entries."""
        self.last_snapshot = info
        log_ = self.raft_log
        if index >= log_.first_index() - 1 and index >= log_.snapshot().meta.index:
            log_.create_snapshot(index, conf, b"")
        active = self.raft.active_conf_state
        if len(active.voters) > 1 or active.learners:
            # Followers catch up from entries: keep a margin of them in memory; one further
            # behind gets this snapshot (snapshot_transfer.py).
            margin = self.snapshot_settings.follower_log_margin_entries
            log_.compact(min(index, max(log_.first_index() - 1, index - margin)))
        elif index <= log_.last_index():
            log_.compact(index)

    def _wait_snapshot_job(self) -> None:
        """Blocking wait for a snapshot in flight, then its completion (shutdown, installs)."""
        job = self._snap_job
        if job is None or job.future is None:
            return
        try:
            job.future.result()
        except Exception:  # noqa: BLE001 - _snapshot_written reports it
            pass
        self._snapshot_written(job)

    def _run_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """File work nobody waits for, on the node's executor (inline without one); errors logged."""
        def run() -> None:
            try:
                fn(*args)
            except OSError as exc:
                log.error("shard %d: %s failed: %s", self.shard, getattr(fn, "__name__", fn), exc)

        executor = self.snapshot_settings.executor
        if executor is None:
            run()
        else:
            executor.submit(run)

    # --- installing a leader's snapshot ----------------------------------------------------------
    def _install(self, snap: Snapshot) -> None:
        """The core accepted a leader's snapshot (the Ready carries it): the staged state and store
        replace this replica's, durably (snapshot_install.py), before the Ready's WAL records are
        staged. A Ready with a snapshot nobody staged (a peer of another version) fails the shard
        rather than apply an empty state."""
        coverage.hit("snapshot_installed")
        meta = snap.meta
        staged, self.staged_install = self.staged_install, None
        if staged is None or (staged.index, staged.term) != (meta.index, meta.term):
            self.fail(f"asked to install a snapshot at index {meta.index} (term {meta.term}) that was not "
                      "received here")
            log.error("shard %d: %s", self.shard, self.failed)
            if staged is not None:
                self._run_io(snapshot_install.discard_staging, staged.directory)
            return
        self._wait_snapshot_job()  # none should be (the receiver waited): never two writers of one store
        old_store = self.store
        # Closed before its directory moves aside: closing writes the records it still buffers to
        # its last segment by path, which after the move is absent (the group-commit task died on
        # it) or, worse, the installed store's segment of the same name (found by moorline sim
        # --cluster with a small raft.follower_log_margin_entries, which makes installs common).
        old_store.close()
        try:
            snapshot_install.commit_install(staged, old_store.directory, self.snapshots)
            staged.store.relocate(old_store.directory)
        except OSError as exc:
            # Before COMMIT: the old replica stays on disk; after it: a restart finishes the install.
            # Either way this process serves neither (the group commit must not stop for it).
            self.fail(f"installing the leader's snapshot at index {meta.index} failed: {exc}")
            log.error("shard %d: %s", self.shard, self.failed)
            return
        self.store = staged.store
        self.store.on_corruption = self._store_damaged
        old_state, self.state = self.state, staged.state
        self.raft_log.apply_snapshot(snap)
        self.generation += 1
        self.installs += 1
        self._entries_since_snapshot = 0
        self.last_snapshot_bytes = staged.state_file_bytes
        self.last_snapshot = None
        self._installed = staged
        if self.recent is not None:  # nothing cached of the old state may be delivered
            mask = (1 << SHARD_SHIFT) - 1
            self.recent.drop(self.shard, [k & mask for k in list(self.recent.by_key) if k >> SHARD_SHIFT == self.shard])
        self._settle_own_after_install()
        self.check_admission()  # the installed state may admit this node only under a later boot
        log.warning("shard %d: installed the leader's snapshot at index %d (term %d): this replica was "
                    "%d entries behind", self.shard, meta.index, meta.term, meta.index - old_state.applied_index)
        hook = self.snapshot_settings.on_installed
        if hook is not None:
            hook(self)

    def _settle_own_after_install(self) -> None:
        """Our proposals that the installed state already applied (its per-node sequence says so)
        will never be applied here: their waiters learn the outcome is unknown (a publisher is
        disconnected and resends; nothing is refused falsely). The rest stay, to be resent."""
        done = self.state.proposals.get(self.node_id)
        if done is None or done[0] != self.boot:
            return
        applied = [seq for seq in self._own if seq <= done[1]]
        failure = ShardUnavailable(f"shard {self.shard}: outcome unknown (this replica installed a snapshot)")
        for seq in applied:
            own = self._own.pop(seq)
            for fut in own.futures:
                _resolve(fut, None, failure)

    # --- deliberately broken builds (testing/faults.py), for tests only ----------------------------
    def _answered_here(self, cmd: c.Command, waiter: Waiter) -> bool:
        """Faults.dedup_at_propose_only: a PUBLISH whose GUID this replica's history holds is
        answered as a duplicate here, without a proposal; any other is proposed, and the shard
        applies it without a GUID check (TopicLimits.dedup_at_propose_only)."""
        if type(cmd) is not c.Publish:
            return False
        seen = self.state.topics.dedup.get(cmd.principal, cmd.msg.guid)
        if seen is None:
            return False
        _resolve(waiter, PublishResult("duplicate", seen[0]), None)
        return True

    def _ack_appended(self, entries: list[Entry]) -> None:
        """Faults.ack_before_quorum: the publishes of our entries are answered once this replica
        synced them into its log, before a majority committed them; apply answers nobody then."""
        for e in entries:
            if e.type != EntryType.NORMAL or not e.data:
                continue
            head = _head_decoder.decode(e.data)
            own = self._own.get(head.seq) if (head.origin, head.boot) == (self.node_id, self.boot) else None
            if own is None:
                continue
            for k, waiter in enumerate(own.futures):
                size = waiter.size if isinstance(waiter, GroupEnd) else 1
                if waiter is None or waiter is IN_GROUP or any(type(x) is not c.Publish
                                                               for x in own.commands[k + 1 - size:k + 1]):
                    continue
                ok = PublishResult("ok")
                _resolve(waiter, [ok] * size if isinstance(waiter, GroupEnd) else ok, None)
                own.futures[k] = None

    def _forget_unapplied(self, keep_newest: bool) -> None:
        """Faults.forwarder_drops_on_leader_change: the proposals not applied yet (the newest,
        being proposed now, excepted) are never handed to the new leader nor resent. Those the old
        leader's log kept are answered when applied; the others never are (publish_timeout closes
        the client), and the shard skips every later proposal of this node (they apply in order)."""
        for seq in list(self._own)[:-1] if keep_newest else list(self._own):
            self._forgotten[seq] = self._own.pop(seq)

    def fail_on_bug(self, where: str, exc: BaseException) -> None:
        """A bug surfaced in this group (an apply that raised, an invariant of the Raft core): the
        group stops serving, as for corruption in synced data, and says so once with the
        traceback; every other group goes on (one bad shard stops one shard)."""
        reason = self.failed or f"{where} failed: {exc!r}"
        log.error("shard %d stops serving: %s", self.shard, reason, exc_info=exc)
        self.fail(reason)

    def fail(self, reason: str) -> None:
        self.failed = reason
        self._held_from = None
        for own in self._own.values():
            for fut in own.futures:
                _resolve(fut, None, ShardUnavailable(reason))
        self._own.clear()
        # Proposed, not sealed yet: a failed shard is never sealed again, so they would wait forever.
        batch, self._batch_cmds, self._batch_futs, self.batch_bytes = self._batch_futs, [], [], 0
        for fut in batch:
            _resolve(fut, None, ShardUnavailable(reason))
        if self.recent is not None:  # nothing of a failed shard is delivered, cached or not
            self.recent.drop(self.shard, list(self.state.topics.meta))

    def _store_damaged(self, exc: StoreCorruption) -> None:
        """A read found a record of this shard's store damaged: synced data is lost, so the shard
        stops (an operator's matter: logged once, with the file and offset)."""
        if self.failed is None:
            self.fail(f"checksum failure in synced data: {exc}")
            log.error("shard %d refuses service: %s", self.shard, self.failed)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the node is gone
        pass


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _fork_encoder(state: ShardState, path: Path, group: int, index: int, term: int, meta: bytes) -> tuple[int, int]:
    """Fork a child that encodes ``state`` as it is now (its copy-on-write view of it) and writes
    the snapshot file at ``path``; returns (pid, read end of its report pipe). The child touches
    nothing but that file and the pipe: it closes every other descriptor it inherited first
    (client sockets, the data directory's lock, the WAL), never runs the event loop, never logs,
    and leaves with ``os._exit``."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns about fork in a threaded process: see above
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        status = 1
        try:
            gc.disable()  # a collection would touch (and copy) every page of the parent's heap
            # Ctrl-C in a terminal reaches the whole process group: the parent stops in order and
            # waits for this file; a SIGTERM to the group (a service manager) ends the child too.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.closerange(3, w)  # the read end too
            os.closerange(w + 1, _max_fd())
            data = state.snapshot()
            size = write_snapshot_file(path, group, index, term, data, meta)
            os.write(w, f"ok {size} {len(data)}".encode())
            status = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            try:
                os.write(w, f"error {exc!r}"[:2000].encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(status)
    os.close(w)
    return pid, r


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 1 << 16


def _wait_encoder(pid: int, report_fd: int) -> tuple[int, int]:
    """(file size, state bytes) from a forked encoder, once it ended (blocking: executor thread)."""
    chunks = []
    try:
        while True:
            chunk = os.read(report_fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(report_fd)
    _, status = os.waitpid(pid, 0)
    report = b"".join(chunks).decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0 or not report.startswith("ok "):
        raise OSError(f"snapshot encoder (pid {pid}) failed: {report or f'exit status {status}'}")
    _, size, data_bytes = report.split()
    return int(size), int(data_bytes)


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

