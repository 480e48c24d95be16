"""Public types of the sans-IO Raft core (stable API shared with the simulator and the node).

Everything here is plain data: entries, messages, hard state, configuration, the ``Ready``
batch the host handles before ``advance``. Wire-facing structs are ``msgspec.Struct`` so they
are cheap to create (the core makes one per entry and per message) and encode directly with
``msgspec.msgpack``.

Member identity is ``MemberId = (node id, storage id)``: a node whose storage is new or wiped
gets a new storage id and is therefore a *different* member; it can rejoin only as a new
learner and never votes with a vote it forgot.
"""

from __future__ import annotations

import enum
import random
import struct
from dataclasses import dataclass, field

import msgspec

from moorline.hashing import crc32c

MemberId = tuple[int, str]
"""(node id, storage id). Storage id changes whenever a node's data directory is new or wiped."""

NO_MEMBER: MemberId = (0, "")
"""Placeholder 'nobody' (e.g. no leader known). Real node ids are >= 1."""

# Bytes counted per entry on top of its payload, for size limits (term, index, type, framing).
ENTRY_OVERHEAD_BYTES = 24


class RaftError(Exception):
    """Base of the errors the core reports to its host."""


class ProposalDropped(RaftError):
    """A proposal was refused (not leader, transfer in progress, too many uncommitted bytes, ...).

    Nothing entered the log, so the host may answer with a refusal."""


class CompactedError(RaftError):
    """The requested index is at or below the storage's compacted prefix."""


class UnavailableError(RaftError):
    """The requested index is above the storage's last index."""


class SnapshotTemporarilyUnavailable(RaftError):
    """The host cannot produce a snapshot right now; the leader retries later."""


class HardStateCorrupt(ValueError):
    """An encoded hard state failed its CRC32C or length check."""


class EntryType(enum.IntEnum):
    NORMAL = 0
    CONF_CHANGE = 1


class Entry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One log entry. ``data`` is opaque to Raft (a batch of broker commands, or an encoded
    ``ConfChange`` when ``type`` is ``CONF_CHANGE``; empty for the leader's no-op)."""

    term: int
    index: int
    type: EntryType = EntryType.NORMAL
    data: bytes = b""

    def size(self) -> int:
        return len(self.data) + ENTRY_OVERHEAD_BYTES


_HS_HEAD = struct.Struct(">QQqH")  # term, commit, vote node id (-1: none), storage id length
_HS_CRC = struct.Struct(">I")


class HardState(msgspec.Struct, frozen=True, gc=False):
    """The state that must be durable before any message depending on it is sent."""

    term: int = 0
    vote: MemberId | None = None
    commit: int = 0

    def encode(self) -> bytes:
        """Binary form with its own CRC32C trailer (so a WAL record is checked twice)."""
        if self.vote is None:
            node, sid = -1, b""
        else:
            node, sid = self.vote[0], self.vote[1].encode("utf-8")
        body = _HS_HEAD.pack(self.term, self.commit, node, len(sid)) + sid
        return body + _HS_CRC.pack(crc32c(body))

    @classmethod
    def decode(cls, raw: bytes) -> HardState:
        """Inverse of ``encode``; raises ``HardStateCorrupt`` on any length or checksum failure."""
        head = _HS_HEAD.size
        if len(raw) < head + _HS_CRC.size:
            raise HardStateCorrupt("hard state too short")
        term, commit, node, sid_len = _HS_HEAD.unpack_from(raw, 0)
        if len(raw) != head + sid_len + _HS_CRC.size:
            raise HardStateCorrupt("hard state length mismatch")
        body = raw[: head + sid_len]
        (crc,) = _HS_CRC.unpack_from(raw, head + sid_len)
        if crc32c(body) != crc:
            raise HardStateCorrupt("hard state checksum mismatch")
        vote: MemberId | None = None
        if node >= 0:
            vote = (node, body[head:].decode("utf-8"))
        return cls(term=term, vote=vote, commit=commit)

    def is_empty(self) -> bool:
        return self.term == 0 and self.vote is None and self.commit == 0


class ConfState(msgspec.Struct, frozen=True, gc=False):
    """A configuration: voters and learners, each a sorted tuple (deterministic iteration)."""

    voters: tuple[MemberId, ...] = ()
    learners: tuple[MemberId, ...] = ()

    @classmethod
    def of(cls, voters: object = (), learners: object = ()) -> ConfState:
        """Build from any iterables of MemberId, sorting them."""
        return cls(voters=tuple(sorted(voters)), learners=tuple(sorted(learners)))  # type: ignore[call-overload]

    def members(self) -> tuple[MemberId, ...]:
        return tuple(sorted(self.voters + self.learners))


class ConfChangeType(enum.IntEnum):
    ADD_VOTER = 0
    ADD_LEARNER = 1
    REMOVE = 2
    PROMOTE = 3  # learner -> voter


class ConfChange(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One single-member configuration change (see moorline/raft/README.md for the safety argument)."""

    type: ConfChangeType
    member: MemberId
    context: bytes = b""

    def encode(self) -> bytes:
        return _CC_ENCODER.encode(self)

    @classmethod
    def decode(cls, raw: bytes) -> ConfChange:
        return _CC_DECODER.decode(raw)


_CC_ENCODER = msgspec.msgpack.Encoder()
_CC_DECODER = msgspec.msgpack.Decoder(ConfChange)


class SnapshotMeta(msgspec.Struct, frozen=True, gc=False):
    index: int = 0
    term: int = 0
    conf_state: ConfState = ConfState()


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    meta: SnapshotMeta = SnapshotMeta()
    data: bytes = b""

    def is_empty(self) -> bool:
        return self.meta.index == 0


class MessageType(enum.IntEnum):
    APP = 1  # leader -> follower: entries after (log_term, index); carries commit
    APP_RESP = 2  # follower -> leader: index = last matching index, or reject with reject_hint
    VOTE = 3
    VOTE_RESP = 4
    PRE_VOTE = 5
    PRE_VOTE_RESP = 6
    SNAP = 7  # leader -> follower: install snapshot
    HEARTBEAT = 8  # leader -> follower: term + commit (+ read-index context)
    HEARTBEAT_RESP = 9
    TIMEOUT_NOW = 10  # leadership transfer: target campaigns at once
    READ_INDEX = 11  # follower -> leader: please confirm leadership for context
    READ_INDEX_RESP = 12  # leader -> follower: read state (index, context)


class Stream(enum.IntEnum):
    """Separate streams so bulk traffic never delays heartbeats and votes."""

    CONTROL = 0  # votes, heartbeats, timeout-now, read index: tiny, latency critical
    APPEND = 1  # appends and their responses
    SNAPSHOT = 2  # snapshot installs (bulk)


_STREAM_OF: dict[int, Stream] = {
    MessageType.APP: Stream.APPEND,
    MessageType.APP_RESP: Stream.APPEND,
    MessageType.SNAP: Stream.SNAPSHOT,
}


class Message(msgspec.Struct, kw_only=True, gc=False):
    """A message between two members of one group (the host adds the group id on the wire)."""

    type: MessageType
    from_: MemberId
    to: MemberId
    term: int = 0
    log_term: int = 0  # APP: term of entry ``index``; votes: candidate's last term
    index: int = 0  # APP: index preceding ``entries``; votes: candidate's last index
    entries: list[Entry] = []
    commit: int = 0
    reject: bool = False
    reject_hint: int = 0  # APP_RESP reject: follower's best guess of the match index
    snapshot: Snapshot | None = None
    context: bytes = b""  # read-index context; b"transfer" on VOTE from a leadership transfer

    @property
    def stream(self) -> Stream:
        return _STREAM_OF.get(self.type, Stream.CONTROL)

    @property
    def is_response(self) -> bool:
        return self.type in _RESPONSES


_RESPONSES = frozenset(
    {
        MessageType.APP_RESP,
        MessageType.VOTE_RESP,
        MessageType.PRE_VOTE_RESP,
        MessageType.HEARTBEAT_RESP,
        MessageType.READ_INDEX_RESP,
    }
)

# Context a VOTE carries when it comes from a leadership transfer (TIMEOUT_NOW): it must
# override the receivers' leader stickiness.
CAMPAIGN_TRANSFER = b"transfer"


class ReadState(msgspec.Struct, frozen=True, gc=False):
    """A linearizable read may be served once the local applied index reaches ``index``."""

    index: int
    ctx: bytes


class StateRole(enum.IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3


@dataclass(slots=True)
class Ready:
    """One batch of work for the host. Host obligations (in this order):

    1. Persist ``snapshot`` (if any), then append ``entries`` (overwriting any suffix at or after
       the first entry's index) and ``hard_state`` (if any) to stable storage; fsync when
       ``must_sync`` is true.
    2. Only after step 1 is durable, send ``messages``. ``early_messages`` (leader appends,
       snapshots and heartbeats, which never depend on this Ready's persistence) may be sent at
       once, before or during step 1.
    3. Apply ``committed_entries`` (in order) to the state machine and serve ``read_states``
       whose index is <= the applied index.
    4. Call ``advance(ready)``. Only then does a leader count its own copy of ``entries``
       toward the commit quorum.
    ``step``/``tick``/``propose`` may be called between ``ready()`` and ``advance()``;
    ``ready()`` must not be called again before ``advance()``.
    """

    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    messages: list[Message] = field(default_factory=list)
    committed_entries: list[Entry] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
    must_sync: bool = False
    early_messages: list[Message] = field(default_factory=list)


@dataclass(slots=True)
class RaftBugs:
    """Test-only switches that deliberately break the core; all False in production."""

    vote_without_persist: bool = False  # grant a vote but leave it out of the Ready's hard state
    commit_prev_term_by_count: bool = False  # commit an older-term entry by counting replicas
    no_election_reset_on_append: bool = False  # forget to reset the election timer on a valid append
    # Leader counts itself toward quorum before its own sync: it counts an entry at propose and
    # hands its entries out with must_sync=False (observable through a host that honours it).
    self_ack_before_sync: bool = False
    # A Ready whose only durable change is the term or vote is written but not fsynced before
    # its messages (vote grants, rejections carrying the new term) go out: must_sync stays false.
    hard_state_sync_skipped: bool = False
    # A follower handles an append from a leader of a lower term instead of rejecting it.
    accept_stale_term_append: bool = False
    # A leader accepts a membership change while an earlier one is not applied (nor its own
    # first entry of the term): two changes in flight.
    conf_change_while_pending: bool = False
    # A restarted replica reloads its term but not its vote from the stored hard state.
    forget_vote_on_restart: bool = False
    # Heartbeats carry the leader's commit index instead of min(commit, the follower's match).
    heartbeat_commit_unclamped: bool = False
    # A snapshot installed over a log that disagrees at the snapshot's index keeps the entries
    # after that index (the rule is: keep them only if the entry at the index matches).
    snapshot_keeps_log_tail: bool = False

    def any(self) -> bool:
        return any(getattr(self, name) for name in RAFT_BUG_NAMES)


RAFT_BUG_NAMES: tuple[str, ...] = tuple(RaftBugs.__dataclass_fields__)


@dataclass(slots=True, kw_only=True)
class Config:
    """Configuration of one replica. Every bound has a default; ticks are logical."""

    id: MemberId
    election_tick: int = 10  # election timeout is drawn from [election_tick, 2*election_tick)
    heartbeat_tick: int = 1
    max_entries_per_append: int = 4096
    max_bytes_per_append: int = 1 << 20
    max_inflight_appends: int = 256  # pipelined appends per follower in replicate state
    max_uncommitted_bytes: int = 64 << 20  # leader refuses proposals beyond this (0: no limit)
    max_committed_bytes_per_ready: int = 8 << 20  # bound on committed_entries per Ready
    max_read_index_pending: int = 4096  # bound on outstanding read-index requests at the leader
    pre_vote: bool = True
    check_quorum: bool = True
    applied: int = 0  # index the host's state machine has applied (0: the snapshot index)
    rng: random.Random | None = None  # seeded; default derives a seed from ``id``
    bugs: RaftBugs = field(default_factory=RaftBugs)

    def validate(self) -> None:
        if self.id[0] <= 0:
            raise ValueError("node id must be >= 1")
        if self.heartbeat_tick <= 0 or self.election_tick <= self.heartbeat_tick:
            raise ValueError("need 0 < heartbeat_tick < election_tick")
        if self.max_entries_per_append <= 0 or self.max_bytes_per_append <= 0:
            raise ValueError("append limits must be positive")
        if self.max_inflight_appends <= 0:
            raise ValueError("max_inflight_appends must be positive")
        if self.max_committed_bytes_per_ready <= 0 or self.max_read_index_pending <= 0:
            raise ValueError("ready limits must be positive")
