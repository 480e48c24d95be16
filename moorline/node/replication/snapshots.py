"""Snapshots of one shard replica (``ShardHost.snaps``): taken at the applied index, recorded in
the core's log storage, and a leader's snapshot installed in place of the replica's state and store.

Snapshots (``start_snapshot``) never encode or sync on the event loop once a shard's state is
large: the loop forks a child, which encodes the state as it was at the fork (the child's
copy-on-write view: apply goes on in the parent and cannot change what the child encodes) and
writes the snapshot file; a thread then syncs the message store's records up to that state and
moves the file into place, and only then is the WAL told (``on_saved``). A thread alone would not
do: encoding is one long call that holds the GIL (measured: the loop stood still for as long as
the encoding took, 480 ms for 58 MB, whether on a thread or not). At most one snapshot per shard is
in flight, and ``SnapshotSettings.max_parallel`` per node.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from moorline import coverage
from moorline.broker.shard import ShardState
from moorline.node.errors import ShardUnavailable
from moorline.node.replication import snapshot_install
from moorline.node.sessions.recent import SHARD_SHIFT
from moorline.raft import ConfState, MemberId, Ready
from moorline.storage.msgstore import MessageStore, StoreSyncJob
from moorline.storage.snapshots import write_snapshot_file

if TYPE_CHECKING:
    from moorline.node.replication.shard_host import ShardHost

log = logging.getLogger("moorline.shard")

# Default of raft.follower_log_margin_entries: entries a multi-voter group keeps in memory below
# its snapshot, so a follower that lags by less catches up from entries, not a snapshot.
MULTI_VOTER_LOG_MARGIN = 50_000

_conf_encoder = msgspec.msgpack.Encoder()
_conf_decoder = msgspec.msgpack.Decoder(ConfState)


def encode_conf(conf: ConfState) -> bytes:
    """A snapshot file's meta: the membership configuration as of its index."""
    return _conf_encoder.encode(conf)


def decode_conf(meta: bytes) -> ConfState | None:
    """The configuration a snapshot file records; None for a file from before it was recorded."""
    return _conf_decoder.decode(meta) if meta else None


@dataclass(slots=True)
class SnapshotSettings:
    """How a node takes and installs its shards' snapshots; one object shared by every host. The
    defaults (no executor) do everything inline: unit tests, and a simulator, where a seed must
    decide every step."""

    follower_log_margin_entries: int = MULTI_VOTER_LOG_MARGIN
    # Shards whose last snapshot was at most this big are encoded on the event loop (a fork costs
    # more than that); larger ones in a forked child. Writing and syncing go to ``executor``.
    inline_max_bytes: int = 512 << 10
    max_parallel: int = 2  # snapshots being written at once, node-wide (forked children included)
    executor: concurrent.futures.Executor | None = None
    install_root: Path | None = None  # where received snapshots are staged (<data>/install); None: refused
    # Told once a snapshot is durable (file and store records): the node marks it in the WAL.
    on_saved: Callable[[ShardHost, int, int], None] | None = None
    # Told after a replica installed a leader's snapshot: delivery state of the shard is stale.
    on_installed: Callable[[ShardHost], None] | None = None
    running: int = 0  # snapshots being written now
    forked: int = 0  # snapshots encoded by a forked child since start

    @classmethod
    def for_node(cls, cfg: Any, data_dir: Path, on_saved: Callable[[ShardHost, int, int], None],
                 on_installed: Callable[[ShardHost], None], inline: bool = False) -> SnapshotSettings:
        """A node's: snapshots off the event loop (a thread pool of ``storage.max_parallel_snapshots``
        threads, forked encoders), received snapshots staged under ``<data>/install``. ``inline``
        (the simulator's seam: no threads, no forks) does all of it on the event loop."""
        workers = cfg.storage.max_parallel_snapshots
        return cls(
            follower_log_margin_entries=cfg.raft.follower_log_margin_entries,
            inline_max_bytes=cfg.storage.snapshot_inline_max_bytes,
            max_parallel=workers,
            # One more thread than snapshots: staging received chunks and cleaning up go there too.
            executor=None if inline else concurrent.futures.ThreadPoolExecutor(workers + 1,
                                                                               thread_name_prefix="snapshot"),
            on_saved=on_saved,
            on_installed=on_installed,
            install_root=snapshot_install.install_root(data_dir),
        )


def records_from(state: ShardState) -> int:
    """The lowest offset whose record a snapshot of ``state`` must carry: its first kept message
    (the next offset when it keeps none). Not the store's low-water mark: that is only where every
    later offset is present, and a message kept longer (still owed) than later released ones
    survives below it; a transfer starting there installed a replica without it (moorline sim
    --cluster, seed 203)."""
    return next(iter(state.topics.meta), state.topics.next_offset)


def recorded_members(meta: bytes, voters: list[MemberId], learners: list[MemberId]
                     ) -> tuple[list[MemberId], list[MemberId]]:
    """The voters and learners a replica starts with: the configuration its snapshot recorded
    (the committed history decides membership), else the ones given (no snapshot yet, or one
    from before configurations were recorded)."""
    conf = decode_conf(meta)
    if conf is None:
        return voters, learners
    return list(conf.voters), list(conf.learners)


@dataclass(eq=False)
class SavedSnapshotInfo:
    """A snapshot this host saved: what a transfer to a follower sends."""

    index: int
    term: int
    meta: bytes
    path: Path
    size: int
    # Where a transfer's records start: the state's lowest kept offset when it was frozen
    # (``records_from``), which can be below the store's low-water mark (sparse survivors).
    low_water: int
    next_offset: int  # the state's (and the store's) next message offset at ``index``


@dataclass(eq=False)
class _SnapshotJob:
    index: int
    term: int
    conf: ConfState
    store: MessageStore
    store_job: StoreSyncJob
    low_water: int
    next_offset: int
    generation: int
    pending: Path
    data: bytes | None = None  # encoded on the loop (small states)
    child: tuple[int, int] | None = None  # (pid, read end of its report pipe) of a forked encoder
    future: concurrent.futures.Future[int] | None = None
    waiters: list[asyncio.Future[SavedSnapshotInfo]] = field(default_factory=list)


class ShardSnapshots:
    """Taking, recording and installing snapshots of one replica (``ShardHost.snaps``)."""

    def __init__(self, host: ShardHost) -> None:
        self.host = host
        self.job: _SnapshotJob | None = None
        # The Ready carrying a leader's snapshot while the install's files are moved off the loop,
        # and that work's future (``install``).
        self.installing: tuple[Ready, concurrent.futures.Future[None]] | None = None

    def take_snapshot(self) -> tuple[int, int]:
        """Persist the state at the applied index now, on this thread (shutdown, tests); waits for
        a snapshot in flight first. The caller marks it in the WAL. Refused (OSError) while a
        leader's snapshot is installed: the restart finishes that install (snapshot_install.py)."""
        if self.installing is not None:
            try:
                self.installing[1].result()  # blocking: shutdown, after the loop's work is done
            except BaseException:  # noqa: BLE001 - the restart sees what was done
                pass
            raise OSError(f"shard {self.host.shard}: stopped while installing a leader's snapshot")
        self.wait_job()
        coverage.hit("snapshot_taken")
        self.host.entries_since_snapshot = 0
        index = self.host.state.applied_index
        term = self.host.raft_log.term(index)
        conf = self.host.raft.conf_state
        self.host.store.sync()
        data = self.host.state.snapshot()
        meta = encode_conf(conf)
        path = self.host.snapshots.save(self.host.shard, index, term, data, meta)
        self.host.last_snapshot_bytes = len(data)
        self._snapshot_recorded(index, term, conf, SavedSnapshotInfo(
            index, term, meta, path, path.stat().st_size, records_from(self.host.state), self.host.state.topics.next_offset))
        return index, term

    def start_snapshot(self) -> bool:
        """Start a snapshot of the state at the applied index, off the event loop when a node's
        executor is set (module doc); ``SnapshotSettings.on_saved`` hears when it is durable. False
        when one is in flight, the node's limit is reached, or the shard cannot take one now."""
        settings = self.host.snapshot_settings
        if (self.job is not None or self.host.failed is not None or self.host.staged_install is not None
                or settings.running >= settings.max_parallel or self.host.reads_remotely):
            return False  # (a partial state, fed by another node, is never kept as the shard's)
        self.host.entries_since_snapshot = 0
        coverage.hit("snapshot_taken")
        index = self.host.state.applied_index
        store = self.host.store
        job = _SnapshotJob(index, self.host.raft_log.term(index), self.host.raft.conf_state, store, store.begin_sync(),
                           records_from(self.host.state), self.host.state.topics.next_offset, self.host.generation,
                           self.host.snapshots.temp_path(self.host.shard, f"{index}-{self.host.generation}-{os.getpid()}"))
        executor = settings.executor
        if not self.host.last_snapshot_bytes:  # first one since start: the size of the one loaded
            latest = self.host.snapshots.latest(self.host.shard)
            self.host.last_snapshot_bytes = _file_size(latest[2]) if latest is not None else 0
        try:
            if executor is None or self.host.last_snapshot_bytes <= settings.inline_max_bytes:
                job.data = self.host.state.snapshot()  # small: cheaper than a fork
            else:
                job.child = _fork_encoder(self.host.state, job.pending, self.host.shard, index, job.term, encode_conf(job.conf))
                settings.forked += 1
        except OSError as exc:  # fork refused (memory): try again at the next occasion
            store.abort_sync(job.store_job)
            self.host.entries_since_snapshot = self.host.snapshot_every_entries
            log.error("shard %d: snapshot not started: %s", self.host.shard, exc)
            return False
        self.job = job
        settings.running += 1
        if executor is None:
            fut: concurrent.futures.Future[int] = concurrent.futures.Future()
            try:
                fut.set_result(self._write_snapshot(job))
            except BaseException as exc:  # noqa: BLE001 - reported by _snapshot_written
                fut.set_exception(exc)
            job.future = fut
            self._snapshot_written(job)
            return True
        loop = asyncio.get_running_loop()
        job.future = executor.submit(self._write_snapshot, job)
        job.future.add_done_callback(lambda _f: _call_soon(loop, self._snapshot_written, job))
        return True

    async def fresh_snapshot(self) -> SavedSnapshotInfo:
        """A snapshot taken from now on (a transfer to a follower holds the store's reclaim first,
        so every record the state keeps is still in the store when it is read). Raises
        ShardUnavailable when none can be taken (the shard failed or installs one)."""
        while True:
            if self.host.failed is not None or self.host.staged_install is not None:
                raise ShardUnavailable(f"shard {self.host.shard}: no snapshot can be taken now")
            job = self.job
            if job is None:
                if not self.host.start_snapshot():
                    await asyncio.sleep(0.05)  # the node's limit of parallel snapshots
                    continue
                if self.job is None:  # done inline already
                    if self.host.last_snapshot is None or self.host.last_snapshot.index != self.host.state.applied_index:
                        raise ShardUnavailable(f"shard {self.host.shard}: snapshot failed")
                    return self.host.last_snapshot
                job = self.job
                waiter: asyncio.Future[SavedSnapshotInfo] = asyncio.get_running_loop().create_future()
                job.waiters.append(waiter)
                return await waiter
            await self._job_done(job)  # one started before: wait for it, then start ours

    async def snapshot_idle(self) -> None:
        """Until no snapshot of this host is in flight."""
        while self.job is not None:
            await self._job_done(self.job)

    @staticmethod
    async def _job_done(job: _SnapshotJob) -> None:
        waiter: asyncio.Future[SavedSnapshotInfo] = asyncio.get_running_loop().create_future()
        job.waiters.append(waiter)
        try:
            await waiter
        except Exception:  # noqa: BLE001 - it failed; the caller decides what next
            pass

    def _write_snapshot(self, job: _SnapshotJob) -> int:
        """The blocking part (executor thread): the encoded file (by the child, or from ``data``),
        the store's records up to the snapshot's next offset, then the file into place. Returns
        the state's encoded size. In this order: a snapshot file must never name records the
        store could lose."""
        meta = encode_conf(job.conf)
        if job.child is not None:
            size, data_bytes = _wait_encoder(*job.child)
        else:
            assert job.data is not None
            size = write_snapshot_file(job.pending, self.host.shard, job.index, job.term, job.data, meta)
            data_bytes = len(job.data)
        job.store.run_sync_job(job.store_job)
        path = self.host.snapshots.adopt(self.host.shard, job.index, job.term, job.pending, size)
        job.pending = path
        return data_bytes

    def _snapshot_written(self, job: _SnapshotJob) -> None:
        """Back on the loop: record what became durable, then tell the node (WAL mark)."""
        if job.future is None or (self.job is not job):
            return  # completed already (take_snapshot waited for it)
        self.job = None
        self.host.snapshot_settings.running -= 1
        exc = job.future.exception()
        if exc is not None:
            if job.store is self.host.store:
                job.store.abort_sync(job.store_job)
            self.host.entries_since_snapshot = self.host.snapshot_every_entries  # try again soon
            log.error("shard %d: snapshot at index %d failed: %s", self.host.shard, job.index, exc)
            for w in job.waiters:
                if not w.done():
                    w.set_exception(ShardUnavailable(f"shard {self.host.shard}: snapshot failed: {exc}"))
            try:
                job.pending.unlink()
            except OSError:
                pass
            return
        if job.generation != self.host.generation or job.store is not self.host.store:
            # A leader's snapshot was installed meanwhile: this one describes the replaced state.
            for w in job.waiters:
                if not w.done():
                    w.set_exception(ShardUnavailable(f"shard {self.host.shard}: replaced by an installed snapshot"))
            return
        job.store.finish_sync(job.store_job)
        self.host.last_snapshot_bytes = job.future.result()
        info = SavedSnapshotInfo(job.index, job.term, encode_conf(job.conf), job.pending,
                                 _file_size(job.pending), job.low_water, job.next_offset)
        self._snapshot_recorded(job.index, job.term, job.conf, info)
        on_saved = self.host.snapshot_settings.on_saved
        if on_saved is not None:
            on_saved(self.host, job.index, job.term)
        for w in job.waiters:
            if not w.done():
                w.set_result(info)

    def _snapshot_recorded(self, index: int, term: int, conf: ConfState, info: SavedSnapshotInfo) -> None:
        """The snapshot at ``index`` is durable: the core's storage records it and drops entries."""
        self.host.last_snapshot = info
        log_ = self.host.raft_log
        if index >= log_.first_index() - 1 and index >= log_.snapshot_index():
            log_.create_snapshot(index, conf, b"")
        active = self.host.raft.active_conf_state
        if len(active.voters) > 1 or active.learners:
            # Followers catch up from entries: keep a margin of them in memory; one further
            # behind gets this snapshot (snapshot_transfer.py).
            margin = self.host.snapshot_settings.follower_log_margin_entries
            log_.compact(min(index, max(log_.first_index() - 1, index - margin)))
        elif index <= log_.last_index():
            log_.compact(index)

    def wait_job(self) -> None:
        """Blocking wait for a snapshot in flight, then its completion (shutdown, installs)."""
        job = self.job
        if job is None or job.future is None:
            return
        try:
            job.future.result()
        except Exception:  # noqa: BLE001 - _snapshot_written reports it
            pass
        self._snapshot_written(job)

    def run_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """File work nobody waits for, on the node's executor (inline without one); errors logged."""
        def run() -> None:
            try:
                fn(*args)
            except OSError as exc:
                log.error("shard %d: %s failed: %s", self.host.shard, getattr(fn, "__name__", fn), exc)

        executor = self.host.snapshot_settings.executor
        if executor is None:
            run()
        else:
            executor.submit(run)

    def install(self, rd: Ready) -> None:
        """The core accepted a leader's snapshot (``rd`` carries it): the staged state and store
        replace this replica's, durably (snapshot_install.py), before the Ready's WAL records are
        staged. The file work (a snapshot job still writing the old store, closing it, COMMIT,
        renames, fsyncs) runs off the event loop (``snapshot_install.run_off_loop``); meanwhile
        ``installing`` holds the Ready and the host takes nothing from its core, applies nothing
        and reads nothing from either store. ``_install_done`` swaps state and store and hands the
        Ready back (``ShardHost.ready_after_install``). A Ready with a snapshot nobody staged (a
        peer of another version) fails the shard rather than apply an empty state."""
        coverage.hit("snapshot_installed")
        snap = rd.snapshot
        assert snap is not None
        meta = snap.meta
        staged = self.host.staged_install  # kept until the swap: no snapshot of the old state starts
        if staged is None or (staged.index, staged.term) != (meta.index, meta.term):
            self.host.staged_install = None
            self.host.fail(f"asked to install a snapshot at index {meta.index} (term {meta.term}) that was not "
                           "received here")
            log.error("shard %d: %s", self.host.shard, self.host.failed)
            if staged is not None:
                self.run_io(snapshot_install.discard_staging, staged.directory)
            return
        job = self.job  # none should be (the receiver waited): never two writers of one store
        old_store = self.host.store
        snapshots = self.host.snapshots
        # Closed (off the loop) before its directory moves aside: closing writes the records it
        # still buffers to its last segment by path, which after the move is absent (the
        # group-commit task died on it) or, worse, the installed store's segment of the same name
        # (found by moorline sim --cluster with a small raft.follower_log_margin_entries).
        fut = snapshot_install.run_off_loop(
            self.host.snapshot_settings.executor,
            lambda: snapshot_install.install_files(staged, old_store, snapshots,
                                                   before=None if job is None else lambda: _job_result(job)),
            lambda exc: self._install_done(rd, staged, job, exc))
        self.installing = (rd, fut)

    def _install_done(self, rd: Ready, staged: snapshot_install.StagedInstall, job: _SnapshotJob | None,
                      exc: BaseException | None) -> None:
        """Back on the loop after the install's file work: swap state and store, then the Ready
        with the snapshot is the next the group commit writes."""
        if self.installing is None or self.installing[0] is not rd:
            return
        self.installing = None
        host = self.host
        host.staged_install = None
        snap = rd.snapshot
        assert snap is not None
        meta = snap.meta
        if job is not None and self.job is job:
            self._snapshot_written(job)
        if exc is not None:
            # Before COMMIT: the old replica stays on disk; after it: a restart finishes the install.
            # Either way this process serves neither (the group commit must not stop for it).
            host.fail(f"installing the leader's snapshot at index {meta.index} failed: {exc!r}")
            log.error("shard %d: %s", host.shard, host.failed)
            return
        if host.failed is not None:  # stopped meanwhile (a bug, corruption): it serves nothing
            staged.store.close()  # (the install reached COMMIT: a restart finishes it)
            return
        host.store = staged.store
        host.store_stale = False  # (a copy dropped before: its old store went with the install)
        host.store.on_corruption = host.store_damaged
        old_state, host.state = host.state, staged.state
        host.raft_log.apply_snapshot(snap)
        host.generation += 1
        host.installs += 1
        host.entries_since_snapshot = 0
        host.last_snapshot_bytes = staged.state_file_bytes
        host.last_snapshot = None
        host.installed = staged
        host.ready_after_install(rd)
        if host.recent is not None:  # nothing cached of the old state may be delivered
            mask = (1 << SHARD_SHIFT) - 1
            host.recent.drop(host.shard, [k & mask for k in list(host.recent.by_key) if k >> SHARD_SHIFT == host.shard])
        host.proposer.settle_after_install()
        host.check_admission()  # the installed state may admit this node only under a later boot
        log.warning("shard %d: installed the leader's snapshot at index %d (term %d): this replica was "
                    "%d entries behind", host.shard, meta.index, meta.term, meta.index - old_state.applied_index)
        hook = host.snapshot_settings.on_installed
        if hook is not None:
            hook(host)


def _job_result(job: _SnapshotJob) -> None:
    """Until a snapshot job's file work ended (blocking: off the loop); its outcome is taken on
    the loop (``_snapshot_written``)."""
    if job.future is not None:
        try:
            job.future.result()
        except Exception:  # noqa: BLE001 - _snapshot_written reports it
            pass


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the node is gone
        pass


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _fork_encoder(state: ShardState, path: Path, group: int, index: int, term: int, meta: bytes) -> tuple[int, int]:
    """Fork a child that encodes ``state`` as it is now (its copy-on-write view of it) and writes
    the snapshot file at ``path``; returns (pid, read end of its report pipe). The child touches
    nothing but that file and the pipe: it closes every other descriptor it inherited first
    (client sockets, the data directory's lock, the WAL), never runs the event loop, never logs,
    and leaves with ``os._exit``."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns about fork in a threaded process: see above
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        status = 1
        try:
            gc.disable()  # a collection would touch (and copy) every page of the parent's heap
            # Ctrl-C in a terminal reaches the whole process group: the parent stops in order and
            # waits for this file; a SIGTERM to the group (a service manager) ends the child too.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.closerange(3, w)  # the read end too
            os.closerange(w + 1, _max_fd())
            data = state.snapshot()
            size = write_snapshot_file(path, group, index, term, data, meta)
            os.write(w, f"ok {size} {len(data)}".encode())
            status = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            try:
                os.write(w, f"error {exc!r}"[:2000].encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(status)
    os.close(w)
    return pid, r


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 1 << 16


def _wait_encoder(pid: int, report_fd: int) -> tuple[int, int]:
    """(file size, state bytes) from a forked encoder, once it ended (blocking: executor thread)."""
    chunks = []
    try:
        while True:
            chunk = os.read(report_fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(report_fd)
    _, status = os.waitpid(pid, 0)
    report = b"".join(chunks).decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0 or not report.startswith("ok "):
        raise OSError(f"snapshot encoder (pid {pid}) failed: {report or f'exit status {status}'}")
    _, size, data_bytes = report.split()
    return int(size), int(data_bytes)
