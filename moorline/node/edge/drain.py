"""Draining a node before it goes away (SIGTERM, ``POST /v1/drain``, ``moorline cluster drain``).

A drain is a one-way sequence of phases (``Drain``):

``serving`` -> ``draining`` -> ``closing_clients`` -> ``stopping``

* **draining**: new CONNECTs are refused — MQTT 5 with CONNACK 0x9C (use another server) and a
  Server Reference naming a live peer's client address, 3.1.1 with return code 3 (server
  unavailable), the same answer EMQX's node evacuation gives; the TCP listener stays open so a client
  is told why, instead of a bare "connection refused". The peers learn of it from this node's next
  announcement (sent at once): they stop naming it as a Server Reference and stop calling the cluster
  ready. Every leadership is handed to a caught-up peer while the clients are still connected, so
  what they have in flight commits through the new leaders.
* **closing_clients**: each connection stops being read (what it sends next stays in its socket,
  unacknowledged: the client resends it to the next node), and once every PUBLISH already read is
  answered it is closed — MQTT 5 with DISCONNECT 0x9C and the Server Reference, 3.1.1 plainly (it
  has no DISCONNECT from the server). Nobody is closed with a publish outcome unknown while the
  drain's time lasts.
* **stopping**: listeners close and the node stops as before (final snapshots); the process exits 0.

The whole drain is bounded by ``cluster.drain_timeout_s``; the stop after it keeps a reserve of that
time (``TAIL_RESERVE_FRACTION``). Readiness (``GET /v1/health?ready=...``) is computed here too:
``ready=node`` (this node takes clients) and ``ready=cluster`` (safe to take the next node down:
every peer heard from and not draining, every group led, every replica caught up as its leader sees it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from moorline.mqtt.codec import MQTT_5
from moorline.mqtt.packets import Connack, Disconnect, Properties
from moorline.mqtt.reasons import ReasonCode as RC
from moorline.raft.progress import ProgressState

if TYPE_CHECKING:
    from moorline.node.edge.connection import Connection
    from moorline.node.node import Node

log = logging.getLogger("moorline.drain")

# A peer's announcement (cluster link, every ANNOUNCE_INTERVAL_S = 1 s) older than this is not
# trusted for readiness nor for a Server Reference: the peer is down or cut off.
ANNOUNCEMENT_FRESH_S = 2.5
TAIL_RESERVE_FRACTION = 0.25  # of drain_timeout_s, kept for the stop after the drain (snapshots, sync)
TAIL_RESERVE_MAX_S = 5.0
CLIENT_POLL_S = 0.02
HANDOVER_CHECK_S = 0.05  # how often a hand-over looks whether any peer can still take over
CLOSE_GRACE_S = 1.0  # after our FIN, how long a client may take to close its side (within the drain's time)


class Phase(enum.IntEnum):
    SERVING = 0
    DRAINING = 1
    CLOSING_CLIENTS = 2
    STOPPING = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class Drain:
    """This node's drain: its phase, why and since when, and its deadline. Time comes from ``clock``
    (the loop's monotonic clock). ``on_begin`` callbacks run once, when a drain is first asked for."""

    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.phase = Phase.SERVING
        self.reason = ""
        self.started_at: float | None = None
        self.on_begin: list[Callable[[], None]] = []
        self.clients_closed = 0  # connections closed by the drain once answered
        self.clients_cut = 0  # connections closed at the deadline with a publish still unanswered

    @property
    def draining(self) -> bool:
        return self.phase != Phase.SERVING

    def request(self, reason: str) -> bool:
        """Start draining (False: already draining). Idempotent: a SIGTERM during a drain asked over
        HTTP changes nothing."""
        if self.phase != Phase.SERVING:
            return False
        self.phase = Phase.DRAINING
        self.reason = reason
        self.started_at = self.clock()
        for fn in self.on_begin:
            fn()
        return True

    def advance(self, phase: Phase) -> None:
        """Move forward to ``phase``; phases never go back (ValueError)."""
        if phase < self.phase or self.phase == Phase.SERVING:
            raise ValueError(f"drain cannot go from {self.phase.label} to {phase.label}")
        self.phase = phase

    @property
    def deadline(self) -> float:
        assert self.started_at is not None, "not draining"
        return self.started_at + self.timeout_s

    @property
    def work_deadline(self) -> float:
        """Until when leaderships and clients may take: the deadline less the stop's reserve."""
        return self.deadline - min(TAIL_RESERVE_MAX_S, self.timeout_s * TAIL_RESERVE_FRACTION)

    def remaining(self, until: float | None = None) -> float:
        return max(0.0, (self.work_deadline if until is None else until) - self.clock())

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase.label}
        if self.started_at is not None:
            out.update(reason=self.reason, elapsed_s=round(self.clock() - self.started_at, 3),
                       timeout_s=self.timeout_s, clients_closed=self.clients_closed, clients_cut=self.clients_cut)
        return out


# --- where clients go: the one lookup that the membership table can replace --------------------------


def client_address_of_live_peer(node: Node, client_id: str, now: float) -> str | None:
    """A live, not draining peer's client address (``listeners.advertise``) for this client, or None
    (single node, or no peer heard from lately). Spread by client id over the candidates, so a
    drained node's clients do not all land on one peer. Today from the peers' cluster-link
    announcements; a member table in the metadata group can take its place here."""
    link = node.link
    if link is None:
        return None
    candidates = sorted(
        (name, body["client"]) for name, (at, body) in link.announced.items()
        if now - at <= ANNOUNCEMENT_FRESH_S and not body.get("draining") and isinstance(body.get("client"), str))
    if not candidates:
        return None
    return candidates[zlib.crc32(client_id.encode()) % len(candidates)][1]


def live_peers(node: Node, now: float) -> list[str]:
    """Peers heard from within ANNOUNCEMENT_FRESH_S that do not drain: those that can take over."""
    link = node.link
    if link is None:
        return []
    return sorted(name for name, (at, body) in link.announced.items()
                  if now - at <= ANNOUNCEMENT_FRESH_S and not body.get("draining"))


async def hand_over(node: Node, timeout_s: float) -> bool:
    """``node.hand_over_leadership`` (bounded by ``timeout_s``), given up as soon as no peer could take
    a leadership — every peer down or draining, as when a whole cluster stops at once — instead of
    trying until the bound. False when given up."""
    task = asyncio.ensure_future(node.hand_over_leadership(timeout_s=timeout_s))
    while not task.done():
        await asyncio.wait({task}, timeout=HANDOVER_CHECK_S)
        if not task.done() and not live_peers(node, node.clock.monotonic()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
    task.result()
    return True


def advertised_address(node: Node, bound_mqtt: tuple[str, int], advertise: bool = True) -> str:
    """This node's client address for its peers to hand out: ``listeners.advertise``, else the bound
    MQTT address, a wildcard host replaced by the host of --cluster. ``advertise=False``: the bound
    address alone (the HTTP listener's, for the peers' admin requests)."""
    if advertise and node.cfg.listeners.advertise:
        return node.cfg.listeners.advertise
    host, port = bound_mqtt
    if host in ("0.0.0.0", "::", "") and node.link is not None:
        host = node.link.spec.listen[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- readiness --------------------------------------------------------------------------------------


def group_label(node: Node, group: int) -> str:
    return "the metadata group" if group == node.meta_group else f"shard {group}"


def lagging_replicas(node: Node, host: Any, max_lag: int) -> list[str]:
    """On this group's leader: the replicas (voters and learners) not caught up — not heard from
    lately, being sent a snapshot, or more than ``max_lag`` entries behind the commit index — and a
    voter set below the placement's. Empty: the group is whole."""
    raft = host.raft
    conf = raft.active_conf_state
    committed = raft.log.committed
    out = []
    for m in conf.members():
        if m == raft.id:
            continue
        pr = raft.progress.get(m)
        name = node.node_name(m[0])
        if pr is None or not raft.is_active(m):
            out.append(f"{name} not heard from")
        elif pr.state == ProgressState.SNAPSHOT:
            out.append(f"{name} being sent a snapshot")
        elif pr.match + max_lag < committed:
            out.append(f"{name} {committed - pr.match} entries behind")
    if host.shard < len(node.placement):
        want = len(node.placement[host.shard].voters)
        if len(conf.voters) < want:
            out.append(f"{len(conf.voters)} of {want} voters")
    return out


def announcement(node: Node, drain: Drain, client_address: str, http_address: str | None = None) -> dict[str, Any]:
    """What this node tells its peers every announcement: where its clients connect (and its HTTP
    listener (informational; the admin API's cluster-wide lists go over the link: node/admin/peer_ask.py), whether it drains,
    which groups it leads, and which of those are not whole (lagging_replicas)."""
    max_lag = node.cfg.cluster.ready_max_lag_entries
    leads: list[int] = []
    lagging: list[int] = []
    for host in node.groups:
        if host.failed is None and host.raft.is_leader:
            leads.append(host.shard)
            if lagging_replicas(node, host, max_lag):
                lagging.append(host.shard)
    out = {"client": client_address, "draining": drain.draining, "leads": leads, "lagging": lagging}
    if http_address is not None:
        out["http"] = http_address
    return out


def node_readiness(node: Node, drain: Drain | None) -> list[str]:
    """Why this node does not take clients (empty: it does): draining, or a shard failed here."""
    reasons = []
    if drain is not None and drain.draining:
        reasons.append(f"this node is draining ({drain.reason})")
    failed = sorted(h.shard for h in node.hosts if h.failed)
    if failed:
        reasons.append(f"shards failed on this node: {', '.join(map(str, failed))}")
    return reasons


def cluster_readiness(node: Node, drain: Drain | None, now: float) -> list[str]:
    """Why it is not safe to take the next node down (empty: it is). As this node sees it: it takes
    clients; every peer was heard from within ANNOUNCEMENT_FRESH_S and is not draining; every group
    has a leader; and every group is whole as its leader reports (this node's own view for the
    groups it leads, the leader's latest announcement for the others)."""
    reasons = node_readiness(node, drain)
    link = node.link
    if link is None:
        return reasons
    fresh: dict[str, dict[str, Any]] = {}
    peers = link.transport.peer_names()  # members that joined too; forgotten and left ones are no peers
    for name in link.spec.known:
        if name == link.spec.me or name not in peers:
            continue
        got = link.announced.get(name)
        if got is None or now - got[0] > ANNOUNCEMENT_FRESH_S:
            reasons.append(f"{name} not heard from within {ANNOUNCEMENT_FRESH_S:g} s")
            continue
        if got[1].get("draining"):
            reasons.append(f"{name} is draining")
        fresh[name] = got[1]
    max_lag = node.cfg.cluster.ready_max_lag_entries
    for host in node.groups:
        if host.failed is not None:
            continue  # reported above (a shard; the metadata group's failure stops the node)
        label = group_label(node, host.shard)
        raft = host.raft
        if raft.lead is None:
            reasons.append(f"{label}: no leader")
        elif raft.is_leader:
            behind = lagging_replicas(node, host, max_lag)
            if behind:
                reasons.append(f"{label}: {', '.join(behind)}")
        else:
            leader = node.node_name(raft.lead[0])
            body = fresh.get(leader)
            if body is None:
                if leader in link.spec.ids and leader != link.spec.me:
                    reasons.append(f"{label}: its leader {leader} not heard from")
                continue
            if host.shard not in _ints(body.get("leads")):
                reasons.append(f"{label}: leadership moving (to {leader})")
            elif host.shard in _ints(body.get("lagging")):
                reasons.append(f"{label}: a replica is not caught up (as its leader {leader} reports)")
    return reasons


def _ints(value: Any) -> set[int]:
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


# --- clients ----------------------------------------------------------------------------------------


def refusal_connack(version: int, reference: str | None, in_cluster: bool) -> Connack:
    """The CONNACK a draining node answers a CONNECT with. In a cluster 0x9C (use another server),
    with a Server Reference when a live peer is known (MQTT 5 only; the 3.1.1 encoder makes it
    return code 3, server unavailable); a single node has no other server: 0x88 (server unavailable)."""
    if not in_cluster:
        return Connack(False, RC.SERVER_UNAVAILABLE)
    props = Properties(server_reference=reference, reason_string="node draining") if version == MQTT_5 \
        else Properties()
    return Connack(False, RC.USE_ANOTHER_SERVER, props)


def goodbye(conn: Connection, reference: str | None, in_cluster: bool, connected: bool) -> None:
    """Close a connection the drain is done with: MQTT 5 (``connected``: CONNACK sent) gets DISCONNECT
    0x9C with the Server Reference (single node: 0x8B, server shutting down); others are closed."""
    if conn.version == MQTT_5 and connected and not conn.closing:
        if in_cluster:
            props = Properties(server_reference=reference, reason_string="node draining")
            conn.send_disconnect(Disconnect(RC.USE_ANOTHER_SERVER, props))
        else:
            conn.send_disconnect(Disconnect(RC.SERVER_SHUTTING_DOWN))
    conn.close_after_goodbye("node draining")


async def release_and_close(conn: Connection, drain: Drain, reference_of: Callable[[str], str | None],
                            in_cluster: bool) -> None:
    """The session's close committed first (Connection.close_session_for_drain, bounded by the
    drain's time), then the client told to go: its CONNECT elsewhere never waits for this node."""
    connected = conn.live is not None
    released = conn.close_session_for_drain()
    if released is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released, max(0.05, drain.remaining()))
    goodbye(conn, reference_of(conn.client_id), in_cluster, connected)


async def close_clients(conns: Iterable[Connection], drain: Drain, reference_of: Callable[[str], str | None],
                        in_cluster: bool) -> None:
    """Stop reading every connection; release and close each as soon as every PUBLISH it read is
    answered; at ``drain.work_deadline`` the rest (counted in ``drain.clients_cut``)."""
    conns = list(conns)
    waiting = [c for c in conns if not c.closing]
    for conn in waiting:
        conn.stop_reading_for_drain()
    closing: list[asyncio.Task[None]] = []
    while True:
        still = []
        for conn in waiting:
            if conn.closing:
                continue
            if conn.has_unanswered_work():
                still.append(conn)
            else:
                closing.append(asyncio.ensure_future(release_and_close(conn, drain, reference_of, in_cluster)))
                drain.clients_closed += 1
        waiting = still
        if not waiting or drain.remaining() <= 0:
            break
        await asyncio.sleep(CLIENT_POLL_S)
    for conn in waiting:
        log.warning("drain: closing %s (%r) with a publish still unanswered at the drain's deadline "
                    "(cluster.drain_timeout_s): the client resends it", conn.peer, conn.client_id)
        closing.append(asyncio.ensure_future(release_and_close(conn, drain, reference_of, in_cluster)))
        drain.clients_cut += 1
    if closing:
        await asyncio.gather(*closing)
    # The clients close on our FIN; whoever has not within CLOSE_GRACE_S is closed here.
    told = [c for c in conns if c.transport is not None]
    grace_until = min(drain.clock() + CLOSE_GRACE_S, drain.deadline)
    while any(not c.transport.is_closing() for c in told) and drain.clock() < grace_until:  # type: ignore[union-attr]
        await asyncio.sleep(CLIENT_POLL_S)
    for conn in told:
        conn.close_transport()
