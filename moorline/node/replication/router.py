"""Commands into the node's Raft groups (the propose API every other part uses) and Raft
traffic between this node's groups and the cluster link. Each proposal kicks group commit."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING, Any

from moorline.broker import commands as c
from moorline.invariant import InvariantViolation
from moorline.node.errors import ShardUnavailable
from moorline.node.replication import reader_feed as rf
from moorline.node.replication.proposer import outcome_within
from moorline.node.replication.shard_host import ShardHost
from moorline.raft import Message
from moorline.raft.types import MessageType

_FROM_LEADER = (MessageType.APP, MessageType.SNAP, MessageType.HEARTBEAT)

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")


class GroupRouter:
    """The node's propose API and Raft message routing."""

    def __init__(self, node: Node) -> None:
        self.node = node
        seed = node.faults.cross_shard_chaos_seed
        self._chaos = random.Random(seed) if seed is not None else None

    def send_raft(self, host: ShardHost, msgs: list[Message]) -> None:
        if self.node.link is not None:
            self.node.link.send(host.shard, msgs)

    def forward(self, host: ShardHost, node_id: int, entries: list[bytes]) -> None:
        if self.node.link is not None:
            self.node.link.forward(host.shard, node_id, entries)

    def on_raft_message(self, shard: int, m: Message) -> None:
        if not 0 <= shard < len(self.node.groups):
            return  # groups not open yet (bootstrap), or a group this node does not have
        host = self.node.groups[shard]
        if host.failed is not None or not self.node.serving:
            return  # not serving yet: the sender retransmits
        reader = host.reader
        if reader is not None and m.type in _FROM_LEADER:  # (shard.learners = "none" only: not per message otherwise)
            host.leader_heard_at = self.node.clock.monotonic()
            if reader.active:
                reader.become_member()  # added to the group: its log replaces the feed, from nothing
        try:
            host.raft.step(m)
        except InvariantViolation as exc:  # our core broke its own rule: this group stops, as for corruption
            host.fail_on_bug("raft step", exc)
            return
        except Exception as exc:  # a peer's message must never take a group (or the node) down
            log.warning("shard %d: dropped a raft message from %r: %s", shard, m.from_, exc)
            return
        if host.raft.has_ready():
            self.node.commit.kick(shard)

    def on_forwarded(self, shard: int, entries: list[bytes]) -> None:
        if 0 <= shard < len(self.node.groups) and self.node.serving:
            self.node.groups[shard].propose_forwarded(entries)
            self.node.commit.kick(shard)

    def on_reader(self, peer: int, data: bytes) -> None:
        """A reader feed's message (reader_feed.py): to the shard's feeds (we lead it) or its reader."""
        if not self.node.serving:
            return  # the reader asks again, the leader sends again
        msg = rf.decode_msg(data)  # a malformed one refuses the peer's frame (cluster_link)
        if not 0 <= msg.shard < len(self.node.hosts):
            return
        host = self.node.hosts[msg.shard]
        if type(msg) in (rf.Items, rf.NotLeader, rf.GroupInfo):
            if host.reader is not None:
                host.reader.on_message(peer, msg)  # type: ignore[arg-type]
        elif host.feeds is not None:
            host.feeds.on_message(peer, msg)
        self.node.commit.kick(msg.shard)

    def propose(self, shard: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any] | None:
        """``cmd`` into group ``shard`` (a shard, or ``meta_group`` for the metadata group)."""
        host = self.node.groups[shard]
        fut = host.propose(cmd, want)
        self.node.commit.kick(shard)
        return fut

    def read_barrier(self, shard: int) -> asyncio.Future[None]:
        """``ShardHost.read_barrier`` of ``shard``: this node's replica as of the group's commit now."""
        fut = self.node.groups[shard].read_barrier()
        self.node.commit.kick(shard)
        return fut

    def propose_lazy(self, shard: int, cmd: c.Command, want: bool = False) -> asyncio.Future[Any] | None:
        """A command nobody waits for and whose delay costs nothing but a later release (ack
        reports, QoS 1 session acks, housekeeping): it never forces a sync of its own, it rides on
        the next one somebody waits for, or goes after ``storage.lazy_sync_delay_ms``."""
        fut = self.node.groups[shard].propose(cmd, want)
        self.node.commit.kick_lazy(shard)
        return fut

    def propose_cb(self, shard: int, cmd: c.Command, callback: Any) -> None:
        self.node.groups[shard].propose_cb(cmd, callback)
        self.node.commit.kick(shard)

    def propose_group(self, shard: int, cmds: list[c.Command], callback: Any) -> None:
        """Propose ``cmds`` together; ``callback(results, error)`` runs once, after the last applies."""
        self.node.groups[shard].propose_group(cmds, callback)
        self.node.commit.kick(shard)

    def propose_cross(self, shard: int, cmd: c.Command) -> asyncio.Future[Any]:
        """A command caused by another shard. The test-only chaos switch delays and reorders them."""
        if self._chaos is None:
            fut = self.node.propose(shard, cmd)
            assert fut is not None
            return fut
        loop = asyncio.get_running_loop()
        outer: asyncio.Future[Any] = loop.create_future()
        delay = self._chaos.random() * 0.02

        def fire() -> None:
            inner = self.node.propose(shard, cmd)
            assert inner is not None
            inner.add_done_callback(
                lambda f: outer.set_exception(f.exception())  # type: ignore[arg-type]
                if f.exception() is not None else outer.set_result(f.result())
            )

        loop.call_later(delay, fire)
        return outer

    async def bounded(self, fut: asyncio.Future[Any], shard: int) -> Any:
        """A command's result within mqtt.control_timeout_s, else ShardUnavailable (a shard without
        a quorum commits nothing: the request is answered with a failure instead of hanging)."""
        limit = self.node.cfg.mqtt.control_timeout_s
        try:
            return await outcome_within(fut, limit)
        except TimeoutError:
            where = f"shard {shard}" if shard >= 0 else "a shard"
            raise ShardUnavailable(f"{where} committed nothing within {limit:g} s (no quorum?)") from None
