"""Installing a leader's snapshot on a replica: the files, in an order a crash cannot mix.

A replica that fell behind its leader's log receives the shard state (a snapshot file as the
leader's ``SnapshotStore`` saved it) and the leader's message-store records up to that state's
next offset (``snapshot_transfer.py``). They are staged in ``<data>/install/shard-<n>-<tag>/``:

    state.snap     the snapshot file (verified: header and data checksums)
    store/         a complete message store (segments and store.meta), fdatasynced
    COMMIT         written last, atomically: from here on the install is rolled forward

Nothing in the live data changes while staging, so a crash before ``COMMIT`` exists leaves the old
state and store untouched (recovery deletes the staging directory). Installing, once the Raft
core's Ready carries the snapshot (``ShardHost._install``):

1. ``COMMIT`` is written (tmp, fsync, rename, fsync of the directory): the commit point.
2. ``store/shard-<n>`` is renamed to ``old-store`` inside the staging directory, then the staged
   ``store/`` to ``store/shard-<n>``; both directories fsynced.
3. ``state.snap`` is moved into ``snapshots/group-<n>/`` under its (index, term) name (fsync).
4. The group commit writes the WAL records of the same Ready: a truncation of the group's entries
   after the snapshot index (a replica that needs a snapshot does not hold the snapshot's last
   entry, so any entry it has beyond it is from a deposed leader), the snapshot mark, then the
   new hard state, synced together.
5. After that sync, ``COMMIT`` and the staging directory (with the old store) are removed.

Steps 1-3 (with the old store's closing before them and the staged store's ``relocate`` after)
run off the event loop (``install_files`` through ``run_off_loop``: the node's file-work
executor, or, under the simulator's inline seam, at once with the completion a loop pass later):
they fsync and rename, which must never delay a heartbeat. Meanwhile the shard takes no Ready,
applies nothing and reads nothing from either store (``ShardHost``); its state and store are
swapped when they are done, and the Ready with the snapshot goes to the WAL after that.

Recovery (``recover_install``) finds a staging directory with ``COMMIT`` and repeats 2 and 3 where
they had not happened (each step looks at what exists, so repeating is harmless), and step 4 if
the WAL's snapshot mark for the group is older than the snapshot: then no batch after the
install's was synced either, so every entry the WAL holds beyond the snapshot index is one of the
deposed ones and is dropped. Either way the replica starts with the new state, store and log, or
(without ``COMMIT``) with the old ones; never a mixture. Recovery must then find the store of the
snapshot the snapshot store names, which is what steps 2 and 3 (in that order) guarantee.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moorline.broker.shard import ShardState
from moorline.storage.fsutil import ensure_dir, fsync_dir, write_file_atomically
from moorline.storage.msgstore import MessageStore
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import GroupRecovery, WriteAheadLog

log = logging.getLogger("moorline.snapshot")

INSTALL_DIR = "install"
COMMIT_FILE = "COMMIT"
STATE_FILE = "state.snap"
STORE_DIR = "store"
OLD_STORE_DIR = "old-store"


def install_root(data_dir: Path) -> Path:
    return Path(data_dir) / INSTALL_DIR


def staging_dir(root: Path, shard: int, tag: str) -> Path:
    return root / f"shard-{shard}-{tag}"


def _staging_dirs(root: Path, shard: int) -> list[Path]:
    if not root.is_dir():
        return []
    prefix = f"shard-{shard}-"
    return sorted(Path(e.path) for e in os.scandir(root) if e.name.startswith(prefix) and e.is_dir())


@dataclass(eq=False)
class StagedInstall:
    """A received snapshot, durable in its staging directory and decoded, waiting for the core."""

    shard: int
    index: int
    term: int
    conf_meta: bytes  # the membership configuration as of ``index`` (encoded by the shard host)
    directory: Path
    state: ShardState  # decoded from state.snap (applied_index == index)
    store: MessageStore  # open on directory/store, synced; relocated by the install
    state_file_bytes: int
    leader: tuple[int, str]
    committed: bool = field(default=False)


def commit_install(staged: StagedInstall, store_dir: Path, snapshots: SnapshotStore) -> None:
    """Steps 1-3 of the module doc: after this the node restarts with the new state and store."""
    data_dir = staged.directory.parent.parent  # <data>/install/<staging>
    record = {"shard": staged.shard, "index": staged.index, "term": staged.term,
              "store_dir": os.path.relpath(store_dir, data_dir)}
    write_file_atomically(staged.directory / COMMIT_FILE, json.dumps(record).encode())
    staged.committed = True
    _roll_forward(staged.directory, staged.shard, staged.index, staged.term, store_dir, snapshots)


def install_files(staged: StagedInstall, old_store: MessageStore, snapshots: SnapshotStore,
                  before: Callable[[], None] | None = None) -> None:
    """The file work of an install, on any thread (the loop touches neither store meanwhile):
    ``before`` (the end of a snapshot job still writing the old store), the old store closed (its
    buffered records written where its directory still is), steps 1-3, the staged store relocated
    to the live directory. An ``OSError`` before ``COMMIT`` leaves the old replica on disk; after
    it, a restart finishes the install (``staged.committed`` says which)."""
    if before is not None:
        before()
    old_store.close()
    commit_install(staged, old_store.directory, snapshots)
    staged.store.relocate(old_store.directory)


def run_off_loop(executor: concurrent.futures.Executor | None, fn: Callable[[], None],
                 done: Callable[[BaseException | None], None]) -> concurrent.futures.Future[None]:
    """``fn()`` on ``executor``, then ``done(error or None)`` on the running loop. Without an
    executor (the simulator's inline seam: no threads) ``fn`` runs now and ``done`` a loop pass
    later, so the caller takes the same path in an order the seed decides. Returns the work's
    future (``result()`` waits for it, on a thread that may block: shutdown)."""
    loop = asyncio.get_running_loop()
    if executor is None:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            fn()
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to ``done``
            fut.set_exception(exc)
        loop.call_soon(done, fut.exception())
        return fut

    def finished(f: concurrent.futures.Future[None]) -> None:
        try:
            loop.call_soon_threadsafe(done, f.exception())
        except RuntimeError:  # the loop is closed: the node is gone (a restart finishes the install)
            pass

    fut = executor.submit(fn)
    fut.add_done_callback(finished)
    return fut


def _roll_forward(directory: Path, shard: int, index: int, term: int, store_dir: Path,
                  snapshots: SnapshotStore) -> None:
    staged_store = directory / STORE_DIR
    if staged_store.exists():
        old = directory / OLD_STORE_DIR
        if store_dir.exists():
            if old.exists():
                shutil.rmtree(old)
            os.rename(store_dir, old)
        ensure_dir(store_dir.parent)
        os.rename(staged_store, store_dir)
        fsync_dir(store_dir.parent)
        fsync_dir(directory)
    staged_state = directory / STATE_FILE
    if staged_state.exists():
        snapshots.adopt(shard, index, term, staged_state)


def finish_install(directory: Path) -> None:
    """Step 5: the WAL holds the install; the staging directory (and the old store) can go."""
    try:
        (directory / COMMIT_FILE).unlink()
    except FileNotFoundError:
        pass
    fsync_dir(directory)
    discard_staging(directory)


def discard_staging(directory: Path) -> None:
    """Remove a staging directory that holds no ``COMMIT`` (a transfer that did not finish, or
    one the core did not install)."""
    shutil.rmtree(directory, ignore_errors=True)
    if directory.parent.exists():
        fsync_dir(directory.parent)


def recover_install(data_dir: Path, shard: int, snapshots: SnapshotStore, wal: WriteAheadLog,
                    group: GroupRecovery | None) -> str | None:
    """At startup, before the shard's snapshot is loaded: finish an install that reached its
    commit point, discard staging that did not. Returns what was done (for the log), or None.
    ``group`` is what the WAL recovered of the shard; an install it does not hold yet is written
    to the WAL here (truncation and mark, synced with the recovery's first sync) and the entries
    beyond the snapshot are dropped from ``group``."""
    root = install_root(data_dir)
    done: str | None = None
    for directory in _staging_dirs(root, shard):
        commit = directory / COMMIT_FILE
        if not commit.exists():
            discard_staging(directory)
            done = done or f"discarded an unfinished snapshot transfer ({directory.name})"
            continue
        record = json.loads(commit.read_text())
        index, term, store_dir = int(record["index"]), int(record["term"]), Path(data_dir) / record["store_dir"]
        _roll_forward(directory, shard, index, term, store_dir, snapshots)
        if group is None or group.snapshot_index < index:
            # The install's WAL batch was not synced: nothing after it was either, so every entry
            # beyond the snapshot index is from before the install (a deposed leader's).
            if wal.last_index(shard) > index:
                wal.truncate(shard, index + 1)
            wal.mark_snapshot(shard, index, term)
            if group is not None:
                group.entries = []
                group.snapshot_index, group.snapshot_term = index, term
        finish_install(directory)
        done = f"finished installing the leader's snapshot at index {index} (term {term})"
    return done
