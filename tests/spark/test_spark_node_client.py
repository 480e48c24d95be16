"""The node client rides out a server that is down for a while, names every server when it gives up,
and says so when ``servers`` points at something that does not speak HTTP (no Spark needed)."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from fake_broker import FakeBroker

from moorline.spark.node_client import MoorlineUnavailable, NodeClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ClosingServer:
    """Accepts connections, reads what the client sends, and closes (as an MQTT listener does with
    an HTTP request) or answers with ``reply`` bytes first."""

    def __init__(self, reply: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(4096)
                    if self.reply:
                        conn.sendall(self.reply)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture()
def late_broker() -> Iterator[tuple[str, threading.Thread, list[FakeBroker]]]:
    """An address whose server comes up 3 s from now."""
    port = free_port()
    started: list[FakeBroker] = []

    def come_up() -> None:
        time.sleep(3.0)
        started.append(FakeBroker(shard_count=4, port=port).start())

    t = threading.Thread(target=come_up, daemon=True)
    t.start()
    yield f"127.0.0.1:{port}", t, started
    t.join(10)
    for fb in started:
        fb.stop()


def test_a_server_down_for_3_s_costs_a_call_nothing(late_broker: tuple[str, threading.Thread, list[FakeBroker]]) -> None:
    address, _, started = late_broker
    dead = f"127.0.0.1:{free_port()}"  # never comes up: the client goes round both servers
    t0 = time.monotonic()
    with NodeClient((dead, address), timeout_s=20.0) as client:
        shards = client.shards()
    elapsed = time.monotonic() - t0
    assert started, "the call returned before the server was up"
    assert len(shards) == 4
    assert 2.5 <= elapsed < 15, elapsed


def test_a_server_that_never_comes_up_fails_naming_every_server_and_its_error() -> None:
    refused = f"127.0.0.1:{free_port()}"
    closing = ClosingServer()
    try:
        t0 = time.monotonic()
        with pytest.raises(MoorlineUnavailable) as err, NodeClient((refused, closing.address), timeout_s=2.0) as client:
            client.shards()
        elapsed = time.monotonic() - t0
    finally:
        closing.stop()
    text = str(err.value)
    assert "requestTimeoutMs=2000" in text
    assert f"{refused}: ConnectionRefusedError" in text
    assert f"{closing.address}: servers={closing.address} does not speak HTTP" in text
    assert 1.5 <= elapsed < 5, elapsed  # retried until the deadline, not past it


@pytest.mark.parametrize("reply", [b"", b"\x20\x03\x00\x00\x00"], ids=["closes", "answers-mqtt-bytes"])
def test_servers_pointing_at_an_mqtt_port_says_so_at_once(reply: bytes) -> None:
    mqtt_like = ClosingServer(reply)
    try:
        t0 = time.monotonic()
        with pytest.raises(MoorlineUnavailable) as err, NodeClient((mqtt_like.address,), timeout_s=30.0) as client:
            client.shards()
        elapsed = time.monotonic() - t0
    finally:
        mqtt_like.stop()
    assert f"servers={mqtt_like.address} does not speak HTTP" in str(err.value)
    assert "is that the MQTT port? the HTTP API listens on --http" in str(err.value)
    assert elapsed < 5, f"waited {elapsed:.1f}s of the 30 s deadline for a port that will never answer HTTP"


def test_backoff_doubles_with_jitter_and_stops_at_the_deadline() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    client = NodeClient(
        (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"),
        timeout_s=10.0,
        backoff_s=0.1,
        backoff_max_s=1.0,
        rng=random.Random(1),
        clock=lambda: now[0],
        sleep=sleep,
    )
    with pytest.raises(MoorlineUnavailable):
        client.shards()
    steps = [min(1.0, 0.1 * 2**i) for i in range(len(sleeps))]
    *backoffs, last = sleeps  # the last pause is cut to end at the deadline
    assert all(step / 2 <= s <= step for s, step in zip(backoffs, steps, strict=False)), sleeps
    assert 0 <= last <= steps[-1]
    assert len(set(backoffs)) == len(backoffs)  # jittered
    assert sum(sleeps) == pytest.approx(10.0)  # used the whole deadline, never past it
