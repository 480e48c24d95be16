"""Installing a leader's snapshot survives a crash at any step (snapshot_install.py): recovery
finds either the replica's old state, store and log, or the new ones, never a mixture. A follower
with a snapshot at index 5 and a log to 25 (entries 21..25 from a deposed leader) installs the
leader's snapshot at (20, term 2); the process "crashes" after each step, and what a restart
reads (as Node.open_groups reads it) is checked: the state's kept messages are all in the store,
with the GUIDs of the one side, and the WAL holds no entry of the other."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.node.replication import snapshot_install as si
from moorline.node.replication.group_commit import stage_ready
from moorline.node.replication.shard_host import encode_conf
from moorline.raft import ConfState, Ready
from moorline.raft.types import Entry, EntryType, HardState, Snapshot, SnapshotMeta
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore, write_snapshot_file
from moorline.storage.wal import WriteAheadLog

LIMITS = TopicLimits(reserved_headroom_bytes=0)
CONF = ConfState.of([(1, "a"), (2, "b"), (3, "c")])
SHARD = 0
OLD_INDEX, NEW_INDEX, NEW_TERM = 5, 20, 2


def state_with(store: MessageStore, tag: str, count: int, index: int) -> ShardState:
    """A shard state that applied ``count`` publishes (GUIDs tagged ``tag``), written to ``store``."""
    st = ShardState(SHARD, "inc", LIMITS, 3600)
    fx = Effects()
    cmds = [c.Publish(StoredMessage(f"t/{i % 3}", f"{tag}{i}".encode(), 1, False,
                                    f"{tag}-{i}".encode().ljust(16, b"."), 1000 + i)) for i in range(count)]
    st.apply_publishes(cmds, fx)
    store.append_many(fx.appends)
    if count > 4:  # a few released, so the stores are sparse
        released = [1, 3]
        store.release(released)
        for o in released:
            st.topics.meta.discard(o)
    st.applied_index = index
    return st


def follower(data: Path) -> None:
    """The replica before the install: snapshot at 5, store, WAL entries 1..25 (21..25 stale)."""
    store = MessageStore(data / "store" / f"shard-{SHARD}", cache_bytes=0)
    store.open()
    st = state_with(store, "old", 10, OLD_INDEX)
    store.sync()
    store.close()
    SnapshotStore(data / "snapshots").save(SHARD, OLD_INDEX, 1, st.snapshot(), encode_conf(CONF))
    wal = WriteAheadLog(data / "wal")
    wal.open()
    wal.append_entries(SHARD, [(1, i, int(EntryType.NORMAL), b"") for i in range(1, 26)])
    wal.set_hard_state(SHARD, 1, b"", OLD_INDEX)
    wal.mark_snapshot(SHARD, OLD_INDEX, 1)
    wal.sync()
    wal.close()


def staged(data: Path, tmp: Path) -> si.StagedInstall:
    """The leader's snapshot at (20, 2) and its store, received and staged (as the receiver does)."""
    leader_store = MessageStore(tmp / "leader-store", cache_bytes=0)
    leader_store.open()
    leader_state = state_with(leader_store, "new", 30, NEW_INDEX)
    directory = si.staging_dir(si.install_root(data), SHARD, "20-test")
    directory.mkdir(parents=True)
    data_bytes = leader_state.snapshot()
    write_snapshot_file(directory / si.STATE_FILE, SHARD, NEW_INDEX, NEW_TERM, data_bytes, encode_conf(CONF))
    store = MessageStore(directory / si.STORE_DIR, cache_bytes=0)
    store.open()
    store.reset(0)
    offset = 0
    while (plan := leader_store.plan_read(offset, leader_state.topics.next_offset, 64)) is not None:
        raw = MessageStore.read_plan(plan)
        p = 0
        while p < len(raw):
            length, off = int.from_bytes(raw[p + 8:p + 12], "little"), int.from_bytes(raw[p + 12:p + 20], "little")
            store.append_received(off, raw[p + 20:p + 20 + length])
            p += 20 + length
        offset = plan.next_offset
    store.end_received(leader_state.topics.next_offset)
    store.sync()
    leader_store.close()
    state = ShardState.restore(data_bytes, LIMITS, 3600)
    return si.StagedInstall(SHARD, NEW_INDEX, NEW_TERM, encode_conf(CONF), directory, state, store,
                            len(data_bytes), (1, "a"))


class Crash(Exception):
    pass


def install(data: Path, tmp: Path, crash_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the install (ShardSnapshots.install, then the group commit's WAL records and sync, then the
    clean-up) and stop dead at ``crash_at``."""
    st = staged(data, tmp)
    if crash_at == "staged":
        return
    snapshots = SnapshotStore(data / "snapshots")
    renames = {"n": 0}
    real_rename = os.rename

    def rename(a: object, b: object) -> None:
        renames["n"] += 1
        if crash_at == f"rename{renames['n']}":
            raise Crash()
        real_rename(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(si.os, "rename", rename)
    if crash_at == "adopt":
        monkeypatch.setattr(snapshots, "adopt", lambda *a, **k: (_ for _ in ()).throw(Crash()))
    try:
        si.commit_install(st, data / "store" / f"shard-{SHARD}", snapshots)
    except Crash:
        return
    finally:
        monkeypatch.undo()
    st.store.relocate(data / "store" / f"shard-{SHARD}")
    wal = WriteAheadLog(data / "wal")
    wal.open()
    snap = Snapshot(meta=SnapshotMeta(index=NEW_INDEX, term=NEW_TERM, conf_state=CONF))
    later = [Entry(NEW_TERM, i, EntryType.NORMAL, b"") for i in (21, 22, 23)]
    stage_ready(wal, SHARD, Ready(hard_state=HardState(term=NEW_TERM, commit=NEW_INDEX), entries=later, snapshot=snap))
    if crash_at == "wal_unsynced":
        return  # the WAL's batch never reached the disk
    wal.sync()
    wal.close()
    if crash_at == "wal_synced":
        return  # COMMIT and the staging directory are still there
    si.finish_install(st.directory)


def restart(data: Path) -> tuple[str, ShardState, MessageStore, list[tuple[int, int]]]:
    """What Node.open_groups reads: the WAL, a finished or discarded install, the latest snapshot,
    the store cut at the state's next offset. Returns (side, state, store, (term, index) of the
    WAL's entries after the snapshot)."""
    wal = WriteAheadLog(data / "wal")
    rec = wal.open()
    snapshots = SnapshotStore(data / "snapshots")
    si.recover_install(data, SHARD, snapshots, wal, rec.groups.get(SHARD))
    saved = snapshots.load_latest_full(SHARD)
    assert saved is not None
    state = ShardState.restore(saved.data, LIMITS, 3600)
    store = MessageStore(data / "store" / f"shard-{SHARD}", cache_bytes=0)
    store.open()
    store.truncate_from(state.topics.next_offset)
    grec = rec.groups[SHARD]
    entries = [(e.term, e.index) for e in grec.entries if e.index > saved.index]
    wal.sync()  # the recovery's first sync (Startup.recover_group) makes what recover_install wrote durable
    wal.close()
    side = "new" if saved.index == NEW_INDEX else "old"
    assert saved.meta == encode_conf(CONF), "the snapshot records the configuration"
    return side, state, store, entries


CRASH_POINTS = {  # where the install stops -> what a restart must find
    "staged": "old",  # everything received and synced, no COMMIT
    "rename1": "new",  # COMMIT written, the live store not moved yet
    "rename2": "new",  # the live store moved aside, the staged one not in place
    "adopt": "new",  # the store swapped, the snapshot file not in place
    "wal_unsynced": "new",  # files done, the WAL batch lost
    "wal_synced": "new",  # WAL synced, the staging directory not removed
    "done": "new",
}


@pytest.mark.parametrize("crash_at", list(CRASH_POINTS))
def test_a_crash_at_any_step_recovers_the_old_or_the_new_replica(
        tmp_path: Path, crash_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    follower(data)
    install(data, tmp_path, crash_at, monkeypatch)
    side, state, store, entries = restart(data)
    assert side == CRASH_POINTS[crash_at]
    t = state.topics
    kept = [o for o in range(t.low_water, t.next_offset) if o in t.meta]
    assert len(kept) == (10 if side == "old" else 30) - 2
    for offset in kept:
        rec = store.get(offset)
        assert rec is not None, f"message {offset} is kept by the {side} state but missing from the store"
        assert f"{side}{offset}".encode() in rec, f"message {offset} in the store is not the {side} one"
    assert store.next_offset == t.next_offset
    if side == "old":
        assert entries == [(1, i) for i in range(OLD_INDEX + 1, 26)]  # untouched
    elif crash_at in ("wal_synced", "done"):
        assert entries == [(NEW_TERM, 21), (NEW_TERM, 22), (NEW_TERM, 23)]  # the leader's, kept
    else:
        assert entries == [], "entries of a deposed leader survived the install"
    store.close()
    assert not list(si.install_root(data).glob("*")), "staging left behind"
    # Recovering again changes nothing (every step looks at what exists).
    assert restart(data)[0] == side
