"""``moorline cluster status``: a cluster as one node sees it, as tables (GET /v1/cluster, /v1/shards)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Annotated, Any

import typer

from moorline.node.admin.cli_auth import auth_header
from moorline.node.admin.membership_cli import print_membership, register

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Inspect a moorline cluster.")

NARROW_BELOW_COLUMNS = 120  # a terminal narrower than this gets the compact shard table
REPLICAS_NOTE = (
    "replicas: NODE: MATCH/APPLIED. MATCH is the last log index the shard's leader knows that "
    "replica holds; only the leader knows it, so it is '-' on a node that does not lead the shard. "
    "APPLIED (shown for the node answering only) is the last index it has applied. "
    "'n1: -/7' = n1 answered, does not lead this shard, and has applied up to index 7."
)


class Unreachable(Exception):
    """The node did not answer (refused, timed out, no route): another may."""


class Refused(Exception):
    """The node answered with an error (401, 403, ...): asking another would not help."""


def _request(base: str, path: str, auth: str | None, timeout_s: float, body: Any = None) -> Any:
    """GET ``path`` (or POST ``body`` as JSON) on one node; its JSON answer. Refused: the node said
    no (asking another would not help); Unreachable: no answer."""
    headers = {"Authorization": auth} if auth else {}
    data = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = json.dumps(body).encode()
    req = urllib.request.Request(base.rstrip("/") + path, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:300]
        raise Refused(f"{base}{path}: HTTP {exc.code} {text}") from exc
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise Unreachable(reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)) from exc
    except (OSError, ValueError) as exc:  # a timeout, a reset, an answer that is not JSON
        raise Unreachable(str(exc)) from exc


def _get(base: str, path: str, auth: str | None, timeout_s: float) -> Any:
    return _request(base, path, auth, timeout_s)


def _addresses(http: str) -> list[str]:
    out = []
    for item in http.split(","):
        item = item.strip()
        if item:
            out.append(item if item.startswith(("http://", "https://")) else f"http://{item}")
    return out


@app.command()
def status(
    http: Annotated[str, typer.Option(
        help="a node's HTTP listener HOST:PORT, or several separated by commas: the first that answers "
             "is asked")] = "127.0.0.1:8888",
    user: Annotated[str | None, typer.Option(help="HTTP Basic user (an admin)")] = None,
    password: Annotated[str | None, typer.Option(help="HTTP Basic password")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (instead of user/password)")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for each node")] = 5.0,
    wide: Annotated[bool | None, typer.Option(
        "--wide/--narrow", help="the shard table's layout [default: by the terminal's width]")] = None,
) -> None:
    """Nodes (addresses, storage ids, reachability, groups led) and shards (leader, voters, term,
    commit and applied positions per replica), as the first node of --http that answers sees them."""
    from rich.console import Console

    auth = auth_header(user, password, token)
    bases = _addresses(http)
    if not bases:
        raise typer.BadParameter("give at least one HOST:PORT", param_hint="--http")
    console = Console()
    err = Console(stderr=True)
    for i, base in enumerate(bases):
        try:
            cluster = _get(base, "/v1/cluster", auth, timeout)
            shards = _get(base, "/v1/shards", auth, timeout)
        except Unreachable as exc:
            more = f"; trying {bases[i + 1].removeprefix('http://')}" if i + 1 < len(bases) else ""
            err.print(f"{base.removeprefix('http://')}: unreachable ({exc}){more}", markup=False, highlight=False, soft_wrap=True)
            continue
        except Refused as exc:
            err.print(f"moorline cluster status: {exc}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        _print(console, base, cluster, shards, wide)
        return
    hint = "" if len(bases) > 1 else (
        " (give the others too: --http HOST:PORT,HOST:PORT,...; the HTTP listeners of a cluster's nodes "
        "are not announced to each other)")
    err.print(f"moorline cluster status: no node answered{hint}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _replicas(s: dict[str, Any]) -> str:
    return ", ".join(
        f"{name}: {r.get('match') if r.get('match') is not None else '-'}"
        + (f"/{r['applied']}" if "applied" in r else "")
        for name, r in sorted(s.get("replicas", {}).items()))


def _print(console: Any, base: str, cluster: dict[str, Any], shards: dict[str, Any], wide: bool | None) -> None:
    from rich.table import Table

    narrow = not wide if wide is not None else console.width < NARROW_BELOW_COLUMNS
    console.print(f"as {base.removeprefix('http://')} sees it", highlight=False)
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
    if narrow:
        # Five short columns fit 80: learners, term and the offsets' low-water mark go; voters are
        # the replicas' names.
        table = Table(title=f"shards ({shards['shard_count']})")
        for col in ("shard", "leader", "commit", "replicas", "state"):
            table.add_column(col, no_wrap=col != "replicas")
        for s in shards["shards"]:
            table.add_row(str(s["shard"]), s.get("leader") or "[red]none[/red]", str(s.get("commit", "-")),
                          _replicas(s), "ok" if s.get("available", True) else f"[red]{s.get('error', 'failed')}[/red]")
    else:
        table = Table(title=f"shards ({shards['shard_count']})")
        for col in ("shard", "leader", "voters", "learners", "term", "commit", "replicas (match / applied)",
                    "offsets", "state"):
            table.add_column(col)
        for s in shards["shards"]:
            table.add_row(str(s["shard"]), s.get("leader") or "[red]none[/red]", ",".join(s.get("voters", [])),
                          ",".join(s.get("learners", [])) or "-", str(s.get("term", "-")), str(s.get("commit", "-")),
                          _replicas(s), f"{s['low_water']}..{s['next_offset']}",
                          "ok" if s.get("available", True) else f"[red]{s.get('error', 'failed')}[/red]")
    console.print(table)
    console.print(REPLICAS_NOTE, highlight=False, style="dim")
    print_membership(console, cluster)


register(app)  # forget, shard add-replica|remove-replica


def _post(base: str, path: str, body: Any, auth: str | None, timeout_s: float) -> Any:
    return _request(base, path, auth, timeout_s, body)


@app.command()
def drain(
    node: Annotated[str, typer.Argument(help="the node to drain, by its --node-id (e.g. n2)")],
    http: Annotated[str, typer.Option(
        help="any live node's HTTP listener HOST:PORT, or several separated by commas: the first that answers "
             "is asked (and forwards the request to NODE over the cluster link)")] = "127.0.0.1:8888",
    user: Annotated[str | None, typer.Option(help="HTTP Basic user (an admin)")] = None,
    password: Annotated[str | None, typer.Option(help="HTTP Basic password")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (instead of user/password)")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for each node's answer")] = 5.0,
    wait: Annotated[float, typer.Option(
        help="then wait up to this many seconds until NODE has stopped (no longer reachable from the node "
             "asked); 0: do not wait")] = 0.0,
) -> None:
    """Drain NODE: it refuses new connections (MQTT 5: 0x9C naming another node), hands its leaderships
    over, closes each client once its publishes are answered (MQTT 5: DISCONNECT 0x9C with a Server
    Reference) and exits 0 within cluster.drain_timeout_s. Then restart it, and wait for
    GET /v1/health?ready=cluster before draining the next one (docs/operations.md, rolling restart)."""
    import time

    from rich.console import Console

    err = Console(stderr=True)
    auth = auth_header(user, password, token)
    bases = _addresses(http)
    if not bases:
        raise typer.BadParameter("give at least one HOST:PORT", param_hint="--http")
    for i, base in enumerate(bases):
        try:
            answer = _post(base, "/v1/drain", {"node": node}, auth, timeout)
        except Unreachable as exc:
            more = f"; trying {bases[i + 1].removeprefix('http://')}" if i + 1 < len(bases) else ""
            err.print(f"{base.removeprefix('http://')}: unreachable ({exc}){more}", markup=False, highlight=False)
            continue
        except Refused as exc:
            err.print(f"moorline cluster drain: {exc}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        how = f" (asked through {answer['forwarded_by']})" if answer.get("forwarded_by") else ""
        print(f"{node} is draining{how}; it exits within {answer.get('timeout_s')} s")
        if wait <= 0:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                cluster = _get(base, "/v1/cluster", auth, timeout)
            except Unreachable:
                if not answer.get("forwarded_by"):  # the node asked was NODE itself: it has stopped
                    print(f"{node} has stopped")
                    return
                continue
            except Refused as exc:
                err.print(f"moorline cluster drain: {exc}", markup=False, highlight=False, soft_wrap=True)
                raise typer.Exit(1) from None
            if any(n.get("id") == node and not n.get("reachable") for n in cluster.get("nodes", [])):
                print(f"{node} has stopped")
                return
        err.print(f"moorline cluster drain: {node} still running after {wait:g} s", markup=False, highlight=False)
        raise typer.Exit(1)
    err.print("moorline cluster drain: no node answered", markup=False, highlight=False)
    raise typer.Exit(1)
