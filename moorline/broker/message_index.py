"""Per-message metadata of a shard's present messages, kept in columns by dense offset (pure).

A shard keeps the metadata of every message it still stores (retention keeps unowed messages for
``retention.min_age``, an hour by default), so its memory grows with the publish rate times the
retention time. One object plus one dict entry per message cost about 230 bytes and the topic
string another 60; columns cost about 45 bytes (8 time, 8 size, 8 expiry, 1 flags, 16 GUID, 8 for
a reference to the interned topic), which is what makes an hour of retention fit in memory.

Offsets are appended in increasing order and released in any order; the released prefix is cut off
once it is long enough to be worth a copy.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from moorline.broker.columns import column_bytes, column_from
from moorline.invariant import violated

_PRESENT = 0x80
_QOS_MASK = 0x03
NO_EXPIRY = -1  # the expiry column's value for a message without one
# Cutting the released prefix copies every column: do it once the prefix is at least this long
# and at least half of what is kept, so each entry is copied O(1) times on average.
_COMPACT_MIN = 4096


@dataclass(slots=True, frozen=True)
class MessageMeta:
    ts_ms: int
    size: int
    guid: bytes
    topic: str
    qos: int
    expires_at_ms: int | None


class MessageIndex:
    """A mapping offset -> ``MessageMeta`` of present messages, ascending by offset."""

    __slots__ = ("_base", "_head", "_count", "_ts", "_size", "_exp", "_flags", "_guid", "_topic")
    _base: int
    _head: int
    _count: int
    _ts: array
    _size: array
    _exp: array
    _flags: bytearray
    _guid: bytearray
    _topic: list[str]

    def __init__(self) -> None:
        self._reset(0)

    # --- mapping-like reads ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def _pos(self, offset: int) -> int:
        """Column position of a present ``offset``, or -1."""
        i = offset - self._base
        if self._head <= i < len(self._flags) and self._flags[i] & _PRESENT:
            return i
        return -1

    def __contains__(self, offset: object) -> bool:
        return isinstance(offset, int) and self._pos(offset) >= 0

    def get(self, offset: int) -> MessageMeta | None:
        i = self._pos(offset)
        if i < 0:
            return None
        exp = self._exp[i]
        return MessageMeta(self._ts[i], self._size[i], bytes(self._guid[16 * i:16 * i + 16]), self._topic[i],
                           self._flags[i] & _QOS_MASK, None if exp == NO_EXPIRY else exp)

    def ts_of(self, offset: int) -> int | None:
        i = self._pos(offset)
        return None if i < 0 else self._ts[i]

    def time_keys(self, offsets: Iterable[int], shift: int) -> list[int]:
        """``ts_of(o) << shift | o`` for each present offset ``o``, in order (absent ones skipped):
        ``ts_of`` for a run of acknowledged messages, without a call per offset."""
        base, head, end = self._base, self._head, len(self._flags)
        flags, ts = self._flags, self._ts
        keys: list[int] = []
        for offset in offsets:
            i = offset - base
            if head <= i < end and flags[i] & _PRESENT:
                keys.append((ts[i] << shift) | offset)
        return keys

    def size_of(self, offset: int) -> int | None:
        i = self._pos(offset)
        return None if i < 0 else self._size[i]

    def expires_at(self, offset: int) -> int | None:
        """Expiry time of a present message (None when it has none or is not present)."""
        i = self._pos(offset)
        if i < 0:
            return None
        exp = self._exp[i]
        return None if exp == NO_EXPIRY else exp

    def guid_of(self, offset: int) -> bytes | None:
        i = self._pos(offset)
        return None if i < 0 else bytes(self._guid[16 * i:16 * i + 16])

    def __iter__(self) -> Iterator[int]:
        flags = self._flags
        base = self._base
        for i in range(self._head, len(flags)):
            if flags[i] & _PRESENT:
                yield base + i

    def __reversed__(self) -> Iterator[int]:
        flags = self._flags
        base = self._base
        for i in range(len(flags) - 1, self._head - 1, -1):
            if flags[i] & _PRESENT:
                yield base + i

    def times(self) -> Iterator[tuple[int, int, int | None]]:
        """(offset, ts_ms, expires_at_ms) of every present message, ascending (no objects built)."""
        flags, ts, exp, base = self._flags, self._ts, self._exp, self._base
        for i in range(self._head, len(flags)):
            if flags[i] & _PRESENT:
                e = exp[i]
                yield base + i, ts[i], None if e == NO_EXPIRY else e

    def items(self) -> Iterator[tuple[int, MessageMeta]]:
        for offset in self:
            meta = self.get(offset)
            assert meta is not None
            yield offset, meta

    # --- writes ---------------------------------------------------------------------------------
    def add(self, offset: int, ts_ms: int, size: int, guid: bytes, topic: str, qos: int,
            expires_at_ms: int | None) -> None:
        """Record a new message; offsets only grow (gaps are messages never present here)."""
        self.add_run(offset, [ts_ms], [size], guid, [topic], [qos],
                     [NO_EXPIRY if expires_at_ms is None else expires_at_ms])

    def add_run(self, first_offset: int, ts_ms: list[int], sizes: list[int], guids: bytes, topics: list[str],
                qos: list[int], expires_at_ms: list[int]) -> None:
        """Record the new messages ``first_offset``, ``first_offset + 1``, ...: one entry of each list
        per message (``guids`` concatenated, ``NO_EXPIRY`` for none). One call per column instead
        of an append per message and column: a shard applies a run of publishes at once."""
        count = len(ts_ms)
        end = self._base + len(self._flags)
        if (first_offset < end or count == 0 or len(guids) != 16 * count
                or not len(sizes) == len(topics) == len(qos) == len(expires_at_ms) == count
                or min(qos) < 0 or max(qos) > 2):
            violated(f"message index: add of {count} at offset {first_offset} (next free {end}), "
                     f"{len(guids)} bytes of GUIDs, qos {sorted(set(qos))}")
        if self._count == 0:
            self._reset(first_offset)  # nothing present: start the columns at this offset
        elif first_offset > end:
            self._pad(first_offset - end)
        self._ts.fromlist(ts_ms)
        self._size.fromlist(sizes)
        self._exp.fromlist(expires_at_ms)
        self._flags += bytes(map(_PRESENT.__or__, qos))
        self._guid += guids
        self._topic.extend(map(sys.intern, topics))  # one string per distinct topic, not per message
        self._count += count

    def discard(self, offset: int) -> bool:
        """Forget a message; False when it was not present."""
        i = self._pos(offset)
        if i < 0:
            return False
        self._flags[i] = 0
        self._topic[i] = ""
        self._count -= 1
        if self._count == 0:
            self._reset(self._base + len(self._flags))
            return True
        if i == self._head:
            flags = self._flags
            head = i + 1
            while not flags[head] & _PRESENT:  # count > 0: a present entry follows
                head += 1
            self._head = head
            if head >= _COMPACT_MIN and head * 2 >= len(flags):
                self._cut_prefix()
        return True

    def _reset(self, base: int) -> None:
        """Empty columns starting at offset ``base``."""
        self._base = base  # offset of column position 0
        self._head = 0  # no present entry lies before this position
        self._count = 0
        self._ts = array("q")
        self._size = array("q")
        self._exp = array("q")
        self._flags = bytearray()
        self._guid = bytearray()
        self._topic = []

    def _pad(self, n: int) -> None:
        self._ts.extend([0] * n)
        self._size.extend([0] * n)
        self._exp.extend([NO_EXPIRY] * n)
        self._flags += bytes(n)
        self._guid += bytes(16 * n)
        self._topic.extend([""] * n)

    def _cut_prefix(self) -> None:
        h = self._head
        del self._ts[:h], self._size[:h], self._exp[:h], self._flags[:h], self._guid[:16 * h], self._topic[:h]
        self._base += h
        self._head = 0

    # --- snapshots (canonical: from the first present entry to the last one) --------------------
    def to_columns(self) -> tuple[int, bytes, bytes, bytes, bytes, bytes, list[str]]:
        if self._count == 0:
            return (0, b"", b"", b"", b"", b"", [])
        lo = self._head
        hi = len(self._flags)
        while not self._flags[hi - 1] & _PRESENT:
            hi -= 1
        return (self._base + lo, column_bytes(self._ts, lo, hi), column_bytes(self._size, lo, hi),
                column_bytes(self._exp, lo, hi), bytes(self._flags[lo:hi]),
                bytes(self._guid[16 * lo:16 * hi]), self._topic[lo:hi])

    @classmethod
    def from_columns(cls, data: tuple[int, bytes, bytes, bytes, bytes, bytes, list[str]]) -> MessageIndex:
        base, ts, size, exp, flags, guid, topics = data
        index = cls()
        n = len(flags)
        if n == 0:
            return index
        index._base = base
        index._ts, index._size, index._exp = column_from(ts), column_from(size), column_from(exp)
        index._flags = bytearray(flags)
        index._guid = bytearray(guid)
        index._topic = [sys.intern(t) for t in topics]
        if {len(index._ts), len(index._size), len(index._exp), len(index._topic)} != {n} or len(guid) != 16 * n:
            raise ValueError("message index snapshot: columns of different lengths")
        index._count = sum(1 for f in index._flags if f & _PRESENT)
        if index._count == 0 or not flags[0] & _PRESENT or not flags[-1] & _PRESENT:
            raise ValueError("message index snapshot: not cut to its first and last present entries")
        return index


__all__ = ["MessageIndex", "MessageMeta"]
