"""Unit tests of the register linearizability checker on handcrafted histories."""

from __future__ import annotations

from moorline.sim.checkers.linearizable import RegOp, check_register, check_registers


def w(v: str, inv: int, ret: int | None) -> RegOp:
    return RegOp("k", "write", v, None, inv, ret)


def r(v: object, inv: int, ret: int | None) -> RegOp:
    return RegOp("k", "read", None, v, inv, ret)


def cas(expect: object, new: str, out: object, inv: int, ret: int | None) -> RegOp:
    return RegOp("k", "cas", (expect, new), out, inv, ret)


def test_sequential_history_is_linearizable() -> None:
    assert check_register([w("a", 0, 1), r("a", 2, 3), w("b", 4, 5), r("b", 6, 7)]) == "ok"


def test_stale_read_after_completed_write_is_a_violation() -> None:
    assert check_register([w("a", 0, 1), w("b", 2, 3), r("a", 4, 5)]) == "violation"


def test_concurrent_write_may_be_seen_or_not() -> None:
    # the write of b overlaps both reads: a then b is fine
    assert check_register([w("a", 0, 1), w("b", 2, 10), r("a", 3, 4), r("b", 5, 6)]) == "ok"
    # but once b was seen, a later read can't see a again
    assert check_register([w("a", 0, 1), w("b", 2, 10), r("b", 3, 4), r("a", 5, 6)]) == "violation"


def test_read_of_never_written_value_is_a_violation() -> None:
    assert check_register([w("a", 0, 1), r("zzz", 2, 3)]) == "violation"


def test_initial_value_is_none() -> None:
    assert check_register([r(None, 0, 1), w("a", 2, 3)]) == "ok"
    assert check_register([w("a", 0, 1), r(None, 2, 3)]) == "violation"


def test_indeterminate_write_may_take_effect_late_or_never() -> None:
    # timed-out write of b: may appear long after it was invoked
    assert check_register([w("a", 0, 1), w("b", 2, None), r("a", 10, 11), r("b", 20, 21)]) == "ok"
    # or never
    assert check_register([w("a", 0, 1), w("b", 2, None), r("a", 10, 11), r("a", 20, 21)]) == "ok"
    # but not before it was invoked
    assert check_register([w("a", 0, 1), r("b", 2, 3), w("b", 5, None)]) == "violation"


def test_cas_semantics() -> None:
    assert check_register([w("a", 0, 1), cas("a", "b", True, 2, 3), r("b", 4, 5)]) == "ok"
    # a successful cas whose expectation can't hold
    assert check_register([w("a", 0, 1), cas("x", "b", True, 2, 3)]) == "violation"
    # a failed cas reporting the current value
    assert check_register([w("a", 0, 1), cas("x", "b", ("fail", "a"), 2, 3), r("a", 4, 5)]) == "ok"
    assert check_register([w("a", 0, 1), cas("a", "b", ("fail", "a"), 2, 3)]) == "violation"
    # two successful cas from the same value (lost update)
    h = [w("a", 0, 1), cas("a", "b", True, 2, 5), cas("a", "c", True, 3, 6)]
    assert check_register(h) == "violation"


def test_pruning_keeps_observed_indeterminate_writes() -> None:
    # the indeterminate write of b is observed, so it must explain the read
    h = [w("a", 0, 1), w("b", 2, None), r("b", 3, 4)]
    assert check_register(h) == "ok"
    assert check_register(h, prune=False) == "ok"
    bad = [w("a", 0, 1), w("b", 5, None), r("b", 2, 3)]
    assert check_register(bad) == "violation"
    assert check_register(bad, prune=False) == "violation"


def test_budget_exhaustion_is_unknown_not_ok() -> None:
    h = [w(f"v{i}", i * 10, None) for i in range(30)] + [r("nope", 1000, 1001)]
    assert check_register(h, max_steps=50, prune=False) in ("unknown", "violation")


def test_check_registers_partitions_by_key() -> None:
    ops = [
        RegOp("x", "write", "1", None, 0, 1),
        RegOp("y", "write", "2", None, 0, 1),
        RegOp("x", "read", None, "1", 2, 3),
        RegOp("y", "read", None, "1", 2, 3),  # y never held "1"
    ]
    assert check_registers(ops) == {"x": "ok", "y": "violation"}
