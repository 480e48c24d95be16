"""Bringing a node up: lock the data directory, open the WAL, read or write cluster.json,
recover every group (shards and the metadata group) from its snapshot and log, and, in a
cluster, start the link and learn the initial members before the groups open."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
from functools import partial
from typing import TYPE_CHECKING, Any

from moorline import coverage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from moorline.config import ConfigError
from moorline.hashing import guid128
from moorline.invariant import invariant
from moorline.node.replication.cluster_join import join_cluster
from moorline.node.replication.cluster_link import ClusterLink
from moorline.node.replication.cluster_spec import ClusterSpec, parse_cluster, parse_hostport
from moorline.node.replication.group_commit import stage_hard_state, stage_ready
from moorline.node.replication.membership import refuse_if_left
from moorline.node.replication.placement import ShardPlacement, layout_fingerprint, place_shards
from moorline.node.replication.raft_group import build_replica, encode_vote
from moorline.node.replication.reader import ShardReader
from moorline.node.replication.reader_feed import FeedLimits, ReaderFeeds
from moorline.node.replication.shard_host import ApplyHooks, ShardHost, default_limits
from moorline.node.replication.snapshot_install import recover_install
from moorline.node.replication.snapshots import recorded_members
from moorline.raft import MemberId
from moorline.storage.dirlock import DataDirLock
from moorline.storage.fsutil import write_file_atomically
from moorline.storage.identity import load_or_create_storage_id, next_boot_number
from moorline.storage.msgstore import MessageStore, StoreCorruption
from moorline.storage.snapshots import SnapshotStore
from moorline.storage.wal import WriteAheadLog

if TYPE_CHECKING:
    from moorline.node.node import Node

log = logging.getLogger("moorline.node")
SINGLE_NODE_ID = 1  # a node started without cluster flags is member 1 of every group


class Startup:
    """Opens the node's storage and groups (``Node.open`` / ``open_async``)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def open(self) -> None:
        """One node: every shard a group of one voter, this node."""
        self.node.prepare()
        me = self.node.node_name(self.node.member[0])
        self.node.open_groups({me: self.node.member}, [ShardPlacement((me,), ())] * self.node.shard_count)

    def prepare(self, node_id: int = SINGLE_NODE_ID, cluster_key: str | None = None) -> None:
        """Lock the data directory, learn this node's identity, open the WAL (no groups yet).
        ``cluster_key`` (cluster mode) makes the shards' incarnations the same on every node."""
        refuse_if_left(self.node.data_dir)  # a node that left its cluster does not start again
        self.node.dir_lock = DataDirLock(self.node.data_dir)
        self.node.dir_lock.acquire()  # before anything is opened: DataDirInUse / DataDirUnusable
        # Half of this node's Raft identity (node id, storage id): a wiped data directory is a new
        # member. Data written by a single node before ids existed adopts one (it never voted
        # anywhere else); a cluster member's never does. First, so a new directory gets it first.
        self.node.storage_id = load_or_create_storage_id(self.node.data_dir, self.node.seams.random_bytes,
                                                    adopt_existing=cluster_key is None)
        self.node.cluster_meta = self._cluster_meta(cluster_key)
        self.node.member = (node_id, self.node.storage_id)
        self.node.boot = next_boot_number(self.node.data_dir)
        self.node.wal = WriteAheadLog(
            self.node.data_dir / "wal", segment_bytes=self.node.cfg.storage.wal_segment_bytes,
            max_pending_bytes=self.node.cfg.storage.max_pending_bytes, ledger=self.node.ledger,
            preallocate=self.node.cfg.storage.wal_preallocate,
        )
        self._recovery = self.node.wal.open()  # WalCorruption here refuses to start, naming file and offset
        for torn in self._recovery.torn_tails:  # names the sync batch and how many records went
            log.warning("WAL %s", torn.describe())
        self.node.snapshots = SnapshotStore(self.node.data_dir / "snapshots", ledger=self.node.ledger)

    def open_groups(self, members: dict[str, MemberId], placement: list[ShardPlacement]) -> None:
        """Every shard's replica, recovered and applied up to what its log commits. ``placement``
        names each shard's voters (this node among them or not: the others are learners) and its
        preferred leader. With one voter the node campaigns at once; in a cluster the preferred
        leader (spreading leaders) campaigns at its first start and elections do the rest."""
        rec, meta = self._recovery, self.node.cluster_meta
        limits = default_limits(self.node.cfg, self.node.faults.dedup_at_propose_only)
        if self.node.faults.dlq_count_not_replicated:  # a deliberately broken build (tests only)
            limits = dataclasses.replace(limits, dlq_count_not_replicated=True)
        hooks = ApplyHooks(on_effects=self.node.fanout.on_effects, on_results=self.node.lifecycle.on_results,
                           send=self.node.router.send_raft, forward=self.node.router.forward, now_ms=self.node.now_ms)
        invariant(len(placement) == self.node.shard_count, "one placement per shard")
        self.node.placement = placement
        self.node.member_ids = members
        # The metadata group (group id shard.count): every initial node votes in it (1, 3 or 5).
        meta_voters = [members[name] for name in sorted(members)]
        self.node.preferred_leader = [members[p.preferred_leader] for p in placement] + [meta_voters[0]]
        corrupted = {r.group: r for r in rec.corrupted if r.group is not None}
        for shard in range(self.node.shard_count + 1):
            is_meta = shard == self.node.shard_count
            voters = meta_voters if is_meta else [members[name] for name in placement[shard].voters]
            learners = [] if is_meta else [members[name] for name in placement[shard].learners]
            finished = recover_install(self.node.data_dir, shard, self.node.snapshots, self.node.wal, rec.groups.get(shard))
            if finished:
                log.warning("shard %d: %s", shard, finished)
            left = shard in rec.removed  # this node dropped its copy once (leave_group): only a
            if left:  # snapshot marked after that is its own; the older ones (and stored messages) go
                self._drop_stale_snapshots(shard, rec.groups.get(shard))
            loaded = self.node.snapshots.load_latest(shard)
            snap_index = snap_term = 0
            if loaded is not None:
                snap_index, snap_term, data = loaded
                state = ShardState.restore(data, limits, self.node.cfg.session.max_expiry_s)
                coverage.hit("snapshot_restored")
            else:
                state = ShardState(shard, "meta" if is_meta else meta["incarnations"][shard], limits,
                                   self.node.cfg.session.max_expiry_s)
            store = MessageStore(  # the metadata group's stays empty: it takes no publishes
                self.node.data_dir / "store" / ("meta" if is_meta else f"shard-{shard}"), segment_bytes=self.node.cfg.storage.store_segment_bytes,
                ledger=self.node.ledger, cache_bytes=0,  # recent messages are kept decoded, node-wide (self.node.recent)
            )
            store_damage: StoreCorruption | None = None
            try:
                store.open()
                store.truncate_from(state.topics.next_offset)
            except StoreCorruption as exc:  # one bad store stops its shard, never the node
                store_damage = exc  # the store is closed and touches its files no more
            grec = rec.groups.get(shard)
            hs = grec.hard_state if grec is not None else None
            voters, learners = recorded_members(self.node.snapshots.loaded_meta(shard), voters, learners)
            raft, raft_log = build_replica(
                self.node.member, voters, learners, snap_index, snap_term,
                [(e.term, e.index, e.type, e.data) for e in grec.entries] if grec is not None else [],
                (hs.term, hs.vote, hs.commit) if hs is not None else None, state.applied_index,
                random.Random(f"{self.node.storage_id}/{shard}"), election_tick=self.node.cfg.raft.election_ticks,
                max_entry_bytes=self.node.cfg.raft.max_entry_bytes,
            )
            host = ShardHost(shard, state, raft, raft_log, store, self.node.snapshots, hooks,
                             self.node.cfg.shard.snapshot_every_entries, self.node.cfg.raft.max_entry_bytes, self.node.recent)
            host.node_id, host.boot = self.node.member[0], self.node.boot
            host.check_admission()  # a snapshot whose admission of this node is past this boot
            host.max_pending_proposals = self.node.cfg.raft.max_pending_proposals
            host.proposer.entry_format = self.node.cfg.cluster.entry_format
            host.snapshot_settings = self.node.snapshot_settings
            host.faults = self.node.faults
            if self.node.link is not None and not is_meta:
                self._attach_reader_feeds(host, limits)
                if left and host.reader is not None and not raft_log.last_index():
                    host.reader.member = False  # left, and not added again since: read through a feed
            self.node.groups.append(host)
            if is_meta:
                self.node.meta_host = host
            else:
                self.node.hosts.append(host)
            if shard in corrupted or store_damage is not None:
                raft.mark_corrupted()  # never leads, never votes with a log it cannot vouch for
            else:
                fresh = raft_log.last_index() == 0 and hs is None
                if voters == [self.node.member] or (fresh and self.node.preferred_leader[shard] == self.node.member):
                    raft.campaign()  # one voter: leader at once, with a no-op of a new term
                self.recover_group(host)
            present = set(state.topics.meta)
            # What the state no longer keeps goes from the store, also under its low-water mark
            # (records released before a restart are kept again when the files are read). Not from
            # a damaged store: closed and empty, it keeps nothing (and its next offset is 0).
            gone = [o for o in store.kept_below(store.low_water) if o not in present]
            gone += [o for o in range(store.low_water, state.topics.next_offset) if o not in present]
            if gone and store_damage is None:
                store.release(gone)
            if store_damage is not None:
                host.fail(f"checksum failure in synced data: {store_damage}")
                log.error("shard %d refuses service: %s", shard, host.failed)
            elif shard in corrupted:
                r = corrupted[shard]
                host.fail(f"checksum failure in synced data: {r.path} at offset {r.offset}: {r.message}")
                log.error("shard %d refuses service: %s", shard, host.failed)
        if self.node.faults.drop_on_restart:
            self._test_drop_last_messages()

    async def open_async(self) -> None:
        """``open`` for either mode: with cluster settings, start the link to the peers, learn (or
        recall) every initial member's storage id, then open the groups with all of them as voters."""
        joined = self._joined_record()
        if joined is not None or self.node.cfg.cluster.join is not None:
            await self._open_joined(joined)
            return
        spec = parse_cluster(self.node.cfg.cluster)
        if spec is None:
            self.node.open()
            return
        cluster_key = f"{self.node.cfg.cluster.cluster_id}/{','.join(spec.names)}"
        self.node.prepare(spec.my_id, cluster_key)
        replicas = self.node.cluster_meta.get("replicas", len(spec.names))  # clusters from before placement: all voters
        if replicas != self.node.cfg.shard.replicas:
            log.warning("this cluster was created with shard.replicas = %d; using that (it is fixed at creation)",
                        replicas)
        learners = self.initial_learners(self.node.cluster_meta.get("learners", "all"))
        layout = layout_fingerprint(self.node.shard_count, replicas, len(spec.names))
        link = ClusterLink(spec, self.node.cfg.cluster, self.node.storage_id, self.known_members(), self.node.seams.rng(), layout,
                           seams=self.node.seams)
        self.attach_cluster(link)
        await link.start(self.node.supervisor)  # its announce and clock loops are supervised
        members = await link.wait_for_members(self.node.cfg.cluster.bootstrap_timeout_s)
        self.save_members(members)
        ids = {name: (spec.node_id(name), sid) for name, sid in members.items()}
        self.node.open_groups(ids, place_shards(cluster_key, spec.names, self.node.shard_count, replicas, learners))

    def _joined_record(self) -> dict[str, Any] | None:
        """cluster.json's record of a node that joined (not in --initial-cluster), if this is one."""
        path = self.node.data_dir / "cluster.json"
        if not path.exists():
            return None
        joined = json.loads(path.read_text()).get("joined")
        return joined if isinstance(joined, dict) else None

    async def _open_joined(self, joined: dict[str, Any] | None) -> None:
        """A node that joined a running cluster: at its first start (``--join``) a live member binds
        its storage to the entry an operator admitted and tells it the cluster; the answer is kept in
        cluster.json, from which every later start opens (``--join`` again or not). Its groups open
        with the cluster's initial configuration, this node in none of them: the reconciler adds it
        as a learner of each (it catches up by snapshot transfer, then the log), then promotes it."""
        cfg = self.node.cfg.cluster
        if cfg.initial_cluster is not None:
            raise ConfigError("--join and --initial-cluster are exclusive" if joined is None else
                              f"this data directory ({self.node.data_dir}) is a node that joined its cluster: start "
                              f"it without --initial-cluster")
        if cfg.node_id is None or cfg.listen is None:
            raise ConfigError("--join needs --node-id (the name it was admitted under) and --cluster HOST:PORT")
        me = cfg.node_id
        listen = parse_hostport(cfg.listen, "--cluster")
        if joined is None:
            if (self.node.data_dir / "cluster.json").exists():
                raise ConfigError(f"this data directory ({self.node.data_dir}) belongs to a member of a cluster "
                                  f"started with --initial-cluster: start it so, or join on a new, empty directory")
            assert cfg.join is not None
            seeds = [parse_hostport(x.strip(), "--join") for x in cfg.join.split(",") if x.strip()]
            if not seeds:
                raise ConfigError("--join needs HOST:PORT[,HOST:PORT...] of live members' cluster listeners")
            refuse_if_left(self.node.data_dir)
            self.node.data_dir.mkdir(parents=True, exist_ok=True)
            storage_id = load_or_create_storage_id(self.node.data_dir, self.node.seams.random_bytes,
                                                   adopt_existing=False)
            welcome = await join_cluster(cfg, me, listen, storage_id, seeds, self.node.seams.rng(), self.node.seams)
            if welcome.get("cluster_id") != cfg.cluster_id:
                raise ConfigError(f"--join: the cluster is {welcome.get('cluster_id')!r}, cluster.cluster_id here "
                                  f"{cfg.cluster_id!r}")
            joined = {k: welcome[k] for k in ("node_id", "names", "initial", "shard_count", "replicas", "members")}
            # (a member from before shard.learners sends none: its cluster started with learners everywhere)
            joined["learners"] = welcome.get("learners", "all")
        names = tuple(str(n) for n in joined["names"])
        if self.node.shard_count != joined["shard_count"]:
            log.warning("the cluster has %d shards; using that (shard.count is fixed at creation)", joined["shard_count"])
            self.node.shard_count = int(joined["shard_count"])
        cluster_key = f"{cfg.cluster_id}/{','.join(names)}"
        node_id = int(joined["node_id"])
        self.node.prepare(node_id, cluster_key)
        replicas = int(joined["replicas"])
        learners = self.initial_learners(str(joined.get("learners", "all")))
        if (self.node.cluster_meta.get("joined") != joined or self.node.cluster_meta.get("replicas") != replicas
                or self.node.cluster_meta.get("learners") != learners):
            self.node.cluster_meta["joined"] = joined
            self.node.cluster_meta["replicas"] = replicas
            self.node.cluster_meta["learners"] = learners
            write_file_atomically(self.node.data_dir / "cluster.json", json.dumps(self.node.cluster_meta).encode())
        ids: dict[str, int] = {me: node_id}
        addresses: dict[str, tuple[str, int]] = {me: listen}
        known: dict[str, str] = {}
        for name, (nid, cluster, sid) in joined["members"].items():
            if name != me and cluster:
                ids[name] = int(nid)
                addresses[name] = parse_hostport(cluster, f"member {name}'s cluster address")
                known[name] = sid
        spec = ClusterSpec(me, names, addresses, listen, ids)
        layout = layout_fingerprint(self.node.shard_count, replicas, len(names))
        link = ClusterLink(spec, cfg, self.node.storage_id, known, self.node.seams.rng(), layout, seams=self.node.seams)
        self.attach_cluster(link)
        await link.start(self.node.supervisor)
        initial = {str(name): (int(nid), str(sid)) for name, nid, sid in joined["initial"]}
        self.node.open_groups(initial, place_shards(cluster_key, names, self.node.shard_count, replicas, learners))

    def initial_learners(self, created: str) -> str:
        """The ``shard.learners`` the cluster was created with (``created``, from cluster.json or the
        join welcome), which the groups' initial configurations are placed with on every start. Not
        this node's current setting: every replica must start a group from the same configuration,
        or a change naming a learner that only some of them start with (a promotion) would be a
        no-op on the others, which would then count a different set of voters. Switched later, the
        setting is carried out by the reconciler, through configuration changes every replica applies."""
        if created not in ("all", "none"):
            raise ConfigError(f"cluster.json in {self.node.data_dir} records shard.learners = {created!r}: "
                              f"'all' or 'none' expected")
        if created != self.node.cfg.shard.learners:
            log.info("this cluster was created with shard.learners = %r: its shards start from that placement, and "
                     "the reconciler brings them to %r", created, self.node.cfg.shard.learners)
        return created

    def attach_cluster(self, link: ClusterLink) -> None:
        """Raft traffic of this node's groups goes through ``link`` from now on."""
        self.node.link = link
        link.on_raft = self.node.router.on_raft_message
        link.on_forward = self.node.router.on_forwarded
        link.on_reader = self.node.router.on_reader
        link.hosts = self.node.groups  # a snapshot transfer reads and installs through the hosts

    def known_members(self) -> dict[str, str] | None:
        members = self.node.cluster_meta.get("members")
        return dict(members) if isinstance(members, dict) else None

    def save_members(self, members: dict[str, str]) -> None:
        """The initial members' storage ids, once known: a restart needs no bootstrap, and a peer
        that comes back with other storage is recognised as wiped."""
        if self.node.cluster_meta.get("members") == members:
            return
        self.node.cluster_meta["members"] = dict(sorted(members.items()))
        write_file_atomically(self.node.data_dir / "cluster.json", json.dumps(self.node.cluster_meta).encode())

    def _attach_reader_feeds(self, host: ShardHost, limits: TopicLimits) -> None:
        """Cluster mode: the shard feeds the nodes that hold no replica of it while this node leads
        it (reader_feed.py); with shard.learners = "none" this node reads it from its leader while
        it is no member of its group (reader.py)."""
        node, link = self.node, self.node.link
        assert link is not None
        clock = node.clock.monotonic
        cl = node.cfg.cluster
        limits_of_feeds = FeedLimits(cl.feed_max_items, cl.feed_max_bytes, cl.feed_resend_s, cl.feed_heartbeat_s,
                                     cl.feed_max_queued_bytes)
        host.feeds = ReaderFeeds(host, link.send_reader, clock, limits_of_feeds, node.next_feed_id)
        host.feeds.skip_on_resend = node.faults.stream_resume_skips_one
        if node.cfg.shard.learners == "none":
            host.reader = ShardReader(
                host, node.member[0], link.node_ids, link.send_reader, clock, limits,
                node.cfg.session.max_expiry_s, node.housekeeping.snapshot_installed,
                node.lifecycle.session_record_set, silence_s=cl.feed_silence_s)
            host.reader.member = host.node_member()

    def _drop_stale_snapshots(self, shard: int, grec: Any) -> None:
        """The group's snapshot files from before this node dropped its copy (any but the one the
        WAL marked since): void, and deleted now that the WAL's removal record is durable."""
        keep = grec.snapshot_index if grec is not None else 0
        for index, _, path in self.node.snapshots.list_snapshots(shard):
            if index != keep or keep == 0:
                path.unlink(missing_ok=True)

    def leave_group(self, host: ShardHost) -> None:
        """This node was removed from ``host``'s group and reads the shard through a reader feed
        from now on (shard.learners = "none"): its copy goes. The WAL forgets the group (its
        entries pin no segment once synced), the host gets an empty state and a core that is no
        member (so a later re-add starts from nothing, as for a new member), and once that record
        is synced the group's snapshots are deleted (a restart before then recovers the old copy and
        leaves again; one after it drops the stale snapshots and stored messages as it opens the
        group). The stored messages stay until then, or until a new copy's first append cuts them
        (``ShardHost.store_stale``) or an install replaces the store: the store is never cut under
        a snapshot install."""
        node, reader = self.node, host.reader
        assert reader is not None
        conf = host.raft.active_conf_state
        me = tuple(node.member)
        # Its term and vote stay (a member's promise outlives its copy: it may be added again under
        # the same identity, and must not vote twice in a term); everything else goes.
        term, vote = host.raft.term, host.raft.vote
        node.wal.remove_group(host.shard)
        node.wal.set_hard_state(host.shard, term, encode_vote(vote), 0)
        removed_at = node.wal.appended_seq()
        raft, raft_log = build_replica(
            node.member, [v for v in conf.voters if v != me], [x for x in conf.learners if x != me], 0, 0, [],
            (term, encode_vote(vote), 0), 0,
            random.Random(f"{node.storage_id}/{host.shard}/left"), election_tick=node.cfg.raft.election_ticks,
            max_entry_bytes=node.cfg.raft.max_entry_bytes)
        host.raft, host.raft_log = raft, raft_log
        node.recent.drop(host.shard, list(host.state.topics.meta))  # the cached copies of its messages too
        limits = default_limits(node.cfg, node.faults.dedup_at_propose_only)
        host.state = ShardState(host.shard, host.state.topics.incarnation, limits, node.cfg.session.max_expiry_s)
        host.entries_since_snapshot = 0
        host.store_stale = host.store.next_offset > 0
        reader.leave(sorted({*node.connections, *node.live}))
        node.commit.kick(host.shard)
        log.info("shard %d: this node was removed from the group: its copy goes, the shard is read from its leader",
                 host.shard)

        async def delete_files() -> None:
            while node.wal.synced_seq() < removed_at and not node.stopping.is_set():
                await asyncio.sleep(0.05)
            if node.stopping.is_set() or not host.reads_remotely:
                return
            for _, _, path in node.snapshots.list_snapshots(host.shard):
                path.unlink(missing_ok=True)

        node.run_in_background(asyncio.get_running_loop().create_task(delete_files()))

    def recover_group(self, host: ShardHost) -> None:
        """Before serving: the new term's no-op is made durable, and with it the core hands out as
        committed every entry it may (after a snapshot: those the WAL kept), which are applied."""
        while host.failed is None:
            rd = host.seal()
            if rd is None:
                return
            stage_ready(self.node.wal, host.shard, rd)
            self.node.wal.sync()
            try:
                host.after_sync(partial(stage_hard_state, self.node.wal))
            except OSError:
                raise
            except Exception as exc:  # a replayed entry this code cannot apply stops its shard only
                host.fail_on_bug("recovery apply", exc)

    def _cluster_meta(self, cluster_key: str | None = None) -> dict[str, Any]:
        path = self.node.data_dir / "cluster.json"
        if path.exists():
            meta: dict[str, Any] = json.loads(path.read_text())
            if meta["shard_count"] != self.node.shard_count:
                log.warning("data dir was created with %d shards; using that (shard.count is fixed at creation)",
                            meta["shard_count"])
                self.node.shard_count = meta["shard_count"]
            invariant(meta.get("hash") == "crc32c", "unknown placement hash")
            return meta
        meta = {
            "shard_count": self.node.shard_count,
            "hash": "crc32c",
            # A shard's incarnation is the same on every replica: drawn at random by a single node,
            # derived from the cluster's key (id and initial members) in a cluster.
            "incarnations": [self.node.seams.random_bytes(8).hex() if cluster_key is None else
                             guid128(cluster_key, shard)[:8].hex() for shard in range(self.node.shard_count)],
            "created_ms": self.node.clock.wall_ms(),
            # (a cluster's, fixed at its creation: learners are what its groups' first configuration has)
            **({} if cluster_key is None else {"replicas": self.node.cfg.shard.replicas,
                                               "learners": self.node.cfg.shard.learners}),
        }
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.node.data_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return meta

    def _test_drop_last_messages(self) -> None:
        """Deliberately broken build (Faults.drop_on_restart): lose each shard's newest message."""
        for host in self.node.hosts:
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
