"""The cluster simulator's model clients (moorline/sim/cluster/workload.py) on a 3-node world:
every kind of client does its thing, the history they record is clean by the checkers, well
formed, and the same every time a seed runs."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from moorline.sim.cluster.checkers import analyze_history, check_history
from moorline.sim.cluster.workload import NO_GUID, WorkloadConfig, run_workload
from moorline.sim.cluster.world import World
from moorline.verify.history import FIELD_NAMES, check_record

SEEDS = (1, 2, 3)


def test_workload_seeds_are_clean_and_every_client_kind_did_its_thing() -> None:
    by_kind: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    for seed in SEEDS:
        run = run_workload(seed)
        assert run.drained and run.workload.errors == [], seed
        assert run.workload.stats["not_drained"] == 0 and run.workload.stats["drained"] > 5, seed
        assert [e for sn in run.world.nodes for e in sn.errors] == [], seed
        assert check_history(run.records) == [], seed
        counts = analyze_history(run.records).counts
        published = counts["published"]
        # no faults: every QoS 1/2 publish is acknowledged, nothing refused but discarded wills
        assert counts["acknowledged"] == run.workload.stats["publish_acked"] > 100, seed
        assert counts["first_deliveries"] > 500 and published > 200, seed
        totals.update(counts)
        for kind, c in run.workload.stats_by_kind.items():
            by_kind.setdefault(kind, Counter()).update(c)
    # each kind of client did what it is there for, over the seeds
    assert by_kind["publisher"]["publish_resends"] > 0
    assert by_kind["publisher"]["reconnects"] > 0
    assert by_kind["subscriber"]["sessions_resumed"] > 0 and by_kind["subscriber"]["withheld_puback"] > 0
    assert by_kind["subscriber"]["retained_deliveries"] > 0 and by_kind["subscriber"]["will_deliveries"] > 0
    assert by_kind["qos2_method_B"]["withheld_pubrec"] + by_kind["qos2_method_B"]["method_b_resends"] > 0
    assert by_kind["qos2_method_A"]["method_a_released"] > 0 and by_kind["qos2_method_A"]["method_a_restored"] > 0
    assert by_kind["takeover"]["takeovers_started"] > 0 and by_kind["takeover"]["displaced"] > 0
    assert by_kind["takeover"]["taken_over_0x8e"] > 0  # the 5.0 process hears why
    assert by_kind["racer"]["race_subscribes"] > 0 and by_kind["racer"]["unsubscribed"] > 0
    assert by_kind["share"]["rejoined_as_new_session"] > 0 and by_kind["share"]["left_for_good"] == len(SEEDS)
    assert by_kind["share"]["deliveries"] > 0
    assert by_kind["will"]["wills_due"] > 0 and by_kind["will"]["wills_discarded"] > 0
    # delayed wills whose session a reconnect resumed within the delay: judged never published
    assert by_kind["will"]["wills_delayed"] > 0 and by_kind["will"]["wills_cancelled"] > 0
    assert totals["duplicate_legit"] > 0  # QoS 1 resends after a reconnect happened and were allowed


def test_workload_under_a_crash_and_a_pause_stays_clean() -> None:
    state = {"crashed": False, "restarted": False, "paused": False}

    def faults(world: World, _wl: Any) -> None:
        t = world.scheduler.now
        n2, n3 = world.nodes[1], world.nodes[2]
        if t >= 3.0 and not state["crashed"]:
            world.crash(n2)
            state["crashed"] = True
        if t >= 6.0 and not state["restarted"]:
            world.start(n2)
            state["restarted"] = True
        if t >= 9.0 and not state["paused"]:
            world.pause(n3, 2.0)
            state["paused"] = True

    run = run_workload(5, during=faults)
    assert all(state.values())
    assert run.drained and run.workload.errors == []
    assert check_history(run.records) == []
    stats = run.workload.stats
    assert stats["connections_lost"] > 0 and stats["connect_failures"] > 0  # the crash was felt
    assert analyze_history(run.records).counts["acknowledged"] == stats["publish_acked"] > 100


def test_history_is_well_formed_and_a_seed_replays_exactly() -> None:
    cfg = WorkloadConfig(messages_per_publisher=8, race_messages=8, share_messages=8, retained_messages=3,
                         will_rounds=1, takeovers_per_pair=1)
    first = run_workload(11, cfg=cfg)
    again = run_workload(11, cfg=cfg)
    text = [json.dumps(r, sort_keys=True) for r in first.records]
    assert text == [json.dumps(r, sort_keys=True) for r in again.records]
    assert len(text) > 300
    prev = (-1, -1)
    for i, r in enumerate(first.records):
        check_record({k: v for k, v in r.items() if k not in ("index", "mono_ns", "wall_ms")})
        assert set(r) <= FIELD_NAMES and r["index"] == i and r["run"] == "sim-11"
        assert (r["mono_ns"], r["index"]) > prev  # file order is time order
        prev = (r["mono_ns"], r["index"])
        assert r["wall_ms"] == 1_790_000_000_000 + r["mono_ns"] // 1_000_000
        if r["op"] in ("publish", "deliver") and r["type"] != "drop":
            assert len(r["guid"]) == 32
    # 3.1.1 and 5.0 clients, publishes with and without a guid
    assert any(r.get("detail") == NO_GUID for r in first.records)
    assert any(r["op"] == "publish" and r.get("detail") is None for r in first.records)
    versions = {c.version for c in first.workload.clients}
    assert versions == {4, 5}
    other = run_workload(12, cfg=cfg)
    assert [json.dumps(r, sort_keys=True) for r in other.records] != text


def test_a_cluster_that_cannot_recover_is_reported_stuck_and_judged_on_nothing_else() -> None:
    """Two of three nodes gone for good: the drain gives up; its subscribers are recorded as not
    drained (nothing is judged owed to them) and unanswered publishes as abandoned: ``stuck``."""
    cfg = WorkloadConfig(messages_per_publisher=40, race_messages=40, share_messages=40)

    def lose_the_majority(world: World, _wl: Any) -> None:
        if world.scheduler.now >= 3.0:
            for sn in world.nodes[1:]:
                world.crash(sn)

    run = run_workload(4, cfg=cfg, production_s=6.0, drain_s=16.0, during=lose_the_majority)
    assert not run.drained and run.workload.errors == []
    found = check_history(run.records)
    assert {v.kind for v in found} == {"stuck"}
    stats = run.workload.stats
    assert stats["not_drained"] > 0 and stats["drained"] == 0 and stats["publishes_abandoned"] > 0
    assert len(found) == stats["not_drained"] + stats["publishes_abandoned"]
