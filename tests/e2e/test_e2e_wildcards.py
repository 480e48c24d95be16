"""Topic filters: + and #, $-topics not matched by leading wildcards, overlapping filters, unsubscribe."""

from __future__ import annotations

import pytest
from e2e_broker import BROKER_KIND, BrokerFactory, BrokerProc
from e2e_support import Paho

pytestmark = pytest.mark.e2e

TOPICS = ["a", "a/b", "a/b/c", "a/b/c/d", "a/x/c", "a//c", "b/b/c", "a/b/d"]


@pytest.mark.parametrize(
    "flt,expected",
    [
        ("a/+/c", ["a/b/c", "a/x/c", "a//c"]),
        ("a/#", ["a", "a/b", "a/b/c", "a/b/c/d", "a/x/c", "a//c", "a/b/d"]),
        ("+/b/+", ["a/b/c", "b/b/c", "a/b/d"]),
        ("a/b/c/#", ["a/b/c", "a/b/c/d"]),
        ("+", ["a"]),
        ("a/+", ["a/b"]),
        ("+/+/+/+", ["a/b/c/d"]),
        ("a/b/c", ["a/b/c"]),
    ],
)
def test_wildcard_matching(shared_broker: BrokerProc, uniq: str, flt: str, expected: list[str]) -> None:
    # The prefix keeps tests apart on the shared broker; "+" and "#" apply below it.
    sub = Paho(shared_broker.mqtt_port, f"{uniq}-s", version=5)
    sub.connect()
    sub.subscribe(f"{uniq}/{flt}", 1)
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=4)
    pub.connect()
    for t in TOPICS:
        pub.publish(f"{uniq}/{t}", t.encode(), 1)
    got = sub.collect(len(expected), timeout=10) + sub.drain(0.5)
    assert sorted(m.payload.decode() for m in got) == sorted(expected)
    pub.disconnect()
    sub.disconnect()


# moorline: `$`-topics are the broker's; a client may publish one only where an ACL rule whose pattern
# itself starts with `$` grants it (mosquitto lets anyone publish them).
DOLLAR_GRANT = """
[[auth.acl]]
action = "all"
pattern = "$e2e/#"

[[auth.acl]]
action = "all"
pattern = "#"
"""


def test_dollar_topics_not_matched_by_leading_wildcards(broker_factory: BrokerFactory, uniq: str) -> None:
    b = broker_factory(config_text=DOLLAR_GRANT if BROKER_KIND == "moorline" else None)
    port = b.mqtt_port
    hash_sub = Paho(port, f"{uniq}-hash", version=5)
    hash_sub.connect()
    hash_sub.subscribe("#", 0)
    plus_sub = Paho(port, f"{uniq}-plus", version=5)
    plus_sub.connect()
    plus_sub.subscribe(f"+/{uniq}/x", 0)
    dollar_sub = Paho(port, f"{uniq}-dollar", version=5)
    dollar_sub.connect()
    dollar_sub.subscribe(f"$e2e/{uniq}/#", 0)
    pub = Paho(port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(f"$e2e/{uniq}/x", b"dollar", 1)
    pub.publish(f"n/{uniq}/x", b"normal", 1)
    assert [m.payload for m in dollar_sub.collect(1)] == [b"dollar"]
    assert [m.payload for m in plus_sub.collect(1) + plus_sub.drain(0.5)] == [b"normal"]
    seen = [m.topic for m in hash_sub.drain(0.7)]
    assert f"n/{uniq}/x" in seen
    assert not [t for t in seen if t.startswith("$")], seen
    for c in (hash_sub, plus_sub, dollar_sub, pub):
        c.disconnect()


def test_overlapping_filters_deliver_once_with_highest_qos(shared_broker: BrokerProc, uniq: str) -> None:
    sub = Paho(shared_broker.mqtt_port, f"{uniq}-s", version=5)
    sub.connect()
    sub.subscribe(f"{uniq}/o/#", 0)
    sub.subscribe(f"{uniq}/o/+", 2)
    sub.subscribe(f"{uniq}/o/t", 1)
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(f"{uniq}/o/t", b"one", 2)
    got = sub.collect(1) + sub.drain(0.7)
    assert {m.payload for m in got} == {b"one"}
    assert max(m.qos for m in got) == 2, "the highest QoS of the matching subscriptions"
    if shared_broker.is_moorline:
        # MQTT 5 allows one copy per matching subscription (mosquitto does that); moorline promises one
        assert len(got) == 1, "moorline delivers a message once per session"
    pub.disconnect()
    sub.disconnect()


def test_unsubscribe_stops_delivery(shared_broker: BrokerProc, uniq: str) -> None:
    sub = Paho(shared_broker.mqtt_port, f"{uniq}-s", version=5)
    sub.connect()
    sub.subscribe(f"{uniq}/u/+", 1)
    pub = Paho(shared_broker.mqtt_port, f"{uniq}-p", version=5)
    pub.connect()
    pub.publish(f"{uniq}/u/1", b"before", 1)
    assert [m.payload for m in sub.collect(1)] == [b"before"]
    rcs = sub.unsubscribe(f"{uniq}/u/+")
    assert [int(getattr(r, "value", r)) for r in rcs] == [0]
    pub.publish(f"{uniq}/u/1", b"after", 1)
    assert sub.drain(0.7) == []
    pub.disconnect()
    sub.disconnect()
