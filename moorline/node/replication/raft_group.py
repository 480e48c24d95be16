"""Building a shard's Raft replica from what the node's disk holds, and the WAL form of its vote.

A single node runs every shard as a group of one voter, the node itself, through the same core
(moorline/raft) a cluster uses: there is no second path to keep correct. At startup the core is
rebuilt from the latest snapshot (index, term) and the WAL's entries and hard state for the group;
it then re-delivers, as committed entries, exactly what its persisted commit index and a fresh
leadership term allow, and the host applies them (never "every entry in the WAL").
"""

from __future__ import annotations

import random
import struct

from moorline.raft import Config, ConfState, Entry, EntryType, HardState, MemberId, MemoryStorage, RaftNode
from moorline.raft.types import Snapshot, SnapshotMeta

_VOTE = struct.Struct(">q")


def encode_vote(vote: MemberId | None) -> bytes:
    """The WAL's hard-state vote field: node id (8 bytes) and storage id; empty for none."""
    if vote is None:
        return b""
    return _VOTE.pack(vote[0]) + vote[1].encode("utf-8")


def decode_vote(raw: bytes) -> MemberId | None:
    if not raw:
        return None
    (node,) = _VOTE.unpack_from(raw, 0)
    return node, raw[_VOTE.size:].decode("utf-8")


def build_replica(
    member: MemberId,
    voters: list[MemberId],
    learners: list[MemberId],
    snapshot_index: int,
    snapshot_term: int,
    entries: list[tuple[int, int, int, bytes]],
    hard_state: tuple[int, bytes, int] | None,
    applied: int,
    rng: random.Random,
    election_tick: int = 10,
    heartbeat_tick: int = 1,
    max_entry_bytes: int = 1 << 20,
) -> tuple[RaftNode, MemoryStorage]:
    """The core and its storage view for one group of ``voters`` and ``learners`` (this node is
    one of them), from the snapshot's (index, term), the WAL's entries after it and its hard state
    (term, vote, commit); ``applied`` is how far the state machine restored from the snapshot is."""
    conf = ConfState.of(voters, learners)
    log = MemoryStorage(conf)
    if snapshot_index > 0:
        log.apply_snapshot(Snapshot(meta=SnapshotMeta(index=snapshot_index, term=snapshot_term, conf_state=conf)))
    later = [Entry(term=t, index=i, type=EntryType(ty), data=d) for t, i, ty, d in entries if i > snapshot_index]
    if later:
        log.append(later)
    if hard_state is not None:
        term, vote, commit = hard_state
        # The commit index was written unsynced (it rides on later syncs): never past the log.
        log.set_hard_state(HardState(term=term, vote=decode_vote(vote), commit=min(commit, log.last_index())))
    cfg = Config(id=member, applied=max(applied, snapshot_index), election_tick=election_tick,
                 heartbeat_tick=heartbeat_tick, max_bytes_per_append=max_entry_bytes, rng=rng)
    return RaftNode(cfg, log), log
