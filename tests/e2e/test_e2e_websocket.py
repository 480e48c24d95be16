"""MQTT over WebSocket (listeners.ws / listeners.wss, path /mqtt, subprotocol mqtt): paho's WebSocket
transport with 3.1.1 and 5.0, and a raw client whose binary frames split packets anywhere or join
several in one; the same ACLs; what is not MQTT over WebSocket is refused without an error logged."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from e2e_broker import BrokerFactory
from listener_support import (
    WsSocket,
    broker_errors,
    client_tls_context,
    dev_certs,
    listener_ports,
    paho_client,
    split_every,
    tls_config,
    ws_raw_client,
)
from rawclient import CONNACK, PUBACK, PUBLISH, SUBACK, encode_connect, encode_publish, encode_subscribe

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]


@pytest.fixture
def ws_broker(broker_factory: BrokerFactory, tmp_path: Path) -> tuple[object, dict[str, int], Path]:
    certs = dev_certs(tmp_path)
    broker = broker_factory(config_text=tls_config(certs, listeners=("ws", "wss")))
    return broker, listener_ports(broker), certs.ca_cert


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("secure", [False, True])
def test_paho_over_websocket(ws_broker: tuple[object, dict[str, int], Path], uniq: str, version: int,
                             secure: bool) -> None:
    broker, ports, ca = ws_broker
    tls = client_tls_context(ca) if secure else None
    port = ports["wss" if secure else "ws"]
    sub = paho_client(port, version, transport="websockets", tls=tls)
    sub.connect()
    sub.subscribe(f"{uniq}/#", qos=1)
    pub = paho_client(port, version, transport="websockets", tls=tls)
    pub.connect()
    for i in range(20):
        pub.publish(f"{uniq}/t", f"m{i}".encode() * 50, qos=1)
    got = [m.payload for m in sub.collect(20)]
    assert got == [f"m{i}".encode() * 50 for i in range(20)]
    # ... and to a plain TCP client: one broker, whatever the transport
    tcp = paho_client(broker.mqtt_port, version)  # type: ignore[attr-defined]
    tcp.connect()
    tcp.publish(f"{uniq}/tcp", b"from tcp", qos=1)
    assert sub.get().payload == b"from tcp"
    for c in (sub, pub, tcp):
        c.disconnect()
    assert broker_errors(broker) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [4, 5])
def test_frames_split_and_join_packets_anywhere(ws_broker: tuple[object, dict[str, int], Path], uniq: str,
                                                version: int) -> None:
    broker, ports, _ = ws_broker
    sub, sub_ws = ws_raw_client(ports["ws"], version)
    # CONNECT and SUBSCRIBE joined in one frame
    sub_ws.send_frame(encode_connect(f"{uniq}-s", version) + encode_subscribe(1, [(f"{uniq}/#", 1)], version))
    assert sub.expect(CONNACK).reason == 0
    assert sub.expect(SUBACK).pid == 1
    pub, pub_ws = ws_raw_client(ports["ws"], version)
    pub_ws.framer = split_every(1)  # every byte a frame of its own: packets split everywhere
    assert pub.connect(f"{uniq}-p").reason == 0
    pub_ws.framer = split_every(7)
    assert pub.publish_and_wait(f"{uniq}/a", b"split in sevens").type == PUBACK
    # three PUBLISHes in one frame, then one PUBLISH across two frames cut in its topic
    joined = b"".join(encode_publish(f"{uniq}/j", f"j{i}".encode(), 1, False, 10 + i, False, version)
                      for i in range(3))
    pub_ws.send_frame(joined)
    acks = sorted(pub.expect(PUBACK).pid for _ in range(3))  # type: ignore[type-var]
    assert acks == [10, 11, 12]
    last = encode_publish(f"{uniq}/cut", b"x" * 3000, 1, False, 20, False, version)
    pub_ws.send_frame(last[:5])
    pub_ws.send_frame(last[5:])
    assert pub.expect(PUBACK).pid == 20
    got = []
    for _ in range(5):
        msg = sub.next_message()
        assert msg.type == PUBLISH
        got.append((msg.topic, msg.payload))
        sub.ack(msg)
    assert got == [(f"{uniq}/a", b"split in sevens"), (f"{uniq}/j", b"j0"), (f"{uniq}/j", b"j1"),
                   (f"{uniq}/j", b"j2"), (f"{uniq}/cut", b"x" * 3000)]
    sub.disconnect()
    pub.disconnect()
    assert broker_errors(broker) == []  # type: ignore[arg-type]


def test_what_is_not_mqtt_over_websocket_is_refused(ws_broker: tuple[object, dict[str, int], Path],
                                                    uniq: str) -> None:
    broker, ports, _ = ws_broker
    no_protocol = WsSocket("127.0.0.1", ports["ws"], protocol=None)
    assert no_protocol.status == 400, no_protocol.response
    no_protocol.close()
    wrong_path = WsSocket("127.0.0.1", ports["ws"], path="/other")
    assert wrong_path.status == 404
    wrong_path.close()
    # a text frame closes the connection (MQTT-6.0.0-1)
    client, ws = ws_raw_client(ports["ws"], 4)
    assert client.connect(f"{uniq}-t").reason == 0
    ws.send_frame(b"hello", opcode=0x1)
    ws.settimeout(10)
    assert client.wait_closed(10) == []
    # a socket that never upgrades is closed after mqtt.connect_timeout_s (10 s here): not waited for;
    # one that sends garbage instead of HTTP is closed at once
    with socket.create_connection(("127.0.0.1", ports["ws"]), timeout=10) as raw:
        raw.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")
        deadline = time.monotonic() + 10
        data = b""
        try:
            while chunk := raw.recv(4096):
                data += chunk
                assert time.monotonic() < deadline
        except ConnectionResetError:
            pass
        assert b"400" in data or data == b""
    assert broker_errors(broker) == []  # type: ignore[arg-type]


def test_a_websocket_that_never_upgrades_is_closed_and_counts_as_pending(broker_factory: BrokerFactory,
                                                                         tmp_path: Path) -> None:
    extra = "max_pending_connections = 2\n[mqtt]\nconnect_timeout_s = 1.5\n"
    broker = broker_factory(config_text=f'[listeners]\nws = "127.0.0.1:0"\n{extra}')
    port = listener_ports(broker)["ws"]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    time.sleep(0.3)
    third = socket.create_connection(("127.0.0.1", port), timeout=10)
    third.settimeout(1.0)
    try:
        assert third.recv(10) == b""  # refused at once: the two idle sockets hold the pending slots
    except ConnectionResetError:
        pass
    t0 = time.monotonic()
    for s in idle:
        s.settimeout(10)
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass
    assert time.monotonic() - t0 < 5.0
    for s in (*idle, third):
        s.close()
    client, _ = ws_raw_client(port, 5)
    assert client.connect("after-idle").reason == 0
    client.disconnect()
    assert broker_errors(broker) == []


def test_a_websocket_subscriber_that_stops_reading_is_cut_at_max_write_buffer_bytes(
        broker_factory: BrokerFactory) -> None:
    """The same bound as on TCP: what the WebSocket queues plus the socket's own buffer counts, and
    past mqtt.max_write_buffer_bytes the connection is reset (its session keeps what it is owed)."""
    import os

    from rawclient import P_RECEIVE_MAXIMUM, P_SESSION_EXPIRY

    broker = broker_factory(config_text='[listeners]\nws = "127.0.0.1:0"\n'
                                        "[mqtt]\nmax_write_buffer_bytes = 262144\nwrite_buffer_high_bytes = 4194304\n")
    port = listener_ports(broker)["ws"]
    slow, slow_ws = ws_raw_client(port, 5)
    slow_ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    props = [(P_SESSION_EXPIRY, 600), (P_RECEIVE_MAXIMUM, 65535)]
    assert slow.connect("ws-slow-cut", keepalive=0, props=props).reason == 0
    assert slow.subscribe([("wscut/#", 1)]).reasons == [1]
    # slow stops reading now
    pub, _ = ws_raw_client(port, 5)
    assert pub.connect("ws-cut-pub").reason == 0
    payload = os.urandom(16 * 1024)
    for start in range(0, 400, 50):
        for i in range(start, start + 50):
            pub.publish(f"wscut/{i % 4}", payload, 1)
        assert all(pub.expect(PUBACK, 30).reason == 0 for _ in range(50))
    pub.disconnect()
    slow_ws.sock.settimeout(0.5)
    deadline = time.monotonic() + 15
    reset = False
    while time.monotonic() < deadline and not reset:
        try:
            if not slow_ws.sock.recv(1 << 20):
                break
        except TimeoutError:
            continue
        except ConnectionResetError:
            reset = True
    slow_ws.close()
    assert reset, "the WebSocket of a client that stopped reading was not reset"
    assert "not reading" in broker.log_path.read_text(errors="replace")
    again, _ = ws_raw_client(port, 5)
    assert again.connect("ws-slow-cut", clean=False, props=[(P_SESSION_EXPIRY, 600), (P_RECEIVE_MAXIMUM, 4)]
                         ).session_present
    first = again.next_message(10)
    assert first.topic.startswith("wscut/") and first.payload == payload
    again.disconnect()
    assert broker_errors(broker) == []
