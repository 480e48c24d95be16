"""mqtt.max_keepalive_s caps a client's keepalive (moorline only), as Mosquitto's max_keepalive does:
a 5.0 client asking more is told the cap as Server Keep Alive (CONNACK property 0x13); a 3.1.1 client
cannot be told, but the cap holds for it too. Either is closed after 1.5 x the cap of silence
(MQTT-3.1.2-24), not 1.5 x what it asked for."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2e_broker import BrokerProc, running_broker
from rawclient import DISCONNECT, P_SERVER_KEEP_ALIVE, RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"
CAP_S = 10
ASKED_S = 60


@pytest.fixture(scope="module")
def capped_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    config = f"[mqtt]\nmax_keepalive_s = {CAP_S}\n"
    with running_broker(tmp_path_factory.mktemp("keepalive"), config_text=config) as b:
        yield b


def test_a_keepalive_within_the_cap_is_left_alone(capped_broker: BrokerProc) -> None:
    c = RawClient(HOST, capped_broker.mqtt_port, 5)
    ack = c.connect("ka-within", keepalive=CAP_S - 5)
    assert ack.reason == 0 and ack.prop(P_SERVER_KEEP_ALIVE) is None, ack
    c.disconnect()


def test_a_longer_keepalive_is_capped_and_enforced(capped_broker: BrokerProc) -> None:
    v5 = RawClient(HOST, capped_broker.mqtt_port, 5)
    v3 = RawClient(HOST, capped_broker.mqtt_port, 4)
    ack5 = v5.connect("ka-v5", keepalive=ASKED_S)
    ack3 = v3.connect("ka-v3", keepalive=ASKED_S)
    idle_from = time.monotonic()
    assert ack5.reason == 0 and ack5.prop(P_SERVER_KEEP_ALIVE) == CAP_S, ack5
    assert ack3.reason == 0 and ack3.props == [], ack3  # 3.1.1 has no properties to say it with
    # Both stay silent: each must be closed about 1.5 x CAP_S after its CONNECT (the node checks
    # keepalive at least once a second), long before 1.5 x ASKED_S = 90 s.
    got5 = v5.wait_closed(timeout=1.5 * CAP_S + 10)
    v5_closed_after = time.monotonic() - idle_from
    got3 = v3.wait_closed(timeout=max(0.0, idle_from + 1.5 * CAP_S + 10 - time.monotonic()))
    assert v5_closed_after >= 1.5 * CAP_S - 1, v5_closed_after  # the cap's 1.5x, not earlier
    assert [(p.type, p.reason) for p in got5] == [(DISCONNECT, 0x8D)], got5  # Keep Alive timeout
    assert got3 == [], got3  # 3.1.1: the connection is closed
