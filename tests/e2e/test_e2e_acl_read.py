"""Read ACLs that cannot be dodged (issue 19 item 3): with a deny on `secret/#`, the wildcards `#`,
`+/x`, `+/+` and `+` are granted but never deliver a `secret/...` message (live or retained); a
filter wholly inside the denied pattern is refused; the Paho interoperability suite's
`test_subscribe_failure` case (a broker that refuses `test/nosubscribe`) holds while its wildcard
subscriptions keep working."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_broker import BrokerProc, running_broker
from e2e_support import Paho
from rawclient import RawClient

pytestmark = [pytest.mark.e2e, pytest.mark.moorline_only]
HOST = "127.0.0.1"

CONFIG = """
[auth]
allow_anonymous = true

[[auth.acl]]
action = "subscribe"
allow = false
pattern = "secret/#"

[[auth.acl]]
action = "subscribe"
allow = false
pattern = "test/nosubscribe"

[[auth.acl]]
action = "all"
pattern = "#"
"""


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    with running_broker(tmp_path_factory.mktemp("aclread"), config_text=CONFIG) as b:
        yield b


def _drain(c: RawClient, quiet_s: float = 0.8) -> list[str]:
    got = []
    while (pkt := c.recv_or_none(quiet_s)) is not None:
        got.append(pkt.topic or "")
        if pkt.qos:
            c.ack(pkt)
    return got


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("flt", ["#", "+/x", "+/+", "+"])
def test_wildcards_overlapping_a_deny_are_granted_and_filtered(acl_broker: BrokerProc, version: int,
                                                                flt: str) -> None:
    pub = RawClient(HOST, acl_broker.mqtt_port, 5)
    assert pub.connect(f"aclr-pub-{version}-{flt}").reason == 0
    # Retained first: a SUBSCRIBE returns retained messages too, and must filter them the same way.
    for topic in ("secret", "secret/x", "public", "public/x"):
        pub.publish_and_wait(topic, b"retained " + topic.encode(), qos=1, retain=True)
    sub = RawClient(HOST, acl_broker.mqtt_port, version)
    assert sub.connect(f"aclr-sub-{version}-{flt}").reason == 0
    assert sub.subscribe([(flt, 1)]).reasons == [1], f"{flt} with a deny on secret/# should be granted"
    retained = _drain(sub)
    for topic in ("secret", "secret/x", "public", "public/x"):
        pub.publish_and_wait(topic, b"live", qos=1)
    live = _drain(sub)
    expected = {"#": ["public", "public/x"], "+/x": ["public/x"], "+/+": ["public/x"], "+": ["public"]}[flt]
    assert sorted(retained) == expected and sorted(live) == expected, (retained, live)
    for topic in ("secret", "secret/x", "public", "public/x"):
        pub.publish_and_wait(topic, b"", qos=1, retain=True)  # clear for the next case
    sub.close()
    pub.close()


@pytest.mark.parametrize("version", [4, 5])
def test_filters_inside_the_denied_pattern_are_refused(acl_broker: BrokerProc, version: int) -> None:
    sub = RawClient(HOST, acl_broker.mqtt_port, version)
    assert sub.connect(f"aclr-refused-{version}").reason == 0
    refused = 0x87 if version == 5 else 0x80
    codes = sub.subscribe([("secret/#", 1), ("secret/+/y", 1), ("secret", 1), ("other/#", 1)]).reasons
    assert codes == [refused, refused, refused, 1], codes  # "secret/#" matches "secret" too (MQTT-4.7.1-2)
    sub.close()


def test_paho_interop_subscribe_failure_and_wildcards(acl_broker: BrokerProc) -> None:
    a = Paho(acl_broker.mqtt_port, "interop-a", version=4)
    a.connect()
    rc = a.subscribe("test/nosubscribe", 2)
    assert [int(getattr(x, "value", x)) for x in rc] == [0x80], rc
    for flt in ("TopicA/+", "+/C", "#", "/#", "TopicA/#"):
        assert [int(getattr(x, "value", x)) for x in a.subscribe(flt, 2)] == [2]
    b = Paho(acl_broker.mqtt_port, "interop-b", version=4)
    b.connect()
    for t in ("TopicA", "TopicA/B", "Topic/C", "TopicA/C", "/TopicA", "test/nosubscribe"):
        b.publish(t, b"m", qos=1)
    got = sorted({m.topic for m in a.drain(1.0)})
    assert got == sorted(["TopicA", "TopicA/B", "Topic/C", "TopicA/C", "/TopicA"]), got
    a.disconnect()
    b.disconnect()
