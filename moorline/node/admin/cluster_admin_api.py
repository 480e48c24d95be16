"""Admin routes that change a cluster's membership (docs/operations.md, "Change a cluster"):

- ``POST /v1/cluster/members/{name}/join?cluster=HOST:PORT[&zone=Z]``: admits a node before it
  starts (an entry with a new node id; every member's cluster link then takes its connections);
  the node then starts with ``--join`` and binds its storage. The answer has the command to start it.
  Refused (409) for a name that is a member (forget a wiped one first) or an address in use.
- ``POST /v1/cluster/members/{name}/forget`` (``?force=true``): the member becomes ``forgotten``;
  the reconciler then removes its memberships from every shard first (shrink before grow) and
  grows the shards elsewhere. Refused (409, saying which shards and why) when removing it would
  leave a group without a live majority of its voters, or when the node is live; ``force``
  records it anyway and says what that risks.
- ``POST /v1/cluster/members/{name}/leave``: a live node goes away: every shard it votes in gets a
  voter elsewhere first, then loses its (grow before shrink); once it is in no shard it is ``left``
  and stops by itself (exit 0), its data directory marked so it never starts again.
- ``POST /v1/cluster/shards/{shard}/replicas/{name}``: add-replica (a learner caught up is
  promoted; a node that follows nothing becomes a learner first).
- ``DELETE /v1/cluster/shards/{shard}/replicas/{name}``: remove-replica.

Each goes through the metadata group as a move: one per shard at a time, so a manual change racing
the reconciler's is refused (409) rather than run beside it. ``membership_metric_lines`` gives the
membership metrics for ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from moorline.node.admin.http_api import CALLER, _err

JOIN = "/v1/cluster/members/{name}/join"
FORGET = "/v1/cluster/members/{name}/forget"
LEAVE = "/v1/cluster/members/{name}/leave"
REPLICA = "/v1/cluster/shards/{shard}/replicas/{name}"


def _driver(node: Any) -> Any:
    return node.membership


def register_cluster_admin(routes: web.RouteTableDef, node: Any) -> None:
    def refused() -> web.Response | None:
        if not CALLER.get().admin:
            return _err(403, "this route needs the admin role (auth.admin_users)")
        if _driver(node) is None:
            return _err(409, "this node has no member table (a single node)")
        return None

    @routes.post(JOIN)
    async def join(req: web.Request) -> web.Response:
        if (r := refused()) is not None:
            return r
        cluster = req.query.get("cluster", "")
        if not cluster:
            return _err(400, "cluster=HOST:PORT (the node's --cluster address) is required")
        res = await _driver(node).admit(req.match_info["name"], cluster, req.query.get("zone", ""))
        return web.json_response(res.body, status=res.status)

    @routes.post(FORGET)
    async def forget(req: web.Request) -> web.Response:
        if (r := refused()) is not None:
            return r
        force = req.query.get("force", "false").lower()
        if force not in ("true", "false", "1", "0"):
            return _err(400, "force is true or false")
        res = await _driver(node).forget(req.match_info["name"], force in ("true", "1"))
        return web.json_response(res.body, status=res.status)

    @routes.post(LEAVE)
    async def leave(req: web.Request) -> web.Response:
        if (r := refused()) is not None:
            return r
        res = await _driver(node).leave(req.match_info["name"])
        return web.json_response(res.body, status=res.status)

    async def replica(req: web.Request, kind: str) -> web.Response:
        if (r := refused()) is not None:
            return r
        try:
            shard = int(req.match_info["shard"])
        except ValueError:
            return _err(400, f"shard must be a number, not {req.match_info['shard']!r}")
        res = await _driver(node).change_replica(shard, req.match_info["name"], kind)
        return web.json_response(res.body, status=res.status)

    @routes.post(REPLICA)
    async def add_replica(req: web.Request) -> web.Response:
        return await replica(req, "add")

    @routes.delete(REPLICA)
    async def remove_replica(req: web.Request) -> web.Response:
        return await replica(req, "remove")


def membership_metric_lines(node: Any) -> list[str]:
    """Members by state, shards below target, moves in progress, reconcile runs: the # TYPE lines
    always, the samples in cluster mode once the metadata group holds the member table."""
    drv = _driver(node)
    m = drv.metrics() if drv is not None and drv.table is not None and node.link is not None else None
    lines = ["# TYPE moorline_cluster_members gauge"]
    if m is not None:
        for state, n in sorted(m["members"].items()):
            lines.append(f'moorline_cluster_members{{state="{state}"}} {n}')
    for name, kind, key in (("moorline_cluster_shards_below_target", "gauge", "shards_below_target"),
                            ("moorline_cluster_moves_in_progress", "gauge", "moves_in_progress"),
                            ("moorline_cluster_reconcile_runs_total", "counter", "reconcile_runs"),
                            ("moorline_cluster_moves_started_total", "counter", "moves_started"),
                            ("moorline_cluster_conf_changes_proposed_total", "counter", "changes_proposed")):
        lines.append(f"# TYPE {name} {kind}")
        if m is not None:
            lines.append(f"{name} {m[key]}")
    return lines
