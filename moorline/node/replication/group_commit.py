"""Group commit: one fdatasync covers a batch of every shard's entries.

Each pass seals the commands proposed to every shard into one entry per shard, stages them in
the node-wide WAL, syncs once and only then lets the shards apply — which is what releases
PUBACKs. Proposals made while a sync runs form the next batch, so syncs pipeline back to back
under load and cost nothing when idle.

Where the sync runs is decided per pass from how long recent syncs took (``SyncTimer``): on a
disk that syncs in a few hundred microseconds the event loop does it itself, because handing it
to a thread (queue put, futex wake, GIL hand-back, self-pipe wake-up) costs more CPU than the
sync; a slow sync goes to the dedicated thread so the loop keeps serving connections meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from moorline.node.replication.raft_group import encode_vote
from moorline.node.replication.shard_host import ShardHost
from moorline.node.seams import SyncRunner
from moorline.raft import HardState, Ready
from moorline.storage.wal import WriteAheadLog

log = logging.getLogger("moorline.commit")

UNSAFE_SYNC_DELAY_S = 0.25



def stage_hard_state(wal: WriteAheadLog, shard: int, hs: HardState) -> None:
    """Written with the next batch; synced with it (a new commit index alone never forces a sync)."""
    wal.set_hard_state(shard, hs.term, encode_vote(hs.vote), hs.commit)


def stage_ready(wal: WriteAheadLog, shard: int, rd: Ready) -> None:
    """A group's Ready into the WAL's next batch: a leader's snapshot it installed (the host did,
    before this: its entries after the index are a deposed leader's, then the mark), its entries,
    then its hard state."""
    if rd.snapshot is not None:
        index, term = rd.snapshot.meta.index, rd.snapshot.meta.term
        if wal.last_index(shard) > index:
            wal.truncate(shard, index + 1)
        wal.mark_snapshot(shard, index, term)
    if rd.entries:
        wal.append_entries(shard, [(e.term, e.index, int(e.type), e.data) for e in rd.entries])
    if rd.hard_state is not None:
        stage_hard_state(wal, shard, rd.hard_state)

class SyncTimer:
    """Decides where the next sync runs: on the event loop while recent ones were fast.

    Only syncs run on the loop are timed: a thread's own timing would include its wait for the
    GIL after each system call, which under load is far longer than the sync. So while syncs go to
    the thread, every ``PROBE_EVERY``-th one runs on the loop to measure the disk again: a disk
    that became fast gets its syncs back, a slow one costs the loop one sync in ``PROBE_EVERY``."""

    WEIGHT = 0.2  # of the newest sample in the running mean
    PROBE_EVERY = 32

    def __init__(self, inline_max_s: float) -> None:
        self.inline_max_s = inline_max_s
        self.mean_s = 0.0
        self.inline = 0  # syncs run on the event loop
        self.threaded = 0  # syncs run on the sync thread
        self._since_probe = 0

    def use_inline(self) -> bool:
        if self.inline_max_s <= 0:
            return False
        if self.mean_s <= self.inline_max_s:
            return True
        self._since_probe += 1
        if self._since_probe >= self.PROBE_EVERY:
            self._since_probe = 0
            return True
        return False

    def note(self, seconds: float) -> None:
        self.mean_s += self.WEIGHT * (seconds - self.mean_s)


class SyncThread:
    """One thread that runs ``wal.sync`` on request and hands the outcome back to the event loop.

    Lighter than an executor per sync: one queue put, one ``call_soon_threadsafe``, no chained
    futures. Requests are bounded by construction: the group commit waits for each before the next.
    """

    def __init__(self, wal: WriteAheadLog) -> None:
        self.wal = wal
        self._requests: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="wal-sync", daemon=True)
        self._thread.start()

    def sync(self) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        self._requests.put((loop, fut))
        return fut

    def _run(self) -> None:
        while True:
            req = self._requests.get()
            if req is None:
                return
            loop, fut = req
            try:
                seq = self.wal.sync()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which stops the node
                _hand_over(loop, fut, None, exc)
            else:
                _hand_over(loop, fut, seq, None)

    def stop(self) -> None:
        self._requests.put(None)
        self._thread.join()


def _hand_over(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[int], seq: int | None,
               exc: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():  # cancelled: the node is stopping
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            assert seq is not None
            fut.set_result(seq)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


class GroupCommit:
    def __init__(
        self,
        wal: WriteAheadLog,
        hosts: list[ShardHost],
        on_fatal: Callable[[BaseException], None],
        after_commit: Callable[[], None],
        inline_sync_max_us: int = 0,
        lazy_sync_delay_ms: int = 0,
        unsafe_ack_before_sync: bool = False,  # deliberately broken build (testing.Faults)
        slow_sync_s: float = 0.0,  # test instrument (testing.Faults): a slow disk
        inline_only: bool = False,  # no sync thread: every sync on the loop (the simulator's threads seam)
        sync_runner: Callable[[WriteAheadLog], SyncRunner] | None = None,  # instead of a SyncThread (seams)
    ) -> None:
        self.slow_sync_s = slow_sync_s
        self.wal = wal
        self.hosts = hosts
        self.on_fatal = on_fatal
        self.after_commit = after_commit
        self.max_stage_bytes = max(1 << 20, wal.max_pending_bytes // 2)
        self.unsafe_ack_before_sync = unsafe_ack_before_sync
        self._wake = asyncio.Event()
        self._dirty: set[int] = set()
        # Whether a proposal since the last sync waits for it; lazy ones alone wait for a timer.
        self._urgent = False
        self.lazy_sync_delay_s = lazy_sync_delay_ms / 1000
        self._lazy_timer: asyncio.TimerHandle | None = None
        # Groups of several members whose batch holds lazy proposals only (shard -> batch length
        # then). An entry costs such a group a replication round on every member (append, a sync
        # on each, the commit), so their lazy proposals do not ride on another shard's sync: they
        # go with the next urgent proposal to the same shard, or when the lazy timer ends.
        self._lazy_only: dict[int, int] = {}
        self._release_lazy = False  # the lazy timer ended (or a flush): held proposals go now
        self.lazy_syncs = 0  # syncs that carried only lazy commands (their timer ran out)
        self._flush_waiters: list[asyncio.Future[None]] = []  # woken when the next pass is done
        self.timer = SyncTimer(inline_sync_max_us / 1e6)
        self._sync_thread: SyncRunner | None = (
            sync_runner(wal) if sync_runner is not None else None if inline_only else SyncThread(wal))
        self._stopped = False
        self.syncs = 0
        self.shard_batches_synced = 0  # (shard, sync) pairs: how many shards one sync covers on average

    def kick(self, shard: int) -> None:
        self._dirty.add(shard)
        held = self._lazy_only.get(shard)
        if held is not None and self.hosts[shard].batch_len() != held:
            del self._lazy_only[shard]  # an urgent proposal joined the held ones: they go with it
        if not self._urgent:  # called once per proposal: the event is set by the first of a pass
            self._urgent = True
            self._wake.set()

    def kick_lazy(self, shard: int) -> None:
        """A proposal nobody waits for: synced with the next urgent one, or when the lazy timer ends
        (in a group of several members: the next urgent one to the same shard, see ``_lazy_only``)."""
        self._dirty.add(shard)
        host = self.hosts[shard]
        conf = host.raft.active_conf_state
        if len(conf.voters) > 1 or conf.learners:
            size = host.batch_len()
            if size == 1 or self._lazy_only.get(shard) == size - 1:
                self._lazy_only[shard] = size  # nothing urgent in the batch: held back
            if self._lazy_timer is None:
                self._lazy_timer = asyncio.get_running_loop().call_later(self.lazy_sync_delay_s, self._lazy_due)
            return
        if not self._urgent and self._lazy_timer is None:
            self._lazy_timer = asyncio.get_running_loop().call_later(self.lazy_sync_delay_s, self._lazy_due)

    async def flush(self, timeout_s: float) -> bool:
        """Sync and apply everything proposed so far, lazy commands included (at shutdown), waiting
        at most ``timeout_s``. False when that was not done in time."""
        if self._stopped or (not self._dirty and not self._urgent and not self._lazy_only):
            return True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(done)
        self._release_lazy = True
        self._dirty.update(self._lazy_only)
        self._urgent = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            return False
        return True

    def _lazy_due(self) -> None:
        self._lazy_timer = None
        self.lazy_syncs += 1
        self._release_lazy = True
        self._dirty.update(self._lazy_only)
        self._urgent = True
        self._wake.set()

    async def run(self) -> None:
        while not self._stopped:
            await self._wake.wait()
            self._wake.clear()
            if self._lazy_timer is not None and not self._lazy_only:
                self._lazy_timer.cancel()  # an urgent proposal takes the lazy ones along
                self._lazy_timer = None
            # One more loop pass lets every connection's already-read packets join this batch.
            await asyncio.sleep(0)
            self._urgent = False  # proposals from here on wake the next pass
            dirty, self._dirty = sorted(self._dirty), set()
            flushed, self._flush_waiters = self._flush_waiters, []
            try:
                alive = await self._commit(dirty)
            finally:
                for fut in flushed:
                    if not fut.done():
                        fut.set_result(None)
            if not alive:
                return

    async def _commit(self, dirty: list[int]) -> bool:
        """One pass: seal, stage, sync once, apply. False when a failed sync stopped the node."""
        staged: list[ShardHost] = []
        release, self._release_lazy = self._release_lazy, False
        lazy_only = self._lazy_only
        for shard in dirty:
            host = self.hosts[shard]
            if host.failed is not None or not host.has_work():
                lazy_only.pop(shard, None)
                continue
            if staged and self.wal.pending_bytes() + host.batch_bytes > self.max_stage_bytes:
                self._dirty.add(shard)  # over the staging budget: this shard joins the next sync
                self._wake.set()
                continue
            try:
                if shard in lazy_only and not release:
                    rd = host.take_ready()  # its lazy proposals wait; what the core has does not
                else:
                    lazy_only.pop(shard, None)
                    rd = host.seal()
                if rd is not None and not rd.must_sync and not rd.entries and rd.snapshot is None:
                    # Nothing this Ready's messages depend on needs a sync (a follower's heartbeat
                    # response, a new commit index): handled now, its hard state riding on the next sync.
                    if rd.hard_state is not None:
                        self.stage_hard_state(shard, rd.hard_state)
                    if host.after_sync(self.stage_hard_state):
                        self._dirty.add(shard)
                        self._urgent = True
                        self._wake.set()
                    continue
                if rd is not None:
                    stage_ready(self.wal, shard, rd)
                    staged.append(host)
            except OSError:
                raise  # the WAL itself failed: every shard's durability is unknown (the node stops)
            except Exception as exc:  # a bug in one shard stops that shard; the others go on
                host.fail_on_bug("commit", exc)
        if lazy_only and self._lazy_timer is None:
            self._lazy_timer = asyncio.get_running_loop().call_later(self.lazy_sync_delay_s, self._lazy_due)
        if not staged and self.wal.pending_bytes() == self.wal.pending_hard_state_bytes():
            # Nothing waits for a sync: hard states alone (a new commit index, on a follower after
            # every round) ride on the next one instead of costing an fdatasync each.
            return True
        if self.unsafe_ack_before_sync:  # deliberately broken build for the crash harness
            self._after_sync(staged)
            # Acknowledged, then synced only a while later (like a periodic flush): the window
            # in which a kill plus power loss loses acknowledged messages is most of the run,
            # so the harness catches this build every time, not only when a kill is lucky.
            await asyncio.sleep(UNSAFE_SYNC_DELAY_S)
        if self.slow_sync_s:
            await asyncio.sleep(self.slow_sync_s)
        try:
            if self._sync_thread is None or self.timer.use_inline():
                started = time.perf_counter()
                self.wal.sync()  # blocks the loop for about timer.mean_s: cheaper than a hand-off
                self.timer.note(time.perf_counter() - started)
                self.timer.inline += 1
            else:
                self.timer.threaded += 1
                await self._sync_thread.sync()
        except asyncio.CancelledError:
            raise  # node stopping: the final sync happens in Node.stop
        except Exception as exc:  # a failed fsync leaves durability unknown: stop the node
            log.critical("WAL sync failed: %s; stopping without acknowledging", exc)
            for host in staged:
                host.fail(f"WAL sync failed: {exc}")
            self.on_fatal(exc)
            return False
        self.syncs += 1
        self.shard_batches_synced += len(staged)
        if not self.unsafe_ack_before_sync:
            self._after_sync(staged)
        self.after_commit()
        return True

    def _after_sync(self, staged: list[ShardHost]) -> None:
        for host in staged:
            try:
                more = host.failed is None and host.after_sync(self.stage_hard_state)
            except OSError:
                raise
            except Exception as exc:  # an apply bug stops its shard (DESIGN: one bad shard stops one shard)
                host.fail_on_bug("apply", exc)
                continue
            if more:
                self._dirty.add(host.shard)  # the core has more for the WAL: another pass
                self._urgent = True
                self._wake.set()

    def stage_hard_state(self, shard: int, hs: HardState) -> None:
        stage_hard_state(self.wal, shard, hs)

    def stop(self) -> None:
        self._stopped = True
        if self._lazy_timer is not None:
            self._lazy_timer.cancel()
            self._lazy_timer = None
        self._wake.set()
        if self._sync_thread is not None:
            self._sync_thread.stop()
