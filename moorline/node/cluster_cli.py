"""``moorline cluster status``: a cluster as one node sees it, as tables (GET /v1/cluster, /v1/shards)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Annotated, Any

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Inspect a moorline cluster.")


def _get(base: str, path: str, auth: str | None) -> Any:
    req = urllib.request.Request(base.rstrip("/") + path, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        raise typer.BadParameter(f"{base}{path}: HTTP {exc.code} {body}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise typer.BadParameter(f"cannot reach {base}{path}: {exc}") from exc


@app.command()
def status(
    http: Annotated[str, typer.Option(help="a node's HTTP listener HOST:PORT")] = "127.0.0.1:8888",
    user: Annotated[str | None, typer.Option(help="HTTP Basic user (an admin)")] = None,
    password: Annotated[str | None, typer.Option(help="HTTP Basic password")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (instead of user/password)")] = None,
) -> None:
    """Nodes (addresses, storage ids, reachability, groups led) and shards (leader, voters, term,
    commit and applied positions per replica), as the node at --http sees them."""
    from rich.console import Console
    from rich.table import Table

    auth = None
    if token:
        auth = f"Bearer {token}"
    elif user is not None:
        auth = "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    base = http if http.startswith("http") else f"http://{http}"
    cluster = _get(base, "/v1/cluster", auth)
    shards = _get(base, "/v1/shards", auth)
    console = Console()
    nodes = Table(title="nodes")
    for col in ("node", "cluster address", "storage id", "reachable", "leads"):
        nodes.add_column(col)
    for n in cluster["nodes"]:
        nodes.add_row(n["id"] + (" (this)" if n.get("self") else ""), n.get("cluster", "-"),
                      (n.get("storage_id") or "?")[:12], "yes" if n.get("reachable") else "[red]no[/red]",
                      str(n.get("groups_led", 0)))
    console.print(nodes)
    meta = cluster.get("metadata")
    if meta is not None:
        record = meta.get("record") or {}
        console.print(f"metadata group: leader {meta.get('leader') or '[red]none[/red]'}, voters "
                      f"{','.join(meta.get('voters', []))}, term {meta.get('term')}, commit {meta.get('commit')}; "
                      f"{record.get('shard_count', '?')} shards x {record.get('replicas', '?')} voters")
    table = Table(title=f"shards ({shards['shard_count']})")
    for col in ("shard", "leader", "voters", "learners", "term", "commit", "replicas (match / applied)", "offsets",
                "state"):
        table.add_column(col)
    for s in shards["shards"]:
        replicas = ", ".join(
            f"{name}: {r.get('match') if r.get('match') is not None else '-'}"
            + (f"/{r['applied']}" if "applied" in r else "")
            for name, r in sorted(s.get("replicas", {}).items()))
        table.add_row(str(s["shard"]), s.get("leader") or "[red]none[/red]", ",".join(s.get("voters", [])),
                      ",".join(s.get("learners", [])) or "-", str(s.get("term", "-")), str(s.get("commit", "-")), replicas,
                      f"{s['low_water']}..{s['next_offset']}",
                      "ok" if s.get("available", True) else f"[red]{s.get('error', 'failed')}[/red]")
    console.print(table)
