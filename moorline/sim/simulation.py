"""One seeded simulation: a cluster of sim nodes, faults, an operator, clients, two phases.

Phase 1 (safety): clients run ``ops`` operations while faults are injected; the Raft checks run
online. Phase 2 (liveness): heal everything, stop injecting faults, drain the queues; the
cluster must converge (every node a caught-up voter, clients done) within a bound. Then the
offline checkers run on the client histories.

Everything non-deterministic comes from ``random.Random(seed)``; a seed replays exactly.

An exception from the core or the host (an invariant violation, an error from ``tick`` or
``step``) ends the seed as a violation that names the exception and where it was raised; it
never escapes ``run()``.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from moorline.hashing import crc32c
from moorline.raft import (
    RAFT_BUG_NAMES,
    ConfChange,
    ConfChangeType,
    MemberId,
    Message,
    MessageType,
    ProposalDropped,
    RaftBugs,
    RaftError,
    StateRole,
)
from moorline.sim.checkers.linearizable import check_registers
from moorline.sim.checkers.raft_safety import RaftObserver
from moorline.sim.checkers.total_queue import check_total_queue
from moorline.sim.disk import SimDisk
from moorline.sim.faults import FaultParams, draw_faults
from moorline.sim.host import HOST_BUG_NAMES, HostBugs, HostParams, LogView, SimNode, SimShared, fmt_member
from moorline.sim.loop import EventLoop
from moorline.sim.marks import Marks
from moorline.sim.network import SimNetwork
from moorline.sim.statemachine import SimStateMachine
from moorline.sim.workload import Budget, Client, History, WorkloadParams

CORE_BUGS: tuple[str, ...] = RAFT_BUG_NAMES  # switches in the core (RaftBugs)
HOST_BUGS: tuple[str, ...] = HOST_BUG_NAMES  # switches in the sim host (HostBugs)
ALL_BUGS: tuple[str, ...] = CORE_BUGS + HOST_BUGS

CLIENT_BASE = 1000
STABILITY_CLIENT = 999
LOAD_CLIENT = 998  # background bursts of writes (no history: only the Raft checks see them)


@dataclass(slots=True)
class SimConfig:
    seed: int
    nodes: int = 3
    ops: int = 1000
    bug: str | None = None
    all_faults: bool = False  # every fault kind on (benchmark); default: swarm draws
    corrupt_mode: str | None = None  # force "quarantine" or "core_mark" (experiments)
    trace_lines: int = 60
    liveness_ms: int = 40_000  # bound on convergence after the heal
    safety_ms_per_op: int = 60  # the safety phase ends at ops * this even if ops are stuck
    reconcile_every_ms: int = 100
    stability_ms: int = 2_000
    linearizability_steps: int = 300_000  # search budget per key ("unknown" beyond, counted)
    stability_write_every_ms: int = 40
    # checks that restate a core rule instead of observing an effect (the host's commit-rule
    # check); the bug tests turn them off: the effect checks must catch every switch alone
    rule_checks: bool = True
    # --verbose: every Raft message (with its fate), vote and trace line, as it happens
    verbose: Callable[[str], None] | None = None
    verbose_max_lines: int = 50_000  # bound on the verbose output of one seed


@dataclass(slots=True)
class SeedResult:
    seed: int
    ops_started: int
    ops_ok: int
    faults: Counter[str]
    violations: list[str]
    trace: list[str]
    trace_digest: int
    marks: Marks
    events: int
    virtual_ms: int
    params: str
    queue_summary: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(slots=True)
class _NodeState:
    doomed: bool = False  # data about to be destroyed (bit flip applied, restart pending)
    replacing: bool = False  # operator is removing this member to re-add it fresh
    down_since: int | None = None
    linger_until: int | None = None  # removed member keeps running until then (operator's delay)


class Simulation:
    def __init__(self, cfg: SimConfig) -> None:
        if cfg.bug is not None and cfg.bug not in ALL_BUGS:
            raise ValueError(f"unknown bug {cfg.bug!r}; known: {', '.join(ALL_BUGS)}")
        if cfg.nodes not in (1, 3, 5):
            raise ValueError("nodes must be 1, 3 or 5")
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        # one fault mix for every run: a bug run draws exactly what a clean run of its seed draws
        self.fp: FaultParams = draw_faults(self.rng, cfg.nodes, cfg.all_faults)
        if cfg.corrupt_mode is not None:
            self.fp.corrupt_mode = cfg.corrupt_mode
        self.loop = EventLoop(random.Random(self.rng.random()))
        self.marks = Marks()
        self.net = SimNetwork(self.loop, random.Random(self.rng.random()), self.fp.net, self.marks)
        self.observer = RaftObserver()
        self.observer.on_first_commit = self._check_commit_stability
        self.faults: Counter[str] = Counter()
        self._trace: deque[str] = deque(maxlen=cfg.trace_lines)
        self._digest = 0
        self._verbose_lines = 0
        if cfg.verbose is not None:
            self.net.watch = self._watch_message
        bug = cfg.bug
        raft_bugs = RaftBugs(**{bug: True}) if bug in CORE_BUGS else RaftBugs()
        host_bugs = HostBugs(**{bug: True}) if bug in HOST_BUGS else HostBugs()
        dedup_at_apply = bug != "dedup_at_propose"
        self.shared = SimShared(
            loop=self.loop,
            net=self.net,
            rng=random.Random(self.rng.random()),
            marks=self.marks,
            observer=self.observer,
            raft_bugs=raft_bugs,
            host_bugs=host_bugs,
            sm_factory=lambda: SimStateMachine(dedup_at_apply=dedup_at_apply),
            trace=self.trace,
            rule_checks=cfg.rule_checks,
            on_leader_elected=self._on_leader_elected,
        )
        self.fault_rng = random.Random(self.rng.random())
        self.nodes: list[SimNode] = []
        self.state: dict[int, _NodeState] = {}
        for i in range(cfg.nodes):
            hp = HostParams(
                snapshot_every=self.fp.snapshot_every,
                keep_entries=self.fp.keep_entries,
                clock_skew_ms=self.fp.clock_skews_ms[i],
                report_snapshot=self.fp.report_snapshot,
                max_entries_per_append=self.fp.max_entries_per_append,
                corrupt_mode=self.fp.corrupt_mode,
            )
            self.nodes.append(SimNode(i + 1, self.shared, SimDisk(self.fp.disks[i]), hp))
            self.state[i + 1] = _NodeState()
        self.history = History()
        self.budget = Budget(cfg.ops)
        self.wp = WorkloadParams()
        self.clients: list[Client] = []
        self.phase = "safety"
        self.done = False
        self.partition_epoch = 0
        self.transfer_target: MemberId | None = None
        self.load_target = 1
        self.load_req = 0

    # -- tracing -------------------------------------------------------------------------------
    def trace(self, line: str) -> None:
        text = f"{self.loop.now_ms:>8}ms {line}"
        self._trace.append(text)
        self._digest = crc32c(text.encode()) ^ ((self._digest * 31) & 0xFFFFFFFF)
        if self.cfg.verbose is not None:
            self._emit(text)

    def _emit(self, line: str) -> None:
        out = self.cfg.verbose
        assert out is not None
        self._verbose_lines += 1
        if self._verbose_lines <= self.cfg.verbose_max_lines:
            out(line)
        elif self._verbose_lines == self.cfg.verbose_max_lines + 1:
            out(f"... verbose output stops after {self.cfg.verbose_max_lines} lines (the run goes on)")

    def _watch_message(self, src: int, dst: int, payload: object, fate: str) -> None:
        if isinstance(payload, Message):
            note = "" if fate == "sent" else f"  [{fate}]"
            self._emit(
                f"{self.loop.now_ms:>8}ms   {fmt_member(payload.from_)} -> {fmt_member(payload.to)} "
                f"{describe_message(payload)}{note}"
            )

    def _violation(self, msg: str) -> None:
        self.observer._fail(msg)

    # -- run -----------------------------------------------------------------------------------
    def run(self) -> SeedResult:
        try:
            self._run()
        except Exception as exc:  # an error from the core or the host: a violation of this seed
            where = _raised_at(exc)
            self.trace(f"exception {type(exc).__name__}: {exc} ({where})")
            self._violation(f"exception from the code under test: {type(exc).__name__}: {exc} ({where})")
        return self._result()

    def _run(self) -> None:
        cfg = self.cfg
        voters = [n.member_id() for n in self.nodes]
        SimNode.sh_initial_voters = voters
        for n in self.nodes:
            n.start_bootstrap(voters)
        node_ids = [n.node_id for n in self.nodes]
        for i in range(self.wp.queue_clients + self.wp.kv_clients):
            role = "queue" if i < self.wp.queue_clients else "kv"
            c = Client(
                CLIENT_BASE + i,
                role,
                self.loop,
                self.net,
                random.Random(self.rng.random()),
                node_ids,
                self.wp,
                self.history,
                self.budget,
                self.marks,
                self._on_client_idle,
            )
            self.clients.append(c)
            c.start()
        self.trace(
            f"start seed={cfg.seed} nodes={cfg.nodes} ops={cfg.ops} bug={cfg.bug} {self.fp.describe()}"
        )
        self._start_faults()
        if self.fp.burst_every_ms:
            self.net.attach(LOAD_CLIENT, self._on_load_reply)
            self.loop.call_later(self.fp.burst_every_ms, self._load_burst)
        self.loop.call_later(cfg.reconcile_every_ms, self._reconcile_tick)
        safety_end = cfg.ops * cfg.safety_ms_per_op + 5_000
        self.loop.call_at(safety_end, self._end_safety)
        stop = self._should_stop
        self.loop.run_until(safety_end + cfg.liveness_ms + 1, stop)
        if not self.done and not self.observer.violations:
            self._violation(
                f"liveness: not converged {cfg.liveness_ms}ms after heal: {self._convergence_gap()}"
            )
        if not self.observer.violations:
            self._final_checks()

    def _should_stop(self) -> bool:
        return self.done or bool(self.observer.violations)

    def _result(self) -> SeedResult:
        return SeedResult(
            seed=self.cfg.seed,
            ops_started=self.budget.started,
            ops_ok=self.history.ops_ok,
            faults=self.faults,
            violations=list(self.observer.violations),
            trace=list(self._trace),
            trace_digest=self._digest,
            marks=self.marks,
            events=self.loop.events_run,
            virtual_ms=self.loop.now_ms,
            params=self.fp.describe(),
        )

    # -- phases -------------------------------------------------------------------------------
    def _on_client_idle(self) -> None:
        if self.phase == "safety" and all(c.idle for c in self.clients):
            self.loop.call_later(0, self._end_safety)
        elif self.phase in ("liveness", "settle"):
            self.loop.call_later(0, self._check_converged)

    def _end_safety(self) -> None:
        if self.phase != "safety":
            return
        self.phase = "liveness"
        self.liveness_deadline = self.loop.now_ms + self.cfg.liveness_ms
        self.trace("heal: end of faults, liveness phase")
        self.net.heal()
        self.net.clear_stalls()
        self.net.faults_enabled = False
        self.partition_epoch += 1
        for n in self.nodes:
            n.paused_until_ms = min(n.paused_until_ms, self.loop.now_ms)
            if not n.alive:
                self._restart(n, allow_destroy=False)
            else:
                n._resume(n.epoch)
        for c in self.clients:
            c.start_drain()
        self.loop.call_later(100, self._converge_tick)

    def _converge_tick(self) -> None:
        self._check_converged()
        if not self.done:
            self.loop.call_later(100, self._converge_tick)

    def _check_converged(self) -> None:
        if self.phase == "liveness" and not self.done and self._convergence_gap() is None:
            self.trace("converged")
            self.phase = "stability"
            self._start_stability()
        elif self.phase == "settle" and not self.done and self._convergence_gap() is None:
            self.done = True
            self.trace("settled")

    # -- steady state: heartbeats lost while appends flow must not cause an election ---------------
    def _start_stability(self) -> None:
        leader = self._leader()
        assert leader is not None and leader.replica is not None
        self.stable_leader = leader.replica.member
        self.stable_term = leader.replica.raft.term
        lid = leader.node_id
        self.net.drop_filter = lambda src, dst, m: (
            src == lid and isinstance(m, Message) and m.type == MessageType.HEARTBEAT
        )
        self.trace(f"stability: heartbeats from n{lid} dropped, appends flowing")
        self.stability_end = self.loop.now_ms + self.cfg.stability_ms
        self.net.attach(STABILITY_CLIENT, lambda src, payload: None)
        self._stability_write(lid, 0)

    def _stability_write(self, lid: int, n: int) -> None:
        if self.loop.now_ms >= self.stability_end:
            self._end_stability()
            return
        self.net.send(STABILITY_CLIENT, lid, ("cmd", n, "put", "_stability", n), reliable=True)
        self.loop.call_later(self.cfg.stability_write_every_ms, self._stability_write, lid, n + 1)

    def _end_stability(self) -> None:
        self.net.drop_filter = None
        terms = {n.node_id: n.replica.raft.term for n in self.nodes if n.replica is not None}
        leader = self._leader()
        lm = leader.replica.member if leader is not None and leader.replica is not None else None
        if max(terms.values(), default=0) != self.stable_term or lm != self.stable_leader:
            self._violation(
                f"liveness: election in steady state (heartbeats lost, appends flowing): leader "
                f"{self.stable_leader} term {self.stable_term} -> {lm}, terms {terms}"
            )
        self.phase = "settle"
        self.trace("stability window over")

    def _convergence_gap(self) -> str | None:
        busy = [c.cid for c in self.clients if not c.idle]
        if busy:
            return f"clients still busy: {busy}"
        leader = self._leader()
        if leader is None:
            return "no leader"
        assert leader.replica is not None
        raft = leader.replica.raft
        conf = raft.conf_state
        want = sorted(n.member_id() for n in self.nodes)
        if list(conf.voters) != want or conf.learners:
            return f"config {conf.voters} learners {conf.learners} != all nodes {want}"
        commit = raft.log.committed
        if commit != raft.log.last_index():
            return f"leader commit {commit} < last index {raft.log.last_index()}"
        for n in self.nodes:
            if not n.alive or n.replica is None:
                return f"n{n.node_id} has no running replica"
            if n.replica.applied != commit:
                return f"n{n.node_id} applied {n.replica.applied} != commit {commit}"
        return None

    def _final_checks(self) -> None:
        # replicas at the same applied index must hold byte-identical state
        states = {n.node_id: n.replica.sm.snapshot() for n in self.nodes if n.replica is not None}
        if len(set(states.values())) > 1:
            self._violation(f"state machine safety: final states differ across nodes {sorted(states)}")
        h = self.history
        v = check_total_queue(h.enqueues, h.deliveries, h.acked)
        for p in v.problems():
            self._violation(p)
        self.queue_summary = f"enq acked={v.acknowledged} delivered={v.delivered} recovered={v.recovered}"
        verdicts = check_registers(h.reg_ops, max_steps=self.cfg.linearizability_steps)
        for key, verdict in verdicts.items():
            if verdict == "violation":
                self._violation(f"linearizability: register {key} history is not linearizable")
            elif verdict == "unknown":
                self.marks.hit("linearizability_search_budget_exhausted")

    # -- helpers ------------------------------------------------------------------------------
    def _leader(self) -> SimNode | None:
        best: SimNode | None = None
        best_term = -1
        for n in self.nodes:
            r = n.replica
            if n.alive and r is not None and not n.paused() and r.raft.role == StateRole.LEADER:
                if r.raft.term > best_term:
                    best, best_term = n, r.raft.term
        return best

    def _node(self, node_id: int) -> SimNode:
        return self.nodes[node_id - 1]

    def _damaged(self, voters: tuple[MemberId, ...]) -> int:
        count = 0
        for n in self.nodes:
            st = self.state[n.node_id]
            if st.doomed or st.replacing or n.quarantined is not None or n.member_id() not in voters:
                count += 1
        return count

    def _may_destroy(self) -> bool:
        """Destroying a node's data is allowed only while the others keep a majority intact."""
        leader = self._leader()
        if leader is None or leader.replica is None:
            return False
        voters = leader.replica.raft.conf_state.voters
        f = (len(self.nodes) - 1) // 2
        return self._damaged(voters) + 1 <= f

    # -- faults ---------------------------------------------------------------------------------
    def _start_faults(self) -> None:
        fp = self.fp
        for kind, every in (
            ("partition", fp.partition_every_ms),
            ("crash", fp.crash_every_ms),
            ("pause", fp.pause_every_ms),
            ("transfer", fp.transfer_every_ms),
            ("replace", fp.replace_every_ms),
            ("stall", fp.stall_every_ms),
        ):
            if every:
                self._schedule_fault(kind, every)

    def _schedule_fault(self, kind: str, every: int) -> None:
        delay = int(self.fault_rng.expovariate(1.0 / every)) + 1
        self.loop.call_later(delay, self._fault, kind, every)

    def _fault(self, kind: str, every: int) -> None:
        if self.phase != "safety":
            return
        getattr(self, f"_fault_{kind}")()
        self._schedule_fault(kind, every)

    def _fault_partition(self) -> None:
        rng = self.fault_rng
        ids = [n.node_id for n in self.nodes]
        if len(ids) < 2:
            return
        self.net.heal()
        mode = rng.choice(["symmetric", "one_way", "bridge", "isolate_leader"])
        if mode == "symmetric":
            rng.shuffle(ids)
            cut = rng.randint(1, len(ids) - 1)
            a, b = ids[:cut], ids[cut:]
            for x in a:
                for y in b:
                    self.net.block(x, y)
                    self.net.block(y, x)
            desc = f"{sorted(a)} | {sorted(b)}"
        elif mode == "one_way":
            x = rng.choice(ids)
            outbound = rng.random() < 0.5
            for y in ids:
                if y != x:
                    self.net.block(x, y) if outbound else self.net.block(y, x)
            desc = f"n{x} {'cannot send' if outbound else 'cannot receive'}"
        elif mode == "bridge":
            rng.shuffle(ids)
            k = len(ids)
            for i in range(k):  # keep only ring neighbours connected
                for j in range(k):
                    if i != j and (j - i) % k not in (1, k - 1):
                        self.net.block(ids[i], ids[j])
            desc = f"ring {ids}"
        else:
            leader = self._leader()
            x = leader.node_id if leader is not None else rng.choice(ids)
            for y in ids:
                if y != x:
                    self.net.block(x, y)
                    self.net.block(y, x)
            desc = f"isolate n{x}"
        self.faults[f"partition_{mode}"] += 1
        self.marks.hit("partition_started")
        self.partition_epoch += 1
        self.trace(f"partition {mode}: {desc}")
        dur = rng.randint(50, self.fp.partition_ms_max)
        self.loop.call_later(dur, self._heal_partition, self.partition_epoch)

    def _heal_partition(self, epoch: int) -> None:
        if epoch == self.partition_epoch:
            self.net.heal()
            self.trace("partition healed")

    def _fault_stall(self) -> None:
        """A node's outbound links stall (as TCP connections waiting out a retransmission
        timeout): everything it sends arrives late, in a burst. A deposed leader's appends then
        reach followers that moved on to a newer term."""
        rng = self.fault_rng
        alive = [n for n in self.nodes if n.alive]
        if not alive:
            return
        n = rng.choice(alive)
        leader = self._leader()
        if leader is not None and rng.random() < 0.5:
            n = leader
        dur = rng.randint(100, self.fp.stall_ms_max)
        for other in self.nodes:
            if other is not n:
                self.net.stall(n.node_id, other.node_id, self.loop.now_ms + dur)
        self.faults["stall"] += 1
        self.marks.hit("link_stalled")
        self.trace(f"stall n{n.node_id}'s outbound links for {dur}ms")

    def _on_leader_elected(self, n: SimNode) -> None:
        """Faults at the moment of interest: a new leader crashes or is cut off before its first
        entries spread (Figure 8 of the Raft paper starts this way)."""
        if self.phase != "safety" or not self.fp.new_leader_fault_p:
            return
        rng = self.fault_rng
        if rng.random() >= self.fp.new_leader_fault_p:
            return
        if rng.random() < 0.7:  # cut off at once: its first entries stay on it alone
            self._cut_off_new_leader(n)
        else:  # crash a little later: its first entries may or may not have spread
            self.loop.call_later(rng.randint(0, 20), self._crash_new_leader, n, n.epoch)

    def _crash_new_leader(self, n: SimNode, epoch: int) -> None:
        if self.phase != "safety" or n.epoch != epoch or not n.alive:
            return
        self.faults["new_leader_fault"] += 1
        self.trace(f"new leader n{n.node_id} crashes")
        n.crash()
        self.marks.hit("node_crashed")
        self.loop.call_later(self.fault_rng.randint(1, self.fp.down_ms_max), self._restart, n, True)

    def _cut_off_new_leader(self, n: SimNode) -> None:
        self.faults["new_leader_fault"] += 1
        self.net.heal()
        for other in self.nodes:
            if other is not n:
                self.net.block(n.node_id, other.node_id)
                self.net.block(other.node_id, n.node_id)
        self.partition_epoch += 1
        self.marks.hit("partition_started")
        self.trace(f"new leader n{n.node_id} cut off")
        dur = self.fault_rng.randint(50, self.fp.partition_ms_max)
        self.loop.call_later(dur, self._heal_partition, self.partition_epoch)

    # -- background load ------------------------------------------------------------------------
    def _load_burst(self) -> None:
        """A burst of writes to the node believed to lead (as a pipelining publisher sends): a
        leader cut off meanwhile piles up a long tail that a newer leader must replace."""
        if self.phase != "safety":
            return
        rng = self.fault_rng
        if rng.random() < 0.1:
            self.load_target = rng.choice(self.nodes).node_id
        for _ in range(rng.randint(1, self.fp.burst_max)):
            self.load_req += 1
            self.net.send(LOAD_CLIENT, self.load_target, ("cmd", self.load_req, "put", "_load", self.load_req), reliable=True)
        self.loop.call_later(int(rng.expovariate(1.0 / self.fp.burst_every_ms)) + 1, self._load_burst)

    def _on_load_reply(self, src: int, payload: Any) -> None:
        result = payload[2]
        if result[0] == "not_leader" and result[1]:
            self.load_target = result[1]

    def _fault_crash(self) -> None:
        rng = self.fault_rng
        alive = [n for n in self.nodes if n.alive]
        if not alive:
            return
        n = rng.choice(alive)
        leader = self._leader()
        if leader is not None and rng.random() < self.fp.crash_leader_p:
            n = leader
        n.crash()
        self.faults["crash"] += 1
        self.marks.hit("node_crashed")
        if self.fp.corrupt_p and rng.random() < self.fp.corrupt_p and self._may_destroy_node(n):
            if n.disk.flip_bit(rng):
                self.state[n.node_id].doomed = True
                self.faults["bit_flip"] += 1
                self.trace(f"bit flip in synced data of n{n.node_id}")
        self.loop.call_later(rng.randint(1, self.fp.down_ms_max), self._restart, n, True)

    def _may_destroy_node(self, n: SimNode) -> bool:
        st = self.state[n.node_id]
        if st.doomed or st.replacing or n.quarantined is not None:
            return False
        return self._may_destroy()

    def _restart(self, n: SimNode, allow_destroy: bool) -> None:
        if n.alive:
            return
        st = self.state[n.node_id]
        rng = self.fault_rng
        if (
            allow_destroy
            and self.phase == "safety"
            and self.fp.wipe_p
            and not st.doomed
            and rng.random() < self.fp.wipe_p
            and self._may_destroy_node(n)
        ):
            self.faults["wipe"] += 1
            self.trace(f"n{n.node_id} restarts with a wiped disk")
            n.wipe_and_restart()
            return
        st.doomed = False
        n.restart()

    def _fault_pause(self) -> None:
        rng = self.fault_rng
        alive = [n for n in self.nodes if n.alive]
        if not alive:
            return
        n = rng.choice(alive)
        dur = rng.randint(50, self.fp.pause_ms_max)
        n.pause(self.loop.now_ms + dur)
        self.faults["pause"] += 1
        self.marks.hit("node_paused")
        self.trace(f"pause n{n.node_id} for {dur}ms")

    def _fault_transfer(self) -> None:
        leader = self._leader()
        if leader is None or leader.replica is None:
            return
        raft = leader.replica.raft
        others = [m for m in raft.conf_state.voters if m != leader.replica.member]
        if not others:
            return
        to = self.fault_rng.choice(others)
        try:
            raft.transfer_leader(to)
        except RaftError:
            return
        self.transfer_target = to
        self.faults["transfer"] += 1
        self.trace(f"transfer leadership {leader.replica.member} -> {to}")
        leader._kick()

    def _fault_replace(self) -> None:
        """Operator churn: remove healthy members, then re-add their nodes with fresh storage
        (one at a time, or a batch of ``replace_batch`` while the damage budget allows)."""
        for _ in range(self.fp.replace_batch):
            cands = [n for n in self.nodes if n.alive and n.replica is not None and self._may_destroy_node(n)]
            if not cands:
                return
            n = self.fault_rng.choice(cands)
            self.state[n.node_id].replacing = True
            self.faults["replace"] += 1
            self.trace(f"operator replaces n{n.node_id}")

    # -- the operator / reconciler -------------------------------------------------------------------
    def _reconcile_tick(self) -> None:
        self._reconcile()
        self._observe_transfer()
        ci, ct = self.observer.committed_max
        if ci:
            self._check_commit_stability(ci, ct)
        self._check_config_quorums()
        self.loop.call_later(self.cfg.reconcile_every_ms, self._reconcile_tick)

    def _observe_transfer(self) -> None:
        if self.transfer_target is None:
            return
        leader = self._leader()
        if (
            leader is not None
            and leader.replica is not None
            and leader.replica.member == self.transfer_target
        ):
            self.marks.hit("leadership_transferred")
            self.transfer_target = None

    def _propose(self, leader: SimNode, cc: ConfChange) -> None:
        assert leader.replica is not None
        if cc.type == ConfChangeType.REMOVE and cc.member == leader.replica.member:
            # a leader does not remove itself: hand leadership to another voter first
            raft = leader.replica.raft
            others = [
                m for m in raft.conf_state.voters if m != cc.member and self._node(m[0]).replica is not None
            ]
            if others:
                try:
                    raft.transfer_leader(self.fault_rng.choice(others))
                except RaftError:
                    return
                self.trace(f"transfer leadership away from {cc.member} before removing it")
                leader._kick()
            return
        try:
            leader.replica.raft.propose_conf_change(cc)
        except ProposalDropped as exc:
            if "pending" in str(exc):
                self.marks.hit("conf_change_refused_pending")  # one change at a time
            return
        self.trace(f"propose {cc.type.name} {cc.member} on n{leader.node_id}")
        self._check_config_quorums()
        leader._kick()

    def _reconcile(self) -> None:
        """The operator: bring the configuration to one caught-up voter per node. A patient
        operator (half the seeds) proposes one change per round; an eager one proposes every
        change it wants at once and lets the leader refuse what must wait."""
        leader = self._leader()
        if leader is None or leader.replica is None:
            return
        raft = leader.replica.raft
        conf = raft.conf_state
        members = set(conf.voters) | set(conf.learners)
        for n in self.nodes:
            change = self._wanted_change(n, raft, conf, members)
            if change is None:
                continue
            self._propose(leader, change)
            if not self.fp.eager_operator:
                return

    def _wanted_change(self, n: SimNode, raft: Any, conf: Any, members: set[MemberId]) -> ConfChange | None:
        st = self.state[n.node_id]
        cur = n.quarantined if n.quarantined is not None else n.member_id()
        for m in sorted(members):
            if m[0] == n.node_id and m != cur:
                return ConfChange(ConfChangeType.REMOVE, m)
        if n.quarantined is not None:
            if cur in members:
                return ConfChange(ConfChangeType.REMOVE, cur)
            self.marks.hit("corrupted_replica_removed")
            self.trace(f"n{n.node_id}: corrupted member {cur} removed; new storage")
            n.replace_storage()
            return None
        if st.replacing:
            if cur in members:
                if len(conf.voters) > 1 or cur not in conf.voters:
                    return ConfChange(ConfChangeType.REMOVE, cur)
                return None
            if n.alive and self._linger(n, cur):
                return None
            if n.alive:
                st.replacing = False
                self.shared.removed_members.discard(cur)
                self.trace(f"n{n.node_id}: member {cur} removed; new storage")
                n.replace_storage()
            return None
        if n.alive and n.replica is not None and cur not in members:
            return ConfChange(ConfChangeType.ADD_LEARNER, cur)
        if cur in conf.learners and n.replica is not None and n.replica.applied >= raft.log.committed:
            if n.storage_gen > 0:
                self.marks.hit("wiped_node_readded")
            return ConfChange(ConfChangeType.PROMOTE, cur)
        return None

    def _linger(self, n: SimNode, member: MemberId) -> bool:
        """A removed member keeps running for a while before the operator deletes its data (as
        an operator who stops the process later would): True while it still runs."""
        st = self.state[n.node_id]
        now = self.loop.now_ms
        if st.linger_until is None:
            st.linger_until = now + self.fault_rng.randint(0, self.fp.removed_linger_ms_max)
            self.shared.removed_members.add(member)
            self.trace(f"n{n.node_id}: member {member} removed, keeps running until {st.linger_until}ms")
        if now < st.linger_until and n.replica is not None:
            self.marks.hit("removed_member_running")
            return True
        st.linger_until = None
        return False

    # -- checks that need every replica's log ------------------------------------------------------
    def _views(self) -> list[LogView]:
        views = []
        for n in self.nodes:
            v = n.view()
            if v is not None:
                views.append(v)
        return views

    def _check_commit_stability(self, index: int, term: int) -> None:
        """A committed entry (index, term) must survive every election: no member that lacks it
        may have a log at least as up to date as a majority of its own configuration's voters
        (they would all vote for it, and as leader it would overwrite the entry). Members are
        the running replicas and the crashed nodes (with the durable log they will restart
        with). Run when an index is first applied and every operator round, on the highest
        applied entry."""
        views = self._views()
        lacking = [v for v in views if not _holds(v, index, term)]
        if not lacking:
            return
        last = {v.member: _last_of(v) for v in views if v.can_vote}
        for r in lacking:
            voters = r.voters
            if r.member not in voters or r.member not in last:
                continue  # cannot campaign
            mine = last[r.member]
            support = [m for m in voters if m in last and last[m] <= mine]
            if len(support) > len(voters) // 2:
                self._violation(
                    f"committed entry can be lost: ({index}, term {term}) is committed but "
                    f"{fmt_member(r.member)} lacks it (log ends {mine[1]}, term {mine[0]}) and "
                    f"{', '.join(fmt_member(m) for m in support)} of voters "
                    f"{', '.join(fmt_member(m) for m in voters)} would vote for it"
                )
                return

    def _check_config_quorums(self) -> None:
        """Any two configurations that can decide (elect a leader, commit) must have
        intersecting majorities. A replica can decide only if it is a voter of its own
        configuration and holds every committed entry (otherwise it cannot win)."""
        ci, ct = self.observer.committed_max
        confs: dict[tuple[MemberId, ...], MemberId] = {}
        for v in self._views():
            voters = tuple(v.voters)
            if v.can_vote and v.member in voters and _holds(v, ci, ct):
                confs.setdefault(voters, v.member)
        for a, b in combinations(sorted(confs), 2):
            if majorities_may_be_disjoint(set(a), set(b)):
                self._violation(
                    f"configurations with disjoint majorities in force: "
                    f"{fmt_member(confs[a])} uses {[fmt_member(m) for m in a]}, "
                    f"{fmt_member(confs[b])} uses {[fmt_member(m) for m in b]}"
                )
                return


def majorities_may_be_disjoint(a: set[MemberId], b: set[MemberId]) -> bool:
    """Could a majority of ``a`` and a majority of ``b`` share no member?"""
    need_a = max(0, len(a) // 2 + 1 - len(a - b))  # members of a majority of a also in b
    need_b = max(0, len(b) // 2 + 1 - len(b - a))
    return need_a + need_b <= len(a & b)


def _holds(v: LogView, index: int, term: int) -> bool:
    """Does the member's log (or its snapshot) hold entry (index, term)?"""
    log = v.log
    if index < log.first_index():
        return True  # inside its snapshot: committed there (snapshot states are compared)
    return bool(log.term_or_zero(index) == term)


def _last_of(v: LogView) -> tuple[int, int]:
    """(last term, last index) of a member's log, as the vote's up-to-date rule compares them."""
    log = v.log
    last = log.last_index()
    return (log.term_or_zero(last), last)


def describe_message(m: Message) -> str:
    """One Raft message on one line (``--verbose``)."""
    t = m.type
    head = f"{t.name} term={m.term}"
    if t == MessageType.APP:
        ents = m.entries
        span = f"{ents[0].index}..{ents[-1].index}" if ents else "none"
        return f"{head} prev={m.index}/{m.log_term} entries={span} commit={m.commit}"
    if t == MessageType.APP_RESP:
        if m.reject:
            return f"{head} REJECT at={m.index} hint={m.reject_hint}/{m.log_term}"
        return f"{head} match={m.index}"
    if t in (MessageType.VOTE, MessageType.PRE_VOTE):
        extra = " (leadership transfer)" if m.context else ""
        return f"{head} last={m.index}/{m.log_term}{extra}"
    if t in (MessageType.VOTE_RESP, MessageType.PRE_VOTE_RESP):
        return f"{head} {'REJECTED' if m.reject else 'GRANTED'}"
    if t == MessageType.SNAP:
        meta = m.snapshot.meta if m.snapshot is not None else None
        return f"{head} snapshot={meta.index}/{meta.term}" if meta is not None else head
    if t == MessageType.HEARTBEAT:
        return f"{head} commit={m.commit}" + (f" read={m.context.decode(errors='replace')}" if m.context else "")
    if t == MessageType.HEARTBEAT_RESP:
        return head + (f" read={m.context.decode(errors='replace')}" if m.context else "")
    if t in (MessageType.READ_INDEX, MessageType.READ_INDEX_RESP):
        return f"{head} index={m.index} read={m.context.decode(errors='replace')}"
    return head


def _raised_at(exc: BaseException) -> str:
    """Where an exception was raised: the innermost frame outside moorline/invariant.py."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.endswith("invariant.py")]
    if not frames:
        return "unknown place"
    f = frames[-1]
    path = f.filename
    if "moorline/" in path:
        path = "moorline/" + path.rsplit("moorline/", 1)[1]
    return f"raised at {path}:{f.lineno} in {f.name}"


def run_seed(seed: int, nodes: int = 3, ops: int = 1000, bug: str | None = None) -> SeedResult:
    return Simulation(SimConfig(seed=seed, nodes=nodes, ops=ops, bug=bug)).run()
