"""Snapshot transfers between nodes: a leader sends its shard snapshot and message store to a
follower too far behind its log; the follower stages them and hands the snapshot to its core.

A snapshot is the shard state at an index plus the store records still live (docs/design.md). The
Raft core decides that a follower needs one (its log no longer holds the entries the follower
lacks) and emits a MsgSnapshot carrying only the snapshot's metadata. The cluster link hands that
message here instead of to the wire (``SnapshotTransfers.offer``), and a transfer starts:

leader                                              follower
  hold the store's reclaim; take a fresh snapshot
  Offer(shard, members, terms, index, meta, sizes) ->  checks, creates its staging directory
                                                  <-   Ack(0)
  Chunk(1..n): the snapshot file, then the store's
  records in [low-water mark, next offset), framed
  as in the store, each chunk with a CRC32C      ->   verifies, writes (a thread), Ack(seq)
  Done(n)                                        ->   syncs, verifies the whole file, decodes the
                                                      state, steps the MsgSnapshot into the core
                                                  <-   Ack(n, final)

Everything travels as ``Payload("snap", ...)`` frames on the transport's snapshot stream, so bulk
chunks never queue in front of a heartbeat (control stream) or an append. Bounded: chunks of
``cluster.snapshot_chunk_bytes``, at most ``cluster.snapshot_window_chunks`` of them unacknowledged,
at most ``cluster.max_snapshot_transfers`` transfers out and as many in per node; a transfer with
no progress for ``cluster.snapshot_stall_timeout_s`` is abandoned on both sides (the leader tells
its core: ``report_snapshot(follower, False)``, and the core offers again later). Any refusal,
damaged chunk, lost frame (a gap in the sequence), leadership change or failed write ends the
transfer the same way; nothing half-received is ever installed (snapshot_install.py).

The leader takes a fresh snapshot for each transfer after holding its store's reclaim, so every
record the state keeps is still in the store while it is read; the transfer may send a newer
snapshot than the core's message named, which the core accepts (the follower acknowledges the
index it installed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from moorline import coverage
from moorline.hashing import crc32c
from moorline.node.errors import ShardUnavailable
from moorline.node.replication import snapshot_install
from moorline.node.replication.shard_host import ShardHost
from moorline.node.replication.snapshots import decode_conf
from moorline.node.replication.transfer_staging import (
    PART_RECORDS,
    PART_STATE,
    Incoming,
    close_staging,
    finish_staging,
    open_staging,
    write_chunk,
)
from moorline.raft import MemberId, Message, MessageType
from moorline.raft.types import Snapshot, SnapshotMeta
from moorline.storage.msgstore import MessageStore

log = logging.getLogger("moorline.snapshot")

T = TypeVar("T")
PAYLOAD_KIND = "snap"
BUSY = "(cluster.max_snapshot_transfers)"  # ends the reason of a refusal for want of a free slot


class Offer(msgspec.Struct, tag=1, array_like=True, frozen=True):
    transfer: int
    shard: int
    leader: tuple[int, str]
    follower: tuple[int, str]
    leader_term: int  # the leader's Raft term when it started
    index: int
    term: int
    meta: bytes  # the membership configuration as of ``index`` (the snapshot file's meta)
    state_file_bytes: int
    low_water: int
    next_offset: int


class Chunk(msgspec.Struct, tag=2, array_like=True, frozen=True):
    transfer: int
    seq: int  # 1, 2, ... (0 is the offer)
    part: int
    data: bytes
    crc: int


class Done(msgspec.Struct, tag=3, array_like=True, frozen=True):
    transfer: int
    seq: int  # after the last chunk
    records: int


class Ack(msgspec.Struct, tag=4, array_like=True, frozen=True):
    transfer: int
    seq: int
    ok: bool = True
    reason: str = ""
    final: bool = False  # the follower's core has the snapshot (or, not ok, will not)


class Cancel(msgspec.Struct, tag=5, array_like=True, frozen=True):
    transfer: int
    reason: str


SnapMessage = Offer | Chunk | Done | Ack | Cancel
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[SnapMessage] = msgspec.msgpack.Decoder(SnapMessage)  # type: ignore[arg-type]


def encode(msg: SnapMessage) -> bytes:
    return _encoder.encode(msg)


@dataclass(frozen=True, slots=True)
class TransferLimits:
    chunk_bytes: int = 1 << 20
    window_chunks: int = 4
    max_transfers: int = 2  # out, and again in, per node
    stall_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, cfg: Any) -> TransferLimits:
        return cls(cfg.snapshot_chunk_bytes, cfg.snapshot_window_chunks, cfg.max_snapshot_transfers,
                   cfg.snapshot_stall_timeout_s)


class TransferAbort(Exception):
    """A transfer ends without an install; the message says why (logged, and sent to the peer)."""


@dataclass
class TransferStats:
    sent: int = 0  # transfers a follower installed (final ack)
    send_failed: int = 0
    received: int = 0  # transfers handed to this node's core
    receive_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_failure: str | None = None


# --- the leader's side ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Outgoing:
    id: int
    shard: int
    to: MemberId
    peer: str
    acked: int = -1
    final: bool = False
    refused: str | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


# --- both sides (the follower's file work: transfer_staging.py) ---------------------------------


class SnapshotTransfers:
    """Both sides of snapshot transfers for one node (see the module doc)."""

    def __init__(
        self,
        limits: TransferLimits,
        send: Callable[[str, bytes], bool],
        hosts: Callable[[], Sequence[ShardHost]],
        on_raft: Callable[[int, Message], None],
        node_id_of: Callable[[str], int],
        name_of: Callable[[int], str],
        rng: random.Random | None = None,
    ) -> None:
        self.limits = limits
        self._send_raw = send  # (peer, encoded message) on the snapshot stream; False when dropped
        self._hosts = hosts
        self._on_raft = on_raft
        self._node_id_of = node_id_of
        self._name_of = name_of
        self._rng = rng or random.Random()
        self._out: dict[int, _Outgoing] = {}
        self._out_by_target: dict[tuple[int, MemberId], _Outgoing] = {}
        self._in: dict[int, Incoming] = {}
        self.stats = TransferStats()
        self._closed = False

    # --- entry points ---------------------------------------------------------------------------
    def offer(self, shard: int, m: Message) -> None:
        """The core of ``shard`` wants ``m`` (a MsgSnapshot) sent: start a transfer to its
        follower unless one runs already; at the limit, tell the core it failed (it offers again)."""
        hosts = self._hosts()
        if self._closed or not 0 <= shard < len(hosts):
            return
        host = hosts[shard]
        key = (shard, m.to)
        if key in self._out_by_target:
            return  # the core re-offers while one runs (its own timer): that one goes on
        if len(self._out) >= self.limits.max_transfers:
            host.raft.report_snapshot(m.to, False)
            return
        t = _Outgoing(self._new_id(), shard, m.to, self._name_of(m.to[0]))
        coverage.hit("snapshot_sent")
        self._out[t.id] = t
        self._out_by_target[key] = t
        t.task = asyncio.get_running_loop().create_task(self._run_send(host, t), name=f"snapshot-send:{shard}")

    def on_payload(self, peer: str, data: bytes) -> None:
        """A ``Payload("snap")`` frame from ``peer`` (event loop; never blocks)."""
        try:
            msg = _decoder.decode(data)
        except (msgspec.DecodeError, ValueError) as exc:
            log.warning("snapshot transfer: dropping a malformed message from %s: %r", peer, str(exc)[:200])
            return
        if type(msg) is Ack:
            out = self._out.get(msg.transfer)
            if out is not None and out.peer == peer:
                if not msg.ok:
                    out.refused = msg.reason or "refused"
                elif msg.seq > out.acked:
                    out.acked = msg.seq
                out.final = out.final or msg.final
                out.progress.set()
        elif type(msg) is Offer:
            self._on_offer(peer, msg)
        elif type(msg) is Chunk or type(msg) is Done:
            t = self._in.get(msg.transfer)
            if t is None or t.peer != peer:
                return  # abandoned already (the sender hears of it by its stall timeout)
            if msg.seq != t.next_seq:
                self._abort_in(t, f"chunk {msg.seq} arrived where {t.next_seq} was expected (a frame was lost)")
                return
            t.next_seq += 1
            try:
                t.queue.put_nowait(msg)
            except asyncio.QueueFull:
                self._abort_in(t, "the leader sent more chunks than the window allows")
        elif type(msg) is Cancel:
            t = self._in.get(msg.transfer)
            if t is not None and t.peer == peer:
                self._abort_in(t, f"the leader cancelled it: {msg.reason}", tell=False)

    async def close(self) -> None:
        self._closed = True
        tasks = [t.task for t in self._out.values() if t.task is not None]
        tasks += [t.task for t in self._in.values() if t.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def snapshot_stats(self) -> dict[str, Any]:
        return {"sending": [{"shard": t.shard, "to": t.peer, "acked_chunks": max(0, t.acked)}
                            for t in self._out.values()],
                "receiving": [{"shard": t.offer.shard, "from": t.peer, "chunks": t.next_seq - 1}
                              for t in self._in.values()],
                **dataclasses.asdict(self.stats)}

    # --- sending --------------------------------------------------------------------------------
    def _new_id(self) -> int:
        while True:
            tid = self._rng.getrandbits(62) + 1
            if tid not in self._out:
                return tid

    def _send(self, peer: str, msg: SnapMessage) -> None:
        data = encode(msg)
        if not self._send_raw(peer, data):
            raise TransferAbort(f"the link to {peer} dropped a frame (queue full or disconnected)")
        if type(msg) is Chunk:
            self.stats.bytes_sent += len(msg.data)

    async def _run_send(self, host: ShardHost, t: _Outgoing) -> None:
        store = host.store
        store.hold_reclaim()
        ok = False
        try:
            await self._send_transfer(host, t, store)
            ok = True
            self.stats.sent += 1
        except TransferAbort as exc:
            self._send_failed(host, t, str(exc))
        except ShardUnavailable as exc:
            self._send_failed(host, t, str(exc))
        except OSError as exc:
            self._send_failed(host, t, f"reading the snapshot failed: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not take the node down; the core offers again
            log.exception("shard %d: snapshot transfer to %s failed", t.shard, t.peer)
            self._send_failed(host, t, repr(exc))
        finally:
            store.release_reclaim()
            self._out.pop(t.id, None)
            self._out_by_target.pop((t.shard, t.to), None)
            if ok and host.raft.is_leader:
                host.raft.report_snapshot(t.to, True)

    def _send_failed(self, host: ShardHost, t: _Outgoing, reason: str) -> None:
        self.stats.send_failed += 1
        self.stats.last_failure = f"shard {t.shard} to {t.peer}: {reason}"
        log.log(logging.INFO if reason.endswith(BUSY) else logging.WARNING,
                "shard %d: snapshot transfer to %s abandoned: %s", t.shard, t.peer, reason)
        try:
            self._send_raw(t.peer, encode(Cancel(t.id, reason[:500])))
        except Exception:  # noqa: BLE001 - best effort: the follower's stall timeout ends it too
            pass
        if host.raft.is_leader:
            host.raft.report_snapshot(t.to, False)

    def _check_leading(self, host: ShardHost, term: int, store: MessageStore) -> None:
        if not host.raft.is_leader or host.raft.term != term:
            raise TransferAbort("this node no longer leads the shard")
        if host.store is not store or host.failed is not None:
            raise TransferAbort(f"the shard's store changed or failed ({host.failed or 'replaced'})")

    async def _wait_ack(self, t: _Outgoing, seq: int, final: bool = False) -> None:
        stall = self.limits.stall_timeout_s
        while not (t.final if final else t.acked >= seq):
            if t.refused is not None:
                raise TransferAbort(f"{t.peer} refused it: {t.refused}")
            t.progress.clear()
            try:
                await asyncio.wait_for(t.progress.wait(), stall)
            except TimeoutError:
                raise TransferAbort(f"no progress from {t.peer} for {stall:g} s") from None
        if t.refused is not None:
            raise TransferAbort(f"{t.peer} refused it: {t.refused}")

    async def _send_transfer(self, host: ShardHost, t: _Outgoing, store: MessageStore) -> None:
        term = host.raft.term
        seq = 0
        window = self.limits.window_chunks
        chunk = self.limits.chunk_bytes
        executor = host.snapshot_settings.executor
        self._check_leading(host, term, store)
        info = await host.fresh_snapshot()
        self._check_leading(host, term, store)
        fd = os.open(info.path, os.O_RDONLY)  # kept open: a later snapshot may prune the file meanwhile
        try:
            size = os.fstat(fd).st_size
            self._send(t.peer, Offer(t.id, t.shard, host.raft.id, t.to, term, info.index, info.term, info.meta,
                                     size, info.low_water, info.next_offset))
            await self._wait_ack(t, 0)
            pos = 0
            while pos < size:
                data = await _io(executor, os.pread, fd, min(chunk, size - pos), pos)
                if not data:
                    raise TransferAbort("the snapshot file ended early")
                pos += len(data)
                seq += 1
                await self._wait_ack(t, seq - window)
                self._check_leading(host, term, store)
                self._send(t.peer, Chunk(t.id, seq, PART_STATE, data, crc32c(data)))
        finally:
            os.close(fd)
        records = 0
        offset = info.low_water
        while offset < info.next_offset:
            await self._wait_ack(t, seq + 1 - window)
            self._check_leading(host, term, store)
            plan = store.plan_read(offset, info.next_offset, chunk)
            if plan is None:
                break
            # Read off the loop: the store is held (no segment goes away) and the run was written.
            data = await _io(executor, MessageStore.read_plan, plan)
            self._check_leading(host, term, store)
            offset = plan.next_offset
            records += plan.records
            seq += 1
            self._send(t.peer, Chunk(t.id, seq, PART_RECORDS, data, crc32c(data)))
        await self._wait_ack(t, seq)
        self._send(t.peer, Done(t.id, seq + 1, records))
        await self._wait_ack(t, seq + 1, final=True)
        log.info("shard %d: %s installed this node's snapshot at index %d (%d bytes of state, %d records)",
                 t.shard, t.peer, info.index, info.size, records)

    # --- receiving ------------------------------------------------------------------------------
    def _on_offer(self, peer: str, offer: Offer) -> None:
        reason = self._refusal(peer, offer)
        if reason is not None:
            self.stats.receive_failed += 1
            self.stats.last_failure = f"shard {offer.shard} from {peer}: {reason}"
            # Busy is flow control (the leader offers again), not trouble.
            log.log(logging.INFO if reason.endswith(BUSY) else logging.WARNING,
                    "shard %d: refused a snapshot from %s: %s", offer.shard, peer, reason)
            self._reply(peer, Ack(offer.transfer, 0, False, reason, final=True))
            return
        host = self._hosts()[offer.shard]
        root = host.snapshot_settings.install_root
        assert root is not None
        directory = snapshot_install.staging_dir(root, offer.shard, f"{offer.index}-{offer.transfer:x}")
        t = Incoming(offer, peer, host, directory, asyncio.Queue(self.limits.window_chunks + 1))
        self._in[offer.transfer] = t
        t.task = asyncio.get_running_loop().create_task(self._run_receive(t), name=f"snapshot-receive:{offer.shard}")

    def _refusal(self, peer: str, offer: Offer) -> str | None:
        hosts = self._hosts()
        if self._closed:
            return "the node is stopping"
        if not 0 <= offer.shard < len(hosts):
            return f"no shard {offer.shard} here"
        try:
            peer_id = self._node_id_of(peer)
        except ValueError:
            return f"unknown peer {peer!r}"
        if offer.leader[0] != peer_id:
            return f"the offer names leader {offer.leader[0]}, but came from {peer} ({peer_id})"
        host = hosts[offer.shard]
        if host.snapshot_settings.install_root is None:
            return "this node installs no snapshots"
        if tuple(offer.follower) != host.raft.id:
            return f"meant for member {tuple(offer.follower)}, this replica is {host.raft.id}"
        if host.failed is not None:
            # A replica with damaged synced data refuses to vote until it is re-added as a new
            # member (docs/design.md); a snapshot alone does not make it one.
            return f"the shard refuses service here: {host.failed}"
        if offer.index <= host.raft.log.committed:
            return f"not needed: this replica has committed index {host.raft.log.committed}"
        if not (0 <= offer.low_water <= offer.next_offset) or offer.state_file_bytes <= 0:
            return "implausible sizes"
        for t in list(self._in.values()):
            if t.offer.shard == offer.shard:
                if t.peer == peer and t.offer.leader_term <= offer.leader_term:
                    self._abort_in(t, "the leader started another transfer")  # it gave up on that one
                else:
                    return "another transfer of this shard is in progress"
        if host.staged_install is not None or host.installed is not None:
            return "an install of this shard is in progress"
        if len(self._in) >= self.limits.max_transfers:
            return f"{self.limits.max_transfers} transfers are in progress here {BUSY}"
        return None

    def _reply(self, peer: str, ack: Ack) -> None:
        if not self._send_raw(peer, encode(ack)):
            log.debug("snapshot transfer: an acknowledgement to %s was dropped", peer)

    def _abort_in(self, t: Incoming, reason: str, tell: bool = True) -> None:
        if self._in.get(t.offer.transfer) is not t:
            return
        del self._in[t.offer.transfer]
        self.stats.receive_failed += 1
        self.stats.last_failure = f"shard {t.offer.shard} from {t.peer}: {reason}"
        log.warning("shard %d: snapshot transfer from %s abandoned: %s", t.offer.shard, t.peer, reason)
        if tell:
            self._reply(t.peer, Ack(t.offer.transfer, t.next_seq - 1, False, reason[:500], final=True))
        if t.task is not None and t.task is not asyncio.current_task():
            t.task.cancel()

    async def _run_receive(self, t: Incoming) -> None:
        executor = t.host.snapshot_settings.executor
        staged: snapshot_install.StagedInstall | None = None
        try:
            await _io(executor, open_staging, t)
            self._reply(t.peer, Ack(t.offer.transfer, 0))
            while True:
                try:
                    item = await asyncio.wait_for(t.queue.get(), self.limits.stall_timeout_s)
                except TimeoutError:
                    raise TransferAbort(f"no chunk from {t.peer} for {self.limits.stall_timeout_s:g} s") from None
                if item is None:
                    raise TransferAbort("cancelled")
                if type(item) is Chunk:
                    await _io(executor, write_chunk, t, item)
                    self.stats.bytes_received += len(item.data)
                    self._reply(t.peer, Ack(t.offer.transfer, item.seq))
                    continue
                assert type(item) is Done
                if item.records != len(t.received):
                    raise TransferAbort(f"{len(t.received)} records arrived, the leader sent {item.records}")
                staged = await _io(executor, finish_staging, t)
                await self._hand_to_core(t, staged, item.seq)
                return
        except TransferAbort as exc:
            self._abort_in(t, str(exc))
        except (OSError, ValueError) as exc:  # a bad record, a failed write or fsync, an undecodable state
            self._abort_in(t, f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("shard %d: receiving a snapshot failed", t.offer.shard)
            self._abort_in(t, repr(exc))
        finally:
            self._in.pop(t.offer.transfer, None)
            if not t.handed:
                close_staging(t)
                if staged is not None:
                    staged.store.close()
                t.host.snaps.run_io(snapshot_install.discard_staging, t.directory)

    async def _hand_to_core(self, t: Incoming, staged: snapshot_install.StagedInstall, seq: int) -> None:
        host, offer = t.host, t.offer
        if self._in.get(offer.transfer) is not t:
            raise TransferAbort("abandoned")
        if host.failed is not None or host.staged_install is not None or host.installed is not None:
            raise TransferAbort("the shard cannot take it now")
        host.staged_install = staged  # no new snapshot of the old state starts from here on
        try:
            await host.snapshot_idle()
            if host.failed is not None or offer.index <= host.raft.log.committed:
                raise TransferAbort(f"not needed any more: committed index {host.raft.log.committed}")
            conf = decode_conf(offer.meta)
            if conf is None:
                raise TransferAbort("the snapshot records no membership configuration")
            snap = Snapshot(meta=SnapshotMeta(index=offer.index, term=offer.term, conf_state=conf))
            self._on_raft(offer.shard, Message(type=MessageType.SNAP, from_=tuple(offer.leader),  # type: ignore[arg-type]
                                               to=host.raft.id, term=offer.leader_term, snapshot=snap))
            pending = host.raft.log.unstable_snapshot
            if host.staged_install is not staged or pending is None or pending.meta.index != offer.index:
                raise TransferAbort("the core did not take it (a newer term, or it holds that entry already)")
        except BaseException:
            if host.staged_install is staged:
                host.staged_install = None
            raise
        t.handed = True
        self._in.pop(offer.transfer, None)
        self.stats.received += 1
        self._reply(t.peer, Ack(offer.transfer, seq, True, final=True))
        log.info("shard %d: received the snapshot at index %d from %s; installing it", offer.shard, offer.index, t.peer)


async def _io(executor: concurrent.futures.Executor | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the node's snapshot executor; on the event loop without one (the
    simulator's inline seam: a seed decides the order of everything)."""
    if executor is None:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
