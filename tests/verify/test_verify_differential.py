"""One definition, two engines: ``moorline verify`` (PySpark) and the cluster simulator's checkers
(plain Python) must find the same (kind, message, subscriber) set on every history.

Histories: two of the cluster simulator's CI seeds (tests/sim_cluster/test_sim_seeds.py runs
them with faults; the seed's history is read back from its trace file, which holds the records
in docs/history-format.md), a short ``moorline chaos`` run against a real node (kill and
truncate; real MQTT clients record it), and runs derived from all of them with anomalies injected
by a seeded generator (lost, duplicated, swapped and re-numbered deliveries, unsubscribes, refused publishes,
drops, reconnects, QoS changes, retained copies, equal acknowledgement times, ...). Every run is
judged by one Spark job; any difference is a bug in one of the engines (docs/verification.md is
the definition both implement).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

Rec = dict[str, Any]
SEEDS = (100, 101)  # two of CI's 3-node seeds (tests/sim_cluster/test_sim_seeds.py)
MUTATED_RUNS = 16  # derived runs, each with a few injected anomalies
MUTATIONS_PER_RUN = (1, 6)


def _of(recs: list[Rec], **want: Any) -> list[Rec]:
    return [r for r in recs if all(r.get(k) == v for k, v in want.items())]


def _after(r: Rec, dt_ns: int = 1) -> Rec:
    """A copy of ``r`` placed just after it (fractional index keeps the order until renumbering)."""
    return {**r, "mono_ns": r["mono_ns"] + dt_ns, "index": r["index"] + 0.5}


# Each mutation edits the list in place (returns False when it found nothing to edit).
def m_lose_delivery(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if not dl:
        return False
    d = rng.choice(dl)
    recs[:] = [r for r in recs if not (r.get("session") == d.get("session") and r.get("guid") == d.get("guid")
                                        and r.get("op") in ("deliver", "ack"))]
    return True


def m_duplicate_delivery(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if not dl:
        return False
    d = rng.choice(dl)
    recs.append({**_after(d, rng.choice([1, 1000, 10**6])), "dup": rng.random() < 0.5})
    return True


def m_swap_guids(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if len(dl) < 2:
        return False
    i = rng.randrange(len(dl) - 1)
    a, b = dl[i], dl[i + 1]
    if a.get("session") != b.get("session"):
        return False
    ga, gb = a.get("guid"), b.get("guid")
    for r in recs:
        if r.get("session") == a.get("session") and r.get("guid") in (ga, gb):
            r["guid"] = gb if r["guid"] == ga else ga
    return True


def m_packet_id(recs: list[Rec], rng: random.Random) -> bool:
    dl = [r for r in _of(recs, op="deliver", type="ok") if r.get("packet_id") is not None]
    if not dl:
        return False
    rng.choice(dl)["packet_id"] = rng.choice([1, 2, 3, 900])
    return True


def m_unsubscribe(recs: list[Rec], rng: random.Random) -> bool:
    subs = _of(recs, op="subscribe", type="ok")
    if not subs:
        return False
    s = rng.choice(subs)
    later = [r for r in recs if r.get("session") == s.get("session") and r["mono_ns"] > s["mono_ns"]]
    at = rng.choice(later) if later else s
    recs.append({**_after(at), "type": "ok", "op": "unsubscribe", "filter": s.get("filter"),
                 "share_group": s.get("share_group"), "qos": None, "guid": None, "topic": None,
                 "packet_id": None, "detail": None})
    return True


def m_refuse(recs: list[Rec], rng: random.Random) -> bool:
    oks = _of(recs, op="publish", type="ok")
    if not oks:
        return False
    r = rng.choice(oks)
    r["type"], r["reason"] = "fail", "0x80"
    return True


def m_unknown_delivery(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if not dl:
        return False
    d = rng.choice(dl)
    recs.append({**_after(d), "guid": rng.choice([None, "f" * 32]), "packet_id": 777})
    return True


def m_drop(recs: list[Rec], rng: random.Random) -> bool:
    pubs = _of(recs, op="publish", type="invoke")
    sessions = sorted({r["session"] for r in recs if r.get("op") == "subscribe"})
    if not pubs or not sessions:
        return False
    p = rng.choice(pubs)
    recs.append({"run": p["run"], "type": "drop", "op": "drop", "guid": p.get("guid"), "process": "harness",
                 "reason": rng.choice(["queue_cap", "session_expired", "share_qos2_member_gone"]),
                 "session": rng.choice([None, *sessions]), "shard": 0, "offset": 0,
                 "mono_ns": recs[-1]["mono_ns"] + 1, "index": recs[-1]["index"] + 0.5})
    return True


def m_reconnect(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if not dl:
        return False
    d = rng.choice(dl)
    base = {k: d.get(k) for k in ("run", "session", "process", "node")}
    lost = {**base, "type": "info", "op": "disconnect", "reason": "connection lost"}
    inv = {**base, "type": "invoke", "op": "connect", "clean_start": False, "session_expiry": 600}
    ok = {**base, "type": "ok", "op": "connect", "session_present": rng.random() < 0.8}
    for i, r in enumerate((lost, inv, ok), 1):
        r["mono_ns"], r["index"] = d["mono_ns"] - 10 + i, d["index"] - 0.5 + i / 10
    recs.extend((lost, inv, ok))
    return True


def m_qos(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if not dl:
        return False
    rng.choice(dl)["qos"] = rng.choice([0, 1, 2])
    return True


def m_retained(recs: list[Rec], rng: random.Random) -> bool:
    dl = _of(recs, op="deliver", type="ok")
    if not dl:
        return False
    d = rng.choice(dl)
    recs.append({**_after(d, 10**6), "detail": "retained", "packet_id": (d.get("packet_id") or 0) + 1})
    return True


def m_equal_ack_times(recs: list[Rec], rng: random.Random) -> bool:
    oks = sorted(_of(recs, op="publish", type="ok"), key=lambda r: (r["mono_ns"], r["index"]))
    if len(oks) < 2:
        return False
    i = rng.randrange(len(oks) - 1)
    oks[i + 1]["mono_ns"] = oks[i]["mono_ns"]
    return True


def m_no_guid_resend(recs: list[Rec], rng: random.Random) -> bool:
    inv = _of(recs, op="publish", type="invoke")
    if not inv:
        return False
    p = rng.choice(inv)
    p["detail"] = "no_guid"
    recs.append({**_after(p, 1000), "dup": True})
    dl = [r for r in _of(recs, op="deliver", type="ok") if r.get("guid") == p.get("guid")]
    if dl:
        d = rng.choice(dl)
        recs.append({**_after(d, 1000), "packet_id": (d.get("packet_id") or 0) + 5, "dup": False})
    return True


def m_qos2_held_resend(recs: list[Rec], rng: random.Random) -> bool:
    dl = [r for r in _of(recs, op="deliver", type="ok") if r.get("qos") == 2]
    if not dl:
        return False
    d = rng.choice(dl)
    recs.append({**_after(d, rng.choice([1, 10**6])), "dup": rng.random() < 0.8})
    return True


MUTATIONS: tuple[Callable[[list[Rec], random.Random], bool], ...] = (
    m_lose_delivery, m_duplicate_delivery, m_swap_guids, m_packet_id, m_unsubscribe, m_refuse,
    m_unknown_delivery, m_drop, m_reconnect, m_qos, m_retained, m_equal_ack_times, m_no_guid_resend,
    m_qos2_held_resend,
)


def renumber(recs: list[Rec]) -> list[Rec]:
    out = sorted(recs, key=lambda r: (r["mono_ns"], r["index"]))
    for i, r in enumerate(out):
        r["index"] = i
    return out


def mutated(clean: list[Rec], run: str, rng: random.Random, first: Callable[[list[Rec], random.Random], bool]
            ) -> tuple[list[Rec], list[str]]:
    """A copy of ``clean`` as run ``run`` with ``first`` and a few drawn anomalies injected; returns
    it and their names. (``first`` makes every mutation appear in some run whatever the draws: the
    histories change with the simulator, and with them what a seeded draw picks.)"""
    recs = copy.deepcopy(clean)
    for r in recs:
        r["run"] = run
    done = []
    for m in [first, *(rng.choice(MUTATIONS) for _ in range(rng.randint(*MUTATIONS_PER_RUN)))]:
        if m(recs, rng):
            done.append(m.__name__)
    return renumber(recs), done


def seed_history(seed: int, tmp: Path) -> list[Rec]:
    """A CI seed's history as the simulator recorded it (read back from its trace file)."""
    from moorline.sim.cluster.runner import plain_mix, run_seed

    trace = tmp / f"trace-{seed}.jsonl"
    # The plain mix (production-sized configuration), as these histories were before the default
    # mix changed: under the default mix's drawn configuration (queue caps of 20, short retention)
    # an injected lost delivery can be excused as a counted drop, and in one CI run no mutated run
    # showed `lost` (the two engines still agreed); locally the same test passed, as the chaos
    # history (a real node) differs each run.
    # Its verdict is test_sim_seeds' business: here both engines judge it.
    run_seed(seed, nodes=3, trace=trace, cfg=plain_mix())
    recs = [json.loads(line)["history"] for line in trace.read_text().splitlines() if line.startswith('{"history"')]
    for r in recs:
        r["run"] = f"seed-{seed}"
    return recs


def both_engines(spark: Any, records: list[Rec], tmp: Path) -> tuple[set[tuple[Any, ...]], set[tuple[Any, ...]]]:
    """(verify's, the checkers') (run, kind, message, subscriber) sets."""
    from moorline.sim.cluster.checkers import VERIFY_KINDS, analyze_history
    from moorline.verify.checks import analyze
    from moorline.verify.job import checked_events, load_histories

    path = tmp / "histories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    events = checked_events(load_histories(spark, [path]), [path])
    theirs = {(a["run"], a["kind"], a["guid"], a["subscriber"]) for a in analyze(events).anomalies.collect()}
    ours = {(v.run, v.kind, v.guid, v.subscriber) for v in analyze_history(records).violations
            if v.kind in VERIFY_KINDS}
    return theirs, ours


def chaos_history(tmp: Path) -> list[Rec]:
    """A short chaos run's history (a real node killed and its log truncated); [] when no node can
    start here (the chaos suite skips then too)."""
    from moorline.chaos.harness import ChaosConfig, run_once
    from moorline.chaos.node import NodeStartError

    cfg = ChaosConfig(duration_s=5, faults=frozenset({"kill", "truncate"}), kills_per_run=1, seed=21)
    try:
        result = run_once(cfg, "chaos-21", tmp)
    except (NodeStartError, OSError) as exc:  # pragma: no cover - CI can start a node
        pytest.skip(f"moorline node cannot start: {exc}")
    return [json.loads(line) for line in Path(result.history).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def seed_histories(tmp_path_factory: pytest.TempPathFactory) -> list[list[Rec]]:
    tmp = tmp_path_factory.mktemp("seeds")
    # spawn: the test process holds a Spark gateway's threads a fork would copy half-alive.
    with ProcessPoolExecutor(len(SEEDS), mp_context=multiprocessing.get_context("spawn")) as pool:
        seeds = pool.map(seed_history, SEEDS, [tmp] * len(SEEDS))
        chaos = chaos_history(tmp)  # while the seeds run
        return [*seeds, chaos]


def test_verify_and_the_checkers_agree_on_seeds_and_injected_anomalies(
    spark: Any, seed_histories: list[list[Rec]], tmp_path: Path
) -> None:
    rng = random.Random(37)
    records: list[Rec] = [r for h in seed_histories for r in h]
    injected: dict[str, list[str]] = {}
    for i in range(MUTATED_RUNS):
        run = f"mutated-{i}"
        recs, injected[run] = mutated(seed_histories[i % len(seed_histories)], run, rng,
                                      MUTATIONS[i % len(MUTATIONS)])
        records += recs
    theirs, ours = both_engines(spark, records, tmp_path)
    only_verify = sorted(theirs - ours, key=str)
    only_checkers = sorted(ours - theirs, key=str)
    runs = {x[0] for x in only_verify + only_checkers}
    assert not only_verify and not only_checkers, (
        f"verify only: {only_verify[:10]}\nthe checkers only: {only_checkers[:10]}\n"
        f"injected: { {r: injected.get(r) for r in sorted(runs)} }")
    # The injected anomalies were found (the comparison is not between empty sets).
    kinds = {x[1] for x in ours}
    assert {"lost", "duplicate", "unexpected", "refused_delivered", "packet_id_misuse"} <= kinds, kinds
