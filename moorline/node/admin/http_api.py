"""The node's HTTP listener: fetch API (Spark, dashboards), publish, pins, sink markers, drops, metrics.

Serves only committed, applied messages. Errors are JSON with the low-water mark or the current
incarnation, so a reader knows where it can resume.

Authentication (``auth_required``: anonymous clients not allowed, or the listener off loopback):
every route needs HTTP Basic credentials from the password file or ``Authorization: Bearer TOKEN``
from the token file, except ``/metrics`` and ``/v1/health`` while ``auth.http_open_status`` is set.
Without ``auth_required`` a request without credentials is served as the anonymous principal with
the admin role (a loopback listener, open by configuration); credentials, when sent, are checked.
Authorization follows the MQTT ACLs: fetching messages = reading their topics (messages on topics
the caller may not read are left out, and nothing in the answer says they were there), publishing =
the publish ACL and the ``$`` rule per item; shard listing, pins, sink markers and drops need the
admin role (``auth.admin_users``). A Basic login of a username that no password file proves (an open
node without one) is served without any user's rights (auth.py: proven identities).

Web pages and the default open loopback node (docs/security.md):

- ``Host`` must name this node: an IP address, ``localhost``, the listener's own host, or one of
  ``http.allowed_hosts``; any other name is refused (421), so a page whose DNS name was rebound to
  127.0.0.1 reads and writes nothing. Checked on requests that arrive on a loopback address, and on
  every request once ``http.allowed_hosts`` is set (a node reached by DNS name lists its names there).
- A state-changing request (POST, PUT, DELETE) with an ``Origin`` other than the request's own or one
  of ``http.allowed_origins`` is refused (403); POST and PUT need ``Content-Type: application/json``
  (415), which a cross-site page cannot send without a CORS preflight this node never grants.

Bounds: a body over ``http.max_body_bytes`` is refused (413) before it is read; filters obey
``mqtt.max_topic_levels`` / ``max_topic_length``; a fetch examines at most ``http.max_scan_per_fetch``
offsets, yielding to the event loop every ``http.scan_slice``, and stops adding messages past
``http.max_answer_bytes`` (the reader continues from ``scanned_to``). Every answer, unknown routes and
methods included, is JSON (except ``/metrics``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import os
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from moorline.broker import commands as c
from moorline.broker.messages import MessageProps, StoredMessage, decode_message
from moorline.mqtt.topics import (
    TopicBounds,
    matches,
    topic_filter_error,
    topic_name_error,
    validate_topic_name,
)
from moorline.node.admin.http_guard import arrived_on_loopback, host_of, is_ip_literal
from moorline.node.admin.metrics_text import prometheus_text
from moorline.node.admin.openapi import openapi_document
from moorline.node.admin.pins import remove_pin, set_pin
from moorline.node.edge.auth import Authorizer, Login, Principal
from moorline.node.edge.drain import Drain, cluster_readiness, node_readiness
from moorline.node.node import Node
from moorline.node.replication.shard_host import ShardUnavailable

MAX_FETCH = 10_000
MAX_PUBLISH_BATCH = 10_000
MAX_ID_CHARS = 200  # reader ids (pins) and query ids (sink markers)
STATE_CHANGING = frozenset({"POST", "PUT", "DELETE", "PATCH"})
NEEDS_JSON_BODY = frozenset({"POST", "PUT", "PATCH"})
JSON_OFF_LOOP_BYTES = 256 << 10  # larger bodies are parsed on a thread
OPEN_STATUS_PATHS = frozenset({"/metrics", "/v1/health"})
# The Spark sink's client sends this User-Agent (moorline/spark/node_client.py): its publishes count
# as source="spark" in the metrics. A label for operators, not a proof of who sent them.
SPARK_USER_AGENT_PREFIX = "moorline-spark/"
ANONYMOUS = Principal(None, "")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Caller:
    principal: Principal
    admin: bool
    # Who owns pins and sink markers (and de-duplicates publishes): the user name, "" anonymous;
    # an unproven name on a node that proves identities counts as anonymous (Authorizer.owner_name).
    key: str = ""


# Set by the authentication middleware for the request's task (aiohttp runs each request in its own).
CALLER: ContextVar[Caller] = ContextVar("moorline_http_caller")
CHALLENGE = {"WWW-Authenticate": 'Basic realm="moorline", charset="UTF-8", Bearer realm="moorline"'}


def _err(status: int, text: str, headers: dict[str, str] | None = None, **extra: Any) -> web.Response:
    return web.json_response({"error": text, **extra}, status=status, headers=headers)


class BodyError(Exception):
    """A request body that cannot be taken: too large (413) or not JSON (400)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


async def read_json(req: web.Request, max_body: int) -> Any:
    """The request's JSON body, parsed on a thread when large; BodyError when it is over
    ``http.max_body_bytes`` (aiohttp's client_max_size) or not JSON."""
    try:
        raw = await req.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyError(413, f"request body larger than http.max_body_bytes ({max_body} bytes)") from exc
    try:
        if len(raw) > JSON_OFF_LOOP_BYTES:
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except ValueError as exc:
        raise BodyError(400, f"bad JSON body: {exc}") from exc


def _consume(fut: asyncio.Future[Any]) -> None:
    # An outcome nobody waits for any more (answered "unknown") must not be logged as never retrieved.
    if not fut.cancelled():
        fut.exception()


def make_app(node: Node, authorizer: Authorizer, auth_required: bool, drain: Drain | None = None) -> web.Application:
    cfg = node.cfg
    open_status = cfg.auth.http_open_status
    anonymous = Caller(ANONYMOUS, admin=not auth_required)
    markers_created: dict[str, int] = {}  # Caller.key -> query ids it created in this run
    hcfg = cfg.http
    bounds = TopicBounds(cfg.mqtt.max_topic_levels, cfg.mqtt.max_topic_length)
    # Host names this node answers to (module docstring); IP literals always pass.
    own_names = {"localhost"} | {host_of(h) for h in hcfg.allowed_hosts}
    for listener in (cfg.listeners.http, cfg.listeners.https):
        if listener:
            own_names.add(host_of(listener.rpartition(":")[0].strip("[]") or "127.0.0.1"))
    any_origin = "*" in hcfg.allowed_origins
    allowed_origins = {o.strip().lower().rstrip("/") for o in hcfg.allowed_origins}

    def host_allowed(request: web.Request) -> bool:
        """Checked on loopback (DNS rebinding's target: the open default node), and everywhere once
        http.allowed_hosts names the host names of a node reached by name (off loopback every
        request needs credentials, which a rebinding page does not have)."""
        host_header = request.headers.get("Host")
        if not host_header or not (hcfg.allowed_hosts or arrived_on_loopback(request)):
            return True  # HTTP/1.0 without Host: no browser sends that
        name = host_of(host_header)
        return name in own_names or is_ip_literal(name)

    def origin_allowed(req: web.Request) -> bool:
        origin = req.headers.get("Origin")
        if origin is None or any_origin:
            return True  # not a browser's cross-site request (browsers send Origin on every POST/PUT/DELETE)
        origin = origin.strip().lower().rstrip("/")
        if origin in allowed_origins:
            return True
        scheme, sep, authority = origin.partition("://")
        return bool(sep) and scheme == req.scheme and authority == (req.host or "").lower()

    @web.middleware
    async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer is JSON: aiohttp's own 404, 405 and 413 included."""
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            return _err(405, f"method {request.method} not allowed on {request.path}",
                        {"Allow": ", ".join(sorted(exc.allowed_methods))})
        except web.HTTPNotFound:
            return _err(404, f"no route {request.method} {request.path} (GET /v1/openapi.json lists them)")
        except web.HTTPRequestEntityTooLarge:
            return _err(413, f"request body larger than http.max_body_bytes ({hcfg.max_body_bytes} bytes)")

    @web.middleware
    async def web_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        """DNS rebinding, cross-site requests, oversized bodies: refused before credentials are checked."""
        if not host_allowed(request):
            return _err(421, "this node does not serve that Host name (http.allowed_hosts)")
        if request.method in STATE_CHANGING:
            if not origin_allowed(request):
                return _err(403, "cross-origin request refused (http.allowed_origins)")
            if request.method in NEEDS_JSON_BODY and request.content_type != "application/json":
                return _err(415, "the body must be JSON, sent with Content-Type: application/json")
        length = request.content_length
        if length is not None and length > hcfg.max_body_bytes:
            return _err(413, f"request body larger than http.max_body_bytes ({hcfg.max_body_bytes} bytes)",
                        {"Connection": "close"})
        return await handler(request)

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization")
        if header is None:
            if auth_required and not (open_status and request.path in OPEN_STATUS_PATHS):
                return _err(401, "credentials required: HTTP Basic (password file) or Bearer token", CHALLENGE)
            CALLER.set(anonymous)
            return await handler(request)
        scheme, _, value = header.strip().partition(" ")
        peer = request.remote or ""
        scheme = scheme.lower()
        if scheme == "basic":
            try:
                user, sep, password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
            except (binascii.Error, ValueError):
                return _err(401, "malformed Basic credentials", CHALLENGE)
            if not sep or not user:
                return _err(401, "malformed Basic credentials", CHALLENGE)
            login, proven = await authorizer.login(user, password.encode(), peer)
            name: str | None = user
        elif scheme == "bearer":
            login, name = authorizer.authenticate_token(value.strip(), peer)
            proven = True
        else:
            return _err(401, f"unsupported authorization scheme {scheme!r}: use Basic or Bearer", CHALLENGE)
        if login is Login.RATE_LIMITED:
            retry = str(math.ceil(cfg.auth.failed_login_window_s / cfg.auth.max_failed_logins))
            return _err(429, login.value, {"Retry-After": retry})
        if login is not Login.OK:
            return _err(401, "bad credentials", CHALLENGE)
        who = Principal(name, "", proven)
        # An unproven name (an open node without a password file) is served as the anonymous caller is.
        CALLER.set(Caller(who, authorizer.is_admin(who) or (not proven and anonymous.admin),
                          authorizer.owner_name(who)))
        return await handler(request)

    def admin_only() -> web.Response | None:
        if CALLER.get().admin:
            return None
        return _err(403, "this route needs the admin role (auth.admin_users)")

    app = web.Application(client_max_size=hcfg.max_body_bytes, middlewares=[json_errors, web_guard, authenticate])
    routes = web.RouteTableDef()

    @routes.get("/v1/shards")
    async def shards(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        out = []
        for h in node.hosts:
            t = h.state.topics
            out.append({"shard": h.shard, "incarnation": t.incarnation, "low_water": t.low_water,
                        "next_offset": t.next_offset, "available": h.failed is None,
                        **({"error": h.failed} if h.failed else {}), **node.raft_status(h.shard)})
        return web.json_response({"shard_count": node.shard_count, "shards": out})

    @routes.get("/v1/cluster")
    async def cluster(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        body = node.cluster_status()
        body["membership"] = node.membership.status()  # the member table and shard targets (None: one node)
        return web.json_response(body)

    @routes.get("/v1/shards/{shard}/messages")
    async def messages(req: web.Request) -> web.Response:
        who = CALLER.get().principal
        try:
            shard = int(req.match_info["shard"])
            start = int(req.query.get("from", "0"))
            limit = min(int(req.query.get("max", "1000")), MAX_FETCH)
        except ValueError:
            return _err(400, "shard, from and max must be integers")
        if not 0 <= shard < node.shard_count:
            return _err(404, f"no shard {shard}", shard_count=node.shard_count)
        flt = req.query.get("filter")
        if flt is not None and (why := topic_filter_error(flt, bounds)) is not None:
            return _err(400, f"invalid topic filter: {why}")
        if flt is not None and not authorizer.can_subscribe(who, flt):
            return _err(403, f"not authorized to read {flt!r}")
        host = node.hosts[shard]
        t = host.state.topics
        if host.failed:
            return _err(503, host.failed)
        if host.reads_remotely:
            # shard.learners = "none": this node keeps only its own clients' part of the shard
            # (node/replication/reader.py); a scan of it here would silently miss messages.
            replicas = [node.node_name(v[0]) for v in host.group_conf().voters]
            return _err(503, f"this node holds no replica of shard {shard}: fetch it from one of its "
                             f"replicas ({', '.join(replicas)})", replicas=replicas)
        inc = req.query.get("incarnation")
        if inc is not None and inc != t.incarnation:
            return _err(409, "shard incarnation changed", incarnation=t.incarnation)
        if start < t.low_water:
            return _err(410, f"offset {start} is below the low-water mark {t.low_water}", low_water=t.low_water)
        # Without a filter every topic comes back, $-topics too, so "#" would not describe the read.
        check = authorizer.read_check_needed(who, flt) if flt is not None else bool(authorizer.rules)
        can_read = authorizer.can_read
        incarnation, low_water = t.incarnation, t.low_water
        out: list[dict[str, Any]] = []
        answer_bytes = 0
        end = min(t.next_offset, start + hcfg.max_scan_per_fetch)  # at most this much is examined per call
        next_offset = t.next_offset
        offset = start
        slice_end = offset + hcfg.scan_slice
        while offset < end and len(out) < limit and answer_bytes < hcfg.max_answer_bytes:
            if offset >= slice_end:
                await asyncio.sleep(0)  # let the loop serve others between slices of a long scan
                slice_end = offset + hcfg.scan_slice
                if host.failed or host.state.topics is not t or t.incarnation != incarnation or t.low_water > offset:
                    break  # the shard changed under the scan: answer what was read (the next call says how)
            meta = t.meta.get(offset)
            if (meta is not None and (flt is None or matches(flt, meta.topic))
                    and (not check or can_read(who, meta.topic))):
                rec = host.store.get(offset)
                if rec is None:
                    return _err(500, f"message {shard}/{offset} is committed but unreadable from the store",
                                offset=offset)
                m = decode_message(rec)
                ups = [list(kv) for kv in (m.props.user_properties if m.props else ())]
                out.append({
                    "offset": offset, "topic": m.topic, "payload": base64.b64encode(m.payload).decode(),
                    "qos": m.qos, "retain": m.retain, "guid": m.guid.hex(), "timestamp_ms": m.ts_ms,
                    "user_properties": ups,
                })
                # About what the message adds to the answer: base64 payload, topic, properties, field names.
                answer_bytes += (len(m.payload) * 4 // 3 + 2 * len(m.topic) + 200
                                 + sum(2 * (len(k) + len(v)) + 8 for k, v in ups))
            offset += 1
        return web.json_response({"shard": shard, "incarnation": incarnation, "low_water": low_water,
                                  "next_offset": next_offset, "scanned_to": offset, "messages": out})

    @routes.get("/v1/topics/{topic:.+}/shard")
    async def topic_shard(req: web.Request) -> web.Response:
        """Which shard a topic's messages are stored in (so a reader knows where to fetch them)."""
        topic = req.match_info["topic"]
        if (why := topic_name_error(topic, bounds)) is not None:
            return _err(400, f"invalid topic name: {why}")
        return web.json_response({"topic": topic, "shard": node.topic_shard(topic), "shard_count": node.shard_count})

    def parse_item(i: int, it: Any, now: int) -> tuple[StoredMessage, bytes | None, int | None, int] | str:
        """The message an item asks for, its producer and sequence, and its size; or what is wrong."""
        if not isinstance(it, dict):
            return f"item {i}: not an object"
        try:
            topic = it["topic"]
            if not isinstance(topic, str) or not validate_topic_name(topic):
                return f"item {i}: invalid topic {topic!r}"
            if (why := topic_name_error(topic, bounds)) is not None:
                return f"item {i}: invalid topic: {why}"
            payload = base64.b64decode(it.get("payload", ""), validate=True)
            qos = int(it.get("qos", 1))
            if qos not in (0, 1, 2):
                return f"item {i}: qos must be 0, 1 or 2"
            ups = tuple((str(k), str(v)) for k, v in it.get("user_properties", []))
            producer = bytes.fromhex(it["producer"]) if it.get("producer") else None
            seq = int(it["seq"]) if it.get("seq") is not None else None
            if it.get("guid"):
                guid = bytes.fromhex(it["guid"])
            elif producer is not None and seq is not None:
                guid = producer + seq.to_bytes(8, "big")
            else:
                guid = os.urandom(16)
            if len(guid) != 16 or (producer is not None and len(producer) != 8):
                return f"item {i}: guid must be 32 hex characters and producer 16"
            if (it.get("guid") or producer is not None) and not any(k == "guid" for k, _ in ups):
                # The publisher's identity for the message travels with it, as an MQTT 5
                # publisher's `guid` user property does (subscribers can de-duplicate too).
                ups = (*ups, ("guid", guid.hex()))
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            return f"item {i}: bad message: {exc}"
        # What an MQTT PUBLISH of it would at least carry: topic, payload, user properties.
        size = len(topic.encode()) + len(payload) + sum(len(k.encode()) + len(v.encode()) for k, v in ups)
        msg = StoredMessage(topic, payload, qos, bool(it.get("retain", False)), guid, now, None,
                            MessageProps(user_properties=ups) if ups else None, "")
        return msg, producer, seq, size

    @routes.post("/v1/publish")
    async def publish(req: web.Request) -> web.Response:
        """Answers per item: ``ok`` / ``duplicate`` (with its offset), ``refused`` with a reason (the
        message provably entered no log), or ``unknown`` (it may have: send it again with the same
        guid or producer sequence). A malformed item fails the whole request before anything is
        proposed."""
        caller: Caller = CALLER.get()
        source = "spark" if req.headers.get("User-Agent", "").startswith(SPARK_USER_AGENT_PREFIX) else "http"
        try:
            body = await read_json(req, hcfg.max_body_bytes)
            items = body["messages"]
        except BodyError as exc:
            return _err(exc.status, str(exc))
        except Exception as exc:
            return _err(400, f"bad JSON body: {exc}")
        if not isinstance(items, list) or len(items) > MAX_PUBLISH_BATCH:
            return _err(400, f"messages must be a list of at most {MAX_PUBLISH_BATCH}")
        now = node.now_ms()
        parsed = []
        for i, it in enumerate(items):
            item = parse_item(i, it, now)
            if isinstance(item, str):
                return _err(400, item, item=i)
            parsed.append(item)
        max_size = cfg.mqtt.max_packet_size
        results: list[dict[str, Any]] = []
        pending: list[tuple[dict[str, Any], asyncio.Future[Any]]] = []
        for msg, producer, seq, size in parsed:
            shard = node.topic_shard(msg.topic)
            entry: dict[str, Any] = {"status": "refused", "shard": shard, "offset": -1}
            results.append(entry)
            if size > max_size:
                entry["reason"] = f"larger than mqtt.max_packet_size ({size} > {max_size} bytes)"
                continue
            if not authorizer.can_publish(caller.principal, msg.topic):
                entry["reason"] = "not authorized"
                node.publish_denied[source] += 1
                continue
            node.published[source] += 1
            try:
                fut = node.propose(shard, c.Publish(msg, caller.key, producer, seq))
            except ShardUnavailable as exc:
                entry["reason"] = str(exc)
                continue
            assert fut is not None
            pending.append((entry, fut))
        if pending:
            await asyncio.wait([f for _, f in pending], timeout=cfg.mqtt.publish_timeout_s)
        for entry, fut in pending:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                r = fut.result()
                entry["status"], entry["offset"] = r.status, r.offset
                if r.status == "refused":
                    entry["reason"] = r.reason
            else:
                # Proposed, so it may be in a log: never call that a refusal (docs/design.md promise 6).
                fut.add_done_callback(_consume)
                entry["status"] = "unknown"
                entry["error"] = (f"outcome unknown: {fut.exception()!r}" if fut.done() and not fut.cancelled()
                                  else f"no outcome within mqtt.publish_timeout_s ({cfg.mqtt.publish_timeout_s} s)")
        return web.json_response({"results": results})

    def valid_id(value: Any) -> bool:
        return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS

    @routes.post("/v1/pins")
    async def pin(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        key = CALLER.get().key
        try:
            body = await read_json(req, hcfg.max_body_bytes)
            reader = body["reader"]
            offsets = {int(k): int(v) for k, v in body["offsets"].items()}
            ttl = float(body.get("ttl_ms", cfg.pins.reader_pin_ttl_s * 1000)) / 1000
        except BodyError as exc:
            return _err(exc.status, str(exc))
        except Exception as exc:
            return _err(400, f"bad pin: {exc}")
        if not valid_id(reader):
            return _err(400, f"reader must be a string of 1-{MAX_ID_CHARS} characters")
        if not all(0 <= s < node.shard_count and o >= 0 for s, o in offsets.items()):
            return _err(400, f"offsets maps shards 0..{node.shard_count - 1} to offsets >= 0")
        if not ttl > 0 or not math.isfinite(ttl):
            return _err(400, "ttl_ms must be a positive number")
        ttl = min(ttl, cfg.pins.max_ttl_s)
        # Through the logs of the shards it names (admin/pins.py): whoever leads them holds it.
        status, out = await set_pin(node, cfg, key, reader, offsets, max(1, round(ttl * 1000)))
        return web.json_response(out, status=status)

    @routes.delete("/v1/pins/{reader}")
    async def unpin(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        reader = req.match_info["reader"]
        status, out = await remove_pin(node, cfg, CALLER.get().key, reader)
        return web.json_response(out, status=status)

    @routes.get("/v1/sink-markers/{query_id}")
    async def get_marker(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        qid = req.match_info["query_id"]
        return web.json_response({"batch_id": node.sink_marker(qid)})

    @routes.put("/v1/sink-markers/{query_id}")
    async def put_marker(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        key = CALLER.get().key
        qid = req.match_info["query_id"]
        if not valid_id(qid):
            return _err(400, f"query id must be 1-{MAX_ID_CHARS} characters")
        try:
            batch = int((await read_json(req, hcfg.max_body_bytes))["batch_id"])
        except BodyError as exc:
            return _err(exc.status, str(exc))
        except Exception as exc:
            return _err(400, f"bad marker: {exc}")
        new = node.sink_marker(qid) is None
        limit = cfg.pins.max_sink_markers_per_principal
        if new and markers_created.get(key, 0) >= limit:
            return _err(429, f"too many sink markers for this principal (pins.max_sink_markers_per_principal = "
                             f"{limit})")
        try:
            fut = node.propose(node.meta_group, c.SetSinkMarker(qid, batch))
        except ShardUnavailable as exc:
            return _err(503, str(exc))
        if new:
            markers_created[key] = markers_created.get(key, 0) + 1
        assert fut is not None
        try:
            value = await asyncio.wait_for(asyncio.shield(fut), cfg.mqtt.publish_timeout_s)
        except Exception as exc:  # the marker may or may not be set: the caller sets it again
            fut.add_done_callback(_consume)
            return _err(503, f"marker outcome unknown: {exc!r}")
        return web.json_response({"batch_id": value})

    @routes.get("/v1/drops")
    async def drops(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        return web.json_response({"drops": list(node.iter_drops())})

    @routes.get("/v1/health")
    async def health(req: web.Request) -> web.Response:
        """Liveness (no ``ready``: 503 only when a shard failed; a draining node is alive), or
        readiness: ``ready=node`` (this node takes clients), ``ready=cluster`` (safe to take the next
        node down: node/edge/drain.py cluster_readiness); 503 with the reasons when not."""
        failed = {h.shard: h.failed for h in node.hosts if h.failed}
        body: dict[str, Any] = {"ok": not failed, "failed_shards": failed,
                                "draining": drain is not None and drain.draining}
        if drain is not None and drain.draining:
            body["drain"] = drain.status()
        ready = req.query.get("ready")
        if ready is None:
            return web.json_response(body, status=200 if not failed else 503)
        if ready == "node":
            reasons = node_readiness(node, drain)
        elif ready == "cluster":
            reasons = cluster_readiness(node, drain, node.clock.monotonic())
        else:
            return _err(400, f"ready must be 'node' or 'cluster', not {ready[:40]!r}")
        body.update(ready=not reasons, not_ready=reasons)
        return web.json_response(body, status=503 if reasons else 200)

    @routes.post("/v1/drain")
    async def drain_route(req: web.Request) -> web.Response:
        if (refused := admin_only()) is not None:
            return refused
        try:
            asked = await read_json(req, hcfg.max_body_bytes)
        except BodyError as exc:
            return _err(exc.status, str(exc))
        target = asked.get("node") if isinstance(asked, dict) else None
        if not isinstance(asked, dict) or not (target is None or isinstance(target, str)):
            return _err(400, 'the body must be an object: {} (this node) or {"node": NAME}')
        me = node.link.spec.me if node.link is not None else node.node_name(node.member[0])
        if target is None or target == me:
            if drain is None:
                return _err(503, "this node cannot drain here (no MQTT server)")
            started = drain.request(f"POST /v1/drain by {CALLER.get().key or 'anonymous'}")
            return web.json_response({"node": me, "draining": True, "already": not started,
                                      "timeout_s": drain.timeout_s}, status=202)
        if node.link is None or not node.link.request_drain(target):
            known = ", ".join(node.link.spec.names) if node.link is not None else me
            return _err(404, f"no node {target[:60]!r} in this cluster (nodes: {known})")
        return web.json_response({"node": target, "draining": True, "forwarded_by": me,
                                  "timeout_s": cfg.cluster.drain_timeout_s}, status=202)

    api_doc = openapi_document()

    @routes.get("/v1/openapi.json")
    async def openapi(_req: web.Request) -> web.Response:
        return web.json_response(api_doc)

    @routes.get("/metrics")
    async def metrics(_req: web.Request) -> web.Response:
        return web.Response(text=prometheus_text(node, authorizer, drain), content_type="text/plain")

    from moorline.node.admin.cluster_admin_api import register_cluster_admin  # (imports this module)
    register_cluster_admin(routes, node)
    app.add_routes(routes)
    from moorline.node.admin.admin_api import (
        register_admin,  # the console and admin routes (imports this module)
    )
    register_admin(app, node, authorizer)
    return app


async def start_http(node: Node, authorizer: Authorizer, auth_required: bool, host: str,
                     port: int) -> tuple[web.AppRunner, tuple[str, int]]:
    runner = web.AppRunner(make_app(node, authorizer, auth_required), access_log=None)  # tests only
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    sock = server.sockets[0]  # type: ignore[attr-defined]
    bound = sock.getsockname()
    return runner, (bound[0], bound[1])
