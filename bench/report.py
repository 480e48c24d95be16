"""Rich tables for a finished run (the same dict that is written as JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

QUICK_LABEL = "not comparable (--quick: few messages, one repetition)"


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def target_format(label: str) -> str:
    """How a target's figures are printed (and so compared)."""
    return ",.0f" if "msgs/s" in label else ".3f"


def target_met(value: float | None, op: str, bound: float | None, fmt: str) -> bool | None:
    """Whether a figure meets its bound, compared as both are printed: a figure that prints as
    its bound meets it (``2.000 <= 2.000`` is met, also when the unrounded figure is 2.0004)."""
    if value is None or bound is None:
        return None
    shown, limit = (float(format(x, fmt).replace(",", "")) for x in (value, bound))
    if op == "<=":
        return shown <= limit
    if op == ">=":
        return shown >= limit
    raise ValueError(f"unknown comparison {op!r}")


def met_label(row: dict[str, Any], quick: bool) -> str:
    """The "met" cell of a target row: a --quick run's figures are not comparable with the targets."""
    if quick:
        return f"[yellow]{QUICK_LABEL}[/yellow]"
    return {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[row["met"]]


def mark_quick(comparison: dict[str, Any]) -> None:
    """In a --quick run's JSON, targets carry no verdict: ``met`` null, ``comparable`` false."""
    for row in comparison["targets"]:
        row["met"] = None
        row["comparable"] = False


def _row_figures(block: dict[str, Any]) -> dict[str, Any] | None:
    return block.get("median") or block.get("max") or block.get("run")


def print_report(console: Console, report: dict[str, Any]) -> None:
    results: dict[str, Any] = report["results"]
    config = report["config"]
    titles = {
        "w1": f"W1: QoS 1, {config['w1']['payload_bytes']} B x {config['w1']['messages']:,}, 1 pub -> 1 sub, "
        f"window {config['w1']['window']}, median of {config['reps']}",
        "w2": f"W2: QoS 1, {config['w2']['payload_bytes'] // 1024} KiB x {config['w2']['messages']:,}, "
        f"median of {config['reps']}",
        "saturation": "Saturation: lean load generator (pre-encoded QoS 1, windowed), best of pair counts "
        f"{tuple(config['saturation']['pair_counts'])}",
        "shallow": f"Shallow pipeline: 1 pair, {config['shallow']['window']} QoS 1 in flight (latency-bound: "
        "CPU per message shows what a round trip costs)",
    }
    for workload, title in titles.items():
        table = Table(title=title, title_justify="left")
        for column in ("broker", "msgs/s", "p50 ms", "p99 ms", "max ms", "CPU-s/10k", "peak RSS MB", "notes"):
            table.add_column(column, justify="left" if column in ("broker", "notes") else "right")
        rows = [(broker, per.get(workload, {})) for broker, per in results.items()]
        if workload == "w1":  # moorline's persistent-subscriber variants under the clean-session rows
            for broker, per in results.items():
                for extra, label in (("w1_persistent", "persistent subscriber"),
                                     ("w1_persistent_loose_packet_ids", "persistent, loose packet ids")):
                    if extra in per:
                        rows.append((f"{broker} ({label})", per[extra]))
        for broker, block in rows:
            figures = _row_figures(block)
            if figures is None:
                error = str(block.get("error", "no result"))
                short = error if len(error) <= 150 else error[:150] + "... (full text in the JSON)"
                table.add_row(broker, *["-"] * 6, f"[red]{short}[/red]")
                continue
            notes = []
            if not figures.get("complete", True):
                notes.append("[red]INCOMPLETE[/red]")
            if figures.get("duplicates"):
                notes.append(f"{figures['duplicates']:.0f} dup")
            if "pairs" in figures:
                notes.append(
                    f"{figures['pairs']} pair(s), {_num(figures.get('publish_acks_per_s'), ',.0f')} PUBACK/s"
                )
            if block.get("still_rising"):
                notes.append("[yellow]still rising at the most pairs[/yellow]")
            table.add_row(
                broker,
                _num(figures.get("msgs_per_s"), ",.0f"),
                _num(figures.get("latency_p50_ms"), ".1f"),
                _num(figures.get("latency_p99_ms"), ".1f"),
                _num(figures.get("latency_max_ms"), ".1f"),
                _num(figures.get("cpu_s_per_10k"), ".3f"),
                _num(figures.get("peak_rss_mb"), ".0f"),
                " ".join(notes),
            )
        console.print(table)

    comparison = report["comparison"]
    quick = bool(report.get("meta", {}).get("quick"))
    if comparison["targets"]:
        table = Table(title="moorline targets", title_justify="left")
        for column in ("target", "moorline", "bound", "met"):
            table.add_column(column)
        for row in comparison["targets"]:
            fmt = target_format(row["target"])
            table.add_row(
                row["target"],
                _num(row["moorline"], fmt),
                f"{row['op']} {_num(row['bound'], fmt)}",
                met_label(row, quick),
            )
        console.print(table)
    if comparison["ratios"]:
        table = Table(
            title="moorline / peer (msgs/s: higher is better; CPU: lower is better)", title_justify="left"
        )
        table.add_column("peer")
        keys = (
            "w1_msgs_per_s",
            "w1_cpu_s_per_10k",
            "w2_msgs_per_s",
            "w2_cpu_s_per_10k",
            "saturation_msgs_per_s",
            "shallow_cpu_s_per_10k",
        )
        for key in keys:
            table.add_column(key.replace("_per_", "/").replace("_s/10k", "-s/10k"), justify="right")
        for peer, ratios in comparison["ratios"].items():
            table.add_row(
                peer,
                *[
                    _num(ratios.get(key), ".2f") + ("x" if ratios.get(key) is not None else "")
                    for key in keys
                ],
            )
        console.print(table)
    strict = comparison.get("strict_packet_ids")
    if strict:
        console.print(
            f"Strict packet ids (delivery batch committed before send), W1: "
            f"{strict['w1_cpu_s_per_10k_strict']:.3f} CPU-s/10k strict vs {strict['w1_cpu_s_per_10k_loose']:.3f} loose "
            f"= [bold]{strict['cost_cpu_s_per_10k']:+.3f}[/bold] CPU-s/10k "
            f"({_num(strict['w1_msgs_per_s_strict'], ',.0f')} vs {_num(strict['w1_msgs_per_s_loose'], ',.0f')} msgs/s)"
        )
    for name, tls in comparison.get("tls", {}).items():
        console.print(
            f"W1 over TLS, {name}: {_num(tls['w1_cpu_s_per_10k_tls'], '.3f')} CPU-s/10k vs "
            f"{_num(tls['w1_cpu_s_per_10k_plain'], '.3f')} plain = [bold]{_num(tls['tls_to_plain_cpu'], '.2f')}x[/bold] "
            f"CPU per message ({_num(tls['w1_msgs_per_s_tls'], ',.0f')} vs {_num(tls['w1_msgs_per_s_plain'], ',.0f')} msgs/s)"
        )
    for name, info in report["brokers"].items():
        if info["status"] != "ok":
            console.print(f"[yellow]{name} skipped:[/yellow] {info['reason']}")
