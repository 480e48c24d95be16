"""A shard's replicated state machine: topic side + session side, one ``apply`` entry point.

Pure and deterministic: same commands in the same order give byte-identical snapshots on every
replica. Cross-shard effects are returned to the host (``Effects``), never performed here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.guid_history import GuidHistory
from moorline.broker.membership import MembershipSnapshot, MembershipState
from moorline.broker.message_index import MessageIndex
from moorline.broker.messages import StoredMessage
from moorline.broker.session_state import (
    InflightDelivery,
    OwedWill,
    Session,
    SessionState,
    SubscriptionState,
)
from moorline.broker.topic_state import (
    DropRecord,
    Registration,
    TopicLimits,
    TopicState,
)

# 2: message index and GUID history as columns; 3: $share incarnations; 4: sequenced producers keyed
# by (principal, producer), registrations without a copy of the client id; 5: a $share group's
# work-queue policy and state (Registration.queue: single-active, delivery attempts, dead letters,
# ack timeouts; None elsewhere, and absent, so None, in a version-4 snapshot); 6: readers' retention
# pins (``Pin``; absent, so none, in older snapshots). Wills owed (``SessionState.wills_owed``) came
# within version 6 as an optional field: absent, so none owed, in snapshots written before them
SNAPSHOT_VERSION = 6


# How far ahead of a node's last admitted boot (ShardState.admit) a new boot may be: a node starts
# that many times without one proposal to a shard only in a crash loop of months.
MAX_BOOT_JUMP = 1 << 20


class ShardState:
    def __init__(self, shard: int, incarnation: str, limits: TopicLimits, max_session_expiry_s: int) -> None:
        self.shard = shard
        self.topics = TopicState(shard, incarnation, limits)
        self.sessions = SessionState(max_session_expiry_s)
        self.sink_markers: dict[str, int] = {}
        # Readers' retention pins (``c.Pin``): reader -> (offset, until_ms, owner).
        self.pins: dict[str, tuple[int, int, str]] = {}
        self.cluster: c.ClusterRecord | None = None  # the metadata group's record of the cluster
        self.membership: MembershipState | None = None  # the metadata group's member table (from the record on)
        self.applied_index = 0
        # Proposer node -> (boot, last seq applied). A node's proposals to a shard apply strictly in
        # their order: the next seq of its boot (1 for a new boot) or nothing. A copy already applied
        # (resent to a new leader), a dead boot's leftover and anything after a gap (a proposal lost
        # with a leader or a dropped frame) are skipped; the origin resends everything it has not
        # seen applied, in order, so the gap fills and what follows applies then.
        self.proposals: dict[int, tuple[int, int]] = {}

    def admit(self, origin: int, boot: int, seq: int) -> bool:
        """Whether the entry proposed as (origin, boot, seq) is applied now, or skipped.

        A boot more than MAX_BOOT_JUMP above the origin's last one (0 when none) is skipped too: one
        entry (a bug, or a frame a peer forged) must not move a node's admission past every boot it
        will ever have. A node whose admission is nevertheless ahead of its boot, or too far behind
        it, proposes under a boot that follows the admitted one (ShardHost.check_admission)."""
        if origin == 0:
            return True  # entries from before proposal ids
        last = self.proposals.get(origin)
        if boot > (last[0] if last is not None else 0) + MAX_BOOT_JUMP:
            return False
        if last is None or boot > last[0]:
            if seq != 1:
                return False  # a new boot starts at 1: an earlier proposal of it is missing
        elif boot < last[0] or seq != last[1] + 1:
            return False
        self.proposals[origin] = (boot, seq)
        return True

    def apply(self, cmd: c.Command, fx: Effects) -> Any:
        t = self.topics
        s = self.sessions
        match cmd:
            case c.Publish():
                return t.apply_publish(cmd, fx)
            case c.Deliver():
                return s.apply_deliver(cmd, fx)
            case c.SessionAcks():
                return s.apply_acks(cmd, fx)
            case c.AckReport():
                return t.apply_ack_report(cmd, fx)
            case c.Register():
                return t.apply_register(cmd, fx)
            case c.Unregister():
                return t.apply_unregister(cmd, fx)
            case c.ShareMember():
                return t.apply_share_member(cmd, fx)
            case c.ShareClaim():
                return t.apply_share_claim(cmd, fx)
            case c.ShareReturn():
                return t.apply_share_return(cmd, fx)
            case c.ShareDecline():
                return t.apply_share_decline(cmd, fx)
            case c.ShareActivate():
                return t.apply_share_activate(cmd, fx)
            case c.ShareTimeout():
                return t.apply_share_timeout(cmd, fx)
            case c.ShareDeadLettered():
                return t.apply_share_dead_lettered(cmd, fx)
            case c.DropOwed():
                return t.apply_drop_owed(cmd, fx)
            case c.Housekeeping():
                return t.apply_housekeeping(self._pinned(cmd), fx)
            case c.SessionOpen():
                return s.apply_open(cmd, fx)
            case c.SessionSubscribe():
                return s.apply_subscribe(cmd, fx)
            case c.SessionUnsubscribe():
                return s.apply_unsubscribe(cmd, fx)
            case c.InboundQos2():
                return s.apply_inbound_qos2(cmd, fx)
            case c.InboundRelease():
                return s.apply_inbound_release(cmd, fx)
            case c.SessionClose():
                return s.apply_close(cmd, fx)
            case c.SessionHousekeeping():
                return s.apply_housekeeping(cmd, fx)
            case c.WillPublished():
                return s.apply_will_published(cmd, fx)
            case c.SessionsForget():
                return None
            case c.SessionRenew():
                return s.apply_renew(cmd, fx)
            case c.LeaseRelease():
                return s.apply_release(cmd, fx)
            case c.SetSinkMarker():
                prev = self.sink_markers.get(cmd.query_id, -1)
                self.sink_markers[cmd.query_id] = max(prev, cmd.batch_id)
                return self.sink_markers[cmd.query_id]
            case c.Pin():
                return self._apply_pin(cmd)
            case c.Unpin():
                held = self.pins.get(cmd.reader)
                if held is not None and held[2] != cmd.owner:
                    return "held"
                self.pins.pop(cmd.reader, None)
                return "ok"
            case c.ClusterBootstrap():
                if self.cluster is None:
                    self.cluster = cmd.record
                    self.membership = MembershipState.from_record(cmd.record)
                return self.cluster
            case c.MemberAnnounce() | c.MemberSetState() | c.MoveStart() | c.MoveEnd():
                if self.membership is None:
                    return "the metadata group holds no cluster record yet"
                return self.membership.apply(cmd)
        raise ValueError(f"unknown command {type(cmd).__name__}")

    def _apply_pin(self, cmd: c.Pin) -> str:
        pins = self.pins
        held = pins.get(cmd.reader)
        if held is not None and held[2] != cmd.owner:
            return "held"
        if held is None:
            if len(pins) >= cmd.max_pins:
                return "too_many"
            if sum(1 for p in pins.values() if p[2] == cmd.owner) >= cmd.max_per_owner:
                return "too_many_for_owner"
        pins[cmd.reader] = (cmd.offset, cmd.ts_ms + max(0, cmd.ttl_ms), cmd.owner)
        return "ok"

    def _pinned(self, cmd: c.Housekeeping) -> c.Housekeeping:
        """``cmd`` with its pin floor lowered to the lowest offset pinned here; pins whose time
        ran out by the entry's time go first."""
        pins = self.pins
        if not pins:
            return cmd
        for reader in [r for r, (_o, until, _w) in pins.items() if until < cmd.ts_ms]:
            del pins[reader]
        floor = cmd.pin_floor
        for offset, _until, _owner in pins.values():
            if floor < 0 or offset < floor:
                floor = offset
        return cmd if floor == cmd.pin_floor else msgspec.structs.replace(cmd, pin_floor=floor)

    def apply_publishes(self, cmds: list[c.Publish], fx: Effects) -> list[Any]:
        """``apply`` of each command of a run of ``Publish`` commands, in one call (the hot path)."""
        return self.topics.apply_publishes(cmds, fx)

    # --- snapshots (canonical encoding) ----------------------------------------------------
    def snapshot(self) -> bytes:
        t = self.topics
        s = self.sessions
        snap = _Snapshot(
            version=SNAPSHOT_VERSION,
            shard=self.shard,
            applied_index=self.applied_index,
            incarnation=t.incarnation,
            next_offset=t.next_offset,
            low_water=t.low_water,
            regs=list(t.regs.values()),
            meta=t.meta.to_columns(),
            retained=sorted(t.retained.values(), key=lambda m: m.topic),
            dedup=t.dedup.to_columns(),
            producers=sorted((p, v[0], v[1], v[2]) for p, v in t.producers.items()),
            bytes_used=t.bytes_used,
            drops=list(t.drops),
            drop_counts=dict(sorted(t.drop_counts.items())),
            topic_ts_ms=t.last_ts_ms,
            max_released=t.max_released,
            sessions=list(s.sessions.values()),
            incarnations=s.incarnations,
            epochs=s.epochs,
            session_ts_ms=s.last_ts_ms,
            wills_owed=list(s.wills_owed.values()),
            sink_markers=dict(sorted(self.sink_markers.items())),
            pins=sorted((r, o, u, w) for r, (o, u, w) in self.pins.items()),
            proposals=sorted((o, b, s) for o, (b, s) in self.proposals.items()),
            cluster=self.cluster,
            membership=self.membership.to_snapshot() if self.membership is not None else None,
        )
        return msgspec.msgpack.encode(snap)

    @classmethod
    def restore(cls, data: bytes, limits: TopicLimits, max_session_expiry_s: int) -> ShardState:
        try:
            snap = msgspec.msgpack.decode(data, type=_Snapshot)
        except msgspec.ValidationError:
            # Version 2 kept $share members as a list and claims without incarnations. Looked at
            # only on a failed decode: a second parse of every snapshot costs ~8% of its decode.
            if msgspec.msgpack.decode(data, type=_Version).version != 2:
                raise
            snap = msgspec.msgpack.decode(_upgrade_v2(data), type=_Snapshot)
        if snap.version in (2, 3):  # (a version 2 without registrations fits version 3's types as it is)
            snap.producers = _attribute_producers(snap.producers, snap.dedup[0])
            snap.version = SNAPSHOT_VERSION
        if snap.version in (4, 5):  # no work-queue fields (4), no pins (4, 5): their defaults
            snap.version = SNAPSHOT_VERSION
        if snap.version != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported snapshot version {snap.version}")
        st = cls(snap.shard, snap.incarnation, limits, max_session_expiry_s)
        st.applied_index = snap.applied_index
        t = st.topics
        t.next_offset = snap.next_offset
        t.low_water = snap.low_water
        for reg in snap.regs:
            t.regs[reg.reg_key] = reg
            if not reg.draining:
                t.trie.insert(reg.filter, reg.reg_key, None)
        t.meta = MessageIndex.from_columns(snap.meta)
        for reg in snap.regs:
            for o in reg.owed:
                t.owed_count[o] = t.owed_count.get(o, 0) + 1
        t.retained = {m.topic: m for m in snap.retained}
        t.dedup = GuidHistory.from_columns(snap.dedup)
        t.producers = {p: (seq, o, ts) for p, seq, o, ts in snap.producers}
        t.bytes_used = snap.bytes_used
        t.drops = deque(snap.drops, maxlen=limits.max_drop_records)
        t.drop_counts = dict(snap.drop_counts)
        t.last_ts_ms = snap.topic_ts_ms
        t.max_released = snap.max_released
        t.rebuild_indexes()
        st.sessions.sessions = {x.client_id: x for x in snap.sessions}
        st.sessions.incarnations = snap.incarnations
        st.sessions.epochs = snap.epochs
        st.sessions.last_ts_ms = snap.session_ts_ms
        st.sessions.wills_owed = {(w.client_id, w.incarnation, w.epoch): w for w in snap.wills_owed}
        st.sessions.rebuild_counts()
        st.sink_markers = dict(snap.sink_markers)
        st.pins = {r: (o, u, w) for r, o, u, w in snap.pins}
        st.proposals = {o: (b, s) for o, b, s in snap.proposals}
        st.cluster = snap.cluster
        if snap.membership is not None:
            st.membership = MembershipState.from_snapshot(snap.membership)
        elif snap.cluster is not None:  # a metadata snapshot from before the member table
            st.membership = MembershipState.from_record(snap.cluster)
        return st


def _attribute_producers(producers: list[tuple[bytes, int, int, int]],
                         history_keys: list[bytes]) -> list[tuple[bytes, int, int, int]]:
    """Producers of a snapshot before version 4 (keyed by producer id alone) keyed by (principal,
    producer): each goes to the principal whose GUID history holds its highest sequence's GUID
    (producer ‖ seq), else to principal "" (its history entry expired: the GUID history no longer
    knows whose it was)."""
    owner = {k[:16]: k[16:] for k in history_keys if len(k) > 16}  # GUID -> principal (UTF-8)
    out = []
    for p, seq, o, ts in producers:
        principal = owner.get(p + seq.to_bytes(8, "big"), b"") if 0 <= seq < 1 << 64 else b""
        out.append((p + principal, seq, o, ts))
    return sorted(out)


class _Version(msgspec.Struct):
    version: int


def _upgrade_v2(data: bytes) -> bytes:
    """A version-2 snapshot as version 3: $share members and claims recorded without the
    member's incarnation match any incarnation of it (LEGACY_INC), as they did."""
    raw = msgspec.msgpack.decode(data)
    for reg in raw["regs"]:
        reg["members"] = {m: c.LEGACY_INC for m in reg.get("members", ())}
        reg["claims"] = {o: (m, c.LEGACY_INC) for o, m in reg.get("claims", {}).items()}
    raw["version"] = 3
    return msgspec.msgpack.encode(raw)


@dataclass
class _Snapshot:
    version: int
    shard: int
    applied_index: int
    incarnation: str
    next_offset: int
    low_water: int
    regs: list[Registration]
    meta: tuple[int, bytes, bytes, bytes, bytes, bytes, list[str]]  # MessageIndex columns
    retained: list[StoredMessage]
    dedup: tuple[list[bytes], bytes, bytes, bytes]  # GuidHistory columns
    producers: list[tuple[bytes, int, int, int]]
    bytes_used: int
    drops: list[DropRecord]
    drop_counts: dict[str, int]
    topic_ts_ms: int
    max_released: int
    sessions: list[Session]
    incarnations: int
    epochs: int
    session_ts_ms: int
    sink_markers: dict[str, int]
    # (origin, boot, seq); absent in snapshots from before proposal ids
    proposals: list[tuple[int, int, int]] = field(default_factory=list)
    cluster: c.ClusterRecord | None = None  # the metadata group's; absent in shards' and older snapshots
    # The metadata group's member table (versioned inside); absent in shards' snapshots and in the
    # metadata group's from before it (then rebuilt from ``cluster``).
    membership: MembershipSnapshot | None = None
    pins: list[tuple[str, int, int, str]] = field(default_factory=list)  # (reader, offset, until_ms, owner); v6
    wills_owed: list[OwedWill] = field(default_factory=list)  # absent before owed wills (v6 too)


__all__ = ["ShardState", "InflightDelivery", "SubscriptionState"]
