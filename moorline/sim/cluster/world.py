"""A simulated world of real moorline nodes: 3 or 5 ``Node`` processes in one Python process.

Each node is the production code, built by the production composition root
(``moorline.node.assembly.NodeAssembly``: the node, its MQTT server, ``$SYS``, the loop-lag
watcher, the drain, the admin HTTP app on port 8080; group commit, cluster link and transport)
on its own ``VirtualLoop`` with its seams (DESIGN: simulation seams) pointed at the world:
virtual time (a per-node clock rate within the drift bound and a wall-clock offset), the in-memory network, seeded random bytes, and every fdatasync inline — or, with
``timed_sync``, each WAL sync of group commit taking a drawn stretch of virtual time beside the
loop, as on the production sync thread (``TimedSync``). Its disk is a real directory under the
run's base; a ledger of synced lengths (the crash harness's instrument) lets a crash lose or tear
what was written after the last completed sync, as power loss would.

The world watches what each node puts on the virtual network (``_FrameTap``: Raft messages in
the cluster frames; ``_MqttTap``: MQTT packet types to clients) for the world-state checks
(world_checks.py) and for crashes aimed at a protocol moment (``arm_crash``: the node dies right
after its next vote grant, append response, PUBACK or PUBREC).

A crash drops the node's loop (nothing of it runs again), breaks its connections, closes the files
the process held (releasing its data-directory lock, as the kernel would) and cuts its files back
to their synced lengths plus a seeded few bytes; a restart builds a new node on the same
directory. A pause skips the loop for a while; overdue timers then fire at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from moorline.cluster.limits import TransportLimits
from moorline.cluster.wire import MAGIC, PREAMBLE_BYTES, RaftMessages
from moorline.config import NodeConfig
from moorline.node.assembly import NodeAssembly
from moorline.node.edge.server import MqttServer
from moorline.node.node import Node
from moorline.node.seams import Seams, SyncRunner
from moorline.raft import Message, MessageType
from moorline.sim.cluster.tuning import DEFAULT_TUNING, NodeTuning
from moorline.sim.cluster.vloop import Scheduler, VirtualLoop
from moorline.sim.cluster.vnet import HostNetwork, LinkDelay, SimNetwork
from moorline.sim.cluster.world_checks import (
    DurableAtSend,
    PinCheck,
    PromiseLedger,
    ReadBarrierCheck,
    RecoveredLogCheck,
    canonical_state_findings,
    watch_barriers,
)
from moorline.storage.ledger import SyncLedger
from moorline.storage.wal import WriteAheadLog
from moorline.testing.faults import Faults

log = logging.getLogger("moorline.sim.cluster")

CLUSTER_PORT = 7000
MQTT_PORT = 1883
HTTP_PORT = 8080  # the admin HTTP API (node/admin/http_api.py), served on the virtual network too
EPOCH_MS = 1_790_000_000_000  # the world's wall clock at t=0 (a fixed date: traces replay exactly)


class SimClock:
    """A node's clock: the loop's (virtual, rate-scaled) time, and a wall clock offset from the
    world's by the node's skew. The wall clock is disciplined (NTP, as docs/design.md "Leases and
    clocks" requires): its offset stays the skew while the monotonic clock's rate drifts. (A wall
    clock drifting with the rate put two nodes 1.1 s apart by the end of a seed, past
    cluster.max_clock_offset_ms: a 3-node cluster that forgot a node then refused every CONNECT.)"""

    def __init__(self, loop: VirtualLoop, skew_ms: int) -> None:
        self.loop = loop
        self.skew_ms = skew_ms

    def monotonic(self) -> float:
        return self.loop.time()

    def wall_ms(self) -> int:
        return EPOCH_MS + self.skew_ms + int(self.loop.scheduler.now * 1000)


class MemoryLedger(SyncLedger):
    """Synced lengths per file, in memory: what a crash may keep of each file."""

    def __init__(self) -> None:
        self.synced: dict[str, int] = {}

    def record_many(self, items: Any) -> None:
        for file, length in items:
            self.synced[os.path.abspath(file)] = length

    def forget(self, file: Path) -> None:
        self.synced.pop(os.path.abspath(file), None)

    def cut_unsynced(self, rng: random.Random, extra_bytes_max: int = 16) -> list[str]:
        """Every file back to its synced length plus 0..extra_bytes_max of what followed (power loss)."""
        done = []
        for name, synced in sorted(self.synced.items()):
            try:
                size = os.path.getsize(name)
            except OSError:
                continue
            keep = min(size, synced + rng.randint(0, extra_bytes_max))
            if keep < size:
                os.truncate(name, keep)
                done.append(f"{Path(name).name}:{size}->{keep}")
        return done

    def as_file(self, path: Path) -> Path:
        """The same record in the ledger file format (for tools that read one)."""
        import json
        with open(path, "w", encoding="utf-8") as f:
            for name, length in sorted(self.synced.items()):
                f.write(json.dumps({"file": name, "synced_length": length}) + "\n")
        return path


def seeded_bytes(rng: random.Random) -> Any:
    def draw(n: int) -> bytes:
        return rng.randbytes(n)
    return draw


def draw_sync_s(rng: random.Random) -> float:
    """How long one WAL sync takes: mostly a fast disk, sometimes a slow one, now and then a stall."""
    r = rng.random()
    if r < 0.7:
        return rng.uniform(0.0002, 0.002)
    if r < 0.95:
        return rng.uniform(0.002, 0.02)
    return rng.uniform(0.02, 0.15)


class TimedSync:
    """Group commit's sync runner under the simulator (``Seams.sync_runner``): the production
    ``SyncThread`` with virtual time instead of a thread. ``sync()`` returns at once; the loop goes
    on serving while the sync runs, and after a drawn duration the WAL is written and synced and
    the future resolves. The ledger of synced lengths records the sync only then: a crash before
    (the loop dropped, so the completion never runs) finds nothing of it synced. Appends the loop
    made meanwhile are written with it (in production they wait for the next sync): a sync here
    covers at least what production's would."""

    def __init__(self, wal: WriteAheadLog, draw: Callable[[], float]) -> None:
        self.wal = wal
        self.draw = draw
        self.started = 0
        self.completed = 0

    def sync(self) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        self.started += 1
        loop.call_later(self.draw(), self._complete, fut)
        return fut

    def _complete(self, fut: asyncio.Future[int]) -> None:
        if fut.done():  # cancelled: the node is stopping (Node.stop syncs the WAL itself)
            return
        try:
            seq = self.wal.sync()
        except Exception as exc:  # noqa: BLE001 - handed to group commit, which stops the node
            fut.set_exception(exc)
            return
        self.completed += 1
        fut.set_result(seq)

    def stop(self) -> None:
        return None


_MT = MessageType
_LENGTH = struct.Struct(">I")
_RAFT_FRAME_HEAD = b"\x92\x05"  # a RaftMessages frame body: msgpack array of 2, tag 5 (cluster/wire.py)
_RAFT_DECODER = msgspec.msgpack.Decoder(RaftMessages)
_TAP_MAX_FRAME_BYTES = TransportLimits().max_frame_bytes  # above it the receiver refuses the frame
MOMENTS = ("vote", "append_response", "puback", "pubrec")  # what a crash may be aimed at


class _FrameTap:
    """The cluster frames one side of a connection writes, read as the peer will: every Raft
    message (with its group) goes to ``on_message``. Only RaftMessages frames are decoded."""

    def __init__(self, on_message: Callable[[int, Message], None]) -> None:
        self._decoder = _RAFT_DECODER
        self.on_message = on_message
        self.buf = bytearray()
        self.need_preamble = True
        self.dead = False

    def feed(self, data: bytes) -> None:
        if self.dead:
            return
        buf = self.buf
        buf += data
        if self.need_preamble:
            if len(buf) < PREAMBLE_BYTES:
                return
            if not buf.startswith(MAGIC):  # not a plain cluster stream (TLS): not ours to read
                self.dead = True
                buf.clear()
                return
            del buf[:PREAMBLE_BYTES]
            self.need_preamble = False
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = _LENGTH.unpack_from(buf, pos)
            if size > _TAP_MAX_FRAME_BYTES:  # the peer refuses it: stop reading
                self.dead = True
                buf.clear()
                return
            start = pos + 4
            if end - start < size:
                break
            if buf[start:start + 2] == _RAFT_FRAME_HEAD:
                try:
                    frame = self._decoder.decode(bytes(buf[start:start + size]))
                except Exception:  # noqa: BLE001 - not ours to judge (the peer refuses it): stop reading
                    self.dead = True
                    return
                for group, m in frame.messages:
                    self.on_message(int(group), m)
            pos = start + size
        if pos:
            del buf[:pos]


class _MqttTap:
    """The MQTT packets a node writes to one client: each packet's type goes to ``on_packet``."""

    def __init__(self, on_packet: Callable[[int], None]) -> None:
        self.on_packet = on_packet
        self.buf = bytearray()
        self.dead = False

    def feed(self, data: bytes) -> None:
        if self.dead:
            return
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 2:
            length, shift, i, whole = 0, 0, pos + 1, False
            while i < end and i - pos <= 4:  # the remaining length: at most 4 bytes
                b = buf[i]
                length |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    whole = True
                    break
            if not whole:
                if i - pos > 4:  # not MQTT: stop reading this connection
                    self.dead = True
                    buf.clear()
                    return
                break  # the length's bytes are still to come
            if end - i < length:
                break
            self.on_packet(buf[pos] >> 4)
            pos = i + length
        if pos:
            del buf[:pos]


class _TapProtocol(asyncio.Protocol):
    """The node's MQTT protocol for one connection, with the transport's writes watched."""

    def __init__(self, inner: asyncio.Protocol, on_packet: Callable[[int], None]) -> None:
        self.inner = inner
        self.tap = _MqttTap(on_packet)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        write = transport.write  # type: ignore[attr-defined]
        tap = self.tap

        def watched(data: Any) -> None:
            live = not transport.is_closing()
            write(data)
            if live:
                tap.feed(bytes(data))

        transport.write = watched  # type: ignore[attr-defined]
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _TappedNetwork:
    """A node's cluster network seam with every stream's writes watched (``_FrameTap``)."""

    def __init__(self, inner: HostNetwork, on_message: Callable[[int, Message], None]) -> None:
        self.inner = inner
        self.on_message = on_message

    def _watch(self, stream: Any) -> Any:
        write = stream.write
        tap = _FrameTap(self.on_message)

        def watched(data: bytes | memoryview) -> None:
            live = not stream.closed and stream._error is None
            write(data)
            if live:
                tap.feed(bytes(data))

        stream.write = watched
        return stream

    async def connect(self, host: str, port: int, local_host: str | None) -> Any:
        return self._watch(await self.inner.connect(host, port, local_host))

    async def listen(self, host: str, port: int, on_stream: Callable[[Any], None]) -> Any:
        return await self.inner.listen(host, port, lambda stream: on_stream(self._watch(stream)))


@dataclass
class SimNode:
    name: str
    index: int
    host: str
    data_dir: Path
    ledger: Path  # where the synced lengths are written out for tools (flip_synced_byte)
    memory_ledger: MemoryLedger = field(default_factory=MemoryLedger)
    loop: VirtualLoop | None = None
    assembly: NodeAssembly | None = None  # the node and its edge, as ``moorline run`` builds them
    node: Node | None = None
    server: MqttServer | None = None
    boots: int = 0
    crashed: bool = False
    ready: bool = False
    boot_error: BaseException | None = None
    errors: list[str] = field(default_factory=list)
    armed: str | None = None  # a crash aimed at the next such send (MOMENTS)
    crash_due: bool = False  # the aimed moment came: frozen, to be crashed by the fault plan
    syncer: TimedSync | None = None
    join: str | None = None  # joined a running cluster: `moorline run --join` these seeds (no --initial-cluster)

    @property
    def mqtt(self) -> tuple[str, int]:
        return self.host, MQTT_PORT

    @property
    def http(self) -> tuple[str, int]:
        return self.host, HTTP_PORT


@dataclass
class WorldConfig:
    nodes: int = 3
    shards: int = 4
    replicas: int = 3
    learners: str = "all"  # shard.learners
    tick_ms: int = 100
    election_ticks: int = 10
    owner_lease_s: float = 10.0
    max_skew_ms: int = 200  # wall-clock offsets between nodes, within what leases tolerate
    max_rate_drift: float = 0.01  # clock rates within the documented 2 % bound
    delay: LinkDelay = field(default_factory=LinkDelay)
    publish_timeout_s: float = 5.0
    tuning: NodeTuning = DEFAULT_TUNING  # the seed's node configuration (tuning.py)
    timed_sync: bool = False  # WAL syncs take drawn virtual time beside the loop (TimedSync)
    # Work queues (docs/queues.md): the workload's delivery-limited $share group ("dl") has these.
    queue_limited_groups: tuple[str, ...] = ("dl",)
    queue_max_deliveries: int = 3
    queue_ack_timeout_s: float = 3.0
    # Membership (membership_faults.py): the reconciler's times scaled to a seed's virtual minute.
    reconcile_interval_s: float = 2.0
    reconcile_after_event_s: float = 0.5
    move_timeout_s: float = 10.0
    promote_lag_entries: int = 100
    drain_timeout_s: float = 5.0  # membership_faults.DRAIN_TIMEOUT_S


class World:
    def __init__(self, seed: int, base: Path, cfg: WorldConfig | None = None,
                 switches: frozenset[str] = frozenset()) -> None:
        """``switches``: names of ``Faults`` fields (deliberately broken builds) every node runs with."""
        self.seed = seed
        self.switches = switches
        self.cfg = cfg or WorldConfig()
        self.rng = random.Random(seed)
        self.scheduler = Scheduler(random.Random(self.rng.getrandbits(64)))
        self.net = SimNetwork(self.scheduler, random.Random(self.rng.getrandbits(64)), self.cfg.delay)
        self.base = base
        self.crash_rng = random.Random(self.rng.getrandbits(64))
        self.events: list[str] = []
        self.forgotten: set[str] = set()  # nodes forgotten by the membership faults: never restarted
        self.nodes: list[SimNode] = []
        self.scheduler.on_error = self._loop_error
        names = [f"n{i}" for i in range(1, self.cfg.nodes + 1)]
        self.secret_file = base / "cluster.secret"
        base.mkdir(parents=True, exist_ok=True)
        self.secret_file.write_text(self.rng.randbytes(32).hex() + "\n")
        os.chmod(self.secret_file, 0o600)
        self.initial_cluster = ",".join(f"{n}=10.0.0.{i}:{CLUSTER_PORT}" for i, n in enumerate(names, 1))
        for i, name in enumerate(names, 1):
            d = base / name
            d.mkdir(parents=True, exist_ok=True)
            self.nodes.append(SimNode(name, i, f"10.0.0.{i}", d / "data", d / "ledger.jsonl"))
        self._node_rngs = {n.name: random.Random(self.rng.getrandbits(64)) for n in self.nodes}
        self._skews = {n.name: (self.rng.randint(-self.cfg.max_skew_ms, self.cfg.max_skew_ms),
                                1.0 + self.rng.uniform(-self.cfg.max_rate_drift, self.cfg.max_rate_drift))
                       for n in self.nodes}
        if "no_clock_bound" in switches:  # clocks past the bound (testing/faults.py): 3.5 s apart
            self._skews = {n.name: (3500 * (i - 1), rate) for i, (n, (_s, rate)) in
                           enumerate(zip(self.nodes, self._skews.values(), strict=True))}
        # Drawn last: the draws above (and so every trace without timed syncs) stay as they were.
        self._sync_rngs = {n.name: random.Random(self.rng.getrandbits(64)) for n in self.nodes}
        self.promises = PromiseLedger()  # world_checks.py
        self.durable = DurableAtSend()
        self.recovered_logs = RecoveredLogCheck()
        self.on_install: Callable[[SimNode], None] | None = None  # the fault plan's aim (runner.FaultPlan)
        self.barriers = ReadBarrierCheck()
        self.pins = PinCheck()  # retention holds back from live pins (the workload's pinning reader)
        self.canonical_findings: list[tuple[str, str]] = []  # snapshots installed, or restored at a restart
        self.states_checked_at_crash = 0  # replicas' states restored and compared as their node crashed
        self.installs_checked = 0
        self.aimed_crashes: dict[str, int] = {}  # moment -> armed crashes that fired on it
        self.syncs_timed = 0  # syncs of crashed boots' runners (the live ones are added at the end)
        self.syncs_cut = 0  # syncs a crash fell inside

    # --- events -----------------------------------------------------------------------------------
    def note(self, what: str) -> None:
        self.events.append(f"{self.scheduler.now:10.3f} {what}")

    def _loop_error(self, loop: VirtualLoop, context: dict[str, Any]) -> None:
        if loop.crashed:
            return  # a dead process's leftovers
        msg = context.get("message", "")
        exc = context.get("exception")
        for sn in self.nodes:
            if sn.loop is loop:
                sn.errors.append(f"{msg}: {exc!r}")
                self.note(f"{sn.name} loop error: {msg}: {exc!r}")

    # --- nodes ------------------------------------------------------------------------------------
    def node_config(self, sn: SimNode) -> NodeConfig:
        cfg = NodeConfig()
        cfg.data_dir = str(sn.data_dir)
        cfg.shard.count = self.cfg.shards
        cfg.shard.replicas = self.cfg.replicas
        cfg.shard.learners = self.cfg.learners
        cfg.cluster.node_id = sn.name
        cfg.cluster.listen = f"{sn.host}:{CLUSTER_PORT}"
        cfg.cluster.initial_cluster = self.initial_cluster
        if sn.join is not None:  # as `moorline run --join` (a restart reads cluster.json's record)
            cfg.cluster.initial_cluster, cfg.cluster.join = None, sn.join
        cfg.cluster.secret_file = str(self.secret_file)  # peers authenticate, as off loopback they must
        cfg.raft.tick_interval_ms = self.cfg.tick_ms
        cfg.raft.election_ticks = self.cfg.election_ticks
        cfg.session.owner_lease_s = self.cfg.owner_lease_s
        cfg.mqtt.publish_timeout_s = self.cfg.publish_timeout_s
        cfg.storage.wal_preallocate = False  # no preparer thread
        cfg.storage.inline_sync_max_us = 0
        cfg.listeners.mqtt = f"{sn.host}:{MQTT_PORT}"
        cfg.listeners.http = f"{sn.host}:{HTTP_PORT}"
        cfg.queue.limited_groups = list(self.cfg.queue_limited_groups)
        cfg.queue.max_deliveries = self.cfg.queue_max_deliveries
        cfg.queue.ack_timeout_s = self.cfg.queue_ack_timeout_s
        cfg.cluster.reconcile_interval_s = self.cfg.reconcile_interval_s
        cfg.cluster.reconcile_after_event_s = self.cfg.reconcile_after_event_s
        cfg.cluster.move_timeout_s = self.cfg.move_timeout_s
        cfg.cluster.promote_lag_entries = self.cfg.promote_lag_entries
        cfg.cluster.drain_timeout_s = self.cfg.drain_timeout_s
        self.cfg.tuning.apply(cfg)
        return cfg

    def start(self, sn: SimNode) -> None:
        skew_ms, rate = self._skews[sn.name]
        loop = self.scheduler.new_loop(f"{sn.name}#{sn.boots + 1}", rate)
        sn.loop, sn.crashed, sn.ready, sn.boot_error = loop, False, False, None
        sn.boots += 1
        host_net = self.net.for_host(sn.host, loop)
        sn.syncer, sn.armed, sn.crash_due = None, None, False
        seams = Seams(clock=SimClock(loop, skew_ms),
                      cluster_network=_TappedNetwork(host_net, self._raft_sent(sn, loop)),  # type: ignore[arg-type]
                      random_bytes=seeded_bytes(self._node_rngs[sn.name]), inline_io=True,
                      sync_ledger=sn.memory_ledger,
                      sync_runner=self._sync_runner(sn) if self.cfg.timed_sync else None)
        cfg = self.node_config(sn)
        cfg.validate()

        async def boot() -> None:
            try:
                faults = Faults(**dict.fromkeys(self.switches, True))  # type: ignore[arg-type]
                # The production composition root (node/assembly.py): the node, its authorizer on the
                # virtual clock, $SYS, the lag watcher, the drain and link hooks, the admin HTTP app.
                # The virtual network is closed: anonymous clients and an open HTTP API, as on loopback.
                asm = NodeAssembly(cfg, faults, seams, loopback_only=True, http_auth=False)
                sn.assembly, sn.node, sn.server = asm, asm.node, asm.server
                self._watch_recovery(sn, asm.node)
                if not await asm.start(sn.mqtt, sn.http):
                    raise RuntimeError("stopped while opening")  # nothing asks a simulated node to stop then
                server = asm.server
                on_packet = self._mqtt_sent(sn, loop)
                host_net.serve_protocol(sn.host, MQTT_PORT,
                                        lambda: _TapProtocol(server.protocol_factory(), on_packet))
                assert asm.http_runner is not None and asm.http_runner.server is not None
                host_net.serve_protocol(sn.host, HTTP_PORT, asm.http_runner.server)
                sn.ready = True
                self.note(f"{sn.name} ready (boot {sn.boots})")
            except BaseException as exc:  # noqa: BLE001 - a node that cannot start is a finding
                sn.boot_error = exc
                self.note(f"{sn.name} failed to start: {exc!r}")

        loop.create_task(boot(), name=f"boot-{sn.name}")
        self.note(f"{sn.name} starting (boot {sn.boots})")

    def start_all(self) -> None:
        for sn in self.nodes:
            self.start(sn)

    # --- nodes that join a running cluster (membership_faults.py) --------------------------------
    def add_node(self, name: str) -> SimNode:
        """A new node of the world (not started): the next host address, its own directory, and its
        clock, random bytes and syncs drawn from its own stream (the world's draws stay as they were)."""
        if any(sn.name == name for sn in self.nodes):
            raise ValueError(f"the world has a node {name!r} already")
        index = max(sn.index for sn in self.nodes) + 1
        d = self.base / name
        d.mkdir(parents=True, exist_ok=True)
        sn = SimNode(name, index, f"10.0.0.{index}", d / "data", d / "ledger.jsonl")
        rng = random.Random(f"{self.seed}/node/{name}")
        self._node_rngs[name] = random.Random(rng.getrandbits(64))
        self._skews[name] = (rng.randint(-self.cfg.max_skew_ms, self.cfg.max_skew_ms),
                             1.0 + rng.uniform(-self.cfg.max_rate_drift, self.cfg.max_rate_drift))
        self._sync_rngs[name] = random.Random(rng.getrandbits(64))
        self.nodes.append(sn)
        self.note(f"{name} added to the world at {sn.host}")
        return sn

    def wipe(self, sn: SimNode) -> None:
        """A crashed node's data directory deleted (a replaced disk): a start makes a new member.
        The world-state checks forget what the old storage promised (a new storage promised nothing)."""
        if not sn.crashed:
            raise ValueError(f"{sn.name} is running: crash it before wiping its data")
        import shutil

        shutil.rmtree(sn.data_dir, ignore_errors=True)
        sn.memory_ledger = MemoryLedger()
        p, r = self.promises, self.recovered_logs
        for d in (p.term_sent, p.acked, r.cursor, self.pins.samples):
            for key in [k for k in d if k[0] == sn.name]:
                del d[key]  # type: ignore[attr-defined]
        for vote in [k for k in p.votes if k[0] == sn.name]:
            del p.votes[vote]
        self.note(f"{sn.name}: data directory wiped")

    # --- what nodes send; crashes aimed at it ----------------------------------------------------
    def _sync_runner(self, sn: SimNode) -> Callable[[WriteAheadLog], SyncRunner]:
        rng = self._sync_rngs[sn.name]

        def make(wal: WriteAheadLog) -> SyncRunner:
            sn.syncer = TimedSync(wal, lambda: draw_sync_s(rng))
            return sn.syncer
        return make

    def _raft_sent(self, sn: SimNode, loop: VirtualLoop) -> Callable[[int, Message], None]:
        def sent(group: int, m: Message) -> None:
            if loop.crashed:
                return
            self.promises.on_send(sn.name, group, m, self._term_of(sn, group, m.term))
            self.durable.on_send(sn.name, group, m)
            if sn.armed is not None and not m.reject and (
                    (sn.armed == "vote" and m.type == _MT.VOTE_RESP)
                    or (sn.armed == "append_response" and m.type == _MT.APP_RESP)):
                self._aimed(sn, loop)
        return sent

    def _term_of(self, sn: SimNode, group: int, term: int) -> Callable[[int], int | None]:
        def term_of(index: int) -> int | None:
            node = sn.node
            if node is None or not 0 <= group < len(node.groups):
                return None
            raft = node.groups[group].raft
            if raft.term != term:
                return None  # its log may have changed since, in a later term
            return raft.log.term_or_zero(index) or None
        return term_of

    def _mqtt_sent(self, sn: SimNode, loop: VirtualLoop) -> Callable[[int], None]:
        def sent(packet_type: int) -> None:
            if loop.crashed or sn.armed is None:
                return
            if (sn.armed == "puback" and packet_type == 4) or (sn.armed == "pubrec" and packet_type == 5):
                self._aimed(sn, loop)
        return sent

    def arm_crash(self, sn: SimNode, moment: str) -> None:
        """Crash ``sn`` right after it next sends ``moment`` (MOMENTS); ``disarm`` if it never does."""
        if moment not in MOMENTS:
            raise ValueError(f"unknown moment {moment!r}: one of {', '.join(MOMENTS)}")
        sn.armed = moment
        self.note(f"{sn.name}: a crash armed for its next {moment}")

    def disarm(self, sn: SimNode) -> None:
        if sn.armed is not None:
            self.note(f"{sn.name}: the crash armed for its next {sn.armed} disarmed")
            sn.armed = None

    def _aimed(self, sn: SimNode, loop: VirtualLoop) -> None:
        """The moment came: the node's loop never runs another step (the bytes it wrote are on
        their way); the fault plan crashes it at its next look (``take_due_crashes``)."""
        moment = sn.armed or ""
        self.note(f"{sn.name}: sent a {moment}; crashing")
        sn.armed, sn.crash_due = None, True
        loop.paused_until = math.inf
        self.aimed_crashes[moment] = self.aimed_crashes.get(moment, 0) + 1

    def take_due_crashes(self) -> list[SimNode]:
        due = [sn for sn in self.nodes if sn.crash_due and not sn.crashed]
        for sn in self.nodes:
            sn.crash_due = False
        return due

    # --- recovery and read barriers, watched (world_checks.py) -----------------------------------
    def _watch_recovery(self, sn: SimNode, node: Node) -> None:
        open_groups = node.open_groups
        settings = node.snapshot_settings
        on_installed = settings.on_installed

        def installed(host: Any) -> None:
            # A leader's snapshot just became this replica's state, before anything else applies.
            self.installs_checked += 1
            self.canonical_findings += canonical_state_findings([(sn.name, host.shard, host.state)])
            if on_installed is not None:
                on_installed(host)
            if self.on_install is not None:
                self.on_install(sn)

        settings.on_installed = installed

        def watched(*args: Any, **kwargs: Any) -> None:
            open_groups(*args, **kwargs)
            self.durable.watch(sn.name, node.wal)
            for host in node.groups:
                if host.failed is not None:
                    continue
                raft, log_ = host.raft, host.raft.log
                snap_index = log_.first_index() - 1
                self.promises.on_recovered(sn.name, host.shard, raft.term, raft.vote, snap_index,
                                           log_.last_index(), log_.term_or_zero)
                self.recovered_logs.on_recovered(sn.name, host.shard, snap_index, log_.term_or_zero(snap_index),
                                                 log_.committed, log_.last_index(), log_.term_or_zero)
                if sn.boots > 1 and snap_index > 0:
                    self.canonical_findings += canonical_state_findings([(sn.name, host.shard, host.state)])
                watch_barriers(self.barriers, sn.name, host)

        node.open_groups = watched  # type: ignore[method-assign]
        leave_group = node.startup.leave_group

        def left(host: Any) -> None:
            # A copy dropped (shard.learners = "none") must be one its group no longer counts on:
            # no live leader of the group has this member in its applied configuration.
            me = tuple(node.member)
            leading = [(o.name, o.node.groups[host.shard]) for o in self.nodes
                       if o.node is not None and not o.crashed and o.node.groups[host.shard].raft.is_leader]
            newest = max((oh.raft.term for _, oh in leading), default=0)  # (a deposed leader may not know yet)
            for name, oh in leading:
                if oh.raft.term == newest and me in oh.raft.conf_state.members():
                    self.canonical_findings.append((
                        "copy_dropped_while_member", f"{sn.name} group {host.shard}: dropped its copy while "
                        f"{name}, leading in term {oh.raft.term}, counts it as a member"))
            self.promises.on_left(sn.name, host.shard)
            leave_group(host)

        node.startup.leave_group = left  # type: ignore[method-assign]

    def sample_commits(self) -> None:
        """Record what every live replica committed since the last sample (RecoveredLogCheck), and
        sample its topic shards' pins and messages (PinCheck)."""
        for sn in self.nodes:
            if sn.node is None or sn.crashed:
                continue
            for host in sn.node.groups:
                if host.failed is not None:
                    continue
                log_ = host.raft.log
                self.recovered_logs.sample(sn.name, host.shard, log_.committed, log_.first_index(), log_.term_or_zero)
            for host in sn.node.hosts:
                if host.failed is None and not host.reads_remotely:
                    self.pins.sample(sn.name, host.shard, host.state)

    def check_counts(self) -> dict[str, int]:
        """How much the world-state checks saw (a check that saw nothing proves nothing)."""
        live = sum(sn.syncer.completed for sn in self.nodes if sn.syncer is not None and not sn.crashed)
        counts = {"raft_messages_seen": self.promises.messages_seen, "sends_judged_durable": self.durable.judged,
                  "recoveries_checked": self.promises.recoveries_checked,
                  "recovered_logs_checked": self.recovered_logs.logs_checked,
                  "committed_entries_recorded": self.recovered_logs.entries_recorded,
                  "read_barriers_judged": self.barriers.resolved,
                  "snapshot_installs_checked": self.installs_checked,
                  "states_checked_at_crash": self.states_checked_at_crash,
                  "pin_intervals_judged": self.pins.judged, "pinned_offsets_watched": self.pins.watched}
        if self.cfg.timed_sync:
            counts |= {"syncs_timed": self.syncs_timed + live, "crash_inside_sync": self.syncs_cut}
        counts |= {f"aimed_crash_on_{moment}": n for moment, n in sorted(self.aimed_crashes.items())}
        return counts

    def world_findings(self) -> list[tuple[str, str]]:
        """The world-state checks' verdicts (world_checks.py), with every live replica's state
        restored from its own snapshot bytes."""
        # (not a partial state a reader feed keeps: node/replication/reader.py; it equals no replica's)
        replicas = [(sn.name, h.shard, h.state) for sn in self.nodes if sn.node is not None and sn.ready
                    for h in sn.node.groups if h.failed is None and not h.reads_remotely]
        return (self.promises.findings + self.durable.findings + self.recovered_logs.findings + self.barriers.findings
                + self.canonical_findings
                + self.pins.findings + canonical_state_findings(replicas))

    def crash(self, sn: SimNode, lose_unsynced: bool = True) -> list[str]:
        """kill -9 plus (optionally) power loss: what was not synced may be lost or torn."""
        if sn.loop is None or sn.crashed:
            return []
        if sn.node is not None and sn.ready:
            # Its replicas mid-run, as they die (owed messages, sessions connected): restored from
            # their snapshot bytes they must equal what the node kept, derived indexes included.
            self.states_checked_at_crash += 1
            self.canonical_findings += canonical_state_findings(
                [(sn.name, h.shard, h.state) for h in sn.node.groups if h.failed is None and not h.reads_remotely])
        if sn.syncer is not None and sn.syncer.started > sn.syncer.completed:
            self.syncs_cut += 1
            self.note(f"{sn.name}: crashed while a WAL sync ran")
        if sn.syncer is not None:
            self.syncs_timed += sn.syncer.completed
        sn.syncer, sn.armed, sn.crash_due = None, None, False
        self.scheduler.drop(sn.loop)
        self.net.crash_host(sn.host)
        _close_files_under(sn.data_dir)
        sn.crashed, sn.ready = True, False
        cut = sn.memory_ledger.cut_unsynced(self.crash_rng) if lose_unsynced else []
        self.note(f"{sn.name} crashed" + (f", cut {len(cut)} file(s) to their synced length" if cut else ""))
        sn.assembly, sn.node, sn.server = None, None, None
        return cut

    def pause(self, sn: SimNode, seconds: float) -> None:
        if sn.loop is not None and not sn.crashed:
            sn.loop.paused_until = self.scheduler.now + seconds
            self.note(f"{sn.name} paused for {seconds:.1f} s")

    def run_for(self, seconds: float) -> None:
        self.scheduler.run_until(self.scheduler.now + seconds)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        deadline = self.scheduler.now + timeout_s
        while self.scheduler.now < deadline:
            if all(sn.ready or sn.crashed for sn in self.nodes) and self.leaders_known():
                return True
            if any(sn.boot_error is not None for sn in self.nodes):
                return False
            self.run_for(0.1)
        return False

    def leaders_known(self) -> bool:
        live = [sn.node for sn in self.nodes if sn.ready and sn.node is not None]
        if not live:
            return False
        # (a node that is no member of a group knows it once its reader feed started: reader.py)
        return all(h.reader.started if h.reader is not None and h.reads_remotely else h.raft.lead is not None
                   for node in live for h in node.groups)

    def close(self) -> None:
        for sn in self.nodes:
            if sn.loop is not None and not sn.crashed:
                self.scheduler.drop(sn.loop)
                sn.crashed = True
            _close_files_under(sn.data_dir)
        for loop in list(self.scheduler.all_loops):
            self.scheduler.dispose(loop)
        _release_placeholders()


def _close_files_under(directory: Path) -> None:
    """What the kernel does to a killed process's files: every descriptor it held under
    ``directory`` closes (its data-directory lock is released with it). Each number is kept taken by
    a placeholder (/dev/null) rather than freed: the dead node's objects still hold those numbers and
    close them when their coroutines are disposed or collected; a freed number would by then belong
    to another node's file or a loop's self-pipe, and that close would end it (seen as EBADF when a
    virtual loop closed its self-pipe, seed 30024)."""
    prefix = os.path.realpath(directory)
    fd_dir = "/proc/self/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return
    for fd_name in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd_name))
        except OSError:
            continue
        if target.startswith(prefix + os.sep) or target == prefix:
            fd = int(fd_name)
            try:
                placeholder = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(placeholder, fd)  # the file's description is released, the number stays taken
                finally:
                    os.close(placeholder)
                _PLACEHOLDERS[fd] = None
            except OSError:
                pass


_PLACEHOLDERS: dict[int, None] = {}  # descriptor numbers _close_files_under keeps taken


def _release_placeholders() -> None:
    """After the world's loops were disposed (the dead objects closed what they still closed):
    the placeholders nobody closed are closed, so a long run does not leak descriptors."""
    for fd in list(_PLACEHOLDERS):
        del _PLACEHOLDERS[fd]
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == os.devnull:
                os.close(fd)
        except OSError:
            pass


def quiet_logs() -> None:
    """Node logs go to the trace, not the terminal: a seed's run prints only its verdict."""
    logging.getLogger("moorline").setLevel(logging.CRITICAL)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def run_coro(world: World, loop: VirtualLoop, coro: Any, limit_s: float) -> Any:
    return world.scheduler.run_task(loop, coro, world.scheduler.now + limit_s)


__all__ = ["World", "WorldConfig", "SimNode", "asyncio"]
