"""``GET /metrics``: the node's counters and gauges in Prometheus' text format (docs/metrics.md
lists every one; tests/e2e/test_e2e_metrics.py checks that list against what is emitted)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moorline.node.edge.drain import Drain, cluster_readiness

if TYPE_CHECKING:
    from moorline.node.edge.auth import Authorizer
    from moorline.node.node import Node


def prometheus_text(node: Node, authorizer: Authorizer, drain: Drain | None) -> str:
    from moorline.node.admin.cluster_admin_api import membership_metric_lines  # (imports http_api)

    lines = [
        "# TYPE moorline_published_total counter",
        *(f'moorline_published_total{{source="{s}"}} {n}' for s, n in node.published.items()),
        "# TYPE moorline_publish_denied_total counter",
        *(f'moorline_publish_denied_total{{source="{s}"}} {n}' for s, n in node.publish_denied.items()),
        "# TYPE moorline_delivered_total counter", f"moorline_delivered_total {node.stats['delivered']}",
        "# TYPE moorline_wal_syncs_total counter", f"moorline_wal_syncs_total {node.commit.syncs}",
        "# TYPE moorline_wal_syncs_lazy_total counter", f"moorline_wal_syncs_lazy_total {node.commit.lazy_syncs}",
        "# TYPE moorline_wal_syncs_inline_total counter",
        f"moorline_wal_syncs_inline_total {node.commit.timer.inline}",
        "# TYPE moorline_wal_sync_seconds_mean gauge", f"moorline_wal_sync_seconds_mean {node.commit.timer.mean_s:.6f}",
        "# TYPE moorline_delivery_batches_committed_total counter",
        f"moorline_delivery_batches_committed_total {node.stats['delivery_batches_committed']}",
        "# TYPE moorline_recent_messages_hits_total counter",
        f"moorline_recent_messages_hits_total {node.recent.hits}",
        "# TYPE moorline_recent_messages_misses_total counter",
        f"moorline_recent_messages_misses_total {node.recent.misses}",
        "# TYPE moorline_recent_messages_bytes gauge", f"moorline_recent_messages_bytes {node.recent.used_bytes}",
        "# TYPE moorline_connected_sessions gauge", f"moorline_connected_sessions {len(node.live)}",
        "# TYPE moorline_login_hashes_total counter", f"moorline_login_hashes_total {authorizer.hashes_run}",
        "# TYPE moorline_logins_refused_total counter",
        *(f'moorline_logins_refused_total{{reason="{r}"}} {n}' for r, n in sorted(authorizer.refused.items())),
        "# TYPE moorline_dropped_total counter",
    ]
    totals: dict[str, int] = {}
    for h in node.hosts:
        for reason, n in h.state.topics.drop_counts.items():
            totals[reason] = totals.get(reason, 0) + n
    for reason, n in sorted(totals.items()):
        lines.append(f'moorline_dropped_total{{reason="{reason}"}} {n}')
    # $share work queues (docs/queues.md): dead-lettered messages (this node's replicas' count
    # of the replicated drops "delivery_limit") and members' connections this node closed for
    # their ack timeout.
    lines += ["# TYPE moorline_share_dlq_total counter",
              f"moorline_share_dlq_total {totals.get('delivery_limit', 0)}",
              "# TYPE moorline_share_ack_timeouts_total counter",
              f"moorline_share_ack_timeouts_total {node.share_ack_timeouts}"]
    # Follow-ups this node proposed as a shard's leader (sessions/followups.py).
    followups = node.housekeeping.followups
    lines += ["# TYPE moorline_followup_acks_resent_total counter",
              f"moorline_followup_acks_resent_total {followups.acks_resent}",
              "# TYPE moorline_followup_ghosts_unregistered_total counter",
              f"moorline_followup_ghosts_unregistered_total {followups.ghosts_unregistered}"]
    lines += _group_metric_lines(node)
    lines += ["# TYPE moorline_draining gauge", f"moorline_draining {int(drain is not None and drain.draining)}",
              "# TYPE moorline_cluster_ready gauge",
              f"moorline_cluster_ready {int(not cluster_readiness(node, drain, node.clock.monotonic()))}"]
    lines.append("# TYPE moorline_shard_failed gauge")
    for h in node.hosts:
        lines.append(f'moorline_shard_failed{{shard="{h.shard}"}} {1 if h.failed else 0}')
    lines += node.ack_latency.prometheus_lines()
    lines.append("# TYPE moorline_task_failures_total counter")
    for task, n in sorted(node.supervisor.failures.items()):
        lines.append(f'moorline_task_failures_total{{task="{task}"}} {n}')
    lines.append("# TYPE moorline_cluster_frames_refused_total counter")  # samples in cluster mode only
    if node.link is not None:
        for peer, n in sorted(node.link.frames_refused.items()):
            lines.append(f'moorline_cluster_frames_refused_total{{peer="{peer}"}} {n}')
    lines.append("# TYPE moorline_cluster_clock_offset_ms gauge")  # cluster mode only (clock_offset.py)
    if node.link is not None:
        clocks = node.link.clocks
        for peer in clocks.peers:
            est = clocks.estimate(peer)
            if est is not None:
                lines.append(f'moorline_cluster_clock_offset_ms{{peer="{peer}"}} {est.offset_ms:.1f}')
    out_of_bound = node.link is not None and node.link.clocks.out_of_bound() is not None
    lines += ["# TYPE moorline_cluster_clock_out_of_bound gauge",  # 0 on a single node: no peers to be off
              f"moorline_cluster_clock_out_of_bound {int(out_of_bound)}"]
    lines += membership_metric_lines(node)
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value (group names and client ids come from clients)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _group_metric_lines(node: Node) -> list[str]:
    """Per $share group (docs/queues.md): backlog, in flight, members, the single-active group's
    active member, dead letters waiting to move; the first http.max_admin_page groups by name."""
    from moorline.node.admin.admin_api import share_groups  # (imports this module)

    rows = share_groups(node)[: node.cfg.http.max_admin_page]
    out = ["# TYPE moorline_share_group_backlog gauge", "# TYPE moorline_share_group_in_flight gauge",
           "# TYPE moorline_share_group_members gauge", "# TYPE moorline_share_group_dead_letter_waiting gauge",
           "# TYPE moorline_share_group_active_member gauge"]
    for r in rows:
        lbl = f'group="{_label(r["group"])}",filter="{_label(r["filter"])}"'
        out += [f"moorline_share_group_backlog{{{lbl}}} {r['backlog']}",
                f"moorline_share_group_in_flight{{{lbl}}} {r['in_flight']}",
                f"moorline_share_group_members{{{lbl}}} {len(r['members'])}",
                f"moorline_share_group_dead_letter_waiting{{{lbl}}} {r['dead_letter_pending']}"]
        out += [f'moorline_share_group_active_member{{{lbl},member="{_label(m)}"}} 1' for m in r["active"]]
    return out
