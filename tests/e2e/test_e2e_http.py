"""The node's HTTP API end to end (moorline only): shards, fetch, publish (GUID and sequenced-producer
de-duplication), sink markers, metrics; what was answered 200 survives kill -9. With authentication:
every route needs HTTP Basic or a bearer token, reads are filtered by the read ACL, publishes are
answered per item (ACL, the $ rule, the size limit), admin routes need the admin role, pins and sink
markers are limited per principal, and an open listener off loopback refuses to start."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_broker import REPO_ROOT, BrokerProc, running_broker
from rawclient import P_SESSION_EXPIRY, P_USER_PROPERTY, RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"


def http(b: BrokerProc, method: str, path: str, body: Any = None, auth: str | None = None) -> tuple[int, Any]:
    """``auth``: "user:password" (Basic) or "Bearer TOKEN"."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if auth is not None:
        headers["Authorization"] = auth if auth.startswith("Bearer ") else (
            "Basic " + base64.b64encode(auth.encode()).decode())
    req = urllib.request.Request(b.http_url + path, data=data, method=method, headers=headers)
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


def test_dollar_topics_refused_per_item_without_any_acl(shared_broker: BrokerProc, uniq: str) -> None:
    items = [{"topic": f"{uniq}/fine", "payload": b64(b"1")}, {"topic": f"$x/{uniq}", "payload": b64(b"2")},
             {"topic": "$SYS/broker/version", "payload": b64(b"3"), "retain": True}]
    status, body = http(shared_broker, "POST", "/v1/publish", {"messages": items})
    assert status == 200, body
    assert [r["status"] for r in body["results"]] == ["ok", "refused", "refused"]
    assert body["results"][1]["offset"] == -1 and "not authorized" in body["results"][1]["reason"]
    assert fetch(shared_broker, f"$x/{uniq}") == [] and fetch(shared_broker, "$SYS/broker/version") == []


# --- with authentication ---------------------------------------------------------------------------

def same_shard_topics(prefixes: list[str]) -> list[str]:
    """One topic under each prefix, all in the first one's shard (each searched on its own: CRC32C is
    linear, so one common suffix would keep the shards apart)."""
    first = f"{prefixes[0]}/t0"
    out = [first]
    for p in prefixes[1:]:
        out.append(next(f"{p}/t{i}" for i in range(10_000) if shard_of(f"{p}/t{i}") == shard_of(first)))
    return out


def passwd(file: Path, user: str, password: str) -> None:
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "passwd", str(file), user, password],
                       capture_output=True, cwd=str(REPO_ROOT), timeout=60)
    assert r.returncode == 0, r.stderr


def new_token(file: Path, user: str) -> str:
    r = subprocess.run([sys.executable, "-m", "moorline.cli", "token", str(file), user],
                       capture_output=True, cwd=str(REPO_ROOT), timeout=60, text=True)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token and token not in file.read_text(), "token stored in clear text"
    return token


MAX_PACKET = 65536


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProc, dict[str, str]]]:
    """alice: her own tree and public/; bob: reads public/ only; ops: admin; spark (token): admin."""
    tmp = tmp_path_factory.mktemp("http-auth")
    pw, tokens = tmp / "passwd", tmp / "tokens"
    for user in ("alice", "bob", "ops"):
        passwd(pw, user, f"{user}-pw")
    creds = {u: f"{u}:{u}-pw" for u in ("alice", "bob", "ops")}
    creds["spark"] = "Bearer " + new_token(tokens, "spark")
    creds["reader"] = "Bearer " + new_token(tokens, "reader")
    config = f"""
[mqtt]
max_packet_size = {MAX_PACKET}

[auth]
allow_anonymous = false
password_file = "{pw}"
token_file = "{tokens}"
admin_users = ["ops", "spark"]
max_failed_logins = 1000

[pins]
reader_pin_ttl_s = 30
max_ttl_s = 60
max_pins_per_principal = 2
max_sink_markers_per_principal = 2

[[auth.acl]]
user = "alice"
action = "all"
pattern = "u/%u/#"

[[auth.acl]]
user = "ops"
action = "publish"
pattern = "$dev/#"

[[auth.acl]]
user = "ops"
action = "publish"
pattern = "$SYS/#"

[[auth.acl]]
action = "all"
pattern = "public/#"
"""
    with running_broker(tmp, config_text=config) as b:
        yield b, creds


ROUTES = [("GET", "/v1/shards", None), ("GET", "/v1/shards/0/messages?from=0", None),
          ("POST", "/v1/publish", {"messages": [{"topic": "public/x", "payload": ""}]}),
          ("POST", "/v1/pins", {"reader": "r", "offsets": {"0": 0}}), ("DELETE", "/v1/pins/r", None),
          ("GET", "/v1/sink-markers/q", None), ("PUT", "/v1/sink-markers/q", {"batch_id": 1}),
          ("GET", "/v1/drops", None), ("GET", "/v1/nope", None)]


def test_every_route_needs_credentials(secured: tuple[BrokerProc, dict[str, str]]) -> None:
    b, creds = secured
    for method, path, body in ROUTES:
        for auth in (None, "alice:wrong", "nobody:alice-pw", "Bearer not-a-token", "Digest abc", "Basic !!!"):
            status, answer = http(b, method, path, body, auth=auth)
            assert status == 401, (method, path, auth, status, answer)
    # /metrics and /v1/health stay open (auth.http_open_status, default true)
    assert http(b, "GET", "/metrics")[0] == 200 and http(b, "GET", "/v1/health")[0] == 200
    assert http(b, "GET", "/metrics", auth="alice:wrong")[0] == 401
    req = urllib.request.Request(b.http_url + "/v1/shards")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert "Basic" in e.value.headers["WWW-Authenticate"]
    # nothing above was published
    status, body = http(b, "GET", f"/v1/shards/{shard_of('public/x')}/messages?from=0&filter=public/x",
                        auth=creds["ops"])
    assert status == 200 and body["messages"] == []


def test_admin_routes_need_the_admin_role(secured: tuple[BrokerProc, dict[str, str]], uniq: str) -> None:
    b, creds = secured
    for who in ("alice", "bob", "reader"):
        for method, path, body in ROUTES:
            if path.startswith(("/v1/shards/0/messages", "/v1/publish", "/v1/nope")):
                continue
            status, answer = http(b, method, path, body, auth=creds[who])
            assert status == 403 and "admin" in answer["error"], (who, method, path, status, answer)
    for who in ("ops", "spark"):
        status, body = http(b, "GET", "/v1/shards", auth=creds[who])
        assert status == 200 and body["shard_count"] == 16
        assert http(b, "GET", "/v1/drops", auth=creds[who])[0] == 200
        assert http(b, "PUT", f"/v1/sink-markers/{uniq}-{who}", {"batch_id": 3}, auth=creds[who]) == (
            200, {"batch_id": 3})
        assert http(b, "GET", f"/v1/sink-markers/{uniq}-{who}", auth=creds[who]) == (200, {"batch_id": 3})


def test_reads_are_filtered_by_the_read_acl(secured: tuple[BrokerProc, dict[str, str]], uniq: str) -> None:
    b, creds = secured
    mine, public = same_shard_topics([f"u/alice/{uniq}", f"public/{uniq}"])
    shard = shard_of(mine)
    items = [{"topic": t, "payload": b64(t.encode())} for t in (mine, public, mine, public)]
    status, body = http(b, "POST", "/v1/publish", {"messages": items}, auth=creds["alice"])
    assert status == 200 and [r["status"] for r in body["results"]] == ["ok"] * 4, body
    first = min(r["offset"] for r in body["results"])

    def read(who: str, flt: str | None = None) -> tuple[int, Any]:
        q = f"/v1/shards/{shard}/messages?from={first}&max=1000"
        if flt is not None:
            q += "&filter=" + urllib.parse.quote(flt)
        return http(b, "GET", q, auth=creds[who])

    status, body = read("bob")
    assert status == 200 and [m["topic"] for m in body["messages"]] == [public, public]
    assert set(body) == {"shard", "incarnation", "low_water", "next_offset", "scanned_to", "messages"}
    assert body["scanned_to"] == body["next_offset"], "a reader must be able to move past what it may not see"
    status, body = read("bob", "#")
    assert status == 200 and [m["topic"] for m in body["messages"]] == [public, public]
    status, body = read("bob", "+/#")  # reaches both trees: granted, filtered
    assert status == 200 and [m["topic"] for m in body["messages"]] == [public, public]
    status, body = read("bob", f"u/alice/{uniq}/#")  # reaches nothing bob may read
    assert status == 403, body
    status, body = read("alice")
    assert status == 200 and [m["topic"] for m in body["messages"]] == [mine, public, mine, public]
    status, body = read("reader")  # a token user with no rule but the public one
    assert status == 200 and [m["topic"] for m in body["messages"]] == [public, public]


def test_publish_answers_per_item(secured: tuple[BrokerProc, dict[str, str]], uniq: str) -> None:
    b, creds = secured
    items = [
        {"topic": f"u/alice/{uniq}/1", "payload": b64(b"1")},
        {"topic": f"u/bob/{uniq}", "payload": b64(b"not hers")},
        {"topic": f"$dev/{uniq}", "payload": b64(b"dollar")},
        {"topic": "$SYS/broker/uptime", "payload": b64(b"sys"), "retain": True},
        {"topic": f"u/alice/{uniq}/big", "payload": b64(b"x" * MAX_PACKET)},
        {"topic": f"u/alice/{uniq}/2", "payload": b64(b"2"), "retain": True},
    ]
    status, body = http(b, "POST", "/v1/publish", {"messages": items}, auth=creds["alice"])
    assert status == 200, body
    results = body["results"]
    assert [r["status"] for r in results] == ["ok", "refused", "refused", "refused", "refused", "ok"]
    assert [r.get("reason") for r in results[1:4]] == ["not authorized"] * 3
    assert "max_packet_size" in results[4]["reason"]
    assert all(r["offset"] == -1 for r in results[1:5])
    for r, it in zip(results, items, strict=True):
        assert r["shard"] == shard_of(it["topic"])
    got = [(m["topic"], base64.b64decode(m["payload"])) for m in _fetch_as(b, creds["alice"], f"u/alice/{uniq}/#")]
    assert got == [(f"u/alice/{uniq}/1", b"1"), (f"u/alice/{uniq}/2", b"2")]
    # a rule whose own pattern begins with $ grants a $-topic; $SYS stays the broker's whatever the ACL says
    status, body = http(b, "POST", "/v1/publish", {"messages": [items[2], items[3]]}, auth=creds["ops"])
    assert [r["status"] for r in body["results"]] == ["ok", "refused"], body
    # a malformed item fails the whole request before anything is proposed
    bad = [{"topic": f"u/alice/{uniq}/3", "payload": b64(b"3")}, {"topic": "a/+/wild", "payload": ""}]
    status, body = http(b, "POST", "/v1/publish", {"messages": bad}, auth=creds["alice"])
    assert status == 400 and body["item"] == 1, body
    assert [m["topic"] for m in _fetch_as(b, creds["alice"], f"u/alice/{uniq}/#")] == [
        f"u/alice/{uniq}/1", f"u/alice/{uniq}/2"]


def _fetch_as(b: BrokerProc, auth: str, flt: str) -> list[dict[str, Any]]:
    """Every message matching ``flt`` in any shard, ordered by topic."""
    out: list[dict[str, Any]] = []
    for shard in range(16):
        status, body = http(b, "GET", f"/v1/shards/{shard}/messages?from=0&max=10000&filter="
                            f"{urllib.parse.quote(flt)}", auth=auth)
        assert status == 200, body
        out.extend(body["messages"])
    return sorted(out, key=lambda m: m["topic"])


def test_pins_and_sink_markers_are_limited_per_principal(secured: tuple[BrokerProc, dict[str, str]],
                                                         uniq: str) -> None:
    b, creds = secured
    ops, spark = creds["ops"], creds["spark"]
    status, body = http(b, "POST", "/v1/pins", {"reader": f"{uniq}-1", "offsets": {"0": 0}, "ttl_ms": 10**9},
                        auth=ops)
    assert status == 200 and body["ttl_ms"] == 60_000, body  # cut to pins.max_ttl_s
    assert http(b, "POST", "/v1/pins", {"reader": f"{uniq}-2", "offsets": {"1": 0}}, auth=ops)[0] == 200
    status, body = http(b, "POST", "/v1/pins", {"reader": f"{uniq}-3", "offsets": {"1": 0}}, auth=ops)
    assert status == 429 and "max_pins_per_principal" in body["error"], body
    assert http(b, "POST", "/v1/pins", {"reader": f"{uniq}-1", "offsets": {"0": 1}}, auth=ops)[0] == 200  # renew
    assert http(b, "POST", "/v1/pins", {"reader": f"{uniq}-s", "offsets": {"0": 0}}, auth=spark)[0] == 200
    # another principal neither replaces nor removes a pin it does not hold
    assert http(b, "POST", "/v1/pins", {"reader": f"{uniq}-1", "offsets": {"0": 0}}, auth=spark)[0] == 403
    assert http(b, "DELETE", f"/v1/pins/{uniq}-1", auth=spark)[0] == 403
    assert http(b, "DELETE", f"/v1/pins/{uniq}-1", auth=ops)[0] == 200
    assert http(b, "POST", "/v1/pins", {"reader": f"{uniq}-3", "offsets": {"1": 0}}, auth=ops)[0] == 200
    for bad in ({"reader": "", "offsets": {}}, {"reader": "r", "offsets": {"99": 0}},
                {"reader": "r", "offsets": {"0": 0}, "ttl_ms": -5}):
        assert http(b, "POST", "/v1/pins", bad, auth=ops)[0] == 400, bad
    for who in ("ops", "spark"):  # pins left for the next test module: none
        for r in (f"{uniq}-2", f"{uniq}-3", f"{uniq}-s"):
            http(b, "DELETE", f"/v1/pins/{r}", auth=creds[who])
    # sink markers: at most 2 new query ids per principal (ops made one in an earlier test, or not)
    made = 0
    for i in range(3):
        status, body = http(b, "PUT", f"/v1/sink-markers/{uniq}-q{i}", {"batch_id": i}, auth=spark)
        if status == 429:
            assert "max_sink_markers_per_principal" in body["error"]
            break
        made += 1
    assert 1 <= made <= 2  # spark may have made one in test_admin_routes_need_the_admin_role
    assert http(b, "PUT", f"/v1/sink-markers/{uniq}-q0", {"batch_id": 7}, auth=spark) == (200, {"batch_id": 7})


def test_open_status_routes_can_be_closed(broker_factory: Any, tmp_path: Path) -> None:
    pw = tmp_path / "passwd"
    passwd(pw, "ops", "ops-pw")
    b = broker_factory(config_text=f"""
[auth]
allow_anonymous = false
password_file = "{pw}"
http_open_status = false
""")
    assert http(b, "GET", "/metrics")[0] == 401 and http(b, "GET", "/v1/health")[0] == 401
    assert http(b, "GET", "/metrics", auth="ops:ops-pw")[0] == 200
    assert http(b, "GET", "/v1/health", auth="ops:ops-pw")[0] == 200
    assert http(b, "GET", "/v1/shards", auth="ops:ops-pw")[0] == 403  # not an admin user


def test_http_off_loopback_without_auth_refuses_to_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for extra in ([], ["--config", str(_write(tmp_path / "anon.toml", "[auth]\nallow_anonymous = true\n"))]):
        r = subprocess.run([sys.executable, "-m", "moorline.cli", "run", "--data-dir", str(data), "--mqtt",
                            "127.0.0.1:0", "--http", "0.0.0.0:0", *extra],
                           capture_output=True, cwd=str(REPO_ROOT), timeout=60, text=True)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "refusing to serve HTTP on 0.0.0.0" in r.stderr and "moorline ready" not in r.stdout
        assert not data.exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_spark_node_client_sends_credentials(secured: tuple[BrokerProc, dict[str, str]]) -> None:
    from moorline.spark.node_client import MoorlineHTTPError, NodeClient
    from moorline.spark.options import MoorlineOptionError, parse_read_options, parse_write_options

    b, creds = secured
    server = f"127.0.0.1:{b.http_port}"
    token = creds["spark"].removeprefix("Bearer ")
    basic = parse_read_options({"servers": server, "topics": "public/#", "user": "ops", "password": "ops-pw"},
                               streaming=False)
    bearer = parse_write_options({"servers": server, "token": token})
    assert "ops-pw" not in repr(basic) and token not in repr(bearer)
    for opts in (basic, bearer):
        with NodeClient(opts.servers, 10, authorization=opts.authorization) as client:
            assert len(client.shards()) == 16
    with NodeClient((server,), 10) as client, pytest.raises(MoorlineHTTPError) as e:
        client.shards()
    assert e.value.status == 401
    for bad in ({"user": "ops"}, {"password": "x"}, {"user": "ops", "password": "x", "token": "t"}):
        with pytest.raises(MoorlineOptionError):
            parse_write_options({"servers": server, **bad})
