"""The broker under test as a process: moorline (default) or mosquitto (MOORLINE_E2E_BROKER=mosquitto).

Kept out of conftest.py so test modules import it by a unique name (several test areas have a conftest).
"""

from __future__ import annotations

import json
import os
import pwd
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BROKER_KIND = os.environ.get("MOORLINE_E2E_BROKER", "moorline")
READY_RE = re.compile(r"moorline ready mqtt=([\d.]+):(\d+) http=([\d.]+):(\d+)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class BrokerProc:
    """One broker process on one data dir. restart() keeps the data dir and the ports."""

    def __init__(self, kind: str, data_dir: Path, env: dict[str, str] | None = None,
                 config_text: str | None = None, extra_args: list[str] | None = None,
                 faults: dict[str, object] | None = None) -> None:
        self.kind = kind
        # testing.Faults fields: the node then starts through the test entry point, never `moorline run`.
        self.faults = dict(faults or {})
        self.host = "127.0.0.1"
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.config_text = config_text
        self.extra_args = list(extra_args or [])
        self.mqtt_port = 0
        self.http_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.exit_codes: list[int] = []
        self.starts = 0

    # ---- lifecycle

    @property
    def is_moorline(self) -> bool:
        return self.kind == "moorline"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.starts += 1
        if self.is_moorline:
            self._start_moorline()
        else:
            self._start_mosquitto()

    def _start_moorline(self) -> None:
        head = ["-m", "moorline.cli"] if not self.faults else [
            "-m", "moorline.testing.faulty_node", "--faults", json.dumps(self.faults)]
        cmd = [sys.executable, *head, "run", "--data-dir", str(self.data_dir),
               "--mqtt", f"127.0.0.1:{self.mqtt_port}", "--http", f"127.0.0.1:{self.http_port}"]
        if self.config_text is not None:
            cfg = self.data_dir.parent / f"{self.data_dir.name}.toml"
            cfg.write_text(self.config_text)
            cmd += ["--config", str(cfg)]
        cmd += self.extra_args
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = open(self.log_path, "ab")
        log.write(f"\n===== start #{self.starts}: {' '.join(cmd)}\n".encode())
        log.flush()
        offset = log.tell()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=env,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            m = READY_RE.search(text)
            if m:
                self.mqtt_port, self.http_port = int(m.group(2)), int(m.group(4))
                return
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"moorline exited before ready:\n{self.log_tail()}")
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        raise RuntimeError(f"moorline not ready in {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def _start_mosquitto(self) -> None:
        if not self.mqtt_port:
            self.mqtt_port = free_port()
        conf = self.data_dir.parent / f"{self.data_dir.name}.mosquitto.conf"
        text = (
            f"listener {self.mqtt_port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {self.data_dir}/\n"
            "max_queued_messages 100000\n"
            "max_packet_size 1048576\n"
            # mosquitto started as root drops to user "mosquitto", which cannot write our temp dir
            f"user {pwd.getpwuid(os.getuid()).pw_name}\n"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
        )
        if self.config_text:
            text += self.config_text
        conf.write_text(text)
        log = open(self.log_path, "ab")
        log.write(f"\n===== start #{self.starts}: mosquitto -c {conf}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"mosquitto exited before ready:\n{self.log_tail()}")
            if _port_open(self.host, self.mqtt_port):
                return
            time.sleep(0.05)
        raise RuntimeError("mosquitto not ready")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Stop with `sig` and wait; returns the exit code (negative = killed by signal)."""
        assert self.proc is not None, "not running"
        proc, self.proc = self.proc, None
        proc.send_signal(sig)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.wait()
            raise AssertionError(f"broker did not stop within {timeout}s after signal {sig}:\n{self.log_tail()}") from e
        self.exit_codes.append(rc)
        return rc

    def stop_clean(self) -> None:
        rc = self.stop(signal.SIGTERM)
        assert rc == 0, f"broker exit code {rc} after SIGTERM:\n{self.log_tail()}"

    def kill9(self) -> None:
        rc = self.stop(signal.SIGKILL)
        assert rc == -signal.SIGKILL, rc

    def restart(self, kill: bool = False) -> None:
        """SIGKILL (kill=True) or SIGTERM (asserting exit 0), then start on the same data dir and ports."""
        if kill:
            self.kill9()
            self.start()
            return
        rc = self.stop(signal.SIGTERM)
        log = self.log_tail()
        self.start()  # start again even after a bad exit, so one failure does not cascade
        assert rc == 0, f"broker exit code {rc} after SIGTERM:\n{log}"

    def power_loss(self, seed: int) -> dict[str, tuple[int, int]]:
        """SIGKILL, then cut every data file back to its last fsynced length plus a few random bytes, as a
        power loss would (moorline started with the sync_ledger instrument), then start again.

        Returns {file: (size at kill, size after the cut)} for the files that were cut.
        """
        ledger = self.faults.get("sync_ledger")
        assert self.is_moorline and isinstance(ledger, str), "power_loss needs moorline with faults={'sync_ledger': ...}"
        self.kill9()
        rng = random.Random(seed)
        synced: dict[str, int] = {}
        with open(ledger, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    rec = json.loads(line)
                    synced[rec["file"]] = int(rec["synced_length"])
        cut: dict[str, tuple[int, int]] = {}
        for path, length in sorted(synced.items()):
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                continue
            if size > length:
                keep = length + rng.randint(0, min(16, size - length))
                os.truncate(path, keep)
                cut[path] = (size, keep)
        self.start()
        return cut

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- observation

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    @property
    def http_url(self) -> str:
        assert self.is_moorline and self.http_port
        return f"http://{self.host}:{self.http_port}"

    def __repr__(self) -> str:
        return f"<{self.kind} {self.host}:{self.mqtt_port} pid={self.proc.pid if self.proc else None}>"


BrokerFactory = Callable[..., BrokerProc]


@contextmanager
def running_broker(base: Path, env: dict[str, str] | None = None, config_text: str | None = None,
                   kind: str | None = None, faults: dict[str, object] | None = None) -> Iterator[BrokerProc]:
    """A broker for a block (e.g. a module fixture); at the end it must stop cleanly (SIGTERM -> exit 0)."""
    b = BrokerProc(kind or BROKER_KIND, base / "broker", env, config_text, faults=faults)
    b.start()
    try:
        yield b
    finally:
        if b.proc is not None:
            rc = b.stop(signal.SIGTERM)
            assert rc == 0, f"{b}: exit code {rc} after SIGTERM\n{b.log_tail()}"
