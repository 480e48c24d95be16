"""Micro-benchmark: the retained messages one SUBSCRIBE gets, found by the scan Register used to do
(every retained topic, sorted, tested with ``matches``) and by the retained-topic trie it uses now.

Run: ``python -m bench.retained_bench [N]`` (default 100,000 retained messages, all in one shard:
the worst case, and what one shard of a busy node may hold). Prints, per filter, the milliseconds of
one Register apply (the event loop is blocked that long) for the old scan and for the index, the best
of a few repeats.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moorline.broker import commands as c  # noqa: E402
from moorline.broker.effects import Effects  # noqa: E402
from moorline.broker.messages import StoredMessage  # noqa: E402
from moorline.broker.shard import ShardState  # noqa: E402
from moorline.broker.topic_state import TopicLimits  # noqa: E402
from moorline.mqtt.topics import matches  # noqa: E402

FILTERS = ["site/7/dev/707/temp", "site/7/#", "site/+/dev/+/temp", "#"]


def build(n: int) -> ShardState:
    s = ShardState(0, "inc0", TopicLimits(shard_max_bytes=1 << 40), 3600)
    fx = Effects()
    rng = random.Random(1)
    for i in range(n):
        topic = f"site/{i % 100}/dev/{i}/{'temp' if i % 2 else 'hum'}"
        s.apply(c.Publish(StoredMessage(topic, b"v" * 16, 1, True, rng.randbytes(16), 1000)), fx)
        fx.clear()
    return s


def best_ms(fn: Callable[[], list[StoredMessage]], repeats: int = 3) -> tuple[float, list[StoredMessage]]:
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000, out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    s = build(n)
    topics = s.topics
    print(f"{len(topics.retained):,} retained messages in one shard")
    for k, flt in enumerate(FILTERS):
        def scan(flt: str = flt) -> list[StoredMessage]:
            return [m for t, m in sorted(topics.retained.items()) if matches(flt, t)]

        def index(flt: str = flt, k: int = k) -> list[StoredMessage]:
            return list(s.apply(c.Register(0, f"c\0{k}", "c", 1, flt, 1), Effects()).retained)

        scan_ms, old = best_ms(scan)
        index_ms, new = best_ms(index)
        assert old == new, flt
        print(f"{flt:<22} {len(new):>7,} matched   scan {scan_ms:8.1f} ms   index {index_ms:8.2f} ms")


if __name__ == "__main__":
    main()
