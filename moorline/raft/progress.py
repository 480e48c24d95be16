"""The leader's view of one follower: how far it matches and how to send it more (flow control).

States: PROBE (one append per heartbeat until a match is found), REPLICATE (optimistic
pipelining, at most ``max_inflight`` appends outstanding), SNAPSHOT (waiting for a snapshot to
be installed; no appends).
"""

from __future__ import annotations

import enum
from collections import deque

from moorline.invariant import invariant


class ProgressState(enum.IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Progress:
    __slots__ = (
        "match",
        "next",
        "state",
        "pending_snapshot",
        "recent_active",
        "active_last_period",
        "probe_sent",
        "inflights",
        "max_inflight",
        "is_learner",
        "pending_commit",
        "snapshot_ticks",
    )

    def __init__(self, next_index: int, max_inflight: int, is_learner: bool) -> None:
        self.match = 0
        self.next = next_index
        self.state = ProgressState.PROBE
        self.pending_snapshot = 0
        self.recent_active = False
        # Whether it was heard from during the last whole check-quorum period: recent_active is
        # cleared at each period's start, so on its own it reads False just after the reset.
        self.active_last_period = False
        self.probe_sent = False  # PROBE: an append is out, wait for a response or a heartbeat
        self.inflights: deque[int] = deque()  # last index of each in-flight append (REPLICATE)
        self.max_inflight = max_inflight
        self.is_learner = is_learner
        self.pending_commit = 0  # highest commit index already sent (< next)
        self.snapshot_ticks = 0  # ticks spent in SNAPSHOT state (a lost snapshot is retried)

    def _reset(self, state: ProgressState) -> None:
        self.state = state
        self.snapshot_ticks = 0
        self.probe_sent = False
        self.pending_snapshot = 0
        self.inflights.clear()

    def become_probe(self) -> None:
        # After a snapshot the follower is known to have at least the snapshot's index.
        if self.state == ProgressState.SNAPSHOT:
            pending = self.pending_snapshot
            self._reset(ProgressState.PROBE)
            self.next = max(self.match + 1, pending + 1)
        else:
            self._reset(ProgressState.PROBE)
            self.next = self.match + 1
        self.pending_commit = min(self.pending_commit, self.next - 1)

    def become_replicate(self) -> None:
        self._reset(ProgressState.REPLICATE)
        self.next = self.match + 1
        self.pending_commit = min(self.pending_commit, self.match)

    def become_snapshot(self, snapshot_index: int) -> None:
        self._reset(ProgressState.SNAPSHOT)
        self.pending_snapshot = snapshot_index

    def maybe_update(self, n: int) -> bool:
        """An append up to ``n`` was acknowledged; False if the ack is stale."""
        if n <= self.match:
            return False
        self.match = n
        self.probe_sent = False
        if self.next < n + 1:
            self.next = n + 1
        invariant(self.match < self.next, "progress: match must stay below next")
        return True

    def maybe_decr_to(self, rejected: int, match_hint: int) -> bool:
        """An append at ``rejected`` was refused; move ``next`` back. False if stale."""
        if self.state == ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            self.pending_commit = min(self.pending_commit, self.match)
            return True
        # Probes go one at a time, so a genuine rejection is for exactly next - 1.
        if self.next - 1 != rejected:
            return False
        self.next = max(min(rejected, match_hint + 1), self.match + 1)
        self.pending_commit = min(self.pending_commit, self.next - 1)
        self.probe_sent = False
        return True

    def sent_entries(self, last_index: int) -> None:
        """An append carrying entries up to ``last_index`` was sent."""
        if self.state == ProgressState.REPLICATE:
            self.next = last_index + 1
            self.inflights.append(last_index)
        else:
            self.probe_sent = True

    def free_le(self, index: int) -> None:
        infl = self.inflights
        while infl and infl[0] <= index:
            infl.popleft()

    def inflight_full(self) -> bool:
        return len(self.inflights) >= self.max_inflight

    def is_paused(self) -> bool:
        if self.state == ProgressState.PROBE:
            return self.probe_sent
        if self.state == ProgressState.REPLICATE:
            return len(self.inflights) >= self.max_inflight
        return True

    def describe(self) -> str:
        parts = [f"{self.state.name} match={self.match} next={self.next}"]
        if self.is_learner:
            parts.append("learner")
        if self.is_paused():
            parts.append("paused")
        if self.pending_snapshot:
            parts.append(f"pendingSnap={self.pending_snapshot}")
        if not self.recent_active:
            parts.append("inactive")
        if self.inflights:
            parts.append(f"inflight={len(self.inflights)}" + ("[full]" if self.inflight_full() else ""))
        return " ".join(parts)
