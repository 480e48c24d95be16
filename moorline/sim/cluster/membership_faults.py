"""Membership changes in the cluster simulator's default fault mix, and their checkers.

Drawn from the seed's own stream (``f"{seed}/membership"``, so the node faults' draws stay as they
were), every 3-8 virtual seconds of the fault phase, through a live node's ``MembershipDriver``
exactly as the HTTP routes call it:

- **forget** a crashed node (at most once a seed, and only while a node is down): the driver's own
  check refuses it when a shard would be left without a live majority (counted, not a finding).
  A forgotten node is never restarted; with three nodes the cluster goes on with two.
- **replica race** (#7209 scenario Two): an operator removes a voter of a shard (three times in four
  a voter on a node that is down, paused or cut off, when there is one), then adds it back with ``add-replica`` at the
  moment the reconciler grows the shard too, and again (a learner is promoted by a second
  add-replica once caught up): the member table refuses whichever comes second (409).
- **drain** a healthy node (the server's drain, as ``moorline cluster drain``), then stop it; it
  starts again 1-8 s later, as in a rolling restart.

With ``joins`` (the whole default mix; ``--no-joins`` turns it off), from a stream of their own
(``f"{seed}/join"``, so the membership and node-fault draws stay as they were until one happens):

- **join** (7 seeds in 10, once, 2-15 s into the fault phase): a new node (n4 of three, n6 of five)
  is admitted through a live node's driver as ``moorline cluster join`` admits it, then started as
  ``moorline run --node-id N --cluster ADDR --join SEEDS`` with the seeds the answer's start command
  names (no ``--initial-cluster``): a member binds its storage and welcomes it, it becomes a learner
  of every shard and the reconciler gives it its share of voters. Refused or unanswered: asked
  again 2-4 s later (three times at most).
- **replace** (3 forgets in 4 that were answered 200, 1-5 s after): the forgotten node's data
  directory is wiped (a new disk), it is admitted again under its name and started with ``--join``:
  a new member, with a new node id and storage id.

A node started to join counts as faulty until it is ready (no node fault is added meanwhile), and
must be ready by the end (``join_not_completed``). While a shard is below its target or a change is in progress, no new node fault starts (a shard
of two voters has no fault to spare); connection resets go on.

Checkers:

- ``ConfRules`` wraps every leader's ``propose_conf_change`` (re-wrapped as replicas come and go):
  at most one change pending per group (``conf_two_pending``), one voter at a time
  (``conf_multi_voter_change``), a learner promoted only within ``cluster.promote_lag_entries``
  of the leader's log (``conf_promote_lagging``), no reconciler growth of a shard that still has
  a voter on a forgotten node (``conf_grow_before_shrink``: shrink before grow; an operator's
  add-replica may win that race and is not judged), and every leader counting the voters of the
  latest configuration in its log (``conf_not_in_force``).
- ``Convergence``: after the faults heal, every shard reaches its target voter count on live,
  non-forgotten nodes (the target, or every such node when there are fewer; the metadata group's
  target is the initial members' count: a replaced node's voter comes back), with no voter on a
  forgotten node, and (with joins) every live active node's storage follows every group as a voter
  or learner, within ``CONVERGE_BOUND_S`` virtual seconds (``membership_not_converged``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moorline.raft.types import ConfChange, ConfChangeType

if TYPE_CHECKING:
    from moorline.sim.cluster.world import SimNode, World

GAP_S = (3.0, 8.0)  # between membership events of the fault phase
RACE_ADD_S = (0.2, 2.0)  # the operator's add-replica after its remove (the reconciler runs 0.5 s after)
RACE_AGAIN_S = (1.0, 3.0)  # and again (a learner is promoted by a second add-replica)
RACE_ADDS = 3
DRAIN_TIMEOUT_S = 5.0  # cluster.drain_timeout_s of the simulator's nodes (WorldConfig)
MIN_VOTERS_TO_REMOVE = 3  # a race's remove-replica leaves a shard two voters at least (see _race)
HOLD_MAX_S = 20.0  # node faults wait at most this long for the shards to be back at target
CONVERGE_BOUND_S = 30.0  # after the heal: every shard at target within this (virtual seconds)
JOIN_P = 0.7  # the share of seeds (with joins) in which a new node joins
JOIN_AT_S = (2.0, 15.0)  # into the fault phase
REPLACE_P = 0.75  # the share of answered forgets after which the node is replaced (wiped, joins again)
REPLACE_AFTER_S = (1.0, 5.0)
ADMIT_RETRY_S = (2.0, 4.0)  # an admission refused or unanswered is asked again after this
ADMIT_TRIES = 3


def live_nodes(world: World) -> list[SimNode]:
    return [sn for sn in world.nodes if sn.node is not None and sn.ready and not sn.crashed]


def group_confs(world: World) -> dict[int, Any]:
    """Each group's configuration in force, from its leader (else from the replica furthest ahead)."""
    out: dict[int, Any] = {}
    best: dict[int, tuple[int, int]] = {}
    for sn in live_nodes(world):
        assert sn.node is not None
        for h in sn.node.groups:
            raft = h.raft
            rank = (1 if raft.is_leader else 0, raft.log.last_index())
            if h.shard not in best or rank > best[h.shard]:
                best[h.shard], out[h.shard] = rank, raft.active_conf_state
    return out


def member_ids(world: World) -> dict[str, tuple[int, str]]:
    """Node name -> its member id (node id, storage id), as any live replica's member table has it."""
    for sn in live_nodes(world):
        assert sn.node is not None
        table = sn.node.membership.table
        if table is not None:
            return {m.name: m.member_id for m in table.members.values()}
    return {}


def member_replicas(world: World, names: list[str], group: int) -> list[str]:
    """Of ``names``, the nodes whose storage is a member (voter or learner) of ``group`` in the
    configuration in force: a replica removed from a group is no copy of it any more."""
    conf = group_confs(world).get(group)
    ids = member_ids(world)
    if conf is None or not ids:
        return names
    members = set(conf.members())
    return [n for n in names if ids.get(n) in members]


class MembershipPlan:
    def __init__(self, world: World, rng: random.Random, plan: Any, joins: bool = False) -> None:
        self.world = world
        self.rng = rng
        self.plan = plan  # runner.FaultPlan: its crashed nodes, and their restarts
        self.counts: dict[str, int] = {}
        self.next_at = world.scheduler.now + rng.uniform(*GAP_S)
        self.forgotten_ids: set[tuple[int, str]] = set()
        self.pending: list[tuple[float, Callable[[], None]]] = []  # the operator's later commands
        self.hold_since: float | None = None
        self.forgetting: tuple[str, float] | None = None  # a forget asked, not answered: (node, its restart)
        self.draining: dict[str, float] = {}  # node -> how long it stays down once stopped
        self.stopped: list[str] = []  # drained nodes whose stop finished (their loop ends at the next tick)
        # Joins and replacements (``joins``): their own stream, drawn only when they are on.
        self.joins = joins
        self.join_rng = random.Random(f"{world.seed}/join")
        self.join_at: float | None = None  # a new node's admission is due
        self.replace_at: tuple[str, float] | None = None  # a forgotten node's replacement is due
        self.replace_drawn = False  # one replacement a seed at most
        self.admitting: str | None = None  # an admission asked, not answered
        self.tries: dict[str, int] = {}
        self.joining: dict[str, float] = {}  # started to join, not ready yet: name -> since
        self.joined: list[str] = []  # every node started to join in this run
        if joins and self.join_rng.random() < JOIN_P:
            self.join_at = self.now + self.join_rng.uniform(*JOIN_AT_S)

    @property
    def now(self) -> float:
        return self.world.scheduler.now

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    # --- the fault phase -------------------------------------------------------------------------
    def tick(self) -> None:
        """Called every 0.1 s of the fault phase."""
        self._drained()
        if self.joins:
            self._joins()
        for item in [p for p in self.pending if p[0] <= self.now]:
            self.pending.remove(item)
            item[1]()
        if self.now < self.next_at:
            return
        self.next_at = self.now + self.rng.uniform(*GAP_S)
        kind = self.rng.choices(["forget", "replica_race", "drain", "none"], weights=[2, 3, 2, 1])[0]
        if kind == "forget" and not self._forget():
            kind = "replica_race"
        if kind == "drain" and not self._drain():
            kind = "replica_race"
        if kind == "replica_race":
            self._race()

    def hold(self) -> bool:
        """Whether node faults wait: a shard below target or a change in progress (bounded)."""
        busy = self.below_target() or any(
            sn.node.membership.table is not None and sn.node.membership.table.moves
            for sn in live_nodes(self.world) if sn.node is not None)
        if not busy:
            self.hold_since = None
            return False
        if self.hold_since is None:
            self.hold_since = self.now
        return self.now - self.hold_since < HOLD_MAX_S

    def _via(self) -> SimNode | None:
        faulty = self.plan.faulty()
        ok = [sn for sn in live_nodes(self.world) if sn.name not in faulty]
        return self.rng.choice(ok) if ok else None

    def _call(self, via: SimNode, what: str, coro: Any) -> None:
        """Run an operator's command on ``via``'s loop; its answer goes to the trace."""
        assert via.loop is not None
        task = via.loop.create_task(coro)

        def done(t: Any) -> None:
            if t.cancelled() or t.exception() is not None:
                self.world.note(f"membership: {what} via {via.name}: no answer")
                self._count("membership_no_answer")
                if what.startswith("forget"):
                    self._forget_answered(what.split()[1], False)
                return
            r = t.result()
            self.world.note(f"membership: {what} via {via.name}: {r.status}")
            self._count(f"{what.split()[0]}_{r.status}")
            if what.startswith("forget"):
                self._forget_answered(what.split()[1], r.status == 200)

        task.add_done_callback(done)

    def _forget(self) -> bool:
        w = self.world
        if w.forgotten or self.forgetting is not None or not self.plan.down_until:
            return False
        candidates = sorted(self.plan.down_until)
        name = self.rng.choice(candidates)
        via = self._via()
        if via is None or via.node is None:
            return False
        self._count("forget")
        w.note(f"membership: forget {name} (down)")
        self.forgetting = (name, self.plan.down_until.pop(name))  # not restarted while the answer is due
        self._call(via, f"forget {name}", via.node.membership.forget(name, False))
        return True

    def _forget_answered(self, name: str, forgotten: bool) -> None:
        w = self.world
        asked = self.forgetting is not None and self.forgetting[0] == name
        restart_at = self.forgetting[1] if self.forgetting is not None and asked else self.now
        if asked:
            self.forgetting = None
        if not forgotten:  # refused: it comes back as it would have
            if asked:
                self.plan.down_until[name] = max(restart_at, self.now)
            return
        w.forgotten.add(name)  # gone for good: never restarted
        self.plan.down_until.pop(name, None)
        sn = next(x for x in w.nodes if x.name == name)
        if not sn.crashed:  # answered after the heal restarted it: down again, for good
            w.crash(sn)
        ids = member_ids(w)
        if name in ids:
            self.forgotten_ids.add(ids[name])
        w.note(f"membership: {name} forgotten")
        if self.joins and not self.replace_drawn and self.join_rng.random() < REPLACE_P:
            self.replace_drawn = True
            # The replacement's own tries (a node that joined earlier in the seed counted its join's):
            # its first try wipes the data directory.
            self.tries.pop(name, None)
            self.replace_at = (name, self.now + self.join_rng.uniform(*REPLACE_AFTER_S))

    def _drain(self) -> bool:
        """A node drained as ``moorline cluster drain`` drains it (the server's drain: CONNECTs
        refused, leaderships handed over, connections closed once answered), then stopped; it
        starts again 1-8 s later, as in a rolling restart."""
        w, plan = self.world, self.plan
        minority = (len(w.nodes) - 1) // 2
        faulty = plan.faulty()
        if len(faulty) >= minority or self.hold():
            return False
        ok = [sn for sn in live_nodes(w) if sn.name not in faulty and sn.assembly is not None]
        if not ok:
            return False
        sn = self.rng.choice(ok)
        self._count("drain")
        self.draining[sn.name] = self.rng.uniform(*plan.cfg.crash_down_s)
        plan._record_fault(sn.name, "drain")
        w.note(f"membership: drain {sn.name}")
        assert sn.loop is not None and sn.assembly is not None
        # What ``moorline run`` does on a drain request: the assembly's shutdown (drain, hand-over, stop).
        task = sn.loop.create_task(sn.assembly.shutdown("simulator: drain"))
        task.add_done_callback(lambda t, name=sn.name: self.stopped.append(name))  # type: ignore[misc]
        return True

    def _drained(self) -> None:
        """A drained node's process exits (from the world's side: its loop ends, nothing is lost)."""
        w = self.world
        for name in list(self.stopped):
            self.stopped.remove(name)
            down = self.draining.pop(name, 1.0)
            sn = next(x for x in w.nodes if x.name == name)
            w.note(f"membership: {name} drained and stopped")
            w.crash(sn, lose_unsynced=False)
            self.plan.down_until[name] = self.now + down

    def _race(self) -> None:
        w = self.world
        confs = group_confs(w)
        via = self._via()
        ids = member_ids(w)
        if via is None or via.node is None or not ids:
            return
        shards = sorted(s for s in confs if s != via.node.meta_group)
        if not shards:
            return
        shard = self.rng.choice(shards)
        by_id = {v: k for k, v in ids.items()}
        voters = [by_id[v] for v in confs[shard].voters if v in by_id and by_id[v] not in w.forgotten]
        if len(confs[shard].voters) < MIN_VOTERS_TO_REMOVE:
            # Not down to one voter: a shard of one voter with no learner compacts its log past
            # its last snapshot (ShardHost.advance), and growing it again then fails the group
            # ("need a snapshot but storage has none"; seed 4 found it, docs/simulation.md).
            return
        faulty = [v for v in voters if v in self.plan.faulty()]
        name = self.rng.choice(faulty if faulty and self.rng.random() < 0.75 else voters)
        self._count("replica_race")
        w.note(f"membership: shard {shard}: remove-replica {name}, then add-replica racing the reconciler")
        self._call(via, f"remove-replica {name} {shard}", via.node.membership.change_replica(shard, name, "remove"))
        at = self.now + self.rng.uniform(*RACE_ADD_S)
        for i in range(RACE_ADDS):
            self.pending.append((at, self._adder(shard, name, i)))
            at += self.rng.uniform(*RACE_AGAIN_S)

    def _adder(self, shard: int, name: str, i: int) -> Callable[[], None]:
        def add() -> None:
            via = self._via()
            if via is None or via.node is None or name in self.world.forgotten:
                return
            self._call(via, f"add-replica {name} {shard}", via.node.membership.change_replica(shard, name, "add"))
        return add

    # --- joins and replacements --------------------------------------------------------------
    def _joins(self) -> None:
        w = self.world
        for name in list(self.joining):
            sn = next(x for x in w.nodes if x.name == name)
            if sn.ready:
                del self.joining[name]
                assert sn.node is not None
                w.note(f"membership: {name} joined (ready), node id {sn.node.member[0]}")
            elif sn.boot_error is not None or sn.crashed:
                del self.joining[name]  # join_not_completed at the end, unless it comes back
        if self.admitting is not None:
            return
        if self.join_at is not None and self.now >= self.join_at:
            self.join_at = None
            index = max(sn.index for sn in w.nodes) + 1
            self._admit(f"n{index}", f"10.0.0.{index}", None)
        elif self.replace_at is not None and self.now >= self.replace_at[1]:
            name = self.replace_at[0]
            self.replace_at = None
            sn = next(x for x in w.nodes if x.name == name)
            if name not in w.forgotten or not sn.crashed:
                return
            if not self.tries.get(name):
                w.wipe(sn)  # a new disk: the replacement
                self._count("replace")
            self._admit(name, sn.host, sn)

    def _admit(self, name: str, host: str, sn: SimNode | None) -> None:
        """``moorline cluster join NAME --cluster HOST:PORT`` through a live node; once admitted the
        node starts as the answer's start command says (``--join`` its seeds)."""
        from moorline.sim.cluster.world import CLUSTER_PORT

        w = self.world
        via = self._via()
        tries = self.tries[name] = self.tries.get(name, 0) + 1
        kind = "join" if sn is None else "replace"
        if via is None or via.node is None:
            self._admit_later(name, sn)
            return
        if sn is None:
            self._count("join")
        cluster = f"{host}:{CLUSTER_PORT}"
        w.note(f"membership: {kind} {name}: admit {name} --cluster {cluster} via {via.name} (try {tries})")
        self.admitting = name
        assert via.loop is not None
        task = via.loop.create_task(via.node.membership.admit(name, cluster, ""))

        def done(t: Any) -> None:
            self.admitting = None
            if t.cancelled() or t.exception() is not None:
                w.note(f"membership: admit {name} via {via.name}: no answer")
                self._count("admit_no_answer")
                self._admit_later(name, sn)
                return
            r = t.result()
            w.note(f"membership: admit {name} via {via.name}: {r.status}")
            self._count(f"admit_{r.status}")
            if r.status not in (200, 201):
                self._admit_later(name, sn)
                return
            start = str(r.body.get("start", ""))
            seeds = start.split("--join", 1)[1].strip() if "--join" in start else ""
            self._start_joining(name, sn, seeds or f"{via.host}:{CLUSTER_PORT}")

        task.add_done_callback(done)

    def _admit_later(self, name: str, sn: SimNode | None) -> None:
        if self.tries.get(name, 0) >= ADMIT_TRIES:
            self.world.note(f"membership: {name} not admitted after {ADMIT_TRIES} tries")
            return
        at = self.now + self.join_rng.uniform(*ADMIT_RETRY_S)
        if sn is None:
            self.join_at = at
        else:
            self.replace_at = (name, at)

    def _start_joining(self, name: str, sn: SimNode | None, seeds: str) -> None:
        w = self.world
        if sn is None:
            sn = w.add_node(name)
        else:
            w.forgotten.discard(name)  # a new member under the old name
        sn.join = seeds
        self.joining[name] = self.now
        if name not in self.joined:
            self.joined.append(name)
        w.note(f"membership: {name} starts with --join {seeds}")
        w.start(sn)

    def join_findings(self) -> list[tuple[str, str]]:
        """Every node started to join (and not forgotten since) is up at the end."""
        w = self.world
        out = []
        for name in self.joined:
            sn = next(x for x in w.nodes if x.name == name)
            if name not in w.forgotten and not sn.ready:
                out.append(("join_not_completed", f"{name} started with --join {sn.join} and is not up at the end"
                            + (f": {sn.boot_error!r}" if sn.boot_error is not None else "")))
        return out

    def settle(self) -> None:
        """Before the heal: the operator's commands still to come are dropped; a forget not answered
        yet is let go (the node restarts with the others)."""
        self.pending.clear()
        end = self.now + DRAIN_TIMEOUT_S + 1.0
        while self.draining and self.now < end:  # a drain under way ends first (bounded)
            self.world.run_for(0.1)
            self._drained()
        if self.forgetting is not None:
            name, at = self.forgetting
            self.forgetting = None
            if name not in self.world.forgotten:
                self.plan.down_until[name] = at

    # --- the target -----------------------------------------------------------------------------
    def below_target(self) -> list[str]:
        """Shards not at their target on live, non-forgotten nodes (why, each)."""
        w = self.world
        live = live_nodes(w)
        if not live or live[0].node is None:
            return ["no live node"]
        table = live[0].node.membership.table
        ids = member_ids(w)
        if table is None or not ids:
            return []
        up = {ids[sn.name] for sn in live if sn.name in ids and sn.name not in w.forgotten}
        active = sum(1 for m in table.members.values() if m.state == "active" and m.name not in w.forgotten)
        out = []
        meta = live[0].node.meta_host
        record = meta.state.cluster if meta is not None else None
        for shard, conf in sorted(group_confs(w).items()):
            if shard < len(table.targets):
                want = min(table.targets[shard], active)
            elif record is not None:  # the metadata group: back to the initial members' count
                want = min(len(record.members), active)
            else:
                continue
            on_live = sum(1 for v in conf.voters if v in up)
            gone = [v for v in conf.voters if v in self.forgotten_ids]
            if on_live < want or gone:
                out.append(f"{'the metadata group' if shard >= len(table.targets) else f'shard {shard}'}: "
                           f"{on_live} of {want} voters on live nodes"
                           + (f", a voter on a forgotten node {gone}" if gone else ""))
        return out

    def not_following(self) -> list[str]:
        """Live, active members whose storage is no member (voter or learner) of some group: every
        node follows every group (reconcile.py), a joined or replaced one too, once the faults heal:
        one that follows no replica of a shard serves that shard's sessions from a replica that
        never moves again."""
        w = self.world
        live = live_nodes(w)
        table = live[0].node.membership.table if live and live[0].node is not None else None
        if table is None:
            return []
        confs = group_confs(w)
        out = []
        for sn in live:
            m = table.members.get(sn.name)
            if sn.node is None or m is None or m.state != "active" or sn.name in w.forgotten:
                continue
            me = (int(sn.node.member[0]), str(sn.node.member[1]))
            voters_only = w.cfg.learners == "none"
            missing = []
            for g, conf in sorted(confs.items()):
                if me in conf.voters or me in conf.learners:
                    continue
                host = sn.node.groups[g]
                if voters_only and g < len(table.targets):
                    # shard.learners = "none": a node no member of a shard reads it through a feed
                    # from its leader (node/replication/reader.py), which must have started.
                    if host.reader is not None and host.reader.active and host.reader.started:
                        continue
                missing.append(g)
            if missing:
                out.append(f"{sn.name} (member {me[0]}) follows no replica of group(s) {missing}"
                           + (" and reads none through a feed" if voters_only else ""))
        if w.cfg.learners == "none":
            for g, conf in sorted(confs.items()):
                if g < len(table.targets) and conf.learners:
                    out.append(f"shard {g} keeps learner(s) {list(conf.learners)} (shard.learners = none)")
        return out


class ConfRules:
    """Raft's configuration-change rules, judged at every leader's proposal (see the module doc)."""

    def __init__(self, world: World, forgotten_ids: set[tuple[int, str]]) -> None:
        self.world = world
        self.forgotten_ids = forgotten_ids
        self.findings: list[tuple[str, str]] = []
        self.judged = 0

    def instrument(self) -> None:
        for sn in live_nodes(self.world):
            assert sn.node is not None
            for h in sn.node.groups:
                raft = h.raft
                # Marked on the wrapper, not remembered by id(): a new replica's Raft node may get a
                # dead one's address, and would go unjudged (and a seed would not replay exactly).
                if not getattr(raft.propose_conf_change, "conf_rules_wrapped", False):
                    wrapper = self._wrap(sn, h, raft)
                    wrapper.conf_rules_wrapped = True  # type: ignore[attr-defined]
                    raft.propose_conf_change = wrapper  # type: ignore[method-assign,assignment]

    def sample(self) -> None:
        """Every leader counts the voters of the latest configuration in its log."""
        self.instrument()
        for sn in live_nodes(self.world):
            assert sn.node is not None
            for h in sn.node.groups:
                raft = h.raft
                if not raft.is_leader:
                    continue
                counted = {m for m, pr in raft.progress.items() if not pr.is_learner}
                if counted != set(raft.active_conf_state.voters):
                    self._find("conf_not_in_force", f"{sn.name} group {h.shard} term {raft.term}: counts voters "
                               f"{sorted(counted)}, its log's configuration has {list(raft.active_conf_state.voters)}")

    def _find(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.findings and len(self.findings) < 50:
            self.findings.append((kind, detail))

    def _wrap(self, sn: SimNode, host: Any, raft: Any) -> Callable[[ConfChange], int]:
        inner = raft.propose_conf_change
        node = sn.node
        assert node is not None
        lag_bound = node.cfg.cluster.promote_lag_entries

        def propose(cc: ConfChange) -> int:
            before = raft.active_conf_state
            pending = raft.pending_conf_index > raft.log.applied
            last = raft.log.last_index()
            pr = raft.progress.get(cc.member)
            table = node.membership.table
            move = table.moves.get(host.shard) if table is not None else None
            index = inner(cc)  # raises when refused: nothing proposed, nothing to judge
            self.judged += 1
            where = f"{sn.name} group {host.shard} term {raft.term} index {index}"
            if pending:
                self._find("conf_two_pending", f"{where}: {cc.type.name} {cc.member} while the change at "
                           f"{raft.pending_conf_index} was not applied")
            after = raft.active_conf_state
            if len(set(before.voters) ^ set(after.voters)) > 1:
                self._find("conf_multi_voter_change", f"{where}: voters {before.voters} -> {after.voters}")
            if cc.type in (ConfChangeType.PROMOTE, ConfChangeType.ADD_VOTER):
                lag = None if pr is None else last - pr.match
                if lag is None or lag > lag_bound:
                    self._find("conf_promote_lagging", f"{where}: {cc.member} made a voter "
                               f"{'never heard from' if lag is None else f'{lag} entries behind'} "
                               f"(cluster.promote_lag_entries = {lag_bound})")
                gone = [v for v in before.voters if v in self.forgotten_ids]
                if gone and (move is None or move.origin != "manual"):
                    self._find("conf_grow_before_shrink", f"{where}: {cc.member} made a voter while {gone} (a "
                               f"forgotten node) still votes: {before.voters}")
            return index

        return propose


class Convergence:
    """After the heal: every shard at target on live, non-forgotten nodes within the bound."""

    def __init__(self, members: MembershipPlan) -> None:
        self.members = members
        self.healed_at: float | None = None
        self.converged_at: float | None = None
        self.last_why: list[str] = []

    def healed(self) -> None:
        self.healed_at = self.members.now

    def sample(self) -> None:
        if self.healed_at is None or self.converged_at is not None:
            return
        self.last_why = self.members.below_target()
        if self.members.joins:  # (with joins: the plain mix's seeds replay their verdicts as before)
            self.last_why += self.members.not_following()
        if not self.last_why:
            self.converged_at = self.members.now

    def finish(self, world: World) -> list[tuple[str, str]]:
        """Run on (the workload has stopped) until converged or the bound; the verdict."""
        if self.healed_at is None:
            return []
        self.sample()
        while self.converged_at is None and world.scheduler.now < self.healed_at + CONVERGE_BOUND_S:
            world.run_for(0.1)
            self.sample()
        if self.converged_at is None:
            return [("membership_not_converged", f"{CONVERGE_BOUND_S:.0f} s after the heal: "
                     + "; ".join(self.last_why[:6]))]
        return []
