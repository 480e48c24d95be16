"""Pure planning of reads: which shards, which offsets, how much per trigger.

An offset (Spark's checkpointed position) is ``{"<shard>": {"incarnation": "<hex>", "offset": N}}``
where ``N`` is the next offset to read. String keys, because offsets round-trip through JSON.
Nothing here does IO: callers pass in the shard table they fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from moorline.hashing import shard_of
from moorline.invariant import invariant
from moorline.spark.node_client import ShardInfo
from moorline.spark.options import EARLIEST, LATEST, MoorlineOptionError, StartSpec

Offsets = dict[str, dict[str, object]]


class MoorlineDataLossError(RuntimeError):
    """Rows between the checkpoint and the shard's complete range are gone (or the shard was rebuilt)."""


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching; ``#``/``+`` at the first level do not match ``$`` topics (MQTT-4.7.2-1)."""
    if topic.startswith("$") and topic_filter[:1] in ("#", "+"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def any_filter_matches(filters: Iterable[str], topic: str) -> bool:
    return any(topic_matches(f, topic) for f in filters)


def relevant_shards(filters: tuple[str, ...], shard_count: int) -> list[int]:
    """Shards that can hold matching topics: the topics' own shards when no filter has a wildcard."""
    if any("+" in f or "#" in f for f in filters):
        return list(range(shard_count))
    return sorted({shard_of(f, shard_count) for f in filters})


def server_filter(filters: tuple[str, ...]) -> str | None:
    """The filter the node can apply for us (it takes one); with several we filter ourselves."""
    return filters[0] if len(filters) == 1 else None


def _pos(inc: str, offset: int) -> dict[str, object]:
    return {"incarnation": inc, "offset": offset}


def get_pos(offsets: Mapping[str, Mapping[str, object]], shard: int) -> tuple[str, int] | None:
    v = offsets.get(str(shard))
    if v is None:
        return None
    inc = v.get("incarnation")
    off = v.get("offset")
    invariant(isinstance(inc, str) and isinstance(off, int), f"malformed offset for shard {shard}: {v!r}")
    assert isinstance(inc, str) and isinstance(off, int)
    return inc, off


def loss_message(shard: int, inc: str, offset: int, info: ShardInfo) -> str:
    if inc != info.incarnation:
        return (
            f"moorline shard {shard} was rebuilt: the checkpoint is in incarnation {inc} but the shard is now "
            f"incarnation {info.incarnation}, whose earliest complete offset is {info.low_water}. Rows of the old "
            f"incarnation after offset {offset} may be lost. Set failOnDataLoss=false to continue from there."
        )
    return (
        f"moorline shard {shard}: offset {offset} is below the shard's complete range; the earliest complete "
        f"offset is {info.low_water}, so rows {offset}..{info.low_water - 1} are gone (retention removed them). "
        f"Set failOnDataLoss=false to skip to offset {info.low_water}, or start a new query."
    )


def resolve_spec(
    spec: StartSpec, shards: Mapping[int, ShardInfo], wanted: list[int], fail_on_data_loss: bool, what: str
) -> Offsets:
    """Turn earliest / latest / user JSON into a full offset for ``wanted`` shards."""
    out: Offsets = {}
    for s in wanted:
        info = shards[s]
        if spec.kind == "earliest":
            out[str(s)] = _pos(info.incarnation, info.low_water)
            continue
        if spec.kind == "latest":
            out[str(s)] = _pos(info.incarnation, info.next_offset)
            continue
        inc, off = spec.per_shard.get(s, (None, EARLIEST))
        if off == EARLIEST:
            off = info.low_water
        elif off == LATEST:
            off = info.next_offset
        inc = info.incarnation if inc is None else inc
        if off > info.next_offset and inc == info.incarnation:
            if what == "endingOffsets":
                # Nothing is missing past the end: the read ends where the shard ends (as "latest").
                off = info.next_offset
            else:
                raise MoorlineOptionError(
                    f"{what}: shard {s} offset {off} is past the shard's end (its next offset is "
                    f"{info.next_offset}); use an offset up to {info.next_offset}, or \"latest\""
                )
        out[str(s)] = _pos(inc, off)
    unknown = sorted(set(spec.per_shard) - set(shards))
    if unknown:
        raise MoorlineOptionError(f"{what}: unknown shard(s) {unknown}; the cluster has {len(shards)} shards")
    return out


def first_offset_at_or_after(
    t_ms: int, low: int, high: int, first_at: Callable[[int], tuple[int, int] | None]
) -> tuple[int, int]:
    """The first offset in [low, high] from which messages were published at or after ``t_ms``
    (``high``, the shard's next offset, when none was), and the number of probes it took.

    ``first_at(o)`` gives (offset, publish time ms) of the first message stored at or after
    offset ``o``, or None. Publish times grow with offsets (the node stamps them when it receives
    the message), so this is a binary search: at most about log2(high - low) + 1 probes.
    """
    lo, hi, probes = low, high, 0
    while lo < hi:
        mid = (lo + hi) // 2
        found = first_at(mid)
        probes += 1
        if found is None or found[1] >= t_ms:
            hi = mid
        else:
            invariant(found[0] >= mid, "the first message at or after an offset is not before it")
            lo = found[0] + 1
    return lo, probes


def clamp_to_complete(
    offsets: Mapping[str, Mapping[str, object]], shards: Mapping[int, ShardInfo], fail_on_data_loss: bool
) -> Offsets:
    """Check every shard's position against its complete range; fail, or skip forward when allowed."""
    out: Offsets = {}
    for key in offsets:
        s = int(key)
        pos = get_pos(offsets, s)
        assert pos is not None
        inc, off = pos
        info = shards.get(s)
        if info is None:
            raise MoorlineDataLossError(f"moorline shard {s} is in the checkpoint but not in the cluster")
        lost = inc != info.incarnation or off < info.low_water
        if lost and fail_on_data_loss:
            raise MoorlineDataLossError(loss_message(s, inc, off, info))
        if inc != info.incarnation:
            out[key] = _pos(info.incarnation, info.low_water)
        else:
            out[key] = _pos(inc, max(off, info.low_water))
    return out


def latest_end(
    start: Mapping[str, Mapping[str, object]], shards: Mapping[int, ShardInfo], max_offsets: int | None
) -> Offsets:
    """The end of the next batch: each shard's next offset, with at most ``max_offsets`` offsets in all.

    ``start`` is already clamped (same incarnations as ``shards``). The budget is shared in
    proportion to each shard's backlog, rounding down, and the remainder goes to the largest
    backlogs first, so a batch always makes progress when anything is pending.
    """
    backlog: dict[str, int] = {}
    for key in start:
        pos = get_pos(start, int(key))
        assert pos is not None
        inc, off = pos
        info = shards[int(key)]
        invariant(inc == info.incarnation, "latest_end needs clamped offsets")
        backlog[key] = max(0, info.next_offset - off)
    total = sum(backlog.values())
    take = dict(backlog)
    if max_offsets is not None and total > max_offsets:
        take = {k: (max_offsets * b) // total for k, b in backlog.items()}
        left = max_offsets - sum(take.values())
        for k in sorted(backlog, key=lambda k: (-(backlog[k] - take[k]), int(k))):
            if left == 0:
                break
            if take[k] < backlog[k]:
                take[k] += 1
                left -= 1
        invariant(sum(take.values()) == max_offsets, "the trigger budget is used exactly")
    out: Offsets = {}
    for key in start:
        pos = get_pos(start, int(key))
        assert pos is not None
        out[key] = _pos(pos[0], pos[1] + take[key])
    return out


@dataclass(frozen=True)
class ShardRange:
    """One input partition: offsets [start, end) of one shard incarnation."""

    shard: int
    incarnation: str
    start: int
    end: int


def plan_ranges(
    start: Mapping[str, Mapping[str, object]],
    end: Mapping[str, Mapping[str, object]],
    shards: Mapping[int, ShardInfo] | None,
    fail_on_data_loss: bool,
) -> list[ShardRange]:
    """The ranges a batch reads. ``shards`` (current table) is used to check the complete range;
    with ``failOnDataLoss=false`` a range is cut to what is still complete."""
    ranges: list[ShardRange] = []
    for key in sorted(end, key=int):
        s = int(key)
        end_pos = get_pos(end, s)
        assert end_pos is not None
        end_inc, end_off = end_pos
        start_pos = get_pos(start, s) or (end_inc, 0)
        start_inc, start_off = start_pos
        if start_inc != end_inc:
            # A skip across a rebuild, planned by latestOffset with failOnDataLoss=false.
            invariant(not fail_on_data_loss, "an incarnation change is planned only when skipping is allowed")
            start_off = 0
        if shards is not None:
            info = shards[s]
            if info.incarnation != end_inc or start_off < info.low_water:
                if fail_on_data_loss:
                    raise MoorlineDataLossError(loss_message(s, end_inc, start_off, info))
                if info.incarnation != end_inc:
                    continue  # the planned incarnation is gone; the next batch moves to the new one
                start_off = info.low_water
        if start_off < end_off:
            ranges.append(ShardRange(s, end_inc, start_off, end_off))
    return ranges


def pin_offsets(offsets: Mapping[str, Mapping[str, object]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in offsets:
        pos = get_pos(offsets, int(key))
        assert pos is not None
        out[key] = pos[1]
    return out
