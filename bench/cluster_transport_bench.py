"""Micro-benchmark of the inter-node transport: two ClusterTransports in one process on loopback.

Run: ``python -m bench.cluster_transport_bench [--messages N] [--loop uvloop|asyncio]``.

Node n1 sends N Raft messages to n2 (appends with one 100-byte entry, as a leader replicating small
publishes does), in four shapes: one message per frame and 64 per frame on the append stream,
append responses (tiny) one per frame, and coalesced heartbeats of 64 groups per frame on the
control stream. Printed per shape: frames/s and messages/s from the first send to the last
delivery, and CPU seconds per 10k messages — both transports are in this process, so that is
sender plus receiver, handshake excluded. The queues are sized so nothing is dropped (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moorline.cluster import ClusterTransport, DataFrame, TransportLimits  # noqa: E402
from moorline.cluster.wire import Heartbeats, RaftMessages  # noqa: E402
from moorline.raft.coalesce import GroupId, HeartbeatBatch, HeartbeatItem  # noqa: E402
from moorline.raft.types import Entry, Message, MessageType, Stream  # noqa: E402

SECRET = b"benchmark secret, not for production"
BURST_FRAMES = 256  # frames queued before the sender yields to the event loop


def hosts() -> tuple[str, str]:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.11", 0))
        return "127.0.0.11", "127.0.0.12"
    except OSError:
        return "127.0.0.1", "127.0.0.1"


@dataclass
class Result:
    shape: str
    messages: int
    frames: int
    wall_s: float
    cpu_s: float
    bytes_sent: int

    def line(self) -> str:
        return (f"{self.shape:<34} {self.frames / self.wall_s:>12,.0f} {self.messages / self.wall_s:>12,.0f} "
                f"{self.cpu_s / self.messages * 10_000:>10.3f} {self.bytes_sent / self.wall_s / 1e6:>9.1f}")


class Counter:
    def __init__(self) -> None:
        self.messages = 0
        self.done = asyncio.Event()
        self.target = 0

    def __call__(self, peer: str, frame: DataFrame) -> None:
        if isinstance(frame, RaftMessages):
            self.messages += len(frame.messages)
        elif isinstance(frame, Heartbeats):
            self.messages += len(frame.batch.items)
        if self.messages >= self.target:
            self.done.set()


def append(i: int) -> Message:
    return Message(type=MessageType.APP, from_=(1, "s1"), to=(2, "s2"), term=5, log_term=5, index=i,
                   entries=[Entry(5, i + 1, data=b"p" * 100)], commit=i)


def append_resp(i: int) -> Message:
    return Message(type=MessageType.APP_RESP, from_=(1, "s1"), to=(2, "s2"), term=5, index=i)


async def run_shape(a: ClusterTransport, counter: Counter, shape: str, n: int, per_frame: int) -> Result:
    counter.messages = 0
    counter.target = n
    counter.done.clear()
    before = a.stats().peers["n2"]
    frames = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    sent = 0
    while sent < n:
        for _ in range(BURST_FRAMES):
            if sent >= n:
                break
            k = min(per_frame, n - sent)
            if shape.startswith("heartbeats"):
                batch = HeartbeatBatch(1, 2, [HeartbeatItem(g, False, (1, "s1"), (2, "s2"), 5, sent)
                                              for g in range(k)])
                ok = a.send("n2", Stream.CONTROL, Heartbeats(batch))
            else:
                make = append_resp if "responses" in shape else append
                items: list[tuple[GroupId, Message]] = [(g % 16, make(sent + g)) for g in range(k)]
                ok = a.send("n2", Stream.APPEND, RaftMessages(items))
            if not ok:
                raise SystemExit("a frame was dropped: raise the bench's queue limits")
            sent += k
            frames += 1
        await asyncio.sleep(0)
    await asyncio.wait_for(counter.done.wait(), 120)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = a.stats().peers["n2"]
    if after.dropped != before.dropped:
        raise SystemExit("frames were dropped")
    return Result(shape, n, frames, wall, cpu, after.bytes_sent - before.bytes_sent)


async def main(n: int) -> None:
    host_a, host_b = hosts()
    limits = TransportLimits(max_queue_frames=1 << 20, max_queue_bytes=1 << 30)
    counter = Counter()
    a = ClusterTransport("n1", (host_a, 0), {}, SECRET, lambda p, f: None, random.Random(1), limits=limits)
    b = ClusterTransport("n2", (host_b, 0), {}, SECRET, counter, random.Random(2), limits=limits)
    await a.start()
    await b.start()
    a.add_peer("n2", b.listen_address)
    b.add_peer("n1", a.listen_address)
    try:
        while len(a.stats().peers["n2"].connected_streams) < 3:
            await asyncio.sleep(0.01)
        await run_shape(a, counter, "appends, 1 per frame", min(n, 2000), 1)  # warm-up
        results = [
            await run_shape(a, counter, "appends, 1 per frame", n, 1),
            await run_shape(a, counter, "appends, 64 per frame", n, 64),
            await run_shape(a, counter, "append responses, 1 per frame", n, 1),
            await run_shape(a, counter, "heartbeats, 64 groups per frame", n, 64),
        ]
    finally:
        await a.close()
        await b.close()
    print(f"{n:,} raft messages n1 -> n2 over {host_a} -> {host_b}, {asyncio.get_event_loop_policy().__class__.__module__}")
    print(f"{'shape':<34} {'frames/s':>12} {'messages/s':>12} {'CPU-s/10k':>10} {'MB/s':>9}")
    for r in results:
        print(r.line())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = ap.parse_args()
    if args.loop == "uvloop":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            print("uvloop not installed; using asyncio", file=sys.stderr)
    asyncio.run(main(args.messages))
