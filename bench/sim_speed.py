"""Simulator speed: seeds per minute for 3-node schedules of 1,000 client ops, all faults on.

Prints wall-clock and CPU-time rates (the machine may be shared; CPU time is what one core
spends). Usage: python bench/sim_speed.py [--seeds N] [--start S] [--nodes 3] [--ops 1000]
"""

from __future__ import annotations

import argparse
import time

from moorline.sim.simulation import SimConfig, Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--start", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--ops", type=int, default=1000)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
