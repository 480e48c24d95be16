"""The lean saturation load generator: pre-encoded MQTT packets on plain sockets, one process per pair.

Each process owns one publisher connection (QoS 1, at most ``window`` unacknowledged) and one subscriber
connection on the pair's own topic (QoS 1, Receive Maximum ``window`` on 5.0), and multiplexes both with
select(). Publishes are pre-encoded into a ring with fixed packet ids and written many per send(); the
subscriber answers a whole read's PUBLISHes with one send() of PUBACKs. The client side stays a few
microseconds per message, so the broker is what saturates.
"""

from __future__ import annotations

import select
import socket
import time
from multiprocessing.connection import Connection

from bench import wire

RING_SIZE = 4096  # > window: a packet id comes round again only long after its PUBACK
RECV_BYTES = 1 << 18


def _read_packet(sock: socket.socket, expected_type: int, timeout_s: float) -> None:
    sock.settimeout(timeout_s)
    buf = bytearray()
    while True:
        chunk = sock.recv(RECV_BYTES)
        if not chunk:
            raise ConnectionError("broker closed the connection during setup")
        buf += chunk
        packets, _ = wire.split_packets(buf)
        if packets:
            first, start, end = packets[0]
            if first >> 4 != expected_type:
                raise ConnectionError(f"expected packet type {expected_type}, got {first >> 4}")
            if expected_type == wire.CONNACK and buf[start + 1] != 0:
                raise ConnectionError(f"CONNACK refused with code {buf[start + 1]}")
            sock.settimeout(None)
            return


def _open(
    port: int, client_id: str, protocol: int, receive_maximum: int | None, timeout_s: float
) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(wire.connect_packet(client_id, protocol, receive_maximum=receive_maximum))
    _read_packet(sock, wire.CONNACK, timeout_s)
    return sock


def pair_main(
    conn: Connection,
    port: int,
    protocol: int,
    index: int,
    window: int,
    payload_size: int,
    warm_s: float,
    measure_s: float,
    timeout_s: float,
    sub_port: int | None = None,
    topic: str | None = None,
) -> None:
    """Run one publisher/subscriber pair; report deliveries and PUBACKs inside the measuring window.

    The publisher connects to ``port``, the subscriber to ``sub_port`` (default: ``port``; a cluster run puts them
    on different nodes), both on ``topic`` (default ``bench/sat/<index>``)."""
    topic = topic or f"bench/sat/{index}"
    tag = f"{index}-{time.monotonic_ns()}"
    sub = _open(sub_port or port, f"bench-sat-sub-{tag}", protocol, window, timeout_s)
    sub.sendall(wire.subscribe_packet(1, topic, 1, protocol))
    _read_packet(sub, wire.SUBACK, timeout_s)
    pub = _open(port, f"bench-sat-pub-{tag}", protocol, None, timeout_s)
    payload = bytes(payload_size)
    ring = [wire.publish_qos1_packet(topic, pid, payload, protocol) for pid in range(1, RING_SIZE + 1)]
    conn.send(("ready",))

    command, start_at = conn.recv()
    assert command == "go"
    measure_from = start_at + warm_s
    measure_to = measure_from + measure_s
    stop_at = min(measure_to + 0.2, start_at + timeout_s)
    while time.monotonic() < start_at:
        time.sleep(0.001)

    outstanding = 0
    next_slot = 0
    delivered_in_window = 0
    acked_in_window = 0
    delivered_total = 0
    pub_buf = bytearray()
    sub_buf = bytearray()
    now = time.monotonic()
    while now < stop_at:
        free = window - outstanding
        if free > 0:
            end = next_slot + free
            if end <= RING_SIZE:
                chunk = b"".join(ring[next_slot:end])
            else:
                chunk = b"".join(ring[next_slot:]) + b"".join(ring[: end - RING_SIZE])
            pub.sendall(chunk)
            next_slot = end % RING_SIZE
            outstanding = window
        readable, _, _ = select.select([pub, sub], [], [], 0.05)
        now = time.monotonic()
        in_window = measure_from <= now < measure_to
        for sock in readable:
            data = sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionError("broker closed a load-generator connection")
            if sock is pub:
                pub_buf += data
                packets, used = wire.split_packets(pub_buf)
                del pub_buf[:used]
                acks = sum(1 for first, _, _ in packets if first >> 4 == wire.PUBACK)
                outstanding -= acks
                if in_window:
                    acked_in_window += acks
            else:
                sub_buf += data
                packets, used = wire.split_packets(sub_buf)
                replies = [
                    wire.puback_packet(wire.publish_packet_id(sub_buf, start))
                    for first, start, _ in packets
                    if first >> 4 == wire.PUBLISH and first & 0x06
                ]
                del sub_buf[:used]
                if replies:
                    sub.sendall(b"".join(replies))
                n = sum(1 for first, _, _ in packets if first >> 4 == wire.PUBLISH)
                delivered_total += n
                if in_window:
                    delivered_in_window += n
    for sock in (pub, sub):
        try:
            sock.sendall(wire.disconnect_packet())
        except OSError:
            pass
        sock.close()
    conn.send(
        (
            "result",
            {
                "delivered_in_window": delivered_in_window,
                "acked_in_window": acked_in_window,
                "delivered_total": delivered_total,
            },
        )
    )
