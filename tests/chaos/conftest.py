"""Chaos tests need a moorline node; they skip only when one cannot start here. Cluster runs also
need the loopback addresses 127.0.0.31.. (Linux routes all of 127/8 to loopback)."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest

CLUSTER_BASE = 31  # 127.0.0.31..35: apart from the cluster e2e tests' 127.0.0.11..15


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster_e2e: a real multi-process cluster on this machine")


@pytest.fixture(scope="session")
def node_available() -> None:
    from moorline.chaos.node import NodeProcess, NodeStartError

    with tempfile.TemporaryDirectory(prefix="moorline-chaos-probe-") as tmp:
        node = NodeProcess(data_dir=Path(tmp) / "data")
        try:
            node.start()
        except (NodeStartError, OSError) as exc:
            pytest.skip(f"moorline node cannot start: {exc}")
        finally:
            node.stop()


@pytest.fixture(scope="session")
def cluster_addresses(node_available: None) -> str:
    """The base address of a chaos cluster, once its five addresses are known to be bindable."""
    for i in range(CLUSTER_BASE, CLUSTER_BASE + 5):
        try:
            with socket.socket() as s:
                s.bind((f"127.0.0.{i}", 0))
        except OSError as exc:
            pytest.skip(f"chaos cluster tests need the loopback address 127.0.0.{i}: {exc}")
    return f"127.0.0.{CLUSTER_BASE}"
