"""Read barriers (Raft read index) of one replica: a read asked now resolves once this replica
applied everything the group had committed when it was asked, as the leader's quorum confirms."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from moorline import coverage
from moorline.raft import ProposalDropped, Ready

if TYPE_CHECKING:
    from moorline.node.replication.shard_host import ShardHost


READS_ASKED_MAX = 1024  # read barriers asked and not yet answered, per group (the oldest past it fail)


class ReadBarriers:
    """The read barriers of one replica (``ShardHost.reads``)."""

    def __init__(self, host: ShardHost) -> None:
        self.host = host
        # Read barriers (Raft read index): asked, by context; then confirmed, waiting for the apply.
        self.asked: dict[bytes, asyncio.Future[None]] = {}
        self.confirmed: list[tuple[int, asyncio.Future[None]]] = []
        self._seq = 0

    def ask(self) -> asyncio.Future[None]:
        """Resolves once this replica has applied everything the group had committed when it was
        asked (Raft read index, confirmed by the leader's quorum). A replica that was down, cut off
        or is replaying its log reads as of then, not as of its own past. Raises ProposalDropped
        when no leader is known (or too many reads wait); the caller bounds the wait."""
        self._seq += 1
        ctx = b"rb" + self.host.node_id.to_bytes(4, "big") + self.host.boot.to_bytes(8, "big") + self._seq.to_bytes(8, "big")
        self.host.raft.read_index(ctx)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.asked[ctx] = fut
        return fut

    def serve(self, rd: Ready) -> None:
        for rs in rd.read_states:
            fut = self.asked.pop(rs.ctx, None)
            if fut is not None and not fut.done():
                self.confirmed.append((rs.index, fut))
        if self.confirmed:
            applied = self.host.state.applied_index
            waiting = []
            for index, fut in self.confirmed:
                if fut.done():
                    continue
                if index <= applied:
                    fut.set_result(None)
                else:
                    coverage.hit("read_barrier_waited")
                    waiting.append((index, fut))
            self.confirmed = waiting
        if len(self.asked) > READS_ASKED_MAX:  # answers lost with a leader change: forget the oldest
            for ctx in list(self.asked)[: len(self.asked) - READS_ASKED_MAX]:
                fut = self.asked.pop(ctx)
                if not fut.done():
                    fut.set_exception(ProposalDropped("read index not answered"))
