"""Batch and streaming readers of ``format("moorline")``.

Planning (``initialOffset`` / ``latestOffset`` / ``partitions`` / ``commit``) runs in one
long-lived Python process per query on the driver; ``read()`` runs on executors on a pickled
copy. So only plain data lives on ``self`` and every method opens its own ``NodeClient``.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from moorline.invariant import invariant
from moorline.spark import failpoints
from moorline.spark.node_client import NodeClient, ShardInfo
from moorline.spark.options import EARLIEST, MoorlineOptionError, ReadOptions, StartSpec
from moorline.spark.planning import (
    MoorlineDataLossError,
    Offsets,
    ShardRange,
    any_filter_matches,
    clamp_to_complete,
    first_offset_at_or_after,
    latest_end,
    loss_message,
    pin_offsets,
    plan_ranges,
    relevant_shards,
    resolve_spec,
    server_filter,
)

log = logging.getLogger("moorline.spark")

LAG_WAITS_MAX = 300  # x 0.1 s: how long a read waits for a lagging server to reach the planned end

READ_SCHEMA = (
    "topic string, payload binary, qos int, retain boolean, guid string, shard int, offset long, "
    "timestamp timestamp, user_properties map<string,string>"
)
ARROW_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("payload", pa.binary()),
        ("qos", pa.int32()),
        ("retain", pa.bool_()),
        ("guid", pa.string()),
        ("shard", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("user_properties", pa.map_(pa.string(), pa.string())),
    ]
)


class ShardRangePartition(InputPartition):
    """An input partition: offsets [start, end) of one shard incarnation (plain, picklable fields)."""

    def __init__(self, r: ShardRange) -> None:
        super().__init__((r.shard, r.start, r.end))
        self.shard = r.shard
        self.incarnation = r.incarnation
        self.start = r.start
        self.end = r.end


def _client(opts: ReadOptions) -> NodeClient:
    return NodeClient(
        opts.servers, opts.request_timeout_s, backoff_s=opts.retry_backoff_s, backoff_max_s=opts.retry_backoff_max_s,
        authorization=opts.authorization,
    )


def _wanted(opts: ReadOptions, shards: dict[int, ShardInfo]) -> list[int]:
    return relevant_shards(opts.topics, len(shards))


def _first_at(client: NodeClient, info: ShardInfo, offset: int) -> tuple[int, int] | None:
    """(offset, publish time) of the first message stored at or after ``offset``, or None."""
    for _ in range(3):  # retention may raise the low-water mark between the shard table and the fetch
        r = client.fetch(info.shard, offset, 1, info.incarnation, None)
        if r.status == 410:
            offset = max(offset, int(r.body.get("low_water", offset)))
            continue
        if r.status == 409:
            raise MoorlineDataLossError(
                f"moorline shard {info.shard} was rebuilt while its start was looked up by timestamp; start again"
            )
        if r.status != 200:
            raise RuntimeError(f"moorline fetch shard {info.shard} from {offset}: HTTP {r.status}: {r.body}")
        msgs = r.body.get("messages") or []
        if not msgs:
            return None
        return int(msgs[0]["offset"]), int(msgs[0].get("timestamp_ms", 0))
    raise RuntimeError(f"moorline shard {info.shard}: the low-water mark kept moving while looking up a timestamp")


def _resolve_start(
    client: NodeClient, opts: ReadOptions, shards: dict[int, ShardInfo], wanted: list[int], fail: bool
) -> Offsets:
    """``startingOffsets`` as full offsets; ``startingTimestamp`` / ``startingOffsetsByTimestamp``
    are first turned into offsets by a binary search over each shard's publish times."""
    spec = opts.starting
    if spec.kind == "timestamp":
        unknown = sorted(set(spec.timestamps) - set(shards))
        if unknown:
            raise MoorlineOptionError(
                f"startingOffsetsByTimestamp: unknown shard(s) {unknown}; the cluster has {len(shards)} shards"
            )
        per: dict[int, tuple[str | None, int]] = {}
        for s in wanted:
            t_ms = spec.timestamps.get(s, spec.default_timestamp)
            info = shards[s]
            if t_ms is None:
                per[s] = (None, EARLIEST)
                continue
            offset, probes = first_offset_at_or_after(
                t_ms, info.low_water, info.next_offset, functools.partial(_first_at, client, info)
            )
            log.info("moorline shard %d: publish time %d ms starts at offset %d (%d probes)", s, t_ms, offset, probes)
            per[s] = (info.incarnation, offset)
        spec = StartSpec("json", per)
    return resolve_spec(spec, shards, wanted, fail, "startingOffsets")


def _props(pairs: list[list[str]] | None) -> list[tuple[str, str]]:
    if not pairs:
        return []
    return list({str(k): str(v) for k, v in pairs}.items())  # a map holds one value per name: last wins


def _to_batch(rows: list[dict[str, Any]], shard: int) -> pa.RecordBatch:
    b64 = base64.b64decode
    arrays = [
        pa.array([m["topic"] for m in rows], pa.string()),
        pa.array([b64(m["payload"]) for m in rows], pa.binary()),
        pa.array([m.get("qos", 0) for m in rows], pa.int32()),
        pa.array([bool(m.get("retain", False)) for m in rows], pa.bool_()),
        pa.array([m.get("guid") for m in rows], pa.string()),
        pa.array([shard] * len(rows), pa.int32()),
        pa.array([m["offset"] for m in rows], pa.int64()),
        pa.array([m.get("timestamp_ms", 0) for m in rows], pa.timestamp("ms", tz="UTC")).cast(
            pa.timestamp("us", tz="UTC")
        ),
        pa.array([_props(m.get("user_properties")) for m in rows], pa.map_(pa.string(), pa.string())),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def read_range(opts: ReadOptions, part: ShardRangePartition) -> Iterator[pa.RecordBatch]:
    """Yield the committed messages of one shard range that match the topic filters."""
    flt = server_filter(opts.topics)
    cur = part.start
    lag_waits = 0
    with _client(opts) as client:
        while cur < part.end:
            r = client.fetch(
                part.shard, cur, min(opts.fetch_max_messages, part.end - cur), part.incarnation, flt
            )
            if r.status == 410:
                low = int(r.body.get("low_water", cur))
                info = ShardInfo(part.shard, part.incarnation, low, part.end)
                if opts.fail_on_data_loss:
                    raise MoorlineDataLossError(loss_message(part.shard, part.incarnation, cur, info))
                invariant(low > cur, "a 410 names a low-water mark above the requested offset")
                log.warning(
                    "moorline shard %d: skipping offsets %d..%d (failOnDataLoss=false)",
                    part.shard,
                    cur,
                    low - 1,
                )
                cur = low
                continue
            if r.status == 409:
                if opts.fail_on_data_loss:
                    raise MoorlineDataLossError(
                        f"moorline shard {part.shard} was rebuilt while reading: planned incarnation "
                        f"{part.incarnation}, now {r.body.get('incarnation')}; set failOnDataLoss=false to skip"
                    )
                return
            if r.status != 200:
                raise RuntimeError(f"moorline fetch shard {part.shard} from {cur}: HTTP {r.status}: {r.body}")
            msgs = r.body.get("messages") or []
            scanned = int(r.body.get("scanned_to", cur))
            if not msgs:
                if scanned > cur:
                    cur = scanned  # the node looked this far and found nothing matching
                    continue
                if int(r.body.get("next_offset", part.end)) < part.end:
                    # This server has not applied the planned range yet (a lagging replica):
                    # wait for it rather than end the range early.
                    lag_waits += 1
                    if lag_waits > LAG_WAITS_MAX:
                        raise RuntimeError(
                            f"moorline shard {part.shard}: the server stays behind offset {part.end} "
                            f"(next_offset {r.body.get('next_offset')})"
                        )
                    time.sleep(0.1)
                    continue
                break  # nothing matching is left below the shard's next offset
            keep = [
                m for m in msgs if int(m["offset"]) < part.end and any_filter_matches(opts.topics, m["topic"])
            ]
            last = int(msgs[-1]["offset"])
            invariant(last >= cur, "the node returns offsets at or after the requested one")
            if keep:
                yield _to_batch(keep, part.shard)
            cur = max(last + 1, scanned)


class MoorlineBatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self.reader_id = opts.reader_id or f"spark-batch-{uuid.uuid4().hex}"

    def partitions(self) -> list[InputPartition]:
        with _client(self.opts) as client:
            shards = client.shards()
            wanted = _wanted(self.opts, shards)
            start = _resolve_start(client, self.opts, shards, wanted, self.opts.fail_on_data_loss)
            start = clamp_to_complete(start, shards, self.opts.fail_on_data_loss)
            end = resolve_spec(self.opts.ending, shards, wanted, self.opts.fail_on_data_loss, "endingOffsets")
            ranges = plan_ranges(start, end, shards, self.opts.fail_on_data_loss)
            if ranges:
                client.pin(self.reader_id, {str(r.shard): r.start for r in ranges}, self.opts.pin_ttl_ms)
        return [ShardRangePartition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ShardRangePartition):
            # partitions() planned nothing (an empty range): PySpark then reads one placeholder.
            invariant(partition.value is None, "moorline partitions only")
            return
        yield from read_range(self.opts, partition)


class MoorlineStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        # A stable readerId lets a restarted query replace its own pin; without one each run pins
        # under a fresh id, and a dead run's pin lapses after pinTtlMs.
        self.reader_id = opts.reader_id or f"spark-stream-{uuid.uuid4().hex}"
        self.pins_supported = True
        self.target: dict[str, int] | None = None  # availableNow: next offsets when the run started

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 (Spark's name)
        with _client(self.opts) as client:
            shards = client.shards()
        self.target = {str(s): shards[s].next_offset for s in _wanted(self.opts, shards)}

    def _pin(self, client: NodeClient, offsets: Offsets) -> None:
        if not offsets or not self.pins_supported:
            return
        if not client.pin(self.reader_id, pin_offsets(offsets), self.opts.pin_ttl_ms):
            self.pins_supported = False
            log.warning("moorline node has no /v1/pins: retention is not held for this query")

    def initialOffset(self) -> dict:
        with _client(self.opts) as client:
            # Retention may pass the start between reading the shards and pinning it: those rows
            # were never promised to this query. So plan, pin, and plan once more under the pin:
            # the second plan cannot move again (the pin holds everything at or above the first
            # start), and "earliest" then means the earliest row still there. A start given as
            # explicit offsets that retention removed meanwhile still fails (or skips) as asked.
            start: Offsets = {}
            for _attempt in range(2):
                shards = client.shards()
                wanted = _wanted(self.opts, shards)
                start = _resolve_start(client, self.opts, shards, wanted, self.opts.fail_on_data_loss)
                start = clamp_to_complete(start, shards, self.opts.fail_on_data_loss)
                self._pin(client, start)
        return start

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger is not None:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        with _client(self.opts) as client:
            shards = client.shards()
            if start is None:  # Spark 4.0/4.1 call without arguments: plan from the head
                start = _resolve_start(client, self.opts, shards, _wanted(self.opts, shards), True)
            clamped = clamp_to_complete(start, shards, self.opts.fail_on_data_loss)
            self._pin(client, clamped)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        if self.target is not None:  # availableNow: behave as if nothing arrived after the start
            shards = {
                s: ShardInfo(
                    s, i.incarnation, i.low_water, min(i.next_offset, self.target.get(str(s), i.next_offset))
                )
                for s, i in shards.items()
            }
        end = latest_end(clamped, shards, max_rows)
        return start if end == start else end

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        if start == end:
            return []
        with _client(self.opts) as client:
            shards = client.shards()
            ranges = plan_ranges(start, end, shards, self.opts.fail_on_data_loss)
            self._pin(client, start)  # the whole position: a pin replaces the reader's previous one
        failpoints.maybe_fail("stream_partitions")  # tests: die after the batch's offsets were logged
        return [ShardRangePartition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        invariant(isinstance(partition, ShardRangePartition), "moorline partitions only")
        assert isinstance(partition, ShardRangePartition)
        yield from read_range(self.opts, partition)

    def commit(self, end: dict) -> None:
        # Everything below ``end`` is processed: hold retention only from there on.
        with _client(self.opts) as client:
            self._pin(client, end)

    def stop(self) -> None:
        # The pin is kept on purpose: a restart within pinTtlMs replays from it.
        pass
