"""``moorline clients|sessions|retained``: the admin API (docs/console.md) as commands, over a node's
HTTP listener (``--http``, credentials as ``moorline cluster status`` takes them)."""

from __future__ import annotations

import base64
import datetime
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer

clients_app = typer.Typer(no_args_is_help=True, add_completion=False, help="MQTT clients connected to a node.")
sessions_app = typer.Typer(no_args_is_help=True, add_completion=False, help="MQTT sessions of the cluster.")
retained_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Retained messages of the cluster.")

Http = Annotated[str, typer.Option(help="a node's HTTP listener HOST:PORT (or a URL)")]
User = Annotated[str | None, typer.Option(help="HTTP Basic user (an admin for every item)")]
Password = Annotated[str | None, typer.Option(help="HTTP Basic password")]
Token = Annotated[str | None, typer.Option(help="bearer token (instead of user/password)")]
Limit = Annotated[int, typer.Option(help="at most this many items (up to the node's http.max_admin_page)")]
Offset = Annotated[int, typer.Option(help="skip this many items")]
AsJson = Annotated[bool, typer.Option("--json", help="print the answer as JSON")]


def _auth(user: str | None, password: str | None, token: str | None) -> str | None:
    if token:
        return f"Bearer {token}"
    if user is not None:
        return "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    return None


def call(http: str, method: str, path: str, auth: str | None, query: dict[str, Any] | None = None) -> Any:
    """The JSON answer; a clear error (exit 1) for an HTTP error or an unreachable node."""
    base = (http if http.startswith(("http://", "https://")) else f"http://{http}").rstrip("/")
    q = {k: v for k, v in (query or {}).items() if v is not None}
    url = base + path + ("?" + urllib.parse.urlencode(q) if q else "")
    req = urllib.request.Request(url, method=method, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        try:
            text = json.loads(raw).get("error", raw)
        except (ValueError, AttributeError):
            text = raw[:300]
        typer.echo(f"{method} {url}: HTTP {exc.code}: {text}", err=True)
        raise typer.Exit(1) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        typer.echo(f"cannot reach {url}: {exc}", err=True)
        raise typer.Exit(1) from exc


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def _table(title: str, columns: list[str], rows: list[list[str]], page: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    shown = len(rows)
    total = page.get("total", shown)
    table = Table(title=f"{title} ({total}" + (f", {shown} shown from {page.get('offset', 0)}" if total != shown else "")
                  + ")")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


# --- clients ------------------------------------------------------------------------------------
@clients_app.command("list")
def clients_list(http: Http = "127.0.0.1:8888", user: User = None, password: Password = None, token: Token = None,
                 q: Annotated[str | None, typer.Option(help="a part of the client id")] = None,
                 of_user: Annotated[str | None, typer.Option("--of-user", help="only this user's clients")] = None,
                 node: Annotated[str | None, typer.Option(help="only the clients of this node")] = None,
                 here: Annotated[bool, typer.Option("--here", help="only the node at --http (scope=node)")] = False,
                 limit: Limit = 100, offset: Offset = 0, as_json: AsJson = False) -> None:
    """Clients connected to the cluster (the node at --http asks the others), or to one node."""
    page = call(http, "GET", "/v1/clients", _auth(user, password, token),
                {"q": q, "user": of_user, "node": node, "scope": "node" if here else None, "limit": limit,
                 "offset": offset})
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    _table(f"clients (asked {page.get('node', '?')})", ["client id", "user", "node", "address", "protocol", "since"],
           [[c["client_id"], c.get("user") or "-", c.get("node") or "-", c["address"], c["protocol"],
             _when(c["since_ms"])] for c in page["items"]], page)
    for u in page.get("unreachable") or []:
        typer.echo(f"not listed: {u.get('node')}'s clients ({u.get('error')})", err=True)
    for name in page.get("partial") or []:
        typer.echo(f"partial: {name} has more clients than it sends for one page (10 x http.max_admin_page)", err=True)


@clients_app.command("disconnect")
def clients_disconnect(client_id: Annotated[str, typer.Argument(help="the client id")],
                       http: Http = "127.0.0.1:8888", user: User = None, password: Password = None,
                       token: Token = None) -> None:
    """Disconnect a client, on whichever node serves it (MQTT 5 DISCONNECT 0x98, Administrative action)."""
    r = call(http, "DELETE", f"/v1/clients/{urllib.parse.quote(client_id, safe='')}", _auth(user, password, token))
    typer.echo(f"disconnected {r['client_id']} from {r['node']}")


# --- sessions -----------------------------------------------------------------------------------
@sessions_app.command("list")
def sessions_list(http: Http = "127.0.0.1:8888", user: User = None, password: Password = None, token: Token = None,
                  q: Annotated[str | None, typer.Option(help="a part of the client id")] = None,
                  of_user: Annotated[str | None, typer.Option("--of-user", help="only this user's sessions")] = None,
                  connected: Annotated[bool | None, typer.Option("--connected/--disconnected",
                                                                 help="only connected (or disconnected) ones")] = None,
                  limit: Limit = 100, offset: Offset = 0, as_json: AsJson = False) -> None:
    """Sessions of the cluster (an admin sees all, another user its own)."""
    page = call(http, "GET", "/v1/sessions", _auth(user, password, token),
                {"q": q, "user": of_user, "limit": limit, "offset": offset,
                 "connected": None if connected is None else str(connected).lower()})
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    _table("sessions", ["client id", "user", "state", "owner", "epoch", "expiry", "subs", "in flight", "last seen"],
           [[s["client_id"], s.get("user") or "-", "connected" if s["connected"] else "disconnected",
             s.get("owner_node") or "-", str(s["epoch"]), f"{s['expiry_s']} s", str(s["subscriptions"]),
             str(s["inflight"]), "now" if s["connected"] else _when(s.get("last_seen_ms"))] for s in page["items"]],
           page)


@sessions_app.command("show")
def sessions_show(client_id: Annotated[str, typer.Argument(help="the client id")],
                  http: Http = "127.0.0.1:8888", user: User = None, password: Password = None,
                  token: Token = None, as_json: AsJson = False) -> None:
    """One session: owner, epoch, subscriptions, owed and in-flight counts, will."""
    s = call(http, "GET", f"/v1/sessions/{urllib.parse.quote(client_id, safe='')}", _auth(user, password, token))
    if as_json:
        typer.echo(json.dumps(s, indent=2))
        return
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{s['client_id']}[/bold] (user {s.get('user') or '-'}): "
                  + (f"connected to {s.get('owner_node')}" if s["connected"]
                     else f"disconnected since {_when(s.get('last_seen_ms'))}")
                  + f", epoch {s['epoch']}, expiry {s['expiry_s']} s, session shard {s['shard']}")
    console.print(f"owed {s['owed']} messages ({s['owed_bytes']} bytes), {s['inflight']} in flight, "
                  f"{s['inbound_qos2']} QoS 2 received and not released")
    if s.get("will"):
        console.print(f"will: {s['will']['topic']} (QoS {s['will']['qos']}, delay {s['will']['delay_s']} s)")
    _table("subscriptions", ["filter", "QoS", "no local", "subscription id"],
           [[x["filter"], str(x["qos"]), "yes" if x["no_local"] else "no",
             "-" if x.get("subscription_id") is None else str(x["subscription_id"])]
            for x in s["subscriptions_list"]], {"total": len(s["subscriptions_list"])})


@sessions_app.command("delete")
def sessions_delete(client_id: Annotated[str, typer.Argument(help="the client id")],
                    http: Http = "127.0.0.1:8888", user: User = None, password: Password = None,
                    token: Token = None,
                    yes: Annotated[bool, typer.Option("--yes", help="do not ask for confirmation")] = False) -> None:
    """End a session as its expiry would: its will is published now, its subscriptions go."""
    if not yes:
        typer.confirm(f"end session {client_id!r} (its will, if any, is published)?", abort=True)
    r = call(http, "DELETE", f"/v1/sessions/{urllib.parse.quote(client_id, safe='')}", _auth(user, password, token))
    typer.echo(f"session {r['client_id']} " + ("ended" if r["ended"] else "end proposed (not applied yet)"))


# --- retained -----------------------------------------------------------------------------------
@retained_app.command("list")
def retained_list(filter: Annotated[str, typer.Option("--filter", help="an MQTT topic filter")] = "#",
                  http: Http = "127.0.0.1:8888", user: User = None, password: Password = None, token: Token = None,
                  limit: Limit = 100, offset: Offset = 0, as_json: AsJson = False) -> None:
    """Retained messages matching --filter."""
    page = call(http, "GET", "/v1/retained", _auth(user, password, token),
                {"filter": filter, "limit": limit, "offset": offset})
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    _table("retained messages", ["topic", "bytes", "QoS", "stored", "guid"],
           [[r["topic"], str(r["bytes"]), str(r["qos"]), _when(r["timestamp_ms"]), r["guid"]] for r in page["items"]],
           page)


@retained_app.command("clear")
def retained_clear(filter: Annotated[str, typer.Option("--filter", help="an MQTT topic filter (required)")],
                   http: Http = "127.0.0.1:8888", user: User = None, password: Password = None, token: Token = None,
                   yes: Annotated[bool, typer.Option("--yes", help="do not ask for confirmation")] = False) -> None:
    """Clear the retained messages matching --filter (an empty retained publish per topic)."""
    if not yes:
        typer.confirm(f"clear every retained message matching {filter!r}?", abort=True)
    auth = _auth(user, password, token)
    cleared = 0
    while True:
        r = call(http, "DELETE", "/v1/retained", auth, {"filter": filter})
        cleared += r["cleared"]
        for f in r["failed"]:
            typer.echo(f"not cleared: {f['topic']}: {f['error']}", err=True)
        if not r["remaining"] or not r["cleared"]:
            break
    typer.echo(f"cleared {cleared} retained message{'' if cleared == 1 else 's'}")
    if r["failed"]:
        raise typer.Exit(1)
