"""The node's HTTP listener: fetch API (Spark, dashboards), publish, pins, sink markers, drops, metrics.

Serves only committed, applied messages. Errors are JSON with the low-water mark or the current
incarnation, so a reader knows where it can resume.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

from aiohttp import web

from moorline.broker import commands as c
from moorline.broker.messages import MessageProps, StoredMessage, decode_message
from moorline.mqtt.topics import matches, validate_topic_filter, validate_topic_name
from moorline.node.node import Node

MAX_FETCH = 10_000
MAX_PUBLISH_BATCH = 10_000


def _err(status: int, text: str, **extra: Any) -> web.Response:
    return web.json_response({"error": text, **extra}, status=status)


def make_app(node: Node) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    routes = web.RouteTableDef()

    @routes.get("/v1/shards")
    async def shards(_req: web.Request) -> web.Response:
        out = []
        for h in node.hosts:
            t = h.state.topics
            out.append({"shard": h.shard, "incarnation": t.incarnation, "low_water": t.low_water,
                        "next_offset": t.next_offset, "available": h.failed is None,
                        **({"error": h.failed} if h.failed else {})})
        return web.json_response({"shard_count": node.shard_count, "shards": out})

    @routes.get("/v1/shards/{shard}/messages")
    async def messages(req: web.Request) -> web.Response:
        try:
            shard = int(req.match_info["shard"])
            start = int(req.query.get("from", "0"))
            limit = min(int(req.query.get("max", "1000")), MAX_FETCH)
        except ValueError:
            return _err(400, "shard, from and max must be integers")
        if not 0 <= shard < node.shard_count:
            return _err(404, f"no shard {shard}", shard_count=node.shard_count)
        host = node.hosts[shard]
        t = host.state.topics
        if host.failed:
            return _err(503, host.failed)
        inc = req.query.get("incarnation")
        if inc is not None and inc != t.incarnation:
            return _err(409, "shard incarnation changed", incarnation=t.incarnation)
        if start < t.low_water:
            return _err(410, f"offset {start} is below the low-water mark {t.low_water}", low_water=t.low_water)
        flt = req.query.get("filter")
        if flt is not None and not validate_topic_filter(flt):
            return _err(400, f"invalid topic filter {flt!r}")
        out: list[dict[str, Any]] = []
        end = t.next_offset
        offset = start
        while offset < end and len(out) < limit:
            meta = t.meta.get(offset)
            if meta is not None and (flt is None or matches(flt, meta.topic)):
                rec = host.store.get(offset)
                if rec is None:
                    return _err(500, f"message {shard}/{offset} is committed but unreadable from the store",
                                offset=offset)
                m = decode_message(rec)
                out.append({
                    "offset": offset, "topic": m.topic, "payload": base64.b64encode(m.payload).decode(),
                    "qos": m.qos, "retain": m.retain, "guid": m.guid.hex(), "timestamp_ms": m.ts_ms,
                    "user_properties": [list(kv) for kv in (m.props.user_properties if m.props else ())],
                })
            offset += 1
        return web.json_response({"shard": shard, "incarnation": t.incarnation, "low_water": t.low_water,
                                  "next_offset": end, "scanned_to": offset, "messages": out})

    @routes.post("/v1/publish")
    async def publish(req: web.Request) -> web.Response:
        try:
            body = await req.json()
            items = body["messages"]
            if not isinstance(items, list) or len(items) > MAX_PUBLISH_BATCH:
                return _err(400, f"messages must be a list of at most {MAX_PUBLISH_BATCH}")
        except Exception as exc:
            return _err(400, f"bad JSON body: {exc}")
        futs = []
        now = node.now_ms()
        for it in items:
            try:
                topic = it["topic"]
                if not validate_topic_name(topic):
                    return _err(400, f"invalid topic {topic!r}")
                payload = base64.b64decode(it.get("payload", ""), validate=True)
                qos = int(it.get("qos", 1))
                if qos not in (0, 1, 2):
                    return _err(400, "qos must be 0, 1 or 2")
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
                    return _err(400, "guid must be 32 hex characters and producer 16")
                if (it.get("guid") or producer is not None) and not any(k == "guid" for k, _ in ups):
                    # The publisher's identity for the message travels with it, as an MQTT 5
                    # publisher's `guid` user property does (subscribers can de-duplicate too).
                    ups = (*ups, ("guid", guid.hex()))
            except (KeyError, ValueError, TypeError) as exc:
                return _err(400, f"bad message: {exc}")
            msg = StoredMessage(topic, payload, qos, bool(it.get("retain", False)), guid, now, None,
                                MessageProps(user_properties=ups) if ups else None, "")
            shard = node.topic_shard(topic)
            futs.append((shard, node.propose(shard, c.Publish(msg, "", producer, seq))))
        results = []
        for shard, fut in futs:
            r = await fut  # type: ignore[misc]
            entry: dict[str, Any] = {"status": r.status, "shard": shard, "offset": r.offset}
            if r.status == "refused":
                entry["reason"] = r.reason
            results.append(entry)
        return web.json_response({"results": results})

    @routes.post("/v1/pins")
    async def pin(req: web.Request) -> web.Response:
        try:
            body = await req.json()
            reader = str(body["reader"])
            offsets = {int(k): int(v) for k, v in body["offsets"].items()}
            ttl = float(body.get("ttl_ms", node.cfg.pins.reader_pin_ttl_s * 1000)) / 1000
        except Exception as exc:
            return _err(400, f"bad pin: {exc}")
        if reader not in node.pins and len(node.pins) >= node.cfg.pins.max_pins:
            return _err(429, "too many pins")
        node.pins[reader] = (offsets, time.time() + ttl)
        return web.json_response({"reader": reader, "offsets": {str(k): v for k, v in offsets.items()}})

    @routes.delete("/v1/pins/{reader}")
    async def unpin(req: web.Request) -> web.Response:
        node.pins.pop(req.match_info["reader"], None)
        return web.json_response({"ok": True})

    @routes.get("/v1/sink-markers/{query_id}")
    async def get_marker(req: web.Request) -> web.Response:
        qid = req.match_info["query_id"]
        host = node.hosts[node.session_shard("$sink/" + qid)]
        return web.json_response({"batch_id": host.state.sink_markers.get(qid)})

    @routes.put("/v1/sink-markers/{query_id}")
    async def put_marker(req: web.Request) -> web.Response:
        qid = req.match_info["query_id"]
        try:
            batch = int((await req.json())["batch_id"])
        except Exception as exc:
            return _err(400, f"bad marker: {exc}")
        fut = node.propose(node.session_shard("$sink/" + qid), c.SetSinkMarker(qid, batch))
        value = await fut  # type: ignore[misc]
        return web.json_response({"batch_id": value})

    @routes.get("/v1/drops")
    async def drops(_req: web.Request) -> web.Response:
        return web.json_response({"drops": list(node.iter_drops())})

    @routes.get("/v1/health")
    async def health(_req: web.Request) -> web.Response:
        failed = {h.shard: h.failed for h in node.hosts if h.failed}
        return web.json_response({"ok": not failed, "failed_shards": failed}, status=200 if not failed else 503)

    @routes.get("/metrics")
    async def metrics(_req: web.Request) -> web.Response:
        lines = [
            "# TYPE moorline_published_total counter", f"moorline_published_total {node.stats['published']}",
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
            "# TYPE moorline_dropped_total counter",
        ]
        totals: dict[str, int] = {}
        for h in node.hosts:
            for reason, n in h.state.topics.drop_counts.items():
                totals[reason] = totals.get(reason, 0) + n
        for reason, n in sorted(totals.items()):
            lines.append(f'moorline_dropped_total{{reason="{reason}"}} {n}')
        lines.append("# TYPE moorline_shard_failed gauge")
        for h in node.hosts:
            lines.append(f'moorline_shard_failed{{shard="{h.shard}"}} {1 if h.failed else 0}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app.add_routes(routes)
    return app


async def start_http(node: Node, host: str, port: int) -> tuple[web.AppRunner, tuple[str, int]]:
    runner = web.AppRunner(make_app(node), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    sock = server.sockets[0]  # type: ignore[attr-defined]
    bound = sock.getsockname()
    return runner, (bound[0], bound[1])
