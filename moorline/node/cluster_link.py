"""A node's link to its cluster: who the members are, and Raft traffic in and out of its groups.

Bootstrap is static (etcd style): every node starts with the same ``initial_cluster``; node names
map to Raft node ids by their position in it (n1 -> 1). A Raft member is (node id, storage id), so
at first start each node announces its storage id and waits until it knows every initial member's,
then records the table in ``cluster.json``; a node that later comes back with a different storage
id (its data was wiped) is told so by its peers and refuses to start as a voter.

Outgoing Raft messages of all groups are buffered for one event-loop pass; heartbeats bound for
one node are then coalesced into one frame (moorline.raft.coalesce), the rest go by stream.
Proposals made on a node that does not lead the group are forwarded to the leader as encoded
entries (``Payload("fwd")``); the origin keeps them until its own replica applies them and hands
them to a new leader if the leader changes (ShardHost.check_leader), and the shard applies each
(node, boot, seq) once.

A MsgSnapshot of a group's core never goes on the wire as such: it carries only the snapshot's
metadata, and the link hands it to ``SnapshotTransfers`` (snapshot_transfer.py), which streams the
shard state and message store in chunks on the snapshot stream (``Payload("snap")``) and, on the
follower, steps a MsgSnapshot into the core once all of it is staged. One arriving from a peer is
dropped: nothing but a whole, verified transfer may reach a core.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from moorline.cluster import ClusterTransport, Heartbeats, Payload, RaftMessages, read_secret_file
from moorline.cluster.auth import require_secret_or_loopback
from moorline.config import ClusterConfig, ConfigError
from moorline.node.aio import cancel_all
from moorline.node.seams import PRODUCTION, Seams
from moorline.node.snapshot_transfer import PAYLOAD_KIND as SNAP_PAYLOAD
from moorline.node.snapshot_transfer import SnapshotTransfers, TransferLimits
from moorline.raft import Message, MessageType, Stream, coalesce, expand

log = logging.getLogger("moorline.cluster.link")

ANNOUNCE_INTERVAL_S = 1.0  # storage-id announcements to peers, until and after bootstrap
_fwd_enc = msgspec.msgpack.Encoder()
_fwd_dec = msgspec.msgpack.Decoder(tuple[int, list[bytes]])
_member_dec = msgspec.msgpack.Decoder(dict[str, Any])


class StorageMismatch(Exception):
    """A peer knows this node by another storage id: this node's data was wiped or replaced."""


class LayoutMismatch(ConfigError):
    """A peer was started with another shard count or replica count."""


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what} must be HOST:PORT, not {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True)
class ClusterSpec:
    me: str
    names: tuple[str, ...]  # initial_cluster order: node ids are positions + 1
    addresses: dict[str, tuple[str, int]]
    listen: tuple[str, int]

    def node_id(self, name: str) -> int:
        return self.names.index(name) + 1

    def name_of(self, node_id: int) -> str:
        return self.names[node_id - 1]

    @property
    def my_id(self) -> int:
        return self.node_id(self.me)


def parse_cluster(cfg: ClusterConfig) -> ClusterSpec | None:
    """None without cluster settings (one node); a checked spec otherwise."""
    given = [cfg.node_id, cfg.initial_cluster]
    if all(v is None for v in given) and cfg.listen is None:
        return None
    if cfg.node_id is None or cfg.initial_cluster is None:
        raise ConfigError("a cluster needs --node-id and --initial-cluster (and --cluster for its peer address)")
    names: list[str] = []
    addresses: dict[str, tuple[str, int]] = {}
    for item in cfg.initial_cluster.split(","):
        name, sep, addr = item.strip().partition("=")
        if not sep or not name:
            raise ConfigError(f"--initial-cluster items are NAME=HOST:PORT, not {item!r}")
        if name in addresses:
            raise ConfigError(f"--initial-cluster names {name!r} twice")
        names.append(name)
        addresses[name] = parse_hostport(addr, f"--initial-cluster {name}")
    if len(names) not in (1, 3, 5):
        raise ConfigError(f"--initial-cluster must name 1, 3 or 5 nodes, not {len(names)}")
    if cfg.node_id not in addresses:
        raise ConfigError(f"--node-id {cfg.node_id!r} is not in --initial-cluster ({', '.join(names)})")
    listen = parse_hostport(cfg.listen, "--cluster") if cfg.listen else addresses[cfg.node_id]
    return ClusterSpec(cfg.node_id, tuple(names), addresses, listen)


class ClusterLink:
    def __init__(self, spec: ClusterSpec, cfg: ClusterConfig, storage_id: str, known: dict[str, str] | None,
                 rng: random.Random, layout: str = "", seams: Seams = PRODUCTION) -> None:
        self.spec = spec
        # Shard count, voters per shard, placement scheme: members that disagree would count
        # different majorities for one shard, so a peer with another layout is refused at bootstrap.
        self.layout = layout
        self.cfg = cfg
        self.storage_id = storage_id
        self.members: dict[str, str] = dict(known or {})  # name -> storage id
        self.members[spec.me] = storage_id
        self._members_complete = asyncio.Event()
        self._mismatch: StorageMismatch | LayoutMismatch | None = None
        secret = read_secret_file(cfg.secret_file) if cfg.secret_file else None
        require_secret_or_loopback(spec.listen[0], secret)
        peers = {n: a for n, a in spec.addresses.items() if n != spec.me}
        self.transport = ClusterTransport(spec.me, spec.listen, peers, secret, self._on_frame, rng,
                                          cluster_id=cfg.cluster_id, net=seams.cluster_network,
                                          clock=seams.clock.monotonic, nonce_source=seams.random_bytes)
        self._out: list[tuple[int, Message]] = []
        self._flush_scheduled = False
        self._tasks: list[asyncio.Task[Any]] = []
        # Set by the node once its groups exist: (shard, message) in, (shard, entries) forwarded in.
        self.on_raft: Callable[[int, Message], None] | None = None
        self.on_forward: Callable[[int, list[bytes]], None] | None = None
        self.frames_in = 0
        self.hosts: list[Any] = []  # the node's ShardHosts (set by the node): snapshots are read from them
        self.snapshots = SnapshotTransfers(
            TransferLimits.from_config(cfg),
            lambda peer, data: self.transport.send(peer, Stream.SNAPSHOT, Payload(SNAP_PAYLOAD, data)),
            lambda: self.hosts, self._step_snapshot, spec.node_id, spec.name_of, rng)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.transport.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._announce_loop(), name="cluster-announce"))
        self._check_complete()

    async def wait_for_members(self, timeout_s: float) -> dict[str, str]:
        """Every initial member's storage id (first start: announced by the peers themselves)."""
        try:
            await asyncio.wait_for(self._members_complete.wait(), timeout_s)
        except TimeoutError:
            missing = [n for n in self.spec.names if n not in self.members]
            raise ConfigError(f"cluster bootstrap: no word from {', '.join(missing)} within {timeout_s:.0f} s "
                              f"(are they started, with the same --initial-cluster and secret?)") from None
        if self._mismatch is not None:
            raise self._mismatch
        return dict(self.members)

    async def close(self) -> None:
        await cancel_all(self._tasks)
        await self.snapshots.close()
        await self.transport.close()

    def _check_complete(self) -> None:
        if all(n in self.members for n in self.spec.names):
            self._members_complete.set()

    async def _announce_loop(self) -> None:
        while True:
            body = _fwd_enc.encode({"name": self.spec.me, "storage_id": self.storage_id, "members": self.members,
                                    "layout": self.layout})
            for peer in self.spec.names:
                if peer != self.spec.me:
                    self.transport.send(peer, Stream.CONTROL, Payload("member", body))
            await asyncio.sleep(ANNOUNCE_INTERVAL_S)

    # --- outgoing --------------------------------------------------------------------------------
    def send(self, shard: int, msgs: list[Message]) -> None:
        """Raft messages of one group; sent at the end of this loop pass, heartbeats coalesced.
        A snapshot becomes a transfer (module doc)."""
        for m in msgs:
            if m.type == MessageType.SNAP:
                self.snapshots.offer(shard, m)
            else:
                self._out.append((shard, m))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        batches, rest = coalesce(self.spec.my_id, out)
        for batch in batches:
            self.transport.send_heartbeats(self.spec.name_of(batch.dst), batch)
        by_dst: dict[int, list[tuple[int, Message]]] = {}
        for shard, m in rest:
            by_dst.setdefault(m.to[0], []).append((int(shard), m))
        for dst, items in by_dst.items():
            self.transport.send_raft(self.spec.name_of(dst), items)

    def forward(self, shard: int, node_id: int, entries: list[bytes]) -> None:
        if node_id == self.spec.my_id or not 1 <= node_id <= len(self.spec.names):
            return
        self.transport.send(self.spec.name_of(node_id), Stream.APPEND, Payload("fwd", _fwd_enc.encode((shard, entries))))

    # --- incoming --------------------------------------------------------------------------------
    def _on_frame(self, peer: str, frame: Any) -> None:
        self.frames_in += 1
        try:
            if type(frame) is RaftMessages:
                if self.on_raft is not None:
                    for group, m in frame.messages:
                        if m.type != MessageType.SNAP:  # only a whole transfer reaches a core (module doc)
                            self.on_raft(int(group), m)
            elif type(frame) is Heartbeats:
                if self.on_raft is not None:
                    for group, m in expand(frame.batch):
                        self.on_raft(int(group), m)
            elif type(frame) is Payload:
                if frame.kind == "fwd":
                    if self.on_forward is not None:
                        shard, entries = _fwd_dec.decode(frame.data)
                        self.on_forward(shard, entries)
                elif frame.kind == "member":
                    self._on_member(peer, _member_dec.decode(frame.data))
                elif frame.kind == SNAP_PAYLOAD:
                    self.snapshots.on_payload(peer, frame.data)
        except (msgspec.DecodeError, ValueError, TypeError, KeyError) as exc:
            log.warning("dropping a malformed frame from %s: %s", peer, exc)

    def _on_member(self, peer: str, body: dict[str, Any]) -> None:
        sid = body.get("storage_id")
        if body.get("name") != peer or not isinstance(sid, str):
            return
        theirs_layout = body.get("layout")
        if isinstance(theirs_layout, str) and theirs_layout != self.layout:
            if self._mismatch is None:
                self._mismatch = LayoutMismatch(
                    f"{peer} places shards as {theirs_layout!r}, this node as {self.layout!r}: every node of a "
                    f"cluster must be started with the same shard.count and shard.replicas")
                self._members_complete.set()
            return
        known = self.members.get(peer)
        if known is None:
            self.members[peer] = sid
        elif known != sid:
            log.error("node %s now has storage id %s, but this node knows it as %s: its data was wiped or "
                      "replaced, so it is not the member it was (it must rejoin as a new member)", peer, sid, known)
        theirs = body.get("members") or {}
        mine = theirs.get(self.spec.me) if isinstance(theirs, dict) else None
        if isinstance(mine, str) and mine != self.storage_id and self._mismatch is None:
            self._mismatch = StorageMismatch(
                f"{peer} knows this node ({self.spec.me}) by storage id {mine}, but this data directory has "
                f"{self.storage_id}: the storage is new or wiped, and a node that lost its log must not vote "
                f"again as the member it was; rejoining as a new member is not supported yet")
            self._members_complete.set()
        self._check_complete()

    def _step_snapshot(self, shard: int, m: Message) -> None:
        """A transfer is staged: its MsgSnapshot goes to the core like any message from the peer."""
        if self.on_raft is not None:
            self.on_raft(shard, m)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self.transport.stats())
        out["snapshot_transfers"] = self.snapshots.snapshot_stats()
        return out
