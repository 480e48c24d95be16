"""The session side of a shard's state machine (pure).

The session's shard is the only authority for per-session state: subscriptions, expiry, will,
epoch, inbound QoS 2 packet ids and the delivery log. Every command carries the owner's epoch
and is ignored at apply when stale (docs/design.md, "Sessions").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moorline.broker.commands import (
    SHARE_PREFIX,
    Deliver,
    DeliveryItem,
    InboundQos2,
    InboundRelease,
    LeaseRelease,
    SessionAcks,
    SessionClose,
    SessionHousekeeping,
    SessionOpen,
    SessionRenew,
    SessionSubscribe,
    SessionUnsubscribe,
    WillPublished,
    WillSpec,
)
from moorline.broker.effects import Effects

MAX_SHARE_DONE = 4096
SENT = 0  # PUBLISH sent, waiting for PUBACK / PUBREC
RELEASING = 1  # PUBREC committed, PUBREL sent, waiting for PUBCOMP


def packet_id_of(seqno: int) -> int:
    return seqno % 65535 + 1


@dataclass(slots=True)
class SubscriptionState:
    filter: str  # as sent (may carry $share/GROUP/)
    qos: int
    no_local: bool
    retain_as_published: bool
    retain_handling: int
    sub_id: int | None
    version: int


@dataclass(slots=True)
class InflightDelivery:
    item: DeliveryItem
    state: int = SENT


@dataclass(slots=True)
class Session:
    client_id: str
    incarnation: int
    epoch: int
    expiry_s: int
    principal: str = ""
    connected: bool = True
    owner_node: int = 0  # the node serving it while connected (0: before leases)
    lease_until_ms: int = 0  # entry time until which no other node may serve it
    # The previous owner's lease a takeover waits for: (node, epoch, until ms), None once released.
    prev_lease: tuple[int, int, int] | None = None
    disconnected_at_ms: int = 0
    will: WillSpec | None = None
    will_due_ms: int | None = None
    subs: dict[str, SubscriptionState] = field(default_factory=dict)
    inbound_qos2: dict[int, bytes] = field(default_factory=dict)  # packet id -> GUID
    next_seq: int = 0
    inflight: dict[int, InflightDelivery] = field(default_factory=dict)  # seqno -> delivery, ascending
    last_delivered: dict[int, int] = field(default_factory=dict)  # topic shard -> highest offset delivered
    sub_version: int = 0
    # $share deliveries this session finished (shard, registration, offset), newest last, bounded:
    # until the topic shard applies the ack report, the claim still names this member, and the
    # session must not take it for an undelivered claim (e.g. after a crash in between).
    share_done: list[tuple[int, str, int]] = field(default_factory=list)


@dataclass(slots=True)
class OwedWill:
    """A will that fell due (a connection's end without DISCONNECT once its delay passed, a
    takeover, a lapsed owner lease) and is not yet known committed in its topic's shard: the
    session shard keeps it until a ``WillPublished`` says so, and the shard's leader publishes it
    again meanwhile (sessions/followups.py), so a refused or lost publish (its proposer crashed, the
    topic shard had no room for proposals) is not a lost will. Its GUID (the client id,
    incarnation and epoch) makes every publication after the first a duplicate."""

    client_id: str
    incarnation: int
    epoch: int
    will: WillSpec
    due_ms: int  # entry time it fell due


@dataclass(frozen=True, slots=True)
class OpenResult:
    session_present: bool
    epoch: int
    incarnation: int
    ended: Session | None  # the previous session that a clean start discarded
    refused: bool = False  # the session belongs to another principal: nothing changed
    # Refused (nothing changed): the principal already has SessionOpen.max_persistent persistent
    # sessions in this shard (session.max_persistent_per_user).
    over_quota: bool = False
    # Another node's lease on the previous connection of this client runs until this entry time:
    # the new owner serves only after it (promise: never two owners at once). 0: nothing to wait for.
    wait_until_ms: int = 0
    ts_ms: int = 0  # the open's entry time (what wait_until_ms is measured from)
    # The will of the connection (or ended session) this open replaced that is due now, as
    # (incarnation, epoch, will) of that connection: the opener publishes it (exactly once: it is
    # gone from the shard's state). None: no will, or it is cancelled (MQTT 5 §3.1.2.5, §3.1.3.2.2).
    replaced_will: tuple[int, int, WillSpec] | None = None


@dataclass(frozen=True, slots=True)
class EndedSession:
    session: Session
    reason: str


# A connected session whose owner's lease ended this long ago (entry time) without a renewal is
# ended as a connection lost without DISCONNECT. The owner closed its client a margin before the
# lease's end by its own clock; this covers the stamping leaders' clock offsets on top of that.
LEASE_LAPSE_GRACE_MS = 1000


def lease_lapsed(s: Session, now_ms: int) -> bool:
    """Whether ``s`` is marked connected under a lease nobody renewed in time (owner gone)."""
    return s.connected and s.lease_until_ms > 0 and now_ms > s.lease_until_ms + LEASE_LAPSE_GRACE_MS


class SessionState:
    def __init__(self, max_expiry_s: int) -> None:
        self.sessions: dict[str, Session] = {}
        self.incarnations = 0
        self.epochs = 0  # shard-wide, so an epoch never repeats for a client id, even across incarnations
        self.max_expiry_s = max_expiry_s
        self.last_ts_ms = 0
        # Wills due and not yet known published, by (client id, incarnation, epoch) (OwedWill).
        self.wills_owed: dict[tuple[str, int, int], OwedWill] = {}
        # Derived (rebuilt on restore, never snapshotted): principal -> its sessions here with an
        # expiry above 0, for session.max_persistent_per_user.
        self.persistent: dict[str, int] = {}

    def rebuild_counts(self) -> None:
        self.persistent = {}
        for sess in self.sessions.values():
            self._count(sess)

    def _count(self, sess: Session) -> None:
        if sess.expiry_s > 0:
            self.persistent[sess.principal] = self.persistent.get(sess.principal, 0) + 1

    def _uncount(self, sess: Session) -> None:
        if sess.expiry_s > 0:
            n = self.persistent.get(sess.principal, 0) - 1
            if n > 0:
                self.persistent[sess.principal] = n
            else:
                self.persistent.pop(sess.principal, None)

    def persistent_of(self, principal: str) -> int:
        """Persistent sessions (expiry above 0, not yet ended) of ``principal`` in this shard."""
        return self.persistent.get(principal, 0)

    def _current(self, client_id: str, epoch: int) -> Session | None:
        s = self.sessions.get(client_id)
        if s is None or s.epoch != epoch:
            return None  # stale owner: rejected at apply
        return s

    def apply_open(self, cmd: SessionOpen, fx: Effects) -> OpenResult:
        self.last_ts_ms = max(self.last_ts_ms, cmd.ts_ms)
        old = self.sessions.get(cmd.client_id)
        if cmd.owner_only and old is not None and old.principal != cmd.principal and self._alive(old, cmd.ts_ms):
            return OpenResult(False, 0, 0, None, refused=True)  # not a takeover: another user's session
        ended: Session | None = None
        expiry = min(cmd.expiry_s, self.max_expiry_s)
        wait = 0
        prev: tuple[int, int, int] | None = None
        if (old is not None and old.connected and cmd.owner_node and old.owner_node not in (0, cmd.owner_node)
                and old.lease_until_ms > cmd.ts_ms):
            wait = old.lease_until_ms  # still another node's: it closes its client before this
            prev = (old.owner_node, old.epoch, old.lease_until_ms)
        lease_until = cmd.ts_ms + cmd.lease_ms if cmd.lease_ms else 0
        # A session with expiry 0 ends with its network connection: a new CONNECT that finds it
        # (its old connection's close not applied yet, or a takeover) starts a fresh one.
        ending = old is not None and (cmd.clean_start or old.expiry_s == 0 or self._expired(old, cmd.ts_ms))
        replaced_will = None
        if old is not None and (due := self._replaced_will(old, ending, cmd.ts_ms)) is not None:
            replaced_will = (old.incarnation, old.epoch, due)
            self._owe(old, due, cmd.ts_ms)
        if ending:
            ended = old
            old = None
        if cmd.max_persistent > 0 and expiry > 0:
            # session.max_persistent_per_user, decided here (every replica alike): a persistent
            # session the principal does not hold yet needs room under the bound.
            mine = old if old is not None else ended  # the session this open continues or replaces
            holds = mine is not None and mine.principal == cmd.principal and mine.expiry_s > 0
            if not holds and self.persistent_of(cmd.principal) >= cmd.max_persistent:
                return OpenResult(False, 0, 0, None, refused=True, over_quota=True)
        self.epochs += 1
        if ended is not None:
            self._uncount(ended)
        if old is None:
            self.incarnations += 1
            sess = Session(cmd.client_id, self.incarnations, self.epochs, expiry, cmd.principal, will=cmd.will,
                           owner_node=cmd.owner_node, lease_until_ms=lease_until, prev_lease=prev)
            self.sessions[cmd.client_id] = sess
            self._count(sess)
            return OpenResult(False, sess.epoch, sess.incarnation, ended, wait_until_ms=wait, ts_ms=cmd.ts_ms,
                              replaced_will=replaced_will)
        self._uncount(old)
        old.epoch = self.epochs
        old.connected = True
        old.expiry_s = expiry
        old.will = cmd.will
        old.will_due_ms = None  # a reconnect within the will delay cancels the will
        old.principal = cmd.principal
        old.owner_node, old.lease_until_ms, old.prev_lease = cmd.owner_node, lease_until, prev
        self._count(old)
        return OpenResult(True, old.epoch, old.incarnation, None, wait_until_ms=wait, ts_ms=cmd.ts_ms,
                          replaced_will=replaced_will)

    @staticmethod
    def _replaced_will(old: Session, ending: bool, now_ms: int) -> WillSpec | None:
        """The will of ``old``'s last network connection that is due as a new CONNECT of its client
        applies (the open then takes it: neither a later close nor housekeeping sees it again).

        A connection still marked connected is closed by this open (MQTT-3.1.4-3: its owner
        ends it on applying the open; a dead owner's lapsed lease ended it already, as of the
        lease's end), not by a DISCONNECT: its will is due once the will delay elapses or the
        session ends, whichever is first (§3.1.2.5, §3.1.3.2.2). A new connection that continues
        the session within the delay cancels it (MQTT-3.1.3-9); a clean start, or a session with
        expiry 0, ends the session: due at once. A 3.1.1 will has no delay: always due."""
        will = old.will
        if will is None:
            return None
        if old.connected:
            closed_at = old.lease_until_ms if lease_lapsed(old, now_ms) else now_ms
            due = closed_at + min(will.delay_s, old.expiry_s) * 1000
        elif old.will_due_ms is not None:
            due = old.will_due_ms  # closed without DISCONNECT, its will delay running
        else:
            return None
        return will if ending or due <= now_ms else None

    def _owe(self, s: Session, will: WillSpec, now_ms: int) -> OwedWill:
        owed = self.wills_owed[(s.client_id, s.incarnation, s.epoch)] = OwedWill(s.client_id, s.incarnation, s.epoch,
                                                                                 will, now_ms)
        return owed

    def apply_will_published(self, cmd: WillPublished, fx: Effects) -> bool:
        """The will is committed in its topic's shard: no longer owed (False: it was not)."""
        return self.wills_owed.pop((cmd.client_id, cmd.incarnation, cmd.epoch), None) is not None

    def apply_release(self, cmd: LeaseRelease, fx: Effects) -> bool:
        s = self.sessions.get(cmd.client_id)
        if s is None or s.prev_lease is None or s.prev_lease[:2] != (cmd.owner_node, cmd.epoch):
            return False
        s.prev_lease = None
        return True

    def apply_renew(self, cmd: SessionRenew, fx: Effects) -> tuple[tuple[str, int], ...]:
        """Extends the leases still held by ``cmd.owner_node`` (same epoch); returns those it
        extended (the owner extends its own deadline for these only: a session the shard ended
        or gave to another node meanwhile is not the owner's to serve any longer)."""
        self.last_ts_ms = max(self.last_ts_ms, cmd.ts_ms)
        renewed: list[tuple[str, int]] = []
        for client_id, epoch in cmd.sessions:
            s = self.sessions.get(client_id)
            if s is not None and s.epoch == epoch and s.connected and s.owner_node == cmd.owner_node:
                s.lease_until_ms = max(s.lease_until_ms, cmd.ts_ms + cmd.lease_ms)
                renewed.append((client_id, epoch))
        return tuple(renewed)

    def _alive(self, s: Session, now_ms: int) -> bool:
        """Whether a CONNECT would find the session (or its live connection) rather than none."""
        return s.connected or (s.expiry_s > 0 and not self._expired(s, now_ms))

    def owner_of(self, client_id: str, now_ms: int) -> str | None:
        """The principal a live session of ``client_id`` belongs to, or None when there is none."""
        s = self.sessions.get(client_id)
        return s.principal if s is not None and self._alive(s, now_ms) else None

    def _expired(self, s: Session, now_ms: int) -> bool:
        return (not s.connected) and now_ms - s.disconnected_at_ms >= s.expiry_s * 1000

    def apply_subscribe(self, cmd: SessionSubscribe, fx: Effects) -> tuple[bool, int] | None:
        s = self._current(cmd.client_id, cmd.epoch)
        if s is None:
            return None
        existed = cmd.filter in s.subs
        s.sub_version += 1
        s.subs[cmd.filter] = SubscriptionState(
            cmd.filter, cmd.qos, cmd.no_local, cmd.retain_as_published, cmd.retain_handling, cmd.sub_id,
            s.sub_version,
        )
        return existed, s.incarnation

    def apply_unsubscribe(self, cmd: SessionUnsubscribe, fx: Effects) -> int | None:
        """None: stale owner; 0: no such subscription; else the new subscription version, which
        the Unregister commands carry so a later subscribe of the same filter wins over them."""
        s = self._current(cmd.client_id, cmd.epoch)
        if s is None:
            return None
        if s.subs.pop(cmd.filter, None) is None:
            return 0
        s.sub_version += 1
        return s.sub_version

    def apply_deliver(self, cmd: Deliver, fx: Effects) -> bool:
        s = self._current(cmd.client_id, cmd.epoch)
        if s is None:
            return False
        if cmd.first_seq != s.next_seq:
            # An earlier batch of this owner never committed (its proposal was dropped, e.g. while
            # leadership moved): this one does not continue the delivery log, so it is refused,
            # and the owner ends the connection so the session resumes from what was committed.
            return False
        seq = cmd.first_seq
        for item in cmd.items:
            if item.qos > 0:
                s.inflight[seq] = InflightDelivery(item)
            if item.offset >= 0:
                prev = s.last_delivered.get(item.shard, -1)
                if item.offset > prev:
                    s.last_delivered[item.shard] = item.offset
            seq += 1
        s.next_seq = seq
        return True

    def apply_acks(self, cmd: SessionAcks, fx: Effects) -> list[DeliveryItem]:
        """Returns the deliveries finished by this batch (their topic shards get ack reports)."""
        s = self._current(cmd.client_id, cmd.epoch)
        done: list[DeliveryItem] = []
        if s is None:
            return done
        for seq, kind in cmd.acks:
            d = s.inflight.get(seq)
            if d is None:
                continue
            if kind == 2:
                d.state = RELEASING
            else:
                del s.inflight[seq]
                done.append(d.item)
                it = d.item
                if it.offset >= 0:
                    for rk in it.reg_keys:
                        if rk.startswith(SHARE_PREFIX):
                            s.share_done.append((it.shard, rk, it.offset))
        if len(s.share_done) > MAX_SHARE_DONE:
            del s.share_done[: len(s.share_done) - MAX_SHARE_DONE]
        return done

    def apply_inbound_qos2(self, cmd: InboundQos2, fx: Effects) -> bytes | None:
        s = self._current(cmd.client_id, cmd.epoch)
        if s is None:
            return None
        return s.inbound_qos2.setdefault(cmd.packet_id, cmd.guid)

    def apply_inbound_release(self, cmd: InboundRelease, fx: Effects) -> bool:
        s = self._current(cmd.client_id, cmd.epoch)
        if s is None:
            return False
        return s.inbound_qos2.pop(cmd.packet_id, None) is not None

    def apply_close(self, cmd: SessionClose, fx: Effects) -> Session | None:
        """Returns the session if it ended now (expiry 0), for the host to clean up its registrations."""
        self.last_ts_ms = max(self.last_ts_ms, cmd.ts_ms)
        s = self._current(cmd.client_id, cmd.epoch)
        if s is None:
            return None
        s.connected = False
        s.disconnected_at_ms = cmd.ts_ms
        s.lease_until_ms = 0  # released: a new owner need not wait
        if cmd.expiry_s is not None:
            self._uncount(s)
            s.expiry_s = min(cmd.expiry_s, self.max_expiry_s)
            self._count(s)
        if cmd.send_will and s.will is not None:
            delay_ms = min(s.will.delay_s, s.expiry_s) * 1000
            s.will_due_ms = cmd.ts_ms + delay_ms
        else:
            s.will = None
        if s.expiry_s == 0 and s.will_due_ms is None:
            del self.sessions[s.client_id]
            self._uncount(s)
            return s
        return None

    def apply_housekeeping(self, cmd: SessionHousekeeping, fx: Effects) -> tuple[list[tuple[OwedWill, WillSpec]], list[Session]]:
        """Fires due wills and ends expired sessions (both decided by the entry's time). Each will
        comes with its owed record, which names the connection (incarnation, epoch) it was due for
        as of this entry: the session itself is mutable, and a later open applied before the
        proposer reads the result (the same batch of entries) gives it a new epoch, so the will's
        GUID and its WillPublished would name the wrong connection (its owed record then never
        cleared, and published again under its own GUID by the followups: twice)."""
        now = max(self.last_ts_ms, cmd.ts_ms)
        self.last_ts_ms = now
        wills: list[tuple[OwedWill, WillSpec]] = []
        ended: list[Session] = []
        for cid in list(self.sessions):
            s = self.sessions[cid]
            if s.connected:
                if not lease_lapsed(s, now):
                    continue
                # Its owner neither renewed nor released the lease (its node died or was cut off
                # for good, and it closed its client before the lease ran out): the connection
                # ended without DISCONNECT as of the lease's end. Decided here, by the entry's
                # time, so whichever node leads this shard after any crash does the same.
                s.connected = False
                s.disconnected_at_ms = s.lease_until_ms
                s.lease_until_ms = 0
                if s.will is not None:
                    s.will_due_ms = s.disconnected_at_ms + min(s.will.delay_s, s.expiry_s) * 1000
            expired = now - s.disconnected_at_ms >= s.expiry_s * 1000
            if s.will is not None and s.will_due_ms is not None and (s.will_due_ms <= now or expired):
                wills.append((self._owe(s, s.will, now), s.will))
                s.will = None
                s.will_due_ms = None
            if expired:
                del self.sessions[cid]
                self._uncount(s)
                ended.append(s)
        return wills, ended
