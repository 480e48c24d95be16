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

The spec the link starts from (``ClusterSpec``, ``parse_cluster``, the node's cluster TLS) is in
cluster_spec.py; a new node's ``--join`` handshake with a live member (``join_cluster``) in
cluster_join.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from moorline.broker.commands import decode_head
from moorline.cluster import (
    ClusterTransport,
    Heartbeats,
    Payload,
    RaftMessages,
    TransportLimits,
    read_secret_file,
)
from moorline.cluster.auth import ClusterConfigError, require_secret_or_loopback, require_tls_or_loopback
from moorline.cluster.stats import escape
from moorline.config import ClusterConfig, ConfigError
from moorline.node.aio import cancel_all
from moorline.node.replication.clock_offset import PAYLOAD_KIND as CLOCK_PAYLOAD
from moorline.node.replication.clock_offset import PROBE_INTERVAL_S, ClockOffsets
from moorline.node.replication.cluster_join import JOIN_PAYLOAD, WELCOME_PAYLOAD
from moorline.node.replication.cluster_spec import ClusterSpec, load_node_tls
from moorline.node.replication.reader_feed import PAYLOAD_KIND as READER_PAYLOAD
from moorline.node.replication.snapshot_transfer import PAYLOAD_KIND as SNAP_PAYLOAD
from moorline.node.replication.snapshot_transfer import SnapshotTransfers, TransferLimits
from moorline.node.seams import PRODUCTION, Seams
from moorline.raft import Message, MessageType, Stream, coalesce, expand

if TYPE_CHECKING:
    from moorline.node.supervisor import Supervisor

log = logging.getLogger("moorline.cluster.link")

ANNOUNCE_INTERVAL_S = 1.0  # storage-id announcements to peers, until and after bootstrap
ANNOUNCE_TASK = "cluster-announce"  # the link's loops, as the node's Supervisor names them
CLOCK_TASK = "cluster-clocks"
MAX_RAFT_NUMBER = (1 << 62) - 1  # terms, indexes, commits: a peer's larger (or negative) one is refused
ADMIN_ASK_PAYLOAD = "admin-ask"  # a request/response between members (ClusterLink.ask)
ADMIN_ANSWER_PAYLOAD = "admin-answer"
REFUSAL_LOG_INTERVAL_S = 60.0  # a peer's refused frames are logged at most this often (and counted always)
_fwd_enc = msgspec.msgpack.Encoder()
_fwd_dec = msgspec.msgpack.Decoder(tuple[int, list[bytes]])
_member_dec = msgspec.msgpack.Decoder(dict[str, Any])


class ForgedSender(ValueError):
    """A frame names another sender than the peer its connection authenticated."""


class StorageMismatch(Exception):
    """A peer knows this node by another storage id: this node's data was wiped or replaced."""


class LayoutMismatch(ConfigError):
    """A peer was started with another shard count or replica count."""


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
        tls = load_node_tls(cfg, spec.me)
        if tls is None:
            require_secret_or_loopback(spec.listen[0], secret)
            if seams.cluster_network is None:  # real sockets (a simulator's network never leaves the process)
                require_tls_or_loopback([spec.listen[0], *(a[0] for a in spec.addresses.values())])
        peers = {n: a for n, a in spec.addresses.items() if n != spec.me}
        limits = TransportLimits(max_pending_handshakes=cfg.max_pending_handshakes,
                                 max_pending_handshakes_per_address=cfg.max_pending_handshakes_per_address,
                                 preauth_timeout_s=cfg.preauth_timeout_s)
        self.transport = ClusterTransport(spec.me, spec.listen, peers, secret, self._on_frame, rng,
                                          cluster_id=cfg.cluster_id, net=seams.cluster_network, limits=limits,
                                          clock=seams.clock.monotonic, nonce_source=seams.random_bytes, tls=tls)
        self.transport.quiet_failures_until(seams.clock.monotonic() + cfg.bootstrap_timeout_s)
        # Frames whose claimed sender (a Raft message's from, a heartbeat batch's source, a forwarded
        # entry's origin, an announcement's name) is not the authenticated peer: refused, counted
        # per peer, logged at most once per peer per interval.
        self.frames_refused: dict[str, int] = {}
        self._refusal_logged_at: dict[str, float] = {}
        self._clock = seams.clock.monotonic
        self._out: list[tuple[int, Message]] = []
        self._flush_scheduled = False
        self._supervisor: Supervisor | None = None  # runs the announce and clock loops (start)
        self._tasks: list[asyncio.Task[Any]] = []  # the same loops when no supervisor was given
        self._tls = tls is not None
        self._real_network = seams.cluster_network is None
        # Set by the node once its groups exist: (shard, message) in, (shard, entries) forwarded in.
        self.on_raft: Callable[[int, Message], None] | None = None
        self.on_forward: Callable[[int, list[bytes]], None] | None = None
        # Reader feeds (reader_feed.py): (sending node id, encoded message).
        self.on_reader: Callable[[int, bytes], None] | None = None
        self.frames_in = 0
        self.hosts: list[Any] = []  # the node's ShardHosts (set by the node): snapshots are read from them
        # Announcements carry more than storage ids once the node serves (node/edge/drain.py: its client
        # address, whether it drains, the groups it leads and which of those are not whole); each
        # peer's latest, with when it arrived, is kept for readiness and Server References.
        self.announce_extra: Callable[[], dict[str, Any]] | None = None
        self.announced: dict[str, tuple[float, dict[str, Any]]] = {}
        self.on_drain_request: Callable[[str], None] | None = None  # a peer asks this node to drain
        self.on_join_request: Callable[[str, dict[str, Any]], None] | None = None  # membership.py answers
        # Admin requests between members (node/admin/peer_ask.py: the cluster-wide client list and
        # disconnect): a peer's question is answered by this handler (op, args) -> answer, at once;
        # this node's own questions wait in _asked for their answer, by request id.
        self.on_admin_request: Callable[[str, str, dict[str, Any]], dict[str, Any]] | None = None
        self._asked: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._ask_seq = 0
        self.snapshots = SnapshotTransfers(
            TransferLimits.from_config(cfg),
            lambda peer, data: self.transport.send(peer, Stream.SNAPSHOT, Payload(SNAP_PAYLOAD, data)),
            lambda: self.hosts, self._step_snapshot, spec.node_id, spec.name_of, rng)
        # Peers' wall-clock offsets (clock_offset.py): owner leases are safe only within a bound.
        self.clocks = ClockOffsets(
            spec.me, spec.names, lambda peer, data: self.transport.send(peer, Stream.CONTROL, Payload(CLOCK_PAYLOAD, data)),
            seams.clock.wall_ms, seams.clock.monotonic, cfg.max_clock_offset_ms)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Listen and dial the peers; the announce and clock loops run under ``supervisor`` (the
        node's: a loop that raises is logged, counted and restarted), else as plain tasks (tests)."""
        await self.transport.start()
        if supervisor is not None:
            self._supervisor = supervisor
            supervisor.spawn(ANNOUNCE_TASK, self._announce_loop, critical=False)
            supervisor.spawn(CLOCK_TASK, self._clock_loop, critical=False)
        else:
            self._tasks.append(asyncio.get_running_loop().create_task(self._announce_loop(), name=ANNOUNCE_TASK))
            self._tasks.append(asyncio.get_running_loop().create_task(self._clock_loop(), name=CLOCK_TASK))
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
        if self._supervisor is not None:
            await self._supervisor.stop([ANNOUNCE_TASK, CLOCK_TASK])
        await cancel_all(self._tasks)
        await self.snapshots.close()
        await self.transport.close()

    def _check_complete(self) -> None:
        if all(n in self.members for n in self.spec.names):
            self._members_complete.set()

    async def _announce_loop(self) -> None:
        while True:
            self.announce_now()
            await asyncio.sleep(ANNOUNCE_INTERVAL_S)

    async def _clock_loop(self) -> None:
        while True:
            self.clocks.probe_all()
            await asyncio.sleep(PROBE_INTERVAL_S)

    def announce_now(self) -> None:
        """This node's announcement to every peer (also between the periodic ones: a drain's start)."""
        fields = {"name": self.spec.me, "node_id": self.spec.my_id, "storage_id": self.storage_id,
                  "members": self.members, "layout": self.layout}
        if self.announce_extra is not None:
            try:
                fields = {**self.announce_extra(), **fields}
            except Exception:  # noqa: BLE001 - the storage-id announcement must go on regardless
                log.exception("cluster: this node's announcement could not be completed")
        body = _fwd_enc.encode(fields)
        for peer in self.spec.known:
            if peer != self.spec.me:
                self.transport.send(peer, Stream.CONTROL, Payload("member", body))

    def peer_draining(self, peer: str) -> bool:
        """Whether ``peer``'s latest announcement says it drains (it is about to go: give it no leadership)."""
        got = self.announced.get(peer)
        return got is not None and bool(got[1].get("draining"))

    def request_drain(self, peer: str) -> bool:
        """Ask ``peer`` to drain (POST /v1/drain naming another node); False: no such peer."""
        if peer == self.spec.me or peer not in self.spec.ids:
            return False
        self.transport.send(peer, Stream.CONTROL, Payload("drain", b""))
        return True

    async def ask(self, peer: str, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """An admin request to ``peer`` over its authenticated link; its answer (a dict), or
        TimeoutError when none came within ``timeout_s`` (not connected, dropped, too slow)."""
        if peer == self.spec.me or peer not in self.spec.ids:
            raise KeyError(peer)
        self._ask_seq += 1
        rid = self._ask_seq
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._asked[rid] = (peer, fut)
        try:
            self.transport.send(peer, Stream.CONTROL,
                                Payload(ADMIN_ASK_PAYLOAD, _fwd_enc.encode({"id": rid, "op": op, "args": args})))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._asked.pop(rid, None)

    def _on_admin_ask(self, peer: str, body: dict[str, Any]) -> None:
        rid, op, args = body.get("id"), body.get("op"), body.get("args")
        if not isinstance(rid, int) or not isinstance(op, str) or not isinstance(args, dict):
            raise ValueError("an admin request without id, op or args")
        if self.on_admin_request is None:
            answer: dict[str, Any] = {"error": "this node does not answer admin requests (yet)"}
        else:
            try:
                answer = self.on_admin_request(peer, op, args)
            except Exception as exc:  # noqa: BLE001 - the asker gets the failure, not a timeout
                log.exception("cluster: %s's admin request %r failed here", peer, escape(op, 40))
                answer = {"error": f"{type(exc).__name__} on {self.spec.me}"}
        self.transport.send(peer, Stream.CONTROL, Payload(ADMIN_ANSWER_PAYLOAD, _fwd_enc.encode({"id": rid, "answer": answer})))

    def _on_admin_answer(self, peer: str, body: dict[str, Any]) -> None:
        rid, answer = body.get("id"), body.get("answer")
        asked = self._asked.get(rid) if isinstance(rid, int) else None
        if asked is None:
            return  # answered after its timeout
        if asked[0] != peer:
            raise ForgedSender(f"an answer to admin request {rid} asked of {asked[0]}")
        if not isinstance(answer, dict):
            raise ValueError("an admin answer that is not a map")
        if not asked[1].done():
            asked[1].set_result(answer)

    def learn_member(self, name: str, node_id: int, address: tuple[str, int]) -> bool:
        """A member this node did not start with (the member table admitted it): from now on the
        link accepts its authenticated connections (the same proof as any peer's: its certificate
        with cluster TLS, else the cluster secret), dials it, and maps its node id, so its Raft
        traffic, forwards and snapshots flow like an initial member's. True when it was new.
        Refused (logged, False): this node's name, a node id another member has, and, without
        cluster TLS on a real network, an address off loopback."""
        if name == self.spec.me:
            return False
        known = self.spec.ids.get(name)
        if known is not None:
            if known != node_id:
                log.error("cluster: the member table names %s node id %d, but this node knows it as %d; "
                          "not changed", name, node_id, known)
            return False
        if self.spec.has_id(node_id):
            log.error("cluster: the member table names %s node id %d, which is %s's here; not added", name,
                      node_id, self.spec.name_of(node_id))
            return False
        if not self._tls and self._real_network:
            try:
                require_tls_or_loopback([address[0]])
            except ClusterConfigError as exc:
                log.error("cluster: member %s (%s:%d) not added: %s", name, address[0], address[1], exc)
                return False
        self.spec.ids[name] = node_id
        self.spec.addresses[name] = address
        self.transport.add_peer(name, address)
        self.clocks.add_peer(name)  # its clock is compared like an initial member's (owner leases)
        log.info("cluster: %s (node id %d, %s:%d) is a member: now a peer of this node", name, node_id, *address)
        return True

    def forget_member(self, name: str) -> None:
        """A member whose record was replaced (a forgotten node's name admitted again with a new node
        id): its old id, address and storage id go, so ``learn_member`` can take the new one."""
        if name == self.spec.me:
            return
        self.transport.remove_peer(name)
        self.spec.ids.pop(name, None)
        self.spec.addresses.pop(name, None)
        self.members.pop(name, None)
        self.announced.pop(name, None)

    def send_welcome(self, peer: str, welcome: dict[str, Any]) -> None:
        """The answer to ``peer``'s join request (``join_cluster``)."""
        self.transport.send(peer, Stream.CONTROL, Payload(WELCOME_PAYLOAD, _fwd_enc.encode(welcome)))

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
            if self.spec.has_id(batch.dst):
                self.transport.send_heartbeats(self.spec.name_of(batch.dst), batch)
        by_dst: dict[int, list[tuple[int, Message]]] = {}
        for shard, m in rest:
            by_dst.setdefault(m.to[0], []).append((int(shard), m))
        for dst, items in by_dst.items():
            if self.spec.has_id(dst):  # (a member removed from the link since the message was made)
                self.transport.send_raft(self.spec.name_of(dst), items)

    def forward(self, shard: int, node_id: int, entries: list[bytes]) -> None:
        if node_id == self.spec.my_id or not self.spec.has_id(node_id):
            return
        self.transport.send(self.spec.name_of(node_id), Stream.APPEND, Payload("fwd", _fwd_enc.encode((shard, entries))))

    def send_reader(self, node_id: int, data: bytes) -> None:
        """A reader feed's message (reader_feed.py) to ``node_id``, on the append stream."""
        if node_id == self.spec.my_id or not self.spec.has_id(node_id):
            return
        self.transport.send(self.spec.name_of(node_id), Stream.APPEND, Payload(READER_PAYLOAD, data))

    def node_ids(self) -> list[int]:
        """Every member this node knows, by node id (ascending)."""
        return sorted(self.spec.ids.values())

    # --- incoming --------------------------------------------------------------------------------
    def _on_frame(self, peer: str, frame: Any) -> None:
        self.frames_in += 1
        try:
            peer_id = self.spec.node_id(peer)
            if type(frame) is RaftMessages:
                for _, m in frame.messages:
                    self._check_from(peer, peer_id, m)
                if self.on_raft is not None:
                    for group, m in frame.messages:
                        if m.type != MessageType.SNAP:  # only a whole transfer reaches a core (module doc)
                            self.on_raft(int(group), m)
            elif type(frame) is Heartbeats:
                if frame.batch.src != peer_id:
                    raise ForgedSender(f"a heartbeat batch from node {frame.batch.src!r}")
                msgs = expand(frame.batch)
                for _, m in msgs:
                    self._check_from(peer, peer_id, m)
                if self.on_raft is not None:
                    for group, m in msgs:
                        self.on_raft(int(group), m)
            elif type(frame) is Payload:
                if frame.kind == "fwd":
                    shard, entries = _fwd_dec.decode(frame.data)
                    # Only a node's own proposals are forwarded (ShardHost.check_leader): an entry
                    # naming another origin would move that node's admission (ShardState.admit).
                    for data in entries:
                        origin = decode_head(data).origin  # its commands not decoded
                        if origin != peer_id:
                            raise ForgedSender(f"a forwarded entry of origin {origin!r}")
                    if self.on_forward is not None:
                        self.on_forward(shard, entries)
                elif frame.kind == "member":
                    body = _member_dec.decode(frame.data)
                    if body.get("name") != peer:
                        raise ForgedSender(f"a membership announcement of {escape(str(body.get('name')), 80)}")
                    self.announced[peer] = (self._clock(), body)
                    self._on_member(peer, body)
                elif frame.kind == JOIN_PAYLOAD:  # a member admitted by an operator, starting with --join
                    body = _member_dec.decode(frame.data)
                    if body.get("name") != peer:
                        raise ForgedSender(f"a join request of {escape(str(body.get('name')), 80)}")
                    if self.on_join_request is not None:
                        self.on_join_request(peer, body)
                elif frame.kind == "drain":  # from an authenticated peer, asked by its admin
                    if self.on_drain_request is not None:
                        self.on_drain_request(peer)
                elif frame.kind == ADMIN_ASK_PAYLOAD:  # an authenticated peer's admin asks (its admin checked)
                    self._on_admin_ask(peer, _member_dec.decode(frame.data))
                elif frame.kind == ADMIN_ANSWER_PAYLOAD:
                    self._on_admin_answer(peer, _member_dec.decode(frame.data))
                elif frame.kind == READER_PAYLOAD:
                    if self.on_reader is not None:
                        self.on_reader(peer_id, frame.data)
                elif frame.kind == SNAP_PAYLOAD:
                    self.snapshots.on_payload(peer, frame.data)
                elif frame.kind == CLOCK_PAYLOAD:
                    self.clocks.on_payload(peer, frame.data)
        except ForgedSender as exc:
            self._refuse_frame(peer, str(exc))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, KeyError, IndexError,
                OverflowError) as exc:
            self._refuse_frame(peer, f"malformed: {exc}", forged=False)

    def _check_from(self, peer: str, peer_id: int, m: Message) -> None:
        """The message's sender must be the peer; its numbers must be ones a Raft core can hold
        (a negative or 2^64 index is refused here, not left to the core)."""
        from_ = m.from_
        if not isinstance(from_, tuple | list) or len(from_) != 2 or from_[0] != peer_id:
            raise ForgedSender(f"a raft {m.type.name} from {escape(repr(from_), 120)}")
        to = m.to
        if not isinstance(to, tuple | list) or len(to) != 2 or to[0] != self.spec.my_id:
            raise ValueError(f"a raft {m.type.name} addressed to {escape(repr(to), 120)}")
        if not (0 <= m.term <= MAX_RAFT_NUMBER and 0 <= m.log_term <= MAX_RAFT_NUMBER
                and 0 <= m.index <= MAX_RAFT_NUMBER and 0 <= m.commit <= MAX_RAFT_NUMBER
                and 0 <= m.reject_hint <= MAX_RAFT_NUMBER):
            raise ValueError(f"a raft {m.type.name} with a term, index or commit out of range")
        for e in m.entries:
            if not (0 <= e.term <= MAX_RAFT_NUMBER and 0 <= e.index <= MAX_RAFT_NUMBER):
                raise ValueError(f"a raft {m.type.name} carrying an entry with a term or index out of range")

    def _refuse_frame(self, peer: str, what: str, forged: bool = True) -> None:
        """Count, and log at most once per peer per REFUSAL_LOG_INTERVAL_S (escaped)."""
        self.frames_refused[peer] = self.frames_refused.get(peer, 0) + 1
        now = self._clock()
        last = self._refusal_logged_at.get(peer)
        if last is None or now - last >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged_at[peer] = now
            why = "it claims another sender than the authenticated peer" if forged else "it is malformed"
            log.warning("cluster: refused a frame from %s (%s): %s; %d refused from it so far", peer, why,
                        escape(what), self.frames_refused[peer])

    def _on_member(self, peer: str, body: dict[str, Any]) -> None:
        sid = body.get("storage_id")
        if not isinstance(sid, str):
            return
        nid = body.get("node_id")
        if isinstance(nid, int) and nid != self.spec.ids.get(peer):
            return  # a new member under a forgotten one's name: learned from the member table (learn_member)
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
        out["frames_refused"] = dict(self.frames_refused)
        out["clocks"] = self.clocks.stats()
        for name, peer in out.get("peers", {}).items():
            peer["frames_refused"] = self.frames_refused.get(name, 0)
        return out
