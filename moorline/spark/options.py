"""Options of the ``moorline`` Spark data source, parsed and validated once on the driver.

Spark hands options over as a case-insensitive mapping of strings. Everything is parsed here into
frozen dataclasses of plain values, so the objects Spark pickles to executors carry no surprises,
and a misspelt option fails the query at ``load()`` / ``start()`` with a message naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moorline.invariant import invariant


class MoorlineOptionError(ValueError):
    """An option of ``format("moorline")`` is missing, unknown or malformed."""


# Lower-cased names (Spark lower-cases keys). Options Spark itself adds or users commonly pass
# for the query (checkpointLocation, path) are accepted and ignored.
READ_OPTIONS = {
    "servers",
    "topics",
    "startingoffsets",
    "endingoffsets",
    "maxoffsetspertrigger",
    "failondataloss",
    "readerid",
    "pinttlms",
    "fetchmaxmessages",
    "requesttimeoutms",
}
WRITE_OPTIONS = {
    "servers",
    "topic",
    "keycolumn",
    "qos",
    "publishbatchsize",
    "publishretries",
    "requesttimeoutms",
    "maxtaskrows",
}
SPARK_OPTIONS = {"path", "checkpointlocation", "queryname"}
ALL_OPTIONS = READ_OPTIONS | WRITE_OPTIONS | SPARK_OPTIONS

# A per-shard position in a shard's log: (incarnation or None = "whatever is current", offset).
# Offset sentinels used only while resolving user input.
EARLIEST = -2
LATEST = -1


@dataclass(frozen=True)
class StartSpec:
    """What the user asked for as a starting or ending position."""

    kind: str  # "earliest" | "latest" | "json"
    per_shard: dict[int, tuple[str | None, int]] = field(default_factory=dict)  # json only


@dataclass(frozen=True)
class ReadOptions:
    servers: tuple[str, ...]
    topics: tuple[str, ...]
    starting: StartSpec
    ending: StartSpec
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    reader_id: str | None
    pin_ttl_ms: int
    fetch_max_messages: int
    request_timeout_s: float


@dataclass(frozen=True)
class WriteOptions:
    servers: tuple[str, ...]
    topic: str | None
    key_column: str | None
    qos: int
    publish_batch_size: int
    publish_retries: int
    request_timeout_s: float
    max_task_rows: int


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in options.items()}


def check_known(options: Mapping[str, str], allowed: set[str], what: str) -> None:
    unknown = sorted(k for k in _lower(options) if k not in allowed and k not in SPARK_OPTIONS)
    if unknown:
        raise MoorlineOptionError(
            f"unknown option(s) for moorline {what}: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(allowed))}"
        )


def parse_servers(value: str | None) -> tuple[str, ...]:
    if value is None or not value.strip():
        raise MoorlineOptionError('option "servers" is required, e.g. .option("servers", "127.0.0.1:8080")')
    out: list[str] = []
    for part in value.split(","):
        hp = part.strip()
        if hp.startswith("http://"):
            hp = hp[len("http://") :]
        hp = hp.rstrip("/")
        host, sep, port = hp.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MoorlineOptionError(
                f'option "servers": {part.strip()!r} is not HOST:PORT (the node\'s --http address)'
            )
        out.append(f"{host}:{int(port)}")
    return tuple(out)


def parse_topics(value: str | None) -> tuple[str, ...]:
    if value is None or not value.strip():
        raise MoorlineOptionError('option "topics" is required, e.g. .option("topics", "sensors/#")')
    filters = tuple(t.strip() for t in value.split(",") if t.strip())
    for f in filters:
        levels = f.split("/")
        for i, level in enumerate(levels):
            if ("#" in level and (level != "#" or i != len(levels) - 1)) or ("+" in level and level != "+"):
                raise MoorlineOptionError(f'option "topics": {f!r} is not a valid MQTT topic filter')
        if f.startswith("$share/"):
            raise MoorlineOptionError(
                f'option "topics": shared subscriptions ({f!r}) cannot be read by Spark'
            )
    return filters


def _int(opts: dict[str, str], key: str, default: int | None, minimum: int) -> int | None:
    raw = opts.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise MoorlineOptionError(f'option "{key}": {raw!r} is not an integer') from None
    if value < minimum:
        raise MoorlineOptionError(f'option "{key}": {value} is below the minimum {minimum}')
    return value


def _req_int(opts: dict[str, str], key: str, default: int, minimum: int) -> int:
    value = _int(opts, key, default, minimum)
    invariant(value is not None, "a default was given")
    assert value is not None
    return value


def _bool(opts: dict[str, str], key: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if raw.strip().lower() in ("true", "1", "yes"):
        return True
    if raw.strip().lower() in ("false", "0", "no"):
        return False
    raise MoorlineOptionError(f'option "{key}": {raw!r} is not true or false')


def parse_offsets_spec(key: str, raw: str | None, default: str) -> StartSpec:
    """``earliest`` | ``latest`` | JSON ``{"<shard>": {"incarnation": "..", "offset": N}}``.

    A shard's value may also be a bare offset (``{"0": 42}``); the incarnation then is the
    current one.
    """
    text = (raw if raw is not None else default).strip()
    if text.lower() in ("earliest", "latest"):
        return StartSpec(text.lower())
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MoorlineOptionError(
            f'option "{key}": expected "earliest", "latest" or JSON like '
            f'{{"0": {{"incarnation": "..", "offset": 5}}}}; JSON error: {exc}'
        ) from None
    if not isinstance(doc, dict) or not doc:
        raise MoorlineOptionError(
            f'option "{key}": the JSON must be a non-empty object keyed by shard number'
        )
    per: dict[int, tuple[str | None, int]] = {}
    for shard_key, value in doc.items():
        if not str(shard_key).isdigit():
            raise MoorlineOptionError(f'option "{key}": shard key {shard_key!r} is not a shard number')
        inc: str | None = None
        if isinstance(value, dict):
            off = value.get("offset")
            inc_raw = value.get("incarnation")
            if inc_raw is not None and not isinstance(inc_raw, str):
                raise MoorlineOptionError(f'option "{key}": shard {shard_key}: incarnation must be a string')
            inc = inc_raw
            unknown = set(value) - {"offset", "incarnation"}
            if unknown:
                raise MoorlineOptionError(
                    f'option "{key}": shard {shard_key}: unknown field(s) {sorted(unknown)}'
                )
        else:
            off = value
        if isinstance(off, bool) or not isinstance(off, int) or off < EARLIEST:
            raise MoorlineOptionError(
                f'option "{key}": shard {shard_key}: offset must be an integer >= 0 (or -2 earliest, -1 latest)'
            )
        per[int(shard_key)] = (inc, off)
    return StartSpec("json", per)


def parse_read_options(options: Mapping[str, str], streaming: bool) -> ReadOptions:
    check_known(options, READ_OPTIONS, "reads")
    o = _lower(options)
    if streaming and "endingoffsets" in o:
        raise MoorlineOptionError('option "endingOffsets" applies to batch reads (spark.read) only')
    if not streaming and "maxoffsetspertrigger" in o:
        raise MoorlineOptionError('option "maxOffsetsPerTrigger" applies to streaming reads only')
    ending = parse_offsets_spec("endingOffsets", o.get("endingoffsets"), "latest")
    if ending.kind == "earliest":
        raise MoorlineOptionError(
            'option "endingOffsets": "earliest" makes an empty read; use "latest" or JSON'
        )
    reader_id = o.get("readerid")
    if reader_id is not None and (not reader_id or "/" in reader_id or len(reader_id) > 200):
        raise MoorlineOptionError('option "readerId": must be 1-200 characters without "/"')
    return ReadOptions(
        servers=parse_servers(o.get("servers")),
        topics=parse_topics(o.get("topics")),
        starting=parse_offsets_spec(
            "startingOffsets", o.get("startingoffsets"), "latest" if streaming else "earliest"
        ),
        ending=ending,
        max_offsets_per_trigger=_int(o, "maxoffsetspertrigger", None, 1),
        fail_on_data_loss=_bool(o, "failondataloss", True),
        reader_id=reader_id,
        pin_ttl_ms=_req_int(o, "pinttlms", 600_000, 1_000),
        fetch_max_messages=_req_int(o, "fetchmaxmessages", 5_000, 1),
        request_timeout_s=_req_int(o, "requesttimeoutms", 30_000, 100) / 1000.0,
    )


def parse_write_options(options: Mapping[str, str]) -> WriteOptions:
    check_known(options, WRITE_OPTIONS, "writes")
    o = _lower(options)
    topic = o.get("topic")
    if topic is not None and (not topic or "+" in topic or "#" in topic):
        raise MoorlineOptionError(f'option "topic": {topic!r} is not a valid topic name (no wildcards)')
    qos = _req_int(o, "qos", 1, 0)
    if qos > 2:
        raise MoorlineOptionError(f'option "qos": {qos} is not 0, 1 or 2')
    return WriteOptions(
        servers=parse_servers(o.get("servers")),
        topic=topic,
        key_column=o.get("keycolumn") or None,
        qos=qos,
        publish_batch_size=_req_int(o, "publishbatchsize", 5_000, 1),
        publish_retries=_req_int(o, "publishretries", 10, 0),
        request_timeout_s=_req_int(o, "requesttimeoutms", 60_000, 100) / 1000.0,
        max_task_rows=_req_int(o, "maxtaskrows", 1_000_000, 1),
    )
