"""Housekeeping (leader-stamped times): retention, $share timers, wills and expiry rounds, pins,
follow-ups derived from replicated state (lost ack reports, ghost registrations); snapshots when
due and WAL / store reclaim."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.queries import all_sessions
from moorline.broker.session_state import lease_lapsed
from moorline.node.errors import NodeFailure, ShardUnavailable
from moorline.node.replication.shard_host import ShardHost
from moorline.node.sessions.followups import FollowUps
from moorline.raft import ProposalDropped

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")


class Housekeeping:
    """The housekeeping loop, snapshots when due, reclaim."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.followups = FollowUps(node)  # lost ack reports, ghost registrations (sessions/followups.py)

    def after_commit(self) -> None:
        for host in self.node.hosts:
            if host.failed is None and host.wants_snapshot():
                host.start_snapshot()  # off the loop; _snapshot_saved marks it in the WAL

    def snapshot_saved(self, host: ShardHost, index: int, term: int) -> None:
        """A snapshot is durable (file and store records): the WAL may drop the group's entries up to it."""
        self.node.wal.mark_snapshot(host.shard, index, term)
        if self.node.serving:
            self.node.commit.kick(host.shard)

    def snapshot_installed(self, host: ShardHost) -> None:
        """A replica installed its leader's snapshot: what sessions here were told to deliver from
        the old state is reloaded from the new one; its Ready (the snapshot) goes to the WAL next."""
        self.node.commit.kick(host.shard)
        self.node.registry.views.clear()
        for live in list(self.node.live.values()):
            sess = live.session()
            if sess is not None and not live.closed:
                live.load_pending(sess)
                live.wake()

    async def run(self) -> None:
        interval = self.node.cfg.shard.housekeeping_interval_s
        while not self.node.stopping.is_set():
            await asyncio.sleep(interval)
            now = self.node.now_ms()
            for host in self.node.hosts:
                if host.failed is not None or not host.raft.is_leader:
                    self.followups.forget(host.shard)
                    continue  # leader-proposed: entry times are the leader's, and proposed once
                try:
                    t = host.state.topics
                    if t.meta or t.dedup:
                        # Readers' pins are shard state (admin/pins.py): each shard applies its own.
                        self.node.propose_lazy(host.shard, c.Housekeeping(now, -1))
                    self.node.share.timers(host, now)
                    sessions = all_sessions(host.state.sessions)
                    if any(lease_lapsed(s, now) for s in sessions):
                        coverage.hit("owner_lease_lapsed")
                    if any(not s.connected or lease_lapsed(s, now) for s in sessions):
                        await self.node.lifecycle.session_housekeeping(host.shard)  # wills due, expiry, owners gone
                    self.followups.run(host)  # derived from the replicas: lost ack reports, ghosts
                except (ShardUnavailable, ProposalDropped, NodeFailure) as exc:
                    # One shard's trouble (a failed will publish, a full proposal queue) must not
                    # stop retention and reclaim for every other shard: it is tried next round.
                    log.warning("shard %d: housekeeping deferred: %s", host.shard, exc)
            self.node.follow_leader_interest()  # sessions the leader-side work above reads, followed
            self.node.ack_timeouts.run(now)  # members connected here holding messages past queue.ack_timeout_s
            self.node.share.prune_rr()
            self.reclaim()

    def reclaim(self) -> None:
        try:
            if len(self.node.wal.segment_paths()) > 2:
                # Idle groups pin old segments: snapshot them so the segments can go.
                for shard in self.node.wal.groups_pinning_oldest_segment():
                    host = self.node.groups[shard] if shard < len(self.node.groups) else None
                    if host is not None and host.failed is None:
                        host.start_snapshot()  # _snapshot_saved marks it in the WAL
            if self.node.wal.reclaim():
                coverage.hit("wal_segment_reclaimed")
            for host in self.node.groups:
                if host.store.reclaim():
                    coverage.hit("store_segment_reclaimed")
        except OSError as exc:
            log.error("reclaim failed: %s", exc)
