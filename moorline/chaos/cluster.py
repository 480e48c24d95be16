"""A cluster of real moorline nodes for the chaos harness: start, health, leaders, stop.

Node i (n1, n2, ...) gets its own loopback address, ``base_address`` + i - 1 (127.0.0.31, .32, ...
by default), for its MQTT, HTTP and cluster listeners, and leaves from it for its peers, so a
partition can cut the links of one node by address (``partition.Firewall``) while clients, which
connect from 127.0.0.1, are untouched. The members find each other through
``--initial-cluster`` (the peers themselves, or the relays of ``partition.LinkProxy``) and prove
themselves with a secret generated into the run directory. Each node appends its output to
``RUN_DIR/<name>.log`` and its synced file lengths to ``RUN_DIR/<name>.ledger.jsonl`` (the
``sync_ledger`` instrument, for truncation after a kill).

``healthy()`` is the harness's own knowledge of which nodes are not in a fault; clients pick
their next node from it (``NodePicker``), as a client with a list of brokers moves to another one
when its broker stops answering.
"""

from __future__ import annotations

import ipaddress
import json
import random
import re
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moorline.chaos.node import ClusterMember, NodeProcess
from moorline.chaos.partition import Address, Partitioner, make_partitioner
from moorline.chaos.wire import Endpoint
from moorline.testing.faults import Faults

CLUSTER_SIZES = (1, 3, 5)
HTTP_TIMEOUT_S = 2.0
LEADER_POLL_S = 0.25
BAD_LOG_RE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |Traceback \(most recent call last\)")


class ClusterSetupError(Exception):
    """The cluster cannot be set up here (addresses, partitions) or did not come up."""


def node_addresses(base_address: str, n: int) -> list[str]:
    """``n`` consecutive IPv4 loopback addresses from ``base_address``; each must be bindable."""
    try:
        base = ipaddress.IPv4Address(base_address)
    except ValueError:
        raise ClusterSetupError(f"--base-address must be an IPv4 address, not {base_address!r}") from None
    if not base.is_loopback:
        raise ClusterSetupError(f"--base-address {base} is not a loopback address (127.x.y.z)")
    if int(base) + n - 1 > int(ipaddress.IPv4Address("127.255.255.254")):
        raise ClusterSetupError(f"--base-address {base} leaves no room for {n} addresses")
    out = [str(base + i) for i in range(n)]
    for host in out:
        try:
            with socket.socket() as s:
                s.bind((host, 0))
        except OSError as exc:
            raise ClusterSetupError(
                f"cannot bind to {host} ({exc}); this system routes only 127.0.0.1 to loopback: "
                "add the addresses (e.g. `ifconfig lo0 alias HOST` on macOS) or choose --base-address"
            ) from None
    return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_secret(path: Path) -> Path:
    """A fresh cluster secret, readable by its owner only (the node refuses anything looser)."""
    path.write_text(secrets.token_urlsafe(32) + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


class ClusterNodes:
    """``n`` moorline nodes (n1..nn) with their data, logs and ledgers under ``run_dir``."""

    def __init__(
        self,
        n: int,
        run_dir: Path,
        *,
        base_address: str = "127.0.0.31",
        node_faults: dict[str, Any] | None = None,
        shards: int | None = None,
        config_text: str | None = None,
        partition_with: str = "auto",
        partitions_wanted: bool = False,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if n not in CLUSTER_SIZES:
            raise ClusterSetupError(f"a cluster has 1, 3 or 5 nodes, not {n}")
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        hosts = node_addresses(base_address, n)
        self.names = [f"n{i}" for i in range(1, n + 1)]
        self.addresses: dict[str, Address] = {name: (h, _free_port(h)) for name, h in zip(self.names, hosts,
                                                                                            strict=True)}
        secret = write_secret(run_dir / "cluster.secret")
        config_file = None
        if config_text is not None:
            config_file = run_dir / "node.toml"
            config_file.write_text(config_text, encoding="utf-8")
        self.partitioner: Partitioner = make_partitioner(partition_with, self.addresses, partitions_wanted)
        self.nodes: dict[str, NodeProcess] = {}
        for name, host in zip(self.names, hosts, strict=True):
            initial = ",".join(f"{peer}={a[0]}:{a[1]}" for peer, a in (
                (p, self.addresses[p] if p == name else self.partitioner.peer_address(name, p))
                for p in self.names))
            faults = Faults(**{**(node_faults or {}), "sync_ledger": str(self.ledger(name))})
            self.nodes[name] = NodeProcess(
                data_dir=run_dir / "data" / name,
                faults=faults,
                start_timeout_s=start_timeout_s,
                stop_timeout_s=stop_timeout_s,
                shards=shards,
                mqtt=(host, 0),
                http=(host, 0),
                cluster=ClusterMember(name, self.addresses[name], initial, secret),
                config_file=config_file,
                log_path=self.log_path(name),
            )
        self._lock = threading.Lock()
        self._faulty: set[str] = set()

    def __getitem__(self, name: str) -> NodeProcess:
        return self.nodes[name]

    def ledger(self, name: str) -> Path:
        return self.run_dir / f"{name}.ledger.jsonl"

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self, leaders_timeout_s: float) -> None:
        """Every node at once (bootstrap waits for all initial members), then every shard led."""
        for nd in self.nodes.values():
            nd.spawn()
        for nd in self.nodes.values():
            nd.wait_ready()
        if self.wait_leaders(leaders_timeout_s) is None:
            raise ClusterSetupError(f"not every shard had a leader within {leaders_timeout_s:.0f} s of the "
                                    f"start; node logs in {self.run_dir}")

    def stop(self) -> dict[str, int | None]:
        """SIGTERM to every running node at once (paused ones continued), then wait; exit codes."""
        for nd in self.nodes.values():
            nd.send_stop()
        for nd in self.nodes.values():
            nd.wait_stopped()
        return {name: nd.returncode for name, nd in self.nodes.items()}

    def kill_all(self) -> None:
        for nd in self.nodes.values():
            try:
                nd.kill()
            except Exception:  # noqa: BLE001 - emergency teardown goes on with the other nodes
                pass

    def close(self) -> None:
        self.partitioner.close()

    # --- health, as the harness knows it --------------------------------------------------------------
    def set_faulty(self, names: tuple[str, ...] | list[str], faulty: bool) -> None:
        with self._lock:
            if faulty:
                self._faulty.update(names)
            else:
                self._faulty.difference_update(names)

    def healthy(self) -> list[str]:
        with self._lock:
            return [n for n in self.names if n not in self._faulty]

    def endpoint(self, name: str) -> Endpoint:
        host, port = self.nodes[name].mqtt
        return Endpoint(host, port, name)

    # --- what the nodes say ---------------------------------------------------------------------------
    def get_json(self, name: str, path: str, timeout_s: float = HTTP_TIMEOUT_S) -> Any:
        host, port = self.nodes[name].http
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout_s) as resp:  # noqa: S310
            return json.loads(resp.read())

    def leaders(self, name: str) -> dict[int, str | None]:
        return {int(s["shard"]): s.get("leader") for s in self.get_json(name, "/v1/shards")["shards"]}

    def terms_and_leaders(self, name: str) -> dict[int, tuple[int, str | None]]:
        return {int(s["shard"]): (int(s.get("term") or 0), s.get("leader"))
                for s in self.get_json(name, "/v1/shards")["shards"]}

    def wait_leaders(self, timeout_s: float) -> dict[int, str] | None:
        """Until every healthy node names the same leader for every shard; None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                views = [self.leaders(n) for n in self.healthy()]
                first = views[0]
                if all(v == first for v in views[1:]) and all(ld is not None for ld in first.values()):
                    return {s: ld for s, ld in first.items() if ld is not None}
            except (OSError, ValueError, KeyError, IndexError):
                pass  # a node restarting, an answer not there yet
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def bad_log_lines(self) -> dict[str, list[str]]:
        """Per node, the ERROR/CRITICAL lines and tracebacks of its log (for the run's notes)."""
        out: dict[str, list[str]] = {}
        for name in self.names:
            try:
                text = self.log_path(name).read_text(encoding="utf-8", errors="replace")
            except FileNotFoundError:
                continue
            bad = [ln for ln in text.splitlines() if BAD_LOG_RE.search(ln)]
            if bad:
                out[name] = bad
        return out


class NodePicker:
    """A client's choice of node at each connect: a random healthy node, or ``prefer()`` when that
    names a healthy one. Faulty nodes are avoided while another is healthy (a client whose node
    died or stopped answering moves on)."""

    def __init__(self, cluster: ClusterNodes, rng: random.Random,
                 prefer: Callable[[], str | None] | None = None) -> None:
        self.cluster = cluster
        self.rng = rng
        self.prefer = prefer
        self.lock = threading.Lock()

    def __call__(self) -> Endpoint:
        healthy = self.cluster.healthy() or list(self.cluster.names)
        wanted = self.prefer() if self.prefer is not None else None
        with self.lock:  # one rng, shared by the clients' threads
            name = wanted if wanted in healthy else self.rng.choice(healthy)
        return self.cluster.endpoint(name)


class LeaderMonitor:
    """Polls GET /v1/shards on a healthy node and counts leader changes per shard (a shard whose
    known leader becomes another node), for the run's result: proof that faults moved leaders."""

    def __init__(self, cluster: ClusterNodes, poll_s: float = LEADER_POLL_S) -> None:
        self.cluster = cluster
        self.poll_s = poll_s
        self.changes = 0
        self.last: dict[int, tuple[int, str]] = {}  # shard -> (term, leader) last seen
        self.log: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-leader-monitor", daemon=True)
        self._started = time.monotonic()
        self._rng = random.Random(0)  # which healthy node to ask: any will do

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def poll_once(self) -> None:
        healthy = self.cluster.healthy()
        if not healthy:
            return
        try:
            view = self.cluster.terms_and_leaders(self._rng.choice(healthy))
        except (OSError, ValueError, KeyError, TypeError):
            return
        for shard, (term, leader) in sorted(view.items()):
            before = self.last.get(shard)
            # A node that lags reports an older term: only a newer term's leader is news.
            if leader is None or (before is not None and term <= before[0]):
                continue
            if before is not None and before[1] != leader:
                self.changes += 1
                self.log.append(f"{time.monotonic() - self._started:7.2f}s shard {shard} leader "
                                f"{before[1]} -> {leader} (term {term})")
            self.last[shard] = (term, leader)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(HTTP_TIMEOUT_S * 2)
