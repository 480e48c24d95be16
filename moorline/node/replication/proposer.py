"""This node's proposals to one shard: commands batched per event-loop pass into log entries,
proposed to the core when this replica leads or forwarded to the leader, kept until this replica
applies them, handed over again (in order) to a new leader or after ``resend_after_ticks``, held in
order when the leader's own log refuses one; and who waits for each command's result."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.shard import MAX_BOOT_JUMP
from moorline.broker.topic_state import PublishResult
from moorline.invariant import invariant
from moorline.node.errors import ShardUnavailable
from moorline.raft import Entry, EntryType, ProposalDropped

if TYPE_CHECKING:
    from moorline.node.replication.shard_host import ShardHost

log = logging.getLogger("moorline.shard")


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


def resolve_waiter(waiter: Waiter, result: Any, exc: BaseException | None) -> None:
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


class Proposer:
    """The proposals of this node to one shard (``ShardHost.proposer``)."""

    def __init__(self, host: ShardHost) -> None:
        self.host = host
        self._batch_cmds: list[c.Command] = []
        self._batch_futs: list[Waiter] = []
        self.batch_bytes = 0  # estimated bytes of the commands not yet sealed
        # Proposal ids (node, boot, seq): the boot number changes with every start of the node.
        self.node_id = 1
        self.boot = 0
        self._seq = 0
        self._own: dict[int, _Own] = {}  # seq -> proposal not applied here yet, in seq order
        self.max_pending_proposals = 256  # raft.max_pending_proposals: entries in _own (and sealing)
        self.entry_format = c.ENTRY_VERSION  # cluster.entry_format: 1 while a rolling upgrade runs
        self._lead_seen: Any = None  # the leader our proposals were last handed to
        self.ticks = 0
        self.resend_after_ticks = 20  # a proposal not applied after this many ticks is handed over again
        # The seq of our oldest proposal that our own log (we lead) refused to take (a leadership
        # transfer in progress, too many uncommitted bytes): it and every later one wait in _own,
        # in order, until the log takes them (propose_held) or another leader is handed them all.
        self.held_from: int | None = None
        self._stamp_ms = 0  # the latest time this replica stamped forwarded entries with, as leader
        # Forwarded entries this leader put into its log, as it decoded them (checking them) for
        # its own apply: (origin, boot, seq) -> (entry, commands). At most max_pending_proposals
        # (the oldest go; an entry not found here is decoded at apply like anywhere else).
        self._forwarded: dict[tuple[int, int, int], tuple[bytes, list[c.Command]]] = {}
        self._forgotten: dict[int, _Own] = {}  # Faults.forwarder_drops_on_leader_change: never resent

    def propose(self, cmd: c.Command, want_result: bool = True) -> asyncio.Future[Any] | None:
        if self.host.failed is not None:
            if not want_result:
                # Nobody waits for it (ack reports, expiry drops, claims, QoS 0): a failed shard
                # applies nothing, and raising would only break whoever sent it, often on behalf
                # of another shard. Ack reports are sent again at restart; QoS 0 may be lost.
                return None
            raise ShardUnavailable(f"shard {self.host.shard} unavailable: {self.host.failed}")
        if len(self._own) >= self.max_pending_proposals:
            if not want_result:
                return None  # as for a failed shard: nobody waits for it, its sender repeats what matters
            raise ShardUnavailable(f"shard {self.host.shard}: {len(self._own)} proposals of this node wait for a leader "
                                   f"to commit them (raft.max_pending_proposals): refused, it entered no log")
        fut: asyncio.Future[Any] | None = asyncio.get_running_loop().create_future() if want_result else None
        if self.host.faults.dedup_at_propose_only and self._answered_here(cmd, fut):
            return fut
        self._batch_cmds.append(cmd)
        self._batch_futs.append(fut)
        if isinstance(cmd, c.Publish):
            self.batch_bytes += len(cmd.msg.payload) + 128
        return fut

    def propose_cb(self, cmd: c.Command, callback: Callback) -> None:
        """Like ``propose``, but ``callback(result, error)`` runs right at apply (or failure)."""
        if self.host.failed is not None:
            raise ShardUnavailable(f"shard {self.host.shard} unavailable: {self.host.failed}")
        if len(self._own) >= self.max_pending_proposals:
            raise ShardUnavailable(f"shard {self.host.shard}: {len(self._own)} proposals of this node wait for a leader "
                                   f"to commit them (raft.max_pending_proposals): refused, it entered no log")
        if self.host.faults.dedup_at_propose_only and self._answered_here(cmd, callback):
            return
        self._batch_cmds.append(cmd)
        self._batch_futs.append(callback)
        if isinstance(cmd, c.Publish):
            self.batch_bytes += len(cmd.msg.payload) + 128

    def propose_group(self, cmds: list[c.Command], callback: Callback) -> None:
        """Propose ``cmds`` as one group: ``callback(results, error)`` runs once, when the last is applied."""
        if self.host.failed is not None:
            raise ShardUnavailable(f"shard {self.host.shard} unavailable: {self.host.failed}")
        if len(self._own) >= self.max_pending_proposals:
            raise ShardUnavailable(f"shard {self.host.shard}: {len(self._own)} proposals of this node wait for a leader "
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

    def _propose_entry(self, cmds: list[c.Command], futs: list[Waiter]) -> None:
        self._seq += 1
        own = _Own(self._seq, c.encode_entry(cmds, self.node_id, self.boot, self._seq, self.entry_format), cmds, futs, self.ticks)
        self._own[own.seq] = own
        if self.host.proposal_lead != self._lead_seen:
            # A new leader: everything not applied yet goes to it first, in order, then this one
            # (the shard applies a node's proposals only in their order).
            self.host.check_leader(force=True)
            return
        if self.held_from is not None:
            return  # behind a proposal our log refused: proposed after it (propose_held)
        if self.host.raft.is_leader:
            try:
                self.host.raft.propose(own.data)
            except ProposalDropped:
                # It entered no log, yet it is not refused: a refusal here, after later PUBLISHes
                # of the same client were read and proposed, would let them commit before its
                # resend (moorline sim --cluster seed 10993: a message refused during a leadership
                # transfer, the next two of its topic committed first). It waits, and so does
                # everything after it, until the log takes them or another leader is given them.
                self.held_from = own.seq
                coverage.hit("proposal_held")
            return
        lead = self.host.proposal_lead
        if lead is not None:
            self.host.hooks.forward(self.host, lead[0], [own.data])

    def propose_forwarded(self, entries: list[bytes]) -> int:
        """Another member's proposals (or ours, handed over again): into the log if we lead, else
        dropped (its origin hands them to the leader it learns of; an entry applies once whoever
        proposes it). Returns how many, from the first, the log took."""
        if not self.host.raft.is_leader or self.host.failed is not None:
            return 0
        # The leader's time, never decreasing, replaces the proposer's in every command: in the
        # entry's head (a copy, nothing re-encoded), which every replica's decode gives its commands.
        self._stamp_ms = stamp = max(self._stamp_ms, self.host.hooks.now_ms())
        forwarded = self._forwarded
        for i, data in enumerate(entries):
            stamped = c.restamp_entry(data, stamp)
            # Decoded once, as every replica will: an entry no replica could decode never enters the
            # log (the error refuses the peer's frame), and this replica's apply takes the commands.
            batch = c.decode_batch(stamped)
            try:
                self.host.raft.propose(stamped)
            except ProposalDropped:
                return i  # the origin resends after resend_after_ticks
            if len(forwarded) >= self.max_pending_proposals:
                del forwarded[next(iter(forwarded))]
            forwarded[(batch.origin, batch.boot, batch.seq)] = (stamped, batch.commands)
        return len(entries)

    def take_forwarded(self, head: c.EntryHead, data: bytes) -> list[c.Command] | None:
        """The commands of a forwarded entry this leader decoded when it put ``data`` into its log
        (None: not one of those, or another copy of its proposal)."""
        if not self._forwarded:
            return None
        kept = self._forwarded.pop((head.origin, head.boot, head.seq), None)
        if kept is None or not (kept[0] is data or kept[0] == data):
            return None
        return kept[1]

    def propose_held(self) -> None:
        """Our proposals from the one our log refused: into it, in order, as far as it takes them."""
        held = self.held_from
        if held is None or not self.host.raft.is_leader or self.host.raft.lead != self._lead_seen or self.host.failed is not None:
            return
        for seq, own in self._own.items():  # ascending
            if seq < held:
                continue
            try:
                self.host.raft.propose(own.data)
            except ProposalDropped:
                self.held_from = seq
                return
            own.sent_tick = self.ticks
        self.held_from = None

    def check_admission(self) -> None:
        """The shard applies this node's proposals only under a boot after the last one it admitted
        from it, at most MAX_BOOT_JUMP after (ShardState.admit). When the admitted boot is at or
        beyond ours (an entry forged for this node, or a data directory restored from an old copy)
        or more than MAX_BOOT_JUMP behind (a crash loop), every proposal of ours would be skipped
        forever: we propose under the boot after the admitted one from then on, renumbering what
        waits (nothing of it was applied: its boot is refused), and hand it all over again."""
        last = self.host.state.proposals.get(self.node_id)
        floor = last[0] if last is not None else 0
        if floor < self.boot <= floor + MAX_BOOT_JUMP or (last is not None and last[0] == self.boot):
            return
        boot = floor + 1
        log.error("shard %d: this node's proposals are admitted only under a boot after %d, but it runs as boot "
                  "%d (an entry forged for this node, or restored data?): it proposes as boot %d from now on",
                  self.host.shard, floor, self.boot, boot)
        self.boot = boot
        owns = list(self._own.values())
        self._own = {}
        self._seq = 0
        for own in owns:
            self._seq += 1
            own.seq = self._seq
            own.data = c.encode_entry(own.commands, self.node_id, boot, own.seq, self.entry_format)
            self._own[own.seq] = own
        self.held_from = None
        if owns:
            self.host.check_leader(force=True)

    def check_leader(self, force: bool = False) -> None:
        """Hands every proposal not applied yet, in original order, to a new leader; or again to
        the same one when the oldest waited ``resend_after_ticks`` (it, or a frame carrying it, may
        have been dropped, and then nothing after it applies either)."""
        if self._forwarded and not self.host.raft.is_leader:
            self._forwarded.clear()  # no longer leading: what it logged and has not applied decodes at apply
        if not self._own:
            self._lead_seen = self.host.proposal_lead
            return
        lead = self.host.proposal_lead
        oldest = next(iter(self._own.values()))
        if not force and lead == self._lead_seen and self.ticks - oldest.sent_tick < self.resend_after_ticks:
            return
        if self.host.faults.forwarder_drops_on_leader_change and lead != self._lead_seen:
            self._forget_unapplied(keep_newest=force)
        if lead != self._lead_seen and lead is not None and self._own:
            coverage.hit("proposals_handed_to_new_leader")
        self._lead_seen = lead
        if lead is None or not self._own:
            return
        owns = list(self._own.values())
        for own in owns:
            own.sent_tick = self.ticks
        self.held_from = None  # every one of them is handed over now, in order
        if self.host.raft.is_leader:
            taken = self.host.propose_forwarded([o.data for o in owns])
            if taken < len(owns):
                self.held_from = owns[taken].seq  # the rest wait for room, in order
                coverage.hit("proposal_held")
        else:
            self.host.hooks.forward(self.host, lead[0], [o.data for o in owns])

    def settle_after_install(self) -> None:
        """Our proposals that the installed state already applied (its per-node sequence says so)
        will never be applied here: their waiters learn the outcome is unknown (a publisher is
        disconnected and resends; nothing is refused falsely). The rest stay, to be resent."""
        done = self.host.state.proposals.get(self.node_id)
        if done is None or done[0] != self.boot:
            return
        applied = [seq for seq in self._own if seq <= done[1]]
        failure = ShardUnavailable(f"shard {self.host.shard}: outcome unknown (this replica installed a snapshot)")
        for seq in applied:
            own = self._own.pop(seq)
            for fut in own.futures:
                resolve_waiter(fut, None, failure)

    def _answered_here(self, cmd: c.Command, waiter: Waiter) -> bool:
        """Faults.dedup_at_propose_only: a PUBLISH whose GUID this replica's history holds is
        answered as a duplicate here, without a proposal; any other is proposed, and the shard
        applies it without a GUID check (TopicLimits.dedup_at_propose_only)."""
        if type(cmd) is not c.Publish:
            return False
        seen = self.host.state.topics.dedup.get(cmd.principal, cmd.msg.guid)
        if seen is None:
            return False
        resolve_waiter(waiter, PublishResult("duplicate", seen[0]), None)
        return True

    def ack_appended(self, entries: list[Entry]) -> None:
        """Faults.ack_before_quorum: the publishes of our entries are answered once this replica
        synced them into its log, before a majority committed them; apply answers nobody then."""
        for e in entries:
            if e.type != EntryType.NORMAL or not e.data:
                continue
            head = c.decode_head(e.data)
            own = self._own.get(head.seq) if (head.origin, head.boot) == (self.node_id, self.boot) else None
            if own is None:
                continue
            for k, waiter in enumerate(own.futures):
                size = waiter.size if isinstance(waiter, GroupEnd) else 1
                if waiter is None or waiter is IN_GROUP or any(type(x) is not c.Publish
                                                               for x in own.commands[k + 1 - size:k + 1]):
                    continue
                ok = PublishResult("ok")
                resolve_waiter(waiter, [ok] * size if isinstance(waiter, GroupEnd) else ok, None)
                own.futures[k] = None

    def _forget_unapplied(self, keep_newest: bool) -> None:
        """Faults.forwarder_drops_on_leader_change: the proposals not applied yet (the newest,
        being proposed now, excepted) are never handed to the new leader nor resent. Those the old
        leader's log kept are answered when applied; the others never are (publish_timeout closes
        the client), and the shard skips every later proposal of this node (they apply in order)."""
        for seq in list(self._own)[:-1] if keep_newest else list(self._own):
            self._forgotten[seq] = self._own.pop(seq)

    def seal_batch(self) -> None:
        """Turn the commands proposed so far into log entries (proposed to the core, or forwarded)."""
        if self._batch_cmds:
            cmds, futs = self._batch_cmds, self._batch_futs
            self._batch_cmds, self._batch_futs = [], []
            self.batch_bytes = 0
            start = 0
            size = 0
            for i, cmd in enumerate(cmds):  # one entry per batch, split to respect max_entry_bytes
                est = len(cmd.msg.payload) + 256 if isinstance(cmd, c.Publish) else 256
                # A group stays in one entry, so its results arrive together.
                if size + est > self.host.max_entry_bytes and i > start and futs[i - 1] is not IN_GROUP:
                    self._propose_entry(cmds[start:i], futs[start:i])
                    start, size = i, 0
                size += est
            self._propose_entry(cmds[start:], futs[start:])

    def take_own_seq(self, boot: int, seq: int) -> _Own | None:
        """Our proposal (boot, seq), taken for its results (a reader feed's: reader.py)."""
        return self._own.pop(seq, None) or self._forgotten.pop(seq, None) if boot == self.boot else None

    def take_own(self, head: c.EntryHead) -> _Own | None:
        """Our proposal an entry of the log carries, taken for its apply (None: not ours, or not of this boot)."""
        return (self._own.pop(head.seq, None) or self._forgotten.pop(head.seq, None)
                if head.origin == self.node_id and head.boot == self.boot else None)

    def fail_all(self, reason: str) -> None:
        """The shard failed: every proposal waiting here, sealed or not, is answered with the failure."""
        self.held_from = None
        for own in self._own.values():
            for fut in own.futures:
                resolve_waiter(fut, None, ShardUnavailable(reason))
        self._own.clear()
        # Proposed, not sealed yet: a failed shard is never sealed again, so they would wait forever.
        batch, self._batch_cmds, self._batch_futs, self.batch_bytes = self._batch_futs, [], [], 0
        for fut in batch:
            resolve_waiter(fut, None, ShardUnavailable(reason))
