"""W1/W2 clients for RabbitMQ (AMQP 0-9-1 through pika): a publisher with confirms and a consumer with manual acks.

They speak the same Pipe protocol as bench/paho_clients.py and put the same header in every payload, so the
orchestrator measures them alike. At-least-once both ways, ``window`` unconfirmed publishes at most and
``window`` prefetch at the consumer, as for every other peer. pika is not a project dependency: it is
installed into the bench's cache dir and put on ``sys.path`` here, in the client processes only.
"""

from __future__ import annotations

import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from bench.paho_clients import HEADER, PHASE_MEASURED, PHASE_WARMUP, _percentile


def _pika(pika_path: str) -> Any:
    if pika_path not in sys.path:
        sys.path.insert(0, pika_path)
    import pika  # type: ignore[import-not-found,unused-ignore]

    return pika


def declare_quorum_queue(port: int, queue: str, pika_path: str) -> None:
    """A durable quorum queue declared through the node on ``port``: with the client-local leader locator its
    leader is that node (the bench declares through node 3, as moorline's topic is one node 3 leads)."""
    pika = _pika(pika_path)
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        connection.channel().queue_declare(
            queue,
            durable=True,
            arguments={"x-queue-type": "quorum", "x-queue-leader-locator": "client-local"},
        )
    finally:
        connection.close()


def subscriber_main(
    conn: Connection,
    port: int,
    queue: str,
    warmup: int,
    count: int,
    window: int,
    timeout_s: float,
    pika_path: str,
) -> None:
    """Consume with ``window`` prefetch and an ack per message; report warm-up done, then the latencies."""
    pika = _pika(pika_path)
    warm_seen = bytearray(max(warmup, 1))
    seen = bytearray(count)
    latencies: list[int] = []
    counters = {"warm": 0, "measured": 0, "duplicates": 0, "last_ns": 0}

    def on_message(channel: Any, method: Any, properties: Any, body: bytes) -> None:
        now = time.monotonic_ns()
        phase, seq, sent_ns = HEADER.unpack_from(body)
        channel.basic_ack(method.delivery_tag)
        if phase == PHASE_WARMUP:
            if not warm_seen[seq]:
                warm_seen[seq] = 1
                counters["warm"] += 1
                if counters["warm"] == warmup:
                    conn.send(("warm_done",))
            return
        if seen[seq]:
            counters["duplicates"] += 1
            return
        seen[seq] = 1
        latencies.append(now - sent_ns)
        counters["measured"] += 1
        counters["last_ns"] = now

    try:
        connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=60))
        channel = connection.channel()
        channel.basic_qos(prefetch_count=window)
        channel.basic_consume(queue, on_message, auto_ack=False)
    except Exception as exc:  # reported to the orchestrator instead of a silent exit
        conn.send(("error", f"consumer could not start: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    if warmup == 0:
        conn.send(("warm_done",))
    deadline = time.monotonic() + timeout_s
    try:
        while counters["measured"] < count and time.monotonic() < deadline:
            connection.process_data_events(time_limit=0.1)
    except Exception as exc:
        conn.send(("error", f"consumer failed: {type(exc).__name__}: {exc}"))
        return
    finished = counters["measured"] == count
    try:
        connection.close()
    except Exception:  # the figures are taken; a failing close changes none of them
        pass
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


class _ConfirmingPublisher:
    """Publishes on pika's SelectConnection (its I/O loop in a thread of its own) with at most ``window``
    unconfirmed messages; the main thread starts a phase and waits for all of it to be confirmed."""

    def __init__(self, pika: Any, port: int, queue: str, size: int, window: int) -> None:
        self.pika = pika
        self.queue = queue
        self.window = window
        self.padding = b"\x00" * max(0, size - HEADER.size)
        self.properties = pika.BasicProperties(delivery_mode=2)  # persistent, as a quorum queue stores it
        self.ready = threading.Event()
        self.phase_done = threading.Event()
        self.failure: str | None = None
        self.channel: Any = None
        self.pending: set[int] = set()
        self.next_tag = 0
        self.closing = False
        self.phase = PHASE_WARMUP
        self.to_send = 0
        self.sent = 0
        self.connection = pika.SelectConnection(
            pika.ConnectionParameters("127.0.0.1", port, heartbeat=60),
            on_open_callback=self._on_open,
            on_open_error_callback=lambda _c, err: self._fail(f"could not connect: {err}"),
            on_close_callback=self._on_close,
        )
        self.thread = threading.Thread(target=self.connection.ioloop.start, daemon=True)
        self.thread.start()

    def _fail(self, why: str) -> None:
        if self.failure is None and not (self.phase == PHASE_MEASURED and self.phase_done.is_set()):
            self.failure = why
        self.ready.set()
        self.phase_done.set()

    def _on_close(self, connection: Any, reason: Any) -> None:
        if self.closing:
            connection.ioloop.stop()  # our own close() completed its handshake
        else:
            self._fail(f"connection closed: {reason}")

    def _on_open(self, connection: Any) -> None:
        connection.channel(on_open_callback=self._on_channel)

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_delivery(self._on_confirm, callback=lambda _frame: self.ready.set())

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if isinstance(method, self.pika.spec.Basic.Nack):
            self._fail(f"broker nacked delivery tag {method.delivery_tag}")
            return
        if method.multiple:
            self.pending = {tag for tag in self.pending if tag > method.delivery_tag}
        else:
            self.pending.discard(method.delivery_tag)
        self._publish_more()

    def _publish_more(self) -> None:
        while len(self.pending) < self.window and self.sent < self.to_send:
            body = HEADER.pack(self.phase, self.sent, time.monotonic_ns()) + self.padding
            self.channel.basic_publish("", self.queue, body, self.properties)
            self.next_tag += 1
            self.pending.add(self.next_tag)
            self.sent += 1
        if self.sent == self.to_send and not self.pending:
            self.phase_done.set()

    def run_phase(self, phase: int, count: int, timeout_s: float) -> bool:
        """Publish ``count`` messages of ``phase``; True once every one is confirmed within ``timeout_s``."""

        def start() -> None:
            self.phase, self.to_send, self.sent = phase, count, 0
            self._publish_more()

        self.phase_done.clear()
        self.connection.ioloop.add_callback_threadsafe(start)
        return self.phase_done.wait(timeout_s) and self.failure is None

    def close(self) -> None:
        def stop() -> None:
            self.closing = True
            if self.connection.is_open:
                self.connection.close()  # _on_close stops the loop once the broker answered
            else:
                self.connection.ioloop.stop()

        try:
            self.connection.ioloop.add_callback_threadsafe(stop)
        except Exception:  # the loop is already gone
            return
        self.thread.join(5)


def publisher_main(
    conn: Connection,
    port: int,
    queue: str,
    warmup: int,
    count: int,
    size: int,
    window: int,
    timeout_s: float,
    pika_path: str,
) -> None:
    """Publish persistent messages with publisher confirms: warm-up on "warmup", the measured pass on "go"."""
    pika = _pika(pika_path)
    publisher = _ConfirmingPublisher(pika, port, queue, size, window)
    if not publisher.ready.wait(timeout_s) or publisher.failure is not None:
        conn.send(("error", f"publisher could not start: {publisher.failure or 'timeout'}"))
        publisher.close()
        return
    conn.send(("ready",))
    assert conn.recv() == "warmup"
    conn.send(("warm_acked", publisher.run_phase(PHASE_WARMUP, warmup, timeout_s)))
    assert conn.recv() == "go"
    first_ns = time.monotonic_ns()
    ok = publisher.run_phase(PHASE_MEASURED, count, timeout_s)
    if publisher.failure is not None:
        conn.send(("error", f"publisher: {publisher.failure}"))
    conn.send(("done", {"complete": ok, "first_publish_ns": first_ns, "last_ack_ns": time.monotonic_ns()}))
    publisher.close()
