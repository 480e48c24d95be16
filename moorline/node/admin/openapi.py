"""The node's HTTP API as data: every route, its parameters, bodies and answers, and the OpenAPI 3
document built from them (served at ``GET /v1/openapi.json``).

This table is the reference the tests hold the code and the prose to: every route aiohttp
registers in ``http_api.make_app`` has an entry here and a section in docs/http-api.md, and the
JSON the routes answer matches these schemas (tests/node/test_node_openapi.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import moorline

Schema = dict[str, Any]

OPENAPI_VERSION = "3.0.3"

# What a route needs of its caller (see http_api: the authentication middleware and admin_only).
CALLER = "caller"  # anyone the listener accepts: anonymous on an open loopback listener, else credentials
ADMIN = "admin"  # a caller with the admin role (auth.admin_users; anonymous on an open loopback listener)
OPEN_STATUS = "open_status"  # no credentials while auth.http_open_status is true (the default)


def _t(kind: str, description: str | None = None, **extra: Any) -> Schema:
    out: Schema = {"type": kind, **extra}
    if description:
        out["description"] = description
    return out


def integer(description: str | None = None, **extra: Any) -> Schema:
    return _t("integer", description, **extra)


def string(description: str | None = None, **extra: Any) -> Schema:
    return _t("string", description, **extra)


def boolean(description: str | None = None) -> Schema:
    return _t("boolean", description)


def number(description: str | None = None) -> Schema:
    return _t("number", description)


def array(items: Schema, description: str | None = None, **extra: Any) -> Schema:
    return _t("array", description, items=items, **extra)


def obj(props: dict[str, Schema], required: tuple[str, ...] = (), description: str | None = None,
        more: bool | Schema = False) -> Schema:
    """An object with these properties; ``more``: whether (or as what) other properties may appear."""
    out = _t("object", description, properties=props, additionalProperties=more)
    if required:
        out["required"] = list(required)
    return out


def nullable(schema: Schema) -> Schema:
    return {**schema, "nullable": True}


GUID = string("32 hex characters (16 bytes)", pattern="^[0-9a-f]{32}$")
INCARNATION = string("the shard's incarnation id (hex); it changes only if the shard is rebuilt")
USER_PROPERTIES = array(array(string(), minItems=2, maxItems=2),
                        "MQTT 5 user properties as [name, value] pairs, in order")
ERROR = obj({"error": string("what is wrong, in words")}, ("error",),
            "an error; some carry more fields that say where to resume (named per route)", more=True)

SHARD = obj({
    "shard": integer(), "incarnation": INCARNATION,
    "low_water": integer("lowest offset from which every message is still present (only rises)"),
    "next_offset": integer("the offset the next accepted message gets"),
    "available": boolean("false once the shard stopped on damage"),
    "error": string("why the shard stopped (file and offset); only when it did"),
}, ("shard", "incarnation", "low_water", "next_offset", "available"),
    more=True)  # and, as this replica sees the shard's Raft group: leader, voters, term, commit, ...

MESSAGE = obj({
    "offset": integer(), "topic": string(), "payload": string("the payload, base64", format="byte"),
    "qos": integer(enum=[0, 1, 2]), "retain": boolean(), "guid": GUID,
    "timestamp_ms": integer("publish time: when the node stamped the message, ms since the epoch"),
    "user_properties": USER_PROPERTIES,
}, ("offset", "topic", "payload", "qos", "retain", "guid", "timestamp_ms", "user_properties"))

PUBLISH_ITEM = obj({
    "topic": string("topic name (no wildcards)"),
    "payload": string("the payload, base64 (default: empty)", format="byte"),
    "qos": integer("default 1; the answer waits for the outcome at any QoS", enum=[0, 1, 2]),
    "retain": boolean("default false"),
    "user_properties": USER_PROPERTIES,
    "guid": GUID,
    "producer": string("a sequenced producer's id: 16 hex characters (8 bytes); with seq", pattern="^[0-9a-f]{16}$"),
    "seq": integer("the producer's sequence number; the GUID is then producer followed by seq"),
}, ("topic",))

PUBLISH_RESULT = obj({
    "status": string("ok or duplicate: stored (at offset); refused: it entered no log (reason); "
                     "unknown: it may have, send it again with the same guid or producer sequence (error)",
                     enum=["ok", "duplicate", "refused", "unknown"]),
    "shard": integer(),
    "offset": integer("the message's offset (the original's for a duplicate); -1 when there is none or it is "
                      "not known (a sequenced producer's duplicate below its highest sequence)"),
    "reason": string("why it was refused"),
    "error": string("why the outcome is unknown"),
}, ("status", "shard", "offset"))

DROP = obj({
    "guid": GUID, "reason": string("the counted limit that removed it, e.g. queue_cap, message_expiry, "
                                   "session_expired, clean_start, share_qos2_member_gone"),
    "shard": integer(), "offset": integer(),
    "session": nullable(string("the client id whose subscription it was owed to; null for a $share group")),
    "subscription": string("the subscription: client id / filter, or the $share group's key"),
}, ("guid", "reason", "shard", "offset", "session", "subscription"))

HEALTH = obj({
    "ok": boolean("no shard failed on this node"), "failed_shards": obj({}, more=string()),
    "draining": boolean("this node drains (it refuses new clients, then exits)"),
    "drain": obj({}, (), "while draining: phase, reason, elapsed_s, timeout_s, clients_closed, clients_cut",
                 more=True),
    "ready": boolean("with ready=: ready"), "not_ready": array(string(), "with ready=: why not, one line each"),
}, ("ok", "failed_shards", "draining"))


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "path" | "query"
    schema: Schema
    description: str
    required: bool = False


@dataclass(frozen=True)
class Route:
    method: str  # lower case, as OpenAPI writes it
    path: str  # aiohttp's and OpenAPI's template syntax agree: /v1/shards/{shard}/messages
    summary: str
    access: str  # CALLER, ADMIN or OPEN_STATUS
    responses: dict[int, tuple[str, Schema | None]]  # status -> (meaning, JSON schema; None: not JSON)
    params: tuple[Param, ...] = ()
    body: Schema | None = None
    tags: tuple[str, ...] = field(default=())


MOVE = obj({"id": integer(), "shard": integer("the group id (shard.count: the metadata group)"),
            "kind": string(enum=["add_learner", "promote", "remove"]), "node": string(),
            "origin": string(enum=["reconcile", "manual"]), "started_ms": integer(), "ended_ms": integer(),
            "outcome": string("done, or why it was given up")}, ("id", "shard", "kind", "node", "origin"))
MEMBERSHIP = obj({
    "members": array(obj({
        "name": string(), "node_id": integer(), "storage_id": string(), "cluster": string(), "client": string(),
        "zone": string(), "state": string(enum=["active", "draining", "leaving", "left", "forgotten"]),
        "since_ms": integer(), "live": boolean("this node hears from it")}, ("name", "state"), more=True)),
    "shards": array(obj({"shard": integer(), "voters": array(string()), "learners": array(string()),
                         "target": nullable(integer("voters wanted: shard.replicas")),
                         "health": string(enum=["at target", "below target", "above target"])},
                        ("shard", "voters", "target", "health"))),
    "moves": array(MOVE, "configuration changes in progress: one per shard at most"),
    "recent_moves": array(MOVE, "the last ones ended"),
    "reconciler": obj({"interval_s": number(), "max_concurrent_moves": integer(),
                       "runs_here": integer()}, more=True),
}, ("members", "shards", "moves"), "the metadata group's member table and shard configurations (cluster mode)")

ROUTES: tuple[Route, ...] = (
    Route("get", "/v1/shards", "Shards: incarnation, low-water mark and next offset of each", ADMIN, {
        200: ("every shard of the node", obj({"shard_count": integer(), "shards": array(SHARD)},
                                            ("shard_count", "shards"))),
    }, tags=("fetch",)),
    Route("get", "/v1/cluster", "Nodes of the cluster as this node sees them", ADMIN, {
        200: ("the nodes: one on a single node", obj({"nodes": array(obj({
            "id": string("the node's name"), "storage_id": nullable(string()), "self": boolean(),
            "reachable": boolean(), "groups_led": integer("Raft groups (shards and the metadata group) this node "
                                                          "leads, as seen from here"),
        }, ("id", "self", "reachable", "groups_led"), more=True)),
            "metadata": obj({
                "leader": nullable(string()), "voters": array(string()), "learners": array(string()),
                "term": integer(), "commit": integer(), "applied_index": integer(),
                "record": nullable(obj({"cluster_id": string(), "shard_count": integer(), "replicas": integer(),
                                        "feature_level": integer()}, ("shard_count", "replicas"), more=True)),
            }, ("leader", "voters", "record"), more=True),
            "membership": nullable(MEMBERSHIP)}, ("nodes", "metadata"))),
    }, tags=("admin",)),
    Route("get", "/v1/shards/{shard}/messages", "Committed messages of a shard by offset (reading never consumes)",
          CALLER, {
              200: ("a page of messages; continue from scanned_to (a page examines at most http.max_scan_per_fetch "
                    "offsets and holds about http.max_answer_bytes at most)", obj({
                  "shard": integer(), "incarnation": INCARNATION, "low_water": integer(), "next_offset": integer(),
                  "scanned_to": integer("the offset after the last one examined: the next page's from"),
                  "messages": array(MESSAGE),
              }, ("shard", "incarnation", "low_water", "next_offset", "scanned_to", "messages"))),
              400: ("shard, from or max not an integer, or an invalid filter (also: over mqtt.max_topic_levels "
                    "or max_topic_length)", ERROR),
              403: ("the filter reaches no topic the caller may read", ERROR),
              404: ("no such shard (shard_count says how many there are)", ERROR),
              409: ("the shard's incarnation is not the one asked for (incarnation says the current one)", ERROR),
              410: ("from is below the low-water mark (low_water says where to resume)", ERROR),
              500: ("a committed message cannot be read from the store (offset names it)", ERROR),
              503: ("the shard stopped on damage", ERROR),
          }, params=(
              Param("shard", "path", integer(minimum=0), "shard number, 0 .. shard_count - 1", required=True),
              Param("from", "query", integer(minimum=0, default=0), "first offset to examine"),
              Param("max", "query", integer(minimum=1, default=1000, maximum=10_000),
                    "at most this many messages (capped at 10,000)"),
              Param("filter", "query", string(), "an MQTT topic filter; only matching messages come back"),
              Param("incarnation", "query", string(), "fail with 409 unless the shard still has this incarnation"),
          ), tags=("fetch",)),
    Route("get", "/v1/topics/{topic}/shard", "The shard a topic's messages are stored in", CALLER, {
        200: ("the topic's shard", obj({"topic": string(), "shard": integer(), "shard_count": integer()},
                                       ("topic", "shard", "shard_count"))),
        400: ("not a valid topic name (wildcards, or over mqtt.max_topic_levels / max_topic_length)", ERROR),
    }, params=(Param("topic", "path", string(), "the topic name; its slashes may be written as they are",
                     required=True),), tags=("fetch",)),
    Route("post", "/v1/publish", "Publish messages; answered per item", CALLER, {
        200: ("one result per item, in order", obj({"results": array(PUBLISH_RESULT)}, ("results",))),
        400: ("the body is not JSON, messages is not a list of at most 10,000, or an item is malformed "
              "(item says which; nothing was proposed)", ERROR),
    }, body=obj({"messages": array(PUBLISH_ITEM, maxItems=10_000)}, ("messages",)), tags=("publish",)),
    Route("post", "/v1/pins", "Set or renew a reader's retention pin", ADMIN, {
        200: ("the pin as set (ttl_ms as granted)", obj({
            "reader": string(), "offsets": obj({}, more=integer()), "ttl_ms": integer(),
        }, ("reader", "offsets", "ttl_ms"))),
        400: ("a malformed pin", ERROR),
        403: ("the pin is held by another principal", ERROR),
        429: ("too many pins: pins.max_pins for the node or pins.max_pins_per_principal", ERROR),
    }, body=obj({
        "reader": string("the reader's id, 1-200 characters"),
        "offsets": obj({}, description="shard number (as a string) -> first offset the reader still needs",
                       more=integer(minimum=0)),
        "ttl_ms": number("how long the pin holds without renewal (default pins.reader_pin_ttl_s; "
                         "cut to pins.max_ttl_s)"),
    }, ("reader", "offsets")), tags=("fetch",)),
    Route("delete", "/v1/pins/{reader}", "Remove a reader's pin", ADMIN, {
        200: ("removed (or there was none)", obj({"ok": boolean()}, ("ok",))),
        403: ("the pin is held by another principal", ERROR),
    }, params=(Param("reader", "path", string(), "the reader's id", required=True),), tags=("fetch",)),
    Route("get", "/v1/sink-markers/{query_id}", "A Spark sink's last committed batch", ADMIN, {
        200: ("the marker; null when none was set", obj({"batch_id": nullable(integer())}, ("batch_id",))),
    }, params=(Param("query_id", "path", string(), "the streaming query's id", required=True),), tags=("spark",)),
    Route("put", "/v1/sink-markers/{query_id}", "Move a Spark sink's commit marker (it never goes back)", ADMIN, {
        200: ("the marker now: the higher of the old and the new batch id", obj({"batch_id": integer()},
                                                                                ("batch_id",))),
        400: ("query id longer than 200 characters or batch_id not an integer", ERROR),
        429: ("this principal created pins.max_sink_markers_per_principal new markers in this run", ERROR),
        503: ("the shard is unavailable, or the outcome is unknown: set it again", ERROR),
    }, params=(Param("query_id", "path", string(), "the streaming query's id (1-200 characters)", required=True),),
        body=obj({"batch_id": integer()}, ("batch_id",)), tags=("spark",)),
    Route("get", "/v1/drops", "Messages removed by a counted limit before every owed ack", ADMIN, {
        200: ("every recorded drop still in shard state", obj({"drops": array(DROP)}, ("drops",))),
    }, tags=("admin",)),
    Route("get", "/v1/health", "Whether every shard serves; with ready=, whether the node (or cluster) is ready",
          OPEN_STATUS, {
              200: ("every shard serves (and, with ready=, ready)", HEALTH),
              400: ("ready is neither node nor cluster", ERROR),
              503: ("a shard stopped (failed_shards maps it to the reason), or, with ready=, not ready "
                    "(not_ready says why)", HEALTH),
          }, params=(Param("ready", "query", string(enum=["node", "cluster"]),
                           "node: 503 unless this node takes clients (not draining, no shard failed), for a load "
                           "balancer; cluster: 503 unless it is safe to take the next node down (every peer heard "
                           "from and not draining, every group led and every replica caught up), for a rolling "
                           "restart"),), tags=("admin",)),
    Route("post", "/v1/drain", "Drain this node or another (then it exits 0)", ADMIN, {
        202: ("the drain began (already: it had)", obj({
            "node": string(), "draining": boolean(), "already": boolean(), "forwarded_by": string(),
            "timeout_s": number("cluster.drain_timeout_s")}, ("node", "draining", "timeout_s"))),
        400: ("the body is not {} or {\"node\": NAME}", ERROR),
        404: ("no such node in the cluster", ERROR),
    }, body=obj({"node": string("the node's name (--node-id); this node when absent")}), tags=("admin",)),
    Route("get", "/metrics", "Prometheus metrics (text exposition format; docs/metrics.md)", OPEN_STATUS, {
        200: ("metrics, text/plain", None),
    }, tags=("admin",)),
    Route("get", "/v1/openapi.json", "This description of the API (OpenAPI 3)", CALLER, {
        200: ("an OpenAPI 3 document", obj({}, more=True)),
    }, tags=("admin",)),
)

# The web console and the admin API behind it (moorline/node/admin/admin_api.py, docs/console.md).
PAGE_PARAMS = (
    Param("offset", "query", integer(minimum=0, default=0), "skip this many items of the list"),
    Param("limit", "query", integer(minimum=1, default=100), "at most this many items (up to http.max_admin_page)"),
)
Q_PARAM = Param("q", "query", string(), "only items whose client id (group name) contains this")
CLIENT_ID = Param("client_id", "path", string(), "the MQTT client id", required=True)
SCOPE = Param("scope", "query", string(enum=["cluster", "node"], default="cluster"),
              "cluster: every live node (asked over the cluster link); node: this node only")
RETAINED_FILTER = Param("filter", "query", string(default="#"), "an MQTT topic filter")


def page_of(item: Schema) -> Schema:
    return obj({"total": integer("items that matched"), "offset": integer(), "limit": integer(),
                "items": array(item)}, ("total", "offset", "limit", "items"), more=True)


SESSION_ROW = obj({
    "client_id": string(), "user": nullable(string("the user name the session belongs to")),
    "connected": boolean(), "owner_node": nullable(string("the node serving it while connected")),
    "epoch": integer("changes at every connect"), "expiry_s": integer(),
    "subscriptions": integer("how many"), "inflight": integer("deliveries sent and not yet acknowledged"),
    "last_seen_ms": nullable(integer("when it disconnected (null while connected)")),
    "will_pending": boolean("a will waits for its delay"),
}, ("client_id", "connected", "epoch"), more=True)

CONSOLE_ROUTES: tuple[Route, ...] = (
    Route("get", "/console/{file}", "The console's script and style sheet", CALLER, {
        200: ("the file", None), 404: ("no such console file", ERROR),
    }, params=(Param("file", "path", string(), "console.js or console.css", required=True),), tags=("console",)),
    Route("get", "/v1/me", "Who the caller is, and whether it has the admin role", CALLER, {
        200: ("the caller", obj({"user": nullable(string()), "admin": boolean(), "node": string("this node")},
                                ("user", "admin", "node"))),
    }, tags=("console",)),
    Route("get", "/v1/console/stream", "Live cluster view and this node's rates (server-sent events)", ADMIN, {
        200: ("text/event-stream: a snapshot event (JSON) every http.console_update_interval_s", None),
        429: ("http.max_console_streams are open", ERROR),
    }, tags=("console",)),
    Route("get", "/v1/clients", "Clients connected to the cluster (scope=node: this node's); the admin role sees "
          "all, others their own. Every live peer is asked at once over the authenticated cluster link, each "
          "answer within http.peer_request_timeout_s",
          CALLER, {
              200: ("a page of clients; with scope=cluster, the nodes that could not be asked (unreachable) and "
                    "those whose rows for this page were cut at 10 x http.max_admin_page (partial)", page_of(obj({
                  "client_id": string(), "user": nullable(string()), "node": string(), "address": string(),
                  "protocol": string(), "since_ms": integer("connected since, ms since the epoch"),
              }, ("client_id", "node", "address", "protocol", "since_ms"), more=True))),
              400: ("offset, limit or scope out of range", ERROR),
          }, params=(*PAGE_PARAMS, Q_PARAM, Param("user", "query", string(), "only this user's clients"),
                     Param("node", "query", string(), "only the clients of this node"), SCOPE),
          tags=("console",)),
    Route("delete", "/v1/clients/{client_id}", "Disconnect a client (MQTT 5 DISCONNECT 0x98), on whichever node "
          "serves it (scope=node: only if here)", ADMIN, {
        200: ("disconnected", obj({"client_id": string(), "node": string(), "disconnected": boolean(),
                                   "forwarded_by": string("the node asked, when another disconnected it")},
                                  ("client_id", "node", "disconnected"))),
        404: ("the client is not connected to any node that answered", ERROR),
        502: ("the nodes asked refused or did not answer", ERROR),
        503: ("the node serving it cannot be asked", ERROR),
    }, params=(CLIENT_ID, SCOPE), tags=("console",)),
    Route("get", "/v1/sessions", "Sessions (the admin role sees all; others their own)", CALLER, {
        200: ("a page of sessions", page_of(SESSION_ROW)),
        400: ("offset, limit or connected out of range", ERROR),
    }, params=(*PAGE_PARAMS, Q_PARAM, Param("user", "query", string(), "only this user's sessions"),
               Param("connected", "query", string(enum=["true", "false"]), "only connected (true) or not")),
        tags=("console",)),
    Route("get", "/v1/sessions/{client_id}", "One session: subscriptions, owed and in-flight counts", CALLER, {
        200: ("the session", obj({
            **SESSION_ROW["properties"], "shard": integer("its session shard"),
            "owed": integer("messages its subscriptions are owed"), "owed_bytes": integer(),
            "inbound_qos2": integer("QoS 2 publishes received and not released"),
            "will": nullable(obj({"topic": string(), "qos": integer(), "delay_s": integer(),
                                  "due_ms": nullable(integer())}, ("topic",), more=True)),
            "subscriptions_list": array(obj({
                "filter": string(), "qos": integer(), "no_local": boolean(), "retain_as_published": boolean(),
                "retain_handling": integer(), "subscription_id": nullable(integer())}, ("filter", "qos"))),
        }, ("client_id", "connected", "epoch"), more=True)),
        404: ("no such session (or not the caller's)", ERROR),
    }, params=(CLIENT_ID,), tags=("console",)),
    Route("delete", "/v1/sessions/{client_id}", "End a session as its expiry would, will included", ADMIN, {
        200: ("ended", obj({"client_id": string(), "ended": boolean()}, ("client_id", "ended"))),
        202: ("the end is proposed and not applied here yet", obj({"client_id": string(), "ended": boolean()},
                                                                  ("client_id", "ended"))),
        404: ("no such session", ERROR),
        409: ("the session is connected to another node (owner_node): end it there", ERROR),
        503: ("the session shard is unavailable", ERROR),
    }, params=(CLIENT_ID,), tags=("console",)),
    Route("get", "/v1/retained", "Retained messages", ADMIN, {
        200: ("a page of retained messages", page_of(obj({
            "topic": string(), "shard": integer(), "bytes": integer("payload size"), "qos": integer(),
            "guid": GUID, "timestamp_ms": integer()}, ("topic", "shard", "bytes")))),
        400: ("an invalid filter, offset or limit", ERROR),
    }, params=(RETAINED_FILTER, *PAGE_PARAMS), tags=("console",)),
    Route("delete", "/v1/retained", "Clear retained messages (an empty retained publish per topic)", ADMIN, {
        200: ("what was cleared", obj({
            "filter": string(), "cleared": integer(), "failed": array(obj({"topic": string(), "error": string()})),
            "remaining": integer("matched beyond http.max_admin_page: call again")},
            ("filter", "cleared", "failed", "remaining"))),
        400: ("no filter, or an invalid one", ERROR),
    }, params=(RETAINED_FILTER,), tags=("console",)),
    Route("get", "/v1/groups", "$share groups: members and backlog", ADMIN, {
        200: ("a page of groups (one per group and filter)", page_of(obj({
            "group": string(), "filter": string(), "members": array(string()),
            "backlog": integer("messages owed and not claimed by a member"),
            "in_flight": integer("claimed by a member, not acknowledged"), "shards": integer(),
            # work queues (docs/queues.md)
            "single_active": boolean(), "active": array(string("the single-active group's active member")),
            "max_deliveries": integer(), "ack_timeout_ms": integer(),
            "dead_letter_pending": integer("past max_deliveries, not yet on the dead-letter topic"),
            "redelivering": integer("handed out and returned unacknowledged at least once"),
            "dead_lettered": integer("moved to the dead-letter topic, as far as the shards' recorded drops go")},
            ("group", "filter", "members", "backlog")))),
        400: ("offset or limit out of range", ERROR),
    }, params=(*PAGE_PARAMS, Q_PARAM), tags=("console",)),
)
ROUTES += CONSOLE_ROUTES

MEMBER_NAME = Param("name", "path", string(), "a member's node name", required=True)
MEMBERSHIP_ROUTES: tuple[Route, ...] = (
    Route("post", "/v1/cluster/members/{name}/join", "Admit a new node before it starts with --join",
          ADMIN, {
              200: ("already admitted, not started yet", obj({"member": string(), "node_id": integer(), "state": string(),
                                                              "start": string()}, ("member", "node_id"), more=True)),
              201: ("admitted: the member table has its entry and node id; start it with the command in start",
                    obj({"member": string(), "node_id": integer(), "state": string(), "start": string(),
                         "note": string()}, ("member", "node_id", "start"), more=True)),
              400: ("no cluster address, or a bad name or address", ERROR),
              409: ("refused: the name is a member (forget a wiped one first), the address is another member's, "
                    "an address off loopback without cluster TLS; or no member table here", ERROR),
              503: ("the metadata group did not commit the change", ERROR),
          }, params=(MEMBER_NAME, Param("cluster", "query", string(), "the node's --cluster HOST:PORT", required=True),
                     Param("zone", "query", string(), "its zone (cluster.zone)")),
          tags=("admin",)),
    Route("post", "/v1/cluster/members/{name}/forget", "Forget a node gone for good (its replicas are replaced)",
          ADMIN, {
              200: ("the member is forgotten; the reconciler removes its memberships, then grows the shards",
                    obj({"member": string(), "state": string(), "forced": boolean(), "risks": array(string()),
                         "shards": array(integer("groups it voted in"))}, ("member", "state"), more=True)),
              400: ("force is not true or false", ERROR),
              404: ("no such member", ERROR),
              409: ("refused: the node is live, or removing it would leave a group without a live majority "
                    "(reasons lists which and why); or no member table here", ERROR),
              503: ("the metadata group did not commit the change", ERROR),
          }, params=(MEMBER_NAME, Param("force", "query", string(enum=["true", "false"]),
                                        "forget even so (disaster recovery): says what it risks")),
          tags=("admin",)),
    Route("post", "/v1/cluster/members/{name}/leave", "A live node leaves: its voters are replaced, then it stops",
          ADMIN, {
              200: ("already leaving or left", obj({"member": string(), "state": string(), "note": string()},
                                                   ("member", "state"), more=True)),
              202: ("the member is leaving; the reconciler gives its shards voters elsewhere, then removes it",
                    obj({"member": string(), "state": string(), "shards": array(integer("shards it votes in")),
                         "note": string()}, ("member", "state", "shards"), more=True)),
              404: ("no such member", ERROR),
              409: ("refused: the node is not live, was forgotten, or too few live active nodes would remain to "
                    "take its voters; or no member table here", ERROR),
              503: ("the metadata group did not commit the change", ERROR),
          }, params=(MEMBER_NAME,), tags=("admin",)),
    Route("post", "/v1/cluster/shards/{shard}/replicas/{name}", "Add a voter of a shard on a node (add-replica)",
          ADMIN, {
              202: ("recorded as a move; the shard's leader proposes it", obj({"shard": integer(), "move": MOVE},
                                                                              ("shard", "move"), more=True)),
              400: ("shard is not a number", ERROR), 404: ("no such shard or member", ERROR),
              409: ("refused: a change is in progress on the shard, or the node is a voter already", ERROR),
              503: ("the metadata group did not commit the change", ERROR),
          }, params=(SHARD_PARAM_MEMBERSHIP := Param("shard", "path", integer(), "the shard", required=True),
                     MEMBER_NAME), tags=("admin",)),
    Route("delete", "/v1/cluster/shards/{shard}/replicas/{name}", "Remove a node's replica of a shard "
          "(remove-replica)", ADMIN, {
              202: ("recorded as a move; the shard's leader proposes it", obj({"shard": integer(), "move": MOVE},
                                                                              ("shard", "move"), more=True)),
              400: ("shard is not a number", ERROR), 404: ("no such shard or member", ERROR),
              409: ("refused: a change is in progress on the shard, the node is not a member of it, or removing "
                    "it would leave no live majority", ERROR),
              503: ("the metadata group did not commit the change", ERROR),
          }, params=(SHARD_PARAM_MEMBERSHIP, MEMBER_NAME), tags=("admin",)),
)
ROUTES += MEMBERSHIP_ROUTES


def _operation(route: Route) -> Schema:
    responses: dict[str, Any] = {}
    for status, (text, schema) in sorted(route.responses.items()):
        resp: Schema = {"description": text}
        if schema is not None:
            resp["content"] = {"application/json": {"schema": schema}}
        elif route.path == "/metrics":
            resp["content"] = {"text/plain": {"schema": string()}}
        responses[str(status)] = resp
    # What the middleware and the admin check may answer on top of each route's own.
    auth_errors = {"401": "credentials missing or wrong (when the listener requires them)",
                   "421": "the Host header names no name of this node (http.allowed_hosts)",
                   "429": "too many failed logins from this address (Retry-After says when to try again)"}
    if route.method in ("post", "put", "delete"):
        auth_errors["403"] = "a cross-origin request (Origin not allowed: http.allowed_origins)"
    if route.body is not None:
        auth_errors["413"] = "the body is larger than http.max_body_bytes"
        auth_errors["415"] = "the body was not sent with Content-Type: application/json"
    if route.access == ADMIN:
        auth_errors["403"] = "the caller lacks the admin role (auth.admin_users)" + (
            ", or a cross-origin request" if "403" in auth_errors else "")
    for code, text in auth_errors.items():
        responses.setdefault(code, {"description": text, "content": {"application/json": {"schema": ERROR}}})
    op: Schema = {
        "operationId": f"{route.method}_{route.path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"
                       .replace(".", "_"),
        "summary": route.summary,
        "tags": list(route.tags),
        "x-moorline-access": route.access,
        "responses": dict(sorted(responses.items())),
    }
    if route.params:
        op["parameters"] = [{"name": p.name, "in": p.where, "required": p.required or p.where == "path",
                             "description": p.description, "schema": p.schema} for p in route.params]
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": route.body}}}
    if route.access == OPEN_STATUS:
        op["security"] = [{}, {"basic": []}, {"bearer": []}]
    return op


def openapi_document() -> Schema:
    """The OpenAPI 3 document of ROUTES (the same every call: a fresh dict)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "moorline node HTTP API",
            "version": moorline.__version__,
            "description": (
                "Fetch committed messages by offset, publish, pins, Spark sink markers, drops, health and "
                "metrics. Credentials (HTTP Basic from auth.password_file, or a Bearer token from "
                "auth.token_file) are needed when anonymous clients are not allowed or the listener is off "
                "loopback; on an open loopback listener a request without them is served as the anonymous "
                "admin. x-moorline-access says what a route needs: caller, admin (auth.admin_users) or "
                "open_status (open while auth.http_open_status is true). Every GET route also answers HEAD. "
                "An unknown route or method answers 404 or 405 with a JSON error. "
                "See docs/http-api.md."
            ),
        },
        "components": {"securitySchemes": {
            "basic": {"type": "http", "scheme": "basic"},
            "bearer": {"type": "http", "scheme": "bearer", "description": "a token from `moorline token`"},
        }},
        "security": [{}, {"basic": []}, {"bearer": []}],
        "paths": paths,
    }
