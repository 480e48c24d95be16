"""The seeded fault schedule of a cluster chaos run: which nodes fail how, and when they heal.

Pure: everything comes from the ``random.Random`` passed in. The schedule never takes a majority
away: at any moment at most ``(n - 1) // 2`` nodes are faulty (killed and not yet restarted,
paused, or on the minority side of a partition), a node is never in two faults at once, and every
fault ends (restart, SIGCONT, heal) before the schedule does. The harness executes the steps one
after another in this order, so a step that runs late (a restart waiting for its node) only delays
the ones after it and never makes two faults overlap that the plan kept apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CLUSTER_FAULT_KINDS = frozenset({"kill", "truncate", "pause", "partition"})
# Faults that take nodes out for a while; ``truncate`` is a property of a kill (its damage).
EPISODE_KINDS = ("kill", "pause", "partition")


@dataclass(frozen=True)
class Episode:
    """One fault on ``nodes`` from ``start_s`` to ``end_s`` (seconds from the start of the run)."""

    kind: str  # kill | pause | partition
    nodes: tuple[str, ...]  # for a partition: the minority side, cut from every other node
    start_s: float
    end_s: float
    truncate: bool = False  # a kill: cut the node's files back to their synced length before restarting


@dataclass(frozen=True)
class Step:
    """One action of the harness: the start (``begin``) or the end of an episode."""

    at_s: float
    begin: bool
    episode: Episode


@dataclass(frozen=True)
class ScheduleTimes:
    window_start: float = 0.1  # episodes start in [window_start, window_end] x duration
    window_end: float = 0.7
    kill_down_s: tuple[float, float] = (0.5, 1.5)  # how long a killed node stays down
    pause_s: float = 3.0  # SIGSTOP to SIGCONT: longer than an election timeout (1-2 s by default)
    partition_s: float = 5.0
    gap_s: float = 1.0  # a node rests this long after an episode before its next one


def max_faulty(n: int) -> int:
    """Nodes that may be faulty at once without losing a majority."""
    return (n - 1) // 2


def plan(
    names: list[str],
    counts: dict[str, int],
    duration_s: float,
    rng: random.Random,
    truncate: bool = False,
    times: ScheduleTimes | None = None,
) -> list[Episode]:
    """``counts[kind]`` episodes of each kind in ``EPISODE_KINDS``, in a seeded order and at seeded
    moments, postponed when needed so that no more than ``max_faulty`` nodes are faulty at once."""
    t = times or ScheduleTimes()
    budget = max_faulty(len(names))
    if budget < 1:
        raise ValueError(f"a cluster of {len(names)} node(s) cannot lose any: faults need 3 or 5 nodes")
    unknown = set(counts) - set(EPISODE_KINDS)
    if unknown:
        raise ValueError(f"unknown episode kinds {sorted(unknown)}")
    kinds = [k for k in EPISODE_KINDS for _ in range(max(0, counts.get(k, 0)))]
    rng.shuffle(kinds)
    starts = sorted(rng.uniform(t.window_start, t.window_end) * duration_s for _ in kinds)
    episodes: list[Episode] = []
    clock = 0.0
    for kind, wanted in zip(kinds, starts, strict=True):
        at = max(wanted, clock)
        while True:
            busy = {n for e in episodes if e.end_s + t.gap_s > at for n in e.nodes}
            in_fault = {n for e in episodes if e.start_s <= at < e.end_s for n in e.nodes}
            free = [n for n in names if n not in busy]
            room = budget - len(in_fault)
            if room >= 1 and free:
                break
            # Wait for the first episode (with its rest) that ends after ``at``.
            at = min(e.end_s + t.gap_s for e in episodes if e.end_s + t.gap_s > at)
        size = 1 if kind != "partition" else rng.randint(1, min(room, len(free)))
        nodes = tuple(sorted(rng.sample(free, size)))
        if kind == "kill":
            hold = rng.uniform(*t.kill_down_s)
        elif kind == "pause":
            hold = t.pause_s
        else:
            hold = t.partition_s
        episodes.append(Episode(kind, nodes, at, at + hold, truncate=truncate and kind == "kill"))
        clock = at
    return episodes


def steps(episodes: list[Episode]) -> list[Step]:
    """Every episode's begin and end, in time order (an end before a begin at the same moment)."""
    out = [Step(e.start_s, True, e) for e in episodes] + [Step(e.end_s, False, e) for e in episodes]
    return sorted(out, key=lambda s: (s.at_s, s.begin))


def faulty_at(episodes: list[Episode], at_s: float) -> set[str]:
    return {n for e in episodes if e.start_s <= at_s < e.end_s for n in e.nodes}
