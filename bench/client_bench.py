"""The publisher's own CPU per message: moorline.client next to paho-mqtt.

Run: ``python -m bench.client_bench`` (from the repository root; ``--help`` for options). Each
publisher runs in its own process and publishes ``--count`` QoS 1 messages of 100 B (after a
``--warmup``) with at most 256 unacknowledged, to a broker started fresh for the run (Mosquitto if
installed, else moorline; ``--broker``). The figure is the publisher process's user+sys CPU
(``time.process_time``: every thread, paho's network thread included) over the measured messages,
in µs per message: the client's own cost, not the broker's. Median of ``--reps``, publishers
interleaved rep by rep so outside load hits each alike.

Variants: ``paho`` (paho-mqtt 2, MQTT 5, loop thread, ``publish`` + ``on_publish``), ``client``
(moorline.client, producer id and sequence on every message, ``enqueue`` with a window of futures),
``client+spool`` (the same with the fsynced spool file), ``client await`` (one ``await publish`` at
a time: latency-bound, shown for what a naive loop costs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WINDOW = 256
PAYLOAD = b"x" * 100
TOPIC = "bench/client"
VARIANTS = ("paho", "client", "client+spool", "client await")


# ------------------------------------------------------------------------------------------ workers
def _worker_paho(port: int, count: int, warmup: int) -> tuple[float, float]:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(WINDOW)
    room = threading.Semaphore(WINDOW)
    done = threading.Event()
    acked = [0]
    total = warmup + count

    def on_publish(*_: object) -> None:
        acked[0] += 1
        room.release()
        if acked[0] == total:
            done.set()

    connected = threading.Event()
    c.on_connect = lambda *a: connected.set()
    c.on_publish = on_publish
    c.connect("127.0.0.1", port)
    c.loop_start()
    connected.wait(10)
    t0 = w0 = 0.0
    for i in range(total):
        if i == warmup:
            while acked[0] < warmup:
                time.sleep(0.001)
            t0, w0 = time.process_time(), time.monotonic()
        room.acquire()
        c.publish(TOPIC, PAYLOAD, qos=1)
    done.wait(120)
    cpu, wall = time.process_time() - t0, time.monotonic() - w0
    c.disconnect()
    c.loop_stop()
    return cpu, wall


async def _worker_client(port: int, count: int, warmup: int, spool: str | None, one_at_a_time: bool) -> tuple[float, float]:
    from moorline.client import Client

    async with Client([f"127.0.0.1:{port}"], spool=spool) as c:
        await c.connected.wait()
        pending: deque[asyncio.Future[None]] = deque()
        t0 = w0 = 0.0
        for i in range(warmup + count):
            if i == warmup:
                if pending:
                    await asyncio.wait(pending)
                    pending.clear()
                t0, w0 = time.process_time(), time.monotonic()
            if one_at_a_time:
                await c.publish(TOPIC, PAYLOAD)
                continue
            pending.append(await c.enqueue(TOPIC, PAYLOAD))
            if len(pending) >= WINDOW:
                await pending.popleft()
        if pending:
            await asyncio.wait(pending)
        return time.process_time() - t0, time.monotonic() - w0


def worker(kind: str, port: int, count: int, warmup: int) -> None:
    if kind == "paho":
        cpu, wall = _worker_paho(port, count, warmup)
    else:
        with tempfile.TemporaryDirectory() as d:
            spool = os.path.join(d, "bench.spool") if kind == "client+spool" else None
            cpu, wall = asyncio.run(_worker_client(port, count, warmup, spool, kind == "client await"))
    print(json.dumps({"cpu_s": cpu, "wall_s": wall}))


# ------------------------------------------------------------------------------------------ brokers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_broker(kind: str, tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    if kind == "mosquitto":
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_inflight_messages {WINDOW}\n")
        proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        log = open(Path(tmp) / "moorline.log", "wb")  # noqa: SIM115 - kept open for the broker's life
        proc = subprocess.Popen([sys.executable, "-m", "moorline.cli", "run", "--data-dir", str(Path(tmp) / "data"),
                                 "--mqtt", f"127.0.0.1:{port}", "--http", "127.0.0.1:0"], stdout=log,
                                stderr=subprocess.STDOUT, cwd=str(REPO))
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"client_bench: {kind} did not start") from None
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=20_000)
    p.add_argument("--warmup", type=int, default=2_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--broker", choices=("mosquitto", "moorline"), default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.port, a.count, a.warmup)
        return
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"client_bench: unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}")
    broker = a.broker or ("mosquitto" if shutil.which("mosquitto") or os.path.exists("/usr/sbin/mosquitto") else "moorline")
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_broker(broker, tmp)
        try:
            for rep in range(a.reps):
                for v in variants:
                    count = a.count if v != "client await" else max(1, a.count // 10)
                    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", v, "--port", str(port),
                                        "--count", str(count), "--warmup", str(min(a.warmup, count))],
                                       capture_output=True, text=True, timeout=600, cwd=str(REPO))
                    if r.returncode != 0:
                        raise SystemExit(f"client_bench: the {v} publisher failed:\n{r.stderr[-2000:]}")
                    fig = json.loads(r.stdout.strip().splitlines()[-1])
                    results[v].append((fig["cpu_s"] / count * 1e6, count / fig["wall_s"]))
                print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"publisher CPU per QoS 1 message (100 B, {WINDOW} in flight, broker {broker}, "
          f"{a.count} messages, median of {a.reps}; 'client await': {max(1, a.count // 10)} messages)")
    print(f"{'publisher':<16}{'µs CPU/msg':>12}{'msgs/s':>10}")
    med = {v: (statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs)) for v, rs in results.items()}
    for v, (us, rate) in med.items():
        print(f"{v:<16}{us:>12.1f}{rate:>10.0f}")
    if "paho" in med:
        for v in variants:
            if v != "paho":
                print(f"{v} / paho CPU per message: {med[v][0] / med['paho'][0]:.2f}")


if __name__ == "__main__":
    main()
