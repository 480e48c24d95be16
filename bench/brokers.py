"""Start and stop each broker under test: fresh config, fresh free port, empty data dir, stopped afterwards."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from bench import procstat

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
AMQTT_VERSION = "0.12.1"  # the version peers.md measured
CACHE_DIR = Path(os.environ.get("MOORLINE_BENCH_CACHE", Path.home() / ".cache" / "moorline-bench"))


Log = Callable[[str], None]


class BrokerUnavailable(Exception):
    """The broker cannot be run here; the message says why (it is printed and the broker skipped)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out on ``host`` (tiny race until the broker binds it; acceptable for a bench)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"broker did not listen on {port} within {timeout_s} s")


@dataclass
class RunningBroker:
    """One started broker process (tree). ``protocol`` is the MQTT level its clients use (4 = 3.1.1, 5 = 5.0)."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    protocol: int
    workdir: Path
    _log_files: list[IO[bytes]] = field(default_factory=list)
    # Where the W1/W2 publisher and subscriber connect (0: ``port``). A cluster puts them on different nodes.
    publish_port: int = 0
    subscribe_port: int = 0

    def __post_init__(self) -> None:
        self.publish_port = self.publish_port or self.port
        self.subscribe_port = self.subscribe_port or self.port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def topic_for(self, base: str) -> str:
        """The topic a workload named ``base`` uses (a cluster may pick one whose shard a given node leads)."""
        return base

    def cpu_seconds(self) -> float:
        return procstat.tree_cpu_seconds(self.pid)

    def cpu_seconds_by_member(self) -> dict[str, float]:
        """CPU per member process tree (one member unless this is a cluster)."""
        return {self.name: self.cpu_seconds()}

    def findings(self) -> dict[str, object]:
        """What the broker's own logs say about the run, read after stop() (clusters: errors, warnings)."""
        return {}

    def peak_rss_bytes(self) -> int:
        return procstat.tree_peak_rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bound; only this broker's own process (and its group, which we created)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        for handle in self._log_files:
            handle.close()


def _spawn(
    argv: list[str], workdir: Path, env: Mapping[str, str] | None, stdout_pipe: bool
) -> subprocess.Popen[bytes]:
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.Popen(
        argv,
        cwd=workdir,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if stdout_pipe else open(workdir / "stdout.log", "wb"),  # noqa: SIM115
        stderr=open(workdir / "stderr.log", "wb"),  # noqa: SIM115
        start_new_session=True,  # own process group: stop() signals the whole tree and nothing else
    )


class Broker:
    """A kind of broker the bench knows how to run."""

    name = ""

    def prepare(self, log: Log) -> str:
        """Make sure the broker can run (install if allowed); returns its version text or raises BrokerUnavailable."""
        raise NotImplementedError

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        raise NotImplementedError


class Mosquitto(Broker):
    """Debian's mosquitto with persistence on, as peers.md measured it (autosave every 1,800 s)."""

    name = "mosquitto"

    def __init__(self) -> None:
        self.binary: str | None = None

    def _find(self) -> str | None:
        return shutil.which("mosquitto") or next(
            (p for p in ("/usr/sbin/mosquitto", "/usr/bin/mosquitto") if os.path.exists(p)), None
        )

    def prepare(self, log: Log) -> str:
        self.binary = self._find()
        if self.binary is None:
            if os.geteuid() != 0:
                raise BrokerUnavailable(
                    "mosquitto is not installed and we are not root (apt-get install mosquitto)"
                )
            log("mosquitto missing: apt-get install -y mosquitto")
            apt_env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            result = subprocess.run(
                ["apt-get", "install", "-y", "mosquitto"], env=apt_env, capture_output=True, timeout=600
            )
            if result.returncode != 0:
                subprocess.run(["apt-get", "update"], env=apt_env, capture_output=True, timeout=600)
                result = subprocess.run(
                    ["apt-get", "install", "-y", "mosquitto"], env=apt_env, capture_output=True, timeout=600
                )
            self.binary = self._find()
            if self.binary is None:
                raise BrokerUnavailable(f"apt-get install mosquitto failed: {result.stderr.decode()[-300:]}")
        out = subprocess.run([self.binary, "-h"], capture_output=True, timeout=30)
        match = re.search(r"mosquitto version (\S+)", (out.stdout + out.stderr).decode())
        return match.group(1) if match else "unknown"

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        assert self.binary is not None, "prepare() first"
        env = dict(env or {})
        extra_config = env.pop("__extra_config__", "")  # more config lines (a TLS listener: bench/tls_bench.py)
        port = free_port()
        data = workdir / "data"
        data.mkdir()
        lines = [
            f"listener {port} 127.0.0.1",
            "allow_anonymous true",
            "persistence true",
            f"persistence_location {data}/",
            "autosave_interval 1800",
            # 256 consumer-side credit, like every peer in peers.md; no queue limit so nothing is dropped.
            "max_inflight_messages 256",
            "max_queued_messages 0",
            "log_dest stderr",
            "log_type error",
        ]
        if os.geteuid() == 0:
            lines.append("user root")  # otherwise it drops to user 'mosquitto', who cannot write our data dir
        conf = workdir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n" + extra_config)
        proc = _spawn([self.binary, "-c", str(conf)], workdir, env, stdout_pipe=False)
        _wait_for_port(port, proc, READY_TIMEOUT_S)
        return RunningBroker(self.name, proc, port, protocol=5, workdir=workdir)


class Amqtt(Broker):
    """amqtt (PyPI) in its own venv under the cache dir, so it never enters the project's dependencies."""

    name = "amqtt"

    def __init__(self) -> None:
        self.venv = CACHE_DIR / "amqtt-venv"

    @property
    def _python(self) -> Path:
        return self.venv / "bin" / "python"

    def _installed_version(self) -> str | None:
        if not self._python.exists():
            return None
        out = subprocess.run(
            [str(self._python), "-c", "import importlib.metadata as m; print(m.version('amqtt'))"],
            capture_output=True,
            timeout=60,
        )
        return out.stdout.decode().strip() if out.returncode == 0 else None

    def prepare(self, log: Log) -> str:
        version = self._installed_version()
        if version is not None:
            return version
        log(f"installing amqtt=={AMQTT_VERSION} into {self.venv}")
        try:
            if not self._python.exists():
                subprocess.run(
                    [sys.executable, "-m", "venv", str(self.venv)],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
            subprocess.run(
                [str(self._python), "-m", "pip", "install", "-q", f"amqtt=={AMQTT_VERSION}"],
                check=True,
                capture_output=True,
                timeout=600,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            raise BrokerUnavailable(f"could not install amqtt: {exc} {detail.decode()[-300:]}") from exc
        version = self._installed_version()
        if version is None:
            raise BrokerUnavailable("amqtt installed but not importable")
        return version

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        port = free_port()
        conf = workdir / "amqtt.yaml"
        # Only anonymous auth: the packet/event logger plugins of the default config are left out.
        conf.write_text(
            "listeners:\n"
            "  default:\n"
            "    type: tcp\n"
            f"    bind: 127.0.0.1:{port}\n"
            "plugins:\n"
            "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        script = "import sys; from amqtt.scripts.broker_script import main; sys.argv = ['amqtt', '-c', sys.argv[1]]; main()"
        proc = _spawn([str(self._python), "-c", script, str(conf)], workdir, env, stdout_pipe=False)
        _wait_for_port(port, proc, READY_TIMEOUT_S)
        return RunningBroker(self.name, proc, port, protocol=4, workdir=workdir)


_READY = re.compile(rb"moorline ready mqtt=([\d.]+):(\d+) http=([\d.]+):(\d+)")


class Moorline(Broker):
    """The node from this checkout, started as ``python -m moorline run`` (NODE_CONTRACT)."""

    name = "moorline"

    def _argv(self) -> list[str]:
        import importlib.util

        module = "moorline" if importlib.util.find_spec("moorline.__main__") is not None else "moorline.cli"
        return [sys.executable, "-m", module, "run"]

    def prepare(self, log: Log) -> str:
        out = subprocess.run([*self._argv(), "--help"], capture_output=True, timeout=120,
                             env={**os.environ, **self._checkout_env(None)})
        if out.returncode != 0 or b"--data-dir" not in out.stdout:
            raise BrokerUnavailable(
                f"`moorline run --help` failed: {(out.stdout + out.stderr).decode()[-400:]}"
            )
        try:
            import importlib.metadata as metadata

            return metadata.version("moorline")
        except Exception:  # not pip-installed: a checkout
            return "checkout"

    @staticmethod
    def _checkout_env(env: Mapping[str, str] | None) -> dict[str, str]:
        """The node runs from the same ``moorline`` package the bench imported (this checkout), also
        when the broker's working directory is elsewhere and the package is not pip-installed here."""
        import importlib.util

        full = dict(env or {})
        spec = importlib.util.find_spec("moorline")
        if spec is not None and spec.submodule_search_locations:
            root = str(Path(next(iter(spec.submodule_search_locations))).parent)
            full["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        return full

    def start(self, workdir: Path, env: Mapping[str, str] | None = None) -> RunningBroker:
        data = workdir / "data"
        data.mkdir()
        env = dict(env or {})
        faults = env.pop("__faults__", None)  # a comparison variant: the test entry point, never `moorline run`
        head = [sys.executable, "-m", "moorline.testing.faulty_node", "--faults", faults, "run"] if faults else self._argv()
        argv = [*head, "--data-dir", str(data), "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0"]
        proc = _spawn(argv, workdir, self._checkout_env(env), stdout_pipe=True)
        assert proc.stdout is not None
        port = _read_ready_line(proc, READY_TIMEOUT_S)
        # Keep draining stdout so a chatty node never blocks on a full pipe.
        sink = open(workdir / "stdout.log", "wb")  # noqa: SIM115
        threading.Thread(target=_drain, args=(proc.stdout, sink), daemon=True).start()
        broker = RunningBroker(self.name, proc, port, protocol=5, workdir=workdir)
        broker._log_files.append(sink)
        return broker


def _read_ready_line(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    return _read_ready_ports(proc, timeout_s)[0]


def _read_ready_ports(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, int]:
    """The MQTT and HTTP ports of moorline's ready line."""
    assert proc.stdout is not None
    found: list[tuple[int, int]] = []
    seen: list[bytes] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            match = _READY.search(line)
            if match:
                found.append((int(match.group(2)), int(match.group(4))))
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"moorline printed no ready line within {timeout_s} s: {b''.join(seen)[-400:]!r}")
    return found[0]


def _drain(stream: IO[bytes], sink: IO[bytes]) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
        sink.write(chunk)


ALL_BROKERS: dict[str, type[Broker]] = {"moorline": Moorline, "mosquitto": Mosquitto, "amqtt": Amqtt}
