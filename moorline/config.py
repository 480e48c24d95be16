"""Configuration: every limit has a key and a default (docs/design.md, "Limits").

Loaded from a TOML file whose tables mirror the dataclasses below, e.g.::

    [session]
    max_queued_messages = 100000

Unknown keys are an error, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
SHARD_LEARNERS = ("all", "none")  # shard.learners


class ConfigError(ValueError):
    """The configuration file or a command-line option is invalid."""


@dataclass
class ListenerConfig:
    mqtt: str = "127.0.0.1:1883"
    # 8888, as VerneMQ's HTTP listener: 8883 is MQTT over TLS's registered port, 8080 any web server's.
    http: str = "127.0.0.1:8888"
    max_connections: int = 10_000
    # Sockets that have not completed CONNECT (not yet authenticated): a cap of their own, so a flood
    # of idle or slow handshakes cannot take every connection slot. Each holds at most
    # mqtt.max_connect_packet_bytes, for at most mqtt.connect_timeout_s.
    max_pending_connections: int = 1000
    # New connections per second from one address (IPv6: one /64), a token bucket holding
    # connection_burst_per_address; refused ones are closed at once. 0 = no limit. With the defaults
    # one address holds at most 100 + 20 x connect_timeout_s (10) = 300 pending sockets.
    max_connection_rate_per_address: float = 20.0
    connection_burst_per_address: int = 100
    rate_limit_tracked_addresses: int = 10_000  # buckets kept; the least recently seen address goes first
    # Loopback peers are local processes (a TLS terminator or bridge forwarding many clients, tests):
    # not rate-limited unless this is set.
    rate_limit_loopback: bool = False
    # Further listeners, HOST:PORT each, off when unset: MQTT over TLS (8883 by convention), HTTPS (the
    # HTTP API over TLS, beside the plain one), MQTT over WebSocket and over secure WebSocket (path /mqtt,
    # subprotocol mqtt). TLS ones need tls.cert_file and tls.key_file.
    mqtts: str | None = None
    https: str | None = None
    ws: str | None = None
    wss: str | None = None
    # After the broker's WebSocket close frame, the client's is awaited this long before the socket is dropped.
    ws_close_timeout_s: float = 2.0
    # Origins (``scheme://host[:port]``) whose web pages may open MQTT over WebSocket; a browser's
    # upgrade from any other Origin is refused (403). Empty: only pages served by the same host and
    # port as the listener. "*" allows every Origin. A client that sends no Origin (not a browser) is
    # not affected.
    ws_allowed_origins: list[str] = field(default_factory=list)
    # HOST:PORT of this node's MQTT listener as clients should reach it: announced to the cluster's
    # peers, which name it in the Server Reference of an MQTT 5 CONNACK / DISCONNECT 0x9C (use another
    # server) while they drain. Unset: the bound mqtt address (a wildcard host replaced by --cluster's).
    advertise: str | None = None


@dataclass
class HttpConfig:
    """Bounds of the HTTP API (moorline/node/admin/http_api.py, docs/security.md)."""

    max_body_bytes: int = 8 << 20  # a larger request body is refused with 413 before it is read
    # A fetch looks at at most this many offsets per call (matching or not) and answers with
    # ``scanned_to``, where the next call continues: a filter that matches nothing never scans a
    # whole shard in one request.
    max_scan_per_fetch: int = 100_000
    scan_slice: int = 2_000  # offsets scanned between yields to the event loop
    max_answer_bytes: int = 8 << 20  # a fetch stops adding messages once its answer holds about this much
    # Host header names (besides the listener's own address, localhost and loopback addresses) a
    # request may carry: a name that resolves to this node by DNS rebinding is refused (421).
    allowed_hosts: list[str] = field(default_factory=list)
    # Origins whose pages may make state-changing requests (POST, PUT, DELETE); "*" allows all. A
    # request without Origin (curl, the Spark sink) is not affected; state-changing requests must
    # carry Content-Type: application/json either way (a page cannot send that cross-site unasked).
    allowed_origins: list[str] = field(default_factory=list)
    # The web console (docs/console.md): live streams (GET /v1/console/stream) open at once, their
    # update interval (0.5 s or more: at most 2 updates a second), the rate history they start with,
    # and the largest page of an admin list (clients, sessions, retained, groups; and the most
    # retained messages one DELETE /v1/retained clears).
    max_console_streams: int = 8
    console_update_interval_s: float = 1.0
    console_history_s: float = 300.0
    max_admin_page: int = 1000
    # GET /v1/clients and DELETE /v1/clients/{id} ask the other nodes' HTTP listeners: each answer
    # within this many seconds, or that node is reported unreachable.
    peer_request_timeout_s: float = 3.0


@dataclass
class MqttConfig:
    max_packet_size: int = 1 << 20  # never above raft.max_entry_bytes
    receive_maximum: int = 256  # inbound QoS>0 publishes in flight per connection (MQTT 5 Receive Maximum)
    max_inflight_out: int = 256  # outbound unacknowledged deliveries per session (when the client sets none)
    topic_alias_maximum: int = 64
    max_keepalive_s: int = 65535
    connect_timeout_s: float = 10.0  # a socket that sends no CONNECT in time is closed
    write_buffer_high_bytes: int = 4 << 20  # delivery pauses while a client's socket buffer is above this
    max_write_buffer_bytes: int = 16 << 20  # a client that stops reading is disconnected past this
    publish_timeout_s: float = 10.0  # outcome unknown after this: close the connection (0x89)
    # CONNECT, SUBSCRIBE and UNSUBSCRIBE whose commit does not come within this (a shard without a
    # quorum) are answered with a failure: CONNACK 0x88 (3.1.1: 3), SUBACK 0x80 for that filter.
    control_timeout_s: float = 15.0
    max_queued_packets: int = 1024  # decoded packets waiting for the handler before reading pauses
    # MQTT 5: add a "guid" user property to delivered messages that carry none, so a history can match
    # deliveries to publishes. Off by default: messages are forwarded unaltered (MQTT-3.3.2-17), and
    # parsing the extra property slows every MQTT 5 subscriber.
    stamp_guid_property: bool = False
    # Topic names and filters: every level of a filter is a trie node (~300 B) in each shard it is
    # registered in (all 16 for a wildcard), so depth is bounded first; Mosquitto allows 200 levels,
    # AWS IoT 8, real topics rarely pass 10. Length: topics in use are far shorter (AWS IoT caps them
    # at 256 B), while each byte is kept per retained topic, per stored message's index entry and per
    # registration; the protocol's own limit is 65535. Longer or deeper: SUBACK 0x8F (0x80 on 3.1.1)
    # for a filter, DISCONNECT 0x90 (a close on 3.1.1) for a PUBLISH, CONNACK 0x90 for a will.
    max_topic_levels: int = 32
    max_topic_length: int = 1024  # UTF-8 bytes
    # Bytes a socket may send before its CONNECT is accepted (the first packet's size, refused from
    # its fixed header on). A CONNECT is small, but a will payload may legitimately be up to 65535
    # bytes: 128 KiB leaves room for that plus credentials and properties, 8x below max_packet_size.
    max_connect_packet_bytes: int = 128 << 10
    # A packet that has begun to arrive must be complete within this, keepalive or not (a client
    # sending a byte now and then cannot hold a connection and its partial buffer for ever). Long
    # enough for a 1 MiB packet over a ~150 kbit/s link.
    packet_read_timeout_s: float = 60.0
    # A client id is kept in its session, its registrations' keys in every shard a filter reaches,
    # and every delivery batch: longer ids are refused at CONNECT (CONNACK 0x85; 3.1.1: return code
    # 2). MQTT requires servers to take at least 23 bytes; the protocol's own limit is 65535.
    max_client_id_bytes: int = 256


@dataclass
class SessionConfig:
    max_expiry_s: int = 7 * 24 * 3600
    max_queued_messages: int = 100_000  # oldest dropped first (counted)
    max_queued_bytes: int = 256 << 20
    # QoS 1 acks are committed in batches: those of this many ms, or (0) those read in one event-loop
    # pass, with no timer. A timer that ends while the loop is idle wakes it (20-40 us of CPU on this
    # VM), but per-pass batches are smaller: W2 measured 5-8 % more CPU with 0 (bench/README.md).
    ack_commit_interval_ms: float = 2.0
    max_subscriptions: int = 1000  # per session, whatever shards its filters reach (SUBACK 0x97)
    # Persistent sessions (expiry above 0) one user may hold: a CONNECT that would open one more is
    # refused with CONNACK 0x97 (3.1.1: return code 3). Checked against every session shard's
    # replica on the node (cluster-wide up to CONNECTs racing on other nodes) and, exactly, by
    # each session shard at apply: a user never holds more than this in one shard. Users with a
    # name only; anonymous clients share no per-user bound. 0: no bound.
    max_persistent_per_user: int = 1000
    delivery_batch_max: int = 256
    # Notices of owed messages a connected session keeps in memory per shard while its client does
    # not take them; past this they are dropped and read again from the shard's state later.
    max_pending_notices: int = 10_000
    # The node serving a session holds a lease on it in the session's shard, renewed every third
    # of it. A node that cannot renew (cut off from the shard's majority) closes the client's
    # connection before the lease ends; a new owner elsewhere serves only after it has run out.
    # Clocks may drift owner_lease_drift apart (both sides keep that margin).
    owner_lease_s: float = 10.0
    owner_lease_drift: float = 0.02


@dataclass
class RetentionConfig:
    min_age_s: float = 3600.0
    min_bytes: int = 0


@dataclass
class ShardConfig:
    count: int = 16
    # Voters per shard in a cluster (1, 3 or 5; every node when there are fewer). Fixed when the
    # cluster is created; the other nodes keep the shard as learners.
    replicas: int = 3
    # Which other nodes keep a copy of each shard: "all" (every node that is not a voter follows it
    # as a learner, so any node reads any shard from its own disk) or "none" (a shard lives on its
    # voters only; a node becomes a learner just while it catches up to be promoted to voter, by a
    # growth, a rebalance or a zone repair). Switched on a running cluster, the reconciler brings the
    # shards to it: with "none" it removes the learners no promotion needs, one group per round.
    learners: str = "all"
    max_bytes: int = 1 << 30
    reserved_headroom_bytes: int = 16 << 20  # publishes refused (0x97) before max_bytes - headroom
    snapshot_every_entries: int = 20_000
    housekeeping_interval_s: float = 1.0  # expiry / release commands proposed by the leader
    # Follow-ups a shard's leader derives each housekeeping round (sessions/followups.py): at most
    # this many acknowledged offsets reported again, and ghost registrations unregistered; 0: off.
    followups_max_per_round: int = 1024


@dataclass
class DedupConfig:
    history_window_s: float = 3600.0
    max_history: int = 250_000  # per shard; about 150 bytes an entry
    producer_ttl_s: float = 7 * 24 * 3600.0


@dataclass
class ProducerConfig:
    # A sequenced producer's sequence further than this past its highest applied one is refused
    # (PUBACK 0x83), never applied: accepted, it would make every later sequence a duplicate. The
    # Spark sink starts batch b at b << 32, so the default lets a producer skip 2**24 - 1 batches.
    max_seq_gap: int = 1 << 56


@dataclass
class ShareConfig:
    dispatch: str = "round_robin"  # or "sticky_topic"


@dataclass
class QueueConfig:
    """Work queues (docs/queues.md): policies of ``$share`` groups, by group name pattern."""

    # Group name patterns (fnmatch: "orders-*") whose groups are single-active: one member receives
    # at a time, the others stand by.
    single_active: list[str] = field(default_factory=list)
    # max_deliveries and ack_timeout_s apply to the groups matching these patterns.
    limited_groups: list[str] = field(default_factory=lambda: ["*"])
    max_deliveries: int = 0  # unacknowledged hand-outs before the dead-letter topic; 0: unlimited
    # "{group}" and "{topic}" are replaced by the group's name and the message's topic.
    dead_letter_topic: str = "$dlq/{group}/{topic}"
    # A connected member holding a message unacknowledged this long has its connection closed
    # (MQTT 5: DISCONNECT 0x83 "ack timeout"); its QoS 1 messages go back to the group. 0: off.
    ack_timeout_s: float = 0.0


# Keys that moved (a file using the old name gets an error naming the new one, never a silent alias).
MOVED_KEYS = {f"share.{k}": f"queue.{k}" for k in
              ("single_active", "limited_groups", "max_deliveries", "dead_letter_topic", "ack_timeout_s")}


@dataclass
class StorageConfig:
    wal_segment_bytes: int = 64 << 20
    store_segment_bytes: int = 16 << 20
    store_cache_bytes: int = 64 << 20  # node-wide: recently applied messages kept decoded for delivery
    max_pending_bytes: int = 64 << 20  # staged WAL bytes before proposers are slowed
    # A group commit whose write + fdatasync recently took at most this long runs on the event loop
    # itself: measured here, handing syncs of ~1-2 ms to a thread cost 30 % more CPU per message
    # (queue, futex, GIL waits after each system call, wake-up) and no throughput. Slower disks get
    # the sync thread so the loop keeps serving meanwhile. 0 = always the thread.
    inline_sync_max_us: int = 5000
    # Commands nobody waits for (ack reports, QoS 1 session acks, housekeeping) never force a sync
    # of their own: they ride on the next sync a proposer waits for, or go after this long.
    lazy_sync_delay_ms: int = 20
    # A busy WAL writes into segments a thread zero-filled ahead, so a group commit's fdatasync
    # writes data blocks only, not the file's size too (storage/prealloc.py). Costs one extra
    # segment of disk while a node is busy.
    wal_preallocate: bool = True
    # Shard snapshots are encoded off the event loop, in a forked child (a thread would hold the
    # GIL while it encodes), except for shards whose last snapshot was at most this big: a fork
    # costs more than encoding those on the loop. Writing and syncing always go to a thread.
    snapshot_inline_max_bytes: int = 512 << 10
    max_parallel_snapshots: int = 2  # snapshots being encoded / written at once, node-wide
    # The data directory is created 0700 and its files 0600 (messages are in them); a node refuses a
    # data directory that other users can read or enter, unless this is set (then group access is
    # accepted, never access by others).
    allow_group_read: bool = False


@dataclass
class RaftConfig:
    # One entry holds one batch of commands; appends to followers carry at most this much too.
    max_entry_bytes: int = 1 << 20
    # The logical clock of every group (cluster mode): heartbeats every tick, elections after
    # election_ticks..2*election_ticks ticks without a leader (100 ms x 10: 1-2 s).
    tick_interval_ms: float = 100.0
    election_ticks: int = 10
    # Entries a multi-voter group keeps in memory below its latest snapshot: a follower that lags
    # by fewer catches up from entries, one further behind is sent the snapshot (cluster.*snapshot*).
    follower_log_margin_entries: int = 50_000
    # Entries this node proposed to a shard that its own replica has not applied yet (waiting for
    # a leader, or resent to a new one). Past it new proposals are refused (they entered no log):
    # a leader that stays unreachable must not make the node hold every publish sent meanwhile.
    max_pending_proposals: int = 256


@dataclass
class ClusterTlsConfig:
    """The cluster link over TLS with mutual certificates (docs/cluster-transport.md): required
    whenever any cluster address is not loopback. Each node's certificate names it by the subject
    alternative name URI ``urn:moorline:node:<node_id>``; ca_file is the cluster's own CA."""

    cert_file: str | None = None  # PEM: this node's certificate (then any intermediates)
    key_file: str | None = None  # PEM private key
    ca_file: str | None = None  # PEM CA(s) that sign node certificates (use a CA only for nodes)
    crl_file: str | None = None  # optional PEM CRL: revoked node certificates are refused


@dataclass
class ClusterConfig:
    """Cluster mode (all unset: one node, zero configuration). Static bootstrap, etcd-style: every
    node is started with the same initial_cluster."""

    node_id: str | None = None  # this node's name in initial_cluster, e.g. "n1"
    listen: str | None = None  # HOST:PORT for peers; outgoing connections leave from this host
    initial_cluster: str | None = None  # "n1=HOST:PORT,n2=HOST:PORT,n3=HOST:PORT" (1, 3 or 5 nodes)
    # A node that was not in initial_cluster: HOST:PORT[,HOST:PORT...] of live members' cluster
    # listeners, asked at its first start (once admitted: `moorline cluster join`); later starts read
    # the cluster from the data directory's cluster.json.
    join: str | None = None
    # Shared secret: only for clusters whose every address is loopback (without cluster.tls the node
    # refuses any other address); without one the listener must be on loopback.
    secret_file: str | None = None
    tls: ClusterTlsConfig = field(default_factory=ClusterTlsConfig)
    # Connections to the cluster port not yet authenticated: at most max_pending_handshakes from
    # hosts that are not a member's cluster host, at most max_pending_handshakes_per_address from any
    # one host (members' hosts never wait for the global bound); each must authenticate within
    # preauth_timeout_s.
    max_pending_handshakes: int = 64
    max_pending_handshakes_per_address: int = 8
    preauth_timeout_s: float = 2.0
    cluster_id: str = "moorline"  # nodes of different clusters refuse each other
    # Waiting at first start for every initial member to announce its storage id (a member is
    # (node, storage id): a node whose storage is wiped is refused as a voter).
    bootstrap_timeout_s: float = 60.0
    # Snapshots sent to a follower too far behind (shard state, then message-store records), on the
    # snapshot stream: in chunks of this size, at most snapshot_window_chunks unacknowledged, at
    # most max_snapshot_transfers out and as many in per node; a transfer with no progress for
    # snapshot_stall_timeout_s is abandoned (and offered again later by the leader).
    snapshot_chunk_bytes: int = 1 << 20
    snapshot_window_chunks: int = 4
    max_snapshot_transfers: int = 2
    snapshot_stall_timeout_s: float = 10.0
    # A drain (SIGTERM, POST /v1/drain, `moorline cluster drain`) hands every leadership over, answers
    # every publish in flight, sends MQTT 5 clients to another node (0x9C) and exits 0 within this.
    drain_timeout_s: float = 20.0
    # GET /v1/health?ready=cluster counts a replica caught up when its shard's leader knows it holds
    # the log to within this many entries of the commit index (and heard from it recently).
    ready_max_lag_entries: int = 100
    # The log-entry format this node proposes in: 2 (a fixed head the leader restamps in place) or 1
    # (what nodes before format 2 write and read). Every node reads both. A rolling upgrade from a
    # version before format 2 runs every node at 1 first, then raises it to 2 in a second round
    # (docs/operations.md, "Upgrade").
    entry_format: int = 2
    # Membership (docs/operations.md, "Change a cluster"). The metadata group's leader compares every
    # shard with its target (shard.replicas) every reconcile_interval_s (+-20 % jitter) and
    # reconcile_after_event_s after a membership event: members on forgotten or left nodes go first,
    # then a shard below target gets a voter on a live node (zone-aware). At most max_concurrent_moves
    # changes cluster-wide at once, one per shard; a learner is promoted only within
    # promote_lag_entries of the leader's log; a change not done within move_timeout_s is given up (and
    # planned again). auto_remove_after_s > 0 removes the memberships of a node down that long (0: never).
    zone: str = ""  # this node's zone (--zone): no two voters of a shard in one zone while enough zones exist
    reconcile_interval_s: float = 30.0
    reconcile_after_event_s: float = 3.0
    max_concurrent_moves: int = 2
    promote_lag_entries: int = 1000
    move_timeout_s: float = 120.0
    auto_remove_after_s: float = 0.0
    # Owner leases are safe only while shard leaders' wall clocks agree within a margin (docs/design.md,
    # "Leases and clocks"): a node whose clock is not within this of a majority of the cluster (measured
    # over the cluster link) refuses new sessions and leads nothing. At most half the lease margin.
    max_clock_offset_ms: float = 500.0
    # Reader feeds (shard.learners = "none"): a shard's leader sends each node that holds no replica
    # of it the shard's entries cut to that node's clients, at most feed_max_items items (and
    # feed_max_bytes) unacknowledged, again from after the acknowledged one after feed_resend_s of
    # silence, and a sign of life every feed_heartbeat_s; a node whose feed is silent for
    # feed_silence_s follows the shard's next leader.
    feed_max_items: int = 256
    feed_max_bytes: int = 8 << 20
    feed_max_queued_bytes: int = 64 << 20  # queued, unacknowledged: past it the feed ends (the reader starts anew)
    feed_resend_s: float = 1.0
    feed_heartbeat_s: float = 0.5
    feed_silence_s: float = 2.0


@dataclass
class AclRule:
    action: str  # "publish" | "subscribe" | "all"
    pattern: str  # topic filter, %u and %c substituted
    allow: bool = True
    user: str | None = None
    client_id: str | None = None


@dataclass
class AuthConfig:
    allow_anonymous: bool | None = None  # None: allowed only while every listener is on loopback
    password_file: str | None = None
    acl: list[AclRule] = field(default_factory=list)
    # A session belongs to the principal (username) that created it; a CONNECT with its client id
    # by anyone else is refused. True lets any client take a session over by client id, as plain
    # MQTT does: only for setups that prove no identity, where a username proves nothing (None: on
    # exactly when there is no password file, no token file and no tls.use_identity_as_username;
    # true together with a password file or certificate identities is refused).
    session_takeover_across_users: bool | None = None
    # HTTP bearer tokens: lines ``user:sha256$<hex>`` written by ``moorline token FILE USER``.
    token_file: str | None = None
    admin_users: list[str] = field(default_factory=list)  # HTTP admin role: shards, pins, sink markers, drops
    http_open_status: bool = True  # /metrics and /v1/health answer without credentials
    # scrypt runs on this many threads at most; further logins wait (the event loop never hashes).
    max_parallel_hashes: int = 2
    # Failed logins per source address: a token bucket of this many, refilled over the window; a
    # login in progress holds one, so one address never has more hashes queued than this.
    max_failed_logins: int = 10
    failed_login_window_s: float = 60.0
    login_rate_addresses: int = 10_000  # addresses tracked; the least recently seen is forgotten first
    # Loopback peers are local processes (a TLS terminator or bridge forwarding many clients, tests):
    # their failed logins are not rate-limited unless this is set.
    limit_loopback_logins: bool = False
    # Verified (user, password) pairs remembered (as keyed hashes, never the password) so a
    # reconnect storm costs no scrypt per client; 0 verifies every login.
    login_cache_entries: int = 10_000
    acl_cache_entries: int = 100_000  # cached ACL decisions (principal, topic); all dropped when full
    # The password and token files are read again on SIGHUP, and when a change is seen (checked this
    # often, seconds; 0 = on SIGHUP only): a removed user or token stops working without a restart.
    credentials_poll_s: float = 2.0


@dataclass
class TlsConfig:
    """Certificates of every TLS listener (listeners.mqtts, https, wss); re-read on SIGHUP."""

    cert_file: str | None = None  # PEM: the server certificate, then any intermediates
    key_file: str | None = None  # PEM private key
    ca_file: str | None = None  # PEM CAs that sign client certificates
    require_client_cert: bool = False  # refuse a handshake without a client certificate from ca_file
    # PEM certificate revocation list(s) of the CA in ca_file: a revoked client certificate is refused
    # at the handshake. Re-read with the certificates on SIGHUP.
    crl_file: str | None = None
    # The MQTT username is the client certificate's subject CN (Mosquitto's use_identity_as_username):
    # the certificate is the login (no password checked); ACLs apply to that username.
    use_identity_as_username: bool = False


@dataclass
class SysConfig:
    # $SYS/... statistics are published to subscribed clients this often (seconds); 0 = no $SYS topics.
    interval_s: float = 10.0


@dataclass
class PinConfig:
    reader_pin_ttl_s: float = 600.0
    max_pins: int = 1000
    max_ttl_s: float = 3600.0  # longer pin TTLs asked over HTTP are cut to this (a pin holds retention)
    max_pins_per_principal: int = 100
    max_sink_markers_per_principal: int = 10_000  # new query ids one principal may create per node run


@dataclass
class RuntimeConfig:
    """Process tuning (moorline/node/runtime.py says why)."""

    gc_young_threshold: int = 50_000  # allocations between young-generation collections
    malloc_mmap_threshold_bytes: int = 32 << 20  # blocks below this come from the reused heap
    malloc_trim_threshold_bytes: int = 64 << 20  # free heap kept before memory goes back to the kernel
    malloc_top_pad_bytes: int = 4 << 20  # extra heap taken per growth


@dataclass
class SupervisorConfig:
    """The node's long-lived tasks (moorline/node/supervisor.py): a task that fails is restarted
    after a backoff that starts here and doubles up to the maximum (critical tasks stop the node)."""

    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0


@dataclass
class LogConfig:
    """What ``moorline run`` logs (stderr). ``--log-level`` overrides ``level``."""

    level: str = "info"  # debug, info, warning, error
    format: str = "text"  # text: one line per record; json: one JSON object per line (ts, level, logger, msg)
    failed_login_interval_s: float = 10.0  # failed logins: one line per this interval, the rest counted in it
    # Lines a client's misbehaviour causes (protocol errors, refused publishes, WebSocket refusals)
    # are limited per source address (IPv6: its /64): this many a minute, the rest counted in the next.
    per_source_lines_per_minute: int = 20


@dataclass
class NodeConfig:
    data_dir: str = "./moorline-data"
    loop_lag_threshold_ms: float = 500.0
    shutdown_drain_s: float = 5.0
    listeners: ListenerConfig = field(default_factory=ListenerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    share: ShareConfig = field(default_factory=ShareConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    raft: RaftConfig = field(default_factory=RaftConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    sys: SysConfig = field(default_factory=SysConfig)
    pins: PinConfig = field(default_factory=PinConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        if self.log.level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log.level must be one of {', '.join(LOG_LEVELS)}, not {self.log.level!r}")
        if self.log.format not in ("text", "json"):
            raise ConfigError(f"log.format must be 'text' or 'json', not {self.log.format!r}")
        if self.log.per_source_lines_per_minute < 1:
            raise ConfigError("log.per_source_lines_per_minute must be 1 or more")
        if self.log.failed_login_interval_s < 0:
            raise ConfigError("log.failed_login_interval_s must be 0 or more")
        if self.mqtt.max_packet_size > self.raft.max_entry_bytes:
            raise ConfigError("mqtt.max_packet_size must not exceed raft.max_entry_bytes")
        if not 1 <= self.shard.count <= 4096:
            raise ConfigError("shard.count must be within 1..4096")
        if self.shard.followups_max_per_round < 0:
            raise ConfigError("shard.followups_max_per_round must be 0 (off) or more")
        if self.session.max_pending_notices < 1:
            raise ConfigError("session.max_pending_notices must be 1 or more")
        if not self.session.owner_lease_s >= 1.5 or not 0 <= self.session.owner_lease_drift < 0.2:
            # A client is closed 1 s before its node's lease would end unrenewed, and an open past
            # that point is not served: a shorter lease would serve nobody.
            raise ConfigError("session.owner_lease_s must be 1.5 or more (a client is closed 1 s before its lease "
                              "ends), session.owner_lease_drift within 0..0.2")
        if not 0 < self.supervisor.backoff_initial_s <= self.supervisor.backoff_max_s:
            raise ConfigError("supervisor.backoff_initial_s must be above 0 and at most supervisor.backoff_max_s")
        if self.raft.max_pending_proposals < 1:
            raise ConfigError("raft.max_pending_proposals must be 1 or more")
        if self.shard.replicas not in (1, 3, 5):
            raise ConfigError("shard.replicas must be 1, 3 or 5 (an even number of voters tolerates no more failures)")
        if self.shard.learners not in SHARD_LEARNERS:
            raise ConfigError(f"shard.learners must be 'all' (every node keeps every shard) or 'none' (a shard's "
                              f"voters only), not {self.shard.learners!r}")
        if not 1 <= self.producer.max_seq_gap < 1 << 64:
            raise ConfigError("producer.max_seq_gap must be within 1..2**64-1")
        if self.share.dispatch not in ("round_robin", "sticky_topic"):
            raise ConfigError("share.dispatch must be 'round_robin' or 'sticky_topic'")
        if self.queue.max_deliveries < 0 or self.queue.ack_timeout_s < 0:
            raise ConfigError("queue.max_deliveries and queue.ack_timeout_s must be 0 (off) or more")
        try:
            dlq = self.queue.dead_letter_topic.format(group="g", topic="t")
        except (KeyError, IndexError, ValueError):
            dlq = ""
        if not dlq or "+" in dlq or "#" in dlq or "\0" in dlq:
            raise ConfigError("queue.dead_letter_topic must be a topic name without wildcards; "
                              "{group} and {topic} are its only placeholders")
        if not 23 <= self.mqtt.max_client_id_bytes <= 65535:
            raise ConfigError("mqtt.max_client_id_bytes must be within 23..65535 (MQTT requires 23 at least)")
        if self.session.max_persistent_per_user < 0 or self.session.max_subscriptions < 1:
            raise ConfigError("session.max_persistent_per_user must be 0 or more, session.max_subscriptions 1 or more")
        if not 1 <= self.mqtt.receive_maximum <= 65535:
            raise ConfigError("mqtt.receive_maximum must be within 1..65535")
        if self.shard.reserved_headroom_bytes >= self.shard.max_bytes:
            raise ConfigError("shard.reserved_headroom_bytes must be below shard.max_bytes")
        if self.storage.inline_sync_max_us < 0:
            raise ConfigError("storage.inline_sync_max_us must be 0 or more")
        if not 0 <= self.session.ack_commit_interval_ms <= 1000:
            raise ConfigError("session.ack_commit_interval_ms must be 0..1000")
        if not 0 <= self.storage.lazy_sync_delay_ms <= 1000:
            raise ConfigError("storage.lazy_sync_delay_ms must be 0..1000")
        if self.storage.snapshot_inline_max_bytes < 0 or self.storage.max_parallel_snapshots < 1:
            raise ConfigError("storage.snapshot_inline_max_bytes must be 0 or more, "
                              "storage.max_parallel_snapshots 1 or more")
        if self.raft.follower_log_margin_entries < 0:
            raise ConfigError("raft.follower_log_margin_entries must be 0 or more")
        cl = self.cluster
        if not 4096 <= cl.snapshot_chunk_bytes <= 16 << 20:
            # (a stored message larger than a chunk travels alone in one)
            raise ConfigError("cluster.snapshot_chunk_bytes must be within 4 KiB..16 MiB")
        if not 1 <= cl.snapshot_window_chunks <= 64 or cl.max_snapshot_transfers < 1:
            raise ConfigError("cluster.snapshot_window_chunks must be 1..64, cluster.max_snapshot_transfers 1 or more")
        if cl.entry_format not in (1, 2):
            raise ConfigError(f"cluster.entry_format must be 1 or 2, not {cl.entry_format!r}")
        if not 1.0 <= cl.drain_timeout_s <= 3600 or cl.ready_max_lag_entries < 0:
            raise ConfigError("cluster.drain_timeout_s must be within 1..3600, cluster.ready_max_lag_entries 0 or more")
        if not cl.snapshot_stall_timeout_s > 0:
            raise ConfigError("cluster.snapshot_stall_timeout_s must be positive")
        # Two nodes each within the bound of a third may be twice it apart: that must stay inside the
        # leases' margin (the old owner closes its client 1 s early, and owner_lease_drift of the lease).
        lease_margin_ms = (self.session.owner_lease_s * self.session.owner_lease_drift + 1.0) * 1000
        if not 0 < 2 * cl.max_clock_offset_ms < lease_margin_ms:
            raise ConfigError(f"cluster.max_clock_offset_ms must be positive and below half the owner lease's "
                              f"margin ({lease_margin_ms / 2:g} ms with these session.owner_lease_* settings)")
        if not (cl.reconcile_interval_s > 0 and cl.reconcile_after_event_s >= 0 and cl.move_timeout_s > 0):
            raise ConfigError("cluster.reconcile_interval_s and cluster.move_timeout_s must be positive, "
                              "cluster.reconcile_after_event_s 0 or more")
        if cl.feed_max_items < 1 or cl.feed_max_bytes < 1 << 16 or cl.feed_max_queued_bytes < cl.feed_max_bytes:
            raise ConfigError("cluster.feed_max_items must be 1 or more, cluster.feed_max_bytes 65536 or more, "
                              "cluster.feed_max_queued_bytes at least cluster.feed_max_bytes")
        if not 0 < cl.feed_heartbeat_s < cl.feed_silence_s or not cl.feed_resend_s > 0:
            raise ConfigError("cluster.feed_resend_s must be positive, and cluster.feed_heartbeat_s positive and "
                              "below cluster.feed_silence_s")
        if cl.max_concurrent_moves < 1 or cl.promote_lag_entries < 0 or cl.auto_remove_after_s < 0:
            raise ConfigError("cluster.max_concurrent_moves must be 1 or more, cluster.promote_lag_entries and "
                              "cluster.auto_remove_after_s 0 or more")
        if cl.max_pending_handshakes < 1 or cl.max_pending_handshakes_per_address < 1 or not cl.preauth_timeout_s > 0:
            raise ConfigError("cluster.max_pending_handshakes and max_pending_handshakes_per_address must be 1 or "
                              "more, cluster.preauth_timeout_s positive")
        ct = cl.tls
        given = [k for k in ("cert_file", "key_file", "ca_file") if getattr(ct, k)]
        if (given or ct.crl_file) and len(given) != 3:
            missing = [k for k in ("cert_file", "key_file", "ca_file") if not getattr(ct, k)]
            raise ConfigError(f"cluster TLS needs cluster.tls.cert_file, key_file and ca_file (missing: "
                              f"{', '.join('cluster.tls.' + k for k in missing)})")
        m, li = self.mqtt, self.listeners
        if not 1 <= m.max_topic_levels <= 65536 or not 1 <= m.max_topic_length <= 65535:
            raise ConfigError("mqtt.max_topic_levels must be 1..65536 and mqtt.max_topic_length 1..65535")
        if m.max_connect_packet_bytes < 256 or not m.packet_read_timeout_s > 0:
            raise ConfigError("mqtt.max_connect_packet_bytes must be 256 or more, mqtt.packet_read_timeout_s positive")
        if li.max_pending_connections < 1 or li.max_connection_rate_per_address < 0:
            raise ConfigError("listeners.max_pending_connections must be 1 or more, "
                              "listeners.max_connection_rate_per_address 0 (no limit) or more")
        if li.connection_burst_per_address < 1 or li.rate_limit_tracked_addresses < 1:
            raise ConfigError("listeners.connection_burst_per_address and rate_limit_tracked_addresses must be 1 or more")
        rt = self.runtime
        if rt.gc_young_threshold < 1 or min(rt.malloc_mmap_threshold_bytes, rt.malloc_trim_threshold_bytes,
                                             rt.malloc_top_pad_bytes) < 0:
            raise ConfigError("runtime.* must be positive")
        if rt.malloc_mmap_threshold_bytes > 32 << 20:
            raise ConfigError("runtime.malloc_mmap_threshold_bytes must not exceed 32 MiB (glibc's limit)")
        t = self.tls
        tls_listeners = [k for k in ("mqtts", "https", "wss") if getattr(li, k)]
        if tls_listeners and not (t.cert_file and t.key_file):
            raise ConfigError(f"listeners.{tls_listeners[0]} needs tls.cert_file and tls.key_file")
        if t.crl_file and not t.ca_file:
            raise ConfigError("tls.crl_file needs tls.ca_file (the CA whose revocations it lists)")
        if t.require_client_cert and not t.ca_file:
            raise ConfigError("tls.require_client_cert needs tls.ca_file (the CAs that sign client certificates)")
        if t.use_identity_as_username and not t.require_client_cert:
            raise ConfigError("tls.use_identity_as_username needs tls.require_client_cert = true: the certificate "
                              "is then the login")
        if li.advertise is not None:
            a_host, a_sep, a_port = li.advertise.rpartition(":")
            if not a_sep or not a_host.strip("[]") or not a_port.isdigit() or not 0 < int(a_port) <= 65535:
                raise ConfigError(f"listeners.advertise must be HOST:PORT, not {li.advertise!r}")
        if not 0 < li.ws_close_timeout_s <= 60:
            raise ConfigError("listeners.ws_close_timeout_s must be positive, at most 60")
        if not 0 <= self.sys.interval_s <= 86400:
            raise ConfigError("sys.interval_s must be 0 (off) .. 86400")
        if self.auth.session_takeover_across_users and self.auth.password_file:
            raise ConfigError("auth.session_takeover_across_users cannot be true with auth.password_file: "
                              "any user could then resume another user's session")
        if self.auth.session_takeover_across_users and self.tls.use_identity_as_username:
            raise ConfigError("auth.session_takeover_across_users cannot be true with tls.use_identity_as_username: "
                              "any certificate holder could then resume another user's session")
        if self.auth.credentials_poll_s < 0:
            raise ConfigError("auth.credentials_poll_s must be 0 (on SIGHUP only) or more")
        h = self.http
        if h.max_body_bytes < 1024 or h.max_scan_per_fetch < 1 or h.scan_slice < 1 or h.max_answer_bytes < 1024:
            raise ConfigError("http.max_body_bytes and http.max_answer_bytes must be 1024 or more, "
                              "http.max_scan_per_fetch and http.scan_slice 1 or more")
        if h.max_console_streams < 0 or h.console_update_interval_s < 0.5 or h.max_admin_page < 1:
            raise ConfigError("http.max_console_streams must be 0 (no live console) or more, "
                              "http.console_update_interval_s 0.5 or more, http.max_admin_page 1 or more")
        if not 0 <= h.console_history_s <= 86_400:
            raise ConfigError("http.console_history_s must be between 0 and 86400")
        if not 0.1 <= h.peer_request_timeout_s <= 60:
            raise ConfigError("http.peer_request_timeout_s must be between 0.1 and 60")
        for rule in self.auth.acl:
            if rule.action not in ("publish", "subscribe", "all"):
                raise ConfigError(f"acl action must be publish, subscribe or all, not {rule.action!r}")
        a = self.auth
        if a.max_parallel_hashes < 1 or a.max_failed_logins < 1 or a.login_rate_addresses < 1:
            raise ConfigError("auth.max_parallel_hashes, max_failed_logins and login_rate_addresses must be 1 or more")
        if not a.failed_login_window_s > 0 or a.login_cache_entries < 0 or a.acl_cache_entries < 0:
            raise ConfigError("auth.failed_login_window_s must be positive, auth.*_cache_entries 0 or more")
        if not isinstance(a.admin_users, list) or not all(isinstance(u, str) for u in a.admin_users):
            raise ConfigError("auth.admin_users must be a list of user names")
        pins = self.pins
        if not 0 < pins.reader_pin_ttl_s <= pins.max_ttl_s:
            raise ConfigError("pins.reader_pin_ttl_s must be positive and at most pins.max_ttl_s")
        if pins.max_pins_per_principal < 1 or pins.max_sink_markers_per_principal < 1:
            raise ConfigError("pins.max_pins_per_principal and max_sink_markers_per_principal must be 1 or more")


def _show(value: Any) -> str:
    """A value as it would be written in TOML (strings quoted), for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _check(value: Any, tp: Any, name: str) -> Any:
    """``value`` checked against the field's declared type ``tp`` (and converted where lossless)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [t for t in options if t is not type(None)]
        if len(inner) == 1:
            return _check(value, inner[0], name)
        raise ConfigError(f"{name}: unsupported type {tp}")  # pragma: no cover - not used by any field
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list, not {_show(value)}")
        return [_check(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name)  # type: ignore[arg-type]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, not {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, not {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} must be a number, not {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, not {_show(value)}")
        return value
    raise ConfigError(f"{name}: unsupported type {tp}")  # pragma: no cover - a new field type needs a rule here


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"[{where}] must be a table, not {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in names:
            if name in MOVED_KEYS:
                raise ConfigError(f"configuration key {name} is now {MOVED_KEYS[name]} (docs/queues.md)")
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f" (did you mean {where + '.' if where else ''}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown configuration key {name}{hint}")
        kwargs[key] = _check(value, hints[key], name)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:  # e.g. an ACL rule without a pattern
        raise ConfigError(f"{where} needs {' and '.join(missing)}")
    return cls(**kwargs)


def _field_type(dotted: str) -> Any:
    """The declared type of a dotted key (``mqtt.max_packet_size``), or ConfigError if unknown."""
    if dotted in MOVED_KEYS:
        raise ConfigError(f"configuration key {dotted} is now {MOVED_KEYS[dotted]} (docs/queues.md)")
    cls: Any = NodeConfig
    *parents, last = dotted.split(".")
    for p in parents:
        hints = typing.get_type_hints(cls)
        if p not in hints or not dataclasses.is_dataclass(hints[p]):
            raise ConfigError(f"unknown configuration section {p!r} in {dotted}")
        cls = hints[p]
    hints = typing.get_type_hints(cls)
    if last not in hints:
        raise ConfigError(f"unknown configuration key {dotted}")
    return hints[last]


def _parse_env_value(raw: str, tp: Any, name: str) -> Any:
    """An environment variable's text as the key's type: TOML syntax (``true``, ``10``,
    ``["a", "b"]``), or the bare text for a string key."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    base = [t for t in typing.get_args(tp) if t is not type(None)] or [tp]
    if base[0] is str and not isinstance(value, str):
        value = raw
    return _check(value, tp, name)


ENV_PREFIX = "MOORLINE_"


def env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``MOORLINE_SECTION__KEY=value`` (``__`` between levels, e.g. ``MOORLINE_MQTT__MAX_PACKET_SIZE``)
    overrides a key of the file; ``MOORLINE_DATA_DIR`` a top-level one. Other ``MOORLINE_*``
    variables without ``__`` that name no top-level key belong to other tools and are ignored."""
    out: dict[str, Any] = {}
    top = set(typing.get_type_hints(NodeConfig))
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):].lower()
        if "__" not in rest and rest not in top:
            continue
        dotted = rest.replace("__", ".")
        try:
            tp = _field_type(dotted)
        except ConfigError as exc:
            raise ConfigError(f"environment variable {var}: {exc}") from exc
        out[dotted] = _parse_env_value(raw, tp, f"{dotted} (from {var})")
    return out


def load_config(path: Path | None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> NodeConfig:
    """The file, then environment variables (``environ``; none when not given), then ``overrides``
    (command-line flags): each checked for type, then the whole for ranges."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    cfg: NodeConfig = _build(NodeConfig, data, "")
    layered = {**env_overrides(environ or {}), **(overrides or {})}
    for dotted, value in layered.items():
        value = _check(value, _field_type(dotted), dotted)
        target: Any = cfg
        *parents, last = dotted.split(".")
        for p in parents:
            target = getattr(target, p)
        setattr(target, last, value)
    cfg.validate()
    return cfg
