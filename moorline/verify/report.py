"""A self-contained HTML report with hand-written inline SVG plots (no plotting dependency)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moorline.verify.checks import ALL_KINDS, FAILING_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from moorline.verify.job import Verdict

WIDTH, HEIGHT, PAD = 720, 180, 40
FAULT_COLOURS = {
    "kill": "#d62728",
    "restart": "#2ca02c",
    "truncate": "#9467bd",
    "bitflip": "#ff7f0e",
    "corruption_detected": "#8c564b",
}


def _scale(v: float, lo: float, hi: float, out_lo: float, out_hi: float) -> float:
    if hi <= lo:
        return out_lo
    return out_lo + (v - lo) * (out_hi - out_lo) / (hi - lo)


def svg_timeline(
    title: str,
    points: list[dict[str, Any]],
    series: list[tuple[str, str, str]],
    faults: list[dict[str, Any]],
    unit: str,
) -> str:
    """A line chart of ``series`` (key, label, colour) over ``second``, faults as vertical lines."""
    xs = [float(p["second"]) for p in points] + [float(f["t_s"]) for f in faults]
    x_hi = max(xs, default=1.0) + 1.0
    ys = [float(p[k]) for p in points for k, _, _ in series if p.get(k) is not None]
    y_hi = max(ys, default=1.0) * 1.1 or 1.0
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img"><title>{html.escape(title)}</title>',
        f'<rect x="{PAD}" y="10" width="{WIDTH - PAD - 10}" height="{HEIGHT - PAD - 10}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    x0, x1, y0, y1 = PAD, WIDTH - 10, HEIGHT - PAD, 10
    for frac in (0.0, 0.5, 1.0):
        y = _scale(frac * y_hi, 0, y_hi, y0, y1)
        out.append(
            f'<text x="{PAD - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{frac * y_hi:.3g}</text>'
        )
    out.append(f'<text x="{x1}" y="{HEIGHT - 8}" font-size="10" text-anchor="end">{x_hi - 1:.0f} s</text>')
    out.append(f'<text x="{PAD}" y="{HEIGHT - 8}" font-size="10">0 s ({html.escape(unit)})</text>')
    for f in faults:
        x = _scale(float(f["t_s"]), 0, x_hi, x0, x1)
        colour = FAULT_COLOURS.get(str(f["reason"]), "#555")
        label = html.escape(f"{f['reason']} {f.get('detail') or ''}".strip())
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y1}" y2="{y0}" stroke="{colour}" '
            f'stroke-dasharray="3,2"><title>{label}</title></line>'
        )
    for i, (key, label, colour) in enumerate(series):
        pts = [(float(p["second"]), float(p[key])) for p in points if p.get(key) is not None]
        if pts:
            path = " ".join(
                f"{_scale(x, 0, x_hi, x0, x1):.1f},{_scale(y, 0, y_hi, y0, y1):.1f}" for x, y in pts
            )
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
        out.append(
            f'<text x="{PAD + 6 + 110 * i}" y="24" font-size="11" fill="{colour}">{html.escape(label)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            bad = c in FAILING_KINDS and v
            cells.append(
                f'<td class="{"bad" if bad else ""}">{html.escape("" if v is None else str(v))}</td>'
            )
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def write_html(path: Path, verdict: Verdict) -> None:
    t = verdict.totals
    status = "PASS" if verdict.ok else "FAIL"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>moorline verify</title><style>",
        "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}.bad{background:#fdd;font-weight:bold}"
        ".pass{color:#2a2}.fail{color:#c22}</style></head><body>",
        f"<h1>moorline verify: <span class='{status.lower()}'>{html.escape(verdict.headline())}</span></h1>",
        f"<p>{t['runs']} runs, {t['events']} events, {t['published']} publishes "
        f"({t['acknowledged']} acknowledged, {t['refused']} refused, {t['indeterminate']} indeterminate, "
        f"{t['indeterminate_delivered']} of those delivered), {t['first_deliveries']} first deliveries, "
        f"{t['excused']} excused, {t['duplicate_legit']} legitimate redeliveries.</p>",
        (
            f"<p class='fail'><b>{verdict.unavailable} messages unavailable</b>: the node detected and reported "
            "corruption and these acknowledged messages were not delivered. No loss was silent, but a PASS "
            "here does not mean nothing was lost.</p>"
            if verdict.unavailable
            else ""
        ),
        "<h2>Anomalies</h2>",
        _table([{k: t[k] for k in ALL_KINDS}], list(ALL_KINDS)),
        "<p>Failing kinds: " + ", ".join(FAILING_KINDS) + ". <code>lost_detected_corruption</code> counts "
        "losses in runs where the node detected and reported corruption (not silent).</p>",
        "<h2>Latency (ms, all runs)</h2>",
        _table(
            [{k: (None if v is None else round(v, 2)) for k, v in verdict.latency.items()}],
            list(verdict.latency),
        ),
        "<h2>Timelines</h2><p>Runs with the most anomalies first. Dashed lines: faults "
        + ", ".join(f"<span style='color:{c}'>{k}</span>" for k, c in FAULT_COLOURS.items())
        + ".</p>",
    ]
    for run, points in verdict.timelines.items():
        faults = verdict.faults.get(run, [])
        parts.append(f"<h3>run {html.escape(run)}</h3>")
        parts.append(
            svg_timeline(
                f"throughput {run}",
                points,
                [("acked", "acked/s", "#1f77b4"), ("delivered", "delivered/s", "#2ca02c")],
                faults,
                "messages/s",
            )
        )
        parts.append(
            svg_timeline(
                f"latency {run}",
                points,
                [("ack_p50_ms", "ack p50 ms", "#1f77b4"), ("ack_p99_ms", "ack p99 ms", "#d62728")],
                faults,
                "ms",
            )
        )
    run_cols = [
        "run",
        "events",
        "duration_s",
        "published",
        "acknowledged",
        "indeterminate",
        "first_deliveries",
        "excused",
        "duplicate_legit",
        *ALL_KINDS,
        "fault_kill",
        "fault_truncate",
        "fault_bitflip",
        "fault_corruption_detected",
    ]
    parts.append("<h2>Per run</h2>")
    parts.append(
        _table(
            [
                {c: (round(v, 2) if isinstance(v, float) else v) for c, v in r.items()}
                for r in verdict.runs[:2000]
            ],
            run_cols,
        )
    )
    parts.append("<h2>Anomaly samples</h2>")
    for kind, rows in verdict.samples.items():
        if rows:
            parts.append(f"<h3>{html.escape(kind)}</h3>")
            parts.append(_table(rows, ["run", "subscriber", "topic", "guid", "detail"]))
    parts.append(f"<script type='application/json' id='totals'>{html.escape(json.dumps(t))}</script>")
    parts.append("</body></html>")
    path.write_text("".join(parts), encoding="utf-8")
