"""WAL and message-store micro benchmark.

    python bench/wal_bench.py [--seconds 3] [--dir /tmp/x]

Prints, per scenario: entries/s, µs per 100-byte entry (append + its share of sync), syncs/s.
Scenarios: group commit of N entries per sync on one group, the same spread over 16 groups,
append-only (no sync: the encoding cost alone), syncs on a second thread while the main thread
appends (the node's shape), recovery speed, and message-store append/get.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from moorline.storage.msgstore import MessageStore
from moorline.storage.wal import WriteAheadLog

PAYLOAD = b"x" * 100


def run_group_commit(d: Path, seconds: float, per_sync: int, groups: int) -> tuple[int, int, float]:
    w = WriteAheadLog(d)
    w.open()
    next_index = dict.fromkeys(range(groups), 1)
    entries = syncs = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for k in range(per_sync):
            g = k % groups
            i = next_index[g]
            w.append_entries(g, [(1, i, 0, PAYLOAD)])
            next_index[g] = i + 1
        for g in range(groups):
            w.set_hard_state(g, 1, b"", next_index[g] - 1)
        w.sync()
        entries += per_sync
        syncs += 1
    elapsed = time.perf_counter() - start
    w.close()
    return entries, syncs, elapsed


def run_batched_append(d: Path, seconds: float, batch: int) -> tuple[int, float]:
    """One append_entries call per batch of entries (how Raft's Ready hands them over), no sync."""
    w = WriteAheadLog(d, max_pending_bytes=1 << 40)
    w.open()
    i = 1
    entries = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        w.append_entries(0, [(1, j, 0, PAYLOAD) for j in range(i, i + batch)])
        i += batch
        entries += batch
        if w.pending_bytes() > 32 << 20:
            w._pending.clear()  # encoding cost only: drop instead of writing
            w._pending_bytes = 0
    elapsed = time.perf_counter() - start
    return entries, elapsed


def run_threaded(d: Path, seconds: float, groups: int) -> tuple[int, int, float]:
    """Main thread appends as fast as it can; a sync thread syncs back to back (group commit)."""
    w = WriteAheadLog(d)
    w.open()
    stop = threading.Event()
    syncs = [0]

    def syncer() -> None:
        last = 0
        while not stop.is_set():
            seq = w.sync()
            if seq != last:  # a sync with nothing pending does no fdatasync
                syncs[0] += 1
                last = seq
            else:
                time.sleep(0.0001)

    t = threading.Thread(target=syncer)
    t.start()
    i = 1
    entries = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for g in range(groups):
            w.append_entries(g, [(1, i, 0, PAYLOAD)])
        i += 1
        entries += groups
        while w.pending_bytes() > 16 << 20:
            time.sleep(0.001)
    elapsed = time.perf_counter() - start
    stop.set()
    t.join()
    w.close()
    return entries, syncs[0], elapsed


def run_raw_fdatasync(d: Path, seconds: float) -> float:
    """The disk's own rate: write 150 bytes + fdatasync, in a loop (the floor for everything)."""
    d.mkdir(parents=True)
    fd = os.open(d / "raw", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        os.write(fd, b"r" * 150)
        os.fdatasync(fd)
        n += 1
    elapsed = time.perf_counter() - start
    os.close(fd)
    return n / elapsed


def run_recovery(d: Path) -> tuple[int, float]:
    start = time.perf_counter()
    rec = WriteAheadLog(d).open()
    elapsed = time.perf_counter() - start
    return sum(len(g.entries) for g in rec.groups.values()), elapsed


def run_store(d: Path, seconds: float) -> tuple[int, float, float]:
    s = MessageStore(d)
    s.open()
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        s.append(n, PAYLOAD)
        n += 1
    append_s = time.perf_counter() - start
    s.sync()
    start = time.perf_counter()
    for o in range(n):
        s.get(o)
    get_s = time.perf_counter() - start
    s.close()
    return n, append_s, get_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="walbench-", dir=args.dir))
    try:
        print(f"payload 100 B, {args.seconds:.1f} s per scenario, dir {base}")
        print(
            f"raw write(150 B)+fdatasync baseline:          {run_raw_fdatasync(base / 'raw', args.seconds):>9,.0f} fdatasync/s"
        )
        for per_sync, groups in ((1, 1), (10, 1), (100, 1), (100, 16), (1000, 16)):
            d = base / f"gc-{per_sync}-{groups}"
            n, syncs, el = run_group_commit(d, args.seconds, per_sync, groups)
            print(
                f"group commit {per_sync:>4} entries/sync, {groups:>2} groups: {n / el:>9,.0f} entries/s "
                f"{el / n * 1e6:7.2f} µs/entry  {syncs / el:8,.0f} fdatasync/s"
            )
        n, el = run_batched_append(base / "append", args.seconds, 100)
        print(
            f"append_entries only (100/call, no IO):        {n / el:>9,.0f} entries/s {el / n * 1e6:7.2f} µs/entry"
        )
        n, syncs, el = run_threaded(base / "thr", args.seconds, 16)
        print(
            f"append thread + sync thread, 16 groups:       {n / el:>9,.0f} entries/s "
            f"{el / n * 1e6:7.2f} µs/entry  {syncs / el:8,.0f} fdatasync/s ({n / max(syncs, 1):.0f} entries/sync)"
        )
        n, el = run_recovery(base / "gc-100-16")
        print(
            f"recovery (open) of the 100x16 log:            {n / el:>9,.0f} entries/s ({n:,} entries, {el:.2f} s)"
        )
        n, ap_s, get_s = run_store(base / "store", args.seconds)
        print(
            f"message store append (buffered):              {n / ap_s:>9,.0f} records/s {ap_s / n * 1e6:7.2f} µs/record"
        )
        print(
            f"message store get (cache + disk):             {n / get_s:>9,.0f} records/s {get_s / n * 1e6:7.2f} µs/record"
        )
    finally:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
