"""Snapshot transfers between real nodes in one process (snapshot_transfer.py): a follower whose
leaders compacted their logs past it is sent each shard's snapshot and message store, installs
them, and ends with the same state and store as its peers; across a restart too. Transfers that
go wrong (a damaged chunk, a lost chunk, acknowledgements that stop coming) are abandoned on both
sides, reported to the leader's core, and the next offer succeeds; nothing half-received is
installed and no staging directory is left behind."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from moorline.config import NodeConfig
from moorline.node.replication import snapshot_transfer as st
from tests.node.inproc_cluster import InProcCluster

pytestmark = pytest.mark.timeout(120)


def small_logs(cfg: NodeConfig) -> None:
    cfg.shard.snapshot_every_entries = 10
    cfg.raft.follower_log_margin_entries = 5
    cfg.storage.snapshot_inline_max_bytes = 0  # every snapshot after a shard's first is encoded by a forked child
    cfg.cluster.snapshot_chunk_bytes = 4096  # many chunks per transfer
    cfg.cluster.snapshot_stall_timeout_s = 1.0


async def fall_behind(c: InProcCluster, publishes: int = 120) -> None:
    """n3 stops; the others take ``publishes`` single-entry publishes, so their logs compact past it."""
    await c.start()
    await c.wait_leaders()
    await c.publish("n1", 30, one_by_one=False)
    await c.wait("applied equally", c.applied_equal)
    had = [h.state.applied_index for h in c.nodes["n3"].hosts]
    await c.stop("n3")
    await c.wait_leaders()
    await c.publish("n1", publishes)
    for shard in range(c.shards):
        leader = next(nd for nd in c.nodes.values() if nd.hosts[shard].raft.is_leader)
        first = leader.hosts[shard].raft_log.first_index()
        assert first > had[shard] + 1, f"shard {shard}: the leader's log starts at {first}, n3 has {had[shard]}"


def assert_same_stores(c: InProcCluster) -> None:
    for shard in range(c.shards):
        views = {name: c.stored(name, shard) for name in c.nodes}
        assert views["n3"] == views["n1"] == views["n2"], f"shard {shard}: stores differ"


def install_dirs(c: InProcCluster, name: str) -> list[Path]:
    return sorted((c.base / f"{name}-data" / "install").glob("*"))


def test_follower_catches_up_by_snapshot_and_restarts_from_it(tmp_path: Path) -> None:
    async def body() -> None:
        c = InProcCluster(tmp_path, tune=small_logs)
        try:
            await fall_behind(c)
            await c.start("n3")
            await c.wait("n3 caught up", c.applied_equal)
            n3 = c.nodes["n3"]
            assert all(h.failed is None for h in n3.hosts), [h.failed for h in n3.hosts]
            assert sum(h.installs for h in n3.hosts) == c.shards, [h.installs for h in n3.hosts]
            assert_same_stores(c)
            assert sum(len(c.stored("n3", s)) for s in range(c.shards)) == 150
            # The leaders encoded their (fresh) snapshots for the transfers in forked children.
            assert sum(nd.snapshot_settings.forked for nd in c.nodes.values() if nd is not n3) > 0
            # A cluster node never fdatasyncs on its event loop.
            assert all(nd.commit.timer.inline == 0 for nd in c.nodes.values())
            stats = n3.link.stats()["snapshot_transfers"] if n3.link else {}
            assert stats["received"] == c.shards and not stats["receiving"], stats
            await c.wait("staging directories removed", lambda: not install_dirs(c, "n3"))
            # n3 takes part again: a publish through it, then a restart from its installed snapshots.
            await c.publish("n3", 10)
            await c.wait("applied equally", c.applied_equal)
            await c.stop("n3")
            await c.start("n3")
            await c.wait("n3 caught up after its restart", c.applied_equal)
            assert all(h.failed is None for h in c.nodes["n3"].hosts)
            assert_same_stores(c)
            assert sum(len(c.stored("n3", s)) for s in range(c.shards)) == 160
        finally:
            await c.close()

    asyncio.run(body())


class Tamper:
    """Patches every node's transfers: damages or drops one chosen chunk a leader sends, or
    withholds the follower's acknowledgements for a while."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
        self.mode: str | None = mode
        self.count = 0
        send, reply = st.SnapshotTransfers._send, st.SnapshotTransfers._reply
        tamper = self

        def _send(transfers: st.SnapshotTransfers, peer: str, msg: Any) -> None:
            if tamper.mode == "corrupt" and type(msg) is st.Chunk and msg.seq == 1:
                tamper.mode, tamper.count = None, tamper.count + 1
                msg = st.Chunk(msg.transfer, msg.seq, msg.part, msg.data[:-1] + b"\x00", msg.crc)
            elif tamper.mode == "lose" and type(msg) is st.Chunk and msg.seq == 1:
                tamper.mode, tamper.count = None, tamper.count + 1
                return  # as if the connection took it and then broke
            send(transfers, peer, msg)

        def _reply(transfers: st.SnapshotTransfers, peer: str, ack: st.Ack) -> None:
            if tamper.mode == "mute":
                tamper.count += 1
                return
            reply(transfers, peer, ack)

        monkeypatch.setattr(st.SnapshotTransfers, "_send", _send)
        monkeypatch.setattr(st.SnapshotTransfers, "_reply", _reply)


@pytest.mark.parametrize("fault", ["corrupt", "lose", "mute"])
def test_a_transfer_that_goes_wrong_is_abandoned_and_offered_again(tmp_path: Path, fault: str,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="moorline.snapshot")

    async def body() -> None:
        c = InProcCluster(tmp_path, tune=small_logs)
        try:
            await fall_behind(c, publishes=60)
            tamper = Tamper(monkeypatch, fault)
            if fault == "mute":  # n3's acknowledgements stop for a while: the leaders stall, then give up
                asyncio.get_running_loop().call_later(2.5, setattr, tamper, "mode", None)
            await c.start("n3")
            await c.wait("n3 caught up", c.applied_equal, timeout=60)
            n3 = c.nodes["n3"]
            assert tamper.count >= 1
            assert all(h.failed is None for h in n3.hosts), [h.failed for h in n3.hosts]
            assert_same_stores(c)
            failed_out = sum(nd.link.snapshots.stats.send_failed for nd in c.nodes.values() if nd.link is not None)
            assert failed_out >= 1, "the leader's side never gave up on the bad transfer"
            assert n3.link is not None and n3.link.snapshots.stats.receive_failed >= 1
            await c.wait("staging directories removed", lambda: not install_dirs(c, "n3"))
        finally:
            await c.close()

    asyncio.run(body())
    expected = {"corrupt": "fails its checksum", "lose": "a frame was lost", "mute": "no progress from n3"}[fault]
    assert expected in caplog.text, caplog.text[-3000:]
