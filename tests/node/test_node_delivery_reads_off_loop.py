"""Issue 29 item 7 (delivery): a message the recent cache no longer holds is read from the shard's
store off the event loop, so a slow disk never delays the loop (a heartbeat, a keep-alive) for the
read. Measured with a 5 ms ticker while a client takes 12 messages that only the disk holds, each
read made to take 50 ms: on 0cfae23 the pump pread them on the loop and the ticker fell ~600 ms
behind (one batch); here it stays within 150 ms (measured: a few ms)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from moorline.broker.messages import StoredMessage
from moorline.config import NodeConfig
from moorline.node.node import Node
from moorline.node.sessions.delivery import LiveSession, OutboundPublish

pytestmark = pytest.mark.timeout(60)
MESSAGES = 12
READ_S = 0.05  # one disk read of a record, slowed
LAG_BOUND_S = 0.15  # far below one batch of reads on the loop (12 x 50 ms), far above scheduling noise


def test_cache_misses_are_read_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        cfg = NodeConfig()
        cfg.data_dir = str(tmp_path / "data")
        cfg.shard.count = 2
        cfg.storage.store_cache_bytes = 0  # nothing kept decoded: every delivery reads the store
        node = Node(cfg)
        node.open()
        await node.start()
        live: LiveSession | None = None
        try:
            _present, epoch, inc = await node.open_session("reader", False, 600, None, "")
            got: list[OutboundPublish] = []
            live = LiveSession(node, "reader", epoch, inc, 100, got.extend, lambda pid: None)
            node.live["reader"] = live
            await node.subscribe(live, "q/t", 1, False, False, 0, None)
            live.writable = False  # the client reads nothing yet: its messages pile up owed
            live.start()
            for i in range(MESSAGES):
                await node.publish(StoredMessage("q/t", b"m%d" % i, 1, False, i.to_bytes(16, "big"), node.now_ms()))
            for host in node.hosts:
                host.store.flush()  # in the segment files, as after a while: only the disk has them
            await asyncio.sleep(0.05)
            assert not got

            real_pread = os.pread
            reads_on_loop = 0
            loop_thread = threading.get_ident()

            def slow_pread(fd: int, n: int, pos: int) -> bytes:
                nonlocal reads_on_loop
                if threading.get_ident() == loop_thread:
                    reads_on_loop += 1
                time.sleep(READ_S)
                return real_pread(fd, n, pos)

            monkeypatch.setattr(os, "pread", slow_pread)
            worst = 0.0
            stop = False

            async def ticker() -> None:
                nonlocal worst
                loop = asyncio.get_running_loop()
                while not stop:
                    t0 = loop.time()
                    await asyncio.sleep(0.005)
                    worst = max(worst, loop.time() - t0 - 0.005)

            tick = asyncio.get_running_loop().create_task(ticker())
            await asyncio.sleep(0.02)
            live.writable = True
            live.wake()
            for _ in range(400):
                if len(got) >= MESSAGES:
                    break
                await asyncio.sleep(0.01)
            stop = True
            await tick
            monkeypatch.setattr(os, "pread", real_pread)
            assert [p.msg.payload for p in got] == [b"m%d" % i for i in range(MESSAGES)]
            assert worst < LAG_BOUND_S, f"the event loop fell {worst * 1000:.0f} ms behind during delivery"
            assert reads_on_loop == 0, f"{reads_on_loop} store reads ran on the event loop"
        finally:
            if live is not None:
                await live.close()
            await node.stop()

    asyncio.run(body())
