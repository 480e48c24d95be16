"""SessionOpen with owner_only: another principal's live session is refused at apply, changing nothing."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.session_state import SessionState


def _open(s: SessionState, ts: int, principal: str, clean: bool = False, owner_only: bool = True,
          expiry: int = 600) -> object:
    return s.apply_open(c.SessionOpen(ts, "cid", clean, expiry, None, principal, owner_only), Effects())


def test_other_principal_refused_and_nothing_changes() -> None:
    s = SessionState(max_expiry_s=3600)
    first = _open(s, 1000, "alice")
    before = (s.epochs, s.incarnations, s.sessions["cid"].epoch, s.sessions["cid"].principal)
    for clean in (False, True):
        r = _open(s, 2000, "mallory", clean=clean)
        assert r.refused  # type: ignore[attr-defined]
    assert (s.epochs, s.incarnations, s.sessions["cid"].epoch, s.sessions["cid"].principal) == before
    again = _open(s, 3000, "alice")
    assert not again.refused and again.session_present  # type: ignore[attr-defined]
    assert again.incarnation == first.incarnation  # type: ignore[attr-defined]


def test_expired_session_can_be_claimed_and_legacy_entries_replay_unchecked() -> None:
    s = SessionState(max_expiry_s=3600)
    _open(s, 1000, "alice", expiry=1)
    s.apply_close(c.SessionClose(1500, "cid", s.sessions["cid"].epoch, False), Effects())
    assert _open(s, 1600, "mallory").refused  # type: ignore[attr-defined]
    r = _open(s, 2600, "mallory")  # expired one second after the close
    assert not r.refused and not r.session_present  # type: ignore[attr-defined]
    # An entry written before owners existed decodes with owner_only False and applies as it did then.
    legacy = c.SessionOpen(3000, "cid", False, 600, None, "alice")
    assert legacy.owner_only is False
    assert not s.apply_open(legacy, Effects()).refused
