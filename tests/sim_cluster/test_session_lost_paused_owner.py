"""session_lost (moorline/sim/cluster/checkers.py) and a connection whose node was paused while
serving it: the node renews no lease while paused, so the session shard's leader may end the
connection at the lease's end (lost without DISCONNECT) and expire the session from then, while the
client, which cannot tell a paused server from a slow one, sees the connection open until the node
resumes and closes it. That end is not before the pause began, and the checker counts from there.

Default-mix seed 30762 as it ran at f451631: sh3 (session expiry 2 s) got CONNACK from n3 at 7.45 s,
n3 was paused at 7.7 s for 13.2 s (past its 10 s lease plus the 1 s grace plus the expiry), and on
resuming closed the connection (DISCONNECT 0x80, lease lost) at 20.86 s; the reconnect to n1 at
21.80 s was answered session present 0, flagged as "0.935 s away". The session had ended at the
lease's end, 17.5 s. A CONNACK sent after such a pause (seeds 30456, 30575: a node bug, fixed in
lifecycle.open_session) is still flagged: the pause began before that connection was served."""

from __future__ import annotations

from typing import Any

from moorline.sim.cluster.checkers import analyze_history

S = 1_000_000_000


def _history(pause_at: float, resume_at: float, paused_node: str = "n3", connack_at: float = 7.45,
             end_at: float = 20.86) -> list[dict[str, Any]]:
    rows: list[tuple[float, dict[str, Any]]] = [
        (7.39, {"op": "connect", "type": "invoke", "node": "n3", "clean_start": True, "session_expiry": 2}),
        (connack_at, {"op": "connect", "type": "ok", "node": "n3", "session_present": False}),
        (pause_at, {"op": "fault", "type": "fault", "process": "harness", "node": paused_node, "reason": "pause"}),
        (end_at, {"op": "disconnect", "type": "info", "node": "n3", "reason": "server disconnect 0x80"}),
        (resume_at, {"op": "fault", "type": "fault", "process": "harness", "node": paused_node,
                     "reason": "resume"}),
        (21.68, {"op": "connect", "type": "invoke", "node": "n1", "clean_start": False, "session_expiry": 2}),
        (21.80, {"op": "connect", "type": "ok", "node": "n1", "session_present": False}),
    ]
    out = []
    for i, (t, rec) in enumerate(sorted(rows, key=lambda r: r[0])):
        base: dict[str, Any] = {"run": "r", "index": i, "mono_ns": int(t * S), "wall_ms": int(t * 1000)}
        if rec.get("process") != "harness":
            base.update(process="sh3", session="sh3")
        out.append({**base, **rec})
    return out


def _lost(records: list[dict[str, Any]]) -> int:
    return sum(v.kind == "session_lost" for v in analyze_history(records).violations)


def test_a_connection_ended_by_its_paused_node_counts_from_the_pause() -> None:
    assert _lost(_history(pause_at=7.7, resume_at=20.9)) == 0
    # closed as the node resumed, within the grace (2 s) after the resume record
    assert _lost(_history(pause_at=7.7, resume_at=19.5)) == 0


def test_other_pauses_excuse_nothing() -> None:
    # another node's pause
    assert _lost(_history(pause_at=7.7, resume_at=20.9, paused_node="n2")) == 1
    # the connection went on well past the resume: it ended then, not at the pause
    assert _lost(_history(pause_at=7.7, resume_at=12.0)) == 1
    # the pause began before the CONNACK (served after it: seeds 30456 and 30575)
    assert _lost(_history(pause_at=7.42, resume_at=18.0, connack_at=18.05)) == 1
