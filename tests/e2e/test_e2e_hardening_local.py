"""Issue 30 item 10, against running nodes: another local user of the machine reads message payloads
out of the data directory (created 0755, files 0644)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from e2e_broker import BrokerFactory
from listener_support import run_moorline
from rawclient import RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def test_a_local_user_cannot_read_payloads_from_the_data_directory(broker_factory: BrokerFactory) -> None:
    """Attack: any local user reads the WAL (0644 files in a 0755 directory) and so every payload."""
    broker = broker_factory()  # the harness made the (empty) data directory with the usual 0755
    c = RawClient("127.0.0.1", broker.mqtt_port, version=5)
    assert c.connect("local-1", clean=False, props=[(0x11, 3600)]).reason == 0
    assert c.publish_and_wait("secret/t", b"payload only alice may read", retain=True).reason == 0
    c.disconnect()
    broker.stop_clean()  # snapshots and everything a stop writes are there too
    modes = _modes(broker.data_dir)
    assert len(modes) > 3, modes
    open_to_others = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert open_to_others == {}, open_to_others


def test_a_data_directory_other_users_can_read_is_refused(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    """Attack: an operator's data directory left (or made) readable by others: the node refuses to
    serve from it instead of exposing the messages; storage.allow_group_read admits group access only."""
    broker = broker_factory()
    broker.stop_clean()
    data = broker.data_dir
    os.chmod(data, 0o755)
    proc = run_moorline(tmp_path, ["--data-dir", str(data), "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0"])
    assert proc.returncode == 2, proc.stderr
    assert "open to other users" in proc.stderr and "chmod 700" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # group access, allowed by configuration; others still refused
    os.chmod(data, 0o750)
    broker.config_text = "[storage]\nallow_group_read = true\n"
    broker.start()
    broker.stop_clean()
    os.chmod(data, 0o754)
    proc = run_moorline(tmp_path, ["--data-dir", str(data), "--mqtt", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                   "--config", str(broker.data_dir.parent / f"{data.name}.toml")])
    assert proc.returncode == 2 and "chmod 750" in proc.stderr, proc.stderr
