"""Fixtures for the cluster end-to-end tests: real moorline processes forming 3- and 5-node clusters
on 127.0.0.11.. (cluster_harness.py). Clients are tests/e2e/rawclient.py's raw-socket client."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # rawclient

from cluster_harness import Cluster, ClusterFactory  # noqa: E402

from moorline.chaos.partition import iptables_usable, remove_stale_chains  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster_e2e: a real multi-process cluster on this machine")
    config.addinivalue_line("markers", "iptables: cuts links between nodes with iptables (root)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.when == "call":
        item.stash[_CALL_PASSED] = rep.passed and not hasattr(rep, "wasxfail")


_CALL_PASSED = pytest.StashKey[bool]()


@pytest.fixture(scope="session", autouse=True)
def _no_stale_iptables_chains() -> None:
    """A crashed earlier run may have left its chain (and partitions) behind."""
    if iptables_usable() is not None:
        return
    removed = remove_stale_chains()
    if removed:
        print(f"removed stale iptables chains: {removed}")


@pytest.fixture(scope="session")
def iptables_reason() -> str | None:
    return iptables_usable()


@pytest.fixture
def needs_iptables(iptables_reason: str | None) -> None:
    if iptables_reason is not None:
        pytest.skip(f"partitions need iptables: {iptables_reason}")


@pytest.fixture(scope="session")
def node_addresses() -> None:
    """Nodes listen on 127.0.0.11..15: loopback addresses Linux routes without configuration."""
    for i in range(11, 16):
        try:
            with socket.socket() as s:
                s.bind((f"127.0.0.{i}", 0))
        except OSError as exc:
            pytest.skip(f"cluster tests need the loopback address 127.0.0.{i}: {exc}")


@pytest.fixture
def cluster_factory(tmp_path: Path, request: pytest.FixtureRequest, node_addresses: None) -> Iterator[ClusterFactory]:
    """Clusters for one test. At teardown every partition is healed and every node stopped with
    SIGTERM; when the test itself passed, each node must have exited 0 and logged no ERROR or
    traceback beyond what the test allowed (Cluster.allow_errors)."""
    made: list[Cluster] = []

    def make(n: int = 3, config_text: str | None = None, start: bool = True, **kw: object) -> Cluster:
        c = Cluster(tmp_path / f"cluster{len(made)}", n, config_text, **kw)  # type: ignore[arg-type]
        made.append(c)
        if start:
            c.start()
        return c

    yield make
    problems: list[str] = []
    for c in made:
        problems += c.close()
        bad = c.bad_log_lines()
        problems += [f"{name} logged: {ln}" for name, lines in bad.items() for ln in lines[:10]]
    if problems and request.node.stash.get(_CALL_PASSED, False):
        pytest.fail("cluster teardown:\n" + "\n".join(problems), pytrace=False)
    elif problems:
        print("cluster teardown (test did not pass):\n" + "\n".join(problems))
