"""The cluster fault schedule never takes a majority away, and every fault ends before it does."""

from __future__ import annotations

import random

import pytest

from moorline.chaos import schedule


def _check(episodes: list[schedule.Episode], names: list[str], counts: dict[str, int]) -> None:
    budget = schedule.max_faulty(len(names))
    assert sorted(e.kind for e in episodes) == sorted(k for k, n in counts.items() for _ in range(n))
    moments = sorted({e.start_s for e in episodes} | {e.end_s for e in episodes})
    for t in moments:
        faulty = [n for e in episodes if e.start_s <= t < e.end_s for n in e.nodes]
        assert len(faulty) == len(set(faulty)), f"a node in two faults at {t}: {episodes}"
        assert len(faulty) <= budget, f"{faulty} faulty at {t:.2f}s of {names}: {episodes}"
    for e in episodes:
        assert e.end_s > e.start_s and set(e.nodes) <= set(names) and e.nodes
        assert len(e.nodes) == 1 or e.kind == "partition"
    # Executed in order, one step after another: ends before begins at the same moment.
    steps = schedule.steps(episodes)
    assert [s.at_s for s in steps] == sorted(s.at_s for s in steps)
    open_: set[schedule.Episode] = set()
    for s in steps:
        if s.begin:
            open_.add(s.episode)
            assert sum(len(e.nodes) for e in open_) <= budget
        else:
            open_.remove(s.episode)
    assert not open_  # everything healed at the end


@pytest.mark.parametrize("n", [3, 5])
def test_chaos_schedule_keeps_a_majority_healthy_for_many_seeds(n: int) -> None:
    names = [f"n{i}" for i in range(1, n + 1)]
    counts = {"kill": 3, "pause": 2, "partition": 3}
    sizes = set()
    for seed in range(200):
        episodes = schedule.plan(names, counts, 20.0, random.Random(seed), truncate=True)
        _check(episodes, names, counts)
        assert all(e.truncate == (e.kind == "kill") for e in episodes)
        sizes |= {len(e.nodes) for e in episodes if e.kind == "partition"}
    assert sizes == ({1} if n == 3 else {1, 2})  # five nodes: a minority of two is cut off too


def test_chaos_schedule_is_seeded() -> None:
    names = ["n1", "n2", "n3"]
    counts = {"kill": 2, "pause": 1, "partition": 1}
    a = schedule.plan(names, counts, 20.0, random.Random(4))
    assert a == schedule.plan(names, counts, 20.0, random.Random(4))
    assert a != schedule.plan(names, counts, 20.0, random.Random(5))


def test_chaos_schedule_needs_a_node_to_spare() -> None:
    with pytest.raises(ValueError, match="3 or 5"):
        schedule.plan(["n1"], {"kill": 1}, 10.0, random.Random(1))
    with pytest.raises(ValueError, match="unknown"):
        schedule.plan(["n1", "n2", "n3"], {"bitflip": 1}, 10.0, random.Random(1))
