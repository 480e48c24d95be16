"""Valid histories ``moorline verify`` used to misjudge, each written as the MQTT rule it follows.

Each was listed in docs/cluster-sim-workload.md ("Where the checkers differ from verify") before
it was fixed; every test fails on the verify of commit 5e679c4. All scenarios are one Spark job
(module fixture), and each is also judged by the simulator's checkers
(moorline/sim/cluster/checkers.py): both engines must give the expected (kind, message,
subscriber) set, so the one definition in docs/verification.md holds in both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.spark

G1, G2, G3 = ("b" * 32, "a" * 32, "c" * 32)  # G2 < G1: a tie broken by guid goes the wrong way
Anoms = set[tuple[str, str | None, str | None]]  # (kind, guid, subscriber)
SCENARIOS: dict[str, tuple[Callable[[Any], None], Anoms]] = {}


def scenario(expected: Anoms) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        SCENARIOS[fn.__name__] = (fn, expected)
        return fn

    return register


@scenario(set())
def unsubscribed_plain_subscription(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.publish("p1", G1).deliver("s1", G1).unsubscribe("s1", "t/#").publish("p1", G2, pid=2)
    h.disconnect("s1")


@scenario(set())
def qos0_before_a_resend(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.publish("p1", G1, qos=0).publish("p1", G2, pid=2)
    h.deliver("s1", G1, qos=0, pid=None).deliver("s1", G2, pid=2, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G2, pid=2, dup=True).disconnect("s1")


@scenario(set())
def qos2_resent_with_its_held_packet_id(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#", qos=2).connect("p1", present=False)
    h.publish("p1", G1, qos=2).publish("p1", G2, pid=2)
    h.deliver("s1", G1, qos=2, pid=5, ack=False).deliver("s1", G2, pid=6, ack=False).lose_connection("s1")
    h.connect("s1").deliver("s1", G1, qos=2, pid=5, dup=True, ack=False).deliver("s1", G2, pid=6, dup=True)
    h.disconnect("s1")  # before PUBREL: the QoS 2 message was resent, not released


@scenario({("out_of_order", G1, "s1#1")})
def qos2_held_resends_out_of_order(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#", qos=2).connect("p1", present=False)
    h.publish("p1", G1, qos=2).publish("p1", G2, qos=2, pid=2)
    h.deliver("s1", G1, qos=2, pid=5, ack=False).deliver("s1", G2, qos=2, pid=6, ack=False)
    h.lose_connection("s1").connect("s1")
    h.deliver("s1", G2, qos=2, pid=6, dup=True).deliver("s1", G1, qos=2, pid=5, dup=True).disconnect("s1")


@scenario(set())
def acknowledgements_read_at_once(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.ev("invoke", "publish", session="p1", guid=G1, topic="t/a", qos=1, packet_id=1)
    h.ev("invoke", "publish", session="p1", guid=G2, topic="t/a", qos=1, packet_id=2)
    h.ev("ok", "publish", session="p1", guid=G1, topic="t/a", qos=1, packet_id=1)
    h.ev("ok", "publish", session="p1", guid=G2, topic="t/a", qos=1, packet_id=2)
    h.rows[-1]["mono_ns"] = h.rows[-2]["mono_ns"]  # both PUBACKs read in one step
    h.deliver("s1", G1, pid=1).deliver("s1", G2, pid=2).disconnect("s1")


def _share_pair(h: Any, first_granted: int, second_granted: int) -> None:
    h.connect("m1", present=False).subscribe("m1", "t/#", qos=first_granted, group="g")
    h.connect("m2", present=False).subscribe("m2", "t/#", qos=second_granted, group="g")
    h.connect("p1", present=False).publish("p1", G1, qos=2)
    h.deliver("m1", G1, qos=first_granted, ack=False).lose_connection("m1").connect("m1", present=False)
    h.deliver("m2", G1, qos=second_granted).disconnect("m1").disconnect("m2")


@scenario(set())
def share_qos1_claim_redelivered_at_qos2(h: Any) -> None:
    _share_pair(h, 1, 2)


@scenario({("duplicate", G1, "m2")})
def share_qos2_claim_redelivered_at_qos1(h: Any) -> None:
    _share_pair(h, 2, 1)


@scenario(set())
def retained_copy_for_a_new_subscribe(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "r/#").connect("p1", present=False)
    h.publish("p1", G1, topic="r/0").deliver("s1", G1, topic="r/0", pid=1)
    h.subscribe("s1", "r/#").deliver("s1", G1, topic="r/0", pid=2, detail="retained").disconnect("s1")


@scenario(set())
def publish_without_guid_stored_twice(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#").connect("p1", present=False)
    h.ev("invoke", "publish", session="p1", guid=G1, topic="t/a", qos=1, packet_id=1, detail="no_guid")
    h.lose_connection("p1").connect("p1")
    h.ev("invoke", "publish", session="p1", guid=G1, topic="t/a", qos=1, packet_id=1, dup=True, detail="no_guid")
    h.ev("ok", "publish", session="p1", guid=G1, topic="t/a", qos=1, packet_id=1)
    h.deliver("s1", G1, pid=1).deliver("s1", G1, pid=2).disconnect("s1")


@scenario({("lost", G1, "s1#1")})
def overlapping_filters_qos0_first(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/#", qos=0).subscribe("s1", "t/a", qos=1)
    h.connect("p1", present=False).publish("p1", G1).disconnect("s1")


@scenario({("lost", G1, "s1#1")})
def overlapping_filters_qos1_first(h: Any) -> None:
    h.connect("s1", present=False).subscribe("s1", "t/a", qos=1).subscribe("s1", "t/#", qos=0)
    h.connect("p1", present=False).publish("p1", G1).disconnect("s1")


@pytest.fixture(scope="module")
def judged(spark: Any, hist: Any) -> dict[str, dict[str, Anoms]]:
    from moorline.sim.cluster.checkers import VERIFY_KINDS, analyze_history
    from moorline.verify.checks import analyze
    from moorline.verify.history import FIELDS, spark_schema

    records: list[dict[str, Any]] = []
    for name, (build, _) in SCENARIOS.items():
        h = hist(name)
        build(h)
        records.extend(h.rows)
    rows = [tuple(r.get(f) for f, _ in FIELDS) for r in records]
    out: dict[str, dict[str, Anoms]] = {"verify": {n: set() for n in SCENARIOS}, "checkers": {n: set() for n in SCENARIOS}}
    for a in analyze(spark.createDataFrame(rows, spark_schema())).anomalies.collect():
        out["verify"][a["run"]].add((a["kind"], a["guid"], a["subscriber"]))
    for v in analyze_history(records).violations:
        if v.kind in VERIFY_KINDS and v.run is not None:
            out["checkers"][v.run].add((v.kind, v.guid, v.subscriber))
    return out


def _judge(judged: dict[str, dict[str, Anoms]], name: str) -> None:
    expected = SCENARIOS[name][1]
    assert judged["verify"][name] == expected
    assert judged["checkers"][name] == expected


def test_unsubscribe_ends_a_plain_subscription(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 3.10.4 (MQTT-3.10.4-2): after UNSUBACK the server stops adding new messages
    matching the filter for delivery: a message published after it is owed to nobody. (verify
    joined unsubscribes on the null share_group of a plain subscription and reported it lost.)"""
    _judge(judged, "unsubscribed_plain_subscription")


def test_qos0_deliveries_are_never_owed_a_resend(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 4.3.1 (QoS 0: no acknowledgement, no retry) and MQTT-4.4.0-1 (on reconnect
    only unacknowledged QoS 1 / QoS 2 PUBLISHes are resent): a QoS 0 message older than a resend
    is not "skipped"."""
    _judge(judged, "qos0_before_a_resend")


def test_a_qos2_resend_with_the_held_packet_id_is_a_resend(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 4.3.3 and MQTT-4.4.0-1: a QoS 2 PUBLISH not yet released is resent on the
    new connection with its packet id (the receiver, Method B, holds it: not a new delivery), and
    that resend continues the message: it was not skipped."""
    _judge(judged, "qos2_resent_with_its_held_packet_id")


def test_qos2_held_resends_keep_the_original_order(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 4.6 (MQTT-4.6.0-1): resent PUBLISHes go in their original order, also the
    QoS 2 resends of held packet ids."""
    _judge(judged, "qos2_held_resends_out_of_order")


def test_acknowledgements_of_equal_time_keep_record_order(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 4.6 (MQTT-4.6.0-2: PUBACKs in the order the PUBLISHes were received;
    MQTT-4.6.0-5/6: forwarded in that order): two acknowledgements read at the same instant are
    ordered as the publisher recorded them, not by guid."""
    _judge(judged, "acknowledgements_read_at_once")


def test_share_redelivery_is_judged_by_the_previous_members_qos(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 4.8.2 (MQTT-4.8.2-4/5): a QoS 1 message whose member's session ended goes
    to another member (at that member's granted QoS); a QoS 2 one is never sent to another member.
    The QoS the previous member received it at decides, not the new delivery's."""
    _judge(judged, "share_qos1_claim_redelivered_at_qos2")
    _judge(judged, "share_qos2_claim_redelivered_at_qos1")


def test_retained_copy_for_a_new_subscribe_is_no_duplicate(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 3.8.4 (MQTT-3.8.4-3: a SUBSCRIBE replacing a subscription re-sends the
    matching retained messages) and 3.3.1.3 (RETAIN=1 on those): the retained copy (recorded with
    detail "retained") is not a second delivery, and its new packet id is no misuse."""
    _judge(judged, "retained_copy_for_a_new_subscribe")


def test_a_publish_without_guid_sent_twice_may_be_stored_twice(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 4.3.2 (QoS 1: at least once; the publisher resends with DUP=1 after a
    reconnect, MQTT-4.4.0-1) and the design's promise 2: without a guid nothing de-duplicates a
    QoS 1 resend, so a second copy is not a duplicate."""
    _judge(judged, "publish_without_guid_stored_twice")


def test_overlapping_filters_are_owed_at_the_highest_qos(judged: dict[str, dict[str, Anoms]]) -> None:
    """MQTT 5 section 3.3.4 (MQTT-3.3.4-2): with overlapping subscriptions the server delivers at
    the maximum QoS of the matching ones: a QoS 0 filter does not excuse a message the QoS 1 filter
    is owed, whichever came first."""
    _judge(judged, "overlapping_filters_qos0_first")
    _judge(judged, "overlapping_filters_qos1_first")
