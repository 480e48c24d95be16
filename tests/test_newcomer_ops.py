"""Issue 36, items 5 and 7: `moorline --version`, a SIGTERM during start-up is a clean exit that
says so, and the log lines an operator reads (connect, disconnect, failed login, takeover) in the
text or JSON format of `log.format`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moorline
from moorline.chaos.node import free_port
from moorline.cli import app

REPO = Path(__file__).resolve().parents[1]


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"moorline {moorline.__version__}"


def _start(args: list[str], log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w", encoding="utf-8") as sink:
        return subprocess.Popen([sys.executable, "-m", "moorline", "run", *args], cwd=REPO, env=env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True)


def _wait_for(log: Path, text: str, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(encoding="utf-8"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged: {log.read_text(encoding='utf-8')[-3000:]}")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_sigterm_while_a_cluster_node_waits_for_its_peers_exits_0_and_says_so(tmp_path: Path) -> None:
    """The README promises exit 0 on SIGTERM: also before the node is open (a cluster node waits up
    to cluster.bootstrap_timeout_s for peers that are not started)."""
    ports = [free_port() for _ in range(5)]
    ic = ",".join(f"n{i + 1}=127.0.0.1:{ports[i]}" for i in range(3))
    log = tmp_path / "node.log"
    proc = _start(["--node-id", "n1", "--cluster", f"127.0.0.1:{ports[0]}", "--initial-cluster", ic,
                   "--data-dir", str(tmp_path / "d1"), "--mqtt", f"127.0.0.1:{ports[3]}",
                   "--http", f"127.0.0.1:{ports[4]}"], log)
    try:
        _wait_for(log, "Connection refused", proc)  # dialing peers that are not there: inside open
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
    finally:
        _stop(proc)
    text = log.read_text(encoding="utf-8")
    assert code == 0, text[-3000:]
    assert "stopped by SIGTERM during start-up" in text, text[-3000:]
    assert "WARNING" not in text, text[-3000:]  # peers still starting is no warning before the bootstrap timeout


def _mqtt_client(client_id: str, port: int, user: str | None = None, password: str | None = None) -> object:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    if user is not None:
        c.username_pw_set(user, password)
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    return c


def test_operator_log_lines_in_json(tmp_path: Path) -> None:
    pytest.importorskip("paho.mqtt.client")
    passwd = tmp_path / "passwd"
    subprocess.run([sys.executable, "-m", "moorline", "passwd", str(passwd), "alice", "s3cret"], cwd=REPO,
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "node.toml"
    config.write_text(f'[log]\nformat = "json"\n\n[auth]\nallow_anonymous = false\npassword_file = "{passwd}"\n',
                      encoding="utf-8")
    mqtt_port, http_port = free_port(), free_port()
    log = tmp_path / "node.log"
    proc = _start(["--config", str(config), "--data-dir", str(tmp_path / "data"), "--mqtt",
                   f"127.0.0.1:{mqtt_port}", "--http", f"127.0.0.1:{http_port}"], log)
    clients: list[object] = []
    try:
        _wait_for(log, "moorline ready", proc)
        first = _mqtt_client("dev\n1", mqtt_port, "alice", "s3cret")  # a client id with a newline in it
        clients.append(first)
        _wait_for(log, "connect: client 'dev\\\\n1'", proc)
        clients.append(_mqtt_client("dev\n1", mqtt_port, "alice", "s3cret"))  # takes the session over
        _wait_for(log, "takeover: client 'dev\\\\n1'", proc)
        for i in range(3):  # three wrong passwords at once: one line (log.failed_login_interval_s)
            clients.append(_mqtt_client(f"guess{i}", mqtt_port, "alice", "wrong"))
        _wait_for(log, "login failed: user 'alice'", proc)
        clients[1].disconnect()  # type: ignore[attr-defined]
        _wait_for(log, "client sent DISCONNECT", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        for c in clients:
            c.loop_stop()  # type: ignore[attr-defined]
        _stop(proc)
    records = []
    for line in log.read_text(encoding="utf-8").splitlines():
        if line.startswith("moorline ready"):
            continue  # the ready line is stdout, for scripts
        records.append(json.loads(line))  # every log line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    msgs = [r["msg"] for r in records if r["level"] == "INFO"]
    connects = [m for m in msgs if m.startswith("connect: ")]
    assert connects[0].startswith("connect: client 'dev\\n1' user 'alice' from 127.0.0.1:"), connects
    assert "MQTT 5.0, clean, keepalive 30 s" in connects[0], connects
    assert len(connects) == 2
    assert any(m.startswith("takeover: client 'dev\\n1' user 'alice'") for m in msgs), msgs
    assert any(m.startswith("disconnect: client 'dev\\n1' user 'alice'") and "session taken over" in m
               for m in msgs), msgs
    assert any(m.startswith("disconnect: client 'dev\\n1'") and "client sent DISCONNECT (0x00)" in m
               for m in msgs), msgs
    failed = [m for m in msgs if m.startswith("login failed")]
    assert len(failed) == 1, failed  # rate-limited
    assert re.match(r"login failed: user 'alice' client 'guess\d' from 127\.0\.0\.1:\d+: CONNACK 0x86$", failed[0]), failed


def test_cluster_status_says_unreachable_tries_the_next_and_fits_80_columns(tmp_path: Path) -> None:
    mqtt_port, http_port, dead = free_port(), free_port(), free_port()
    log = tmp_path / "node.log"
    proc = _start(["--data-dir", str(tmp_path / "data"), "--mqtt", f"127.0.0.1:{mqtt_port}",
                   "--http", f"127.0.0.1:{http_port}"], log)
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}

    def status(http: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "moorline", "cluster", "status", "--http", http], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=60)

    try:
        _wait_for(log, "moorline ready", proc)
        alone = status(f"127.0.0.1:{dead}")
        both = status(f"127.0.0.1:{dead},127.0.0.1:{http_port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        _stop(proc)
    assert alone.returncode == 1
    assert f"127.0.0.1:{dead}: unreachable (" in alone.stderr, alone.stderr
    assert "no node answered" in alone.stderr
    assert "Usage" not in alone.stderr + alone.stdout and "Invalid value" not in alone.stderr + alone.stdout
    assert both.returncode == 0, both.stderr
    assert f"127.0.0.1:{dead}: unreachable (" in both.stderr and f"trying 127.0.0.1:{http_port}" in both.stderr
    lines = both.stdout.splitlines()
    assert f"as 127.0.0.1:{http_port} sees it" in lines[0]
    assert max(len(line) for line in lines) <= 80, both.stdout
    header = next(line for line in lines if "shard " in line and "leader " in line and "replicas" in line)
    assert all(col in header for col in ("shard", "leader", "commit", "replicas", "state")), header  # not cut
    rows = [line for line in lines if line.startswith("│") and "n1: " in line]
    assert len(rows) == 16, both.stdout  # one line per shard: no row wraps
    assert "MATCH/APPLIED" in both.stdout and "does not lead this shard" in " ".join(both.stdout.split())


def test_sim_prints_an_estimate_after_the_first_seed_of_a_long_run() -> None:
    """Issue 36 item 6: 21 s a seed x the default 100 seeds is half an hour; say so at once."""
    import io

    from moorline.sim.cli import SeedProgress

    now = [0.0]
    out = io.StringIO()
    p = SeedProgress(total=100, every_s=600.0, stream=out, clock=lambda: now[0])
    now[0] = 21.0
    p.seed_done(0)
    now[0] = 42.0
    p.seed_done(0)
    lines = out.getvalue().splitlines()
    assert lines == ["sim: the first seed took 21.0 s here: 100 seeds will take about 35 min (fewer: --seeds N)"]
    out = io.StringIO()
    p = SeedProgress(total=100, every_s=600.0, stream=out, clock=lambda: now[0], workers=4)
    now[0] += 21.0
    p.seed_done(0)
    assert "100 seeds will take about 9 min on 4 workers" in out.getvalue()
    out = io.StringIO()
    p = SeedProgress(total=5, every_s=600.0, stream=out, clock=lambda: now[0])
    now[0] += 3.0
    p.seed_done(0)
    assert out.getvalue() == ""  # a short run: nothing to warn about
