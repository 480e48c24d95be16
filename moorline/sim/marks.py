"""Coverage marks (TigerBeetle style): count how often rare paths were reached.

A test can assert that a mark was hit, so the simulator cannot silently stop reaching the
paths it claims to exercise.
"""

from __future__ import annotations

from collections import Counter

# Marks the README promises; printed (with zero counts) so a silent gap is visible.
KNOWN_MARKS: tuple[str, ...] = (
    "leader_elected",
    "leader_stepped_down",
    "leader_stepped_down_check_quorum",
    "leadership_transferred",
    "snapshot_sent",
    "snapshot_installed",
    "log_compacted",
    "torn_tail_truncated",
    "unsynced_writes_lost",
    "corruption_detected",
    "corrupted_replica_removed",
    "wiped_node_restarted",
    "wiped_node_readded",
    "learner_promoted",
    "conf_change_applied",
    "read_index_served",
    "queue_dedup_at_apply",
    "queue_redelivery_after_expiry",
    "client_retry",
    "partition_started",
    "node_crashed",
    "node_paused",
    "proposal_dropped",
)


class Marks:
    """A counter of named marks; cheap enough to call on hot paths."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def hit(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def merge(self, other: Marks) -> None:
        self.counts.update(other.counts)

    def get(self, name: str) -> int:
        return self.counts.get(name, 0)

    def report_lines(self) -> list[str]:
        names = list(KNOWN_MARKS) + sorted(n for n in self.counts if n not in KNOWN_MARKS)
        return [f"  {name:<36} {self.counts.get(name, 0)}" for name in names]
