"""The will of the connection a CONNECT replaces (session_state._replaced_will): due at once when the
session ends (clean start, expiry 0) whatever its delay, or when its delay is 0 or already over;
cancelled by a resume within the delay (MQTT 5 §3.1.2.5, §3.1.3.2.2, MQTT-3.1.3-9). The open that
takes it is the only one to get it: no close or housekeeping publishes it again."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.session_state import LEASE_LAPSE_GRACE_MS, OpenResult, SessionState

LEASE = 10_000


def _will(delay_s: int) -> c.WillSpec:
    return c.WillSpec("w/cid", b"gone", 1, False, delay_s)


def _open(s: SessionState, ts: int, node: int, clean: bool, expiry: int = 600,
          will: c.WillSpec | None = None) -> OpenResult:
    return s.apply_open(c.SessionOpen(ts, "cid", clean, expiry, will, "", False, node, LEASE), Effects())


def test_clean_start_takes_a_connected_sessions_will_whatever_its_delay() -> None:
    for other_node in (1, 2):  # the same node (no close applied), a remote owner (alive or dead)
        s = SessionState(3600)
        first = _open(s, 1_000, 1, False, will=_will(300))
        res = _open(s, 2_000, other_node, True)
        assert res.replaced_will == (first.incarnation, first.epoch, _will(300))
        assert res.ended is not None
        assert s.apply_housekeeping(c.SessionHousekeeping(400_000), Effects()) == ([], [])


def test_resume_takes_an_undelayed_will_and_cancels_a_delayed_one() -> None:
    s = SessionState(3600)
    first = _open(s, 1_000, 1, False, will=_will(0))
    res = _open(s, 2_000, 2, False, will=_will(5))
    assert res.session_present and res.replaced_will == (first.incarnation, first.epoch, _will(0))
    res = _open(s, 3_000, 1, False)  # the previous connection's will had a 5 s delay: cancelled
    assert res.session_present and res.replaced_will is None
    assert s.apply_housekeeping(c.SessionHousekeeping(60_000), Effects()) == ([], [])


def test_expiry_0_session_ends_with_its_connection_so_its_will_is_due() -> None:
    s = SessionState(3600)
    _open(s, 1_000, 1, False, expiry=0, will=_will(30))
    res = _open(s, 2_000, 2, False)
    assert not res.session_present and res.replaced_will is not None and res.replaced_will[2] == _will(30)


def test_dead_owners_lapsed_connection_counts_from_its_lease_end() -> None:
    s = SessionState(3600)
    _open(s, 1_000, 1, False, will=_will(5))  # lease until 11,000; owner dead, nobody ran housekeeping
    late = 11_000 + LEASE_LAPSE_GRACE_MS + 5_000  # delay over, counted from the lease's end
    assert _open(s, late, 2, False).replaced_will is not None
    s = SessionState(3600)
    _open(s, 1_000, 1, False, will=_will(60))
    assert _open(s, late, 2, False).replaced_will is None  # resumed within its delay


def test_pending_delayed_will_after_a_close() -> None:
    s = SessionState(3600)
    first = _open(s, 1_000, 1, False, will=_will(10))
    s.apply_close(c.SessionClose(2_000, "cid", first.epoch, True), Effects())  # due at 12,000
    assert _open(s, 3_000, 1, True).replaced_will is not None  # the clean start ends the session
    s = SessionState(3600)
    first = _open(s, 1_000, 1, False, will=_will(10))
    s.apply_close(c.SessionClose(2_000, "cid", first.epoch, True), Effects())
    assert _open(s, 12_500, 1, False).replaced_will is not None  # past due, housekeeping not run yet
    s = SessionState(3600)
    first = _open(s, 1_000, 1, False, will=_will(10))
    s.apply_close(c.SessionClose(2_000, "cid", first.epoch, False), Effects())  # clean DISCONNECT
    assert _open(s, 3_000, 1, True).replaced_will is None
