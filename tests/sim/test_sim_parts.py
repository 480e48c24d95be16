"""Unit tests of the simulator's parts: virtual time, disk, network, state machine."""

from __future__ import annotations

import random

from moorline.raft import Entry, HardState
from moorline.sim.disk import DiskParams, SimDisk, batch_record
from moorline.sim.loop import EventLoop
from moorline.sim.marks import Marks
from moorline.sim.network import NetParams, SimNetwork
from moorline.sim.statemachine import SimStateMachine, encode_command


# -- virtual time -------------------------------------------------------------------------------
def _order(seed: int) -> list[int]:
    loop = EventLoop(random.Random(seed))
    out: list[int] = []
    for i in range(8):
        loop.call_at(5, out.append, i)
    loop.call_at(1, out.append, -1)
    loop.run_until(10)
    return out


def test_loop_runs_in_time_order_and_shuffles_same_instant_events_by_seed() -> None:
    a = _order(1)
    assert a[0] == -1 and sorted(a[1:]) == list(range(8))
    assert _order(1) == a  # same seed, same order
    assert any(_order(s) != a for s in range(2, 10))  # other seeds shuffle ties differently


def test_loop_cancel_and_stop() -> None:
    loop = EventLoop(random.Random(0))
    out: list[int] = []
    t = loop.call_later(3, out.append, 1)
    loop.call_later(4, out.append, 2)
    loop.call_later(9, out.append, 3)
    t.cancel()
    loop.run_until(100, stop=lambda: len(out) >= 1)
    assert out == [2] and loop.now_ms == 4


# -- disk ---------------------------------------------------------------------------------------
def _rec(i: int) -> object:
    return batch_record([Entry(1, i, data=b"x" * 20)], HardState(term=1, commit=i))


def test_disk_sync_and_crash_loses_only_unsynced_writes() -> None:
    d = SimDisk(DiskParams(keep_pending_p=0.0, torn_write_p=0.0))
    for i in (1, 2):
        d.write(_rec(i))  # type: ignore[arg-type]
    d.sync()
    d.write(_rec(3))  # type: ignore[arg-type]
    lost, torn = d.crash(random.Random(0))
    assert lost == 1 and not torn
    rec = d.recover()
    assert [r.entries[0].index for r in rec.records] == [1, 2] and rec.corrupt_at is None


def test_torn_tail_is_truncated() -> None:
    d = SimDisk(DiskParams(keep_pending_p=1.0, torn_write_p=1.0))
    d.write(_rec(1))  # type: ignore[arg-type]
    d.sync()
    for i in (2, 3):
        d.write(_rec(i))  # type: ignore[arg-type]
    rng = random.Random(3)
    while True:  # find a crash that keeps both pending writes (the last one torn)
        d2 = SimDisk(d.params)
        d2.durable, d2.pending, d2.synced_count = list(d.durable), list(d.pending), d.synced_count
        _lost, torn = d2.crash(rng)
        if torn and len(d2.pending) == 2:
            break
    rec = d2.recover()
    assert rec.torn_tail_truncated and rec.corrupt_at is None
    assert [r.entries[0].index for r in rec.records] == [1, 2]


def test_bit_flip_in_synced_data_is_corruption_not_a_torn_tail() -> None:
    for buggy in (False, True):
        d = SimDisk(DiskParams())
        for i in (1, 2, 3):
            d.write(_rec(i))  # type: ignore[arg-type]
        d.sync()
        rng = random.Random(7)
        assert d.flip_bit(rng)
        rec = d.recover(truncate_synced_corruption=buggy)
        if buggy:  # the broken variant cuts synced data as if it were a torn tail
            assert rec.synced_corruption_truncated and rec.corrupt_at is None
        else:
            assert rec.corrupt_at is not None and not rec.torn_tail_truncated


def test_flip_of_last_synced_record_is_still_corruption() -> None:
    d = SimDisk(DiskParams())
    d.write(_rec(1))  # type: ignore[arg-type]
    d.sync()
    d.flip_bit(random.Random(1))
    assert d.recover().corrupt_at == 0


# -- network ------------------------------------------------------------------------------------
def test_network_partitions_drops_and_duplicates() -> None:
    loop = EventLoop(random.Random(0))
    got: list[tuple[int, object]] = []
    net = SimNetwork(loop, random.Random(0), NetParams(delay_min_ms=1, delay_jitter_ms=0), Marks())
    net.attach(2, lambda src, p: got.append((src, p)))
    net.attach(1, lambda src, p: got.append((src, p)))
    net.block(1, 2)
    net.send(1, 2, "blocked")
    net.send(2, 1, "other way")
    loop.run_until(10)
    assert got == [(2, "other way")]
    net.heal()
    net.params.dup_p = 1.0
    net.send(1, 2, "twice")
    loop.run_until(20)
    assert got.count((1, "twice")) == 2
    net.params.dup_p, net.params.drop_p = 0.0, 1.0
    net.send(1, 2, "dropped")
    net.send(1, 2, "client", reliable=True)
    loop.run_until(30)
    assert (1, "dropped") not in got and (1, "client") in got


# -- state machine --------------------------------------------------------------------------------
def _cmd(*parts: object) -> bytes:
    return encode_command(list(parts))


def test_queue_dedup_at_apply_and_expiry_by_entry_time() -> None:
    sm = SimStateMachine(dedup_window_ms=1_000)
    assert sm.apply(_cmd("enq", 1, 1, 100, "q", "m1", "v"))[2] == ("ok",)
    assert sm.apply(_cmd("enq", 1, 2, 200, "q", "m1", "v"))[2] == ("dup",)
    # beyond the window (by entry time) the id is forgotten
    assert sm.apply(_cmd("enq", 1, 3, 5_000, "q", "m1", "v"))[2] == ("ok",)
    broken = SimStateMachine(dedup_at_apply=False)
    broken.apply(_cmd("enq", 1, 1, 100, "q", "m1", "v"))
    assert broken.apply(_cmd("enq", 1, 2, 200, "q", "m1", "v"))[2] == ("ok",)


def test_queue_fifo_ack_and_redelivery_after_visibility_timeout() -> None:
    sm = SimStateMachine(visibility_ms=100)
    sm.apply(_cmd("enq", 1, 1, 0, "q", "a", "va"))
    sm.apply(_cmd("enq", 1, 2, 0, "q", "b", "vb"))
    assert sm.apply(_cmd("deq", 2, 1, 10, "q"))[2] == ("msg", "a", "va", 1)
    assert sm.apply(_cmd("ack", 2, 2, 20, "q", "a", 1))[2] == ("ok",)
    assert sm.apply(_cmd("deq", 2, 3, 30, "q"))[2] == ("msg", "b", "vb", 1)
    # not acked in time: comes back, with its delivery count raised
    assert sm.apply(_cmd("deq", 2, 4, 500, "q"))[2] == ("msg", "b", "vb", 2)
    assert sm.apply(_cmd("ack", 2, 5, 510, "q", "b", 1))[2] == ("stale",)
    assert sm.apply(_cmd("ack", 2, 6, 510, "q", "b", 2))[2] == ("ok",)
    assert sm.apply(_cmd("deq", 2, 7, 2_000, "q"))[2] == ("empty",)


def test_register_and_canonical_snapshots() -> None:
    sm = SimStateMachine()
    sm.apply(_cmd("put", 1, 1, 0, "k", "a"))
    assert sm.apply(_cmd("cas", 1, 2, 0, "k", "x", "b"))[2] == ("fail", "a")
    assert sm.apply(_cmd("cas", 1, 3, 0, "k", "a", "b"))[2] == ("ok",)
    sm.apply(_cmd("enq", 1, 4, 0, "q", "m", "v"))
    snap = sm.snapshot()
    other = SimStateMachine()
    other.restore(snap)
    assert other.snapshot() == snap and other.read("k") == "b"
