"""Which nodes vote in which shard, and which of them leads a fresh cluster's shard.

Pure and deterministic: every node computes the same table from the cluster's key (its id and its
initial members), the node names, the shard count and ``shard.replicas``, so no node has to ask
another at bootstrap. The nodes are ordered by a BLAKE2b hash of (key, name) — a permutation of
the cluster's own, never Python's salted ``hash()`` — and voter slots are dealt round that ring,
``replicas`` per shard, so each node votes in ``replicas * shards / n`` shards (rounded up or
down). Each shard's preferred leader is the voter that leads fewest so far, so leaders start
spread as evenly, and the leader rebalancer moves them back there after failures.

With ``shard.learners = "all"`` (the default) every node keeps a replica of every shard: the
shard's voters decide commits (an acknowledgement is durable on a majority of *them*), the other
nodes follow as learners, which never count for a quorum or vote, so a learner's slowness or death
costs the shard nothing. Learners are what let every node serve any session and read any shard
from its own disk (monotonic views through the session shard's commit, delivery from a local
cursor); the price is disk and apply CPU on every node, not only on the voters. With ``"none"`` a
shard starts on its voters only (the reconciler adds a learner just while one catches up to be
promoted). Which of the two a cluster *started* with is part of each group's initial configuration,
so every member must place with the same one (boot.py takes it from the data directory, where the
cluster's creation recorded it); it is not in the layout fingerprint, as learners count for no
quorum at bootstrap.
"""

from __future__ import annotations

from dataclasses import dataclass

from moorline.hashing import guid128
from moorline.invariant import invariant

VALID_REPLICAS = (1, 3, 5)
VALID_LEARNERS = ("all", "none")  # shard.learners


@dataclass(frozen=True)
class ShardPlacement:
    voters: tuple[str, ...]  # node names; voters[0] is the preferred leader
    learners: tuple[str, ...]

    @property
    def preferred_leader(self) -> str:
        return self.voters[0]


def effective_replicas(replicas: int, nodes: int) -> int:
    """``shard.replicas``, or every node when there are fewer."""
    return min(replicas, nodes)


def place_shards(cluster_key: str, names: list[str] | tuple[str, ...], shard_count: int,
                 replicas: int, learners: str = "all") -> list[ShardPlacement]:
    """Each shard's voters (the preferred leader first) and learners: every other node with
    ``learners = "all"``, none with ``"none"``. The voters do not depend on ``learners``."""
    invariant(len(set(names)) == len(names) and len(names) > 0, "node names must be distinct")
    invariant(replicas in VALID_REPLICAS, "shard.replicas is 1, 3 or 5")
    invariant(learners in VALID_LEARNERS, "shard.learners is 'all' or 'none'")
    n = len(names)
    r = effective_replicas(replicas, n)
    ring = sorted(names, key=lambda name: (guid128("placement", cluster_key, name), name))
    leads = dict.fromkeys(ring, 0)
    table = []
    for shard in range(shard_count):
        # Voter slots are dealt round the ring: shard s takes slots s*r .. s*r + r - 1, so every
        # node gets floor or ceil of r * shards / n of them, and r <= n keeps a shard's distinct.
        voters = [ring[(shard * r + k) % n] for k in range(r)]
        leader = min(voters, key=lambda v: (leads[v], voters.index(v)))
        leads[leader] += 1
        voters.remove(leader)
        followers = () if learners == "none" else tuple(n for n in names if n != leader and n not in voters)
        table.append(ShardPlacement((leader, *voters), followers))
    return table


def layout_fingerprint(shard_count: int, replicas: int, nodes: int) -> str:
    """What every member must agree on before it joins a group: two nodes that placed voters
    differently would count different majorities for one shard (two leaders in one term). Not
    ``shard.learners``: learners count for no majority, and a cluster switches it while running."""
    return f"shards={shard_count},replicas={effective_replicas(replicas, nodes)},hash=crc32c,ring=blake2b-v1"
