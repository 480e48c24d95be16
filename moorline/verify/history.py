"""The history format: one JSON object per line, one line per event seen by a client (or the harness).

The column list lives here once. ``FIELDS`` is the plain description (used by the writer and by
pyarrow); ``spark_schema()`` turns it into a pyspark ``StructType`` lazily, so importing this
module never imports pyspark. docs/history-format.md explains every field.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any, Final

# (name, type) with type one of "string", "int", "long", "boolean".
FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("run", "string"),  # run id: histories of several runs may be checked together
    ("process", "string"),  # the logical client (thread) that saw the event
    ("index", "long"),  # per-writer sequence number, increases with mono_ns
    ("type", "string"),  # invoke | ok | fail | info | drop | fault
    (
        "op",
        "string",
    ),  # publish | deliver | ack | subscribe | unsubscribe | connect | disconnect | drop | fault
    ("topic", "string"),
    ("qos", "int"),  # publish: requested QoS; deliver: QoS of the PUBLISH; subscribe ok: granted QoS
    ("guid", "string"),  # 32 hex characters, unique per published message
    ("session", "string"),  # MQTT client id of the session that saw the event
    ("packet_id", "int"),
    ("node", "string"),  # the node the client was connected to
    ("dup", "boolean"),  # DUP flag of a received PUBLISH / of a sent PUBLISH
    ("filter", "string"),  # subscribe/unsubscribe: the topic filter without the $share prefix
    ("share_group", "string"),  # subscribe: the $share group name, else null
    ("sticky", "boolean"),  # subscribe: the group uses sticky_topic dispatch (per-topic order promised)
    ("no_local", "boolean"),
    ("clean_start", "boolean"),  # connect invoke
    ("session_present", "boolean"),  # connect ok
    ("session_expiry", "long"),  # connect invoke: session expiry interval in seconds
    ("expiry", "long"),  # publish: message expiry interval in seconds, null when none
    ("reason", "string"),  # fail/info/drop/fault: why (reason code, "timeout", "message_expiry", "kill", ...)
    ("shard", "int"),  # drop records
    ("offset", "long"),  # drop records
    ("mono_ns", "long"),  # time.monotonic_ns() of the machine running the clients
    ("wall_ms", "long"),  # time.time() in milliseconds
    ("detail", "string"),  # free text for people (fault file/offset, error message)
)
FIELD_NAMES: Final[frozenset[str]] = frozenset(name for name, _ in FIELDS)
TYPES: Final[frozenset[str]] = frozenset({"invoke", "ok", "fail", "info", "drop", "fault"})
OPS: Final[frozenset[str]] = frozenset(
    {"publish", "deliver", "ack", "subscribe", "unsubscribe", "connect", "disconnect", "drop", "fault"}
)


def spark_schema() -> Any:
    """The history schema as a pyspark ``StructType`` (imports pyspark on first use)."""
    from pyspark.sql import types as T

    kinds = {
        "string": T.StringType(),
        "int": T.IntegerType(),
        "long": T.LongType(),
        "boolean": T.BooleanType(),
    }
    return T.StructType([T.StructField(name, kinds[kind], True) for name, kind in FIELDS])


def arrow_schema() -> Any:
    """The history schema as a pyarrow schema, for writing Parquet histories."""
    import pyarrow as pa

    kinds = {"string": pa.string(), "int": pa.int32(), "long": pa.int64(), "boolean": pa.bool_()}
    return pa.schema([pa.field(name, kinds[kind]) for name, kind in FIELDS])


def check_record(record: dict[str, Any]) -> None:
    """Reject records a checker could silently misread (unknown field, unknown type or op)."""
    unknown = set(record) - FIELD_NAMES
    if unknown:
        raise ValueError(f"unknown history fields: {sorted(unknown)}")
    if record.get("type") not in TYPES:
        raise ValueError(f"history record type must be one of {sorted(TYPES)}: {record.get('type')!r}")
    if record.get("op") not in OPS:
        raise ValueError(f"history record op must be one of {sorted(OPS)}: {record.get('op')!r}")


class HistoryWriter:
    """Thread-safe JSON-lines appender. Timestamps and ``index`` are taken under one lock, so the
    file order, ``index`` order and ``mono_ns`` order agree, whichever thread writes."""

    def __init__(self, path: Path, run: str, *, flush_every: int = 256) -> None:
        if flush_every < 1:
            raise ValueError("flush_every must be >= 1")
        self.path = path
        self.run = run
        self._flush_every = flush_every
        self._lock = threading.Lock()
        self._index = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def record(self, type: str, op: str, **fields: Any) -> dict[str, Any]:
        """Append one event; returns the record as written."""
        rec: dict[str, Any] = {"type": type, "op": op}
        rec.update({k: v for k, v in fields.items() if v is not None})
        rec.setdefault("run", self.run)
        check_record(rec)
        with self._lock:
            if self._file is None:
                raise ValueError("history writer is closed")
            rec["index"] = self._index
            rec["mono_ns"] = time.monotonic_ns()
            rec["wall_ms"] = time.time_ns() // 1_000_000
            self._index += 1
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if self._index % self._flush_every == 0:
                self._file.flush()
        return rec

    @property
    def count(self) -> int:
        with self._lock:
            return self._index

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                self._file.close()
                self._file = None

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
