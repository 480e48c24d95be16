"""Replicated commands: what a shard's Raft log carries. One log entry holds a batch of them.

Every command is a tagged msgspec struct; the entry is a fixed head (version, stamp) and
``EntryBatch(version, commands)`` so the format can evolve behind a feature level (docs/design.md,
"Determinism"). Times inside commands are stamped by the leader's host (a forwarded entry is
restamped in its head, ``restamp_entry``, and decoding gives its commands that time); apply never
reads a clock.
"""

from __future__ import annotations

import struct
import typing

import msgspec

from moorline.broker.messages import StoredMessage

ENTRY_VERSION = 2  # an entry starts with a head (ENTRY_HEAD_BYTES); version 1, without one, still decodes
SHARE_PREFIX = "$share\x00"  # registration keys of $share groups: "$share\0GROUP\0FILTER"


class Cmd(msgspec.Struct, tag=True, array_like=True):
    pass


# --- topic-shard commands -------------------------------------------------------------------


class Publish(Cmd, tag="pub"):
    msg: StoredMessage
    principal: str = ""
    producer: bytes | None = None  # sequenced producer id (8 bytes) ...
    seq: int | None = None  # ... and its sequence number


class Register(Cmd, tag="reg"):
    """A subscription (or a $share group) starts being owed messages of this shard."""

    ts_ms: int
    reg_key: str  # client_id \0 filter, or "$share" \0 group \0 filter
    client_id: str  # owner (or "" for a share group)
    session_inc: int  # the owning session's incarnation; a stale one is ignored
    filter: str  # the topic filter without the $share prefix
    qos: int
    no_local: bool = False
    want_retained: bool = True  # false for $share and for retain handling 2 / 1-existing
    share_group: str | None = None
    # The session's subscription version (SessionSubscribe/-Unsubscribe bump it): of the commands a
    # shard receives for one plain registration, the latest version wins even when cross-shard
    # commands arrive out of order. -1 (entries written before versions): unchecked.
    sub_version: int = -1
    # $share groups only (docs/queues.md), stamped by the proposer from its config and the
    # SUBSCRIBE's user property; absent (defaults) in entries written before work-queue policies.
    single_active: bool = False  # the group turns single-active (for good)
    max_deliveries: int = 0  # hand-outs without acknowledgement before dead-lettering; 0: unlimited
    ack_timeout_ms: int = 0  # a claim unacknowledged this long goes back (ShareTimeout); 0: off


class Unregister(Cmd, tag="unreg"):
    reg_key: str
    session_inc: int
    reason: str = "unsubscribe"  # counted as a drop reason for what was still owed
    sub_version: int = -1  # ignored when the registration is already of a later version; -1: always


class AckReport(Cmd, tag="ackr"):
    """Idempotent: offsets acknowledged by the subscriber(s) behind reg_key."""

    reg_key: str
    offsets: tuple[int, ...]


# $share commands name the member's session incarnation as well as its client id: a client id
# outlives its sessions, and an ended incarnation's leave or claims, applied late, must never
# reach the incarnation that replaced it. LEGACY_INC (entries written before incarnations were
# recorded) matches any incarnation of the member.
LEGACY_INC = -1


class ShareMember(Cmd, tag="shm"):
    reg_key: str
    member: str  # client id
    joined: bool
    session_inc: int = LEGACY_INC  # the member's incarnation that joins or leaves


class ShareClaim(Cmd, tag="shc"):
    reg_key: str
    member: str
    offsets: tuple[int, ...]
    session_inc: int = LEGACY_INC  # granted only while this incarnation is the member
    ts_ms: int = 0  # the leader's time of the claim (ack timeouts count from it); 0: unrecorded


class ShareReturn(Cmd, tag="shr"):
    """A member's session ended: its claims go back to the group, except QoS 2 deliveries not yet
    PUBREC'd, which are dropped and counted (MQTT-4.8.2-5)."""

    reg_key: str
    member: str
    dropped: tuple[int, ...]
    session_inc: int = LEGACY_INC  # only the claims made for this incarnation


class ShareDecline(Cmd, tag="shd"):
    """A member's node refuses claims its read ACL denies: they go back to the group, marked as
    declined by that member, so the dispatcher offers them to the other members. Once every member
    of the group has declined one, it is dropped and counted as ``acl_no_reader``."""

    reg_key: str
    member: str
    offsets: tuple[int, ...]
    session_inc: int  # only claims held by this incarnation of the member


class ShareActivate(Cmd, tag="sha"):
    """A single-active group's active member changes from ``prev`` (which must be the active member
    and hold no claims, else nothing changes) to ``member`` (which must be a member)."""

    reg_key: str
    member: str
    prev: str


class ShareTimeout(Cmd, tag="sht"):
    """Claims of a member's incarnation held unacknowledged past the group's ack timeout (by this
    entry's time) go back to the group, each counted as a delivery attempt."""

    ts_ms: int
    reg_key: str
    member: str
    session_inc: int
    offsets: tuple[int, ...]


class ShareDeadLettered(Cmd, tag="shx"):
    """Messages past the group's delivery limit were published to the dead-letter topic (under a
    GUID derived from group, shard and offset): they leave the group, a drop ``delivery_limit``."""

    reg_key: str
    offsets: tuple[int, ...]


class DropOwed(Cmd, tag="drop"):
    """A counted limit removes owed messages of one registration (queue cap, expiry at delivery)."""

    reg_key: str
    offsets: tuple[int, ...]
    reason: str


class Housekeeping(Cmd, tag="hk"):
    ts_ms: int
    # Lowest offset pinned by a reader (retention holds from there); -1 = none. Pins are replicated
    # now (``Pin``: the shard applies its own); entries of older nodes carry their local pins here.
    pin_floor: int


# --- session-shard commands -----------------------------------------------------------------


class WillSpec(msgspec.Struct, array_like=True, frozen=True):
    topic: str
    payload: bytes
    qos: int
    retain: bool
    delay_s: int = 0
    expiry_s: int | None = None
    props: bytes | None = None  # encoded MessageProps


class SessionOpen(Cmd, tag="sopen"):
    ts_ms: int
    client_id: str
    clean_start: bool
    expiry_s: int
    will: WillSpec | None
    principal: str = ""
    # Refuse when the session exists and belongs to another principal (absent, so False, in
    # entries written before sessions had owners: they replay as they applied then).
    owner_only: bool = False
    # The node that will serve the session, and the lease it takes (from ts_ms). 0: no lease
    # (entries from before leases).
    owner_node: int = 0
    lease_ms: int = 0
    # session.max_persistent_per_user of the proposing node: a new persistent session of a
    # principal that already has this many in the session's shard is refused. 0: unchecked (and in
    # entries written before the bound: they replay as they applied then).
    max_persistent: int = 0


class LeaseRelease(Cmd, tag="srelease"):
    """The previous owner node stopped serving epoch ``epoch`` of a session taken over elsewhere:
    the new owner need not wait for that lease to run out."""

    client_id: str
    epoch: int
    owner_node: int


class SessionRenew(Cmd, tag="srenew"):
    """The owner node renews its leases: each (client id, epoch) still its own gets ts_ms + lease_ms."""

    ts_ms: int
    owner_node: int
    lease_ms: int
    sessions: tuple[tuple[str, int], ...]


class SessionSubscribe(Cmd, tag="ssub"):
    client_id: str
    epoch: int
    filter: str  # as sent, with any $share prefix
    qos: int
    no_local: bool
    retain_as_published: bool
    retain_handling: int
    sub_id: int | None


class SessionUnsubscribe(Cmd, tag="sunsub"):
    client_id: str
    epoch: int
    filter: str


class DeliveryItem(msgspec.Struct, array_like=True, frozen=True):
    shard: int
    offset: int  # -1 for a retained message delivered on subscribe (message embedded)
    qos: int
    retain: bool
    sub_ids: tuple[int, ...] = ()
    reg_keys: tuple[str, ...] = ()
    embedded: StoredMessage | None = None


class Deliver(Cmd, tag="dlv"):
    """A delivery batch, committed before any PUBLISH of it is sent. seqno i -> pid (i % 65535) + 1."""

    client_id: str
    epoch: int
    first_seq: int
    items: tuple[DeliveryItem, ...]


class SessionAcks(Cmd, tag="sack"):
    """(seqno, kind): kind 1 = final (PUBACK / PUBCOMP), 2 = PUBREC received (PUBREL may be sent)."""

    client_id: str
    epoch: int
    acks: tuple[tuple[int, int], ...]


class InboundQos2(Cmd, tag="iq2"):
    client_id: str
    epoch: int
    packet_id: int
    guid: bytes


class InboundRelease(Cmd, tag="irel"):
    client_id: str
    epoch: int
    packet_id: int


class SessionClose(Cmd, tag="sclose"):
    ts_ms: int
    client_id: str
    epoch: int
    send_will: bool
    expiry_s: int | None = None  # MQTT 5 DISCONNECT may change the session expiry


class SessionHousekeeping(Cmd, tag="shk"):
    ts_ms: int


class WillPublished(Cmd, tag="swill"):
    """The will of ``client_id``'s connection of that incarnation and epoch is committed in its
    topic's shard: the session shard no longer owes it (``SessionState.wills_owed``)."""

    client_id: str
    incarnation: int
    epoch: int


class SessionsForget(Cmd, tag="sforget"):
    """Remove subscriptions whose topic-shard registrations vanished (reconcile)."""

    client_id: str
    epoch: int


# --- metadata group (a Raft group of its own, on one node too) ------------------------------


class SetSinkMarker(Cmd, tag="sink"):
    query_id: str
    batch_id: int


class Pin(Cmd, tag="pin"):
    """A reader's retention pin on one topic shard (``POST /v1/pins``; the Spark source): nothing
    at or above ``offset`` is released by retention there until ``ts_ms + ttl_ms`` (the leader's
    entry time, as every replicated time) unless renewed. Set or renewed only by its ``owner``;
    at most ``max_pins`` pins in the shard and ``max_per_owner`` of one owner (the proposer's
    config: pins.max_pins, pins.max_pins_per_principal). Result: "ok", "held" (another owner's),
    "too_many" or "too_many_for_owner"."""

    reader: str
    owner: str
    offset: int
    ttl_ms: int
    max_pins: int
    max_per_owner: int
    ts_ms: int = 0


class Unpin(Cmd, tag="unpin"):
    """The pin of ``reader`` goes (result "ok", also when there was none), unless another owner
    holds it ("held")."""

    reader: str
    owner: str


class ClusterRecord(msgspec.Struct, array_like=True, frozen=True):
    """What the metadata group knows of the cluster: its members as (name, node id, storage id),
    the shard layout and each shard's voters and learners (node names). Membership changes will
    rewrite it through this group; today it is written once, at bootstrap."""

    cluster_id: str
    members: tuple[tuple[str, int, str], ...]
    shard_count: int
    replicas: int
    placement: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # per shard: (voters, learners)
    feature_level: int = 1


class ClusterBootstrap(Cmd, tag="cboot"):
    """Proposed by the metadata group's first leader: the first one applied is the cluster's
    record; a later one (another node's, racing) changes nothing, and its proposer compares."""

    record: ClusterRecord


class MemberInfo(msgspec.Struct, array_like=True, frozen=True):
    """A node as the metadata group's member table knows it (moorline/broker/membership.py)."""

    name: str
    node_id: int
    storage_id: str
    cluster: str = ""  # HOST:PORT of its cluster listener
    client: str = ""  # HOST:PORT of its MQTT listener (what drain's Server Reference names)
    zone: str = ""  # cluster.zone: no two voters of a shard in one zone while enough zones exist


class MemberAnnounce(Cmd, tag="mann"):
    """A node's own addresses and zone, proposed by it when they differ from the table's."""

    member: MemberInfo
    ts_ms: int = 0


class MemberSetState(Cmd, tag="mstate"):
    """An operator's (or the reconciler's) change of a member's state: forget, drain, leave."""

    name: str
    state: str
    ts_ms: int = 0


class MoveStart(Cmd, tag="mvs"):
    """One configuration change of one shard, recorded before any shard leader proposes it: refused
    (the result is a string saying why) while the shard has a change in progress."""

    shard: int
    kind: str  # "add_learner" | "promote" | "remove"
    node: str
    node_id: int
    storage_id: str
    origin: str  # "reconcile" | "manual"
    ts_ms: int = 0


class MoveEnd(Cmd, tag="mve"):
    """The change ``move_id`` of ``shard`` is in the shard's configuration, or was given up."""

    shard: int
    move_id: int
    outcome: str  # "done" or why it was abandoned
    ts_ms: int = 0


Command = (
    Publish
    | Register
    | Unregister
    | AckReport
    | ShareMember
    | ShareClaim
    | ShareReturn
    | ShareDecline
    | ShareActivate
    | ShareTimeout
    | ShareDeadLettered
    | DropOwed
    | Housekeeping
    | SessionOpen
    | SessionSubscribe
    | SessionUnsubscribe
    | Deliver
    | SessionAcks
    | InboundQos2
    | InboundRelease
    | SessionClose
    | SessionHousekeeping
    | WillPublished
    | SessionsForget
    | SessionRenew
    | LeaseRelease
    | SetSinkMarker
    | Pin
    | Unpin
    | ClusterBootstrap
    | MemberAnnounce
    | MemberSetState
    | MoveStart
    | MoveEnd
)


class EntryBatch(msgspec.Struct, array_like=True, frozen=True):
    version: int
    commands: list[Command]
    # Who proposed it: (node, boot, seq), seq rising per boot. A node resends what it proposed
    # until it sees it applied (to a new leader after a leader change), so one proposal can reach
    # the log twice; ShardState.admit applies only the first. 0, 0, 0: unchecked (entries written
    # before proposals had ids).
    origin: int = 0
    boot: int = 0
    seq: int = 0


class EntryHead(msgspec.Struct, array_like=True, frozen=True):
    """An entry's proposal id, decoded without its commands (msgspec.Raw is not parsed)."""

    version: int
    commands: msgspec.Raw
    origin: int = 0
    boot: int = 0
    seq: int = 0


# An entry of version 2 is a fixed head, then the msgpack EntryBatch (its version 2 too):
#   byte 0      ENTRY_VERSION
#   bytes 1-8   the leader's stamp, unsigned big-endian: the time every command of the entry is
#               applied with (``Publish.msg.ts_ms``, every other command's ``ts_ms``), or
#               UNSTAMPED: the commands keep the times they carry (a leader's own proposal).
# A leader restamps a forwarded entry by copying it with those 8 bytes replaced (``restamp_entry``),
# never decoding it; decoding gives every command the stamp. An entry of version 1 (written before)
# is the EntryBatch alone: its first byte is a msgpack array's, never ENTRY_VERSION.
ENTRY_HEAD_BYTES = 9
UNSTAMPED = (1 << 64) - 1
_HEAD = struct.Struct(">BQ")
_STAMP = struct.Struct(">Q")
_UNSTAMPED_HEAD = _HEAD.pack(ENTRY_VERSION, UNSTAMPED)
_VERSION_BYTE = _UNSTAMPED_HEAD[:1]
_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}  # msgpack fixarray, array 16, array 32
LEGACY_ENTRY_VERSION = 1
# The commands a stamp sets the time of (Publish: its message's ts_ms).
_TIMED = frozenset(t for t in typing.get_args(Command) if "ts_ms" in t.__struct_fields__)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(EntryBatch)
_head_dec = msgspec.msgpack.Decoder(EntryHead)
_force_setattr = msgspec.structs.force_setattr


def encode_entry(commands: list[Command], origin: int = 0, boot: int = 0, seq: int = 0,
                 version: int = ENTRY_VERSION) -> bytes:
    """A proposal, unstamped: its commands keep their times (a leader's own, or restamped when
    forwarded). ``version`` 1 (cluster.entry_format, during a rolling upgrade from nodes that read
    only that): the batch alone, restamped by decoding and encoding it again."""
    if version == LEGACY_ENTRY_VERSION:
        return _enc.encode(EntryBatch(LEGACY_ENTRY_VERSION, commands, origin, boot, seq))
    return _UNSTAMPED_HEAD + _enc.encode(EntryBatch(ENTRY_VERSION, commands, origin, boot, seq))


def restamp_entry(data: bytes, now_ms: int) -> bytes:
    """A forwarded entry with every time in it replaced by ``now_ms``, the leader's: replicated
    time (lease ends, expiry, de-duplication windows, message times) moves only with the leaders'
    clocks, never with a forwarding node's, which may be skewed. A copy with the stamp replaced;
    an entry of version 1 (a node of an earlier version forwarded it) is decoded, restamped and
    encoded again as version 1."""
    if now_ms == UNSTAMPED:
        raise ValueError(f"a stamp of {now_ms} ms is out of range")
    if data[:1] == _VERSION_BYTE and len(data) >= ENTRY_HEAD_BYTES:
        try:
            return _HEAD.pack(ENTRY_VERSION, now_ms) + data[ENTRY_HEAD_BYTES:]
        except struct.error:
            raise ValueError(f"a stamp of {now_ms} ms is out of range") from None
    batch = decode_batch(data)  # version 1 (or a clear error)
    _stamp(batch.commands, now_ms)
    return _enc.encode(EntryBatch(LEGACY_ENTRY_VERSION, batch.commands, batch.origin, batch.boot, batch.seq))


def _stamp(commands: list[Command], now_ms: int) -> None:
    """Every time in ``commands`` set to ``now_ms``; they were just decoded, so nothing else holds
    them yet (a StoredMessage is frozen once it leaves here)."""
    timed = _TIMED
    for cmd in commands:
        t = type(cmd)
        if t is Publish:
            _force_setattr(cmd.msg, "ts_ms", now_ms)  # type: ignore[union-attr]
        elif t in timed:
            cmd.ts_ms = now_ms  # type: ignore[union-attr]


def _body(data: bytes) -> tuple[memoryview | bytes, int, int]:
    """An entry's msgpack EntryBatch, its stamp (UNSTAMPED for version 1) and the version it must name."""
    if len(data) >= ENTRY_HEAD_BYTES:
        version, stamp = _HEAD.unpack_from(data)
        if version == ENTRY_VERSION:
            return memoryview(data)[ENTRY_HEAD_BYTES:], stamp, ENTRY_VERSION
    if not data:
        raise ValueError("an empty entry")
    if data[0] in _ARRAY_HEADS:
        return data, UNSTAMPED, LEGACY_ENTRY_VERSION
    if data[0] == ENTRY_VERSION:
        raise ValueError(f"an entry of {len(data)} bytes is shorter than its head")
    raise ValueError(f"unsupported entry version {data[0]}")


def decode_batch(data: bytes) -> EntryBatch:
    """An entry of version 2 or 1, every time in it the leader's stamp when it has one."""
    body: memoryview | bytes
    if data[:1] == _VERSION_BYTE and len(data) >= ENTRY_HEAD_BYTES:  # _body's common case, inline
        stamp, = _STAMP.unpack_from(data, 1)
        body, version = memoryview(data)[ENTRY_HEAD_BYTES:], ENTRY_VERSION
    else:
        body, stamp, version = _body(data)
    batch = _dec.decode(body)
    if batch.version != version:
        raise ValueError(f"unsupported entry version {batch.version}")
    if stamp != UNSTAMPED:
        _stamp(batch.commands, stamp)
    return batch


def decode_entry(data: bytes) -> list[Command]:
    return decode_batch(data).commands


def decode_head(data: bytes) -> EntryHead:
    """An entry's proposal id (origin, boot, seq), its commands not decoded."""
    return _head_dec.decode(_body(data)[0])


def entry_stamp(data: bytes) -> int | None:
    """The leader's stamp of an entry, None when its commands keep their own times."""
    stamp = _body(data)[1]
    return None if stamp == UNSTAMPED else stamp
