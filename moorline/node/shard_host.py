"""Hosts one shard on this node: its state machine, its Raft replica, message store and snapshots.

Proposals are batched: every command proposed during one pass of the event loop goes into one
log entry (``seal`` proposes it to the Raft core). The node's ``GroupCommit`` writes each host's
``Ready`` (entries, hard state) to the node-wide WAL, syncs every group with one fdatasync, then
calls ``after_sync`` here, which records what is durable, applies what the core says is
committed and resolves the proposers' futures. A single node is a one-voter group on this same
path: its own sync is the quorum.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage, decode_message
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.invariant import invariant
from moorline.node.recent import RecentMessages
from moorline.raft import (
    Entry,
    EntryType,
    HardState,
    MemoryStorage,
    Message,
    ProposalDropped,
    RaftNode,
    Ready,
)
from moorline.storage.msgstore import MessageStore, StoreCorruption
from moorline.storage.snapshots import SnapshotStore

log = logging.getLogger("moorline.shard")

# Entries a multi-voter group keeps in memory below its snapshot, for followers that lag.
MULTI_VOTER_LOG_MARGIN = 50_000


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
        self._lead_seen: Any = None  # the leader our proposals were last handed to
        self._ticks = 0
        self.resend_after_ticks = 20  # a proposal not applied after this many ticks is handed over again
        self._fx = Effects()
        self._entries_since_snapshot = 0
        self._stamp_ms = 0  # the latest time this replica stamped forwarded entries with, as leader

    # --- proposing ---------------------------------------------------------------------------
    def propose(self, cmd: c.Command, want_result: bool = True) -> asyncio.Future[Any] | None:
        if self.failed is not None:
            if not want_result:
                # Nobody waits for it (ack reports, expiry drops, claims, QoS 0): a failed shard
                # applies nothing, and raising would only break whoever sent it, often on behalf
                # of another shard. Ack reports are sent again at restart; QoS 0 may be lost.
                return None
            raise ShardUnavailable(f"shard {self.shard} unavailable: {self.failed}")
        fut: asyncio.Future[Any] | None = asyncio.get_running_loop().create_future() if want_result else None
        self._batch_cmds.append(cmd)
        self._batch_futs.append(fut)
        if isinstance(cmd, c.Publish):
            self.batch_bytes += len(cmd.msg.payload) + 128
        return fut

    def propose_cb(self, cmd: c.Command, callback: Callback) -> None:
        """Like ``propose``, but ``callback(result, error)`` runs right at apply (or failure)."""
        if self.failed is not None:
            raise ShardUnavailable(f"shard {self.shard} unavailable: {self.failed}")
        self._batch_cmds.append(cmd)
        self._batch_futs.append(callback)
        if isinstance(cmd, c.Publish):
            self.batch_bytes += len(cmd.msg.payload) + 128

    def propose_group(self, cmds: list[c.Command], callback: Callback) -> None:
        """Propose ``cmds`` as one group: ``callback(results, error)`` runs once, when the last is applied."""
        if self.failed is not None:
            raise ShardUnavailable(f"shard {self.shard} unavailable: {self.failed}")
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
        if self.raft.is_leader:
            try:
                self.raft.propose(own.data)
            except ProposalDropped as exc:  # too much uncommitted: it entered no log
                del self._own[own.seq]
                self._seq -= 1  # nothing follows it yet: the next proposal takes its place
                failure = ShardUnavailable(f"shard {self.shard}: proposal refused: {exc}")
                for fut in futs:
                    _resolve(fut, None, failure)
            return
        lead = self.raft.lead
        if lead is not None:
            self.hooks.forward(self, lead[0], [own.data])
        # No leader known: kept, handed over when one is (check_leader).

    def propose_forwarded(self, entries: list[bytes]) -> None:
        """Another member's proposals: into the log if we lead, else dropped (its origin hands
        them to the leader it learns of; an entry applies once whoever proposes it)."""
        if not self.raft.is_leader or self.failed is not None:
            return
        # The leader's time, never decreasing, replaces the proposer's in every command.
        self._stamp_ms = stamp = max(self._stamp_ms, self.hooks.now_ms())
        for data in entries:
            try:
                self.raft.propose(c.restamp_entry(data, stamp))
            except ProposalDropped:
                return  # the origin resends after resend_after_ticks

    def tick(self) -> None:
        """The logical clock (cluster mode): the core's timers, then our proposals' hand-over."""
        self._ticks += 1
        self.raft.tick()
        self.check_leader()

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
        self._lead_seen = lead
        if lead is None:
            return
        owns = list(self._own.values())
        for own in owns:
            own.sent_tick = self._ticks
        if self.raft.is_leader:
            self.propose_forwarded([o.data for o in owns])
        else:
            self.hooks.forward(self, lead[0], [o.data for o in owns])

    def has_work(self) -> bool:
        """Commands to seal, or a Ready for the WAL."""
        return bool(self._batch_cmds) or self._rd is not None or self.raft.has_ready()

    def take_ready(self) -> Ready | None:
        """The Ready to write to the WAL now: one ``after_sync`` left waiting, or the core's next."""
        if self._rd is None and self.raft.has_ready():
            self._rd = self.raft.ready()
        return self._rd

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
            rd = self.raft.ready()
            if rd.entries or rd.snapshot is not None or rd.must_sync:
                self._rd = rd
                return True
            if rd.hard_state is not None:
                stage_hard_state(self.shard, rd.hard_state)
            self._persisted(rd)
        return False

    def _persisted(self, rd: Ready) -> None:
        if rd.snapshot is not None:
            # Installing a leader's snapshot (state plus message store) is not built yet, and the
            # host never makes one a follower could need (MULTI_VOTER_LOG_MARGIN). Refuse loudly
            # rather than apply an empty state.
            self.fail(f"asked to install a snapshot at index {rd.snapshot.meta.index}: not supported yet; "
                      "this replica fell too far behind its leader")
            log.error("shard %d: %s", self.shard, self.failed)
            return
        log_ = self.raft_log
        if rd.entries:
            log_.append(rd.entries)
        if rd.hard_state is not None:
            log_.set_hard_state(rd.hard_state)
        if rd.early_messages or rd.messages:
            self.hooks.send(self, rd.early_messages + rd.messages)
        for e in rd.committed_entries:
            self._apply_entry(e)
        self.raft.advance(rd)
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
            return
        own = self._own.pop(head.seq, None) if head.origin == self.node_id and head.boot == self.boot else None
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
            except Exception as exc:  # an apply bug must not take the node down silently
                log.exception("shard %d: apply of %s failed", self.shard, type(cmd).__name__)
                self.failed = f"apply failed at index {index}: {exc}"
                failure = ShardUnavailable(self.failed)
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
        return self._entries_since_snapshot >= self.snapshot_every_entries

    def take_snapshot(self) -> tuple[int, int]:
        """Persist the state at the applied index; the WAL may then drop entries up to it."""
        self.store.sync()
        data = self.state.snapshot()
        index = self.state.applied_index
        term = self.raft_log.term(index)
        self.snapshots.save(self.shard, index, term, data)
        self.raft_log.create_snapshot(index, self.raft.conf_state, b"")
        conf = self.raft.active_conf_state
        if len(conf.voters) > 1 or conf.learners:
            # Followers catch up from entries: keep a margin of them in memory (a leader's snapshot
            # to a follower further behind is not built yet).
            self.raft_log.compact(max(self.raft_log.first_index() - 1, index - MULTI_VOTER_LOG_MARGIN))
        else:
            self.raft_log.compact(index)
        self._entries_since_snapshot = 0
        return index, term

    def fail(self, reason: str) -> None:
        self.failed = reason
        for own in self._own.values():
            for fut in own.futures:
                _resolve(fut, None, ShardUnavailable(reason))
        self._own.clear()
        if self.recent is not None:  # nothing of a failed shard is delivered, cached or not
            self.recent.drop(self.shard, list(self.state.topics.meta))

    def _store_damaged(self, exc: StoreCorruption) -> None:
        """A read found a record of this shard's store damaged: synced data is lost, so the shard
        stops (an operator's matter: logged once, with the file and offset)."""
        if self.failed is None:
            self.fail(f"checksum failure in synced data: {exc}")
            log.error("shard %d refuses service: %s", self.shard, self.failed)


def default_limits(cfg: Any) -> TopicLimits:
    return TopicLimits(
        retention_min_age_ms=int(cfg.retention.min_age_s * 1000),
        shard_max_bytes=cfg.shard.max_bytes,
        reserved_headroom_bytes=cfg.shard.reserved_headroom_bytes,
        dedup_window_ms=int(cfg.dedup.history_window_s * 1000),
        dedup_max_history=cfg.dedup.max_history,
        producer_ttl_ms=int(cfg.dedup.producer_ttl_s * 1000),
    )

