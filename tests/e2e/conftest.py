"""Fixtures for the end-to-end suite: the broker under test runs as a real process.

MOORLINE_E2E_BROKER=moorline (default): `python -m moorline.cli run` on a temp data dir.
MOORLINE_E2E_BROKER=mosquitto: `mosquitto -c CONF` (the reference for MQTT semantics).
Tests marked `moorline_only` (kill -9, durability, exact reason codes, HTTP API, auth) skip on mosquitto.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_broker import BROKER_KIND, BrokerFactory, BrokerProc, running_broker

__all__ = ["BROKER_KIND", "BrokerFactory", "BrokerProc", "running_broker"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "moorline_only: promise of moorline beyond MQTT; skipped on mosquitto")
    config.addinivalue_line("markers", "e2e: end-to-end test against a real broker process")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if BROKER_KIND != "mosquitto":
        return
    skip = pytest.mark.skip(reason="moorline-only promise (MOORLINE_E2E_BROKER=mosquitto)")
    for item in items:
        if "moorline_only" in item.keywords and "tests/e2e" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[BrokerFactory]:
    """Make brokers for one test; each one still running at teardown must stop cleanly (SIGTERM -> exit 0)."""
    made: list[BrokerProc] = []

    def make(env: dict[str, str] | None = None, config_text: str | None = None,
             extra_args: list[str] | None = None, kind: str | None = None, start: bool = True,
             faults: dict[str, object] | None = None) -> BrokerProc:
        b = BrokerProc(kind or BROKER_KIND, tmp_path / f"broker{len(made)}", env, config_text, extra_args, faults)
        made.append(b)
        if start:
            b.start()
        return b

    yield make
    errors = []
    for b in made:
        if b.proc is not None:
            rc = b.stop(signal.SIGTERM)
            if rc != 0:
                errors.append(f"{b}: exit code {rc} after SIGTERM\n{b.log_tail()}")
    assert not errors, "\n".join(errors)


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> BrokerProc:
    """A fresh broker per test (the default broker kind, default config)."""
    return broker_factory()


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    """One broker for a whole module of tests; tests isolate themselves by topic prefix and client id.
    Tests may restart it (the ports stay the same)."""
    with running_broker(tmp_path_factory.mktemp("shared")) as b:
        yield b


@pytest.fixture
def uniq(request: pytest.FixtureRequest) -> str:
    """A topic prefix / client-id stem unique to this test run."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40]
    return f"e2e-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session", autouse=True)
def _tools_present() -> None:
    if BROKER_KIND == "mosquitto" and shutil.which("mosquitto") is None:
        pytest.skip("mosquitto not installed")
