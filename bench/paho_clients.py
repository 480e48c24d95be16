"""W1/W2 clients: one paho-mqtt publisher and one paho-mqtt subscriber, each in its own process (as in peers.md).

Both talk to the orchestrator over a multiprocessing Pipe with small tuples. Every payload starts with
(phase, sequence number, CLOCK_MONOTONIC ns at publish); CLOCK_MONOTONIC is one clock for every process of the
machine, so publish -> deliver latency can be taken across processes.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

HEADER = struct.Struct(">BIq")  # phase (0 = warm-up, 1 = measured), seq, publish time in monotonic ns
PHASE_WARMUP = 0
PHASE_MEASURED = 1


PERSISTENT_SESSION_EXPIRY_S = 3600


def _new_client(client_id: str, protocol: int, persistent: bool = False) -> Any:
    import paho.mqtt.client as mqtt

    if protocol == 5:
        return mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    return mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=not persistent
    )


def _connect(client: Any, port: int, protocol: int, receive_maximum: int | None, persistent: bool = False) -> None:
    """``persistent``: the session outlives the connection (3.1.1 clean session 0, 5.0 session expiry),
    so a broker must keep its delivery state durable; otherwise it ends with the connection. Over TLS when
    ``MOORLINE_BENCH_TLS_CA`` names the CA to trust (bench/tls_bench.py)."""
    ca = os.environ.get("MOORLINE_BENCH_TLS_CA")
    if ca:
        client.tls_set(ca_certs=ca)
    if protocol == 5:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        if receive_maximum is not None:
            props.ReceiveMaximum = receive_maximum
        if persistent:
            props.SessionExpiryInterval = PERSISTENT_SESSION_EXPIRY_S
        client.connect("127.0.0.1", port, keepalive=60, clean_start=True, properties=props)
    else:
        client.connect("127.0.0.1", port, keepalive=60)


def _percentile(sorted_values: list[int], fraction: float) -> int:
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def subscriber_main(
    conn: Connection,
    port: int,
    protocol: int,
    topic: str,
    warmup: int,
    count: int,
    window: int,
    timeout_s: float,
    persistent: bool = False,
) -> None:
    """Subscribe (QoS 1, ``window`` receive maximum), report warm-up done, then latencies of the measured pass."""
    client = _new_client(f"bench-sub-{time.monotonic_ns()}", protocol, persistent)
    warm_seen = bytearray(max(warmup, 1))
    seen = bytearray(count)
    latencies: list[int] = []
    counters = {"warm": 0, "measured": 0, "duplicates": 0, "last_ns": 0}
    done = threading.Event()

    def on_connect(client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        client.subscribe(topic, qos=1)

    def on_subscribe(client: Any, userdata: Any, mid: Any, reason_codes: Any, properties: Any) -> None:
        conn.send(("ready",))
        if warmup == 0:
            conn.send(("warm_done",))

    def on_message(client: Any, userdata: Any, message: Any) -> None:
        now = time.monotonic_ns()
        phase, seq, sent_ns = HEADER.unpack_from(message.payload)
        if phase == PHASE_WARMUP:
            if not warm_seen[seq]:
                warm_seen[seq] = 1
                counters["warm"] += 1
                if counters["warm"] == warmup:
                    conn.send(("warm_done",))
            return
        if seen[seq]:
            counters["duplicates"] += 1  # QoS 1 may redeliver; counted, not timed twice
            return
        seen[seq] = 1
        latencies.append(now - sent_ns)
        counters["measured"] += 1
        counters["last_ns"] = now
        if counters["measured"] == count:
            done.set()

    def on_disconnect(client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if not done.is_set():  # paho would reconnect with a clean session: that run is void, say why
            conn.send(("error", f"subscriber disconnected by the broker: {reason_code}"))
            client.disconnect()

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    client.on_disconnect = on_disconnect
    _connect(client, port, protocol, receive_maximum=window, persistent=persistent)
    client.loop_start()
    finished = done.wait(timeout_s)
    done.set()
    client.disconnect()
    client.loop_stop()
    latencies.sort()
    conn.send(
        (
            "result",
            {
                "complete": finished,
                "received": counters["measured"],
                "duplicates": counters["duplicates"],
                "last_receive_ns": counters["last_ns"],
                "latency_p50_ns": _percentile(latencies, 0.50),
                "latency_p99_ns": _percentile(latencies, 0.99),
                "latency_max_ns": latencies[-1] if latencies else 0,
            },
        )
    )


def publisher_main(
    conn: Connection,
    port: int,
    protocol: int,
    topic: str,
    warmup: int,
    count: int,
    size: int,
    window: int,
    timeout_s: float,
) -> None:
    """Publish QoS 1 with at most ``window`` unacknowledged: warm-up on "warmup", the measured pass on "go"."""
    client = _new_client(f"bench-pub-{time.monotonic_ns()}", protocol)
    client.max_inflight_messages_set(window)
    credit = threading.Semaphore(window)
    connected = threading.Event()
    padding = b"\x00" * max(0, size - HEADER.size)

    def on_connect(client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        connected.set()

    def on_publish(client: Any, userdata: Any, mid: Any, reason_code: Any, properties: Any) -> None:
        credit.release()

    finished = threading.Event()

    def on_disconnect(client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if not finished.is_set():
            conn.send(("error", f"publisher disconnected by the broker: {reason_code}"))
            client.disconnect()

    client.on_connect = on_connect
    client.on_publish = on_publish
    client.on_disconnect = on_disconnect
    _connect(client, port, protocol, receive_maximum=None)
    client.loop_start()
    if not connected.wait(timeout_s):
        conn.send(("error", "publisher could not connect"))
        return
    conn.send(("ready",))

    def publish_all(phase: int, n: int) -> bool:
        deadline = time.monotonic() + timeout_s
        for seq in range(n):
            if not credit.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            client.publish(topic, HEADER.pack(phase, seq, time.monotonic_ns()) + padding, qos=1)
        for _ in range(window):  # every publish acknowledged = all the credit back
            if not credit.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
        for _ in range(window):
            credit.release()
        return True

    assert conn.recv() == "warmup"
    ok = publish_all(PHASE_WARMUP, warmup)
    conn.send(("warm_acked", ok))
    assert conn.recv() == "go"
    first_ns = time.monotonic_ns()
    ok = publish_all(PHASE_MEASURED, count)
    finished.set()
    conn.send(("done", {"complete": ok, "first_publish_ns": first_ns, "last_ack_ns": time.monotonic_ns()}))
    client.disconnect()
    client.loop_stop()
