"""Issue 33 item 1, in the pure state machine: a single-active $share group grants claims to its
active member only; the active member is replicated state that passes on in join order when it
leaves, or (ShareActivate, proposed by the leader) when it is offline and holds nothing."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits
from tests.broker.share_helpers import KEY, as_version_4, group, publish, queue_of, same_after_restore


def test_only_the_active_member_is_granted_claims() -> None:
    s = group("a", "b", single_active=True)
    assert queue_of(s).active == "a"
    offs = publish(s, 3)
    assert s.apply(c.ShareClaim(KEY, "b", tuple(offs), 2), Effects()) == ()  # standby
    assert s.apply(c.ShareClaim(KEY, "a", tuple(offs), 1), Effects()) == tuple(offs)
    same_after_restore(s)


def test_a_plain_group_still_grants_any_member() -> None:
    s = group("a", "b")
    offs = publish(s, 2)
    assert s.apply(c.ShareClaim(KEY, "b", (offs[0],), 2), Effects()) == (offs[0],)
    assert s.topics.regs[KEY].queue is None  # a plain group keeps no work-queue state


def test_the_next_member_takes_over_from_the_first_unacknowledged_after_the_active_one_ends() -> None:
    s = group("a", "b", "c", single_active=True)
    offs = publish(s, 4)
    s.apply(c.ShareClaim(KEY, "a", tuple(offs[:3]), 1), Effects())
    s.apply(c.AckReport(KEY, (offs[0],)), Effects())
    # a's session ends: its claims come back, then it leaves (as SessionLifecycle.end_session proposes them)
    s.apply(c.ShareReturn(KEY, "a", (), 1), Effects())
    s.apply(c.ShareMember(KEY, "a", False, 1), Effects())
    assert queue_of(s).active == "b"
    reg = s.topics.regs[KEY]
    unclaimed = [o for o in reg.owed if o not in reg.claims]
    assert unclaimed == offs[1:]  # from the first unacknowledged, in order
    assert s.apply(c.ShareClaim(KEY, "c", tuple(unclaimed), 3), Effects()) == ()
    assert s.apply(c.ShareClaim(KEY, "b", tuple(unclaimed), 2), Effects()) == tuple(offs[1:])
    same_after_restore(s)


def test_activate_moves_on_only_from_the_active_member_holding_nothing() -> None:
    s = group("a", "b", single_active=True)
    offs = publish(s, 2)
    s.apply(c.ShareClaim(KEY, "a", (offs[0],), 1), Effects())
    assert s.apply(c.ShareActivate(KEY, "b", "a"), Effects()) is False  # a still holds a claim
    assert s.apply(c.ShareActivate(KEY, "b", "x"), Effects()) is False  # not the active member
    assert s.apply(c.ShareActivate(KEY, "zz", "a"), Effects()) is False  # not a member
    s.apply(c.AckReport(KEY, (offs[0],)), Effects())
    fx = Effects()
    assert s.apply(c.ShareActivate(KEY, "b", "a"), fx) is True
    assert queue_of(s).active == "b" and KEY in fx.owed_regs
    assert s.apply(c.ShareActivate(KEY, "b", "a"), Effects()) is False  # applied twice: once
    assert s.apply(c.ShareClaim(KEY, "a", (offs[1],), 1), Effects()) == ()


def test_a_register_turns_an_existing_group_single_active_for_good() -> None:
    s = group("a", "b")
    s.apply(c.Register(0, KEY, "", 1, "jobs/#", 1, share_group="g", want_retained=False, single_active=True),
            Effects())
    assert queue_of(s).single_active and queue_of(s).active == "a"
    s.apply(c.Register(0, KEY, "", 1, "jobs/#", 1, share_group="g", want_retained=False), Effects())
    assert queue_of(s).single_active


def test_the_last_member_leaving_leaves_no_active_member_and_the_next_join_is_active() -> None:
    s = group("a", single_active=True)
    s.apply(c.ShareMember(KEY, "a", False, 1), Effects())
    assert queue_of(s).active == ""
    s.apply(c.ShareMember(KEY, "b", True, 5), Effects())
    assert queue_of(s).active == "b"


def test_version_4_snapshots_still_restore() -> None:
    s = group("a", "b")
    publish(s, 2)
    snap = s.snapshot()
    old = ShardState.restore(as_version_4(snap), TopicLimits(), 3600)
    assert old.snapshot() == snap


def test_old_log_entries_decode_with_the_defaults() -> None:
    old = c._enc.encode(c.EntryBatch(c.LEGACY_ENTRY_VERSION, [c.ShareClaim(KEY, "a", (1,), 1)]))
    # an entry written before ts_ms existed: the same array one element shorter
    import msgspec

    raw = msgspec.msgpack.decode(old)
    raw[1][0] = raw[1][0][:-1]
    (cmd,) = c.decode_entry(msgspec.msgpack.encode(raw))
    assert isinstance(cmd, c.ShareClaim) and cmd.ts_ms == 0
    raw_reg = msgspec.msgpack.decode(c._enc.encode(c.EntryBatch(c.LEGACY_ENTRY_VERSION, [
        c.Register(0, KEY, "", 1, "jobs/#", 1, share_group="g")])))
    raw_reg[1][0] = raw_reg[1][0][:-3]
    (reg,) = c.decode_entry(msgspec.msgpack.encode(raw_reg))
    assert isinstance(reg, c.Register) and not reg.single_active and reg.max_deliveries == 0


def test_no_claim_and_no_handover_while_an_ended_incarnation_still_holds_claims() -> None:
    """a's first session holds a claim when a's next session (which joined in its place) leaves:
    the leave makes b active at once, but b is granted nothing, and no ShareActivate moves the
    group on, until the old incarnation's claim comes back (the leader's follow-ups return it):
    one holder at a time (sim --cluster seed 148: sa2 claimed while sa3's ended incarnation held)."""
    s = group("a", "b", "c", single_active=True)
    offs = publish(s, 3)
    assert s.apply(c.ShareClaim(KEY, "a", (offs[0],), 1), Effects()) == (offs[0],)
    s.apply(c.ShareMember(KEY, "a", True, 7), Effects())  # a reconnected: its new session joined
    s.apply(c.ShareMember(KEY, "a", False, 7), Effects())  # ... and ended cleanly
    assert queue_of(s).active == "b"
    assert s.topics.regs[KEY].claims == {offs[0]: ("a", 1)}
    assert s.apply(c.ShareClaim(KEY, "b", (offs[1],), 2), Effects()) == ()
    assert s.apply(c.ShareActivate(KEY, "c", "b"), Effects()) is False
    s.apply(c.ShareReturn(KEY, "a", (), 1), Effects())  # the follow-ups return the ended claims
    assert s.apply(c.ShareClaim(KEY, "b", (offs[0], offs[1]), 2), Effects()) == (offs[0], offs[1])
    same_after_restore(s)
