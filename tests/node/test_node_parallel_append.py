"""The leader replicates while it syncs (issue 32, item 3): the appends of a Ready leave when the
group commit takes it for the WAL, before its fsync, so a follower writes the entries while the
leader does; votes and append acknowledgements still wait for the sync (they promise durability).
"""

from __future__ import annotations

import random
from pathlib import Path

from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost
from moorline.raft import Entry, Message, MessageType
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from tests.node.test_node_command_groups import publish

ME, PEER2, PEER3 = (1, "s1"), (2, "s2"), (3, "s3")


def _synced(host: ShardHost) -> None:
    while host.after_sync(lambda shard, hs: None):
        host.take_ready()


def _leader_of_three(tmp_path: Path, sent: list[Message]) -> ShardHost:
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    raft, raft_log = build_replica(ME, [ME, PEER2, PEER3], [], 0, 0, [], None, 0, random.Random(0))
    hooks = ApplyHooks(on_effects=lambda h, fx: None, send=lambda h, msgs: sent.extend(msgs))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), hooks, snapshot_every_entries=1_000_000)
    raft.campaign()
    for _ in range(2):  # a pre-vote round (if configured), then the vote: PEER2 grants both
        host.take_ready()
        _synced(host)
        asks = [m for m in sent if m.type in (MessageType.PRE_VOTE, MessageType.VOTE) and m.to == PEER2]
        sent.clear()
        for m in asks:
            kind = MessageType.PRE_VOTE_RESP if m.type == MessageType.PRE_VOTE else MessageType.VOTE_RESP
            raft.step(Message(type=kind, from_=PEER2, to=ME, term=m.term))
    host.take_ready()
    _synced(host)
    assert raft.lead == ME
    for m in [m for m in sent if m.type == MessageType.APP]:  # both followers take the leader's no-op
        last = m.entries[-1].index if m.entries else m.index
        raft.step(Message(type=MessageType.APP_RESP, from_=m.to, to=ME, term=raft.term, index=last))
    host.take_ready()
    _synced(host)
    return host


def test_a_leaders_appends_leave_before_its_own_sync(tmp_path: Path) -> None:
    sent: list[Message] = []
    host = _leader_of_three(tmp_path, sent)
    sent.clear()
    host.propose_cb(publish(1), lambda result, exc: None)
    host.seal()
    rd = host.take_ready()  # the group commit writes this Ready now and syncs it
    assert rd is not None and rd.entries and rd.must_sync
    appends = [m for m in sent if m.type == MessageType.APP and m.entries]
    assert {m.to for m in appends} == {PEER2, PEER3}, "the appends waited for the leader's fsync"
    last = rd.entries[-1].index
    assert all(m.entries[-1].index == last for m in appends)
    assert host.raft.log.committed < last  # nothing commits before a quorum has it durably
    n = len(sent)
    _synced(host)
    assert not [m for m in sent[n:] if m.type == MessageType.APP and m.entries and m.entries[-1].index == last], \
        "the appends went out twice"


def test_a_followers_acknowledgement_waits_for_its_sync(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    sent: list[Message] = []
    raft, raft_log = build_replica(ME, [ME, PEER2, PEER3], [], 0, 0, [], None, 0, random.Random(0))
    hooks = ApplyHooks(on_effects=lambda h, fx: None, send=lambda h, msgs: sent.extend(msgs))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), hooks, snapshot_every_entries=1_000_000)
    raft.step(Message(type=MessageType.APP, from_=PEER2, to=ME, term=1, log_term=0, index=0,
                      entries=[Entry(term=1, index=1, data=b"")], commit=0))
    rd = host.take_ready()
    assert rd is not None and rd.entries
    assert not [m for m in sent if m.type == MessageType.APP_RESP], "an append acknowledged before its sync"
    _synced(host)
    assert [m for m in sent if m.type == MessageType.APP_RESP and not m.reject]
