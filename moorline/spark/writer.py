"""Batch and streaming writers of ``format("moorline")``: every row acknowledged before a task succeeds.

A streaming task first reads the query's sink commit marker: a batch at or below it was
committed already (the query stopped between the sink commit and the checkpoint commit), so the
task publishes nothing. Otherwise it publishes its rows with sequenced-producer identities (see
``sequencing``), or GUIDs from a key column, and returns only when the node acknowledged every
row as ``ok`` or ``duplicate``. The driver-side ``commit`` then moves the marker.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, BooleanType, IntegerType, LongType, MapType, StringType, StructType

from moorline.invariant import invariant
from moorline.spark import failpoints
from moorline.spark.node_client import MoorlineHTTPError, MoorlineUnavailable, NodeClient
from moorline.spark.options import MoorlineOptionError, WriteOptions
from moorline.spark.sequencing import OutRow, keyed_message, make_row, sequenced_messages

log = logging.getLogger("moorline.spark")


class MoorlinePublishError(RuntimeError):
    """Rows could not be acknowledged within the retry budget (the task fails; Spark may retry it)."""


@dataclass
class MoorlineCommit(WriterCommitMessage):
    query_id: str | None
    batch_id: int
    partition_id: int
    published: int
    duplicates: int
    skipped_committed_batch: bool


@dataclass(frozen=True)
class Columns:
    """Where each field of a row comes from (column names, or None)."""

    topic: str | None
    payload: str
    qos: str | None
    retain: str | None
    props: str | None
    key: str | None


def resolve_columns(schema: StructType, opts: WriteOptions) -> Columns:
    by_name = {f.name.lower(): f for f in schema.fields}

    def col(name: str, types: tuple[type, ...]) -> str | None:
        f = by_name.get(name)
        if f is None:
            return None
        if not isinstance(f.dataType, types):
            raise MoorlineOptionError(
                f"column {f.name!r} has type {f.dataType.simpleString()}; expected "
                + " or ".join(t.__name__.replace("Type", "").lower() for t in types)
            )
        return f.name

    payload = col("payload", (StringType, BinaryType)) or col("value", (StringType, BinaryType))
    if payload is None:
        raise MoorlineOptionError(
            'writing to moorline needs a "payload" or "value" column (string or binary)'
        )
    topic = col("topic", (StringType,))
    if topic is None and opts.topic is None:
        raise MoorlineOptionError('writing to moorline needs option "topic" or a "topic" column')
    props = col("user_properties", (MapType,))
    if props is not None:
        mt = by_name["user_properties"].dataType
        assert isinstance(mt, MapType)
        if not isinstance(mt.keyType, StringType) or not isinstance(mt.valueType, StringType):
            raise MoorlineOptionError('column "user_properties" must be map<string,string>')
    key = None
    if opts.key_column is not None:
        f = by_name.get(opts.key_column.lower())
        if f is None:
            raise MoorlineOptionError(f'option "keyColumn": no column named {opts.key_column!r}')
        key = f.name
    return Columns(
        topic=topic,
        payload=payload,
        qos=col("qos", (IntegerType, LongType)),
        retain=col("retain", (BooleanType,)),
        props=props,
        key=key,
    )


def client_for(opts: WriteOptions) -> NodeClient:
    return NodeClient(
        opts.servers, opts.request_timeout_s, backoff_s=opts.retry_backoff_s, backoff_max_s=opts.retry_backoff_max_s,
        authorization=opts.authorization,
    )


def _column(batch: pa.RecordBatch, name: str | None) -> list[Any]:
    names = batch.schema.names
    if name is None or name not in names:
        return [None] * batch.num_rows
    return list(batch.column(names.index(name)).to_pylist())


def rows_of(batches: Iterator[pa.RecordBatch], cols: Columns, opts: WriteOptions) -> Iterator[OutRow]:
    for batch in batches:
        n = batch.num_rows
        topics = _column(batch, cols.topic) if cols.topic is not None else [opts.topic] * n
        payloads, qoss, retains = (
            _column(batch, cols.payload),
            _column(batch, cols.qos),
            _column(batch, cols.retain),
        )
        props, keys = _column(batch, cols.props), _column(batch, cols.key)
        for i in range(n):
            topic = topics[i] if topics[i] is not None else opts.topic
            yield make_row(topic, payloads[i], qoss[i], retains[i], props[i], keys[i], opts.qos)


def publish_all(
    client: NodeClient, messages: list[dict[str, Any]], opts: WriteOptions, sequenced: bool
) -> tuple[int, int]:
    """Publish in chunks; return (ok, duplicate). Refused and unanswered rows are retried, bounded."""
    ok = dup = 0
    for i in range(0, len(messages), opts.publish_batch_size):
        pending = messages[i : i + opts.publish_batch_size]
        attempt = 0
        while pending:
            try:
                results = client.publish(pending)
            except MoorlineUnavailable as exc:
                # The client already went round every server until requestTimeoutMs: fail the task
                # (Spark retries it with the same identities) rather than wait that long again.
                raise MoorlinePublishError(str(exc)) from exc
            except MoorlineHTTPError as exc:
                if exc.status < 500 and exc.status != 429:
                    raise MoorlinePublishError(f"moorline rejected a publish request: {exc}") from exc
                attempt += 1
                if attempt > opts.publish_retries:
                    raise MoorlinePublishError(f"publish failed after {attempt} attempts: {exc}") from exc
                time.sleep(min(2.0, 0.1 * 2**attempt))
                continue  # same rows again: identities make the resend idempotent
            refused: list[dict[str, Any]] = []
            refused_shards: set[int] = set()
            reason = ""
            for m, r in zip(pending, results, strict=True):
                status = r.get("status")
                shard = int(r.get("shard", -1))
                if status == "refused":
                    refused.append(m)
                    refused_shards.add(shard)
                    reason = str(r.get("reason", "refused"))
                elif status in ("ok", "duplicate"):
                    if sequenced and status == "ok" and shard in refused_shards:
                        # A later sequence was applied after a refused one: resending the refused
                        # row would now count as a duplicate. Never hide that.
                        raise MoorlinePublishError(
                            f"moorline shard {shard} applied seq {m.get('seq')} after refusing an earlier one "
                            f"({reason}); rows of producer {m.get('producer')} would be lost"
                        )
                    ok += status == "ok"
                    dup += status == "duplicate"
                else:
                    raise MoorlinePublishError(f"unknown publish status {status!r}: {r}")
            if refused:
                attempt += 1
                if attempt > opts.publish_retries:
                    raise MoorlinePublishError(
                        f"{len(refused)} row(s) refused after {attempt} attempts; last reason: {reason}"
                    )
                time.sleep(min(2.0, 0.1 * 2**attempt))
            pending = refused
        if i == 0:
            failpoints.maybe_fail("write_after_first_chunk")
    return ok, dup


def write_task(
    opts: WriteOptions, cols: Columns, batches: Iterator[pa.RecordBatch], identity: str, batch_id: int
) -> tuple[int, int]:
    """Publish one task's rows; ``identity`` names the producer (query or job id)."""
    ctx = TaskContext.get()
    invariant(ctx is not None, "write() runs in a Spark task")
    assert ctx is not None
    partition_id = ctx.partitionId()
    with client_for(opts) as client:
        if cols.key is not None:
            ok = dup = 0
            chunk: list[dict[str, Any]] = []
            for row in rows_of(batches, cols, opts):
                if row.key is None:
                    raise MoorlinePublishError(f"row with a null key column {cols.key!r}")
                chunk.append(keyed_message(row))
                if len(chunk) >= opts.publish_batch_size:
                    o, d = publish_all(client, chunk, opts, sequenced=False)
                    ok, dup, chunk = ok + o, dup + d, []
            o, d = publish_all(client, chunk, opts, sequenced=False)
            return ok + o, dup + d
        rows: list[OutRow] = []
        for row in rows_of(batches, cols, opts):
            rows.append(row)
            if len(rows) > opts.max_task_rows:
                raise MoorlinePublishError(
                    f"a write task holds more than maxTaskRows={opts.max_task_rows} rows (they are sorted in memory "
                    "to number them canonically); repartition into more partitions, raise maxTaskRows, or use keyColumn"
                )
        if not rows:
            return 0, 0
        shard_count = len(client.shards())
        messages = sequenced_messages(rows, shard_count, identity, partition_id, batch_id)
        return publish_all(client, messages, opts, sequenced=True)


class MoorlineStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, opts: WriteOptions, cols: Columns) -> None:
        self.opts = opts
        self.cols = cols

    def write(self, iterator: Iterator[pa.RecordBatch]) -> MoorlineCommit:
        ctx = TaskContext.get()
        assert ctx is not None
        query_id = ctx.getLocalProperty("sql.streaming.queryId")
        batch_raw = ctx.getLocalProperty("streaming.sql.batchId")
        if not query_id or batch_raw is None:
            raise MoorlinePublishError("no streaming query id / batch id in the task context")
        batch_id = int(batch_raw)
        with client_for(self.opts) as client:
            marker = client.get_marker(query_id)
        if marker is not None and marker >= batch_id:
            failpoints.mark("skipped_committed_batch")
            return MoorlineCommit(query_id, batch_id, ctx.partitionId(), 0, 0, True)
        ok, dup = write_task(self.opts, self.cols, iterator, query_id, batch_id)
        return MoorlineCommit(query_id, batch_id, ctx.partitionId(), ok, dup, False)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 (Spark's name)
        ids = {m.query_id for m in messages if isinstance(m, MoorlineCommit) and m.query_id}
        invariant(len(ids) <= 1, "one query per batch")
        if not ids:
            return  # no task ran: nothing was published, nothing to protect
        with client_for(self.opts) as client:
            client.put_marker(ids.pop(), batchId)
        failpoints.maybe_fail("commit_after_marker")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        # Rows already acknowledged stay: the retry re-sends the same identities, so they dedup.
        log.warning("moorline sink: batch %d aborted; its re-run is de-duplicated", batchId)


class MoorlineBatchWriter(DataSourceArrowWriter):
    """``df.write``: task retries are de-duplicated (the job id is fixed when the job is planned);
    a re-run of the whole job is exactly-once only with ``keyColumn``."""

    def __init__(self, opts: WriteOptions, cols: Columns) -> None:
        self.opts = opts
        self.cols = cols
        self.job_id = uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> MoorlineCommit:
        ok, dup = write_task(self.opts, self.cols, iterator, self.job_id, 0)
        ctx = TaskContext.get()
        return MoorlineCommit(None, 0, ctx.partitionId() if ctx else -1, ok, dup, False)
