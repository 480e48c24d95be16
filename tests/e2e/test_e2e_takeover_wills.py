"""The will of a connection ended by a takeover (a new CONNECT with the same client id).

MQTT 5 §3.1.4 (MQTT-3.1.4-3): the server closes the existing client's network connection, and
"if the existing Client has a Will Message, that Will Message is published as described in section
3.1.2.5": once the will delay elapses or the session ends, whichever is first (§3.1.3.2.2), unless
a new network connection to this session is made within the delay (MQTT-3.1.3-9). So a clean start
(the session ends) publishes it at once, whatever its delay; a takeover that continues the session
publishes a will without delay and cancels a delayed one. 3.1.1 has no will delay: published.

On 38673de the first case never published the will (the close queued it for later, the clean
start then discarded the session with it)."""

from __future__ import annotations

import pytest
from e2e_broker import BrokerProc
from e2e_support import Paho
from rawclient import DISCONNECT, P_SESSION_EXPIRY, P_WILL_DELAY, RawClient

pytestmark = pytest.mark.e2e


def _watch(port: int, topic: str, uniq: str) -> Paho:
    w = Paho(port, f"{uniq}-watch", version=5)
    w.connect()
    w.subscribe(topic, 1)
    return w


def _taken_over(c: RawClient) -> None:
    """The old connection was closed, after DISCONNECT 0x8E (session taken over) if any (mosquitto
    2.0 closes it without one)."""
    got = c.wait_closed(5.0)
    assert [p.reason for p in got if p.type == DISCONNECT] in ([], [0x8E]), got


@pytest.mark.moorline_only
def test_clean_start_takeover_publishes_a_delayed_will_at_once(shared_broker: BrokerProc, uniq: str) -> None:
    """The clean start ends the session, before the delay: the will is due then (§3.1.3.2.2, "until
    the Will Delay Interval has passed or the Session ends, whichever happens first"). Mosquitto
    2.0.11 does not publish it (not within 5 s)."""
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    old = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    assert old.connect(f"{uniq}-c", clean=False, props=[(P_SESSION_EXPIRY, 600)],
                       will=(topic, b"replaced", 1, False), will_props=[(P_WILL_DELAY, 300)]).reason == 0
    assert watch.drain(0.3) == [], "no will while connected"
    new = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    ack = new.connect(f"{uniq}-c", clean=True)
    assert ack.reason == 0 and not ack.session_present
    _taken_over(old)
    m = watch.get(timeout=5)
    assert (m.topic, m.payload) == (topic, b"replaced")
    assert watch.drain(1.0) == [], "exactly one will"
    new.disconnect()
    watch.disconnect()


@pytest.mark.moorline_only
@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_takeover_continuing_the_session_publishes_an_undelayed_will(shared_broker: BrokerProc, uniq: str,
                                                                     version: int) -> None:
    """The old connection is closed without DISCONNECT and a will without delay is due right then
    (3.1.1: MQTT-3.1.2-8; 5: §3.1.3.2.2, no delay). Mosquitto 2.0 discards it instead."""
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    props = [(P_SESSION_EXPIRY, 600)] if version == 5 else None
    old = RawClient("127.0.0.1", shared_broker.mqtt_port, version)
    assert old.connect(f"{uniq}-c", clean=False, props=props, will=(topic, b"old conn", 1, False)).reason == 0
    new = RawClient("127.0.0.1", shared_broker.mqtt_port, version)
    ack = new.connect(f"{uniq}-c", clean=False, props=props)
    assert ack.reason == 0 and ack.session_present
    m = watch.get(timeout=5)
    assert (m.topic, m.payload) == (topic, b"old conn")
    assert watch.drain(1.0) == [], "exactly one will"
    new.disconnect()
    old.close()
    watch.disconnect()


def test_takeover_within_the_will_delay_cancels_the_will(shared_broker: BrokerProc, uniq: str) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    old = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    assert old.connect(f"{uniq}-c", clean=False, props=[(P_SESSION_EXPIRY, 600)],
                       will=(topic, b"cancelled", 1, False), will_props=[(P_WILL_DELAY, 2)]).reason == 0
    new = RawClient("127.0.0.1", shared_broker.mqtt_port, 5)
    ack = new.connect(f"{uniq}-c", clean=False, props=[(P_SESSION_EXPIRY, 600)])
    assert ack.reason == 0 and ack.session_present
    _taken_over(old)
    assert watch.drain(3.0) == [], "will published although the session was resumed within its delay"
    new.disconnect()
    watch.disconnect()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_clean_start_takeover_publishes_the_will(shared_broker: BrokerProc, uniq: str, version: int) -> None:
    topic = f"{uniq}/will"
    watch = _watch(shared_broker.mqtt_port, topic, uniq)
    old = RawClient("127.0.0.1", shared_broker.mqtt_port, version)
    assert old.connect(f"{uniq}-c", clean=True, will=(topic, b"clean", 1, False)).reason == 0
    new = RawClient("127.0.0.1", shared_broker.mqtt_port, version)
    assert new.connect(f"{uniq}-c", clean=True).reason == 0
    m = watch.get(timeout=5)
    assert (m.topic, m.payload) == (topic, b"clean")
    assert watch.drain(1.0) == [], "exactly one will"
    new.disconnect()
    old.close()
    watch.disconnect()
