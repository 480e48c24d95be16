"""The shard state machine (pure): offsets, owed, retention, de-dup, sessions, snapshots."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.messages import StoredMessage
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits


def msg(topic: str, payload: bytes = b"x", guid: bytes | None = None, ts: int = 1000, qos: int = 1,
        retain: bool = False, expiry: int | None = None, origin: str = "pub") -> StoredMessage:
    return StoredMessage(topic, payload, qos, retain, guid or random.randbytes(16), ts, expiry, None, origin)


def new_shard(**kw: int) -> ShardState:
    return ShardState(0, "inc0", TopicLimits(**kw), 3600)


def reg(key: str, flt: str, client: str = "c1", inc: int = 1, **kw: object) -> c.Register:
    return c.Register(0, key, client, inc, flt, 1, **kw)  # type: ignore[arg-type]


def test_offsets_are_dense_and_duplicates_take_none() -> None:
    s, fx = new_shard(), Effects()
    g = bytes(16)
    r1 = s.apply(c.Publish(msg("a", guid=g)), fx)
    r2 = s.apply(c.Publish(msg("b")), fx)
    r3 = s.apply(c.Publish(msg("a", guid=g)), fx)
    assert (r1.status, r1.offset) == ("ok", 0)
    assert (r2.status, r2.offset) == ("ok", 1)
    assert (r3.status, r3.offset) == ("duplicate", 0)
    assert s.topics.next_offset == 2
    assert [o for o, _, _ in fx.appends] == [0, 1]


def test_guid_reused_with_other_content_is_refused() -> None:
    s, fx = new_shard(), Effects()
    g = bytes(range(16))
    assert s.apply(c.Publish(msg("a", b"one", guid=g)), fx).status == "ok"
    r = s.apply(c.Publish(msg("a", b"two", guid=g)), fx)
    assert r.status == "refused" and r.reason_code == 0x99


def test_sequenced_producer_dedup() -> None:
    s, fx = new_shard(), Effects()
    p = b"P" * 8
    assert s.apply(c.Publish(msg("t"), producer=p, seq=1), fx).status == "ok"
    assert s.apply(c.Publish(msg("t"), producer=p, seq=2), fx).status == "ok"
    assert s.apply(c.Publish(msg("t"), producer=p, seq=2), fx).status == "duplicate"
    assert s.apply(c.Publish(msg("t"), producer=p, seq=1), fx).status == "duplicate"
    gap = s.apply(c.Publish(msg("t"), producer=p, seq=10), fx)
    assert gap.status == "refused"  # 3..9 missing: retriable, never applied
    assert s.apply(c.Publish(msg("t"), producer=p, seq=3), fx).status == "ok"
    assert s.apply(c.Publish(msg("t"), producer=p, seq=1 << 32), fx).status == "ok"  # a later batch
    assert s.apply(c.Publish(msg("t"), producer=p, seq=(2 << 32) + 5), fx).status == "refused"


def test_owed_is_decided_at_apply() -> None:
    s, fx = new_shard(), Effects()
    s.apply(c.Publish(msg("a/b")), fx)  # before the registration: not owed
    s.apply(reg("c1\0a/+", "a/+"), fx)
    s.apply(c.Publish(msg("a/b")), fx)
    s.apply(c.Publish(msg("x/y")), fx)  # does not match
    r = s.topics.regs["c1\0a/+"]
    assert list(r.owed) == [1]
    assert s.topics.owed_count == {1: 1}


def test_no_local_is_excluded_at_apply() -> None:
    s, fx = new_shard(), Effects()
    s.apply(reg("c1\0t", "t", no_local=True), fx)
    s.apply(c.Publish(msg("t", origin="c1")), fx)
    s.apply(c.Publish(msg("t", origin="other")), fx)
    assert list(s.topics.regs["c1\0t"].owed) == [1]


def test_retained_returned_by_register_and_cleared_by_empty_payload() -> None:
    s, fx = new_shard(), Effects()
    s.apply(c.Publish(msg("r/1", b"v1", retain=True)), fx)
    s.apply(c.Publish(msg("r/2", b"v2", retain=True)), fx)
    res = s.apply(reg("c1\0r/#", "r/#"), fx)
    assert [m.payload for m in res.retained] == [b"v1", b"v2"]
    s.apply(c.Publish(msg("r/1", b"", retain=True)), fx)
    res = s.apply(reg("c2\0r/#", "r/#", client="c2"), fx)
    assert [m.payload for m in res.retained] == [b"v2"]
    res = s.apply(reg("c3\0$x", "#", client="c3"), fx)
    assert res.retained[0].topic == "r/2"


def test_release_waits_for_ack_and_min_age() -> None:
    s, fx = new_shard(retention_min_age_ms=1000), Effects()
    s.apply(reg("c1\0t", "t"), fx)
    for _i in range(3):
        s.apply(c.Publish(msg("t", ts=0)), fx)
    fx.clear()
    s.apply(c.Housekeeping(5000, -1), fx)
    assert fx.releases == []  # all owed
    s.apply(c.AckReport("c1\0t", (0, 1)), fx)
    s.apply(c.AckReport("c1\0t", (0, 1)), fx)  # idempotent
    s.apply(c.Housekeeping(5000, -1), fx)
    assert fx.releases == [0, 1]
    assert s.topics.low_water == 2  # 0 and 1 gone, everything from 2 present
    s.apply(c.AckReport("c1\0t", (2,)), fx)
    fx.clear()
    s.apply(c.Housekeeping(5000, -1), fx)
    assert fx.releases == [2]
    assert s.topics.low_water == 3


def test_young_messages_are_kept_even_when_nobody_is_owed() -> None:
    s, fx = new_shard(retention_min_age_ms=10_000), Effects()
    s.apply(c.Publish(msg("t", ts=0)), fx)
    s.apply(c.Housekeeping(5_000, -1), fx)
    assert 0 in s.topics.meta
    s.apply(c.Housekeeping(10_000, -1), fx)
    assert 0 not in s.topics.meta


def test_pins_hold_retention() -> None:
    s, fx = new_shard(retention_min_age_ms=0), Effects()
    for _ in range(4):
        s.apply(c.Publish(msg("t", ts=0)), fx)
    s.apply(c.Housekeeping(1, 2), fx)
    assert sorted(s.topics.meta) == [2, 3]


def test_message_expiry_drops_owed_and_counts() -> None:
    s, fx = new_shard(retention_min_age_ms=3_600_000), Effects()
    s.apply(reg("c1\0t", "t"), fx)
    g = bytes([7]) * 16
    s.apply(c.Publish(msg("t", guid=g, ts=0, expiry=1)), fx)
    s.apply(c.Housekeeping(500, -1), fx)
    assert list(s.topics.regs["c1\0t"].owed) == [0]
    s.apply(c.Housekeeping(1000, -1), fx)
    assert list(s.topics.regs["c1\0t"].owed) == []
    assert [(d.guid, d.reason) for d in s.topics.drops] == [(g, "message_expiry")]


def test_unsubscribe_drains_in_flight_then_forgets() -> None:
    s, fx = new_shard(), Effects()
    s.apply(reg("c1\0t", "t"), fx)
    s.apply(c.Publish(msg("t")), fx)
    s.apply(c.Unregister("c1\0t", 1, "unsubscribe"), fx)
    s.apply(c.Publish(msg("t")), fx)  # no longer owed
    assert list(s.topics.regs["c1\0t"].owed) == [0]
    s.apply(c.AckReport("c1\0t", (0,)), fx)
    assert "c1\0t" not in s.topics.regs


def test_session_end_drops_owed_with_reason() -> None:
    s, fx = new_shard(), Effects()
    s.apply(reg("c1\0t", "t"), fx)
    s.apply(c.Publish(msg("t")), fx)
    s.apply(c.Unregister("c1\0t", 1, "session_expired"), fx)
    assert "c1\0t" not in s.topics.regs
    assert s.topics.drop_counts == {"session_expired": 1}
    assert s.topics.owed_count == {}


def test_stale_registration_incarnation_is_ignored() -> None:
    s, fx = new_shard(), Effects()
    s.apply(reg("c1\0t", "t", inc=2), fx)
    assert s.apply(c.Unregister("c1\0t", 1, "session_expired"), fx) is False
    assert "c1\0t" in s.topics.regs


def test_share_claims_and_return_drop_qos2() -> None:
    s, fx = new_shard(), Effects()
    key = "$share\0g\0t"
    s.apply(c.Register(0, key, "", 1, "t", 2, share_group="g", want_retained=False), fx)
    s.apply(c.ShareMember(key, "m1", True, 1), fx)
    s.apply(c.ShareMember(key, "m2", True, 2), fx)
    for _ in range(4):
        s.apply(c.Publish(msg("t", qos=2)), fx)
    assert s.apply(c.ShareClaim(key, "m1", (0, 1, 2), 1), fx) == (0, 1, 2)
    assert s.apply(c.ShareClaim(key, "m2", (2, 3), 2), fx) == (3,)  # 2 already claimed
    s.apply(c.ShareReturn(key, "m1", (1,), 1), fx)  # m1 gone: 1 was an unreceived QoS 2
    r = s.topics.regs[key]
    assert r.claims == {3: ("m2", 2)}
    assert list(r.owed) == [0, 2, 3]
    assert s.topics.drop_counts == {"share_qos2_member_gone": 1}


def test_share_claims_belong_to_the_incarnation_that_joined() -> None:
    """A client id's ended session (incarnation 1) and its new one (3) are different members: the
    old one's claims, return and leave, applied after the new one joined, never touch the new one's."""
    s, fx = new_shard(), Effects()
    key = "$share\0g\0t"
    s.apply(c.Register(0, key, "", 1, "t", 2, share_group="g", want_retained=False), fx)
    s.apply(c.ShareMember(key, "m1", True, 1), fx)
    for _ in range(3):
        s.apply(c.Publish(msg("t", qos=2)), fx)
    assert s.apply(c.ShareClaim(key, "m1", (0,), 1), fx) == (0,)
    s.apply(c.ShareMember(key, "m1", True, 3), fx)  # m1 reconnected as a new session and joined
    r = s.topics.regs[key]
    assert r.members == {"m1": 3} and r.claims == {0: ("m1", 1)}  # the claim stays the old session's
    assert s.apply(c.ShareClaim(key, "m1", (1,), 1), fx) == ()  # not the member any more
    assert s.apply(c.ShareClaim(key, "m1", (1,), 3), fx) == (1,)
    s.apply(c.ShareMember(key, "m1", True, 1), fx)  # a late join of the old session: no change
    assert r.members == {"m1": 3}
    # The old session's end applies late: its unreceived QoS 2 claim is dropped, the new one's kept.
    s.apply(c.ShareReturn(key, "m1", (0, 1), 1), fx)
    s.apply(c.ShareMember(key, "m1", False, 1), fx)
    assert r.members == {"m1": 3} and r.claims == {1: ("m1", 3)}
    assert list(r.owed) == [1, 2] and s.topics.drop_counts == {"share_qos2_member_gone": 1}
    s.apply(c.ShareReturn(key, "m1", (), 3), fx)  # the new session ends: its claim goes back
    s.apply(c.ShareMember(key, "m1", False, 3), fx)
    assert r.members == {} and r.claims == {} and list(r.owed) == [1, 2]


def test_version_2_snapshot_share_state_matches_any_incarnation() -> None:
    """Members and claims from before incarnations were recorded are kept, as LEGACY_INC."""
    s, fx = new_shard(), Effects()
    key = "$share\0g\0t"
    s.apply(c.Register(0, key, "", 1, "t", 2, share_group="g", want_retained=False), fx)
    s.apply(c.ShareMember(key, "m1", True, 4), fx)
    s.apply(c.Publish(msg("t", qos=2)), fx)
    s.apply(c.ShareClaim(key, "m1", (0,), 4), fx)
    raw = msgspec.msgpack.decode(s.snapshot())
    for r in raw["regs"]:  # the version-2 shapes: members a list, claims offset -> client id
        r["members"] = list(r["members"])
        r["claims"] = {o: m for o, (m, _inc) in r["claims"].items()}
    raw["version"] = 2
    old = ShardState.restore(msgspec.msgpack.encode(raw), TopicLimits(), 3600)
    reg = old.topics.regs[key]
    assert reg.members == {"m1": c.LEGACY_INC} and reg.claims == {0: ("m1", c.LEGACY_INC)}
    old.apply(c.ShareReturn(key, "m1", (), 7), fx)  # any incarnation's return takes a legacy claim
    assert reg.claims == {}
    assert ShardState.restore(old.snapshot(), TopicLimits(), 3600).snapshot() == old.snapshot()


def test_shard_cap_refuses_before_the_limit() -> None:
    s, fx = new_shard(shard_max_bytes=1000, reserved_headroom_bytes=200), Effects()
    results = [s.apply(c.Publish(msg("t", b"x" * 100)), fx).status for _ in range(10)]
    assert "refused" in results
    assert s.topics.bytes_used <= 800


def test_sessions_epochs_and_stale_commands() -> None:
    s, fx = new_shard(), Effects()
    r = s.apply(c.SessionOpen(0, "c1", False, 100, None), fx)
    assert (r.session_present, r.epoch) == (False, 1)
    r2 = s.apply(c.SessionOpen(1, "c1", False, 100, None), fx)
    assert (r2.session_present, r2.epoch) == (True, 2)
    assert s.apply(c.SessionSubscribe("c1", 1, "t", 1, False, False, 0, None), fx) is None  # stale epoch
    assert s.apply(c.SessionSubscribe("c1", 2, "t", 1, False, False, 0, None), fx) == (False, 1)
    r3 = s.apply(c.SessionOpen(2, "c1", True, 100, None), fx)  # clean start ends the old session
    assert r3.session_present is False and r3.ended is not None and "t" in r3.ended.subs
    assert r3.epoch == 3  # never reused, even by a new incarnation: the old owner stays stale
    assert s.apply(c.SessionClose(3, "c1", 1, False), fx) is None
    assert "c1" in s.sessions.sessions


def test_delivery_log_and_acks() -> None:
    s, fx = new_shard(), Effects()
    s.apply(c.SessionOpen(0, "c1", False, 100, None), fx)
    items = tuple(c.DeliveryItem(3, o, 2 if o == 11 else 1, False, (), ("c1\0t",)) for o in (10, 11))
    assert s.apply(c.Deliver("c1", 1, 0, items), fx) is True
    before = s.snapshot()
    # A batch that does not continue the log (one before it never committed) is refused, the
    # same on every replica, and changes nothing: the shard keeps serving.
    assert s.apply(c.Deliver("c1", 1, 5, items), fx) is False
    assert s.snapshot() == before
    sess = s.sessions.sessions["c1"]
    assert list(sess.inflight) == [0, 1] and sess.last_delivered == {3: 11}
    assert s.apply(c.SessionAcks("c1", 1, ((1, 2),)), fx) == []  # PUBREC: not finished yet
    assert sess.inflight[1].state == 1
    done = s.apply(c.SessionAcks("c1", 1, ((0, 1), (1, 1))), fx)
    assert [d.offset for d in done] == [10, 11] and sess.inflight == {}


def test_inbound_qos2_guid_is_kept_until_release() -> None:
    s, fx = new_shard(), Effects()
    s.apply(c.SessionOpen(0, "c1", False, 100, None), fx)
    g1, g2 = b"1" * 16, b"2" * 16
    assert s.apply(c.InboundQos2("c1", 1, 7, g1), fx) == g1
    assert s.apply(c.InboundQos2("c1", 1, 7, g2), fx) == g1  # a resend keeps the first GUID
    assert s.apply(c.InboundRelease("c1", 1, 7), fx) is True
    assert s.apply(c.InboundRelease("c1", 1, 7), fx) is False


def test_will_fires_after_delay_and_session_expires() -> None:
    s, fx = new_shard(), Effects()
    will = c.WillSpec("w", b"bye", 1, False, delay_s=5)
    s.apply(c.SessionOpen(0, "c1", False, 10, will), fx)
    s.apply(c.SessionClose(1000, "c1", 1, True), fx)
    wills, ended = s.apply(c.SessionHousekeeping(3000), fx)
    assert wills == [] and ended == []
    wills, ended = s.apply(c.SessionHousekeeping(6000), fx)
    assert [w.topic for _, w in wills] == ["w"] and ended == []
    wills, ended = s.apply(c.SessionHousekeeping(11_000), fx)
    assert wills == [] and [e.client_id for e in ended] == ["c1"]


def test_reconnect_within_will_delay_cancels_will() -> None:
    s, fx = new_shard(), Effects()
    s.apply(c.SessionOpen(0, "c1", False, 100, c.WillSpec("w", b"", 0, False, delay_s=5)), fx)
    s.apply(c.SessionClose(1000, "c1", 1, True), fx)
    s.apply(c.SessionOpen(2000, "c1", False, 100, None), fx)
    wills, _ = s.apply(c.SessionHousekeeping(10_000), fx)
    assert wills == []


def _random_commands(rng: random.Random, n: int) -> list[c.Command]:
    cmds: list[c.Command] = [c.SessionOpen(0, "c1", False, 100, None)]
    topics = ["a", "a/b", "b/c", "r"]
    for i in range(n):
        k = rng.random()
        if k < 0.5:
            cmds.append(c.Publish(msg(rng.choice(topics), rng.randbytes(4), guid=rng.randbytes(16), ts=i,
                                      retain=rng.random() < 0.2)))
        elif k < 0.6:
            flt = rng.choice(["#", "a/+", "b/#", "r"])
            cmds.append(reg(f"c1\0{flt}", flt))
        elif k < 0.8:
            cmds.append(c.AckReport(rng.choice(["c1\0#", "c1\0a/+"]), tuple(rng.sample(range(i + 3), 3))))
        else:
            cmds.append(c.Housekeeping(i, -1))
    return cmds


@pytest.mark.parametrize("seed", range(5))
def test_replicas_agree_byte_for_byte_and_snapshots_round_trip(seed: int) -> None:
    cmds = _random_commands(random.Random(seed), 300)
    a, b = new_shard(retention_min_age_ms=10), new_shard(retention_min_age_ms=10)
    for cmd in cmds:
        a.apply(cmd, Effects())
        b.apply(cmd, Effects())
    snap = a.snapshot()
    assert snap == b.snapshot()
    restored = ShardState.restore(snap, TopicLimits(retention_min_age_ms=10), 3600)
    assert restored.snapshot() == snap
    # The restored replica keeps applying identically.
    more = _random_commands(random.Random(seed + 100), 100)[1:]
    for cmd in more:
        a.apply(cmd, Effects())
        restored.apply(cmd, Effects())
    assert a.snapshot() == restored.snapshot()


def test_entries_round_trip() -> None:
    cmds: list[c.Command] = [c.Publish(msg("t")), c.AckReport("k", (1, 2)), c.Housekeeping(5, -1)]
    assert c.decode_entry(c.encode_entry(cmds)) == cmds


_GUIDS = [bytes([i]) * 16 for i in range(4)]


@st.composite
def _publish_runs(draw: st.DrawFn) -> list[c.Publish]:
    """Publishes that collide: few GUIDs (same or other content), two principals, a sequenced
    producer with repeats and gaps, retained set and cleared, expiry, several topics."""
    cmds: list[c.Publish] = []
    for i in range(draw(st.integers(1, 40))):
        guid = draw(st.sampled_from([*_GUIDS, None]))
        topic = draw(st.sampled_from(["a", "a/b", "z"]))
        payload = draw(st.sampled_from([b"", b"one", b"two"]))
        retain = draw(st.booleans())
        expiry = draw(st.sampled_from([None, 5]))
        m = StoredMessage(topic, payload, draw(st.integers(0, 2)), retain, guid or (16 + i).to_bytes(16, "big"),
                          1000 + i, expiry, None, draw(st.sampled_from(["pub", "c1"])))
        principal = draw(st.sampled_from(["", "alice"]))
        if draw(st.booleans()):
            cmds.append(c.Publish(m, principal, b"producer", draw(st.integers(0, 12))))
        else:
            cmds.append(c.Publish(m, principal))
    return cmds


@settings(max_examples=200, deadline=None)
@given(_publish_runs(), st.integers(1, 8), st.sampled_from([1 << 30, 16 << 20 | 700]))
def test_a_run_of_publishes_applies_exactly_as_one_at_a_time(cmds: list[c.Publish], cut: int, max_bytes: int) -> None:
    # The host applies a log entry's consecutive PUBLISHes with one apply_publishes call: results,
    # effects and the snapshot must be those of apply() per command. max_bytes leaves room for a
    # few messages only, so "shard is full" happens inside runs too.
    limits = {"shard_max_bytes": max_bytes, "retention_min_age_ms": 10}
    one, run = new_shard(**limits), new_shard(**limits)
    for s in (one, run):
        s.apply(reg("c1\0a/+", "a/+", no_local=True), Effects())
        s.apply(reg("c2\0#", "#", client="c2"), Effects())
    fx_one, fx_run = Effects(), Effects()
    expected = [one.apply(cmd, fx_one) for cmd in cmds]
    got = []
    for start in range(0, len(cmds), cut):
        got += run.apply_publishes(cmds[start:start + cut], fx_run)
    assert got == expected
    assert fx_run.appends == fx_one.appends
    assert fx_run.owed_new == fx_one.owed_new and fx_run.owed_regs == fx_one.owed_regs
    assert run.snapshot() == one.snapshot()
