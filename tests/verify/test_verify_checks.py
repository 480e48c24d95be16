"""Handcrafted histories: each anomaly is flagged, clean and legitimately duplicated histories are not.

Every scenario is its own run; all runs are analysed by one Spark job (module fixture), which is
also what shows that runs do not leak into each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.spark

G1, G2, G3, G4 = ("a" * 32, "b" * 32, "c" * 32, "d" * 32)
SCENARIOS: dict[str, tuple[Callable[[Any], None], dict[str, int]]] = {}


def scenario(expected: dict[str, int]) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        SCENARIOS[fn.__name__] = (fn, expected)
        return fn

    return register


def base(h: Any) -> Any:
    """A persistent subscriber s1 on t/# (QoS 1) and a publisher p1."""
    h.connect("s1", present=False).subscribe("s1", "t/#", qos=1)
    return h.connect("p1", present=False, clean_start=True)


# ---------------------------------------------------------------- clean histories (nothing flagged)
@scenario({})
def clean_basic(h: Any) -> None:
    base(h).publish("p1", G1).publish("p1", G2, pid=2).publish("p1", G3, qos=2, pid=3)
    h.deliver("s1", G1, pid=1).deliver("s1", G2, pid=2).deliver("s1", G3, qos=2, pid=3).disconnect("s1")


@scenario({})
def clean_qos1_redelivery_after_reconnect(h: Any) -> None:
    base(h).publish("p1", G1).deliver("s1", G1, ack=False).lose_connection("s1")
    h.connect("s1", present=True).deliver("s1", G1, dup=True).disconnect("s1")


@scenario({})
def clean_qos1_redelivery_of_acked_but_uncommitted(h: Any) -> None:
    base(h).publish("p1", G1).publish("p1", G2, pid=2).deliver("s1", G1).deliver("s1", G2, pid=2)
    h.lose_connection("s1").connect("s1").deliver("s1", G1, dup=True).deliver("s1", G2, pid=2, dup=True)
    h.disconnect("s1")


@scenario({})
def clean_qos2_resend_before_release(h: Any) -> None:
    base(h).publish("p1", G1, qos=2).deliver("s1", G1, qos=2, pid=5, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G1, qos=2, pid=5, dup=True).disconnect("s1")


@scenario({})
def clean_share_qos1_member_session_ended(h: Any) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", group="g")
    h.connect("m2", present=False).subscribe("m2", "t/#", group="g")
    h.connect("p1", present=False).publish("p1", G1).deliver("m1", G1, ack=False).lose_connection("m1")
    h.connect("m1", present=False).deliver("m2", G1).disconnect("m1").disconnect("m2")


@scenario({})
def clean_share_round_robin_order_is_exempt(h: Any) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", group="g")
    h.connect("p1", present=False).publish("p1", G1).publish("p1", G2, pid=2).publish("p1", G3, pid=3)
    h.deliver("m1", G2, pid=1).deliver("m1", G1, pid=2).deliver("m1", G3, pid=3).disconnect("m1")


@scenario({})
def clean_excused_drops_qos0_and_no_local(h: Any) -> None:
    base(h).connect("s0", present=False).subscribe("s0", "t/#", qos=0)
    h.connect("nl", present=False).subscribe("nl", "t/#", no_local=True)
    h.publish("p1", G1).drop(G1, "queue_cap", session="s1").deliver("nl", G1)
    h.publish("p1", G2, pid=2).drop(G2, "message_expiry")
    h.publish("nl", G3).deliver("s1", G3, pid=3)
    h.disconnect("s1").disconnect("s0").disconnect("nl")


@scenario({})
def clean_indeterminate_publishes(h: Any) -> None:
    base(h).publish("p1", G1, outcome="info").publish("p1", G2, pid=2, outcome=None)
    h.publish("p1", G3, pid=3, outcome="fail").deliver("s1", G2, pid=2).disconnect("s1")


@scenario({})
def clean_session_expired_and_not_drained(h: Any) -> None:
    base(h).connect("s2", present=False).subscribe("s2", "t/#")
    h.publish("p1", G1).lose_connection("s1").lose_connection("s2")
    h.connect("s1", present=False).subscribe("s1", "t/#").publish("p1", G2, pid=2).deliver("s1", G2)
    h.disconnect("s1")  # s2 never came back: not drained, nothing owed can be judged


@scenario({})
def clean_subscribed_after_publish_and_interleaved_publishers(h: Any) -> None:
    base(h).connect("p2", present=False).publish("p1", G1).publish("p2", G2).publish("p1", G3, pid=2)
    h.connect("late", present=False).subscribe("late", "t/#").publish("p2", G4, pid=2)
    h.deliver("s1", G2, pid=1).deliver("s1", G1, pid=2).deliver("s1", G4, pid=3).deliver("s1", G3, pid=4)
    h.deliver("late", G4).disconnect("s1").disconnect("late")


@scenario({})
def clean_qos2_release_of_older_while_newer_is_resent(h: Any) -> None:
    # PUBREC of G1 (QoS 2) reached the broker, PUBACK of G2 (QoS 1) did not: after the reconnect the
    # broker sends PUBREL for G1 (answered by PUBCOMP: an ack) and resends the PUBLISH of G2.
    h.connect("s2", present=False).subscribe("s2", "t/#", qos=2).connect("p1", present=False)
    h.publish("p1", G1, qos=2).publish("p1", G2, qos=1, pid=2)
    h.deliver("s2", G1, qos=2, pid=1, ack=False).deliver("s2", G2, qos=1, pid=2, ack=False)
    h.lose_connection("s2").connect("s2").ack("s2", G1, 1, qos=2)
    h.deliver("s2", G2, qos=1, pid=2, dup=True).disconnect("s2")


@scenario({"lost_detected_corruption": 1})
def lost_in_run_with_detected_corruption(h: Any) -> None:
    base(h).publish("p1", G1).fault("bitflip").fault("corruption_detected", "wal.log offset 4096")
    h.disconnect("s1")


# ---------------------------------------------------------------- anomalies (each must be flagged)
@scenario({"lost": 1})
def lost_plain(h: Any) -> None:
    base(h).publish("p1", G1).publish("p1", G2, pid=2).deliver("s1", G1).disconnect("s1")


@scenario({"lost": 1})
def lost_share_group(h: Any) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", group="g")
    h.connect("m2", present=False).subscribe("m2", "t/#", group="g")
    h.connect("p1", present=False).publish("p1", G1).disconnect("m1").disconnect("m2")


@scenario({"duplicate": 1})
def duplicate_in_same_connection(h: Any) -> None:
    base(h).publish("p1", G1).deliver("s1", G1, ack=False).deliver("s1", G1, dup=True).disconnect("s1")


@scenario({"duplicate": 1})
def duplicate_without_dup_flag(h: Any) -> None:
    base(h).publish("p1", G1).deliver("s1", G1, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G1, dup=False).disconnect("s1")


@scenario({"duplicate": 1})
def duplicate_qos2_after_release(h: Any) -> None:
    base(h).publish("p1", G1, qos=2).deliver("s1", G1, qos=2, pid=5).lose_connection("s1")
    h.connect("s1").deliver("s1", G1, qos=2, pid=5, dup=True).disconnect("s1")


@scenario({"duplicate": 1})
def duplicate_share_second_member_while_first_alive(h: Any) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", group="g")
    h.connect("m2", present=False).subscribe("m2", "t/#", group="g")
    h.connect("p1", present=False).publish("p1", G1).deliver("m1", G1).deliver("m2", G1)
    h.disconnect("m1").disconnect("m2")


@scenario({"duplicate": 1})
def duplicate_share_qos2_after_member_gone(h: Any) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", qos=2, group="g")
    h.connect("m2", present=False).subscribe("m2", "t/#", qos=2, group="g")
    h.connect("p1", present=False).publish("p1", G1, qos=2).deliver("m1", G1, qos=2, ack=False)
    h.lose_connection("m1").connect("m1", present=False).deliver("m2", G1, qos=2)
    h.disconnect("m1").disconnect("m2")


@scenario({"unexpected": 2})
def unexpected_deliveries(h: Any) -> None:
    base(h).publish("p1", G1).deliver("s1", G1).deliver("s1", G4, pid=2).deliver("s1", None, pid=3)
    h.disconnect("s1")


@scenario({"refused_delivered": 1})
def refused_publish_delivered(h: Any) -> None:
    base(h).publish("p1", G1, outcome="fail").deliver("s1", G1).disconnect("s1")


@scenario({"out_of_order": 1})
def out_of_order_first_deliveries(h: Any) -> None:
    base(h).publish("p1", G1).publish("p1", G2, pid=2).publish("p1", G3, pid=3)
    h.deliver("s1", G1, pid=1).deliver("s1", G3, pid=2).deliver("s1", G2, pid=3).disconnect("s1")


@scenario({"out_of_order": 1})
def out_of_order_sticky_share(h: Any) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", group="g", sticky=True)
    h.connect("p1", present=False).publish("p1", G1).publish("p1", G2, pid=2).publish("p1", G3, pid=3)
    h.deliver("m1", G2, pid=1).deliver("m1", G1, pid=2).deliver("m1", G3, pid=3).disconnect("m1")


@scenario({"out_of_order": 1})
def out_of_order_resends_reversed(h: Any) -> None:
    base(h).publish("p1", G1).publish("p1", G2, pid=2)
    h.deliver("s1", G1, pid=1, ack=False).deliver("s1", G2, pid=2, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G2, pid=2, dup=True).deliver("s1", G1, pid=1, dup=True).disconnect("s1")


@scenario({"out_of_order": 1})
def out_of_order_resend_after_new_message(h: Any) -> None:
    base(h).publish("p1", G1).deliver("s1", G1, pid=1, ack=False).lose_connection("s1")
    h.publish("p1", G2, pid=2).connect("s1").deliver("s1", G2, pid=2).deliver("s1", G1, pid=1, dup=True)
    h.disconnect("s1")


@scenario({"out_of_order": 1})
def out_of_order_resend_skips_oldest_unacked(h: Any) -> None:
    base(h).publish("p1", G1).publish("p1", G2, pid=2)
    h.deliver("s1", G1, pid=1, ack=False).deliver("s1", G2, pid=2, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G2, pid=2, dup=True).disconnect("s1")


@scenario({"packet_id_misuse": 1})
def packet_id_reused_before_release(h: Any) -> None:
    base(h).publish("p1", G1, qos=2).publish("p1", G2, qos=2, pid=2)
    h.deliver("s1", G1, qos=2, pid=7, ack=False).deliver("s1", G2, qos=2, pid=7).ack("s1", G1, 7, qos=2)
    h.disconnect("s1")


@scenario({"packet_id_misuse": 1})
def packet_id_changed_on_resend(h: Any) -> None:
    base(h).publish("p1", G1).deliver("s1", G1, pid=3, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G1, pid=4, dup=True).disconnect("s1")


@pytest.fixture(scope="module")
def results(spark: Any, hist: Any) -> Any:
    from moorline.verify.checks import ALL_KINDS, analyze
    from moorline.verify.history import FIELDS, spark_schema

    rows: list[tuple[Any, ...]] = []
    for name, (build, _) in SCENARIOS.items():
        h = hist(name)
        build(h)
        rows.extend(tuple(r.get(f) for f, _ in FIELDS) for r in h.rows)
    a = analyze(spark.createDataFrame(rows, spark_schema()))
    anomalies = a.anomalies.collect()
    per_run = {r["run"]: r.asDict() for r in a.per_run.collect()}
    counts: dict[str, dict[str, int]] = {name: {} for name in SCENARIOS}
    for r in anomalies:
        counts[r["run"]][r["kind"]] = counts[r["run"]].get(r["kind"], 0) + 1
    for run, row in per_run.items():  # the per-run table must agree with the anomaly list
        assert {k: row[k] for k in ALL_KINDS if row[k]} == counts[run], run
    return counts, per_run, anomalies


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_verify_scenario(name: str, results: Any) -> None:
    counts, _, anomalies = results
    expected = SCENARIOS[name][1]
    mine = [(a["kind"], a["subscriber"], a["guid"], a["detail"]) for a in anomalies if a["run"] == name]
    assert counts[name] == expected, mine


def test_verify_counts_excused_legit_and_indeterminate(results: Any) -> None:
    _, per_run, _ = results
    assert (
        per_run["clean_excused_drops_qos0_and_no_local"]["excused"] == 6
    )  # s1: 2 drops, s0: 3 QoS 0, nl: 1 expiry
    assert per_run["clean_qos1_redelivery_after_reconnect"]["duplicate_legit"] == 1
    assert per_run["clean_qos1_redelivery_of_acked_but_uncommitted"]["duplicate_legit"] == 2
    assert per_run["clean_share_qos1_member_session_ended"]["duplicate_legit"] == 1
    assert per_run["clean_qos2_resend_before_release"]["duplicate_legit"] == 0
    ind = per_run["clean_indeterminate_publishes"]
    assert (ind["indeterminate"], ind["indeterminate_delivered"], ind["refused"]) == (2, 1, 1)
    corrupt = per_run["lost_in_run_with_detected_corruption"]
    assert (corrupt["fault_bitflip"], corrupt["fault_corruption_detected"]) == (1, 1)
