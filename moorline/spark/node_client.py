"""A small blocking client for the node's HTTP fetch/publish API (stdlib only).

Created inside ``read()`` / ``write()`` / the driver-side planning methods, never stored on an
object Spark pickles. Keeps one keep-alive connection to the server that answered last. When a
server does not answer, the call goes on to the next listed server; after every server failed once
it waits (exponential backoff with jitter) and goes round again, until the call's deadline
(``requestTimeoutMs``): a broker restart of a few seconds costs a running query nothing.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode


class MoorlineUnavailable(ConnectionError):
    """No listed server answered before the call's deadline (or none speaks HTTP)."""

# A server that closes a fresh connection without an HTTP reply, or answers with bytes that are not
# HTTP, this many times in a row is taken for a non-HTTP port (typically the MQTT listener): once
# every listed server is, the call fails at once instead of waiting out its deadline. More than once,
# because a node killed while answering also closes a fresh connection without a reply.
NOT_HTTP_AFTER = 3
ATTEMPT_MIN_S = 0.5  # socket timeout of an attempt started just before the call's deadline
# Sent with every request, so the node tells the Spark integration's publishes from other HTTP
# clients' (moorline_published_total{source="spark"}: moorline/node/admin/http_api.py checks the prefix).
USER_AGENT = "moorline-spark/1"


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


def _not_http(exc: BaseException) -> bool:
    """The server accepted the connection but did not answer in HTTP (closed, reset, or garbage)."""
    return isinstance(exc, http.client.BadStatusLine | ConnectionResetError | http.client.IncompleteRead)


def authorization_header(user: str | None, password: str | None, token: str | None) -> str | None:
    """The Authorization header for the node's HTTP API: Basic for a user of the node's password
    file, Bearer for a token of its token file (``moorline token``), None for an open node."""
    if token is not None:
        return f"Bearer {token}"
    if user is not None:
        return "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    return None


class NodeClient:
    def __init__(
        self,
        servers: tuple[str, ...],
        timeout_s: float,
        *,
        backoff_s: float = 0.1,
        backoff_max_s: float = 2.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        authorization: str | None = None,
    ) -> None:
        if not servers:
            raise ValueError("at least one server is needed")
        self._authorization = authorization  # an HTTP Authorization header value (see authorization_header)
        self._servers = servers
        self._timeout_s = timeout_s  # deadline of one call, retries across servers included
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._sleep = sleep
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
        """One request; any HTTP status is returned. Servers that do not answer are retried, each
        in turn, with jittered exponential backoff between rounds, until ``timeout_s`` has passed."""
        body = None if doc is None else json.dumps(doc, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        headers["User-Agent"] = USER_AGENT
        if self._authorization is not None:
            headers["Authorization"] = self._authorization
        deadline = self._clock() + self._timeout_s
        last_error: dict[str, str] = {}
        not_http_streak: dict[str, int] = {}
        failed_in_round: set[str] = set()
        rounds = 0
        while True:
            server = self._servers[self._current]
            reused = self._conn is not None
            try:
                # An attempt started before the deadline gets a little time even at its very end.
                timeout = max(ATTEMPT_MIN_S, deadline - self._clock())
                return self._attempt(server, method, path, body, headers, timeout)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if reused and _not_http(exc):
                    # The server closed our idle keep-alive connection (e.g. it restarted): not a
                    # failure of the server, try it again at once on a new connection.
                    continue
                if _not_http(exc):
                    not_http_streak[server] = not_http_streak.get(server, 0) + 1
                    last_error[server] = self._not_http_text(server, exc)
                else:
                    not_http_streak[server] = 0
                    last_error[server] = f"{type(exc).__name__}: {exc}"
                if all(not_http_streak.get(s, 0) >= NOT_HTTP_AFTER for s in self._servers):
                    raise MoorlineUnavailable("; ".join(last_error[s] for s in self._servers)) from exc
                if self._clock() >= deadline:
                    raise MoorlineUnavailable(self._unavailable_text(method, path, last_error)) from exc
                failed_in_round.add(server)
                self._current = (self._current + 1) % len(self._servers)
                if len(failed_in_round) < len(self._servers):
                    continue
                # Every server failed once: back off (equal jitter, so rounds stay apart) and go again;
                # the last pause ends at the deadline, where one more round is tried.
                failed_in_round.clear()
                step = min(self._backoff_max_s, self._backoff_s * 2**rounds)
                rounds += 1
                pause = step / 2 + self._rng.uniform(0, step / 2)
                self._sleep(max(0.0, min(pause, deadline - self._clock())))

    def _attempt(
        self, server: str, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout_s: float
    ) -> Response:
        if self._conn is None:
            host, _, port = server.rpartition(":")
            self._conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
        elif self._conn.sock is not None:
            self._conn.sock.settimeout(timeout_s)  # the call's deadline bounds a reused connection too
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

    @staticmethod
    def _not_http_text(server: str, exc: BaseException) -> str:
        return (
            f"servers={server} does not speak HTTP ({type(exc).__name__}: {exc}) — is that the MQTT port? "
            "the HTTP API listens on --http (moorline run --http HOST:PORT)"
        )

    def _unavailable_text(self, method: str, path: str, last_error: dict[str, str]) -> str:
        per_server = "; ".join(f"{s}: {last_error.get(s, 'not tried')}" for s in self._servers)
        return (
            f"no moorline server answered {method} {path} within requestTimeoutMs={self._timeout_s * 1000:.0f} "
            f"(servers: {', '.join(self._servers)}). Last error of each: {per_server}"
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
