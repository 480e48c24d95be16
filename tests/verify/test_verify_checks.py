"""Handcrafted histories: each anomaly is flagged, clean and legitimately-duplicated histories are not."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.spark

G1, G2, G3, G4 = ("a" * 32, "b" * 32, "c" * 32, "d" * 32)


def failing(counts: dict[str, int]) -> dict[str, int]:
    from moorline.verify.checks import FAILING_KINDS

    return {k: v for k, v in counts.items() if k in FAILING_KINDS and v}


def base(hist: Any, run: str = "r1") -> Any:
    """A subscriber s1 on t/# (QoS 1) and a publisher p1, both connected."""
    h = hist(run)
    h.connect("s1", present=False).subscribe("s1", "t/#", qos=1)
    h.connect("p1", present=False, clean_start=True)
    return h


def test_clean_history_has_no_anomaly(hist: Any, check: Any) -> None:
    h = base(hist)
    h.publish("p1", G1).publish("p1", G2, pid=2).publish("p1", G3, qos=2, pid=3)
    h.deliver("s1", G1, pid=1).deliver("s1", G2, pid=2).deliver("s1", G3, qos=2, pid=3)
    h.disconnect("s1")
    counts, per_run, _ = check(h)
    assert failing(counts) == {}
    r = per_run["r1"]
    assert (r["published"], r["acknowledged"], r["first_deliveries"]) == (3, 3, 3)


def test_lost_acknowledged_message_is_flagged(hist: Any, check: Any) -> None:
    h = base(hist)
    h.publish("p1", G1).publish("p1", G2, pid=2)
    h.deliver("s1", G1, pid=1)
    h.disconnect("s1")
    counts, _, anomalies = check(h)
    assert failing(counts) == {"lost": 1}
    assert anomalies[0]["guid"] == G2 and anomalies[0]["subscriber"] == "s1#1"
