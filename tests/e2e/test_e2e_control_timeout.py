"""Every request gets an answer in bounded time (DESIGN promise 6), CONNECT and SUBSCRIBE too: when
a shard commits nothing within mqtt.control_timeout_s (no quorum; here: every sync takes 3 s), the
client gets CONNACK 0x88 / SUBACK 0x80 instead of waiting for ever."""

from __future__ import annotations

import time

import pytest
from e2e_broker import BrokerFactory
from rawclient import RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"


@pytest.mark.parametrize("version", [4, 5])
def test_connect_and_subscribe_fail_within_the_control_timeout(broker_factory: BrokerFactory, uniq: str,
                                                               version: int) -> None:
    b = broker_factory(faults={"slow_sync_s": 3.0}, config_text="[mqtt]\ncontrol_timeout_s = 1.0\n")
    c = RawClient(HOST, b.mqtt_port, version, timeout=30)
    started = time.monotonic()
    ack = c.connect(f"{uniq}-c", timeout=20)
    took = time.monotonic() - started
    assert ack.reason == (0x88 if version == 5 else 3), ack
    assert took < 2.5, f"CONNACK came {took:.1f} s after CONNECT (control timeout 1 s)"
    c.close()
    # With a timeout the slow commit fits in, the same requests succeed (the check can tell).
    b2 = broker_factory(faults={"slow_sync_s": 0.5}, config_text="[mqtt]\ncontrol_timeout_s = 5.0\n")
    c = RawClient(HOST, b2.mqtt_port, version, timeout=30)
    assert c.connect(f"{uniq}-c2", timeout=20).reason == 0
    assert c.subscribe([(f"{uniq}/t", 1)], timeout=20).reasons == [1]
    c.close()
    log = b.log_path.read_text()
    assert "Traceback" not in log and " ERROR " not in log
