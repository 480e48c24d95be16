"""Coalescing heartbeats of many Raft groups between the same two nodes (pure).

Every shard is a Raft group, and every leader heartbeats each follower every tick; between two
nodes that is one tiny message per shard per tick. The host collects the heartbeats (and
heartbeat responses) of all its groups bound for one node into a single ``HeartbeatBatch``
that keeps each group's (term, commit, context), sends it on the control stream, and the
receiver ``expand``s it back into per-group messages and steps each into its group. Because
every item is stepped into its own group, check-quorum stays per group: a group's leader sees
exactly the responses of its own followers.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from moorline.raft.types import MemberId, Message, MessageType

GroupId = int | str

_COALESCED = (MessageType.HEARTBEAT, MessageType.HEARTBEAT_RESP)


class HeartbeatItem(msgspec.Struct, array_like=True, gc=False):
    group: GroupId
    response: bool
    from_: MemberId
    to: MemberId
    term: int
    commit: int
    context: bytes = b""


class HeartbeatBatch(msgspec.Struct, array_like=True):
    """All heartbeats (and responses) from node ``src`` to node ``dst`` in one host pass."""

    src: int
    dst: int
    items: list[HeartbeatItem]


def coalesce(
    src: int, outgoing: Iterable[tuple[GroupId, Message]], max_items: int = 4096
) -> tuple[list[HeartbeatBatch], list[tuple[GroupId, Message]]]:
    """Split ``outgoing`` into heartbeat batches per destination node (at most ``max_items``
    each) and the remaining messages, whose order is kept."""
    batches: dict[int, list[HeartbeatBatch]] = {}
    rest: list[tuple[GroupId, Message]] = []
    for group, m in outgoing:
        if m.type not in _COALESCED:
            rest.append((group, m))
            continue
        dst = m.to[0]
        per_dst = batches.setdefault(dst, [])
        if not per_dst or len(per_dst[-1].items) >= max_items:
            per_dst.append(HeartbeatBatch(src=src, dst=dst, items=[]))
        per_dst[-1].items.append(
            HeartbeatItem(
                group=group,
                response=m.type == MessageType.HEARTBEAT_RESP,
                from_=m.from_,
                to=m.to,
                term=m.term,
                commit=m.commit,
                context=m.context,
            )
        )
    flat = [b for dst in sorted(batches) for b in batches[dst]]
    return flat, rest


def expand(batch: HeartbeatBatch) -> list[tuple[GroupId, Message]]:
    """The per-group messages a batch stands for, in the order they were batched."""
    out: list[tuple[GroupId, Message]] = []
    for it in batch.items:
        t = MessageType.HEARTBEAT_RESP if it.response else MessageType.HEARTBEAT
        out.append(
            (
                it.group,
                Message(type=t, from_=it.from_, to=it.to, term=it.term, commit=it.commit, context=it.context),
            )
        )
    return out
