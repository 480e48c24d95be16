"""A moorline cluster of real processes on this machine, for end-to-end tests (issue 21).

Node i (n1, n2, ...) listens for peers on 127.0.0.1<i> (127.0.0.11, 127.0.0.12, ...) and, since a
node's outgoing peer connections leave from the host of its own ``--cluster`` address, every packet
between two nodes carries both nodes' addresses. Clients connect from 127.0.0.1 to each node's MQTT
port on 127.0.0.1, so iptables rules on (node address, cluster port) pairs cut links between nodes
without touching any client. The rules are ``moorline.chaos.partition.Firewall``'s, the same as
``moorline chaos`` uses: a chain of this process's own, jumped to from INPUT and OUTPUT, removed on
``close`` (and, for a crashed earlier run, by ``remove_stale_chains`` at session start).

Every wait here is bounded; each returns as soon as its condition holds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from moorline.chaos.partition import Firewall
from moorline.hashing import shard_of

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_RE = re.compile(r"moorline ready mqtt=([\d.]+):(\d+) http=([\d.]+):(\d+)")
START_TIMEOUT_S = 60.0  # one node from exec to "moorline ready" (bootstrap waits for its peers)
STOP_TIMEOUT_S = 30.0
LEADERS_TIMEOUT_S = 30.0
SHARD_COUNT = 16
# Log entries no test expects: a node logging one of these has a bug (or a test provoked it and
# says so with Cluster.allow_errors). An entry is a timestamped line and the lines after it (a traceback).
ENTRY_START_RE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", re.MULTILINE)
BAD_ENTRY_RE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |Traceback \(most recent call last\)", re.MULTILINE)
# Bugs of the node found by these tests and not fixed yet: (signature of the log entry, what it is).
# A test whose only bad log entries are known ones is reported as xfail with the reason, not passed.
KNOWN_LOG_BUGS: list[tuple[re.Pattern[str], str]] = []  # (log pattern, reason) of bugs not fixed yet


T = TypeVar("T")


class ClusterError(AssertionError):
    pass


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.1) -> T:
    """``check()`` until it returns something other than None/False; ClusterError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except (OSError, ValueError, KeyError) as exc:  # a node restarting, an answer not there yet
            last_exc = exc
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout:.1f} s waiting for {what}"
                               + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------ nodes


class ClusterNode:
    """One node's process. Its ports stay the same across restarts, so clients and peers find it."""

    def __init__(self, name: str, index: int, base: Path, cluster_host: str, cluster_port: int) -> None:
        self.name = name
        self.index = index  # 1-based, as in n1
        self.cluster_host = cluster_host
        self.cluster_port = cluster_port
        self.data_dir = base / f"{name}-data"
        self.log_path = base / f"{name}.log"
        self.config_path = base / f"{name}.toml"
        self.mqtt_port = 0
        self.http_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.starts = 0
        self._log_offset = 0  # where the current start's output begins
        # JSON of a moorline.testing.Faults: the node is started through moorline.testing.faulty_node.
        self.faults: str | None = None
        self.exit_codes: list[int] = []

    def __repr__(self) -> str:
        return f"<{self.name} pid={self.proc.pid if self.proc else None} mqtt={self.mqtt_port}>"

    @property
    def cluster_addr(self) -> tuple[str, int]:
        return self.cluster_host, self.cluster_port

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    def spawn(self, initial_cluster: str, config_text: str | None, extra_args: list[str]) -> None:
        assert self.proc is None, f"{self.name} already running"
        self.starts += 1
        self.data_dir.mkdir(parents=True, exist_ok=True)
        entry = ["moorline.cli"] if self.faults is None else ["moorline.testing.faulty_node", "--faults", self.faults]
        cmd = [sys.executable, "-m", *entry, "run", "--node-id", self.name,
               "--cluster", f"{self.cluster_host}:{self.cluster_port}", "--initial-cluster", initial_cluster,
               "--data-dir", str(self.data_dir),
               "--mqtt", f"127.0.0.1:{self.mqtt_port}", "--http", f"127.0.0.1:{self.http_port}"]
        if config_text is not None:
            # "@NODE@" stands for the node's name (per-node files, e.g. its cluster TLS certificate)
            self.config_path.write_text(config_text.replace("@NODE@", self.name))
            cmd += ["--config", str(self.config_path)]
        cmd += extra_args
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start #{self.starts}: {' '.join(cmd)}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=env,
                                         stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            m = READY_RE.search(self.log(since_start=True))
            if m:
                self.mqtt_port, self.http_port = int(m.group(2)), int(m.group(4))
                return
            assert self.proc is not None
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.exit_codes.append(rc)
                self.proc = None
                raise ClusterError(f"{self.name} exited ({rc}) before ready:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                self.signal_and_wait(signal.SIGKILL, 10)
                raise ClusterError(f"{self.name} not ready within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def wait_exit(self, timeout: float) -> int:
        """The exit code of a process that ends by itself (e.g. refused to start)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{self.name} still running after {timeout:.0f} s:\n{self.log_tail()}") from None
        self.exit_codes.append(rc)
        self.proc = None
        return rc

    def signal_and_wait(self, sig: int, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig`` to this node's own process (a paused one is resumed first) and wait for it."""
        assert self.proc is not None, f"{self.name} is not running"
        proc, self.proc = self.proc, None
        proc.send_signal(sig)
        if self.paused and sig != signal.SIGKILL:
            proc.send_signal(signal.SIGCONT)
        self.paused = False
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            self.exit_codes.append(-9)
            raise ClusterError(f"{self.name} did not stop within {timeout:.0f} s of signal {sig}:\n"
                               f"{self.log_tail()}") from None
        self.exit_codes.append(rc)
        return rc

    def log(self, since_start: bool = False) -> str:
        try:
            with open(self.log_path, "rb") as f:
                if since_start:
                    f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    # --- HTTP -------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 5.0) -> Any:
        with urllib.request.urlopen(self.http_url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def shards(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        return list(self.get("/v1/shards", timeout)["shards"])

    def messages(self, shard: int, start: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """Every message this replica's store holds for ``shard`` from ``start`` (paged)."""
        out: list[dict[str, Any]] = []
        while True:
            page = self.get(f"/v1/shards/{shard}/messages?from={start}&max={limit}", timeout=10)
            out.extend(page["messages"])
            if page["scanned_to"] >= page["next_offset"]:
                return out
            start = page["scanned_to"]


# ---------------------------------------------------------------------------------------- cluster


class Cluster:
    """``n`` nodes (n1..nn) on 127.0.0.11.. with data dirs and logs under ``base``."""

    def __init__(self, base: Path, n: int = 3, config_text: str | None = None,
                 extra_args: list[str] | None = None, faults: str | None = None) -> None:
        assert n in (1, 3, 5)
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.config_text = config_text
        self.extra_args = list(extra_args or [])
        self.nodes: dict[str, ClusterNode] = {}
        for i in range(1, n + 1):
            host = f"127.0.0.{10 + i}"
            self.nodes[f"n{i}"] = ClusterNode(f"n{i}", i, base, host, _free_port(host))
            self.nodes[f"n{i}"].faults = faults
        self.initial_cluster = ",".join(f"{nd.name}={nd.cluster_host}:{nd.cluster_port}" for nd in self.nodes.values())
        self.firewall = Firewall({nd.name: nd.cluster_addr for nd in self.nodes.values()})
        self.allowed_errors: list[re.Pattern[str]] = []

    def __getitem__(self, name: str) -> ClusterNode:
        return self.nodes[name]

    @property
    def names(self) -> list[str]:
        return list(self.nodes)

    def running(self) -> list[ClusterNode]:
        return [nd for nd in self.nodes.values() if nd.running]

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self, wait_leaders: bool = True) -> None:
        """Every node at once (bootstrap waits for all initial members), then every shard led."""
        for nd in self.nodes.values():
            nd.spawn(self.initial_cluster, self.config_text, self.extra_args)
        for nd in self.nodes.values():
            nd.wait_ready()
        if wait_leaders:
            self.wait_leaders()

    def start_node(self, name: str, wait_ready: bool = True) -> None:
        nd = self.nodes[name]
        nd.spawn(self.initial_cluster, self.config_text, self.extra_args)
        if wait_ready:
            nd.wait_ready()

    def restart(self, name: str, kill: bool = True) -> None:
        """SIGKILL (or SIGTERM) a running node, then start it again on the same data dir and ports."""
        if self.nodes[name].running:
            if kill:
                self.kill9(name)
            else:
                self.stop(name)
        self.start_node(name)

    def kill9(self, name: str) -> None:
        rc = self.nodes[name].signal_and_wait(signal.SIGKILL, 10)
        assert rc == -signal.SIGKILL, f"{name}: exit code {rc} after SIGKILL"

    def stop(self, name: str, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM; returns the exit code (0 for a clean stop)."""
        return self.nodes[name].signal_and_wait(signal.SIGTERM, timeout)

    def pause(self, name: str) -> None:
        nd = self.nodes[name]
        os.kill(nd.pid, signal.SIGSTOP)
        nd.paused = True

    def resume(self, name: str) -> None:
        nd = self.nodes[name]
        os.kill(nd.pid, signal.SIGCONT)
        nd.paused = False

    def close(self) -> list[str]:
        """Heals every partition, resumes paused nodes, stops the rest with SIGTERM. Returns the
        problems seen (a node that did not exit 0), for the fixture to report."""
        problems: list[str] = []
        try:
            self.firewall.close()
        except Exception as exc:  # noqa: BLE001 - teardown goes on; reported
            problems.append(f"iptables cleanup failed: {exc}")
        for nd in self.nodes.values():
            if nd.proc is not None and nd.paused:
                try:
                    os.kill(nd.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                nd.paused = False
        for nd in self.nodes.values():  # SIGTERM to all first: they stop in parallel
            if nd.proc is not None and nd.proc.poll() is None:
                nd.proc.send_signal(signal.SIGTERM)
        for nd in self.nodes.values():
            if nd.proc is None:
                continue
            proc, nd.proc = nd.proc, None
            try:
                rc = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                problems.append(f"{nd.name} did not stop within {STOP_TIMEOUT_S:.0f} s of SIGTERM:\n{nd.log_tail()}")
                continue
            nd.exit_codes.append(rc)
            if rc != 0:
                problems.append(f"{nd.name}: exit code {rc} after SIGTERM:\n{nd.log_tail()}")
        return problems

    # --- partitions ---------------------------------------------------------------------------------
    def partition(self, a: str, b: str) -> None:
        """Cut every packet between nodes a and b (both directions); clients are untouched."""
        self.firewall.cut(a, b)

    def heal(self, a: str, b: str) -> None:
        self.firewall.heal(a, b)

    def isolate(self, name: str) -> None:
        for other in self.nodes:
            if other != name:
                self.partition(name, other)

    def heal_all(self) -> None:
        self.firewall.heal_all()

    # --- what the nodes say -------------------------------------------------------------------------
    def shards(self, name: str) -> list[dict[str, Any]]:
        return self.nodes[name].shards()

    def leaders(self, name: str) -> dict[int, str | None]:
        return {s["shard"]: s["leader"] for s in self.shards(name)}

    def leader_of(self, shard: int, via: Iterable[str] | None = None) -> str | None:
        """The shard's leader as the first reachable node of ``via`` (default: running ones) sees it."""
        for name in via if via is not None else [nd.name for nd in self.running() if not nd.paused]:
            try:
                return self.shards(name)[shard]["leader"]  # type: ignore[no-any-return]
            except OSError:
                continue
        raise ClusterError("no node answered GET /v1/shards")

    def wait_leaders(self, timeout: float = LEADERS_TIMEOUT_S, nodes: Iterable[str] | None = None,
                     exclude_leaders: Iterable[str] = ()) -> dict[int, str]:
        """Until every shard has a leader that every one of ``nodes`` (default: running, unpaused)
        agrees on, none of them in ``exclude_leaders``. Returns shard -> leader."""
        names = list(nodes) if nodes is not None else [nd.name for nd in self.running() if not nd.paused]
        banned = set(exclude_leaders)

        def agreed() -> dict[int, str] | None:
            views = [self.leaders(n) for n in names]
            first = views[0]
            if any(v != first for v in views[1:]):
                return None
            if any(ld is None or ld in banned for ld in first.values()):
                return None
            return {s: ld for s, ld in first.items() if ld is not None}

        return wait_for(f"a leader of every shard agreed by {', '.join(names)}"
                        + (f", none of {sorted(banned)}" if banned else ""), agreed, timeout, 0.1)

    def wait_leader_of(self, shard: int, timeout: float = LEADERS_TIMEOUT_S, nodes: Iterable[str] | None = None,
                       exclude: Iterable[str] = ()) -> str:
        names = list(nodes) if nodes is not None else [nd.name for nd in self.running() if not nd.paused]
        banned = set(exclude)

        def agreed() -> str | None:
            seen = {self.shards(n)[shard]["leader"] for n in names}
            if len(seen) != 1:
                return None
            ld = seen.pop()
            return ld if ld is not None and ld not in banned else None

        return wait_for(f"a leader of shard {shard} agreed by {', '.join(names)}", agreed, timeout, 0.1)

    @staticmethod
    def shard_of(topic: str) -> int:
        return shard_of(topic, SHARD_COUNT)

    def shard_led_by(self, name: str, timeout: float = LEADERS_TIMEOUT_S) -> int:
        """A shard ``name`` leads (as ``name`` sees it), waiting while it leads none (see topic_led_by)."""
        return wait_for(f"{name} to lead a shard", lambda: next(
            (s for s, ld in self.leaders(name).items() if ld == name), None), timeout, 0.2)

    def topic_led_by(self, name: str, prefix: str, avoid_shards: Iterable[int] = (),
                     timeout: float = LEADERS_TIMEOUT_S) -> str:
        """A topic under ``prefix`` whose shard ``name`` leads now (as ``name`` itself sees it).

        Waits while ``name`` leads none: a node that came up last (a slower TLS handshake, a
        restart) gets its preferred leaderships back from the rebalancer a few per 5-s round."""
        avoid = set(avoid_shards)
        last: dict[int, str | None] = {}

        def find() -> str | None:
            nonlocal last
            last = self.leaders(name)
            for i in range(10_000):
                topic = f"{prefix}/{i}"
                shard = self.shard_of(topic)
                if last.get(shard) == name and shard not in avoid:
                    return topic
            return None

        try:
            return wait_for(f"{name} to lead a shard", find, timeout, 0.2)
        except ClusterError:
            raise ClusterError(f"{name} leads no shard: {last}") from None

    def client_id_on_shard(self, prefix: str, shard: int) -> str:
        """A client id whose session shard is ``shard``."""
        for i in range(10_000):
            cid = f"{prefix}-{i}"
            if shard_of(cid, SHARD_COUNT) == shard:
                return cid
        raise ClusterError(f"no client id for shard {shard}")

    def wait_applied_equal(self, shard: int, names: Iterable[str], timeout: float = 30.0) -> int:
        """Until every one of ``names`` has applied the same index of ``shard`` (and its commit)."""
        names = list(names)

        def same() -> int | None:
            views = [self.shards(n)[shard] for n in names]
            applied = {v["applied_index"] for v in views}
            commits = {v["commit"] for v in views}
            if len(applied) == 1 and commits == applied:
                return applied.pop()  # type: ignore[no-any-return]
            return None

        return wait_for(f"shard {shard} applied equally on {', '.join(names)}", same, timeout, 0.1)

    # --- logs ---------------------------------------------------------------------------------------
    def allow_errors(self, pattern: str) -> None:
        """An ERROR line this test provokes on purpose (matched by ``pattern``) is not a failure."""
        self.allowed_errors.append(re.compile(pattern))

    def bad_log_entries(self) -> tuple[dict[str, list[str]], set[str]]:
        """Per node, log entries at ERROR/CRITICAL or with a traceback that neither ``allow_errors``
        nor a known bug (KNOWN_LOG_BUGS) explains; and the reasons of the known bugs seen."""
        out: dict[str, list[str]] = {}
        known: set[str] = set()
        for nd in self.nodes.values():
            text = nd.log()
            starts = [m.start() for m in ENTRY_START_RE.finditer(text)] + [len(text)]
            entries = [text[a:b].rstrip("\n") for a, b in zip(starts, starts[1:], strict=False)]
            if starts[0] > 0:  # output before the first log line (a crash of the interpreter)
                entries.insert(0, text[:starts[0]])
            bad = []
            for entry in entries:
                if not BAD_ENTRY_RE.search(entry) or any(p.search(entry) for p in self.allowed_errors):
                    continue
                reasons = [reason for sig, reason in KNOWN_LOG_BUGS if sig.search(entry)]
                if reasons:
                    known.update(reasons)
                else:
                    bad.append(entry)
            if bad:
                out[nd.name] = bad
        return out, known

    def bad_log_lines(self) -> dict[str, list[str]]:
        """Per node, the first line of each unexplained bad log entry (see ``bad_log_entries``)."""
        return {name: [e.splitlines()[0] if e else e for e in entries]
                for name, entries in self.bad_log_entries()[0].items()}

    def assert_no_errors(self) -> None:
        """No node logged an unexplained ERROR or traceback; a known bug's entries make the test
        xfail with its reason (so a fix turns it back into a pass)."""
        bad, known = self.bad_log_entries()
        assert not bad, "nodes logged errors:\n" + "\n".join(
            f"{name}: {entry}" for name, entries in bad.items() for entry in entries[:5])
        if known:
            pytest.xfail("; ".join(sorted(known)))

    def describe(self) -> str:
        """Every running node's shard table and log tail: for assertion messages."""
        parts = []
        for nd in self.nodes.values():
            parts.append(f"--- {nd.name} ({'paused' if nd.paused else 'running' if nd.running else 'down'})")
            if nd.running and not nd.paused:
                try:
                    parts.append(json.dumps([{k: s.get(k) for k in ("shard", "leader", "term", "commit",
                                                                      "applied_index", "next_offset")}
                                             for s in nd.shards()]))
                except (OSError, urllib.error.URLError) as exc:
                    parts.append(f"(no /v1/shards: {exc})")
            parts.append(nd.log_tail(15))
        return "\n".join(parts)


ClusterFactory = Callable[..., Cluster]  # the cluster_factory fixture: (n=3, config_text=None, start=True)
