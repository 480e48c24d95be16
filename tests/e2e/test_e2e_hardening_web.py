"""Issue 30 items 8 and 9, the WebSocket Low, and issue 36 item 5 (HTTP part), against running nodes:
what one HTTP user can make a node read, scan or hold; what a web page of another site, or one whose
DNS name was rebound to 127.0.0.1, can make the default open loopback node do; unknown routes."""

from __future__ import annotations

import base64
import json
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_broker import BrokerProc, running_broker
from listener_support import WsSocket, listener_ports
from rawclient import RawClient

from moorline.hashing import shard_of

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]

SHARDS = 16


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """The default open loopback node, plus a WebSocket listener (keys that exist since before this round)."""
    with running_broker(tmp_path_factory.mktemp("web"), config_text='[listeners]\nws = "127.0.0.1:0"\n') as b:
        yield b


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """A node with small HTTP bounds, so a test reaches them with a few thousand messages."""
    config = ("[http]\nmax_scan_per_fetch = 1000\nscan_slice = 100\nmax_answer_bytes = 65536\n"
              'allowed_hosts = ["broker.example"]\n')
    with running_broker(tmp_path_factory.mktemp("bounded"), config_text=config) as b:
        yield b


def request(b: BrokerProc, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(b.http_url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw, status, got = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, got = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw.decode(errors="replace"), got


def publish_body(topics: list[str], payload: bytes = b"x") -> bytes:
    enc = base64.b64encode(payload).decode()
    return json.dumps({"messages": [{"topic": t, "payload": enc} for t in topics]}).encode()


JSON = {"Content-Type": "application/json"}


# --- 30.9: web pages and the default open loopback node ---------------------------------------------

def test_a_cross_site_text_plain_post_cannot_publish_on_the_open_loopback_node(node: BrokerProc) -> None:
    """Attack: any web page the node's user visits POSTs text/plain (a "simple" request, no CORS
    preflight) to 127.0.0.1:8888/v1/publish and publishes; or sets a retention pin."""
    sub = RawClient("127.0.0.1", node.mqtt_port, version=5)
    assert sub.connect("web-watch").reason == 0
    assert sub.subscribe([("web/#", 1)]).reasons == [1]
    page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    status, body, _ = request(node, "POST", "/v1/publish", publish_body(["web/forged"]), page)
    assert status in (403, 415) and "error" in body, (status, body)
    status, body, _ = request(node, "POST", "/v1/pins", json.dumps({"reader": "r", "offsets": {"0": 0}}).encode(),
                              page)
    assert status in (403, 415), (status, body)
    # with a JSON content type but a foreign Origin (a page could only send that after a preflight)
    status, body, _ = request(node, "POST", "/v1/publish", publish_body(["web/forged"]),
                              {**JSON, "Origin": "http://evil.example"})
    assert status == 403, (status, body)
    # not JSON, no Origin: refused too (415)
    status, body, _ = request(node, "POST", "/v1/publish", publish_body(["web/forged"]),
                              {"Content-Type": "text/plain"})
    assert status == 415, (status, body)
    assert sub.recv_or_none(0.5) is None  # nothing was published
    # the real clients: JSON without Origin, and a page of this very origin
    status, body, _ = request(node, "POST", "/v1/publish", publish_body(["web/real"]), JSON)
    assert status == 200 and body["results"][0]["status"] == "ok", body
    own = f"http://127.0.0.1:{node.http_port}"
    status, body, _ = request(node, "POST", "/v1/publish", publish_body(["web/own"]), {**JSON, "Origin": own})
    assert status == 200, body
    got = [sub.next_message(10).topic for _ in range(2)]
    assert got == ["web/real", "web/own"]
    sub.disconnect()


def test_a_dns_rebound_host_name_reads_nothing(node: BrokerProc) -> None:
    """Attack: a page at evil.example rebinds its DNS name to 127.0.0.1 and, being same-origin with
    itself, reads the node's messages: the request arrives with Host: evil.example."""
    status, body, _ = request(node, "GET", "/v1/shards/0/messages?from=0", headers={"Host": "evil.example:8888"})
    assert status == 421 and "error" in body, (status, body)
    for host in (f"127.0.0.1:{node.http_port}", f"localhost:{node.http_port}", "localhost"):
        status, body, _ = request(node, "GET", "/v1/shards/0/messages?from=0", headers={"Host": host})
        assert status == 200, (host, status, body)


def test_host_names_listed_in_http_allowed_hosts_are_served(bounded: BrokerProc) -> None:
    """A node reached by DNS name lists its names in http.allowed_hosts; other names stay refused."""
    status, _, _ = request(bounded, "GET", "/v1/health", headers={"Host": f"broker.example:{bounded.http_port}"})
    assert status == 200
    status, _, _ = request(bounded, "GET", "/v1/health", headers={"Host": f"evil.example:{bounded.http_port}"})
    assert status == 421


def test_a_web_page_of_another_site_cannot_open_the_mqtt_websocket(node: BrokerProc) -> None:
    """Attack: any web page opens ws://127.0.0.1:PORT/mqtt (browsers allow cross-origin WebSockets)
    and subscribes to '#'."""
    port = listener_ports(node)["ws"]
    evil = _ws_upgrade(port, {"Origin": "http://evil.example"})
    assert evil.startswith("HTTP/1.1 403"), evil
    rebound = _ws_upgrade(port, {"Origin": f"http://evil.example:{port}", "Host": f"evil.example:{port}"})
    assert rebound.startswith("HTTP/1.1 403"), rebound
    same_host = _ws_upgrade(port, {"Origin": "http://127.0.0.1:8080"})
    assert same_host.startswith("HTTP/1.1 101"), same_host
    ws = WsSocket("127.0.0.1", port)  # an MQTT library: no Origin
    assert ws.status == 101
    ws.close()


def _ws_upgrade(port: int, extra: dict[str, str]) -> str:
    headers = {"Host": f"127.0.0.1:{port}", "Upgrade": "websocket", "Connection": "Upgrade",
               "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode(), "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Protocol": "mqtt", **extra}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("GET /mqtt HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode())
        return s.recv(4096).decode(errors="replace")


def test_a_websocket_cannot_make_the_node_buffer_megabytes_before_connect(node: BrokerProc) -> None:
    """Attack: before CONNECT, a WebSocket client sends one frame announced as 1 MiB and trickles it:
    the node buffers up to 2 MiB per socket (twice mqtt.max_packet_size) against the documented 128 KiB
    (mqtt.max_connect_packet_bytes). Now the socket is dropped once it passes that bound."""
    ws = WsSocket("127.0.0.1", listener_ports(node)["ws"])
    assert ws.status == 101
    size = 1 << 20
    ws.sock.sendall(struct.pack("!BBQ", 0x82, 0x80 | 127, size) + b"\x00\x00\x00\x00")  # masked, mask 0
    sent, closed = 0, False
    chunk = b"\x00" * (32 << 10)
    deadline = time.monotonic() + 10
    while sent < 600 << 10 and time.monotonic() < deadline:
        try:
            ws.sock.sendall(chunk)
            sent += len(chunk)
        except OSError:
            closed = True
            break
        time.sleep(0.01)
    if not closed:
        ws.sock.settimeout(3)
        try:
            closed = ws.sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        except TimeoutError:
            closed = False
    ws.close()
    assert closed, f"still open after {sent} bytes before CONNECT"
    assert sent <= 300 << 10, f"{sent} bytes were taken before the socket was dropped"


# --- 30.8: HTTP API bounds ----------------------------------------------------------------------------

def test_a_huge_request_body_is_refused_before_it_is_read(node: BrokerProc) -> None:
    """Attack: one 16 MiB JSON body froze the event loop for 3 s and took 470 MiB of RSS. Now it gets
    413 from its headers alone (the body is never sent here: the old node waited for it)."""
    with socket.create_connection(("127.0.0.1", node.http_port), timeout=10) as s:
        s.sendall(f"POST /v1/publish HTTP/1.1\r\nHost: 127.0.0.1:{node.http_port}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {16 << 20}\r\n\r\n".encode())
        s.settimeout(5)
        try:
            head = s.recv(4096).decode(errors="replace")
        except TimeoutError:
            head = "(no answer within 5 s)"
    assert head.startswith("HTTP/1.1 413"), head
    assert '"error"' in head


def test_a_filter_deeper_than_mqtt_max_topic_levels_is_refused(node: BrokerProc) -> None:
    """Attack: a 3,500-level filter on a fetch escapes mqtt.max_topic_levels (32) and
    mqtt.max_topic_length (1024 bytes), which MQTT enforces."""
    for deep, why in (("/".join(["a"] * 40) + "/#", "levels"), ("/".join(["a"] * 3500) + "/#", "longer")):
        status, body, _ = request(node, "GET", f"/v1/shards/0/messages?from=0&filter={deep}")
        assert status == 400 and why in body["error"], (status, body)
    status, body, _ = request(node, "GET", "/v1/shards/0/messages?from=0&filter=a/%2B/%23")
    assert status == 200, body


def test_a_fetch_that_matches_nothing_scans_a_bounded_slice(bounded: BrokerProc) -> None:
    """Attack: a fetch whose filter matches nothing scanned a whole shard in one step. Now one call
    examines at most http.max_scan_per_fetch offsets and the reader continues from scanned_to."""
    topic = "scan/t"
    shard = shard_of(topic, SHARDS)
    status, body, _ = request(bounded, "POST", "/v1/publish", publish_body([topic] * 2500), JSON)
    assert status == 200 and all(r["status"] == "ok" for r in body["results"])
    status, page, _ = request(bounded, "GET", f"/v1/shards/{shard}/messages?from=0&filter=nothing/%23")
    assert status == 200 and page["messages"] == [] and page["scanned_to"] == 1000, page
    pages, start = 1, page["scanned_to"]
    while start < page["next_offset"]:
        status, page, _ = request(bounded, "GET", f"/v1/shards/{shard}/messages?from={start}&filter=nothing/%23")
        assert status == 200 and page["scanned_to"] - start <= 1000
        start, pages = page["scanned_to"], pages + 1
    assert pages == 3


def test_a_fetch_answer_is_capped_in_bytes(bounded: BrokerProc) -> None:
    """Attack: answers were capped by count only: max=10000 messages of 1 MiB each is a 13 GiB answer.
    Now a page holds about http.max_answer_bytes (64 KiB here), and the reader continues."""
    topic = "big/t"
    shard = shard_of(topic, SHARDS)
    status, body, _ = request(bounded, "POST", "/v1/publish", publish_body([topic] * 20, b"y" * (16 << 10)), JSON)
    assert status == 200
    first = body["results"][0]["offset"]
    status, page, raw_headers = request(bounded, "GET", f"/v1/shards/{shard}/messages?from={first}&max=10000"
                                                       f"&filter={topic}")
    assert status == 200
    assert 1 <= len(page["messages"]) <= 4, len(page["messages"])
    assert len(json.dumps(page)) < 2 * 65536
    seen = len(page["messages"])
    while page["scanned_to"] < page["next_offset"]:
        status, page, _ = request(bounded, "GET", f"/v1/shards/{shard}/messages?from={page['scanned_to']}"
                                                  f"&max=10000&filter={topic}")
        seen += len(page["messages"])
    assert seen == 20


# --- 36.5: JSON everywhere, the topic's shard -----------------------------------------------------------

def test_unknown_routes_and_methods_answer_json(node: BrokerProc) -> None:
    """Issue 36.5: an unknown route answered plain text where the docs say every answer is JSON."""
    status, body, _ = request(node, "GET", "/v1/no-such-route")
    assert status == 404 and isinstance(body, dict) and "error" in body, (status, body)
    status, body, headers = request(node, "DELETE", "/v1/shards")
    assert status == 405 and isinstance(body, dict) and "error" in body, (status, body)


def test_a_topics_shard_is_one_request_away(node: BrokerProc) -> None:
    """Issue 36.5: docs/http-api.md's example read a shard its topic is not in; nobody should have to
    compute crc32c(topic) % shard_count."""
    status, body, _ = request(node, "GET", "/v1/topics/sensors/t1/shard")
    assert status == 200 and body == {"topic": "sensors/t1", "shard": shard_of("sensors/t1", SHARDS),
                                      "shard_count": SHARDS}, body
    status, body, _ = request(node, "GET", "/v1/topics/sensors%2Ft1/shard")
    assert status == 200 and body["shard"] == shard_of("sensors/t1", SHARDS)
    status, body, _ = request(node, "GET", "/v1/topics/sensors/%23/shard")
    assert status == 400, body
    status, doc, _ = request(node, "GET", "/v1/openapi.json")
    assert "/v1/topics/{topic}/shard" in doc["paths"]


def test_the_http_api_docs_example_reads_the_shard_of_its_topic() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    example = text.split("```bash", 1)[1].split("```", 1)[0]
    shard = shard_of("sensors/t1", SHARDS)
    assert f"/v1/shards/{shard}/messages" in example and '"shard": ' + str(shard) in example, example
