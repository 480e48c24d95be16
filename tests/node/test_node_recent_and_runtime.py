"""The recent-message cache's byte bound and the process tuning's configuration."""

from __future__ import annotations

import gc
import sys

import pytest

from moorline.broker.messages import StoredMessage
from moorline.config import ConfigError, RuntimeConfig, load_config
from moorline.node.runtime import tune_allocator, tune_gc
from moorline.node.sessions.recent import ENTRY_OVERHEAD_BYTES, RecentMessages


def msg(i: int, size: int = 100) -> StoredMessage:
    return StoredMessage("t", bytes(size), 1, False, i.to_bytes(16, "big"), 0)


def entry_bytes(size: int) -> int:
    return size + 1 + ENTRY_OVERHEAD_BYTES


def test_recent_messages_bound_counts_what_the_entries_really_take() -> None:
    # The byte bound is only a bound if each entry is charged what it costs: traced allocations of
    # entries shaped like a broker's (fresh topic, GUID, payload and timestamp objects) stay under it.
    import os
    import tracemalloc

    r = RecentMessages(1 << 40)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5_000):
            m = StoredMessage("".join(["bench/", "w1"]), os.urandom(100), 1, False, os.urandom(16),
                              1_790_000_000_000 + i, None, None, "publisher-1")
            r.put(3, 1_000 + i, m)
            del m
        real = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert real <= r.used_bytes * 1.05, (real / 5_000, r.used_bytes / 5_000)


def test_recent_messages_stay_within_their_byte_bound_oldest_out_first() -> None:
    cap = 10 * entry_bytes(100)
    r = RecentMessages(cap)
    for i in range(25):
        r.put(0, i, msg(i))
        assert r.used_bytes <= cap
    assert len(r) == 10
    assert r.get(0, 14) is None and r.get(0, 15) is not None and r.get(0, 24) is not None
    assert (r.hits, r.misses) == (2, 1)


def test_recent_messages_drop_and_oversized_and_shards_are_separate() -> None:
    r = RecentMessages(5 * entry_bytes(100))
    r.put(0, 1, msg(1))
    r.put(1, 1, msg(2))
    got = r.get(1, 1)
    assert got is not None and got.guid == (2).to_bytes(16, "big")
    r.drop(0, [1, 99])
    assert r.get(0, 1) is None and r.get(1, 1) is not None
    r.put(0, 2, msg(3, size=10_000))  # larger than the whole bound: not kept, nothing evicted
    assert r.get(0, 2) is None and len(r) == 1
    r.drop(1, [1])
    assert len(r) == 0 and r.used_bytes == 0


def test_replacing_an_entry_does_not_leak_its_bytes() -> None:
    r = RecentMessages(1 << 20)
    for _ in range(3):
        r.put(0, 7, msg(7))
    assert r.used_bytes == entry_bytes(100)


def test_runtime_config_is_validated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nmalloc_mmap_threshold_bytes = 1073741824\n")
    with pytest.raises(ConfigError, match="32 MiB"):
        load_config(bad, {})
    typo = tmp_path / "typo.toml"
    typo.write_text("[runtime]\ngc_young = 5\n")
    with pytest.raises(ConfigError, match="unknown configuration key"):
        load_config(typo, {})


def test_tune_gc_sets_threshold_and_freezes() -> None:
    before = gc.get_threshold()
    try:
        tune_gc(RuntimeConfig(gc_young_threshold=12_345))
        assert gc.get_threshold()[0] == 12_345
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_allocator_is_accepted_by_glibc() -> None:
    assert tune_allocator(RuntimeConfig()) is True
