"""Acknowledgement latency (issue 35's p99 card, /metrics histogram): percentiles over the last
minute from fixed log-spaced buckets, a window that forgets, and a cumulative histogram."""

from __future__ import annotations

import re

from moorline.node.ack_latency import AckLatency


def test_percentiles_are_within_a_bucket_of_the_truth_and_forget_old_seconds() -> None:
    now = [1000.0]
    lat = AckLatency(lambda: now[0])
    assert lat.percentile_ms(0.99) is None
    for i in range(1000):
        lat.observe(0.002 if i < 985 else 0.300)
    p50, p99 = lat.percentile_ms(0.5), lat.percentile_ms(0.99)
    assert p50 is not None and 2.0 <= p50 <= 2.0 * 1.125
    assert p99 is not None and 300.0 <= p99 <= 300.0 * 1.125  # 15 slow ones: the p99 is slow
    now[0] += 30
    lat.observe(0.010, 10)
    assert lat.percentile_ms(0.99, window_s=10) == lat.percentile_ms(0.5, window_s=10)  # only the recent ones
    now[0] += 61
    assert lat.percentile_ms(0.99) is None  # a minute later nothing is recent


def test_the_prometheus_histogram_is_cumulative_and_counts_everything() -> None:
    lat = AckLatency(lambda: 0.0)
    for s in (0.0005, 0.004, 0.004, 0.2, 20.0):
        lat.observe(s)
    text = "\n".join(lat.prometheus_lines())
    buckets = [(float(le), int(n)) for le, n in re.findall(r'_bucket\{le="([0-9.e-]+)"\} (\d+)', text)]
    counts = [n for _, n in buckets]
    assert counts == sorted(counts)  # cumulative
    assert dict(buckets)[min(le for le, _ in buckets if le >= 0.005)] == 3
    assert re.search(r'_bucket\{le="\+Inf"\} 5$', text, re.M) and re.search(r"_count 5$", text, re.M)
