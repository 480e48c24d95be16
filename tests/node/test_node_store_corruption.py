"""One bad shard stops one shard (issue 19 item 11): a checksum failure in one shard's message store,
found when the node starts or when a record is read while it runs, stops that shard only. It is
visible in /v1/health and /v1/shards with the file and offset, the other shards serve, a publish to
the stopped shard is refused or its connection closed, and the log holds one ERROR, no traceback."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from moorline.hashing import shard_of
from moorline.storage.msgstore import HEADER_BYTES
from tests.node.nodeproc import NodeProcess

SHARDS = 16
BAD_TOPIC = "corrupt/a"
GOOD_TOPIC = next(t for t in (f"fine/{i}" for i in range(100)) if shard_of(t, SHARDS) != shard_of(BAD_TOPIC, SHARDS))
BAD, GOOD = shard_of(BAD_TOPIC, SHARDS), shard_of(GOOD_TOPIC, SHARDS)
CLIENTS = ("pub", "pub5", "pub3", "after", "reader")
assert all(shard_of(cid, SHARDS) != BAD for cid in CLIENTS)  # their sessions live in healthy shards
_HDR = struct.Struct("<HHIIq")  # magic, flags, crc, length, offset


def http_json(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def publish(port: int, topic: str, payloads: list[bytes], cid: str = "pub") -> None:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, clean_session=True, protocol=mqtt.MQTTv311)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        infos = [c.publish(topic, p, qos=1) for p in payloads]
        for i in infos:
            i.wait_for_publish(20)
            assert i.is_published()
    finally:
        c.disconnect()
        c.loop_stop()


def reply_to_v5_publish(port: int, topic: str) -> tuple[str, int, str]:
    """Raw MQTT 5 (paho drops a DISCONNECT whose reason code is not valid for it): CONNECT, one
    QoS 1 PUBLISH, and the first packet back: ("puback" | "disconnect", reason code, reason
    string), or ("closed", -1, "") when the connection closed without one."""

    def s(b: bytes) -> bytes:
        return len(b).to_bytes(2, "big") + b

    def packet(first: int, body: bytes) -> bytes:
        n, length = len(body), b""
        while True:
            n, digit = n >> 7, n & 0x7F
            length += bytes([digit | (0x80 if n else 0)])
            if not n:
                return bytes([first]) + length + body

    def read_packet(sock: socket.socket) -> tuple[int, bytes] | None:
        head = sock.recv(1)
        if not head:
            return None
        n = shift = 0
        while True:
            b = sock.recv(1)[0]
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        body = b""
        while len(body) < n:
            chunk = sock.recv(n - len(body))
            if not chunk:
                return None
            body += chunk
        return head[0] >> 4, body

    def reason_string(props: bytes) -> str:
        i = 0
        while i < len(props):
            pid = props[i]
            if pid == 0x1F:
                n = int.from_bytes(props[i + 1 : i + 3], "big")
                return props[i + 3 : i + 3 + n].decode()
            return ""  # the refusal carries the reason string first; nothing else to look for
        return ""

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(packet(0x10, s(b"MQTT") + bytes([5, 0x02]) + (60).to_bytes(2, "big") + b"\x00" + s(b"pub5")))
        connack = read_packet(sock)
        assert connack is not None and connack[0] == 2 and connack[1][1] == 0, connack
        sock.sendall(packet(0x32, s(topic.encode()) + (1).to_bytes(2, "big") + b"\x00" + b"x"))
        got = read_packet(sock)
    if got is None:
        return ("closed", -1, "")
    kind, body = got
    if kind == 4:  # PUBACK: packet id, reason code, properties
        props = body[4:] if len(body) > 3 else b""
        return ("puback", body[2] if len(body) > 2 else 0, reason_string(props[1:] if props else b""))
    assert kind == 14, got  # DISCONNECT: reason code, properties
    return ("disconnect", body[0] if body else 0, reason_string(body[2:] if len(body) > 1 and body[1] < 0x80 else body[3:]))


def publish_v311_closed(port: int, topic: str) -> bool:
    """Does a 3.1.1 QoS 1 publish end with the connection closed (and no PUBACK)?"""
    closed, acked = threading.Event(), threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub3", clean_session=True, protocol=mqtt.MQTTv311)
    c.on_disconnect = lambda *_a: closed.set()
    c.on_publish = lambda *_a: acked.set()
    c.reconnect_delay_set(60, 60)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        c.publish(topic, b"x", qos=1)
        return closed.wait(10) and not acked.is_set()
    finally:
        c.disconnect()
        c.loop_stop()


def flip_a_record(store_dir: Path, nth: int) -> tuple[Path, int]:
    """Flip one byte in the payload of the ``nth`` record of the shard's first store segment;
    returns (segment, where that record starts)."""
    seg = sorted(store_dir.glob("seg-*.dat"))[0]
    raw = bytearray(seg.read_bytes())
    p = 0
    for _ in range(nth):
        p += HEADER_BYTES + _HDR.unpack_from(raw, p)[3]
    length = _HDR.unpack_from(raw, p)[3]
    assert length > 4
    with open(seg, "r+b") as f:  # in place: a running node's open descriptor sees it
        f.seek(p + HEADER_BYTES + length // 2)
        f.write(bytes([raw[p + HEADER_BYTES + length // 2] ^ 0x20]))
    return seg, p


def assert_only_bad_shard_failed(port: int, seg: Path, at: int) -> None:
    status, health = http_json(port, "/v1/health")
    assert status == 503 and list(health["failed_shards"]) == [str(BAD)], health
    reason = health["failed_shards"][str(BAD)]
    assert str(seg) in reason and f"byte {at}" in reason, reason
    _, shards = http_json(port, "/v1/shards")
    available = {s["shard"]: s["available"] for s in shards["shards"]}
    assert [s for s, ok in available.items() if not ok] == [BAD]
    status, body = http_json(port, f"/v1/shards/{BAD}/messages?from=0")
    assert status == 503 and str(seg) in body["error"]


def assert_serving_and_refusing(node: NodeProcess) -> None:
    publish(node.mqtt_port, GOOD_TOPIC, [b"still served"], cid="after")  # another shard serves
    status, body = http_json(node.http_port, f"/v1/shards/{GOOD}/messages?from=0&max=10000")
    assert status == 200 and len(body["messages"]) == 31
    # MQTT 5: refused (PUBACK >= 0x80: the message entered no log) or the connection closed,
    # with a reason string that says which shard and why.
    kind, code, reason = reply_to_v5_publish(node.mqtt_port, BAD_TOPIC)
    assert kind in ("puback", "disconnect") and code >= 0x80, (kind, code, reason)
    assert f"shard {BAD}" in reason and "checksum failure" in reason, reason
    assert publish_v311_closed(node.mqtt_port, BAD_TOPIC)  # 3.1.1 cannot say no: closed


def assert_one_error_no_traceback(log: str, seg: Path) -> None:
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"shard {BAD} refuses service" in errors[0] and str(seg) in errors[0], errors


def node_with_a_corrupt_store(tmp_path: Path) -> tuple[NodeProcess, Path, int]:
    """A node that stopped cleanly (every store record synced), then one byte of a record in the
    bad shard's store flipped; started again. Returns (node, damaged segment, record offset)."""
    node = NodeProcess(tmp_path / "data").start()
    publish(node.mqtt_port, BAD_TOPIC, [f"bad-{i}".encode() * 20 for i in range(30)])
    publish(node.mqtt_port, GOOD_TOPIC, [f"good-{i}".encode() * 20 for i in range(30)])
    assert node.stop() == 0  # a clean stop syncs the stores: every record is synced data
    seg, at = flip_a_record(tmp_path / "data" / "store" / f"shard-{BAD}", 10)
    node.start()  # before: "refusing to start" (a StoreCorruption out of Node.open)
    return node, seg, at


def test_a_corrupt_store_record_found_at_start_stops_that_shard_only(tmp_path: Path) -> None:
    node, seg, at = node_with_a_corrupt_store(tmp_path)
    try:
        size = seg.stat().st_size
        assert_only_bad_shard_failed(node.http_port, seg, at)
        assert_serving_and_refusing(node)
        assert node.stop() == 0
        assert_one_error_no_traceback(node.log.read_text(), seg)
        assert seg.stat().st_size == size  # the damaged store is left as it was
    finally:
        if node.proc and node.proc.poll() is None:
            node.kill()


# Reason codes a DISCONNECT may carry (MQTT 5.0, 3.14.2.1); 0x88 "Server unavailable" is CONNACK's.
DISCONNECT_CODES = {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
                    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2}


def test_an_mqtt5_publish_to_a_failed_shard_gets_an_answer_its_client_can_read(tmp_path: Path) -> None:
    node, _seg, _at = node_with_a_corrupt_store(tmp_path)
    try:
        kind, code, _reason = reply_to_v5_publish(node.mqtt_port, BAD_TOPIC)
        assert (kind == "puback" and code >= 0x80) or (kind == "disconnect" and code in DISCONNECT_CODES), (kind, code)
    finally:
        if node.proc and node.proc.poll() is None:
            node.stop()


def test_a_corrupt_store_record_read_at_runtime_stops_that_shard_only(tmp_path: Path) -> None:
    """A subscriber's backlog is read from the store (nothing is cached after a restart): the
    damaged record stops the shard, instead of an exception in the subscriber's delivery."""
    node = NodeProcess(tmp_path / "data").start()
    try:
        sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="reader", clean_session=False,
                          protocol=mqtt.MQTTv311)
        sub.connect("127.0.0.1", node.mqtt_port)
        sub.loop_start()
        sub.subscribe(BAD_TOPIC, qos=1)
        time.sleep(0.5)
        sub.disconnect()
        sub.loop_stop()
        publish(node.mqtt_port, BAD_TOPIC, [f"bad-{i}".encode() * 20 for i in range(30)])
        publish(node.mqtt_port, GOOD_TOPIC, [f"good-{i}".encode() * 20 for i in range(30)])
        assert node.stop() == 0
        node.start()
        status, _ = http_json(node.http_port, "/v1/health")
        assert status == 200
        seg, at = flip_a_record(tmp_path / "data" / "store" / f"shard-{BAD}", 10)  # bit rot, node running

        got: list[bytes] = []
        sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="reader", clean_session=False,
                          protocol=mqtt.MQTTv311)
        sub.on_message = lambda _c, _u, m: got.append(bytes(m.payload))
        sub.connect("127.0.0.1", node.mqtt_port)
        sub.loop_start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and http_json(node.http_port, "/v1/health")[0] == 200:
            time.sleep(0.1)
        time.sleep(0.5)
        sub.disconnect()
        sub.loop_stop()
        assert got == [f"bad-{i}".encode() * 20 for i in range(10)]  # in order, up to the damage
        assert_only_bad_shard_failed(node.http_port, seg, at)
        assert_serving_and_refusing(node)
        assert node.stop() == 0
        assert_one_error_no_traceback(node.log.read_text(), seg)
    finally:
        if node.proc and node.proc.poll() is None:
            node.kill()


def test_a_wildcard_subscribe_over_a_failed_shard_fails_with_a_reason(tmp_path: Path) -> None:
    """A filter a failed shard would have to serve is refused (0x80, with the reason on 5.0), never a
    subscription that silently misses that shard's messages; a filter of a healthy shard is granted."""
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from rawclient import P_REASON_STRING, RawClient  # noqa: PLC0415

    node, _seg, _at = node_with_a_corrupt_store(tmp_path)
    try:
        c = RawClient("127.0.0.1", node.mqtt_port, 5)
        assert c.connect("wild").reason == 0
        ack = c.subscribe([("corrupt/#", 1), (GOOD_TOPIC, 1)])
        assert ack.reasons == [0x80, 1], ack
        reason = ack.prop(P_REASON_STRING, "")
        assert "corrupt/#" in reason and f"shard {BAD}" in reason, reason
        c.close()
    finally:
        if node.proc and node.proc.poll() is None:
            node.stop()
