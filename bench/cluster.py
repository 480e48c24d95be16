"""``python -m bench --cluster 3``: W1 and W2 against three-node clusters on this machine, side by side.

moorline: three nodes (cluster addresses 127.0.0.11-13, clients on 127.0.0.1), the publisher connected to node 1,
the subscriber to node 2, and a topic whose shard node 3 leads, so every message crosses all three nodes: it is
forwarded to the leader, replicated to a quorum and read by the subscriber's node from its own replica.
NATS JetStream R3: three nats-server processes clustered with JetStream and the MQTT listener on (MQTT streams
with 3 replicas), publisher on node 1, subscriber on node 2. RabbitMQ: a three-node cluster and a quorum queue
whose leader is node 3 (declared there with the client-local locator), AMQP publisher with confirms on node 1,
consumer with manual acks on node 2.

``python -m bench --cluster 5``: five nodes (127.0.0.11-15) and three replicas of each shard / stream / queue
(moorline ``shard.replicas = 3``, NATS ``stream_replicas: 3``, RabbitMQ ``x-quorum-initial-group-size: 3``).
Once the cluster says where the topic's replicas are, the publisher and the subscriber connect to the two
nodes that hold no voting replica of it (moorline: not a voter of the topic's shard; NATS: not a peer of
the ``$MQTT_msgs`` stream; RabbitMQ: not a member of the quorum queue), so every message is forwarded to the
leader by the publisher's node and reaches the subscriber's node from outside the quorum. With three nodes
every node is a voter and the placement above is kept.

``python -m bench --scale``: moorline's W1 on one node, three nodes and five nodes (three replicas), each
node's share of the summed CPU, and the 5-node / 3-node ratio of the summed CPU per message (issue 32).

Every figure is per cluster: broker CPU-seconds are summed over all nodes' process trees, peak RSS too; the
JSON also holds each node's CPU and its role in the run (``node_roles``: pub / sub, leader / follower /
non-voter), and the table prints the CPU per node by role.
Each run starts a fresh cluster in a temporary directory and stops every process of it afterwards.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import amqp_clients, runner
from bench.brokers import (
    CACHE_DIR,
    STOP_TIMEOUT_S,
    Broker,
    BrokerUnavailable,
    Moorline,
    RunningBroker,
    _drain,
    _read_ready_ports,
    _spawn,
    free_port,
)
from bench.report import QUICK_LABEL, target_format, target_met

Log = Callable[[str], None]

NODE_HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14", "127.0.0.15")
CLUSTER_READY_TIMEOUT_S = 120.0  # three nodes starting at once on 2 shared cores, then elections
PIKA_VERSION = "1.4.4"
PIKA_DIR = CACHE_DIR / f"pika-{PIKA_VERSION}"
LOGS_KEPT_DIR = CACHE_DIR / "cluster-logs"  # node logs of runs whose logs had errors or warnings


def hosts_bindable(nodes: int) -> str | None:
    """None if every node's cluster address can be bound here, else why not."""
    for host in NODE_HOSTS[:nodes]:
        try:
            free_port(host)
        except OSError as exc:
            return f"cannot bind {host}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# A running cluster: several member process trees measured and stopped as one broker.


@dataclass
class _LogPattern:
    error: re.Pattern[str]
    warning: re.Pattern[str]


@dataclass
class RunningCluster(RunningBroker):
    """Members are the nodes (and helpers such as RabbitMQ's epmd). CPU and peak RSS are sums over all of them."""

    members: list[RunningBroker] = field(default_factory=list)
    log_pattern: _LogPattern | None = None
    log_name: str = "stderr.log"  # each member's log, in its own directory
    notes: dict[str, Any] = field(default_factory=dict)
    _ready_offsets: dict[str, int] = field(default_factory=dict)
    _stop_offsets: dict[str, int] = field(default_factory=dict)
    _stopped: bool = False

    def cpu_seconds_by_member(self) -> dict[str, float]:
        return {member.name: member.cpu_seconds() for member in self.members}

    def member_names(self) -> list[str]:
        return [member.name for member in self.members if member.name != "epmd"]

    def place(self, placement: Placement) -> None:
        """The clients go to the placement's nodes; the JSON keeps where everything was at the start."""
        ports = {member.name: member.port for member in self.members}
        self.publish_port = ports[placement.publish_node]
        self.subscribe_port = ports[placement.subscribe_node]
        self.notes.update({
            "publish_node": placement.publish_node, "subscribe_node": placement.subscribe_node,
            "topic_voters": list(placement.voters), "node_roles": placement.roles(self.member_names()),
        })

    def cpu_seconds(self) -> float:
        return sum(self.cpu_seconds_by_member().values())

    def saturation_pairs(self, pairs: int) -> list[PairPlacement]:
        """The saturation run's pairs: spread over the nodes (see ``pair_nodes``), one topic each."""
        placed = spread_pairs(pairs, self.member_names())
        self.notes["saturation_pairs"] = [asdict(p) for p in placed]
        return placed

    def peak_rss_bytes(self) -> int:
        return sum(member.peak_rss_bytes() for member in self.members)

    def alive(self) -> bool:
        return all(member.alive() for member in self.members)

    def _log_path(self, member: RunningBroker) -> Path:
        return member.workdir / self.log_name

    def _offsets(self) -> dict[str, int]:
        out = {}
        for member in self.members:
            try:
                out[member.name] = self._log_path(member).stat().st_size
            except OSError:
                out[member.name] = 0
        return out

    def mark_ready(self) -> None:
        """Log lines from here on belong to the run (before: start-up, which has its own expected warnings)."""
        self._ready_offsets = self._offsets()
        self.notes["member_pids"] = {member.name: member.pid for member in self.members}

    def before_stop(self) -> None:
        """Hook: read what the cluster says about itself while it still runs (leaders at the end)."""

    def stop(self) -> None:
        """SIGTERM to every member's process group at once, then wait (bounded) and SIGKILL what is left."""
        if self._stopped:
            return
        self._stopped = True
        if self.alive():
            try:
                self.before_stop()
            except Exception as exc:  # a reading that failed must not keep the cluster running
                self.notes["before_stop_error"] = f"{type(exc).__name__}: {exc}"
        self._stop_offsets = self._offsets()
        for member in self.members:
            if member.proc.poll() is None:
                try:
                    os.killpg(member.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for member in self.members:
            try:
                member.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.notes.setdefault("killed_after_stop_timeout", []).append(member.name)
                try:
                    os.killpg(member.proc.pid, signal.SIGKILL)  # its own group, created by _spawn
                except ProcessLookupError:
                    pass
        for member in self.members:
            member.stop()  # each has exited by now: this reaps it and closes its log files

    def findings(self) -> dict[str, Any]:
        """Errors and warnings the members logged while the run was measured (after start-up, before stop),
        and during shutdown; members' logs are kept under LOGS_KEPT_DIR when the run logged any."""
        out: dict[str, Any] = dict(self.notes)
        if self.log_pattern is None:
            return out
        counts = {"log_errors": 0, "log_warnings": 0, "shutdown_log_errors": 0}
        samples: list[str] = []
        for member in self.members:
            try:
                data = self._log_path(member).read_bytes()
            except OSError:
                continue
            start = self._ready_offsets.get(member.name, 0)
            end = self._stop_offsets.get(member.name, len(data))
            for line in data[start:end].decode(errors="replace").splitlines():
                if self.log_pattern.error.search(line) or "Traceback" in line:
                    counts["log_errors"] += 1
                    if len(samples) < 6:
                        samples.append(f"{member.name}: {line.strip()[:300]}")
                elif self.log_pattern.warning.search(line):
                    counts["log_warnings"] += 1
                    if len(samples) < 6:
                        samples.append(f"{member.name}: {line.strip()[:300]}")
            for line in data[end:].decode(errors="replace").splitlines():
                if self.log_pattern.error.search(line) or "Traceback" in line:
                    counts["shutdown_log_errors"] += 1
        out.update(counts)
        if samples:
            out["log_samples"] = samples
        if counts["log_errors"] or counts["log_warnings"] or counts["shutdown_log_errors"]:
            kept = LOGS_KEPT_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-{self.name}-{os.getpid()}-{id(self)}"
            kept.mkdir(parents=True, exist_ok=True)
            for member in self.members:
                for path in member.workdir.glob("*.log"):
                    shutil.copy(path, kept / f"{member.name}-{path.name}")
            out["logs_kept"] = str(kept)
        return out


def _stop_all(members: list[RunningBroker]) -> None:
    for member in members:
        member.stop()


def _get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback only
        return json.loads(response.read())


# ---------------------------------------------------------------------------------------------------------------
# Where a run's traffic goes: the topic's (stream's, queue's) replicas and the clients' nodes. Pure.

CLUSTER_REPLICAS = 3  # replicas of the topic's shard / stream / queue in every cluster run (all nodes if fewer)


@dataclass(frozen=True)
class Placement:
    topic: str
    leader: str
    voters: tuple[str, ...]  # the leader included
    publish_node: str
    subscribe_node: str
    shard: int | None = None

    def roles(self, names: list[str]) -> dict[str, str]:
        return node_roles(names, self.leader, self.voters, self.publish_node, self.subscribe_node)


def node_roles(names: list[str], leader: str | None, voters: tuple[str, ...] | list[str], publish_node: str,
               subscribe_node: str) -> dict[str, str]:
    """Each node's part in a run: ``pub`` / ``sub`` (the clients' nodes) and ``leader`` / ``follower`` (a voter
    of the topic's shard, a peer of the stream, a member of the queue) / ``non-voter`` (none of these)."""
    out = {}
    for name in names:
        parts = [part for part, node in (("pub", publish_node), ("sub", subscribe_node)) if node == name]
        parts.append("leader" if name == leader else "follower" if name in voters else "non-voter")
        out[name] = "+".join(parts)
    return out


def spread_clients(names: list[str], voters: tuple[str, ...] | list[str], default_pub: str,
                   default_sub: str) -> tuple[str, str]:
    """The publisher's and the subscriber's nodes: the first two nodes (in ``names`` order) that are not voters,
    when there are two (5 nodes, 3 replicas), else the defaults (3 nodes: every node votes)."""
    outside = [name for name in names if name not in voters]
    if len(outside) >= 2:
        return outside[0], outside[1]
    return default_pub, default_sub


def pick_moorline_topic(base: str, names: list[str], shard_count: int, shards: Mapping[int, Mapping[str, Any]],
                        leader_node: str, shard_of: Callable[[str, int], int]) -> Placement:
    """The workload's topic and the clients' nodes, from each shard's Raft view (``GET /v1/shards``).

    Every node a voter of every shard (3 nodes): a topic whose shard ``leader_node`` leads, the publisher on
    ``names[0]``, the subscriber on ``names[1]`` (the first cluster run's layout, kept). More nodes than voters:
    a topic whose shard is led by its preferred leader (the rebalancer would move any other), the publisher and
    the subscriber on two nodes that are not voters of it."""
    spread = any(set(names) - set(view["voters"]) for view in shards.values() if view.get("voters"))
    for index in range(100_000):
        topic = f"{base}/{index}"
        shard = shard_of(topic, shard_count)
        view = shards.get(shard)
        if not view or not view.get("leader"):
            continue
        leader, voters = str(view["leader"]), tuple(view.get("voters") or ())
        if not spread:
            if leader == leader_node:
                return Placement(topic, leader, voters, names[0], names[1], shard)
            continue
        if leader != view.get("preferred_leader", leader):
            continue
        pub, sub = spread_clients(names, voters, names[0], names[1])
        if pub not in voters and sub not in voters:
            return Placement(topic, leader, voters, pub, sub, shard)
    wanted = f"led by {leader_node}" if not spread else "led by its preferred leader with two non-voters"
    raise RuntimeError(f"no shard {wanted}: {dict(shards)}")


@dataclass(frozen=True)
class PairPlacement:
    """One saturation pair: its topic, the publisher's node, the subscriber's node (and, when known, the leader of
    the topic's shard or stream)."""

    index: int
    topic: str
    publish_node: str
    subscribe_node: str
    leader: str | None = None
    shard: int | None = None


def pair_nodes(index: int, names: list[str]) -> tuple[str, str]:
    """Pair ``index``'s publisher on node ``index % n``, its subscriber on node ``(index + 1) % n``."""
    return names[index % len(names)], names[(index + 1) % len(names)]


def spread_pairs(pairs: int, names: list[str], base: str = "bench/sat", leader: str | None = None
                 ) -> list[PairPlacement]:
    """Pairs spread over the nodes, one topic each (a broker that places its stream itself: NATS)."""
    return [PairPlacement(i, f"{base}/{i}", *pair_nodes(i, names), leader=leader) for i in range(pairs)]


def pick_moorline_pairs(pairs: int, names: list[str], shard_count: int, shards: Mapping[int, Mapping[str, Any]],
                        shard_of: Callable[[str, int], int], base: str = "bench/sat") -> list[PairPlacement]:
    """moorline's saturation pairs: pair ``i``'s publisher on ``names[i % n]``, its subscriber on
    ``names[(i + 1) % n]`` and its topic on a shard led by ``names[(i + 2) % n]`` (with three nodes each
    message crosses all three, as in W1), a shard no earlier pair uses while there is one; so the pairs' shards
    are led by every node in turn."""
    used: set[int] = set()
    out = []
    for i in range(pairs):
        pub, sub = pair_nodes(i, names)
        wanted = names[(i + 2) % len(names)]
        fallback: PairPlacement | None = None
        chosen: PairPlacement | None = None
        for k in range(100_000):
            topic = f"{base}/{i}/{k}"
            shard = shard_of(topic, shard_count)
            view = shards.get(shard)
            if not view or str(view.get("leader")) != wanted:
                continue
            candidate = PairPlacement(i, topic, pub, sub, wanted, shard)
            if shard not in used:
                chosen = candidate
                break
            fallback = fallback or candidate
            if k > 10 * shard_count:  # every shard this node leads is taken by an earlier pair
                break
        chosen = chosen or fallback
        if chosen is None:
            raise RuntimeError(f"no shard led by {wanted} for saturation pair {i}: {dict(shards)}")
        used.add(chosen.shard or 0)
        out.append(chosen)
    return out


def next_pair_count(steps: list[tuple[int, float]], start: tuple[int, ...], max_pairs: int) -> int | None:
    """The saturation sweep's next pair count after ``steps`` ((pairs, delivered msgs/s) so far, in order): the
    ``start`` counts first, then one more pair while the last one still added more than 5 %, at most
    ``max_pairs``; None: the sweep is done."""
    if len(steps) < len(start):
        return start[len(steps)]
    if len(steps) < 2:
        return None
    (_, before), (pairs, last) = steps[-2], steps[-1]
    if last > 1.05 * before and pairs < max_pairs:
        return pairs + 1
    return None


def cpu_by_role(cpu_by_member: Mapping[str, float], roles: Mapping[str, str], received: int) -> dict[str, Any]:
    """CPU-s per 10k messages of a node in each role (the mean over the nodes of a role: two followers), and
    the role's nodes' share of the summed CPU."""
    total = sum(cpu_by_member.values())
    out: dict[str, Any] = {}
    for member, cpu in cpu_by_member.items():
        role = roles.get(member, member)
        entry = out.setdefault(role, {"nodes": 0, "cpu_s": 0.0})
        entry["nodes"] += 1
        entry["cpu_s"] += cpu
    for entry in out.values():
        entry["cpu_s_per_10k_per_node"] = entry["cpu_s"] / entry["nodes"] / received * 10_000 if received else None
        entry["share"] = entry["cpu_s"] / total if total > 0 else None
    return out


def median_by_role(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per role, the median over the repetitions that had it of its CPU-s/10k per node and its share."""
    import statistics

    out: dict[str, Any] = {}
    roles: list[str] = []
    for rep in reps:
        roles.extend(role for role in rep.get("cpu_by_role", {}) if role not in roles)
    for role in roles:
        entries = [rep["cpu_by_role"][role] for rep in reps if role in rep.get("cpu_by_role", {})]
        per_node = [e["cpu_s_per_10k_per_node"] for e in entries if e.get("cpu_s_per_10k_per_node") is not None]
        shares = [e["share"] for e in entries if e.get("share") is not None]
        out[role] = {"nodes": entries[0]["nodes"], "reps": len(entries),
                     "cpu_s_per_10k_per_node": statistics.median(per_node) if per_node else None,
                     "share": statistics.median(shares) if shares else None}
    return out


def _role_order(role: str) -> tuple[int, str]:
    """pub's node, sub's node, the leader, followers, the rest (epmd)."""
    for rank, word in enumerate(("pub", "sub", "leader", "follower", "non-voter")):
        if role.startswith(word) or role.endswith(word):
            return rank, role
    return 9, role


def format_roles(by_role: Mapping[str, Any]) -> str:
    """``pub+non-voter 0.21 (17%), leader 0.40 (32%), follower x2 0.30 (24%)``: CPU-s/10k of one node in the
    role and the role's nodes' share of the summed CPU."""
    parts = []
    for role in sorted(by_role, key=_role_order):
        entry = by_role[role]
        count = f" x{entry['nodes']}" if entry.get("nodes", 1) > 1 else ""
        value = _num(entry.get("cpu_s_per_10k_per_node"), ".3f")
        share = entry.get("share")
        parts.append(f"{role}{count} {value}" + (f" ({share * 100:.0f}%)" if isinstance(share, float) else ""))
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# moorline


@dataclass
class RunningMoorlineCluster(RunningCluster):
    http_ports: list[int] = field(default_factory=list)
    leader_node: str = "n3"  # the node whose shard the workload's topic is on
    _chosen: list[tuple[str, int]] = field(default_factory=list)

    def shards(self, node: int = 0) -> dict[str, Any]:
        result: dict[str, Any] = _get_json(f"http://127.0.0.1:{self.http_ports[node]}/v1/shards")
        return result

    def shard_views(self) -> tuple[int, dict[int, dict[str, Any]]]:
        """Each shard's Raft view from the first node that knows its leader and voters."""
        views: dict[int, dict[str, Any]] = {}
        shard_count = 0
        for node in range(len(self.http_ports)):
            report = self.shards(node)
            shard_count = report["shard_count"]
            for entry in report["shards"]:
                if entry.get("leader") and entry.get("voters") and entry["shard"] not in views:
                    views[entry["shard"]] = entry
        return shard_count, views

    def topic_for(self, base: str) -> str:
        """The topic (and the clients' nodes): see ``pick_moorline_topic``."""
        from moorline.hashing import shard_of

        shard_count, views = self.shard_views()
        placement = pick_moorline_topic(base, self.member_names(), shard_count, views, self.leader_node, shard_of)
        self.place(placement)
        self._chosen.append((placement.topic, placement.shard or 0))
        self.notes.update({"topic": placement.topic, "topic_shard": placement.shard,
                           "topic_leader_at_start": placement.leader})
        return placement.topic

    def saturation_pairs(self, pairs: int) -> list[PairPlacement]:
        """See ``pick_moorline_pairs``: the pairs' shards led by each node in turn."""
        from moorline.hashing import shard_of

        shard_count, views = self.shard_views()
        placed = pick_moorline_pairs(pairs, self.member_names(), shard_count, views, shard_of)
        self.notes["saturation_pairs"] = [asdict(p) for p in placed]
        return placed

    def before_stop(self) -> None:
        if self.notes.get("saturation_pairs"):
            views = self.shard_views()[1]
            moved = [p["index"] for p in self.notes["saturation_pairs"]
                     if views.get(p["shard"], {}).get("leader") != p["leader"]]
            self.notes["saturation_leaders_moved"] = moved  # pairs whose shard's leader changed during the run
        if not self._chosen:
            return
        _, shard = self._chosen[-1]
        entry = self.shard_views()[1].get(shard, {})
        self.notes["topic_leader_at_end"] = entry.get("leader")
        self.notes["topic_shard_term_at_end"] = entry.get("term")


# shard.learners of the moorline clusters a run starts (``python -m bench --learners``): "all" (every node
# keeps every shard) or "none" (a shard on its replicas only; the other nodes read it through reader feeds).
MOORLINE_LEARNERS = ["all"]


class MoorlineCluster(Broker):
    """``python -m moorline run`` once per node, each a member of one static cluster (--initial-cluster), with
    ``shard.replicas = 3`` in a config file of the run."""

    name = "moorline"

    def __init__(self, nodes: int = 3, replicas: int = CLUSTER_REPLICAS, learners: str | None = None) -> None:
        self.nodes = nodes
        self.replicas = replicas
        self.learners = learners or MOORLINE_LEARNERS[0]
        self.single = Moorline()

    def config_text(self) -> str:
        return f"[shard]\nreplicas = {self.replicas}\nlearners = \"{self.learners}\"\n"

    def prepare(self, log: Log) -> str:
        why = hosts_bindable(self.nodes)
        if why is not None:
            raise BrokerUnavailable(f"the nodes' cluster addresses are not usable here: {why}")
        return (f"{self.single.prepare(log)}, {self.nodes} nodes, shard.replicas = {self.replicas}, "
                f"shard.learners = {self.learners}")

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        names = [f"n{i + 1}" for i in range(self.nodes)]
        hosts = NODE_HOSTS[: self.nodes]
        cluster_addrs = [f"{host}:{free_port(host)}" for host in hosts]
        initial = ",".join(f"{name}={addr}" for name, addr in zip(names, cluster_addrs, strict=True))
        procs: list[tuple[str, Path, subprocess.Popen[bytes]]] = []
        members: list[RunningBroker] = []
        config = workdir / "moorline.toml"
        config.write_text(self.config_text())
        try:
            for name, addr in zip(names, cluster_addrs, strict=True):
                node_dir = workdir / name
                (node_dir / "data").mkdir(parents=True)
                argv = [*self.single._argv(), "--node-id", name, "--cluster", addr, "--initial-cluster", initial,
                        "--data-dir", str(node_dir / "data"), "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0",
                        "--config", str(config)]
                procs.append((name, node_dir, _spawn(argv, node_dir, Moorline._checkout_env(env), stdout_pipe=True)))
            http_ports = []
            for name, node_dir, proc in procs:
                # A node prints its ready line once the cluster is formed; all of them start at once.
                mqtt_port, http_port = _read_ready_ports(proc, CLUSTER_READY_TIMEOUT_S)
                assert proc.stdout is not None
                sink = open(node_dir / "stdout.log", "wb")  # noqa: SIM115 - closed by RunningBroker.stop
                threading.Thread(target=_drain, args=(proc.stdout, sink), daemon=True).start()
                member = RunningBroker(name, proc, mqtt_port, protocol=5, workdir=node_dir)
                member._log_files.append(sink)
                members.append(member)
                http_ports.append(http_port)
            cluster = RunningMoorlineCluster(
                self.name, members[0].proc, members[0].port, protocol=5, workdir=workdir,
                publish_port=members[0].port, subscribe_port=members[1].port, members=members,
                log_pattern=_LogPattern(re.compile(r" (ERROR|CRITICAL) "), re.compile(r" WARNING ")),
                http_ports=http_ports, leader_node=names[-1],
            )
            _wait_for_moorline_leaders(cluster, CLUSTER_READY_TIMEOUT_S)
            cluster.mark_ready()
            return cluster
        except BaseException:
            started = {member.proc.pid for member in members}
            _stop_all(members)
            for name, node_dir, proc in procs:
                if proc.pid not in started:
                    RunningBroker(name, proc, 0, 5, node_dir).stop()
            raise


def _wait_for_moorline_leaders(cluster: RunningMoorlineCluster, timeout_s: float) -> None:
    """Every node sees a leader for every shard (a fresh cluster elects them within a few seconds)."""
    deadline = time.monotonic() + timeout_s
    missing: Any = "no answer yet"
    while time.monotonic() < deadline:
        if not cluster.alive():
            raise RuntimeError("a moorline node exited while the cluster formed")
        try:
            missing = {}
            for node in range(len(cluster.http_ports)):
                report = cluster.shards(node)
                leaderless = [e["shard"] for e in report["shards"] if not e.get("leader")]
                if leaderless:
                    missing[cluster.members[node].name] = leaderless
            if not missing:
                return
        except OSError as exc:
            missing = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    raise RuntimeError(f"shards without a leader after {timeout_s} s: {missing}")


# ---------------------------------------------------------------------------------------------------------------
# NATS


@dataclass
class RunningNatsCluster(RunningCluster):
    monitor_ports: list[int] = field(default_factory=list)

    def stream_placement(self) -> tuple[str | None, list[str]]:
        """The MQTT message stream's leader and peers (NATS places it itself), from the first node that hosts it
        (a node lists the streams it hosts, each with its leader and the *other* peers as ``replicas``)."""
        for name, port in zip(self.member_names(), self.monitor_ports, strict=True):
            found = stream_placement(name, _get_json(f"http://127.0.0.1:{port}/jsz?accounts=true&streams=true"))
            if found is not None:
                return found
        return None, []

    def topic_for(self, base: str) -> str:
        """The clients on the two nodes that are no peer of the ``$MQTT_msgs`` stream when there are two."""
        names = self.member_names()
        leader, peers = self.stream_placement()
        pub, sub = spread_clients(names, peers, names[0], names[1]) if leader else (names[0], names[1])
        self.place(Placement(base, leader or "", tuple(peers), pub, sub))
        self.notes["mqtt_msgs_stream_leader_at_start"] = leader
        return base

    def saturation_pairs(self, pairs: int) -> list[PairPlacement]:
        """Spread over the nodes; every topic's messages go to the one ``$MQTT_msgs`` stream NATS placed."""
        leader, peers = self.stream_placement()
        placed = spread_pairs(pairs, self.member_names(), leader=leader)
        self.notes.update({"saturation_pairs": [asdict(p) for p in placed],
                           "mqtt_msgs_stream_leader_at_start": leader, "topic_voters": peers})
        return placed

    def before_stop(self) -> None:
        """Where the MQTT message stream's leader is at the end."""
        self.notes["mqtt_msgs_stream_leader"] = self.stream_placement()[0]


def stream_placement(host: str, report: Mapping[str, Any], stream_name: str = "$MQTT_msgs"
                     ) -> tuple[str, list[str]] | None:
    """A stream's leader and peers from ``host``'s ``/jsz?accounts=true&streams=true`` (None: ``host`` does not
    host it or knows no leader); a node lists each stream it hosts with the *other* peers as ``replicas``."""
    for account in report.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            placed = stream.get("cluster") or {}
            if stream.get("name") == stream_name and placed.get("leader"):
                peers = [host, *(str(r["name"]) for r in placed.get("replicas") or [] if r.get("name"))]
                return str(placed["leader"]), sorted(set(peers))
    return None


class NatsCluster(Broker):
    """nats-server processes with JetStream, clustered, MQTT listener on with 3 stream replicas."""

    name = "nats"

    def __init__(self, nodes: int = 3) -> None:
        self.nodes = nodes
        self.replicas = min(CLUSTER_REPLICAS, nodes)
        self.binary: str | None = None

    def _find(self) -> str | None:
        return shutil.which("nats-server") or next(
            (p for p in ("/usr/bin/nats-server", "/usr/sbin/nats-server") if os.path.exists(p)), None
        )

    def prepare(self, log: Log) -> str:
        why = hosts_bindable(self.nodes)
        if why is not None:
            raise BrokerUnavailable(f"the nodes' route addresses are not usable here: {why}")
        self.binary = self._find() or _apt_install("nats-server", self._find, log)
        out = subprocess.run([self.binary, "--version"], capture_output=True, timeout=30)
        match = re.search(r"v?(\d+\.\d+\.\d+)", (out.stdout + out.stderr).decode())
        return f"{match.group(1) if match else 'unknown'}, {self.nodes} nodes, R{self.replicas}"

    def config_text(self, name: str, node_dir: Path, route: str, routes: list[str], client_port: int,
                    monitor_port: int, mqtt_port: int) -> str:
        return (
            f"server_name: {name}\n"
            f"listen: 127.0.0.1:{client_port}\n"
            f"http: 127.0.0.1:{monitor_port}\n"
            f'jetstream {{\n  store_dir: "{node_dir / "js"}"\n}}\n'
            "cluster {\n  name: bench\n"
            f"  listen: {route.removeprefix('nats://')}\n"
            f"  routes: [{', '.join(routes)}]\n}}\n"
            # R3 for the MQTT sessions and messages streams; 256 consumer-side credit, like every peer.
            f"mqtt {{\n  listen: 127.0.0.1:{mqtt_port}\n  stream_replicas: {self.replicas}\n"
            "  max_ack_pending: 256\n}\n"
        )

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        assert self.binary is not None, "prepare() first"
        names = [f"n{i + 1}" for i in range(self.nodes)]
        hosts = NODE_HOSTS[: self.nodes]
        routes = [f"nats://{host}:{free_port(host)}" for host in hosts]
        members: list[RunningBroker] = []
        monitor_ports = []
        try:
            for name, route in zip(names, routes, strict=True):
                node_dir = workdir / name
                node_dir.mkdir()
                client_port, mqtt_port, monitor_port = free_port(), free_port(), free_port()
                conf = node_dir / "nats.conf"
                conf.write_text(self.config_text(name, node_dir, route, routes, client_port, monitor_port,
                                                 mqtt_port))
                proc = _spawn([self.binary, "-c", str(conf)], node_dir, env, stdout_pipe=False)
                members.append(RunningBroker(name, proc, mqtt_port, protocol=4, workdir=node_dir))
                monitor_ports.append(monitor_port)
            cluster = RunningNatsCluster(
                self.name, members[0].proc, members[0].port, protocol=4, workdir=workdir,
                publish_port=members[0].port, subscribe_port=members[1].port, members=members,
                log_pattern=_LogPattern(re.compile(r"\[(ERR|FTL)\]"), re.compile(r"\[WRN\]")),
                monitor_ports=monitor_ports,
            )
            deadline = time.monotonic() + CLUSTER_READY_TIMEOUT_S
            for member in members:
                # JetStream must have its meta leader and the MQTT streams before a CONNECT is accepted.
                _wait_for_mqtt_connack(member, deadline)
            cluster.mark_ready()
            return cluster
        except BaseException:
            _stop_all(members)
            raise


def _wait_for_mqtt_connack(member: RunningBroker, deadline: float) -> None:
    """A 3.1.1 CONNECT to ``member`` is accepted (CONNACK return code 0) before ``deadline``."""
    client_id = f"bench-probe-{os.urandom(4).hex()}".encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id  # clean session
    packet = bytes([0x10, len(body)]) + body
    last = "no attempt"
    while time.monotonic() < deadline:
        if member.proc.poll() is not None:
            raise RuntimeError(f"{member.name} exited with {member.proc.returncode} while the cluster formed")
        try:
            with socket.create_connection(("127.0.0.1", member.port), timeout=5) as sock:
                sock.sendall(packet)
                answer = sock.recv(4)
            if len(answer) == 4 and answer[0] == 0x20 and answer[3] == 0:
                return
            last = f"CONNACK {answer.hex()}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.3)
    raise RuntimeError(f"{member.name}: no successful MQTT CONNECT in time (last: {last})")


def _apt_install(package: str, find: Callable[[], str | None], log: Log) -> str:
    """Install a Debian package when running as root (as the bench does for mosquitto); its path or unavailable."""
    if os.geteuid() != 0:
        raise BrokerUnavailable(f"{package} is not installed and we are not root (apt-get install {package})")
    log(f"{package} missing: apt-get install -y {package}")
    apt_env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", package]
    result = subprocess.run(command, env=apt_env, capture_output=True, timeout=900)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update"], env=apt_env, capture_output=True, timeout=600)
        result = subprocess.run(command, env=apt_env, capture_output=True, timeout=900)
    found = find()
    if found is None:
        raise BrokerUnavailable(f"apt-get install {package} failed: {result.stderr.decode()[-300:]}")
    return found


# ---------------------------------------------------------------------------------------------------------------
# RabbitMQ

RABBIT_LIB = Path("/usr/lib/rabbitmq/bin")  # the scripts themselves: /usr/sbin's wrappers su to 'rabbitmq'


@dataclass
class RunningRabbitCluster(RunningCluster):
    amqp_ports: list[int] = field(default_factory=list)
    ctl_env: dict[str, str] = field(default_factory=dict)
    node_names: list[str] = field(default_factory=list)

    def ctl(self, *args: str, node: int = 0, timeout_s: float = 60.0) -> str:
        out = subprocess.run(
            [str(RABBIT_LIB / "rabbitmqctl"), "-n", self.node_names[node], *args],
            env={**os.environ, **self.ctl_env}, capture_output=True, timeout=timeout_s,
        )
        if out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {(out.stdout + out.stderr).decode()[-400:]}")
        return out.stdout.decode()

    def queue_leaders(self) -> dict[str, str]:
        rows = json.loads(self.ctl("list_queues", "name", "leader", "--formatter", "json", "--quiet"))
        return {row["name"]: row.get("leader", "") for row in rows}

    def queue_members(self, queue: str) -> list[str]:
        rows = json.loads(self.ctl("list_queues", "name", "members", "--formatter", "json", "--quiet"))
        return next((list(row.get("members") or []) for row in rows if row["name"] == queue), [])

    def topic_for(self, base: str) -> str:
        """A quorum queue of 3 members declared through the last node (client-local leader locator: it leads
        it); the clients on node 1 and node 2, or on the two nodes that are no member of it when there are two."""
        queue = base.replace("/", ".")
        declare_quorum_queue(self.amqp_ports[-1], queue, min(CLUSTER_REPLICAS, len(self.node_names)))
        leader = self.queue_leaders().get(queue)
        self.notes.update({"queue": queue, "queue_leader_at_start": leader})
        if leader != self.node_names[-1]:
            raise RuntimeError(f"quorum queue {queue} is led by {leader}, not {self.node_names[-1]}")
        short = dict(zip(self.node_names, self.member_names()[: len(self.node_names)], strict=True))
        voters = tuple(short.get(member, member) for member in self.queue_members(queue))
        names = [short[node] for node in self.node_names]
        pub, sub = spread_clients(names, voters, names[0], names[1])
        self.place(Placement(queue, short[leader], voters, pub, sub))
        return queue

    def before_stop(self) -> None:
        queue = self.notes.get("queue")
        if queue:
            self.notes["queue_leader_at_end"] = self.queue_leaders().get(queue)


def quorum_queue_arguments(group_size: int) -> dict[str, Any]:
    return {"x-queue-type": "quorum", "x-queue-leader-locator": "client-local",
            "x-quorum-initial-group-size": group_size}


def declare_quorum_queue(port: int, queue: str, group_size: int) -> None:
    """A durable quorum queue of ``group_size`` members declared through the node on ``port``: with the
    client-local leader locator its leader is that node; RabbitMQ picks the other members."""
    pika = amqp_clients._pika(str(PIKA_DIR))
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        connection.channel().queue_declare(queue, durable=True, arguments=quorum_queue_arguments(group_size))
    finally:
        connection.close()


class RabbitCluster(Broker):
    """Debian's rabbitmq-server, three nodes on this host (own node names, ports, mnesia dirs, an epmd of our own
    on its own port), clustered by classic config; quorum queues; pika clients (installed into the cache dir)."""

    name = "rabbitmq"

    def __init__(self, nodes: int = 3) -> None:
        self.nodes = nodes

    @staticmethod
    def _find() -> str | None:
        script = RABBIT_LIB / "rabbitmq-server"
        return str(script) if script.exists() else None

    def prepare(self, log: Log) -> str:
        if self._find() is None:
            _apt_install("rabbitmq-server", self._find, log)
        epmd = shutil.which("epmd")
        if epmd is None:
            raise BrokerUnavailable("rabbitmq-server is installed but epmd is not on PATH")
        if not (PIKA_DIR / "pika").exists():
            log(f"installing pika=={PIKA_VERSION} into {PIKA_DIR}")
            result = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--target", str(PIKA_DIR), f"pika=={PIKA_VERSION}"],
                capture_output=True, timeout=600,
            )
            if result.returncode != 0:
                raise BrokerUnavailable(f"could not install pika: {result.stderr.decode()[-300:]}")
        version = "unknown"
        for path in Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*"):
            version = path.name.removeprefix("rabbitmq_server-")
        return f"{version}, {self.nodes} nodes, quorum queue"

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        names = [f"bench{i + 1}@localhost" for i in range(self.nodes)]
        epmd_port = free_port()
        cookie = os.urandom(16).hex()
        members: list[RunningBroker] = []
        try:
            epmd_dir = workdir / "epmd"
            epmd_dir.mkdir()
            epmd = _spawn([shutil.which("epmd") or "epmd", "-port", str(epmd_port)], epmd_dir, env, stdout_pipe=False)
            members.append(RunningBroker("epmd", epmd, epmd_port, protocol=0, workdir=epmd_dir))
            amqp_ports: list[int] = []
            common_env = {"ERL_EPMD_PORT": str(epmd_port), "RABBITMQ_USE_LONGNAME": "false"}
            for index, node in enumerate(names):
                node_dir = workdir / f"n{index + 1}"
                (node_dir / "mnesia").mkdir(parents=True)
                (node_dir / "log").mkdir()
                cookie_file = node_dir / ".erlang.cookie"
                cookie_file.write_text(cookie)
                cookie_file.chmod(0o400)
                (node_dir / "enabled_plugins").write_text("[].\n")
                (node_dir / "rabbitmq.conf").write_text(
                    "loopback_users = none\n"
                    "cluster_formation.peer_discovery_backend = classic_config\n"
                    + "".join(f"cluster_formation.classic_config.nodes.{i + 1} = {n}\n" for i, n in enumerate(names))
                )
                amqp_port = free_port()
                node_env = {
                    **(env or {}),
                    **common_env,
                    "HOME": str(node_dir),  # the Erlang cookie
                    "RABBITMQ_NODENAME": node,
                    "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                    "RABBITMQ_NODE_PORT": str(amqp_port),
                    "RABBITMQ_DIST_PORT": str(_free_dist_port()),
                    "RABBITMQ_MNESIA_BASE": str(node_dir / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(node_dir / "log"),
                    "RABBITMQ_LOGS": str(node_dir / "rabbit.log"),
                    "RABBITMQ_CONFIG_FILE": str(node_dir / "rabbitmq.conf"),
                    "RABBITMQ_ADVANCED_CONFIG_FILE": str(node_dir / "advanced.config"),
                    "RABBITMQ_CONF_ENV_FILE": str(node_dir / "rabbitmq-env.conf"),  # not /etc's
                    "RABBITMQ_ENABLED_PLUGINS_FILE": str(node_dir / "enabled_plugins"),
                    "RABBITMQ_PID_FILE": str(node_dir / "rabbit.pid"),
                }
                proc = _spawn([str(RABBIT_LIB / "rabbitmq-server")], node_dir, node_env, stdout_pipe=False)
                members.append(RunningBroker(f"n{index + 1}", proc, amqp_port, protocol=0, workdir=node_dir))
                amqp_ports.append(amqp_port)
            nodes = members[1:]
            cluster = RunningRabbitCluster(
                self.name, nodes[0].proc, amqp_ports[0], protocol=0, workdir=workdir,
                publish_port=amqp_ports[0], subscribe_port=amqp_ports[1], members=members,
                log_pattern=_LogPattern(re.compile(r"\[(error|critical|alert|emergency)\]"),
                                        re.compile(r"\[warning\]")),
                log_name="rabbit.log", amqp_ports=amqp_ports,
                ctl_env={**common_env, "HOME": str(nodes[0].workdir)}, node_names=names,
            )
            _wait_for_rabbit_cluster(cluster, CLUSTER_READY_TIMEOUT_S)
            cluster.mark_ready()
            return cluster
        except BaseException:
            _stop_all(members[::-1])  # the nodes, then their epmd
            raise


def _free_dist_port() -> int:
    """A free port outside 35672-35682, which rabbitmqctl uses for itself."""
    while True:
        port = free_port()
        if not 35672 <= port <= 35682:
            return port


def _wait_for_rabbit_cluster(cluster: RunningRabbitCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not cluster.alive():
            raise RuntimeError("a RabbitMQ node (or its epmd) exited while the cluster formed")
        try:
            status = json.loads(cluster.ctl("cluster_status", "--formatter", "json", timeout_s=30))
            running = set(status.get("running_nodes", []))
            if running >= set(cluster.node_names):
                for port in cluster.amqp_ports:
                    with socket.create_connection(("127.0.0.1", port), timeout=2):
                        pass
                return
            last = f"running nodes {sorted(running)}"
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            last = str(exc)[-300:]
        time.sleep(1.0)
    raise RuntimeError(f"the RabbitMQ cluster did not form within {timeout_s} s: {last}")


def run_amqp_once(kind: Broker, workload: runner.PahoWorkload, timeout_s: float) -> dict[str, Any]:
    """W1/W2 through AMQP: a fresh cluster, the queue declared, warm-up, then the measured pass."""
    ctx = multiprocessing.get_context("spawn")

    def body(broker: RunningBroker) -> dict[str, Any]:
        queue = broker.topic_for(f"bench/{workload.name}")
        sub_conn, sub_child = ctx.Pipe()
        pub_conn, pub_child = ctx.Pipe()
        common = (queue, workload.warmup, workload.messages)
        sub = ctx.Process(
            target=amqp_clients.subscriber_main,
            args=(sub_child, broker.subscribe_port, *common, workload.window, timeout_s, str(PIKA_DIR)),
            name="amqp-consumer", daemon=True,
        )
        pub = ctx.Process(
            target=amqp_clients.publisher_main,
            args=(pub_child, broker.publish_port, *common, workload.payload_bytes, workload.window, timeout_s,
                  str(PIKA_DIR)),
            name="amqp-publisher", daemon=True,
        )
        try:
            sub.start()
            runner._expect(sub_conn, "ready", 60, sub)
            pub.start()
            runner._expect(pub_conn, "ready", 60, pub)
            pub_conn.send("warmup")
            _, warm_ok = runner._expect(pub_conn, "warm_acked", timeout_s, pub)
            runner._expect(sub_conn, "warm_done", timeout_s, sub)
            if not warm_ok:
                raise RuntimeError("warm-up publishes were not all confirmed in time")
            cpu_before = broker.cpu_seconds_by_member()
            pub_conn.send("go")
            _, pub_result = runner._expect(pub_conn, "done", timeout_s + 10, pub)
            _, sub_result = runner._expect(sub_conn, "result", timeout_s + 10, sub)
            cpu_after = broker.cpu_seconds_by_member()
        finally:
            runner._stop_clients([pub, sub])
        cpu_by_member = {member: cpu_after[member] - cpu_before[member] for member in cpu_before}
        cpu = sum(cpu_by_member.values())
        elapsed_s = (sub_result["last_receive_ns"] - pub_result["first_publish_ns"]) / 1e9
        received = sub_result["received"]
        return {
            "complete": bool(pub_result["complete"] and sub_result["complete"]),
            "messages": workload.messages,
            "received": received,
            "duplicates": sub_result["duplicates"],
            "elapsed_s": elapsed_s,
            "msgs_per_s": received / elapsed_s if elapsed_s > 0 else 0.0,
            "latency_p50_ms": sub_result["latency_p50_ns"] / 1e6,
            "latency_p99_ms": sub_result["latency_p99_ns"] / 1e6,
            "latency_max_ms": sub_result["latency_max_ns"] / 1e6,
            "cpu_s": cpu,
            "cpu_s_per_10k": cpu / received * 10_000 if received else None,
            "topic": queue,
            "cpu_s_by_member": cpu_by_member,
        }

    return runner._with_broker(kind, None, body)


def run_cluster_saturation_once(kind: Broker, workload: runner.SaturationWorkload, pairs: int,
                                timeout_s: float) -> dict[str, Any]:
    """A fresh cluster, ``pairs`` load-generator processes (bench/loadgen.py) placed by the cluster's
    ``saturation_pairs``: each publisher and its subscriber on different nodes. Delivered messages in the
    measuring window, and the CPU of every node read at its start and end."""

    def body(broker: RunningBroker) -> dict[str, Any]:
        if not isinstance(broker, RunningCluster):
            raise RuntimeError(f"{kind.name}: the cluster saturation run needs a cluster")
        ports = {member.name: member.port for member in broker.members}
        placements = [(pair.index, ports[pair.publish_node],
                       {"sub_port": ports[pair.subscribe_node], "topic": pair.topic})
                      for pair in broker.saturation_pairs(pairs)]
        results, cpu_before, cpu_after = runner.drive_pairs(workload, placements, broker.protocol,
                                                            broker.cpu_seconds_by_member, timeout_s)
        cpu_by_member = {member: cpu_after[member] - cpu_before[member] for member in cpu_before}
        return {**runner.saturation_figures(pairs, workload, results, sum(cpu_by_member.values())),
                "cpu_s_by_member": cpu_by_member,
                "delivered_by_pair": [r["delivered_in_window"] for r in results]}

    return runner._with_broker(kind, None, body)


def saturation_sweep(kind: Broker, workload: runner.SaturationWorkload, timeout_s: float, log: Log
                     ) -> dict[str, Any]:
    """The pair counts of ``next_pair_count``, a fresh cluster for each; the best delivered rate is the figure."""
    steps: list[dict[str, Any]] = []
    pairs = next_pair_count([], workload.pair_counts, workload.max_pairs)
    while pairs is not None:
        def step(pairs: int = pairs) -> dict[str, Any]:
            return run_cluster_saturation_once(kind, workload, pairs, timeout_s)

        result = runner._guarded(log, f"{kind.name} cluster saturation x{pairs}", step)
        if "error" in result:
            return {"error": result["error"], "steps": steps}
        shares = ", ".join(f"{name} {cpu / result['cpu_s'] * 100:.0f}%"
                           for name, cpu in result["cpu_s_by_member"].items() if result["cpu_s"] > 0)
        log(f"{kind.name} cluster saturation {pairs} pair(s): {result['msgs_per_s']:,.0f} msgs/s delivered, "
            f"{result['publish_acks_per_s']:,.0f} PUBACKs/s, {result['cpu_s_per_10k'] or 0:.3f} CPU-s/10k summed "
            f"({shares})"
            + (f" [yellow]{result['log_errors']} errors, {result['log_warnings']} warnings in node logs[/yellow]"
               if result.get("log_errors") or result.get("log_warnings") else ""))
        steps.append(result)
        pairs = next_pair_count([(s["pairs"], s["msgs_per_s"]) for s in steps], workload.pair_counts,
                                workload.max_pairs)
    best = max(steps, key=lambda r: r["msgs_per_s"])
    # The best at the largest pair count, still clearly above the one before: the clients may be the limit.
    still_rising = len(steps) > 1 and best is steps[-1] and steps[-1]["msgs_per_s"] > 1.05 * steps[-2]["msgs_per_s"]
    return {"max": best, "steps": steps, "still_rising": still_rising}


# ---------------------------------------------------------------------------------------------------------------
# Orchestration, comparison, report

CLUSTER_BROKERS: dict[str, Callable[[int], Broker]] = {
    "moorline": MoorlineCluster, "nats": NatsCluster, "rabbitmq": RabbitCluster,
}
DEFAULT_CLUSTER_BROKERS = "moorline,nats,rabbitmq"


@dataclass(frozen=True)
class ClusterBenchConfig:
    brokers: tuple[str, ...]
    nodes: int
    reps: int
    w1: runner.PahoWorkload
    w2: runner.PahoWorkload
    client_timeout_s: float = 180.0
    targets: dict[str, float] = field(
        default_factory=lambda: {"w1_cpu_s_per_10k": 0.5, "w1_p99_ms": 50.0}
    )
    # The lean load generator's pairs spread over the nodes (3 nodes only); None: not run.
    saturation: runner.SaturationWorkload | None = None
    workloads: tuple[str, ...] = ("w1", "w2")


CLUSTER_WORKLOADS = ("w1", "w2", "saturation")
SATURATION_NODES = 3  # the saturation sweep runs against 3-node clusters (issue 32's target is about 3 nodes)
SATURATION_BROKERS = ("moorline", "nats")  # RabbitMQ speaks AMQP: the MQTT load generator does not fit it
SATURATION_MAX_PAIRS = 6


def parse_workloads(text: str | None, nodes: int) -> tuple[str, ...]:
    """``--workloads w1,w2,saturation`` (default: all that run at ``nodes``); a clear error for anything else."""
    default = CLUSTER_WORKLOADS if nodes == SATURATION_NODES else ("w1", "w2")
    if text is None:
        return default
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in CLUSTER_WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown cluster workload(s) {unknown or text!r}: choose from {', '.join(CLUSTER_WORKLOADS)}")
    if "saturation" in names and nodes != SATURATION_NODES:
        raise ValueError(f"the cluster saturation sweep runs at {SATURATION_NODES} nodes only")
    return names


def full_config(brokers: tuple[str, ...], nodes: int, reps: int,
                workloads: tuple[str, ...] = ("w1", "w2")) -> ClusterBenchConfig:
    return ClusterBenchConfig(
        brokers=brokers, nodes=nodes, reps=reps,
        w1=runner.PahoWorkload("w1", 100, 20_000, 1_000),
        w2=runner.PahoWorkload("w2", 64 * 1024, 2_000, 1_000),
        saturation=(runner.SaturationWorkload(pair_counts=(1, 2), warm_s=1.5, measure_s=5.0,
                                              max_pairs=SATURATION_MAX_PAIRS)
                    if "saturation" in workloads else None),
        workloads=workloads,
    )


def quick_config(brokers: tuple[str, ...], nodes: int, workloads: tuple[str, ...] = ("w1", "w2")) -> ClusterBenchConfig:
    return ClusterBenchConfig(
        brokers=brokers, nodes=nodes, reps=1,
        w1=runner.PahoWorkload("w1", 100, 2_000, 200),
        w2=runner.PahoWorkload("w2", 64 * 1024, 200, 50),
        client_timeout_s=60.0,
        saturation=(runner.SaturationWorkload(pair_counts=(1,), warm_s=0.5, measure_s=1.5,
                                              max_pairs=SATURATION_MAX_PAIRS)
                    if "saturation" in workloads else None),
        workloads=workloads,
    )


def _reps(kind: Broker, workload: runner.PahoWorkload, config: ClusterBenchConfig, log: Log,
          what: str = "cluster", first_rep: int = 0, of: int | None = None) -> dict[str, Any]:
    reps: list[dict[str, Any]] = []
    for rep in range(config.reps):
        label = f"{kind.name} {what} {workload.name} rep {first_rep + rep + 1}"

        def once() -> dict[str, Any]:
            if isinstance(kind, RabbitCluster):
                return run_amqp_once(kind, workload, config.client_timeout_s)
            return runner.run_paho_once(kind, workload, config.client_timeout_s)

        result = runner._guarded(log, label, once)
        if "error" in result:
            return {"error": result["error"], "reps": reps}
        add_roles(result)
        where = ", ".join(f"{k} {v}" for k, v in result.items()
                          if k in ("publish_node", "subscribe_node", "topic_voters", "topic_leader_at_start",
                                   "topic_leader_at_end", "queue_leader_at_end", "mqtt_msgs_stream_leader"))
        log(
            f"{label}/{of or config.reps}: {result['msgs_per_s']:,.0f} msgs/s, p50 {result['latency_p50_ms']:.1f} ms, "
            f"p99 {result['latency_p99_ms']:.1f} ms, {result['cpu_s_per_10k'] or 0:.3f} CPU-s/10k summed"
            + (f" ({where})" if where else "")
            + (f" [yellow]{result['log_errors']} errors, {result['log_warnings']} warnings in node logs "
               f"(kept in {result.get('logs_kept')})[/yellow]"
               if result.get("log_errors") or result.get("log_warnings") else "")
        )
        if result.get("cpu_by_role"):
            log(f"  CPU-s/10k per node: {format_roles(result['cpu_by_role'])}")
        reps.append(result)
    return {"median": runner.median_of(reps), "median_by_role": median_by_role(reps), "reps": reps}


def add_roles(result: dict[str, Any]) -> None:
    """``cpu_by_role`` from the run's CPU per node and the nodes' roles (every node its name when unknown)."""
    by_member = result.get("cpu_s_by_member")
    if not by_member and isinstance(result.get("cpu_s"), int | float):  # one node: it does everything
        by_member = {"n1": result["cpu_s"]}
        result["node_roles"] = {"n1": "pub+sub+leader"}
    if by_member:
        result["cpu_by_role"] = cpu_by_role(by_member, result.get("node_roles") or {}, result.get("received") or 0)


def run(config: ClusterBenchConfig, log: Log) -> dict[str, Any]:
    brokers: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for name in config.brokers:
        if name not in CLUSTER_BROKERS:
            brokers[name] = {"status": "skipped",
                             "reason": f"unknown cluster broker (known: {', '.join(CLUSTER_BROKERS)})"}
            log(f"[yellow]skipping {name}: unknown cluster broker[/yellow]")
            continue
        kind = CLUSTER_BROKERS[name](config.nodes)
        try:
            version = kind.prepare(log)
        except (BrokerUnavailable, OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            brokers[name] = {"status": "skipped", "reason": str(exc)}
            log(f"[yellow]skipping {name}: {exc}[/yellow]")
            continue
        brokers[name] = {"status": "ok", "version": version}
        log(f"[bold]{name}[/bold] {version}")
        results[name] = {}
        for workload in ("w1", "w2"):
            if workload in config.workloads:
                results[name][workload] = _reps(kind, getattr(config, workload), config, log)
        if config.saturation is not None:
            if name in SATURATION_BROKERS:
                results[name]["saturation"] = saturation_sweep(kind, config.saturation, config.client_timeout_s, log)
            else:
                results[name]["saturation"] = {"skipped": "not measured: the MQTT load generator does not speak AMQP"}
    return {"config": asdict(config), "brokers": brokers, "results": results,
            "comparison": compare(results, config)}


def compare(results: dict[str, Any], config: ClusterBenchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"targets": [], "ratios": {}}
    if "moorline" not in results:
        return out
    targets: list[tuple[str, float | None, str, float | None]] = [
        ("W1 CPU-s/10k, summed over nodes", runner._fig(results, "moorline", "w1", "cpu_s_per_10k"), "<=",
         config.targets["w1_cpu_s_per_10k"]),
        ("W1 p99 ms", runner._fig(results, "moorline", "w1", "latency_p99_ms"), "<=", config.targets["w1_p99_ms"]),
    ]
    if "saturation" in results["moorline"] and "nats" in results:
        targets.append(("saturation msgs/s vs NATS R3", runner._fig(results, "moorline", "saturation", "msgs_per_s"),
                        ">=", runner._fig(results, "nats", "saturation", "msgs_per_s")))
    targets = [row for row in targets if not row[0].startswith("W1") or "w1" in results["moorline"]]
    for label, value, op, bound in targets:
        fmt = ".1f" if label.endswith(" ms") else target_format(label)
        out["targets"].append({"target": label, "moorline": value, "op": op, "bound": bound,
                               "met": target_met(value, op, bound, fmt)})
    for peer in results:
        if peer == "moorline":
            continue
        ratios: dict[str, float | None] = {}
        for workload in ("w1", "w2"):
            for key in ("msgs_per_s", "cpu_s_per_10k", "latency_p99_ms", "peak_rss_mb"):
                mine, theirs = runner._fig(results, "moorline", workload, key), runner._fig(results, peer, workload, key)
                ratios[f"{workload}_{key}"] = mine / theirs if mine is not None and theirs else None
        for key in ("msgs_per_s", "cpu_s_per_10k"):
            mine, theirs = (runner._fig(results, "moorline", "saturation", key),
                            runner._fig(results, peer, "saturation", key))
            ratios[f"saturation_{key}"] = mine / theirs if mine is not None and theirs else None
        out["ratios"][peer] = ratios
    return out


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def print_report(console: Console, report: dict[str, Any]) -> None:
    config = report["config"]
    nodes = config["nodes"]
    for workload in ("w1", "w2"):
        if workload not in config.get("workloads", ("w1", "w2")):
            continue
        spec = config[workload]
        size = f"{spec['payload_bytes']} B" if spec["payload_bytes"] < 1024 else f"{spec['payload_bytes'] // 1024} KiB"
        clients = ("pub -> node 1, sub -> node 2" if nodes <= CLUSTER_REPLICAS
                   else f"pub and sub on the two nodes outside the topic's {CLUSTER_REPLICAS} replicas")
        table = Table(
            title=f"{workload.upper()} on {nodes}-node clusters: QoS 1 / confirms, {size} x {spec['messages']:,}, "
                  f"{clients}, median of {config['reps']}; CPU and RSS summed over all nodes",
            title_justify="left",
        )
        for column in ("broker", "msgs/s", "p50 ms", "p99 ms", "max ms", "CPU-s/10k", "peak RSS MB",
                       "CPU-s/10k per node (role, share)", "notes"):
            table.add_column(column, justify="left" if column in ("broker", "notes") or "role" in column else "right")
        for broker, per in report["results"].items():
            block = per.get(workload, {})
            figures = block.get("median")
            if figures is None:
                error = str(block.get("error", "no result"))
                table.add_row(broker, *["-"] * 7, f"[red]{error[:150]}[/red]")
                continue
            notes = []
            if not figures.get("complete", True):
                notes.append("[red]INCOMPLETE[/red]")
            if figures.get("duplicates"):
                notes.append(f"{figures['duplicates']:.0f} dup")
            reps = block.get("reps", [])
            errors = sum(r.get("log_errors", 0) for r in reps)
            warnings = sum(r.get("log_warnings", 0) for r in reps)
            if errors or warnings:
                notes.append(f"[yellow]node logs: {errors} errors, {warnings} warnings[/yellow]")
            moved = [r for r in reps if r.get("topic_leader_at_end") not in (None, r.get("topic_leader_at_start"))]
            if moved:
                notes.append(f"[yellow]leader moved in {len(moved)} rep(s)[/yellow]")
            table.add_row(
                broker,
                _num(figures.get("msgs_per_s"), ",.0f"),
                _num(figures.get("latency_p50_ms"), ".1f"),
                _num(figures.get("latency_p99_ms"), ".1f"),
                _num(figures.get("latency_max_ms"), ".1f"),
                _num(figures.get("cpu_s_per_10k"), ".3f"),
                _num(figures.get("peak_rss_mb"), ".0f"),
                format_roles(block.get("median_by_role") or {}),
                " ".join(notes),
            )
        console.print(table)
    if config.get("saturation"):
        print_saturation(console, report)
    comparison = report["comparison"]
    quick = bool(report.get("meta", {}).get("quick"))
    if comparison["targets"]:
        table = Table(title=f"moorline targets ({nodes} nodes, {min(nodes, CLUSTER_REPLICAS)} replicas)",
                      title_justify="left")
        for column in ("target", "moorline", "bound", "met"):
            table.add_column(column)
        for row in comparison["targets"]:
            fmt = ".1f" if row["target"].endswith(" ms") else target_format(row["target"])
            met = (f"[yellow]{QUICK_LABEL}[/yellow]" if quick
                   else {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[row["met"]])
            table.add_row(row["target"], _num(row["moorline"], fmt), f"{row['op']} {_num(row['bound'], fmt)}", met)
        console.print(table)
    if comparison["ratios"]:
        table = Table(title="moorline / peer, same run (msgs/s: higher is better; CPU, p99, RSS: lower is better)",
                      title_justify="left")
        table.add_column("peer")
        keys: tuple[str, ...] = ("w1_msgs_per_s", "w1_cpu_s_per_10k", "w1_latency_p99_ms", "w1_peak_rss_mb",
                                 "w2_msgs_per_s", "w2_cpu_s_per_10k", "w2_latency_p99_ms",
                                 "saturation_msgs_per_s", "saturation_cpu_s_per_10k")
        keys = tuple(k for k in keys if any(r.get(k) is not None for r in comparison["ratios"].values()))
        for key in keys:
            table.add_column(key.replace("_per_", "/").replace("_s/10k", "-s/10k").replace("latency_", "")
                             .replace("saturation_", "sat_"),
                             justify="right")
        for peer, ratios in comparison["ratios"].items():
            table.add_row(peer, *[_num(ratios.get(k), ".2f") + ("x" if ratios.get(k) is not None else "")
                                  for k in keys])
        console.print(table)
    for name, info in report["brokers"].items():
        if info["status"] != "ok":
            console.print(f"[yellow]{name} skipped:[/yellow] {info['reason']}")


def print_saturation(console: Console, report: dict[str, Any]) -> None:
    """The cluster saturation row of each broker: the best delivered rate of the sweep, and every step."""
    spec = report["config"]["saturation"]
    nodes = report["config"]["nodes"]
    table = Table(
        title=f"saturation on {nodes}-node clusters: lean load generator, QoS 1, {spec['payload_bytes']} B, "
              f"{spec['window']} in flight per publisher; pair i's publisher on node i % {nodes}, its subscriber "
              f"on node (i + 1) % {nodes}; best of the sweep over pairs ({spec['measure_s']:g} s measured after "
              f"{spec['warm_s']:g} s); CPU summed over all nodes",
        title_justify="left",
    )
    for column in ("broker", "best msgs/s", "pairs", "PUBACKs/s", "CPU-s/10k", "sweep (pairs: msgs/s)", "notes"):
        table.add_column(column, justify="left" if column in ("broker", "notes") or "sweep" in column else "right")
    for broker, per in report["results"].items():
        block = per.get("saturation")
        if block is None:
            continue
        steps = ", ".join(f"{s['pairs']}: {s['msgs_per_s']:,.0f}" for s in block.get("steps", []))
        best = block.get("max")
        if best is None:
            why = block.get("skipped") or block.get("error", "no result")
            colour = "yellow" if "skipped" in block else "red"
            table.add_row(broker, *["-"] * 4, steps or "-", f"[{colour}]{str(why)[:150]}[/{colour}]")
            continue
        notes = []
        if block.get("still_rising"):
            notes.append("[yellow]still rising at the last pair count[/yellow]")
        errors = sum(s.get("log_errors", 0) for s in block["steps"])
        warnings = sum(s.get("log_warnings", 0) for s in block["steps"])
        if errors or warnings:
            notes.append(f"[yellow]node logs: {errors} errors, {warnings} warnings[/yellow]")
        moved = [s for s in block["steps"] if s.get("saturation_leaders_moved")]
        if moved:
            notes.append(f"[yellow]a pair's shard leader moved in {len(moved)} step(s)[/yellow]")
        table.add_row(broker, _num(best.get("msgs_per_s"), ",.0f"), str(best.get("pairs")),
                      _num(best.get("publish_acks_per_s"), ",.0f"), _num(best.get("cpu_s_per_10k"), ".3f"),
                      steps, " ".join(notes))
    console.print(table)


def mark_quick(comparison: dict[str, Any]) -> None:
    for row in comparison["targets"]:
        row["met"] = None
        row["comparable"] = False


# ---------------------------------------------------------------------------------------------------------------
# The scale table (issue 32): moorline's W1 on 1, 3 and 5 nodes.

SCALE_SIZES = (1, 3, 5)
SCALE_TARGET_5_OVER_3 = 1.1  # issue 32: W1 summed CPU-s/10k at 5 nodes <= 1.1 x the 3-node figure


@dataclass(frozen=True)
class ScaleConfig:
    reps: int
    w1: runner.PahoWorkload
    sizes: tuple[int, ...] = SCALE_SIZES
    client_timeout_s: float = 180.0
    target_5_over_3: float = SCALE_TARGET_5_OVER_3


def scale_config(reps: int, quick: bool) -> ScaleConfig:
    source = quick_config(("moorline",), 3) if quick else full_config(("moorline",), 3, reps)
    return ScaleConfig(reps=source.reps, w1=source.w1, client_timeout_s=source.client_timeout_s)


def scale_broker(nodes: int) -> Broker:
    """One node: ``moorline run`` without cluster flags (replicas 1, as the single-node bench runs it);
    more: a static cluster with ``shard.replicas = 3``."""
    return Moorline() if nodes == 1 else MoorlineCluster(nodes)


def run_scale(config: ScaleConfig, log: Log) -> dict[str, Any]:
    """The sizes interleaved (1, 3, 5, 1, 3, 5, ...: load that drifts over the run shifts every size alike), a
    fresh node or cluster for every run, medians per size."""
    rows: dict[str, Any] = {}
    once = ClusterBenchConfig(brokers=("moorline",), nodes=0, reps=1, w1=config.w1, w2=config.w1,
                              client_timeout_s=config.client_timeout_s)
    kinds: dict[int, Broker] = {}
    for nodes in config.sizes:
        kind = scale_broker(nodes)
        try:
            log(f"[bold]moorline, {nodes} node(s)[/bold] {kind.prepare(log)}")
            kinds[nodes] = kind
        except (BrokerUnavailable, OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            rows[str(nodes)] = {"error": f"skipped: {exc}", "reps": []}
            log(f"[yellow]skipping {nodes} node(s): {exc}[/yellow]")
    reps: dict[int, list[dict[str, Any]]] = {nodes: [] for nodes in kinds}
    errors: dict[int, str] = {}
    for rep in range(config.reps):
        for nodes, kind in kinds.items():
            if nodes in errors:
                continue
            block = _reps(kind, config.w1, once, log, what=f"{nodes}-node", first_rep=rep, of=config.reps)
            reps[nodes].extend(block["reps"])
            if "error" in block:
                errors[nodes] = block["error"]
    for nodes, done in reps.items():
        if nodes in errors:
            rows[str(nodes)] = {"error": errors[nodes], "reps": done}
        else:
            rows[str(nodes)] = {"median": runner.median_of(done), "median_by_role": median_by_role(done),
                                "reps": done}
    return {"config": asdict(config), "rows": rows, "comparison": compare_scale(rows, config)}


def _row_fig(rows: Mapping[str, Any], nodes: int, key: str) -> float | None:
    value = (rows.get(str(nodes), {}).get("median") or {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def compare_scale(rows: Mapping[str, Any], config: ScaleConfig) -> dict[str, Any]:
    """Each size's summed CPU-s/10k over the 1-node and the 3-node figure, and the issue's target on 5 / 3."""
    one, three, five = (_row_fig(rows, n, "cpu_s_per_10k") for n in (1, 3, 5))
    ratios = {}
    for nodes in config.sizes:
        mine = _row_fig(rows, nodes, "cpu_s_per_10k")
        ratios[str(nodes)] = {"over_1_node": mine / one if mine is not None and one else None,
                              "over_3_nodes": mine / three if mine is not None and three else None}
    ratio = five / three if five is not None and three else None
    bound = config.target_5_over_3
    target = {"target": "W1 summed CPU-s/10k, 5 nodes / 3 nodes", "moorline": ratio, "op": "<=", "bound": bound,
              "met": target_met(ratio, "<=", bound, ".2f")}
    return {"ratios": ratios, "targets": [target]}


def print_scale(console: Console, report: dict[str, Any]) -> None:
    config = report["config"]
    spec = config["w1"]
    table = Table(
        title=f"moorline W1 by cluster size: QoS 1, {spec['payload_bytes']} B x {spec['messages']:,}, median of "
              f"{config['reps']}; CPU summed over all nodes; per node: CPU-s/10k of one node in the role and the "
              "role's share of the sum",
        title_justify="left",
    )
    for column in ("nodes", "shard.replicas", "clients", "msgs/s", "p50 ms", "p99 ms", "CPU-s/10k summed",
                   "x 1 node", "x 3 nodes", "per node (role, share)"):
        table.add_column(column, justify="left" if column in ("clients", "per node (role, share)") else "right")
    ratios = report["comparison"]["ratios"]
    for nodes in config["sizes"]:
        block = report["rows"].get(str(nodes), {})
        replicas = str(min(nodes, CLUSTER_REPLICAS))
        clients = ("one node" if nodes == 1 else "pub n1, sub n2, leader n3" if nodes <= CLUSTER_REPLICAS
                   else "pub, sub on the 2 non-voters")
        figures = block.get("median")
        if figures is None:
            table.add_row(str(nodes), replicas, clients, *["-"] * 6,
                          f"[red]{str(block.get('error', 'no result'))[:150]}[/red]")
            continue
        row_ratios = ratios.get(str(nodes), {})
        table.add_row(
            str(nodes), replicas, clients,
            _num(figures.get("msgs_per_s"), ",.0f"),
            _num(figures.get("latency_p50_ms"), ".1f"),
            _num(figures.get("latency_p99_ms"), ".1f"),
            _num(figures.get("cpu_s_per_10k"), ".3f"),
            _num(row_ratios.get("over_1_node"), ".2f"),
            _num(row_ratios.get("over_3_nodes"), ".2f"),
            format_roles(block.get("median_by_role") or {}),
        )
    console.print(table)
    quick = bool(report.get("meta", {}).get("quick"))
    targets = Table(title="moorline scale target (issue 32)", title_justify="left")
    for column in ("target", "moorline", "bound", "met"):
        targets.add_column(column)
    for row in report["comparison"]["targets"]:
        met = (f"[yellow]{QUICK_LABEL}[/yellow]" if quick
               else {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[row["met"]])
        targets.add_row(row["target"], _num(row["moorline"], ".2f") + ("x" if row["moorline"] is not None else ""),
                        f"{row['op']} {_num(row['bound'], '.2f')}x", met)
    console.print(targets)
