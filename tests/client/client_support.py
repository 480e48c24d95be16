"""Helpers and fixtures for the moorline.client tests: real moorline clusters (tests/cluster_e2e/cluster_harness.py,
nodes on 127.0.0.11..), a real Mosquitto, and producer processes (producer.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "cluster_e2e"))

from cluster_harness import Cluster  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[[int], Cluster]]:
    """``cluster(n)``: a started n-node moorline cluster; stopped (SIGTERM) at teardown."""
    for i in range(11, 14):
        try:
            with socket.socket() as s:
                s.bind((f"127.0.0.{i}", 0))
        except OSError as exc:
            pytest.skip(f"cluster tests need the loopback address 127.0.0.{i}: {exc}")
    made: list[Cluster] = []

    def make(n: int = 3) -> Cluster:
        c = Cluster(tmp_path / f"cluster{len(made)}", n)
        made.append(c)
        c.start()
        return c

    yield make
    for c in made:
        problems = c.close()
        if problems:
            print("cluster teardown:", problems)


class Proc:
    """A process whose stdout/stderr go to files; ``lines()`` reads what it wrote so far."""

    def __init__(self, args: list[str], base: Path, name: str) -> None:
        self.out_path = base / f"{name}.out"
        self.err_path = base / f"{name}.err"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        with open(self.out_path, "ab") as out, open(self.err_path, "ab") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=str(REPO), env=env)

    def lines(self) -> list[str]:
        try:
            text = self.out_path.read_text()
        except FileNotFoundError:
            return []
        return text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]

    def stderr(self) -> str:
        try:
            return self.err_path.read_text()
        except FileNotFoundError:
            return ""

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"{self.out_path.name}: still running after {timeout:.0f} s;"
                                 f" stderr tail:\n{self.stderr()[-3000:]}") from None


def wait_until(what: str, check: Callable[[], bool], timeout: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.proc.poll() is not None and not check():
            raise AssertionError(f"{what}: the process exited ({proc.proc.returncode}) first; stderr:\n"
                                 f"{proc.stderr()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s"
                                 + (f"; stderr tail:\n{proc.stderr()[-3000:]}" if proc else ""))
        time.sleep(0.05)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """``procs(args, name)`` starts a process; every one still running is SIGKILLed at teardown."""
    made: list[Proc] = []

    def start(args: list[str], name: str) -> Proc:
        p = Proc(args, tmp_path, name)
        made.append(p)
        return p

    yield start
    for p in made:
        p.kill9()


def producer_args(**kw: object) -> list[str]:
    args = [sys.executable, str(HERE / "producer.py")]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v is not None and v is not False:
            args += [flag, str(v)]
    return args


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Callable[[], tuple[int, Callable[[int], None]]]]:
    """``mosquitto()`` -> (port, signal): Mosquitto with persistence on, QoS 1 queued for offline
    persistent sessions; ``signal(SIGSTOP)`` etc. signals its process."""
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
    if exe is None:
        pytest.skip("mosquitto not installed")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
                    f"persistence_location {tmp_path}/\nmax_inflight_messages 100\nmax_queued_messages 100000\n")
    holder: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        with open(tmp_path / "mosquitto.log", "ab") as log:
            holder.append(subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("mosquitto did not start") from None
                time.sleep(0.05)

    def send(sig: int) -> None:
        holder[-1].send_signal(sig)

    def make() -> tuple[int, Callable[[int], None]]:
        start()
        return port, send

    yield make
    for p in holder:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
