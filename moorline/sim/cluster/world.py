"""A simulated world of real moorline nodes: 3 or 5 ``Node`` processes in one Python process.

Each node is the production code (``moorline.node.node.Node``, its MQTT server, group commit,
cluster link and transport) on its own ``VirtualLoop`` with its seams (DESIGN: simulation seams)
pointed at the world: virtual time (a per-node clock rate within the drift bound and a wall-clock
offset), the in-memory network, seeded random bytes, and every fdatasync inline. Its disk is a
real directory under the run's base; a ledger of synced lengths (the crash harness's instrument)
lets a crash lose or tear what was written after the last sync, as power loss would.

A crash drops the node's loop (nothing of it runs again), breaks its connections, closes the files
the process held (releasing its data-directory lock, as the kernel would) and cuts its files back
to their synced lengths plus a seeded few bytes; a restart builds a new node on the same
directory. A pause skips the loop for a while; overdue timers then fire at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moorline.config import NodeConfig
from moorline.node.auth import Authorizer
from moorline.node.node import Node
from moorline.node.seams import Seams
from moorline.node.server import MqttServer
from moorline.sim.cluster.tuning import DEFAULT_TUNING, NodeTuning
from moorline.sim.cluster.vloop import Scheduler, VirtualLoop
from moorline.sim.cluster.vnet import LinkDelay, SimNetwork
from moorline.storage.ledger import SyncLedger
from moorline.testing.faults import Faults

log = logging.getLogger("moorline.sim.cluster")

CLUSTER_PORT = 7000
MQTT_PORT = 1883
EPOCH_MS = 1_790_000_000_000  # the world's wall clock at t=0 (a fixed date: traces replay exactly)


class SimClock:
    """A node's clock: the loop's (virtual, rate-scaled) time, and a wall clock offset from the
    world's by the node's skew."""

    def __init__(self, loop: VirtualLoop, skew_ms: int) -> None:
        self.loop = loop
        self.skew_ms = skew_ms

    def monotonic(self) -> float:
        return self.loop.time()

    def wall_ms(self) -> int:
        return EPOCH_MS + self.skew_ms + int(self.loop.time() * 1000)


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


@dataclass
class SimNode:
    name: str
    index: int
    host: str
    data_dir: Path
    ledger: Path  # where the synced lengths are written out for tools (flip_synced_byte)
    memory_ledger: MemoryLedger = field(default_factory=MemoryLedger)
    loop: VirtualLoop | None = None
    node: Node | None = None
    server: MqttServer | None = None
    boots: int = 0
    crashed: bool = False
    ready: bool = False
    boot_error: BaseException | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def mqtt(self) -> tuple[str, int]:
        return self.host, MQTT_PORT


@dataclass
class WorldConfig:
    nodes: int = 3
    shards: int = 4
    replicas: int = 3
    tick_ms: int = 100
    election_ticks: int = 10
    owner_lease_s: float = 10.0
    max_skew_ms: int = 200  # wall-clock offsets between nodes, within what leases tolerate
    max_rate_drift: float = 0.01  # clock rates within the documented 2 % bound
    delay: LinkDelay = field(default_factory=LinkDelay)
    publish_timeout_s: float = 5.0
    tuning: NodeTuning = DEFAULT_TUNING  # the seed's node configuration (tuning.py)


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
        cfg.cluster.node_id = sn.name
        cfg.cluster.listen = f"{sn.host}:{CLUSTER_PORT}"
        cfg.cluster.initial_cluster = self.initial_cluster
        cfg.cluster.secret_file = str(self.secret_file)  # peers authenticate, as off loopback they must
        cfg.raft.tick_interval_ms = self.cfg.tick_ms
        cfg.raft.election_ticks = self.cfg.election_ticks
        cfg.session.owner_lease_s = self.cfg.owner_lease_s
        cfg.mqtt.publish_timeout_s = self.cfg.publish_timeout_s
        cfg.storage.wal_preallocate = False  # no preparer thread
        cfg.storage.inline_sync_max_us = 0
        cfg.listeners.mqtt = f"{sn.host}:{MQTT_PORT}"
        self.cfg.tuning.apply(cfg)
        return cfg

    def start(self, sn: SimNode) -> None:
        skew_ms, rate = self._skews[sn.name]
        loop = self.scheduler.new_loop(f"{sn.name}#{sn.boots + 1}", rate)
        sn.loop, sn.crashed, sn.ready, sn.boot_error = loop, False, False, None
        sn.boots += 1
        host_net = self.net.for_host(sn.host, loop)
        seams = Seams(clock=SimClock(loop, skew_ms), cluster_network=host_net,
                      random_bytes=seeded_bytes(self._node_rngs[sn.name]), inline_io=True,
                      sync_ledger=sn.memory_ledger)
        cfg = self.node_config(sn)
        cfg.validate()

        async def boot() -> None:
            try:
                faults = Faults(**dict.fromkeys(self.switches, True))  # type: ignore[arg-type]
                node = Node(cfg, faults, seams)
                sn.node = node
                await node.open_async()
                await node.start()
                server = MqttServer(node, Authorizer(cfg.auth, loopback_only=True, clock=seams.clock.monotonic))
                sn.server = server
                host_net.serve_protocol(sn.host, MQTT_PORT, server.protocol_factory)
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

    def crash(self, sn: SimNode, lose_unsynced: bool = True) -> list[str]:
        """kill -9 plus (optionally) power loss: what was not synced may be lost or torn."""
        if sn.loop is None or sn.crashed:
            return []
        self.scheduler.drop(sn.loop)
        self.net.crash_host(sn.host)
        _close_files_under(sn.data_dir)
        sn.crashed, sn.ready = True, False
        cut = sn.memory_ledger.cut_unsynced(self.crash_rng) if lose_unsynced else []
        self.note(f"{sn.name} crashed" + (f", cut {len(cut)} file(s) to their synced length" if cut else ""))
        sn.node, sn.server = None, None
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
        return all(h.raft.lead is not None for node in live for h in node.groups)

    def close(self) -> None:
        for sn in self.nodes:
            if sn.loop is not None and not sn.crashed:
                self.scheduler.drop(sn.loop)
                sn.crashed = True
            _close_files_under(sn.data_dir)
        for loop in list(self.scheduler.all_loops):
            self.scheduler.dispose(loop)


def _close_files_under(directory: Path) -> None:
    """What the kernel does to a killed process's files: every descriptor it held under
    ``directory`` closes (its data-directory lock is released with it)."""
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
            try:
                os.close(int(fd_name))
            except OSError:
                pass


def quiet_logs() -> None:
    """Node logs go to the trace, not the terminal: a seed's run prints only its verdict."""
    logging.getLogger("moorline").setLevel(logging.CRITICAL)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def run_coro(world: World, loop: VirtualLoop, coro: Any, limit_s: float) -> Any:
    return world.scheduler.run_task(loop, coro, world.scheduler.now + limit_s)


__all__ = ["World", "WorldConfig", "SimNode", "asyncio"]
