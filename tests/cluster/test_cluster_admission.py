"""A node's admission state in a shard (ShardState.proposals, (node, boot, seq)) cannot be moved to a
value that locks the node out (issue 30.5): a too-large boot jump is refused, and a node whose
admission is past its boot anyway proposes under the boot after it."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from moorline.broker import commands as c
from moorline.broker import shard as shard_module
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost
from moorline.raft.types import Entry
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore


def test_one_forged_entry_with_a_huge_boot_cannot_lock_a_node_out_of_a_shard() -> None:
    """Attack: one entry (origin n3, boot 2**62, seq 1) reaches the log: n3's real boot is then
    below the admitted one, and every later proposal of n3 would be skipped forever."""
    st = ShardState(0, "inc", TopicLimits(), 3600)
    assert st.admit(3, 1, 1)
    assert not st.admit(3, 2**62, 1)  # refused: further ahead than MAX_BOOT_JUMP
    assert st.admit(3, 1, 2)  # n3's own proposals still apply
    assert st.admit(3, 2, 1)  # and its next boot
    max_jump = shard_module.MAX_BOOT_JUMP
    assert not st.admit(4, max_jump + 1, 1)  # an origin not seen yet: measured from 0
    assert st.admit(4, max_jump, 1)


def _host(tmp_path: Path, boot: int) -> ShardHost:
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    me, peer = (1, "a"), (2, "b")
    raft, raft_log = build_replica(me, [me, peer], [], 0, 0, [], None, 0, random.Random(0))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), ApplyHooks(on_effects=lambda h, fx: None),
                     snapshot_every_entries=1_000_000, max_entry_bytes=1 << 20)
    host.node_id, host.boot = 1, boot
    return host


def _publish(i: int) -> c.Command:
    return c.Publish(StoredMessage("t", b"x", 1, False, i.to_bytes(16, "big"), 1))


def test_a_node_whose_admission_was_pushed_past_its_boot_proposes_under_the_next_boot(tmp_path: Path) -> None:
    """Attack: an entry naming this node with a boot above its real one (within the bound) is
    applied; the node's waiting and later proposals must still apply, not be skipped for good."""
    async def body() -> None:
        host = _host(tmp_path, boot=5)
        host.propose(_publish(1), want_result=False)
        host.seal()
        forged = c.encode_entry([], origin=1, boot=1000, seq=1)
        host._apply_entry(Entry(1, 1, data=forged))
        assert host.boot == 1001
        waiting = list(host.proposer._own.values())
        assert [o.seq for o in waiting] == [1]
        # what waits, and what comes next, is admitted
        assert host.state.admit(1, host.boot, 1)
        host.propose(_publish(2), want_result=False)
        host.seal()
        assert host.state.admit(1, host.boot, 2)

    asyncio.run(body())


def test_a_snapshot_admitting_a_later_boot_moves_the_nodes_boot_at_start(tmp_path: Path) -> None:
    host = _host(tmp_path, boot=5)
    host.state.proposals[1] = (77, 3)
    host.check_admission()
    assert host.boot == 78
    host.state.proposals[1] = (78, 1)
    host.check_admission()  # its own boot admitted: nothing to do
    assert host.boot == 78
