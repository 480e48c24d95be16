"""Resource limits that hold against a real broker process (issue 19 items 6 and 8): bounded topic
names and filters, bytes buffered before CONNECT, sockets that never complete CONNECT, the connection
rate of one address, partial packets that never complete, and a subscriber that stops reading. After
each, a well-behaved client still works."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
from e2e_broker import BrokerFactory, BrokerProc, running_broker
from e2e_support import wait_until
from rawclient import (
    CONNACK,
    DISCONNECT,
    P_RECEIVE_MAXIMUM,
    P_SESSION_EXPIRY,
    PUBACK,
    SUBACK,
    ConnectionClosed,
    Packet,
    RawClient,
    encode_connect,
    encode_publish,
    encode_subscribe,
    utf8,
)
from test_e2e_badinput import assert_healthy

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
PACKET_READ_TIMEOUT_S = 1.5
MAX_PENDING = 20
CONNECT_TIMEOUT_S = 30  # long, so only the limits under test can close an idle socket


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """Default topic bounds (32 levels, 1024 bytes) and CONNECT bound (128 KiB); a short packet read
    timeout and a small cap on sockets without a completed CONNECT."""
    config = (
        f"[mqtt]\npacket_read_timeout_s = {PACKET_READ_TIMEOUT_S}\nconnect_timeout_s = {CONNECT_TIMEOUT_S}\n"
        f"[listeners]\nmax_pending_connections = {MAX_PENDING}\n"
    )
    with running_broker(tmp_path_factory.mktemp("limits"), config_text=config) as b:
        yield b


def connected(b: BrokerProc, version: int, cid: str, keepalive: int = 60) -> RawClient:
    c = RawClient(HOST, b.mqtt_port, version)
    assert c.connect(cid, keepalive=keepalive).reason == 0
    return c


def closed_within(c: RawClient, seconds: float) -> list[Packet]:
    """What the broker sent before closing; fails if it is still open after ``seconds``."""
    try:
        return c.wait_closed(seconds)
    except TimeoutError:
        pytest.fail(f"the broker kept the connection open for {seconds} s")


# --- item 6: topic filters and names are bounded ------------------------------------------------------


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_deep_and_long_filters_are_refused_per_filter_and_cost_no_memory(limited: BrokerProc, version: int) -> None:
    """A SUBSCRIBE of two 65,535-byte filters of 32,768 "+" levels each took ~300 MB of RSS (a trie
    node per level in each of 16 shards); 33 levels or 1,025 bytes are now refused for that filter
    alone (0x8F; 0x80 on 3.1.1, which has that failure code), before anything is split or stored."""
    c = connected(limited, version, f"deep-filter-{version}")
    deep = "/".join(["+"] * 32768)
    ok = f"deep/{version}/" + "/".join(["l"] * 30)  # 32 levels: allowed
    filters = [(ok, 1), ("/".join(["+"] * 33), 1), ("x" * 1025, 0), (deep, 1), (deep[:-2] + "/#", 0),
               (f"$share/g/{ok}", 1)]
    rss_before = limited.rss_bytes()
    c.send(encode_subscribe(7, filters, version))
    ack = c.expect(SUBACK, 30)
    refused = 0x8F if version == 5 else 0x80
    assert ack.reasons == [1, refused, refused, refused, refused, 1], ack
    growth = limited.rss_bytes() - rss_before
    assert growth < 32 << 20, f"RSS grew {growth >> 20} MiB for a refused SUBSCRIBE"
    assert c.publish_and_wait(ok, b"still-served", 1).reason == 0
    got = [c.next_message(10), c.next_message(10)]  # the plain and the shared subscription
    assert sorted(m.payload for m in got) == [b"still-served"] * 2
    c.disconnect()
    assert_healthy(limited, f"deep-filter-{version}")


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_publish_to_a_topic_beyond_the_bounds_is_refused(limited: BrokerProc, version: int) -> None:
    watcher = connected(limited, 5, f"bound-watch-{version}")
    assert watcher.subscribe([("#", 0)]).reasons == [0]
    for i, topic in enumerate(["/".join(["t"] * 33), "t/" + "x" * 1023]):
        c = connected(limited, version, f"bound-pub-{version}-{i}")
        c.send(encode_publish(topic, b"x", 1, pid=1, version=version))
        got = closed_within(c, 10)
        c.close()
        assert not [p for p in got if p.type == PUBACK], got
        if version == 5:
            assert [p.reason for p in got if p.type == DISCONNECT] == [0x90], got  # Topic Name invalid
        assert not [m for m in [watcher.recv_or_none(0.3)] if m is not None and m.topic == topic]
    at_bound = "/".join(["t"] * 31) + "/" + "x" * (1024 - 62)  # 32 levels, 1024 bytes: allowed
    assert len(at_bound) == 1024 and at_bound.count("/") == 31
    c = connected(limited, version, f"bound-pub-{version}-ok")
    assert c.publish_and_wait(at_bound, b"ok", 1).reason == 0
    c.disconnect()
    watcher.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_will_topic_beyond_the_bounds_is_refused_at_connect(limited: BrokerProc, version: int) -> None:
    c = RawClient(HOST, limited.mqtt_port, version)
    c.send(encode_connect(f"deep-will-{version}", version, will=("/".join(["w"] * 40), b"bye", 1, False)))
    got = closed_within(c, 10)
    c.close()
    # MQTT 5: CONNACK 0x90; 3.1.1 has no return code for it and closes without a CONNACK.
    assert [p.reason for p in got if p.type == CONNACK] == ([0x90] if version == 5 else []), got


# --- item 8: unauthenticated sockets are cheap ---------------------------------------------------------


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_oversized_connect_is_refused_from_its_header(limited: BrokerProc, version: int) -> None:
    """A CONNECT whose header announces 200 KiB (a 1 MiB max_packet_size allowed it, and the broker
    buffered it until connect_timeout_s) is refused at once; the body is never sent."""
    body = utf8(b"MQTT") + bytes([version, 0x02, 0, 60])
    header = bytes([0x10]) + bytes([0x80, 0x80, 0x0C])  # remaining length 196,608
    c = RawClient(HOST, limited.mqtt_port, version)
    c.send(header + body)
    got = closed_within(c, 5)
    c.close()
    assert [p.reason for p in got if p.type == CONNACK] == ([0x95] if version == 5 else []), got
    # A will payload of the protocol's maximum (65,535 bytes) still fits in the 128 KiB bound.
    big_will = RawClient(HOST, limited.mqtt_port, version)
    assert big_will.connect(f"big-will-{version}", will=("w/big", os.urandom(65535), 0, False)).reason == 0
    big_will.disconnect()
    assert_healthy(limited, f"big-connect-{version}")


def test_sockets_without_a_completed_connect_are_capped(limited: BrokerProc) -> None:
    """listeners.max_pending_connections: idle sockets beyond the cap are closed at once (they used to
    hold a slot until connect_timeout_s), clients that completed CONNECT do not count, and the slots
    come back when the idle sockets go."""
    established = [connected(limited, 5, f"established-{i}") for i in range(MAX_PENDING + 5)]  # not pending
    idle = [socket.create_connection((HOST, limited.mqtt_port), timeout=5) for _ in range(MAX_PENDING)]
    try:
        time.sleep(0.3)  # every idle socket accepted
        extra = socket.create_connection((HOST, limited.mqtt_port), timeout=5)
        try:
            assert extra.recv(1) == b"", "a socket beyond the pending cap was kept open"
        except ConnectionResetError:
            pass
        extra.close()
        for c in established:
            c.ping()  # unaffected
    finally:
        for s in idle:
            s.close()
    assert wait_until(lambda: _connects(limited), timeout=10), "slots did not come back after the idle sockets closed"
    for c in established:
        c.disconnect()
    assert_healthy(limited, "pending-cap")


def _connects(b: BrokerProc) -> bool:
    try:
        c = RawClient(HOST, b.mqtt_port, 5, timeout=2)
        ok = c.connect("pending-probe", timeout=2).reason == 0
        c.disconnect()
        return ok
    except (ConnectionClosed, OSError, TimeoutError):
        return False


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_partial_packet_with_keepalive_0_is_closed_after_the_read_timeout(limited: BrokerProc, version: int) -> None:
    """Keepalive 0 and one byte of a PUBLISH every 0.4 s: every byte used to count as life, so the
    connection and its partial packet lived for ever. mqtt.packet_read_timeout_s closes it."""
    c = connected(limited, version, f"slowloris-{version}", keepalive=0)
    data = encode_publish("slow/topic", b"x" * 100, 1, pid=1, version=version)
    started = time.monotonic()
    got: list[Packet] = []
    for i in range(len(data) - 1):  # never the last byte
        try:
            c.send(data[i:i + 1])
            pkt = c.recv_or_none(0.4)
        except (OSError, ConnectionClosed):
            break
        if pkt is not None:
            got.append(pkt)
        if time.monotonic() - started > 8:
            pytest.fail("a partial packet trickling in was kept for 8 s")
    else:
        pytest.fail("the whole packet but one byte went through")
    got += closed_within(c, 5)
    elapsed = time.monotonic() - started
    c.close()
    assert PACKET_READ_TIMEOUT_S <= elapsed < PACKET_READ_TIMEOUT_S + 4, elapsed
    assert not [p for p in got if p.type == PUBACK], got
    if version == 5:
        assert [p.reason for p in got if p.type == DISCONNECT] == [0x8D], got
    # An idle connection with keepalive 0 and nothing half-sent stays open.
    idle = connected(limited, version, f"idle-{version}", keepalive=0)
    time.sleep(PACKET_READ_TIMEOUT_S + 1.5)
    idle.ping()
    idle.disconnect()


def test_connection_rate_per_address_is_limited(broker_factory: BrokerFactory) -> None:
    """listeners.max_connection_rate_per_address with a burst: beyond it, new sockets from the same
    address are closed at once; tokens come back at the configured rate."""
    b = broker_factory(config_text="[listeners]\nmax_connection_rate_per_address = 4.0\n"
                                   "connection_burst_per_address = 10\nrate_limit_loopback = true\n")
    accepted = 0
    started = time.monotonic()
    for i in range(25):
        try:
            c = RawClient(HOST, b.mqtt_port, 5, timeout=5)
            ok = c.connect(f"rate-{i}", timeout=5).reason == 0
            c.disconnect()
        except (ConnectionClosed, OSError):
            ok = False
        accepted += ok
    refilled = int(4.0 * (time.monotonic() - started))
    assert 10 <= accepted <= 10 + refilled + 1, f"{accepted} of 25 back-to-back connections accepted (burst 10)"
    time.sleep(1.0)  # four tokens back
    assert _connects(b), "the rate limit did not refill"
    text = b.log_path.read_text(errors="replace")
    assert "max_connection_rate_per_address" in text  # said why, once (not once per refused socket)
    assert text.count("refusing connections") <= 2, text


def test_subscriber_that_stops_reading_is_cut_at_max_write_buffer_bytes(broker_factory: BrokerFactory) -> None:
    """Deliveries pause while a client's socket buffer is above mqtt.write_buffer_high_bytes, and a
    buffer past mqtt.max_write_buffer_bytes disconnects the client. With the cut below the pause (as
    here), a subscriber that stops reading while messages flow is disconnected once its buffer passes
    the cut; the node stays healthy and the session keeps what it is still owed."""
    b = broker_factory(config_text="[mqtt]\nmax_write_buffer_bytes = 262144\nwrite_buffer_high_bytes = 4194304\n")
    slow = RawClient(HOST, b.mqtt_port, 5)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # A Receive Maximum of 65535: the client's window never holds deliveries back, only the buffer does.
    props = [(P_SESSION_EXPIRY, 600), (P_RECEIVE_MAXIMUM, 65535)]
    assert slow.connect("slow-cut", keepalive=0, props=props).reason == 0
    assert slow.subscribe([("cut/#", 1)]).reasons == [1]
    # slow now stops reading
    pub = connected(b, 5, "cut-pub")
    payload = os.urandom(16 * 1024)
    n = 1000  # 16 MiB, published 50 at a time (one fsync per window, not per message)
    for start in range(0, n, 50):
        for i in range(start, start + 50):
            pub.publish(f"cut/{i % 4}", payload, 1)
        acks = [pub.expect(PUBACK, 30) for _ in range(50)]
        assert all(a.reason == 0 for a in acks), acks
        if start % 250 == 0:
            assert_healthy(b, f"cut-{start}")
    pub.disconnect()
    assert_healthy(b, "after-cut")
    # The broker resets the connection: what it had buffered is dropped, not held until the client
    # reads it. (Before, it closed "gracefully": the buffer and the session stayed until the client had
    # drained every byte, which through this 4 KiB window took two minutes, and a client that never
    # reads never.)
    slow.sock.settimeout(0.5)
    deadline = time.monotonic() + 10
    received = 0
    reset = False
    while time.monotonic() < deadline and not reset:
        try:
            chunk = slow.sock.recv(1 << 20)
        except TimeoutError:
            continue
        except ConnectionResetError:
            reset = True
            break
        if not chunk:
            break
        received += len(chunk)
    slow.close()
    assert reset, f"no reset within 10 s of the flood ({received} bytes read; still draining a buffer)"
    again = RawClient(HOST, b.mqtt_port, 5)  # unacknowledged and unsent messages are still owed
    assert again.connect("slow-cut", clean=False, props=[(P_SESSION_EXPIRY, 600), (P_RECEIVE_MAXIMUM, 4)]).session_present
    first = again.next_message(10)
    assert first.topic.startswith("cut/") and first.payload == payload and first.dup, first
    again.disconnect()
