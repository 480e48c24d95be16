"""Options of the ``moorline`` Spark data source, parsed and validated once on the driver.

Spark hands options over as a case-insensitive mapping of strings. Everything is parsed here into
frozen dataclasses of plain values, so the objects Spark pickles to executors carry no surprises,
and a misspelt option fails the query at ``load()`` / ``start()`` with a message naming it.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moorline.invariant import invariant


class MoorlineOptionError(ValueError):
    """An option of ``format("moorline")`` is missing, unknown or malformed."""


# Every option by its documented spelling; Spark lower-cases keys, so lookups use the lower case.
READ_OPTION_NAMES = (
    "servers",
    "topics",
    "startingOffsets",
    "startingOffsetsByTimestamp",
    "startingTimestamp",
    "endingOffsets",
    "maxOffsetsPerTrigger",
    "failOnDataLoss",
    "readerId",
    "pinTtlMs",
    "fetchMaxMessages",
    "requestTimeoutMs",
    "retryBackoffMs",
    "retryBackoffMaxMs",
    "user",
    "password",
    "token",
)
WRITE_OPTION_NAMES = (
    "servers",
    "topic",
    "keyColumn",
    "qos",
    "publishBatchSize",
    "publishRetries",
    "requestTimeoutMs",
    "retryBackoffMs",
    "retryBackoffMaxMs",
    "maxTaskRows",
    "user",
    "password",
    "token",
)
# Options Spark itself adds or users commonly pass for the query: accepted and ignored.
SPARK_OPTION_NAMES = ("path", "checkpointLocation", "queryName")
DISPLAY_NAMES = {n.lower(): n for n in READ_OPTION_NAMES + WRITE_OPTION_NAMES + SPARK_OPTION_NAMES}
READ_OPTIONS = {n.lower() for n in READ_OPTION_NAMES}
WRITE_OPTIONS = {n.lower() for n in WRITE_OPTION_NAMES}
SPARK_OPTIONS = {n.lower() for n in SPARK_OPTION_NAMES}
ALL_OPTIONS = READ_OPTIONS | WRITE_OPTIONS | SPARK_OPTIONS

# A per-shard position in a shard's log: (incarnation or None = "whatever is current", offset).
# Offset sentinels used only while resolving user input.
EARLIEST = -2
LATEST = -1


@dataclass(frozen=True)
class StartSpec:
    """What the user asked for as a starting or ending position."""

    kind: str  # "earliest" | "latest" | "json" | "timestamp"
    per_shard: dict[int, tuple[str | None, int]] = field(default_factory=dict)  # json only
    # kind "timestamp": publish time (ms since the epoch) per shard, and for shards not listed
    # (None: those start at earliest, as with JSON offsets).
    timestamps: dict[int, int] = field(default_factory=dict)
    default_timestamp: int | None = None


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
    request_timeout_s: float  # one call to the node, retries across servers included
    retry_backoff_s: float  # first pause after every server failed once; doubles, jittered
    retry_backoff_max_s: float
    # The node's HTTP Authorization header (options user/password or token); kept out of repr.
    authorization: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class WriteOptions:
    servers: tuple[str, ...]
    topic: str | None
    key_column: str | None
    qos: int
    publish_batch_size: int
    publish_retries: int
    request_timeout_s: float
    retry_backoff_s: float
    retry_backoff_max_s: float
    max_task_rows: int
    authorization: str | None = field(default=None, repr=False)  # as ReadOptions.authorization


def parse_credentials(o: Mapping[str, str]) -> str | None:
    """Options ``user`` and ``password`` (HTTP Basic, the node's password file) or ``token`` (a
    bearer token of its token file) as an Authorization header; None for a node without auth."""
    from moorline.spark.node_client import authorization_header

    user, password, token = o.get("user"), o.get("password"), o.get("token")
    if token is not None and (user is not None or password is not None):
        raise MoorlineOptionError('give either option "token" or options "user" and "password", not both')
    if (user is None) != (password is None):
        raise MoorlineOptionError('options "user" and "password" go together')
    if user is not None and (not user or ":" in user):
        raise MoorlineOptionError('option "user": non-empty, without ":"')
    return authorization_header(user, password, token)


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in options.items()}


def check_known(options: Mapping[str, str], allowed: set[str], what: str) -> None:
    """Reject unknown options, suggesting the closest known one (a typo should not cost a run)."""
    unknown = sorted(str(k) for k in options if str(k).lower() not in allowed | SPARK_OPTIONS)
    if not unknown:
        return
    candidates = sorted(allowed | SPARK_OPTIONS)
    parts = []
    for k in unknown:
        close = difflib.get_close_matches(k.lower(), candidates, n=1, cutoff=0.6)
        hint = f' (did you mean "{DISPLAY_NAMES[close[0]]}"?)' if close else ""
        parts.append(f'"{k}"{hint}')
    known = ", ".join(DISPLAY_NAMES[k] for k in sorted(allowed))
    raise MoorlineOptionError(f"unknown option(s) for moorline {what}: {', '.join(parts)}; known: {known}")


def parse_servers(value: str | None) -> tuple[str, ...]:
    if value is None or not value.strip():
        raise MoorlineOptionError('option "servers" is required, e.g. .option("servers", "127.0.0.1:8888")')
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
    name = DISPLAY_NAMES.get(key, key)
    try:
        value = int(raw)
    except ValueError:
        raise MoorlineOptionError(f'option "{name}": {raw!r} is not an integer') from None
    if value < minimum:
        raise MoorlineOptionError(f'option "{name}": {value} is below the minimum {minimum}')
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


def parse_timestamp_spec(o: dict[str, str]) -> StartSpec | None:
    """``startingTimestamp`` (ms, every shard) or ``startingOffsetsByTimestamp`` (JSON
    ``{"<shard>": ms}``; shards left out start at earliest). As in Kafka's source,
    ``startingTimestamp`` wins over ``startingOffsetsByTimestamp``, which wins over
    ``startingOffsets``."""
    if "startingtimestamp" in o:
        ts = _int(o, "startingtimestamp", None, 0)
        assert ts is not None
        return StartSpec("timestamp", default_timestamp=ts)
    raw = o.get("startingoffsetsbytimestamp")
    if raw is None:
        return None
    try:
        doc: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise MoorlineOptionError(
            f'option "startingOffsetsByTimestamp": expected JSON like {{"0": 1767225600000}} '
            f"(shard -> publish time in ms since the epoch); JSON error: {exc}"
        ) from None
    if not isinstance(doc, dict) or not doc:
        raise MoorlineOptionError(
            'option "startingOffsetsByTimestamp": the JSON must be a non-empty object keyed by shard number'
        )
    per: dict[int, int] = {}
    for shard_key, value in doc.items():
        if not str(shard_key).isdigit():
            raise MoorlineOptionError(
                f'option "startingOffsetsByTimestamp": shard key {shard_key!r} is not a shard number'
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MoorlineOptionError(
                f'option "startingOffsetsByTimestamp": shard {shard_key}: {value!r} is not a time in ms since the epoch'
            )
        per[int(shard_key)] = value
    return StartSpec("timestamp", timestamps=per)


def _backoff(o: dict[str, str]) -> tuple[float, float]:
    first = _req_int(o, "retrybackoffms", 100, 1)
    most = _req_int(o, "retrybackoffmaxms", 2_000, 1)
    if most < first:
        raise MoorlineOptionError(
            f'option "retryBackoffMaxMs": {most} is below "retryBackoffMs" ({first})'
        )
    return first / 1000.0, most / 1000.0


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
    starting = parse_timestamp_spec(o) or parse_offsets_spec(
        "startingOffsets", o.get("startingoffsets"), "latest" if streaming else "earliest"
    )
    backoff_s, backoff_max_s = _backoff(o)
    return ReadOptions(
        servers=parse_servers(o.get("servers")),
        topics=parse_topics(o.get("topics")),
        starting=starting,
        ending=ending,
        max_offsets_per_trigger=_int(o, "maxoffsetspertrigger", None, 1),
        fail_on_data_loss=_bool(o, "failondataloss", True),
        reader_id=reader_id,
        pin_ttl_ms=_req_int(o, "pinttlms", 600_000, 1_000),
        fetch_max_messages=_req_int(o, "fetchmaxmessages", 5_000, 1),
        request_timeout_s=_req_int(o, "requesttimeoutms", 30_000, 100) / 1000.0,
        retry_backoff_s=backoff_s,
        retry_backoff_max_s=backoff_max_s,
        authorization=parse_credentials(o),
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
    backoff_s, backoff_max_s = _backoff(o)
    return WriteOptions(
        servers=parse_servers(o.get("servers")),
        topic=topic,
        key_column=o.get("keycolumn") or None,
        qos=qos,
        publish_batch_size=_req_int(o, "publishbatchsize", 5_000, 1),
        publish_retries=_req_int(o, "publishretries", 10, 0),
        request_timeout_s=_req_int(o, "requesttimeoutms", 60_000, 100) / 1000.0,
        retry_backoff_s=backoff_s,
        retry_backoff_max_s=backoff_max_s,
        max_task_rows=_req_int(o, "maxtaskrows", 1_000_000, 1),
        authorization=parse_credentials(o),
    )
