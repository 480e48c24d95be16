"""A leader and the entries other members forward to it (issue 32, item 3): it restamps them in
their head, never re-encoding them; it decodes each once, so that one no replica could decode
never enters the log (the peer's frame is refused), and its own apply takes those commands
instead of decoding the entry a second time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from tests.node.test_node_leader_stamps import LEADER_NOW, SKEW_MS, leader_host, synced


def forwarded(seq: int) -> bytes:
    msg = StoredMessage("t/a", b"x", 1, False, seq.to_bytes(16, "big"), LEADER_NOW + SKEW_MS)
    return c.encode_entry([c.Publish(msg)], origin=2, boot=1, seq=seq)


def test_an_undecodable_forwarded_entry_never_enters_the_log(tmp_path: Path) -> None:
    async def body() -> None:
        host = leader_host(tmp_path)
        last = host.raft_log.last_index()
        # Its proposal id reads well (as the cluster link checks it), its commands do not: a command
        # no replica knows (a flipped bit in a tag, a newer node's command).
        poisoned = forwarded(1)[:c.ENTRY_HEAD_BYTES] + msgspec.msgpack.encode([c.ENTRY_VERSION, [["pub?", 1]], 2, 1, 1])
        assert c.decode_head(poisoned).origin == 2
        with pytest.raises(ValueError):
            host.propose_forwarded([poisoned])
        assert host.take_ready() is None and host.raft_log.last_index() == last
        assert host.propose_forwarded([forwarded(1)]) == 1  # the shard goes on
        host.take_ready()
        synced(host)
        assert host.failed is None
        stored = host.message(0)
        assert stored is not None and stored.ts_ms == LEADER_NOW

    asyncio.run(body())


def test_the_leader_applies_a_forwarded_entry_without_decoding_it_again(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        host = leader_host(tmp_path)
        assert host.propose_forwarded([forwarded(1), forwarded(2)]) == 2
        decoded: list[bytes] = []
        real = c.decode_entry
        monkeypatch.setattr(c, "decode_entry", lambda data: decoded.append(data) or real(data))
        host.take_ready()
        synced(host)
        assert decoded == []  # applied from the leader's one decode
        assert host.proposer._forwarded == {}  # nothing kept once applied
        stored = [host.message(i) for i in (0, 1)]
        assert [m.ts_ms for m in stored if m is not None] == [LEADER_NOW, LEADER_NOW]

    asyncio.run(body())


def test_a_replica_that_stops_leading_keeps_none_of_its_decodes(tmp_path: Path) -> None:
    """What it logged as leader and has not applied may never commit (a new leader truncates it):
    nothing of it is kept past the leadership (if it commits, its apply decodes it)."""
    async def body() -> None:
        host = leader_host(tmp_path)
        assert host.propose_forwarded([forwarded(1)]) == 1
        assert len(host.proposer._forwarded) == 1
        host.raft._become_follower(host.raft.term + 1, None)
        host.check_leader()
        assert host.proposer._forwarded == {}

    asyncio.run(body())


def test_a_node_at_entry_format_1_proposes_what_nodes_before_format_2_read(tmp_path: Path) -> None:
    """cluster.entry_format = 1 (a rolling upgrade's first round): this node's own proposals are
    plain version-1 batches, with no head, and apply with their own times."""
    async def body() -> None:
        host = leader_host(tmp_path)
        host.proposer.entry_format = c.LEGACY_ENTRY_VERSION
        msg = StoredMessage("t/a", b"x", 1, False, bytes(16), LEADER_NOW)
        host.propose(c.Publish(msg), want_result=False)
        rd = host.seal()
        assert rd is not None
        data = [e.data for e in rd.entries if e.data][-1]
        assert data[0] != c.ENTRY_VERSION and msgspec.msgpack.decode(data)[0] == c.LEGACY_ENTRY_VERSION
        synced(host)
        stored = host.message(0)
        assert stored is not None and stored.ts_ms == LEADER_NOW

    asyncio.run(body())
