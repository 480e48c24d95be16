"""Wills owed (docs/verification.md, "Wills"): the simulator's checkers report a due will that a
durable subscription was owed and never got (``will_lost``, reported, not failing)."""

from __future__ import annotations

from typing import Any

from moorline.sim.cluster.checkers import analyze_history, check_history

W1 = "e" * 32


class H:
    def __init__(self, run: str) -> None:
        self.run, self.rows, self.t = run, [], 1_000_000_000

    def ev(self, type: str, op: str, session: str, **kw: Any) -> H:
        self.t += 1_000_000
        self.rows.append({"run": self.run, "index": len(self.rows), "type": type, "op": op, "session": session,
                          "process": session, "mono_ns": self.t, **kw})
        return self


def history(run: str, *, end: str = "abrupt", delivered: bool = False, granted: int = 1) -> list[dict[str, Any]]:
    h = H(run)
    h.ev("invoke", "connect", "s1", clean_start=False, session_expiry=600)
    h.ev("ok", "connect", "s1", session_present=False)
    h.ev("ok", "subscribe", "s1", filter="w/#", qos=granted)
    h.ev("invoke", "connect", "will1", clean_start=True)
    h.ev("invoke", "publish", "will1", guid=W1, topic="w/will1", qos=1, detail="will")
    h.ev("ok", "connect", "will1", session_present=False)
    if end == "abrupt":
        h.ev("info", "disconnect", "will1", reason="ended without DISCONNECT: will due")
    elif end == "lost":
        h.ev("info", "disconnect", "will1", reason="connection lost")
    else:
        h.ev("ok", "disconnect", "will1")
    if delivered:
        h.ev("ok", "deliver", "s1", guid=W1, topic="w/will1", qos=1, packet_id=1)
        h.ev("ok", "ack", "s1", guid=W1, qos=1, packet_id=1)
    h.ev("ok", "disconnect", "s1")
    return h.rows


def _wills_lost(rows: list[dict[str, Any]]) -> set[tuple[str | None, str | None]]:
    return {(v.guid, v.subscriber) for v in analyze_history(rows).violations if v.kind == "will_lost"}


def test_a_due_will_never_delivered_is_reported_not_failed() -> None:
    rows = history("due")
    assert _wills_lost(rows) == {(W1, "s1#1")}
    assert check_history(rows) == []  # reported only: the history does not record node crashes
    assert analyze_history(rows).counts["wills_due"] == 1


def test_no_will_owed_when_delivered_discarded_unknown_or_at_qos0() -> None:
    assert _wills_lost(history("delivered", delivered=True)) == set()
    assert _wills_lost(history("clean", end="clean")) == set()  # DISCONNECT: never published
    assert _wills_lost(history("lost", end="lost")) == set()  # the client cannot tell who ended it
    assert _wills_lost(history("qos0", granted=0)) == set()
