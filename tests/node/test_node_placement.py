"""Shard placement (moorline/node/replication/placement.py): every node computes the same voters for every
shard from the cluster's key, evenly spread, with the preferred leaders spread too."""

from __future__ import annotations

from collections import Counter

import pytest

from moorline.invariant import InvariantViolation
from moorline.node.replication.placement import layout_fingerprint, place_shards

NAMES5 = ["n1", "n2", "n3", "n4", "n5"]


@pytest.mark.parametrize("shards", [1, 7, 16, 64, 100])
@pytest.mark.parametrize(("names", "replicas"), [(NAMES5, 3), (NAMES5, 5), (NAMES5, 1), (NAMES5[:3], 3),
                                                 (NAMES5[:3], 5), (["solo"], 3)])
def test_voters_are_even_distinct_and_leaders_spread(names: list[str], replicas: int, shards: int) -> None:
    table = place_shards("moorline/" + ",".join(names), names, shards, replicas)
    r = min(replicas, len(names))
    assert len(table) == shards
    for p in table:
        assert len(p.voters) == r and len(set(p.voters)) == r
        assert set(p.voters) | set(p.learners) == set(names) and not set(p.voters) & set(p.learners)
        assert p.preferred_leader == p.voters[0]
    votes = Counter(v for p in table for v in p.voters)
    leads = Counter(p.preferred_leader for p in table)
    # every node within one of its fair share: replicas * shards / n voterships, shards / n leads
    for name in names:
        assert abs(votes[name] - r * shards / len(names)) < 1, (name, votes)
        assert abs(leads[name] - shards / len(names)) < 1, (name, leads)


def test_same_on_every_node_and_independent_of_name_order() -> None:
    a = place_shards("moorline/n1,n2,n3,n4,n5", NAMES5, 16, 3)
    b = place_shards("moorline/n1,n2,n3,n4,n5", list(reversed(NAMES5)), 16, 3)
    assert [p.voters for p in a] == [p.voters for p in b]


def test_the_cluster_key_seeds_the_ring() -> None:
    rings = {tuple(p.preferred_leader for p in place_shards(f"cluster-{i}", NAMES5, 5, 3)) for i in range(20)}
    assert len(rings) > 5  # not one fixed order for every cluster


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvariantViolation):
        place_shards("k", ["n1", "n1"], 4, 3)
    with pytest.raises(InvariantViolation):
        place_shards("k", NAMES5, 4, 2)


def test_layout_names_what_members_must_agree_on() -> None:
    assert layout_fingerprint(16, 3, 5) != layout_fingerprint(16, 5, 5)
    assert layout_fingerprint(16, 3, 5) != layout_fingerprint(32, 3, 5)
    assert layout_fingerprint(16, 5, 3) == layout_fingerprint(16, 3, 3)  # both: every node votes


@pytest.mark.parametrize(("names", "replicas"), [(NAMES5, 3), (NAMES5, 5), (NAMES5, 1), (NAMES5[:3], 3), (["solo"], 3)])
def test_learners_none_places_the_same_voters_and_no_learners(names: list[str], replicas: int) -> None:
    everywhere = place_shards("moorline/" + ",".join(names), names, 16, replicas)
    voters_only = place_shards("moorline/" + ",".join(names), names, 16, replicas, learners="none")
    assert [p.voters for p in voters_only] == [p.voters for p in everywhere]  # leaders first, as before
    assert all(p.learners == () for p in voters_only)
    assert place_shards("moorline/" + ",".join(names), names, 16, replicas, learners="all") == everywhere


def test_learners_other_than_all_or_none_is_refused() -> None:
    with pytest.raises(InvariantViolation):
        place_shards("k", NAMES5, 4, 3, learners="some")
