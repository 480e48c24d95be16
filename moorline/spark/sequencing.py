"""Pure part of the sink: turning a task's rows into publish requests with stable identities.

Idempotency scheme (see docs/spark.md):

* producer id = ``producer_id64(query_id, partition_id, shard)`` (8 bytes): one sequenced producer
  per (streaming query, output partition, target shard). ``query_id`` is the query's persistent id
  (it survives restarts from the checkpoint), never the run id. The shard is part of the producer
  so that GUIDs (producer ‖ seq) are unique across shards, while each shard still sees one
  producer whose sequences it can check.
* sequence = ``batch_id << 32 | n`` where ``n`` numbers the task's rows *per shard*, from 0,
  in canonical order: the rows sorted by their encoded bytes. A retried task, or the same batch
  re-run after a restart, sees the same multiset of rows (after a shuffle their order may differ;
  the sort removes that) and so sends the same (producer, seq) for the same row.
* per shard, a producer's sequences only grow: within a batch by 1, and the first row of a later
  batch (``n = 0``) is above every sequence of an earlier batch. The shard accepts the next
  sequence or the first of a later batch and reports anything at or below its highest applied
  sequence as a duplicate.

With a key column, the row's GUID is ``guid128("moorline.spark.key", key)`` instead, and no sort
is needed: de-duplication then rests on the shard's GUID history.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moorline.hashing import guid128, producer_id64, shard_of
from moorline.invariant import invariant

ROW_BITS = 32
MAX_ROWS_PER_SHARD = 1 << ROW_BITS


class MoorlineRowError(ValueError):
    """A row cannot be published (no topic, a wildcard in its topic, a bad qos...)."""


@dataclass(frozen=True)
class OutRow:
    """One row to publish, in plain values."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    props: tuple[tuple[str, str], ...]
    key: str | None

    def canonical(self) -> bytes:
        parts = [self.topic.encode("utf-8"), self.payload, bytes([self.qos, int(self.retain)])]
        for k, v in self.props:
            parts.append(k.encode("utf-8"))
            parts.append(v.encode("utf-8"))
        return b"".join(len(p).to_bytes(4, "big") + p for p in parts)

    def to_message(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "payload": base64.b64encode(self.payload).decode("ascii"),
            "qos": self.qos,
            "retain": self.retain,
            "user_properties": [list(p) for p in self.props],
        }


def make_row(
    topic: Any, payload: Any, qos: Any, retain: Any, props: Any, key: Any, default_qos: int
) -> OutRow:
    if not isinstance(topic, str) or not topic:
        raise MoorlineRowError(f"row without a topic (got {topic!r}); set option topic or a topic column")
    if "+" in topic or "#" in topic or "\0" in topic:
        raise MoorlineRowError(f"topic {topic!r} contains a wildcard or NUL; a topic name is needed")
    if payload is None:
        body = b""
    elif isinstance(payload, str):
        body = payload.encode("utf-8")
    elif isinstance(payload, bytes | bytearray | memoryview):
        body = bytes(payload)
    else:
        raise MoorlineRowError(f"payload must be string or binary, not {type(payload).__name__}")
    q = default_qos if qos is None else int(qos)
    if q not in (0, 1, 2):
        raise MoorlineRowError(f"qos must be 0, 1 or 2, not {q}")
    pairs: tuple[tuple[str, str], ...] = ()
    if props is not None:
        items = props.items() if isinstance(props, Mapping) else props  # arrow maps arrive as pair lists
        pairs = tuple(sorted((str(k), "" if v is None else str(v)) for k, v in items))
        reserved = {"guid", "producer", "seq"} & {k for k, _ in pairs}
        if reserved:
            raise MoorlineRowError(
                f"user property name(s) {sorted(reserved)} are reserved for moorline's identities"
            )
    return OutRow(
        topic,
        body,
        q,
        bool(retain) if retain is not None else False,
        pairs,
        None if key is None else _key_text(key),
    )


def _key_text(key: Any) -> str:
    if isinstance(key, bytes | bytearray | memoryview):
        return "b:" + bytes(key).hex()
    return "s:" + str(key)


def producer_hex(query_id: str, partition_id: int, shard: int) -> str:
    return producer_id64("moorline.spark.sink", query_id, partition_id, shard).hex()


def key_guid_hex(key: str) -> str:
    return guid128("moorline.spark.key", key).hex()


def sequence(batch_id: int, n: int) -> int:
    invariant(0 <= n < MAX_ROWS_PER_SHARD, "fewer than 2**32 rows per (task, shard, batch)")
    invariant(batch_id >= 0, "batch ids are non-negative")
    return (batch_id << ROW_BITS) | n


def sequenced_messages(
    rows: list[OutRow], shard_count: int, identity: str, partition_id: int, batch_id: int
) -> list[dict[str, Any]]:
    """Messages in canonical order with (producer, seq); each shard's seqs are 0,1,2.. of the batch."""
    keyed = sorted(((r.canonical(), r) for r in rows), key=lambda kr: kr[0])
    next_n: dict[int, int] = {}
    shard_by_topic: dict[str, int] = {}
    producers: dict[int, str] = {}
    out: list[dict[str, Any]] = []
    for _, r in keyed:
        s = shard_by_topic.get(r.topic)
        if s is None:
            s = shard_by_topic[r.topic] = shard_of(r.topic, shard_count)
            producers.setdefault(s, producer_hex(identity, partition_id, s))
        n = next_n.get(s, 0)
        next_n[s] = n + 1
        m = r.to_message()
        m["producer"] = producers[s]
        m["seq"] = sequence(batch_id, n)
        out.append(m)
    return out


def keyed_message(row: OutRow) -> dict[str, Any]:
    invariant(row.key is not None, "keyed rows carry a key")
    assert row.key is not None
    m = row.to_message()
    m["guid"] = key_guid_hex(row.key)
    return m
