"""``moorline groups``: the ``$share`` groups (work queues, docs/queues.md) as one node sees them
(GET /v1/groups): backlog, members, the single-active group's active member, dead-letter counts."""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Any

import typer

from moorline.node.admin.cli_auth import auth_header
from moorline.node.admin.cluster_cli import Refused, Unreachable, _addresses, _get

PAGE = 500  # groups asked for per request (at most http.max_admin_page: 1000 by default)


def groups(
    http: Annotated[str, typer.Option(
        help="a node's HTTP listener HOST:PORT, or several separated by commas: the first that answers "
             "is asked")] = "127.0.0.1:8888",
    q: Annotated[str, typer.Option(help="only groups whose name contains this")] = "",
    user: Annotated[str | None, typer.Option(help="HTTP Basic user (an admin)")] = None,
    password: Annotated[str | None, typer.Option(help="HTTP Basic password")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (instead of user/password)")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for each node")] = 5.0,
) -> None:
    """$share groups: backlog (owed, not handed out), in flight, members, the single-active group's
    active member, and dead-letter counts (waiting to move, moved as the recorded drops go)."""
    from rich.console import Console

    auth = auth_header(user, password, token)
    bases = _addresses(http)
    if not bases:
        raise typer.BadParameter("give at least one HOST:PORT", param_hint="--http")
    err = Console(stderr=True)
    for i, base in enumerate(bases):
        try:
            rows = _fetch(base, q, auth, timeout)
        except Unreachable as exc:
            more = f"; trying {bases[i + 1].removeprefix('http://')}" if i + 1 < len(bases) else ""
            err.print(f"{base.removeprefix('http://')}: unreachable ({exc}){more}", markup=False, highlight=False,
                      soft_wrap=True)
            continue
        except Refused as exc:
            err.print(f"moorline groups: {exc}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        _print(Console(), base, rows)
        return
    err.print("moorline groups: no node answered", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _fetch(base: str, q: str, auth: str | None, timeout_s: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    offset = 0
    while True:
        query = urllib.parse.urlencode({"q": q, "offset": offset, "limit": PAGE})
        page = _get(base, f"/v1/groups?{query}", auth, timeout_s)
        items = page.get("items", [])
        rows += items
        offset += len(items)
        if not items or offset >= page.get("total", 0):
            return rows


def _print(console: Any, base: str, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    console.print(f"as {base.removeprefix('http://')} sees it", highlight=False)
    table = Table(title=f"$share groups ({len(rows)})")
    for col in ("group", "filter", "backlog", "in flight", "members", "active member", "dead-letter waiting",
                "dead-lettered"):
        numeric = col in ("backlog", "in flight", "members", "dead-letter waiting", "dead-lettered")
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")  # names whole
    for r in rows:
        active = ", ".join(r.get("active", [])) if r.get("single_active") else "(all: round robin)"
        table.add_row(r["group"], r["filter"], str(r.get("backlog", 0)), str(r.get("in_flight", 0)),
                      str(len(r.get("members", []))), active or "[red]none[/red]",
                      str(r.get("dead_letter_pending", 0)), str(r.get("dead_lettered", 0)))
    console.print(table)
