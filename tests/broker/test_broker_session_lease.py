"""Owner leases in the session shard (DESIGN promise 5): a takeover by another node waits for the
previous owner's lease (until released or run out); renewals extend only the current owner's."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.session_state import SessionState

LEASE = 10_000


def _open(s: SessionState, ts: int, node: int, lease: int = LEASE):  # type: ignore[no-untyped-def]
    return s.apply_open(c.SessionOpen(ts, "cid", False, 600, None, "", False, node, lease), Effects())


def test_takeover_from_another_node_waits_for_its_lease_unless_released() -> None:
    s = SessionState(3600)
    first = _open(s, 1_000, node=1)
    assert first.wait_until_ms == 0
    assert s.apply_renew(c.SessionRenew(4_000, 1, LEASE, (("cid", first.epoch),)), Effects()) == (("cid", first.epoch),)
    assert s.sessions["cid"].lease_until_ms == 14_000
    second = _open(s, 5_000, node=2)
    assert second.wait_until_ms == 14_000 and second.ts_ms == 5_000  # node 1's lease still runs
    assert s.sessions["cid"].prev_lease == (1, first.epoch, 14_000)
    # A stale renewal of the old owner changes nothing now.
    assert s.apply_renew(c.SessionRenew(6_000, 1, LEASE, (("cid", first.epoch),)), Effects()) == ()
    assert s.sessions["cid"].lease_until_ms == 15_000 and s.sessions["cid"].owner_node == 2
    # Node 1 stopped serving and says so: the wait ends early.
    assert not s.apply_release(c.LeaseRelease("cid", second.epoch, 1), Effects())  # wrong epoch
    assert s.apply_release(c.LeaseRelease("cid", first.epoch, 1), Effects())
    assert s.sessions["cid"].prev_lease is None


def test_no_wait_for_the_same_node_an_expired_lease_or_a_closed_session() -> None:
    s = SessionState(3600)
    a = _open(s, 1_000, node=1)
    assert _open(s, 2_000, node=1).wait_until_ms == 0  # a takeover on the same node (it closes the old)
    b = _open(s, 20_000, node=2)  # node 1's lease ran out at 12,000
    assert b.wait_until_ms == 0 and a.epoch != b.epoch
    s.apply_close(c.SessionClose(21_000, "cid", b.epoch, False), Effects())
    assert _open(s, 22_000, node=3).wait_until_ms == 0  # released by the close
    legacy = s.apply_open(c.SessionOpen(23_000, "cid", False, 600, None, ""), Effects())
    assert legacy.wait_until_ms == 0  # entries from before leases: no owner, no wait
