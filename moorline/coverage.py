"""Path counters: how often this process reached a rare path of the node (a snapshot installed, a
session taken over, a proposal held for room in the log, ...).

Always on and cheap: one dict increment, only on paths that are rare by nature. The cluster
simulator resets them before a seed and reads them after it, so that a batch of seeds proves which
rare paths it exercised (``moorline sim --cluster`` prints them; CI's seed pool must reach every
one of ``RARE_NODE_PATHS``) instead of assuming it. Not replicated state and not a metric: counts
of the whole process, whatever node (the simulator runs several in one process) reached them.
"""

from __future__ import annotations

from collections import Counter

PATHS: Counter[str] = Counter()

# The rare paths a batch of cluster-simulator seeds must reach, and what each means.
RARE_NODE_PATHS: dict[str, str] = {
    "snapshot_taken": "a replica wrote a snapshot of its shard state (log compaction)",
    "snapshot_restored": "a restarted node loaded a shard's state from its snapshot",
    "snapshot_installed": "a follower replaced its state with a leader's snapshot",
    "snapshot_sent": "a leader sent a snapshot transfer to a lagging follower",
    "wal_segment_reclaimed": "a WAL segment was deleted once every group was past it",
    "store_segment_reclaimed": "a message-store segment was reclaimed (released or copied forward)",
    "release_on_ack": "an acknowledgement report released a message from the store",
    "retention_release": "housekeeping released messages past retention that nobody was owed",
    "queue_cap_drop": "a session's queue cap dropped its oldest owed messages (counted)",
    "takeover_waited": "a CONNECT waited for the previous owner's lease (another node's session)",
    "session_replaced": "a clean start replaced the incarnation of a session",
    "owner_lease_lapsed": "a session shard ended a session whose owner's lease ran out unrenewed",
    "will_published": "a will was published",
    "read_barrier_waited": "a read barrier waited for this replica to apply up to the read index",
    "proposals_handed_to_new_leader": "unapplied proposals were handed again to a new leader, in order",
    "proposal_held": "the leader's log refused a proposal for room, and it waited in order",
}


def hit(name: str) -> None:
    PATHS[name] += 1


def reset() -> None:
    PATHS.clear()


def snapshot() -> dict[str, int]:
    return dict(PATHS)
