"""Wills owed (docs/verification.md, "Wills"): the simulator's checkers report a due will that a
durable subscription was owed and never got (``will_lost``, reported), and fail it
(``will_not_published``) where nothing excuses it."""

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


def simulator_history(run: str, *, end: str, crash_at_s: float, end_after_s: float,
                      healed_at_s: float | None = None) -> list[dict[str, Any]]:
    """A simulator's history (fault records present): ``will1``'s connection ends as ``end`` says
    while its node crashes ``crash_at_s`` after that; the history goes on ``end_after_s``."""
    rows = [r for r in history(run, end=end) if not (r["session"] == "s1" and r["op"] == "disconnect")]
    t_end = rows[-1]["mono_ns"]

    def fault(at_ns: int, reason: str) -> dict[str, Any]:
        return {"run": run, "index": 0, "type": "fault", "op": "fault", "process": "harness", "node": "n1",
                "reason": reason, "mono_ns": at_ns}

    rows.append(fault(t_end + int(crash_at_s * 1e9), "crash"))
    if healed_at_s is not None:
        rows.append(fault(t_end + int(healed_at_s * 1e9), "healed"))
    rows.append({"run": run, "index": 0, "type": "ok", "op": "disconnect", "session": "s1", "process": "s1",
                 "mono_ns": t_end + int(end_after_s * 1e9)})
    for i, r in enumerate(rows):
        r["index"] = i
    return rows


def _kinds(rows: list[dict[str, Any]]) -> set[str]:
    return {v.kind for v in analyze_history(rows).violations}


def test_in_a_simulator_history_a_lost_connection_owes_its_will_once_there_was_time() -> None:
    # The connection was lost (its node crashed, say): no DISCONNECT was processed, so the will is
    # owed; the session shard's leader publishes it once the owner's lease ran out, whatever node
    # leads it, so with the faults healed long before the end nothing excuses it.
    rows = simulator_history("lost-late", end="lost", crash_at_s=0.001, healed_at_s=2.0, end_after_s=30.0)
    assert _kinds(rows) == {"will_not_published"}
    assert "will_not_published" in {v.kind for v in check_history(rows)}
    # Near the end, before the lease could have run out: reported, not failed.
    rows = simulator_history("lost-near-end", end="lost", crash_at_s=0.001, healed_at_s=2.0, end_after_s=5.0)
    assert _kinds(rows) == {"will_lost"}
    assert check_history(rows) == []


def test_in_a_simulator_history_an_abrupt_end_beside_a_crash_owes_its_will_too() -> None:
    # Formerly excused (a crash 1 ms after the end): a will whose node dies before its close
    # committed is published from the lease lapse, so only a history ending too soon excuses it.
    rows = simulator_history("abrupt", end="abrupt", crash_at_s=0.001, healed_at_s=3.0, end_after_s=25.0)
    assert _kinds(rows) == {"will_not_published"}
    rows = simulator_history("abrupt-soon", end="abrupt", crash_at_s=0.001, healed_at_s=3.0, end_after_s=10.0)
    assert _kinds(rows) == {"will_lost"}
    # Delivered: nothing owed.
    rows = simulator_history("delivered", end="abrupt", crash_at_s=0.001, healed_at_s=3.0, end_after_s=25.0)
    rows.insert(-1, {"run": "delivered", "index": 0, "type": "ok", "op": "deliver", "session": "s1", "process": "s1",
                     "guid": W1, "topic": "w/will1", "qos": 1, "packet_id": 1, "mono_ns": rows[-2]["mono_ns"] + 1})
    for i, r in enumerate(rows):
        r["index"] = i
    assert "will_not_published" not in _kinds(rows) and "will_lost" not in _kinds(rows)
