"""``moorline cluster join|forget|leave`` and ``moorline cluster shard add-replica|remove-replica``: membership
changes through any live node's HTTP listener (the admin routes of admin/cluster_admin_api.py), and
the member table printed by ``moorline cluster status``."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer

from moorline.node.admin.cli_auth import auth_header

HttpOpt = Annotated[str, typer.Option(
    help="a node's HTTP listener HOST:PORT, or several separated by commas: the first that answers is asked")]
UserOpt = Annotated[str | None, typer.Option(help="HTTP Basic user (an admin)")]
PasswordOpt = Annotated[str | None, typer.Option(help="HTTP Basic password")]
TokenOpt = Annotated[str | None, typer.Option(help="bearer token (instead of user/password)")]
TimeoutOpt = Annotated[float, typer.Option(help="seconds to wait for each node")]


def _bases(http: str) -> list[str]:
    out = [item.strip() for item in http.split(",") if item.strip()]
    if not out:
        raise typer.BadParameter("give at least one HOST:PORT", param_hint="--http")
    return [b if b.startswith(("http://", "https://")) else f"http://{b}" for b in out]


def _call(http: str, method: str, path: str, auth: str | None, timeout_s: float) -> tuple[str, int, dict[str, Any]]:
    """(node asked, HTTP status, JSON body) from the first node of ``http`` that answers."""
    err: list[str] = []
    for base in _bases(http):
        headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
        req = urllib.request.Request(base + path, method=method, data=b"{}" if method != "GET" else None,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return base, r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"error": raw.decode(errors="replace")[:300]}
            return base, exc.code, body if isinstance(body, dict) else {"error": str(body)}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            err.append(f"{base.removeprefix('http://')}: unreachable ({reason})")
    raise _fail("no node answered: " + "; ".join(err))


def _fail(text: str) -> typer.Exit:
    from rich.console import Console

    Console(stderr=True).print(text, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(1)


def _report(what: str, status: int, body: dict[str, Any]) -> None:
    from rich.console import Console

    if status >= 400:
        lines = [f"moorline cluster {what}: refused (HTTP {status}): {body.get('error', body)}"]
        lines += [f"  - {r}" for r in body.get("reasons", [])]
        if "force" in body:
            lines.append(f"  {body['force']}")
        raise _fail("\n".join(lines))
    Console().print_json(data=body)


def join(
    node: Annotated[str, typer.Argument(help="the new node's name (its --node-id)")],
    cluster: Annotated[str, typer.Option("--cluster", help="the new node's cluster address HOST:PORT (its --cluster)")],
    zone: Annotated[str, typer.Option(help="its zone (cluster.zone)")] = "",
    http: HttpOpt = "127.0.0.1:8888", user: UserOpt = None, password: PasswordOpt = None, token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Admit a new node before it starts: the member table gets its entry and node id, and every
    member's cluster link takes its connections (authenticated as any peer: the cluster secret, or
    its certificate with cluster TLS). Then start it with the command the answer prints
    (moorline run --node-id NODE --cluster HOST:PORT --join MEMBERS): it becomes a learner of every
    shard, catches up, and the reconciler gives it its share of voters. A wiped node comes back so
    too, once its old self is forgotten (moorline cluster forget)."""
    query = urllib.parse.urlencode({"cluster": cluster, **({"zone": zone} if zone else {})})
    path = f"/v1/cluster/members/{urllib.parse.quote(node, safe='')}/join?{query}"
    _, status, body = _call(http, "POST", path, auth_header(user, password, token), timeout)
    _report("join", status, body)


def forget(
    node: Annotated[str, typer.Argument(help="the member's node name (as in --initial-cluster)")],
    force: Annotated[bool, typer.Option(
        "--force", help="forget it even if it is live or its removal leaves a shard without a live majority "
                        "(disaster recovery: the answer says what that risks)")] = False,
    http: HttpOpt = "127.0.0.1:8888", user: UserOpt = None, password: PasswordOpt = None, token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Forget a node gone for good: its voters are removed from every shard first (shrink before
    grow), then the reconciler adds voters on live nodes until every shard is at shard.replicas.
    Refused while the node is live, or when removing it would leave a shard without a live majority
    of its voters (the answer names the shards)."""
    path = f"/v1/cluster/members/{urllib.parse.quote(node, safe='')}/forget" + ("?force=true" if force else "")
    _, status, body = _call(http, "POST", path, auth_header(user, password, token), timeout)
    _report("forget", status, body)


def leave(
    node: Annotated[str, typer.Argument(help="the member's node name (a live node)")],
    http: HttpOpt = "127.0.0.1:8888", user: UserOpt = None, password: PasswordOpt = None, token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Take a live node out of the cluster for good: every shard it votes in first gets a voter on
    another node (caught up, then promoted), then loses NODE's (grow before shrink: no shard is ever
    below shard.replicas); once NODE is in no shard it is 'left', and it drains and exits 0 by itself.
    Its data directory is marked: starting it again is refused. Refused when the node is not live,
    or when too few live active nodes would remain to take its voters."""
    path = f"/v1/cluster/members/{urllib.parse.quote(node, safe='')}/leave"
    _, status, body = _call(http, "POST", path, auth_header(user, password, token), timeout)
    _report("leave", status, body)


shard_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Change one shard's replicas by hand (the reconciler respects it).")


def _replica(method: str, what: str, shard: int, node: str, http: str, auth: str | None, timeout: float) -> None:
    if shard < 0:
        raise typer.BadParameter("a shard number is 0 or more", param_hint="SHARD")
    path = f"/v1/cluster/shards/{shard}/replicas/{urllib.parse.quote(node, safe='')}"
    _, status, body = _call(http, method, path, auth, timeout)
    _report(f"shard {what}", status, body)


@shard_app.command("add-replica")
def add_replica(
    shard: Annotated[int, typer.Argument(help="the shard number")],
    node: Annotated[str, typer.Argument(help="the node to give a voter of it")],
    http: HttpOpt = "127.0.0.1:8888", user: UserOpt = None, password: PasswordOpt = None, token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Make NODE a voter of SHARD: a caught-up learner is promoted; a node that follows nothing of
    the shard becomes a learner first (run it again once it has caught up). Refused while the shard
    has another change in progress (the reconciler's, say): one change per shard at a time."""
    _replica("POST", "add-replica", shard, node, http, auth_header(user, password, token), timeout)


@shard_app.command("remove-replica")
def remove_replica(
    shard: Annotated[int, typer.Argument(help="the shard number")],
    node: Annotated[str, typer.Argument(help="the node whose replica goes")],
    http: HttpOpt = "127.0.0.1:8888", user: UserOpt = None, password: PasswordOpt = None, token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Remove NODE's replica (voter or learner) of SHARD. Refused when it would leave the shard without
    a live majority of its voters, or while another change of the shard is in progress. A shard left
    below shard.replicas is grown again by the reconciler."""
    _replica("DELETE", "remove-replica", shard, node, http, auth_header(user, password, token), timeout)


def register(app: typer.Typer) -> None:
    app.command("join")(join)
    app.command("forget")(forget)
    app.command("leave")(leave)
    app.add_typer(shard_app, name="shard")


def print_membership(console: Any, cluster: dict[str, Any]) -> None:
    """The member table, shards off target and moves in progress (``moorline cluster status``)."""
    from rich.table import Table

    ms = cluster.get("membership")
    if not ms:
        return
    members = Table(title="members (the metadata group's table)")
    for col in ("member", "node id", "state", "zone", "client address", "live"):
        members.add_column(col)
    for m in ms.get("members", []):
        state = m["state"] if m["state"] == "active" else f"[yellow]{m['state']}[/yellow]"
        members.add_row(m["name"], str(m.get("node_id", "?")), state, m.get("zone") or "-", m.get("client") or "-",
                        "yes" if m.get("live") else "[red]no[/red]")
    console.print(members)
    off = [s for s in ms.get("shards", []) if s.get("health") != "at target"]
    below = sum(1 for s in off if s["health"] == "below target")
    console.print(f"shards: {len(ms.get('shards', [])) - len(off)} at target, {below} below, {len(off) - below} above"
                  + "".join(f"; shard {s['shard']} {s['health']} ({len(s['voters'])}/{s['target']}: "
                            f"{','.join(s['voters'])})" for s in off[:8]), highlight=False)
    moves = ms.get("moves", [])
    if moves:
        table = Table(title="changes in progress")
        for col in ("shard", "change", "node", "by", "move"):
            table.add_column(col)
        for mv in moves:
            table.add_row(str(mv["shard"]), mv["kind"], mv["node"], mv["origin"], str(mv["id"]))
        console.print(table)
