"""Seeds of the cluster simulator as CI runs them: whole 3- and 5-node clusters of real node code,
the model clients and the default mix (each seed's drawn node configuration, timed syncs, aimed
crashes), with every checker; a smaller pool of the plain mix (production configuration, inline
syncs: ``plain_mix()``); and a seed replays exactly (the same trace hash twice).

The 3-node seeds run in a pool of worker processes (one per core, at most two): each seed is a
whole world in one process, so they are independent, and CI's budget of about five minutes covers
the fifty of them. Each seed is still its own test, with its replay command when it fails."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from moorline.coverage import RARE_NODE_PATHS
from moorline.sim.cluster.runner import RunConfig, SeedResult, plain_mix, run_seed

pytestmark = pytest.mark.timeout(900)

CI_SEEDS_3 = range(100, 150)  # the bounded run CI makes: about 3-5 minutes on two cores
CI_SEEDS_5 = range(200, 202)


def _run3(seed: int) -> SeedResult:
    return run_seed(seed, nodes=3)


def _in_workers(run: Callable[[int], SeedResult], seeds: range) -> dict[int, SeedResult]:
    """``run`` of every seed, in a pool of worker processes (one per core, at most two)."""
    workers = max(1, min(2, os.cpu_count() or 1))
    # spawn: the test process may hold threads (a Spark gateway) a fork would copy half-alive.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(seeds, pool.map(run, seeds), strict=True))


@pytest.fixture(scope="module")
def three_node_results() -> Iterator[dict[int, SeedResult]]:
    yield _in_workers(_run3, CI_SEEDS_3)


@pytest.mark.parametrize("seed", CI_SEEDS_3)
def test_three_node_seeds_have_no_violation(seed: int, three_node_results: dict[int, SeedResult]) -> None:
    r = three_node_results[seed]
    assert r.ok, f"{[(f.kind, f.detail) for f in r.findings[:10]]}\nconfig {r.tuning}\nreplay: {r.replay_command()}"
    assert r.counts.get("records", 0) > 100  # the clients did work
    assert sum(v for k, v in r.counts.items() if k != "records") > 0  # faults were injected
    assert r.draw_config and r.timed_sync and r.aimed_crashes  # the default mix


# The plain mix on other seeds: production-sized configuration (no drawn knob), syncs inline,
# crashes only between scheduler steps, as every seed ran before issue 28; the common path with
# the configuration operators run. (Before drawn configuration was the default, this pool ran 24
# drawn seeds; the default pool above draws now.)
CI_PLAIN_SEEDS = range(150, 174)


def _run3_plain(seed: int) -> SeedResult:
    return run_seed(seed, nodes=3, cfg=plain_mix())


@pytest.fixture(scope="module")
def plain_results() -> Iterator[dict[int, SeedResult]]:
    yield _in_workers(_run3_plain, CI_PLAIN_SEEDS)


@pytest.mark.parametrize("seed", CI_PLAIN_SEEDS)
def test_seeds_of_the_plain_mix_have_no_violation(seed: int, plain_results: dict[int, SeedResult]) -> None:
    r = plain_results[seed]
    assert r.ok, f"{[(f.kind, f.detail) for f in r.findings[:10]]}\nreplay: {r.replay_command()}"
    assert r.tuning == {} and "--no-draw-config --no-timed-sync --no-aimed-crashes" in r.replay_command()


def test_the_default_seeds_reach_every_rare_node_path(three_node_results: dict[int, SeedResult]) -> None:
    """Coverage is measured, not assumed (moorline/coverage.py): with production-sized defaults no
    seed snapshots, installs or reclaims anything; the drawn configurations must reach every one."""
    reached = {name for r in three_node_results.values() for name, n in r.paths.items() if n}
    missing = sorted(set(RARE_NODE_PATHS) - reached)
    assert missing == [], f"rare node paths no drawn seed reached: {missing}"


@pytest.mark.parametrize("seed", CI_SEEDS_5)
def test_five_node_seeds_have_no_violation(seed: int) -> None:
    r = run_seed(seed, nodes=5)
    assert r.ok, f"{[(f.kind, f.detail) for f in r.findings[:10]]}\nreplay: {r.replay_command()}"


def test_a_seed_replays_exactly() -> None:
    a, b = run_seed(7), run_seed(7)
    assert (a.trace_hash, a.steps, a.counts) == (b.trace_hash, b.steps, b.counts)
    assert run_seed(8).trace_hash != a.trace_hash


# Five nodes with shard.learners = "none" (issue 32): each shard on its three voters, the other two
# nodes read it through reader feeds (node/replication/reader.py) under every fault of the default
# mix, joins and replacements included.
CI_SEEDS_5_VOTERS_ONLY = range(300, 316)
READER_PATHS = ("reader_feed_started", "reader_part_merged", "reader_became_member", "reader_left_group",
                "reader_followed_anew", "reader_items_resent")


def _run5_voters_only(seed: int) -> SeedResult:
    return run_seed(seed, nodes=5, cfg=RunConfig(learners="none"))


@pytest.fixture(scope="module")
def voters_only_results() -> Iterator[dict[int, SeedResult]]:
    yield _in_workers(_run5_voters_only, CI_SEEDS_5_VOTERS_ONLY)


@pytest.mark.parametrize("seed", CI_SEEDS_5_VOTERS_ONLY)
def test_five_node_seeds_with_shards_on_their_voters_only_have_no_violation(
        seed: int, voters_only_results: dict[int, SeedResult]) -> None:
    r = voters_only_results[seed]
    assert r.ok, f"{[(f.kind, f.detail) for f in r.findings[:10]]}\nreplay: {r.replay_command()}"
    assert r.learners == "none" and "--learners none" in r.replay_command()
    assert r.counts.get("records", 0) > 100


def test_the_voters_only_seeds_reach_every_reader_path(voters_only_results: dict[int, SeedResult]) -> None:
    """The reader feeds' rare paths (a feed started, a client's part merged, a node added to a
    group it read, one removed from a group it held, a feed followed anew after its leader went
    quiet, items sent again after a loss) are reached, not assumed."""
    reached = {name for r in voters_only_results.values() for name, n in r.paths.items() if n}
    assert [p for p in READER_PATHS if p not in reached] == []


def test_a_reader_feed_resumed_one_past_is_caught_with_shards_on_their_voters_only(
        voters_only_results: dict[int, SeedResult]) -> None:
    """The broken build ``stream_resume_skips_one`` (a resumed reader feed starts one past where it
    should: testing/faults.py) is caught on the first seed of the pool above, which the unmutated
    build runs clean."""
    seed = CI_SEEDS_5_VOTERS_ONLY[0]
    assert voters_only_results[seed].ok
    r = run_seed(seed, nodes=5, switches=frozenset({"stream_resume_skips_one"}), cfg=RunConfig(learners="none"))
    assert not r.ok and {f.kind for f in r.findings} & {"lost", "stuck", "out_of_order"}, r.findings[:5]
