"""What the node's HTTP routes answer matches the OpenAPI table (moorline/node/admin/openapi.py), with a
real node behind them (moorline only): every route is called, the answers and some errors are
checked against the schema of their route and status."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from e2e_broker import BrokerProc
from rawclient import RawClient

from moorline.node.admin.openapi import ROUTES, Schema

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
                                      "integer": (int,), "number": (int, float)}


def conforms(value: Any, schema: Schema, where: str = "$") -> list[str]:
    """What in ``value`` breaks ``schema`` (the OpenAPI subset the table uses)."""
    if value is None:
        return [] if schema.get("nullable") else [f"{where}: null"]
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, TYPES[kind]) or (kind in ("integer", "number")
                                                                     and isinstance(value, bool))):
        return [f"{where}: {value!r} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in {schema['enum']}"]
    problems: list[str] = []
    if kind == "object":
        props = schema.get("properties", {})
        problems += [f"{where}: no {k!r}" for k in schema.get("required", ()) if k not in value]
        more = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                problems += conforms(v, props[k], f"{where}.{k}")
            elif more is False:
                problems.append(f"{where}: {k!r} is not in the table")
            elif isinstance(more, dict):
                problems += conforms(v, more, f"{where}.{k}")
    if kind == "array":
        for i, v in enumerate(value):
            problems += conforms(v, schema["items"], f"{where}[{i}]")
    return problems


def call(b: BrokerProc, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(b.http_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw, ctype = r.status, r.read(), r.headers.get_content_type()
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers.get_content_type()
    return status, json.loads(raw) if ctype == "application/json" else raw.decode()


def check(b: BrokerProc, method: str, template: str, path: str, body: Any = None, expect: int = 200) -> Any:
    route = next(r for r in ROUTES if (r.method, r.path) == (method.lower(), template))
    status, answer = call(b, method, path, body)
    assert status == expect, (method, path, answer)
    assert status in route.responses, f"{method} {template} answered {status}, which the table does not list"
    schema = route.responses[status][1]
    if schema is None:
        assert isinstance(answer, str)
    else:
        assert conforms(answer, schema) == [], (method, path, answer)
    return answer


def test_every_route_answers_what_the_table_says(shared_broker: BrokerProc, uniq: str) -> None:
    b = shared_broker
    topic = f"{uniq}/t"
    pub = RawClient(HOST, b.mqtt_port, 5)
    assert pub.connect(f"{uniq}-pub").reason == 0
    pub.publish_and_wait(topic, b"via mqtt", 1, props=[(0x26, ("k", "v"))])
    pub.disconnect()
    shards = check(b, "GET", "/v1/shards", "/v1/shards")
    check(b, "GET", "/v1/cluster", "/v1/cluster")
    results = check(b, "POST", "/v1/publish", "/v1/publish", {"messages": [
        {"topic": topic, "payload": base64.b64encode(b"via http").decode(), "user_properties": [["a", "b"]]},
        {"topic": topic, "payload": "", "producer": "00000000000000aa", "seq": 1},
        {"topic": "$SYS/x", "payload": ""},
    ]})["results"]
    assert [r["status"] for r in results] == ["ok", "ok", "refused"]
    shard = results[0]["shard"]
    page = check(b, "GET", "/v1/shards/{shard}/messages", f"/v1/shards/{shard}/messages?filter={uniq}/%23")
    assert len(page["messages"]) == 3
    inc = next(s["incarnation"] for s in shards["shards"] if s["shard"] == shard)
    check(b, "GET", "/v1/shards/{shard}/messages", f"/v1/shards/{shard}/messages?incarnation=x{inc}", expect=409)
    check(b, "GET", "/v1/shards/{shard}/messages", "/v1/shards/999/messages", expect=404)
    check(b, "GET", "/v1/shards/{shard}/messages", f"/v1/shards/{shard}/messages?from=x", expect=400)
    check(b, "POST", "/v1/publish", "/v1/publish", {"messages": [{"topic": "a/+"}]}, expect=400)
    check(b, "POST", "/v1/pins", "/v1/pins", {"reader": uniq, "offsets": {str(shard): 0}, "ttl_ms": 60000})
    check(b, "POST", "/v1/pins", "/v1/pins", {"reader": uniq, "offsets": {"99999": 0}}, expect=400)
    check(b, "DELETE", "/v1/pins/{reader}", f"/v1/pins/{uniq}")
    assert check(b, "GET", "/v1/sink-markers/{query_id}", f"/v1/sink-markers/{uniq}") == {"batch_id": None}
    check(b, "PUT", "/v1/sink-markers/{query_id}", f"/v1/sink-markers/{uniq}", {"batch_id": 4})
    assert check(b, "PUT", "/v1/sink-markers/{query_id}", f"/v1/sink-markers/{uniq}", {"batch_id": 2}) == {
        "batch_id": 4}
    check(b, "PUT", "/v1/sink-markers/{query_id}", f"/v1/sink-markers/{uniq}", {"batch_id": "x"}, expect=400)
    check(b, "GET", "/v1/sink-markers/{query_id}", f"/v1/sink-markers/{uniq}")
    check(b, "GET", "/v1/drops", "/v1/drops")
    check(b, "GET", "/v1/health", "/v1/health")
    check(b, "GET", "/metrics", "/metrics")
    check(b, "GET", "/v1/openapi.json", "/v1/openapi.json")
