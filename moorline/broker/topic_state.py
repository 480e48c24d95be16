"""The topic side of a shard's state machine (pure): message offsets, "owed", retained, de-dup.

A message is *owed* to every registration in this shard whose filter matched its topic when it
was applied; that set is decided here, at apply, so every replica agrees (docs/design.md, "Durable
subscriptions and owed"). A message leaves the store only when nothing is owed and it is older
than ``retention.min_age``, or through a counted limit that records its GUID and reason.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from moorline.broker.commands import (
    LEGACY_INC,
    AckReport,
    DropOwed,
    Housekeeping,
    Publish,
    Register,
    ShareActivate,
    ShareClaim,
    ShareDeadLettered,
    ShareDecline,
    ShareMember,
    ShareReturn,
    ShareTimeout,
    Unregister,
)
from moorline.broker.effects import Effects
from moorline.broker.guid_history import GuidHistory
from moorline.broker.message_index import NO_EXPIRY, MessageIndex
from moorline.broker.messages import StoredMessage, encode_message
from moorline.broker.retained_index import RetainedIndex
from moorline.hashing import crc32c
from moorline.invariant import invariant, violated
from moorline.mqtt.topics import SubscriptionTrie


@dataclass(slots=True)
class WorkQueue:
    """A $share group's work-queue policy (from its Registers) and the state it keeps."""

    single_active: bool = False  # one member (``active``) receives at a time
    active: str = ""  # the single-active group's active member (client id); "" while it has none
    max_deliveries: int = 0  # hand-outs without acknowledgement before dead-lettering; 0: unlimited
    ack_timeout_ms: int = 0  # 0: claims are never taken back from a connected member
    # offset -> times it was handed out and came back unacknowledged (session end, ack timeout)
    attempts: dict[int, int] = field(default_factory=dict)
    # offset -> entry time of its claim (groups with an ack timeout only)
    claim_ts: dict[int, int] = field(default_factory=dict)
    # offset -> (attempts, last member): past max_deliveries, to be published to the dead-letter
    # topic by the shard's leader (ShareDeadLettered ends it); never claimed again
    dead: dict[int, tuple[int, str]] = field(default_factory=dict)
    # offset -> the member it was last taken back from (ack timeout): offered to another first
    timed_out: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class Registration:
    reg_key: str  # client_id \0 filter, or "$share" \0 group \0 filter: the one copy of the client id
    session_inc: int
    filter: str
    qos: int
    no_local: bool
    share_group: str | None
    start_offset: int
    owed: dict[int, None] = field(default_factory=dict)  # offsets owed and not acked, ascending
    draining: bool = False  # unsubscribed: no new messages, finishing those in flight
    # $share members: client id -> the session incarnation that joined, in join order.
    members: dict[str, int] = field(default_factory=dict)
    # $share claims: offset -> (member, the incarnation it was claimed for). A claim of an ended
    # incarnation stays with it until that incarnation's ShareReturn, never passing to a newer one.
    claims: dict[int, tuple[str, int]] = field(default_factory=dict)
    sub_version: int = -1  # the latest Register's subscription version (plain registrations)
    # $share: offset -> members (client ids) whose read ACL refused it (ShareDecline), in order; an
    # offset every member declined is dropped ("acl_no_reader"). Gone with the offset's ownership.
    declined: dict[int, list[str]] = field(default_factory=dict)
    # A $share group's work-queue policy and state (docs/queues.md); None for every other
    # registration and group (snapshot version 5: absent before, and one nil for each of those).
    queue: WorkQueue | None = None

    def forget_offset(self, offset: int) -> None:
        """``offset`` is no longer owed: its work-queue bookkeeping goes with it."""
        q = self.queue
        if q is None:
            return
        if q.attempts:
            q.attempts.pop(offset, None)
        if q.claim_ts:
            q.claim_ts.pop(offset, None)
        if q.dead:
            q.dead.pop(offset, None)
        if q.timed_out:
            q.timed_out.pop(offset, None)

    @property
    def client_id(self) -> str:
        """The owner's client id ("" for a $share group), read from the key: a registration keeps
        no second copy of it (snapshots before version 4 did; decoding ignores that field)."""
        return "" if self.share_group is not None else self.reg_key.partition("\0")[0]


ACL_NO_READER = "acl_no_reader"  # the drop reason of a message no reader of its registration may read
DELIVERY_LIMIT = "delivery_limit"  # the drop reason of a message moved to its group's dead-letter topic
SEQ_JUMP_REASON_CODE = 0x83  # implementation specific error: never accepted, whenever resent


def producer_key(principal: str, producer: bytes) -> bytes:
    """The key of a sequenced producer's state: producer ids are 8 bytes, so producer + principal
    is unambiguous (principal "" has the producer id itself, as snapshots before version 4 did)."""
    return producer + principal.encode() if principal else producer


def same_incarnation(a: int, b: int) -> bool:
    """Whether two $share incarnation stamps name the same session (LEGACY_INC matches any)."""
    return a == b or LEGACY_INC in (a, b)


# The unowed heap packs (ts_ms, offset) into one int; offsets stay far below 2**40 (a trillion
# messages in one shard).
OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1


@dataclass(slots=True)
class DropRecord:
    guid: bytes
    reason: str
    offset: int
    reg_key: str


class PublishResult(msgspec.Struct, gc=False):  # one per publish: a Struct costs a third of a dataclass
    status: str  # "ok" | "duplicate" | "refused"
    offset: int = -1
    reason_code: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RegisterResult:
    start_offset: int
    retained: tuple[StoredMessage, ...]


@dataclass(slots=True)
class TopicLimits:
    retention_min_age_ms: int = 3_600_000
    shard_max_bytes: int = 1 << 30
    reserved_headroom_bytes: int = 16 << 20
    dedup_window_ms: int = 3_600_000
    dedup_max_history: int = 250_000
    producer_ttl_ms: int = 7 * 24 * 3_600_000
    # producer.max_seq_gap: a sequence further than this past its producer's highest is refused
    # (SEQ_JUMP_REASON_CODE), not applied: accepted, it would make the producer's every later
    # sequence a "duplicate". The Spark sink's first row of batch b is b << 32, so this allows a
    # producer to skip 2**24 - 1 batches.
    max_seq_gap: int = 1 << 56
    max_drop_records: int = 100_000
    max_release_per_housekeeping: int = 100_000
    # A deliberately broken build for tests (testing/faults.py, dedup_at_propose_only): apply
    # does not consult the GUID history (the proposer looked in its own replica's).
    dedup_at_propose_only: bool = False
    # A deliberately broken build for tests (testing/volatile_dlq.py, dlq_count_not_replicated):
    # $share delivery attempts never reach the limit here; the leader's dispatcher counts them in
    # its memory and its ShareDeadLettered is taken for any message still owed.
    dlq_count_not_replicated: bool = False


class TopicState:
    """Topic-shard state. Mutated only by ``apply_*``; effects go to ``Effects`` for the host."""

    def __init__(self, shard: int, incarnation: str, limits: TopicLimits) -> None:
        self.shard = shard
        self.incarnation = incarnation
        self.limits = limits
        self.next_offset = 0
        self.low_water = 0
        self.regs: dict[str, Registration] = {}
        self.trie: SubscriptionTrie = SubscriptionTrie()
        self.meta = MessageIndex()  # present messages, ascending
        self.owed_count: dict[int, int] = {}
        self.retained: dict[str, StoredMessage] = {}
        self.dedup = GuidHistory()  # (principal, guid) -> offset, ts, crc
        # producer_key(principal, producer) -> highest seq, its offset, ts
        self.producers: dict[bytes, tuple[int, int, int]] = {}
        self.bytes_used = 0
        self.drops: deque[DropRecord] = deque(maxlen=limits.max_drop_records)
        self.drop_counts: dict[str, int] = {}
        self.last_ts_ms = 0
        self.max_released = -1
        # Derived indexes (rebuilt from meta/owed on restore, never snapshotted):
        # Messages owed to nobody, as ts_ms << OFFSET_BITS | offset: one int per entry, not a tuple.
        self._unowed_heap: list[int] = []
        self._expiry_heap: list[tuple[int, int]] = []  # (expires_at_ms, offset)
        self._match_cache: dict[str, list[str]] = {}  # cleared whenever the trie changes
        # The topics of ``retained`` as a trie, so a Register finds its retained messages without a
        # scan: set and cleared with ``retained`` (``_retain``), rebuilt on restore.
        self.retained_index = RetainedIndex()
        # Registration -> bytes of the messages it is owed (payload + topic, as meta sizes count),
        # for session.max_queued_bytes. Only grows at apply and shrinks wherever owed shrinks.
        self.owed_bytes: dict[str, int] = {}
        # The $share registrations' keys (a dict: a deterministic order), so the leader's timers
        # (ack timeouts, dead letters) look at groups only, not at every subscription.
        self.share_keys: dict[str, None] = {}

    def _trie_changed(self) -> None:
        self._match_cache.clear()

    def rebuild_indexes(self) -> None:
        owed = self.owed_count
        times = list(self.meta.times())
        self._unowed_heap = [(ts << OFFSET_BITS) | o for o, ts, _ in times if not owed.get(o)]
        heapq.heapify(self._unowed_heap)
        self._expiry_heap = [(exp, o) for o, _, exp in times if exp is not None]
        heapq.heapify(self._expiry_heap)
        size_of = self.meta.size_of
        self.owed_bytes = {rk: sum(size_of(o) or 0 for o in reg.owed) for rk, reg in self.regs.items() if reg.owed}
        self.retained_index = RetainedIndex(self.retained)
        self.share_keys = {rk: None for rk, reg in self.regs.items() if reg.share_group is not None}

    def _owed_gone(self, reg_key: str, offsets: Iterable[int]) -> None:
        """``offsets`` are no longer owed to ``reg_key`` (acked, dropped, expired, returned)."""
        size_of = self.meta.size_of
        left = self.owed_bytes.get(reg_key, 0) - sum(size_of(o) or 0 for o in offsets)
        if left > 0:
            self.owed_bytes[reg_key] = left
        else:
            self.owed_bytes.pop(reg_key, None)

    # --- publish -------------------------------------------------------------------------
    def apply_publish(self, cmd: Publish, fx: Effects) -> PublishResult:
        return self.apply_publishes((cmd,), fx)[0]

    def apply_publishes(self, cmds: Sequence[Publish], fx: Effects) -> list[PublishResult]:
        if self.limits.dedup_at_propose_only:  # the broken build: see _apply_publish_unchecked
            return [self._apply_publish_unchecked(cmd, fx) for cmd in cmds]
        return self._apply_publishes(cmds, fx)

    def _apply_publish_unchecked(self, cmd: Publish, fx: Effects) -> PublishResult:
        """The broken build ``TopicLimits.dedup_at_propose_only``: a GUID the history holds is
        accepted again as a new message (the history keeps the first copy's entry)."""
        if self.dedup.get(cmd.principal, cmd.msg.guid) is None:
            return self._apply_publishes((cmd,), fx)[0]
        history, self.dedup = self.dedup, GuidHistory()
        try:
            return self._apply_publishes((cmd,), fx)[0]
        finally:
            self.dedup = history

    def _apply_publishes(self, cmds: Sequence[Publish], fx: Effects) -> list[PublishResult]:
        """Apply a run of consecutive ``Publish`` commands, in order; one result each.

        Exactly ``apply_publish`` once per command (nothing else can run between them within one
        log entry), written as one loop because it runs once per message: what is the same for a
        run (the limits, the matching registrations and the CRC of a repeated topic) is looked up
        once, and the accepted messages enter the message index and the GUID history together at
        the end (their offsets are dense). A GUID seen earlier in the same run is found in the
        run's own columns, so de-duplication is what it would be one command at a time."""
        results: list[PublishResult] = []
        limits = self.limits
        max_used = limits.shard_max_bytes - limits.reserved_headroom_bytes
        dedup_get = self.dedup.get_key
        key_of = GuidHistory.key_of
        producers = self.producers
        max_seq_gap = limits.max_seq_gap
        appends = fx.appends
        owed_regs = fx.owed_regs
        owed_new = fx.owed_new
        owed_count = self.owed_count
        owed_bytes = self.owed_bytes
        regs = self.regs
        unowed_heap = self._unowed_heap
        heappush = heapq.heappush
        first_offset = self.next_offset
        # The accepted messages' columns, in offset order from first_offset. Their GUID history
        # keys are those of run_seen, which keeps them in the same order (each accepted once).
        run_seen: dict[bytes, int] = {}  # GUID history key -> position in these columns
        times: list[int] = []
        sizes: list[int] = []
        guids: list[bytes] = []
        topics: list[str] = []
        qoss: list[int] = []
        expiries: list[int] = []
        crcs: list[int] = []
        last_topic: str | None = None
        topic_crc = 0
        matching: list[str] = []
        for cmd in cmds:
            msg = cmd.msg
            guid = msg.guid
            if len(guid) != 16:
                violated(f"GUIDs are 16 bytes, not {len(guid)}")
            ts_ms = msg.ts_ms
            if ts_ms > self.last_ts_ms:
                self.last_ts_ms = ts_ms
            topic = msg.topic
            if topic != last_topic:
                last_topic = topic
                topic_crc = crc32c(topic.encode() + b"\0")
                matching = self._matching(topic)
            content = crc32c(msg.payload, topic_crc)  # no copy of the payload
            producer, seq = cmd.producer, cmd.seq
            pkey = b""
            if producer is not None and seq is not None:
                # A producer's sequence is its principal's, as GUIDs are: another user naming the
                # same producer id has a sequence of its own and cannot touch this one.
                pkey = producer_key(cmd.principal, producer)
                prev = producers.get(pkey)
                if prev is not None:
                    if seq <= prev[0]:
                        results.append(PublishResult("duplicate", prev[1] if seq == prev[0] else -1))
                        continue
                    if seq - prev[0] > max_seq_gap:
                        # Accepted, it would make every later sequence of the producer a
                        # "duplicate": refused, never applied, never counted as a duplicate.
                        results.append(PublishResult("refused", reason_code=SEQ_JUMP_REASON_CODE,
                                                     reason=f"sequence {seq} jumps more than "
                                                            f"producer.max_seq_gap past {prev[0]}"))
                        continue
                    # The next sequence, or the first row of a later batch (high 32 bits: batch), is
                    # accepted; a gap means an earlier one is missing: refused, retriable, never applied.
                    next_batch = (seq >> 32) > (prev[0] >> 32) and (seq & 0xFFFFFFFF) == 0
                    if seq != prev[0] + 1 and not next_batch:
                        results.append(PublishResult("refused", reason_code=0x97,
                                                     reason=f"sequence gap after {prev[0]}"))
                        continue
            key = key_of(cmd.principal, guid)
            seen = dedup_get(key)
            if seen is None:
                i = run_seen.get(key, -1)
                if i >= 0:
                    seen = (first_offset + i, times[i], crcs[i])
            if seen is not None:
                if seen[2] != content:
                    results.append(PublishResult("refused", reason_code=0x99,
                                                 reason="GUID reused with different content"))
                else:
                    results.append(PublishResult("duplicate", seen[0]))
                continue
            size = len(msg.payload) + len(topic) + 64  # msg.size(), inlined: once per message
            if self.bytes_used + size > max_used:
                results.append(PublishResult("refused", reason_code=0x97, reason="shard is full"))
                continue
            offset = self.next_offset
            if offset > OFFSET_MASK:
                violated(f"shard {self.shard}: message offset {offset} beyond {OFFSET_BITS} bits")
            self.next_offset = offset + 1
            appends.append((offset, encode_message(msg), msg))
            exp = None if msg.expiry_s is None else msg.expires_at_ms()
            run_seen[key] = len(times)
            times.append(ts_ms)
            sizes.append(size)
            guids.append(guid)
            topics.append(topic)
            qoss.append(msg.qos)
            expiries.append(NO_EXPIRY if exp is None else exp)
            crcs.append(content)
            self.bytes_used += size
            if pkey and seq is not None:
                producers[pkey] = (seq, offset, ts_ms)
            if msg.retain:
                self._retain(topic, msg)
            owed = 0
            for reg_key in matching:
                reg = regs[reg_key]
                if reg.draining or (reg.no_local and reg.client_id == msg.origin):
                    continue
                reg.owed[offset] = None
                owed_bytes[reg_key] = owed_bytes.get(reg_key, 0) + size
                owed += 1
                owed_regs.add(reg_key)  # fx.owed(reg_key, offset), without the call: once per message
                owed_new.append((offset, reg_key))
            if owed:
                owed_count[offset] = owed
            else:
                heappush(unowed_heap, (ts_ms << OFFSET_BITS) | offset)
            if exp is not None:
                heappush(self._expiry_heap, (exp, offset))
            results.append(PublishResult("ok", offset))
        if times:
            self.meta.add_run(first_offset, times, sizes, b"".join(guids), topics, qoss, expiries)
            self.dedup.add_run(list(run_seen), list(range(first_offset, self.next_offset)), times, crcs)
        return results

    def _retain(self, topic: str, msg: StoredMessage) -> None:
        """A retained PUBLISH: an empty payload clears the topic's retained message (MQTT-3.3.1-10)."""
        if msg.payload:
            if topic not in self.retained:
                self.retained_index.add(topic)
            self.retained[topic] = msg
        elif self.retained.pop(topic, None) is not None:
            self.retained_index.discard(topic)

    def _matching(self, topic: str) -> list[str]:
        """Registration keys whose filter matches ``topic``, sorted (a cache over the trie)."""
        keys = self._match_cache.get(topic)
        if keys is None:
            if len(self._match_cache) >= 10_000:
                self._match_cache.clear()
            keys = self._match_cache[topic] = sorted(k for k, _ in self.trie.match(topic))
        return keys

    # --- registrations -------------------------------------------------------------------
    def apply_register(self, cmd: Register, fx: Effects) -> RegisterResult:
        reg = self.regs.get(cmd.reg_key)
        if (reg is not None and cmd.share_group is None and reg.session_inc == cmd.session_inc
                and cmd.sub_version < reg.sub_version and cmd.sub_version >= 0):
            return RegisterResult(reg.start_offset, ())  # overtaken by a later subscribe or unsubscribe
        if reg is not None and cmd.share_group is None and 0 <= cmd.session_inc < reg.session_inc:
            # Incarnations of a client id only grow (one session shard numbers them all): an ended
            # incarnation's Register, applied after its successor's, must not replace that one.
            return RegisterResult(reg.start_offset, ())
        if reg is not None and (reg.session_inc == cmd.session_inc or cmd.share_group is not None):
            if cmd.share_group is not None:
                self._share_policy(reg, cmd)
            reg.sub_version = max(reg.sub_version, cmd.sub_version)
            reg.qos = cmd.qos
            reg.no_local = cmd.no_local
            if reg.draining:
                reg.draining = False
                self._trie_changed()
                self.trie.insert(reg.filter, reg.reg_key, None)
        else:
            if reg is not None:
                self._remove_registration(reg, "session_replaced", fx)
            reg = Registration(
                cmd.reg_key, cmd.session_inc, cmd.filter, cmd.qos, cmd.no_local,
                cmd.share_group, self.next_offset, sub_version=cmd.sub_version,
            )
            if cmd.share_group is not None:
                self._share_policy(reg, cmd)
                self.share_keys[cmd.reg_key] = None
            self.regs[cmd.reg_key] = reg
            self._trie_changed()
            self.trie.insert(reg.filter, reg.reg_key, None)
        retained: tuple[StoredMessage, ...] = ()
        if cmd.want_retained and cmd.share_group is None:
            by_topic = self.retained
            retained = tuple(
                m for m in (by_topic[t] for t in self.retained_index.match(cmd.filter))
                if not (cmd.no_local and m.origin == cmd.client_id)
            )
            if retained:
                fx.retained_new.append((cmd.reg_key, retained, self.next_offset))
        return RegisterResult(reg.start_offset, retained)

    @staticmethod
    def _share_policy(reg: Registration, cmd: Register) -> None:
        """A $share Register's work-queue policy: single-active only ever turns on; the limits are
        the latest Register's (every node is expected to run the same configuration)."""
        q = reg.queue
        if q is None:
            if not (cmd.single_active or cmd.max_deliveries or cmd.ack_timeout_ms):
                return  # a plain group: no work-queue state at all
            q = reg.queue = WorkQueue()
        if cmd.single_active and not q.single_active:
            q.single_active = True
            if not q.active and reg.members:
                q.active = next(iter(reg.members))
        q.max_deliveries = cmd.max_deliveries
        q.ack_timeout_ms = cmd.ack_timeout_ms

    def apply_unregister(self, cmd: Unregister, fx: Effects) -> bool:
        reg = self.regs.get(cmd.reg_key)
        if reg is None or (cmd.session_inc >= 0 and reg.session_inc != cmd.session_inc):
            return False
        if 0 <= cmd.sub_version < reg.sub_version:
            return False  # a later subscribe of the same session already replaced what this undoes
        if cmd.reason == "unsubscribe" and reg.share_group is None:
            # Stop new messages; those already owed are finished (delivered and acked) first.
            if not reg.draining:
                reg.draining = True
                self._trie_changed()
                self.trie.remove(reg.filter, reg.reg_key)
            if not reg.owed:
                self._forget(reg)
            return True
        self._remove_registration(reg, cmd.reason, fx)
        return True

    def _remove_registration(self, reg: Registration, reason: str, fx: Effects) -> None:
        for offset in list(reg.owed):
            self._record_drop(offset, reg.reg_key, reason)
            self._unowe(offset)
        reg.owed.clear()
        self.owed_bytes.pop(reg.reg_key, None)
        self._forget(reg)

    def _forget(self, reg: Registration) -> None:
        if not reg.draining:
            self._trie_changed()
            self.trie.remove(reg.filter, reg.reg_key)
        del self.regs[reg.reg_key]
        self.share_keys.pop(reg.reg_key, None)
        self.owed_bytes.pop(reg.reg_key, None)

    def apply_ack_report(self, cmd: AckReport, fx: Effects) -> None:
        reg = self.regs.get(cmd.reg_key)
        if reg is None:
            return
        owed, claims = reg.owed, reg.claims
        had_claims = bool(claims)
        share = reg.share_group is not None
        acked: list[int] = []
        declined = reg.declined
        for offset in cmd.offsets:  # once per acknowledged message: no call per offset
            if offset in owed:
                del owed[offset]
                if claims:
                    claims.pop(offset, None)
                if share:
                    reg.forget_offset(offset)
                if declined:
                    declined.pop(offset, None)
                acked.append(offset)
        if acked:
            self._owed_gone(reg.reg_key, acked)
            self._unowe_run(acked)
            if had_claims and owed:
                # A $share member acknowledged: its window has room again, wherever it is
                # connected, so the group's dispatcher (on this shard's leader) looks again.
                fx.owed(reg.reg_key)
        if reg.draining and not owed:
            self._forget(reg)

    def _unowe(self, offset: int) -> None:
        self._unowe_run((offset,))

    def _unowe_run(self, offsets: Sequence[int]) -> None:
        """One registration fewer owes each of ``offsets``; those owed to nobody now join the unowed heap."""
        owed_count = self.owed_count
        free: list[int] = []
        for offset in offsets:
            n = owed_count.get(offset, 0)
            if n <= 0:
                violated(f"offset {offset} was not owed")
            if n == 1:
                del owed_count[offset]
                free.append(offset)
            else:
                owed_count[offset] = n - 1
        if free:
            heap = self._unowed_heap
            for key in self.meta.time_keys(free, OFFSET_BITS):
                heapq.heappush(heap, key)

    def _record_drop(self, offset: int, reg_key: str, reason: str) -> None:
        guid = self.meta.guid_of(offset) or b""
        self.drops.append(DropRecord(guid, reason, offset, reg_key))
        self.drop_counts[reason] = self.drop_counts.get(reason, 0) + 1

    def apply_drop_owed(self, cmd: DropOwed, fx: Effects) -> None:
        reg = self.regs.get(cmd.reg_key)
        if reg is None:
            return
        for offset in cmd.offsets:
            if offset in reg.owed:
                del reg.owed[offset]
                reg.claims.pop(offset, None)
                reg.declined.pop(offset, None)
                reg.forget_offset(offset)
                self._record_drop(offset, reg.reg_key, cmd.reason)
                self._owed_gone(reg.reg_key, (offset,))
                self._unowe(offset)

    # --- shared subscriptions --------------------------------------------------------------
    def apply_share_member(self, cmd: ShareMember, fx: Effects) -> None:
        reg = self.regs.get(cmd.reg_key)
        if reg is None:
            return
        current = reg.members.get(cmd.member)
        if cmd.joined:
            # Incarnations of a client id only grow (one session shard numbers them all): a join
            # of an older one than the member's, applied late, changes nothing.
            if current is None or cmd.session_inc > current:
                reg.members[cmd.member] = cmd.session_inc
                # A new session of the client id (perhaps another user's): its read rights are its own.
                for who in reg.declined.values():
                    if cmd.member in who:
                        who.remove(cmd.member)
            q = reg.queue
            if q is not None and q.single_active and not q.active:
                q.active = cmd.member
        elif current is not None and (same_incarnation(current, cmd.session_inc) or cmd.session_inc > current):
            # An ended incarnation's leave, applied after a newer one joined, leaves that one in.
            del reg.members[cmd.member]
            q = reg.queue
            if q is not None and q.active == cmd.member:
                # The next member in join order: the leader's dispatcher moves it on from there to
                # the first one online (ShareActivate), once this one's claims are back.
                q.active = next(iter(reg.members), "")
            if reg.declined:  # perhaps every member left now declined some
                self._drop_unreadable(reg, list(reg.declined))
        fx.owed(cmd.reg_key)

    def apply_share_claim(self, cmd: ShareClaim, fx: Effects) -> tuple[int, ...]:
        reg = self.regs.get(cmd.reg_key)
        current = reg.members.get(cmd.member) if reg is not None else None
        if reg is None or current is None or not same_incarnation(current, cmd.session_inc):
            return ()  # not a member, or claimed for an incarnation that is no longer the member
        q = reg.queue
        holder = (cmd.member, cmd.session_inc)
        if q is not None and q.single_active:
            if q.active != cmd.member:
                return ()  # a single-active group's standby members receive nothing
            if any(h != holder for h in reg.claims.values()):
                # Another holder still has claims: a member that left (the leave made this one
                # active at once) or an ended incarnation whose claims the leader's follow-ups have
                # not returned yet. One holder at a time, so that the group's order holds (sim
                # --cluster seed 148: sa3's ended incarnation held claims when sa2 was given more).
                return ()
        granted = []
        claim_ts = q.claim_ts if q is not None and q.ack_timeout_ms > 0 and cmd.ts_ms > 0 else None
        dead = q.dead if q is not None else None
        for offset in cmd.offsets:
            if offset in reg.owed and offset not in reg.claims and not (dead and offset in dead):
                reg.claims[offset] = holder
                if claim_ts is not None:
                    claim_ts[offset] = cmd.ts_ms
                granted.append(offset)
        fx.claimed(cmd.reg_key, cmd.member, tuple(granted))
        return tuple(granted)

    def apply_share_decline(self, cmd: ShareDecline, fx: Effects) -> tuple[int, ...]:
        """Claims of the member's incarnation its read ACL refused go back to the group, declined
        by it; returns the offsets dropped because no member of the group may read them."""
        reg = self.regs.get(cmd.reg_key)
        if reg is None:
            return ()
        back: list[int] = []
        for offset in cmd.offsets:
            holder = reg.claims.get(offset)
            if holder is None or holder[0] != cmd.member or not same_incarnation(holder[1], cmd.session_inc):
                continue
            del reg.claims[offset]
            if reg.queue is not None:
                reg.queue.claim_ts.pop(offset, None)
            who = reg.declined.setdefault(offset, [])
            if cmd.member not in who:
                who.append(cmd.member)
            back.append(offset)
        dropped = self._drop_unreadable(reg, back)
        if back:
            fx.owed(cmd.reg_key)  # the dispatcher offers them to another member
        return dropped

    def _drop_unreadable(self, reg: Registration, offsets: Iterable[int]) -> tuple[int, ...]:
        """Drops (counted, "acl_no_reader") those of ``offsets`` still owed and unclaimed that every
        member of the group declined. A group without members keeps them for the next member."""
        members = reg.members
        if not members:
            return ()
        dropped: list[int] = []
        for offset in offsets:
            who = reg.declined.get(offset)
            if who is None or offset not in reg.owed or offset in reg.claims:
                continue
            if all(m in who for m in members):
                del reg.owed[offset]
                del reg.declined[offset]
                reg.forget_offset(offset)
                self._record_drop(offset, reg.reg_key, ACL_NO_READER)
                self._owed_gone(reg.reg_key, (offset,))
                self._unowe(offset)
                dropped.append(offset)
        return tuple(dropped)

    def apply_share_return(self, cmd: ShareReturn, fx: Effects) -> None:
        reg = self.regs.get(cmd.reg_key)
        if reg is None:
            return
        mine = {o for o, (m, inc) in reg.claims.items()
                if m == cmd.member and same_incarnation(inc, cmd.session_inc)}
        dropped = set(cmd.dropped)
        for offset in sorted(mine):
            del reg.claims[offset]
            if offset in dropped and offset in reg.owed:
                del reg.owed[offset]
                reg.declined.pop(offset, None)
                reg.forget_offset(offset)
                self._record_drop(offset, reg.reg_key, "share_qos2_member_gone")
                self._owed_gone(reg.reg_key, (offset,))
                self._unowe(offset)
            else:
                self._handed_back(reg, offset, cmd.member)
        fx.owed(cmd.reg_key)

    def _handed_back(self, reg: Registration, offset: int, member: str) -> None:
        """A claim of ``offset`` (no longer in ``reg.claims``) came back unacknowledged: one
        delivery attempt more; at the group's max_deliveries it waits for the dead-letter topic."""
        q = reg.queue
        if q is None:
            return  # a plain group counts nothing
        q.claim_ts.pop(offset, None)
        if offset not in reg.owed:
            return
        n = q.attempts.get(offset, 0) + 1
        if 0 < q.max_deliveries <= n and not self.limits.dlq_count_not_replicated:
            q.attempts.pop(offset, None)
            q.timed_out.pop(offset, None)
            q.dead[offset] = (n, member)
        else:
            q.attempts[offset] = n

    def apply_share_activate(self, cmd: ShareActivate, fx: Effects) -> bool:
        """Whether the single-active group's active member moved from ``cmd.prev`` to ``cmd.member``."""
        reg = self.regs.get(cmd.reg_key)
        q = reg.queue if reg is not None else None
        if (reg is None or q is None or not q.single_active or q.active != cmd.prev or cmd.member not in reg.members
                or cmd.member == cmd.prev):
            return False
        if reg.claims:
            # What the active member holds comes back first, and so does what any other holder
            # still holds (an ended incarnation's claims, returned by the leader's follow-ups):
            # the order holds (sim --cluster seed 148).
            return False
        q.active = cmd.member
        fx.owed(cmd.reg_key)
        return True

    def apply_share_timeout(self, cmd: ShareTimeout, fx: Effects) -> tuple[int, ...]:
        """Claims of (member, incarnation) held past the group's ack timeout at the entry's time go
        back to the group; returns them."""
        reg = self.regs.get(cmd.reg_key)
        q = reg.queue if reg is not None else None
        if reg is None or q is None or q.ack_timeout_ms <= 0:
            return ()
        back: list[int] = []
        for offset in cmd.offsets:
            holder = reg.claims.get(offset)
            at = q.claim_ts.get(offset)
            if (holder is None or holder[0] != cmd.member or not same_incarnation(holder[1], cmd.session_inc)
                    or at is None or cmd.ts_ms - at < q.ack_timeout_ms):
                continue
            del reg.claims[offset]
            back.append(offset)
            self._handed_back(reg, offset, cmd.member)
            if offset in reg.owed and offset not in q.dead:
                q.timed_out[offset] = cmd.member
        if back:
            fx.owed(cmd.reg_key)
        return tuple(back)

    def apply_share_dead_lettered(self, cmd: ShareDeadLettered, fx: Effects) -> tuple[int, ...]:
        """Dead-lettered messages leave the group, recorded and counted as ``delivery_limit``."""
        reg = self.regs.get(cmd.reg_key)
        if reg is None or reg.queue is None:
            return ()
        done: list[int] = []
        dead = reg.queue.dead
        for offset in cmd.offsets:
            if (offset not in dead and not self.limits.dlq_count_not_replicated) or offset not in reg.owed:
                continue
            del reg.owed[offset]
            reg.claims.pop(offset, None)
            reg.declined.pop(offset, None)
            reg.forget_offset(offset)
            self._record_drop(offset, reg.reg_key, DELIVERY_LIMIT)
            self._owed_gone(reg.reg_key, (offset,))
            self._unowe(offset)
            done.append(offset)
        if done:
            fx.owed(cmd.reg_key)
        return tuple(done)

    # --- time-driven limits ------------------------------------------------------------------
    def apply_housekeeping(self, cmd: Housekeeping, fx: Effects) -> None:
        now = max(self.last_ts_ms, cmd.ts_ms)
        self.last_ts_ms = now
        # Message expiry: a counted drop for every registration still owed the message.
        exp = self._expiry_heap
        while exp and exp[0][0] <= now:
            _, offset = heapq.heappop(exp)
            if offset not in self.meta or not self.owed_count.get(offset):
                continue
            for reg in sorted(self.regs.values(), key=lambda r: r.reg_key):
                if offset in reg.owed:
                    del reg.owed[offset]
                    reg.claims.pop(offset, None)
                    reg.declined.pop(offset, None)
                    reg.forget_offset(offset)
                    self._record_drop(offset, reg.reg_key, "message_expiry")
                    self._owed_gone(reg.reg_key, (offset,))
                    self._unowe(offset)
        # Release what nobody is owed once it is older than retention.min_age (and not pinned).
        released: list[int] = []
        pinned: list[int] = []
        heap = self._unowed_heap
        cutoff = now - self.limits.retention_min_age_ms
        budget = self.limits.max_release_per_housekeeping
        meta = self.meta
        while heap and budget > 0:
            item = heap[0]
            ts, offset = item >> OFFSET_BITS, item & OFFSET_MASK
            exp_at = meta.expires_at(offset)
            if ts > cutoff and not (exp_at is not None and exp_at <= now):
                break
            heapq.heappop(heap)
            size = meta.size_of(offset)
            if size is None or self.owed_count.get(offset):
                continue  # already released, or owed again (stale heap entry)
            if 0 <= cmd.pin_floor <= offset:
                pinned.append(item)
                continue
            meta.discard(offset)
            self.bytes_used -= size
            released.append(offset)
            budget -= 1
        for item in pinned:
            heapq.heappush(heap, item)
        if released:
            released.sort()
            fx.store_release(released)
            self.max_released = max(self.max_released, released[-1])
            # Low water: every offset at or above it is present; released offsets are the gaps.
            lw = self.max_released + 1
            invariant(lw >= self.low_water, "low-water mark only rises")
            self.low_water = lw
        self.dedup.evict(now - self.limits.dedup_window_ms, self.limits.dedup_max_history)
        pcut = now - self.limits.producer_ttl_ms
        if self.producers:
            for p in [p for p, v in self.producers.items() if v[2] < pcut]:
                del self.producers[p]
