"""Model clients for the cluster simulator: the workload whose history the checkers judge.

Every client speaks the real codec (``mqtt_client.ClientConnection``) over the simulated network,
MQTT 3.1.1 or 5.0 drawn per client from the seeded generator, and records what it saw in the
history format ``moorline verify`` reads (docs/history-format.md) into one shared list. Times are
virtual: ``mono_ns`` is the client loop's clock, ``wall_ms`` the world's epoch plus that, so one
seed's history is the same list every time it runs.

The clients (docs/cluster-sim-workload.md has the table):
- publishers at QoS 0/1/2, with or without a ``guid`` user property (5.0 only), persistent or
  clean, a small window of unacknowledged publishes; after a reconnect (to any node) they resend
  every publish not yet acknowledged with DUP=1 and the same packet id (PUBREL for QoS 2 once
  PUBREC came);
- persistent and clean subscribers on wildcard and exact filters, which now and then withhold an
  acknowledgement and reconnect, so the broker must resend with the original packet id;
- QoS 2 receivers of both kinds: Method A (stores the message until PUBREL) and Method B (passes
  it on at once and holds the packet id until PUBREL: a PUBLISH with a held id is a resend);
- a pair of processes sharing one client id that take the session over from each other on
  different nodes (the old connection must be closed: DISCONNECT 0x8E on 5.0);
- a racer that subscribes and unsubscribes wildcard filters over many shards while a publisher
  publishes to them;
- ``$share`` group members that come, go, rejoin as a new session, or leave for good;
- a retained publisher (subscriptions made later receive its last retained message) and clients
  with wills (a will is published when the connection ends without DISCONNECT, never after one).

Message identity is the payload (``publisher#seq``); the history's ``guid`` is a hash of it, and
the ``guid`` user property a 5.0 publisher sends is that same value, so deliveries are matched to
publishes whether or not the broker saw a guid. A publish sent without one is recorded with
``detail="no_guid"``: the checkers allow such a QoS 1 resend to arrive twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import tempfile
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moorline.broker.commands import SHARE_PREFIX
from moorline.broker.share_policy import SHARE_MODE_PROPERTY, SINGLE_ACTIVE
from moorline.hashing import shard_of
from moorline.mqtt.packets import (
    NO_PROPERTIES,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from moorline.mqtt.topics import matches
from moorline.sim.cluster.checkers import WILL_DELAYED
from moorline.sim.cluster.mqtt_client import CLOSED_BY_BROKER, Changed, ClientClosed, ClientConnection
from moorline.sim.cluster.vloop import VirtualLoop
from moorline.sim.cluster.vnet import HostNetwork
from moorline.sim.cluster.world import EPOCH_MS, SimNode, World, WorldConfig
from moorline.verify.history import check_record

if TYPE_CHECKING:
    from moorline.node.node import Node

PROBE_AGAIN_S = (0.3, 1.0)  # a racer's SUBACK is probed at once and again after these delays
RACE_FILTERS_KEPT = 5  # a racer holds at most this many race/ filters; past it the oldest is unsubscribed
NO_GUID = "no_guid"  # detail of a publish sent without a guid user property
WILL_DISCARDED = "will discarded: clean DISCONNECT processed"
# A delayed will (MQTT 5 will delay interval): the client ends its connection without DISCONNECT
# and resumes the session (clean start 0) well within the delay, so the will must never be
# published (MQTT 5 3.1.3.2.2: the session resumed before the delay ran out). The end, recorded
# with reason checkers.WILL_DELAYED, is not "will due" (checkers.WILL_DUE): the will is owed only
# if nothing resumes the session in time.
WILL_CANCELLED = "will cancelled: session resumed within its will delay"
WILL_DELAY_S = 4  # the delayed wills' will delay interval (s)
WILL_SESSION_EXPIRY_S = 30  # their session's expiry: the session outlives the delay
# The resumed session's CONNACK must come this long before the delay runs out for the will to
# be judged cancelled: the broker's timer starts when it notices the end (after the client's
# close), and node clocks differ by up to WorldConfig.max_skew_ms.
WILL_RESUME_MARGIN_S = 1.5
NOT_DRAINED = "not drained: the drain timed out"  # a subscriber that could not catch up after the faults healed
ABANDONED = "abandoned: unanswered when the drain timed out"  # a publish never answered after the faults healed
SESSION_TAKEN_OVER = 0x8E
ACK_TIMEOUT_REASON_CODE = 0x83  # the broker closes a member past queue.ack_timeout_s (docs/queues.md)
POISON = b"poison:"  # a dead-letter consumer crashes on a payload starting with this
PERSISTENT_EXPIRY_S = 600
SA_GROUP, SA_FILTER, SA_TOPIC = "sa", "q/sa", "q/sa"  # the single-active group (one topic: one order)
DL_GROUP, DL_FILTER = "dl", "q/dl/#"  # the delivery-limited group (world.WorldConfig.queue_limited_groups)
MAX_DELIVERIES_DETAIL = "max_deliveries="  # subscribe record detail naming the group's limit (checkers.py)


def message_guid(payload: bytes) -> str:
    """The history's identity of a message: 32 hex characters derived from its payload."""
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


@dataclass
class WorkloadConfig:
    """Sizes of one seed's workload. The defaults keep a 3-node seed to a few seconds of wall time."""

    client_hosts: int = 3  # client machines (one loop each, addresses 10.1.0.1..)
    publishers: int = 6  # QoS 0/1/2 x persistent/clean x 3.1.1/5.0 x guid/no guid, cycled
    messages_per_publisher: int = 25
    publish_window: int = 3  # unacknowledged publishes in flight per publisher, at most
    publisher_qos: tuple[int, ...] = (0, 1, 2)  # the QoS of the plain publishers, cycled
    guidless_publishers: bool = True  # half the plain publishers send no guid (3.1.1 never does)
    subscription_qos: tuple[int, ...] = (0, 1, 2)  # QoS the subscribers ask for, drawn from these
    publish_interval_s: tuple[float, float] = (0.05, 0.4)
    ack_timeout_s: float = 8.0  # above mqtt.publish_timeout_s: the node answers or closes first
    persistent_subscribers: int = 3
    clean_subscribers: int = 1
    qos2_receivers: int = 2  # alternately Method B and Method A
    takeover_pairs: int = 1
    takeovers_per_pair: int = 3
    racers: int = 2
    race_messages: int = 30
    share_members: int = 3  # one $share group; the last member leaves for good
    share_messages: int = 30
    # Work queues (docs/queues.md): a single-active group ("sa", asked for by the SUBSCRIBE user
    # property) and a delivery-limited group with an ack timeout ("dl", the nodes' [queue] config:
    # world.WorldConfig.queue_*) whose publisher sends a poison message every ``poison_every``
    # messages (every consumer crashes on it), one of whose consumers now and then stalls (holds a
    # message unacknowledged while connected); a persistent observer reads the dead-letter topics.
    queue_members: int = 3
    queue_messages: int = 24
    dl_consumers: int = 2  # the first crashes on poison only; the others stall too
    dl_messages: int = 20
    poison_every: int = 4
    dl_publish_interval_s: tuple[float, float] = (0.6, 2.2)  # spread over the faults: leader changes between attempts
    crash_restart_s: tuple[float, float] = (0.3, 1.5)  # a consumer that crashed on poison is back after this
    retained_messages: int = 8
    will_clients: int = 2
    # Rounds go on into the heal phase (the workload's stop ends them): a will due there, with no
    # fault near, must be published (checkers: will_not_published).
    will_rounds: int = 12
    # Pinning readers (PinningReader: retention pins through the node's pin API, judged by
    # world_checks.PinCheck). The runner sets 0 outside the default mix (runner.plain_mix, or drawn
    # configuration without timed syncs and aimed crashes: those seeds replay as before); in it,
    # retention_min_age_s is seconds in half the seeds.
    pinning_readers: int = 1
    pin_gap_s: tuple[float, float] = (0.5, 3.0)  # between one pin's end and the next
    pin_ttl_s: tuple[float, float] = (1.5, 6.0)
    pin_hold_s: tuple[float, float] = (4.0, 20.0)  # renewed for this long
    pin_lapse_probability: float = 0.3  # a pin left to run out by its TTL instead of unpinned
    # A round of an MQTT 5 will client with this probability is a delayed one: will delay
    # WILL_DELAY_S, an end without DISCONNECT, then the session resumed within the delay. The
    # runner sets 0 without drawn configuration (runner.plain_mix: its seeds replay as before).
    delayed_will_probability: float = 0.35
    withhold_probability: float = 0.04  # a subscriber withholds an ack, then reconnects
    reconnect_rate_per_s: float = 0.08  # random reconnects of a connected client, per second
    connect_timeout_s: float = 15.0  # above the owner lease: a takeover may wait for it
    subscribe_timeout_s: float = 15.0
    keepalive_s: int = 30
    quiet_s: float = 4.0  # drain: no delivery for this long means subscribers have what they can get


@dataclass
class Outgoing:
    """A publish not yet acknowledged (QoS 1: PUBACK; QoS 2: PUBREC, then PUBCOMP)."""

    seq: int
    topic: str
    payload: bytes
    guid: str
    qos: int
    pid: int
    with_guid: bool
    retain: bool = False
    state: str = "sent"  # "sent" (PUBLISH out) | "rec" (PUBREC in, PUBREL out)
    sent_at: float = 0.0


class History:
    """Appends history records (``moorline.verify.history`` format) with virtual timestamps."""

    def __init__(self, records: list[dict[str, Any]], run: str) -> None:
        self.records = records
        self.run = run

    def record(self, t_s: float, type: str, op: str, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {"run": self.run, "type": type, "op": op}
        rec.update({k: v for k, v in fields.items() if v is not None})
        check_record(rec)
        mono_ns = round(t_s * 1e9)
        rec["index"] = len(self.records)
        rec["mono_ns"] = mono_ns
        rec["wall_ms"] = EPOCH_MS + mono_ns // 1_000_000
        self.records.append(rec)
        return rec


@dataclass
class ClientHost:
    loop: VirtualLoop
    net: HostNetwork


class ModelClient:
    """One MQTT client process: a connection at a time to a node drawn at random, a reader task
    that records what arrives as it arrives, and a driver (``run``) that decides what to send."""

    kind = "client"

    def __init__(self, wl: Workload, name: str, client_id: str, version: int, host: ClientHost) -> None:
        self.wl = wl
        self.name = name
        self.client_id = client_id
        self.version = version
        self.host = host
        self.rng = random.Random(wl.rng.getrandbits(64))
        self.conn: ClientConnection | None = None
        self.node: str | None = None
        self.connected = False
        self.ever_connected = False
        self.done = False
        self.changed = Changed()  # something arrived or the connection ended
        self._pending: dict[int, asyncio.Future[Packet]] = {}
        self._ctl_pid = 60000  # SUBSCRIBE / UNSUBSCRIBE packet ids (publish ids stay below)
        self.connections = 0  # successful CONNECTs so far
        self.ended: ClientConnection | None = None  # the last connection whose reader has finished
        self.end_reason = ""  # how it ended ("closed": by this client)
        self.awaiting_end: ClientConnection | None = None  # DISCONNECT sent: read on until the broker ends it

    # --- recording -----------------------------------------------------------------------------
    def now(self) -> float:
        return self.host.loop.time()

    def rec(self, type: str, op: str, **fields: Any) -> None:
        self.wl.history.record(self.now(), type, op, process=self.name, session=self.client_id,
                               node=self.node, **fields)

    def stat(self, key: str, n: int = 1) -> None:
        self.wl.stats[key] += n
        self.wl.stats_by_kind[self.kind][key] += n

    # --- connection ----------------------------------------------------------------------------
    def connect_properties(self, expiry: int) -> Properties:
        return Properties(session_expiry_interval=expiry or None, receive_maximum=32)

    def will_for_connect(self) -> Will | None:
        return None

    async def connect(self, clean_start: bool, expiry: int) -> bool | None:
        """CONNECT to a node drawn at random. The session present flag, or None on failure."""
        sn = self.rng.choice(self.wl.world.nodes)
        self.node = sn.name
        v5 = self.version == 5
        # 3.1.1 sends no expiry: a clean session ends with its connection, another never expires.
        self.rec("invoke", "connect", clean_start=clean_start,
                 session_expiry=expiry if v5 else 0 if clean_start else None)
        will = self.will_for_connect()
        try:
            conn = await ClientConnection.open(self.host.net, *sn.mqtt, self.version)
        except ClientClosed as exc:
            self.rec("fail", "connect", reason="refused", detail=str(exc))
            self.on_connect_failed()
            return None
        conn.send(Connect(protocol_level=self.version, client_id=self.client_id, clean_start=clean_start,
                          keepalive=self.wl.cfg.keepalive_s, will=will,
                          properties=self.connect_properties(expiry) if v5 else NO_PROPERTIES))
        try:
            pk = await conn.recv(self.wl.cfg.connect_timeout_s)
        except ClientClosed as exc:
            self.rec("fail", "connect", reason="closed", detail=str(exc))
            self.on_connect_failed()
            return None
        if not isinstance(pk, Connack) or pk.reason_code >= 0x80:
            conn.close()
            reason = "timeout" if pk is None else (
                f"connack 0x{pk.reason_code:02x}" if isinstance(pk, Connack) else f"unexpected {type(pk).__name__}")
            self.rec("fail", "connect", reason=reason)
            self.on_connect_failed()
            return None
        self.conn = conn
        self.connected = True
        self.ever_connected = True
        self.connections += 1
        self.stat("connects")
        if self.connections > 1:
            self.stat("reconnects")
        if pk.session_present:
            self.stat("sessions_resumed")
        self.rec("ok", "connect", session_present=pk.session_present)
        self.host.loop.create_task(self._read_loop(conn), name=f"read-{self.name}")
        self.host.loop.create_task(self._ping_loop(conn), name=f"ping-{self.name}")
        return pk.session_present

    def on_connect_failed(self) -> None:
        self.stat("connect_failures")

    async def _ping_loop(self, conn: ClientConnection) -> None:
        while self.conn is conn and self.connected:
            await asyncio.sleep(self.wl.cfg.keepalive_s / 2)
            if self.conn is conn and self.connected:
                try:
                    conn.send(Pingreq())
                except ClientClosed:
                    return

    async def _read_loop(self, conn: ClientConnection) -> None:
        reason = "reader stopped"
        try:
            while True:
                pk = await conn.recv(3600.0)
                if pk is None:
                    continue
                if self.conn is not conn or (not self.connected and self.awaiting_end is not conn):
                    return  # closed by this client: what was still buffered is never read
                if isinstance(pk, Disconnect):
                    self.on_server_disconnect(pk.reason_code)
                    raise ClientClosed(f"server disconnect 0x{pk.reason_code:02x}")
                if isinstance(pk, (Suback, Unsuback)):
                    fut = self._pending.pop(pk.packet_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(pk)
                    continue
                self.on_packet(pk)
                self.changed.set()
        except ClientClosed as exc:
            reason = str(exc)
            if self.conn is conn and self.connected:
                self._connection_lost(str(exc))
        except Exception as exc:  # noqa: BLE001 - a model client's own bug must surface, not vanish
            self.wl.errors.append(f"{self.name}: reader failed: {exc!r}")
            if self.conn is conn and self.connected:
                self._connection_lost(f"client error {exc!r}")
        finally:
            self.end_reason = reason
            self.ended = conn
            self.changed.set()

    def _connection_lost(self, reason: str) -> None:
        assert self.conn is not None
        self.conn.close()
        self.connected = False
        self.rec("info", "disconnect", reason=reason)
        self.stat("connections_lost")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClientClosed(reason))
        self._pending.clear()
        self.on_lost(reason)
        self.changed.set()

    def close(self, clean: bool, reason: str = "closed by client") -> None:
        """End the connection: clean (DISCONNECT 0) or abrupt (no DISCONNECT: the will is due)."""
        if not self.connected or self.conn is None:
            return
        conn = self.conn
        self.connected = False
        if clean:
            try:
                conn.send(Disconnect(0))
            except ClientClosed:
                pass
        conn.close()
        if clean:
            self.rec("ok", "disconnect")
        else:
            self.rec("info", "disconnect", reason=reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClientClosed("closed"))
        self._pending.clear()
        self.on_lost(reason)
        self.changed.set()

    def on_server_disconnect(self, reason_code: int) -> None:
        if reason_code == SESSION_TAKEN_OVER:
            self.stat("taken_over_0x8e")

    def on_lost(self, reason: str) -> None:
        pass

    def on_packet(self, pk: Packet) -> None:
        pass

    @staticmethod
    def send_raw(conn: ClientConnection, pk: Packet) -> None:
        try:
            conn.send(pk)
        except ClientClosed:
            pass

    def send(self, pk: Packet) -> bool:
        if not self.connected or self.conn is None:
            return False
        try:
            self.conn.send(pk)
        except ClientClosed:
            return False
        return True

    async def request(self, pk: Subscribe | Unsubscribe, timeout_s: float) -> Packet | None:
        """SUBSCRIBE / UNSUBSCRIBE and its answer (None: timed out or the connection ended)."""
        fut: asyncio.Future[Packet] = self.host.loop.create_future()
        self._pending[pk.packet_id] = fut
        if not self.send(pk):
            self._pending.pop(pk.packet_id, None)
            return None
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except (TimeoutError, ClientClosed):
            self._pending.pop(pk.packet_id, None)
            return None

    def next_ctl_pid(self) -> int:
        self._ctl_pid = 60000 + (self._ctl_pid - 60000 + 1) % 5000
        return self._ctl_pid

    async def wait_changed(self, timeout_s: float) -> None:
        self.changed.clear()
        await self.changed.wait(timeout_s)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def main(self) -> None:
        try:
            await self.run()
        except Exception as exc:  # noqa: BLE001 - recorded, and the test that ran it fails
            self.wl.errors.append(f"{self.name}: {exc!r}")
        finally:
            if self.connected:
                self.close(clean=True)
            self.done = True

    async def run(self) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
class Publisher(ModelClient):
    kind = "publisher"

    def __init__(self, wl: Workload, name: str, version: int, host: ClientHost, *, qos: int, with_guid: bool,
                 persistent: bool, topics: list[str], messages: int, retain: bool = False) -> None:
        super().__init__(wl, name, name, version, host)
        self.qos = qos
        self.with_guid = with_guid and version == 5
        self.persistent = persistent
        self.topics = topics
        self.messages = messages
        self.retain = retain
        self.seq = 0
        self.inflight: OrderedDict[int, Outgoing] = OrderedDict()
        self._pid = 0
        self.acked = 0
        self.interval_s = wl.cfg.publish_interval_s  # between two publishes (drawn uniformly)

    def new_pid(self) -> int:
        while True:
            self._pid = self._pid % 59999 + 1
            if self._pid not in self.inflight:
                return self._pid

    def _props(self, out: Outgoing) -> Properties:
        if not out.with_guid:
            return NO_PROPERTIES
        return Properties(user_properties=(("guid", out.guid),))

    def _send_publish(self, out: Outgoing, dup: bool) -> None:
        out.sent_at = self.now()
        self.rec("invoke", "publish", guid=out.guid, topic=out.topic, qos=out.qos,
                 packet_id=out.pid if out.qos else None, dup=dup, detail=None if out.with_guid else NO_GUID)
        self.send(Publish(out.topic, out.payload, out.qos, out.retain, dup, out.pid if out.qos else None,
                          self._props(out)))
        if dup:
            self.stat("publish_resends")

    def on_packet(self, pk: Packet) -> None:
        if isinstance(pk, Puback):
            out = self.inflight.get(pk.packet_id)
            if out is None or out.qos != 1:
                return
            del self.inflight[pk.packet_id]
            self._outcome(out, pk.reason_code)
        elif isinstance(pk, Pubrec):
            out = self.inflight.get(pk.packet_id)
            if out is None or out.qos != 2:
                return
            if pk.reason_code >= 0x80:
                del self.inflight[pk.packet_id]
                self._outcome(out, pk.reason_code)
                return
            if out.state == "sent":
                out.state = "rec"
                self._outcome(out, pk.reason_code)  # PUBREC: committed on a quorum (promise 1)
            out.sent_at = self.now()
            self.send(Pubrel(pk.packet_id))
        elif isinstance(pk, Pubcomp):
            out = self.inflight.get(pk.packet_id)
            if out is not None and out.state == "rec":
                del self.inflight[pk.packet_id]

    def _outcome(self, out: Outgoing, reason_code: int) -> None:
        detail = None if out.with_guid else NO_GUID
        if reason_code >= 0x80:
            self.rec("fail", "publish", guid=out.guid, topic=out.topic, qos=out.qos, packet_id=out.pid,
                     reason=f"0x{reason_code:02x}", detail=detail)
            self.stat("publish_refused")
        else:
            self.rec("ok", "publish", guid=out.guid, topic=out.topic, qos=out.qos, packet_id=out.pid,
                     detail=detail)
            self.acked += 1
            self.stat("publish_acked")
            self.wl.acked_topics[out.topic] = self.wl.acked_topics.get(out.topic, 0) + 1

    def on_lost(self, reason: str) -> None:
        for out in self.inflight.values():
            if out.state == "sent":
                self.rec("info", "publish", guid=out.guid, topic=out.topic, qos=out.qos, packet_id=out.pid,
                         reason="connection lost", detail=None if out.with_guid else NO_GUID)

    async def ensure_connected(self) -> None:
        while not self.connected and not self.wl.abandon_publishes:
            clean = not self.persistent or (not self.ever_connected and self.version == 5)
            expiry = PERSISTENT_EXPIRY_S if self.persistent else 0
            present = await self.connect(clean, expiry)
            if present is None:
                await self.sleep(self.rng.uniform(0.2, 1.0))
                continue
            # Every publish not yet acknowledged goes again, in order, with its packet id.
            for out in list(self.inflight.values()):
                if out.state == "sent":
                    self._send_publish(out, dup=True)
                else:
                    out.sent_at = self.now()  # the PUBREL's answer is what is awaited now
                    self.send(Pubrel(out.pid))

    def next_message(self) -> Outgoing:
        self.seq += 1
        payload = f"{self.name}#{self.seq}".encode()
        topic = self.rng.choice(self.topics)
        return Outgoing(self.seq, topic, payload, message_guid(payload), self.qos,
                        self.new_pid() if self.qos else 0, self.with_guid, self.retain)

    def _timed_out(self) -> bool:
        now = self.now()
        return any(now - o.sent_at > self.wl.cfg.ack_timeout_s for o in self.inflight.values())

    async def run(self) -> None:
        await self.sleep(self.rng.uniform(0.0, 0.5))
        cfg = self.wl.cfg
        while self.seq < self.messages and not self.wl.stopping:
            await self.ensure_connected()
            if self._timed_out():
                self.give_up_waiting()
                continue
            if len(self.inflight) >= cfg.publish_window:
                await self.wait_changed(0.5)
                continue
            out = self.next_message()
            if out.qos:
                self.inflight[out.pid] = out
            self._send_publish(out, dup=False)
            self.stat("published")
            if self.rng.random() < cfg.reconnect_rate_per_s * 0.3:
                self.close(clean=self.rng.random() < 0.5)
                await self.sleep(self.rng.uniform(0.05, 1.0))
            await self.sleep(self.rng.uniform(*self.interval_s))
        await self.finish()

    def give_up_waiting(self) -> None:
        """An acknowledgement took longer than the broker's own bound: record it and reconnect
        (everything in flight is then resent)."""
        for o in self.inflight.values():
            if o.state == "sent":
                self.rec("info", "publish", guid=o.guid, topic=o.topic, qos=o.qos, packet_id=o.pid,
                         reason="timeout", detail=None if o.with_guid else NO_GUID)
        self.close(clean=False, reason="acknowledgement timed out")

    async def finish(self) -> None:
        """Stopping: finish what is in flight (resending after reconnects), then leave cleanly."""
        while self.inflight and not self.wl.abandon_publishes:
            await self.ensure_connected()
            if self._timed_out():
                self.close(clean=False, reason="acknowledgement timed out")
                continue
            await self.wait_changed(0.5)
        for out in self.inflight.values():
            if out.state == "sent":  # never answered although every fault had healed
                self.rec("info", "publish", guid=out.guid, topic=out.topic, qos=out.qos, packet_id=out.pid,
                         reason=ABANDONED, detail=None if out.with_guid else NO_GUID)
                self.stat("publishes_abandoned")
        self.close(clean=True)


# ---------------------------------------------------------------------------------------------
@dataclass
class Sub:
    filter: str
    qos: int
    share_group: str | None = None
    detail: str | None = None  # recorded with the SUBACK: e.g. the group's max_deliveries (checkers.py)

    @property
    def wire(self) -> str:
        return f"$share/{self.share_group}/{self.filter}" if self.share_group else self.filter


class Subscriber(ModelClient):
    """A subscriber session. ``persistent``: session expiry > 0 (clean_session=0 on 3.1.1), clean
    start only the first time; otherwise every connection is a new session. QoS 2 as receiver
    ``method`` "A" or "B"."""

    kind = "subscriber"

    def __init__(self, wl: Workload, name: str, client_id: str, version: int, host: ClientHost, *,
                 subs: list[Sub], persistent: bool, method: str = "B", expiry_s: int = PERSISTENT_EXPIRY_S,
                 withhold: bool = True, offline_breaks: bool = True) -> None:
        super().__init__(wl, name, client_id, version, host)
        self.subs = subs
        self.persistent = persistent
        self.method = method
        self.expiry_s = expiry_s if persistent else 0
        self.withhold = withhold
        self.offline_breaks = offline_breaks
        self.held: dict[int, str | None] = {}  # Method B: packet id -> guid until PUBREL
        self.stored: dict[int, str | None] = {}  # Method A: packet id -> message until PUBREL
        self.withheld = 0  # acknowledgements withheld on this connection
        self.want_online = True
        self.last_delivery = 0.0
        self.subscribed = False  # the current session has its subscriptions
        self.gone = False  # left for good
        self.force_clean = False  # next connect starts a new session
        self.first_clean = True  # the first connect starts the session (False: another process did)
        self.drain_marked = False
        self.sub_props: Properties = NO_PROPERTIES  # SUBSCRIBE properties (a single-active group's)

    def on_packet(self, pk: Packet) -> None:
        if isinstance(pk, Publish):
            self._on_publish(pk)
        elif isinstance(pk, Pubrel):
            guid = self.held.pop(pk.packet_id, None) if self.method == "B" else self.stored.pop(pk.packet_id, None)
            if self.send(Pubcomp(pk.packet_id)):
                self.rec("ok", "ack", packet_id=pk.packet_id, guid=guid, qos=2)
                if self.method == "A" and guid is not None:
                    self.stat("method_a_released")

    def _withhold_now(self) -> bool:
        return (self.withhold and not self.wl.draining and self.withheld < 3
                and self.rng.random() < self.wl.cfg.withhold_probability)

    def _on_publish(self, pk: Publish) -> None:
        guid = message_guid(pk.payload)
        self.last_delivery = self.now()
        self.wl.last_delivery = self.now()
        self.stat("deliveries")
        if pk.retain:
            self.stat("retained_deliveries")
        if pk.topic.startswith("w/"):
            self.stat("will_deliveries")
        pid = pk.packet_id
        retained = "retained" if pk.retain else None
        if pk.qos == 2:
            assert pid is not None
            detail = retained
            if self.method == "B":
                held = pid in self.held
                if held:
                    self.stat("method_b_resends")
                    if self.held[pid] != guid:
                        detail = f"method B dropped: packet id {pid} still held by {self.held[pid]}"
                else:
                    self.held[pid] = guid
            else:
                if pid in self.stored:
                    self.stat("method_a_restored")
                self.stored[pid] = guid
            self.rec("ok", "deliver", topic=pk.topic, qos=2, packet_id=pid, dup=pk.dup, guid=guid, detail=detail)
            if self._withhold_now():
                self.withheld += 1
                self.stat("withheld_pubrec")
                return
            self.send(Pubrec(pid))
            return
        self.rec("ok", "deliver", topic=pk.topic, qos=pk.qos, packet_id=pid if pk.qos else None, dup=pk.dup,
                 guid=guid, detail=retained)
        if pk.qos == 1:
            assert pid is not None
            if self._withhold_now():
                self.withheld += 1
                self.stat("withheld_puback")
                return
            if self.send(Puback(pid)):
                self.rec("ok", "ack", packet_id=pid, guid=guid, qos=1)

    def on_lost(self, reason: str) -> None:
        self.withheld = 0

    async def subscribe(self, subs: list[Sub]) -> bool:
        for s in subs:
            self.rec("invoke", "subscribe", filter=s.filter, qos=s.qos, share_group=s.share_group,
                     no_local=False)
        pk = await self.request(
            Subscribe(self.next_ctl_pid(), tuple((s.wire, SubscriptionOptions(s.qos)) for s in subs),
                      self.sub_props),
            self.wl.cfg.subscribe_timeout_s)
        if not isinstance(pk, Suback):
            for s in subs:
                self.rec("info", "subscribe", filter=s.filter, share_group=s.share_group,
                         reason="no SUBACK")
            return False
        ok = True
        for s, code in zip(subs, pk.reason_codes, strict=False):
            if code < 0x80:
                self.rec("ok", "subscribe", filter=s.filter, qos=code, share_group=s.share_group, no_local=False,
                         detail=s.detail)
                self.stat("subscribed")
            else:
                ok = False
                self.rec("fail", "subscribe", filter=s.filter, share_group=s.share_group, reason=f"0x{code:02x}")
                self.stat("subscribe_refused")
        return ok

    async def unsubscribe(self, subs: list[Sub]) -> bool:
        pk = await self.request(Unsubscribe(self.next_ctl_pid(), tuple(s.wire for s in subs)),
                                self.wl.cfg.subscribe_timeout_s)
        if not isinstance(pk, Unsuback):
            return False
        for s in subs:
            self.rec("ok", "unsubscribe", filter=s.filter, share_group=s.share_group)
        self.stat("unsubscribed")
        return True

    async def go_online(self) -> bool:
        # A 3.1.1 persistent client never asks for a clean session: that one would end at disconnect.
        first = self.first_clean and not self.ever_connected and self.version == 5
        clean = not self.persistent or first or self.force_clean
        present = await self.connect(clean, self.expiry_s)
        if present is None:
            return False
        if self.force_clean:
            self.stat("rejoined_as_new_session")
        self.force_clean = False
        if not present:
            self.held.clear()
            self.stored.clear()
            self.subscribed = False
        if not self.subscribed:
            if not await self.subscribe(self.subs):
                self.close(clean=False, reason="subscribe failed")
                return False
            self.subscribed = True
        return True

    async def act(self) -> None:
        """One step of this subscriber's own behaviour while connected (between 0.1 s waits)."""
        cfg = self.wl.cfg
        if self.withheld and self.rng.random() < 0.15:
            # An acknowledgement was withheld: only a reconnect makes the broker resend.
            self.close(clean=self.rng.random() < 0.5)
            await self.sleep(self.rng.uniform(0.05, 0.5))
            return
        if self.rng.random() < cfg.reconnect_rate_per_s * 0.1:
            clean = self.rng.random() < 0.5
            self.close(clean=clean)
            if self.offline_breaks and self.persistent and self.rng.random() < 0.5:
                await self.sleep(self.rng.uniform(0.5, 3.0))  # offline: the session queues
            else:
                await self.sleep(self.rng.uniform(0.02, 0.3))

    async def run(self) -> None:
        await self.sleep(self.rng.uniform(0.0, 0.3))
        while not self.wl.finishing and not self.gone:
            if not self.want_online:
                await self.wait_changed(0.2)
                continue
            if not self.connected:
                if not await self.go_online():
                    await self.sleep(self.rng.uniform(0.2, 1.0))
                continue
            if not self.wl.draining:
                await self.act()
            elif self.withheld:
                self.close(clean=True)  # draining: reconnect so the broker resends what was withheld
                continue
            await self.wait_changed(0.1)
        self.finish()

    def finish(self) -> None:
        """The end of the run: a subscriber that has what it can get leaves with DISCONNECT (its
        session is judged); one the drain gave up on is recorded as not drained (it is not)."""
        if self.gone or not self.want_online or self.drain_marked:
            return
        settled = self.wl.drain_complete and self.connected and self.subscribed and not self.withheld
        if self.connected:
            self.close(clean=settled, reason=NOT_DRAINED)
        elif not settled and not self.drain_marked:
            self.rec("info", "disconnect", reason=NOT_DRAINED + " (offline)")
        self.drain_marked = True
        self.stat("drained" if settled else "not_drained")


class RacerSubscriber(Subscriber):
    """Subscribes and unsubscribes ``race/+/<j>`` filters (every shard can hold a match) while a
    racer publisher publishes to ``race/<k>/<j>``: SUBACK must mean registered in every shard."""

    kind = "racer"

    async def act(self) -> None:
        await super().act()
        if not self.connected or self.wl.draining or self.rng.random() > 0.1:
            return
        current = [s for s in self.subs if s.filter.startswith("race/")]
        if len(current) >= RACE_FILTERS_KEPT:
            # The oldest goes (UNSUBSCRIBE racing PUBLISH too): the checkers judge a filter's
            # deliveries only if it is still subscribed at the end, so the recent ones stay.
            if await self.unsubscribe([current[0]]):
                self.subs.remove(current[0])
            return
        j = self.rng.randrange(4)
        new = Sub(self.rng.choice([f"race/+/{j}", f"race/{self.rng.randrange(6)}/+", "race/#"]), 1)
        if any(s.filter == new.filter for s in self.subs):
            return
        if await self.subscribe([new]):
            self.subs.append(new)
            self.stat("race_subscribes")
            self.wl.check_registered(self, new.filter)
            self.wl.race_probe(new.filter)  # SUBACK means registered everywhere: test it at once


class RacePublisher(Publisher):
    """The racer's publisher: besides its own paced messages, right after each racer SUBACK it
    publishes one message to a matching topic of every shard the new filter reaches (``probes``),
    through its own connection, usually to another node than the racer's. A SUBACK sent before
    every shard registered the filter shows as such a message lost."""

    kind = "publisher"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.probes: deque[str] = deque()
        self.regular = 0

    def probe(self, topics: list[str]) -> None:
        """At once, and twice more within a second: a registration held up by a leader change or
        a cut link lands after all of them in a broken build."""
        if self.wl.stopping or len(self.probes) >= 64:  # bounded: racers subscribe now and then
            return
        self.probes.extend(topics)
        self.changed.set()  # the race is between the SUBACK and the last registration
        loop = self.host.loop
        for delay in PROBE_AGAIN_S:
            loop.call_later(delay, self._probe_again, topics)

    def _probe_again(self, topics: list[str]) -> None:
        if not self.wl.stopping and len(self.probes) < 64:
            self.probes.extend(topics)
            self.changed.set()

    def next_message(self) -> Outgoing:
        out = super().next_message()
        if self.probes:
            out.topic = self.probes.popleft()
            self.stat("race_probes")
        else:
            self.regular += 1
        return out

    async def run(self) -> None:
        cfg = self.wl.cfg
        next_regular = self.now() + self.rng.uniform(0.0, 0.5)
        while not self.wl.stopping:
            await self.ensure_connected()
            if self._timed_out():
                self.give_up_waiting()
                continue
            due = self.probes or (self.regular < self.messages and self.now() >= next_regular)
            if not due or len(self.inflight) >= cfg.publish_window + (4 if self.probes else 0):
                # Woken by a probe, an acknowledgement, or the next paced message's time (none
                # once the paced messages are all sent: it polled every millisecond then).
                paced = not due and self.regular < self.messages
                await self.wait_changed(min(0.5, max(0.001, next_regular - self.now())) if paced else 0.5)
                continue
            if not self.probes:
                next_regular = self.now() + self.rng.uniform(*cfg.publish_interval_s)
            out = self.next_message()
            self.inflight[out.pid] = out
            self._send_publish(out, dup=False)
            self.stat("published")
        await self.finish()


class ShareMember(Subscriber):
    """A ``$share`` group member: goes offline and back, rejoins as a new session (its QoS 1
    claims go back to the group, QoS 2 ones not yet PUBREC'd are dropped and counted), or, for a
    leaver, leaves for good with a short session expiry."""

    kind = "share"

    def __init__(self, *args: Any, leaver: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.leaver = leaver
        if leaver:
            self.expiry_s = 2

    async def act(self) -> None:
        if self.leaver and self.now() > self.wl.share_leave_at:
            self.close(clean=False, reason="left for good")
            self.gone = True
            self.stat("left_for_good")
            return
        if self.rng.random() < 0.02:
            self.close(clean=self.rng.random() < 0.5)
            self.force_clean = True  # rejoin as a new session
            await self.sleep(self.rng.uniform(0.05, 0.5))
            return
        await super().act()


class QueueMember(ShareMember):
    """A member of the single-active group (SUBSCRIBE user property ``moorline-share-mode:
    single-active``): only the active member receives; after each delivery the world's state is
    checked for a second member holding a message of the group (``Workload.check_single_active``)."""

    kind = "queue"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sub_props = Properties(user_properties=((SHARE_MODE_PROPERTY, SINGLE_ACTIVE),))

    def _on_publish(self, pk: Publish) -> None:
        super()._on_publish(pk)
        self.wl.check_single_active()


class DeadLetterConsumer(Subscriber):
    """A consumer of the delivery-limited group: a clean session (each connection a new one, so
    each delivery is one hand-out), which crashes (ends its connection without acknowledging) on a
    poison message. A ``staller`` now and then holds a message unacknowledged while connected until
    the broker closes its connection for the ack timeout (DISCONNECT 0x83 on 5.0)."""

    kind = "dead_letter"

    def __init__(self, *args: Any, staller: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.staller = staller
        self.stalled = False
        self.stalls_left = 3 if staller else 0
        self.restart_at = 0.0  # after a crash: not back before this
        if staller:
            self.kind = "staller"

    def _on_publish(self, pk: Publish) -> None:
        if self.stalled:  # hung: whatever arrives stays unprocessed and unacknowledged
            self.last_delivery = self.wl.last_delivery = self.now()
            self.rec("ok", "deliver", topic=pk.topic, qos=pk.qos, packet_id=pk.packet_id, dup=pk.dup,
                     guid=message_guid(pk.payload))
            return
        if pk.payload.startswith(POISON):
            guid = message_guid(pk.payload)
            self.last_delivery = self.wl.last_delivery = self.now()
            self.stat("poison_received")
            self.rec("ok", "deliver", topic=pk.topic, qos=pk.qos, packet_id=pk.packet_id, dup=pk.dup, guid=guid)
            self.close(clean=False, reason="crashed on a poison message")
            self.restart_at = self.now() + self.rng.uniform(*self.wl.cfg.crash_restart_s)
            return
        if (self.stalls_left and not self.stalled and not self.wl.draining and pk.qos == 1
                and self.rng.random() < 0.3):
            self.stalled = True
            self.stat("stalls")
            self.last_delivery = self.wl.last_delivery = self.now()
            self.rec("ok", "deliver", topic=pk.topic, qos=1, packet_id=pk.packet_id, dup=pk.dup,
                     guid=message_guid(pk.payload))
            return  # held: never acknowledged on this connection
        super()._on_publish(pk)

    def on_server_disconnect(self, reason_code: int) -> None:
        super().on_server_disconnect(reason_code)
        if reason_code == ACK_TIMEOUT_REASON_CODE:
            self.stat("ack_timeout_disconnects")

    def on_lost(self, reason: str) -> None:
        super().on_lost(reason)
        if self.stalled:
            self.stalled = False
            self.stalls_left -= 1

    async def act(self) -> None:
        if self.stalled:
            return  # connected, holding the message: the broker's ack timeout ends this
        if not self.connected:
            return
        await super().act()

    async def run(self) -> None:
        await self.sleep(self.rng.uniform(0.0, 0.3))
        while not self.wl.finishing and not self.gone:
            if not self.connected:
                if self.now() < self.restart_at:
                    await self.sleep(self.restart_at - self.now())
                elif not await self.go_online():
                    await self.sleep(self.rng.uniform(0.2, 1.0))
                continue
            if not self.wl.draining:
                await self.act()
            await self.wait_changed(0.1)
        self.finish()


class PoisonPublisher(Publisher):
    """The delivery-limited group's publisher: every ``poison_every``-th message is poison, each on
    a topic of its own (its dead-letter copies then have no order to keep between them)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.interval_s = self.wl.cfg.dl_publish_interval_s

    def next_message(self) -> Outgoing:
        out = super().next_message()
        if out.seq % self.wl.cfg.poison_every == 0:
            out.payload = POISON + out.payload
            out.guid = message_guid(out.payload)
            out.topic = f"q/dl/p{out.seq}"
            self.stat("poison_published")
        return out


class TakeoverPair:
    """Two processes with one client id: each in turn connects (to a node drawn at random) and
    takes the session over; the broker must close the other's connection first (0x8E on 5.0)."""

    def __init__(self, wl: Workload, index: int, hosts: list[ClientHost]) -> None:
        cid = f"tk{index}"
        self.wl = wl
        self.procs: list[Subscriber] = []
        for k, host in enumerate(hosts[:2]):
            version = 5 if (k == 0 or wl.rng.random() < 0.5) else 4
            s = Subscriber(wl, f"{cid}-{'ab'[k]}", cid, version, host,
                           subs=[Sub("t/#", 1)], persistent=True, withhold=False, offline_breaks=False)
            s.kind = "takeover"
            s.want_online = k == 0
            s.first_clean = k == 0
            s.subscribed = k == 1  # the session's subscriptions are the pair's: the first process makes them
            s.on_lost = self._lost_hook(s)  # type: ignore[method-assign, assignment]
            self.procs.append(s)
        self.current = self.procs[0]
        self.rng = random.Random(wl.rng.getrandbits(64))

    def _lost_hook(self, s: Subscriber) -> Callable[[str], None]:
        def lost(reason: str) -> None:
            s.withheld = 0
            if self.current is not s:
                s.want_online = False  # displaced: the other process owns the session now
                s.stat("displaced")
        return lost

    async def run(self) -> None:
        for _ in range(self.wl.cfg.takeovers_per_pair):
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))
            if self.wl.stopping:
                return
            other = self.procs[1] if self.current is self.procs[0] else self.procs[0]
            if not self.current.connected:
                continue
            self.current = other
            other.want_online = True
            other.stat("takeovers_started")
            other.changed.set()


class WillClient(ModelClient):
    """Connects with a will on ``w/<client id>`` (payload unique per connection), stays a while,
    then ends either with DISCONNECT (the will must never be published) or without (it is due)."""

    kind = "will"

    def __init__(self, wl: Workload, name: str, version: int, host: ClientHost, rounds: int) -> None:
        super().__init__(wl, name, name, version, host)
        self.rounds = rounds
        self.round = 0
        self.will: Outgoing | None = None
        self.server_disconnected = False
        self.will_delay = 0  # the will delay interval of the next CONNECT's will (s)
        # (ended at, will, the session's incarnation as served) of a delayed will to cancel
        self.delayed: tuple[float, Outgoing, int | None] | None = None
        self.delayed_inc: int | None = None
        self.expect_gone = False  # the next CONNECT (clean start 0) must find no session

    def will_for_connect(self) -> Will | None:
        self.round += 1
        payload = f"will:{self.name}#{self.round}".encode()
        self.will = Outgoing(self.round, f"w/{self.name}", payload, message_guid(payload), 1, 0, True)
        # The broker holds the will from the CONNECT on: recorded as a publish nobody acknowledges.
        self.rec("invoke", "publish", guid=self.will.guid, topic=self.will.topic, qos=1, detail="will")
        props = Properties(will_delay_interval=self.will_delay) if self.will_delay else NO_PROPERTIES
        return Will(self.will.topic, payload, 1, properties=props)

    async def run(self) -> None:
        await self.sleep(self.rng.uniform(0.2, 2.0))
        while self.round < self.rounds and not self.wl.stopping:
            resume, self.delayed = self.delayed, None
            gone, self.expect_gone = self.expect_gone, False
            p_delayed = self.wl.cfg.delayed_will_probability
            delayed = (resume is None and not gone and self.version == 5 and p_delayed > 0
                       and self.rng.random() < p_delayed)
            self.will_delay = WILL_DELAY_S if delayed else 0
            present = await self.connect(resume is None and not gone, WILL_SESSION_EXPIRY_S if delayed else 0)
            if gone and present:
                self.wl.state_findings.append(("session_resurrected", (
                    f"{self.client_id}: CONNECT with clean start 0 found a session (session present 1) at "
                    f"{self.now():.3f} s, right after the broker processed the DISCONNECT that ended it "
                    f"(session expiry 0, the broker closed the connection)")))
            inc = self._served_incarnation() if present is not None else None
            resumed = (resume is not None and bool(present)
                       and self.now() < resume[0] + WILL_DELAY_S - WILL_RESUME_MARGIN_S)
            if resumed and resume is not None and (inc is None or inc != resume[2]):
                # session present 1, but not the incarnation the delayed will belonged to: an
                # earlier CONNECT of this client with an unknown outcome (clean start) committed
                # in between, ended that session (its will due at once) and opened the one resumed
                # (seed 71703). The client cannot tell: it claims nothing about that will.
                resumed = False
                self.stat("wills_cancel_unknown")
            if resume is not None and resumed:
                old = resume[1]
                self.rec("fail", "publish", guid=old.guid, topic=old.topic, qos=1, reason=WILL_CANCELLED,
                         detail="will")
                self.stat("wills_cancelled")
            if present is None:
                await self.sleep(self.rng.uniform(0.5, 1.5))
                continue
            self.delayed_inc = inc
            stay = self.rng.uniform(0.5, 3.0)
            if resume is not None and resumed:
                # Outlive the cancelled will's delay, then end cleanly: a resume that failed to
                # cancel the pending will would publish it (this connection's own will, which
                # replaced it) while the connection lives, and the clean end records that will
                # as discarded (never to be published).
                stay = max(stay, resume[0] + WILL_DELAY_S + WILL_RESUME_MARGIN_S - self.now())
            await self.sleep(stay)
            if not self.connected:
                continue
            will = self.will
            assert will is not None
            if delayed:
                self.close(clean=False, reason=WILL_DELAYED)
                self.delayed = (self.now(), will, self.delayed_inc)
                self.stat("wills_delayed")
                await self.sleep(self.rng.uniform(0.2, 0.8))
                continue
            if not resumed and self.rng.random() < 0.5:
                self.close(clean=False, reason="ended without DISCONNECT: will due")
                self.stat("wills_due")
            else:
                discarded = await self._clean_end(will)
                if resumed and discarded:
                    # The resumed session had expiry 0: the processed DISCONNECT ended it, and a
                    # CONNECT with clean start 0 right away must find none (session_resurrected).
                    self.expect_gone = True
                    self.stat("ended_sessions_probed")
                    continue
            await self.sleep(self.rng.uniform(1.0, 2.0))
        self.done = True

    def _served_incarnation(self) -> int | None:
        """The incarnation of the session the node that answered this CONNECT serves (read from
        the node, as ``_clean_end`` reads its close reason), None when unknown."""
        sn = next(n for n in self.wl.world.nodes if n.name == self.node)
        theirs = sn.node.connections.get(self.client_id) if sn.node is not None else None
        live = getattr(theirs, "live", None)
        return getattr(live, "incarnation", None)

    async def _clean_end(self, will: Outgoing) -> bool:
        """DISCONNECT, then wait for the broker to end the connection. Only when the node that got
        it stayed up throughout (same boot, never crashed) and ended that connection for the
        DISCONNECT is the will known to be discarded."""
        conn = self.conn
        assert conn is not None
        sn = next(n for n in self.wl.world.nodes if n.name == self.node)
        boots = sn.boots
        # The node's side of this connection: a 3.1.1 client cannot tell the node's close for its
        # DISCONNECT from one the node made for its own reason, with the DISCONNECT unread (on
        # resuming from a pause, its session lease lapsed: seed 20048), and then the will is due.
        theirs = sn.node.connections.get(self.client_id) if sn.node is not None else None
        self.server_disconnected = False
        self.connected = False
        self.awaiting_end = conn
        self.send_raw(conn, Disconnect(0))
        self.rec("ok", "disconnect")
        deadline = self.now() + 2.0
        while self.ended is not conn and self.now() < deadline:
            await self.wait_changed(deadline - self.now())
        # Only an orderly close (EOF) is the broker's answer to the DISCONNECT: a connection the
        # network reset meanwhile may have ended before the session close committed (seed 72633:
        # a 3.1.1 client's node, cut from its followers, had not committed the close when a
        # reset ended the connection; the majority then published the will, as it must).
        ended_by_broker = self.ended is conn and self.end_reason == CLOSED_BY_BROKER
        self.awaiting_end = None
        conn.close()
        # A draining node (membership_faults.py) reads nothing more and closes each connection
        # once answered: a 3.1.1 client cannot tell whether its DISCONNECT was read (it was not).
        drained = sn.server is not None and sn.server.drain is not None and sn.server.drain.draining
        # ``ConnectionControl.on_disconnect`` names the close "client sent DISCONNECT (0x..)".
        for_disconnect = theirs is not None and theirs.close_reason.startswith("client sent DISCONNECT")
        if (ended_by_broker and not self.server_disconnected and not sn.crashed and sn.boots == boots
                and not drained and for_disconnect):
            self.rec("fail", "publish", guid=will.guid, topic=will.topic, qos=1, reason=WILL_DISCARDED,
                     detail="will")
            self.stat("wills_discarded")
            return True
        return False

    def on_server_disconnect(self, reason_code: int) -> None:
        self.server_disconnected = True


# ---------------------------------------------------------------------------------------------
class PinningReader:
    """A reader's retention pins (the Spark source's, ``POST /v1/pins``): over and over it pins one
    topic shard at about its newest offset (the shard of a topic a plain publisher writes), through
    the node API the HTTP route calls (admin/pins.py ``set_pin``) on a node drawn at random, renews
    it (same offset) every third of its TTL for a while, then either unpins it (``remove_pin``) or
    lets it run out by its TTL. Each pin has a reader name of its own. World.pins (world_checks.
    PinCheck) judges that retention never released a message at or above a live pin's offset."""

    OWNER = "sim-pinner"

    def __init__(self, wl: Workload, name: str, host: ClientHost, topics: list[str]) -> None:
        self.wl = wl
        self.name = name
        self.host = host
        self.topics = topics
        self.rng = random.Random(f"{wl.world.seed}/{name}")  # the workload's own draws stay as they were
        self.done = False

    def _node(self) -> SimNode | None:
        live = [sn for sn in self.wl.world.nodes if sn.node is not None and sn.ready and not sn.crashed]
        return self.rng.choice(live) if live else None

    async def _call(self, what: str, make: Callable[[Node], Any]) -> int | None:
        """``make(node)`` (a coroutine giving (status, body)) run on a live node's loop; its status,
        or None when the node died or gave no answer in time."""
        sn = self._node()
        if sn is None or sn.node is None or sn.loop is None:
            self.wl.stats["pin_no_node"] += 1
            return None
        node, loop = sn.node, sn.loop
        task = loop.create_task(make(node))
        deadline = self.wl.world.scheduler.now + node.cfg.mqtt.publish_timeout_s + 2.0
        while not task.done():
            if sn.node is not node or sn.crashed or self.wl.world.scheduler.now > deadline:
                break
            await asyncio.sleep(0.05)
        status: int | None = None
        if task.done() and not task.cancelled() and task.exception() is None:
            status = task.result()[0]
        elif task.done() and not task.cancelled():
            task.exception()
        self.wl.world.note(f"{self.name}: {what} via {sn.name}: {status if status is not None else 'no answer'}")
        self.wl.stats[f"pin_{what.split()[0]}_{status}"] += 1
        return status

    async def run(self) -> None:
        from moorline.node.admin.pins import remove_pin, set_pin

        wl, cfg, rng = self.wl, self.wl.cfg, self.rng
        cycle = 0
        try:
            while not wl.stopping:
                await asyncio.sleep(rng.uniform(*cfg.pin_gap_s))
                sn = self._node()
                if wl.stopping or sn is None or sn.node is None:
                    continue
                cycle += 1
                reader = f"{self.name}-{cycle}"
                topic = rng.choice(self.topics)
                shard = sn.node.topic_shard(topic)
                head = sn.node.hosts[shard].state.topics.next_offset
                offset = max(0, head - rng.randint(0, 3))
                ttl_s = rng.uniform(*cfg.pin_ttl_s)
                hold_s = rng.uniform(*cfg.pin_hold_s)
                lapse = rng.random() < cfg.pin_lapse_probability
                ttl_ms = round(ttl_s * 1000)

                def pin(node: Node, reader: str = reader, offsets: dict[int, int] = {shard: offset},  # noqa: B006
                        ttl_ms: int = ttl_ms) -> Any:
                    return set_pin(node, node.cfg, self.OWNER, reader, dict(offsets), ttl_ms)

                await self._call(f"pin {reader} shard {shard} offset {offset} ttl {ttl_ms} ms", pin)
                end = wl.world.scheduler.now + hold_s
                while not wl.stopping and wl.world.scheduler.now < end:
                    await asyncio.sleep(ttl_s / 3)
                    if not wl.stopping:
                        await self._call(f"renew {reader}", pin)
                if lapse and not wl.stopping:
                    wl.world.note(f"{self.name}: {reader} left to run out by its TTL")
                    continue
                wl.world.pins.unpinning(reader)

                def unpin(node: Node, reader: str = reader) -> Any:
                    return remove_pin(node, node.cfg, self.OWNER, reader)

                await self._call(f"unpin {reader}", unpin)
        finally:
            self.done = True


class Workload:
    """The model clients of one seed. ``start()`` spawns them; ``stop()`` ends production;
    ``drain(timeout_s)`` runs the world until subscribers have what they can get, closes every
    client and records the broker's counted drops."""

    def __init__(self, world: World, rng: random.Random, records: list[dict[str, Any]],
                 cfg: WorkloadConfig | None = None) -> None:
        self.world = world
        self.rng = rng
        self.cfg = cfg or WorkloadConfig()
        self.history = History(records, f"sim-{world.seed}")
        self.records = records
        self.stats: Counter[str] = Counter()
        self.stats_by_kind: dict[str, Counter[str]] = {}
        self.errors: list[str] = []
        self.acked_topics: dict[str, int] = {}
        self.stopping = False
        self.draining = False
        self.finishing = False
        self.abandon_publishes = False  # drain: publishers give up on what is still unacknowledged
        self.drain_complete = False  # every subscriber had what it could get before the drain's timeout
        self.last_delivery = 0.0
        self.share_leave_at = 0.0
        self.hosts: list[ClientHost] = []
        self.clients: list[ModelClient] = []
        self.pairs: list[TakeoverPair] = []
        self.race_publishers: list[RacePublisher] = []
        self.pinners: list[PinningReader] = []
        # What the world's own state shows wrong when a client observes something (the runner
        # reports each as a finding): (kind, detail).
        self.state_findings: list[tuple[str, str]] = []
        self._sa_flagged: set[tuple[str, int]] = set()  # (node, shard) already reported two holders
        self._tasks: list[asyncio.Task[None]] = []
        self._build()

    def _host(self, i: int) -> ClientHost:
        return self.hosts[i % len(self.hosts)]

    def _sub_qos(self, wanted: list[int]) -> list[int]:
        """``wanted`` within ``subscription_qos`` (its nearest allowed QoS where none is)."""
        allowed = self.cfg.subscription_qos
        out = [q for q in wanted if q in allowed]
        return out or [min(allowed, key=lambda a: abs(a - wanted[0]))]

    def _version(self) -> int:
        return 5 if self.rng.random() < 0.6 else 4

    def _build(self) -> None:
        cfg = self.cfg
        for h in range(max(1, cfg.client_hosts)):
            loop = self.world.scheduler.new_loop(f"clients{h + 1}")
            self.hosts.append(ClientHost(loop, self.world.net.for_host(f"10.1.0.{h + 1}", loop)))
        n = 0

        def host() -> ClientHost:
            nonlocal n
            n += 1
            return self._host(n)

        plain_topics = [f"t/{a}/{b}" for a in range(4) for b in range(3)]
        for i in range(cfg.publishers):
            qos = cfg.publisher_qos[i % len(cfg.publisher_qos)]
            with_guid = (i // 3) % 2 == 0 or not cfg.guidless_publishers
            persistent = (i // 2) % 2 == 0
            version = 5 if with_guid else self._version()
            topics = self.rng.sample(plain_topics, 4)
            self.clients.append(Publisher(self, f"pub{i + 1}", version, host(), qos=qos, with_guid=with_guid,
                                          persistent=persistent, topics=topics,
                                          messages=cfg.messages_per_publisher))
        sub_filters = ["t/#", "t/+/1", "t/2/#", "t/0/0", "t/+/+", "r/#", "w/#"]
        for i in range(cfg.persistent_subscribers):
            picks = self.rng.sample(sub_filters, self.rng.randint(1, 3))
            if i == 0:
                picks = sorted(set(picks) | {"t/#", "r/#", "w/#"})
            qos = self.rng.choice(self._sub_qos([1, 1, 2, 0])) if i else self._sub_qos([1])[0]
            subs = [Sub(f, qos) for f in picks]
            self.clients.append(Subscriber(self, f"psub{i + 1}", f"psub{i + 1}", self._version(), host(),
                                           subs=subs, persistent=True, method="B"))
        for i in range(cfg.clean_subscribers):
            subs = [Sub(f, self.rng.choice(self._sub_qos([0, 1, 2]))) for f in self.rng.sample(sub_filters, 2)]
            subs.append(Sub("r/+", self._sub_qos([1])[0]))
            self.clients.append(Subscriber(self, f"csub{i + 1}", f"csub{i + 1}", self._version(), host(),
                                           subs=subs, persistent=False))
        top = max(cfg.subscription_qos)
        for i in range(cfg.qos2_receivers):
            method = "B" if i % 2 == 0 else "A"
            s = Subscriber(self, f"q2{method.lower()}{i + 1}", f"q2{method.lower()}{i + 1}", self._version(), host(),
                           subs=[Sub("t/#", top), Sub("race/#", top)], persistent=True, method=method)
            s.kind = f"qos2_method_{method}"
            self.clients.append(s)
        for i in range(cfg.takeover_pairs):
            pair = TakeoverPair(self, i + 1, [host(), host()])
            self.pairs.append(pair)
            self.clients.extend(pair.procs)
        for i in range(cfg.racers):
            self.clients.append(RacerSubscriber(self, f"racer{i + 1}", f"racer{i + 1}", self._version(), host(),
                                                subs=[Sub("race/+/0", 1)], persistent=True))
            topics = [f"race/{k}/{j}" for k in range(6) for j in range(4)]
            racepub = RacePublisher(self, f"racepub{i + 1}", 5, host(), qos=1, with_guid=True,
                                    persistent=True, topics=topics, messages=cfg.race_messages)
            self.race_publishers.append(racepub)
            self.clients.append(racepub)
        if cfg.share_members:
            for i in range(cfg.share_members):
                leaver = i == cfg.share_members - 1 and cfg.share_members > 1
                m = ShareMember(self, f"sh{i + 1}", f"sh{i + 1}", 5, host(),
                                subs=[Sub("s/#", self.rng.choice(self._sub_qos([1, 2])), "g1")], persistent=True,
                                method=self.rng.choice(["A", "B"]), leaver=leaver)
                self.clients.append(m)
            # Drops name the broker's guid: share topics carry the history's own, so a drop excuses it.
            self.clients.append(Publisher(self, "sharepub", 5, host(), qos=self.rng.choice([1, 2]), with_guid=True,
                                          persistent=True, topics=[f"s/{k}" for k in range(4)],
                                          messages=cfg.share_messages))
        self._build_queues(host)
        if cfg.retained_messages:
            self.clients.append(Publisher(self, "retpub", self._version(), host(), qos=1, with_guid=True,
                                          persistent=True, topics=["r/0", "r/1"],
                                          messages=cfg.retained_messages, retain=True))
        for i in range(cfg.will_clients):
            self.clients.append(WillClient(self, f"will{i + 1}", self._version(), host(), cfg.will_rounds))
        if cfg.retained_messages:
            # Retained messages at QoS 0 too: a restore that kept only QoS 1/2 ones (a mutant,
            # tests/sim_cluster/mutants.py) passed every seed while all retained ones were QoS 1.
            self.clients.append(Publisher(self, "retpub0", self._version(), host(), qos=0, with_guid=True,
                                          persistent=False, topics=["r/2"],
                                          messages=max(1, cfg.retained_messages // 2), retain=True))
        publishers = [c for c in self.clients if type(c) is Publisher and c.name.startswith("pub")]
        for i in range(cfg.pinning_readers if publishers else 0):
            topics = sorted({t for p in publishers for t in p.topics})
            self.pinners.append(PinningReader(self, f"pinner{i + 1}", self._host(i), topics))
        for c in self.clients:
            self.stats_by_kind.setdefault(c.kind, Counter())

    def _build_queues(self, host: Callable[[], ClientHost]) -> None:
        """The work-queue clients (docs/queues.md): the single-active group, the delivery-limited
        group with its poison publisher and stalling consumer, and the dead-letter observer."""
        cfg, wcfg = self.cfg, self.world.cfg
        if cfg.queue_members:
            for i in range(cfg.queue_members):
                self.clients.append(QueueMember(self, f"sa{i + 1}", f"sa{i + 1}", 5, host(),
                                                subs=[Sub(SA_FILTER, 1, SA_GROUP)], persistent=True,
                                                method="B"))
            self.clients.append(Publisher(self, "sapub", 5, host(), qos=1, with_guid=True, persistent=True,
                                          topics=[SA_TOPIC], messages=cfg.queue_messages))
        if cfg.dl_consumers:
            limit = wcfg.queue_max_deliveries if DL_GROUP in wcfg.queue_limited_groups else 0
            detail = f"{MAX_DELIVERIES_DETAIL}{limit}" if limit else None
            for i in range(cfg.dl_consumers):
                self.clients.append(DeadLetterConsumer(
                    self, f"dl{i + 1}", f"dl{i + 1}", 5 if i % 2 == 0 else self._version(), host(),
                    subs=[Sub(DL_FILTER, 1, DL_GROUP, detail)], persistent=False, withhold=False, staller=i > 0))
            self.clients.append(PoisonPublisher(self, "dlpub", 5, host(), qos=1, with_guid=True, persistent=True,
                                                topics=["q/dl/0", "q/dl/1"], messages=cfg.dl_messages))
            self.clients.append(Subscriber(self, "dlq", "dlq", 5, host(), subs=[Sub("$dlq/#", 1)],
                                           persistent=True, withhold=False))

    def check_single_active(self) -> None:
        """Single-active (docs/queues.md): in no node's replica of any shard do two members of the
        single-active group hold messages (claims) at once. Looked at on every delivery to a member."""
        key = f"{SHARE_PREFIX}{SA_GROUP}\x00{SA_FILTER}"
        for sn in self.world.nodes:
            node = sn.node if not sn.crashed else None
            if node is None or not sn.ready:
                continue
            for host in node.hosts:
                reg = host.state.topics.regs.get(key)
                if reg is None or not reg.claims:
                    continue
                holders = sorted({m for m, _ in reg.claims.values()})
                if len(holders) > 1 and (sn.name, host.shard) not in self._sa_flagged:
                    self._sa_flagged.add((sn.name, host.shard))
                    self.state_findings.append(("single_active_two_holders", (
                        f"{sn.name} shard {host.shard} at {self.world.scheduler.now:.3f}: {holders} hold "
                        f"messages of the single-active group {SA_GROUP} at once")))
        self.stats["single_active_checks"] += 1

    def check_registered(self, client: ModelClient, topic_filter: str) -> None:
        """On the racer's SUBACK: the node that sent it must already hold the subscription's
        registration in every shard the filter can match (it answers SUBACK only once each of
        them applied there). A node that crashed since has no state to look at."""
        from moorline.node.node import reg_key_for

        sn = next((n for n in self.world.nodes if n.name == client.node), None)
        node = sn.node if sn is not None and not sn.crashed else None
        if node is None or not client.connected:
            return
        reg_key, inner, _ = reg_key_for(client.client_id, topic_filter)
        missing = [s for s in node.shards_for_filter(inner) if reg_key not in node.hosts[s].state.topics.regs]
        if missing:
            self.state_findings.append(("suback_unregistered", f"{client.name} got SUBACK for {topic_filter} from "
                                        f"{sn.name if sn else '?'} at {self.world.scheduler.now:.3f}, whose "
                                        f"shards {missing} had not registered it"))

    def race_probe(self, topic_filter: str) -> None:
        """After a racer's SUBACK for ``topic_filter``: one matching topic per shard, published at once."""
        if not self.race_publishers:
            return
        pub = self.rng.choice(self.race_publishers)
        per_shard: dict[int, list[str]] = {}
        for t in pub.topics:
            if matches(topic_filter, t):
                per_shard.setdefault(shard_of(t, self.world.cfg.shards), []).append(t)
        pub.probe([self.rng.choice(ts) for _, ts in sorted(per_shard.items())])

    # --- driving ------------------------------------------------------------------------------
    def start(self) -> None:
        self.share_leave_at = self.world.scheduler.now + 6.0
        for c in self.clients:
            self._tasks.append(c.host.loop.create_task(c.main(), name=f"client-{c.name}"))
        for p in self.pairs:
            self._tasks.append(p.procs[0].host.loop.create_task(p.run(), name="takeover-pair"))
        for r in self.pinners:
            self._tasks.append(r.host.loop.create_task(r.run(), name=f"pins-{r.name}"))

    def stop(self) -> None:
        """Publishers stop taking new messages (they still finish those in flight)."""
        self.stopping = True
        for p in self.race_publishers:
            p.changed.set()  # it may be waiting for a probe that will not come now

    def publishers_done(self) -> bool:
        return all(c.done for c in self.clients if isinstance(c, (Publisher, WillClient)))

    def drain(self, timeout_s: float = 120.0) -> bool:
        """Run the world until every subscriber has received what it can (publishers finished, then
        ``quiet_s`` without a delivery), close every client and record the drops. False if that
        took longer than ``timeout_s`` (clients are closed anyway)."""
        self.stop()
        sched = self.world.scheduler
        deadline = sched.now + timeout_s
        publish_deadline = sched.now + timeout_s / 2
        while not self.publishers_done() and sched.now < publish_deadline:
            self.world.run_for(0.25)
        self.abandon_publishes = True
        self.draining = True
        for c in self.clients:
            if isinstance(c, Subscriber):
                c.changed.set()
        for p in self.pairs:  # one process of each pair stays: the current owner
            p.current.want_online = True
        self.last_delivery = sched.now
        settled_since: float | None = None
        while sched.now < deadline:
            self.world.run_for(0.25)
            subs = [c for c in self.clients if isinstance(c, Subscriber) and c.want_online and not c.gone]
            settled = all(c.connected and c.subscribed and not c.withheld for c in subs)
            if not settled:
                settled_since = None
                continue
            if settled_since is None:
                settled_since = sched.now  # quiet counts from when the last of them (re)connected too
            if sched.now - max(self.last_delivery, settled_since) >= self.cfg.quiet_s:
                break
        ok = sched.now < deadline
        self.drain_complete = ok
        self.finishing = True
        for c in self.clients:
            c.changed.set()
        end = sched.now + 5.0
        while not all(c.done for c in self.clients) and sched.now < end:
            self.world.run_for(0.1)
        for c in self.clients:
            if isinstance(c, Subscriber):
                c.finish()
            elif c.connected:
                c.close(clean=True)
        self.record_drops()
        return ok and not self.errors

    def record_drops(self) -> int:
        """The broker's counted drops (what ``GET /v1/drops`` lists), from every live node, once each."""
        seen: set[tuple[Any, ...]] = set()
        t = self.world.scheduler.now
        for sn in self.world.nodes:
            if sn.node is None or sn.crashed or not sn.ready:
                continue
            for d in sn.node.iter_drops():
                key = tuple(d.get(k) for k in ("guid", "reason", "session", "shard", "offset"))
                if key in seen:
                    continue
                seen.add(key)
                self.history.record(t, "drop", "drop", process="broker", guid=d.get("guid"),
                                    reason=d.get("reason"), session=d.get("session"), shard=d.get("shard"),
                                    offset=d.get("offset"))
        self.stats["drops"] += len(seen)
        return len(seen)

    def summary(self) -> dict[str, Any]:
        return {"stats": dict(self.stats), "by_kind": {k: dict(v) for k, v in self.stats_by_kind.items()},
                "errors": list(self.errors), "records": len(self.records)}



@dataclass
class WorkloadRun:
    records: list[dict[str, Any]]
    workload: Workload
    world: World
    drained: bool  # drain finished before its timeout


def run_workload(seed: int, base: Path | None = None, nodes: int = 3, cfg: WorkloadConfig | None = None,
                 production_s: float = 60.0, drain_s: float = 120.0,
                 during: Callable[[World, Workload], None] | None = None) -> WorkloadRun:
    """One seed of the workload on a fresh world and no faults of its own (the runner,
    ``runner.py``, adds the fault schedule): boot, produce until every publisher is done (at most
    ``production_s``), drain, close. ``during(world, workload)`` is called every half second of
    production, for a caller's own faults. ``base``: the nodes' directories (a temporary one,
    on tmpfs when there is one, by default)."""
    own = base is None
    if base is None:
        shm = Path("/dev/shm")
        fast = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        base = Path(tempfile.mkdtemp(prefix=f"moorline-workload-{seed}-", dir=fast))
    world = World(seed, base, WorldConfig(nodes=nodes))
    try:
        world.start_all()
        if not world.wait_ready(60.0):
            raise RuntimeError(f"seed {seed}: the cluster did not form: {world.events[-5:]}")
        records: list[dict[str, Any]] = []
        wl = Workload(world, random.Random(f"{seed}/workload"), records, cfg)
        wl.start()
        end = world.scheduler.now + production_s
        while not wl.publishers_done() and world.scheduler.now < end:
            world.run_for(0.5)
            if during is not None:
                during(world, wl)
        drained = wl.drain(drain_s)
        return WorkloadRun(records, wl, world, drained)
    finally:
        world.close()
        if own:
            shutil.rmtree(base, ignore_errors=True)
