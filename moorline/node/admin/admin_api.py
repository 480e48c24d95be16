"""The web console and the admin API behind it, on the node's HTTP listener (docs/console.md).

Registered by ``http_api.make_app`` on the same aiohttp application, so the listener's rules apply
to every route here too: the Host and Origin checks, the body limit, JSON errors, and the same
authentication (HTTP Basic or Bearer). Access:

- ``GET /`` and ``GET /console/{file}``: the console's static files (this package's ``console``
  folder), for any caller the listener accepts. They hold no data.
- ``GET /v1/me``: who the caller is and whether it has the admin role (the console hides admin
  actions from the others).
- ``GET /v1/sessions``, ``GET /v1/sessions/{id}``, ``GET /v1/clients``: the admin role sees every
  session and client; any other caller only those of its own user name (none for an anonymous one).
- Everything else (disconnect, session delete, retained messages, ``$share`` groups, the live
  stream): the admin role only.

What one node knows: sessions, retained messages and ``$share`` groups are replicated state (every
node holds every shard, as voter or learner), so any node lists them all, as of its last apply.
Connected clients are not replicated: ``GET /v1/clients`` adds each live peer's own list, asked
over the authenticated cluster link (peer_ask.py; the caller's role checked here, its credentials
never forwarded), and ``DELETE /v1/clients/{id}`` asks the node serving the client the same way. Rates, uptime and disk use in the live stream are this node's, computed here.

Lists are paged (``offset``, ``limit`` up to ``http.max_admin_page``) and filtered (``q``: a part
of the client id, topic or group name; more per route).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.queries import (
    all_sessions,
    claims_of,
    owed_count,
    registration,
    registrations,
    session_of,
)
from moorline.broker.session_state import Session
from moorline.broker.topic_state import DELIVERY_LIMIT
from moorline.mqtt.topics import TopicBounds, topic_filter_error
from moorline.node.admin.console import CONSOLE_HEADERS, Sampler, console_snapshot, load_console_files
from moorline.node.admin.http_api import CALLER, Caller, Handler, _err
from moorline.node.admin.peer_ask import ask_peers, live_peers
from moorline.node.edge.auth import Authorizer
from moorline.node.node import Node, reg_key_for
from moorline.node.replication.shard_host import ShardUnavailable, consume_outcome

log = logging.getLogger(__name__)

ADMINISTRATIVE_ACTION = 0x98  # MQTT 5 DISCONNECT reason: Administrative action
SESSION_END_WAIT_S = 5.0  # DELETE /v1/sessions/{id} waits this long for the end to apply
PEER_ROWS_PER_PAGE = 10  # GET /v1/clients asks each peer for at most this many http.max_admin_page of rows


def _page(req: web.Request, max_page: int) -> tuple[int, int] | web.Response:
    try:
        offset = int(req.query.get("offset", "0"))
        limit = int(req.query.get("limit", "100"))
    except ValueError:
        return _err(400, "offset and limit must be integers")
    if offset < 0 or not 1 <= limit <= max_page:
        return _err(400, f"offset must be 0 or more and limit 1..{max_page} (http.max_admin_page)")
    return offset, limit


def _paged(items: Iterable[dict[str, Any]], offset: int, limit: int) -> dict[str, Any]:
    every = list(items)
    return {"total": len(every), "offset": offset, "limit": limit, "items": every[offset:offset + limit]}


def share_groups(node: Node, q: str = "") -> list[dict[str, Any]]:
    """One row per $share group and filter whose name contains ``q``, summed over the shards
    (GET /v1/groups, the group metrics, ``moorline groups``)."""
    agg: dict[tuple[str, str], dict[str, Any]] = {}
    for h in node.hosts:
        topics = h.state.topics
        dead_lettered: dict[str, int] = {}  # group registration -> recorded delivery_limit drops
        for d in topics.drops:
            if d.reason == DELIVERY_LIMIT:
                dead_lettered[d.reg_key] = dead_lettered.get(d.reg_key, 0) + 1
        for _rk, reg in registrations(topics):
            if reg.share_group is None or q not in reg.share_group:
                continue
            row = agg.setdefault((reg.share_group, reg.filter), {
                "group": reg.share_group, "filter": reg.filter, "members": [], "backlog": 0, "in_flight": 0,
                "shards": 0, "single_active": False, "active": [], "max_deliveries": 0, "ack_timeout_ms": 0,
                "dead_letter_pending": 0, "redelivering": 0, "dead_lettered": 0})
            for m in reg.members:
                if m not in row["members"]:
                    row["members"].append(m)
            row["backlog"] += max(0, owed_count(reg) - len(claims_of(reg)))
            row["in_flight"] += len(claims_of(reg))
            row["shards"] += 1
            row["dead_lettered"] += dead_lettered.get(reg.reg_key, 0)
            # Work queues (docs/queues.md): a single-active group's active member per shard (one
            # member, but a handover may be under way in one shard and not another).
            wq = reg.queue
            if wq is not None:
                if wq.single_active:
                    row["single_active"] = True
                    if wq.active and wq.active not in row["active"]:
                        row["active"].append(wq.active)
                row["max_deliveries"] = max(row["max_deliveries"], wq.max_deliveries)
                row["ack_timeout_ms"] = max(row["ack_timeout_ms"], wq.ack_timeout_ms)
                row["dead_letter_pending"] += len(wq.dead)
                row["redelivering"] += len(wq.attempts)
    return [agg[k] for k in sorted(agg)]


def register_admin(app: web.Application, node: Node, authorizer: Authorizer) -> None:
    """Adds the console and the admin routes to the node's HTTP application (``http_api.make_app``)."""
    cfg = node.cfg
    hcfg = cfg.http
    max_page = hcfg.max_admin_page
    bounds = TopicBounds(cfg.mqtt.max_topic_levels, cfg.mqtt.max_topic_length)
    files = load_console_files()
    sampler = Sampler(node, hcfg.console_update_interval_s, hcfg.console_history_s)
    streams: set[web.StreamResponse] = set()
    closing = asyncio.Event()
    routes = web.RouteTableDef()

    async def on_startup(_app: web.Application) -> None:
        sampler.start()
        # The app is built before the node opens (node/assembly.py), its runner set up after: the
        # cluster link exists now. Peers' admin requests (the cluster-wide client list) are answered
        # here. (Tests serve this app for stand-ins of a Node too: those have no link.)
        link = node.link if isinstance(node, Node) else None
        if link is not None:
            link.on_admin_request = answer_peer

    async def on_shutdown(_app: web.Application) -> None:
        closing.set()

    async def on_cleanup(_app: web.Application) -> None:
        sampler.stop()
        link = node.link if isinstance(node, Node) else None
        if link is not None and link.on_admin_request is answer_peer:
            link.on_admin_request = None

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)

    def admin_only() -> web.Response | None:
        if CALLER.get().admin:
            return None
        return _err(403, "this route needs the admin role (auth.admin_users)")

    def owner_filter() -> Callable[[str], bool]:
        """Whose sessions and clients the caller may see: every one (admin) or its own user name's."""
        caller: Caller = CALLER.get()
        if caller.admin:
            return lambda _principal: True
        mine = authorizer.owner_name(caller.principal)
        return lambda principal: bool(mine) and principal == mine

    def me_name() -> str:
        return node.node_name(node.member[0])

    # --- the console's files --------------------------------------------------------------------
    def static(name: str) -> web.Response:
        found = files.get(name)
        if found is None:
            return _err(404, f"no console file {name!r}")
        body, kind = found
        return web.Response(body=body, content_type=kind, charset="utf-8" if kind.startswith("text") else None,
                            headers=CONSOLE_HEADERS)

    @web.middleware
    async def console_index(request: web.Request, handler: Handler) -> web.StreamResponse:
        """``GET /``: the console's page. A middleware, not a route, so the route table (and
        /v1/openapi.json) holds the API alone; it runs after the listener's own middlewares (Host,
        Origin, body limit, authentication), as a route's handler would."""
        if request.path == "/" and request.method in ("GET", "HEAD"):
            return static("index.html")
        return await handler(request)

    app.middlewares.append(console_index)

    @routes.get("/console/{file}")
    async def console_file(req: web.Request) -> web.Response:
        return static(req.match_info["file"])

    @routes.get("/v1/me")
    async def me(_req: web.Request) -> web.Response:
        caller: Caller = CALLER.get()
        return web.json_response({"user": caller.principal.username, "admin": caller.admin, "node": me_name()})

    # --- clients --------------------------------------------------------------------------------
    def client_rows() -> Iterable[dict[str, Any]]:
        now_wall, now_mono = time.time(), node.clock.monotonic()
        for cid, conn in sorted(node.connections.items()):
            principal = authorizer.owner_name(conn.principal)
            yield {"client_id": cid, "user": conn.principal.username, "principal": principal,
                   "node": me_name(), "address": conn.peer,
                   "protocol": "MQTT 5" if conn.version == 5 else "MQTT 3.1.1" if conn.version == 4 else "MQTT 3.1",
                   "since_ms": round((now_wall - (now_mono - conn.connected_at)) * 1000)}

    def my_clients(q: str, user: str | None, owner: str | None) -> list[dict[str, Any]]:
        """This node's clients whose id contains ``q`` (of ``user``; of the owner name ``owner``,
        None: anyone's), by client id."""
        return [r for r in client_rows() if q in r["client_id"] and (user is None or r["user"] == user)
                and (owner is None or r["principal"] == owner)]

    def answer_peer(peer: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A member's admin request over the cluster link (peer_ask.py): its asker checked the
        caller's role and narrowed the question to what the caller may see."""
        if op == "clients":
            q, user, owner, limit = args.get("q", ""), args.get("user"), args.get("owner"), args.get("limit")
            if not isinstance(q, str) or not isinstance(limit, int) or limit < 0 \
                    or not isinstance(user, str | None) or not isinstance(owner, str | None):
                return {"error": "clients: q, user, owner or limit malformed"}
            rows = my_clients(q, user, owner)
            return {"total": len(rows), "items": rows[:limit]}
        if op == "disconnect":
            cid = args.get("client_id")
            if not isinstance(cid, str):
                return {"error": "disconnect: client_id missing"}
            conn = node.connections.get(cid)
            if conn is None:
                return {"disconnected": False}
            conn.disconnect(ADMINISTRATIVE_ACTION, "administrative action")
            log.info("client %r disconnected by an administrator (%s, asked through %s)", cid,
                     str(args.get("by", "?"))[:100], peer)
            return {"disconnected": True}
        return {"error": f"unknown admin request {op[:40]!r}"}

    def scope_of(req: web.Request) -> str | web.Response:
        scope = req.query.get("scope", "cluster")
        if scope not in ("cluster", "node"):
            return _err(400, "scope must be cluster (every node's clients) or node (this node's)")
        return scope

    @routes.get("/v1/clients")
    async def clients(req: web.Request) -> web.Response:
        """This node's clients and, unless ``scope=node``, every live peer's (asked over the cluster
        link, peer_ask.py): a peer that cannot be asked or does not answer in time is listed in
        ``unreachable``; one whose rows for this page were cut (``10 * http.max_admin_page`` rows a
        peer at most) in ``partial``."""
        page = _page(req, max_page)
        if isinstance(page, web.Response):
            return page
        offset, limit = page
        scope = scope_of(req)
        if isinstance(scope, web.Response):
            return scope
        q, user, only = req.query.get("q", ""), req.query.get("user"), req.query.get("node")
        caller: Caller = CALLER.get()
        owner = None if caller.admin else (authorizer.owner_name(caller.principal) or "")
        me = me_name()
        rows = my_clients(q, user, owner) if only in (None, me) and owner != "" else []
        total = len(rows)
        unreachable: list[dict[str, str]] = []
        partial: list[str] = []
        if scope == "cluster" and node.link is not None and owner != "":
            live, down = live_peers(node, node.clock.monotonic())
            if only is not None:
                live = [n for n in live if n == only]
                down = {k: v for k, v in down.items() if k == only}
            unreachable += [{"node": k, "error": v} for k, v in sorted(down.items())]
            want = min(offset + limit, PEER_ROWS_PER_PAGE * max_page)  # enough of each peer's first rows for this page
            answers = await ask_peers(node.link, live, "clients",
                                      {"q": q, "user": user, "owner": owner, "limit": want},
                                      hcfg.peer_request_timeout_s)
            for name, ans in answers.items():
                got = ans.answer
                items = got.get("items") if got is not None else None
                if got is None or not isinstance(items, list) or not isinstance(got.get("total"), int):
                    unreachable.append({"node": name, "error": ans.error or "answered without a client list"})
                    continue
                rows += [r for r in items if isinstance(r, dict) and isinstance(r.get("client_id"), str)
                         and (owner is None or r.get("principal") == owner)]
                total += got["total"]
                if len(items) < min(got["total"], offset + limit):
                    partial.append(name)
            unreachable.sort(key=lambda u: u["node"])
        rows.sort(key=lambda r: (r["client_id"], str(r.get("node"))))
        out: dict[str, Any] = {"node": me, "scope": scope, "total": total, "offset": offset, "limit": limit,
                               "items": rows[offset:offset + limit]}
        if scope == "cluster":
            out.update(unreachable=unreachable, partial=sorted(partial))
        return web.json_response(out)

    @routes.delete("/v1/clients/{client_id}")
    async def disconnect(req: web.Request) -> web.Response:
        """Here if the client is connected here; else (unless ``scope=node``) through the node that
        serves its session (the session shard's owner), or every live peer when none is known;
        asked over the cluster link (peer_ask.py)."""
        if (refused := admin_only()) is not None:
            return refused
        scope = scope_of(req)
        if isinstance(scope, web.Response):
            return scope
        cid = req.match_info["client_id"]
        me = me_name()
        by = CALLER.get().principal.username
        conn = node.connections.get(cid)
        if conn is not None:
            conn.disconnect(ADMINISTRATIVE_ACTION, "administrative action")
            log.info("client %r disconnected by an administrator (%s)", cid, by)
            return web.json_response({"client_id": cid, "node": me, "disconnected": True})
        if scope == "node" or node.link is None:
            return _err(404, f"client {cid!r} is not connected to this node ({me})", node=me)
        live, down = live_peers(node, node.clock.monotonic())
        sess = find_session(cid)
        owner = node.node_name(sess.owner_node) if sess is not None and sess.connected and sess.owner_node else None
        if owner is not None and owner != me:
            if owner not in live:
                return _err(503, f"client {cid!r} is served by {owner}, which cannot be asked: "
                                 f"{down.get(owner, 'not a member')}", owner_node=owner)
            live = [owner]
        answers = await ask_peers(node.link, live, "disconnect", {"client_id": cid, "by": by},
                                  hcfg.peer_request_timeout_s)
        for name, ans in sorted(answers.items()):
            if ans.answer is not None and ans.answer.get("disconnected") is True:
                return web.json_response({"client_id": cid, "node": name, "disconnected": True, "forwarded_by": me})
        failed = {n: a.error for n, a in answers.items() if a.answer is None}
        unreachable = [{"node": k, "error": v} for k, v in sorted({**down, **failed}.items())]
        if failed:
            return _err(502, f"client {cid!r}: no node disconnected it", nodes=failed, unreachable=unreachable)
        return _err(404, f"client {cid!r} is not connected to any node that answered", node=me,
                    unreachable=unreachable)

    # --- sessions -------------------------------------------------------------------------------
    def find_session(cid: str) -> Session | None:
        return session_of(node.hosts[node.session_shard(cid)].state.sessions, cid)

    def owed_of(sess: Session) -> tuple[int, int]:
        """(messages, bytes) the topic shards hold for the session's own (not $share) subscriptions."""
        count = size = 0
        for flt in sess.subs:
            reg_key, inner, group = reg_key_for(sess.client_id, flt)
            if group is not None:
                continue
            for shard in node.shards_for_filter(inner):
                topics = node.hosts[shard].state.topics
                reg = registration(topics, reg_key)
                if reg is not None:
                    count += owed_count(reg)
                    size += topics.owed_bytes.get(reg_key, 0)
        return count, size

    def inflight_of(sess: Session) -> int:
        live = node.live.get(sess.client_id)
        if live is not None and live.ephemeral and live.epoch == sess.epoch:
            return len(live.local_inflight)
        return len(sess.inflight)

    def session_row(sess: Session) -> dict[str, Any]:
        return {"client_id": sess.client_id, "user": sess.principal or None, "connected": sess.connected,
                "owner_node": node.node_name(sess.owner_node) if sess.connected and sess.owner_node else None,
                "epoch": sess.epoch, "expiry_s": sess.expiry_s, "subscriptions": len(sess.subs),
                "inflight": inflight_of(sess),
                "last_seen_ms": None if sess.connected else sess.disconnected_at_ms,
                "will_pending": sess.will is not None and not sess.connected}

    @routes.get("/v1/sessions")
    async def sessions(req: web.Request) -> web.Response:
        page = _page(req, max_page)
        if isinstance(page, web.Response):
            return page
        q, user = req.query.get("q", ""), req.query.get("user")
        connected = req.query.get("connected")
        if connected not in (None, "true", "false"):
            return _err(400, "connected must be true or false")
        visible = owner_filter()
        every: list[Session] = []
        for h in node.hosts:
            every.extend(s for s in all_sessions(h.state.sessions)
                         if visible(s.principal) and q in s.client_id and (user is None or s.principal == user)
                         and (connected is None or s.connected == (connected == "true")))
        every.sort(key=lambda s: s.client_id)
        offset, limit = page
        return web.json_response({"total": len(every), "offset": offset, "limit": limit,
                                  "items": [session_row(s) for s in every[offset:offset + limit]]})

    @routes.get("/v1/sessions/{client_id}")
    async def session(req: web.Request) -> web.Response:
        cid = req.match_info["client_id"]
        sess = find_session(cid)
        if sess is None or not owner_filter()(sess.principal):
            return _err(404, f"no session {cid!r}")
        owed, owed_bytes = owed_of(sess)
        return web.json_response({
            **session_row(sess), "shard": node.session_shard(cid), "owed": owed, "owed_bytes": owed_bytes,
            "inbound_qos2": len(sess.inbound_qos2),
            "will": None if sess.will is None else {"topic": sess.will.topic, "qos": sess.will.qos,
                                                    "delay_s": sess.will.delay_s, "due_ms": sess.will_due_ms},
            "subscriptions_list": [{"filter": s.filter, "qos": s.qos, "no_local": s.no_local,
                                    "retain_as_published": s.retain_as_published,
                                    "retain_handling": s.retain_handling, "subscription_id": s.sub_id}
                                   for s in sess.subs.values()],
        })

    async def wait_gone(cid: str, incarnation: int) -> bool:
        deadline = time.monotonic() + SESSION_END_WAIT_S
        while time.monotonic() < deadline:
            s = find_session(cid)
            if s is None or s.incarnation != incarnation:
                return True
            await asyncio.sleep(0.05)
        return False

    @routes.delete("/v1/sessions/{client_id}")
    async def end_session(req: web.Request) -> web.Response:
        """Ends the session as its expiry would: the will (if any) is published now, registrations
        and $share claims go. Through the session shard's log, as the node's own close path."""
        if (refused := admin_only()) is not None:
            return refused
        cid = req.match_info["client_id"]
        sess = find_session(cid)
        if sess is None:
            return _err(404, f"no session {cid!r}")
        incarnation = sess.incarnation
        conn = node.connections.get(cid)
        live = node.live.get(cid)
        if sess.connected:
            if conn is None or live is None or live.epoch != sess.epoch:
                owner = node.node_name(sess.owner_node) if sess.owner_node else "another node"
                return _err(409, f"session {cid!r} is connected to {owner}: end it through that node's HTTP API",
                            owner_node=owner)
            # Served here: the connection closes with 0x98 and its close path ends the session now
            # (expiry 0), the will included.
            conn.session_expiry_override = 0
            conn.will_on_close = True
            conn.disconnect(ADMINISTRATIVE_ACTION, "session ended by an administrator")
        else:
            shard = node.session_shard(cid)
            try:
                fut = node.propose(shard, c.SessionClose(node.now_ms(), cid, sess.epoch, True, 0))
                assert fut is not None
                ended = await node.bounded(fut, shard)
                if isinstance(ended, Session):
                    await node.lifecycle.end_session(ended, "session_expired")
                else:  # a will is due now: housekeeping publishes it and ends the session
                    await node.lifecycle.session_housekeeping(shard)
            except ShardUnavailable as exc:
                return _err(503, f"session shard unavailable: {exc}")
        log.info("session %r ended by an administrator (%s)", cid, CALLER.get().principal.username)
        gone = await wait_gone(cid, incarnation)
        return web.json_response({"client_id": cid, "ended": gone}, status=200 if gone else 202)

    # --- retained -------------------------------------------------------------------------------
    def retained_filter(req: web.Request) -> str | web.Response:
        flt = req.query.get("filter", "#")
        if (why := topic_filter_error(flt, bounds)) is not None:
            return _err(400, f"invalid topic filter: {why}")
        return flt

    def retained_matches(flt: str) -> list[tuple[int, str, StoredMessage]]:
        out = []
        for h in node.hosts:
            topics = h.state.topics
            for topic in topics.retained_index.match(flt):
                msg = topics.retained.get(topic)
                if msg is not None:
                    out.append((h.shard, topic, msg))
        out.sort(key=lambda r: r[1])
        return out

    @routes.get("/v1/retained")
    async def retained(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        flt = retained_filter(req)
        if isinstance(flt, web.Response):
            return flt
        page = _page(req, max_page)
        if isinstance(page, web.Response):
            return page
        rows = ({"topic": t, "shard": s, "bytes": len(m.payload), "qos": m.qos, "guid": m.guid.hex(),
                 "timestamp_ms": m.ts_ms} for s, t, m in retained_matches(flt))
        return web.json_response(_paged(rows, *page))

    @routes.delete("/v1/retained")
    async def clear_retained(req: web.Request) -> web.Response:
        """A retained publish with an empty payload per matching topic (at most http.max_admin_page
        per call; ``remaining`` says how many more matched)."""
        if (refused := admin_only()) is not None:
            return refused
        if "filter" not in req.query:
            return _err(400, "filter is required (e.g. filter=%23 clears every retained message)")
        flt = retained_filter(req)
        if isinstance(flt, web.Response):
            return flt
        found = retained_matches(flt)
        now = node.now_ms()
        key = CALLER.get().key
        pending: list[tuple[str, asyncio.Future[Any]]] = []
        failed: list[dict[str, str]] = []
        for _shard, topic, _msg in found[:max_page]:
            msg = StoredMessage(topic, b"", 1, True, node.new_guid(), now, None, None, "")
            try:
                fut = node.propose(node.topic_shard(topic), c.Publish(msg, key, None, None))
            except ShardUnavailable as exc:
                failed.append({"topic": topic, "error": str(exc)})
                continue
            assert fut is not None
            pending.append((topic, fut))
        if pending:
            await asyncio.wait([f for _, f in pending], timeout=cfg.mqtt.publish_timeout_s)
        cleared = 0
        for topic, fut in pending:
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result().status != "refused":
                cleared += 1
            else:
                if not fut.done():  # answered "try again": its outcome, later, is nobody's
                    fut.add_done_callback(consume_outcome)
                failed.append({"topic": topic, "error": "no outcome in time (or refused): try again"})
        return web.json_response({"filter": flt, "cleared": cleared, "failed": failed,
                                  "remaining": max(0, len(found) - max_page)})

    # --- $share groups --------------------------------------------------------------------------
    @routes.get("/v1/groups")
    async def groups(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        page = _page(req, max_page)
        if isinstance(page, web.Response):
            return page
        return web.json_response(_paged(share_groups(node, req.query.get("q", "")), *page))

    # --- live stream ----------------------------------------------------------------------------
    @routes.get("/v1/console/stream")
    async def stream(req: web.Request) -> web.StreamResponse:
        """Server-sent events: a full snapshot first (with the rate history), then one every
        http.console_update_interval_s; at most http.max_console_streams at once."""
        if (refused := admin_only()) is not None:
            return refused
        if len(streams) >= hcfg.max_console_streams:
            return _err(429, f"too many console streams open (http.max_console_streams = {hcfg.max_console_streams})",
                        {"Retry-After": "5"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        streams.add(resp)
        try:
            await resp.prepare(req)
            full = True
            while not closing.is_set() and not node.stopping.is_set() and not node.leadership.handing_over:
                data = json.dumps(console_snapshot(node, sampler, full), separators=(",", ":"))
                full = False
                await resp.write(f"retry: 2000\nevent: snapshot\ndata: {data}\n\n".encode())
                try:
                    await asyncio.wait_for(closing.wait(), hcfg.console_update_interval_s)
                except TimeoutError:
                    pass
        except ConnectionError:  # the console went away
            pass
        finally:
            streams.discard(resp)
        return resp

    app.add_routes(routes)
