"""The cluster simulator's history checkers (moorline/sim/cluster/checkers.py): silent on a real
clean history, and each one fails on that same history doctored to hold exactly its anomaly.
Also: on verify's own handcrafted scenarios they find what verify finds."""

from __future__ import annotations

import copy
import importlib.util
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from moorline.sim.cluster.checkers import EXTRA_KINDS, CheckConfig, analyze_history, check_history
from moorline.sim.cluster.workload import NO_GUID, run_workload

Rec = dict[str, Any]
SEED = 3


@pytest.fixture(scope="module")
def clean() -> list[Rec]:
    run = run_workload(SEED)
    assert run.drained and not run.workload.errors
    assert check_history(run.records) == []
    return run.records


def kinds(records: list[Rec], cfg: CheckConfig | None = None) -> Counter[str]:
    return Counter(v.kind for v in analyze_history(records, cfg).violations)


def renumber(records: list[Rec]) -> list[Rec]:
    """Records in time order again after an edit, with ``index`` the file order (as a writer would)."""
    out = sorted(records, key=lambda r: (r["mono_ns"], r["index"]))
    for i, r in enumerate(out):
        r["index"] = i
    return out


def insert_after(records: list[Rec], anchor: Rec, new: Rec, dt_ns: int = 1) -> list[Rec]:
    new = {**new, "mono_ns": anchor["mono_ns"] + dt_ns, "index": anchor["index"] + 0.5}
    return renumber([*records, new])


def of(records: list[Rec], **want: Any) -> list[Rec]:
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


def acked_guids(records: list[Rec]) -> set[str]:
    return {r["guid"] for r in of(records, op="publish", type="ok")}


def once_delivered(records: list[Rec], session: str, qos: int | None = None) -> list[Rec]:
    """Deliveries to ``session`` of acknowledged messages it received exactly once."""
    acked = acked_guids(records)
    dl = of(records, op="deliver", type="ok", session=session)
    count = Counter(r["guid"] for r in dl)
    return [r for r in dl if count[r["guid"]] == 1 and r["guid"] in acked and r.get("detail") is None
            and (qos is None or r.get("qos") == qos)]


def drop_deliveries(records: list[Rec], session: str, guid: str) -> list[Rec]:
    gone = [r for r in records if r.get("session") == session and r.get("guid") == guid
            and r["op"] in ("deliver", "ack")]
    assert gone
    return renumber([r for r in records if r not in gone])


def lost_target(records: list[Rec]) -> tuple[str, str]:
    """A QoS 1 message psub1 (persistent, ``t/#`` among its filters) was owed and received."""
    last_sub = max(r["mono_ns"] for r in of(records, session="psub1", op="subscribe", type="ok"))
    invoked = {r["guid"]: r["mono_ns"] for r in of(records, op="publish", type="invoke")}
    for r in once_delivered(records, "psub1", qos=1):
        if r["topic"].startswith("t/") and invoked[r["guid"]] > last_sub:
            return "psub1", r["guid"]
    raise AssertionError("no owed delivery to psub1 in the base history")


# --- lost, and drops that excuse exactly what they name -------------------------------------------
def test_lost_message_is_found(clean: list[Rec]) -> None:
    session, guid = lost_target(clean)
    doctored = drop_deliveries(copy.deepcopy(clean), session, guid)
    found = analyze_history(doctored).violations
    assert [(v.kind, v.guid) for v in found] == [("lost", guid)]
    assert found[0].subscriber is not None and found[0].subscriber.startswith("psub1#")


def drop_record(anchor: Rec, guid: str, session: str | None, reason: str = "queue_cap") -> Rec:
    return {"run": anchor["run"], "type": "drop", "op": "drop", "process": "broker", "guid": guid,
            "reason": reason, "session": session, "shard": 0, "offset": 0}


def test_a_drop_excuses_exactly_the_message_and_session_it_names(clean: list[Rec]) -> None:
    session, guid = lost_target(clean)
    doctored = drop_deliveries(copy.deepcopy(clean), session, guid)
    end = doctored[-1]
    other_guid = next(g for g in sorted(acked_guids(clean)) if g != guid)
    excused = insert_after(doctored, end, drop_record(end, guid, session))
    assert "lost" not in kinds(excused)
    assert analyze_history(excused).counts["excused"] >= 1
    everyone = insert_after(doctored, end, drop_record(end, guid, None, "message_expiry"))
    assert "lost" not in kinds(everyone)
    for wrong in (drop_record(end, guid, "psub2"), drop_record(end, other_guid, session)):
        assert kinds(insert_after(doctored, end, wrong))["lost"] == 1, wrong


# --- duplicates -------------------------------------------------------------------------------------
def test_second_delivery_on_the_same_connection_is_a_duplicate(clean: list[Rec]) -> None:
    d = once_delivered(clean, "psub1", qos=1)[5]
    doctored = insert_after(copy.deepcopy(clean), d, {**d, "dup": True}, dt_ns=1000)
    found = analyze_history(doctored).violations
    assert [(v.kind, v.guid) for v in found] == [("duplicate", d["guid"])]


def test_qos1_resend_without_guid_may_arrive_twice_with_a_guid_it_may_not(clean: list[Rec]) -> None:
    def doctor(no_guid: bool) -> list[Rec]:
        recs = copy.deepcopy(clean)
        d = next(r for r in once_delivered(recs, "psub1", qos=1)
                 if any(i.get("detail") == NO_GUID for i in of(recs, op="publish", type="invoke", guid=r["guid"]))
                 == no_guid)
        invoke = of(recs, op="publish", type="invoke", guid=d["guid"])[0]
        # The publisher resent it (a reconnect) and the broker, without a guid, stored it again.
        recs = insert_after(recs, invoke, {**invoke, "dup": True})
        second = {**d, "packet_id": (d["packet_id"] or 0) + 500, "dup": False}
        return insert_after(recs, d, second, dt_ns=1000)

    assert check_history(doctor(no_guid=True)) == []
    # with a guid the broker stores it once: a second copy is a duplicate (and a renumbering)
    assert kinds(doctor(no_guid=False)) == Counter({"duplicate": 1, "packet_id_misuse": 1})


def test_qos2_packet_id_reused_while_held_is_a_method_b_loss(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    for d in of(recs, op="deliver", type="ok", session="q2b1", qos=2):
        ack = next((a for a in of(recs, op="ack", session="q2b1", packet_id=d["packet_id"])
                    if a["mono_ns"] > d["mono_ns"]), None)
        if ack is not None and ack["mono_ns"] - d["mono_ns"] > 1000:
            break
    else:
        raise AssertionError("no held QoS 2 packet id in the base history")
    # A message q2b1 was never sent (one it also received would be judged as its resend too).
    received = {r["guid"] for r in of(recs, op="deliver", session="q2b1")}
    other = next(g for g in sorted(acked_guids(recs)) if g != d["guid"] and g not in received)
    doctored = insert_after(recs, d, {**d, "guid": other, "dup": False}, dt_ns=500)
    found = [v for v in analyze_history(doctored).violations if v.kind == "packet_id_misuse"]
    assert len(found) == 1 and "reused while held" in found[0].detail and found[0].guid == other


def test_qos2_resend_of_a_held_packet_id_needs_dup(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    d = next(d for d in of(recs, op="deliver", type="ok", session="q2b1", qos=2, dup=False)
             if any(a["mono_ns"] > d["mono_ns"] + 1000 for a in of(recs, op="ack", session="q2b1",
                                                                   packet_id=d["packet_id"])))
    with_dup = insert_after(recs, d, {**d, "dup": True}, dt_ns=500)
    assert check_history(with_dup) == []  # the protocol's resend: not a second delivery
    without = insert_after(recs, d, {**d, "dup": False}, dt_ns=500)
    assert kinds(without) == Counter({"resend_without_dup": 1})


# --- order and packet ids -----------------------------------------------------------------------------
def test_first_deliveries_out_of_publish_order_are_found(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    pub_of = {r["guid"]: r["session"] for r in of(recs, op="publish", type="invoke")}
    once = once_delivered(recs, "psub1")
    for a, b in zip(once, once[1:], strict=False):
        if a["topic"] == b["topic"] and pub_of[a["guid"]] == pub_of[b["guid"]]:
            break
    else:
        raise AssertionError("no two deliveries of one publisher and topic to psub1")
    ga, gb = a["guid"], b["guid"]
    for r in recs:  # psub1 sees b's message where a's was, and the other way round
        if r.get("session") == "psub1" and r.get("guid") in (ga, gb):
            r["guid"] = gb if r["guid"] == ga else ga
    found = analyze_history(recs).violations
    assert [(v.kind, v.guid, v.topic) for v in found] == [("out_of_order", ga, a["topic"])]


def test_redelivery_with_a_new_packet_id_is_found(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    seen: dict[tuple[Any, Any], Rec] = {}
    for r in of(recs, op="deliver", type="ok"):
        key = (r["session"], r["guid"])
        if key in seen and r.get("dup") and r["qos"] == 1 and seen[key]["qos"] == 1 and not r.get("detail"):
            break
        seen.setdefault(key, r)
    else:
        raise AssertionError("no QoS 1 redelivery in the base history")
    r["packet_id"] += 700
    for a in of(recs, op="ack", session=r["session"], guid=r["guid"]):
        if a["mono_ns"] >= r["mono_ns"]:
            a["packet_id"] = r["packet_id"]
    found = [(v.kind, v.guid) for v in analyze_history(recs).violations]
    assert found == [("packet_id_misuse", r["guid"])]


# --- sessions: two owners, a lost session --------------------------------------------------------
def takeover(records: list[Rec]) -> tuple[Rec, Rec, Rec]:
    """(the old process's ending, the new process's CONNACK, a later delivery to the new one)."""
    for end in of(records, op="disconnect", type="info", session="tk1"):
        if "0x8e" not in (end.get("reason") or ""):
            continue
        new = next(r for r in of(records, op="connect", type="ok", session="tk1")
                   if r["mono_ns"] >= end["mono_ns"] and r["process"] != end["process"])
        later = [d for d in of(records, op="deliver", type="ok", session="tk1", process=new["process"])
                 if d["mono_ns"] > new["mono_ns"] + 300_000_000]
        if later:
            return end, new, later[0]
    raise AssertionError("no takeover with DISCONNECT 0x8E in the base history")


def test_old_owner_delivering_after_a_takeover_is_a_double_owner(clean: list[Rec]) -> None:
    assert "double_owner" not in kinds(clean)
    recs = copy.deepcopy(clean)
    end, new, later = takeover(recs)
    # The old connection stays open past the new CONNACK and gets a message there.
    end["mono_ns"] = later["mono_ns"] + 1_000_000
    stray = {**later, "process": end["process"], "node": end["node"]}
    doctored = insert_after(renumber(recs), later, stray, dt_ns=500)
    found = analyze_history(doctored).violations
    double = [v for v in found if v.kind in EXTRA_KINDS]
    assert [v.kind for v in double] == ["double_owner"]
    assert double[0].subscriber == "tk1" and end["process"] in double[0].detail
    # the stray copy is also a second delivery of that message to the session
    assert {v.kind for v in found} == {"double_owner", "duplicate"}


def test_old_connection_left_open_after_a_takeover_is_a_stale_owner(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    end, new, _ = takeover(recs)
    # Left open (no delivery) until shortly before that process connects again.
    again = [r["mono_ns"] for r in of(recs, op="connect", type="invoke", process=end["process"])
             if r["mono_ns"] > end["mono_ns"]]
    open_ns = min(3_000_000_000, ((again[0] if again else new["mono_ns"] + 6_000_000_000) - new["mono_ns"]) // 2)
    assert open_ns > 200_000_000
    end["mono_ns"] = new["mono_ns"] + open_ns
    doctored = renumber(recs)
    strict = CheckConfig(stale_owner_grace_s=0.2)
    found = kinds(doctored, strict)
    assert set(found) == {"stale_owner"}  # once per CONNACK of the other process while it stayed open

    def paused(node: str) -> list[Rec]:
        """The node was paused from just before the new CONNACK until just before the close."""
        harness = {"run": new["run"], "process": "harness", "type": "fault", "op": "fault", "node": node}
        out = insert_after(doctored, new, {**harness, "reason": "pause", "mono_ns": new["mono_ns"] - 10}, dt_ns=0)
        resume_at = end["mono_ns"] - 100_000_000
        anchor = max((r for r in out if r["mono_ns"] <= resume_at), key=lambda r: r["mono_ns"])
        return renumber(insert_after(out, anchor, {**harness, "reason": "resume", "mono_ns": resume_at}, dt_ns=0))

    # A paused old owner closes the connection when it resumes: its own node's pause excuses it...
    assert kinds(paused(end["node"]), strict) == Counter()
    # ...another node's does not.
    other_node = next(r["node"] for r in of(recs, op="connect", type="ok") if r.get("node") not in (None, end["node"]))
    assert set(kinds(paused(other_node), strict)) == {"stale_owner"}


def test_session_present_0_on_an_unexpired_session_is_a_lost_session(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    invokes = {r["process"]: r for r in of(recs, op="connect", type="invoke", session="psub1")}
    resumed = [r for r in of(recs, op="connect", type="ok", session="psub1", session_present=True)]
    assert resumed and invokes
    resumed[0]["session_present"] = False
    assert kinds(recs)["session_lost"] == 1


# --- other kinds ------------------------------------------------------------------------------------
def test_will_after_clean_disconnect_and_unknown_messages_are_found(clean: list[Rec]) -> None:
    recs = copy.deepcopy(clean)
    will = of(recs, op="deliver", type="ok", topic=next(r["topic"] for r in of(recs, op="deliver")
                                                          if r["topic"].startswith("w/")))[0]
    invoke = of(recs, op="publish", type="invoke", guid=will["guid"])[0]
    refused = insert_after(recs, invoke, {**invoke, "type": "fail", "reason": "will discarded"})
    assert kinds(refused)["refused_delivered"] >= 1
    d = once_delivered(recs, "psub1")[0]
    unknown = insert_after(recs, d, {**d, "guid": "f" * 32, "packet_id": 9999}, dt_ns=10)
    assert kinds(unknown)["unexpected"] == 1


# --- verify's handcrafted scenarios ---------------------------------------------------------------------
def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERIFY_TESTS = Path(__file__).resolve().parents[1] / "verify"


def test_verify_scenarios_give_the_same_anomalies() -> None:
    """tests/verify/test_verify_checks.py's scenarios, with the counts verify is tested to give."""
    hist = _load("verify_conftest_for_sim", VERIFY_TESTS / "conftest.py").Hist
    scenarios = _load("verify_scenarios_for_sim", VERIFY_TESTS / "test_verify_checks.py").SCENARIOS
    assert len(scenarios) > 20
    for name, (build, expected) in scenarios.items():
        h = hist(name)
        build(h)
        got = Counter(v.kind for v in analyze_history(h.rows).violations if v.kind not in EXTRA_KINDS)
        assert dict(got) == expected, name


def test_a_retained_copy_before_or_after_the_live_one_is_no_duplicate(clean: list[Rec]) -> None:
    """A new subscription's retained copy of a message the session also gets live (through another
    filter) is a copy MQTT asks for, in either order; a second live copy after it still is a
    duplicate."""
    candidates = once_delivered(clean, "psub1", qos=1)
    assert candidates, "seed 3 delivers QoS 1 messages to psub1 once each"
    live = candidates[0]
    retained = {**live, "detail": "retained", "packet_id": (live["packet_id"] or 0) + 1000, "retain": True}
    before = {**retained, "mono_ns": live["mono_ns"] - 1}
    assert "duplicate" not in kinds(renumber([*copy.deepcopy(clean), before]))
    assert "duplicate" not in kinds(insert_after(copy.deepcopy(clean), live, retained))
    again = {**live, "packet_id": (live["packet_id"] or 0) + 2000}
    doubled = insert_after(insert_after(copy.deepcopy(clean), live, retained), live, again, dt_ns=5)
    assert kinds(doubled)["duplicate"] >= 1
