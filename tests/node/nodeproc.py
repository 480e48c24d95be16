"""Start and stop a real moorline node process for tests (loopback, OS-chosen ports)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

READY = re.compile(r"moorline ready mqtt=([\d.]+):(\d+) http=([\d.]+):(\d+)")


class NodeProcess:
    def __init__(self, data_dir: Path, config: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.config = config
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.mqtt_port = 0
        self.http_port = 0
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def start(self, timeout: float = 20.0) -> NodeProcess:
        args = [sys.executable, "-m", "moorline", "run", "--data-dir", str(self.data_dir),
                "--mqtt", f"127.0.0.1:{self.mqtt_port}", "--http", f"127.0.0.1:{self.http_port}"]
        if self.config is not None:
            args += ["--config", str(self.config)]
        logf = open(self.log, "a")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=logf, text=True,
                                     env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = READY.search(line)
            if m:
                self.mqtt_port, self.http_port = int(m.group(2)), int(m.group(4))
                return self
        self.proc.kill()
        raise RuntimeError(f"node did not start; log:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                return -9
        return self.proc.returncode
