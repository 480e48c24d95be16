"""Chaos tests need a moorline node; they skip only when one cannot start here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


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
