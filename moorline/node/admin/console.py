"""The web console's parts that are not routes: its static files, the sampler of this node's
traffic counters, and the live stream's snapshot (the routes: admin_api.py; docs/console.md)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from moorline.node.node import Node

log = logging.getLogger(__name__)

CONSOLE_DIR = Path(__file__).resolve().parent / "console"
CONSOLE_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# The console loads nothing from elsewhere: scripts, styles and data come from this node only.
CONSOLE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}
DISK_EVERY_S = 5.0  # the data directory is measured about this often


def load_console_files() -> dict[str, tuple[bytes, str]]:
    """name -> (content, content type) of the console's static files (read once, when the app is built)."""
    out: dict[str, tuple[bytes, str]] = {}
    if CONSOLE_DIR.is_dir():
        for path in sorted(CONSOLE_DIR.iterdir()):
            kind = CONSOLE_TYPES.get(path.suffix)
            if kind is not None and path.is_file():
                out[path.name] = (path.read_bytes(), kind)
    return out


def dir_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (0 when it cannot be read)."""
    total = 0
    for base, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                continue
    return total


class Sampler:
    """This node's traffic counters, sampled every ``http.console_update_interval_s`` on a loop
    timer (no task: nothing for shutdown to wait for), kept for ``http.console_history_s``."""

    def __init__(self, node: Node, interval_s: float, history_s: float) -> None:
        self.node = node
        self.interval_s = interval_s
        self.samples: deque[tuple[float, int, int, int]] = deque(maxlen=max(2, int(history_s / interval_s) + 1))
        self.points: deque[dict[str, float]] = deque(maxlen=self.samples.maxlen)
        self.started_wall = node.clock.wall_ms() / 1000  # the node's clock: virtual in the simulator
        self.started_mono = node.clock.monotonic()
        self.disk_bytes = 0
        self._handle: asyncio.TimerHandle | None = None
        self._count = 0

    def counters(self) -> tuple[int, int, int]:
        """(publishes received, deliveries sent, publishes refused: the ACL's and those no shard took)
        since the node started; accepted = received - refused."""
        node = self.node
        denied = sum(node.publish_denied.values())
        refused = node.stats.get("refused", 0) + denied
        return sum(node.published.values()) + denied, node.stats.get("delivered", 0), refused

    def start(self) -> None:
        self.started_mono = self.node.clock.monotonic()
        self._tick()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        try:
            self.sample()
        except Exception:  # a sample must never stop the sampling
            log.exception("console sampler")
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def sample(self) -> None:
        now = self.node.clock.monotonic()
        pub, out, refused = self.counters()
        if self._count % max(1, round(DISK_EVERY_S / self.interval_s)) == 0:
            self.disk_bytes = dir_bytes(self.node.data_dir)
        self._count += 1
        if self.samples:
            t0, p0, o0, r0 = self.samples[-1]
            dt = max(now - t0, 1e-6)
            self.points.append({"t": self.node.clock.wall_ms(), "in": round((pub - p0) / dt, 1),
                                "out": round((out - o0) / dt, 1), "refused": round((refused - r0) / dt, 1),
                                "accepted": round(max(0, (pub - p0) - (refused - r0)) / dt, 1)})
        self.samples.append((now, pub, out, refused))

    def uptime_s(self) -> float:
        return round(self.node.clock.monotonic() - self.started_mono, 1)


def console_snapshot(node: Node, sampler: Sampler, full: bool) -> dict[str, Any]:
    """One event of the console's live stream: the cluster's nodes and shards as this node sees them,
    this node's rates, uptime and disk use (``full``: with the rate history)."""
    cfg = node.cfg
    status = node.cluster_status()
    nodes = [{"id": n["id"], "self": n.get("self", False), "reachable": n.get("reachable", False),
              "address": n.get("cluster") or n.get("http"), "groups_led": n.get("groups_led", 0),
              **({"zone": n["zone"]} if n.get("zone") else {})} for n in status["nodes"]]
    membership = node.membership.status()  # None: a single node
    by_shard = {row["shard"]: row for row in membership["shards"]} if membership is not None else {}
    shards = []
    for h in node.hosts:
        t = h.state.topics
        st = node.raft_status(h.shard)
        shards.append({"shard": h.shard, "leader": st["leader"], "voters": st["voters"],
                       "learners": st["learners"], "term": st["term"], "commit": st["commit"],
                       "replicas": st["replicas"], "low_water": t.low_water, "next_offset": t.next_offset,
                       "messages": len(t.meta), "bytes": t.bytes_used, "available": h.failed is None,
                       # the member table's target and health (voters on members not gone)
                       # where it exists; else the configured replica count
                       **({"target": by_shard[h.shard]["target"], "health": by_shard[h.shard]["health"]}
                          if h.shard in by_shard else {"target": min(cfg.shard.replicas, len(nodes))})})
    out: dict[str, Any] = {
        "t": node.clock.wall_ms(), "node": node.node_name(node.member[0]), "uptime_s": sampler.uptime_s(),
        "started_ms": round(sampler.started_wall * 1000), "disk_bytes": sampler.disk_bytes,
        "connections": len(node.connections), "sessions_here": len(node.live),
        "rates": sampler.points[-1] if sampler.points else None,
        "p99_ack_ms": node.ack_latency.percentile_ms(0.99),  # last minute; None when nothing was acknowledged
        "nodes": nodes, "metadata_leader": status["metadata"].get("leader"), "shards": shards,
        # the member table (None: a single node; no drain or forget to offer)
        "members": None if membership is None else [
            {"name": m["name"], "state": m["state"], "live": m["live"]} for m in membership["members"]],
    }
    if full:
        out["history"] = list(sampler.points)
        out["interval_s"] = sampler.interval_s
    return out
