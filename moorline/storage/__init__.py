"""Durable storage: the node-wide WAL, per-shard message stores and snapshot files.

The bottom layer: files only, no asyncio, no knowledge of MQTT or the broker.
"""

from moorline.storage.identity import StorageIdError, load_or_create_storage_id
from moorline.storage.ledger import SyncLedger, read_ledger
from moorline.storage.msgstore import MessageStore, StoreCorruption
from moorline.storage.snapshots import SnapshotCorruption, SnapshotStore
from moorline.storage.wal import (
    CorruptionReport,
    GroupRecovery,
    WalBackpressure,
    WalCorruption,
    WalRecovery,
    WriteAheadLog,
)

__all__ = [
    "CorruptionReport",
    "GroupRecovery",
    "MessageStore",
    "SnapshotCorruption",
    "SnapshotStore",
    "StorageIdError",
    "StoreCorruption",
    "SyncLedger",
    "WalBackpressure",
    "WalCorruption",
    "WalRecovery",
    "WriteAheadLog",
    "load_or_create_storage_id",
    "read_ledger",
]
