"""Issue 30 item 7, against a running node: log lines built from what clients send. A client id
cannot forge a line, and one client address cannot fill the log by varying its text."""

from __future__ import annotations

import time

import pytest
from e2e_broker import BrokerFactory
from listener_support import wait_log
from rawclient import RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only, pytest.mark.timeout(120)]

FORGED = "2026-01-01 00:00:00,000 CRITICAL moorline.server: forged by a client"


def test_a_client_id_cannot_forge_a_log_line(broker_factory: BrokerFactory) -> None:
    """Attack: a client id with a newline and a whole log line in it, then a malformed packet, so the
    node logs a protocol error naming the client: the forged CRITICAL line appears in the log."""
    broker = broker_factory()
    c = RawClient("127.0.0.1", broker.mqtt_port, version=4)
    assert c.connect(f"evil\n{FORGED}").reason == 0
    c.send(b"\x36\x05\x00\x01t\x00\x01")  # PUBLISH with QoS 3: a protocol error
    try:
        c.wait_closed(10)
    finally:
        c.close()
    assert wait_log(broker, "protocol error")
    lines = broker.log_path.read_text(errors="replace").splitlines()
    assert not [line for line in lines if line.startswith(FORGED[:30])], "a client forged a log line"
    assert any("evil\\n2026-01-01" in line for line in lines)  # the id is there, escaped


def test_one_address_cannot_flood_the_log_by_varying_its_text(broker_factory: BrokerFactory) -> None:
    """Attack: one client address makes 200 connections that each send a malformed packet under a
    different client id, and the node logs every one (repeat suppression keyed on the text, or none at all). Now lines a client causes are
    limited per source address (log.per_source_lines_per_minute, 20)."""
    broker = broker_factory()
    before = broker.log_path.read_text(errors="replace").count("protocol error")
    for i in range(200):
        c = RawClient("127.0.0.1", broker.mqtt_port, version=4)
        try:
            assert c.connect(f"flood-{i}-" + "x" * (i % 50)).reason == 0  # every line different
            c.send(b"\x36\x05\x00\x01t\x00\x01")  # PUBLISH with QoS 3: a protocol error
            c.wait_closed(10)
        finally:
            c.close()
    time.sleep(0.5)
    text = broker.log_path.read_text(errors="replace")
    logged = text.count("protocol error") - before
    assert 1 <= logged <= 21, f"{logged} protocol-error lines for 200 bad CONNECTs from one address"
    # the node still serves that address
    c = RawClient("127.0.0.1", broker.mqtt_port, version=4)
    assert c.connect("after-flood").reason == 0
    c.disconnect()
