"""Swarm testing: each seed draws its own fault parameters (some faults off entirely)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from moorline.sim.disk import DiskParams
from moorline.sim.network import NetParams


@dataclass(slots=True)
class FaultParams:
    net: NetParams = field(default_factory=NetParams)
    disks: list[DiskParams] = field(default_factory=list)
    partition_every_ms: int = 0  # mean time between partitions (0: off)
    partition_ms_max: int = 2_000
    crash_every_ms: int = 0
    down_ms_max: int = 1_500
    pause_every_ms: int = 0
    pause_ms_max: int = 2_000
    wipe_p: float = 0.0  # chance a restart comes back with a wiped disk
    corrupt_p: float = 0.0  # chance a crash also flips a bit in synced data
    transfer_every_ms: int = 0
    replace_every_ms: int = 0  # operator removes a healthy member and re-adds it fresh
    snapshot_every: int = 200
    keep_entries: int = 20
    clock_skews_ms: list[int] = field(default_factory=list)
    report_snapshot: bool = True
    max_entries_per_append: int = 4096
    crash_leader_p: float = 0.3  # chance a crash picks the current leader
    corrupt_mode: str = "quarantine"  # how a host handles synced corruption (see host.py)
    eager_operator: bool = False  # operator proposes every change it wants at once (see simulation.py)
    removed_linger_ms_max: int = 0  # a removed member keeps running up to this long before its wipe
    stall_every_ms: int = 0  # mean time between link stalls (a node's outbound links deliver late)
    stall_ms_max: int = 1_000
    new_leader_fault_p: float = 0.0  # chance a newly elected leader is crashed or cut off at once
    burst_every_ms: int = 0  # background load: bursts of writes to whichever node leads (0: off)
    burst_max: int = 20  # writes per burst, at most
    replace_batch: int = 1  # members the operator replaces at once (within the damage budget)

    def describe(self) -> str:
        n = self.net
        return (
            f"delay={n.delay_min_ms}+{n.delay_jitter_ms}ms drop={n.drop_p:.2f} dup={n.dup_p:.2f} "
            f"partition_every={self.partition_every_ms} crash_every={self.crash_every_ms} "
            f"pause_every={self.pause_every_ms} wipe_p={self.wipe_p:.2f} corrupt_p={self.corrupt_p:.2f} "
            f"transfer_every={self.transfer_every_ms} replace_every={self.replace_every_ms} "
            f"snapshot_every={self.snapshot_every} keep={self.keep_entries} report_snap={int(self.report_snapshot)} "
            f"max_append={self.max_entries_per_append} crash_leader_p={self.crash_leader_p} "
            f"corrupt_mode={self.corrupt_mode} eager_operator={int(self.eager_operator)} "
            f"removed_linger_max={self.removed_linger_ms_max} stall_every={self.stall_every_ms} "
            f"stall_max={self.stall_ms_max} new_leader_fault_p={self.new_leader_fault_p:.2f} "
            f"burst_every={self.burst_every_ms} burst_max={self.burst_max} replace_batch={self.replace_batch} "
            f"sync_ms={[(d.sync_latency_ms_min, d.sync_latency_ms_max) for d in self.disks]}"
        )


def draw_faults(rng: random.Random, nodes: int, all_faults: bool = False) -> FaultParams:
    """Draw one seed's fault mix: the default mix, the same for clean runs and for every bug
    switch (a mix tuned to a bug would prove nothing about the default one). ``all_faults``
    turns every fault kind on (the benchmark's worst case); otherwise each kind is on with some
    chance (swarm testing)."""

    def _on(rng: random.Random, p: float = 0.6) -> bool:
        draw = rng.random()  # always drawn, so the stream stays aligned either way
        return all_faults or draw < p

    f = FaultParams()
    f.net = NetParams(
        delay_min_ms=rng.randint(1, 3),
        delay_jitter_ms=rng.choice([0, 3, 10, 30]),
        drop_p=rng.choice([0.01, 0.05, 0.15]) if _on(rng) else 0.0,
        dup_p=rng.choice([0.02, 0.1]) if _on(rng, 0.5) else 0.0,
    )
    for _ in range(nodes):
        kind = rng.random()
        if kind < 0.5:
            f.disks.append(DiskParams(0, 1, rng.random(), rng.random()))
        elif kind < 0.85:
            f.disks.append(DiskParams(0, 5, rng.random(), rng.random()))
        else:
            f.disks.append(DiskParams(5, 60, rng.random(), rng.random()))  # slow disk
    f.partition_every_ms = rng.randint(300, 4_000) if _on(rng) else 0
    f.partition_ms_max = rng.randint(200, 3_000)
    f.crash_every_ms = rng.randint(300, 4_000) if _on(rng) else 0
    f.down_ms_max = rng.randint(10, 2_000)
    f.pause_every_ms = rng.randint(500, 5_000) if _on(rng, 0.4) else 0
    f.pause_ms_max = rng.randint(100, 3_000)
    f.wipe_p = rng.choice([0.1, 0.3]) if _on(rng, 0.3) else 0.0
    f.corrupt_p = rng.choice([0.1, 0.3]) if _on(rng, 0.3) else 0.0
    f.transfer_every_ms = rng.randint(500, 5_000) if _on(rng, 0.4) else 0
    f.replace_every_ms = rng.randint(2_000, 10_000) if _on(rng, 0.35) else 0
    f.snapshot_every = rng.choice([10, 30, 100, 500])
    f.keep_entries = rng.choice([0, 5, 50])
    f.clock_skews_ms = [rng.randint(-50, 50) for _ in range(nodes)]
    f.report_snapshot = rng.random() < 0.5
    f.max_entries_per_append = rng.choices([1, 4, 64, 4096], weights=[3, 3, 2, 2])[0]
    f.crash_leader_p = rng.choice([0.0, 0.3, 0.7])
    # "core_mark" (run the replica on its consistent prefix + mark_corrupted()) is not drawn:
    # it is unsafe with the current core (see README); SimConfig.corrupt_mode forces it
    f.corrupt_mode = "quarantine"
    f.eager_operator = rng.random() < 0.5
    f.removed_linger_ms_max = rng.choice([0, 500, 2_000])
    f.stall_every_ms = rng.randint(500, 4_000) if _on(rng, 0.5) else 0
    f.stall_ms_max = rng.randint(200, 2_500)
    f.new_leader_fault_p = rng.choice([0.3, 0.6]) if _on(rng, 0.6) else 0.0
    f.burst_every_ms = rng.randint(200, 1_500) if _on(rng, 0.5) else 0
    f.burst_max = rng.randint(5, 40)
    f.replace_batch = rng.choice([1, 2])
    return f
