"""Bad input: malformed packets, protocol violations, slow readers and garbage floods. After each, a
well-behaved client still works. Exact reason codes are checked on moorline; on mosquitto only the
structure (the connection is closed, nothing bad is acknowledged)."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from e2e_broker import BROKER_KIND, BrokerProc, running_broker
from rawclient import (
    CONNACK,
    DISCONNECT,
    P_SESSION_EXPIRY,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    ConnectionClosed,
    Packet,
    RawClient,
    encode_ack,
    encode_connect,
    encode_publish,
    encode_subscribe,
    packet,
    utf8,
    varint,
)

pytestmark = pytest.mark.e2e
HOST = "127.0.0.1"
SEED = int(os.environ.get("MOORLINE_E2E_SEED", "20261123"))
CONNECT_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """This module's broker: moorline with a short CONNECT timeout, so idle sockets are dropped quickly, and
    small fixed memory bounds (recent-message cache, free heap kept by the allocator): the slow-reader test
    measures whether memory grows with what a client is owed, which fixed-size caches would blur."""
    config = (
        f"[mqtt]\nconnect_timeout_s = {CONNECT_TIMEOUT_S}\n"
        "[storage]\nstore_cache_bytes = 8388608\n"
        "[runtime]\nmalloc_trim_threshold_bytes = 16777216\nmalloc_top_pad_bytes = 1048576\n"
        if BROKER_KIND == "moorline" else None
    )
    with running_broker(tmp_path_factory.mktemp("bad"), config_text=config) as b:
        yield b


def assert_healthy(b: BrokerProc, tag: str) -> None:
    """A well-behaved client can still connect, subscribe, publish QoS 1 and receive its message."""
    with RawClient(HOST, b.mqtt_port, 5, timeout=10) as c:
        assert c.connect(f"healthy-{tag}-{random.randrange(1 << 30)}").reason == 0
        topic = f"healthy/{tag}/{random.randrange(1 << 30)}"
        assert c.subscribe([(topic, 1)]).reasons == [1]
        assert c.publish_and_wait(topic, b"ok", 1).reason < 0x80
        m = c.next_message(10)
        assert (m.topic, m.payload) == (topic, b"ok")
        c.ack(m)
        c.disconnect()


def closed_after(c: RawClient, data: bytes, timeout: float = 5.0) -> list[Packet]:
    c.send(data)
    return c.wait_closed(timeout)


def connected(b: BrokerProc, version: int, cid: str) -> RawClient:
    c = RawClient(HOST, b.mqtt_port, version)
    assert c.connect(cid).reason == 0
    return c


MALFORMED_FIRST_PACKETS = {
    "publish-before-connect": encode_publish("t", b"x", 0),
    "reserved-type-0": bytes([0x00, 0x00]),
    "connect-bad-flags": bytes([0x11]) + encode_connect("x")[1:],
    "connect-truncated": encode_connect("abcdef")[:-3] + b"",  # length says more than follows... then EOF
    "connect-bad-protocol-name": encode_connect("x", protocol_name=b"MQTX"),
    "connect-reserved-flag-set": (lambda b: b[:9] + bytes([b[9] | 0x01]) + b[10:])(encode_connect("x")),
    "remaining-length-5-bytes": bytes([0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F]),
    "http-request": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: e2e\r\nAccept: */*\r\n"
                    b"Accept-Encoding: gzip\r\nConnection: keep-alive\r\n\r\n",
    "tls-client-hello": bytes.fromhex("16030100a5010000a10303") + os.urandom(40),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_FIRST_PACKETS))
def test_malformed_first_packet_closes_connection(shared_broker: BrokerProc, name: str) -> None:
    data = MALFORMED_FIRST_PACKETS[name]
    with RawClient(HOST, shared_broker.mqtt_port, 4) as c:
        if name == "connect-truncated":
            c.send(data)
            c.sock.shutdown(socket.SHUT_WR)
            got = c.wait_closed(10)
        else:
            got = closed_after(c, data, 10)
        assert not [p for p in got if p.type == CONNACK and p.reason == 0], got
    assert_healthy(shared_broker, name)


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_malformed_packet_after_connect(shared_broker: BrokerProc, version: int) -> None:
    bad_packets = [
        bytes([0x82, 0x02, 0x00, 0x01]),  # SUBSCRIBE with no topic filter
        bytes([0x80, 0x06, 0x00, 0x01, 0x00, 0x01, 0x61, 0x00]),  # SUBSCRIBE with wrong fixed-header flags
        bytes([0x36, 0x03, 0x00, 0x01, 0x74]),  # PUBLISH QoS 3
        packet(PUBLISH, 0x02, utf8("t")),  # QoS 1 PUBLISH without packet id (truncated)
        bytes([0xE0, 0x05, 0x00, 0x00]),  # DISCONNECT whose length exceeds what is sent... then more bytes
    ]
    for i, bad in enumerate(bad_packets):
        c = connected(shared_broker, version, f"bad-after-connect-{version}-{i}")
        if i == len(bad_packets) - 1:
            c.send(bad)
            c.sock.shutdown(socket.SHUT_WR)
            got = c.wait_closed(10)
        else:
            got = closed_after(c, bad, 10)
        c.close()
        assert not [p for p in got if p.type in (PUBACK, CONNACK)], got
        if version == 5 and shared_broker.is_moorline and i < len(bad_packets) - 1:
            assert [p.reason for p in got if p.type == DISCONNECT] in ([0x81], [0x82]), (i, got)
    assert_healthy(shared_broker, f"after-connect-{version}")


def test_second_connect_is_protocol_error(shared_broker: BrokerProc) -> None:
    c = connected(shared_broker, 5, "double-connect")
    got = closed_after(c, encode_connect("double-connect", 5))
    assert not [p for p in got if p.type == CONNACK], got
    if shared_broker.is_moorline:
        assert [p.reason for p in got if p.type == DISCONNECT] == [0x82], got
    assert_healthy(shared_broker, "double-connect")


@pytest.mark.parametrize("level", [3, 6, 7, 255])
def test_wrong_protocol_level(shared_broker: BrokerProc, level: int) -> None:
    with RawClient(HOST, shared_broker.mqtt_port, 4) as c:
        got = closed_after(c, encode_connect("lvl", version=level), 10)
    # 3.1.1 servers answer 0x01 "unacceptable protocol version"; MQTT 5 servers may use 0x84 (3.1.1-shaped
    # or 5-shaped CONNACK); level 3 with protocol name "MQTT" (not "MQIsdp") is wrong too.
    connacks = [p for p in got if p.type == CONNACK]
    assert all(p.reason != 0 for p in connacks), got
    if shared_broker.is_moorline:
        assert [p.reason for p in connacks] in ([0x01], [0x84]), got
    assert_healthy(shared_broker, f"level{level}")


def test_oversized_packet_v5_disconnect_0x95(shared_broker: BrokerProc) -> None:
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = c.connect("oversized")
    assert ack.reason == 0
    limit = ack.prop(0x27)  # Maximum Packet Size the server accepts
    if shared_broker.is_moorline:
        assert limit == 1 << 20, ack
    size = (limit or (1 << 20)) + 1024
    try:
        c.send(encode_publish("big", b"x" * size, 1, pid=1, version=5))
    except OSError:
        pass  # the broker may close while we are still sending
    got = c.wait_closed(10)
    c.close()
    assert not [p for p in got if p.type == PUBACK and p.reason < 0x80], got
    if shared_broker.is_moorline:
        assert [p.reason for p in got if p.type == DISCONNECT] == [0x95], got
    assert_healthy(shared_broker, "oversized")


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_invalid_utf8_topic(shared_broker: BrokerProc, version: int) -> None:
    for bad_topic in (b"t/\xff\xfe", b"t/\xed\xa0\x80", b"t/\x00x"):  # invalid byte, surrogate, NUL
        watcher = connected(shared_broker, 5, f"utf8-watch-{version}-{bad_topic.hex()}")
        watcher.subscribe([("t/#", 0)])
        c = connected(shared_broker, version, f"utf8-{version}-{bad_topic.hex()}")
        got = closed_after(c, encode_publish(bad_topic, b"x", 1, pid=1, version=version))
        c.close()
        assert not [p for p in got if p.type == PUBACK and p.reason < 0x80], (bad_topic, got)
        if version == 5 and shared_broker.is_moorline:
            assert [p.reason for p in got if p.type == DISCONNECT] in ([0x81], [0x90]), got
        assert watcher.recv_or_none(0.3) is None, "a message with an invalid topic was delivered"
        watcher.disconnect()
    assert_healthy(shared_broker, f"utf8-{version}")


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_wildcard_in_publish_topic(shared_broker: BrokerProc, version: int) -> None:
    for bad_topic in ("a/+/b", "a/#", "#"):
        c = connected(shared_broker, version, f"wild-pub-{version}-{bad_topic}")
        got = closed_after(c, encode_publish(bad_topic, b"x", 1, pid=1, version=version))
        c.close()
        assert not [p for p in got if p.type == PUBACK and p.reason < 0x80], got
        if version == 5 and shared_broker.is_moorline:
            assert [p.reason for p in got if p.type == DISCONNECT] == [0x90], got  # Topic Name invalid
    assert_healthy(shared_broker, f"wild-{version}")


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_invalid_subscription_filter(shared_broker: BrokerProc, version: int) -> None:
    c = connected(shared_broker, version, f"bad-filter-{version}")
    c.send(encode_subscribe(5, [("a/#/b", 1), ("ok/+", 1), ("a/b+", 0)], version))
    try:
        first = c.recv(5)  # 3.1.1: SUBACK with 0x80 for the bad filters, or close
    except ConnectionClosed:
        first = None
    if first is not None:
        assert first.type in (9, DISCONNECT), first
        if first.type == 9:
            assert first.reasons[0] >= 0x80 and first.reasons[2] >= 0x80, first
            assert first.reasons[1] == 1, first
    if shared_broker.is_moorline:
        assert first is not None and first.type == 9, "moorline answers with a SUBACK"
        assert first.reasons == ([0x80, 1, 0x80] if version == 4 else [0x8F, 1, 0x8F]), first
    c.close()
    assert_healthy(shared_broker, f"filter-{version}")


def test_pubrel_for_unknown_packet_id(shared_broker: BrokerProc) -> None:
    c = connected(shared_broker, 5, "pubrel-unknown")
    c.send(encode_ack(6, 4242, 5))  # PUBREL for an id we never used
    comp = c.expect(PUBCOMP)
    assert comp.pid == 4242
    assert comp.reason in (0x00, 0x92), comp
    if shared_broker.is_moorline:
        assert comp.reason == 0x92, comp  # Packet Identifier not found
    c.ping()
    c.disconnect()
    c3 = connected(shared_broker, 4, "pubrel-unknown-v3")
    c3.send(encode_ack(6, 4242, 4))
    assert c3.expect(PUBCOMP).pid == 4242  # 3.1.1: PUBCOMP (no reason codes)
    c3.disconnect()


def test_puback_for_unknown_packet_id_is_harmless(shared_broker: BrokerProc) -> None:
    c = connected(shared_broker, 5, "puback-unknown")
    c.send(encode_ack(PUBACK, 999, 5))
    c.send(encode_ack(PUBCOMP, 998, 5))
    c.ping()  # still connected and served
    c.disconnect()
    assert_healthy(shared_broker, "puback-unknown")


def test_qos1_packet_id_zero_is_protocol_error(shared_broker: BrokerProc) -> None:
    c = connected(shared_broker, 5, "pid-zero")
    got = closed_after(c, encode_publish("pid/zero", b"x", 1, pid=0, version=5))
    assert not [p for p in got if p.type == PUBACK and p.reason < 0x80], got
    assert_healthy(shared_broker, "pid-zero")


def test_slow_reader_does_not_stall_others_and_is_bounded(shared_broker: BrokerProc) -> None:
    """A subscriber that never reads its socket: the shared_broker keeps serving others, and its memory does not
    grow with what the slow client is owed."""
    slow = RawClient(HOST, shared_broker.mqtt_port, 5)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    assert slow.connect("slow", clean=False, props=[(P_SESSION_EXPIRY, 600)]).reason == 0
    slow.subscribe([("flood/#", 0), ("flood1/#", 1)])
    # slow now stops reading
    time.sleep(0.5)
    rss_before = shared_broker.rss_bytes()
    pub = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert pub.connect("flood-pub").reason == 0
    payload = os.urandom(16 * 1024)
    n = 2000  # 32 MiB at QoS 0 and 1 each
    stop = threading.Event()
    healthy_errors: list[BaseException] = []
    healthy_rounds = [0]

    def keep_checking() -> None:
        try:
            while not stop.is_set():
                assert_healthy(shared_broker, f"during-flood-{healthy_rounds[0]}")
                healthy_rounds[0] += 1
                time.sleep(0.2)
        except BaseException as e:  # noqa: BLE001
            healthy_errors.append(e)

    t = threading.Thread(target=keep_checking, daemon=True)
    t.start()
    try:
        for i in range(n):
            pub.publish(f"flood/{i % 4}", payload, 0)
            pub.publish_and_wait(f"flood1/{i % 4}", payload, 1, timeout=30)
    finally:
        stop.set()
        t.join(30)
    assert healthy_errors == [], healthy_errors
    assert healthy_rounds[0] >= 1
    growth = shared_broker.rss_bytes() - rss_before
    owed = 2 * n * len(payload)
    # Buffering what the slow reader is owed would grow RSS by about `owed`. mosquitto does keep it all in
    # memory (max_queued_messages 100000 here), so the memory bound is moorline's promise only.
    if shared_broker.is_moorline:
        assert growth < owed * 3 // 4, f"shared_broker RSS grew {growth >> 20} MiB while the slow reader was owed {owed >> 20} MiB"
    pub.disconnect()
    slow.close()
    assert_healthy(shared_broker, "after-slow")
    # end the slow session so the module's broker does not keep its queue
    end = RawClient(HOST, shared_broker.mqtt_port, 5)
    assert end.connect("slow", clean=True).reason == 0
    end.disconnect()


def test_garbage_connection_flood(shared_broker: BrokerProc) -> None:
    rng = random.Random(SEED)
    n = 200
    socks: list[socket.socket] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def garbage() -> None:
        for i in range(n):
            try:
                s = socket.create_connection((HOST, shared_broker.mqtt_port), timeout=5)
                blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600)))
                if i % 3 == 0:
                    blob = bytes([0x10]) + varint(rng.randrange(1, 1 << 20)) + blob  # plausible CONNECT header
                s.sendall(blob)
                socks.append(s)
            except OSError:
                pass  # the broker may refuse or reset: fine
            if stop.is_set():
                return

    t = threading.Thread(target=garbage, daemon=True)
    t.start()
    try:
        for i in range(5):
            assert_healthy(shared_broker, f"flood-{i}")
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    t.join(60)
    stop.set()
    assert not errors, errors
    assert_healthy(shared_broker, "after-flood")
    for s in socks:
        s.close()
    assert_healthy(shared_broker, "after-flood-closed")


@pytest.mark.moorline_only
def test_idle_connection_without_connect_is_closed(shared_broker: BrokerProc) -> None:
    """A socket that never sends CONNECT does not hold a slot for ever (mqtt.connect_timeout_s)."""
    s = socket.create_connection((HOST, shared_broker.mqtt_port), timeout=CONNECT_TIMEOUT_S + 10)
    t0 = time.monotonic()
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 5
    s.close()





def test_client_exceeding_server_receive_maximum(shared_broker: BrokerProc) -> None:
    """QoS 2 PUBLISHes never released stay in flight; one more than the server's Receive Maximum must
    not be accepted (MQTT 5: DISCONNECT 0x93 Receive Maximum exceeded)."""
    c = RawClient(HOST, shared_broker.mqtt_port, 5)
    ack = c.connect("recv-max-abuser")
    assert ack.reason == 0
    limit = ack.prop(0x21, 65535)  # server's Receive Maximum
    assert limit <= 1024, f"server Receive Maximum {limit} is too large to test here"
    for pid in range(1, limit + 2):
        try:
            c.send(encode_publish("recvmax/t", b"x", 2, pid=pid, version=5))
        except OSError:
            break
    recs: list[Packet] = []
    other: list[Packet] = []
    try:
        while True:
            p = c.recv(3)
            (recs if p.type == 5 else other).append(p)
    except (TimeoutError, ConnectionClosed):
        pass
    c.close()
    ok = [p for p in recs if p.reason < 0x80]
    assert len(ok) <= limit, f"{len(ok)} QoS 2 publishes accepted with Receive Maximum {limit}"
    # PUBRECs of the first `limit` may be lost with the connection (the client resends them after reconnect)
    assert recs or other, "no answer at all"
    if shared_broker.is_moorline:
        assert [p.reason for p in other if p.type == DISCONNECT] == [0x93], other
    assert_healthy(shared_broker, "recv-max")
