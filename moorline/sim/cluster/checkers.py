"""History checkers for the cluster simulator: the definitions of docs/verification.md in plain Python.

docs/verification.md is the one statement of every anomaly; ``moorline verify``
(``moorline/verify/checks.py``, PySpark) and this module implement it, row for row, so a seed's
verdict needs no JVM and takes milliseconds. tests/verify/test_verify_differential.py keeps the two
equal (any difference in the (kind, message, subscriber) sets is a bug in one of them).
docs/cluster-sim-workload.md lists what this module checks beyond verify. In short:

- *lost*: an acknowledged message (PUBACK, or PUBREC at QoS 2) owed to a durable subscription
  (plain, or one delivery per ``$share`` group) and never delivered, unless QoS 0 on either side
  or a counted broker drop names exactly that message (and that session, when it names one);
- *duplicate*: a second application delivery to one subscriber that MQTT does not allow (only a
  QoS 1 resend with DUP=1 on a later connection is allowed; a QoS 2 PUBLISH with a packet id the
  receiver still holds for the same message is the protocol's own resend, not a delivery);
- *packet_id_misuse*: a PUBLISH with a packet id still held for another message (a Method B
  receiver would drop it), or a redelivery with a packet id other than the original's;
- *out_of_order*: first deliveries per (subscriber, topic, publisher) not in the publisher's
  acknowledged order; resends after a reconnect out of original order, after a new message, or
  skipping an older unacknowledged one;
- *unexpected* and *refused_delivered*;
- a message a publisher sent **without** a guid (recorded ``detail="no_guid"``) and sent again
  (QoS 1, or QoS 2 on a new publisher session) may legitimately be stored twice: its repeats are
  not duplicates, and neither its packet ids nor its resend order are judged (the history cannot
  tell the two stored copies apart); a retained copy (``detail="retained"``) is never a duplicate.

Beyond verify (``EXTRA_KINDS``):
- *double_owner*: a connection of a session receives a PUBLISH more than ``owner_overlap_s`` after
  another process's connection of the same session got its CONNACK while the first was still
  open: two owners delivering at once. The new owner answers CONNACK only after the previous owner
  released the session (having closed its connection) or its lease ran out, so on the client's
  side the old connection's last byte arrives within a link delay of the new CONNACK;
- *stale_owner*: such an old connection still open more than ``stale_owner_grace_s`` after the new
  CONNACK. The old owner closes it by the end of its lease, which the new owner waits out, so the
  grace covers clock drift and scheduling; a paused old owner closes it when it resumes, so a pause
  of the old owner's node (history records ``fault`` / ``pause`` and ``resume`` with its ``node``)
  that overlaps the lease before the new CONNACK moves the bound to the pause's end plus the grace;
- *session_lost*: CONNECT with clean start 0 answered session present 0 although the session's
  expiry (``session_expiry`` of the CONNECT that opened its last connection; none on 3.1.1 means it
  does not expire within a run) had not run out since its last connection ended (a connection
  whose node was paused after its CONNACK and that ended during that pause, or within
  ``stale_owner_grace_s`` of its end, counts as ended when the pause began: the lease a paused
  node cannot renew may run out, and the session shard then ends the connection as of then);
- *resend_without_dup*: a QoS 2 resend of a held packet id with DUP=0;
- *stuck*: liveness after the faults healed: a subscriber the workload's drain gave up on (it could
  not reconnect and catch up within the drain's time), or a publish never answered.

Reported, not failing (``EXTRA_REPORTED_KINDS``):
- *will_lost*: a will that was due (its client ended the connection without DISCONNECT, recorded
  ``info disconnect`` with a reason starting "ended without DISCONNECT"; in a simulator history,
  any connection lost without a DISCONNECT processed) and was owed to a durable subscription
  (SUBACK before that end, filter matching, QoS > 0 on both sides; one delivery per ``$share``
  group), never delivered to it. Failing as *will_not_published* when nothing excuses it: no fault
  near it, or it was due (or the faults healed) ``WILL_OWED_WITHIN_S`` before the history ends
  (docs/verification.md, "Wills").
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from moorline.verify.checks import FAILING_KINDS as VERIFY_FAILING_KINDS
from moorline.verify.checks import REPORTED_KINDS
from moorline.verify.topics import filter_to_regex

NO_GUID = "no_guid"
STUCK_SUBSCRIBER = "not drained"  # reasons the workload records when its drain gives up
STUCK_PUBLISH = "abandoned"
WILL = "will"  # publish detail of a will (invoke at CONNECT; fail when known discarded)
WILL_DUE = "ended without DISCONNECT"  # info disconnect reason: the client ended the connection abruptly
# Fault records (the simulator's runner writes them, node named) after which a due will may
# legitimately never be published: its connection's close may not commit before the client's next
# clean-start CONNECT replaces the session, or the node dies holding it (docs/verification.md,
# "Wills"). HEALED (node "all"): every fault healed, none comes after.
WILL_FAULTS = frozenset({"crash", "pause", "isolate", "oneway", "leader_cut"})
HEALED = "healed"
WILL_FAULT_BEFORE_S = 16.0  # a fault this long before a will was due may still be in force (pause 14 s)
WILL_FAULT_AFTER_S = 5.0  # ... and one this soon after may hold up its close (the client reconnects in 1-3 s)
WILL_SETTLE_S = 3.0  # after HEALED: elections and resends settle
# A will owed however its connection ended (its node crashed, paused or cut off included) is
# published within this long of its end or of the final heal, whichever is later: the session
# shard's leader ends a session whose owner's lease ran out (session.owner_lease_s, 10 s at most
# in the simulator, plus LEASE_LAPSE_GRACE_MS and a housekeeping round) and publishes what it owes.
WILL_OWED_WITHIN_S = 14.0
WILL_DELAYED = "closed without DISCONNECT, will delayed"  # info disconnect: resumed within the will delay
EXTRA_KINDS: tuple[str, ...] = ("double_owner", "stale_owner", "session_lost", "resend_without_dup", "stuck",
                                 "delivery_limit_exceeded", "dead_letter_lost", "will_not_published")
EXTRA_REPORTED_KINDS: tuple[str, ...] = ("will_lost",)
FAILING_KINDS: tuple[str, ...] = VERIFY_FAILING_KINDS + EXTRA_KINDS
# The kinds moorline verify finds too (the differential test compares exactly these).
VERIFY_KINDS: tuple[str, ...] = VERIFY_FAILING_KINDS + REPORTED_KINDS
ALL_KINDS: tuple[str, ...] = FAILING_KINDS + REPORTED_KINDS + EXTRA_REPORTED_KINDS
END_OF_TIME = 2**62
SHARE_END_REASONS = ("session_expired", "share_qos2_member_gone")
MAX_DELIVERIES_DETAIL = "max_deliveries="  # subscribe detail: the $share group's delivery limit
DELIVERY_LIMIT = "delivery_limit"  # drop reason: moved to the dead-letter topic


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str
    guid: str | None = None
    subscriber: str | None = None
    topic: str | None = None
    run: str | None = None

    @property
    def failing(self) -> bool:
        return self.kind in FAILING_KINDS


@dataclass(frozen=True)
class CheckConfig:
    owner_overlap_s: float = 0.1  # client-link delay allowed between the old owner's last byte and a new CONNACK
    stale_owner_grace_s: float = 2.0  # an old owner's connection must end within this of the new CONNACK
    owner_lease_s: float = 10.0  # a pause this long before the new CONNACK can have kept the old one open
    session_expiry_margin_s: float = 1.0  # clock skew and CONNECT processing, against session expiry


@dataclass
class Analysis:
    violations: list[Violation]  # failing and reported kinds
    counts: dict[str, int] = field(default_factory=dict)  # per run summed: published, acknowledged, ...


def check_history(records: Iterable[dict[str, Any]], cfg: CheckConfig | None = None) -> list[Violation]:
    """The failing violations of every run in ``records`` (a list of history records)."""
    return [v for v in analyze_history(records, cfg).violations if v.failing]


def analyze_history(records: Iterable[dict[str, Any]], cfg: CheckConfig | None = None) -> Analysis:
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("run") is not None:
            runs[r["run"]].append(r)
    out = Analysis([])
    counts: dict[str, int] = defaultdict(int)
    for run in sorted(runs):
        _RunCheck(run, runs[run], cfg or CheckConfig(), out.violations, counts).check()
    out.counts = dict(counts)
    return out


# --- three-valued logic, as Spark's SQL evaluates it (None is "unknown") ---------------------------
def _and3(*xs: bool | None) -> bool | None:
    if any(x is False for x in xs):
        return False
    if any(x is None for x in xs):
        return None
    return True


def _eq3(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a == b


def _gt3(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a > b


def _lt3(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a < b


@dataclass
class _Ev:
    """A session event with its subscriber incarnation and connection number."""

    r: dict[str, Any]
    session: str
    inc: int
    conn: int
    sub: str
    mono: int
    index: int
    k: int = 0
    prev_conn: int | None = None
    prev_pid: int | None = None
    orig_ns: int = 0

    def get(self, name: str) -> Any:
        return self.r.get(name)


@dataclass
class _Msg:
    guid: str
    invoke_ns: int | None = None
    ok_ns: int | None = None
    ok_index: int = 0
    failed: bool = False
    topic: str | None = None
    pub_qos: int | None = None
    pub_session: str | None = None
    no_guid: bool = False
    invokes: int = 0
    pub_incs: set[int] = field(default_factory=set)

    @property
    def status(self) -> str:
        return "ok" if self.ok_ns is not None else "fail" if self.failed else "indeterminate"

    @property
    def may_repeat(self) -> bool:
        """Sent without a guid and more than once where the broker cannot de-duplicate it."""
        return self.no_guid and self.invokes > 1 and (self.pub_qos == 1 or len(self.pub_incs) > 1)


def _smax(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _smin(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


@dataclass
class _SubRow:
    session: str
    sub: str
    inc: int
    filter: str
    share_group: str | None
    first_sub_ns: int
    last_sub_ns: int
    granted: int | None
    sticky: bool
    no_local: bool
    unsub_ns: int | None = None
    start_ns: int = 0
    live: bool = False
    regex: re.Pattern[str] | None = None

    def matches(self, topic: str | None) -> bool:
        return topic is not None and self.regex is not None and self.regex.search(topic) is not None


class _RunCheck:
    def __init__(self, run: str, recs: list[dict[str, Any]], cfg: CheckConfig, out: list[Violation],
                 counts: dict[str, int]) -> None:
        self.run = run
        self.ev = sorted(recs, key=lambda r: (r.get("mono_ns") or 0, r.get("index") or 0))
        self.cfg = cfg
        self.out = out
        self.counts = counts

    def flag(self, kind: str, detail: str, guid: str | None = None, sub: str | None = None,
             topic: str | None = None) -> None:
        self.out.append(Violation(kind, detail, guid, sub, topic, self.run))

    # ------------------------------------------------------------------------------------------
    def check(self) -> None:
        self._sessions()
        self._messages()
        self._deliveries()
        self._subscriptions()
        self._drops()
        self._lost()
        self._share_duplicates()
        self._delivery_limits()
        self._order()
        self._resends()
        self._owners()
        self._session_presence()
        self._stuck()
        self._wills()

    def _sessions(self) -> None:
        inc: dict[str, int] = defaultdict(int)
        conn: dict[str, int] = defaultdict(int)
        self.sev: list[_Ev] = []
        self.inc_at: dict[int, int] = {}  # id(record) -> its session's incarnation (every op)
        self.conn_start: dict[tuple[str, int], int] = {}
        last_conn: dict[str, tuple[str, str]] = {}
        ops = ("deliver", "ack", "subscribe", "unsubscribe", "connect", "disconnect")
        for r in self.ev:
            s = r.get("session")
            if s is None:
                continue
            op, typ = r.get("op"), r.get("type")
            if op == "connect" and typ == "ok":
                conn[s] += 1
                if r.get("session_present") is False:
                    inc[s] += 1
                self.conn_start[(s, conn[s])] = r["mono_ns"]
            self.inc_at[id(r)] = inc[s]
            if op not in ops:
                continue
            self.sev.append(_Ev(r, s, inc[s], conn[s], f"{s}#{inc[s]}", r["mono_ns"], r.get("index") or 0))
            if op in ("connect", "disconnect") and typ in ("ok", "info"):
                last_conn[s] = (op, typ)
        self.final_inc = dict(inc)
        self.last_conn = last_conn
        self.drained = {s: (op == "connect" or typ == "ok") for s, (op, typ) in last_conn.items()}

    def _messages(self) -> None:
        msgs: dict[str, _Msg] = {}
        for r in self.ev:
            if r.get("op") != "publish" or r.get("guid") is None:
                continue
            m = msgs.get(r["guid"])
            if m is None:
                m = msgs[r["guid"]] = _Msg(r["guid"])
            typ = r.get("type")
            if typ == "invoke":
                m.invoke_ns = _smin(m.invoke_ns, r["mono_ns"])
                m.invokes += 1
                if r.get("detail") == NO_GUID:
                    m.no_guid = True
                m.pub_incs.add(self.inc_at.get(id(r), 0))
            elif typ == "ok":
                if m.ok_ns is None or (r["mono_ns"], r.get("index") or 0) < (m.ok_ns, m.ok_index):
                    m.ok_ns, m.ok_index = r["mono_ns"], r.get("index") or 0
            elif typ == "fail":
                m.failed = True
            m.topic = _smax(m.topic, r.get("topic"))
            m.pub_qos = _smax(m.pub_qos, r.get("qos"))
            m.pub_session = _smax(m.pub_session, r.get("session"))
        self.msgs = msgs
        self.acked = [m for m in msgs.values() if m.status == "ok"]
        c = self.counts
        c["published"] += len(msgs)
        c["acknowledged"] += len(self.acked)
        c["refused"] += sum(1 for m in msgs.values() if m.status == "fail")
        c["indeterminate"] += sum(1 for m in msgs.values() if m.status == "indeterminate")

    def _may_repeat(self, guid: str | None) -> bool:
        m = self.msgs.get(guid) if guid is not None else None
        return m is not None and m.may_repeat

    def _deliveries(self) -> None:
        dl = [e for e in self.sev if e.r.get("op") == "deliver" and e.r.get("type") == "ok"]
        self.acks = [e for e in self.sev if e.r.get("op") == "ack"]
        # Per (subscriber, packet id): deliveries with QoS > 0 and acks, in time order.
        streams: dict[tuple[str, Any], list[tuple[str, _Ev]]] = defaultdict(list)
        for item in sorted([*[("d", x) for x in dl if (x.get("qos") or 0) > 0],
                            *[("a", x) for x in self.acks if x.get("packet_id") is not None]],
                           key=lambda p: (p[1].mono, p[1].index)):
            streams[(item[1].sub, item[1].get("packet_id"))].append(item)
        resend: set[int] = set()
        self.inflight_resends: list[tuple[_Ev, _Ev]] = []  # (resend, the delivery it repeats)
        for stream in streams.values():
            for (pk, pe), (kind, e) in zip(stream, stream[1:], strict=False):
                if kind != "d" or pk != "d":
                    continue
                if pe.get("guid") != e.get("guid"):
                    self.flag("packet_id_misuse",
                              f"packet id {e.get('packet_id')} reused while held by {pe.get('guid')}",
                              e.get("guid"), e.sub, e.get("topic"))
                elif e.get("qos") == 2:
                    resend.add(id(e))  # the protocol's resend before PUBREL: not a delivery
                    self.inflight_resends.append((e, pe))
                    if not e.get("dup"):
                        self.flag("resend_without_dup",
                                  f"QoS 2 resend of held packet id {e.get('packet_id')} with DUP=0",
                                  e.get("guid"), e.sub, e.get("topic"))
        self.dl = dl
        app = [e for e in dl if id(e) not in resend]
        groups: dict[tuple[str, Any], list[_Ev]] = defaultdict(list)
        for e in app:
            groups[(e.sub, e.get("guid"))].append(e)
        dup_legit = 0
        for same in groups.values():
            for k, e in enumerate(same, 1):
                e.k = k
                e.orig_ns = same[0].mono
                if k == 1:
                    continue
                # A retained message sent for a new subscription is a copy MQTT asks for (one per
                # matching filter of a SUBSCRIBE, MQTT-3.8.4-4), not a second delivery: in either
                # order with the live copy another filter of the session was owed. So a delivery is
                # compared with the session's earlier live copy, if any.
                earlier_live = [x for x in same[:k - 1] if x.get("detail") != "retained"]
                prev = earlier_live[-1] if earlier_live else same[k - 2]
                e.prev_conn, e.prev_pid = prev.conn, prev.get("packet_id")
                repeatable = (self._may_repeat(e.get("guid")) or e.get("detail") == "retained"
                              or not earlier_live)
                if ((e.get("qos") or 0) > 0 and e.prev_pid is not None and e.get("packet_id") is not None
                        and e.prev_pid != e.get("packet_id") and not repeatable):
                    self.flag("packet_id_misuse",
                              f"resent with packet id {e.get('packet_id')}, original {e.prev_pid}",
                              e.get("guid"), e.sub, e.get("topic"))
                legit = _and3(_eq3(e.get("qos"), 1), bool(e.get("dup")), _gt3(e.conn, e.prev_conn))
                if repeatable:
                    legit = True
                if legit is True:
                    dup_legit += 1
                elif legit is False:
                    self.flag("duplicate",
                              f"delivery #{k} qos={e.get('qos')} dup={bool(e.get('dup'))} conn={e.conn} "
                              f"prev_conn={e.prev_conn}", e.get("guid"), e.sub, e.get("topic"))
        self.app = app
        first_app: dict[tuple[str, Any], int] = {}
        for e in app:
            first_app.setdefault((e.sub, e.get("guid")), e.mono)
        for e, pe in self.inflight_resends:
            e.prev_conn = pe.conn
            e.orig_ns = first_app.get((e.sub, e.get("guid")), pe.mono)
        self.first = [e for e in app if e.k == 1]
        self.first_keys = {(e.sub, e.get("guid")) for e in self.first}
        for e in self.first:
            g = e.get("guid")
            if g is None or g not in self.msgs:
                self.flag("unexpected", "delivered but never published", g, e.sub, e.get("topic"))
            elif self.msgs[g].status == "fail":
                self.flag("refused_delivered", "publish refused, yet delivered", g, e.sub, e.get("topic"))
        self.counts["deliveries_received"] += len(dl)
        self.counts["first_deliveries"] += len(self.first)
        self.counts["duplicate_legit"] += dup_legit

    def _subscriptions(self) -> None:
        rows: dict[tuple[str, str, int, str, str | None], _SubRow] = {}
        unsub: dict[tuple[str, str, str | None], int] = {}
        for e in self.sev:
            op, typ = e.get("op"), e.get("type")
            if typ != "ok":
                continue
            if op == "subscribe":
                key = (e.session, e.sub, e.inc, e.get("filter"), e.get("share_group"))
                row = rows.get(key)
                if row is None:
                    row = rows[key] = _SubRow(e.session, e.sub, e.inc, e.get("filter"), e.get("share_group"),
                                              e.mono, e.mono, e.get("qos"), False, False)
                row.first_sub_ns = min(row.first_sub_ns, e.mono)
                row.last_sub_ns = max(row.last_sub_ns, e.mono)
                row.granted = _smax(row.granted, e.get("qos"))
                row.sticky = row.sticky or bool(e.get("sticky"))
                row.no_local = row.no_local or bool(e.get("no_local"))
            elif op == "unsubscribe":
                ukey = (e.sub, e.get("filter"), e.get("share_group"))
                unsub[ukey] = max(unsub.get(ukey, e.mono), e.mono)
        regex: dict[str, re.Pattern[str] | None] = {}
        for row in rows.values():
            row.unsub_ns = unsub.get((row.sub, row.filter, row.share_group))
            row.start_ns = row.first_sub_ns if row.unsub_ns is None else row.last_sub_ns
            row.live = (row.inc == self.final_inc.get(row.session, 0)
                        and (row.unsub_ns is None or row.unsub_ns < row.last_sub_ns)
                        and self.drained.get(row.session, False))
            if row.filter not in regex:
                try:
                    regex[row.filter] = re.compile(filter_to_regex(row.filter))
                except (ValueError, TypeError):
                    regex[row.filter] = None  # an invalid filter matches nothing
            row.regex = regex[row.filter]
        self.subs = list(rows.values())

    def _drops(self) -> None:
        self.drops = [r for r in self.ev if r.get("op") == "drop"]
        self.drop_sessions: dict[str, list[str | None]] = defaultdict(list)
        for d in self.drops:
            if d.get("guid") is not None:
                self.drop_sessions[d["guid"]].append(d.get("session"))

    def _excused(self, guid: str | None, session: str | None) -> bool:
        """A counted broker drop of exactly this message, for this session or for everyone."""
        if guid is None:
            return False
        return any(s is None or s == session for s in self.drop_sessions.get(guid, ()))

    def _lost(self) -> None:
        lost: list[tuple[str, str, str | None]] = []
        excused = 0
        # Plain subscriptions: (subscriber, message) pairs owed, the highest granted QoS of the
        # subscriber's matching filters (the broker delivers once, at the highest QoS).
        owed: dict[tuple[str, str], tuple[_SubRow, _Msg, int | None]] = {}
        for row in self.subs:
            if row.share_group is not None or not row.live:
                continue
            for m in self.acked:
                if m.invoke_ns is None or not row.start_ns < m.invoke_ns or not row.matches(m.topic):
                    continue
                if row.no_local and m.pub_session == row.session:
                    continue
                key = (row.sub, m.guid)
                have = owed.get(key)
                if have is None or _smax(have[2], row.granted) != have[2]:
                    owed[key] = (row, m, row.granted)
        for (sub, guid), (row, m, granted) in owed.items():
            if (sub, guid) in self.first_keys:
                continue
            if granted == 0 or m.pub_qos == 0:
                excused += 1
            elif granted is not None and m.pub_qos is not None:
                if self._excused(guid, row.session):
                    excused += 1
                else:
                    lost.append((guid, sub, m.topic))
        # $share groups: one delivery owed per group (run, group, filter).
        members: dict[tuple[str, str], set[str]] = defaultdict(set)
        for row in self.subs:
            if row.share_group is not None:
                members[(row.share_group, row.filter)].add(row.session)
        self.members = members
        share_owed: dict[tuple[str, str, str], list[Any]] = {}
        for row in self.subs:
            if row.share_group is None or not row.live:
                continue
            for m in self.acked:
                if m.invoke_ns is None or not row.start_ns < m.invoke_ns or not row.matches(m.topic):
                    continue
                skey = (row.share_group, row.filter, m.guid)
                entry = share_owed.get(skey)
                if entry is None:
                    share_owed[skey] = [m.topic, row.granted, m.pub_qos]
                else:
                    entry[1] = _smax(entry[1], row.granted)
        delivered_by: dict[str, set[str]] = defaultdict(set)  # guid -> sessions with a first delivery
        for e in self.first:
            if e.get("guid") is not None:
                delivered_by[e.get("guid")].add(e.session)
        for (group, flt, guid), (topic, granted, pub_qos) in share_owed.items():
            if delivered_by.get(guid, set()) & members[(group, flt)]:
                continue
            if granted == 0 or pub_qos == 0:
                excused += 1
            elif granted is not None and pub_qos is not None:
                if any(self._excused(guid, s) for s in members[(group, flt)]):
                    excused += 1
                else:
                    lost.append((guid, f"$share/{group}/{flt}", topic))
        corrupted = any(r.get("op") == "fault" and r.get("reason") == "corruption_detected" for r in self.ev)
        for guid, sub, topic in lost:
            if corrupted:
                self.flag("lost_detected_corruption", "lost in a run where the node reported corruption",
                          guid, sub, topic)
            else:
                self.flag("lost", "acknowledged, owed, never delivered, not excused", guid, sub, topic)
        self.counts["excused"] += excused

    def _share_duplicates(self) -> None:
        """A second member receiving a message: legitimate only at QoS 1 after the previous
        member's session ended (a later clean/expired session, a drop naming it, or it left for good)."""
        ends: dict[str, int] = {}
        for e in self.sev:
            if e.get("op") == "connect" and e.get("type") == "ok" and e.get("session_present") is False:
                ends[e.session] = max(ends.get(e.session, e.mono), e.mono)
        for d in self.drops:
            if d.get("reason") in SHARE_END_REASONS and d.get("session") is not None:
                ends[d["session"]] = END_OF_TIME
        for s, (op, typ) in self.last_conn.items():
            if op == "disconnect" and typ == "info":
                ends[s] = END_OF_TIME
        session_groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for (group, flt), sessions in self.members.items():
            for s in sessions:
                session_groups[s].append((group, flt))
        per_key: dict[tuple[str, str, Any], list[_Ev]] = defaultdict(list)
        for e in self.first:
            for group, flt in session_groups.get(e.session, ()):
                per_key[(group, flt, e.get("guid"))].append(e)
        legit = 0
        for (group, _flt, _guid), rows in per_key.items():
            rows.sort(key=lambda x: (x.mono, x.index))
            for prev, e in zip(rows, rows[1:], strict=False):
                end = ends.get(prev.session)
                # The QoS the previous member received it at decides (MQTT-4.8.2-4/5): a QoS 1
                # claim goes back to the group when that session ends, a QoS 2 one never does.
                ok = _and3(_eq3(prev.get("qos"), 1), end is not None and end > prev.mono)
                if ok is True:
                    legit += 1
                elif ok is False:
                    self.flag("duplicate", f"$share/{group}: also delivered to {prev.session} qos={e.get('qos')}",
                              e.get("guid"), e.session, e.get("topic"))
        self.counts["duplicate_legit"] += legit

    def _delivery_limits(self) -> None:
        """Work queues (docs/queues.md). *delivery_limit_exceeded*: a message of a $share group
        with a delivery limit (subscribe detail ``max_deliveries=N``) reached more distinct member
        sessions (incarnations) than N. Each needed a hand-out of its own: a claim belongs to one
        incarnation and comes back (one attempt) before another gets it. *dead_letter_lost*: a
        message the broker dead-lettered (a drop ``delivery_limit``) never reached a live
        dead-letter subscription (``$dlq/...``) made before it was published. (Twice is a
        *duplicate* of that subscriber.)"""
        limits: dict[tuple[str, str], int] = {}
        for e in self.sev:
            d = e.get("detail")
            if (e.get("op") == "subscribe" and e.get("type") == "ok" and e.get("share_group") is not None
                    and isinstance(d, str) and d.startswith(MAX_DELIVERIES_DETAIL)):
                limits[(e.get("share_group"), e.get("filter"))] = int(d[len(MAX_DELIVERIES_DETAIL):])
        for (group, flt), limit in sorted(limits.items()):
            sessions = self.members.get((group, flt), set())
            rows = [r for r in self.subs if r.share_group == group and r.filter == flt]
            reached: dict[Any, set[str]] = defaultdict(set)
            for e in self.first:
                if e.session in sessions and any(r.matches(e.get("topic")) for r in rows):
                    reached[e.get("guid")].add(e.sub)
            for guid, subs in reached.items():
                if len(subs) > limit:
                    self.flag("delivery_limit_exceeded",
                              f"$share/{group}/{flt}: reached {len(subs)} member sessions, limit {limit}: "
                              f"{sorted(subs)}", guid, None, self.msgs[guid].topic if guid in self.msgs else None)
        dead = {d.get("guid") for d in self.drops if d.get("reason") == DELIVERY_LIMIT and d.get("guid")}
        dlq_rows = [r for r in self.subs if r.share_group is None and r.live and (r.filter or "").startswith("$dlq/")]
        got = {(e.sub, e.get("guid")) for e in self.first if (e.get("topic") or "").startswith("$dlq/")}
        for guid in sorted(g for g in dead if g in self.msgs):
            m = self.msgs[guid]
            for row in dlq_rows:
                if m.invoke_ns is None or not row.start_ns < m.invoke_ns or (row.sub, guid) in got:
                    continue
                if any(row.matches(f"$dlq/{g}/{m.topic}") for g, _ in limits):
                    self.flag("dead_letter_lost", "dead-lettered (a drop delivery_limit), never delivered to the "
                              "dead-letter subscription", guid, row.sub, m.topic)

    def _checked_subs(self) -> dict[str, list[_SubRow]]:
        """Subscriptions whose order is promised: plain ones and sticky $share groups. Not a
        dead-letter subscription: the broker publishes there in the order messages reach their
        delivery limit, which no publisher's order says anything about (moorline sim --cluster
        --draw-config seed 23)."""
        out: dict[str, list[_SubRow]] = defaultdict(list)
        for row in self.subs:
            if (row.filter or "").startswith("$dlq/"):
                continue
            if row.share_group is None or row.sticky:
                out[row.sub].append(row)
        return out

    def _order(self) -> None:
        checked = self._checked_subs()
        self.checked = checked
        ranked: dict[str, int] = {}
        by_pub_topic: dict[tuple[str | None, str | None], list[_Msg]] = defaultdict(list)
        for m in self.acked:
            by_pub_topic[(m.pub_session, m.topic)].append(m)
        for ms in by_pub_topic.values():
            # The order the publisher saw its acknowledgements in: ties of equal time (one read
            # of several PUBACKs; every instant of a virtual clock) go by record order.
            ms.sort(key=lambda m: (m.ok_ns or 0, m.ok_index))
            for rank, m in enumerate(ms, 1):
                ranked[m.guid] = rank
        seen: set[tuple[str, Any]] = set()
        prev_max: dict[tuple[str, Any, Any], int] = {}
        for e in sorted(self.first, key=lambda x: (x.mono, x.index)):
            if not any(row.matches(e.get("topic")) for row in checked.get(e.sub, ())):
                continue
            key = (e.sub, e.get("guid"))
            if key in seen:
                continue
            seen.add(key)
            g = e.get("guid")
            if g not in ranked:
                continue
            m = self.msgs[g]
            if m.may_repeat:
                # Sent again without a guid: each copy that reached a log has its own place in the
                # shard's commit order (the first may commit late, after a healed partition, behind
                # newer messages), and nothing says which copy a delivery is.
                continue
            okey = (e.sub, e.get("topic"), m.pub_session)
            rank = ranked[g]
            pm = prev_max.get(okey)
            if pm is not None and rank < pm:
                self.flag("out_of_order", f"first delivery of publisher {m.pub_session} #{rank} after #{pm}",
                          g, e.sub, e.get("topic"))
            prev_max[okey] = rank if pm is None else max(pm, rank)

    def _resends(self) -> None:
        """After a reconnect: resends in original order, before anything new on that topic, and
        from the oldest unacknowledged message on."""
        checked = self.checked
        capp = [e for e in self.app if any(row.matches(e.get("topic")) for row in checked.get(e.sub, ()))]
        capp.sort(key=lambda x: (x.mono, x.index))
        # Resends: repeats on a later connection, and QoS 2 PUBLISHes resent with
        # their held packet id, which are resends too and keep the original order as well.
        inflight = [e for e, _ in self.inflight_resends
                    if e.conn > (e.prev_conn or 0)
                    and any(row.matches(e.get("topic")) for row in checked.get(e.sub, ()))]
        reps = sorted([e for e in capp if e.k > 1 and _gt3(e.conn, e.prev_conn) is True
                       and not self._may_repeat(e.get("guid")) and e.get("detail") != "retained"] + inflight,
                      key=lambda x: (x.mono, x.index))
        prev_orig: dict[tuple[str, Any, int], int] = {}
        for e in reps:
            key = (e.sub, e.get("topic"), e.conn)
            po = prev_orig.get(key)
            if po is not None and e.orig_ns < po:
                self.flag("out_of_order", "resend not in original order", e.get("guid"), e.sub, e.get("topic"))
            prev_orig[key] = e.orig_ns if po is None else max(po, e.orig_ns)
        first_new: dict[tuple[str, Any, int], int] = {}
        for e in capp:
            if e.k == 1:
                key = (e.sub, e.get("topic"), e.conn)
                first_new[key] = min(first_new.get(key, e.mono), e.mono)
        for e in reps:
            fn = first_new.get((e.sub, e.get("topic"), e.conn))
            if fn is not None and e.mono > fn:
                self.flag("out_of_order", "resend after a new message", e.get("guid"), e.sub, e.get("topic"))
        rep_span: dict[tuple[str, Any], dict[int, tuple[str, int]]] = defaultdict(dict)  # (sub, topic) -> conn -> (session, max orig)
        for e in reps:
            spans = rep_span[(e.sub, e.get("topic"))]
            have = spans.get(e.conn)
            spans[e.conn] = (e.session, e.orig_ns if have is None else max(have[1], e.orig_ns))
        first_ack: dict[tuple[str, str], int] = {}
        continued: set[tuple[str, Any, int]] = set()
        for a in self.acks:
            if a.get("guid") is not None:
                key2 = (a.sub, a.get("guid"))
                first_ack[key2] = min(first_ack.get(key2, a.mono), a.mono)
                continued.add((a.sub, a.get("guid"), a.conn))
        # Continued on a connection: delivered on it again (a QoS 2 resend with the held packet id
        # included), or released on it (PUBREL -> PUBCOMP).
        for e in self.dl:
            if e.get("guid") is not None:
                continued.add((e.sub, e.get("guid"), e.conn))
        for e in capp:
            # A QoS 0 delivery is never acknowledged and never resent (at most once, MQTT 5
            # section 4.3.1): it is never owed a resend.
            if e.k != 1 or not (e.get("qos") or 0) > 0:
                continue
            found = rep_span.get((e.sub, e.get("topic")))
            if not found:
                continue
            g = e.get("guid")
            ack_ns = first_ack.get((e.sub, g)) if g is not None else None
            for conn, (session, max_orig) in sorted(found.items()):
                conn_ns = self.conn_start.get((session, conn))
                if conn_ns is None or not (e.conn < conn and e.mono < max_orig):
                    continue
                if ack_ns is not None and not ack_ns > conn_ns:
                    continue
                if g is not None and (e.sub, g, conn) in continued:
                    continue
                if self._excused(g, e.session):
                    continue
                self.flag("out_of_order",
                          f"unacknowledged message not resent on connection {conn} although a newer one was",
                          g, e.sub, e.get("topic"))

    # --- beyond verify -------------------------------------------------------------------------
    def _owners(self) -> None:
        """Two processes' connections of one session: the old one must end before the new one's
        CONNACK (within ``owner_overlap_s``) and must not deliver after it."""
        overlap_ns = int(self.cfg.owner_overlap_s * 1e9)
        grace_ns = int(self.cfg.stale_owner_grace_s * 1e9)
        lease_ns = int(self.cfg.owner_lease_s * 1e9)
        conns: dict[str, list[dict[str, Any]]] = defaultdict(list)  # session -> connections in CONNACK order
        open_conn: dict[tuple[str, Any], dict[str, Any]] = {}
        pauses = self._node_pauses()
        for r in self.ev:
            if r.get("op") == "fault" and r.get("node") is not None:
                continue
            s = r.get("session")
            if s is None:
                continue
            key = (s, r.get("process"))
            op, typ = r.get("op"), r.get("type")
            if op == "connect" and typ == "ok":
                c = {"process": r.get("process"), "node": r.get("node"), "start": r["mono_ns"], "end": None,
                     "deliveries": []}
                conns[s].append(c)
                open_conn[key] = c
            elif op == "disconnect" and typ in ("ok", "info"):
                c2 = open_conn.pop(key, None)
                if c2 is not None:
                    c2["end"] = r["mono_ns"]
            elif op == "deliver" and typ == "ok" and key in open_conn:
                open_conn[key]["deliveries"].append(r)
        for s, cs in conns.items():
            if len({c["process"] for c in cs}) < 2:
                continue
            for i, new in enumerate(cs):
                for old in cs[:i]:
                    if old["process"] == new["process"]:
                        continue
                    end = old["end"] if old["end"] is not None else END_OF_TIME
                    if not old["start"] <= new["start"] < end:
                        continue
                    late = [d for d in old["deliveries"] if d["mono_ns"] > new["start"] + overlap_ns]
                    if late:
                        d = late[0]
                        self.flag("double_owner",
                                  f"{old['process']} on {old['node']} received a PUBLISH "
                                  f"{(d['mono_ns'] - new['start']) / 1e9:.3f} s after {new['process']} got "
                                  f"CONNACK from {new['node']} ({len(late)} such)", d.get("guid"), s,
                                  d.get("topic"))
                        continue
                    limit = new["start"] + grace_ns
                    for p_start, p_end in pauses.get(old["node"], ()):
                        if p_start <= limit and p_end >= new["start"] - lease_ns:
                            limit = max(limit, p_end + grace_ns)  # it closes when it resumes
                    if end > limit:
                        self.flag("stale_owner",
                                  f"{old['process']}'s connection to {old['node']} still open "
                                  f"{(min(end, self.ev[-1]['mono_ns']) - new['start']) / 1e9:.3f} s after "
                                  f"{new['process']} got CONNACK from {new['node']}", None, s, None)

    def _node_pauses(self) -> dict[str, list[list[int]]]:
        """Each node's pauses, [start, end] in history order (end END_OF_TIME while not resumed)."""
        pauses: dict[str, list[list[int]]] = defaultdict(list)
        for r in self.ev:
            if r.get("op") == "fault" and r.get("node") is not None:
                if r.get("reason") == "pause":
                    pauses[r["node"]].append([r["mono_ns"], END_OF_TIME])
                elif r.get("reason") == "resume" and pauses[r["node"]]:
                    pauses[r["node"]][-1][1] = min(pauses[r["node"]][-1][1], r["mono_ns"])
        return pauses

    def _wills(self) -> None:
        """Wills owed: due (the connection ended without a DISCONNECT the node processed) and
        matching a live, drained subscription subscribed before that end (docs/verification.md,
        "Wills")."""
        pending: dict[tuple[str, Any], dict[str, Any]] = {}  # (session, process) -> will of its connection
        faults = [r["mono_ns"] for r in self.ev if r.get("op") == "fault" and r.get("reason") in WILL_FAULTS]
        healed = [r["mono_ns"] for r in self.ev if r.get("op") == "fault" and r.get("reason") == HEALED]
        # Judged (failing when lost) only with fault records to judge by; a history without any
        # (a real cluster's) keeps will_lost reported only, and there a lost connection owes
        # nothing: the client cannot tell whether the node had read a DISCONNECT it sent.
        judge = bool(faults or healed)
        due: list[tuple[dict[str, Any], int]] = []
        for r in self.ev:
            s = r.get("session")
            if s is None:
                continue
            key = (s, r.get("process"))
            op, typ = r.get("op"), r.get("type")
            if op == "publish" and typ == "invoke" and r.get("detail") == WILL and r.get("guid") is not None:
                pending[key] = r
            elif op == "connect" and typ == "fail":
                pending.pop(key, None)  # the CONNECT carrying the will was refused
            elif op == "disconnect" and key in pending:
                will = pending.pop(key)
                reason = r.get("reason") or ""
                if typ != "info" or reason.startswith(WILL_DELAYED):
                    continue  # a DISCONNECT sent (its will discarded, or unknown), or a delayed will
                if reason.startswith(WILL_DUE) or judge:
                    # The client's abrupt end, or (simulator) its connection lost: a reset, its
                    # node's crash, the node's own close. No DISCONNECT was processed either way.
                    due.append((will, r["mono_ns"]))
        delivered_by: dict[str, set[str]] = defaultdict(set)
        for e in self.first:
            if e.get("guid") is not None:
                delivered_by[e.get("guid")].add(e.sub)
                delivered_by[e.get("guid")].add(e.session)
        calm_from = healed[-1] + int(WILL_SETTLE_S * 1e9) if healed else END_OF_TIME
        before_ns, after_ns = int(WILL_FAULT_BEFORE_S * 1e9), int(WILL_FAULT_AFTER_S * 1e9)
        end_ns = self.ev[-1]["mono_ns"] if self.ev else 0
        heal_ns = healed[-1] if healed else END_OF_TIME
        within_ns = int(WILL_OWED_WITHIN_S * 1e9)
        lost = 0
        for will, due_ns in due:
            # Due in a stretch no fault touched, or once everything healed; or, whatever faults
            # came near it, with time left for the session shard to end the session and publish.
            calm = judge and (due_ns >= calm_from or not any(
                due_ns - before_ns <= t <= due_ns + after_ns for t in faults))
            owed_by_now = judge and max(due_ns, heal_ns) + within_ns <= end_ns
            g, topic, qos = will["guid"], will.get("topic"), will.get("qos") or 0
            owed: dict[str, _SubRow] = {}
            for row in self.subs:
                if not row.live or not row.start_ns < due_ns or not row.matches(topic):
                    continue
                who = row.sub if row.share_group is None else f"$share/{row.share_group}/{row.filter}"
                if who not in owed or _smax(owed[who].granted, row.granted) != owed[who].granted:
                    owed[who] = row
            for who, row in owed.items():
                if qos == 0 or not row.granted:
                    continue
                if row.share_group is None:
                    got = row.sub in delivered_by.get(g, set())
                else:
                    got = bool(delivered_by.get(g, set()) & self.members[(row.share_group, row.filter)])
                if not got:
                    lost += 1
                    why = ", no fault near it" if calm else (", the faults healed long before the end"
                                                             if owed_by_now else "")
                    self.flag("will_not_published" if calm or owed_by_now else "will_lost",
                              f"will of {will.get('session')} due at its connection's end "
                              f"({(due_ns - self.ev[0]['mono_ns']) / 1e9:.3f} s{why}), never delivered",
                              g, who, topic)
        self.counts["wills_due"] += len(due)
        self.counts["wills_lost"] += lost

    def _stuck(self) -> None:
        """Liveness once the faults healed: the workload's drain gave up on a subscriber that could
        not catch up, or on a publish that was never answered (the workload records both)."""
        for r in self.ev:
            reason = r.get("reason") or ""
            if r.get("type") != "info":
                continue
            if r.get("op") == "disconnect" and reason.startswith(STUCK_SUBSCRIBER):
                self.flag("stuck", f"{r.get('process')}: {reason}", None, r.get("session"), None)
            elif r.get("op") == "publish" and reason.startswith(STUCK_PUBLISH):
                self.flag("stuck", f"{r.get('process')}: {reason}", r.get("guid"), r.get("session"), r.get("topic"))

    def _session_presence(self) -> None:
        """CONNECT with clean start 0 to a session that cannot have expired yet must find it."""
        margin_ns = int(self.cfg.session_expiry_margin_s * 1e9)
        expiry: dict[str, int | None] = {}  # session -> expiry (s) of its last connection; None: never
        known: set[str] = set()
        uncertain: set[str] = set()
        attempt: dict[tuple[str, Any], dict[str, Any]] = {}
        open_by: dict[str, set[Any]] = defaultdict(set)
        last_end: dict[str, int] = {}
        served: dict[tuple[str, Any], tuple[Any, int]] = {}  # (session, process) -> (node, CONNACK time)
        pauses = self._node_pauses()
        grace_ns = int(self.cfg.stale_owner_grace_s * 1e9)
        for r in self.ev:
            if r.get("op") == "fault" and r.get("node") is not None:
                continue
            s = r.get("session")
            if s is None or r.get("op") not in ("connect", "disconnect"):
                continue
            key = (s, r.get("process"))
            typ = r.get("type")
            if r["op"] == "disconnect":
                if typ in ("ok", "info") and r.get("process") in open_by[s]:
                    open_by[s].discard(r.get("process"))
                    end = r["mono_ns"]
                    node, since = served.pop(key, (None, end))
                    # Its node paused while serving it, the connection ending during the pause or as
                    # the node resumed: a paused owner renews no lease, so the session shard may
                    # have ended the connection (lost without DISCONNECT, design.md "Wills") at the
                    # lease's end, while the client saw it open; that end is not before the pause.
                    for p_start, p_end in pauses.get(node, ()):
                        if since <= p_start <= end <= p_end + grace_ns:
                            end = p_start
                    last_end[s] = end
                continue
            if typ == "invoke":
                attempt[key] = r
                continue
            inv = attempt.pop(key, None)
            if typ == "fail":
                if inv is None or inv.get("clean_start") is not False:
                    uncertain.add(s)  # a clean start may have replaced the session after all
                continue
            if typ != "ok" or inv is None:
                continue
            if (r.get("session_present") is False and inv.get("clean_start") is False and s in known
                    and s not in uncertain):
                exp = expiry.get(s)
                # Away until the CONNACK: the broker may have decided as late as that.
                gap_ns = 0 if open_by[s] else r["mono_ns"] - last_end.get(s, inv["mono_ns"])
                if exp is None or (exp > 0 and gap_ns < exp * 1_000_000_000 - margin_ns):
                    self.flag("session_lost",
                              f"session present 0 after {gap_ns / 1e9:.3f} s away, session expiry "
                              f"{'none' if exp is None else exp} s", None, f"{s}", None)
            known.add(s)
            uncertain.discard(s)
            expiry[s] = inv.get("session_expiry") if inv.get("clean_start") is False or inv.get(
                "session_expiry") is not None else 0
            open_by[s].add(r.get("process"))
            served[key] = (r.get("node"), r["mono_ns"])
