"""The admin API behind the web console, on a real node process with authentication (issue 35):
without credentials every console route answers 401; a non-admin user sees only its own sessions
and clients and none of the admin routes; the admin lists clients (paged, filtered), disconnects
one with MQTT 5 DISCONNECT 0x98, ends a disconnected session as its expiry would (its delayed will
is published at once), lists and clears retained messages through the log; the live stream starts
with a full snapshot and is bounded by http.max_console_streams."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from rawclient import DISCONNECT, P_SESSION_EXPIRY, P_WILL_DELAY, PUBLISH, RawClient

from tests.console.support import USERS, auth_config, basic, call, write_passwords
from tests.node.nodeproc import NodeProcess

pytestmark = pytest.mark.timeout(120)
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("console-api")
    write_passwords(tmp / "passwords")
    (tmp / "node.toml").write_text(auth_config(tmp / "passwords", "[http]\nmax_console_streams = 1\n"
                                                                  "console_update_interval_s = 0.5\n"))
    n = NodeProcess(tmp / "data", tmp / "node.toml").start()
    yield n
    assert n.stop() == 0, n.log.read_text()[-3000:]


def base(n: NodeProcess) -> str:
    return f"http://{HOST}:{n.http_port}"


def mqtt(n: NodeProcess, cid: str, user: str, version: int = 5, **kw: Any) -> RawClient:
    c = RawClient(HOST, n.mqtt_port, version, timeout=10)
    ack = c.connect(cid, username=user, password=USERS[user].encode(), **kw)
    assert ack.reason == 0, ack
    return c


def test_without_credentials_everything_answers_401(node: NodeProcess) -> None:
    for path in ("/", "/console/console.js", "/v1/me", "/v1/console/stream", "/v1/sessions", "/v1/clients",
                 "/v1/sessions/x", "/v1/retained", "/v1/groups"):
        status, body = call(base(node), "GET", path)
        assert status == 401, (path, status, body)
    for path in ("/v1/clients/x", "/v1/sessions/x", "/v1/retained?filter=%23"):
        assert call(base(node), "DELETE", path)[0] == 401, path


def test_non_admin_sees_only_its_own(node: NodeProcess) -> None:
    a = mqtt(node, "alice-own", "alice", props=[(P_SESSION_EXPIRY, 600)])
    b = mqtt(node, "bob-own", "bob", props=[(P_SESSION_EXPIRY, 600)])
    try:
        status, me = call(base(node), "GET", "/v1/me", "alice")
        assert status == 200 and me == {"user": "alice", "admin": False, "node": "n1"}
        status, page = call(base(node), "GET", "/v1/sessions", "alice")
        assert status == 200 and [s["client_id"] for s in page["items"]] == ["alice-own"], page
        assert call(base(node), "GET", "/v1/sessions/bob-own", "alice")[0] == 404
        assert call(base(node), "GET", "/v1/sessions/alice-own", "alice")[0] == 200
        status, page = call(base(node), "GET", "/v1/clients", "alice")
        assert status == 200 and [c["client_id"] for c in page["items"]] == ["alice-own"], page
        for method, path in (("GET", "/v1/console/stream"), ("GET", "/v1/retained"), ("GET", "/v1/groups"),
                             ("DELETE", "/v1/clients/bob-own"), ("DELETE", "/v1/sessions/bob-own"),
                             ("DELETE", "/v1/sessions/alice-own"), ("DELETE", "/v1/retained?filter=%23")):
            assert call(base(node), method, path, "alice")[0] == 403, (method, path)
        # The admin sees both, paged and filtered.
        status, page = call(base(node), "GET", "/v1/sessions?q=-own&limit=1", "root")
        assert status == 200 and page["total"] == 2 and len(page["items"]) == 1, page
        status, page = call(base(node), "GET", "/v1/clients?user=bob", "root")
        assert [(c["client_id"], c["protocol"], c["node"]) for c in page["items"]] == [("bob-own", "MQTT 5", "n1")]
        assert call(base(node), "GET", "/v1/sessions?limit=0", "root")[0] == 400
        assert call(base(node), "GET", "/v1/sessions?connected=maybe", "root")[0] == 400
    finally:
        a.close()
        b.close()


def test_admin_disconnects_a_client_with_0x98(node: NodeProcess) -> None:
    c = mqtt(node, "kick-me", "bob")
    status, body = call(base(node), "DELETE", "/v1/clients/kick-me", "root")
    assert status == 200 and body["disconnected"] is True, body
    pkt = c.expect(DISCONNECT, timeout=5)
    assert pkt.reason == 0x98, pkt
    c.close()
    status, body = call(base(node), "DELETE", "/v1/clients/kick-me", "root")
    assert status == 404, body


def test_admin_ends_a_disconnected_session_and_its_will_goes_out(node: NodeProcess) -> None:
    watcher = mqtt(node, "will-watcher", "root")
    watcher.subscribe([("wills/#", 1)])
    doomed = mqtt(node, "doomed", "alice", clean=False, props=[(P_SESSION_EXPIRY, 3600)],
                  will=("wills/doomed", b"gone", 1, False), will_props=[(P_WILL_DELAY, 3600)])
    doomed.subscribe([("u/alice/#", 1)])
    doomed.abort()  # no DISCONNECT: the will waits for its delay (an hour)
    try:
        def disconnected() -> bool:
            status, s = call(base(node), "GET", "/v1/sessions/doomed", "root")
            return status == 200 and not s["connected"] and s["will_pending"]

        import time

        deadline = time.monotonic() + 10
        while not disconnected():
            assert time.monotonic() < deadline, "the session never showed as disconnected"
            time.sleep(0.1)
        status, s = call(base(node), "GET", "/v1/sessions/doomed", "root")
        assert s["subscriptions"] == 1 and s["subscriptions_list"][0]["filter"] == "u/alice/#", s
        assert watcher.recv_or_none(0.5) is None  # the will is not due yet
        status, body = call(base(node), "DELETE", "/v1/sessions/doomed", "root")
        assert status == 200 and body == {"client_id": "doomed", "ended": True}, body
        will = watcher.expect(PUBLISH, timeout=5)
        assert (will.topic, will.payload) == ("wills/doomed", b"gone")
        assert call(base(node), "GET", "/v1/sessions/doomed", "root")[0] == 404
        assert call(base(node), "DELETE", "/v1/sessions/doomed", "root")[0] == 404
    finally:
        watcher.close()


def test_retained_listed_and_cleared_through_the_log(node: NodeProcess) -> None:
    pub = mqtt(node, "retainer", "root")
    for topic in ("ret/a", "ret/b/c", "other/x"):
        pub.publish_and_wait(topic, b"value", qos=1, retain=True)
    pub.close()
    status, page = call(base(node), "GET", "/v1/retained?filter=ret/%23", "root")
    assert status == 200 and [r["topic"] for r in page["items"]] == ["ret/a", "ret/b/c"], page
    assert call(base(node), "DELETE", "/v1/retained", "root")[0] == 400  # no filter: refused
    assert call(base(node), "GET", "/v1/retained?filter=a/%23/b", "root")[0] == 400
    status, body = call(base(node), "DELETE", "/v1/retained?filter=ret/%23", "root")
    assert status == 200 and body["cleared"] == 2 and body["failed"] == [], body
    assert call(base(node), "GET", "/v1/retained?filter=ret/%23", "root")[1]["total"] == 0
    assert [r["topic"] for r in call(base(node), "GET", "/v1/retained", "root")[1]["items"]] == ["other/x"]
    sub = mqtt(node, "retained-reader", "root")
    sub.subscribe([("ret/#", 1)])
    assert sub.recv_or_none(1.0) is None, "a cleared retained message was delivered"
    sub.close()


def read_event(resp: Any) -> dict[str, Any]:
    data = None
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            data = line[6:]
        elif line == "" and data is not None:
            return json.loads(data)  # type: ignore[no-any-return]
    raise AssertionError("the stream ended before an event")


def test_stream_snapshot_and_bound(node: NodeProcess) -> None:
    req = urllib.request.Request(base(node) + "/v1/console/stream", headers={"Authorization": basic("root")})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = read_event(resp)
        assert [n["id"] for n in first["nodes"]] == ["n1"] and len(first["shards"]) == 16
        assert "history" in first and first["uptime_s"] > 0 and first["disk_bytes"] > 0
        assert all(s["leader"] == "n1" for s in first["shards"])
        second = read_event(resp)
        assert "history" not in second and second["t"] >= first["t"]
        # http.max_console_streams = 1: a second stream is refused while this one is open.
        status, body = call(base(node), "GET", "/v1/console/stream", "root")
        assert status == 429 and "max_console_streams" in body["error"], body


def test_console_page_and_openapi(node: NodeProcess) -> None:
    req = urllib.request.Request(base(node) + "/", headers={"Authorization": basic("alice")})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert b"/console/console.js" in r.read()
    assert call(base(node), "GET", "/console/../node.toml", "root")[0] == 404
    paths = call(base(node), "GET", "/v1/openapi.json", "root")[1]["paths"]
    for path in ("/v1/clients", "/v1/clients/{client_id}", "/v1/sessions", "/v1/sessions/{client_id}",
                 "/v1/retained", "/v1/groups", "/v1/console/stream"):
        assert path in paths, path


def test_cli_commands(node: NodeProcess) -> None:
    from typer.testing import CliRunner

    from moorline.cli import app

    runner = CliRunner(env={"COLUMNS": "200"})  # rich tables: no column cut short
    admin = ["--http", f"{HOST}:{node.http_port}", "--user", "root", "--password", USERS["root"]]
    c = mqtt(node, "cli-client", "bob", props=[(P_SESSION_EXPIRY, 600)])
    try:
        r = runner.invoke(app, ["clients", "list", *admin, "--json"])
        assert r.exit_code == 0, r.output
        assert "cli-client" in [x["client_id"] for x in json.loads(r.output)["items"]]
        r = runner.invoke(app, ["sessions", "list", *admin, "--q", "cli-"])
        assert r.exit_code == 0 and "cli-client" in r.output and "connected" in r.output, r.output
        r = runner.invoke(app, ["sessions", "show", "cli-client", *admin])
        assert r.exit_code == 0 and "connected to n1" in r.output, r.output
        pub = mqtt(node, "cli-retainer", "root")
        pub.publish_and_wait("cli/r", b"v", qos=1, retain=True)
        pub.close()
        r = runner.invoke(app, ["retained", "list", *admin, "--filter", "cli/#"])
        assert r.exit_code == 0 and "cli/r" in r.output, r.output
        r = runner.invoke(app, ["retained", "clear", *admin, "--filter", "cli/#", "--yes"])
        assert r.exit_code == 0 and "cleared 1 retained message" in r.output, r.output
        r = runner.invoke(app, ["clients", "disconnect", "cli-client", *admin])
        assert r.exit_code == 0 and "disconnected cli-client from n1" in r.output, r.output
        # Errors are one clear line, never a traceback.
        r = runner.invoke(app, ["sessions", "delete", "cli-client", "--yes", "--http", f"{HOST}:{node.http_port}",
                                "--user", "alice", "--password", USERS["alice"]])
        assert r.exit_code == 1 and "HTTP 403" in r.output and "admin role" in r.output, r.output
        r = runner.invoke(app, ["sessions", "list", "--http", f"{HOST}:1"])
        assert r.exit_code == 1 and "cannot reach" in r.output and "Traceback" not in r.output, r.output
    finally:
        c.close()


def test_admin_ends_a_connected_session_here(node: NodeProcess) -> None:
    watcher = mqtt(node, "will-watcher-2", "root")
    watcher.subscribe([("wills/#", 1)])
    victim = mqtt(node, "connected-victim", "bob", clean=False, props=[(P_SESSION_EXPIRY, 3600)],
                  will=("wills/victim", b"bye", 1, False))
    try:
        status, body = call(base(node), "DELETE", "/v1/sessions/connected-victim", "root")
        assert status == 200 and body["ended"] is True, body
        assert victim.expect(DISCONNECT, timeout=5).reason == 0x98
        will = watcher.expect(PUBLISH, timeout=5)
        assert (will.topic, will.payload) == ("wills/victim", b"bye")
        assert call(base(node), "GET", "/v1/sessions/connected-victim", "root")[0] == 404
    finally:
        victim.close()
        watcher.close()


@pytest.mark.parametrize("key,value", [("console_update_interval_s", 0.1), ("max_console_streams", -1),
                                       ("max_admin_page", 0), ("console_history_s", -5.0)])
def test_console_bounds_are_checked(key: str, value: float) -> None:
    from moorline.config import ConfigError, NodeConfig

    cfg = NodeConfig()
    setattr(cfg.http, key, value)
    with pytest.raises(ConfigError, match=f"http.{key}"):
        cfg.validate()
