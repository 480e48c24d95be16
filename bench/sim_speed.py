"""Simulator speed.

Default: the Raft simulator, seeds per minute for 3-node schedules of 1,000 client ops, all
faults on. Usage: python bench/sim_speed.py [--seeds N] [--start S] [--nodes 3] [--ops 1000]

``--cluster``: the cluster simulator (``moorline sim --cluster``, real node code, default
build), CPU and wall seconds per seed on the given seeds, one line per seed and the mean. CPU
time (``time.process_time``) is what one core spent: on a shared machine it is the steadier
figure; compare builds on the same seeds, interleaved. docs/simulation.md ("Speed") records
the figures. Usage: python bench/sim_speed.py --cluster [--start 100] [--seeds 6] [--nodes 3]

Prints wall-clock and CPU-time rates (the machine may be shared; CPU time is what one core
spends).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def raft_sim(args: argparse.Namespace) -> None:
    from moorline.sim.simulation import SimConfig, Simulation

    wall0, cpu0 = time.monotonic(), time.process_time()
    events = ops = violations = 0
    for seed in range(args.start, args.start + args.seeds):
        r = Simulation(SimConfig(seed=seed, nodes=args.nodes, ops=args.ops, all_faults=True)).run()
        events += r.events
        ops += r.ops_started
        violations += 0 if r.ok else 1
    wall = time.monotonic() - wall0
    cpu = time.process_time() - cpu0
    print(
        f"sim_speed: {args.seeds} seeds x {args.ops} ops, {args.nodes} nodes, all faults on: "
        f"{args.seeds / wall * 60:.0f} seeds/min wall, {args.seeds / cpu * 60:.0f} seeds/min cpu "
        f"(wall {wall:.1f}s, cpu {cpu:.1f}s, {events / cpu:.0f} events/cpu-s, {ops} ops, violations {violations})"
    )


def cluster_sim(args: argparse.Namespace) -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":  # as `moorline sim --cluster`: seeds replay exactly
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    from moorline.sim.cluster.runner import run_seed

    cpus: list[float] = []
    walls: list[float] = []
    for seed in range(args.start, args.start + args.seeds):
        cpu0, wall0 = time.process_time(), time.monotonic()
        r = run_seed(seed, args.nodes)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        cpus.append(cpu)
        walls.append(wall)
        verdict = "clean" if r.ok else "violations: " + ", ".join(sorted({f.kind for f in r.findings}))
        print(f"seed {seed}: cpu {cpu:.2f} s, wall {wall:.2f} s, {r.sim_s:.1f} virtual s, "
              f"{r.steps} steps, trace {r.trace_hash}, {verdict}", flush=True)
    n = len(cpus)
    print(f"sim_speed --cluster: {n} seeds ({args.start}-{args.start + n - 1}), {args.nodes} nodes: "
          f"{sum(cpus) / n:.2f} cpu s/seed, {sum(walls) / n:.2f} wall s/seed, "
          f"{n / sum(cpus) * 60:.1f} seeds/min per core")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", action="store_true", help="the cluster simulator (real node code)")
    ap.add_argument("--seeds", type=int, default=None, help="how many seeds (30; 6 with --cluster)")
    ap.add_argument("--start", type=int, default=None, help="first seed (10000; 100 with --cluster)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--ops", type=int, default=1000, help="client ops per seed (Raft simulator)")
    args = ap.parse_args()
    if args.seeds is not None and args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.cluster:
        if args.nodes not in (3, 5):
            ap.error("--nodes must be 3 or 5 with --cluster")
        args.seeds = 6 if args.seeds is None else args.seeds
        args.start = 100 if args.start is None else args.start
        cluster_sim(args)
    else:
        args.seeds = 30 if args.seeds is None else args.seeds
        args.start = 10_000 if args.start is None else args.start
        raft_sim(args)


if __name__ == "__main__":
    main()
