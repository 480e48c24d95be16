"""Leadership of this node's groups: the Raft tick loop, moving leaders back to their
preferred nodes, and handing leadership over on a graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from moorline.raft import ProposalDropped
from moorline.raft.types import MemberId

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")
CLOCK_CHECK_EVERY_TICKS = 10  # cluster: a node whose clock is out of bound hands its leaderships over this often
REBALANCE_EVERY_TICKS = 50  # cluster: leaders move back to their preferred nodes this often (5 s)
REBALANCE_MAX_TRANSFERS = 2  # per round


class Leadership:
    """Ticks, leader rebalancing and the shutdown hand-over."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.handing_over = False  # shutting down: leaderships go away, none come back

    async def tick_loop(self) -> None:
        interval = self.node.cfg.raft.tick_interval_ms / 1000
        ticks = 0
        while not self.node.stopping.is_set():
            await asyncio.sleep(interval)
            ticks += 1
            for host in self.node.groups:
                if host.failed is None:
                    try:
                        host.tick()
                    except Exception as exc:  # a bug in one group's core stops that group, not the node
                        host.fail_on_bug("tick", exc)
                        continue
                    if host.has_work():
                        self.node.commit.kick(host.shard)
            if ticks % CLOCK_CHECK_EVERY_TICKS == 0:
                self._lead_nothing_if_clock_off()
            if ticks % REBALANCE_EVERY_TICKS == 0 and not self.handing_over:
                self._rebalance_leaders()

    def _lead_nothing_if_clock_off(self) -> None:
        """A node whose wall clock is not known to be within cluster.max_clock_offset_ms of a
        majority of the cluster (replication/clock_offset.py) stamps no entry: every leadership it
        holds goes to its most caught-up voter (docs/design.md, "Leases and clocks")."""
        link = self.node.link
        if link is None or self.node.faults.no_clock_bound or link.clocks.out_of_bound() is None:
            return
        for host in self.node.groups:
            raft = host.raft
            if host.failed is not None or not raft.is_leader or raft.lead_transferee is not None:
                continue
            others = [m for m in raft.active_conf_state.voters if m != self.node.member and m in raft.progress]
            if not others:
                continue
            best = max(others, key=lambda m: (raft.is_active(m), raft.progress[m].match))
            try:
                raft.transfer_leader(best)
            except ProposalDropped:
                continue
            self.node.commit.kick(host.shard)

    def _rebalance_leaders(self) -> None:
        """Leaders go back to each shard's preferred node (its first voter in the placement, the
        spread a fresh cluster starts with) once that node is caught up: after failures and restarts leadership
        piles up on the survivors. A few transfers per round, so a flapping node causes no storm."""
        moved = 0
        for host in self.node.groups:
            raft = host.raft
            if host.failed is not None or not raft.is_leader or raft.lead_transferee is not None:
                continue
            preferred = self.node.preferred_leader[host.shard]
            pr = raft.progress.get(preferred)
            # Caught up to the commit index is enough: transfer_leader itself catches the rest up
            # (a group with a proposal in flight at every check, e.g. housekeeping, never moved).
            if preferred == self.node.member or pr is None or not raft.is_active(preferred) or pr.match < raft.log.committed:
                continue
            if self._draining(preferred):  # about to go (edge/drain.py): leadership would only bounce back
                continue
            if self._clock_off(preferred):  # it hands leaderships straight back (clock_offset.py)
                continue
            try:
                raft.transfer_leader(preferred)
            except ProposalDropped as exc:  # refused by the core (e.g. a change in progress): next round
                log.info("shard %d: leadership not moved to its preferred node: %s", host.shard, exc)
                continue
            self.node.commit.kick(host.shard)
            moved += 1
            if moved >= REBALANCE_MAX_TRANSFERS:
                return

    def _clock_off(self, member: MemberId) -> bool:
        link = self.node.link
        return (link is not None and not self.node.faults.no_clock_bound
                and link.clocks.beyond(self.node.node_name(member[0])))

    def _draining(self, member: MemberId) -> bool:
        link = self.node.link
        return link is not None and link.peer_draining(self.node.node_name(member[0]))

    async def hand_over_leadership(self, timeout_s: float) -> None:
        """Graceful shutdown: every shard this node leads is handed to its most caught-up voter, so
        clients see a leader change rather than an election timeout. Bounded by ``timeout_s``."""
        if self.node.link is None:
            return
        self.handing_over = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            leading = [h for h in self.node.groups if h.failed is None and h.raft.is_leader]
            if not leading:
                return
            for host in leading:
                raft = host.raft
                others = [m for m in raft.active_conf_state.voters if m != self.node.member and m in raft.progress]
                if not others or raft.lead_transferee is not None:
                    continue
                best = max(others, key=lambda m: (not self._draining(m), raft.is_active(m), raft.progress[m].match))
                try:
                    raft.transfer_leader(best)
                except Exception:  # noqa: BLE001 - not leader any more, or the member is gone
                    continue
                self.node.commit.kick(host.shard)
            await asyncio.sleep(0.05)
        left = sum(1 for h in self.node.groups if h.failed is None and h.raft.is_leader)
        if left:
            log.warning("stopping while still leading %d shard(s): they elect a new leader after a timeout", left)
