"""Filtered followers (issue 32): a shard's state restricted to the clients one node serves.

A node S that holds no replica of shard X still serves sessions whose subscriptions (or session
records) live in X. A serving replica R of X, which applies every committed entry in full, sends S
each entry *reduced* to what touches S's clients ``C``; S applies it with the shard's own apply code
to a *partial* ``ShardState`` that started from a *partial snapshot* (C's part of R's state). The
claim, checked by tests/broker/test_follower_filter.py over random command sequences, is that for
every client in C the partial state equals R's: ``client_view`` (its session record and owed wills,
its registrations with their owed offsets, claims, members, work-queue state and owed bytes, the
``$share`` groups it is a member of, and every owed message's metadata and body), and the shard's
``next_offset``, epochs and incarnations.

What R sends (``FollowerFilter``, one per follower and shard; it tracks what S holds):

- ``Apply(cmd, at)``: a command S applies as R did, at R's ``next_offset`` of that moment (``at``):
  commands on C's plain registrations (key ``client\\0filter``) and on the ``$share`` groups S holds;
  session commands of C's clients. A Publish is sent only when R's apply made it owed to one of
  those registrations (``regs``, which S checks against its own apply), and S applies it at offset
  ``at`` with no GUID history, no producer sequences and no size limit: R decided de-duplication,
  sequences and admission (``ShardState.admit`` is never called on S), S never decides again.
  Skipped publishes cost nothing: the next ``at`` (and the entry's ``next_offset``) moves S past them.
  A Register carries the retained messages R's apply found (S's retained index is not the shard's).
  A Housekeeping (topic or session) carries R's effective time (``max(last time, entry time)``, which
  depends on commands S never sees) and no pin floor (pins are shard-wide, S holds none).
- ``SetSession``: a C client's session record and owed wills as R holds them after an entry with a
  SessionOpen of it. An open is not replayed: it numbers epochs and incarnations shard-wide, and its
  quota (``max_persistent``) counts every session of the principal in the shard.
- ``SetGroup`` / ``DropGroup``: a ``$share`` group S starts to hold (a member in C joined: the whole
  group, its owed messages included) or stops holding (no member in C any more), decided per entry.
- Each entry's header sets S's shard-wide counters to R's: ``next_offset``, both last times, the
  session epochs and incarnations (``followups`` reads ``incarnations``).

Where the partial state does NOT equal the full one (by design; readers of these need a replica):

- Shard-wide state: ``retained`` and its index, the GUID history, producers, ``bytes_used``, drops
  and drop counts, pins, sink markers, cluster and membership records, ``low_water``/``max_released``
  (S releases what C no longer owes on its own schedule), and the message index beyond C's messages.
  So the admin API, ``$SYS`` figures, the fetch API / Spark source (pins) must ask a replica.
- ``SessionState.persistent_of(principal)`` counts only C's sessions: lifecycle's early quota check
  (``persistent_quota_exceeded``) reads every session of the principal; the apply-time check on R
  stays authoritative, so S must skip the early one or ask a replica.
- Results: S's apply of a reduced entry does not return what R's did for a SessionOpen (not
  replayed) or a Register's retained messages (given in ``Effects.retained_new`` only). The futures of
  S's own proposals must be resolved from results R sends with the entry (the stream's business).
- A client S starts serving must be added (``FollowerFilter.add_clients``, merged with
  ``merge_partial``; ``remove_clients`` drops one) before S reads its session record: lifecycle
  reads ``owner_of`` and the record on CONNECT. Leader-side follow-ups (sessions/followups.py: ghost registrations, ack resends) read
  the session record of every client registered on a topic shard: the topic shard's leader needs
  those of all its clients, not of one node's: a follower by that set, or the work moves to the
  session shard's leader.
- Effects: S's ``Effects`` equal R's restricted to C for replayed commands (owed_new, claims,
  retained_new), not for what arrives as an outcome: a ``SetGroup`` brings owed offsets and claims
  with no ``owed_new``/``claims`` effect, a ``SetSession`` a record with none. S's host treats both as
  "reload this group / session" (as after a snapshot install).
- Resume: ``reduce`` reads R's state right after R applied the entry (group relevance, a group's or
  session's outcome, the running offset and times), so it runs at apply, never later from the log.
  R can keep S's reduced entries for a reconnect to R; a follower that moves to another replica
  starts over from a partial snapshot at that replica's applied index (after a read index), not
  from the index it acknowledged. The cost of a move is C's part of the shard, owed messages included.
- Costs: ``MessageIndex`` is dense by offset, so S's index spans from C's oldest unreleased message
  to the newest (about 45 bytes per offset, skipped ones included) while a C client lags; a
  ``SetGroup`` and ``merge_partial`` rebuild S's message index and derived indexes (rare events);
  S applies each publish alone with a fresh GUID history (its offsets are not dense): per message
  (publish and ack) 2-3x R's apply cost; an apply-at-offset entry point in TopicState would cut it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.guid_history import GuidHistory
from moorline.broker.message_index import MessageIndex
from moorline.broker.messages import StoredMessage, encode_message
from moorline.broker.session_state import OwedWill, Session
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import Registration, TopicLimits
from moorline.invariant import violated

MessageOf = Callable[[int], "StoredMessage | None"]


class FollowerDiverged(ValueError):
    """S's apply of a reduced entry did not do what R's did: S rebuilds from a partial snapshot."""


class Held(msgspec.Struct, array_like=True, frozen=True):
    offset: int
    msg: StoredMessage


class Apply(msgspec.Struct, tag="a", array_like=True):
    cmd: c.Command
    at: int  # R's next_offset right before the command (a Publish's offset)
    regs: tuple[str, ...] = ()  # Publish: the registrations S holds that it is owed to
    retained: tuple[StoredMessage, ...] = ()  # Register: the retained messages R's apply found


class SetSession(msgspec.Struct, tag="ss", array_like=True):
    client_id: str
    session: Session | None
    wills: list[OwedWill]


class SetGroup(msgspec.Struct, tag="sg", array_like=True):
    reg: Registration
    messages: list[Held]


class DropGroup(msgspec.Struct, tag="dg", array_like=True):
    reg_key: str


class DropClient(msgspec.Struct, tag="dc", array_like=True):
    """S no longer serves the client: its registrations, session record and owed wills go."""

    client_id: str


Op = Apply | SetSession | SetGroup | DropGroup | DropClient


class ReducedEntry(msgspec.Struct, array_like=True):
    index: int
    ops: list[Op]
    next_offset: int
    topic_ts_ms: int
    session_ts_ms: int
    epochs: int
    incarnations: int


class PartialSnapshot(msgspec.Struct, array_like=True):
    shard: int
    incarnation: str
    applied_index: int
    next_offset: int
    low_water: int
    max_released: int
    topic_ts_ms: int
    session_ts_ms: int
    epochs: int
    incarnations: int
    clients: list[str]
    regs: list[Registration]
    messages: list[Held]
    sessions: list[Session]
    wills: list[OwedWill]


_SESSION_CMDS = (c.SessionSubscribe, c.SessionUnsubscribe, c.Deliver, c.SessionAcks, c.InboundQos2,
                 c.InboundRelease, c.SessionClose, c.WillPublished, c.LeaseRelease)
_REG_CMDS = (c.Register, c.Unregister, c.AckReport, c.ShareMember, c.ShareClaim, c.ShareReturn, c.ShareDecline,
             c.ShareActivate, c.ShareTimeout, c.ShareDeadLettered, c.DropOwed)
_enc = msgspec.msgpack.Encoder()
_entry_dec = msgspec.msgpack.Decoder(ReducedEntry)
_snap_dec = msgspec.msgpack.Decoder(PartialSnapshot)


def plain_owner(reg_key: str) -> str | None:
    """The client id of a plain registration's key; None for a ``$share`` group's key."""
    head, _, rest = reg_key.partition("\0")
    if head == c.SHARE_PREFIX[:-1] and "\0" in rest:
        return None  # "$share\0GROUP\0FILTER" (a filter holds no NUL: a client "$share" has one)
    return head


def _has_member(reg: Registration, clients: dict[str, None]) -> bool:
    return any(m in clients for m in reg.members)


def _held(state: ShardState, reg: Registration, fresh: dict[int, StoredMessage], message_of: MessageOf) -> list[Held]:
    out = []
    for o in reg.owed:
        msg = fresh.get(o) or message_of(o)
        if msg is None:
            raise ValueError(f"shard {state.shard}: offset {o} is owed but its message is not in the store")
        out.append(Held(o, msg))
    return out


class FollowerFilter:
    """R's side of one filtered follower of one shard: which clients and groups S holds, and R's
    running figures between entries (the filter sees every entry R applies, skipped ones too)."""

    def __init__(self, clients: Iterable[str]) -> None:
        self.clients: dict[str, None] = dict.fromkeys(clients)
        self.groups: dict[str, None] = {}  # $share groups S holds (a member in clients)
        self.next_offset = self.topic_ts = self.session_ts = 0

    def snapshot(self, state: ShardState, message_of: MessageOf) -> PartialSnapshot:
        """The partial snapshot S starts from, at R's applied index; the filter starts there too."""
        self.groups = {}
        t, s = state.topics, state.sessions
        self.next_offset, self.topic_ts, self.session_ts = t.next_offset, t.last_ts_ms, s.last_ts_ms
        return self._part(state, list(self.clients), message_of)

    def add_clients(self, state: ShardState, new: Iterable[str], message_of: MessageOf) -> PartialSnapshot:
        """S serves more clients from R's applied index on: their part, for ``merge_partial``."""
        added = [x for x in new if x not in self.clients]
        self.clients.update(dict.fromkeys(added))
        return self._part(state, added, message_of)

    def remove_clients(self, state: ShardState, gone: Iterable[str]) -> ReducedEntry:
        """S stops serving ``gone``: an entry at R's applied index that drops them, and the groups
        no client S still serves is a member of."""
        ops: list[Op] = []
        for cid in gone:
            if cid in self.clients:
                del self.clients[cid]
                ops.append(DropClient(cid))
        t, s = state.topics, state.sessions
        for rk in list(self.groups):
            reg = t.regs.get(rk)
            if reg is None or not _has_member(reg, self.clients):
                ops.append(DropGroup(rk))
                del self.groups[rk]
        return ReducedEntry(state.applied_index, ops, t.next_offset, t.last_ts_ms, s.last_ts_ms, s.epochs,
                            s.incarnations)

    def _part(self, state: ShardState, clients: list[str], message_of: MessageOf) -> PartialSnapshot:
        t, s = state.topics, state.sessions
        mine = dict.fromkeys(clients)
        regs: list[Registration] = []
        for rk, reg in t.regs.items():
            owner = plain_owner(rk)
            if owner in mine or (owner is None and rk not in self.groups and _has_member(reg, self.clients)):
                regs.append(reg)
                if owner is None:
                    self.groups[rk] = None
        offsets = sorted({o for reg in regs for o in reg.owed})
        messages = _held(state, Registration("", 0, "", 0, False, None, 0, dict.fromkeys(offsets)), {}, message_of)
        return PartialSnapshot(
            state.shard, t.incarnation, state.applied_index, t.next_offset, t.low_water, t.max_released,
            t.last_ts_ms, s.last_ts_ms, s.epochs, s.incarnations, clients, regs, messages,
            [x for cid in clients if (x := s.sessions.get(cid)) is not None],
            [w for w in s.wills_owed.values() if w.client_id in mine])

    def _replayed(self, reg_key: str, held: dict[str, None]) -> bool:
        owner = plain_owner(reg_key)
        return reg_key in held if owner is None else owner in self.clients

    def reduce(self, state: ShardState, index: int, cmds: Sequence[c.Command], results: Sequence[Any],
               fx: Effects, message_of: MessageOf) -> ReducedEntry:
        """Entry ``index`` (applied by R to ``state``: ``cmds``, their ``results`` and the entry's
        ``fx``) reduced for S. An entry ``ShardState.admit`` skipped (or a configuration change, a
        leader's no-op) is reduced with no commands: S moves to its index and nothing else."""
        if len(results) != len(cmds):
            violated(f"{len(cmds)} commands with {len(results)} results")
        clients, held = self.clients, dict(self.groups)
        owed_at: dict[int, list[str]] = {}
        for o, rk in fx.owed_new:
            if self._replayed(rk, held):
                owed_at.setdefault(o, []).append(rk)
        opened = {cmd.client_id: None for cmd in cmds if type(cmd) is c.SessionOpen and cmd.client_id in clients}
        touched: dict[str, None] = {}
        ops: list[Op] = []
        offset, tts, sts = self.next_offset, self.topic_ts, self.session_ts
        for cmd, res in zip(cmds, results, strict=True):
            tp = type(cmd)
            if tp is c.Publish:
                tts = max(tts, cmd.msg.ts_ms)  # type: ignore[union-attr]
                if res.status == "ok":
                    if res.offset != offset:
                        violated(f"publish applied at {res.offset}, the filter counted {offset}")
                    if offset in owed_at:
                        ops.append(Apply(cmd, offset, tuple(owed_at[offset])))
                    offset += 1
            elif tp is c.Housekeeping:
                tts = max(tts, cmd.ts_ms)  # type: ignore[union-attr]
                ops.append(Apply(c.Housekeeping(tts, -1), offset))
            elif tp is c.SessionHousekeeping:
                sts = max(sts, cmd.ts_ms)  # type: ignore[union-attr]
                ops.append(Apply(c.SessionHousekeeping(sts), offset))
            elif tp is c.SessionOpen:
                sts = max(sts, cmd.ts_ms)  # type: ignore[union-attr]
            elif tp is c.SessionRenew:
                sts = max(sts, cmd.ts_ms)  # type: ignore[union-attr]
                mine = tuple(x for x in cmd.sessions if x[0] in clients and x[0] not in opened)  # type: ignore[union-attr]
                if mine:
                    ops.append(Apply(msgspec.structs.replace(cmd, sessions=mine), offset))  # type: ignore[type-var]
            elif tp in _SESSION_CMDS:
                if tp is c.SessionClose:
                    sts = max(sts, cmd.ts_ms)  # type: ignore[union-attr]
                cid = cmd.client_id  # type: ignore[union-attr]
                if cid in clients and cid not in opened:
                    ops.append(Apply(cmd, offset))
            elif tp in _REG_CMDS:
                rk = cmd.reg_key  # type: ignore[union-attr]
                if tp in (c.ShareMember, c.Register, c.Unregister) and plain_owner(rk) is None:
                    touched[rk] = None
                if self._replayed(rk, held):
                    retained = res.retained if tp is c.Register else ()
                    ops.append(Apply(cmd, offset, retained=retained))
            # else shard-wide (pins, sink markers, metadata group, SessionsForget): not S's
        t, s = state.topics, state.sessions
        if (offset, tts, sts) != (t.next_offset, t.last_ts_ms, s.last_ts_ms):
            violated(f"the filter counted offset {offset}, times {tts}/{sts}; the shard has {t.next_offset}, "
                     f"{t.last_ts_ms}/{s.last_ts_ms}: apply changed and the filter did not")
        self.next_offset, self.topic_ts, self.session_ts = offset, tts, sts
        for cid in opened:
            ops.append(SetSession(cid, s.sessions.get(cid), [w for w in s.wills_owed.values() if w.client_id == cid]))
        fresh = {o: m for o, _, m in fx.appends}
        for rk in touched:
            reg = t.regs.get(rk)
            relevant = reg is not None and _has_member(reg, clients)
            if rk in held and not relevant:
                ops.append(DropGroup(rk))
                del self.groups[rk]
            elif reg is not None and relevant and rk not in held:
                ops.append(SetGroup(reg, _held(state, reg, fresh, message_of)))
                self.groups[rk] = None
        return ReducedEntry(index, ops, t.next_offset, t.last_ts_ms, s.last_ts_ms, s.epochs, s.incarnations)


def encode(x: ReducedEntry | PartialSnapshot) -> bytes:
    return _enc.encode(x)


def decode_entry(data: bytes) -> ReducedEntry:
    return _entry_dec.decode(data)


def decode_snapshot(data: bytes) -> PartialSnapshot:
    return _snap_dec.decode(data)


def follower_limits(limits: TopicLimits) -> TopicLimits:
    """A partial state's limits: never full (R decided admission); the rest as configured."""
    return dataclasses.replace(limits, shard_max_bytes=1 << 62, reserved_headroom_bytes=0)


def restore_partial(snap: PartialSnapshot, limits: TopicLimits, max_session_expiry_s: int,
                    fx: Effects | None = None) -> ShardState:
    """S's partial state from a partial snapshot (its messages go to ``fx.appends`` for S's host)."""
    state = ShardState(snap.shard, snap.incarnation, follower_limits(limits), max_session_expiry_s)
    t = state.topics
    t.low_water, t.max_released = snap.low_water, snap.max_released
    merge_partial(state, snap, fx if fx is not None else Effects())
    return state


def merge_partial(state: ShardState, snap: PartialSnapshot, fx: Effects) -> None:
    """Adds a part (``FollowerFilter.add_clients``, taken at the index S is at) to S's state."""
    if snap.applied_index != state.applied_index and state.applied_index:
        raise FollowerDiverged(f"a part at index {snap.applied_index} for a follower at {state.applied_index}")
    t, s = state.topics, state.sessions
    _install(state, snap.regs, snap.messages, fx)
    for sess in snap.sessions:
        _set_session(state, sess.client_id, sess, [])
    for w in snap.wills:
        s.wills_owed[(w.client_id, w.incarnation, w.epoch)] = w
    state.applied_index = snap.applied_index
    t.next_offset, t.last_ts_ms = snap.next_offset, snap.topic_ts_ms
    s.last_ts_ms, s.epochs, s.incarnations = snap.session_ts_ms, snap.epochs, snap.incarnations


def _set_session(state: ShardState, cid: str, sess: Session | None, wills: list[OwedWill]) -> None:
    s = state.sessions
    old = s.sessions.get(cid)
    if old is not None:
        s._uncount(old)
    if sess is None:
        s.sessions.pop(cid, None)
    else:
        s.sessions[cid] = sess  # in place when it was there, as R's open does
        s._count(sess)
    for key in [k for k in s.wills_owed if k[0] == cid]:
        del s.wills_owed[key]
    for w in wills:
        s.wills_owed[(w.client_id, w.incarnation, w.epoch)] = w


def _install(state: ShardState, regs: list[Registration], messages: list[Held], fx: Effects) -> None:
    """Registrations S did not hold, with their messages: the message index is rebuilt when one
    lies below its end (it only appends), then every derived index."""
    t = state.topics
    for reg in regs:
        if reg.reg_key in t.regs:
            raise FollowerDiverged(f"registration {reg.reg_key!r} is held already")
        t.regs[reg.reg_key] = reg
        if not reg.draining:
            t.trie.insert(reg.filter, reg.reg_key, None)
        counts = t.owed_count
        for o in reg.owed:
            counts[o] = counts.get(o, 0) + 1
    t._trie_changed()
    new = [h for h in messages if h.offset not in t.meta]
    if new:
        rows = [(o, m.ts_ms, m.size, m.guid, m.topic, m.qos, m.expires_at_ms) for o, m in t.meta.items()]
        rows += [(h.offset, h.msg.ts_ms, h.msg.size(), h.msg.guid, h.msg.topic, h.msg.qos, h.msg.expires_at_ms())
                 for h in new]
        rows.sort()
        meta = MessageIndex()
        for row in rows:
            meta.add(*row)
        t.meta = meta
        fx.appends.extend((h.offset, encode_message(h.msg), h.msg) for h in new)
    t.rebuild_indexes()


def _drop_client(state: ShardState, cid: str) -> None:
    for rk in [k for k in state.topics.regs if plain_owner(k) == cid]:
        _drop_group(state, rk)
    _set_session(state, cid, None, [])


def _drop_group(state: ShardState, reg_key: str) -> None:
    """A registration S no longer holds (a group, or a plain one of a client it stopped serving)."""
    t = state.topics
    reg = t.regs.pop(reg_key, None)
    if reg is None:
        return  # R's replayed Unregister removed it already
    if not reg.draining:
        t.trie.remove(reg.filter, reg_key)
        t._trie_changed()
    t.share_keys.pop(reg_key, None)
    t.owed_bytes.pop(reg_key, None)
    if reg.owed:
        t._unowe_run(list(reg.owed))  # what only this group held is released as S's retention says


def apply_reduced(state: ShardState, entry: ReducedEntry, fx: Effects) -> list[Any]:
    """S applies a reduced entry to its partial state; returns the results of its ``Apply`` ops."""
    t, s = state.topics, state.sessions
    results: list[Any] = []
    for op in entry.ops:
        if isinstance(op, Apply):
            cmd = op.cmd
            if op.at < t.next_offset:
                raise FollowerDiverged(f"an op at offset {op.at} for a follower at {t.next_offset}")
            t.next_offset = op.at
            if type(cmd) is c.Publish:
                t.dedup = GuidHistory()  # R decided: S keeps no history, sequences nor size limit
                t.producers.clear()
                start = len(fx.owed_new)
                res = t.apply_publishes((cmd,), fx)[0]
                got = tuple(rk for _, rk in fx.owed_new[start:])
                if res.status != "ok" or res.offset != op.at or got != op.regs:
                    raise FollowerDiverged(f"publish at {op.at}: {res.status} at {res.offset}, owed to {got}, "
                                           f"R's owed to {op.regs}")
            elif type(cmd) is c.Register:
                res = state.apply(msgspec.structs.replace(cmd, want_retained=False), fx)
                if op.retained:
                    fx.retained_new.append((cmd.reg_key, op.retained, op.at))
            else:
                res = state.apply(cmd, fx)
            results.append(res)
        elif isinstance(op, SetSession):
            _set_session(state, op.client_id, op.session, op.wills)
        elif isinstance(op, SetGroup):
            _install(state, [op.reg], op.messages, fx)
        elif isinstance(op, DropClient):
            _drop_client(state, op.client_id)
        else:
            _drop_group(state, op.reg_key)
    if entry.next_offset < t.next_offset:
        raise FollowerDiverged(f"entry {entry.index} ends at offset {entry.next_offset}, the follower at {t.next_offset}")
    t.next_offset, t.last_ts_ms = entry.next_offset, entry.topic_ts_ms
    s.last_ts_ms, s.epochs, s.incarnations = entry.session_ts_ms, entry.epochs, entry.incarnations
    state.applied_index = entry.index
    return results


def client_view(state: ShardState, client: str, message_of: MessageOf) -> dict[str, Any]:
    """Everything node code reads for ``client`` in a shard's state, in comparable builtins (dict
    orders kept as lists): its session and owed wills, its plain registrations and the $share groups
    it is a member of (all of each, order included), owed bytes, and each owed message."""
    t, s = state.topics, state.sessions
    regs = {}
    offsets: set[int] = set()
    for rk, reg in t.regs.items():
        owner = plain_owner(rk)
        if owner == client or (owner is None and client in reg.members):
            regs[rk] = [msgspec.to_builtins(reg), list(reg.owed), list(reg.claims.items()), list(reg.members.items()),
                        list(reg.declined.items()), t.owed_bytes.get(rk, 0)]
            offsets.update(reg.owed)
    sess = s.sessions.get(client)
    messages = {}
    for o in sorted(offsets):
        m = t.meta.get(o)
        messages[o] = [None if m is None else msgspec.to_builtins(m), msgspec.to_builtins(message_of(o))]
    return {
        "session": None if sess is None else [msgspec.to_builtins(sess), list(sess.inflight), list(sess.subs)],
        "wills": [msgspec.to_builtins(w) for _, w in sorted((k, w) for k, w in s.wills_owed.items() if k[0] == client)],
        "regs": dict(sorted(regs.items())),
        "messages": messages,
        "counters": [t.next_offset, s.epochs, s.incarnations],
    }
