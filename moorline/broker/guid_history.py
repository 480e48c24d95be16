"""The shard's history of accepted message GUIDs, for de-duplication decided at apply (pure).

Each entry is (principal, GUID) -> (offset, entry time, content CRC), oldest first, so the window
(``dedup.history_window``, by entry time) and the count bound (``dedup.max_history``) both cut
from the front. Kept as one bytes key per entry and columns for the rest: about 150 bytes an
entry, where a tuple key, a tuple value and an ordered-dict node cost about 300.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator

from moorline.broker.columns import column_bytes, column_from
from moorline.invariant import violated

GUID_BYTES = 16
_COMPACT_MIN = 4096  # cut the evicted prefix of the columns once it is this long and half of them


class GuidHistory:
    __slots__ = ("_seq", "_keys", "_first", "_head", "_offset", "_ts", "_crc")

    def __init__(self) -> None:
        # Keys are ``key_of(principal, GUID)``.
        self._seq: dict[bytes, int] = {}  # key -> sequence number (position + _first - _head)
        self._keys: deque[bytes] = deque()  # keys, oldest first
        self._first = 0  # sequence number of the oldest entry
        self._head = 0  # column position of the oldest entry
        self._offset = array("q")
        self._ts = array("q")
        self._crc = array("q")

    def __len__(self) -> int:
        return len(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def get(self, principal: str, guid: bytes) -> tuple[int, int, int] | None:
        """(offset, entry time, content CRC) of an accepted publish, or None."""
        return self.get_key(self.key_of(principal, guid))

    def get_key(self, key: bytes) -> tuple[int, int, int] | None:
        """``get`` by a ``key_of`` key."""
        seq = self._seq.get(key)
        if seq is None:
            return None
        i = seq - self._first + self._head
        return self._offset[i], self._ts[i], self._crc[i]

    @staticmethod
    def key_of(principal: str, guid: bytes) -> bytes:
        """GUIDs are fixed-length, so GUID + principal is unambiguous; most publishers share
        principal "", whose key is the GUID itself."""
        return guid + principal.encode() if principal else guid

    def add(self, principal: str, guid: bytes, offset: int, ts_ms: int, crc: int) -> None:
        if len(guid) != GUID_BYTES:
            violated(f"GUID history: add of a {len(guid)}-byte GUID")
        self.add_run([self.key_of(principal, guid)], [offset], [ts_ms], [crc])

    def add_run(self, keys: list[bytes], offsets: list[int], ts_ms: list[int], crcs: list[int]) -> None:
        """Add entries (``key_of`` keys, none present yet, newest last): one ``fromlist`` per column, for a
        run of publishes applied at once."""
        count = len(keys)
        seq = self._seq
        before = len(seq)
        first_seq = self._first + len(self._keys)
        seq.update(zip(keys, range(first_seq, first_seq + count), strict=True))
        if (len(seq) != before + count or not len(offsets) == len(ts_ms) == len(crcs) == count
                or (count and min(map(len, keys)) < GUID_BYTES)):
            violated(f"GUID history: add of {count} keys, {len(seq) - before} of them new")
        self._keys.extend(keys)
        self._offset.fromlist(offsets)
        self._ts.fromlist(ts_ms)
        self._crc.fromlist(crcs)

    def oldest_ts(self) -> int | None:
        return self._ts[self._head] if self._keys else None

    def evict(self, before_ts_ms: int, max_entries: int) -> int:
        """Drop the oldest entries while older than ``before_ts_ms`` or more than ``max_entries``."""
        keys = self._keys
        ts = self._ts
        dropped = 0
        while keys and (ts[self._head] < before_ts_ms or len(keys) > max_entries):
            del self._seq[keys.popleft()]
            self._head += 1
            self._first += 1
            dropped += 1
        if not keys:
            self._head = 0
            self._offset, self._ts, self._crc = array("q"), array("q"), array("q")
        elif self._head >= _COMPACT_MIN and self._head * 2 >= len(self._ts):
            h = self._head
            del self._offset[:h], self._ts[:h], self._crc[:h]
            self._head = 0
        return dropped

    def items(self) -> Iterator[tuple[str, bytes, int, int, int]]:
        """(principal, GUID, offset, entry time, CRC), oldest first."""
        h = self._head
        for i, key in enumerate(self._keys):
            yield key[GUID_BYTES:].decode(), key[:GUID_BYTES], self._offset[h + i], self._ts[h + i], self._crc[h + i]

    # --- snapshots -------------------------------------------------------------------------------
    def to_columns(self) -> tuple[list[bytes], bytes, bytes, bytes]:
        h = self._head
        return list(self._keys), column_bytes(self._offset, h), column_bytes(self._ts, h), column_bytes(self._crc, h)

    @classmethod
    def from_columns(cls, data: tuple[list[bytes], bytes, bytes, bytes]) -> GuidHistory:
        keys, offsets, ts, crcs = data
        history = cls()
        history._offset, history._ts, history._crc = column_from(offsets), column_from(ts), column_from(crcs)
        if not len(history._offset) == len(history._ts) == len(history._crc) == len(keys):
            raise ValueError("GUID history snapshot: columns of different lengths")
        history._keys = deque(keys)
        history._seq = {k: i for i, k in enumerate(keys)}
        if len(history._seq) != len(keys) or any(len(k) < GUID_BYTES for k in keys):
            raise ValueError("GUID history snapshot: duplicate or short keys")
        return history


__all__ = ["GuidHistory"]
