"""Deliberately broken builds are for tests only: `moorline run` never reads a fault switch from its
environment; a harness injects them through the test entry point (moorline/testing/faulty_node.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_broker import BrokerFactory
from e2e_support import mosquitto_presubscribe, mosquitto_pub, mosquitto_sub, sub_lines

from moorline.testing.faults import Faults

pytestmark = pytest.mark.moorline_only

# The switches the node once read from its environment; the names must mean nothing to it now.
LEGACY_SWITCHES = {
    "MOORLINE_TEST_DROP_ON_RESTART": "1",
    "MOORLINE_TEST_UNSAFE_ACK_BEFORE_SYNC": "1",
    "MOORLINE_BENCH_LOOSE_PACKET_IDS": "1",
    "MOORLINE_TEST_CROSS_SHARD_CHAOS": "7",
}


def _messages_survive_restart(b: object, uniq: str, n: int = 20) -> list[str]:
    port = b.mqtt_port  # type: ignore[attr-defined]
    topic, cid = f"{uniq}/d", f"{uniq}-sub"
    mosquitto_presubscribe(port, topic, cid, qos=1)
    assert mosquitto_pub(port, topic, None, qos=1, stdin_lines=[f"m{i}" for i in range(n)]).returncode == 0
    b.restart(kill=True)  # type: ignore[attr-defined]
    lines = sub_lines(mosquitto_sub(port, topic, n, qos=1, client_id=cid, persistent=True, timeout_s=5))
    return [line.rpartition(" ")[2] for line in lines]  # "topic payload"


def test_production_run_ignores_fault_switches_in_its_environment(broker_factory: BrokerFactory, uniq: str) -> None:
    b = broker_factory(env=dict(LEGACY_SWITCHES))
    got = _messages_survive_restart(b, uniq)
    assert got == [f"m{i}" for i in range(20)], "moorline run obeyed a fault switch from its environment"
    assert "BROKEN" not in b.log_tail()


def test_test_entry_point_injects_the_broken_build(broker_factory: BrokerFactory, uniq: str) -> None:
    """The same check against the build the harness breaks on purpose: it must see the loss."""
    b = broker_factory(faults={"drop_on_restart": True})
    got = _messages_survive_restart(b, uniq)
    assert got == [f"m{i}" for i in range(19)], got
    assert "DELIBERATELY BROKEN BUILD" in b.log_tail()


def test_faults_json_round_trip_and_unknown_switches() -> None:
    f = Faults(drop_on_restart=True, sync_ledger="/tmp/x")
    assert Faults.from_json(f.to_json()) == f
    assert Faults.from_json("{}") == Faults()
    with pytest.raises(ValueError, match="unknown fault switch"):
        Faults.from_json('{"drop_on_restrat": true}')


def test_no_fault_switch_names_in_the_package() -> None:
    root = Path(__file__).resolve().parents[2] / "moorline"
    offenders = [str(p) for p in root.rglob("*.py")
                 if "MOORLINE_TEST" in p.read_text() or "MOORLINE_BENCH" in p.read_text()]
    assert offenders == []
