"""Every listener is bound before the data directory is opened: a port in use stops start-up with a
message naming the listener, and leaves no data directory behind (issue 20 item 3)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from listener_support import dev_certs, run_moorline

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_moorline(tmp_path, list(args), env)


@pytest.mark.parametrize("flag", ["--http", "--mqtt"])
def test_a_port_in_use_is_named_and_no_data_dir_is_made(tmp_path: Path, busy_port: int, flag: str) -> None:
    other = "--mqtt" if flag == "--http" else "--http"
    done = _run(tmp_path, flag, f"127.0.0.1:{busy_port}", other, "127.0.0.1:0")
    assert done.returncode == 2, done.stderr
    assert f"{flag} 127.0.0.1:{busy_port} is in use" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


def test_a_tls_or_websocket_port_in_use_is_named(tmp_path: Path, busy_port: int) -> None:
    certs = dev_certs(tmp_path)
    env = {"MOORLINE_LISTENERS__WSS": f"127.0.0.1:{busy_port}", "MOORLINE_TLS__CERT_FILE": str(certs.server_cert),
           "MOORLINE_TLS__KEY_FILE": str(certs.server_key)}
    done = _run(tmp_path, "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0", env=env)
    assert done.returncode == 2, done.stderr
    assert f"listeners.wss 127.0.0.1:{busy_port} is in use" in done.stderr
    assert not (tmp_path / "data").exists()
    # an unreadable certificate is named before anything is bound or created
    env["MOORLINE_TLS__CERT_FILE"] = str(tmp_path / "missing.crt")
    done = _run(tmp_path, "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0", env=env)
    assert done.returncode == 2
    assert "missing.crt" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()
