"""A small blocking client for the node's HTTP fetch/publish API (stdlib only).

Created inside ``read()`` / ``write()`` / the driver-side planning methods, never stored on an
object Spark pickles. Keeps one keep-alive connection to the server that answered last and fails
over to the next listed server on a connection error.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode


class MoorlineUnavailable(ConnectionError):
    """No listed server answered."""


class MoorlineHTTPError(RuntimeError):
    """A server answered with an error status that the caller did not expect."""

    def __init__(self, status: int, method: str, path: str, body: dict[str, Any]) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body.get('error', body)}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class ShardInfo:
    shard: int
    incarnation: str
    low_water: int
    next_offset: int


@dataclass(frozen=True)
class Response:
    status: int
    body: dict[str, Any]


class NodeClient:
    def __init__(self, servers: tuple[str, ...], timeout_s: float, attempts_per_server: int = 2) -> None:
        if not servers:
            raise ValueError("at least one server is needed")
        self._servers = servers
        self._timeout_s = timeout_s
        self._attempts_per_server = attempts_per_server  # bound on reconnects per server and call
        self._current = 0
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport ----------------------------------------------------------------------
    def request(self, method: str, path: str, doc: Any = None) -> Response:
        """One request; any HTTP status is returned, connection failures fail over."""
        body = None if doc is None else json.dumps(doc, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        errors: list[str] = []
        for _ in range(len(self._servers)):
            server = self._servers[self._current]
            for attempt in range(self._attempts_per_server):
                try:
                    if self._conn is None:
                        host, _, port = server.rpartition(":")
                        self._conn = http.client.HTTPConnection(host, int(port), timeout=self._timeout_s)
                    self._conn.request(method, path, body=body, headers=headers)
                    resp = self._conn.getresponse()
                    raw = resp.read()
                    if resp.getheader("Connection", "").lower() == "close":
                        self.close()
                    try:
                        parsed = json.loads(raw) if raw else {}
                    except json.JSONDecodeError:
                        parsed = {"error": raw[:200].decode("utf-8", "replace")}
                    if not isinstance(parsed, dict):
                        parsed = {"value": parsed}
                    return Response(resp.status, parsed)
                except (OSError, http.client.HTTPException) as exc:
                    self.close()
                    errors.append(f"{server}: {type(exc).__name__}: {exc}")
                    if attempt + 1 < self._attempts_per_server:
                        time.sleep(0.05 * (attempt + 1))
            self._current = (self._current + 1) % len(self._servers)
        raise MoorlineUnavailable(
            f"no moorline server answered {method} {path} (servers: {', '.join(self._servers)}): "
            + "; ".join(errors[-4:])
        )

    def _ok(self, method: str, path: str, doc: Any = None) -> dict[str, Any]:
        r = self.request(method, path, doc)
        if r.status != 200:
            raise MoorlineHTTPError(r.status, method, path, r.body)
        return r.body

    # --- API ----------------------------------------------------------------------------
    def shards(self) -> dict[int, ShardInfo]:
        body = self._ok("GET", "/v1/shards")
        out: dict[int, ShardInfo] = {}
        for s in body["shards"]:
            info = ShardInfo(
                int(s["shard"]), str(s["incarnation"]), int(s["low_water"]), int(s["next_offset"])
            )
            out[info.shard] = info
        if len(out) != int(body["shard_count"]):
            raise MoorlineHTTPError(
                200, "GET", "/v1/shards", {"error": "shard list does not match shard_count"}
            )
        return out

    def fetch(
        self, shard: int, start: int, max_messages: int, incarnation: str, topic_filter: str | None
    ) -> Response:
        q: dict[str, str | int] = {"from": start, "max": max_messages, "incarnation": incarnation}
        if topic_filter is not None:
            q["filter"] = topic_filter
        return self.request("GET", f"/v1/shards/{shard}/messages?{urlencode(q)}")

    def publish(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = self._ok("POST", "/v1/publish", {"messages": messages})
        results = body["results"]
        if len(results) != len(messages):
            raise MoorlineHTTPError(
                200, "POST", "/v1/publish", {"error": "result count differs from message count"}
            )
        return list(results)

    def pin(self, reader: str, offsets: dict[str, int], ttl_ms: int) -> bool:
        """Hold retention; False if the node has no pin endpoint (404/405)."""
        r = self.request("POST", "/v1/pins", {"reader": reader, "offsets": offsets, "ttl_ms": ttl_ms})
        if r.status in (404, 405):
            return False
        if r.status != 200:
            raise MoorlineHTTPError(r.status, "POST", "/v1/pins", r.body)
        return True

    def unpin(self, reader: str) -> None:
        self.request("DELETE", f"/v1/pins/{quote(reader, safe='')}")

    def get_marker(self, query_id: str) -> int | None:
        body = self._ok("GET", f"/v1/sink-markers/{quote(query_id, safe='')}")
        value = body.get("batch_id")
        return None if value is None else int(value)

    def put_marker(self, query_id: str, batch_id: int) -> None:
        self._ok("PUT", f"/v1/sink-markers/{quote(query_id, safe='')}", {"batch_id": batch_id})
