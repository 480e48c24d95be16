"""A self-contained HTML report with hand-written inline SVG plots (no plotting dependency)."""

from __future__ import annotations

import hashlib
import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moorline.verify.checks import ALL_KINDS, FAILING_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from moorline.verify.job import Verdict

WIDTH, HEIGHT, PAD = 720, 180, 40
KIND_COLOURS = {
    "lost": "#d62728",
    "duplicate": "#ff7f0e",
    "unexpected": "#9467bd",
    "out_of_order": "#e377c2",
    "packet_id_misuse": "#17becf",
    "refused_delivered": "#8c564b",
    "lost_detected_corruption": "#7f7f7f",
}
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


def anchor(key: str) -> str:
    """The HTML id of the sampled anomaly with ``anomaly_key`` ``key``."""
    return "a-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def svg_timeline(
    title: str,
    points: list[dict[str, Any]],
    series: list[tuple[str, str, str]],
    faults: list[dict[str, Any]],
    unit: str,
    marks: list[dict[str, Any]] | None = None,
    linked: set[str] | None = None,
) -> str:
    """A line chart of ``series`` (key, label, colour) over ``second``, faults as vertical lines and
    anomalies (``marks``: t_s, kind, ...) as triangles under the plot, each a link to its sample row
    (when its anomaly_key is in ``linked``) or to its kind's samples."""
    from moorline.verify.job import anomaly_key

    marks = marks or []
    linked = linked or set()
    xs = (
        [float(p["second"]) for p in points]
        + [float(f["t_s"]) for f in faults]
        + [float(m["t_s"]) for m in marks if m.get("t_s") is not None]
    )
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
    for m in marks:
        if m.get("t_s") is None:
            continue
        x = _scale(float(m["t_s"]), 0, x_hi, x0, x1)
        kind = str(m["kind"])
        colour = KIND_COLOURS.get(kind, "#000")
        key = anomaly_key(m)
        href = f"#{anchor(key)}" if key in linked else f"#kind-{kind}"
        label = html.escape(
            f"{kind} at {float(m['t_s']):.3f} s: {m.get('subscriber') or ''} {m.get('guid') or ''} "
            f"{m.get('detail') or ''}".strip()
        )
        out.append(
            f'<a href="{href}" class="mark"><path d="M{x:.1f},{y0 - 9} l-4,8 h8 z" fill="{colour}" '
            f'stroke="#000" stroke-width="0.5"><title>{label}</title></path></a>'
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


def tested_line(t: dict[str, Any]) -> str:
    """What the verdict is about, in one line: runs, acknowledged publishes, subscribers, faults."""

    def n(key: str, one: str, many: str) -> str:
        v = int(t.get(key, 0) or 0)
        return f"{v:,} {one if v == 1 else many}"

    line = (
        f"Tested {n('runs', 'run', 'runs')}: {n('acknowledged', 'acknowledged publish', 'acknowledged publishes')}"
        f", {n('subscribers', 'subscriber', 'subscribers')}, {n('faults', 'fault', 'faults')}"
    )
    thin = [what for key, what in (("acknowledged", "nothing acknowledged"), ("subscribers", "no subscriber"),
                                   ("faults", "no fault injected")) if not int(t.get(key, 0) or 0)]
    return line + (f" ({', '.join(thin)})" if thin else "")


def _records_table(records: list[dict[str, Any]]) -> str:
    cols = ["mono_ns", "index", "type", "op", "process", "session", "node", "topic", "qos", "packet_id", "dup",
            "filter", "share_group", "session_present", "reason", "detail"]
    used = [c for c in cols if any(c in r for r in records)]
    return _table(records, used)


def _samples(kind: str, rows: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]]) -> str:
    from moorline.verify.job import anomaly_key

    cols = ["run", "subscriber", "topic", "guid", "detail"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [*cols, "records"])
    body = []
    for r in rows:
        key = anomaly_key(r)
        recs = records.get(key, [])
        cells = "".join(f"<td>{html.escape('' if r.get(c) is None else str(r.get(c)))}</td>" for c in cols)
        body.append(
            f"<tr id='{anchor(key)}'>{cells}<td><details><summary>{len(recs)} records</summary>"
            f"{_records_table(recs)}</details></td></tr>"
        )
    return f"<h3 id='kind-{html.escape(kind)}'>{html.escape(kind)}</h3><table><tr>{head}</tr>{''.join(body)}</table>"


def write_html(path: Path, verdict: Verdict) -> None:
    from moorline.verify.job import anomaly_key

    t = verdict.totals
    status = "PASS" if verdict.ok else "FAIL"
    linked = {anomaly_key(a) for rows in verdict.samples.values() for a in rows}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>moorline verify</title><style>",
        "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}.bad{background:#fdd;font-weight:bold}"
        ".pass{color:#2a2}.fail{color:#c22}#tested{font-size:1.1em;margin:0}"
        "tr:target{background:#ffc}details table{margin:4px 0}</style></head><body>",
        f"<p id='tested'>{html.escape(tested_line(t))}</p>",
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
        + ". Triangles: anomalies "
        + ", ".join(f"<span style='color:{c}'>{k}</span>" for k, c in KIND_COLOURS.items())
        + " (each links to its row and records below).</p>",
    ]
    for run, points in verdict.timelines.items():
        faults = verdict.faults.get(run, [])
        marks = verdict.marks.get(run, [])
        parts.append(f"<h3>run {html.escape(run)}: {len(marks)} anomalies marked</h3>")
        parts.append(
            svg_timeline(
                f"throughput {run}",
                points,
                [("acked", "acked/s", "#1f77b4"), ("delivered", "delivered/s", "#2ca02c")],
                faults,
                "messages/s",
                marks,
                linked,
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
        "subscribers",
        "faults",
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
    parts.append(
        "<h2>Anomaly samples</h2><p>Up to 20 per kind; every one lists the history records of its "
        "message. The full list is <code>anomalies/</code> (Parquet).</p>"
    )
    for kind, rows in verdict.samples.items():
        if rows:
            parts.append(_samples(kind, rows, verdict.records))
    parts.append(f"<script type='application/json' id='totals'>{html.escape(json.dumps(t))}</script>")
    parts.append("</body></html>")
    path.write_text("".join(parts), encoding="utf-8")
