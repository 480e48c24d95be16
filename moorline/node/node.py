"""One moorline node: recovery, shards, group commit, sessions, cross-shard commands, housekeeping.

Everything here is IO and orchestration; the rules live in ``moorline.broker`` (pure). Every
cross-shard effect is an explicit command proposed to the other shard (shard isolation), also on
a single node, so one-node tests exercise the same races a cluster has.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any

import msgspec

from moorline import coverage
from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import MessageProps, StoredMessage
from moorline.broker.session_state import SENT, Session, SubscriptionState, lease_lapsed
from moorline.broker.shard import ShardState
from moorline.broker.share_policy import GroupPolicy, dead_letter_message, group_policy
from moorline.broker.topic_state import PublishResult, same_incarnation
from moorline.config import NodeConfig
from moorline.hashing import guid128, shard_of
from moorline.invariant import InvariantViolation, invariant
from moorline.mqtt.topics import is_wildcard, parse_shared
from moorline.node.ack_latency import AckLatency
from moorline.node.aio import cancel_all
from moorline.node.replication.cluster_link import ClusterLink, parse_cluster
from moorline.node.replication.group_commit import GroupCommit, stage_hard_state, stage_ready
from moorline.node.replication.placement import ShardPlacement, layout_fingerprint, place_shards
from moorline.node.replication.raft_group import build_replica
from moorline.node.replication.shard_host import (
    ApplyHooks,
    ShardHost,
    ShardUnavailable,
    SnapshotSettings,
    consume_outcome,
    default_limits,
    outcome_within,
    recorded_members,
)
from moorline.node.replication.snapshot_install import recover_install
from moorline.node.seams import PRODUCTION, Seams
from moorline.node.sessions.delivery import LiveSession
from moorline.node.sessions.recent import RecentMessages
from moorline.node.supervisor import Supervisor
from moorline.raft import MemberId, Message, ProposalDropped
from moorline.storage.dirlock import DataDirLock
from moorline.storage.fsutil import write_file_atomically
from moorline.storage.identity import load_or_create_storage_id, next_boot_number
from moorline.storage.ledger import SyncLedger
from moorline.storage.msgstore import MessageStore, StoreCorruption
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog
from moorline.testing.faults import NO_FAULTS, Faults

log = logging.getLogger("moorline.node")
OFFLINE_EPOCH = -2  # the ack-timeout scan's mark of a claim holder it saw disconnected

SHARE_PREFIX = c.SHARE_PREFIX
SINGLE_NODE_ID = 1  # a node started without cluster flags is member 1 of every group
REBALANCE_EVERY_TICKS = 50  # cluster: leaders move back to their preferred nodes this often (5 s)
REBALANCE_MAX_TRANSFERS = 2  # per round
LEASE_POLL_S = 0.05  # a takeover looks for the previous owner's release this often
LEASE_CHECK_MARGIN_S = 1.0  # a client is closed this long before its lease would end unrenewed


def reg_key_for(client_id: str, topic_filter: str) -> tuple[str, str, str | None]:
    """(registration key, inner filter, share group) of a session's subscription."""
    shared = parse_shared(topic_filter)
    if shared is not None:
        group, inner = shared
        return f"{SHARE_PREFIX}{group}\x00{inner}", inner, group
    return f"{client_id}\x00{topic_filter}", topic_filter, None


class NodeFailure(Exception):
    pass


class SessionOwnedByOther(Exception):
    """A CONNECT found its client id's session owned by another principal: refused, nothing changed."""


class SessionQuotaExceeded(Exception):
    """A CONNECT would give its user more than session.max_persistent_per_user persistent sessions:
    refused, nothing changed."""


@dataclass(slots=True)
class _SessionViews:
    incarnation: int
    sub_version: int
    by_shard: list[tuple[int, list[tuple[str, SubscriptionState]]]]
    by_reg: dict[str, SubscriptionState]
    shares: list[tuple[int, str]]  # (shard, $share registration): where freed window room may dispatch


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
        self._members: dict[str, MemberId] = {}
        self.recent = RecentMessages(cfg.storage.store_cache_bytes)
        self.live: dict[str, LiveSession] = {}
        self.connections: dict[str, Any] = {}  # client id -> Connection (for takeover)
        self.pins: dict[str, tuple[dict[int, int], float]] = {}  # reader -> (shard -> offset, deadline)
        self._share_pending: set[tuple[int, str]] = set()
        self._share_rr: dict[str, int] = {}  # $share registration -> next member (pruned: _prune_share_rr)
        self._share_activating: set[tuple[str, str]] = set()  # (group, active member) a ShareActivate is pending for
        self._dlq_pending: set[tuple[int, str, int]] = set()  # (shard, group, offset) being dead-lettered
        # shard -> (member, incarnation) -> (its session's epoch, since when this node's ack-timeout
        # scan saw that epoch connected; 0: the first epoch it saw)
        self._share_online_since: dict[int, dict[tuple[str, int], tuple[int, int]]] = {}
        self.share_dead_lettered = 0  # messages this node moved to a dead-letter topic
        self.share_ack_timeouts = 0  # claims this node took back from connected members (ack timeout)
        self._housekeeping_rounds = 0
        self._views: dict[str, _SessionViews] = {}  # client id -> derived views; dropped when it disconnects
        self._topic_shards: dict[str, int] = {}
        self._guid_prefix = seams.random_bytes(8)
        self._guid_counter = 0
        self.ack_latency = AckLatency(seams.clock.monotonic)  # PUBLISH read -> PUBACK/PUBREC written
        self.supervisor = Supervisor(self._on_fatal, cfg.supervisor.backoff_initial_s, cfg.supervisor.backoff_max_s)
        self._background: set[asyncio.Task[Any]] = set()  # one-off cleanups nobody awaits
        self.fatal: BaseException | None = None
        self.stopping = asyncio.Event()
        self.ledger = seams.sync_ledger or (SyncLedger(Path(faults.sync_ledger)) if faults.sync_ledger else None)
        seed = faults.cross_shard_chaos_seed
        self._chaos = random.Random(seed) if seed is not None else None
        self.stats = {"delivered": 0, "refused": 0, "delivery_batches_committed": 0}
        # Publishes proposed, and publishes the ACL refused, by where they entered: "mqtt" (PUBLISH
        # packets, wills), "http" (POST /v1/publish), "spark" (the Spark sink's POST /v1/publish).
        # /metrics: moorline_published_total{source}, moorline_publish_denied_total{source}.
        self.published = {"mqtt": 0, "http": 0, "spark": 0}
        self.publish_denied = {"mqtt": 0, "http": 0, "spark": 0}
        self.link: ClusterLink | None = None  # cluster mode: peers, forwarding
        self.placement: list[ShardPlacement] = []  # per shard: voters (preferred leader first), learners
        self.preferred_leader: list[MemberId] = []
        self._handing_over = False  # shutting down: leaderships go away, none come back
        self.snapshot_settings = SnapshotSettings.for_node(cfg, self.data_dir, self._snapshot_saved,
                                                           self._snapshot_installed, inline=seams.inline_io)
        # (client id, epoch) -> monotonic time before which this node must stop serving it, unless
        # a renewal commits (session.owner_lease_s, shortened by the drift bound).
        self._lease_deadline: dict[tuple[str, int], float] = {}

    # --- startup / recovery ----------------------------------------------------------------------
    def open(self) -> None:
        """One node: every shard a group of one voter, this node."""
        self.prepare()
        me = self.node_name(self.member[0])
        self.open_groups({me: self.member}, [ShardPlacement((me,), ())] * self.shard_count)

    def prepare(self, node_id: int = SINGLE_NODE_ID, cluster_key: str | None = None) -> None:
        """Lock the data directory, learn this node's identity, open the WAL (no groups yet).
        ``cluster_key`` (cluster mode) makes the shards' incarnations the same on every node."""
        self.dir_lock = DataDirLock(self.data_dir)
        self.dir_lock.acquire()  # before anything is opened: DataDirInUse / DataDirUnusable
        # Half of this node's Raft identity (node id, storage id): a wiped data directory is a new
        # member. Data written by a single node before ids existed adopts one (it never voted
        # anywhere else); a cluster member's never does. First, so a new directory gets it first.
        self.storage_id = load_or_create_storage_id(self.data_dir, self.seams.random_bytes,
                                                    adopt_existing=cluster_key is None)
        self._meta = self._cluster_meta(cluster_key)
        self.member: MemberId = (node_id, self.storage_id)
        self.boot = next_boot_number(self.data_dir)
        self.wal = WriteAheadLog(
            self.data_dir / "wal", segment_bytes=self.cfg.storage.wal_segment_bytes,
            max_pending_bytes=self.cfg.storage.max_pending_bytes, ledger=self.ledger,
            preallocate=self.cfg.storage.wal_preallocate,
        )
        self._recovery = self.wal.open()  # WalCorruption here refuses to start, naming file and offset
        for torn in self._recovery.torn_tails:  # names the sync batch and how many records went
            log.warning("WAL %s", torn.describe())
        self.snapshots = SnapshotStore(self.data_dir / "snapshots", ledger=self.ledger)

    def open_groups(self, members: dict[str, MemberId], placement: list[ShardPlacement]) -> None:
        """Every shard's replica, recovered and applied up to what its log commits. ``placement``
        names each shard's voters (this node among them or not: the others are learners) and its
        preferred leader. With one voter the node campaigns at once; in a cluster the preferred
        leader (spreading leaders) campaigns at its first start and elections do the rest."""
        rec, meta = self._recovery, self._meta
        limits = default_limits(self.cfg, self.faults.dedup_at_propose_only)
        hooks = ApplyHooks(on_effects=self._on_effects, on_results=self._on_results,
                           send=self._send_raft, forward=self._forward, now_ms=self.now_ms)
        invariant(len(placement) == self.shard_count, "one placement per shard")
        self.placement = placement
        self._members = members
        # The metadata group (group id shard.count): every initial node votes in it (1, 3 or 5).
        meta_voters = [members[name] for name in sorted(members)]
        self.preferred_leader = [members[p.preferred_leader] for p in placement] + [meta_voters[0]]
        corrupted = {r.group: r for r in rec.corrupted if r.group is not None}
        for shard in range(self.shard_count + 1):
            is_meta = shard == self.shard_count
            voters = meta_voters if is_meta else [members[name] for name in placement[shard].voters]
            learners = [] if is_meta else [members[name] for name in placement[shard].learners]
            finished = recover_install(self.data_dir, shard, self.snapshots, self.wal, rec.groups.get(shard))
            if finished:
                log.warning("shard %d: %s", shard, finished)
            loaded = self.snapshots.load_latest(shard)
            snap_index = snap_term = 0
            if loaded is not None:
                snap_index, snap_term, data = loaded
                state = ShardState.restore(data, limits, self.cfg.session.max_expiry_s)
                coverage.hit("snapshot_restored")
            else:
                state = ShardState(shard, "meta" if is_meta else meta["incarnations"][shard], limits,
                                   self.cfg.session.max_expiry_s)
            store = MessageStore(  # the metadata group's stays empty: it takes no publishes
                self.data_dir / "store" / ("meta" if is_meta else f"shard-{shard}"), segment_bytes=self.cfg.storage.store_segment_bytes,
                ledger=self.ledger, cache_bytes=0,  # recent messages are kept decoded, node-wide (self.recent)
            )
            store_damage: StoreCorruption | None = None
            try:
                store.open()
                store.truncate_from(state.topics.next_offset)
            except StoreCorruption as exc:  # one bad store stops its shard, never the node
                store_damage = exc  # the store is closed and touches its files no more
            grec = rec.groups.get(shard)
            hs = grec.hard_state if grec is not None else None
            voters, learners = recorded_members(self.snapshots.loaded_meta(shard), voters, learners)
            raft, raft_log = build_replica(
                self.member, voters, learners, snap_index, snap_term,
                [(e.term, e.index, e.type, e.data) for e in grec.entries] if grec is not None else [],
                (hs.term, hs.vote, hs.commit) if hs is not None else None, state.applied_index,
                random.Random(f"{self.storage_id}/{shard}"), election_tick=self.cfg.raft.election_ticks,
                max_entry_bytes=self.cfg.raft.max_entry_bytes,
            )
            host = ShardHost(shard, state, raft, raft_log, store, self.snapshots, hooks,
                             self.cfg.shard.snapshot_every_entries, self.cfg.raft.max_entry_bytes, self.recent)
            host.node_id, host.boot = self.member[0], self.boot
            host.check_admission()  # a snapshot whose admission of this node is past this boot
            host.max_pending_proposals = self.cfg.raft.max_pending_proposals
            host.snapshot_settings = self.snapshot_settings
            host.faults = self.faults
            self.groups.append(host)
            if is_meta:
                self.meta_host = host
            else:
                self.hosts.append(host)
            if shard in corrupted or store_damage is not None:
                raft.mark_corrupted()  # never leads, never votes with a log it cannot vouch for
            else:
                fresh = raft_log.last_index() == 0 and hs is None
                if voters == [self.member] or (fresh and self.preferred_leader[shard] == self.member):
                    raft.campaign()  # one voter: leader at once, with a no-op of a new term
                self._recover_group(host)
            present = set(state.topics.meta)
            # What the state no longer keeps goes from the store, also under its low-water mark
            # (records released before a restart are kept again when the files are read).
            gone = [o for o in store.kept_below(store.low_water) if o not in present]
            gone += [o for o in range(store.low_water, state.topics.next_offset) if o not in present]
            if gone:
                store.release(gone)
            if store_damage is not None:
                host.fail(f"checksum failure in synced data: {store_damage}")
                log.error("shard %d refuses service: %s", shard, host.failed)
            elif shard in corrupted:
                r = corrupted[shard]
                host.fail(f"checksum failure in synced data: {r.path} at offset {r.offset}: {r.message}")
                log.error("shard %d refuses service: %s", shard, host.failed)
        if self.faults.drop_on_restart:
            self._test_drop_last_messages()

    async def open_async(self) -> None:
        """``open`` for either mode: with cluster settings, start the link to the peers, learn (or
        recall) every initial member's storage id, then open the groups with all of them as voters."""
        spec = parse_cluster(self.cfg.cluster)
        if spec is None:
            self.open()
            return
        cluster_key = f"{self.cfg.cluster.cluster_id}/{','.join(spec.names)}"
        self.prepare(spec.my_id, cluster_key)
        replicas = self._meta.get("replicas", len(spec.names))  # clusters from before placement: all voters
        if replicas != self.cfg.shard.replicas:
            log.warning("this cluster was created with shard.replicas = %d; using that (it is fixed at creation)",
                        replicas)
        layout = layout_fingerprint(self.shard_count, replicas, len(spec.names))
        link = ClusterLink(spec, self.cfg.cluster, self.storage_id, self.known_members(), self.seams.rng(), layout,
                           seams=self.seams)
        self.attach_cluster(link)
        await link.start()
        members = await link.wait_for_members(self.cfg.cluster.bootstrap_timeout_s)
        self.save_members(members)
        ids = {name: (spec.node_id(name), sid) for name, sid in members.items()}
        self.open_groups(ids, place_shards(cluster_key, spec.names, self.shard_count, replicas))

    # --- the metadata group -----------------------------------------------------------------------
    @property
    def meta_group(self) -> int:
        """The metadata group's Raft group id: the one after the last shard."""
        return self.shard_count

    def cluster_record(self) -> c.ClusterRecord:
        """What this node computed of the cluster at bootstrap, as the metadata group records it."""
        names = self.link.spec.names if self.link is not None else (self.node_name(self.member[0]),)
        cluster_id = self.cfg.cluster.cluster_id if self.link is not None else ""
        return c.ClusterRecord(
            cluster_id=cluster_id,
            members=tuple((name, *self._members[name]) for name in names),
            shard_count=self.shard_count,
            replicas=max(len(p.voters) for p in self.placement),
            placement=tuple((p.voters, p.learners) for p in self.placement),
        )

    def sink_marker(self, query_id: str) -> int | None:
        """A Spark sink query's last committed batch: in the metadata group, or (data written
        before it existed) in the session shard of ``$sink/<query id>``, whichever is later."""
        assert self.meta_host is not None
        now = self.meta_host.state.sink_markers.get(query_id)
        before = self.hosts[self.session_shard("$sink/" + query_id)].state.sink_markers.get(query_id)
        known = [b for b in (now, before) if b is not None]
        return max(known) if known else None

    async def _meta_bootstrap_loop(self) -> None:
        """The metadata group's first leader writes the cluster's record (members, layout,
        placement) once; every node then checks its own computation against it. It is what
        membership changes will rewrite (a later feature)."""
        host = self.meta_host
        assert host is not None
        mine = self.cluster_record()
        while host.state.cluster is None and not self.stopping.is_set():
            if host.raft.is_leader and host.failed is None:
                fut = self.propose(self.meta_group, c.ClusterBootstrap(mine))
                if fut is not None:
                    try:
                        await outcome_within(fut, 5.0)
                    except (TimeoutError, ShardUnavailable):
                        pass
            if host.state.cluster is None:
                await asyncio.sleep(0.5)
        record = host.state.cluster
        if record is not None and record != mine:
            log.error("the metadata group records another cluster layout than this node computed: this node "
                      "places shards as %s, the cluster as %s; was it started with other flags or config?",
                      mine, record)

    # --- cluster (none of this runs on a single node) ---------------------------------------------
    def attach_cluster(self, link: ClusterLink) -> None:
        """Raft traffic of this node's groups goes through ``link`` from now on."""
        self.link = link
        link.on_raft = self._on_raft_message
        link.on_forward = self._on_forwarded
        link.hosts = self.groups  # a snapshot transfer reads and installs through the hosts

    def known_members(self) -> dict[str, str] | None:
        members = self._meta.get("members")
        return dict(members) if isinstance(members, dict) else None

    def save_members(self, members: dict[str, str]) -> None:
        """The initial members' storage ids, once known: a restart needs no bootstrap, and a peer
        that comes back with other storage is recognised as wiped."""
        if self._meta.get("members") == members:
            return
        self._meta["members"] = dict(sorted(members.items()))
        write_file_atomically(self.data_dir / "cluster.json", json.dumps(self._meta).encode())

    def _send_raft(self, host: ShardHost, msgs: list[Message]) -> None:
        if self.link is not None:
            self.link.send(host.shard, msgs)

    def _forward(self, host: ShardHost, node_id: int, entries: list[bytes]) -> None:
        if self.link is not None:
            self.link.forward(host.shard, node_id, entries)

    def _on_raft_message(self, shard: int, m: Message) -> None:
        if not 0 <= shard < len(self.groups):
            return  # groups not open yet (bootstrap), or a group this node does not have
        host = self.groups[shard]
        if host.failed is not None or getattr(self, "commit", None) is None:
            return  # not serving yet: the sender retransmits
        try:
            host.raft.step(m)
        except InvariantViolation as exc:  # our core broke its own rule: this group stops, as for corruption
            host.fail_on_bug("raft step", exc)
            return
        except Exception as exc:  # a peer's message must never take a group (or the node) down
            log.warning("shard %d: dropped a raft message from %r: %s", shard, m.from_, exc)
            return
        if host.raft.has_ready():
            self.commit.kick(shard)

    def _on_forwarded(self, shard: int, entries: list[bytes]) -> None:
        if 0 <= shard < len(self.groups) and getattr(self, "commit", None) is not None:
            self.groups[shard].propose_forwarded(entries)
            self.commit.kick(shard)

    async def _tick_loop(self) -> None:
        interval = self.cfg.raft.tick_interval_ms / 1000
        ticks = 0
        while not self.stopping.is_set():
            await asyncio.sleep(interval)
            ticks += 1
            for host in self.groups:
                if host.failed is None:
                    try:
                        host.tick()
                    except Exception as exc:  # a bug in one group's core stops that group, not the node
                        host.fail_on_bug("tick", exc)
                        continue
                    if host.has_work():
                        self.commit.kick(host.shard)
            if ticks % REBALANCE_EVERY_TICKS == 0 and not self._handing_over:
                self._rebalance_leaders()

    def _rebalance_leaders(self) -> None:
        """Leaders go back to each shard's preferred node (its first voter in the placement, the
        spread a fresh cluster starts with) once that node is caught up: after failures and restarts leadership
        piles up on the survivors. A few transfers per round, so a flapping node causes no storm."""
        moved = 0
        for host in self.groups:
            raft = host.raft
            if host.failed is not None or not raft.is_leader or raft.lead_transferee is not None:
                continue
            preferred = self.preferred_leader[host.shard]
            pr = raft.progress.get(preferred)
            # Caught up to the commit index is enough: transfer_leader itself catches the rest up
            # (a group with a proposal in flight at every check, e.g. housekeeping, never moved).
            if preferred == self.member or pr is None or not raft.is_active(preferred) or pr.match < raft.log.committed:
                continue
            try:
                raft.transfer_leader(preferred)
            except ProposalDropped as exc:  # refused by the core (e.g. a change in progress): next round
                log.info("shard %d: leadership not moved to its preferred node: %s", host.shard, exc)
                continue
            self.commit.kick(host.shard)
            moved += 1
            if moved >= REBALANCE_MAX_TRANSFERS:
                return

    async def hand_over_leadership(self, timeout_s: float) -> None:
        """Graceful shutdown: every shard this node leads is handed to its most caught-up voter, so
        clients see a leader change rather than an election timeout. Bounded by ``timeout_s``."""
        if self.link is None:
            return
        self._handing_over = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            leading = [h for h in self.groups if h.failed is None and h.raft.is_leader]
            if not leading:
                return
            for host in leading:
                raft = host.raft
                others = [m for m in raft.active_conf_state.voters if m != self.member and m in raft.progress]
                if not others or raft.lead_transferee is not None:
                    continue
                best = max(others, key=lambda m: (raft.is_active(m), raft.progress[m].match))
                try:
                    raft.transfer_leader(best)
                except Exception:  # noqa: BLE001 - not leader any more, or the member is gone
                    continue
                self.commit.kick(host.shard)
            await asyncio.sleep(0.05)
        left = sum(1 for h in self.groups if h.failed is None and h.raft.is_leader)
        if left:
            log.warning("stopping while still leading %d shard(s): they elect a new leader after a timeout", left)

    def _on_results(self, host: ShardHost, cmds: list[c.Command], results: list[Any]) -> None:
        """A session opened elsewhere (another node, a newer epoch) ends this node's connection of
        it: 0x8E on 5.0 (the new owner already serves; this one's commands are stale)."""
        if self.link is None:
            return
        for cmd, res in zip(cmds, results, strict=False):
            if type(cmd) is c.SessionOpen and res is not None and not res.refused:
                conn = self.connections.get(cmd.client_id)
                live = getattr(conn, "live", None)
                if conn is not None and live is not None and live.epoch != res.epoch:
                    conn.disconnect(0x8E, "session taken over on another node")
                    # Stopped serving it: the new owner need not wait for our lease to run out.
                    self._lease_deadline.pop((cmd.client_id, live.epoch), None)
                    self.propose(host.shard, c.LeaseRelease(cmd.client_id, live.epoch, self.member[0]), want=False)

    def node_name(self, node_id: int) -> str:
        """A Raft node id as operators know it: its --initial-cluster name ("n1" on a single node)."""
        if self.link is not None and 1 <= node_id <= len(self.link.spec.names):
            return self.link.spec.name_of(node_id)
        return f"n{node_id}"

    def raft_status(self, shard: int) -> dict[str, Any]:
        """The shard's Raft view from this replica, for GET /v1/shards: leader (None while there is
        none), voters, learners, term, commit/applied, and per replica its match (known on the leader).
        ``shard`` may be ``meta_group``, the metadata group."""
        host = self.groups[shard]
        raft = host.raft
        conf = raft.active_conf_state
        lead = raft.lead
        replicas = {self.node_name(m[0]): {"match": (raft.progress[m].match if raft.is_leader and m in raft.progress
                                                     else None)} for m in conf.members()}
        replicas[self.node_name(self.member[0])]["applied"] = host.state.applied_index
        return {
            "leader": self.node_name(lead[0]) if lead is not None else None,
            "preferred_leader": self.node_name(self.preferred_leader[shard][0]),
            "voters": [self.node_name(m[0]) for m in conf.voters],
            "learners": [self.node_name(m[0]) for m in conf.learners],
            "term": raft.term,
            "commit": raft.log.committed,
            "applied_index": host.state.applied_index,
            "replicas": replicas,
        }

    def cluster_status(self) -> dict[str, Any]:
        """Nodes of the cluster (GET /v1/cluster): names, addresses, storage ids, reachability, and
        how many groups each leads as this node sees it; and the metadata group (its Raft view and
        the record it holds of the cluster)."""
        led: dict[str, int] = {}
        for h in self.groups:
            if h.raft.lead is not None:
                name = self.node_name(h.raft.lead[0])
                led[name] = led.get(name, 0) + 1
        metadata = self.metadata_status()
        if self.link is None:
            me = self.node_name(self.member[0])
            return {"nodes": [{"id": me, "storage_id": self.storage_id, "self": True, "reachable": True,
                               "groups_led": led.get(me, 0), "mqtt": self.cfg.listeners.mqtt,
                               "http": self.cfg.listeners.http}], "metadata": metadata}
        stats = self.link.stats().get("peers", {})
        nodes = []
        for name in self.link.spec.names:
            peer = stats.get(name, {})
            is_me = name == self.link.spec.me
            streams_up = peer.get("connected_streams") or []
            nodes.append({
                "id": name, "cluster": "{}:{}".format(*self.link.spec.addresses[name]),
                "storage_id": self.link.members.get(name), "self": is_me,
                "reachable": True if is_me else bool(streams_up),
                "groups_led": led.get(name, 0),
                **({"snapshot_transfers": self.link.snapshots.snapshot_stats()} if is_me else {"transport": peer}),
            })
        return {"nodes": nodes, "metadata": metadata}

    def metadata_status(self) -> dict[str, Any]:
        status = self.raft_status(self.meta_group)
        status.pop("preferred_leader", None)
        record = self.meta_host.state.cluster if self.meta_host is not None else None
        status["record"] = None if record is None else {
            "cluster_id": record.cluster_id, "members": [{"id": n, "node_id": i, "storage_id": sid}
                                                         for n, i, sid in record.members],
            "shard_count": record.shard_count, "replicas": record.replicas,
            "feature_level": record.feature_level,
        }
        return status

    def leads(self, shard: int) -> bool:
        """Whether this node proposes the shard's leader-only commands (housekeeping, wills,
        $share dispatch, queue-cap drops). A single node leads every shard."""
        return self.hosts[shard].raft.is_leader

    def _recover_group(self, host: ShardHost) -> None:
        """Before serving: the new term's no-op is made durable, and with it the core hands out as
        committed every entry it may (after a snapshot: those the WAL kept), which are applied."""
        while host.failed is None:
            rd = host.seal()
            if rd is None:
                return
            stage_ready(self.wal, host.shard, rd)
            self.wal.sync()
            try:
                host.after_sync(partial(stage_hard_state, self.wal))
            except OSError:
                raise
            except Exception as exc:  # a replayed entry this code cannot apply stops its shard only
                host.fail_on_bug("recovery apply", exc)

    def _cluster_meta(self, cluster_key: str | None = None) -> dict[str, Any]:
        path = self.data_dir / "cluster.json"
        if path.exists():
            meta: dict[str, Any] = json.loads(path.read_text())
            if meta["shard_count"] != self.shard_count:
                log.warning("data dir was created with %d shards; using that (shard.count is fixed at creation)",
                            meta["shard_count"])
                self.shard_count = meta["shard_count"]
            invariant(meta.get("hash") == "crc32c", "unknown placement hash")
            return meta
        meta = {
            "shard_count": self.shard_count,
            "hash": "crc32c",
            # A shard's incarnation is the same on every replica: drawn at random by a single node,
            # derived from the cluster's key (id and initial members) in a cluster.
            "incarnations": [self.seams.random_bytes(8).hex() if cluster_key is None else
                             guid128(cluster_key, shard)[:8].hex() for shard in range(self.shard_count)],
            "created_ms": self.clock.wall_ms(),
            **({} if cluster_key is None else {"replicas": self.cfg.shard.replicas}),
        }
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return meta

    def _test_drop_last_messages(self) -> None:
        """Deliberately broken build (Faults.drop_on_restart): lose each shard's newest message."""
        for host in self.hosts:
            t = host.state.topics
            if not t.meta:
                continue
            offset = next(reversed(t.meta))
            for reg in t.regs.values():
                if offset in reg.owed:
                    del reg.owed[offset]
            t.owed_count.pop(offset, None)
            t.meta.discard(offset)
            host.store.release([offset])
            log.warning("TEST: dropped message %d/%d at restart", host.shard, offset)

    async def start(self) -> None:
        # In a cluster no fdatasync runs on the event loop: heartbeats of every group would wait behind it.
        inline_sync_max_us = self.cfg.storage.inline_sync_max_us if self.link is None else 0
        self.commit = GroupCommit(self.wal, self.groups, self._on_fatal, self._after_commit,
                                  inline_sync_max_us, self.cfg.storage.lazy_sync_delay_ms,
                                  unsafe_ack_before_sync=self.faults.unsafe_ack_before_sync,
                                  slow_sync_s=self.faults.slow_sync_s, inline_only=self.seams.inline_io,
                                  sync_runner=self.seams.sync_runner)
        # Critical: without group commit, ticks or lease renewals the node would serve unsafely
        # (nothing durable, no elections, two owners of a session): it stops instead.
        self.supervisor.spawn("group-commit", self.commit.run, critical=True)
        if self.link is not None:
            self.supervisor.spawn("raft-ticks", self._tick_loop, critical=True)
        await self._reconcile_after_restart()
        self.supervisor.spawn("housekeeping", self._housekeeping_loop, critical=False)
        self.supervisor.spawn("session-leases", self._lease_loop, critical=True)
        self.supervisor.spawn("metadata-bootstrap", self._meta_bootstrap_loop, critical=False)

    async def _reconcile_after_restart(self) -> None:
        """Sessions that were connected when the node stopped are now disconnected (wills may
        fire); every subscription is registered again (idempotent) in case a crash cut that short.

        Single node only: in a cluster a session marked connected may be served by another node
        right now, and this node's replicas may lag; there the owner lease (to come) ends the
        sessions of a node that died, and registrations are repaired by their owners."""
        if self.link is not None:
            return
        now = self.now_ms()
        futs: list[Any] = []
        wanted: set[str] = set()  # plain registration keys some session's subscription stands behind
        for host in self.hosts:
            for sess in list(host.state.sessions.sessions.values()):
                wanted.update(reg_key_for(sess.client_id, flt)[0] for flt in sess.subs)
                if host.failed is not None:
                    continue
                for flt, sub in sess.subs.items():
                    self._register_everywhere(sess, flt, sub, want_retained=False, futs=futs)
                self._resend_ack_reports(sess)
                if sess.connected:
                    futs.append(self.propose(host.shard, c.SessionClose(now, sess.client_id, sess.epoch, True)))
        self._unregister_ghosts(wanted, futs)
        for f in futs:
            if f is not None:
                try:
                    result = await f
                except ShardUnavailable:
                    continue
                if isinstance(result, Session):
                    await self._end_session(result, "session_expired")

    def _unregister_ghosts(self, wanted: set[str], futs: list[Any]) -> None:
        """Plain registrations no subscription stands behind (a SUBSCRIBE undone, or a session
        ended, while the shard was unavailable) stop collecting messages. Those of sessions whose
        own shard is unavailable are kept: that session's subscriptions are unknown."""
        for host in self.hosts:
            if host.failed is not None:
                continue
            for rk, reg in list(host.state.topics.regs.items()):
                if reg.share_group is not None or reg.draining or rk in wanted:
                    continue  # draining: unsubscribed, finishing what is in flight
                if self.hosts[self.session_shard(reg.client_id)].failed is not None:
                    continue
                futs.append(self.propose(host.shard, c.Unregister(rk, reg.session_inc, "subscribe_failed")))

    def _resend_ack_reports(self, sess: Session) -> None:
        """Acks committed in the session's shard whose reports to topic shards a crash may have cut
        short are reported again (idempotent): delivered (at or below the cursor), not in flight."""
        by_reg: dict[tuple[int, str], list[int]] = {}
        for shard, rk, offset in sess.share_done:
            by_reg.setdefault((shard, rk), []).append(offset)
        inflight = {(d.item.shard, d.item.offset) for d in sess.inflight.values()}
        for shard, regs in self.session_regs(sess.client_id, sess):
            cursor = sess.last_delivered.get(shard, -1)
            topics = self.hosts[shard].state.topics
            for rk, _sub in regs:
                reg = topics.regs.get(rk)
                if reg is None or reg.share_group is not None or reg.session_inc != sess.incarnation:
                    continue
                done = [o for o in reg.owed if o <= cursor and (shard, o) not in inflight]
                if done:
                    by_reg.setdefault((shard, rk), []).extend(done)
        for (shard, rk), offsets in by_reg.items():
            self.propose_lazy(shard, c.AckReport(rk, tuple(offsets)))

    # --- proposing -------------------------------------------------------------------------------
    def propose(self, shard: int, cmd: c.Command, want: bool = True) -> asyncio.Future[Any] | None:
        """``cmd`` into group ``shard`` (a shard, or ``meta_group`` for the metadata group)."""
        host = self.groups[shard]
        fut = host.propose(cmd, want)
        self.commit.kick(shard)
        return fut

    def read_barrier(self, shard: int) -> asyncio.Future[None]:
        """``ShardHost.read_barrier`` of ``shard``: this node's replica as of the group's commit now."""
        fut = self.groups[shard].read_barrier()
        self.commit.kick(shard)
        return fut

    def propose_lazy(self, shard: int, cmd: c.Command, want: bool = False) -> asyncio.Future[Any] | None:
        """A command nobody waits for and whose delay costs nothing but a later release (ack
        reports, QoS 1 session acks, housekeeping): it never forces a sync of its own, it rides on
        the next one somebody waits for, or goes after ``storage.lazy_sync_delay_ms``."""
        fut = self.groups[shard].propose(cmd, want)
        self.commit.kick_lazy(shard)
        return fut

    def propose_cb(self, shard: int, cmd: c.Command, callback: Any) -> None:
        self.groups[shard].propose_cb(cmd, callback)
        self.commit.kick(shard)

    def propose_group(self, shard: int, cmds: list[c.Command], callback: Any) -> None:
        """Propose ``cmds`` together; ``callback(results, error)`` runs once, after the last applies."""
        self.groups[shard].propose_group(cmds, callback)
        self.commit.kick(shard)

    def propose_cross(self, shard: int, cmd: c.Command) -> asyncio.Future[Any]:
        """A command caused by another shard. The test-only chaos switch delays and reorders them."""
        if self._chaos is None:
            fut = self.propose(shard, cmd)
            assert fut is not None
            return fut
        loop = asyncio.get_running_loop()
        outer: asyncio.Future[Any] = loop.create_future()
        delay = self._chaos.random() * 0.02

        def fire() -> None:
            inner = self.propose(shard, cmd)
            assert inner is not None
            inner.add_done_callback(
                lambda f: outer.set_exception(f.exception())  # type: ignore[arg-type]
                if f.exception() is not None else outer.set_result(f.result())
            )

        loop.call_later(delay, fire)
        return outer

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

    # --- publishing ------------------------------------------------------------------------------
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

    # --- sessions --------------------------------------------------------------------------------
    def _session_views(self, sess: Session) -> _SessionViews:
        """Derived from the session's subscriptions; recomputed when they change (sub_version)."""
        cached = self._views.get(sess.client_id)
        if cached is not None and cached.incarnation == sess.incarnation and cached.sub_version == sess.sub_version:
            return cached
        by_shard: dict[int, list[tuple[str, SubscriptionState]]] = {}
        by_reg: dict[str, SubscriptionState] = {}
        for flt, sub in sess.subs.items():
            reg_key, inner, _ = reg_key_for(sess.client_id, flt)
            by_reg[reg_key] = sub
            for shard in self.shards_for_filter(inner):
                by_shard.setdefault(shard, []).append((reg_key, sub))
        ordered = sorted(by_shard.items())
        shares = [(shard, rk) for shard, regs in ordered for rk, _ in regs if self.is_share_key(rk)]
        views = _SessionViews(sess.incarnation, sess.sub_version, ordered, by_reg, shares)
        self._views[sess.client_id] = views
        return views

    def session_regs(self, client_id: str, sess: Session) -> list[tuple[int, list[tuple[str, SubscriptionState]]]]:
        """Per topic shard, the registrations (and subscriptions) this session reads."""
        return self._session_views(sess).by_shard

    def reg_subs(self, client_id: str, sess: Session) -> dict[str, SubscriptionState]:
        """Registration key -> the session's subscription behind it."""
        return self._session_views(sess).by_reg

    def share_policy(self, group: str, asked_single_active: bool = False) -> GroupPolicy:
        """A $share group's work-queue policy from ``[share]`` (docs/work-queues.md)."""
        sh = self.cfg.share
        return group_policy(sh.single_active, sh.limited_groups, sh.max_deliveries, sh.ack_timeout_s,
                            group, asked_single_active)

    def _register_everywhere(
        self, sess: Session, flt: str, sub: SubscriptionState, want_retained: bool, futs: list[Any],
        single_active: bool = False,
    ) -> list[int]:
        """Proposes the registration in every shard the filter can match; returns the shards that
        refused it at once (unavailable). The futures of the others go to ``futs``."""
        reg_key, inner, group = reg_key_for(sess.client_id, flt)
        pol = self.share_policy(group, single_active) if group is not None else GroupPolicy(False, 0, 0)
        refused: list[int] = []
        for shard in self.shards_for_filter(inner):
            try:
                futs.append(self.propose_cross(shard, c.Register(
                    self.now_ms(), reg_key, sess.client_id if group is None else "", sess.incarnation, inner,
                    sub.qos, sub.no_local, want_retained and group is None, group, sub.version,
                    pol.single_active, pol.max_deliveries, pol.ack_timeout_ms,
                )))
                if group is not None:
                    futs.append(self.propose_cross(shard, c.ShareMember(reg_key, sess.client_id, True,
                                                                        sess.incarnation)))
            except ShardUnavailable:
                refused.append(shard)
        return refused

    async def subscribe(
        self, live: LiveSession, flt: str, qos: int, no_local: bool, rap: bool, rh: int, sub_id: int | None,
        single_active: bool = False,
    ) -> None:
        """Commits the subscription in the session's shard, then registers it in every shard the
        filter can match; SUBACK may follow. Each shard's Register hands its retained messages to
        the session as it applies (``_on_effects``): they may precede the SUBACK (MQTT-3.8.4)."""
        fut = self.propose(live.shard, c.SessionSubscribe(live.client_id, live.epoch, flt, qos, no_local, rap, rh, sub_id))
        assert fut is not None
        res = await self.bounded(fut, live.shard)
        sess = live.session()
        if res is None or sess is None or sess.epoch != live.epoch or flt not in sess.subs:
            raise NodeFailure("session taken over")
        existed, _inc = res
        sub = sess.subs[flt]
        want = rh == 0 or (rh == 1 and not existed)
        futs: list[Any] = []
        refused = self._register_everywhere(sess, flt, sub, want, futs, single_active)
        if self.faults.suback_before_all_shards and len(futs) > 1:  # broken build: the first shard's answer only
            asyncio.gather(*futs[1:], return_exceptions=True)  # the other shards answer whenever, unheard
            futs = futs[:1]
        results = await asyncio.gather(*(self.bounded(f, -1) for f in futs), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if refused or errors:
            # Failed part-way: undone everywhere it reached, so nothing registered goes on collecting
            # or delivering messages for a subscription the client was told failed (SUBACK 0x80).
            await self._undo_subscribe(live, flt, sub.version)
            which = ", ".join(f"shard {s}" for s in refused)
            raise ShardUnavailable(f"{which or 'a shard'} unavailable" + (f": {errors[0]}" if errors else ""))
        live.wake()

    async def _undo_subscribe(self, live: LiveSession, flt: str, version: int) -> None:
        """Removes a subscription whose registration failed part-way, from the session and from
        every shard that can still be reached (best effort: a shard that is down now has the
        registration removed when the session's subscriptions are reconciled)."""
        fut = self.propose(live.shard, c.SessionUnsubscribe(live.client_id, live.epoch, flt))
        assert fut is not None
        try:
            undone = await self.bounded(fut, live.shard)
        except ShardUnavailable:
            undone = None
        reg_key, inner, group = reg_key_for(live.client_id, flt)
        futs = []
        for shard in self.shards_for_filter(inner):
            try:
                if group is not None:
                    futs.append(self.propose_cross(shard, c.ShareMember(reg_key, live.client_id, False,
                                                                        live.incarnation)))
                else:
                    futs.append(self.propose_cross(shard, c.Unregister(
                        reg_key, live.incarnation, "subscribe_failed", undone if undone else version)))
            except ShardUnavailable:
                continue
        await asyncio.gather(*(self.bounded(f, -1) for f in futs), return_exceptions=True)

    async def bounded(self, fut: asyncio.Future[Any], shard: int) -> Any:
        """A command's result within mqtt.control_timeout_s, else ShardUnavailable (a shard without
        a quorum commits nothing: the request is answered with a failure instead of hanging)."""
        limit = self.cfg.mqtt.control_timeout_s
        try:
            return await outcome_within(fut, limit)
        except TimeoutError:
            where = f"shard {shard}" if shard >= 0 else "a shard"
            raise ShardUnavailable(f"{where} committed nothing within {limit:g} s (no quorum?)") from None

    async def unsubscribe(self, live: LiveSession, flt: str) -> bool:
        fut = self.propose(live.shard, c.SessionUnsubscribe(live.client_id, live.epoch, flt))
        assert fut is not None
        version = await self.bounded(fut, live.shard)
        if version is None:
            raise NodeFailure("session taken over")
        if not version:
            return False
        reg_key, inner, group = reg_key_for(live.client_id, flt)
        futs = []
        for shard in self.shards_for_filter(inner):
            if group is not None:
                futs.append(self.propose_cross(shard, c.ShareMember(reg_key, live.client_id, False, live.incarnation)))
                continue
            reg = self.hosts[shard].state.topics.regs.get(reg_key)
            cursor = live.cursor.get(shard, -1)
            if reg is not None:
                # Not yet delivered: no longer wanted. In flight: finished first (acked as usual).
                unwanted = tuple(o for o in reg.owed if o > cursor)
                if unwanted:
                    futs.append(self.propose_cross(shard, c.AckReport(reg_key, unwanted)))
            futs.append(self.propose_cross(shard, c.Unregister(reg_key, live.incarnation, "unsubscribe", version)))
        await asyncio.gather(*futs)
        return True

    async def _end_session(self, sess: Session, reason: str, live: LiveSession | None = None) -> None:
        """A session ended (clean start, expiry 0 disconnect, expiry): its registrations go, and
        its $share claims return to the group except unreceived QoS 2, which are dropped. An
        expiry-0 session's deliveries were logged only by its ``live`` driver, if any."""
        qos2_unreceived: dict[tuple[str, int], list[int]] = {}
        # $share deliveries the member finished (acknowledged: share_done) or received at QoS 2
        # (PUBREC'd) are done: reported as acknowledged before the claims go back, so none is
        # sent to another member (MQTT-4.8.2-5). The report from the member's own node may not
        # have reached the topic shard yet (another node may end the session).
        received: dict[tuple[str, int], list[int]] = {}
        for shard, rk, offset in sess.share_done:
            received.setdefault((rk, shard), []).append(offset)
        if live is not None and live.ephemeral:
            releasing = live.local_releasing
            unreceived = [it for seq, it in live.local_inflight.items() if seq not in releasing]
            pubrecd = [it for seq, it in live.local_inflight.items() if seq in releasing]
        else:
            unreceived = [d.item for d in sess.inflight.values() if d.state == SENT]
            pubrecd = [d.item for d in sess.inflight.values() if d.state != SENT]
        for it in unreceived:
            if it.offset >= 0 and it.qos == 2:
                for rk in it.reg_keys:
                    if self.is_share_key(rk):
                        qos2_unreceived.setdefault((rk, it.shard), []).append(it.offset)
        for it in pubrecd:
            if it.offset >= 0 and it.qos == 2:
                for rk in it.reg_keys:
                    if self.is_share_key(rk):
                        received.setdefault((rk, it.shard), []).append(it.offset)
        futs = []
        for flt in sess.subs:
            reg_key, inner, group = reg_key_for(sess.client_id, flt)
            for shard in self.shards_for_filter(inner):
                if self.hosts[shard].failed is not None:
                    continue  # unregistered when the shard is back (_unregister_ghosts)
                if group is not None:
                    done = received.get((reg_key, shard))
                    if done:  # proposed first from this node: applied before the return
                        self.propose(shard, c.AckReport(reg_key, tuple(done)), want=False)
                    dropped = tuple(qos2_unreceived.get((reg_key, shard), ()))
                    inc = sess.incarnation
                    futs.append(self.propose_cross(shard, c.ShareReturn(reg_key, sess.client_id, dropped, inc)))
                    futs.append(self.propose_cross(shard, c.ShareMember(reg_key, sess.client_id, False, inc)))
                else:
                    futs.append(self.propose_cross(shard, c.Unregister(reg_key, sess.incarnation, reason)))
        self._views.pop(sess.client_id, None)
        await asyncio.gather(*futs)

    def takeover_across_users(self) -> bool:
        auth = self.cfg.auth
        allowed = auth.session_takeover_across_users
        if allowed is not None:
            return allowed
        from moorline.node.edge.auth import identities_proven  # unset: on only where no identity is proven

        return not identities_proven(auth, self.cfg.tls.use_identity_as_username)

    def session_owned_by_other(self, client_id: str, principal: str) -> bool:
        """A cheap early answer, before a CONNECT disturbs anything; the session shard's apply of
        ``SessionOpen(owner_only=True)`` is the authority."""
        if self.takeover_across_users():
            return False
        owner = self.hosts[self.session_shard(client_id)].state.sessions.owner_of(client_id, self.now_ms())
        return owner is not None and owner != principal

    def persistent_quota_exceeded(self, client_id: str, principal: str, expiry_s: int) -> bool:
        """Whether a CONNECT of ``principal`` with this expiry would open one persistent session
        more than session.max_persistent_per_user, counted over this node's replica of every
        session shard (the whole cluster's, up to what has not reached this replica yet; each
        session shard enforces the bound exactly for itself at apply)."""
        cap = self.cfg.session.max_persistent_per_user
        if cap <= 0 or expiry_s <= 0 or not principal:
            return False
        now = self.now_ms()
        sessions = self.hosts[self.session_shard(client_id)].state.sessions
        sess = sessions.sessions.get(client_id)
        if sess is not None and sess.principal == principal and sess.expiry_s > 0 and sessions.owner_of(client_id, now):
            return False  # resumed (or replaced by a clean start): no session more
        return sum(h.state.sessions.persistent_of(principal) for h in self.hosts) >= cap

    async def open_session(
        self, client_id: str, clean_start: bool, expiry_s: int, will: c.WillSpec | None, principal: str
    ) -> tuple[bool, int, int]:
        """Raises SessionOwnedByOther when the session belongs to another principal, and
        SessionQuotaExceeded when it would be one persistent session too many for the principal."""
        shard = self.session_shard(client_id)
        lease_s = self.cfg.session.owner_lease_s
        proposed_at = self.clock.monotonic()
        cap = self.cfg.session.max_persistent_per_user if principal else 0
        fut = self.propose(shard, c.SessionOpen(self.now_ms(), client_id, clean_start, expiry_s, will, principal,
                                                not self.takeover_across_users(), self.member[0],
                                                int(lease_s * 1000), cap))
        assert fut is not None
        reason = "session_expired" if not clean_start else "clean_start"
        try:
            res = await self.bounded(fut, shard)
        except ShardUnavailable:
            # Outcome unknown: the open may still commit. If it does, nobody is served by it, but
            # the incarnation it replaced (clean start) must still end (its registrations and
            # $share memberships go), and the session it opened is handed back.
            fut.add_done_callback(lambda f: self._open_applied_unserved(client_id, f, reason))
            raise
        if res.refused:
            raise SessionQuotaExceeded(client_id) if res.over_quota else SessionOwnedByOther(client_id)
        # Our lease counts from when we proposed it, shortened by the clock-drift bound.
        self._lease_deadline[(client_id, res.epoch)] = proposed_at + lease_s * (1 - self.cfg.session.owner_lease_drift)
        try:
            if res.wait_until_ms and not self.faults.no_owner_lease:  # the broken build serves at once
                coverage.hit("takeover_waited")
                await self._wait_for_previous_owner(client_id, res)
        finally:
            # Also when the wait failed (taken over again meanwhile): the incarnation this open
            # replaced is gone from the session shard whatever happens to this connection, and
            # nothing else would end it (a $share member whose claims never come back).
            if res.ended is not None:
                coverage.hit("session_replaced")
                await self._end_session(res.ended, reason)
        return res.session_present, res.epoch, res.incarnation

    def _open_applied_unserved(self, client_id: str, fut: asyncio.Future[Any], reason: str) -> None:
        """A SessionOpen whose caller gave up (outcome unknown) applied after all."""
        if fut.cancelled() or fut.exception() is not None:
            return
        res = fut.result()
        if res is None or res.refused or self.stopping.is_set():
            return
        self.abandon_session(client_id, res.epoch)
        if res.ended is not None:
            task = asyncio.get_running_loop().create_task(self._end_session(res.ended, reason))
            self._background.add(task)
            task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("a background cleanup did not finish: %s", task.exception())

    async def _wait_for_previous_owner(self, client_id: str, res: Any) -> None:
        """A takeover from another node serves only once that node released the session (it ended
        its client's connection when it applied our open) or its lease has run out (a node cut off
        from the majority closes its clients before then): never two owners at once."""
        remaining_s = (res.wait_until_ms - res.ts_ms) / 1000 * (1 + self.cfg.session.owner_lease_drift)
        deadline = self.clock.monotonic() + remaining_s
        host = self.hosts[self.session_shard(client_id)]
        while self.clock.monotonic() < deadline:
            sess = host.state.sessions.sessions.get(client_id)
            if sess is None or sess.epoch != res.epoch:
                raise NodeFailure("session taken over again while waiting for the previous owner")
            if sess.prev_lease is None:
                return  # released
            await asyncio.sleep(LEASE_POLL_S)

    async def _lease_loop(self) -> None:
        """Renews the leases of the sessions this node serves (every third of a lease, one
        committed SessionRenew per session shard) and closes any client whose lease this node
        could not renew in time: cut off from the session shard's majority, it must stop serving
        before another node may start."""
        lease_s = self.cfg.session.owner_lease_s
        margin = lease_s * (1 - self.cfg.session.owner_lease_drift)
        next_renew = 0.0
        while not self.stopping.is_set():
            await asyncio.sleep(LEASE_POLL_S * 10)
            now = self.clock.monotonic()
            if now >= next_renew:
                next_renew = now + lease_s / 3
                by_shard: dict[int, list[tuple[str, int]]] = {}
                for cid, live in self.live.items():
                    by_shard.setdefault(live.shard, []).append((cid, live.epoch))
                for shard, held in by_shard.items():
                    if self.hosts[shard].failed is not None:
                        continue
                    cmd = c.SessionRenew(self.now_ms(), self.member[0], int(lease_s * 1000), tuple(held))
                    try:
                        self.propose_cb(shard, cmd, self._renewed(tuple(held), now + margin))
                    except ShardUnavailable as exc:
                        # Not renewed this round (a long minority partition fills
                        # raft.max_pending_proposals): the deadlines below close the clients in
                        # time; the loop itself must go on, or nothing is ever closed again.
                        log.warning("shard %d: session leases not renewed: %s", shard, exc)
            for key, until in list(self._lease_deadline.items()):
                live_now = self.live.get(key[0])
                if (live_now is None or live_now.epoch != key[1]) and now > until:
                    del self._lease_deadline[key]  # a CONNECT that never became a live session
            for cid, live in list(self.live.items()):
                deadline = self._lease_deadline.get((cid, live.epoch))
                if deadline is not None and now >= deadline - LEASE_CHECK_MARGIN_S and not self.faults.no_owner_lease:
                    conn = self.connections.get(cid)
                    if conn is not None and getattr(conn, "live", None) is live:
                        log.warning("%s: session lease not renewed in time (session shard unreachable?): "
                                    "closing the connection", cid)
                        conn.disconnect(0x80, "session ownership lease lost")

    def _renewed(self, held: tuple[tuple[str, int], ...], deadline: float) -> Any:
        def done(result: Any, exc: BaseException | None) -> None:
            if exc is None:
                for key in held:
                    if key in self._lease_deadline:
                        self._lease_deadline[key] = max(self._lease_deadline[key], deadline)
        return done

    def epoch_is_current(self, client_id: str, epoch: int) -> bool:
        sess = self.hosts[self.session_shard(client_id)].state.sessions.sessions.get(client_id)
        return sess is not None and sess.epoch == epoch

    def abandon_session(self, client_id: str, epoch: int) -> None:
        """A session opened for a connection that closed before it was served: closed (no will),
        its lease released, so a CONNECT elsewhere need not wait for it."""
        self._lease_deadline.pop((client_id, epoch), None)
        self.propose(self.session_shard(client_id), c.SessionClose(self.now_ms(), client_id, epoch, False),
                     want=False)

    def close_session(self, live: LiveSession, send_will: bool, expiry_s: int | None,
                      on_outcome: Callable[[asyncio.Future[Any]], None] | None = None) -> asyncio.Task[None]:
        """Proposes the close at once (before any later CONNECT of the same client can be proposed,
        so the session shard sees them in the order they happened), then finishes asynchronously.
        ``on_outcome`` gets the proposal's future once the close is applied or has failed (a clean
        DISCONNECT waits for it: only a committed close discards the will)."""
        self._lease_deadline.pop((live.client_id, live.epoch), None)
        live.stop()  # pending acks are proposed first, in the same entry
        if self.live.get(live.client_id) is live:
            del self.live[live.client_id]
            self._views.pop(live.client_id, None)
        fut = self.propose(live.shard, c.SessionClose(self.now_ms(), live.client_id, live.epoch, send_will, expiry_s))
        assert fut is not None
        if on_outcome is not None:
            fut.add_done_callback(on_outcome)
        return asyncio.get_running_loop().create_task(self._finish_close(live, fut, send_will))

    async def _finish_close(self, live: LiveSession, fut: asyncio.Future[Any], send_will: bool) -> None:
        await live.close()
        ended = await fut
        if isinstance(ended, Session):
            await self._end_session(ended, "session_expired", live)
        elif send_will:
            await self._session_housekeeping(live.shard)

    # --- effects ---------------------------------------------------------------------------------
    def _on_effects(self, host: ShardHost, fx: Effects) -> None:
        shard = host.shard
        # A dict, not a set: sessions wake in a deterministic order (a set of objects iterates in
        # address order, which differs run to run and breaks a simulator seed's replay).
        woken: dict[LiveSession, None] = {}
        # Retained messages of a new registration go before anything the shard owes the session
        # from now on (the delivery pump serves them first).
        for reg_key, retained in fx.retained_new:
            live = self.live.get(reg_key.partition("\x00")[0])
            if live is not None and live.add_retained(shard, reg_key, retained):
                woken[live] = None
        # Runs of one registration (one subscriber's messages, in apply order) go to its session at once.
        for reg_key, run in groupby(fx.owed_new, key=itemgetter(1)):
            if reg_key.startswith(SHARE_PREFIX):
                continue
            live = self.live.get(reg_key.partition("\x00")[0])
            if live is not None:
                live.notify_run(shard, run)
                woken[live] = None
        for reg_key in fx.owed_regs:
            if self.is_share_key(reg_key):
                self._schedule_dispatch(shard, reg_key)
            else:
                self._enforce_queue_cap(host, reg_key)
        for reg_key, member, offsets in fx.claims:
            live = self.live.get(member)
            if live is not None:
                for offset in offsets:
                    live.notify(shard, reg_key, offset)
                woken[live] = None
        for live in woken:
            live.wake()

    def _enforce_queue_cap(self, host: ShardHost, reg_key: str) -> None:
        """session.max_queued_messages / _bytes hold per subscription across every shard its filter
        reads: past either, its oldest undelivered messages (by entry time, then shard and offset)
        are dropped by committed, counted DropOwed commands. Messages already sent and not yet
        acknowledged are never dropped: the client may be acknowledging them right now."""
        reg = host.state.topics.regs.get(reg_key)
        if reg is None or len(self.hosts) < self.shard_count or not host.raft.is_leader:
            return  # recovering (caps hold again from the next apply), or the leader's to enforce
        cap_n, cap_b = self.cfg.session.max_queued_messages, self.cfg.session.max_queued_bytes
        shards = self.shards_for_filter(reg.filter)
        total_n = total_b = 0
        for shard in shards:
            t = self.hosts[shard].state.topics
            r = t.regs.get(reg_key)
            if r is not None:
                total_n += len(r.owed)
                total_b += t.owed_bytes.get(reg_key, 0)
        if total_n <= cap_n and total_b <= cap_b:
            return
        cursors = self._delivered_cursors(reg.client_id)
        candidates = []
        for shard in shards:
            h = self.hosts[shard]
            r = h.state.topics.regs.get(reg_key)
            if r is not None and r.owed and h.failed is None:
                candidates.append(self._undelivered_by_age(h, r, cursors.get(shard, -1)))
        victims: dict[int, list[int]] = {}
        for _ts, shard, offset, size in heapq.merge(*candidates):
            if total_n <= cap_n and total_b <= cap_b:
                break
            victims.setdefault(shard, []).append(offset)
            total_n -= 1
            total_b -= size
        for shard, offsets in victims.items():
            coverage.hit("queue_cap_drop")
            self.propose(shard, c.DropOwed(reg_key, tuple(offsets), "queue_cap"), want=False)

    def _delivered_cursors(self, client_id: str) -> dict[int, int]:
        """Per topic shard, the highest offset already sent to the session (live or committed)."""
        live = self.live.get(client_id)
        if live is not None:
            return live.cursor
        sess = self.hosts[self.session_shard(client_id)].state.sessions.sessions.get(client_id)
        return sess.last_delivered if sess is not None else {}

    @staticmethod
    def _undelivered_by_age(host: ShardHost, reg: Any, cursor: int) -> Iterable[tuple[int, int, int, int]]:
        """(entry time, shard, offset, size) of what ``reg`` is owed above ``cursor``, oldest first
        (a shard's offsets are in entry-time order)."""
        meta = host.state.topics.meta
        for offset in reg.owed:
            if offset > cursor:
                m = meta.get(offset)
                if m is not None:
                    yield m.ts_ms, host.shard, offset, m.size

    def _schedule_dispatch(self, shard: int, reg_key: str) -> None:
        key = (shard, reg_key)
        if key in self._share_pending:
            return
        self._share_pending.add(key)
        asyncio.get_running_loop().call_soon(self._dispatch_share, shard, reg_key)

    def _dispatch_share(self, shard: int, reg_key: str) -> None:
        """The $share dispatcher for (shard, group): claims are committed before they are pushed."""
        self._share_pending.discard((shard, reg_key))
        host = self.hosts[shard]
        if not host.raft.is_leader:
            return  # a group's dispatcher runs on the shard's leader
        reg = host.state.topics.regs.get(reg_key)
        if reg is None:
            return
        q = reg.queue  # the group's work-queue policy and state (docs/work-queues.md), if any
        dead = q.dead if q is not None else {}
        if dead:
            self._dead_letter(host, reg_key)
        if not reg.members:
            return
        claims = reg.claims
        unclaimed = [o for o in reg.owed if o not in claims and o not in dead]
        if not unclaimed:
            return
        # Members connected anywhere in the cluster, as their session shards record it: the leader
        # of this shard is often not the node a member is connected to. A member connected here
        # has the room its window has; one elsewhere gets the claims its receive window could
        # hold, less those it has not acknowledged yet (its node delivers what is claimed). Only
        # the incarnation that joined is a member: a client id reconnected as a new session that
        # has not joined (or whose old session's leave is still to apply) is given nothing.
        members = reg.members
        online = [m for m, inc in members.items() if self._member_connected(m, inc)]
        if not online:
            return
        if q is not None and q.single_active:
            # One member receives: the active one (replicated). Offline, and holding nothing (what
            # it holds comes back when its session ends), it hands over to the first member
            # online in join order; the apply re-checks both and re-runs this dispatcher.
            active = q.active
            if active not in online:
                if (online[0] != active and (reg_key, active) not in self._share_activating
                        and not any(m == active for m, _ in reg.claims.values())):
                    self._share_activating.add((reg_key, active))
                    coverage.hit("share_single_active_handover")
                    fut = self.propose(shard, c.ShareActivate(reg_key, online[0], active))
                    if fut is not None:
                        def activated(f: asyncio.Future[Any], key: tuple[str, str] = (reg_key, active)) -> None:
                            consume_outcome(f)  # nobody awaits it: an error (outcome unknown) is retried
                            self._share_activating.discard(key)

                        fut.add_done_callback(activated)
                    else:
                        self._share_activating.discard((reg_key, active))
                return
            online = [active]
        outstanding: dict[str, int] = {}
        for member, inc in reg.claims.values():
            if members.get(member) == inc:
                outstanding[member] = outstanding.get(member, 0) + 1
        window = self.cfg.mqtt.receive_maximum
        room = {}
        for m in online:
            live = self.live.get(m)
            if live is not None and same_incarnation(live.incarnation, members[m]):
                room[m] = max(0, live._room())
            else:
                room[m] = max(0, window - outstanding.get(m, 0))
        # A single-active group has one member to give to: its commit order is every topic's order.
        sticky = self.cfg.share.dispatch == "sticky_topic" and not (q is not None and q.single_active)
        order = list(members)
        assigned: dict[str, list[int]] = {}
        rr = self._share_rr.get(reg_key, 0)
        declined = reg.declined  # offset -> members whose read ACL refused it: offered to the others
        timed_out = q.timed_out if q is not None else None  # offset -> the member it was taken back from
        for offset in unclaimed:
            refused = declined.get(offset) if declined else None
            avoid = timed_out.get(offset) if timed_out else None
            if sticky:
                meta = host.state.topics.meta.get(offset)
                topic = meta.topic if meta is not None else ""
                able = [m for m in order if m not in refused] if refused else order
                if not able:
                    continue
                member = able[shard_of(topic, len(able))]
                if member not in room or room[member] <= 0:
                    continue
            else:
                member = ""
                for _ in range(len(online)):
                    cand = online[rr % len(online)]
                    rr += 1
                    if room[cand] > 0 and not (refused and cand in refused) and cand != avoid:
                        member = cand
                        break
                if not member and avoid and room.get(avoid, 0) > 0 and not (refused and avoid in refused):
                    member = avoid  # the only member with room: back to the one it timed out with
                if not member:
                    if refused:
                        continue  # no online member with room that has not declined it: the next offset
                    break  # no room anywhere
            room[member] -= 1
            assigned.setdefault(member, []).append(offset)
        self._share_rr[reg_key] = rr
        now = self.now_ms() if q is not None and q.ack_timeout_ms > 0 else 0
        for member, offsets in assigned.items():
            self.propose(shard, c.ShareClaim(reg_key, member, tuple(offsets), members[member], now), want=False)

    def _dead_letter(self, host: ShardHost, reg_key: str) -> None:
        """Messages of a $share group past its delivery limit (``reg.queue.dead``, replicated): each is
        published to the dead-letter topic under a GUID derived from (group, shard, offset), then
        ShareDeadLettered releases it from the group. A leader change in between publishes it
        again, a duplicate the GUID history refuses: it appears once."""
        reg = host.state.topics.regs.get(reg_key)
        if reg is None or reg.share_group is None or reg.queue is None or not host.raft.is_leader:
            return
        shard = host.shard
        todo = [(o, n, last) for o, (n, last) in reg.queue.dead.items() if (shard, reg_key, o) not in self._dlq_pending]
        if not todo:
            return
        now = self.now_ms()
        msgs: list[tuple[int, StoredMessage]] = []
        for offset, n, last in todo:
            msg = host.message(offset)
            if msg is None:
                continue  # the shard failed, or not readable here now: tried again next round
            msgs.append((offset, dead_letter_message(self.cfg.share.dead_letter_topic, reg.share_group, reg.filter,
                                                     shard, offset, msg, n, last, now)))
            self._dlq_pending.add((shard, reg_key, offset))
        if msgs:
            task = asyncio.get_running_loop().create_task(self._publish_dead_letters(shard, reg_key, msgs))
            self._background.add(task)
            task.add_done_callback(self._background_done)

    async def _publish_dead_letters(self, shard: int, reg_key: str, msgs: list[tuple[int, StoredMessage]]) -> None:
        try:
            done: list[int] = []
            for offset, msg in msgs:
                fut = self.propose(self.topic_shard(msg.topic), c.Publish(msg))
                assert fut is not None
                res = await self.bounded(fut, -1)
                if res.status in ("ok", "duplicate"):
                    done.append(offset)
                else:
                    log.warning("$share dead letter of shard %d offset %d refused: %s", shard, offset, res.reason)
            if done:
                fut = self.propose(shard, c.ShareDeadLettered(reg_key, tuple(done)))
                assert fut is not None
                moved = await self.bounded(fut, shard)
                self.share_dead_lettered += len(moved)
        finally:
            for offset, _ in msgs:
                self._dlq_pending.discard((shard, reg_key, offset))

    def _share_timers(self, host: ShardHost, now: int) -> None:
        """On the shard's leader, each housekeeping round: claims of connected members held past
        their group's ack timeout go back (ShareTimeout, decided again at apply by the entry's
        time), dead letters not yet published are tried again, and groups with unclaimed messages
        and a member online are dispatched."""
        topics = host.state.topics
        was_online = self._share_online_since.get(host.shard, {})
        online_since: dict[tuple[str, int], tuple[int, int]] = {}
        for reg_key in list(topics.share_keys):
            reg = topics.regs.get(reg_key)
            if reg is None or reg.share_group is None:
                continue
            q = reg.queue
            if q is not None and q.dead:
                self._dead_letter(host, reg_key)
            if (len(reg.owed) > len(reg.claims) + (len(q.dead) if q is not None else 0)
                    and any(self._member_connected(m, inc) for m, inc in reg.members.items())):
                # A safety net: a member's connection applied in its session shard's replica here
                # after the group's last change (nothing else would dispatch to it until the next).
                self._schedule_dispatch(host.shard, reg_key)
            if q is None or q.ack_timeout_ms <= 0 or not q.claim_ts:
                continue
            held: dict[tuple[str, int], list[tuple[int, int]]] = {}
            for offset, at in q.claim_ts.items():
                holder = reg.claims.get(offset)
                if holder is not None:
                    held.setdefault(holder, []).append((offset, at))
            for (member, inc), claims in held.items():
                if not self._member_connected(member, inc):
                    online_since[(member, inc)] = (OFFLINE_EPOCH, 0)  # its next connection is a new one
                    continue  # offline: its session's end returns them (MQTT: resent on reconnect)
                # A member seen to reconnect (a new epoch of its session) while holding claims
                # has the timeout from then: its resends need time too. The apply checks only a
                # claim's age, so this can only make a timeout later, never earlier.
                sess = self.hosts[self.session_shard(member)].state.sessions.sessions.get(member)
                epoch = sess.epoch if sess is not None else -1
                prev = was_online.get((member, inc))
                since = 0 if prev is None else prev[1] if prev[0] == epoch else now
                online_since[(member, inc)] = (epoch, since)
                offsets = [o for o, at in claims if now - max(at, since) >= q.ack_timeout_ms]
                if not offsets:
                    continue
                log.info("$share group %s: client %s held %d message(s) past share.ack_timeout_s: taken back",
                         reg.share_group, member, len(offsets))
                self.share_ack_timeouts += len(offsets)
                self.propose(host.shard, c.ShareTimeout(now, reg_key, member, inc, tuple(offsets)), want=False)
        self._share_online_since[host.shard] = online_since

    def _member_connected(self, client_id: str, inc: int) -> bool:
        """Whether ``client_id``'s session incarnation ``inc`` is connected: here, or on some node as
        its session shard records it (LEGACY_INC: any incarnation)."""
        live = self.live.get(client_id)
        if live is not None and same_incarnation(live.incarnation, inc):
            return True
        if self.link is None:
            return False
        sess = self.hosts[self.session_shard(client_id)].state.sessions.sessions.get(client_id)
        return sess is not None and sess.connected and same_incarnation(sess.incarnation, inc)

    def on_ack_room(self, client_id: str) -> None:
        """A member freed window room: its share groups may dispatch again."""
        live = self.live.get(client_id)
        if live is None:
            return
        sess = live.session()
        if sess is None:
            return
        for shard, reg_key in self._session_views(sess).shares:
            self._schedule_dispatch(shard, reg_key)

    def _after_commit(self) -> None:
        for host in self.hosts:
            if host.failed is None and host.wants_snapshot():
                host.start_snapshot()  # off the loop; _snapshot_saved marks it in the WAL

    def _snapshot_saved(self, host: ShardHost, index: int, term: int) -> None:
        """A snapshot is durable (file and store records): the WAL may drop the group's entries up to it."""
        self.wal.mark_snapshot(host.shard, index, term)
        if getattr(self, "commit", None) is not None:
            self.commit.kick(host.shard)

    def _snapshot_installed(self, host: ShardHost) -> None:
        """A replica installed its leader's snapshot: what sessions here were told to deliver from
        the old state is reloaded from the new one."""
        self._views.clear()
        for live in list(self.live.values()):
            sess = live.session()
            if sess is not None and not live.closed:
                live._load_pending(sess)
                live.wake()

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        self.stopping.set()

    # --- housekeeping (leader-stamped times) -----------------------------------------------------------
    async def _housekeeping_loop(self) -> None:
        interval = self.cfg.shard.housekeeping_interval_s
        while not self.stopping.is_set():
            await asyncio.sleep(interval)
            now = self.now_ms()
            for host in self.hosts:
                if host.failed is not None or not host.raft.is_leader:
                    continue  # leader-proposed: entry times are the leader's, and proposed once
                try:
                    t = host.state.topics
                    if t.meta or t.dedup:
                        self.propose_lazy(host.shard, c.Housekeeping(now, self._pin_floor(host.shard, now)))
                    self._share_timers(host, now)
                    sessions = host.state.sessions.sessions.values()
                    if any(lease_lapsed(s, now) for s in sessions):
                        coverage.hit("owner_lease_lapsed")
                    if any(not s.connected or lease_lapsed(s, now) for s in sessions):
                        await self._session_housekeeping(host.shard)  # wills due, expiry, owners gone
                except (ShardUnavailable, ProposalDropped, NodeFailure) as exc:
                    # One shard's trouble (a failed will publish, a full proposal queue) must not
                    # stop retention and reclaim for every other shard: it is tried next round.
                    log.warning("shard %d: housekeeping deferred: %s", host.shard, exc)
            self._prune_share_rr()
            self._reclaim()

    def _prune_share_rr(self) -> None:
        """Round-robin positions of $share groups that no longer exist here go (one entry per group
        ever seen otherwise: a client creating groups would grow it without bound)."""
        self._housekeeping_rounds += 1
        if not self._share_rr or self._housekeeping_rounds % 60:
            return  # every 60th round: a scan of every registration is not for every second
        live_keys = {k for h in self.hosts for k in h.state.topics.regs if self.is_share_key(k)}
        for key in [k for k in self._share_rr if k not in live_keys]:
            del self._share_rr[key]

    async def _session_housekeeping(self, shard: int) -> None:
        fut = self.propose(shard, c.SessionHousekeeping(self.now_ms()))
        assert fut is not None
        wills, ended = await fut
        for sess, will in wills:
            await self._publish_will(sess, will)
        for sess in ended:
            await self._end_session(sess, "session_expired")

    async def _publish_will(self, sess: Session, will: c.WillSpec) -> None:
        coverage.hit("will_published")
        props = msgspec.msgpack.decode(will.props, type=MessageProps) if will.props else None
        msg = StoredMessage(
            will.topic, will.payload, will.qos, will.retain, guid128(sess.client_id, sess.incarnation, sess.epoch, "will"),
            self.now_ms(), will.expiry_s, props, sess.client_id,
        )
        await self.publish(msg, principal="")

    def _pin_floor(self, shard: int, now: int) -> int:
        floor = -1
        for reader, (offsets, deadline) in list(self.pins.items()):
            if deadline * 1000 < now:
                del self.pins[reader]
                continue
            o = offsets.get(shard)
            if o is not None and (floor < 0 or o < floor):
                floor = o
        return floor

    def _reclaim(self) -> None:
        try:
            if len(self.wal.segment_paths()) > 2:
                # Idle groups pin old segments: snapshot them so the segments can go.
                for shard in self.wal.groups_pinning_oldest_segment():
                    host = self.groups[shard] if shard < len(self.groups) else None
                    if host is not None and host.failed is None:
                        host.start_snapshot()  # _snapshot_saved marks it in the WAL
            if self.wal.reclaim():
                coverage.hit("wal_segment_reclaimed")
            for host in self.groups:
                if host.store.reclaim():
                    coverage.hit("store_segment_reclaimed")
        except OSError as exc:
            log.error("reclaim failed: %s", exc)

    # --- shutdown ----------------------------------------------------------------------------------
    async def stop(self) -> None:
        for live in list(self.live.values()):
            await live.close()
        await self.hand_over_leadership(timeout_s=min(self.cfg.shutdown_drain_s, 3.0))
        if not await self.commit.flush(timeout_s=1.0):  # acks and reports proposed lazily, too
            log.warning("stopping: the last proposals were not synced within 1 s")
        await self.supervisor.stop()
        await cancel_all(list(self._background))
        if self.link is not None:
            await self.link.close()
        self.commit.stop()
        for host in self.groups:
            try:
                if host.failed is None:
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

    def iter_drops(self) -> Iterable[dict[str, Any]]:
        for host in self.hosts:
            for d in host.state.topics.drops:
                yield {"guid": d.guid.hex(), "reason": d.reason, "shard": host.shard, "offset": d.offset,
                       "session": d.reg_key.partition("\x00")[0] if not self.is_share_key(d.reg_key) else None,
                       "subscription": d.reg_key.replace("\x00", "/")}
