"""Unit tests of the total-queue checker on handcrafted histories."""

from __future__ import annotations

from moorline.sim.checkers.total_queue import Delivery, EnqueueOp, check_total_queue


def enq(i: str, inv: int, ok: int | None, q: str = "q", refused: bool = False) -> EnqueueOp:
    return EnqueueOp(i, q, f"v-{i}", inv, ok, refused)


def dlv(i: str, n: int, inv: int, ok: int, q: str = "q") -> Delivery:
    return Delivery(i, q, f"v-{i}", n, inv, ok)


def test_clean_history() -> None:
    v = check_total_queue(
        [enq("a", 0, 1), enq("b", 2, 3)],
        [dlv("a", 1, 4, 5), dlv("b", 1, 6, 7)],
        {("a", 1), ("b", 1)},
    )
    assert v.ok, v.problems()
    assert v.acknowledged == 2 and v.delivered == 2


def test_lost_acknowledged_enqueue() -> None:
    v = check_total_queue([enq("a", 0, 1), enq("b", 2, 3)], [dlv("a", 1, 4, 5)], {("a", 1)})
    assert not v.ok and len(v.lost) == 1 and "b" in v.lost[0]


def test_indeterminate_enqueue_may_be_missing_or_recovered() -> None:
    v = check_total_queue([enq("a", 0, None), enq("b", 0, None)], [dlv("b", 1, 4, 5)], set())
    assert v.ok and v.recovered == 1


def test_unexpected_delivery() -> None:
    assert check_total_queue([], [dlv("x", 1, 0, 1)], set()).unexpected
    # refused for sure, yet delivered
    assert check_total_queue([enq("a", 0, None, refused=True)], [dlv("a", 1, 2, 3)], set()).unexpected
    # another value
    bad = Delivery("a", "q", "other", 1, 2, 3)
    assert check_total_queue([enq("a", 0, 1)], [bad], set()).unexpected


def test_redelivery_needs_a_reason() -> None:
    # not acked: a second delivery (#2) is a legal redelivery
    ok = check_total_queue([enq("a", 0, 1)], [dlv("a", 1, 2, 3), dlv("a", 2, 10, 11)], {("a", 2)})
    assert ok.ok, ok.problems()
    # acked, then delivered again: duplicate
    dup = check_total_queue([enq("a", 0, 1)], [dlv("a", 1, 2, 3), dlv("a", 2, 10, 11)], {("a", 1)})
    assert dup.duplicated
    # two first deliveries (the queue held two copies): duplicate
    two = check_total_queue([enq("a", 0, 1)], [dlv("a", 1, 2, 3), dlv("a", 1, 10, 11)], set())
    assert two.duplicated


def test_fifo_violation() -> None:
    # a acknowledged before b was enqueued, yet b was first-delivered before a's dequeue began
    v = check_total_queue(
        [enq("a", 0, 1), enq("b", 2, 3)],
        [dlv("b", 1, 4, 5), dlv("a", 1, 6, 7)],
        set(),
    )
    assert v.fifo
    # concurrent enqueues may come out in either order
    v2 = check_total_queue(
        [enq("a", 0, 5), enq("b", 2, 3)],
        [dlv("b", 1, 6, 7), dlv("a", 1, 8, 9)],
        set(),
    )
    assert v2.ok, v2.problems()
    # different queues are independent
    v3 = check_total_queue(
        [enq("a", 0, 1, q="q1"), enq("b", 2, 3, q="q2")],
        [dlv("b", 1, 4, 5, q="q2"), dlv("a", 1, 6, 7, q="q1")],
        set(),
    )
    assert v3.ok, v3.problems()
