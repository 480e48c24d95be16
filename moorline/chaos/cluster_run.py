"""One chaos run against a cluster of 3 or 5 nodes (``moorline chaos --nodes 3|5``).

Timeline: start every node (``cluster.ClusterNodes``) and wait until every shard has a leader;
start the single-node harness's workload, each client choosing a random healthy node at every
connect (``cluster.NodePicker``), so a client whose node fails reconnects to another; execute the
seeded schedule (``schedule.plan``: kills with restart on the same data directory, optionally with
truncation of the killed node's files to their synced length, SIGSTOP pauses longer than an
election timeout, a minority cut off by a partition; never more than a minority faulty at once);
after the schedule has healed everything and the workload has run ``duration_s`` (and at least
``settle_s`` after the last heal), stop the publishers, wait until every shard is led, drain the
subscribers, record every node's counted drops, stop the nodes with SIGTERM.

The run directory (``OUT/run-<run id>``) keeps each node's log, its sync ledger, the cluster
secret, the nodes' config (if any) and ``faults.txt``: every fault step with its time, and the
leader changes seen. The history (``OUT/history-<run id>.jsonl``) has the single-node format; its
fault records name the node in ``detail``.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moorline.chaos import schedule
from moorline.chaos.cluster import ClusterNodes, LeaderMonitor, NodePicker
from moorline.chaos.harness import (
    ChaosConfig,
    RunResult,
    Workload,
    _corruption_line,
    _drain,
    _sleep_until,
    start_workload,
)
from moorline.chaos.node import NodeStartError, truncate_to_ledger
from moorline.chaos.wire import Endpoint
from moorline.verify.history import HistoryWriter


@dataclass
class _ClusterRunState:
    kills: int = 0
    restarts: int = 0
    truncations: int = 0
    pauses: int = 0
    partitions: int = 0
    corruption: bool = False
    restart_failed: bool = False
    return_to: str | None = None  # the sleeper comes back to the node restarted last

    @property
    def stopped_early(self) -> bool:
        return self.corruption or self.restart_failed


class _Run:
    """The run's moving parts, so the fault steps read as what they do."""

    def __init__(self, cfg: ChaosConfig, run_id: str, cluster: ClusterNodes, hist: HistoryWriter,
                 damage_rng: random.Random) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.cluster = cluster
        self.hist = hist
        self.damage_rng = damage_rng
        self.state = _ClusterRunState()
        self.fault_log: list[str] = []
        self.notes: list[str] = []
        self.start = time.monotonic()
        self.workload: Workload | None = None

    def fault(self, reason: str, detail: str) -> None:
        self.hist.record("fault", "fault", process="harness", reason=reason, detail=detail[:2000])
        self.fault_log.append(f"{time.monotonic() - self.start:8.2f}s {reason:<9} {detail}")

    # --- the steps ------------------------------------------------------------------------------------
    def begin(self, e: schedule.Episode) -> None:
        assert self.workload is not None
        t = time.monotonic() - self.start
        self.cluster.set_faulty(e.nodes, True)  # clients stop choosing it before it fails
        if e.kind == "kill":
            name = e.nodes[0]
            node = self.cluster[name]
            trigger = self.workload.trigger
            # Fired inside the next acknowledgement any publisher receives: a node acknowledging
            # before its data is durable is then caught with that data unsynced.
            trigger.arm(node.send_kill)
            after_ack = trigger.fired.wait(self.cfg.ack_wait_s)
            trigger.disarm()
            node.kill()
            self.state.kills += 1
            self.fault("kill", f"{name}: SIGKILL at {t:.2f}s" + (" right after an acknowledgement" if after_ack else ""))
            if e.truncate:
                cut = truncate_to_ledger(self.cluster.ledger(name), self.damage_rng)
                self.state.truncations += 1
                self.fault("truncate", f"{name}: " + (";".join(cut) or "every file already synced"))
        elif e.kind == "pause":
            name = e.nodes[0]
            self.cluster[name].pause()
            self.state.pauses += 1
            self.fault("pause", f"{name}: SIGSTOP for {e.end_s - e.start_s:.1f}s")
        else:
            side = list(e.nodes)
            rest = [n for n in self.cluster.names if n not in side]
            for a in side:
                for b in rest:
                    self.cluster.partitioner.cut(a, b)
            self.state.partitions += 1
            self.fault("partition", f"{','.join(side)} | {','.join(rest)} for {e.end_s - e.start_s:.1f}s "
                                    f"({self.cluster.partitioner.kind})")

    def end(self, e: schedule.Episode) -> None:
        assert self.workload is not None
        if e.kind == "kill":
            name = e.nodes[0]
            self.fault("restart", name)
            if not self._restart(name):
                return
            self.state.restarts += 1
            self.cluster.set_faulty(e.nodes, False)
            self.state.return_to = name
            self.workload.asleep.clear()
        elif e.kind == "pause":
            name = e.nodes[0]
            self.cluster[name].resume()
            self.cluster.set_faulty(e.nodes, False)
            self.fault("resume", f"{name}: SIGCONT")
        else:
            side = list(e.nodes)
            rest = [n for n in self.cluster.names if n not in side]
            for a in side:
                for b in rest:
                    self.cluster.partitioner.heal(a, b)
            self.cluster.set_faulty(e.nodes, False)
            self.fault("heal", f"{','.join(side)} | {','.join(rest)}")

    def _restart(self, name: str) -> bool:
        """Start a killed node again on its data directory; False (and the run stops) if it will not."""
        node = self.cluster[name]
        try:
            node.start()
        except NodeStartError as exc:
            line = _corruption_line(exc.log_tail)
            if line is not None:
                self.state.corruption = True
                self.fault("corruption_detected", f"{name}: {line}")
                self.notes.append(f"{name} refused to start: {line}")
            else:
                self.state.restart_failed = True
                self.fault("restart_failed", f"{name}: {exc.log_tail[-1500:]}")
                self.notes.append(f"{name} did not restart: {exc}\n{exc.log_tail}")
            return False
        line = _corruption_line(node.current_log())
        if line is not None:
            self.state.corruption = True
            self.fault("corruption_detected", f"{name}: {line}")
            self.notes.append(f"{name} reported corruption: {line}")
        return True

    def execute(self, episodes: list[schedule.Episode], total_s: float,
                progress: Callable[[float], None] | None) -> None:
        """Every step at its moment, strictly in order. A step that comes late (an earlier one took
        longer: a restart, a kill waiting for an acknowledgement) delays the end of its episode as
        much, so a pause or a partition lasts as long as planned."""
        assert self.workload is not None
        began: dict[schedule.Episode, float] = {}
        for step in schedule.steps(episodes):
            if self.state.stopped_early:
                return
            e = step.episode
            if step.begin and e.kind == "kill":
                # The sleeper leaves (session kept) shortly before a kill and comes back after the
                # restart, to the restarted node: what was committed meanwhile must come from there.
                _sleep_until(self.start + max(0.0, step.at_s - self.cfg.sleeper_lead_s), self.start, total_s,
                             progress)
                self.workload.asleep.set()
            at = step.at_s if step.begin else max(step.at_s, began[e] + e.end_s - e.start_s)
            _sleep_until(self.start + at, self.start, total_s, progress)
            if step.begin:
                began[e] = time.monotonic() - self.start
                self.begin(e)
            else:
                self.end(e)

    def heal_everything(self) -> None:
        """A safety net before the drain: nothing the schedule left faulty (it leaves nothing)."""
        self.cluster.partitioner.heal_all()
        for name in self.cluster.names:
            node = self.cluster[name]
            if node.paused:
                node.resume()
                self.fault("resume", f"{name}: SIGCONT (left paused)")
            elif not node.running:
                self.fault("restart", f"{name} (left down)")
                if self._restart(name):
                    self.state.restarts += 1
        self.cluster.set_faulty(self.cluster.names, False)
        if self.workload is not None:
            self.workload.asleep.clear()

    def record_drops(self) -> int:
        """Every node's counted drops (GET /v1/drops), each drop once."""
        seen: set[tuple[object, ...]] = set()
        for name in self.cluster.names:
            if not self.cluster[name].running:
                continue
            try:
                drops = self.cluster.get_json(name, "/v1/drops", timeout_s=10.0).get("drops", [])
            except OSError as exc:
                self.notes.append(f"GET /v1/drops on {name} failed: {exc}")
                self.hist.record("fault", "fault", process="harness", reason="drops_unavailable",
                                 detail=f"{name}: {exc}")
                continue
            for d in drops:
                key = tuple(d.get(k) for k in ("guid", "reason", "session", "shard", "offset"))
                if key in seen:
                    continue
                seen.add(key)
                self.hist.record("drop", "drop", process="broker", guid=d.get("guid"), reason=d.get("reason"),
                                 session=d.get("session"), shard=d.get("shard"), offset=d.get("offset"))
        return len(seen)


def run_cluster_once(
    cfg: ChaosConfig, run_id: str, out_dir: Path, progress: Callable[[float], None] | None = None
) -> RunResult:
    """One run on a fresh cluster; history in ``out_dir/history-<run_id>.jsonl``, node logs and the
    fault log in ``out_dir/run-<run_id>/``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    history_path = out_dir / f"history-{run_id}.jsonl"
    history_path.unlink(missing_ok=True)
    run_dir = out_dir / f"run-{run_id}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)

    def rng(stream: str) -> random.Random:
        return random.Random(f"{cfg.seed}/{run_id}/{stream}")

    names = [f"n{i}" for i in range(1, cfg.nodes + 1)]
    counts = {
        "kill": cfg.kills_per_run if cfg.faults & {"kill", "truncate"} else 0,
        "pause": cfg.pauses_per_run if "pause" in cfg.faults else 0,
        "partition": cfg.partitions_per_run if "partition" in cfg.faults else 0,
    }
    times = schedule.ScheduleTimes(pause_s=cfg.pause_s, partition_s=cfg.partition_s)
    episodes = schedule.plan(names, counts, cfg.duration_s, rng("faults"), truncate="truncate" in cfg.faults,
                             times=times)
    last_heal = max((e.end_s for e in episodes), default=0.0)
    total_s = max(cfg.duration_s, last_heal + cfg.settle_s)

    cluster = ClusterNodes(
        cfg.nodes, run_dir, base_address=cfg.base_address, node_faults=cfg.node_faults, shards=cfg.shards,
        config_text=cfg.node_config_text, partition_with=cfg.partition_with,
        partitions_wanted=counts["partition"] > 0, start_timeout_s=cfg.start_timeout_s,
    )
    monitor = LeaderMonitor(cluster)
    try:
        with HistoryWriter(history_path, run_id) as hist:
            run = _Run(cfg, run_id, cluster, hist, rng("damage"))
            cluster.start(cfg.start_timeout_s)
            monitor.start()
            pick_rng = rng("nodes")

            def endpoints(role: str) -> Callable[[], Endpoint]:
                prefer = (lambda: run.state.return_to) if role == "sleeper" else None
                return NodePicker(cluster, random.Random(pick_rng.getrandbits(64)), prefer)

            run.workload = w = start_workload(cfg, run_id, hist, rng("clients"), endpoints)
            run.start = time.monotonic()
            try:
                run.execute(episodes, total_s, progress)
                if not run.state.stopped_early:  # at least settle_s after the last heal, however late
                    end_s = max(total_s, time.monotonic() - run.start + cfg.settle_s)
                    _sleep_until(run.start + end_s, run.start, end_s, progress)
                w.stop_pubs.set()
                for t in w.pub_threads:
                    t.join(cfg.publish_timeout_s + cfg.client_connect_timeout_s + 10)
                if not run.state.stopped_early:
                    run.heal_everything()
                    if cluster.wait_leaders(cfg.leaders_timeout_s) is None:
                        run.notes.append(f"not every shard had a leader {cfg.leaders_timeout_s:.0f} s after "
                                         "the last fault healed")
                    _drain(w.subs, cfg)
            except BaseException:
                cluster.kill_all()
                raise
            finally:
                w.stop_pubs.set()
                w.stop_subs.set()
                for t in w.pub_threads + w.sub_threads:
                    t.join(cfg.publish_timeout_s + cfg.client_connect_timeout_s + 10)
                monitor.stop()
            drops = 0 if run.state.stopped_early else run.record_drops()
            for name in cluster.names:  # a damaged shard may be refused only when first used
                if run.state.corruption:
                    break
                line = _corruption_line(cluster[name].log_text())
                if line is not None:
                    run.state.corruption = True
                    run.fault("corruption_detected", f"{name}: {line}")
                    run.notes.append(f"{name} reported corruption: {line}")
            exits = cluster.stop() if not run.state.stopped_early else {}
            if run.state.stopped_early:
                cluster.kill_all()
            for name, rc in exits.items():
                if rc not in (0, None):
                    run.notes.append(f"{name} exited {rc} after SIGTERM (log: {cluster.log_path(name)})")
            for name, lines in cluster.bad_log_lines().items():
                run.notes.append(f"{name} logged {len(lines)} ERROR/CRITICAL line(s) or traceback(s), first: "
                                 f"{lines[0][:300]} (log: {cluster.log_path(name)})")
            w = run.workload
            result = RunResult(
                run_id,
                history_path,
                hist.count,
                sum(p.published for p in w.pubs),
                sum(p.acked for p in w.pubs),
                run.state.kills,
                run.state.corruption,
                drops,
                run.notes,
                run.state.restart_failed,
                restarts=run.state.restarts,
                truncations=run.state.truncations,
                pauses=run.state.pauses,
                partitions=run.state.partitions,
                leader_changes=monitor.changes,
                fault_log=run.fault_log,
                run_dir=run_dir,
                partition_kind=cluster.partitioner.kind,
                client_errors=list(w.died),
            )
        _write_fault_log(run_dir / "faults.txt", result, monitor.log)
    finally:
        monitor.stop()
        cluster.kill_all()  # nothing is left running, whatever happened (no-op after a clean stop)
        cluster.close()  # the iptables chain or the relays
        if not cfg.keep_data:
            with contextlib.suppress(OSError):
                shutil.rmtree(run_dir / "data")
    if progress is not None:
        progress(1.0)
    return result


def _write_fault_log(path: Path, res: RunResult, leader_log: list[str]) -> None:
    lines = [
        f"run {res.run}: {res.acked}/{res.published} publishes acknowledged; {res.kills} kills "
        f"({res.truncations} with truncation), {res.restarts} restarts, {res.pauses} pauses, "
        f"{res.partitions} partitions ({res.partition_kind}), {res.leader_changes} leader changes",
        "",
        "faults (seconds from the start of the workload):",
        *res.fault_log,
        "",
        "leader changes seen (seconds from the start of polling):",
        *leader_log,
    ]
    if res.notes:
        lines += ["", "notes:", *res.notes]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
