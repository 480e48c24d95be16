"""One moorline node: it builds the node's parts from its config and Seams, starts and stops them
(every long-lived loop under the Supervisor), and is the one object the edge (connections), the
admin API and the simulator hold: the methods after ``stop`` are thin delegates to the part that
owns the concern. The node and its edge (MQTT server, $SYS, drain, HTTP app) are composed, for
``moorline run`` and the simulator alike, by ``assembly.py`` (NodeAssembly).

    boot.py                     Startup: prepare, open groups, recover, cluster.json
    replication/router.py       GroupRouter: the propose API, Raft messages in and out
    replication/leadership.py   Leadership: ticks, leader rebalancing, hand-over at shutdown
    replication/metadata.py     MetadataGroup: the cluster record, sink markers
    sessions/registry.py        SessionRegistry: client id -> connection, live session, lease; views
    sessions/lifecycle.py       SessionLifecycle: open / close / end, leases, reconcile, wills
    sessions/subscriptions.py   Subscriptions: SUBSCRIBE / UNSUBSCRIBE across shards
    sessions/share.py           ShareDispatch: $share dispatch, ack timeouts, dead letters
    sessions/fanout.py          Fanout: apply effects to live sessions, queue caps
    housekeeping.py             Housekeeping: retention rounds, snapshots when due, reclaim
    admin/status.py             NodeStatus: status JSON

Everything here is IO and orchestration; the rules live in ``moorline.broker`` (pure). Every
cross-shard effect is an explicit command proposed to the other shard (shard isolation), also on
a single node, so one-node tests exercise the same races a cluster has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moorline.broker import commands as c
from moorline.broker.messages import StoredMessage
from moorline.broker.queries import registrations
from moorline.broker.session_state import Session, SubscriptionState
from moorline.broker.share_policy import GroupPolicy
from moorline.broker.topic_state import PublishResult
from moorline.config import NodeConfig
from moorline.hashing import shard_of
from moorline.mqtt.topics import is_wildcard
from moorline.node.ack_latency import AckLatency
from moorline.node.admin.status import NodeStatus
from moorline.node.aio import cancel_all
from moorline.node.boot import SINGLE_NODE_ID, Startup
from moorline.node.errors import NodeFailure as NodeFailure
from moorline.node.errors import SessionOwnedByOther as SessionOwnedByOther
from moorline.node.errors import SessionQuotaExceeded as SessionQuotaExceeded
from moorline.node.errors import ShardUnavailable
from moorline.node.housekeeping import Housekeeping
from moorline.node.replication.cluster_link import ClusterLink
from moorline.node.replication.group_commit import GroupCommit
from moorline.node.replication.leadership import Leadership
from moorline.node.replication.membership import MembershipDriver
from moorline.node.replication.metadata import MetadataGroup
from moorline.node.replication.placement import ShardPlacement
from moorline.node.replication.router import GroupRouter
from moorline.node.replication.shard_host import ShardHost
from moorline.node.replication.snapshots import SnapshotSettings
from moorline.node.seams import PRODUCTION, Seams
from moorline.node.sessions.ack_timeout import AckTimeouts
from moorline.node.sessions.delivery import LiveSession
from moorline.node.sessions.fanout import Fanout
from moorline.node.sessions.lifecycle import SessionLifecycle
from moorline.node.sessions.recent import RecentMessages
from moorline.node.sessions.registry import SessionRegistry
from moorline.node.sessions.share import ShareDispatch
from moorline.node.sessions.subscriptions import SHARE_PREFIX, Subscriptions
from moorline.node.sessions.subscriptions import reg_key_for as reg_key_for
from moorline.node.supervisor import Supervisor
from moorline.raft import MemberId
from moorline.storage.dirlock import DataDirLock
from moorline.storage.ledger import SyncLedger
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog
from moorline.testing.faults import NO_FAULTS, Faults

log = logging.getLogger("moorline.node")


class Node:
    def __init__(self, cfg: NodeConfig, faults: Faults = NO_FAULTS, seams: Seams = PRODUCTION) -> None:
        self.cfg = cfg
        self.seams = seams
        self.clock = seams.clock  # every time this node reads: a simulator passes virtual time
        self.faults = faults
        self.data_dir = Path(cfg.data_dir)
        self.shard_count = cfg.shard.count
        self.hosts: list[ShardHost] = []  # the topic/session shards, by shard number
        self.groups: list[ShardHost] = []  # every Raft group by group id: the shards, then the metadata group
        self.meta_host: ShardHost | None = None
        self.member_ids: dict[str, MemberId] = {}  # initial member name -> Raft id
        self.recent = RecentMessages(cfg.storage.store_cache_bytes)
        # The parts (one owner per concern); each holds this node for what it shares.
        self.startup = Startup(self)
        self.metadata = MetadataGroup(self)
        self.router = GroupRouter(self)
        self.leadership = Leadership(self)
        self.status = NodeStatus(self)
        self.registry = SessionRegistry(self)
        self.lifecycle = SessionLifecycle(self)
        self.subscriptions = Subscriptions(self)
        self.share = ShareDispatch(self)
        self.ack_timeouts = AckTimeouts(self)  # closes members' connections past queue.ack_timeout_s
        self.fanout = Fanout(self)
        self.housekeeping = Housekeeping(self)
        self.membership = MembershipDriver(self)  # member table: announce, reconcile, drive moves
        self.live = self.registry.live  # client id -> LiveSession (the registry's)
        self.connections = self.registry.connections  # client id -> Connection, for takeover (the registry's)
        self._topic_shards: dict[str, int] = {}
        self._guid_prefix = seams.random_bytes(8)
        self._guid_counter = 0
        self._feed_counter = 0
        self.ack_latency = AckLatency(seams.clock.monotonic)  # PUBLISH read -> PUBACK/PUBREC written
        self.supervisor = Supervisor(self._on_fatal, cfg.supervisor.backoff_initial_s, cfg.supervisor.backoff_max_s)
        # One-off cleanups nobody awaits; insertion-ordered so that stop cancels them in the order they
        # began, not by object address (the simulator replays a seed exactly).
        self.background: dict[asyncio.Task[Any], None] = {}
        self.fatal: BaseException | None = None
        self.stopping = asyncio.Event()
        self.ledger = seams.sync_ledger or (SyncLedger(Path(faults.sync_ledger)) if faults.sync_ledger else None)
        self.stats = {"delivered": 0, "refused": 0, "delivery_batches_committed": 0}
        # Publishes proposed, and publishes the ACL refused, by where they entered: "mqtt" (PUBLISH
        # packets, wills), "http" (POST /v1/publish), "spark" (the Spark sink's POST /v1/publish).
        # /metrics: moorline_published_total{source}, moorline_publish_denied_total{source}.
        self.published = {"mqtt": 0, "http": 0, "spark": 0}
        self.publish_denied = {"mqtt": 0, "http": 0, "spark": 0}
        self.link: ClusterLink | None = None  # cluster mode: peers, forwarding
        # HOST:PORT clients reach this node's MQTT listener at (listeners.advertise, else the bound
        # address): set by the assembly's start (assembly.py; edge/drain.py advertised_address).
        self.client_address: str | None = None
        self.placement: list[ShardPlacement] = []  # per shard: voters (preferred leader first), learners
        self.preferred_leader: list[MemberId] = []
        self.snapshot_settings = SnapshotSettings.for_node(cfg, self.data_dir, self.housekeeping.snapshot_saved,
                                                           self.housekeeping.snapshot_installed, inline=seams.inline_io)
        # The data directory's lock (acquired by ``prepare``) and the WAL (opened by ``prepare``): whole
        # from here, so a start-up that fails before them releases and closes them as no-ops. (Today
        # boot.py's ``prepare`` still builds its own of each, the same way, replacing these.)
        self.dir_lock = DataDirLock(self.data_dir)
        self.wal = WriteAheadLog(
            self.data_dir / "wal", segment_bytes=cfg.storage.wal_segment_bytes,
            max_pending_bytes=cfg.storage.max_pending_bytes, ledger=self.ledger,
            preallocate=cfg.storage.wal_preallocate,
        )
        # Set by ``prepare`` (Startup): identity and snapshots; ``commit`` by ``start``, which sets
        # ``serving`` then (before it, Raft messages and forwarded proposals are not taken: the
        # senders retransmit).
        self.storage_id: str
        self.cluster_meta: dict[str, Any]  # cluster.json
        self.member: MemberId
        self.boot: int
        self.snapshots: SnapshotStore
        self.commit: GroupCommit
        self.serving = False

    @property
    def share_ack_timeouts(self) -> int:
        """Connections of $share members this node closed for their ack timeout (docs/queues.md)."""
        return self.ack_timeouts.closed

    def run_in_background(self, task: asyncio.Task[Any]) -> None:
        """A one-off cleanup nobody awaits: kept until done, cancelled at stop, its failure logged."""
        self.background[task] = None
        task.add_done_callback(self.background_done)

    @property
    def meta_group(self) -> int:
        """The metadata group's Raft group id: the one after the last shard."""
        return self.shard_count

    def node_name(self, node_id: int) -> str:
        """A Raft node id as operators know it: its --initial-cluster name ("n1" on a single node)."""
        if self.link is not None and self.link.spec.has_id(node_id):
            return self.link.spec.name_of(node_id)
        return f"n{node_id}"

    def leads(self, shard: int) -> bool:
        """Whether this node proposes the shard's leader-only commands (housekeeping, wills,
        $share dispatch, queue-cap drops). A single node leads every shard."""
        return self.hosts[shard].raft.is_leader

    def now_ms(self) -> int:
        return self.clock.wall_ms()

    def session_shard(self, client_id: str) -> int:
        return shard_of(client_id, self.shard_count)

    def topic_shard(self, topic: str) -> int:
        shard = self._topic_shards.get(topic)
        if shard is None:
            if len(self._topic_shards) >= 100_000:
                self._topic_shards.clear()
            shard = self._topic_shards[topic] = shard_of(topic, self.shard_count)
        return shard

    def next_feed_id(self) -> int:
        """A reader feed's id (reader_feed.py): this boot's, increasing, above every earlier boot's."""
        self._feed_counter += 1
        return (self.boot << 24) + self._feed_counter

    async def follow_client(self, client_id: str) -> None:
        """Before a session of ``client_id`` is served here: every shard this node reads from
        another node's replica (reader.py) serves it too, with its part applied here (read after a
        read barrier on that shard's leader). ShardUnavailable past mqtt.control_timeout_s."""
        futs = [h.reader.add([client_id]) for h in self.hosts if h.reader is not None and h.reader.active]
        if not futs:
            return
        for h in self.hosts:
            self.commit.kick(h.shard)
        limit = self.cfg.mqtt.control_timeout_s
        try:
            await asyncio.wait_for(asyncio.gather(*futs), limit)
        except TimeoutError:
            raise ShardUnavailable(f"the shards this node reads remotely did not serve {client_id!r} within "
                                   f"{limit:g} s (their leaders unreachable?)") from None

    def follow_leader_interest(self) -> None:
        """What a shard's leader derives from other shards' sessions ($share dispatch to members
        connected anywhere, ended members' claims returned, follow-ups) needs their session records:
        for the session shards this node reads remotely (reader.py), every client registered in a
        shard it leads is followed (and no longer, once it is not; an unknown one is never judged)."""
        readers = {h.shard: h for h in self.hosts if h.reader is not None and h.reader.active}
        if not readers:
            return
        want: dict[int, set[str]] = {shard: set() for shard in readers}
        for host in self.hosts:
            if host.failed is not None or not host.raft.is_leader:
                continue
            for _, reg in registrations(host.state.topics):
                for cid in (reg.members if reg.share_group is not None else (reg.client_id,)):
                    ss = self.session_shard(cid)
                    if ss in want:
                        want[ss].add(cid)
        for shard, h in readers.items():
            assert h.reader is not None
            h.reader.want(want[shard])

    def unfollow_client(self, client_id: str) -> None:
        """This node serves ``client_id`` no more: the shards it reads remotely stop feeding it
        (what each feed holds is bounded by the clients this node serves)."""
        for h in self.hosts:
            if h.reader is not None and h.reader.active:
                h.reader.remove([client_id])

    def new_guid(self) -> bytes:
        """A GUID for a message that came without one: this process's random prefix ‖ a counter."""
        self._guid_counter += 1
        return self._guid_prefix + self._guid_counter.to_bytes(8, "big")

    def shards_for_filter(self, topic_filter: str) -> list[int]:
        if is_wildcard(topic_filter):
            return list(range(self.shard_count))
        return [self.topic_shard(topic_filter)]

    @staticmethod
    def is_share_key(reg_key: str) -> bool:
        return reg_key.startswith(SHARE_PREFIX)

    async def publish(
        self, msg: StoredMessage, principal: str = "", producer: bytes | None = None, seq: int | None = None,
        wait: bool = True,
    ) -> PublishResult | None:
        shard = self.topic_shard(msg.topic)
        fut = self.propose(shard, c.Publish(msg, principal, producer, seq), want=wait)
        self.published["mqtt"] += 1  # a will: an MQTT client's message
        if fut is None:
            return None
        return await fut  # type: ignore[no-any-return]

    async def start(self) -> None:
        # In a cluster no fdatasync runs on the event loop: heartbeats of every group would wait behind it.
        inline_sync_max_us = self.cfg.storage.inline_sync_max_us if self.link is None else 0
        self.commit = GroupCommit(self.wal, self.groups, self._on_fatal, self.housekeeping.after_commit,
                                  inline_sync_max_us, self.cfg.storage.lazy_sync_delay_ms,
                                  unsafe_ack_before_sync=self.faults.unsafe_ack_before_sync,
                                  slow_sync_s=self.faults.slow_sync_s, inline_only=self.seams.inline_io,
                                  sync_runner=self.seams.sync_runner)
        self.serving = True
        # Critical: without group commit, ticks or lease renewals the node would serve unsafely
        # (nothing durable, no elections, two owners of a session): it stops instead.
        self.supervisor.spawn("group-commit", self.commit.run, critical=True)
        if self.link is not None:
            self.supervisor.spawn("raft-ticks", self.leadership.tick_loop, critical=True)
        await self.lifecycle.reconcile_after_restart()
        self.supervisor.spawn("housekeeping", self.housekeeping.run, critical=False)
        self.supervisor.spawn("session-leases", self.lifecycle.lease_loop, critical=True)
        self.supervisor.spawn("metadata-bootstrap", self.metadata.bootstrap_loop, critical=False)
        if self.link is not None:
            self.supervisor.spawn("membership", self.membership.run, critical=False)

    def background_done(self, task: asyncio.Task[Any]) -> None:
        self.background.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.info("a background cleanup did not finish: %s", task.exception())

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        self.stopping.set()

    async def stop(self) -> None:
        for live in list(self.live.values()):
            await live.close()
        await self.hand_over_leadership(timeout_s=min(self.cfg.shutdown_drain_s, 3.0))
        if not await self.commit.flush(timeout_s=1.0):  # acks and reports proposed lazily, too
            log.warning("stopping: the last proposals were not synced within 1 s")
        await self.supervisor.stop()
        await cancel_all(list(self.background))
        if self.link is not None:
            await self.link.close()
        self.commit.stop()
        for host in self.groups:
            try:
                if host.failed is None and not host.reads_remotely:  # a partial state is never kept
                    index, term = host.take_snapshot()
                    self.wal.mark_snapshot(host.shard, index, term)
                host.store.close()
            except OSError as exc:
                log.error("shard %d: final snapshot failed: %s", host.shard, exc)
        if self.snapshot_settings.executor is not None:  # its file work ends before the lock is released
            self.snapshot_settings.executor.shutdown(wait=True)
        try:
            self.wal.sync()
        finally:
            self.wal.close()
            self.dir_lock.release()

    # --- delegates: the parts' API as the edge, the admin API and the simulator call it ----------
    def open(self) -> None:
        self.startup.open()

    def prepare(self, node_id: int = SINGLE_NODE_ID, cluster_key: str | None = None) -> None:
        self.startup.prepare(node_id, cluster_key)

    def open_groups(self, members: dict[str, MemberId], placement: list[ShardPlacement]) -> None:
        self.startup.open_groups(members, placement)

    async def open_async(self) -> None:
        await self.startup.open_async()

    def sink_marker(self, query_id: str) -> int | None:
        return self.metadata.sink_marker(query_id)

    async def hand_over_leadership(self, timeout_s: float) -> None:
        await self.leadership.hand_over_leadership(timeout_s)

    def raft_status(self, shard: int) -> dict[str, Any]:
        return self.status.raft_status(shard)

    def cluster_status(self) -> dict[str, Any]:
        return self.status.cluster_status()

    def propose(self, shard: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any] | None:
        return self.router.propose(shard, cmd, want)

    def read_barrier(self, shard: int) -> asyncio.Future[None]:
        return self.router.read_barrier(shard)

    def propose_lazy(self, shard: int, cmd: c.Command, want: bool = False) -> asyncio.Future[Any] | None:
        return self.router.propose_lazy(shard, cmd, want)

    def propose_cb(self, shard: int, cmd: c.Command, callback: Any) -> None:
        self.router.propose_cb(shard, cmd, callback)

    def propose_group(self, shard: int, cmds: list[c.Command], callback: Any) -> None:
        self.router.propose_group(shard, cmds, callback)

    def propose_cross(self, shard: int, cmd: c.Command) -> asyncio.Future[Any]:
        return self.router.propose_cross(shard, cmd)

    def session_regs(self, client_id: str, sess: Session) -> list[tuple[int, list[tuple[str, SubscriptionState]]]]:
        return self.registry.session_regs(client_id, sess)

    def reg_subs(self, client_id: str, sess: Session) -> dict[str, SubscriptionState]:
        return self.registry.reg_subs(client_id, sess)

    def share_policy(self, group: str, asked_single_active: bool = False) -> GroupPolicy:
        return self.subscriptions.share_policy(group, asked_single_active)

    async def subscribe(
        self, live: LiveSession, flt: str, qos: int, no_local: bool, rap: bool, rh: int, sub_id: int | None,
        single_active: bool = False,
    ) -> None:
        await self.subscriptions.subscribe(live, flt, qos, no_local, rap, rh, sub_id, single_active)

    async def bounded(self, fut: asyncio.Future[Any], shard: int) -> Any:
        return await self.router.bounded(fut, shard)

    async def unsubscribe(self, live: LiveSession, flt: str) -> bool:
        return await self.subscriptions.unsubscribe(live, flt)

    def session_owned_by_other(self, client_id: str, principal: str) -> bool:
        return self.lifecycle.session_owned_by_other(client_id, principal)

    def persistent_quota_exceeded(self, client_id: str, principal: str, expiry_s: int) -> bool:
        return self.lifecycle.persistent_quota_exceeded(client_id, principal, expiry_s)

    async def open_session(
        self, client_id: str, clean_start: bool, expiry_s: int, will: c.WillSpec | None, principal: str
    ) -> tuple[bool, int, int]:
        return await self.lifecycle.open_session(client_id, clean_start, expiry_s, will, principal)

    def epoch_is_current(self, client_id: str, epoch: int) -> bool:
        return self.registry.epoch_is_current(client_id, epoch)

    def abandon_session(self, client_id: str, epoch: int) -> None:
        self.lifecycle.abandon_session(client_id, epoch)

    def close_session(self, live: LiveSession, send_will: bool, expiry_s: int | None,
                      on_outcome: Callable[[asyncio.Future[Any]], None] | None = None) -> asyncio.Task[None]:
        return self.lifecycle.close_session(live, send_will, expiry_s, on_outcome)

    def on_ack_room(self, client_id: str) -> None:
        self.share.on_ack_room(client_id)

    def iter_drops(self) -> Iterable[dict[str, Any]]:
        return self.status.iter_drops()
