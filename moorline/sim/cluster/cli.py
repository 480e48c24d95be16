"""``moorline sim --cluster``: seeds of whole clusters of real node code under the simulator.

Seeds run one after another in this process (a progress bar on a terminal, plain lines otherwise),
then a summary table: seeds, violations by kind, faults injected, virtual seconds and wall time per
seed, seeds per minute per core. A failing seed prints its violations and a one-line replay
command; ``--seed S --trace FILE`` writes that seed's whole schedule and message history.

Runs are reproducible only if Python's string hashing is: the command re-executes itself with
``PYTHONHASHSEED=0`` when it is not already set so (set iteration over strings then repeats).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import typer

from moorline.sim.cluster.runner import RunConfig, SeedResult, run_seed

CLUSTER_SIZES = (3, 5)


def ensure_fixed_hash_seed() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, "-m", "moorline", *sys.argv[1:]], env)


def known_switches() -> list[str]:
    from moorline.testing.faults import Faults

    return sorted(n for n, v in vars(Faults()).items() if v is False)


def _run_one(args: tuple[int, int, frozenset[str], Path | None, bool, bool, bool, bool, bool, str]) -> SeedResult:
    s, nodes, switches, trace, bitflips, draw_config, timed_sync, aimed_crashes, joins, learners = args
    return run_seed(s, nodes, switches, trace=trace, cfg=RunConfig(bitflips=bitflips, draw_config=draw_config,
                                                                  timed_sync=timed_sync, aimed_crashes=aimed_crashes,
                                                                  joins=joins, learners=learners))


def cluster_sim(seeds: int, start: int, nodes: int, seed: int | None, trace: Path | None,
                switches: list[str], progress_every: float, bitflips: bool = False, jobs: int = 1,
                draw_config: bool = True, verbose: bool = False, timed_sync: bool = True,
                aimed_crashes: bool = True, joins: bool = True, learners: str = "all") -> None:
    if nodes not in CLUSTER_SIZES:
        raise typer.BadParameter(f"--nodes must be 3 or 5 with --cluster, not {nodes}")
    unknown = [s for s in switches if s not in known_switches()]
    if unknown:
        raise typer.BadParameter(f"unknown --switch {', '.join(unknown)}; known: {', '.join(known_switches())}")
    if learners not in ("all", "none"):
        raise typer.BadParameter(f"--learners must be all or none, not {learners!r}")
    if trace is not None and seed is None:
        raise typer.BadParameter("--trace needs --seed (one seed's trace)")
    if not 1 <= jobs <= 64:
        raise typer.BadParameter(f"--jobs must be between 1 and 64, not {jobs}")
    ensure_fixed_hash_seed()
    from moorline.sim.cli import SeedProgress

    todo = [seed] if seed is not None else list(range(start, start + seeds))
    progress = SeedProgress(len(todo), progress_every, workers=jobs)
    results: list[SeedResult] = []
    failed: list[SeedResult] = []
    t0 = time.monotonic()
    work = [(s, nodes, frozenset(switches), trace, bitflips, draw_config, timed_sync, aimed_crashes, joins, learners)
            for s in todo]
    pool = None
    try:
        if jobs > 1 and len(todo) > 1:
            # Each seed is a whole world in one process: seeds in worker processes are independent
            # and each replays alone. Results come back in seed order.
            pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
            it = pool.map(_run_one, work)
        else:
            it = map(_run_one, work)
        for r in it:
            results.append(r)
            if verbose:  # the seed's node configuration: what it drew away from the defaults
                typer.echo(f"seed {r.seed}: config {r.tuning or 'defaults'}", err=True)
            progress.seed_done(len(r.findings))
            if not r.ok:
                failed.append(r)
                typer.echo(f"VIOLATION seed={r.seed} {sorted({f.kind for f in r.findings})}: "
                           f"replay: {r.replay_command()}", err=True)
    finally:
        progress.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    elapsed = time.monotonic() - t0
    _summary(results, failed, elapsed, jobs)
    if seed is not None:
        typer.echo(f"seed {seed}: trace hash {results[0].trace_hash}" + (f", trace in {trace}" if trace else ""))
    if failed:
        raise typer.Exit(code=1)


def _summary(results: list[SeedResult], failed: list[SeedResult], elapsed: float, jobs: int = 1) -> None:
    from rich.console import Console
    from rich.table import Table

    kinds: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    for r in results:
        kinds.update(f.kind for f in r.findings)
        faults.update({k: v for k, v in r.counts.items() if k != "records"})
    n = max(1, len(results))
    table = Table(title="moorline sim --cluster")
    table.add_column("")
    table.add_column("")
    table.add_row("seeds", f"{len(results)} ({results[0].seed}..{results[-1].seed})" if results else "0")
    table.add_row("nodes", str(results[0].nodes) if results else "-")
    table.add_row("switches", ", ".join(results[0].switches) if results and results[0].switches else "none")
    table.add_row("seeds with violations", str(len(failed)))
    table.add_row("violations by kind", ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())) or "none")
    table.add_row("faults injected", ", ".join(f"{k}={v}" for k, v in sorted(faults.items())) or "none")
    table.add_row("history records", str(sum(r.counts.get("records", 0) for r in results)))
    table.add_row("simulated seconds per seed", f"{sum(r.sim_s for r in results) / n:.1f}")
    table.add_row("wall seconds per seed", f"{sum(r.wall_s for r in results) / n:.2f}")
    table.add_row("worker processes", str(jobs))
    table.add_row("seeds per minute per worker",
                  f"{60 * len(results) / elapsed / max(1, jobs):.1f}" if elapsed > 0 else "-")
    table.add_row("wall time", f"{elapsed:.0f} s")
    Console().print(table)
    if results:
        print_coverage(results)
    for r in failed[:10]:
        typer.echo(f"VIOLATION seed={r.seed}")
        for f in r.findings[:10]:
            typer.echo(f"  {f.kind}: {f.detail}")
        typer.echo(f"  replay: {r.replay_command()}")


def path_coverage(results: list[SeedResult]) -> dict[str, tuple[int, int]]:
    """Each rare node path (moorline/coverage.py): (seeds that reached it, times reached)."""
    from moorline.coverage import RARE_NODE_PATHS

    out: dict[str, tuple[int, int]] = {}
    for name in RARE_NODE_PATHS:
        counts = [r.paths.get(name, 0) for r in results]
        out[name] = (sum(1 for n in counts if n), sum(counts))
    return out


def print_coverage(results: list[SeedResult]) -> None:
    """The rare paths this batch reached; one never reached is printed as such, not left out."""
    from rich.console import Console
    from rich.table import Table

    from moorline.coverage import RARE_NODE_PATHS

    table = Table(title="rare node paths reached")
    table.add_column("path")
    table.add_column("seeds", justify="right")
    table.add_column("times", justify="right")
    table.add_column("what")
    for name, (seeds, times) in path_coverage(results).items():
        table.add_row(name if seeds else f"[red]{name}[/red]", str(seeds), str(times), RARE_NODE_PATHS[name])
    Console().print(table)
