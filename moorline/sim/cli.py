"""``moorline sim``: run seeded fault schedules against the Raft core; replay one exactly."""

from __future__ import annotations

import time
from collections import Counter
from typing import Annotated

import typer

from moorline.sim.marks import Marks
from moorline.sim.simulation import ALL_BUGS, SeedResult, SimConfig, Simulation

TRACE_LINES = 40
PROGRESS_EVERY = 250


def _print_failure(r: SeedResult) -> None:
    typer.echo(f"VIOLATION seed={r.seed}")
    for v in r.violations:
        typer.echo(f"  {v}")
    typer.echo(f"  params: {r.params}")
    typer.echo(f"  trace (last {len(r.trace)} lines, digest {r.trace_digest:08x}):")
    for line in r.trace:
        typer.echo(f"    {line}")


def sim(
    seeds: Annotated[int, typer.Option(help="number of seeds to run")] = 100,
    start: Annotated[int, typer.Option(help="first seed")] = 0,
    nodes: Annotated[int, typer.Option(help="cluster size: 3 or 5 (1 also works)")] = 3,
    replay: Annotated[int | None, typer.Option(help="run only this seed and print its trace")] = None,
    ops: Annotated[int, typer.Option(help="client operations per seed")] = 1000,
    bug: Annotated[
        str | None,
        typer.Option(help=f"test-only broken variant: {', '.join(ALL_BUGS)}"),
    ] = None,
) -> None:
    """Deterministic simulation: seeded faults, online Raft checks, total-queue and
    linearizability checkers. Exits 1 on the first seed with a violation."""
    if bug is not None and bug not in ALL_BUGS:
        raise typer.BadParameter(f"unknown bug {bug!r}; known: {', '.join(ALL_BUGS)}")
    todo = [replay] if replay is not None else list(range(start, start + seeds))
    marks = Marks()
    faults: Counter[str] = Counter()
    ops_started = ops_ok = events = 0
    t0 = time.monotonic()
    failed: SeedResult | None = None
    ran = 0
    for seed in todo:
        r = Simulation(SimConfig(seed=seed, nodes=nodes, ops=ops, bug=bug, trace_lines=TRACE_LINES)).run()
        ran += 1
        marks.merge(r.marks)
        faults.update(r.faults)
        ops_started += r.ops_started
        ops_ok += r.ops_ok
        events += r.events
        if replay is not None:
            typer.echo(f"seed {seed}: {'ok' if r.ok else 'VIOLATION'}  params: {r.params}")
            typer.echo(f"trace (last {len(r.trace)} lines, digest {r.trace_digest:08x}):")
            for line in r.trace:
                typer.echo(f"    {line}")
        if not r.ok:
            failed = r
            break
        if ran % PROGRESS_EVERY == 0 and ran < len(todo):
            typer.echo(
                f"progress: {ran} seeds (last {seed}), {ops_started} ops, 0 violations, "
                f"{time.monotonic() - t0:.0f}s",
                err=True,
            )
    elapsed = time.monotonic() - t0
    typer.echo(
        f"seeds run: {ran}  operations: {ops_started} (ok {ops_ok})  faults injected: {sum(faults.values())} "
        f"({', '.join(f'{k}={v}' for k, v in sorted(faults.items()))})  events: {events}  "
        f"time: {elapsed:.1f}s"
    )
    typer.echo("coverage marks:")
    for line in marks.report_lines():
        typer.echo(line)
    if failed is not None:
        typer.echo(f"violations: {len(failed.violations)} (seed {failed.seed})")
        if replay is None:
            bug_opt = f" --bug {bug}" if bug else ""
            _print_failure(failed)
            typer.echo(f"  replay: moorline sim --replay {failed.seed} --nodes {nodes} --ops {ops}{bug_opt}")
        else:
            for v in failed.violations:
                typer.echo(f"  {v}")
        raise typer.Exit(code=1)
    typer.echo("violations: 0")
