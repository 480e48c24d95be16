"""``Faults.dlq_count_not_replicated``: a deliberately broken build of the work queues' delivery
limit (docs/queues.md), for the cluster simulator to catch (docs/simulation.md, "Bug switches").

The broken design: the shard leader's ``$share`` dispatcher counts each message's hand-outs in its
own memory instead of in the shard's replicated state, and moves a message to the dead-letter
topic when that count reaches ``queue.max_deliveries``. Its replicated apply neither counts nor
dead-letters (``TopicLimits.dlq_count_not_replicated``), and accepts the dispatcher's
``ShareDeadLettered`` for a message it never saw reach the limit. A new leader starts counting from
zero, so across a leader change a poison message is handed out more than ``max_deliveries`` times.
"""

from __future__ import annotations

import asyncio
from typing import Any

from moorline.broker.messages import StoredMessage
from moorline.broker.share_policy import dead_letter_message


class VolatileDeliveryCounts:
    """The broken dispatcher's hand-out counts: this node's memory, one entry per message."""

    def __init__(self) -> None:
        self.handed: dict[tuple[int, str, int], int] = {}
        self._moving: set[tuple[int, str, int]] = set()

    def to_claim(self, node: Any, host: Any, reg_key: str, reg: Any, offsets: list[int]) -> list[int]:
        """``offsets`` less those this node handed out ``max_deliveries`` times already: those are
        published to the dead-letter topic and released (``ShareDeadLettered``) instead."""
        q = reg.queue
        if q is None or q.max_deliveries <= 0:
            return offsets
        shard = host.shard
        keep: list[int] = []
        dead: list[tuple[int, StoredMessage]] = []
        for o in offsets:
            key = (shard, reg_key, o)
            n = self.handed.get(key, 0)
            if n < q.max_deliveries:
                keep.append(o)
                continue
            if key in self._moving:
                continue
            msg = host.message(o)
            if msg is None:
                continue
            self._moving.add(key)
            dead.append((o, dead_letter_message(node.cfg.queue.dead_letter_topic, reg.share_group, reg.filter, shard,
                                                o, msg, n, "", node.now_ms())))
        if dead:
            node.run_in_background(asyncio.get_running_loop().create_task(self._move(node, shard, reg_key, dead)))
        return keep

    async def _move(self, node: Any, shard: int, reg_key: str, msgs: list[tuple[int, StoredMessage]]) -> None:
        try:
            await node.share.publish_dead_letters(shard, reg_key, msgs)
        finally:
            for o, _ in msgs:
                self._moving.discard((shard, reg_key, o))

    def claimed(self, shard: int, reg_key: str, assigned: dict[str, list[int]]) -> None:
        for offsets in assigned.values():
            for o in offsets:
                key = (shard, reg_key, o)
                self.handed[key] = self.handed.get(key, 0) + 1
