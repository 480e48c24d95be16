"""Recently applied messages, kept decoded for delivery: node-wide and bounded in bytes.

Almost every delivery is of a message applied moments before. Reading it back from the shard's
message store would cost a copy and a decode per delivery (and, for large payloads, a pread),
so the host keeps the message object it applied. Oldest first out; released messages leave at
once. A miss falls back to the store, so the bound only trades memory for reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from moorline.broker.messages import StoredMessage

# Everything but the payload and topic characters: the message object, its GUID, timestamp and
# payload headers, the key and value tuples and the ordered-dict entry. Measured with tracemalloc
# (100-byte payloads, 8-character topic): 629 bytes an entry in all.
ENTRY_OVERHEAD_BYTES = 520


# Keys pack (shard, offset) into one int: no tuple per put, get or drop. Offsets stay far below
# 2**40 (see broker/topic_state.py); shards are small.
SHARD_SHIFT = 40


class RecentMessages:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        # (shard << SHARD_SHIFT | offset) -> message; a message's charge is recomputed from it when it
        # leaves. Read-only outside this class: the delivery loop looks messages up in it directly
        # (once per delivered message) and reports its hits with ``count_hits``.
        self.by_key: OrderedDict[int, StoredMessage] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.by_key)

    @staticmethod
    def _charge(msg: StoredMessage) -> int:
        return len(msg.payload) + len(msg.topic) + ENTRY_OVERHEAD_BYTES

    def put(self, shard: int, offset: int, msg: StoredMessage) -> None:
        self.put_many(shard, ((offset, b"", msg),))

    def put_many(self, shard: int, appends: Iterable[tuple[int, bytes, StoredMessage]]) -> None:
        """The messages of one apply, as ``Effects.appends`` lists them: (offset, record, message)."""
        items = self.by_key
        max_bytes = self.max_bytes
        base = shard << SHARD_SHIFT
        used = self.used_bytes
        for offset, _record, msg in appends:
            size = len(msg.payload) + len(msg.topic) + ENTRY_OVERHEAD_BYTES  # _charge(msg), inlined
            if size > max_bytes:
                continue
            key = base | offset
            old = items.pop(key, None)
            if old is not None:
                used -= self._charge(old)
            items[key] = msg
            used += size
            while used > max_bytes:
                _, dropped = items.popitem(last=False)
                used -= self._charge(dropped)
        self.used_bytes = used

    def get(self, shard: int, offset: int) -> StoredMessage | None:
        hit = self.by_key.get((shard << SHARD_SHIFT) | offset)
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        return hit

    def count_hits(self, n: int) -> None:
        self.hits += n

    def drop(self, shard: int, offsets: Iterable[int]) -> None:
        items = self.by_key
        base = shard << SHARD_SHIFT
        for offset in offsets:
            old = items.pop(base | offset, None)
            if old is not None:
                self.used_bytes -= self._charge(old)
