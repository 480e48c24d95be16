"""Proposals carry (node, boot, seq): one that reaches the log twice (resent to a new leader) is
applied once, by every replica alike; a dead boot's leftovers are skipped; the id survives
snapshots. These are what let a node resend what it proposed until it sees it applied."""

from __future__ import annotations

import asyncio
from pathlib import Path

from moorline.broker import commands as c
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.storage.identity import next_boot_number
from tests.node.test_node_command_groups import Recorder, commit_all, make_host, publish


def test_admit_once_per_origin_boot_seq_and_only_in_order() -> None:
    s = ShardState(0, "inc", TopicLimits(), 3600)
    assert not s.admit(2, 1, 2)  # a boot's first applied proposal is its first
    assert s.admit(2, 1, 1) and s.admit(2, 1, 2)
    assert not s.admit(2, 1, 2) and not s.admit(2, 1, 1)  # resent copies
    assert not s.admit(2, 1, 4)  # 3 is missing (lost with a leader): 4 waits for the resend of both
    assert s.admit(2, 1, 3) and s.admit(2, 1, 4)
    assert s.admit(3, 1, 1)  # another node's own sequence
    assert s.admit(2, 2, 1)  # a new boot of node 2 starts again at 1
    assert not s.admit(2, 1, 5)  # a dead boot's leftover
    assert s.admit(0, 0, 0) and s.admit(0, 0, 0)  # entries from before proposal ids: unchecked
    restored = ShardState.restore(s.snapshot(), TopicLimits(), 3600)
    assert restored.proposals == s.proposals and not restored.admit(2, 2, 1)


def test_a_proposal_in_the_log_twice_is_applied_once(tmp_path: Path) -> None:
    async def body() -> None:
        host = make_host(tmp_path)
        rec = Recorder()
        host.propose_cb(publish(1), rec)
        rd = host.seal()
        assert rd is not None
        data = rd.entries[-1].data
        host.propose_forwarded([data])  # the same proposal again, as a resend to a new leader would
        commit_all(host)
        assert len(rec.calls) == 1 and rec.calls[0][0].offset == 0
        assert host.state.topics.next_offset == 1, "the resent copy was applied a second time"
        decoded = c.decode_batch(data)
        assert (decoded.origin, decoded.boot) == (host.node_id, host.boot) and decoded.seq >= 1

    asyncio.run(body())


def test_entries_from_before_proposal_ids_apply(tmp_path: Path) -> None:
    async def body() -> None:
        host = make_host(tmp_path)
        legacy = c.encode_entry([publish(7)])  # no origin: written by an older version
        assert c.decode_batch(legacy).origin == 0
        host.propose_forwarded([legacy, legacy])
        commit_all(host)
        assert host.state.topics.next_offset == 1  # its GUID de-duplicates the second, as before

    asyncio.run(body())


def test_boot_numbers_rise_and_never_repeat(tmp_path: Path) -> None:
    assert [next_boot_number(tmp_path) for _ in range(3)] == [1, 2, 3]
    (tmp_path / "boot").write_text("garbage\n")
    try:
        next_boot_number(tmp_path)
    except Exception as exc:  # noqa: BLE001 - the identity error type
        assert "refusing to reuse boot numbers" in str(exc)
    else:
        raise AssertionError("a damaged boot file was taken for a fresh start")
