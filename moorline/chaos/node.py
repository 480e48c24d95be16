"""Starting, killing, pausing and damaging broker processes for the crash harness.

``NodeProcess`` runs ``python -m moorline run`` per NODE_CONTRACT (loopback, port 0 on first start,
the same ports on restarts so clients reconnect to where they were); with ``cluster`` set it is one
member of a cluster (``--node-id``, ``--cluster``, ``--initial-cluster``, ``--cluster-secret-file``).
``MosquittoProcess`` has the same surface and exists so the harness's client side can be exercised
without a moorline node. Damage helpers (``truncate_to_ledger``, ``flip_synced_byte``) are pure file
operations driven by a seeded ``random.Random``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from moorline.testing.faults import NO_FAULTS, Faults

READY_RE = re.compile(r"moorline ready mqtt=([\d.]+):(\d+) http=([\d.]+):(\d+)")
LOG_LINES_KEPT = 2000
CORRUPTION_RE = re.compile(r"corrupt|checksum fail|fails its checksum", re.IGNORECASE)


class NodeStartError(Exception):
    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


class Broker(Protocol):
    mqtt: tuple[str, int]
    has_http: bool

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def send_kill(self) -> None: ...
    def stop(self) -> None: ...
    def log_text(self) -> str: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _LogPump:
    """Reads a child's merged output into a bounded deque (and, when given, appends every line to
    ``log_file``), signalling the ready line."""

    def __init__(
        self, proc: subprocess.Popen[str], ready: re.Pattern[str] | None, log_file: Path | None = None
    ) -> None:
        self.lines: deque[str] = deque(maxlen=LOG_LINES_KEPT)
        self.ready_match: re.Match[str] | None = None
        self.ready_event = threading.Event()
        self._ready_re = ready
        self._log_file = log_file
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        sink = open(self._log_file, "a", encoding="utf-8") if self._log_file is not None else None
        try:
            for line in proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                self._match(line)
        finally:
            if sink is not None:
                sink.close()
        self.ready_event.set()  # EOF: wake any waiter

    def _match(self, line: str) -> None:
        if self._ready_re is not None and self.ready_match is None:
            m = self._ready_re.search(line)
            if m:
                self.ready_match = m
                self.ready_event.set()


class _Child:
    """Stop, kill, pause and resume for a child process (``_proc``), bounded by ``stop_timeout_s``."""

    _proc: subprocess.Popen[str] | None
    stop_timeout_s: float
    paused: bool = False

    def kill(self) -> None:
        self.send_kill()
        if self._proc is not None:
            self._proc.wait(self.stop_timeout_s)
        self.paused = False

    def send_kill(self) -> None:
        """SIGKILL without waiting (safe from any thread; a stopped process dies too)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets and files but runs nothing until ``resume``."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self.paused = False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def stop(self) -> None:
        self.send_stop()
        self.wait_stopped()

    def send_stop(self) -> None:
        """SIGTERM without waiting (so several processes stop in parallel)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            if self.paused:  # a stopped process handles SIGTERM only once continued
                self.resume()

    def wait_stopped(self) -> None:
        """Wait ``stop_timeout_s`` for the process to end after ``send_stop``; SIGKILL after that."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass(frozen=True)
class ClusterMember:
    """What makes a node one member of a cluster: its name, the address its peers dial, how it
    reaches the others (``--initial-cluster``, which may name relays instead of the peers
    themselves) and the shared secret."""

    node_id: str
    listen: tuple[str, int]
    initial_cluster: str
    secret_file: Path


@dataclass
class NodeProcess(_Child):
    """One node child. With ``faults`` (the ledger, broken builds) it starts through the test entry
    point (moorline/testing/faulty_node.py), since ``moorline run`` never takes such switches."""

    data_dir: Path
    faults: Faults = NO_FAULTS
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 10.0
    shards: int | None = None
    mqtt: tuple[str, int] = ("127.0.0.1", 0)
    http: tuple[str, int] = ("127.0.0.1", 0)
    has_http: bool = True
    cluster: ClusterMember | None = None
    config_file: Path | None = None
    log_path: Path | None = None  # every start's output is appended here as well
    starts: int = 0
    _proc: subprocess.Popen[str] | None = None
    _pump: _LogPump | None = None
    _all_logs: str = ""

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def command(self) -> list[str]:
        head = ["-m", "moorline"] if self.faults == NO_FAULTS else [
            "-m", "moorline.testing.faulty_node", "--faults", self.faults.to_json()]
        cmd = [
            sys.executable,
            *head,
            "run",
            "--data-dir",
            str(self.data_dir),
            "--mqtt",
            f"{self.mqtt[0]}:{self.mqtt[1]}",
            "--http",
            f"{self.http[0]}:{self.http[1]}",
        ]
        if self.shards is not None:
            cmd += ["--shards", str(self.shards)]
        if self.config_file is not None:
            cmd += ["--config", str(self.config_file)]
        if self.cluster is not None:
            c = self.cluster
            cmd += [
                "--node-id", c.node_id,
                "--cluster", f"{c.listen[0]}:{c.listen[1]}",
                "--initial-cluster", c.initial_cluster,
                "--cluster-secret-file", str(c.secret_file),
            ]
        return cmd

    def spawn(self) -> None:
        """Start the process without waiting for it (cluster members wait for each other)."""
        if self._pump is not None:
            self._all_logs += "\n".join(self._pump.lines) + "\n"
        cmd = self.command()
        self.starts += 1
        if self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"===== start #{self.starts}: {' '.join(cmd)}\n")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, stdin=subprocess.DEVNULL
        )
        self.paused = False
        self._pump = _LogPump(self._proc, READY_RE, self.log_path)

    def wait_ready(self) -> None:
        """Until the node prints its ready line; NodeStartError (with its log) when it does not."""
        assert self._pump is not None and self._proc is not None, "spawn() first"
        self._pump.ready_event.wait(self.start_timeout_s)
        m = self._pump.ready_match
        if m is None:
            tail = "\n".join(list(self._pump.lines)[-200:])
            self.kill()
            raise NodeStartError(f"node did not become ready (exit {self._proc.poll()})", tail)
        self.mqtt = (m.group(1), int(m.group(2)))
        self.http = (m.group(3), int(m.group(4)))

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_text(self) -> str:
        current = "\n".join(self._pump.lines) if self._pump is not None else ""
        return self._all_logs + current

    def current_log(self) -> str:
        return "\n".join(self._pump.lines) if self._pump is not None else ""

    def get_json(self, path: str, timeout_s: float = 5.0) -> Any:
        url = f"http://{self.http[0]}:{self.http[1]}{path}"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback only
            return json.loads(resp.read())


@dataclass
class MosquittoProcess(_Child):
    """mosquitto on loopback, for developing the harness's client side (no ledger, no drops API)."""

    work_dir: Path
    start_timeout_s: float = 10.0
    stop_timeout_s: float = 5.0
    mqtt: tuple[str, int] = ("127.0.0.1", 0)
    has_http: bool = False
    _proc: subprocess.Popen[str] | None = None
    _pump: _LogPump | None = None

    def start(self) -> None:
        if self.mqtt[1] == 0:
            self.mqtt = ("127.0.0.1", free_port())
        conf = self.work_dir / "mosquitto.conf"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        conf.write_text(
            f"listener {self.mqtt[1]} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {self.work_dir}/\nmax_queued_messages 100000\nmax_inflight_messages 32\n"
        )
        self._proc = subprocess.Popen(
            ["mosquitto", "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._pump = _LogPump(self._proc, None)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(self.mqtt, timeout=0.5).close()
                return
            except OSError:
                if self._proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.kill()
        raise NodeStartError("mosquitto did not start", "\n".join(self._pump.lines))

    def log_text(self) -> str:
        return "\n".join(self._pump.lines) if self._pump is not None else ""


# ---------------------------------------------------------------- damage (pure file operations)
def read_ledger(path: Path) -> dict[str, int]:
    """Latest synced length per file; later lines win (same format as moorline.storage.ledger)."""
    out: dict[str, int] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of the ledger itself
            out[str(obj["file"])] = int(obj["synced_length"])
    return out


def truncate_to_ledger(ledger: Path, rng: random.Random, *, extra_bytes_max: int = 16) -> list[str]:
    """Cut every file the ledger names back to its synced length plus 0..extra_bytes_max of what followed
    (what power loss could leave). Returns one description per file actually shortened."""
    done: list[str] = []
    for name, synced in sorted(read_ledger(ledger).items()):
        path = Path(name)
        if not path.exists():
            continue
        size = path.stat().st_size
        keep = min(size, synced + rng.randint(0, extra_bytes_max))
        if keep < size:
            os.truncate(path, keep)
            done.append(f"{path.name}:{size}->{keep}")
    return done


def flip_synced_byte(ledger: Path, rng: random.Random) -> tuple[str, int] | None:
    """Flip one bit of a byte below a file's synced length (already durable data). Returns (file, offset)."""
    candidates = [(n, s) for n, s in sorted(read_ledger(ledger).items()) if s > 0 and Path(n).exists()]
    if not candidates:
        return None
    name, synced = rng.choice(candidates)
    size = Path(name).stat().st_size
    offset = rng.randrange(0, min(synced, size)) if min(synced, size) > 0 else 0
    with open(name, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        if not b:
            return None
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    return name, offset
