"""A producer process for the client tests: publishes payloads "0", "1", ... (QoS 1) to one topic and
writes one line per event to stdout (flushed):

    handed I        the client accepted message I (moorline.client: into its buffer and spool;
                    paho: publish() returned)
    ok I / err I E  the publish of I was acknowledged / raised E (moorline.client only)
    done            every message was answered

``--kind client`` uses moorline.client (``--spool`` to make it durable, ``--no-extras`` for a broker
without producer/seq); ``--kind paho`` uses paho-mqtt 2 the usual way (loop thread, QoS 1,
``max_inflight`` messages in flight). ``--window`` messages are outstanding at once. A restarted
producer continues after the highest index it handed before, or that its spool gave back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time
from collections import deque


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run_client(a: argparse.Namespace) -> None:
    from moorline.client import BufferLimits, Client

    c = Client(a.servers.split(","), client_id=a.client_id, spool=a.spool, extras=not a.no_extras,
               publish_timeout=a.publish_timeout, buffer=BufferLimits(max_age_s=a.max_age), keepalive=5)
    await c.start()
    start = a.start
    for _topic, payload in c.recovered():
        start = max(start, int(payload) + 1)
    out(f"start {start} recovered {len(c.recovered())}")
    pending: deque[tuple[int, asyncio.Future[None]]] = deque()

    def settle(i: int, f: asyncio.Future[None]) -> None:
        exc = f.exception()
        out(f"ok {i}" if exc is None else f"err {i} {type(exc).__name__}")

    for i in range(start, a.count):
        f = await c.enqueue(a.topic, str(i).encode())
        out(f"handed {i}")
        f.add_done_callback(lambda f, i=i: settle(i, f))  # type: ignore[misc]
        pending.append((i, f))
        while len(pending) >= a.window:
            _, f0 = pending.popleft()
            await asyncio.wait([f0])
        if a.rate:
            await asyncio.sleep(1 / a.rate)
    if pending:
        await asyncio.wait([f for _, f in pending])
    out("done")
    await c.close()


def run_paho(a: argparse.Namespace) -> None:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    host, port = a.servers.split(",")[0].rsplit(":", 1)
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=a.client_id, protocol=mqtt.MQTTv311, clean_session=True)
    c.max_inflight_messages_set(a.window)
    connected = threading.Event()
    c.on_connect = lambda *args: connected.set()
    c.connect(host, int(port), keepalive=5)
    c.loop_start()
    connected.wait(10)
    out(f"start {a.start} recovered 0")
    infos: deque[object] = deque()
    for i in range(a.start, a.count):
        infos.append(c.publish(a.topic, str(i).encode(), qos=1))
        out(f"handed {i}")
        while len(infos) >= a.window:
            infos.popleft().wait_for_publish(30)  # type: ignore[attr-defined]
        if a.rate:
            time.sleep(1 / a.rate)
    while infos:
        infos.popleft().wait_for_publish(30)  # type: ignore[attr-defined]
    out("done")
    c.disconnect()
    c.loop_stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=("client", "paho"), default="client")
    p.add_argument("--servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--client-id", default="")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--rate", type=float, default=0.0, help="messages per second at most (0: as fast as it goes)")
    p.add_argument("--spool")
    p.add_argument("--no-extras", action="store_true")
    p.add_argument("--publish-timeout", type=float, default=30.0)
    p.add_argument("--max-age", type=float, default=300.0)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.kind == "paho":
        run_paho(a)
    else:
        asyncio.run(run_client(a))


if __name__ == "__main__":
    main()
