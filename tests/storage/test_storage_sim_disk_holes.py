"""The simulator's disk (moorline/sim/disk.py) models page holes as the WAL meets them: a power loss
that zeroes a record of the unfinished write while later records of it survive is a torn tail, not
corruption; damage in a synced batch still is corruption."""

from __future__ import annotations

import random

from moorline.raft import Entry, HardState
from moorline.sim.disk import DiskParams, Record, SimDisk, batch_record


def rec(i: int) -> Record:
    return batch_record([Entry(1, i, data=b"x" * 20)], HardState(term=1, commit=i))


def indexes(records: list[Record]) -> list[int]:
    return [r.entries[0].index for r in records]


def disk_with_unsynced_write(synced: int, unsynced: int) -> SimDisk:
    d = SimDisk(DiskParams())
    for i in range(1, synced + 1):
        d.write(rec(i))
        d.sync()
    for i in range(synced + 1, synced + unsynced + 1):
        d.write(rec(i))
    return d


def test_records_carry_their_sync_batch() -> None:
    d = disk_with_unsynced_write(3, 2)
    assert [r.batch for r in d.durable + d.pending] == [0, 1, 2, 3, 3]


def test_a_hole_in_the_unsynced_write_before_records_that_survived_is_a_torn_tail() -> None:
    d = disk_with_unsynced_write(3, 4)
    d.pending[1] = d.pending[1].damaged(bytes(len(d.pending[1].body)))  # its page never arrived
    r = d.recover()
    assert r.corrupt_at is None and r.torn_tail_truncated
    assert indexes(r.records) == [1, 2, 3, 4]
    assert indexes(d.durable + d.pending) == [1, 2, 3, 4]  # the image was cut there


def test_a_hole_in_a_synced_batch_is_still_corruption() -> None:
    d = disk_with_unsynced_write(5, 2)
    d.durable[3] = d.durable[3].damaged(bytes(len(d.durable[3].body)))
    r = d.recover()
    assert r.corrupt_at == 3 and not r.torn_tail_truncated


def test_crashes_make_page_holes_and_recovery_takes_them_for_torn_tails() -> None:
    holes = 0
    for seed in range(200):
        d = disk_with_unsynced_write(3, 6)
        d.params = DiskParams(torn_write_p=0.0, keep_pending_p=1.0, page_hole_p=1.0)
        d.crash(random.Random(seed))
        kept = d.pending
        if any(not r.valid() for r in kept[:-1]):
            holes += 1
        r = d.recover()
        assert r.corrupt_at is None
        got = indexes(r.records)
        assert got[:3] == [1, 2, 3] and got == list(range(1, len(got) + 1))  # synced kept, a prefix
        assert all(x.valid() for x in r.records)
    assert holes >= 50
