"""``moorline sim``: run seeded fault schedules against the Raft core; replay one exactly."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer

from moorline.sim.marks import CoverageReport
from moorline.sim.simulation import ALL_BUGS, SeedResult, SimConfig, Simulation

TRACE_LINES = 40
SIM_CLUSTER_SIZES = (1, 3, 5)  # what draw_faults models: odd voter counts a shard may have


ESTIMATE_FROM_S = 60.0  # a run estimated shorter than this gets no estimate line


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class SeedProgress:
    """Seeds done, violations so far and seeds per second, on stderr (stdout keeps the results).

    On a terminal a rich progress bar; otherwise (a log, CI, a pipe) a plain line every
    ``every_s`` seconds (0: after every seed) and a last one at the end."""

    def __init__(
        self,
        total: int,
        every_s: float,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        workers: int = 1,
    ) -> None:
        self.total = total
        self.workers = workers  # seeds run at once (--jobs): the estimate divides by them
        self.every_s = every_s
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = clock()
        self.last_line = self.started
        self.done = 0
        self.shown_done = -1  # seeds done at the last plain line
        self.violations = 0
        self._bar: Any = None
        self._task: Any = None
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("sim"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("seeds  {task.fields[violations]} violations  {task.fields[rate]:.2f} seeds/s"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
                redirect_stdout=False,  # results stay on stdout, the bar alone on stderr
                redirect_stderr=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("sim", total=total, violations=0, rate=0.0)

    def rate(self) -> float:
        elapsed = self.clock() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def seed_done(self, violations: int) -> None:
        self.done += 1
        self.violations += violations
        if self.done == 1 and self.total > 1:
            self._estimate()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, violations=self.violations, rate=self.rate())
        elif self.clock() - self.last_line >= self.every_s and self.done < self.total:
            self._line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.done != self.shown_done or self.done == 0:
            self._line()

    def _estimate(self) -> None:
        """After the first seed, how long all of them will take, when that is a minute or more
        (seeds differ, and so does a loaded machine: a rough figure, said once)."""
        first = self.clock() - self.started
        rounds = -(-self.total // max(1, self.workers))  # seeds one worker runs after the other
        total_s = first * rounds
        if total_s < ESTIMATE_FROM_S:
            return
        text = (f"sim: the first seed took {first:.1f} s here: {self.total} seeds will take about "
                f"{_duration(total_s)}" + (f" on {self.workers} workers" if self.workers > 1 else "")
                + " (fewer: --seeds N)")
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _line(self) -> None:
        self.last_line = self.clock()
        self.shown_done = self.done
        print(
            f"sim: {self.done}/{self.total} seeds, {self.violations} violations, {self.rate():.2f} seeds/s, "
            f"{self.last_line - self.started:.0f} s",
            file=self.stream,
            flush=True,
        )


def _print_failure(r: SeedResult) -> None:
    typer.echo(f"VIOLATION seed={r.seed}")
    for v in r.violations:
        typer.echo(f"  {v}")
    typer.echo(f"  params: {r.params}")
    typer.echo(f"  trace (last {len(r.trace)} lines, digest {r.trace_digest:08x}):")
    for line in r.trace:
        typer.echo(f"    {line}")


def replay_command(seed: int, nodes: int, ops: int, bug: str | None, rule_checks: bool) -> str:
    """The one-line command that runs ``seed`` again and prints its every message and vote."""
    extra = (f" --bug {bug}" if bug else "") + ("" if rule_checks else " --no-rule-checks")
    return f"moorline sim --replay {seed} --nodes {nodes} --ops {ops}{extra} --verbose"


def sim(
    seeds: Annotated[int, typer.Option(help="number of seeds to run")] = 100,
    start: Annotated[int, typer.Option(help="first seed")] = 0,
    nodes: Annotated[int, typer.Option(help="cluster size: 1, 3 or 5")] = 3,
    replay: Annotated[int | None, typer.Option(help="run only this seed and print its trace")] = None,
    ops: Annotated[int, typer.Option(help="client operations per seed")] = 1000,
    bug: Annotated[
        str | None,
        typer.Option(help=f"test-only broken variant: {', '.join(ALL_BUGS)}"),
    ] = None,
    progress_every: Annotated[
        float,
        typer.Option(help="seconds between progress lines when stderr is not a terminal (0: every seed)"),
    ] = 10.0,
    rule_checks: Annotated[
        bool,
        typer.Option(help="also run checks that restate a core rule (the commit rule); off: effect checks only"),
    ] = True,
    verbose: Annotated[
        bool, typer.Option(help="with --replay: print every Raft message (and its fate), vote and trace line")
    ] = False,
    verbose_max_lines: Annotated[int, typer.Option(help="with --verbose: stop printing after this many lines")] = 50_000,
    cluster: Annotated[bool, typer.Option(help="whole clusters of real node code (not the Raft core alone)")] = False,
    seed: Annotated[int | None, typer.Option(help="--cluster: run only this seed")] = None,
    trace: Annotated[Path | None, typer.Option(help="--cluster --seed: write its schedule and history here")] = None,
    switch: Annotated[list[str] | None, typer.Option(help="--cluster: a test-only broken build (Faults field)")] = None,
    bitflips: Annotated[bool, typer.Option(help="--cluster: crashes may also flip a bit of synced data")] = False,
    jobs: Annotated[int, typer.Option(help="--cluster: seeds run in this many worker processes at once")] = 1,
    draw_config: Annotated[
        bool, typer.Option("--draw-config/--no-draw-config",
                           help="--cluster: each seed draws its node configuration (tiny snapshot intervals, "
                                "segments, retention, caps, leases; docs/simulation.md); off: production defaults")
    ] = True,
    timed_sync: Annotated[
        bool, typer.Option("--timed-sync/--no-timed-sync",
                           help="--cluster: each WAL sync takes drawn virtual time beside the node's loop; "
                                "a crash may fall inside it; off: syncs are inline")
    ] = True,
    aimed_crashes: Annotated[
        bool, typer.Option("--aimed-crashes/--no-aimed-crashes",
                           help="--cluster: some crashes fire right after a node's next vote grant, append "
                                "response, PUBACK or PUBREC")
    ] = True,
    joins: Annotated[
        bool, typer.Option("--joins/--no-joins",
                           help="--cluster, with the whole default mix: a new node joins the running cluster, "
                                "and a forgotten node is wiped and joins again (replace)")
    ] = True,
    learners: Annotated[
        str, typer.Option(help="--cluster: shard.learners of every node: 'none' stores each shard on its "
                               "voters only (the other nodes read it through their reader feeds), 'all' on "
                               "every node")
    ] = "all",
) -> None:
    """Deterministic simulation: seeded faults, online Raft checks, total-queue and
    linearizability checkers. Exits 1 on the first seed with a violation. With --cluster: whole
    clusters of moorline nodes, model MQTT clients and history checkers (moorline/sim/cluster)."""
    if cluster:
        from moorline.sim.cluster.cli import cluster_sim

        cluster_sim(seeds, start, nodes, seed, trace, switch or [], progress_every, bitflips, jobs,
                    draw_config=draw_config, verbose=verbose, timed_sync=timed_sync, aimed_crashes=aimed_crashes,
                    joins=joins, learners=learners)
        return
    if bug is not None and bug not in ALL_BUGS:
        raise typer.BadParameter(f"unknown bug {bug!r}; known: {', '.join(ALL_BUGS)}")
    if verbose and replay is None:
        raise typer.BadParameter("--verbose needs --replay SEED (it prints one seed's every message)")
    if verbose_max_lines < 1:
        raise typer.BadParameter("--verbose-max-lines must be at least 1")
    if nodes not in SIM_CLUSTER_SIZES:
        # Checked here, before any seed runs: the simulation would otherwise raise from inside its
        # first seed and show a traceback instead of a usage error.
        raise typer.BadParameter(f"--nodes must be 1, 3 or 5, not {nodes}")
    if progress_every < 0:
        raise typer.BadParameter("--progress-every must be 0 or more seconds")
    todo = [replay] if replay is not None else list(range(start, start + seeds))
    coverage = CoverageReport()
    faults: Counter[str] = Counter()
    ops_started = ops_ok = events = 0
    t0 = time.monotonic()
    failed: SeedResult | None = None
    ran = 0
    progress = SeedProgress(len(todo), progress_every)
    try:
        for seed in todo:
            cfg = SimConfig(
                seed=seed,
                nodes=nodes,
                ops=ops,
                bug=bug,
                trace_lines=TRACE_LINES,
                rule_checks=rule_checks,
                verbose=typer.echo if verbose else None,
                verbose_max_lines=verbose_max_lines,
            )
            r = Simulation(cfg).run()
            ran += 1
            progress.seed_done(len(r.violations))
            coverage.add_seed(r.marks)
            faults.update(r.faults)
            ops_started += r.ops_started
            ops_ok += r.ops_ok
            events += r.events
            if replay is not None:
                typer.echo(f"seed {seed}: {'ok' if r.ok else 'VIOLATION'}  params: {r.params}")
                if verbose:  # every line was printed as it happened
                    typer.echo(f"trace digest {r.trace_digest:08x}")
                else:
                    typer.echo(f"trace (last {len(r.trace)} lines, digest {r.trace_digest:08x}):")
                    for line in r.trace:
                        typer.echo(f"    {line}")
            if not r.ok:
                failed = r
                break
    finally:
        progress.close()
    elapsed = time.monotonic() - t0
    typer.echo(
        f"seeds run: {ran}  operations: {ops_started} (ok {ops_ok})  faults injected: {sum(faults.values())} "
        f"({', '.join(f'{k}={v}' for k, v in sorted(faults.items()))})  events: {events}  "
        f"time: {elapsed:.1f}s"
    )
    typer.echo(f"coverage of rare paths ({coverage.seeds} seeds):")
    for line in coverage.table_lines():
        typer.echo(line)
    typer.echo("coverage marks:")
    for line in coverage.marks.report_lines():
        typer.echo(line)
    if failed is not None:
        typer.echo(f"violations: {len(failed.violations)} (seed {failed.seed})")
        if replay is None:
            _print_failure(failed)
        else:
            for v in failed.violations:
                typer.echo(f"  {v}")
        typer.echo(f"  replay: {replay_command(failed.seed, nodes, ops, bug, rule_checks)}")
        raise typer.Exit(code=1)
    typer.echo("violations: 0")
