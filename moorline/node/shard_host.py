"""Hosts one shard on this node: its state machine, Raft stand-in, message store and snapshots.

Proposals are batched: every command proposed during one pass of the event loop goes into one
log entry; the node's ``GroupCommit`` persists the entries of every shard with one fdatasync and
then calls ``commit_upto`` here, which applies them and resolves the proposers' futures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage, decode_message
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.invariant import invariant
from moorline.node.one_voter import LogEntry, OneVoterRaft
from moorline.node.recent import RecentMessages
from moorline.storage.msgstore import MessageStore, StoreCorruption
from moorline.storage.snapshots import SnapshotStore

log = logging.getLogger("moorline.shard")


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
class _Pending:
    index: int
    commands: list[c.Command]
    futures: list[Waiter]


@dataclass(slots=True)
class ApplyHooks:
    """Callbacks into the node for effects (wake-ups, cross-shard commands)."""

    on_effects: Callable[[ShardHost, Effects], None]
    on_results: Callable[[ShardHost, list[c.Command], list[Any]], None] = field(
        default=lambda host, cmds, results: None
    )


class ShardHost:
    def __init__(
        self,
        shard: int,
        state: ShardState,
        raft: OneVoterRaft,
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
        self.store = store
        store.on_corruption = self._store_damaged  # a bad record stops this shard, not the reader
        self.snapshots = snapshots
        self.hooks = hooks
        self.snapshot_every_entries = snapshot_every_entries
        self.failed: str | None = None  # reason the shard refuses service
        self._batch_cmds: list[c.Command] = []
        self._batch_futs: list[Waiter] = []
        self.batch_bytes = 0  # estimated bytes of the commands not yet sealed
        self._inflight: dict[int, _Pending] = {}
        self._fx = Effects()
        self._entries_since_snapshot = 0

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

    def seal(self) -> list[LogEntry]:
        """Turn the commands proposed so far into one log entry; returns the entries to persist."""
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
        return self.raft.ready().entries

    def _propose_entry(self, cmds: list[c.Command], futs: list[Waiter]) -> None:
        index = self.raft.propose(c.encode_entry(cmds))
        self._inflight[index] = _Pending(index, cmds, futs)

    # --- committing and applying -----------------------------------------------------------------
    def commit_upto(self, index: int) -> None:
        old, new = self.raft.advance(index)
        for i in range(old + 1, new + 1):
            pending = self._inflight.pop(i, None)
            invariant(pending is not None, f"shard {self.shard}: committed entry {i} was proposed here")
            assert pending is not None
            self._apply_commands(i, pending.commands, pending.futures)

    def replay(self, entries: list[tuple[int, int, int, bytes]]) -> None:
        """Recovery: re-apply synced entries after the snapshot (no proposers are waiting)."""
        for term, index, _type, data in entries:
            if index <= self.state.applied_index:
                continue
            invariant(index == self.state.applied_index + 1, f"shard {self.shard}: log has a gap at {index}")
            cmds = c.decode_entry(data)
            none: list[Waiter] = [None] * len(cmds)
            self._apply_commands(index, cmds, none)
            self.raft.term = max(self.raft.term, term)

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
        self.snapshots.save(self.shard, index, self.raft.term, data)
        self._entries_since_snapshot = 0
        return index, self.raft.term

    def fail(self, reason: str) -> None:
        self.failed = reason
        for pending in self._inflight.values():
            for fut in pending.futures:
                _resolve(fut, None, ShardUnavailable(reason))
        self._inflight.clear()
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

