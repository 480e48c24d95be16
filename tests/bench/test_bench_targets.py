"""How the bench labels moorline's targets: compared as printed (equal is met), and a --quick run's
figures are not comparable with the targets at all."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from bench.report import QUICK_LABEL, mark_quick, met_label, print_report, target_format, target_met


@pytest.mark.parametrize(
    ("value", "op", "bound", "label", "met"),
    [
        (2.0, "<=", 2.0, "W2 CPU-s/10k", True),
        (2.0004, "<=", 2.0, "W2 CPU-s/10k", True),  # prints as 2.000 <= 2.000
        (2.0006, "<=", 2.0, "W2 CPU-s/10k", False),  # prints as 2.001
        (0.149, "<=", 0.15, "W1 CPU-s/10k", True),
        (42_000.4, ">=", 42_000.0, "saturation msgs/s vs mosquitto", True),
        (41_999.0, ">=", 42_000.0, "saturation msgs/s vs mosquitto", False),
        (None, "<=", 2.0, "W2 CPU-s/10k", None),
        (1.0, ">=", None, "saturation msgs/s vs mosquitto", None),
    ],
)
def test_targets_are_compared_as_printed(
    value: float | None, op: str, bound: float | None, label: str, met: bool | None
) -> None:
    assert target_met(value, op, bound, target_format(label)) is met


def _report(quick: bool) -> dict[str, Any]:
    comparison: dict[str, Any] = {
        "targets": [{"target": "W2 CPU-s/10k", "moorline": 2.0004, "op": "<=", "bound": 2.0, "met": True}],
        "ratios": {},
        "strict_packet_ids": None,
    }
    if quick:
        mark_quick(comparison)
    return {
        "results": {},
        "config": {
            "w1": {"payload_bytes": 100, "messages": 10, "window": 1},
            "w2": {"payload_bytes": 65536, "messages": 10},
            "saturation": {"pair_counts": [1]},
            "shallow": {"window": 16},
            "reps": 1,
        },
        "comparison": comparison,
        "brokers": {},
        "meta": {"quick": quick},
    }


def _printed(report: dict[str, Any]) -> str:
    out = io.StringIO()
    print_report(Console(file=out, width=200, color_system=None), report)
    return out.getvalue()


def test_an_equal_figure_prints_as_met() -> None:
    text = _printed(_report(quick=False))
    row = next(line for line in text.splitlines() if "W2 CPU-s/10k" in line)
    assert "2.000" in row and "<= 2.000" in row and "yes" in row and "no" not in row.split("<=")[1]


def test_a_quick_run_labels_targets_not_comparable_instead_of_met_or_not() -> None:
    report = _report(quick=True)
    [row] = report["comparison"]["targets"]
    assert row["met"] is None and row["comparable"] is False
    text = _printed(report)
    assert "not comparable" in text and " yes" not in text and " no " not in text
    assert met_label(row, quick=True).endswith(f"{QUICK_LABEL}[/yellow]")
