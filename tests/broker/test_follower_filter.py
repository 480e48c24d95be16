"""Filtered followers (moorline/broker/follower_filter.py): the equivalence oracle.

A full ShardState (R) applies random entries built from its own state (so acks, claims, deliveries
and takeovers name what exists); at a random entry a partial snapshot for a random client subset C
is taken, and every later entry, reduced and sent through its wire encoding, is applied to the
partial state (S). After every entry, for every client in C, S's ``client_view`` must equal R's.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.broker import commands as c
from moorline.broker import follower_filter as ff
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits

CLIENTS = ["c1", "c2", "c3", "c4"]
TOPICS = ["a", "a/b", "b/c", "jobs/1", "jobs/2", "r"]
FILTERS = ["#", "a/+", "b/#", "a", "jobs/#", "r"]
GROUPS = {"g": "jobs/#", "h": "a/#"}
GUIDS = [bytes([i]) * 16 for i in range(1, 5)]
LIMITS = dict(retention_min_age_ms=300, shard_max_bytes=(16 << 20) + 3000, dedup_window_ms=2000,
              dedup_max_history=6)


def share_key(group: str) -> str:
    return f"{c.SHARE_PREFIX}{group}\0{GROUPS[group]}"


class World:
    """R: the full state, its message store, the clock, and the entry being built."""

    def __init__(self) -> None:
        self.state = ShardState(0, "inc0", TopicLimits(**LIMITS), 3600)  # type: ignore[arg-type]
        self.store: dict[int, StoredMessage] = {}
        self.clock = 1000
        self.fresh = 100
        self.seq = 0
        self.favoured: list[str] = []  # C's clients: commands name them more often

    def apply_entry(self, cmds: list[c.Command]) -> tuple[list[Any], Effects]:
        """As ShardHost._apply_commands: runs of Publishes in one call, the rest one by one."""
        st_, fx, results, i = self.state, Effects(), [], 0
        while i < len(cmds):
            j = i + 1
            if type(cmds[i]) is c.Publish:
                while j < len(cmds) and type(cmds[j]) is c.Publish:
                    j += 1
                results += st_.apply_publishes(cmds[i:j], fx)  # type: ignore[arg-type]
            else:
                results.append(st_.apply(cmds[i], fx))
            i = j
        for o, _, m in fx.appends:
            self.store[o] = m
        return results, fx


def _pick(data: st.DataObject, items: list[Any]) -> Any:
    return data.draw(st.sampled_from(items)) if items else None


def _subset(data: st.DataObject, items: list[int]) -> tuple[int, ...]:
    return tuple(data.draw(st.lists(st.sampled_from(items), max_size=3, unique=True))) if items else ()


def next_command(data: st.DataObject, w: World) -> c.Command | None:
    """One command, its arguments taken from R's state where that makes it do something."""
    s, t = w.state.sessions, w.state.topics
    w.clock += data.draw(st.sampled_from([0, 40, 150, 700]))
    now = w.clock
    cid = data.draw(st.sampled_from(CLIENTS + w.favoured * 2))
    sess = s.sessions.get(cid)
    regs = list(t.regs.items())
    kind = data.draw(st.sampled_from(
        ["pub"] * 6 + ["open"] * 3 + ["deliver"] * 3 + ["acks"] * 2 + ["reg"] * 3 + ["claim"] * 3 + [
            "close", "shk", "sub", "unsub", "share_reg", "unreg", "member", "member", "return", "decline",
            "activate", "timeout", "timeout", "dead", "dead", "ack", "ack", "drop", "hk", "renew", "release", "willpub", "q2", "pin"]))
    if kind == "pub":
        w.fresh += 1
        guid = data.draw(st.sampled_from([*GUIDS, w.fresh.to_bytes(16, "big")]))
        m = StoredMessage(data.draw(st.sampled_from(TOPICS)), data.draw(st.sampled_from([b"", b"x", b"yy"])),
                          data.draw(st.integers(0, 2)), data.draw(st.booleans()), guid, now,
                          data.draw(st.sampled_from([None, None, 1])), None, data.draw(st.sampled_from(["pub", cid])))
        principal = data.draw(st.sampled_from(["", "alice"]))
        if data.draw(st.integers(0, 3)) == 0:  # a sequenced producer: mostly its next sequence
            last = w.state.topics.producers.get(b"producer" + principal.encode(), (0,))[0]
            return c.Publish(m, principal, b"producer", last + data.draw(st.sampled_from([1, 1, 1, 2, 0])))
        return c.Publish(m, principal)
    if kind == "open":
        will = _pick(data, [None, c.WillSpec("w", b"bye", 1, False), c.WillSpec("w", b"later", 0, False, delay_s=1)])
        return c.SessionOpen(now, cid, data.draw(st.booleans()), data.draw(st.sampled_from([0, 2, 100])), will,
                             data.draw(st.sampled_from(["p1", "p2"])), data.draw(st.booleans()),
                             data.draw(st.sampled_from([0, 1, 2])), data.draw(st.sampled_from([0, 2000])),
                             data.draw(st.sampled_from([0, 1, 2])))
    if kind == "shk":
        return c.SessionHousekeeping(now - data.draw(st.sampled_from([0, 500])))
    if kind == "hk":
        return c.Housekeeping(now - data.draw(st.sampled_from([0, 500])), data.draw(st.sampled_from([-1, -1, 2])))
    if kind == "pin":
        return c.Pin("reader", "o", data.draw(st.integers(0, 5)), 1000, 4, 4, now)
    if kind == "renew":
        mine = [(x.client_id, x.epoch) for x in s.sessions.values()]
        return c.SessionRenew(now, data.draw(st.sampled_from([1, 2])), 2000,
                              tuple(data.draw(st.lists(st.sampled_from(mine), max_size=3, unique=True))) if mine else ())
    if kind == "willpub":
        key = _pick(data, list(s.wills_owed))
        return None if key is None else c.WillPublished(*key)
    if kind in ("reg", "share_reg"):
        if kind == "share_reg":
            g = data.draw(st.sampled_from(list(GROUPS)))
            return c.Register(now, share_key(g), "", 1, GROUPS[g], 1, want_retained=False, share_group=g,
                              single_active=data.draw(st.booleans()), max_deliveries=data.draw(st.sampled_from([0, 1, 2])),
                              ack_timeout_ms=data.draw(st.sampled_from([0, 500, 500])))
        flt = data.draw(st.sampled_from(FILTERS))
        inc = sess.incarnation if sess is not None and data.draw(st.booleans()) else data.draw(st.integers(1, 4))
        return c.Register(now, f"{cid}\0{flt}", cid, inc, flt, data.draw(st.integers(0, 2)), data.draw(st.booleans()),
                          data.draw(st.booleans()), sub_version=data.draw(st.sampled_from([-1, 1, 3])))
    if kind == "member":
        g = data.draw(st.sampled_from(list(GROUPS)))
        inc = sess.incarnation if sess is not None else data.draw(st.integers(1, 3))
        return c.ShareMember(share_key(g), cid, data.draw(st.booleans()), inc)
    if kind == "release":
        return None if sess is None or sess.prev_lease is None else c.LeaseRelease(cid, *sess.prev_lease[1::-1])
    if not regs and kind not in ("close", "sub", "unsub", "deliver", "acks", "q2"):
        return None
    shared = [(k, r) for k, r in regs if r.share_group is not None and r.members]
    share_kind = kind in ("claim", "return", "decline", "activate", "timeout", "dead")
    if share_kind and not shared:
        return None
    picked: tuple[str, Any] = _pick(data, shared if share_kind else regs) if regs else ("", None)
    rk, reg = picked
    owed = list(reg.owed) if reg is not None else []
    if kind == "unreg":
        return c.Unregister(rk, reg.session_inc if data.draw(st.booleans()) else -1,
                            data.draw(st.sampled_from(["unsubscribe", "session_end"])),
                            data.draw(st.sampled_from([-1, 2, 5])))
    if kind == "ack":
        return c.AckReport(rk, _subset(data, owed))
    if kind == "drop":
        return c.DropOwed(rk, _subset(data, owed), "queue_cap")
    if share_kind:
        member, inc = _pick(data, list(reg.members.items()))
        claimed = [o for o, (m, _) in reg.claims.items() if m == member]
        if kind == "claim":
            return c.ShareClaim(rk, member, _subset(data, owed), inc, now)
        if kind == "return":
            return c.ShareReturn(rk, member, _subset(data, claimed), inc)
        if kind == "decline":
            return c.ShareDecline(rk, member, _subset(data, claimed), inc)
        if kind == "activate":
            return c.ShareActivate(rk, member, reg.queue.active if reg.queue is not None else "")
        if kind == "timeout":
            return c.ShareTimeout(now, rk, member, inc, _subset(data, claimed))
        return c.ShareDeadLettered(rk, _subset(data, list(reg.queue.dead) if reg.queue else owed))
    if sess is None:
        return None
    epoch = sess.epoch - data.draw(st.sampled_from([0, 0, 0, 1]))
    if kind == "close":
        return c.SessionClose(now, cid, epoch, data.draw(st.booleans()), data.draw(st.sampled_from([None, 0, 50])))
    if kind == "sub":
        return c.SessionSubscribe(cid, epoch, data.draw(st.sampled_from([*FILTERS, "$share/g/jobs/#"])), 1, False,
                                  False, 0, None)
    if kind == "unsub":
        return c.SessionUnsubscribe(cid, epoch, data.draw(st.sampled_from([*sess.subs, "x"])))
    if kind == "deliver":
        owed_to = [(o, k) for k, r in regs if k.startswith(cid + "\0") or cid in r.members for o in r.owed]
        items = tuple(c.DeliveryItem(0, o, 1, False, (), (k,)) for o, k in data.draw(
            st.lists(st.sampled_from(owed_to), max_size=3, unique=True))) if owed_to else ()
        return c.Deliver(cid, epoch, sess.next_seq + data.draw(st.sampled_from([0, 0, 1])), items)
    if kind == "acks":
        seqs = list(sess.inflight)
        return c.SessionAcks(cid, epoch, tuple((q, data.draw(st.sampled_from([1, 2]))) for q in _subset(data, seqs)))
    return c.InboundQos2(cid, epoch, data.draw(st.integers(1, 3)), bytes(16)) if data.draw(st.booleans()) \
        else c.InboundRelease(cid, epoch, data.draw(st.integers(1, 3)))


def draw_entries(data: st.DataObject, w: World) -> Any:
    """Yields each entry as R applied it: (commands, results, fx), or ([], [], fx) when admit skips it."""
    for _ in range(data.draw(st.integers(5, 45), label="entries")):
        if data.draw(st.integers(0, 9)) == 0:  # a proposal resent to a new leader: skipped by admit
            if w.seq:
                assert not w.state.admit(1, 1, w.seq)
            yield [], [], Effects()
            continue
        w.seq += 1
        assert w.state.admit(1, 1, w.seq)
        cmds: list[c.Command] = []
        results: list[Any] = []
        fx = Effects()
        for _ in range(data.draw(st.integers(1, 4))):
            cmd = next_command(data, w)
            if cmd is None:
                continue
            r, f = w.apply_entry([cmd])  # one at a time within the entry: R's state decides the next
            cmds.append(cmd)
            results += r
            _merge_fx(fx, f)
        yield cmds, results, fx


def _merge_fx(into: Effects, fx: Effects) -> None:
    into.appends += fx.appends
    into.releases += fx.releases
    into.owed_new += fx.owed_new
    into.owed_regs |= fx.owed_regs
    into.claims += fx.claims
    into.retained_new += fx.retained_new


class Follower:
    """S: the partial state, its message cache (what its host keeps from the effects)."""

    def __init__(self, snap: ff.PartialSnapshot) -> None:
        fx = Effects()
        self.state = ff.restore_partial(ff.decode_snapshot(ff.encode(snap)), TopicLimits(**LIMITS), 3600, fx)  # type: ignore[arg-type]
        self.store: dict[int, StoredMessage] = {}
        self.take(fx)

    def take(self, fx: Effects) -> None:
        for o, _, m in fx.appends:
            self.store[o] = m
        for o in fx.releases:
            self.store.pop(o, None)

    def apply(self, entry: ff.ReducedEntry) -> Effects:
        fx = Effects()
        ff.apply_reduced(self.state, ff.decode_entry(ff.encode(entry)), fx)  # over the wire: no shared objects
        self.take(fx)
        return fx

    def add(self, part: ff.PartialSnapshot) -> None:
        fx = Effects()
        ff.merge_partial(self.state, ff.decode_snapshot(ff.encode(part)), fx)
        self.take(fx)


def assert_same(w: World, f: Follower, clients: list[str], where: str) -> None:
    for cid in clients:
        full = ff.client_view(w.state, cid, w.store.get)
        part = ff.client_view(f.state, cid, f.store.get)
        assert part == full, f"{where}: client {cid} differs"


def run(data: st.DataObject, add_later: bool) -> None:
    w = World()
    clients = data.draw(st.lists(st.sampled_from(CLIENTS), min_size=1, max_size=3, unique=True), label="C")
    w.favoured = clients
    cut = data.draw(st.integers(0, 12), label="snapshot after entry")
    late = data.draw(st.sampled_from([x for x in CLIENTS if x not in clients]), label="added later") if add_later \
        else None
    flt: ff.FollowerFilter | None = None
    follower: Follower | None = None
    index = 0
    for cmds, results, fx in draw_entries(data, w):
        index += 1
        w.state.applied_index = index
        if follower is None or flt is None:
            if index >= cut:
                flt = ff.FollowerFilter(clients)
                follower = Follower(flt.snapshot(w.state, w.store.get))
                assert_same(w, follower, clients, f"snapshot at {index}")
            continue
        reduced = flt.reduce(w.state, index, cmds, results, fx, w.store.get)
        sfx = follower.apply(reduced)
        mine = [r for r in fx.retained_new if ff.plain_owner(r[0]) in flt.clients]
        assert sfx.retained_new == mine, f"entry {index}: retained handed to the sessions"
        assert_same(w, follower, clients, f"entry {index} {[type(x).__name__ for x in cmds]}")
        if late is not None and data.draw(st.integers(0, 3), label="add now") == 0:
            follower.add(flt.add_clients(w.state, [late], w.store.get))
            clients, late = [*clients, late], None
            assert_same(w, follower, clients, f"added at {index}")
        elif add_later and late is None and len(clients) > 1 and data.draw(st.integers(0, 5), label="drop") == 0:
            gone, clients = clients[0], clients[1:]  # S stops serving a client
            follower.apply(flt.remove_clients(w.state, [gone]))
            assert_same(w, follower, clients, f"removed at {index}")
            left = ff.client_view(follower.state, gone, follower.store.get)
            assert left["session"] is None and not left["wills"], "the removed client's session stays"
            assert all(ff.plain_owner(rk) is None for rk in left["regs"]), "its registrations stay"
    if follower is not None:
        assert_same(w, follower, clients, "end")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_partial_state_equals_full_state_for_its_clients(data: st.DataObject) -> None:
    run(data, add_later=False)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_client_added_later_converges_and_one_removed_goes(data: st.DataObject) -> None:
    run(data, add_later=True)


def test_plain_owner_tells_share_groups_from_a_client_named_share() -> None:
    assert ff.plain_owner("c1\0a/#") == "c1"
    assert ff.plain_owner("$share\0a/#") == "$share"  # a client whose id is "$share"
    assert ff.plain_owner(share_key("g")) is None


def test_skipped_publishes_keep_offsets_and_admission_is_not_decided_again() -> None:
    w = World()
    w.apply_entry([c.Register(0, "c1\0a", "c1", 1, "a", 1), c.Register(0, "c2\0#", "c2", 1, "#", 1)])
    flt = ff.FollowerFilter(["c1"])
    f = Follower(flt.snapshot(w.state, w.store.get))
    m = [StoredMessage(t, b"x", 1, False, g, 2000, None, None, "pub") for t, g in
         [("b", GUIDS[0]), ("a", GUIDS[1]), ("a", GUIDS[1]), ("b", GUIDS[2]), ("a", GUIDS[3])]]
    cmds: list[c.Command] = [c.Publish(x) for x in m]
    results, fx = w.apply_entry(cmds)
    assert [r.status for r in results] == ["ok", "ok", "duplicate", "ok", "ok"]
    reduced = flt.reduce(w.state, 1, cmds, results, fx, w.store.get)
    assert [(op.at, op.regs) for op in reduced.ops if isinstance(op, ff.Apply)] == [(1, ("c1\0a",)), (3, ("c1\0a",))]
    f.apply(reduced)
    assert list(f.state.topics.regs["c1\0a"].owed) == [1, 3] and f.state.topics.next_offset == 4
    assert_same(w, f, ["c1"], "after")


def _follower_of(w: World, clients: list[str]) -> tuple[ff.FollowerFilter, Follower]:
    flt = ff.FollowerFilter(clients)
    return flt, Follower(flt.snapshot(w.state, w.store.get))


def _entry(w: World, flt: ff.FollowerFilter, f: Follower, cmds: list[c.Command]) -> list[Any]:
    results, fx = w.apply_entry(cmds)
    w.state.applied_index += 1
    f.apply(flt.reduce(w.state, w.state.applied_index, cmds, results, fx, w.store.get))
    return results


def _pub(topic: str, guid: bytes, ts: int = 1000, expiry: int | None = None, payload: bytes = b"x") -> StoredMessage:
    return StoredMessage(topic, payload, 1, False, guid, ts, expiry, None, "pub")


def test_a_sequence_the_follower_saw_only_part_of_is_not_checked_again() -> None:
    # seq 2 goes to a topic C does not read: S sees 1 and 3 and must not call 3 a gap.
    w = World()
    w.apply_entry([c.Register(0, "c1\0a", "c1", 1, "a", 1)])
    flt, f = _follower_of(w, ["c1"])
    seqs = [("a", 1), ("b", 2), ("a", 3)]
    got = _entry(w, flt, f, [c.Publish(_pub(t, GUIDS[n - 1]), "", b"producer", n) for t, n in seqs])
    assert [r.status for r in got] == ["ok", "ok", "ok"]
    assert_same(w, f, ["c1"], "after")


def test_a_guid_the_shard_forgot_is_not_remembered_by_the_follower() -> None:
    # R's GUID history (6 entries at most) forgets X; S, which saw fewer messages, would not.
    w = World()
    w.apply_entry([c.Register(0, "c1\0a", "c1", 1, "a", 1)])
    flt, f = _follower_of(w, ["c1"])
    x = GUIDS[0]
    _entry(w, flt, f, [c.Publish(_pub("a", x))])
    _entry(w, flt, f, [c.Publish(_pub("b", (200 + i).to_bytes(16, "big"))) for i in range(7)])
    _entry(w, flt, f, [c.Housekeeping(1000, -1)])
    assert [r.status for r in _entry(w, flt, f, [c.Publish(_pub("a", x))])] == ["ok"]
    assert_same(w, f, ["c1"], "after")


def test_housekeeping_expires_by_the_shards_time_not_the_followers() -> None:
    # A publish C never sees moves R's time past the owed message's expiry; the Housekeeping in
    # the same entry is stamped earlier: R's expiry is by max(last time, its time).
    w = World()
    w.apply_entry([c.Register(0, "c1\0a", "c1", 1, "a", 1)])
    flt, f = _follower_of(w, ["c1"])
    _entry(w, flt, f, [c.Publish(_pub("a", GUIDS[0], ts=1000, expiry=1))])
    _entry(w, flt, f, [c.Publish(_pub("b", GUIDS[1], ts=2500)), c.Housekeeping(1500, -1)])
    assert not w.state.topics.regs["c1\0a"].owed
    assert_same(w, f, ["c1"], "after")


def test_session_housekeeping_by_the_shards_time() -> None:
    # Another client's open moves R's session time on; c1's will falls due by that time.
    w = World()
    w.apply_entry([c.SessionOpen(1000, "c1", False, 100, c.WillSpec("w", b"", 0, False, delay_s=1))])
    w.apply_entry([c.SessionClose(1000, "c1", 1, True)])
    flt, f = _follower_of(w, ["c1"])
    _entry(w, flt, f, [c.SessionOpen(5000, "c2", False, 100, None), c.SessionHousekeeping(1500)])
    assert w.state.sessions.wills_owed
    assert_same(w, f, ["c1"], "after")


def test_an_open_is_sent_as_its_outcome() -> None:
    # Epochs and incarnations are numbered shard-wide, and a principal's quota counts sessions
    # of clients outside C: replayed on S, c1's open would get other numbers, or not be refused.
    w = World()
    flt, f = _follower_of(w, ["c1"])
    _entry(w, flt, f, [c.SessionOpen(1000, "c2", False, 100, None, "p"), c.SessionOpen(1000, "c1", False, 100, None)])
    _entry(w, flt, f, [c.SessionOpen(1000, "c3", False, 100, None, "q", max_persistent=1),
                       c.SessionOpen(1000, "c4", False, 100, None, "q", max_persistent=1)])
    flt2, f2 = _follower_of(w, ["c4"])
    got = _entry(w, flt2, f2, [c.SessionOpen(1000, "c4", False, 100, None, "q", max_persistent=1)])
    assert got[0].over_quota
    assert_same(w, f, ["c1"], "numbers")
    assert_same(w, f2, ["c4"], "quota")


def test_a_held_groups_timeouts_and_dead_letters_reach_the_follower() -> None:
    w = World()
    key = share_key("g")
    w.apply_entry([c.Register(0, key, "", 1, "jobs/#", 1, want_retained=False, share_group="g", max_deliveries=1,
                              ack_timeout_ms=500), c.ShareMember(key, "c1", True, 1), c.ShareMember(key, "c2", True, 1)])
    flt, f = _follower_of(w, ["c1"])
    _entry(w, flt, f, [c.Publish(_pub("jobs/1", GUIDS[0])), c.Publish(_pub("jobs/2", GUIDS[1]))])
    _entry(w, flt, f, [c.ShareClaim(key, "c2", (0, 1), 1, 1000)])
    assert _entry(w, flt, f, [c.ShareTimeout(2000, key, "c2", 1, (0, 1))]) == [(0, 1)]
    assert _entry(w, flt, f, [c.ShareDeadLettered(key, (0,))]) == [(0,)]
    assert_same(w, f, ["c1"], "after")
