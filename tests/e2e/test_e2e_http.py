"""The node's HTTP API end to end (moorline only): shards, fetch, publish (GUID and sequenced-producer
de-duplication), sink markers, metrics; what was answered 200 survives kill -9."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from e2e_broker import BrokerProc
from rawclient import P_SESSION_EXPIRY, P_USER_PROPERTY, RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"


def http(b: BrokerProc, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(b.http_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    ctype_json = raw[:1] in (b"{", b"[")
    return status, json.loads(raw) if ctype_json else raw.decode()


def shard_of(topic: str) -> int:
    from moorline.hashing import shard_of as _shard_of

    return _shard_of(topic, 16)


def fetch(b: BrokerProc, topic: str, start: int = 0) -> list[dict[str, Any]]:
    status, body = http(b, "GET", f"/v1/shards/{shard_of(topic)}/messages?from={start}&max=1000&filter={urllib.parse.quote(topic)}")
    assert status == 200, body
    return body["messages"]  # type: ignore[no-any-return]


def b64(s: bytes) -> str:
    return base64.b64encode(s).decode()


def test_shards_and_fetch_after_mqtt_publish(shared_broker: BrokerProc, uniq: str) -> None:
    status, body = http(shared_broker, "GET", "/v1/shards")
    assert status == 200
    assert body["shard_count"] == 16 and [s["shard"] for s in body["shards"]] == list(range(16))
    topic = f"{uniq}/fetch"
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect(f"{uniq}-p").reason == 0
    for i in range(5):
        pub.publish_and_wait(topic, f"p{i}".encode(), 1,
                             props=[(P_USER_PROPERTY, ("k", str(i)))])
    pub.disconnect()
    msgs = fetch(shared_broker, topic)
    assert [base64.b64decode(m["payload"]) for m in msgs] == [f"p{i}".encode() for i in range(5)]
    offsets = [m["offset"] for m in msgs]
    assert offsets == sorted(offsets) and len(set(offsets)) == 5
    assert all(len(m["guid"]) == 32 for m in msgs) and len({m["guid"] for m in msgs}) == 5
    assert [("k", str(i)) in [tuple(kv) for kv in m["user_properties"]] for i, m in enumerate(msgs)] == [True] * 5
    assert fetch(shared_broker, topic, start=offsets[2]) == msgs[2:]
    status, _ = http(shared_broker, "GET", "/v1/shards/16/messages?from=0")
    assert status == 404
    status, err = http(shared_broker, "GET", f"/v1/shards/{shard_of(topic)}/messages?from=0&incarnation=nope")
    assert status == 409 and "incarnation" in err


def test_http_publish_reaches_mqtt_and_dedups(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/hp"
    sub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert sub.connect(f"{uniq}-s", props=[(P_SESSION_EXPIRY, 60)]).reason == 0
    sub.subscribe([(topic, 1)])
    guid = "00112233445566778899aabbccddeeff"
    batch = {"messages": [{"topic": topic, "payload": b64(b"via-http"), "qos": 1, "guid": guid}]}
    status, body = http(shared_broker, "POST", "/v1/publish", batch)
    assert status == 200, body
    first = body["results"][0]
    assert first["status"] == "ok" and first["shard"] == shard_of(topic)
    status, body = http(shared_broker, "POST", "/v1/publish", batch)
    assert status == 200
    assert body["results"][0]["status"] == "duplicate"
    assert body["results"][0]["offset"] == first["offset"]
    m = sub.next_message(10)
    sub.ack(m)
    assert m.payload == b"via-http"
    assert [v for k, v in m.user_properties if k == "guid"] == [guid]
    assert sub.recv_or_none(1.0) is None, "the duplicate was delivered"
    sub.disconnect()


def test_sequenced_producer(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/seq"
    producer = "0123456789abcdef"

    def post(seqs: list[int]) -> list[str]:
        msgs = [{"topic": topic, "payload": b64(f"s{s}".encode()), "producer": producer, "seq": s} for s in seqs]
        status, body = http(shared_broker, "POST", "/v1/publish", {"messages": msgs})
        assert status == 200, body
        return [r["status"] for r in body["results"]]

    assert post([1, 2, 3]) == ["ok", "ok", "ok"]
    assert post([2, 3]) == ["duplicate", "duplicate"]
    assert post([4]) == ["ok"]
    assert [base64.b64decode(m["payload"]) for m in fetch(shared_broker, topic)] == [b"s1", b"s2", b"s3", b"s4"]


def test_http_acked_publishes_and_sink_marker_survive_kill9(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/k9"
    msgs = [{"topic": topic, "payload": b64(f"h{i}".encode()), "qos": 1} for i in range(200)]
    status, body = http(shared_broker, "POST", "/v1/publish", {"messages": msgs})
    assert status == 200 and [r["status"] for r in body["results"]] == ["ok"] * 200
    status, _ = http(shared_broker, "PUT", f"/v1/sink-markers/{uniq}", {"batch_id": 41})
    assert status == 200
    shared_broker.restart(kill=True)
    got = fetch(shared_broker, topic)
    assert [base64.b64decode(m["payload"]) for m in got] == [f"h{i}".encode() for i in range(200)]
    assert [m["offset"] for m in got] == [r["offset"] for r in body["results"]]
    status, marker = http(shared_broker, "GET", f"/v1/sink-markers/{uniq}")
    assert status == 200 and marker["batch_id"] == 41


def test_metrics_and_drops_endpoints(shared_broker: BrokerProc) -> None:
    status, text = http(shared_broker, "GET", "/metrics")
    assert status == 200 and isinstance(text, str) and "# TYPE" in text
    status, drops = http(shared_broker, "GET", "/v1/drops")
    assert status == 200 and isinstance(drops["drops"], list)
