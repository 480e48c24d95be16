"""Sans-IO Raft core (etcd-raft shaped): ``RaftNode`` plus its public types.

Import the public API from here: ``from moorline.raft import RaftNode, Config, Message, ...``.
"""

from moorline.raft.storage import MemoryStorage, Storage, limit_size
from moorline.raft.types import (
    CAMPAIGN_TRANSFER,
    ENTRY_OVERHEAD_BYTES,
    NO_MEMBER,
    RAFT_BUG_NAMES,
    CompactedError,
    ConfChange,
    ConfChangeType,
    Config,
    ConfState,
    Entry,
    EntryType,
    HardState,
    HardStateCorrupt,
    MemberId,
    Message,
    MessageType,
    ProposalDropped,
    RaftBugs,
    RaftError,
    ReadState,
    Ready,
    Snapshot,
    SnapshotMeta,
    SnapshotTemporarilyUnavailable,
    StateRole,
    Stream,
    UnavailableError,
)

__all__ = [
    "CAMPAIGN_TRANSFER",
    "ENTRY_OVERHEAD_BYTES",
    "NO_MEMBER",
    "RAFT_BUG_NAMES",
    "CompactedError",
    "Config",
    "ConfChange",
    "ConfChangeType",
    "ConfState",
    "Entry",
    "EntryType",
    "HardState",
    "HardStateCorrupt",
    "MemberId",
    "MemoryStorage",
    "Message",
    "MessageType",
    "ProposalDropped",
    "RaftBugs",
    "RaftError",
    "Ready",
    "ReadState",
    "Snapshot",
    "SnapshotMeta",
    "SnapshotTemporarilyUnavailable",
    "StateRole",
    "Storage",
    "Stream",
    "UnavailableError",
    "limit_size",
]

from moorline.raft.coalesce import HeartbeatBatch, HeartbeatItem, coalesce, expand  # noqa: E402
from moorline.raft.raft import RaftNode, Status  # noqa: E402

__all__ += ["HeartbeatBatch", "HeartbeatItem", "RaftNode", "Status", "coalesce", "expand"]
