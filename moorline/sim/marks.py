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
    "link_stalled",
    "stale_term_append_received",
    "stale_term_suffix_truncated",
    "snapshot_over_longer_divergent_log",
    "conf_change_refused_pending",
    "removed_member_running",
    "removed_member_campaigned",
)

# Rare paths the bug switches need (a check can only see a bug on a path the run reaches): the
# coverage report counts them per run and per seed, and a standard run must reach every one
# (tests/sim/test_sim_runs.py). What each means:
RARE_PATHS: dict[str, str] = {
    "stale_term_append_received": "an append from a deposed leader reached a replica of a newer term",
    "stale_term_suffix_truncated": "a replica replaced a suffix of older-term entries with a newer leader's",
    "snapshot_over_longer_divergent_log": "a snapshot replaced a log that was longer and disagreed at its index",
    "conf_change_refused_pending": "a membership change was proposed while another was pending (refused)",
    "removed_member_running": "a removed member kept running (operator round seen)",
    "removed_member_campaigned": "a removed member asked for (pre-)votes",
    "leader_stepped_down_check_quorum": "a leader cut off from its majority stepped down",
    "torn_tail_truncated": "recovery cut a torn write at the end of the log",
    "corruption_detected": "recovery found corrupt synced data (replica quarantined)",
    "wiped_node_readded": "a node with a wiped disk came back as a new member",
    "link_stalled": "a node's outbound links stalled and delivered late",
}


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


class CoverageReport:
    """The rare paths over a run of seeds: how often each was reached, and in how many seeds."""

    def __init__(self) -> None:
        self.marks = Marks()
        self.seeds_reaching: Counter[str] = Counter()
        self.seeds = 0

    def add_seed(self, marks: Marks) -> None:
        self.seeds += 1
        self.marks.merge(marks)
        for name in RARE_PATHS:
            if marks.get(name):
                self.seeds_reaching[name] += 1

    def missing(self) -> list[str]:
        return [name for name in RARE_PATHS if not self.marks.get(name)]

    def table_lines(self) -> list[str]:
        lines = [f"  {'rare path':<36} {'times':>7} {'seeds':>6}  what"]
        for name, what in RARE_PATHS.items():
            count = self.marks.get(name)
            flag = "" if count else "   NOT REACHED"
            lines.append(f"  {name:<36} {count:>7} {self.seeds_reaching[name]:>6}  {what}{flag}")
        return lines
