"""An in-process fake of the node's HTTP fetch/publish API (NODE_CONTRACT.md), for the Spark tests.

It keeps what the data source relies on: shards by CRC32C of the topic, dense offsets per
incarnation, a low-water mark, 410/409 errors, sequenced-producer and GUID de-duplication,
pins and sink markers. Test hooks (``raise_low_water``, ``rebuild_shard``) force the retention
and rebuild cases a real node reaches only after hours.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from moorline.hashing import guid128, shard_of
from moorline.spark.planning import topic_matches


@dataclass
class FakeShard:
    incarnation: str
    low_water: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)  # index = offset - base
    base: int = 0
    producers: dict[str, tuple[int, int]] = field(default_factory=dict)  # producer -> (highest seq, offset)
    guids: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # guid -> (offset, content)

    @property
    def next_offset(self) -> int:
        return self.base + len(self.messages)


class FakeBroker:
    def __init__(self, shard_count: int = 4, port: int = 0) -> None:
        self.shard_count = shard_count
        self.lock = threading.Lock()
        self.shards = [FakeShard(incarnation=f"{i:02x}" + "a" * 14) for i in range(shard_count)]
        self.pins: dict[str, dict[str, int]] = {}
        self.on_pin: Callable[[dict[str, Any]], None] | None = None
        self.markers: dict[str, int] = {}
        self.publish_requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeBroker:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- test hooks -------------------------------------------------------------------------
    def raise_low_water(self, shard: int, low_water: int) -> None:
        """Retention removed everything below ``low_water`` (pins ignored, as after a lapsed pin)."""
        with self.lock:
            s = self.shards[shard]
            low_water = min(low_water, s.next_offset)
            drop = low_water - s.base
            if drop > 0:
                del s.messages[:drop]
                s.base = low_water
            s.low_water = max(s.low_water, low_water)

    def rebuild_shard(self, shard: int) -> None:
        with self.lock:
            old = self.shards[shard]
            self.shards[shard] = FakeShard(incarnation=old.incarnation[:2] + "b" * 14)

    def all_messages(self) -> list[dict[str, Any]]:
        with self.lock:
            return [m for s in self.shards for m in s.messages]

    # --- API ----------------------------------------------------------------------------------
    def shards_doc(self) -> dict[str, Any]:
        with self.lock:
            return {
                "shard_count": self.shard_count,
                "shards": [
                    {
                        "shard": i,
                        "incarnation": s.incarnation,
                        "low_water": s.low_water,
                        "next_offset": s.next_offset,
                    }
                    for i, s in enumerate(self.shards)
                ],
            }

    def fetch(self, shard: int, q: dict[str, str]) -> tuple[int, dict[str, Any]]:
        if not 0 <= shard < self.shard_count:
            return 404, {"error": "no such shard"}
        start, limit, flt = int(q["from"]), int(q.get("max", "1000")), q.get("filter")
        with self.lock:
            s = self.shards[shard]
            if "incarnation" in q and q["incarnation"] != s.incarnation:
                return 409, {"error": "incarnation changed", "incarnation": s.incarnation}
            if start < s.low_water:
                return 410, {"error": "offset below the complete range", "low_water": s.low_water}
            out = []
            for m in s.messages[max(0, start - s.base) :]:
                if flt is None or topic_matches(flt, m["topic"]):
                    out.append(m)
                    if len(out) >= limit:
                        break
            return 200, {
                "shard": shard,
                "incarnation": s.incarnation,
                "low_water": s.low_water,
                "next_offset": s.next_offset,
                "messages": out,
            }

    def publish(self, doc: dict[str, Any]) -> dict[str, Any]:
        results = []
        with self.lock:
            self.publish_requests += 1
            for m in doc["messages"]:
                results.append(self._publish_one(m))
        return {"results": results}

    def _publish_one(self, m: dict[str, Any]) -> dict[str, Any]:
        topic = m["topic"]
        sh = shard_of(topic, self.shard_count)
        s = self.shards[sh]
        payload = base64.b64decode(m.get("payload", ""))
        content = topic.encode() + b"\0" + payload
        producer, seq = m.get("producer"), m.get("seq")
        if producer is not None and seq is not None:
            prev = s.producers.get(producer)
            if prev is not None and seq <= prev[0]:
                return {"status": "duplicate", "shard": sh, "offset": prev[1] if seq == prev[0] else -1}
            guid = producer + f"{seq:016x}"
        elif m.get("guid"):
            guid = m["guid"]
        else:
            guid = guid128("fake", time.time_ns(), topic).hex()
        seen = s.guids.get(guid)
        if seen is not None:
            if seen[1] != content:
                return {"status": "refused", "shard": sh, "reason": "GUID reused with different content"}
            return {"status": "duplicate", "shard": sh, "offset": seen[0]}
        offset = s.next_offset
        s.messages.append(
            {
                "offset": offset,
                "topic": topic,
                "payload": m.get("payload", ""),
                "qos": m.get("qos", 1),
                "retain": m.get("retain", False),
                "guid": guid,
                "timestamp_ms": int(time.time() * 1000),
                "user_properties": m.get("user_properties", []),
            }
        )
        s.guids[guid] = (offset, content)
        if producer is not None and seq is not None:
            s.producers[producer] = (seq, offset)
        return {"status": "ok", "shard": sh, "offset": offset}

    # --- HTTP plumbing ------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        broker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

            def _send(self, status: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length", "0"))
                return json.loads(self.rfile.read(n)) if n else {}

            def do_GET(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                parts = u.path.strip("/").split("/")
                if u.path == "/v1/shards":
                    return self._send(200, broker.shards_doc())
                if len(parts) == 4 and parts[:2] == ["v1", "shards"] and parts[3] == "messages":
                    q = {k: v[0] for k, v in parse_qs(u.query).items()}
                    return self._send(*broker.fetch(int(parts[2]), q))
                if len(parts) == 3 and parts[:2] == ["v1", "sink-markers"]:
                    with broker.lock:
                        return self._send(200, {"batch_id": broker.markers.get(unquote(parts[2]))})
                self._send(404, {"error": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                doc = self._body()
                if self.path == "/v1/publish":
                    return self._send(200, broker.publish(doc))
                if self.path == "/v1/pins":
                    if broker.on_pin is not None:  # test hook: something happens as the pin arrives
                        broker.on_pin(doc)
                    with broker.lock:
                        broker.pins[doc["reader"]] = dict(doc["offsets"])
                    return self._send(200, {})
                self._send(404, {"error": "not found"})

            def do_PUT(self) -> None:  # noqa: N802
                parts = self.path.strip("/").split("/")
                if len(parts) == 3 and parts[:2] == ["v1", "sink-markers"]:
                    doc = self._body()
                    with broker.lock:
                        broker.markers[unquote(parts[2])] = int(doc["batch_id"])
                    return self._send(200, {})
                self._send(404, {"error": "not found"})

            def do_DELETE(self) -> None:  # noqa: N802
                parts = self.path.strip("/").split("/")
                if len(parts) == 3 and parts[:2] == ["v1", "pins"]:
                    with broker.lock:
                        broker.pins.pop(unquote(parts[2]), None)
                    return self._send(200, {})
                self._send(404, {"error": "not found"})

        return Handler
