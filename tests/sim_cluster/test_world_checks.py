"""The cluster simulator's world-state checks (moorline/sim/cluster/world_checks.py) and the taps
that feed them: each check passes on what the node code does and fails on a planted break."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.cluster.wire import Heartbeats, Payload, RaftMessages, encode_frame, preamble
from moorline.mqtt import codec
from moorline.mqtt import packets as p
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import ApplyHooks, ShardHost
from moorline.raft import Message, MessageType
from moorline.raft.coalesce import HeartbeatBatch
from moorline.raft.types import ReadState
from moorline.sim.cluster.world import TimedSync, _FrameTap, _MqttTap
from moorline.sim.cluster.world_checks import (
    DurableAtSend,
    PinCheck,
    PromiseLedger,
    ReadBarrierCheck,
    RecoveredLogCheck,
    canonical_state_findings,
    watch_barriers,
)
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog

MT = MessageType
A, B = (1, "a"), (2, "b")


# --- durable promises ---------------------------------------------------------------------------
def _acked(ledger: PromiseLedger, term: int = 3, index: int = 10, entry_term: int = 3) -> None:
    ledger.on_send("n1", 0, Message(type=MT.APP_RESP, from_=A, to=B, term=term, index=index),
                   lambda i: entry_term if i == index else None)


def test_a_restart_that_kept_what_it_acknowledged_passes() -> None:
    ledger = PromiseLedger()
    _acked(ledger)
    ledger.on_send("n1", 0, Message(type=MT.VOTE_RESP, from_=A, to=B, term=3), lambda i: None)
    ledger.on_recovered("n1", 0, 3, B, 0, 12, lambda i: 3)
    ledger.on_recovered("n1", 0, 4, None, 0, 8, lambda i: 2)  # a later term: free to have been truncated
    assert ledger.findings == []
    assert ledger.recoveries_checked == 2


def test_a_recovered_log_that_lost_an_acknowledged_entry_is_caught() -> None:
    ledger = PromiseLedger()
    _acked(ledger)
    ledger.on_recovered("n1", 0, 3, None, 0, 9, lambda i: 3)  # the log ends before entry 10
    assert [k for k, _ in ledger.findings] == ["promise_broken"]
    assert "acknowledged entries up to 10" in ledger.findings[0][1]


def test_an_acknowledged_entry_recovered_with_another_term_is_caught() -> None:
    ledger = PromiseLedger()
    _acked(ledger, entry_term=3)
    ledger.on_recovered("n1", 0, 3, None, 0, 10, lambda i: 2)
    assert len(ledger.findings) == 1 and "holding term 2" in ledger.findings[0][1]


def test_an_acknowledged_entry_under_the_recovered_snapshot_is_covered() -> None:
    ledger = PromiseLedger()
    _acked(ledger)
    ledger.on_recovered("n1", 0, 3, None, 10, 10, lambda i: 0)
    assert ledger.findings == []


def test_a_granted_vote_forgotten_at_restart_is_caught() -> None:
    ledger = PromiseLedger()
    ledger.on_send("n1", 0, Message(type=MT.VOTE_RESP, from_=A, to=B, term=5), lambda i: None)
    ledger.on_recovered("n1", 0, 5, None, 0, 0, lambda i: None)
    assert len(ledger.findings) == 1 and "free to vote again" in ledger.findings[0][1]


def test_a_term_recovered_below_one_sent_in_is_caught_and_pre_votes_promise_nothing() -> None:
    ledger = PromiseLedger()
    ledger.on_send("n1", 0, Message(type=MT.PRE_VOTE_RESP, from_=A, to=B, term=9), lambda i: None)
    ledger.on_send("n1", 0, Message(type=MT.APP_RESP, from_=A, to=B, term=6, reject=True), lambda i: None)
    ledger.on_recovered("n1", 0, 6, None, 0, 0, lambda i: None)
    assert ledger.findings == []
    ledger.on_recovered("n1", 0, 5, None, 0, 0, lambda i: None)
    assert len(ledger.findings) == 1 and "sent messages in term 6" in ledger.findings[0][1]


def test_two_votes_in_one_term_are_caught() -> None:
    ledger = PromiseLedger()
    ledger.on_send("n1", 0, Message(type=MT.VOTE_RESP, from_=A, to=B, term=5), lambda i: None)
    ledger.on_send("n1", 0, Message(type=MT.VOTE_RESP, from_=A, to=(3, "c"), term=5), lambda i: None)
    assert len(ledger.findings) == 1


# --- recovered logs ----------------------------------------------------------------------------
def _log(terms: dict[int, int]) -> Callable[[int], int]:
    return lambda i: terms.get(i, 0)


def test_a_recovered_log_that_matches_the_committed_entries_passes() -> None:
    check = RecoveredLogCheck()
    check.sample("n2", 0, 6, 1, _log({i: 1 if i <= 3 else 2 for i in range(1, 9)}))
    assert check.entries_recorded == 6
    # n1 restarts from a snapshot at 4 (term 2), entries 5..8, commit 6: as the group committed them.
    check.on_recovered("n1", 0, 4, 2, 6, 8, _log({5: 2, 6: 2, 7: 2, 8: 3}))
    assert check.findings == [] and check.logs_checked == 1


def test_a_deposed_tail_after_a_snapshot_is_reported() -> None:
    """``install_keeps_deposed_tail``: a leader's snapshot at 10 (term 4) installed, the deposed
    leader's entries 11..12 of term 2 left in the WAL after it and recovered at the restart."""
    check = RecoveredLogCheck()
    check.on_recovered("n1", 0, 10, 4, 10, 12, _log({11: 2, 12: 2}))
    assert [k for k, _ in check.findings] == ["recovered_log_differs"]
    assert "entry 11 of term 2" in check.findings[0][1]


def test_a_recovered_entry_at_or_below_the_commit_index_must_be_the_committed_one() -> None:
    check = RecoveredLogCheck()
    check.sample("n2", 0, 5, 1, _log({1: 1, 2: 1, 3: 2, 4: 2, 5: 2}))
    check.on_recovered("n1", 0, 0, 0, 3, 6, _log({1: 1, 2: 1, 3: 1, 4: 3, 5: 3, 6: 3}))  # 3: term 1, not 2
    assert [k for k, _ in check.findings] == ["recovered_log_differs"]
    ok = RecoveredLogCheck(committed=dict(check.committed))
    ok.on_recovered("n1", 0, 0, 0, 2, 6, _log({1: 1, 2: 1, 3: 1, 4: 3, 5: 3, 6: 3}))  # beyond commit: may differ
    assert ok.findings == []


def test_two_replicas_committing_different_terms_at_one_index_is_reported() -> None:
    check = RecoveredLogCheck()
    check.sample("n1", 0, 3, 1, _log({1: 1, 2: 1, 3: 1}))
    check.sample("n2", 0, 3, 1, _log({1: 1, 2: 1, 3: 2}))
    assert [k for k, _ in check.findings] == ["committed_entries_differ"]
    check.sample("n2", 0, 3, 1, _log({1: 1, 2: 1, 3: 2}))  # a sample goes on from where the last one stopped
    assert len(check.findings) == 1


# --- the taps: what the checks and aimed crashes see -----------------------------------------------
def test_the_frame_tap_reads_raft_messages_written_in_pieces() -> None:
    m1 = Message(type=MT.APP_RESP, from_=A, to=B, term=2, index=7)
    m2 = Message(type=MT.VOTE_RESP, from_=A, to=B, term=3)
    wire = (preamble() + encode_frame(Payload("member", b"x" * 50)) + encode_frame(RaftMessages([(1, m1)]))
            + encode_frame(Heartbeats(HeartbeatBatch(1, 2, []))) + encode_frame(RaftMessages([(4, m2)])))
    seen: list[tuple[int, Message]] = []
    tap = _FrameTap(lambda g, m: seen.append((g, m)))
    rng = random.Random(1)
    pos = 0
    while pos < len(wire):
        step = rng.randint(1, 9)
        tap.feed(wire[pos:pos + step])
        pos += step
    assert seen == [(1, m1), (4, m2)]


def test_the_mqtt_tap_names_each_packet_written_in_pieces() -> None:
    wire = (codec.encode_puback(7) + codec.encode(p.Publish(topic="t", payload=b"y" * 300, qos=1, packet_id=3),
                                                  codec.MQTT_5)
            + codec.encode_pubrec(8))
    seen: list[int] = []
    tap = _MqttTap(seen.append)
    for i in range(0, len(wire), 5):
        tap.feed(wire[i:i + 5])
    assert seen == [4, 3, 5]


def test_a_timed_sync_completes_after_its_duration_and_not_before() -> None:
    synced: list[float] = []

    class Wal:
        def sync(self) -> int:
            synced.append(asyncio.get_running_loop().time())
            return 42

    async def body() -> None:
        loop = asyncio.get_running_loop()
        runner = TimedSync(Wal(), lambda: 0.05)  # type: ignore[arg-type]
        t0 = loop.time()
        fut = runner.sync()
        await asyncio.sleep(0.01)
        assert not fut.done() and synced == []  # the loop goes on; nothing synced yet
        assert await fut == 42
        assert synced[0] - t0 >= 0.05
        assert (runner.started, runner.completed) == (1, 1)

    asyncio.run(body())


# --- durable before sent -------------------------------------------------------------------------
def _app_resp(index: int, term: int = 2) -> Message:
    return Message(type=MT.APP_RESP, from_=A, to=B, term=term, index=index)


def test_an_acknowledgement_is_judged_against_the_wal_s_syncs(tmp_path: Path) -> None:
    """Acknowledged after the sync that covered the entries: passes; before it: caught, with no
    crash needed. The same for a vote: granted once its hard state is synced, or caught."""
    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=1 << 20)
    wal.open()
    check = DurableAtSend()
    check.watch("n1", wal)
    check.watch("n1", wal)  # a second watch of one WAL wraps it once
    wal.append_entries(0, [(2, 1, 0, b"a"), (2, 2, 0, b"b")])
    wal.sync()
    check.on_send("n1", 0, _app_resp(2))
    wal.append_entries(0, [(2, 3, 0, b"c")])
    check.on_send("n1", 0, _app_resp(2))  # entry 2 is synced; 3 is not, and is not acknowledged
    check.on_send("n1", 0, Message(type=MT.APP_RESP, from_=A, to=B, term=2, index=3, reject=True))
    assert check.findings == [] and check.judged == 2
    check.on_send("n1", 0, _app_resp(3))
    assert [k for k, _ in check.findings] == ["sent_before_durable"]
    assert "acknowledged entry 3" in check.findings[0][1]
    wal.sync()
    check.on_send("n1", 0, _app_resp(3))
    wal.set_hard_state(0, 3, b"b", 2)
    check.on_send("n1", 0, Message(type=MT.VOTE_RESP, from_=A, to=B, term=3))  # its vote not synced
    assert len(check.findings) == 2 and "granted a vote in term 3" in check.findings[1][1]
    wal.sync()
    wal.set_hard_state(0, 3, b"b", 3)  # the commit index moved: the vote was synced before
    check.on_send("n1", 0, Message(type=MT.VOTE_RESP, from_=A, to=B, term=3))
    wal.truncate(0, 3)
    wal.append_entries(0, [(3, 3, 0, b"d")])  # entry 3 rewritten in term 3: not synced again yet
    check.on_send("n1", 0, _app_resp(3, term=3))
    assert len(check.findings) == 3
    wal.close()


# --- read barriers ----------------------------------------------------------------------------------
def _leader_host(tmp_path: Path) -> ShardHost:
    store = MessageStore(tmp_path / "store", segment_bytes=1 << 20, cache_bytes=0)
    store.open()
    raft, raft_log = build_replica(A, [A], [], 0, 0, [], None, 0, random.Random(0))
    host = ShardHost(0, ShardState(0, "inc", TopicLimits(), 3600), raft, raft_log, store,
                     SnapshotStore(tmp_path / "snap"), ApplyHooks(on_effects=lambda h, fx: None),
                     snapshot_every_entries=1_000_000, max_entry_bytes=1 << 20)
    host.raft.campaign()
    assert host.raft.is_leader
    return host


def _barrier_run(tmp_path: Path) -> tuple[ReadBarrierCheck, asyncio.Future[None]]:
    check = ReadBarrierCheck()

    async def body() -> asyncio.Future[None]:
        host = _leader_host(tmp_path)
        watch_barriers(check, "n1", host)
        fut = host.read_barrier()
        ctx = next(iter(host.reads.asked))
        host.state.applied_index = 5
        host._serve_reads(SimpleNamespace(read_states=[ReadState(index=9, ctx=ctx)]))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        host.state.applied_index = 9
        host._serve_reads(SimpleNamespace(read_states=[]))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        return fut

    return check, asyncio.run(body())


def test_a_read_barrier_that_waits_for_its_read_index_passes(tmp_path: Path) -> None:
    check, fut = _barrier_run(tmp_path)
    assert fut.done() and fut.exception() is None
    assert check.findings == [] and check.resolved == 1


def test_a_read_barrier_that_resolves_early_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    serve = ShardHost._serve_reads

    def early(self: ShardHost, rd: object) -> None:  # the slip: served as soon as the leader answers
        serve(self, rd)  # type: ignore[arg-type]
        for _, fut in self.reads.confirmed:
            if not fut.done():
                fut.set_result(None)

    monkeypatch.setattr(ShardHost, "_serve_reads", early)
    check, _ = _barrier_run(tmp_path)
    assert [k for k, _ in check.findings] == ["read_barrier_early"]
    assert "applied index 5, below the read index 9" in check.findings[0][1]


# --- snapshots ---------------------------------------------------------------------------------------
def _state(applied: int = 7) -> ShardState:
    st = ShardState(2, "inc", TopicLimits(), 3600)
    st.applied_index = applied
    st.proposals = {3: (1, 4), 1: (2, 9)}
    st.sink_markers = {"s": 5}
    return st


def test_a_canonical_state_passes_and_equal_peers_pass() -> None:
    assert canonical_state_findings([("n1", 2, _state()), ("n2", 2, _state()), ("n3", 2, _state(8))]) == []


def test_a_state_that_its_snapshot_does_not_restore_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    restore = ShardState.restore.__func__  # type: ignore[attr-defined]

    def lossy(cls: type[ShardState], data: bytes, limits: TopicLimits, max_expiry_s: int) -> ShardState:
        st = restore(cls, data, limits, max_expiry_s)
        st.proposals.pop(next(iter(st.proposals)))  # the slip: restore loses an origin's admission
        return st

    monkeypatch.setattr(ShardState, "restore", classmethod(lossy))
    findings = canonical_state_findings([("n1", 2, _state())])
    assert [k for k, _ in findings] == ["snapshot_not_canonical"]
    assert "encodes differently" in findings[0][1]


def test_peers_at_one_applied_index_with_different_states_are_caught() -> None:
    other = _state()
    other.sink_markers = {"s": 6}
    findings = canonical_state_findings([("n1", 2, _state()), ("n2", 2, other)])
    assert len(findings) == 1 and "n2 and n1 at applied index 7" in findings[0][1]


# --- the whole world: syncs that take time, crashes aimed at a promise ------------------------------
def test_a_node_that_acknowledges_before_its_sync_breaks_a_promise_the_ledger_sees() -> None:
    """``unsafe_ack_before_sync`` (a crash-harness switch: group commit releases a batch's messages
    a quarter second before syncing it) at seed 0 with timed syncs and aimed crashes: a node dies
    right after an append response and restarts below the term it sent in. The default build of
    the same seed and mix reports nothing."""
    from moorline.sim.cluster.runner import RunConfig, run_seed

    cfg = RunConfig(draw_config=False, timed_sync=True, aimed_crashes=True)
    broken = run_seed(0, 3, frozenset({"unsafe_ack_before_sync"}), cfg=cfg)
    assert "promise_broken" in {f.kind for f in broken.findings}, broken.findings[:5]
    default = run_seed(0, 3, cfg=cfg)
    assert default.findings == []
    assert default.counts.get("aimed_crash_fired", 0) >= 1 and default.counts["syncs_timed"] > 1000
    assert default.counts["recoveries_checked"] > 0 and default.counts["read_barriers_judged"] > 0
    assert broken.replay_command().endswith("--no-draw-config --trace seed-0.trace")  # the others are the default


def test_a_crash_inside_a_timed_sync_keeps_nothing_of_it(tmp_path: Path) -> None:
    """The ledger records a timed sync only when it completes: power loss before then cuts the
    segment back to what the previous sync covered; after it, what it synced stays."""
    from moorline.sim.cluster.world import MemoryLedger, _close_files_under
    from moorline.storage.wal import WriteAheadLog

    def last_index_after_power_loss(complete: bool) -> int:
        d = tmp_path / ("completed" if complete else "crashed")
        ledger = MemoryLedger()
        # Every append is written at once (unsynced): only the ledger says what a crash keeps.
        wal = WriteAheadLog(d, segment_bytes=1 << 20, ledger=ledger, write_ahead_bytes=1)
        wal.open()
        wal.append_entries(0, [(1, 1, 0, b"first")])
        wal.sync()

        async def body() -> None:
            runner = TimedSync(wal, lambda: 0.05)
            wal.append_entries(0, [(1, 2, 0, b"second" * 100)])
            fut = runner.sync()
            await asyncio.sleep(0.01)
            assert not fut.done()  # the loop goes on while the sync runs
            if complete:
                assert await fut >= 1
            # else: the crash falls here, inside the sync (its completion never runs)

        asyncio.run(body())
        wal.append_entries(0, [(1, 3, 0, b"never synced" * 10)])
        _close_files_under(d)
        ledger.cut_unsynced(random.Random(0), extra_bytes_max=0)
        rec = WriteAheadLog(d, segment_bytes=1 << 20).open()
        entries = rec.groups[0].entries if 0 in rec.groups else []
        return entries[-1].index if entries else 0

    assert last_index_after_power_loss(complete=True) == 2
    assert last_index_after_power_loss(complete=False) == 1


# --- retention pins ----------------------------------------------------------------------------------
def _pinned_shard(messages: int = 6) -> ShardState:
    st = ShardState(0, "inc0", TopicLimits(retention_min_age_ms=1000), 3600)
    for i in range(messages):
        st.apply(c.Publish(StoredMessage("t", b"x", 1, False, i.to_bytes(16, "big"), 0)), Effects())
    assert st.apply(c.Pin("r1", "sim", 3, 10_000, 10, 10, 1_000), Effects()) == "ok"  # live until 11,000
    return st


def _housekeeping(st: ShardState, now: int) -> list[int]:
    fx = Effects()
    st.apply(c.Housekeeping(now, -1), fx)
    st.applied_index += 1
    return list(fx.releases)


def test_retention_that_holds_back_from_a_live_pin_passes() -> None:
    st, check = _pinned_shard(), PinCheck()
    check.sample("n1", 0, st)
    assert _housekeeping(st, 5_000) == [0, 1, 2]  # below the pin: free to go
    check.sample("n1", 0, st)
    assert _housekeeping(st, 10_000) == []
    check.sample("n1", 0, st)
    assert check.findings == [] and check.judged == 2 and check.watched == 6


def test_a_release_at_or_above_a_live_pin_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    st, check = _pinned_shard(), PinCheck()
    check.sample("n1", 0, st)
    monkeypatch.setattr(ShardState, "_pinned", lambda self, cmd: cmd)  # planted: pins ignored
    assert _housekeeping(st, 5_000) == [0, 1, 2, 3, 4, 5]
    check.sample("n1", 0, st)
    assert [k for k, _ in check.findings] == ["pinned_released"]
    assert "offset(s) [3, 4, 5]" in check.findings[0][1] and "r1" in check.findings[0][1]


def test_releases_after_a_pin_ran_out_or_was_unpinned_are_not_findings() -> None:
    st, check = _pinned_shard(), PinCheck()
    check.sample("n1", 0, st)
    assert _housekeeping(st, 11_001) == [0, 1, 2, 3, 4, 5]  # its TTL ran out first
    check.sample("n1", 0, st)
    st2, check2 = _pinned_shard(), PinCheck()
    check2.sample("n1", 0, st2)
    check2.unpinning("r1")
    assert st2.apply(c.Unpin("r1", "sim"), Effects()) == "ok"
    assert _housekeeping(st2, 5_000) == [0, 1, 2, 3, 4, 5]
    check2.sample("n1", 0, st2)
    # A restarted replica (a new state object) starts over rather than comparing across the restart.
    st3, check3 = _pinned_shard(), PinCheck()
    check3.sample("n1", 0, st3)
    fresh = ShardState(0, "inc0", TopicLimits(retention_min_age_ms=1000), 3600)
    fresh.pins = dict(st3.pins)
    check3.sample("n1", 0, fresh)
    assert check.findings == check2.findings == check3.findings == []
