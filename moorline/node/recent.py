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


class RecentMessages:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._items: OrderedDict[tuple[int, int], tuple[StoredMessage, int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, shard: int, offset: int, msg: StoredMessage) -> None:
        size = len(msg.payload) + len(msg.topic) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        items = self._items
        key = (shard, offset)
        old = items.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        items[key] = (msg, size)
        self.used_bytes += size
        while self.used_bytes > self.max_bytes:
            _, (_, dropped) = items.popitem(last=False)
            self.used_bytes -= dropped

    def get(self, shard: int, offset: int) -> StoredMessage | None:
        hit = self._items.get((shard, offset))
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        return hit[0]

    def drop(self, shard: int, offsets: Iterable[int]) -> None:
        items = self._items
        for offset in offsets:
            old = items.pop((shard, offset), None)
            if old is not None:
                self.used_bytes -= old[1]
